"""PyTorch DDP communication hooks: lowbit's centralized algorithms and codecs.

Usage::

    state, hook = make_hook("maxnorm", bits=4, seed=1)         # a lowbit train --algorithm name
    state, hook = make_hook("qsgd_maxnorm", bits=4)            # or a codec hook; or LowbitHookState(codec)
    ddp_model.register_comm_hook(state, hook)
    ...
    state.bytes_sent, state.last_step_bytes                    # the wire cost

``make_hook`` takes every centralized algorithm of ``lowbit train`` by its name, with the
options as ``lowbit train`` names them (:class:`~lowbit.algorithms.options.AlgorithmOptions`:
``bits``, ``k``, ``scales``, ``powersgd_rank``, ``levels``, ``sum_dtype``...; the same
defaults), and sends what the algorithm sends: its codec, rank and code-sum dtype
(:func:`algorithm_codec`); NDQSG, whose two groups no codec path carries, runs as itself on
each bucket. The codec hooks of :data:`HOOKS` name codecs directly (fp16, the l-inf norm...).
One hook function, :func:`lowbit_hook`, serves every codec; the state says which
codec and how its bucket travels. DDP calls the hook once per gradient bucket
with the bucket's flat, *local* gradient; the hook returns a future whose value
is the bucket's gradient averaged over the process group.

How each codec travels (``WIRE_METHODS``):

* ``allreduce-float`` -- fp32 (:class:`IdentityCodec`; the exact reference) and
  fp16/bf16 (:class:`HalfCodec`): each rank divides by the world size, casts to the
  wire dtype (the codec's overflow check applies), one SUM all-reduce, cast back.
* ``allreduce-int`` -- summable codecs (QSGDMaxNorm, multi-scale, GlobalRandK around
  them): the codec's scale rounds (MAX all-reduce of the float32 norm; for the
  multi-scale codec a MIN of the per-coordinate scale indices), then one SUM
  all-reduce of the integer codes in ``codec.sum_dtype(world_size)`` (int16 is
  widened to int32: neither gloo nor NCCL reduces int16), then ``decode_sum``.
  The MIN of the scale indices travels as ``N - 1`` packed bit-planes (plane ``p``
  holds ``index >= p``) combined by bitwise AND, which is exactly the MIN, when
  that is narrower than one uint8 per coordinate (``N <= 8`` scales; for the
  paper's two scales one bit per coordinate, its ``ceil(log2 N)``); otherwise a
  uint8 MIN all-reduce. Integers on the wire take whole bytes (the paper's
  section on framework support): ``bits=4`` (codes -7..7) sums in int8 up to 18
  ranks; ``bits=8`` already needs int16 for 2 ranks, sent as int32, i.e. no saving
  over fp32 -- hence ``make_hook``'s default ``bits=4``.
* ``allreduce-randk`` -- :class:`RandKCodec` with ``send_indices=False``: every
  rank keeps the same ``k`` coordinates of a bucket, chosen from the seed
  ``derive_seed(seed, step, bucket_index, GLOBAL_RANDK_STREAM)`` (the codec's own
  ``seed`` field is replaced by it), and the kept values travel as the inner
  codec does (integers for a summable inner codec, fp32/fp16 floats for an
  identity/half inner codec, all-gather otherwise); the average is scattered back
  (times ``d / k`` when ``rescale``).
* ``allgather`` -- codecs whose codes cannot be added (QSGD, TernGrad, sign, DQSG
  dithered, min-max, uniform, RandK with explicit indices): every rank all-gathers
  the packed wire payloads (``payload.to_wire()``, header included) and decodes all
  of them, a subtractive-dither decode with the sender's regenerated generator
  ``shared_generator(seed, step, sender, stream)``, then averages.
* ``powersgd`` -- PowerSGD's distributed rank-r step (Vogels et al., Algorithm 1),
  the codec giving the rank (:class:`PowerSGDCodec`'s own layout, the whole vector
  as one near-square matrix, has no low-rank structure for a bucket of unrelated
  tensors, so the hook delegates to the paper's per-tensor form, as torch's
  PowerSGD hook does): each gradient with 2+ dims is an ``n x m`` matrix ``M``
  (``shape[0]`` rows) compressed when ``(n + m) r < n m``; ``P = M Q`` of all of them,
  together with the uncompressed vectors (biases), in one all-reduce; each ``P``
  orthogonalised (QR, the same on every rank); ``Q = M^T P`` averaged by a second
  all-reduce; output ``P Q^T``. The averaged ``Q`` warm-starts the bucket's next step
  (the first ``Q`` is drawn from the shared seed, the same on every rank). The three
  parts of the step are the algorithm's (``algorithms.compressed.power_p``, ``power_q``,
  ``power_product``).
* ``algorithm`` -- a centralized algorithm (an instance) that runs its own step on the
  bucket over the default process group (NDQSG), one algorithm state per bucket; its
  transport's ledger gives the bytes.

Asynchrony. The one big transfer of a bucket (the float, integer, gathered or
``Q`` tensor) is issued with ``async_op=True`` and decoded in a ``.then``
callback, so DDP overlaps it with the rest of the backward pass. The small
rounds before it (the 4-byte norm MAX and the scale-index MIN of the max-norm
codecs, PowerSGD's ``P``) are done synchronously inside the hook: a later round
needs the earlier one's result to encode, and waiting inside a future callback
can deadlock a backend with few worker threads.

Randomness. Rank ``r``'s stochastic rounding / dither for bucket ``b`` at step ``k``
comes from ``shared_generator(seed, k, r, HOOK_STREAM + b)``; ``seed`` must be the
same on every rank. The step counter ``state.step`` advances once per iteration,
when the hook has processed the bucket with ``bucket.is_last()``.

Error feedback (``error_feedback=True``; the default for the biased sign and
PowerSGD codecs, False for the others): rank ``m`` compresses
``x_m = g_m + e_m`` and keeps ``e_m <- x_m - D(C(x_m))``, where ``D(C(x_m))`` is its
own contribution to the average (for PowerSGD, ``P Q_m^T`` with its own ``Q_m``, and
its own vectors as sent in float32).
The memory is keyed

* per parameter (by name) when the state knows the model
  (``LowbitHookState(..., model=ddp_model)`` or :meth:`LowbitHookState.bind_model`):
  a bucket's memory is assembled from, and split back into, the memories of its
  parameters, so DDP's bucket rebuild after the first iteration, and restoring a
  checkpoint into a freshly built DDP model, keep the memory exactly;
* otherwise per bucket index, with the bucket's signature (its parameters'
  shapes in bucket order): when DDP's rebuild changes a bucket's size or layout,
  that bucket's memory is RESET to zero (counted in ``state.memory_resets``), never
  misapplied.

PowerSGD's warm-start ``Q`` is always per bucket and is re-drawn on a signature
change (counted in ``state.powersgd_resets``).

Bytes. ``state.bytes_sent`` counts what this rank puts on the wire, by the same
rule as :func:`lowbit.comm.netmodel.op_messages_and_bytes`: an all-reduce of
``m`` bytes as the ring's ``2(n-1)/n * m``, an all-gather of ``m`` bytes per rank as
``(n-1) m``. ``state.fp32_bytes_sent`` counts what plain fp32 all-reduce of the
same buckets would have sent; ``state.last_step_bytes`` is the latest complete
iteration's total and ``state.bucket_bytes[b]`` the latest bytes of bucket ``b``.

Pickling (checkpoints): the state pickles without its process group (restored as
the default group, or set ``state.process_group`` again) and without the
parameter-identity map (call :meth:`LowbitHookState.bind_model` with the new
model after unpickling, when the memory is per parameter). A restored run
continues exactly as the original when the new DDP model meets the same buckets
(the randomness, per-bucket memories and PowerSGD's ``Q`` follow the bucket
layout); DDP without ``find_unused_parameters`` starts a fresh model with one
bucket and rebuilds after the first iteration, so there the first restored step
differs (per-parameter error memory still carries over exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..algorithms import ALGORITHMS
from ..algorithms.allreduce import AllReduceSGD
from ..algorithms.base import Algorithm, Context
from ..algorithms.compressed import GatheredAlgorithm, PowerSGD, power_p, power_product, power_q
from ..algorithms.dqsg import NDQSG
from ..algorithms.maxnorm import MaxNormSGD, agree_scale_by, kept_count
from ..algorithms.options import AlgorithmOptions
from ..codecs.base import Codec, SummableCodec, is_summable
from ..codecs.dithered import DitheredCodec
from ..codecs.identity import IdentityCodec
from ..codecs.lowp import HalfCodec
from ..codecs.maxnorm import MultiScaleMaxNormCodec, QSGDMaxNormCodec
from ..codecs.minmax import MinMaxCodec
from ..codecs.packing import pack_bits, unpack_bits
from ..codecs.powersgd import PowerSGDCodec
from ..codecs.qsgd import QSGDCodec
from ..codecs.randk import GLOBAL_RANDK_STREAM, RandKCodec
from ..codecs.rng import derive_seed, make_generator, shared_generator
from ..codecs.sign import SignCodec
from ..codecs.terngrad import TernGradCodec
from ..codecs.uniform import UniformCodec
from ..comm.netmodel import op_messages_and_bytes

__all__ = [
    "HOOKS",
    "algorithm_codec",
    "centralized_names",
    "hook_algorithm",
    "HOOK_STREAM",
    "WIRE_METHODS",
    "LowbitHookState",
    "lowbit_hook",
    "make_hook",
    "hook_table",
    "wire_method",
]

#: ``stream`` of :func:`derive_seed` for the hooks' per-rank randomness (plus the bucket index).
HOOK_STREAM = 0x484F4F4B << 20  # "HOOK"
#: stream of the PowerSGD warm-start draws (plus the bucket index).
POWERSGD_STREAM = 0x50535344 << 20  # "PSSD"

WIRE_METHODS = ("allreduce-float", "allreduce-int", "allreduce-randk", "allgather", "powersgd", "algorithm")

# Plain codecs whose payload length depends only on the input length, so that the
# ranks' payloads have one size and can be all-gathered.
_GATHERABLE = (QSGDCodec, TernGradCodec, SignCodec, DitheredCodec, MinMaxCodec, UniformCodec)
_FLOAT_WIRE = (IdentityCodec, HalfCodec)


def _float_wire_dtype(codec: Codec) -> torch.dtype:
    return torch.float32 if isinstance(codec, IdentityCodec) else codec.torch_dtype


def wire_method(codec: Codec | Algorithm) -> str:
    """How ``codec`` travels in a DDP hook (one of :data:`WIRE_METHODS`); ValueError
    for a codec the hooks do not support. A centralized algorithm (an instance) travels
    as itself (``"algorithm"``: its own exchange, run on the bucket)."""
    if isinstance(codec, Algorithm):
        if codec.family != "centralized":
            raise ValueError(f"algorithm {codec.name!r} is {codec.family}: the DDP hooks average gradients, "
                             f"which is what the centralized algorithms do")
        return "algorithm"
    if not isinstance(codec, Codec):
        raise ValueError(f"codec must be a lowbit Codec, got {type(codec).__name__}")
    if isinstance(codec, _FLOAT_WIRE):
        return "allreduce-float"
    if isinstance(codec, PowerSGDCodec):
        return "powersgd"
    if isinstance(codec, RandKCodec):
        if codec.send_indices:
            if not isinstance(codec.inner, _GATHERABLE + _FLOAT_WIRE):
                raise ValueError(f"codec: RandK with send_indices needs a fixed-size inner codec, got "
                                 f"{type(codec.inner).__name__}")
            return "allgather"
        if not (is_summable(codec.inner) or isinstance(codec.inner, _GATHERABLE + _FLOAT_WIRE)):
            raise ValueError(f"codec: the inner codec of a global RandK must be summable, fp32/half or one of "
                             f"{[c.__name__ for c in _GATHERABLE]}, got {type(codec.inner).__name__}")
        return "allreduce-randk"
    if is_summable(codec):
        return "allreduce-int"
    if isinstance(codec, _GATHERABLE):
        return "allgather"
    raise ValueError(
        f"codec {type(codec).__name__} (kind {codec.kind.value}) has no DDP hook: supported are fp32, half, "
        "qsgd_maxnorm(_multiscale), randk, qsgd, terngrad, sign, dithered, minmax, uniform, powersgd "
        "(side-information codecs need a receiver reference; entropy-coded payloads vary in size)"
    )


# --- the state ---------------------------------------------------------------------------


class LowbitHookState:
    """State of :func:`lowbit_hook` for one DDP model.

    ``codec``: a lowbit codec (see :func:`wire_method`). ``process_group``: None for the
    default group. ``seed``: the run seed (same on every rank) behind all shared
    randomness. ``error_feedback``: None picks the method's default (True for the biased
    sign and PowerSGD codecs, False otherwise). ``model``: optionally the (DDP) model,
    to key error memory per parameter (see the module docstring).

    Public counters: ``step``, ``bytes_sent``, ``messages``, ``fp32_bytes_sent``,
    ``last_step_bytes``, ``bucket_bytes`` and ``bucket_numel`` (latest, per bucket index),
    ``memory_resets`` (error memories reset by a bucket change), ``powersgd_resets``.

    ``codec`` may also be a centralized algorithm (an instance): the hook then runs the
    algorithm's own step on each bucket over the default process group, one algorithm state
    per bucket (``"algorithm"``; :func:`make_hook` does this for NDQSG, whose two groups no
    codec path carries). ``sum_dtype`` (the integer dtype of a summable code sum, default the
    narrowest that cannot overflow) and ``kept`` (GlobalRandK's kept fraction of each bucket,
    below 1; the codec's ``k`` is then replaced per bucket) are what :func:`make_hook` takes
    from a max-norm algorithm.
    """

    def __init__(self, codec: Codec | Algorithm, process_group=None, seed: int = 0,
                 error_feedback: bool | None = None, model: torch.nn.Module | None = None, *,
                 sum_dtype: torch.dtype | None = None, kept: float | None = None) -> None:
        self.method = wire_method(codec)
        if self.method == "algorithm" and error_feedback:
            raise ValueError(f"error_feedback: algorithm {codec.name!r} keeps its own memory, if any")
        if kept is not None:
            if not (isinstance(codec, RandKCodec) and 0 < kept < 1):
                raise ValueError(f"kept (a fraction in (0, 1) of each bucket) is for a global RandK codec, "
                                 f"got {kept!r} with {type(codec).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if error_feedback is None:
            error_feedback = isinstance(codec, (SignCodec, PowerSGDCodec))
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool or None, got {error_feedback!r}")
        self.codec = codec
        self.process_group = process_group
        self.seed = seed
        self.error_feedback = error_feedback
        self.step = 0
        self.bytes_sent = 0
        self.messages = 0
        self.fp32_bytes_sent = 0
        self.last_step_bytes = 0
        self.bucket_bytes: dict[int, int] = {}
        self.bucket_numel: dict[int, int] = {}
        self.memory_resets = 0
        self.powersgd_resets = 0
        self._step_bytes = 0
        # error memory: per bucket {index: (signature, tensor)} or per parameter {name: tensor}
        self.bucket_memory: dict[int, tuple[tuple, torch.Tensor]] = {}
        self.param_memory: dict[str, torch.Tensor] = {}
        self.per_parameter = False
        self.powersgd_q: dict[int, tuple[tuple, torch.Tensor]] = {}
        self.sum_dtype = sum_dtype
        self.kept = kept
        self.algorithm_states: dict[int, tuple[tuple, Any]] = {}  # "algorithm": per bucket
        self._transport = None  # "algorithm": the default group's transport, made at the first bucket
        self._param_names: dict[int, str] | None = None
        if model is not None:
            self.bind_model(model)

    def bind_model(self, model: torch.nn.Module) -> None:
        """Key error memory per parameter name of ``model`` (the DDP model or its module).
        Call again after unpickling the state, with the model it now serves."""
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        names = {}
        for name, p in model.named_parameters():
            names[id(p)] = name[len("module."):] if name.startswith("module.") else name
        self._param_names = names
        self.per_parameter = True

    # pickling: no process group, no parameter ids (not meaningful in another process)
    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["process_group"] = None
        d["_param_names"] = None
        d["_transport"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)

    # --- helpers used by the hook ---------------------------------------------------------

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _count(self, op: str, nbytes: int, world: int, bucket: int) -> None:
        self._add(*op_messages_and_bytes(op, nbytes, world), bucket)

    def _add(self, msgs: int, sent: int, bucket: int) -> None:
        self.bytes_sent += sent
        self.messages += msgs
        self._step_bytes += sent
        self.bucket_bytes[bucket] = self.bucket_bytes.get(bucket, 0) + sent

    def _generator(self, rank: int, bucket: int) -> torch.Generator:
        return shared_generator(self.seed, self.step, rank, HOOK_STREAM + bucket)

    def _names(self, bucket) -> list[str]:
        if self._param_names is None:
            raise ValueError("this state keys error memory per parameter but knows no model: call "
                             "state.bind_model(model) (needed after unpickling)")
        try:
            return [self._param_names[id(p)] for p in bucket.parameters()]
        except KeyError:
            raise ValueError("a bucket holds a parameter of another model than the one bound with "
                             "state.bind_model(model)") from None

    def _load_memory(self, bucket, buf: torch.Tensor) -> torch.Tensor:
        """The bucket's error memory (zeros where there is none), float64."""
        n = buf.numel()
        idx = bucket.index()
        if self.per_parameter:
            mem = torch.zeros(n, dtype=torch.float64, device=buf.device)
            for name, (off, size) in zip(self._names(bucket), _offsets(bucket)):
                e = self.param_memory.get(name)
                if e is not None and e.numel() == size:
                    mem[off:off + size] = e.to(mem.device)
            return mem
        sig = _signature(bucket)
        entry = self.bucket_memory.get(idx)
        if entry is not None and entry[0] == sig:
            return entry[1].to(device=buf.device, dtype=torch.float64)
        if entry is not None:
            self.memory_resets += 1
        return torch.zeros(n, dtype=torch.float64, device=buf.device)

    def _store_memory(self, bucket_index: int, sig: tuple, layout, e: torch.Tensor) -> None:
        if self.per_parameter:
            for name, (off, size) in layout:
                self.param_memory[name] = e[off:off + size].clone()
        else:
            self.bucket_memory[bucket_index] = (sig, e.clone())

    def _finish_bucket(self, is_last: bool) -> None:
        if is_last:
            self.last_step_bytes = self._step_bytes
            self._step_bytes = 0
            self.step += 1

    def __repr__(self) -> str:
        return (f"LowbitHookState(codec={self.codec!r}, method={self.method!r}, seed={self.seed}, "
                f"error_feedback={self.error_feedback}, step={self.step}, bytes_sent={self.bytes_sent})")


def _signature(bucket) -> tuple:
    return tuple(tuple(p.shape) for p in bucket.parameters())


def _offsets(bucket) -> list[tuple[int, int]]:
    """(offset, numel) of each parameter's gradient inside the bucket buffer."""
    buf = bucket.buffer()
    base = buf.data_ptr()
    size = buf.element_size()
    out = []
    for g in bucket.gradients():
        out.append(((g.data_ptr() - base) // size, g.numel()))
    return out


# --- the reductions: each returns (future of the float64 average, function giving this rank's own decode) ---


def _ok(fut) -> bool:
    """Re-raise a failed collective's error inside a ``.then`` callback (True otherwise)."""
    fut.value()
    return True


def _float_allreduce(state, codec, x, world, group, bidx):
    # the codec's payload data is the wire tensor (HalfCodec raises ValueError on overflow)
    t = codec.encode(x / world).data.view(_float_wire_dtype(codec))
    own = t.to(torch.float64) * world
    state._count("all_reduce", t.numel() * t.element_size(), world, bidx)
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: _ok(f) and t.to(torch.float64)), lambda: own


def _scale_rounds(state, codec: SummableCodec, x, world, group, bidx):
    """The max-norm algorithm's scale agreement (:func:`~lowbit.algorithms.maxnorm.agree_scale_by`)
    over ``group``, the MIN of small scale indices as packed bit-planes."""

    def reduce(stat, op):
        if op == "min" and stat.dtype == torch.uint8 and isinstance(codec, MultiScaleMaxNormCodec) \
                and len(codec.scales) - 1 <= 7:
            return _min_by_bitplanes(state, stat, len(codec.scales) - 1, world, group, bidx)
        state._count("all_reduce", stat.numel() * stat.element_size(), world, bidx)
        dist.all_reduce(stat, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
        return stat

    return agree_scale_by(codec, x, reduce)


def _min_by_bitplanes(state, idx: torch.Tensor, planes: int, world, group, bidx) -> torch.Tensor:
    """Element-wise MIN over ranks of small indices (0..planes): plane p = (index >= p),
    packed one bit per coordinate; the AND of a plane over ranks is (min >= p)."""
    n = idx.numel()
    if planes == 0:
        return idx
    i64 = idx.to(torch.int64)
    packed = torch.cat([pack_bits((i64 >= p).to(torch.int64), 1) for p in range(1, planes + 1)])
    state._count("all_reduce", packed.numel(), world, bidx)
    dist.all_reduce(packed, op=dist.ReduceOp.BAND, group=group)
    per = packed.numel() // planes
    out = torch.zeros(n, dtype=torch.int64, device=idx.device)
    for p in range(planes):
        out += unpack_bits(packed[p * per:(p + 1) * per], 1, n)
    return out.to(torch.uint8)


def _int_allreduce(state, codec: SummableCodec, x, world, group, bidx, gen):
    scale = _scale_rounds(state, codec, x, world, group, bidx)
    codes = codec.encode_int(x, scale, gen)
    dtype = codec.sum_dtype(world, state.sum_dtype)
    if dtype == torch.int16:  # no backend reduces int16
        dtype = torch.int32
    t = codes.to(dtype)
    own = lambda: codec.decode_sum(codes, scale, 1, numel=x.numel(), dtype=torch.float64)  # noqa: E731
    state._count("all_reduce", t.numel() * t.element_size(), world, bidx)
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: _ok(f) and codec.decode_sum(t.to(torch.int64), scale, world, numel=x.numel(),
                                                          dtype=torch.float64)), own


def _allgather(state, codec, x, world, group, bidx, rank):
    payload = codec.encode(x, generator=state._generator(rank, bidx))
    wire = payload.to_wire()
    bufs = [torch.empty_like(wire) for _ in range(world)]
    state._count("all_gather", wire.numel(), world, bidx)
    fut = dist.all_gather(bufs, wire, group=group, async_op=True).get_future()
    step = state.step
    needs_gen = codec.dither_on_decode
    seed = state.seed
    decoded: dict[int, torch.Tensor] = {}

    def decode_all(f):
        _ok(f)
        total = torch.zeros(x.numel(), dtype=torch.float64, device=x.device)
        for s, b in enumerate(bufs):
            gen = shared_generator(seed, step, s, HOOK_STREAM + bidx) if needs_gen else None
            d = codec.decode(codec.payload_from_wire(b), generator=gen).to(torch.float64)
            if s == rank:
                decoded["own"] = d
            total += d
        return total / world

    return fut.then(decode_all), lambda: decoded["own"]


def _randk(state, codec: RandKCodec, x, world, group, bidx, rank, gen):
    d = x.numel()
    if state.kept is not None:  # a fraction of each bucket
        codec = dataclasses.replace(codec, k=kept_count(state.kept, d))
    sel_seed = derive_seed(state.seed, state.step, bidx, GLOBAL_RANDK_STREAM)
    idx = codec.indices(d, sel_seed, device=x.device)
    factor = d / idx.numel() if codec.rescale and idx.numel() else 1.0
    kept = x[idx]
    inner = codec.inner
    if isinstance(inner, _FLOAT_WIRE):
        fut, own = _float_allreduce(state, inner, kept, world, group, bidx)
    elif is_summable(inner):
        fut, own = _int_allreduce(state, inner, kept, world, group, bidx, gen)
    else:
        fut, own = _allgather(state, inner, kept, world, group, bidx, rank)

    def scatter(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(d, dtype=torch.float64, device=x.device)
        out[idx] = v * factor
        return out

    return fut.then(lambda f: scatter(f.value())), lambda: scatter(own())


def _powersgd_plan(codec: PowerSGDCodec, bucket) -> tuple[list, list]:
    """Split a bucket into low-rank matrices ``(offset, n, m, r)`` -- each gradient with 2+
    dims viewed as ``shape[0] x rest``, rank ``min(rank, n, m)``, when ``(n + m) r < n m`` --
    and dense slices ``(offset, size)`` (vectors, and matrices that rank-r would not shrink)."""
    mats, dense = [], []
    for (off, size), p in zip(_offsets(bucket), bucket.parameters()):
        if p.dim() >= 2 and size:
            n = p.shape[0]
            m = size // n
            r = min(codec.rank, n, m)
            if (n + m) * r < n * m:
                mats.append((off, n, m, r))
                continue
        dense.append((off, size))
    return mats, dense


def _powersgd(state, codec: PowerSGDCodec, x, world, group, bidx, sig, bucket):
    """Vogels et al., Algorithm 1, per gradient tensor of the bucket (as the paper and torch's
    PowerSGD hook do); vectors travel uncompressed in the first all-reduce."""
    mats, dense = _powersgd_plan(codec, bucket)
    entry = state.powersgd_q.get(bidx)
    if entry is not None and entry[0] == sig:
        qs = [q.to(device=x.device) for q in entry[1]]
    else:
        if entry is not None:
            state.powersgd_resets += 1
        gen = make_generator(derive_seed(state.seed, state.step, bidx, POWERSGD_STREAM))
        qs = [torch.randn(m, r, generator=gen, dtype=torch.float32).to(device=x.device) for (_, _, m, r) in mats]
    Ms = [x[off:off + n * m].view(n, m) for (off, n, m, _) in mats]
    first = torch.cat([power_p(M, q).reshape(-1) for M, q in zip(Ms, qs)]
                      + [(x[off:off + size] / world).to(torch.float32) for off, size in dense])
    state._count("all_reduce", first.numel() * 4, world, bidx)
    dist.all_reduce(first, group=group)
    p_hats, q_own, pos = [], [], 0
    for M, (_, n, _, r) in zip(Ms, mats):
        p_hat, q_m = power_q(M, first[pos:pos + n * r].view(n, r))  # P summed: orthogonalize ignores 1/N
        p_hats.append(p_hat)
        q_own.append(q_m.to(torch.float32))
        pos += n * r
    dense_avg = first[pos:].to(torch.float64)
    second = torch.cat([q.reshape(-1) for q in q_own]) if q_own else x.new_empty(0, dtype=torch.float32)

    def assemble(qs_used, dense_part) -> torch.Tensor:
        out = torch.empty(x.numel(), dtype=torch.float64, device=x.device)
        for (off, n, m, _), ph, q in zip(mats, p_hats, qs_used):
            out[off:off + n * m] = power_product(ph, q)
        pos = 0
        for off, size in dense:
            out[off:off + size] = dense_part[pos:pos + size]
            pos += size
        return out

    own_dense = torch.cat([x[off:off + size] for off, size in dense]) if dense else x.new_empty(0)
    own = lambda: assemble(q_own, own_dense.to(torch.float32).to(torch.float64))  # noqa: E731

    def finish(f):
        if f is not None:
            _ok(f)
        q_avg, pos = [], 0
        for (_, _, m, r) in mats:
            q_avg.append((second[pos:pos + m * r].view(m, r).to(torch.float64) / world).to(torch.float32))
            pos += m * r
        state.powersgd_q[bidx] = (sig, [q.clone() for q in q_avg])
        return assemble(q_avg, dense_avg)

    if second.numel() == 0:  # nothing low-rank in this bucket: the first all-reduce was all
        return _ok_future(finish(None)), own
    state._count("all_reduce", second.numel() * 4, world, bidx)
    fut = dist.all_reduce(second, group=group, async_op=True).get_future()
    return fut.then(finish), own


def _algorithm(state, algo: Algorithm, x, group, bidx, sig, dtype):
    """The algorithm's own step on the bucket, over the default group: its before_update
    replaces the bucket's gradient by the aggregate; the bytes are its transport's ledger's."""
    from ..comm.distributed import TorchDistributedTransport

    if state.process_group is not None and state.process_group is not dist.group.WORLD:
        raise ValueError(f"algorithm {algo.name!r} runs over the default process group; process_group "
                         f"must be None")
    if state._transport is None:
        state._transport = TorchDistributedTransport()
    t = state._transport
    ctx = Context.make(t, seed=state.seed)
    g = x.to(dtype)
    entry = state.algorithm_states.get(bidx)
    s = entry[1] if entry is not None and entry[0] == sig else algo.init(g, ctx)
    t.set_step(state.step)
    sent, msgs = t.ledger.bytes_sent, t.ledger.messages_sent
    s = algo.before_update(s, ctx, state.step, g, g, 0.0)
    state.algorithm_states[bidx] = (sig, s)
    state._add(t.ledger.messages_sent - msgs, t.ledger.bytes_sent - sent, bidx)
    out = g.to(torch.float64)
    return _ok_future(out), lambda: out


def _ok_future(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


# --- the hook --------------------------------------------------------------------------------


def lowbit_hook(state: LowbitHookState, bucket) -> torch.futures.Future:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, lowbit_hook)``."""
    if not isinstance(state, LowbitHookState):
        raise ValueError(f"state must be a LowbitHookState, got {type(state).__name__}")
    group = state._group()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    buf = bucket.buffer()
    bidx = bucket.index()
    is_last = bucket.is_last()
    sig = _signature(bucket)
    state.bucket_bytes[bidx] = 0
    state.bucket_numel[bidx] = buf.numel()
    fp32_msgs, fp32_sent = op_messages_and_bytes("all_reduce", 4 * buf.numel(), world)
    state.fp32_bytes_sent += fp32_sent
    codec = state.codec
    ef = state.error_feedback
    x = buf.detach().to(torch.float64)
    layout = None
    if ef:
        if state.per_parameter:
            layout = list(zip(state._names(bucket), _offsets(bucket)))
        x = x + state._load_memory(bucket, buf)
    gen = state._generator(rank, bidx)
    try:
        if state.method == "allreduce-float":
            fut, own = _float_allreduce(state, codec, x, world, group, bidx)
        elif state.method == "allreduce-int":
            fut, own = _int_allreduce(state, codec, x, world, group, bidx, gen)
        elif state.method == "allreduce-randk":
            fut, own = _randk(state, codec, x, world, group, bidx, rank, gen)
        elif state.method == "allgather":
            fut, own = _allgather(state, codec, x, world, group, bidx, rank)
        elif state.method == "algorithm":
            fut, own = _algorithm(state, codec, x, group, bidx, sig, buf.dtype)
        else:
            fut, own = _powersgd(state, codec, x, world, group, bidx, sig, bucket)
    finally:
        state._finish_bucket(is_last)

    def write(f):
        avg = f.value()
        if ef:
            state._store_memory(bidx, sig, layout, x - own())
        buf.copy_(avg.to(buf.dtype))
        return buf

    return fut.then(write)


# DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation)
lowbit_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


# --- by name ---------------------------------------------------------------------------------

HOOKS: dict[str, tuple[Any, str]] = {  # codec hooks: name -> (codec factory, description)
    "fp32": (lambda: IdentityCodec(), "plain fp32 all-reduce average (exact reference)"),
    "fp16": (lambda: HalfCodec("fp16"), "fp16 cast, all-reduce, cast back"),
    "bf16": (lambda: HalfCodec("bf16"), "bf16 cast, all-reduce, cast back"),
    "qsgd_maxnorm": (lambda bits=4, norm="l2": QSGDMaxNormCodec(bits=bits, norm=norm),
                     "QSGDMaxNorm: MAX norm, SUM of integer codes"),
    "qsgd_maxnorm_multiscale": (lambda scales=(2, 6), norm="l2": MultiScaleMaxNormCodec(scales=tuple(scales), norm=norm),
                                "multi-scale QSGDMaxNorm: MAX norm, MIN scale index, SUM of codes"),
    "grandk_maxnorm": (lambda k=10000, bits=4, norm="l2", rescale=True:
                       RandKCodec(QSGDMaxNormCodec(bits=bits, norm=norm), k=k, rescale=rescale),
                       "GlobalRandKMaxNorm: shared k coordinates, QSGDMaxNorm on them"),
    "grandk_maxnorm_multiscale": (lambda k=10000, scales=(2, 6), norm="l2", rescale=True:
                                  RandKCodec(MultiScaleMaxNormCodec(scales=tuple(scales), norm=norm), k=k,
                                             rescale=rescale),
                                  "GlobalRandKMaxNormMultiScale: shared k coordinates, multi-scale on them"),
    "grandk_fp32": (lambda k=10000, rescale=True: RandKCodec(IdentityCodec(), k=k, rescale=rescale),
                    "global random-k, fp32 values of the shared coordinates"),
    "sign": (lambda scale="mean_abs": SignCodec(scale=scale),
             "scaled sign (EF-SignSGD), error feedback on: all-gather of 1-bit payloads"),
    "dithered": (lambda levels=1, subtractive=True, partitions=1:
                 DitheredCodec(levels=levels, subtractive=subtractive, partitions=partitions),
                 "DQSG: all-gather, decode with each sender's regenerated dither"),
}

_STATE_OPTIONS = ("process_group", "seed", "error_feedback", "model")


def centralized_names() -> list[str]:
    """The centralized algorithms of the registry (``lowbit train --algorithm`` names), each
    a hook name of :func:`make_hook` with the algorithm's own options."""
    return [name for name, cls in ALGORITHMS.items() if cls.family == "centralized"]


def hook_algorithm(name: str, **options) -> Algorithm:
    """The centralized algorithm ``name`` with ``options`` (names of
    :class:`~lowbit.algorithms.options.AlgorithmOptions`, as ``lowbit train`` takes them: its
    defaults for the others): ValueError for an option the algorithm does not read (listing
    those it reads) or out of range."""
    cls = ALGORITHMS[name]
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ValueError(f"algorithm {name!r} does not take option(s) {', '.join(unknown)}; it takes: "
                         f"{', '.join(cls.options) or 'none'} (and the hook's {', '.join(_STATE_OPTIONS)})")
    opts = AlgorithmOptions(algorithm=name, **options)
    opts.check_options()
    if "k" in cls.options and opts.k is None:
        raise ValueError(f"algorithm {name!r} needs k (coordinates kept: an int, or a fraction of d if < 1)")
    return cls.from_config(opts)


def algorithm_codec(algo: Algorithm) -> tuple[Codec | Algorithm, dict]:
    """What a hook sends for the centralized algorithm ``algo``: ``(codec, state options)``
    for :class:`LowbitHookState`. The algorithm's codec and rank, so that a hook and ``lowbit
    train`` quantize alike; the algorithm itself where no codec path carries it (NDQSG)."""
    if isinstance(algo, AllReduceSGD):
        return IdentityCodec(), {}
    if isinstance(algo, MaxNormSGD):
        inner, kw = algo.inner, {"sum_dtype": algo.sum_dtype}
        if algo.k is None:
            return inner, kw
        if algo.k < 1:  # a fraction of each bucket
            return RandKCodec(inner, k=1), {**kw, "kept": algo.k}
        return RandKCodec(inner, k=int(algo.k)), kw
    if isinstance(algo, PowerSGD):
        return algo.codec, {}
    if isinstance(algo, GatheredAlgorithm) and not isinstance(algo, NDQSG):
        if algo.server != "allgather":
            raise ValueError(f"server={algo.server!r}: the DDP hooks all-gather the payloads (server='allgather')")
        return algo.codec, {}
    return algo, {}


def make_hook(name: str, **options) -> tuple[LowbitHookState, Any]:
    """``(state, hook)`` for the hook ``name``: a centralized algorithm of ``lowbit train``
    (:func:`centralized_names`, e.g. ``make_hook("qsgd", bits=4, seed=1)``, its options named
    as the CLI names them: ``bits``, ``k``, ``scales``, ``powersgd_rank``, ``levels``,
    ``sum_dtype``...), or a codec hook of :data:`HOOKS` (e.g. ``make_hook("qsgd_maxnorm",
    bits=4)``, the options of its codec). ``process_group``, ``seed``, ``error_feedback`` and
    ``model`` go to :class:`LowbitHookState`."""
    state_kw = {k: options.pop(k) for k in _STATE_OPTIONS if k in options}
    if name in ALGORITHMS and ALGORITHMS[name].family == "centralized":
        codec, kw = algorithm_codec(hook_algorithm(name, **options))
        return LowbitHookState(codec, **state_kw, **kw), lowbit_hook
    if name not in HOOKS:
        raise ValueError(f"name must be one of {sorted(set(HOOKS) | set(centralized_names()))}, got {name!r}")
    factory = HOOKS[name][0]
    try:
        codec = factory(**options)
    except TypeError as e:
        raise ValueError(f"bad options for hook {name!r}: {e}") from None
    return LowbitHookState(codec, **state_kw), lowbit_hook


def _first_sentence(cls) -> str:
    doc = " ".join((cls.__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


def hook_table() -> list[tuple[str, str, str]]:
    """(name, wire method, description) of every hook name: the centralized algorithms (at
    their defaults; GlobalRandK with k = 1) and the codec hooks of :data:`HOOKS`."""
    rows = []
    for name in centralized_names():
        cls = ALGORITHMS[name]
        codec, _ = algorithm_codec(hook_algorithm(name, **({"k": 1} if "k" in cls.options else {})))
        rows.append((name, wire_method(codec), _first_sentence(cls)))
    return rows + [(name, wire_method(factory()), desc) for name, (factory, desc) in HOOKS.items()]
