"""Moniqua's one-call CPU kernels (``moniqua_send``, ``moniqua_receive`` and the codec's
``modulo_decode_hash`` of :mod:`lowbit.codecs.kernels.cpu_modulo`) of two source trees side by
side, in one process.

Run (from the repository root; the "before" tree is a worktree of the commit to compare with)::

    git worktree add /tmp/mk_before HEAD
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/moniqua_kernels.py --before /tmp/mk_before
    python benchmarks/moniqua_kernels.py --before /tmp/mk_before --n 100000 --bits 4 --block 64

Method. The "before" tree's ``cpu_modulo`` is loaded as ``lowbit_before`` (``trees.py``), the
"after" one is this checkout's ``lowbit``; both compile first. One torch and numba thread.
The inputs: ``--n`` float32 elements ``x`` (normal, scale 2), a neighbour ``x + U(-0.09, 0.09)``
and ``ModuloCodec(bits, theta=0.1)`` (stochastic rounding), so every block verifies and the
receive runs its mixing loop. Both trees' outputs are checked equal
(message bytes, own decode, the receive's ``found``, ``xh`` and ``delta``, the decode-hash's
outputs) before timing, then ``trees.race`` times them: ``--rounds`` rounds, the trees' order
swapping every round, the best of ``--reps`` calls of each kernel by the thread's CPU time
(``--clock cpu``) or the wall clock; reported: the medians over rounds of each tree's
milliseconds per call and of the per-round ratio after/before (below 1: the change is faster).
"""

from __future__ import annotations

import argparse
import os

from trees import load_before, private_numba_cache, race


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a source tree (e.g. a git worktree) to compare with")
    p.add_argument("--n", type=int, default=1_660_000, help="float32 elements")
    p.add_argument("--bits", type=int, default=2, choices=(1, 2, 4, 8))
    p.add_argument("--block", type=int, default=256, help="verification block, elements")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=3, help="calls per kernel, tree and round (the best counts)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="the thread's CPU time or the wall clock")
    args = p.parse_args(argv)
    private_numba_cache()

    import torch

    torch.set_num_threads(1)
    import lowbit
    from lowbit.codecs.kernels import cpu_modulo as after
    from lowbit.codecs.modulo import ModuloCodec

    before = load_before(args.before, "codecs.kernels.cpu_modulo")
    print(f"after: {os.path.dirname(after.__file__)}  before: {os.path.dirname(before.__file__)}  "
          f"(lowbit {os.path.dirname(lowbit.__file__)})")
    n, bits, block = args.n, args.bits, args.block
    codec = ModuloCodec(bits=bits, theta=0.1, rounding="stochastic")
    B, levels = codec.B_theta, codec.levels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 2
    xj = x + (torch.rand(n, generator=g) * 2 - 1) * 0.09
    nbytes, nb = -(-n * bits // 8), -(-n // block)
    hash_at, w = nbytes + 2, 1 / 3

    def send(K, y, key):
        msg = torch.zeros(hash_at + 2 * nb + 1, dtype=torch.uint8)
        xhat = torch.empty(n, dtype=y.dtype)
        K.moniqua_send(y, B, levels, True, key, bits, block, msg, hash_at, 5, xhat)
        return msg, xhat

    msg_j, _ = send(after, xj, 12345)
    _, xhat_i = send(after, x, 777)
    start = torch.randn(n, generator=g)

    def receive(K, delta, xh):
        return K.moniqua_receive(msg_j, bits, B, levels, x, block, xh, None, xhat_i, w, delta)

    def decode_hash(K):
        return K.modulo_decode_hash(msg_j[:nbytes], bits, n, B, levels, x, block)

    for K in (before, after):  # compile (or load from numba's cache) before timing
        send(K, x, 1)
        receive(K, start.clone(), torch.empty(n))
    outs = {}
    for name, K in (("before", before), ("after", after)):
        m, xh = send(K, xj, 12345)
        d, r = start.clone(), torch.empty(n)
        found = receive(K, d, r)
        outs[name] = (m, xh, torch.from_numpy(found), d, r, *decode_hash(K))
    if not all(torch.equal(a, b) for a, b in zip(outs["before"], outs["after"])):
        raise SystemExit("the two trees' kernels give different results")
    if outs["after"][2][:nb].any():
        raise SystemExit("a block failed verification: the receive would not mix")

    msg = torch.zeros(hash_at + 2 * nb + 1, dtype=torch.uint8)
    xhat = torch.empty(n)
    delta, xh = start.clone(), torch.empty(n)

    calls = {
        "moniqua_send": lambda K: K.moniqua_send(xj, B, levels, True, 12345, bits, block, msg, hash_at, 5, xhat),
        "moniqua_receive": lambda K: receive(K, delta, xh),
        "modulo_decode_hash": lambda K: decode_hash(K),
    }
    print(f"n={n} float32, {bits} bits, block {block}, {args.rounds} rounds x best of {args.reps}, one thread, "
          f"{args.clock} clock")
    race({k: (lambda f=f: f(before), lambda f=f: f(after)) for k, f in calls.items()}, args.rounds, args.reps,
         args.clock, per=n)


if __name__ == "__main__":
    main()
