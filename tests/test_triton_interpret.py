"""The Triton kernels (the CUDA fast path), run on the CPU by Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before Triton decorates a kernel, so the
checks in ``tests/triton_kernels/check_*.py`` run in one child pytest with it
set. Skipped when Triton is not installed (it is in the ``test`` extra)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent


def test_triton_kernels_under_the_interpreter():
    checks = sorted(str(p) for p in (HERE / "triton_kernels").glob("check_*.py"))
    assert checks, "no Triton kernel checks found"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *checks],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
