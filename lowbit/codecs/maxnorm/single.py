"""QSGDMaxNorm (:class:`QSGDMaxNormCodec`), single scale: see :mod:`lowbit.codecs.maxnorm`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import (Payload, SummableCodec, check_world_size, frame_count, frame_header, frame_nbytes,
                    frame_output, frame_scales, pack_header)
from ..kernels import kernels_for
from ..radix import level_bits, levels_nbytes, pack_levels, pack_levels_fast, unpack_levels, unpack_levels_fast
from ..qsgd import round_up_float32
from ..quantize import INT32_MAX, check_int_range, check_numel, lane_sums_reference, round_to_int
from ..rng import draw_key
from .shared import (FAMILY, fast_encode_int, _F32_MAX, _check_norm, _f32_up, _as_float64, _local_statistic,
                     _raise_flags, _fast_norm, _out_dtype, _norm_value, _ratios, _signed, _check_int_sum, _kernels,
                     _x_kernels, _frame, _lemma_bound)


@dataclass(frozen=True)
class QSGDMaxNormCodec(SummableCodec):
    """QSGDMaxNorm (section 3.1): ``s = 2^(bits-1) - 1`` levels, ``bits`` bits per
    coordinate (sign + magnitude), norm shared by MAX; unbiased; kind SUMMABLE.

    ``shared_scale(x)``: ``[W_m]`` (float32, one element), combined by ``max``.
    ``encode_int(x, W)``: int64 codes in ``-s..s``. ``decode_sum(sum, W, M)``:
    ``W * sum / (s * M)``. ``encode(x, scale=W)`` / ``decode``: one message.

    ``bucket``: None (the paper's one norm for the whole vector), or ``d`` in
    ``1..2^31 - 1``: one shared norm per bucket of ``d`` consecutive coordinates (the last
    possibly shorter), as QSGD quantizes (Alistarh et al. use ``d = 512``; the DDP hooks'
    default, :data:`~lowbit.integrations.ddp_hooks.HOOK_BUCKET`). ``shared_scale(x)`` is then
    the ``ceil(n / d)`` float32 norms of this worker's buckets, combined by ``max`` element by
    element (one MAX all-reduce of ``4 ceil(n / d)`` bytes, :meth:`scale_nbytes`), and every
    coordinate is coded against its bucket's shared norm ``W_j``: Lemma 1 holds per bucket,
    ``E||Q(x) - x||^2 <= sum_j (1 + min(d_j / s^2, sqrt(d_j) / s)) W_j^2``. With one norm for
    ``n`` coordinates a typical ``|x_i| / W`` is ``~ 1 / sqrt(n)``: at ``n = 79k`` and ``s = 7``
    almost every code is 0 and the rest are ``+-W / 7``, a variance ``~ sqrt(n) / s = 40``
    times ``||x||^2`` (the l2 factor of Lemma 1); buckets of 512 bring the factor to 3.2. The
    codes, their sum and its dtype are as without buckets (the same uniforms: with equal norms
    the codes are the same). One message: header ``<i`` (numel), data the float32 norms, then
    the packed codes. The fast path's bucketed kernels are the CPU's; elsewhere the float64
    reference runs.
    """

    bits: int = 3  # the paper's "QSGD-MN 2" (precision 2): the default of every entry point
    norm: str = "l2"
    bucket: int | None = None

    name = "qsgd-maxnorm"
    kernel_family = FAMILY
    unbiased = True
    scale_reduce_ops = ("max",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int_range(self.bits, "bits", 2, 32))
        _check_norm(self.norm)
        if self.bucket is not None:
            object.__setattr__(self, "bucket", check_int_range(self.bucket, "bucket", 1, INT32_MAX))

    @property
    def header_format(self) -> str:  # type: ignore[override]
        """``<if`` (numel, W) with one norm; ``<i`` (numel) with buckets (the norms lead the data)."""
        return "if" if self.bucket is None else "i"

    def num_buckets(self, numel: int) -> int:
        """Shared norms of a vector of ``numel`` coordinates: 1, or ``ceil(numel / bucket)`` (at least 1)."""
        return 1 if self.bucket is None else max(1, -(-numel // self.bucket))

    @property
    def levels(self) -> int:
        """``s = 2^(bits-1) - 1``: the paper's number of quantization levels."""
        return (1 << (self.bits - 1)) - 1

    @property
    def precision(self) -> int:
        """The paper's precision ``log2(s + 1) = bits - 1`` (QSGD-MN <precision>)."""
        return self.bits - 1

    @property
    def max_code(self) -> int:
        return self.levels

    @property
    def num_codes(self) -> int:
        """Codes of one message, ``2s + 1 = 2^bits - 1`` (offset codes ``code + s``)."""
        return 2 * self.levels + 1

    @property
    def wire_bits(self) -> float:
        """Bits per coordinate of a message on the wire, :func:`~lowbit.codecs.radix.level_bits`
        ``(2s + 1)``: at most ``bits``, below it where mixed radix saves (1.6 for ``bits = 2``)."""
        return level_bits(self.num_codes)

    def scale_nbytes(self, numel: int) -> int:
        """4 bytes (one float32 norm) per bucket."""
        return 4 * self.num_buckets(numel)

    def variance_bound(self, numel: int, scale) -> float:
        """Lemma 1: ``E||Q(x) - x||^2 <= (1 + min(n / s^2, sqrt(n) / s)) W^2`` for the l2
        norm; for ``linf`` the same argument (``sum_i p_i <= n``) gives ``(1 + n / s^2) W^2``.
        With buckets, the sum of that bound over the buckets (``n = d_j``, ``W = W_j``)."""
        if self.bucket is None:
            return _lemma_bound(numel, self.levels, _norm_value(scale), self.norm)
        W = self._bucket_norms(scale, numel, torch.device("cpu")).tolist()
        sizes = [min(self.bucket, numel - j * self.bucket) for j in range(len(W))]
        return sum(_lemma_bound(d, self.levels, w, self.norm) for d, w in zip(sizes, W))

    # --- buckets: one shared norm per bucket --------------------------------------------

    def _bucket_norms(self, scale, n: int, device) -> torch.Tensor:
        """The agreed bucket norms from ``scale`` (a tensor of :meth:`num_buckets` values, or a
        number when there is one bucket) as float64 on ``device``, each rounded up to float32
        (the values the wire carries): ValueError unless they are finite and >= 0."""
        k = self.num_buckets(n)
        if isinstance(scale, torch.Tensor):
            v = scale.detach().reshape(-1)
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
            v = torch.tensor([float(scale)], dtype=torch.float64)
        else:
            raise ValueError(f"scale must be a tensor of the {k} shared bucket norms (or a number for one bucket), "
                             f"got {type(scale).__name__}")
        if v.numel() != k or v.is_complex() or not v.is_floating_point():
            raise ValueError(f"scale must hold {k} floating-point norms (one per bucket of {self.bucket} of the {n} "
                             f"coordinates), got {v.dtype} of {v.numel()}")
        v = v.to(device=device, dtype=torch.float64)
        lo, hi = torch.aminmax(v)
        if not (float(lo) >= 0 and float(hi) <= _F32_MAX):
            raise ValueError(f"scale (the shared bucket norms) must be finite, >= 0 and within float32, got values in "
                             f"[{float(lo)}, {float(hi)}]")
        return round_up_float32(v).to(torch.float64)

    def _bucket_over_error(self, x: torch.Tensor, W: torch.Tensor) -> ValueError:
        n, d = x.numel(), self.bucket
        k = W.numel()
        amax = torch.nn.functional.pad(x.detach().abs().to(torch.float64).cpu(), (0, k * d - n)).view(k, d).amax(1)
        j = int(torch.nonzero(amax > W.cpu())[0])
        return ValueError(f"scale[{j}]={float(W[j])} is smaller than this worker's max |x_i| = {float(amax[j])} in "
                          f"bucket {j}: the shared {self.norm} norms must be the MAX of the workers' shared_scale "
                          "values (scale_reduce_op='max')")

    def _bucket_kernels(self, t: torch.Tensor):
        """The CPU kernels of the bucketed fast path for ``t``, or None (the reference)."""
        K = _kernels(t)
        return K if K is None else kernels_for(t, FAMILY, "qsgd_encode_buckets")

    def _x_bucket_kernels(self, x: torch.Tensor):
        """:meth:`_bucket_kernels` for an input ``x``, after checking it (as :func:`_x_kernels`)."""
        check_numel(x)
        return self._bucket_kernels(x)

    def _bucket_flags(self, flags, x: torch.Tensor, W: torch.Tensor, K) -> None:
        flags = int(flags)
        if flags & K.FLAG_NONFINITE:
            raise ValueError("x must be finite for the max-norm codecs")
        if flags & K.FLAG_OVER:
            raise self._bucket_over_error(x, W)

    def _shared_bucket_norms(self, x: torch.Tensor) -> torch.Tensor:
        check_numel(x)
        K = self._bucket_kernels(x)
        if K is None:
            return self._bucket_norms_reference(x)
        norms, finite = K.bucket_norms(x.detach(), self.bucket, self.norm == "linf")
        if not finite:
            raise ValueError("x must be finite for the max-norm codecs")
        return self._float32_norms(norms, x.device)

    def _float32_norms(self, norms: torch.Tensor, device) -> torch.Tensor:
        up = round_up_float32(norms)
        if not bool(torch.isfinite(up).all()):
            raise ValueError(f"the norm of a bucket of x ({float(norms.max())}) does not fit the float32 sent on the "
                             "wire")
        return up.to(device)

    def _bucket_norms_reference(self, x: torch.Tensor) -> torch.Tensor:
        x64 = _as_float64(x)
        n, d = x64.numel(), self.bucket
        k = self.num_buckets(n)
        amax = torch.nn.functional.pad(x64.abs(), (0, k * d - n)).view(k, d).amax(1)
        if self.norm == "l2":
            amax = torch.maximum(torch.sqrt(lane_sums_reference(x64 * x64, d)), amax)
        return self._float32_norms(amax, x.device)

    def _expand(self, W: torch.Tensor, n: int) -> torch.Tensor:
        return W.repeat_interleave(self.bucket)[:n]

    def _bucket_encode_int_reference(self, x: torch.Tensor, scale, generator) -> torch.Tensor:
        x64 = _as_float64(x)
        n = x64.numel()
        W = self._bucket_norms(scale, n, x64.device)
        We = self._expand(W, n)
        ax = x64.abs()
        if n and bool((ax > We).any()):
            raise self._bucket_over_error(x64, W)
        a = torch.where(We > 0, ax / torch.where(We > 0, We, torch.ones_like(We)), torch.zeros_like(ax))
        return _signed(x64, round_to_int(a * self.levels, "stochastic", generator))

    def _bucket_decode_reference(self, int_sum: torch.Tensor, scale, m: int, dtype) -> torch.Tensor:
        n = int_sum.numel()
        W = self._bucket_norms(scale, n, int_sum.device)
        out = int_sum.to(torch.float64) * self._expand(W / self.levels, n) / m
        return out.to(_out_dtype(dtype))

    def _bucket_frame(self, payload: Payload, numel: int | None) -> tuple[int, torch.Tensor, torch.Tensor, float]:
        """``(n, float32 norms, packed codes, largest norm)`` of a bucketed message, its frame
        checked (PayloadError)."""
        (n,) = frame_header(self, payload)
        frame_count(self, n, numel)
        k = self.num_buckets(n)
        frame_nbytes(self, payload.data, 4 * k + levels_nbytes(n, self.num_codes),
                     lambda: f"{k} bucket norms and {n} codes of {self.num_codes} levels")
        norms = payload.data[: 4 * k].clone().view(torch.float32)
        return n, norms, payload.data[4 * k:], frame_scales(self, norms, "bucket norm", _F32_MAX)

    def _bucket_message(self, x: torch.Tensor, W: torch.Tensor, packed: torch.Tensor) -> Payload:
        header = pack_header(self.header_format, x.numel(), device=x.device)
        return Payload(header=header, data=torch.cat([W.to(torch.float32).view(torch.uint8).to(x.device), packed]))

    # --- the summable protocol (fast path) --------------------------------------------

    def shared_scale(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        if self.bucket is not None:
            if len(agreed) != 0:
                raise ValueError(f"{type(self).__name__} has one scale round; agreed must be empty, got {len(agreed)}")
            return self._shared_bucket_norms(x)
        K = _x_kernels(x)
        if K is None:
            return self.shared_scale_reference(x, agreed)
        if len(agreed) != 0:
            raise ValueError(f"{type(self).__name__} has one scale round; agreed must be empty, got {len(agreed)}")
        return K.as_scale(_fast_norm(K, x, self.norm), x)

    def encode_int(self, x: torch.Tensor, scale, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
        dtype, K, codes = fast_encode_int(self, x, scale, generator, dtype,
                                          _x_kernels if self.bucket is None else self._x_bucket_kernels)
        if codes is not None:
            return codes
        if self.bucket is not None:
            W = self._bucket_norms(scale, x.numel(), torch.device("cpu"))
            codes, flags = K.qsgd_encode_buckets(x.detach(), W, self.bucket, self.levels, 0, draw_key(generator), dtype)
            self._bucket_flags(flags, x, W, K)
            return codes
        W = _norm_value(scale)
        codes, flags = K.qsgd_encode(x, W, self.levels, 0, draw_key(generator), dtype)
        _raise_flags(K, flags, x, W, self.norm)
        return codes

    def decode_sum(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        n = _check_int_sum(int_sum, numel)
        m = check_world_size(world_size)
        if self.bucket is not None:
            K = self._bucket_kernels(int_sum)
            if K is None:
                return self._bucket_decode_reference(int_sum, scale, m, dtype)
            W = self._bucket_norms(scale, n, torch.device("cpu"))
            return K.qsgd_decode_buckets(int_sum, 0, W, self.bucket, self.levels, m, _out_dtype(dtype))
        W = _norm_value(scale)
        K = _kernels(int_sum)
        if K is None:
            return self.decode_sum_reference(int_sum, W, m, dtype=dtype)
        return K.qsgd_decode(int_sum, 0, W, self.levels, m, _out_dtype(dtype))

    # --- one message (fast path) ------------------------------------------------------------

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None, scale=None) -> Payload:
        """One worker's message; ``scale``: the agreed norm (default: this worker's own), or with
        buckets the agreed bucket norms."""
        if self.bucket is not None:
            check_numel(x)
            K = self._bucket_kernels(x)
            if K is None:
                return self.encode_reference(x, generator=generator, scale=scale)
            W = self._bucket_norms(self.shared_scale(x) if scale is None else scale, x.numel(), torch.device("cpu"))
            codes, flags = K.qsgd_encode_buckets(x.detach(), W, self.bucket, self.levels, self.levels,
                                                 draw_key(generator), K.code_dtype(self.bits))
            self._bucket_flags(flags, x, W, K)
            return self._bucket_message(x, W, pack_levels_fast(codes, self.num_codes))
        K = _x_kernels(x)
        if K is None:
            return self.encode_reference(x, generator=generator, scale=scale)
        W = _fast_norm(K, x, self.norm) if scale is None else _norm_value(scale)
        codes, flags = K.qsgd_encode(x, W, self.levels, self.levels, draw_key(generator), K.code_dtype(self.bits))
        _raise_flags(K, flags, x, W, self.norm)
        header = pack_header(self.header_format, x.numel(), W, device=x.device)
        return Payload(header=header, data=pack_levels_fast(codes, self.num_codes))

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, float]:
        return _frame(self, payload, numel, lambda n: levels_nbytes(n, self.num_codes))

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        if self.bucket is not None:
            K = self._bucket_kernels(payload.data)
            if K is None:
                return self.decode_reference(payload, dtype=dtype, numel=numel)
            n, norms, data, top = self._bucket_frame(payload, numel)
            codes = unpack_levels_fast(data, self.num_codes, n, K.code_dtype(self.bits), codec=self.name)
            out = K.qsgd_decode_buckets(codes, self.levels, norms.to(torch.float64), self.bucket, self.levels, 1,
                                        _out_dtype(dtype))
            return frame_output(self, out, top)
        K = _kernels(payload.data)
        if K is None:
            return self.decode_reference(payload, dtype=dtype, numel=numel)
        n, W = self._frame(payload, numel)
        codes = unpack_levels_fast(payload.data, self.num_codes, n, K.code_dtype(self.bits), codec=self.name)
        return frame_output(self, K.qsgd_decode(codes, self.levels, W, self.levels, 1, _out_dtype(dtype)), W)

    # --- the float64 references -------------------------------------------------------------

    def shared_scale_reference(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        if len(agreed) != 0:
            raise ValueError(f"{type(self).__name__} has one scale round; agreed must be empty, got {len(agreed)}")
        if self.bucket is not None:
            return self._bucket_norms_reference(x)
        W = _f32_up(_local_statistic(_as_float64(x), self.norm))
        return torch.tensor([W], dtype=torch.float32, device=x.device)

    def encode_int_reference(self, x: torch.Tensor, scale, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.bucket is not None:
            return self._bucket_encode_int_reference(x, scale, generator)
        x64 = _as_float64(x)
        W = _norm_value(scale)
        t = _ratios(x64, W, self.norm) * self.levels  # <= s exactly, since a <= 1
        return _signed(x64, round_to_int(t, "stochastic", generator))

    def decode_sum_reference(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
        _check_int_sum(int_sum, numel)
        m = check_world_size(world_size)
        if self.bucket is not None:
            return self._bucket_decode_reference(int_sum, scale, m, dtype)
        W = _norm_value(scale)
        out = int_sum.to(torch.float64) * (W / self.levels) / m
        return out.to(_out_dtype(dtype))

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None, scale=None) -> Payload:
        if scale is None:
            scale = self.shared_scale_reference(x)
        if self.bucket is not None:
            W = self._bucket_norms(scale, x.numel(), x.device)
            codes = self.encode_int_reference(x, W, generator)
            return self._bucket_message(x, W, pack_levels(codes + self.levels, self.num_codes))
        W = _norm_value(scale)
        codes = self.encode_int_reference(x, W, generator)
        header = pack_header(self.header_format, codes.numel(), W, device=x.device)
        return Payload(header=header, data=pack_levels(codes + self.levels, self.num_codes))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        if self.bucket is not None:
            n, norms, data, top = self._bucket_frame(payload, numel)
            codes = unpack_levels(data, self.num_codes, n, codec=self.name) - self.levels
            return frame_output(self, self._bucket_decode_reference(codes, norms, 1, dtype), top)
        n, W = self._frame(payload, numel)
        codes = unpack_levels(payload.data, self.num_codes, n, codec=self.name) - self.levels
        return frame_output(self, self.decode_sum_reference(codes, W, 1, dtype=dtype), W)
