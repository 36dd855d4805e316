"""``lowbit bench codecs``: every codec against memcpy, and against the reference codecs.

Method (:mod:`lowbit.bench.timing`): one torch thread; each timing is a
``torch.utils.benchmark`` ``blocked_autorange`` median, on the CPU of the
thread's CPU time by default (``clock="wall"`` for wall time), on CUDA of
the wall time after synchronizing the device. memcpy is
``dst.copy_(src)`` with ``dst`` a preallocated fp32 tensor of ``src``'s size.
Round by round, each codec's memcpy, encode and decode are timed one after the
other, and the reported ratios (encode / memcpy, decode / memcpy,
(encode + decode) / memcpy) are medians of the per-round ratios. GB/s is fp32
input bytes (``4 * size``) over the median seconds of the operation.

``path="both"`` also times each codec's reference implementation
(``encode``/``decode`` under ``codec_path("reference")``: the float64 code the
fast path is tested against) in the same rounds; ``path="reference"`` times
only that. RandK cases select anew at every encode (a new seed, as at every
training step); a decode finds its step's selection in the per-process cache,
as a global random-k step's decodes do. ``randk_k`` sets the kept counts of the
RandK cases (default: 1% of the size, and half of it). Each round also times a
copy into a fresh buffer allocated as a decode allocates its output
(:func:`lowbit.codecs.kernels.empty_output`, then ``copy_(x)``): what the
allocation and first touch of a decode's new output cost, as a multiple of the
memcpy (a decode given ``out=`` avoids it).

``against="references"`` times, in each round, lowbit's encode + decode and a
reference codec's (:mod:`lowbit.bench.references`) side by side, and reports
the median of the per-round ratios lowbit / reference, with both wire sizes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from ..codecs import Codec, CodecKind, make_generator, shared_generator
from ..codecs.kernels import codec_path, empty_output
from . import references as refs
from .table import Column, span_column, table_lines
from .timing import (check_positive_float, check_positive_int, measure, median_ratio, pinned_threads, resolve_clock,
                     spread)

MEMCPY_DEFINITION = ("memcpy = dst.copy_(src), dst a preallocated fp32 tensor of src's size; "
                     "GB/s = 4 * size bytes of fp32 input / seconds")
AGAINST = ("memcpy", "references")
PATHS = ("fast", "reference", "both")
CLOCK_NAMES = {"cpu": "the thread's CPU time", "wall": "wall time (CUDA: after synchronizing the device)"}


@dataclass(frozen=True)
class BenchCase:
    """``label``: shown in the table; its first word is the codec's family (what
    ``--codecs`` selects). ``make``: builds the codec. ``decode_out``: decode into one
    float32 buffer kept between calls (``decode(..., out=buffer)``)."""

    label: str
    make: Callable[[], Codec]
    decode_out: bool = False

    @property
    def family(self) -> str:
        return self.label.split()[0]


@dataclass(frozen=True)
class ReferencePair:
    """A lowbit codec and the reference computing the same thing. ``decode_out``: the
    reference decodes into a buffer kept between calls, so lowbit's decode is given one
    too (``decode(..., out=buffer)``)."""

    label: str
    make: Callable[[], Codec]
    make_reference: Callable[[], refs.Reference]
    decode_out: bool = False

    @property
    def family(self) -> str:
        return self.label.split()[0]


def _label(cls: type[Codec], variant: str = "") -> str:
    """A case's label: the codec class's registered name (its family, what ``--codecs``
    selects), then the variant."""
    return f"{cls.name} {variant}".rstrip()


THETA = 0.1  # Moniqua's bound in the benchmark; the data keeps |x - ref| < 0.005 < theta


def randk_cases(size: int, ks: list[int] | None = None) -> list[BenchCase]:
    """RandK around QSGDMaxNorm 8 bits: ``ks`` (kept counts, each in ``1..size``), or by
    default 1% and half of ``size``."""
    from .. import codecs as c

    inner = lambda: c.QSGDMaxNormCodec(bits=8)  # noqa: E731
    if ks is None:
        return [BenchCase(_label(c.RandKCodec, f"1% {inner().name} b=8"), lambda: c.RandKCodec(inner(), k=max(1, size // 100), seed=1)),
                BenchCase(_label(c.RandKCodec, f"k=d/2 {inner().name} b=8"), lambda: c.RandKCodec(inner(), k=max(1, size // 2), seed=1))]
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= size:
            raise ValueError(f"randk_k: each kept count must be an integer in [1, size={size}], got {k!r}")
    return [BenchCase(_label(c.RandKCodec, f"k={k} {inner().name} b=8"), lambda k=k: c.RandKCodec(inner(), k=k, seed=1)) for k in ks]


def default_cases(size: int = 1_000_000, randk_k: list[int] | None = None) -> list[BenchCase]:
    """Every codec, with variants; the RandK cases from :func:`randk_cases` (``size``,
    ``randk_k``)."""
    from .. import codecs as c

    cases = [BenchCase(_label(c.IdentityCodec), c.IdentityCodec), BenchCase(_label(c.HalfCodec), lambda: c.HalfCodec("fp16")),
             BenchCase(_label(c.HalfCodec, "out="), lambda: c.HalfCodec("fp16"), decode_out=True),
             BenchCase(_label(c.HalfCodec, "bf16"), lambda: c.HalfCodec("bf16"))]
    for b in (1, 2, 4, 8):
        if b >= 2:
            cases.append(BenchCase(_label(c.ModuloCodec, f"b={b}"), lambda b=b: c.ModuloCodec(bits=b, theta=THETA)))
        cases.append(BenchCase(_label(c.MinMaxCodec, f"b={b}"), lambda b=b: c.MinMaxCodec(bits=b)))
    cases.append(BenchCase(_label(c.MinMaxCodec, "b=4 stochastic"), lambda: c.MinMaxCodec(bits=4, rounding="stochastic")))
    cases.append(BenchCase(_label(c.UniformCodec, "step=0.01"), lambda: c.UniformCodec(step=0.01)))
    cases.append(BenchCase(_label(c.UniformCodec, "step=0.01 nearest"), lambda: c.UniformCodec(step=0.01, rounding="nearest")))
    for m in (1, 3, 7):  # 2, 3, 4 bits
        cases.append(BenchCase(_label(c.DitheredCodec, f"M={m}"), lambda m=m: c.DitheredCodec(levels=m)))
    # 61 levels: mixed radix in 89-bit groups of 15 codes (wider than a 64-bit word: the limb kernels)
    cases.append(BenchCase(_label(c.DitheredCodec, "M=30"), lambda: c.DitheredCodec(levels=30)))
    cases.append(BenchCase(_label(c.DitheredCodec, "M=3 half"), lambda: c.DitheredCodec(levels=3, subtractive=False)))
    cases.append(BenchCase(_label(c.DitheredCodec, "M=7 K=64"), lambda: c.DitheredCodec(levels=7, partitions=64)))
    cases.append(BenchCase(_label(c.NestedDitheredCodec, "k=4"), lambda: c.NestedDitheredCodec(delta1=0.005, k=4)))
    cases.append(BenchCase(_label(c.NestedDitheredCodec, "k=8 alpha=0.9"), lambda: c.NestedDitheredCodec(delta1=0.005, k=8, alpha=0.9)))
    for s in (1, 7, 127):
        cases.append(BenchCase(_label(c.QSGDCodec, f"s={s}"), lambda s=s: c.QSGDCodec(levels=s)))
    cases.append(BenchCase(_label(c.QSGDCodec, "s=7 bucket=512"), lambda: c.QSGDCodec(levels=7, bucket=512)))
    for b in (2, 3, 4, 8):
        cases.append(BenchCase(_label(c.QSGDMaxNormCodec, f"b={b}"), lambda b=b: c.QSGDMaxNormCodec(bits=b)))
    cases.append(BenchCase(_label(c.MultiScaleMaxNormCodec, "(2,6)"), lambda: c.MultiScaleMaxNormCodec(scales=(2, 6))))
    cases += randk_cases(size, randk_k)
    cases += [BenchCase(_label(c.TernGradCodec), c.TernGradCodec), BenchCase(_label(c.SignCodec), c.SignCodec),
              BenchCase(_label(c.SignCodec, "rms"), lambda: c.SignCodec("rms")), BenchCase(_label(c.SignCodec, "none"), lambda: c.SignCodec("none")),
              BenchCase(_label(c.PowerSGDCodec, "r=2"), lambda: c.PowerSGDCodec(rank=2))]
    return cases


def reference_pairs(size: int = 1_000_000) -> list[ReferencePair]:
    """lowbit codec / reference pairs computing the same quantizer (same levels, bits, theta);
    ``size``: the vector length, which sets the global random-k pair's kept count (1%)."""
    from .. import codecs as c

    check_positive_int(size, "size")

    pairs = [ReferencePair(_label(c.QSGDCodec, f"s={s}"), lambda s=s: c.QSGDCodec(levels=s), lambda s=s: refs.QSGDReference(s))
             for s in (7, 127)]
    pairs.append(ReferencePair(_label(c.TernGradCodec), c.TernGradCodec, refs.TernGradReference))
    pairs.append(ReferencePair(_label(c.SignCodec, "(unscaled)"), lambda: c.SignCodec(scale="none"), refs.SignSGDReference))
    pairs += [ReferencePair(_label(c.QSGDMaxNormCodec, f"b={b}"), lambda b=b: c.QSGDMaxNormCodec(bits=b),
                            lambda b=b: refs.QSGDMaxNormReference(b)) for b in (2, 4, 8)]
    pairs += [ReferencePair(_label(c.ModuloCodec, f"b={b}"), lambda b=b: c.ModuloCodec(bits=b, theta=THETA),
                            lambda b=b: refs.MoniquaReference(b, THETA)) for b in (2, 4)]
    k = max(1, size // 100)
    pairs.append(ReferencePair(_label(c.RandKCodec, f"1% {c.QSGDMaxNormCodec.name} b=8"), lambda: c.RandKCodec(c.QSGDMaxNormCodec(bits=8), k=k, seed=1),
                               lambda: refs.GlobalRandKMaxNormReference(8, k)))
    pairs.append(ReferencePair(_label(c.HalfCodec), lambda: c.HalfCodec("fp16"), refs.HalfReference, decode_out=True))
    pairs.append(ReferencePair(_label(c.PowerSGDCodec, "r=2"), lambda: c.PowerSGDCodec(rank=2), lambda: refs.PowerSGDReference(2)))
    return pairs


def select(cases: list, codecs: str | list[str] | None) -> list:
    """The cases whose family (first word of the label) or whole label is in ``codecs``
    (a comma-separated string or a list); None keeps all. An unknown name is a ValueError."""
    if codecs is None:
        return list(cases)
    names = [n.strip() for n in (codecs.split(",") if isinstance(codecs, str) else codecs) if n.strip()]
    if not names:
        raise ValueError("codecs must name at least one codec (comma-separated), got an empty list")
    valid = {c.family for c in cases} | {c.label for c in cases}
    unknown = [n for n in names if n not in valid]
    if unknown:
        families = sorted({c.family for c in cases})
        raise ValueError(f"codecs: unknown {', '.join(map(repr, unknown))}; choose from: {', '.join(families)} "
                         f"(or a full label such as {cases[0].label!r})")
    return [c for c in cases if c.family in names or c.label in names]


def bench_data(size: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, std 0.05) and a neighbour's ``ref`` with ``|x - ref| < 0.005``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(size, generator=g) * 0.05).to(device)
    ref = x + (torch.rand(size, generator=g).to(device) - 0.5) * 0.01
    return x, ref


def _generator(seed: int) -> torch.Generator:
    """The generator lowbit's algorithms hand a codec for one message: ``shared_generator``
    as they call it (where the draws happen is the codec's affair)."""
    return shared_generator(seed, 0, 0)


def _decode_generator(codec: Codec, seed: int) -> torch.Generator | None:
    """The generator a receiver hands ``decode``: the sender's regenerated one for a codec
    with ``dither_on_decode``, else none (lowbit's algorithms and DDP hooks derive none)."""
    return _generator(seed) if codec.dither_on_decode else None


def _reference_generator(seed: int, device: torch.device) -> torch.Generator:
    """The references draw on the data's device, as their code (``torch.rand_like``) does."""
    return make_generator(seed, device)


def _encoder(codec: Codec) -> Callable[[], Codec]:
    """The codec to encode with at each call: a RandK codec with a seed gets a new seed every
    time (a new selection, as at every training step; its decode of that message finds the
    selection in the per-process cache, as a global random-k step's decodes do)."""
    from ..codecs import RandKCodec

    if isinstance(codec, RandKCodec) and codec.seed is not None:
        seeds = itertools.count(codec.seed + 1)
        return lambda: codec.with_seed(next(seeds))
    return lambda: codec


def codec_calls(codec: Codec, x: torch.Tensor, ref: torch.Tensor, seed: int, device: torch.device,
                path: str = "fast", decode_out: bool = False):
    """(encode, decode, payload): the two timed calls on ``path`` ("fast" or "reference"),
    the encode with a fresh shared generator and the decode with one where the codec
    regenerates a dither (:func:`_decode_generator`: as one message's sender and receiver
    derive them), and a payload to decode (with ``decode_out``, into one float32 buffer kept between
    calls). A RandK codec with a seed encodes with a new seed at every call (:func:`_encoder`)."""
    on_path = lambda: codec_path(path) if path == "reference" else contextlib.nullcontext()  # noqa: E731
    with on_path():
        payload = codec.encode(x, generator=_generator(seed))
    kw = {"ref": ref} if codec.kind is CodecKind.SIDE_INFO else {}
    if decode_out:
        kw["out"] = torch.empty(x.numel(), dtype=torch.float32, device=device)
    encoder = _encoder(codec)

    def encode():
        with on_path():
            return encoder().encode(x, generator=_generator(seed))

    def decode():
        with on_path():
            return codec.decode(payload, generator=_decode_generator(codec, seed), **kw)

    return encode, decode, payload


def roundtrip_calls(codec: Codec, reference: refs.Reference, x: torch.Tensor, ref: torch.Tensor, seed: int,
                    device: torch.device, decode_out: bool = False):
    """(lowbit, reference): the two timed encode + decode calls of a pair (a RandK codec with a
    seed selects anew at each call, :func:`_encoder`); with ``decode_out`` lowbit decodes into
    one float32 buffer kept between calls."""
    kw = {"ref": ref} if codec.kind is CodecKind.SIDE_INFO else {}
    if decode_out:
        kw["out"] = torch.empty(x.numel(), dtype=torch.float32, device=device)
    rkw = {"ref": ref} if reference.needs_ref else {}

    encoder = _encoder(codec)

    def lowbit():
        return codec.decode(encoder().encode(x, generator=_generator(seed)),
                            generator=_decode_generator(codec, seed), **kw)

    def reference_rt():
        return reference.decode(reference.encode(x, generator=_reference_generator(seed, device)), **rkw)

    return lowbit, reference_rt


def _setup(size, rounds, min_run_time, device, seed, clock):
    from ..train.config import resolve_device

    device = resolve_device(device)
    clock = resolve_clock(clock, device)
    check_positive_int(size, "size")
    check_positive_int(rounds, "rounds")
    check_positive_float(min_run_time, "min_run_time")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return device, clock


def codec_row(label: str, rounds: list[dict], size: int, nbytes: int) -> dict:
    """One codec's row from its per-round timings (seconds; keys memcpy, encode, decode, and
    with the reference path timed also ref_encode, ref_decode)."""
    gb = 4 * size / 1e9
    med = {k: statistics.median(r[k] for r in rounds) for k in ("memcpy", "encode", "decode")}
    row = {"codec": label, "bytes_per_element": nbytes / size,
           "encode_x_memcpy": median_ratio(rounds, "encode", "memcpy"),
           "decode_x_memcpy": median_ratio(rounds, "decode", "memcpy"),
           "roundtrip_x_memcpy": median_ratio(rounds, ("encode", "decode"), "memcpy"),
           "roundtrip_x_memcpy_range": spread(rounds, ("encode", "decode"), "memcpy"),
           "memcpy_gbps": gb / med["memcpy"], "encode_gbps": gb / med["encode"], "decode_gbps": gb / med["decode"],
           "rounds": rounds}
    if "ref_encode" in rounds[0]:
        row.update(ref_encode_x_memcpy=median_ratio(rounds, "ref_encode", "memcpy"),
                   ref_decode_x_memcpy=median_ratio(rounds, "ref_decode", "memcpy"))
    return row


def pair_row(label: str, reference: str, rounds: list[dict], size: int, lowbit_nbytes: int,
             reference_nbytes: int) -> dict:
    """One pair's row from its per-round timings (seconds; keys lowbit, reference, memcpy:
    encode + decode of each side, and the round's memcpy)."""
    return {"codec": label, "reference": reference,
            "lowbit_x_reference": median_ratio(rounds, "lowbit", "reference"),
            "lowbit_x_reference_range": spread(rounds, "lowbit", "reference"),
            "lowbit_x_memcpy": median_ratio(rounds, "lowbit", "memcpy"),
            "reference_x_memcpy": median_ratio(rounds, "reference", "memcpy"),
            "lowbit_bytes": lowbit_nbytes, "reference_bytes": reference_nbytes,
            "lowbit_bytes_per_element": lowbit_nbytes / size, "reference_bytes_per_element": reference_nbytes / size,
            "rounds": rounds}


def bench_codecs(size: int = 1_000_000, rounds: int = 5, cases: list[BenchCase] | None = None,
                 device: str = "cpu", seed: int = 0, codecs: str | list[str] | None = None,
                 min_run_time: float = 0.05, clock: str = "auto", path: str = "fast",
                 randk_k: list[int] | None = None) -> dict:
    """Each codec's encode and decode on ``size`` fp32 elements on ``device`` (``cpu``,
    ``cuda``, ``cuda:N`` or ``auto``) against memcpy, ``rounds`` interleaved rounds
    (module doc). ``path``: "fast" (default), "reference" (the reference implementation
    only, its ratios in the encode/decode columns) or "both" (also ``ref_encode_x_memcpy``,
    ``ref_decode_x_memcpy``). ``randk_k``: the RandK cases' kept counts. Returns the
    report: settings plus one row per codec."""
    dev, clock = _setup(size, rounds, min_run_time, device, seed, clock)
    if path not in PATHS:
        raise ValueError(f"path={path!r} is unknown; choose one of: {', '.join(PATHS)}")
    cases = select(cases if cases is not None else default_cases(size, randk_k), codecs)
    with pinned_threads(1) as threads:
        x, ref = bench_data(size, dev, seed)
        out = torch.empty_like(x)
        memcpy = lambda: out.copy_(x)  # noqa: E731
        fresh = lambda: empty_output(x.numel(), x.dtype, x.device).copy_(x)  # noqa: E731
        prepared = []
        for case in cases:
            codec = case.make()
            calls = {}
            for p, (e, d) in (("fast", ("encode", "decode")), ("reference", ("ref_encode", "ref_decode"))):
                if path in (p, "both"):
                    enc, dec, payload = codec_calls(codec, x, ref, seed, dev, p, case.decode_out)
                    calls.update({e if path == "both" else "encode": enc, d if path == "both" else "decode": dec})
            prepared.append((case, calls, payload.nbytes))
        timings: dict[str, list[dict]] = {case.label: [] for case in cases}
        fresh_rounds = []
        for _ in range(rounds):
            fresh_rounds.append({"memcpy": measure(memcpy, dev, min_run_time, threads, clock),
                                 "fresh": measure(fresh, dev, min_run_time, threads, clock)})
            for case, calls, _nb in prepared:
                t = {"memcpy": measure(memcpy, dev, min_run_time, threads, clock)}
                t.update({k: measure(fn, dev, min_run_time, threads, clock) for k, fn in calls.items()})
                timings[case.label].append(t)
    rows = [codec_row(case.label, timings[case.label], size, nb) for case, _c, nb in prepared]
    return {"benchmark": "codecs", "against": "memcpy", "path": path, "device": str(dev), "threads": threads,
            "size": size, "rounds": rounds, "min_run_time": min_run_time, "clock": clock, "memcpy": MEMCPY_DEFINITION,
            "fresh_buffer_x_memcpy": median_ratio(fresh_rounds, "fresh", "memcpy"),
            "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"), "rows": rows}


