"""The hook's state (:class:`LowbitHookState`), how a codec travels (:func:`wire_method`) and
the helpers every wire family shares."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...algorithms.base import Algorithm
from ...codecs import codec_names
from ...codecs.base import Codec, is_summable
from ...codecs.identity import IdentityCodec
from ...codecs.powersgd import PowerSGDCodec
from ...codecs.randk import RandKCodec
from ...codecs.rng import shared_generator
from ...codecs.sign import SignCodec
from ...codecs.terngrad import TernGradCodec

#: ``stream`` of :func:`derive_seed` for the hooks' per-rank randomness (plus the bucket index).
HOOK_STREAM = 0x484F4F4B << 20  # "HOOK"

#: :func:`make_hook`'s default ``bucket``: the QSGD codec and the single-scale max-norm codec
#: quantize buckets of this many consecutive coordinates with one norm each (the QSGD paper's
#: d = 512; one norm for a whole DDP bucket of n coordinates gives a variance ~ sqrt(n) / s times
#: the gradient's, which stalled training at 4 bits)
HOOK_BUCKET = 512

#: :func:`make_hook`'s default ``clip`` for TernGrad: each layer's gradient is clipped at
#: ``2.5`` standard deviations before it is ternarized (the TernGrad paper's c = 2.5, section 3.3)
HOOK_CLIP = 2.5

#: ``LowbitHookState(nonfinite=...)``: what the half-precision hooks do with an inf, NaN or overflow
NONFINITE = ("raise", "propagate")

#: the counters :meth:`LowbitHookState.state_dict` saves
STATE_COUNTERS = ("step", "bytes_sent", "messages", "fp32_bytes_sent", "last_step_bytes", "memory_resets",
                  "powersgd_resets")

#: :meth:`LowbitHookState.state_dict`'s ``format`` (1: LowbitStrategy's files before the layout and settings)
STATE_FORMAT = 2

WIRE_METHODS = ("allreduce-float", "allreduce-int", "allreduce-randk", "allgather", "powersgd", "algorithm")



def hook_codec_names() -> tuple[str, ...]:
    """The registry's codecs that travel in a DDP hook (:func:`wire_method`): from their declared
    capabilities (float wire, summable, gatherable), and PowerSGD (its own method)."""
    return tuple(n for n in codec_names() if n in codec_names(float_wire=True) + codec_names(summable=True)
                 + codec_names(gatherable=True) + (PowerSGDCodec.name,))


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
    if codec.float_wire:
        return "allreduce-float"
    if isinstance(codec, PowerSGDCodec):
        return "powersgd"
    if isinstance(codec, RandKCodec):
        if codec.send_indices:
            if not (codec.inner.gatherable or codec.inner.float_wire):
                raise ValueError(f"codec: RandK with send_indices needs a fixed-size inner codec, got "
                                 f"{type(codec.inner).__name__}")
            return "allgather"
        if not (is_summable(codec.inner) or codec.inner.gatherable or codec.inner.float_wire):
            raise ValueError(f"codec: the inner codec of a global RandK must be summable, a float wire or gatherable "
                             f"(one of {', '.join(hook_codec_names())}), got {type(codec.inner).__name__}")
        return "allreduce-randk"
    if is_summable(codec):
        return "allreduce-int"
    if codec.gatherable:
        return "allgather"
    raise ValueError(
        f"codec {type(codec).__name__} (kind {codec.kind.value}) has no DDP hook: supported are "
        f"{', '.join(hook_codec_names())} (a hook needs a float wire, summable codes, or payloads of one size "
        "to all-gather: side-information codecs need a receiver reference; entropy-coded payloads vary in size)"
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
    algorithm's own step on each bucket over the state's process group, one algorithm state
    per bucket (``"algorithm"``; :func:`make_hook` does this for NDQSG, whose two groups no
    codec path carries). ``sum_dtype`` (the integer dtype of a summable code sum, default the
    narrowest that cannot overflow) and ``kept`` (GlobalRandK's kept fraction of each bucket,
    below 1; the codec's ``k`` is then replaced per bucket) are what :func:`make_hook` takes
    from a max-norm algorithm.

    ``nonfinite``: what the fp16 and bf16 hooks do with a bucket that does not cast to finite
    16-bit values (an inf or NaN gradient, or an fp16 overflow). ``"raise"`` (the default):
    the codec's clear ValueError, as everywhere in lowbit. ``"propagate"``: the cast of
    torch's ``fp16_compress_hook`` / ``bf16_compress_hook``, unchecked, so the inf or NaN
    reaches every rank's average and ``torch.amp.GradScaler`` skips the step and lowers its
    scale (no check, hence no host read on CUDA either). Only the float hooks (fp32, fp16,
    bf16), without error memory, can propagate: a quantized code has no inf or NaN, and error
    memory would keep one for good. The fp32 hook sends what it is given either way.

    ``per_layer``: the all-gathered codecs code each parameter's gradient in a bucket as its
    own message (its own scale: TernGrad's layer-wise scaling). None picks the default: True
    for TernGrad, False otherwise; True needs an all-gathered codec without decode-side dither
    (not RandK, not subtractive dither).

    Mixed precision. The fp16 and bf16 hooks refuse a bucket that does not cast to finite
    16-bit values (an inf or NaN gradient, or an fp16 overflow) with a clear ValueError. Under
    ``torch.amp.GradScaler`` such a gradient is expected (the scaler skips the step and lowers
    its scale): ``make_hook("fp16", nonfinite="propagate")`` casts as torch's
    ``fp16_compress_hook`` does, unchecked, so the inf or NaN reaches every rank's average and
    the scaler sees it (:class:`LowbitHookState`; the quantized hooks, whose codes have no inf
    or NaN, refuse the option).

    Randomness. Rank ``r``'s stochastic rounding / dither for bucket ``b`` at step ``k``
    comes from ``shared_generator(seed, k, r, HOOK_STREAM + b)``; ``seed`` must be the
    same on every rank. The step counter ``state.step`` advances once per iteration,
    when the hook has processed the bucket with ``bucket.is_last()``.

    Error feedback (``error_feedback=True``; the default for the biased sign and
    PowerSGD codecs, False for the others): rank ``m`` compresses
    ``x_m = g_m + e_m`` and keeps ``e_m <- x_m - D(C(x_m))``, where ``D(C(x_m))`` is its
    own contribution to the average (for PowerSGD, ``P Q_m^T`` with its own ``Q_m``, and
    its own vectors as sent in float32). The memory is kept in the bucket's dtype (as
    torch's PowerSGD hook keeps it; a float64 memory of an older checkpoint is cast).
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

    Bytes. ``state.bytes_sent`` and ``state.messages`` count what this rank puts on the
    wire, read from the transport's ledger (:meth:`~lowbit.comm.ledger.Ledger.drain`, after
    each bucket), which counts as for every algorithm
    (:func:`lowbit.comm.netmodel.op_messages_and_bytes`: an all-reduce of ``m`` bytes as the
    ring's ``2(n-1)/n * m``, an all-gather of ``m`` bytes per rank as ``(n-1) m``).
    ``state.fp32_bytes_sent`` counts what plain fp32 all-reduce of the same buckets would
    have sent; ``state.last_step_bytes`` is the latest complete iteration's total and
    ``state.bucket_bytes[b]`` the latest bytes of bucket ``b``.

    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (tensors and plain values: saves
    with ``torch.save`` and loads with ``weights_only=True``) carry the step, the counters, the
    error memory, PowerSGD's warm start and the bucket layout. The layout matters because
    randomness, per-bucket memory, PowerSGD's ``Q`` and the quantizer's 512-coordinate blocks
    follow it, and DDP starts a fresh model with one bucket in parameter order and rebuilds it
    in gradient order after the first iteration. When the state knows the model
    (:meth:`bind_model`), it records each bucket's parameter names (``state.bucket_layout``), and after
    :meth:`load_state_dict` the first step runs the saved buckets (index, order) out of the fresh
    one (:mod:`.replay`), so a restored run continues exactly, bit for bit. Without a bound
    model the first restored step follows the fresh layout and differs.

    Pickling: the state pickles without its process group (restored as the default group, or
    set ``state.process_group`` again), without its transport and without the parameter-identity
    map (call :meth:`LowbitHookState.bind_model` with the new model after unpickling).
    """

    def __init__(self, codec: Codec | Algorithm, process_group=None, seed: int = 0,
                 error_feedback: bool | None = None, model: torch.nn.Module | None = None, *,
                 sum_dtype: torch.dtype | None = None, kept: float | None = None,
                 nonfinite: str = "raise", per_layer: bool | None = None) -> None:
        self.method = wire_method(codec)
        if per_layer is None:
            per_layer = isinstance(codec, TernGradCodec)
        if not isinstance(per_layer, bool):
            raise ValueError(f"per_layer must be a bool or None, got {per_layer!r}")
        if per_layer and (self.method != "allgather" or isinstance(codec, RandKCodec) or codec.dither_on_decode):
            raise ValueError(f"per_layer=True is for the all-gathered codecs without decode-side dither (terngrad, "
                             f"qsgd, sign, min-max, uniform), got {type(codec).__name__} ({self.method})")
        if self.method == "algorithm" and error_feedback:
            raise ValueError(f"error_feedback: algorithm {codec.name!r} keeps its own memory, if any")
        if kept is not None:
            if not (isinstance(codec, RandKCodec) and 0 < kept < 1):
                raise ValueError(f"kept (a fraction in (0, 1) of each bucket) is for a global RandK codec, "
                                 f"got {kept!r} with {type(codec).__name__}")
        if sum_dtype == torch.int16:
            raise ValueError("sum_dtype=int16: neither gloo nor NCCL all-reduces int16 (it would travel as int32); "
                             "valid: int8, int32, int64, or None for the narrowest that cannot overflow (in summable "
                             "lanes where those are smaller)")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if error_feedback is None:
            error_feedback = isinstance(codec, (SignCodec, PowerSGDCodec))
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool or None, got {error_feedback!r}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        if nonfinite == "propagate" and (self.method != "allreduce-float" or error_feedback):
            raise ValueError("nonfinite='propagate' is for the fp32, fp16 and bf16 hooks without error memory "
                             f"(a quantized code has no inf or NaN; error memory would keep one), got "
                             f"{type(codec).__name__} ({self.method}), error_feedback={error_feedback}")
        self.codec = codec
        self.process_group = process_group
        self.seed = seed
        self.error_feedback = error_feedback
        self.nonfinite = nonfinite
        self.per_layer = per_layer
        self.step = 0
        self.bytes_sent = 0
        self.messages = 0
        self.fp32_bytes_sent = 0
        self.last_step_bytes = 0
        self.bucket_bytes: dict[int, int] = {}
        self.bucket_numel: dict[int, int] = {}
        self.memory_resets = 0
        self.powersgd_resets = 0
        self.saves_nothing_warned = False
        self._step_bytes = 0
        # error memory: per bucket {index: (signature, tensor)} or per parameter {name: tensor}
        self.bucket_memory: dict[int, tuple[tuple, torch.Tensor]] = {}
        self.param_memory: dict[str, torch.Tensor] = {}
        self.per_parameter = False
        self.powersgd_q: dict[int, tuple[tuple, torch.Tensor]] = {}
        self.sum_dtype = sum_dtype
        self.kept = kept
        self.algorithm_states: dict[int, tuple[tuple, Any]] = {}  # "algorithm": per bucket
        self._transport = None  # the process group's transport, made at the first bucket
        self._param_names: dict[int, str] | None = None
        self.bucket_layout: dict[int, tuple[str, ...]] = {}  # each bucket's parameter names (bound model)
        self._replay: dict[int, tuple[str, ...]] | None = None  # a restored layout, for the first step
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
        d.setdefault("nonfinite", "raise")  # a state pickled before the option
        d.setdefault("per_layer", False)
        d.setdefault("saves_nothing_warned", False)
        d.setdefault("bucket_layout", {})
        d.setdefault("_replay", None)
        self.__dict__.update(d)

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a resumed run needs, as tensors and plain values (``torch.save``; loads with
        ``weights_only=True``): the step and counters (:data:`STATE_COUNTERS`), the error
        memory, PowerSGD's warm-start ``Q``, the bucket layout, and the settings it must be
        restored into (method, seed, error feedback). A hook that runs an algorithm per bucket
        (NDQSG) keeps state it cannot save: RuntimeError."""
        if self.algorithm_states:
            raise RuntimeError(f"the {self.codec.name} hook keeps per-bucket algorithm state that has no "
                               "state_dict; checkpoint its run by pickling the state")

        def entries(d: dict) -> dict:
            return {int(i): [list(map(list, sig)), t] for i, (sig, t) in d.items()}

        return {"format": STATE_FORMAT, "method": self.method, "seed": self.seed,
                "error_feedback": self.error_feedback, **{k: int(getattr(self, k)) for k in STATE_COUNTERS},
                "param_memory": dict(self.param_memory), "bucket_memory": entries(self.bucket_memory),
                "powersgd_q": entries(self.powersgd_q),
                "bucket_layout": {int(i): list(names) for i, names in self.bucket_layout.items()}}

    def load_state_dict(self, saved: dict) -> None:
        """Restore what :meth:`state_dict` returned into this state (the same hook: method,
        seed and error feedback must match; ValueError otherwise). The next step runs the saved
        bucket layout when the state knows the model (see the class docstring)."""
        if not isinstance(saved, dict):
            raise ValueError(f"saved must be a dict from LowbitHookState.state_dict, got {type(saved).__name__}")
        missing = [k for k in (*STATE_COUNTERS, "param_memory", "bucket_memory", "powersgd_q") if k not in saved]
        if missing:
            raise ValueError(f"not a LowbitHookState.state_dict (missing {', '.join(missing)})")
        for key in ("method", "seed", "error_feedback"):  # format 1 (LowbitStrategy's first files) has none
            if key in saved and saved[key] != getattr(self, key):
                raise ValueError(f"the saved hook state has {key}={saved[key]!r}, this state {getattr(self, key)!r}: "
                                 "restore it into a state built with the same hook options")

        if saved["param_memory"] and not self.per_parameter:
            raise ValueError("the saved error memory is per parameter: call state.bind_model(model) before "
                             "load_state_dict")

        def entries(d: dict) -> dict:
            return {int(i): (tuple(tuple(s) for s in sig), t) for i, (sig, t) in d.items()}

        for k in STATE_COUNTERS:
            setattr(self, k, int(saved[k]))
        self.param_memory = dict(saved["param_memory"])
        self.bucket_memory = entries(saved["bucket_memory"])
        self.powersgd_q = entries(saved["powersgd_q"])
        self.bucket_layout = {int(i): tuple(names) for i, names in saved.get("bucket_layout", {}).items()}
        self._replay = dict(self.bucket_layout) or None

    # --- helpers used by the hook ---------------------------------------------------------

    def _comm(self):
        """The transport over the state's process group (made at the first bucket, and again
        when ``process_group`` is changed): every family communicates through it."""
        t = self._transport
        if t is None or t.group is not self.process_group:
            from ...comm.distributed import TorchDistributedTransport

            t = self._transport = TorchDistributedTransport(process_group=self.process_group)
        return t

    def _drain(self, t, bucket: int) -> None:
        """Move what the transport's ledger recorded for this bucket into the counters."""
        for rec in t.ledger.drain():
            self.bytes_sent += rec.sent_bytes
            self.messages += rec.messages
            self._step_bytes += rec.sent_bytes
            self.bucket_bytes[bucket] = self.bucket_bytes.get(bucket, 0) + rec.sent_bytes

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
        """The bucket's error memory (zeros where there is none), in the bucket's dtype (as
        torch's PowerSGD hook keeps it; a float64 memory of an older checkpoint is cast)."""
        n = buf.numel()
        idx = bucket.index()
        if self.per_parameter:
            mem = torch.zeros(n, dtype=buf.dtype, device=buf.device)
            for name, (off, size) in zip(self._names(bucket), _offsets(bucket)):
                e = self.param_memory.get(name)
                if e is not None and e.numel() == size:
                    mem[off:off + size] = e.to(mem.device)
            return mem
        sig = _signature(bucket)
        entry = self.bucket_memory.get(idx)
        if entry is not None and entry[0] == sig:
            return entry[1].to(device=buf.device, dtype=buf.dtype)
        if entry is not None:
            self.memory_resets += 1
        return torch.zeros(n, dtype=buf.dtype, device=buf.device)

    def _store_memory(self, bucket_index: int, sig: tuple, layout, e: torch.Tensor) -> None:
        """Keep ``e``, the memory :meth:`_load_memory` returned, updated in place: as the
        bucket's (the tensor itself), or each parameter's slice (copied)."""
        if self.per_parameter:
            for name, (off, size) in layout:
                self.param_memory[name] = e[off:off + size].clone()
        else:
            self.bucket_memory[bucket_index] = (sig, e)

    def _check_saving(self, bucket: int, fp32_sent: int, world: int) -> None:
        """Warn once when a compressing hook sent a bucket in as many bytes as plain fp32 would."""
        sent = self.bucket_bytes.get(bucket, 0)
        if self.saves_nothing_warned or self.method in ("allreduce-float", "algorithm") or not 0 < fp32_sent <= sent:
            return
        self.saves_nothing_warned = True
        why = {"allgather": f"an all-gather sends the {world - 1} other ranks' payloads whole, where the fp32 "
                            f"all-reduce's ring sends 2(N-1)/N of the bucket",
               "powersgd": "the rank-r factors of these shapes are as large as the matrices"}.get(
            self.method, f"the sum of {world} ranks' integer codes needs as many bits per element as a float32")
        warnings.warn(f"{self.codec!r} sent {sent} bytes for a bucket of {self.bucket_numel.get(bucket)} elements, "
                      f"as many as fp32 (which sends {fp32_sent}): it saves nothing here, since {why}; use fewer "
                      f"bits (or the fp16 hook)", RuntimeWarning, stacklevel=3)

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


def _layer_sizes(bucket, n: int) -> list[int]:
    """The element counts of the bucket's parameters' gradients in buffer order, which tile the
    bucket's ``n`` elements (ValueError otherwise: no layer-wise coding of a gapped bucket)."""
    spans = sorted(_offsets(bucket))
    at = 0
    for off, size in spans:
        if off != at:
            raise ValueError(f"per_layer: the bucket's gradients do not tile its buffer (a gradient at {off}, "
                             f"expected {at}); use per_layer=False")
        at += size
    if at != n:
        raise ValueError(f"per_layer: the bucket's gradients cover {at} of its {n} elements; use per_layer=False")
    return [size for _, size in spans]
