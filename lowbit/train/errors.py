"""The expected ways a training run ends early, each with its exit code.

``lowbit train`` prints every one of them as a single line naming the cause
and the option to change (:func:`describe`), never a traceback, and exits
with the code of its kind (:data:`EXIT_CODES`). Anything not listed here is a
bug: its traceback is shown.
"""

from __future__ import annotations

import math

# exit code of each kind of failure (2 is argparse's own for a bad option)
EXIT_CODES = {
    "usage": 2,        # a bad option value or combination (ValueError before or while training)
    "diverged": 3,     # a non-finite loss, gradient or parameter
    "io": 4,           # --out, --data-dir, --resume: a file or folder that cannot be read or written
    "data": 5,         # a dataset file that is missing, malformed or out of range
    "memory": 6,       # out of (CPU or GPU) memory
    "worker": 7,       # a worker process died or raised
    "stalled": 8,      # no progress (--stall-timeout) or the whole-run --timeout
    "checkpoint": 9,   # a checkpoint that is corrupt or does not match the run
    "interrupted": 130,
}


# One class for a divergence, raised alike by the training loop, the wrapper and the ranks'
# agreement (lowbit.algorithms.faults, below this layer): re-exported here.
from ..algorithms.faults import Diverged  # noqa: E402,F401


class OutputExists(FileExistsError):
    """``--out`` holds a previous run."""


class NoSpace(OSError):
    """A file an option names could not be written: its filesystem is full (or over quota)."""


def unwritable(option: str, path, e: OSError) -> OSError:
    """The error for ``path`` (``option``'s file or folder) that could not be written because of
    ``e``: :class:`NoSpace` for a full filesystem or quota, PermissionError otherwise; the message
    names the path, the option and the cause."""
    import errno

    why = e.strerror or str(e) or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        err: OSError = NoSpace(f"{option}: cannot write {path}: {why} (its filesystem is full); free space there "
                               f"or choose another {option}")
    else:
        err = PermissionError(f"{option}: cannot write {path} ({why}); choose another {option}")
    err.errno = e.errno
    return err


def strict_json(value):
    """``value`` with every non-finite float replaced by None (JSON has no NaN or
    Infinity); returns (clean value, list of the dotted keys that were replaced)."""
    replaced: list[str] = []

    def walk(v, path):
        if isinstance(v, float) and not math.isfinite(v):
            replaced.append(path or "<root>")
            return None
        if isinstance(v, dict):
            return {k: walk(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return v

    return walk(value, ""), replaced


def classify(e: BaseException) -> tuple[str, str]:
    """(kind, one-line message) of an expected failure; kind None for a bug."""
    from ..comm.launcher import WorkerDied, WorkerFailed, WorkerStalled

    if isinstance(e, WorkerFailed) and e.cause is not None:
        kind, msg = classify(e.cause)
        if kind is not None:
            return kind, f"worker {e.rank}: {msg}" if kind != "diverged" else msg
        return "worker", f"worker {e.rank} failed: {e.error}"
    if isinstance(e, WorkerFailed):
        return "worker", f"worker {e.rank} failed: {e.error}"
    if isinstance(e, Diverged):
        return "diverged", str(e)
    if isinstance(e, WorkerDied):
        return "worker", str(e)
    if isinstance(e, WorkerStalled):
        return "stalled", str(e).splitlines()[0]
    if isinstance(e, TimeoutError):
        return "stalled", f"{e} (raise --timeout, or leave it unset for no whole-run limit)"
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
            isinstance(e, RuntimeError) and "out of memory" in str(e).lower()):
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return "memory", (f"out of memory ({first}); lower --batch-size or --workers, or use a smaller "
                          f"--task/--hidden")
    from ..data.errors import DataError
    from ..integrations.checkpoint import CheckpointError

    if isinstance(e, CheckpointError):
        return "checkpoint", f"{e} (--resume)"
    if isinstance(e, DataError):
        return "data", f"{e} (check --data-dir)"
    from ..comm.wire_objects import BadPeerData

    if isinstance(e, BadPeerData):
        return "worker", str(e)
    if isinstance(e, (KeyboardInterrupt,)):
        return "interrupted", "interrupted; the workers were ended"
    if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)):
        msg = str(e)
        return "io", msg if "--" in msg else f"{msg} (check --data-dir / --out)"
    if isinstance(e, ValueError):
        return "usage", str(e)
    if isinstance(e, OSError):
        return "io", str(e)
    return None, str(e)
