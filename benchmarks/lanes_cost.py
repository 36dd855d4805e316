"""What the summable lanes (:mod:`lowbit.codecs.lanes`) cost and save against the int8 (or
wider) sum of the max-norm codes, at 1e6 elements, one thread.

Per case (codec bits, workers n): the sender's side, ``encode_int`` to the sum dtype
(int8 path) against ``encode_int`` to int8 codes plus ``Lanes.pack`` (lanes path), and the
receiver's side, ``decode_sum`` of the int8 sum against ``Lanes.unpack`` plus
``decode_sum``. Each is :func:`lowbit.bench.timing.measure` (median of
``blocked_autorange``, thread CPU time), the two paths timed side by side inside each of
``--rounds`` rounds (their order alternating from round to round); the table gives the
median of the per-round ratios lanes / int8 with the smallest and largest, each side's
median milliseconds, and the added milliseconds (encode + decode, median over rounds)
against the wire time the lanes save in a ring all-reduce at 1 Gbit/s (each rank sends
``2 (n - 1) / n`` times the buffer).

First it prints the bits per element of the code sum's all-reduce buffer that the DDP
hooks' exchange sends for 2 and 4 bits on 2-16 thread workers (from the ledger).

Run: ``python benchmarks/lanes_cost.py`` (``--rounds 7 --numel 1000000``).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from lowbit.bench.timing import measure, median_ratio, spread
from lowbit.codecs import QSGDMaxNormCodec
from lowbit.codecs.base import agree_scale
from lowbit.codecs.rng import shared_generator
from lowbit.comm.netmodel import ring_allreduce_sent_bytes

CASES = [(2, n) for n in (2, 4, 8, 16)] + [(4, n) for n in (2, 4, 8)]
GBIT = 1e9


def _case(bits: int, n: int, numel: int, rounds: int, min_run: float) -> dict:
    codec = QSGDMaxNormCodec(bits=bits)
    lanes = codec.sum_lanes(n)
    dtype = codec.sum_dtype(n)
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    W = agree_scale(codec, xs)
    codes = [codec.encode_int(x, W, shared_generator(0, 0, m), lanes.code_dtype) for m, x in enumerate(xs)]
    plain_sum = torch.stack(codes).sum(0, dtype=dtype)
    words = torch.stack([lanes.pack(c) for c in codes]).sum(0)
    assert torch.equal(lanes.unpack(words, numel).to(dtype), plain_sum)
    x = xs[0]
    ops = {
        "enc_int8": lambda: codec.encode_int(x, W, shared_generator(0, 0, 0), dtype),
        "enc_lanes": lambda: lanes.pack(codec.encode_int(x, W, shared_generator(0, 0, 0), lanes.code_dtype)),
        "dec_int8": lambda: codec.decode_sum(plain_sum, W, n),
        "dec_lanes": lambda: codec.decode_sum(lanes.unpack(words, numel), W, n),
    }
    cpu = torch.device("cpu")
    rs = []
    for r in range(rounds):
        order = list(ops) if r % 2 == 0 else [k for pair in (("enc_lanes", "enc_int8"), ("dec_lanes", "dec_int8"))
                                              for k in pair]
        rs.append({k: measure(ops[k], cpu, min_run) for k in order})
    saved = ring_allreduce_sent_bytes(numel * torch.iinfo(dtype).bits // 8, n) \
        - ring_allreduce_sent_bytes(lanes.nbytes(numel), n)
    added = statistics.median(t["enc_lanes"] + t["dec_lanes"] - t["enc_int8"] - t["dec_int8"] for t in rs)
    return {"bits": bits, "n": n, "sum_dtype": str(dtype).replace("torch.", ""),
            "lane_bits": lanes.bits_per_element, "rounds": rs,
            "enc_ratio": median_ratio(rs, "enc_lanes", "enc_int8"), "enc_spread": spread(rs, "enc_lanes", "enc_int8"),
            "dec_ratio": median_ratio(rs, "dec_lanes", "dec_int8"), "dec_spread": spread(rs, "dec_lanes", "dec_int8"),
            "ms": {k: 1e3 * statistics.median(t[k] for t in rs) for k in ops},
            "added_ms": 1e3 * added, "saved_ms_1gbit": 1e3 * saved * 8 / GBIT}


def ledger_bits(numel: int = 100_000) -> dict:
    """Bits per element of the code sum's all-reduce buffer as the DDP hooks' exchange
    (``int_allreduce``) sends it on the thread runtime, from the ledger: ``{(bits, n): bits}``."""
    import types

    from lowbit.comm import run_threads
    from lowbit.integrations.ddp_hooks.maxnorm import int_allreduce

    out = {}
    for bits in (2, 4):
        codec = QSGDMaxNormCodec(bits=bits)
        for n in (2, 4, 8, 16):
            def worker(t):
                x = torch.randn(numel, generator=torch.Generator().manual_seed(t.rank))
                fut, _ = int_allreduce(types.SimpleNamespace(sum_dtype=None), t, codec, x,
                                       shared_generator(0, 0, t.rank))
                fut.wait()
                return [r.nbytes for r in t.ledger.records[0] if r.op == "all_reduce"][-1]  # the code sum

            out[bits, n] = 8 * run_threads(n, worker)[0] / numel
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--min-run", type=float, default=0.2, help="seconds per blocked_autorange")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lb = ledger_bits()
    print("code-sum all-reduce buffer, bits per element (the hook's exchange, ledger, 1e5 elements):")
    for bits in (2, 4):
        print(f"  codec bits={bits}: " + ", ".join(f"n={n} {lb[bits, n]:.3f}" for n in (2, 4, 8, 16)))
    print(f"numel={a.numel}, one thread, {a.rounds} interleaved rounds; load average {os.getloadavg()}")
    print("bits  n  sum  lane bits | encode ms int8 / lanes  ratio [min, max] | decode ms int8 / lanes  "
          "ratio [min, max] | added ms  saved ms at 1 Gbit/s")
    for bits, n in CASES:
        c = _case(bits, n, a.numel, a.rounds, a.min_run)
        ms = c["ms"]
        print(f"{bits:>4} {n:>2} {c['sum_dtype']:>4} {c['lane_bits']:9.2f} | {ms['enc_int8']:8.2f} / "
              f"{ms['enc_lanes']:5.2f}  {c['enc_ratio']:5.2f} [{c['enc_spread'][0]:.2f}, {c['enc_spread'][1]:.2f}] | "
              f"{ms['dec_int8']:8.2f} / {ms['dec_lanes']:5.2f}  {c['dec_ratio']:5.2f} "
              f"[{c['dec_spread'][0]:.2f}, {c['dec_spread'][1]:.2f}] | {c['added_ms']:8.2f}  {c['saved_ms_1gbit']:8.2f}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
