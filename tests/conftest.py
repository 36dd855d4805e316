"""Tests marked ``gpu`` run only where torch sees a CUDA device; elsewhere they are
skipped, with the reason, at collection (``python -m pytest -m gpu`` selects them)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