def bench_references(size: int = 1_000_000, rounds: int = 5, device: str = "cpu", seed: int = 0,
                     codecs: str | list[str] | None = None, min_run_time: float = 0.05,
                     pairs: list[ReferencePair] | None = None, clock: str = "auto") -> dict:
    """Encode + decode of each lowbit codec against its reference (:func:`reference_pairs`),
    side by side in ``rounds`` interleaved rounds, with a memcpy in each round."""
    dev, clock = _setup(size, rounds, min_run_time, device, seed, clock)
    pairs = select(pairs if pairs is not None else reference_pairs(size), codecs)
    with pinned_threads(1) as threads:
        x, ref = bench_data(size, dev, seed)
        out = torch.empty_like(x)
        memcpy = lambda: out.copy_(x)  # noqa: E731
        prepared = []
        for pair in pairs:
            codec, reference = pair.make(), pair.make_reference()
            lowbit, reference_rt = roundtrip_calls(codec, reference, x, ref, seed, dev, pair.decode_out)
            payload = codec.encode(x, generator=_generator(seed))
            wire = reference.encode(x, generator=_reference_generator(seed, dev))
            prepared.append((pair, reference.name, lowbit, reference_rt, payload.nbytes, refs.wire_nbytes(wire)))
        timings: dict[str, list[dict]] = {p.label: [] for p in pairs}
        for _ in range(rounds):
            for pair, _name, lowbit, reference_rt, _lb, _rb in prepared:
                timings[pair.label].append({"memcpy": measure(memcpy, dev, min_run_time, threads, clock),
                                            "lowbit": measure(lowbit, dev, min_run_time, threads, clock),
                                            "reference": measure(reference_rt, dev, min_run_time, threads, clock)})
    rows = [pair_row(p.label, name, timings[p.label], size, lb, rb) for p, name, _l, _r, lb, rb in prepared]
    return {"benchmark": "codecs", "against": "references", "device": str(dev), "threads": threads, "size": size,
            "rounds": rounds, "min_run_time": min_run_time, "clock": clock, "memcpy": MEMCPY_DEFINITION, "rows": rows}


