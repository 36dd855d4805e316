"""integrations: what a PyTorch user touches (flat parameters, wrappers)."""

from .decentralized import DecentralizedDataParallel
from .ddp_hooks import LowbitHookState, hook_table, lowbit_hook, make_hook
from .flat import FlatParams

__all__ = ["DecentralizedDataParallel", "FlatParams", "LowbitHookState", "lowbit_hook", "make_hook", "hook_table"]
