"""The Triton kernels (the CUDA fast path), run on the CPU by Triton's interpreter, and
compiled for a real GPU.

``TRITON_INTERPRET=1`` must be set before Triton decorates a kernel, so the
checks in ``tests/triton_kernels/check_*.py`` run in one child pytest with it
set. That run records every kernel launch (``record_launches.py``), and each
specialization is then compiled for sm_90 (the H100/H200) without a GPU
(``compile_launches.py``): the interpreter runs code the compiler refuses (a
plain module-level int in a kernel, which the first run on a GPU met in 78 of
194 specializations), and it does not show Triton's approximate float32
division. Skipped when Triton is not installed (it is in the ``test`` extra)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent
KERNELS = HERE / "triton_kernels"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The interpreter run of every check: (its process, the file of recorded launches)."""
    checks = sorted(str(p) for p in KERNELS.glob("check_*.py"))
    assert checks, "no Triton kernel checks found"
    launches = tmp_path_factory.mktemp("triton") / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", LOWBIT_TRITON_LAUNCHES=str(launches),
               PYTHONPATH=os.pathsep.join([str(KERNELS), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "record_launches",
                           *checks], cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=1200)
    return proc, launches


def test_triton_kernels_under_the_interpreter(interpreted):
    proc, _ = interpreted
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_every_launched_kernel_compiles_for_the_gpu(interpreted):
    _, launches = interpreted
    assert launches.exists(), "the interpreter run recorded no launches"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(KERNELS / "compile_launches.py"), str(launches), "90"],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
