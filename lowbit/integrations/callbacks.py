"""Ready ``on_step`` callbacks for :class:`~lowbit.integrations.DecentralizedDataParallel`.

The wrapper calls ``on_step(step, stats)`` after every step with the figures of
:meth:`~lowbit.integrations.DecentralizedDataParallel.stats` (bytes and messages
sent at that step and in total, wire bits per element, the algorithm's report
such as Moniqua's theta and mismatch counters)::

    ddp = DecentralizedDataParallel(net, opt, "moniqua", bits=2, on_step=LogStats(every=50))
    ddp.on_step = TensorBoardStats("runs/moniqua") if ddp.rank == 0 else None   # or set it later
"""

from __future__ import annotations

import logging
import os


def _check_every(every) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    return every


class LogStats:
    """Log each ``every``-th step's figures through :mod:`logging` (logger
    ``lowbit.wrapper`` unless ``logger`` is given, at ``level``), one line a step:
    ``step 10: bytes_sent_step=2400 bytes_sent=26400 ... theta=0.05``."""

    def __init__(self, logger: logging.Logger | None = None, *, level: int = logging.INFO, every: int = 1):
        self.logger = logger if logger is not None else logging.getLogger("lowbit.wrapper")
        self.level = level
        self.every = _check_every(every)

    def __call__(self, step: int, stats: dict) -> None:
        if step % self.every:
            return
        figures = " ".join(f"{k}={_fmt(v)}" for k, v in stats.items() if k != "step")
        self.logger.log(self.level, "step %d: %s", step, figures)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


class TensorBoardStats:
    """Write each ``every``-th step's figures as TensorBoard scalars
    ``{prefix}/{name}`` (the numeric ones) at global step ``step``, live (the writer flushes every
    ``flush_secs`` seconds; :meth:`close` flushes the rest). ``log_dir``: the
    directory for a new ``torch.utils.tensorboard.SummaryWriter``, or pass your
    own ``writer``. Needs the ``tensorboard`` package (``pip install tensorboard``).
    Usually only rank 0 logs."""

    def __init__(self, log_dir: str | os.PathLike | None = None, *, writer=None, prefix: str = "lowbit",
                 every: int = 1, flush_secs: float = 10.0):
        if (log_dir is None) == (writer is None):
            raise ValueError("give exactly one of log_dir (a directory) and writer (a SummaryWriter)")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        if not flush_secs > 0:
            raise ValueError(f"flush_secs must be > 0, got {flush_secs!r}")
        self.every = _check_every(every)
        self.prefix = prefix
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch's module needs the tensorboard package
                raise ImportError("TensorBoardStats needs the tensorboard package, which is not installed: "
                                  "pip install tensorboard") from e
            writer = SummaryWriter(log_dir=os.fspath(log_dir), flush_secs=flush_secs)
        self.writer = writer

    def __call__(self, step: int, stats: dict) -> None:
        if step % self.every:
            return
        for name, value in stats.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{self.prefix}/{name}", value, step)

    def close(self) -> None:
        self.writer.close()
