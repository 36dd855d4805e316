"""Random-k sparsification around an inner codec (paper 004, sections 3.3-3.4:
GlobalRandKMaxNorm and GlobalRandKMaxNormMultiScale).

``k`` of the ``d`` coordinates are kept (``min(k, d)`` when ``d < k``), chosen
without replacement by :meth:`RandKCodec.indices` from a seed: the kept set is
``{i < d : sigma(i) < k}`` (returned sorted), where ``sigma`` is a keyed
pseudo-random permutation of ``[0, d)`` (see "Selection" below). The inner codec encodes the ``k`` kept values; decoding
scatters them back (zeros elsewhere) and, with ``rescale=True``, multiplies by
``d / k`` so that the result is unbiased when the inner codec is.

GlobalRandK (``send_indices=False``, the paper's scheme): every worker uses the
same seed for a step (``codec.with_seed(global_index_seed(run_seed, step))``),
so every worker keeps the same coordinates and the indices are NOT sent: the
header carries the 8-byte seed (``<iq``: numel, seed, then the inner header)
from which a receiver regenerates them. If the codec has no seed, ``encode``
draws one from ``generator`` (a per-worker selection, still only 8 bytes).
With a summable inner codec and a seed, the random-k codec is summable: the
scale protocol of the inner codec runs on the ``k`` kept values, the integer
codes (``k`` of them) are summed, and ``decode_sum(..., numel=d)`` scatters
and rescales the average.

Per-worker RandK with explicit indices (``send_indices=True``): the data starts
with the ``k`` indices packed in ``max(1, ceil(log2 d))`` bits each (counted
in ``nbytes``), then the inner data; header ``<i`` (numel) + inner header.
Workers keep different coordinates, so this form is never summable.

Selection. ``sigma`` is a Feistel network with cycle walking, computed with
integer arithmetic only, so a selection depends on (d, k, seed) alone: the same
on every device, thread count, code path and torch version, and it never
materialises a permutation of ``d`` elements. With ``hb = ceil(bitlen(d-1)/2)``
and ``a = ceil(d / 2^hb)``, a value ``v < a 2^hb`` is split as
``v = L 2^hb + R``; :data:`FEISTEL_ROUNDS` (even) rounds alternate
``(L, R) -> (R, (L + F_r(R)) mod a)`` and ``(L, R) -> (R, (L + F_r(R)) mod 2^hb)``
(:data:`FEISTEL_ROUNDS`, or :data:`FEISTEL_ROUNDS_SMALL` for ``d <= 2^14``)
with ``F_r(R) = mix32(R XOR K_r)`` reduced to the modulus by multiply-shift
(``mod a``) or by its top bits (``mod 2^hb``), and round keys ``K_r`` the
counter hashes of ``r`` under the seed (:func:`lowbit.codecs.rng.counter_hash`).
That is a bijection of ``[0, a 2^hb)``, a domain at most ``2^hb - 1 < 2 sqrt(d) + 1``
larger than ``d``; cycle walking (apply it again while the value is ``>= d``)
restricts it to a bijection of ``[0, d)``, so the kept set has exactly
``min(k, d)`` distinct elements, each coordinate kept with probability ``k / d``
over seeds (tested). The fast path runs on the data's device. On the CPU
(numba) it evaluates ``sigma^-1`` on ``j < k`` and sorts when ``k`` is small
against ``d`` (``O(k log k)``, :mod:`lowbit.codecs.kernels.cpu_randk`), else
tests ``sigma(i) < k`` for every ``i`` in one pass, already sorted, in 32-bit
vector lanes (:mod:`lowbit.codecs.kernels.cpu_randk`). On CUDA a Triton kernel
tests every ``i`` and counts each block's kept indices, and a second writes them at the
block's offset in the prefix sum of the counts (:mod:`lowbit.codecs.kernels.gpu_randk`;
no copy from the CPU, no host synchronisation). :func:`select_reference` (:meth:`RandKCodec.indices_reference`)
is the plain-torch version of the one-pass definition; every path gives its
indices exactly (integer arithmetic only). (Earlier versions used ``torch.randperm``: the wire format
is unchanged, but a seed now selects a different set.)
"""

from __future__ import annotations

import dataclasses
import collections
import functools
import threading
import inspect
from dataclasses import dataclass

import torch

from .base import (
    Codec,
    CodecKind,
    Payload,
    PayloadError,
    SummableCodec,
    check_flat,
    frame_count,
    frame_header,
    header_size,
    is_summable,
    pack_header,
)
from .kernels import kernels_for
from .packing import pack_wide, packed_nbytes, unpack_wide
from .quantize import INT32_MAX, check_int_range, check_numel
from .rng import counter_hash, derive_seed, mix32

