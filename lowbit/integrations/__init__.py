"""integrations: what a PyTorch user touches (flat parameters, wrappers)."""

from .amp import GradScaler
from .callbacks import LogStats, TensorBoardStats
from .ddp_hooks import LowbitHookState, hook_table, lowbit_hook, make_hook
from .decentralized import DecentralizedDataParallel
from .flat import FlatParams

__all__ = ["DecentralizedDataParallel", "FlatParams", "GradScaler", "LogStats", "TensorBoardStats", "LowbitHookState",
           "lowbit_hook", "make_hook", "hook_table"]
