"""The kernel families' interfaces: one :class:`typing.Protocol` per family, and :data:`FAMILIES`,
the table the dispatch (:mod:`lowbit.codecs.kernels`) reads.

A family is the set of torch-level functions that the codecs of one kind call on their
fast path. It is named after the codec module that calls it (``qsgd`` for
:mod:`lowbit.codecs.qsgd`, ``modulo`` for :mod:`lowbit.codecs.modulo`, ...), except
``core``: the bit packing and statistics every codec shares. Each family has a CPU
module ``cpu_<family>`` (numba) and a GPU module ``gpu_<family>`` (Triton; ``cpu``/``gpu``
for the core), and both give the same functions with the same arguments. Where the CPU
side has more (a CPU-only path, which on CUDA takes the reference), the family says so:
its ``cpu`` Protocol extends the shared one, and ``cpu_only`` names each extra with the
reason; a family with no GPU module at all says why in ``no_gpu``.
``tests/test_kernel_families.py`` checks every module against its Protocol, the two sides
against each other, and each module's ``__all__`` against the Protocol.

Usage: ``kernels_for(x, "qsgd")`` returns the module for ``x``'s device, which conforms
to ``FAMILIES["qsgd"].cpu`` on the CPU and ``FAMILIES["qsgd"].common`` on CUDA::

    K = kernels_for(x, "qsgd")
    if K is None:          # no fast path here: the reference
        ...
    codes = K.qsgd_encode(x, factor, bucket, levels, bits, key)

A new family: a Protocol here, an entry in :data:`FAMILIES`, and its two modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Family", "FAMILIES", "protocol_members", "CoreKernels", "CpuCoreKernels", "ModuloKernels",
           "DitheredKernels", "NestedKernels", "QSGDKernels", "MinMaxKernels", "UniformKernels", "SignKernels",
           "TernGradKernels", "MaxNormKernels", "CpuMaxNormKernels", "RandKKernels", "RadixKernels",
           "LanesKernels", "LowpKernels"]

Tensor = torch.Tensor


@runtime_checkable
class CoreKernels(Protocol):
    """Bit packing (:mod:`lowbit.codecs.packing`'s layout) and one-pass statistics."""

    def pack(self, codes: Tensor, b: int) -> Tensor: ...
    def unpack(self, data: Tensor, b: int, n: int, dtype: torch.dtype = torch.uint8) -> Tensor: ...
    def stats(self, x: Tensor) -> tuple: ...


@runtime_checkable
class CpuCoreKernels(CoreKernels, Protocol):
    """The core on the CPU: also the checks that are cheaper as one numba call than as torch
    reductions on small CPU tensors."""

    def within(self, a: Tensor, split: int, head_lim: float, tail_lim: float) -> bool: ...
    def max_abs(self, x: Tensor) -> float: ...


@runtime_checkable
class ModuloKernels(Protocol):
    """Moniqua's modulo codec (eq. (5)) and its verified exchange, one call per message."""

    def pack(self, codes: Tensor, b: int) -> Tensor: ...
    def unpack(self, data: Tensor, b: int, n: int, dtype: torch.dtype = torch.uint8) -> Tensor: ...
    def modulo_encode(self, x: Tensor, B: float, levels: int, stochastic: bool, key: int) -> Tensor: ...
    def modulo_decode(self, codes: Tensor, B: float, levels: int, ref: Tensor) -> Tensor: ...
    def modulo_decode_hash(self, data: Tensor, bits: int, n: int, B: float, levels: int, ref: Tensor,
                           block: int) -> tuple[Tensor, Tensor]: ...
    def moniqua_send(self, x: Tensor, B: float, levels: int, stochastic: bool, key: int, bits: int, block: int,
                     msg: Tensor, hash_at: int, ctrl: int, xhat: Tensor) -> None: ...
    def moniqua_receive(self, msg: Tensor, bits: int, B: float, levels: int, y: Tensor, block: int, xh: Tensor,
                        v: Tensor | None, xhat_i: Tensor, w: float, delta: Tensor) -> Any: ...
    def to_host(self, found: list) -> list: ...


@runtime_checkable
class _DitherScalars(Protocol):
    """What the dithered codecs share: the code dtype, and scalars read back in one go."""

    def code_dtype(self, b: int) -> torch.dtype: ...
    def host_values(self, *values) -> tuple: ...
    def ratio(self, num: float, den: Tensor) -> Tensor: ...


@runtime_checkable
class DitheredKernels(_DitherScalars, Protocol):
    """DQSG (:class:`lowbit.codecs.DitheredCodec`): per-part scales, dithered codes."""

    def dithered_scales(self, x: Tensor, parts: int) -> tuple: ...
    def dithered_encode(self, x: Tensor, factor: Tensor, levels: int, bits: int, key: int) -> Tensor: ...
    def dithered_decode(self, codes: Tensor, step: Tensor, levels: int, subtractive: bool, key: int,
                        dtype: torch.dtype) -> Tensor: ...


@runtime_checkable
class NestedKernels(Protocol):
    """NDQSG (:class:`lowbit.codecs.NestedDitheredCodec`): nested lattices decoded against ``y``."""

    def code_dtype(self, b: int) -> torch.dtype: ...
    def index_limit(self, dtype: torch.dtype) -> float: ...
    def nested_encode(self, x: Tensor, alpha: float, delta1: float, k: int, bits: int, key: int) -> tuple: ...
    def nested_decode(self, codes: Tensor, y: Tensor, alpha: float, delta1: float, delta2: float,
                      key: int) -> Tensor: ...


@runtime_checkable
class QSGDKernels(_DitherScalars, Protocol):
    """QSGD (:class:`lowbit.codecs.QSGDCodec`): per-bucket norms and stochastic levels."""

    def qsgd_sumsq(self, x: Tensor, bucket: int) -> tuple: ...
    def qsgd_encode(self, x: Tensor, factor: Tensor, bucket: int, levels: int, bits: int, key: int) -> Tensor: ...
    def qsgd_decode(self, codes: Tensor, step: Tensor, bucket: int, levels: int, dtype: torch.dtype) -> Tensor: ...


@runtime_checkable
class MinMaxKernels(Protocol):
    """Min-max (Bagua's) quantization, :class:`lowbit.codecs.MinMaxCodec`."""

    def minmax_range(self, x: Tensor) -> tuple[float, float, bool]: ...
    def minmax_encode(self, x: Tensor, lo: float, scale: float, bits: int, stochastic: bool, key: int) -> Tensor: ...
    def minmax_decode(self, data: Tensor, bits: int, n: int, lo: float, scale: float,
                      dtype: torch.dtype) -> Tensor: ...


@runtime_checkable
class UniformKernels(Protocol):
    """The uniform grid ``{step n}``, :class:`lowbit.codecs.UniformCodec`."""

    def uniform_codes(self, x: Tensor, step: float, stochastic: bool, key: int) -> tuple: ...
    def uniform_pack(self, codes: Tensor, shift: int, b: int) -> Tensor: ...
    def uniform_decode(self, data: Tensor, b: int, n: int, offset: int, step: float, dtype: torch.dtype) -> Tensor: ...


@runtime_checkable
class SignKernels(Protocol):
    """1-bit SGD and signSGD, :class:`lowbit.codecs.SignCodec`."""

    def sign_encode(self, x: Tensor, order: int) -> tuple[Tensor, float, bool]: ...
    def sign_decode(self, data: Tensor, n: int, c: float, dtype: torch.dtype) -> Tensor: ...


@runtime_checkable
class TernGradKernels(Protocol):
    """TernGrad, :class:`lowbit.codecs.TernGradCodec`."""

    def terngrad_max_abs(self, x: Tensor) -> tuple[float, bool]: ...
    def terngrad_encode(self, x: Tensor, scale: float, key: int) -> Tensor: ...
    def terngrad_decode(self, data: Tensor, n: int, scale: float, dtype: torch.dtype) -> tuple[Tensor, bool]: ...


@runtime_checkable
class MaxNormKernels(Protocol):
    """QSGDMaxNorm and its multi-scale variant (:mod:`lowbit.codecs.maxnorm`). Encodes return
    ``(codes, flags)``: the ``FLAG_*`` bits, an int on the CPU, a device tensor on CUDA."""

    FLAG_NONFINITE: int
    FLAG_OVER: int
    FLAG_INDEX: int
    FLAG_LEVEL: int

    def as_scale(self, W: float, x: Tensor) -> Tensor: ...
    def norm_stats(self, x: Tensor) -> tuple[float, float, bool]: ...
    def code_dtype(self, bits: int) -> torch.dtype: ...
    def qsgd_encode(self, x: Tensor, W, levels: int, offset: int, key: int, dtype: torch.dtype) -> tuple: ...
    def qsgd_decode(self, codes: Tensor, offset: int, W, levels: int, m: int, dtype: torch.dtype) -> Tensor: ...
    def ms_index(self, x: Tensor, W, levels: Tensor) -> tuple: ...
    def ms_encode_int(self, x: Tensor, W, levels: Tensor, idx: Tensor, key: int,
                      dtype: torch.dtype = torch.int64) -> tuple: ...
    def ms_encode_words(self, x: Tensor, W, levels: Tensor, code_bits: int, key: int, dtype: torch.dtype) -> tuple: ...
    def ms_decode_sum(self, codes: Tensor, idx: Tensor, W, levels: Tensor, m: int, dtype: torch.dtype) -> tuple: ...
    def ms_decode_words(self, words: Tensor, code_bits: int, W, levels: Tensor, dtype: torch.dtype) -> tuple: ...


@runtime_checkable
class CpuMaxNormKernels(MaxNormKernels, Protocol):
    """Max-norm on the CPU: also the bucketed variant (one norm per bucket)."""

    def bucket_norms(self, x: Tensor, bucket: int, linf: bool) -> tuple[Tensor, bool]: ...
    def qsgd_encode_buckets(self, x: Tensor, W: Tensor, bucket: int, levels: int, offset: int, key: int,
                            dtype: torch.dtype) -> tuple: ...
    def qsgd_decode_buckets(self, codes: Tensor, offset: int, W: Tensor, bucket: int, levels: int, m: int,
                            dtype: torch.dtype) -> Tensor: ...


@runtime_checkable
class RandKKernels(Protocol):
    """Random-k (:mod:`lowbit.codecs.randk`): the keyed selection and the decode's scatter."""

    def select(self, d: int, k: int, a: int, hb: int, round_keys, dense: bool, device=None,
               x: Tensor | None = None): ...
    def scatter(self, vals: Tensor, idx: Tensor, n: int, factor: float, dtype: torch.dtype) -> tuple[Tensor, bool]: ...


@runtime_checkable
class RadixKernels(Protocol):
    """Radix packing of ``L``-level symbols, ``g`` to a group of ``b`` bytes (:mod:`lowbit.codecs.radix`)."""

    def pack(self, codes: Tensor, L: int, g: int, b: int) -> Tensor: ...
    def unpack(self, data: Tensor, L: int, g: int, b: int, n: int, dtype: torch.dtype = torch.uint8) -> tuple: ...


@runtime_checkable
class LanesKernels(Protocol):
    """Lane packing of ``k``-bit codes into ``R``-bit words (:mod:`lowbit.codecs.lanes`)."""

    def pack(self, codes: Tensor, R: int, k: int) -> Tensor: ...
    def unpack(self, words: Tensor, R: int, k: int, n: int, dtype: torch.dtype) -> tuple[Tensor, int]: ...


@runtime_checkable
class LowpKernels(Protocol):
    """fp16/bf16 casts with the overflow check in the same pass (:mod:`lowbit.codecs.lowp`)."""

    def half_encode(self, x: Tensor, dtype: torch.dtype, divisor: int | None = None,
                    check: bool = True) -> tuple[Tensor, bool]: ...
    def half_decode(self, h: Tensor, out: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class Family:
    """One kernel family: ``common``, the Protocol both sides conform to; ``cpu``, the CPU
    side's (``common`` or a Protocol extending it); ``cpu_only``, each function of ``cpu``
    beyond ``common`` with the reason the GPU side lacks it; ``no_gpu``, the reason when the
    family has no GPU module at all (then empty ``cpu_only``)."""

    common: type
    cpu: type
    cpu_only: dict[str, str] = field(default_factory=dict)
    no_gpu: str = ""

    def module_name(self, name: str, backend: str) -> str | None:
        """The module of family ``name`` for ``backend`` ("numba" or "triton"), None when none."""
        if backend == "triton" and self.no_gpu:
            return None
        prefix = "cpu" if backend == "numba" else "gpu"
        return prefix if name == "core" else f"{prefix}_{name}"


def _same(p: type) -> Family:
    return Family(common=p, cpu=p)


#: family name -> :class:`Family`. The names are the codec modules that call them.
FAMILIES: dict[str, Family] = {
    "core": Family(CoreKernels, CpuCoreKernels, cpu_only={
        "within": "PowerSGD's frame check of a few thousand factor values, called with cpu_kernels() on the "
                  "host copy it decodes from",
        "max_abs": "random-k's range check; on CUDA torch's abs().max() is one kernel already"}),
    "modulo": _same(ModuloKernels),
    "dithered": _same(DitheredKernels),
    "nested": _same(NestedKernels),
    "qsgd": _same(QSGDKernels),
    "minmax": _same(MinMaxKernels),
    "uniform": _same(UniformKernels),
    "sign": _same(SignKernels),
    "terngrad": _same(TernGradKernels),
    "maxnorm": Family(MaxNormKernels, CpuMaxNormKernels, cpu_only={
        name: "the bucketed max-norm (one norm per bucket) has no Triton kernel: on CUDA it takes the reference"
        for name in ("bucket_norms", "qsgd_encode_buckets", "qsgd_decode_buckets")}),
    "randk": _same(RandKKernels),
    "radix": _same(RadixKernels),
    "lanes": Family(LanesKernels, LanesKernels, no_gpu="lane packing has no Triton kernel: on CUDA the lanes "
                    "codec packs with the torch reference"),
    "lowp": _same(LowpKernels),
}


def protocol_members(proto: type) -> set[str]:
    """The names a Protocol requires (its methods and annotated attributes, inherited ones too)."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {k for k, v in vars(cls).items() if callable(v) and not k.startswith("_")}
        names |= {k for k in getattr(cls, "__annotations__", {}) if not k.startswith("_")}
    return names