__all__ = ["RandKCodec", "global_index_seed", "GLOBAL_RANDK_STREAM", "FEISTEL_ROUNDS", "feistel_params",
           "round_keys", "select_reference", "clear_selection_cache"]

#: Rounds of the selection's Feistel network (even: the halves end where they started):
#: 6 when the halves have >= 8 bits, 16 for smaller domains (halves of a few bits
#: leave few round functions; 6 rounds skew the subsets of d = 5 by ~25%, 16 by less
#: than the sampling noise of tests/test_fastpath_maxnorm.py).
FEISTEL_ROUNDS = 6
FEISTEL_ROUNDS_SMALL = 16
#: The fast path tests every coordinate (one pass) when ``k * SPARSE_RATIO >= d``, else
#: inverts the permutation on ``j < k`` and sorts.
SPARSE_RATIO = 8
_FAMILY = "randk"  # the scatter of the decode
_SELECT_FAMILY = "randk"

#: The ``stream`` of :func:`lowbit.codecs.rng.derive_seed` reserved for global random-k selections.
GLOBAL_RANDK_STREAM = 0x52414E444B  # "RANDK"
_SEED_MAX = 2**63 - 1
_F32_MAX = float(torch.finfo(torch.float32).max)


def global_index_seed(run_seed: int, step: int) -> int:
    """The selection seed every worker derives for ``step`` (sender-independent)."""
    return derive_seed(run_seed, step, 0, GLOBAL_RANDK_STREAM)


def feistel_params(d: int) -> tuple[int, int]:
    """``(a, hb)``: the Feistel domain ``[0, a 2^hb)`` for ``[0, d)``, ``d >= 1``."""
    hb = ((d - 1).bit_length() + 1) // 2
    return -(-d >> hb), hb


def round_keys(seed: int, d: int) -> torch.Tensor:
    """The round keys ``K_r`` (int64 holding uint32) for a domain of ``d``: counter hashes of
    ``r`` under ``seed``, :data:`FEISTEL_ROUNDS` of them (:data:`FEISTEL_ROUNDS_SMALL` when
    the halves have fewer than 8 bits)."""
    return counter_hash(seed, FEISTEL_ROUNDS if feistel_params(d)[1] >= 8 else FEISTEL_ROUNDS_SMALL)


def _feistel_torch(v: torch.Tensor, a: int, hb: int, keys: list[int]) -> torch.Tensor:
    bmask = (1 << hb) - 1
    L, R = v >> hb, v & bmask
    for r, key in enumerate(keys):
        h = mix32(R ^ key)
        if r % 2 == 0:
            t = L + ((h * a) >> 32)
            L, R = R, torch.where(t >= a, t - a, t)
        else:
            L, R = R, (L + (h >> (32 - hb))) & bmask
    return (L << hb) | R


def select_reference(d: int, k: int, seed: int) -> torch.Tensor:
    """The sorted kept indices ``{i < d : sigma(i) < k}`` (int64, CPU), in plain torch:
    the definition the fast path is checked against (see the module docstring)."""
    if k >= d:
        return torch.arange(d, dtype=torch.int64)
    a, hb = feistel_params(d)
    keys = [int(v) for v in round_keys(seed, d)]
    s = _feistel_torch(torch.arange(d, dtype=torch.int64), a, hb, keys)
    while True:  # cycle walking
        out = s >= d
        if not bool(out.any()):
            break
        s[out] = _feistel_torch(s[out], a, hb, keys)
    return torch.nonzero(s < k).view(-1)


def _selector(device: torch.device | str):
    """The kernel module that selects on ``device`` (numba on the CPU, Triton on CUDA), or
    None: take :func:`select_reference`."""
    return kernels_for(torch.empty(0, device=device), _SELECT_FAMILY)


_CACHE_SIZE = 2
_cache: collections.OrderedDict = collections.OrderedDict()
_cache_lock = threading.Lock()


def clear_selection_cache() -> None:
    """Forget the cached selections (see :func:`_select`)."""
    with _cache_lock:
        _cache.clear()