def format_report(report: dict) -> str:
    """The report as a table (lower ratios are better)."""
    head = (f"{report['size']} fp32 elements on {report['device']}, {report['threads']} torch thread "
            f"(torch.set_num_threads({report['threads']})), {report['rounds']} interleaved rounds, "
            f"medians of per-round ratios (torch.utils.benchmark blocked_autorange, min_run_time "
            f"{report['min_run_time']} s, clock: {CLOCK_NAMES[report['clock']]})\n{report['memcpy']}")
    if report["against"] == "references":
        cols = [Column("codec", 20, "codec", left=True), Column("reference", 27, "reference", left=True),
                Column("lowbit/ref", 10, "lowbit_x_reference", ".2f"), span_column("lowbit_x_reference_range", ".2f", 13),
                Column("lowbit/memcpy", 13, "lowbit_x_memcpy", ".1f"), Column("ref/memcpy", 10, "reference_x_memcpy", ".1f"),
                Column("lowbit B", 10, "lowbit_bytes"), Column("ref B", 10, "reference_bytes")]
        return "\n".join(["lowbit against reference codecs: encode + decode, lowbit / reference (< 1: lowbit faster)",
                          head, *table_lines(cols, report["rows"])])
    both = report.get("path") == "both"
    title = "codec throughput against memcpy (times as multiples of memcpy: lower is better)"
    if report.get("path") == "reference":
        title += "; the REFERENCE implementations (codec_path('reference'))"
    fresh = report.get("fresh_buffer_x_memcpy")
    lines = [title, head]
    if fresh is not None:
        lines.append(f"a copy into a fresh buffer (allocated as a decode's output is, by lowbit.codecs.kernels."
                     f"empty_output, then copy_(x): what a decode's new output costs to allocate and first touch): "
                     f"{fresh:.1f}x memcpy; THP_MEM_ALLOC_ENABLE={report.get('thp_mem_alloc')}")
    cols = [Column("codec", 27, "codec", left=True), Column("enc/memcpy", 10, "encode_x_memcpy", ".1f"),
            Column("dec/memcpy", 10, "decode_x_memcpy", ".1f"), Column("(e+d)/memcpy", 12, "roundtrip_x_memcpy", ".1f"),
            span_column("roundtrip_x_memcpy_range", ".1f", 13), Column("enc GB/s", 9, "encode_gbps", ".3f"),
            Column("dec GB/s", 9, "decode_gbps", ".3f"), Column("memcpy GB/s", 11, "memcpy_gbps", ".2f"),
            Column("B/elem", 7, "bytes_per_element", ".4f")]
    if both:
        cols += [Column("ref enc", 8, "ref_encode_x_memcpy", ".1f"), Column("ref dec", 8, "ref_decode_x_memcpy", ".1f")]
    return "\n".join(lines + table_lines(cols, report["rows"]))
