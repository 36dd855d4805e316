"""How often each DDP hook makes the host wait for the GPU: every lowbit hook of ``lowbit bench
hooks`` (and the fp16/bf16 hooks with ``nonfinite="propagate"``) on one bucket in a one-process
NCCL group, one call and its wait counted by :func:`lowbit.bench.timing.host_syncs` (torch's
sync debug mode), with where each came from, and the mean time of 20 calls with their refills.

Run: ``OMP_NUM_THREADS=1 python benchmarks/hook_syncs.py [--size N]`` on a machine with CUDA
(default: a 25 MiB bucket).
"""

import argparse
import time

import torch
import torch.distributed as dist

from lowbit.bench.hooks import DEFAULT_HOOKS, _Bucket, matrix_of
from lowbit.bench.timing import host_syncs
from lowbit.integrations.ddp_hooks import make_hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=6553600)
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    g = torch.randn(args.size, device=dev) * 0.01
    rows, cols = matrix_of(args.size)
    cases = [(h, {}) for h in DEFAULT_HOOKS] + [(h, {"nonfinite": "propagate"}) for h in ("fp16", "bf16")]
    for name, options in cases:
        state, hook = make_hook(name, **options)
        bucket = _Bucket(g, rows, cols)

        def call():
            bucket.buffer().copy_(g)
            return hook(state, bucket).wait()

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        _, syncs = host_syncs(call)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 20 * 1e3
        label = name + (" (propagate)" if options else "")
        print(f"{label:26s} host reads {len(syncs):3d}  {ms:7.3f} ms a call with its refill")
        for where in syncs:
            print(f"    {where.split('lowbit/')[-1]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
