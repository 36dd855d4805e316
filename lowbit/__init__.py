"""lowbit: train PyTorch models on many workers while sending few bits.

Importing lowbit turns on PyTorch's huge-page CPU allocation (the environment
variable ``THP_MEM_ALLOC_ENABLE=1``, read by torch at its first CPU allocation
of 2 MiB or more) unless the variable is already set: a codec's decode writes a
fresh output tensor every step, and on this project's machine touching a fresh
40 MB buffer page by page cost 6.5x a copy into a kept one, against 2.4x with
huge pages (``docs/ARCHITECTURE.md``, "Fresh outputs and huge pages"). The cost:
up to one 2 MiB page of extra resident memory per tensor of 2 MiB or more. Set
``THP_MEM_ALLOC_ENABLE=0`` to keep torch's default; import lowbit before allocating large CPU tensors for the
setting to take effect.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
