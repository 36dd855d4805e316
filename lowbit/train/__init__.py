"""train: tasks, the training loop, results."""

from .config import TrainConfig
from .run import Run, train
from .tasks import TASKS, make_task

__all__ = ["Run", "TASKS", "TrainConfig", "make_task", "train"]
