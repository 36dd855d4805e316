"""Tests marked ``gpu`` run only where torch sees a CUDA device; elsewhere they are
skipped, with the reason, at collection (``python -m pytest -m gpu`` selects them). Tests
marked ``numba_kernels`` call the CPU kernels themselves: they are skipped where numba
compiles for another CPU than this one (``NUMBA_CPU_NAME``), where the codecs do not use
the kernels (:func:`lowbit.codecs.kernels.native_target`)."""

import os

import pytest
import torch

from lowbit.codecs.kernels import native_target

# Under pytest-xdist (``-n N``) each of the N test processes gets its share of the cores for
# torch's intra-op threads (and the OpenMP threads of the subprocesses it starts), not all of
# them: N processes of 16 threads each on 16 cores made the suite and the GPU tests run side by
# side time out (issue 28).
_XDIST = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _XDIST > 1:
    _SHARE = str(max(1, (os.cpu_count() or 1) // _XDIST))
    os.environ.setdefault("OMP_NUM_THREADS", _SHARE)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
    if not native_target():
        skips["numba_kernels"] = pytest.mark.skip(
            reason="numba compiles for another CPU here (NUMBA_CPU_NAME): the codecs take the reference, not these kernels")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
