"""Where a DDP hook's per-call time goes: lowbit's fp32 and fp16 hooks beside torch's
``allreduce_hook`` and ``fp16_compress_hook`` on one bucket, in a one-process group (NCCL on
CUDA, gloo on the CPU), then a cProfile of lowbit's two hooks.

``lowbit bench hooks`` gives the ratios; this script says what a call is made of. Per call:
``call+wait`` is a refill of the bucket and ``hook(state, bucket).wait()`` (200 calls, device
synchronized before and after); ``issue`` is the refill and the hook's call alone, its future
waited for once after the 200. Rounds interleave the four hooks.

Run: ``OMP_NUM_THREADS=1 python benchmarks/hook_calls.py cuda:0`` (or ``cpu``; ``--size``
elements, default a 25 MiB bucket).
"""

import argparse
import cProfile
import pstats
import time

import torch
import torch.distributed as dist

from lowbit.bench.hooks import _Bucket, _lowbit_hook, _torch_hook, matrix_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("device", nargs="?", default="cuda:0", help="a device with an index, e.g. cuda:0, or cpu")
    ap.add_argument("--size", type=int, default=6553600)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.set_num_threads(1)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
        sync = torch.cuda.synchronize
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        sync = lambda: None  # noqa: E731
    try:
        g = torch.randn(args.size, generator=torch.Generator().manual_seed(0)).to(dev) * 0.01
        bucket = _Bucket(g, *matrix_of(args.size))
        buf = bucket.buffer()
        hooks = {"torch allreduce": _torch_hook("allreduce", 2), "torch fp16": _torch_hook("fp16", 2),
                 "lowbit fp32": _lowbit_hook("fp32", 2), "lowbit fp16": _lowbit_hook("fp16", 2)}

        def call(hook, state):
            buf.copy_(g)
            return hook(state, bucket).wait()

        for hook, state in hooks.values():  # warm up (Triton compiles on the first call)
            for _ in range(20):
                call(hook, state)
        n = args.calls
        for rnd in range(args.rounds):
            for key, (hook, state) in hooks.items():
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    call(hook, state)
                sync()
                t1 = time.perf_counter()
                for _ in range(n):
                    buf.copy_(g)
                    fut = hook(state, bucket)
                t2 = time.perf_counter()
                fut.wait()
                sync()
                print(f"round {rnd} {key:16s} call+wait {1e6 * (t1 - t0) / n:8.1f} us   "
                      f"issue {1e6 * (t2 - t1) / n:8.1f} us")
        for key in ("lowbit fp32", "lowbit fp16"):
            hook, state = hooks[key]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                call(hook, state)
            sync()
            prof.disable()
            print(f"==== cProfile, {n} calls of {key}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
