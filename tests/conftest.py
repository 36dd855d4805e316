"""Tests marked ``gpu`` run only where torch sees a CUDA device; elsewhere they are
skipped, with the reason, at collection (``python -m pytest -m gpu`` selects them). Tests
marked ``numba_kernels`` call the CPU kernels themselves: they are skipped where numba
compiles for another CPU than this one (``NUMBA_CPU_NAME``), where the codecs do not use
the kernels (:func:`lowbit.codecs.kernels.native_target`)."""

import pytest
import torch

from lowbit.codecs.kernels import native_target


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
