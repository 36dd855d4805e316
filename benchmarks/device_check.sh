#!/usr/bin/env bash
# The checks of a machine with a CUDA GPU, in one run (issue 10): the gpu-marked tests and
# the rest of the suite side by side, then the codec, step and DDP-hook benchmarks alone on the machine.
#
#   bash benchmarks/device_check.sh OUTDIR
#
# Each part has its own time limit (seconds: T_TESTS, T_CODECS per codec group, T_STEP, T_HOOKS, T_SYNCS), so
# one that hangs leaves the others' logs in OUTDIR. Wheels in .whl/ (constriction, for a
# Python without it) are installed first. DEVICE=cpu and SIZE=... rehearse it without a GPU.
# A shorter run: GPU_TESTS (pytest arguments instead of "-m gpu"), SUITE=0 (not the rest of
# the suite), CODEC_GROUPS (space-separated groups of --codecs), STEP_ALGORITHMS, GPU_WORKERS.
set -u
out=${1:?usage: device_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
device=${DEVICE:-cuda}
size=${SIZE:-100000000}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >"$out/install.log" 2>&1 \
    || echo "wheel install failed: see install.log"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python3 -c "import sys, torch, numba; print(sys.version.split()[0], 'torch', torch.__version__, 'numba', numba.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1
  nproc --all
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# 1. correctness: the gpu tests and everything else that is not slow, at the same time
if [ "$device" != cpu ]; then
  # shellcheck disable=SC2086
  timeout "${T_TESTS:-300}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider -n "${GPU_WORKERS:-4}" --timeout 150 \
    ${GPU_TESTS:--m gpu} >"$out/gpu_tests.log" 2>&1 &
fi
if [ "${SUITE:-1}" != 0 ]; then
  timeout "${T_TESTS:-300}" python3 -m pytest -v -rfE -p no:cacheprovider -m "not gpu and not slow" \
    -n "${SUITE_WORKERS:-10}" --timeout 250 ${SUITE_ARGS:-} >"$out/suite.log" 2>&1 &
fi
wait
grep -h -E "^(FAILED|ERROR)|passed|failed" "$out"/gpu_tests.log "$out/suite.log" 2>/dev/null

# 2. benchmarks, alone: codecs at $size elements (three groups, each its own limit), then steps
read -r -a groups <<<"${CODEC_GROUPS:-fp32,fp16,bf16,minmax,modulo,sign,uniform dithered,nested,qsgd,terngrad \
qsgd_maxnorm,multiscale,globalrandk,randk,powersgd}"
for i in "${!groups[@]}"; do
  timeout "${T_CODECS:-70}" python3 -m lowbit bench codecs --device "$device" --size "$size" --rounds 3 \
    --min-run-time 0.02 --codecs "${groups[$i]}" --json "$out/codecs_$i.json" >"$out/codecs_$i.txt" 2>&1
  cat "$out/codecs_$i.txt"
done
timeout "${T_STEP:-80}" python3 -m lowbit bench step --device "$device" --rounds 3 \
  --algorithms "${STEP_ALGORITHMS:-moniqua,choco,qsgd,powersgd}" --json "$out/step.json" >"$out/step.txt" 2>&1
cat "$out/step.txt"
# 3. the DDP hooks against torch's on a 25 MiB bucket (a one-process NCCL group)
timeout "${T_HOOKS:-60}" python3 -m lowbit bench hooks --device "$device" --size "${HOOK_SIZE:-6553600}" --rounds 3 \
  --min-run-time 0.02 --json "$out/hooks.json" >"$out/hooks.txt" 2>&1
cat "$out/hooks.txt"
# 4. how often each hook makes the host wait for the GPU
if [ "$device" != cpu ]; then
  timeout "${T_SYNCS:-60}" python3 benchmarks/hook_syncs.py --size "${HOOK_SIZE:-6553600}" >"$out/hook_syncs.txt" 2>&1
  cat "$out/hook_syncs.txt"
fi
