"""The CPU kernels that share one inlined loop between a general and a specialised caller, of
two source trees side by side: ``cpu_lanes``' packer (``pack_words``, ``R`` and ``k`` at run
time, and ``specialised(R, k)``'s ``pack_all``, compiled with them as constants) at four
layouts, and ``cpu_sign._sign_encode`` at orders 0, 1 and 2 (order 0 a constant in its loop).
Both trees' results are checked equal, then ``trees.race`` times them (one thread, the trees'
order swapping every round, best of ``--reps`` calls by the thread's CPU time).

Run (the "before" tree a worktree of the commit to compare with)::

    git worktree add /tmp/kp_before HEAD
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/kernel_pairs.py --before /tmp/kp_before
"""

from __future__ import annotations

import argparse

from trees import load_before, private_numba_cache, race


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a source tree (e.g. a git worktree) to compare with")
    p.add_argument("--n", type=int, default=1_000_000, help="codes (lanes) and float32 elements (sign)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5, help="calls per kernel, tree and round (the best counts)")
    args = p.parse_args(argv)
    private_numba_cache()
    import numpy as np

    from lowbit.codecs.kernels import cpu_lanes, cpu_sign

    before = tuple(load_before(args.before, f"codecs.kernels.{m}") for m in ("cpu_lanes", "cpu_sign"))
    trees = (before, (cpu_lanes, cpu_sign))
    n = args.n
    rng = np.random.default_rng(0)
    calls = {}
    for R, k in ((5, 27), (9, 19), (17, 15), (33, 12)):
        codes = rng.integers(-(R // 2), R // 2 + 1, n).astype(np.int8)
        outs = [np.empty(-(-n // k), np.int64) for _ in range(4)]
        for side, (L, _) in enumerate(trees):
            L.pack_words(codes, R, k, outs[2 * side])
            L.specialised(R, k)[0](codes, outs[2 * side + 1])
        if not all((o == outs[0]).all() for o in outs):
            raise SystemExit(f"lanes R={R} k={k}: the kernels give different words")
        calls[f"pack_words R={R} k={k}"] = tuple(
            lambda L=L, o=outs[2 * s], R=R, k=k, c=codes: L.pack_words(c, R, k, o) for s, (L, _) in enumerate(trees))
        calls[f"pack_all R={R} k={k}"] = tuple(
            lambda f=L.specialised(R, k)[0], o=outs[2 * s + 1], c=codes: f(c, o) for s, (L, _) in enumerate(trees))
    x = rng.standard_normal(n).astype(np.float32)
    for order in (0, 1, 2):
        outs = [np.empty((n + 7) // 8, np.uint8) for _ in trees]
        got = [S._sign_encode(x, order, o) for (_, S), o in zip(trees, outs)]
        if got[0] != got[1] or not (outs[0] == outs[1]).all():
            raise SystemExit(f"sign order {order}: the kernels give different results")
        calls[f"sign_encode order={order}"] = tuple(
            lambda S=S, o=o, order=order: S._sign_encode(x, order, o) for (_, S), o in zip(trees, outs))
    print(f"n={n}, {args.rounds} rounds x best of {args.reps}, one thread, cpu clock")
    race(calls, args.rounds, args.reps, per=n)


if __name__ == "__main__":
    main()