def _select(d: int, k: int, seed: int, device: torch.device, x: torch.Tensor | None = None):
    """The fast selection on ``device``, cached (the last :data:`_CACHE_SIZE`, shared by the
    process's threads): a global random-k step selects once per process for its encode and
    every decode of that step (read-only tensors). With ``x``: ``(indices, x's kept values)``,
    gathered in the selection's pass when the selection is computed here."""
    key = (d, k, seed, device)
    with _cache_lock:
        idx = _cache.get(key)
        if idx is not None:
            _cache.move_to_end(key)
    if idx is not None:
        return idx if x is None else (idx, x.index_select(0, idx))
    a, hb = feistel_params(d)
    keys = round_keys(seed, d).numpy().astype("uint64")
    got = _selector(device).select(d, k, a, hb, keys, k * SPARSE_RATIO >= d, device, x=x)
    idx = got if x is None else got[0]
    with _cache_lock:
        _cache[key] = idx
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return got


def _check_seed(seed, field: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _SEED_MAX:
        raise ValueError(f"{field} must be an int in 0..2^63-1, got {seed!r}")
    return seed


def _check_sent_indices(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``idx`` as a message carried it, checked: strictly increasing in ``[0, n)``, as every
    encode sends them (anything else would write outside the decoded vector, or twice to one
    coordinate). On CUDA the check reads one flag back to the host."""
    if idx.numel() and bool((idx[-1] >= n) | (idx[1:] <= idx[:-1]).any()):
        raise PayloadError("randk", f"sent indices strictly increasing and below numel={n}", "others",
                           f"malformed randk payload: the sent indices must be strictly increasing and below "
                           f"numel={n} (a malformed or corrupted RandK message)")
    return idx


@functools.lru_cache(maxsize=256)
def _accepts_kw_of(fn, name: str) -> bool:
    return _accepts_kw(fn, name)


def _inner_accepts(inner, name: str) -> bool:
    """Whether ``inner.decode`` takes the keyword ``name`` (its class's function, cached: a
    signature read costs more than a small decode's checks)."""
    fn = getattr(type(inner), "decode", None)
    return _accepts_kw_of(fn, name) if fn is not None else _accepts_kw(inner.decode, name)


def _accepts_kw(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@dataclass(frozen=True)
class RandKCodec(SummableCodec):
    """Keep ``k`` random coordinates, encode them with ``inner``; see the module docstring.

    ``kind`` is SUMMABLE when ``inner`` is summable and ``send_indices`` is False (the
    summable methods then need ``seed``, the same on every worker), PLAIN otherwise.
    ``unbiased`` when ``inner`` is and ``rescale`` is True. ``bits`` is nominal: the
    inner codec's bits per KEPT coordinate (plus 32 per index with ``send_indices``);
    ``payload.nbytes`` is the honest size.

    Range: the inner codec's, and with ``rescale`` the kept values times ``d / k`` must fit
    float32 (encode raises ValueError naming ``x`` beyond; a decode whose rescaled values
    would not fit its dtype raises a PayloadError, never returns inf). Decode checks the
    frame first: the header's size, its count against ``numel`` (without it, at most
    :data:`~lowbit.codecs.base.MAX_DECODE_NUMEL`: a 16-byte payload cannot announce 2^31
    elements), the seed, the sent indices, then the inner payload against ``min(k, numel)``.
    """

    inner: Codec
    k: int
    rescale: bool = True
    send_indices: bool = False
    seed: int | None = None

    name = "randk"
    kernel_family = _SELECT_FAMILY

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Codec):
            raise ValueError(f"inner must be a Codec, got {type(self.inner).__name__}")
        if self.inner.kind is CodecKind.SIDE_INFO:
            raise ValueError(f"inner must be a PLAIN or SUMMABLE codec, got {type(self.inner).__name__} "
                             "(side-information codecs need the receiver's reference)")
        object.__setattr__(self, "k", check_int_range(self.k, "k", 1, INT32_MAX))
        for field in ("rescale", "send_indices"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be a bool, got {getattr(self, field)!r}")
        if self.seed is not None:
            _check_seed(self.seed)

    # --- description -------------------------------------------------------------------

    @property
    def kind(self) -> CodecKind:  # type: ignore[override]
        return CodecKind.SUMMABLE if is_summable(self.inner) and not self.send_indices else CodecKind.PLAIN

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return bool(self.inner.unbiased) and self.rescale

    @property
    def bits(self) -> float:  # type: ignore[override]
        return self.inner.bits + (32 if self.send_indices else 0)

    @property
    def header_format(self) -> str:  # type: ignore[override]
        return ("i" if self.send_indices else "iq") + self.inner.header_format

    @property
    def _own_header(self) -> str:
        return "i" if self.send_indices else "iq"

    @property
    def dither_on_decode(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.inner, "dither_on_decode", False))

    @staticmethod
    def _draw_seed(generator: torch.Generator | None) -> int:
        """A per-message selection seed from ``generator`` (when the codec has none)."""
        device = generator.device if generator is not None else "cpu"
        return int(torch.randint(0, _SEED_MAX, (1,), generator=generator, device=device))

    def with_seed(self, seed: int) -> "RandKCodec":
        """The same codec with the selection seed fixed (e.g. ``global_index_seed(run_seed, step)``)."""
        return dataclasses.replace(self, seed=_check_seed(seed))

    def kept(self, numel: int) -> int:
        """How many coordinates are kept out of ``numel``: ``min(k, numel)``."""
        return min(self.k, numel)

    def indices(self, numel: int, seed: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """The sorted kept indices (int64) for a vector of ``numel`` elements and ``seed``
        (default: the codec's ``seed``)."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        seed = self._need_seed() if seed is None else _check_seed(seed)
        return self._indices(numel, seed, torch.device(device)).to(torch.int64, copy=True)

    def _indices(self, numel: int, seed: int, device: torch.device) -> torch.Tensor:
        """:meth:`indices` for the codec's own use (read-only: may be the cached tensor; int32
        or int64), selected on ``device`` itself."""
        return self._kept(numel, seed, device)

    def _kept(self, numel: int, seed: int, device: torch.device, x: torch.Tensor | None = None):
        """The kept indices (read-only), or with ``x`` ``(indices, x's kept values)``."""
        kk = self.kept(numel)
        if kk == numel or _selector(device) is None:
            idx = self.indices_reference(numel, seed, device)
            return idx if x is None else (idx, x.index_select(0, idx))
        return _select(numel, kk, seed, device, x)

    def indices_reference(self, numel: int, seed: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """:meth:`indices` by :func:`select_reference` (plain torch, one pass over ``[0, numel)``)."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        seed = self._need_seed() if seed is None else _check_seed(seed)
        return select_reference(numel, self.kept(numel), seed).to(device)

    def _need_seed(self) -> int:
        if self.seed is None:
            raise ValueError(
                "seed must be set for this RandKCodec call (the same on every worker for global random-k), "
                "e.g. codec.with_seed(global_index_seed(run_seed, step))"
            )
        return self.seed

    def _index_bits(self, numel: int) -> int:
        return max(1, (numel - 1).bit_length())

    def _factor(self, numel: int) -> float:
        kk = self.kept(numel)
        return numel / kk if self.rescale and kk else 1.0

    # --- one message -----------------------------------------------------------------

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None, scale=None) -> Payload:
        """Encode the kept values with ``inner``; ``scale`` (summable inner only) is passed on."""
        n = check_numel(x)
        seed = self.seed if self.seed is not None else self._draw_seed(generator)
        idx, vals = self._kept(n, seed, x.device, x.detach())
        factor = self._factor(n)
        if factor > 1 and vals.numel():
            # a pass over the k kept values (NaN passes: the inner encode refuses it); on the CPU one
            # vectorised kernel pass without a temporary (torch's abs().max() took 5% of the encode)
            K = kernels_for(vals, "core", "max_abs")
            amax = K.max_abs(vals) if K is not None else float(vals.abs().max())
            if amax * factor > _F32_MAX:
                raise ValueError(f"x is out of the random-k codec's range: a kept value |x_i| = {amax:.6g} times the "
                                 f"rescale d / k = {factor:.6g} exceeds float32's largest value {_F32_MAX:.6g}")
        kw = {"generator": generator}
        if scale is not None:
            if not is_summable(self.inner):
                raise ValueError(f"scale= needs a summable inner codec, got {type(self.inner).__name__}")
            kw["scale"] = scale
        ip = self.inner.encode(vals, **kw)
        if self.send_indices:
            header = pack_header("i", n, device=x.device)
            data = torch.cat([pack_wide(idx.to(torch.int64), self._index_bits(n)), ip.data.to(x.device)])
        else:
            header = pack_header("iq", n, seed, device=x.device)
            data = ip.data
        return Payload(header=torch.cat([header, ip.header.to(x.device)]), data=data)

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        """Scatter the inner decode back. ``generator``: only for an inner codec with
        ``dither_on_decode`` (a copy of the sender's generator; the seed draw of ``encode``
        is replayed on it first when the codec has no fixed ``seed``)."""
        own = header_size(self._own_header)
        fields = frame_header(self, payload)[:2 if not self.send_indices else 1]  # own fields and the inner's
        n = frame_count(self, fields[0], numel, bounded=False)
        kk = self.kept(n)
        data = payload.data
        if self.send_indices:
            nb = packed_nbytes(kk, self._index_bits(n))
            if data.numel() < nb:
                raise PayloadError(self.name, f"at least {nb} data bytes for {kk} indices of {self._index_bits(n)} "
                                   "bits", f"{data.numel()}")
            idx = _check_sent_indices(unpack_wide(data[:nb], self._index_bits(n), kk), n)
            data = data[nb:]
        else:
            if not 0 <= fields[1] <= _SEED_MAX:
                raise PayloadError(self.name, "a selection seed in 0..2^63-1", f"{fields[1]}")
            idx = None
        inner_p = Payload(header=payload.header[own:], data=data)
        out_dtype = torch.float32 if dtype is None else dtype
        kw = {"numel": kk} if _inner_accepts(self.inner, "numel") else {}
        if dtype is not None and _inner_accepts(self.inner, "dtype"):
            kw["dtype"] = dtype
        if self.dither_on_decode:
            if generator is not None and self.seed is None:
                self._draw_seed(generator)  # keep the receiver's copy in step with the sender's
            kw["generator"] = generator
        vals = self.inner.decode(inner_p, **kw)  # the inner frame checked before the selection runs
        if idx is None:
            idx = self._indices(n, fields[1], data.device)
        out, far = self._scatter(vals, idx, n, out_dtype)
        if far:
            raise PayloadError(self.name, f"kept values that, times d / k = {self._factor(n):.6g}, fit {out_dtype}",
                               "larger ones")
        return out

    def _scatter(self, vals: torch.Tensor, idx: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """Zeros with the kept values (times the rescale factor, in float64, then cast) at ``idx``,
        and whether a product is beyond ``dtype``'s largest finite value (or NaN)."""
        K = kernels_for(vals, _FAMILY)
        if K is not None and idx.device == vals.device:
            return K.scatter(vals, idx, n, self._factor(n), dtype)
        out = torch.zeros(n, dtype=dtype, device=vals.device)
        prod = vals.to(torch.float64) * self._factor(n)
        out[idx.to(vals.device)] = prod.to(dtype)
        return out, bool(prod.numel()) and not bool((prod.abs() <= torch.finfo(dtype).max).all())

    # --- the summable protocol (inner summable, send_indices False, seed set) ---------------

    def _summable_inner(self) -> SummableCodec:
        if self.kind is not CodecKind.SUMMABLE:
            raise ValueError(
                f"RandKCodec is summable only with a summable inner codec and send_indices=False "
                f"(inner={type(self.inner).__name__}, send_indices={self.send_indices})"
            )
        self._need_seed()
        return self.inner  # type: ignore[return-value]

    def _kept_values(self, x: torch.Tensor) -> torch.Tensor:
        check_flat(x)
        return self._kept(check_numel(x), self._need_seed(), x.device, x.detach())[1]

    @property
    def scale_reduce_ops(self) -> tuple:  # type: ignore[override]
        return self.inner.scale_reduce_ops if is_summable(self.inner) else ()

    @property
    def max_code(self) -> int:
        if not is_summable(self.inner):
            raise ValueError(f"max_code needs a summable inner codec, got {type(self.inner).__name__}")
        return self.inner.max_code

    def sum_dtype(self, world_size: int, dtype: torch.dtype | None = None) -> torch.dtype:
        return self._summable_inner().sum_dtype(world_size, dtype)

    def scale_nbytes(self, numel: int) -> int:
        return self._summable_inner().scale_nbytes(self.kept(numel))

    def shared_scale(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        return self._summable_inner().shared_scale(self._kept_values(x), agreed)

    def encode_int(self, x: torch.Tensor, scale, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return self._summable_inner().encode_int(self._kept_values(x), scale, generator, dtype)

    def decode_sum(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        inner = self._summable_inner()
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be given (the length of the decoded vector, a non-negative int), got {numel!r}")
        if int_sum.dim() != 1 or int_sum.numel() != self.kept(numel):
            raise ValueError(f"int_sum must hold the {self.kept(numel)} kept codes for numel={numel}, "
                             f"got shape {tuple(int_sum.shape)}")
        vals = inner.decode_sum(int_sum, scale, world_size, dtype=torch.float64)
        idx = self._indices(numel, self._need_seed(), int_sum.device)
        out_dtype = torch.float32 if dtype is None else dtype
        out, far = self._scatter(vals, idx, numel, out_dtype)
        if far:
            raise ValueError(f"the decoded average times d / k = {self._factor(numel):.6g} does not fit {out_dtype}: "
                             "the workers' inputs are out of the random-k codec's range")
        return out
