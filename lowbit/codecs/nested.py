"""Nested dithered quantization, NDQSG ("Nested Dithered Quantization for
Communication Reduction in Distributed Training", ICLR 2019 submission):
section 2.2, section 3.2 eq. (6)-(7), Theorem 6 eq. (8)-(9), Algorithm 2,
appendix E.

Quantizers. ``Q1(t) = Delta1 round(t / Delta1)`` (fine) and ``Q2(t) = Delta2
round(t / Delta2)`` (coarse) with ``Delta2 = k Delta1`` (nested: integer
``k >= 2``); ``round`` is round-half-up, ``floor(. + 1/2)``. As in the paper
(Algorithm 2, Theorem 6) the quantizers act on ``x`` itself: there is no
``||x||_inf`` normalisation, ``delta1`` is in the units of ``x`` and Theorem 6's
``sigma_z`` is the std of ``z = x - y`` in those units. (A scale in the header
would not help: the receiver's side information lives in absolute units.)

Sender, dither ``u ~ U[-Delta1/2, Delta1/2)`` from the shared generator:

    t = alpha x + u,    s = Q1(t) - Q2(t)                                    (6)

``s`` is a multiple of ``Delta1``; what is sent is ``c = round(t / Delta1) mod k``
in ``0..k-1``, packed by :func:`~lowbit.codecs.radix.pack_levels`: ``log2 k`` bits for a
power of two, mixed radix at about ``log2 k`` bits for other ``k <= 2^16`` (e.g. 1.6 bits for
``k = 3``), ``ceil(log2 k)`` bits beyond; ``bits`` is that count
(:func:`~lowbit.codecs.radix.level_bits`). ``Delta1 c`` differs from ``s``
by a multiple of ``Delta2``, and the decoder below depends on ``s`` only modulo
``Delta2``, so this is the paper's scheme with exactly ``k`` levels (the
``log2(Delta2/Delta1)`` bits of the remark after Theorem 6).

Receiver with side information ``y`` (the same dither, regenerated):

    r = Delta1 c - u - alpha y,   x_hat = y + alpha (r - Q2(r))              (7)

Error (appendix E). With ``z = x - y`` and ``e = t - Q1(t)`` (the fine
dithered error, uniform on ``[-Delta1/2, Delta1/2]`` and independent of ``x``
by Schuchman's theorem), ``r - Q2(r) = (alpha z - e) - Q2(alpha z - e)``, so

    |alpha z - e| < Delta2/2   <=>   x_hat = x - (1 - alpha^2) z - alpha e   (correct decoding)

and otherwise ``x_hat`` is off by a nonzero multiple of ``alpha Delta2``. The
condition is per element in terms of ``e``, not of the dither ``u``; because
``-e`` has the law of ``u`` and is independent of ``z``, the failure
probability is Theorem 6's ``p = Pr(|alpha z + u| > Delta2/2)`` with ``u``
an independent ``U[-Delta1/2, Delta1/2]``. (Per element,
``|alpha z + u| < Delta2/2`` with the actual dither is *not* sufficient.)
``|z| < (Delta2 - Delta1) / (2 alpha)`` is sufficient (``p = 0``). Given correct
decoding, eq. (9): ``E[(x_hat - x)^2] = alpha^2 Delta1^2/12 + (1 - alpha^2)^2 sigma_z^2``.

Shared randomness as in :mod:`lowbit.codecs.dithered`: ``u = (r - 1/2) Delta1``
with ``r_i`` the counter uniforms of one key drawn from ``g`` by ``encode``;
``decode`` needs a generator of the same kind built from the same seed
(``shared_generator(run_seed, step, sender)`` on both ends) and regenerates
``r_i`` element by element.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, frame_counted, pack_header
from .dithered import _uniforms
from .kernels import kernels_for
from .radix import level_bits, levels_nbytes, pack_levels, pack_levels_fast, unpack_levels, unpack_levels_fast
from .quantize import check_int_range, check_numel, check_positive, finite_float64
from .rng import draw_key

__all__ = [
    "NestedDitheredCodec",
    "NestedParameters",
    "choose_nested_parameters",
    "theorem6_failure_bound",
    "gaussian_failure_probability",
    "theorem6_mse",
    "matched_alpha",
]

_MAX_K = 2**32
_MAX_INDEX = 2.0**52  # |round(t / Delta1)| beyond this is no longer an exact integer in float64


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not (0 < alpha <= 1):
        raise ValueError(f"alpha must be a number in (0, 1], got {alpha!r}")
    return float(alpha)


def _check_sigma(sigma_z) -> float:
    if isinstance(sigma_z, bool) or not isinstance(sigma_z, numbers.Real) or not math.isfinite(sigma_z) or sigma_z < 0:
        raise ValueError(f"sigma_z must be a finite number >= 0, got {sigma_z!r}")
    return float(sigma_z)


# --- Theorem 6 ---------------------------------------------------------------------


def theorem6_failure_bound(delta1: float, delta2: float, alpha: float, sigma_z: float) -> float:
    """Theorem 6, eq. (8): ``p <= Delta1^2 / (3 Delta2^2) + 4 alpha^2 sigma_z^2 / Delta2^2``.

    This is Chebyshev's inequality for ``alpha z + u`` (``E[(alpha z + u)^2] =
    alpha^2 sigma_z^2 + Delta1^2/12``, threshold ``Delta2/2``); it holds for any
    zero-mean ``z`` with ``E[z^2] = sigma_z^2``. May exceed 1."""
    delta1, delta2 = check_positive(delta1, "delta1"), check_positive(delta2, "delta2")
    alpha, sigma_z = _check_alpha(alpha), _check_sigma(sigma_z)
    return delta1**2 / (3 * delta2**2) + 4 * alpha**2 * sigma_z**2 / delta2**2


def _q(x: float) -> float:
    """Gaussian upper tail ``Pr(Z > x)``."""
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def _tail_integral(x: float) -> float:
    """``int_x^inf Pr(Z > t) dt = phi(x) - x Pr(Z > x)`` (relative error ~ x^2 eps)."""
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) - x * _q(x)


def gaussian_failure_probability(delta1: float, delta2: float, alpha: float, sigma_z: float) -> float:
    """Theorem 6's ``p = Pr(|alpha z + u| > Delta2/2)`` exactly, for ``z ~ N(0, sigma_z^2)``
    independent of ``u ~ U[-Delta1/2, Delta1/2]`` (``Delta1 < Delta2``).

    With ``s = alpha sigma_z``, ``a = Delta1/2``, ``h = Delta2/2`` and
    ``H(x) = int_x^inf Q(t) dt = phi(x) - x Q(x)``:
    ``p = (s / a) [H((h - a)/s) - H((h + a)/s)]`` (0 when ``s = 0``)."""
    delta1, delta2 = check_positive(delta1, "delta1"), check_positive(delta2, "delta2")
    alpha, sigma_z = _check_alpha(alpha), _check_sigma(sigma_z)
    if delta1 >= delta2:
        raise ValueError(f"delta1 must be smaller than delta2, got delta1={delta1}, delta2={delta2}")
    s, a, h = alpha * sigma_z, delta1 / 2, delta2 / 2
    if s == 0:
        return 0.0
    p = (s / a) * (_tail_integral((h - a) / s) - _tail_integral((h + a) / s))
    return min(max(p, 0.0), 1.0)


def theorem6_mse(delta1: float, alpha: float, sigma_z: float) -> float:
    """Eq. (9): ``E[(x_hat - x)^2] = alpha^2 Delta1^2 / 12 + (1 - alpha^2)^2 sigma_z^2``
    per element, given correct decoding."""
    delta1 = check_positive(delta1, "delta1")
    alpha, sigma_z = _check_alpha(alpha), _check_sigma(sigma_z)
    return alpha**2 * delta1**2 / 12 + (1 - alpha**2) ** 2 * sigma_z**2


def matched_alpha(delta1: float, sigma_z: float) -> float:
    """``alpha = sqrt(1 - Delta1^2 / (12 sigma_z^2))`` (remark after Theorem 6): eq. (9)
    then equals ``Delta1^2 / 12``, the variance of DQSG with step ``Delta1``, as for
    ``alpha = 1``, with a smaller failure probability. Needs ``Delta1^2 < 12 sigma_z^2``."""
    delta1, sigma_z = check_positive(delta1, "delta1"), check_positive(sigma_z, "sigma_z")
    a2 = 1 - delta1**2 / (12 * sigma_z**2)
    if a2 <= 0:
        raise ValueError(
            f"matched alpha needs delta1^2 < 12 sigma_z^2, got delta1={delta1}, sigma_z={sigma_z} "
            "(the side information alone is then as accurate as the fine quantizer)"
        )
    return math.sqrt(a2)


@dataclass(frozen=True)
class NestedParameters:
    """A choice of ``(Delta1, Delta2 = k Delta1, alpha)`` for side-information noise
    of std ``sigma_z``, with Theorem 6's figures for it."""

    delta1: float
    delta2: float
    k: int
    alpha: float
    sigma_z: float
    failure_bound: float  # eq. (8), Chebyshev: any zero-mean z with E z^2 = sigma_z^2
    failure_probability: float  # exact Pr(|alpha z + u| > Delta2/2) for Gaussian z
    mse: float  # eq. (9), per element, given correct decoding

    @property
    def bits(self) -> float:
        """Bits per index on the wire, :func:`~lowbit.codecs.radix.level_bits` ``(k)``."""
        return level_bits(self.k)

    def codec(self) -> "NestedDitheredCodec":
        return NestedDitheredCodec(delta1=self.delta1, k=self.k, alpha=self.alpha)


def _params(delta1: float, k: int, alpha: float, sigma_z: float) -> NestedParameters:
    delta2 = k * delta1
    return NestedParameters(
        delta1=delta1, delta2=delta2, k=k, alpha=alpha, sigma_z=sigma_z,
        failure_bound=theorem6_failure_bound(delta1, delta2, alpha, sigma_z),
        failure_probability=gaussian_failure_probability(delta1, delta2, alpha, sigma_z),
        mse=theorem6_mse(delta1, alpha, sigma_z),
    )


def choose_nested_parameters(sigma_z: float, failure_prob: float, *, k: int | None = None, bits: int | None = None,
                             alpha: float | str = "matched", method: str = "bound") -> NestedParameters:
    """Choose ``(Delta1, Delta2, alpha)`` from Theorem 6 for a target per-element
    decoding-failure probability ``failure_prob`` with side-information noise
    ``z = x - y`` of std ``sigma_z``, at ``k`` levels (or ``bits``: ``k = 2^bits``).

    For a fixed ``k`` the smallest ``Delta1`` (the most accurate quantizer) whose
    failure probability is ``failure_prob`` is returned, ``Delta2 = k Delta1``.

    ``alpha``: ``"matched"`` (default) uses ``alpha^2 = 1 - Delta1^2 / (12 sigma_z^2)``
    (:func:`matched_alpha`: eq. (9) gives ``Delta1^2/12``, DQSG's variance with step
    ``Delta1``); a number in (0, 1] fixes it.

    ``method="bound"`` sets Theorem 6's bound (8) equal to the target:
      * matched alpha: (8) simplifies to ``4 sigma_z^2 / Delta2^2``, so
        ``Delta2 = 2 sigma_z / sqrt(p)``, ``Delta1 = Delta2 / k``,
        ``alpha = sqrt(1 - 1 / (3 k^2 p))``;
      * fixed alpha: ``Delta2 = 2 alpha sigma_z / sqrt(p - 1 / (3 k^2))``.
      Both need ``p > 1/(3 k^2)`` (the dither's own share of (8)); valid for any
      zero-mean ``z`` with ``E[z^2] = sigma_z^2``.

    ``method="gaussian"`` instead solves ``Pr(|alpha z + u| > Delta2/2) = p`` exactly
    for ``z ~ N(0, sigma_z^2)`` (:func:`gaussian_failure_probability`, decreasing in
    ``Delta2``) by bisection; smaller steps for the same target, any ``p`` in (0, 1).
    """
    sigma_z = check_positive(sigma_z, "sigma_z")
    if isinstance(failure_prob, bool) or not isinstance(failure_prob, numbers.Real) or not 0 < failure_prob < 1:
        raise ValueError(f"failure_prob must be a number in (0, 1), got {failure_prob!r}")
    p = float(failure_prob)
    if (k is None) == (bits is None):
        raise ValueError(f"give exactly one of k and bits, got k={k!r}, bits={bits!r}")
    if bits is not None:
        k = 1 << check_int_range(bits, "bits", 1, 32)
    k = check_int_range(k, "k", 2, _MAX_K)
    matched = isinstance(alpha, str)
    if matched and alpha != "matched":
        raise ValueError(f"alpha must be 'matched' or a number in (0, 1], got {alpha!r}")
    if not matched:
        alpha = _check_alpha(alpha)
    if method not in ("bound", "gaussian"):
        raise ValueError(f"method must be 'bound' or 'gaussian', got {method!r}")

    if method == "bound":
        floor_p = 1 / (3 * k**2)
        if p <= floor_p:
            raise ValueError(
                f"failure_prob={p} is not above 1/(3 k^2) = {floor_p:.6g}, the least value Theorem 6's bound (8) "
                f"reaches with k={k}; use more levels or method='gaussian'"
            )
        if matched:
            delta2 = 2 * sigma_z / math.sqrt(p)
            a = math.sqrt(1 - floor_p / p)
        else:
            delta2 = 2 * alpha * sigma_z / math.sqrt(p - floor_p)
            a = alpha
        return _params(delta2 / k, k, a, sigma_z)

    # method == "gaussian": bisection on log Delta2; failure probability decreases in Delta2.
    def alpha_of(d2: float) -> float:
        return matched_alpha(d2 / k, sigma_z) if matched else alpha

    def fail(d2: float) -> float:
        return gaussian_failure_probability(d2 / k, d2, alpha_of(d2), sigma_z)

    lo = 1e-6 * sigma_z
    while fail(lo) < p:
        lo /= 16
    if matched:
        hi = k * math.sqrt(12) * sigma_z * (1 - 1e-12)  # alpha -> 0 there, failure -> 0
    else:
        hi = sigma_z
        while fail(hi) > p:
            hi *= 16
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if fail(mid) > p:
            lo = mid
        else:
            hi = mid
        if hi / lo - 1 < 1e-13:
            break
    return _params(hi / k, k, alpha_of(hi), sigma_z)


# --- the codec ---------------------------------------------------------------------


@dataclass(frozen=True)
class NestedDitheredCodec(Codec):
    """NDQSG (eq. 6-7): fine step ``delta1``, coarse step ``delta2 = k delta1``,
    shrinkage ``alpha`` in (0, 1]. Kind SIDE_INFO.

    ``encode(x, generator=g)``: ``g`` (required) supplies the dither.
    ``decode(payload, ref=y, generator=g2)``: ``y`` is the receiver's side
    information (the paper's ``g_bar``), ``g2`` a generator of the same kind
    seeded like ``g`` and not yet drawn from; both are required (ValueError).
    ``roundtrip(x, generator=g, ref=y)`` decodes with a copy of ``g``.

    ``unbiased`` is True only for ``alpha = 1``, and then in the regime of correct
    decoding (guaranteed by ``|x - y| < safe_radius``): ``x_hat = x - e``.
    For ``alpha < 1`` the estimate is shrunk towards ``y`` by ``(1 - alpha^2) z``.

    Range: finite ``x`` whose fine index ``|alpha x + u| / delta1`` stays below 2^52 (2^24 for
    float32 on CUDA), where the arithmetic is exact; encode raises ValueError beyond. A
    payload whose count is not ``ref``'s (or ``numel``'s), or whose data is not
    ``levels_nbytes(numel, k)`` bytes, is a PayloadError before any kernel reads it.

    Header ``<i``: numel (4 bytes); ``nbytes = 4 + ceil(n ceil(log2 k) / 8)``.
    ``decode`` returns ``ref``'s dtype on ``ref``'s device.

    Arithmetic. ``m = floor(t (1/Delta1) + 1/2)`` and ``Q2(r) = Delta2 floor(r
    (1/Delta2) + 1/2)``, with the inverses computed once. The reference
    (``encode_reference``/``decode_reference``) computes in float64 on whole
    tensors; the CPU fast path (numba, :mod:`.kernels.cpu_nested`) runs the same
    float64 operations per element: the same bytes and decodes exactly. The CUDA
    fast path (Triton) computes in float32 for float32/half input: the fine index
    is exact only below ``2^24``, so it raises the ``delta1`` error when
    ``|x| / Delta1`` reaches ``2^24`` (float64 input: ``2^52``, as the reference);
    an index may differ from the reference's by one (mod ``k``) on a tiny fraction
    of elements; and with ``|z| < safe_radius`` the decode error ``|x_hat - x + (1 -
    alpha^2) z + alpha e|`` is at most ``4 eps32 (|x| + |y| + Delta2)``
    (``eps32 = 2^-24``; rounding of ``t``, ``r``, the fold and the final sum, each
    of a value of magnitude at most ``|x| + |y| + Delta2``). The coarse decision
    ``|alpha z - e| < Delta2 / 2`` can flip only within that slack of the cell edge.
    """

    delta1: float
    k: int
    alpha: float = 1.0

    name = "nested"
    kernel_family = "nested"
    dither_on_decode = True
    kind = CodecKind.SIDE_INFO
    header_format = "i"

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta1", check_positive(self.delta1, "delta1"))
        object.__setattr__(self, "k", check_int_range(self.k, "k", 2, _MAX_K))
        object.__setattr__(self, "alpha", _check_alpha(self.alpha))
        if not math.isfinite(self.delta2):
            raise ValueError(f"delta2 = k * delta1 must be finite, got k={self.k}, delta1={self.delta1}")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.alpha == 1.0

    @property
    def delta2(self) -> float:
        """Coarse step ``k Delta1``."""
        return self.k * self.delta1

    @property
    def bits(self) -> float:
        """Bits per index on the wire, :func:`~lowbit.codecs.radix.level_bits` ``(k)``: ``log2 k``
        for a power of two, about ``log2 k`` (mixed radix) for other ``k <= 2^16``, else ``ceil(log2 k)``."""
        return level_bits(self.k)

    @property
    def code_bits(self) -> int:
        """Width of one unpacked index, ``ceil(log2 k)`` (the kernels' code dtype)."""
        return (self.k - 1).bit_length()

    @property
    def safe_radius(self) -> float:
        """Theorem 6: ``|x - y| < (Delta2 - Delta1) / (2 alpha)`` guarantees correct decoding."""
        return (self.delta2 - self.delta1) / (2 * self.alpha)

    def failure_bound(self, sigma_z: float) -> float:
        """Theorem 6, eq. (8), for this codec."""
        return theorem6_failure_bound(self.delta1, self.delta2, self.alpha, sigma_z)

    def failure_probability(self, sigma_z: float) -> float:
        """Exact per-element failure probability for Gaussian ``z = x - y`` of std ``sigma_z``."""
        return gaussian_failure_probability(self.delta1, self.delta2, self.alpha, sigma_z)

    def mse(self, sigma_z: float) -> float:
        """Eq. (9), per element, given correct decoding."""
        return theorem6_mse(self.delta1, self.alpha, sigma_z)

    # --- the two halves of the scheme, with an explicit dither ---------------------------

    def dither(self, n: int, generator: torch.Generator, device=None) -> torch.Tensor:
        """The dither ``u`` in ``[-Delta1/2, Delta1/2)`` that ``encode`` draws from ``generator``
        (float64, on ``device``, default the generator's)."""
        device = device if device is not None else generator.device
        return (_uniforms(n, generator, device) - 0.5) * self.delta1

    def indices(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Eq. (6) as sent: ``round((alpha x + u) / Delta1) mod k`` (int64, in ``0..k-1``)."""
        t = self.alpha * x.to(torch.float64) + u.to(torch.float64)
        m = torch.floor(t * (1.0 / self.delta1) + 0.5)
        if m.numel():
            self._check_index(float(m.abs().max()), _MAX_INDEX)
        return torch.remainder(m, self.k).to(torch.int64)

    def _check_index(self, worst: float, limit: float) -> None:
        if not worst < limit:
            raise ValueError(
                f"delta1={self.delta1} is too small for x (or x is not finite): the fine index reaches "
                f"{worst:.6g}, beyond the 2^{int(math.log2(limit))} that the arithmetic holds exactly"
                + ("" if limit == _MAX_INDEX else " (float32 on CUDA: pass float64 input for up to 2^52)")
            )

    def reconstruct(self, codes: torch.Tensor, u: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Eq. (7): ``r = Delta1 c - u - alpha y``, ``x_hat = y + alpha (r - Q2(r))`` (float64)."""
        y64 = y.to(torch.float64)
        r = codes.to(torch.float64) * self.delta1 - u.to(torch.float64) - self.alpha * y64
        fold = r - self.delta2 * torch.floor(r * (1.0 / self.delta2) + 0.5)
        return y64 + self.alpha * fold

    # --- codec -------------------------------------------------------------------

    def _need_generator(self, generator, what: str) -> None:
        if generator is not None:
            return
        if what == "encode":
            raise ValueError(
                "NestedDitheredCodec.encode needs generator= (e.g. shared_generator(run_seed, step, sender)): "
                "the receiver regenerates the dither from the same seed"
            )
        raise ValueError(
            "NestedDitheredCodec.decode needs generator=: a generator of the same kind seeded like the "
            "sender's (e.g. shared_generator(run_seed, step, sender)), to regenerate the dither"
        )

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """Eq. (6): ``c = round((alpha x + u) / Delta1) mod k``, packed."""
        self._need_generator(generator, "encode")
        n = check_numel(x)
        K = kernels_for(x, self.kernel_family)
        if K is None:
            return self.encode_reference(x, generator=generator)
        codes, finite, worst = K.nested_encode(x, self.alpha, self.delta1, self.k, self.code_bits,
                                               draw_key(generator))
        if not finite:
            raise ValueError("x must be finite for the nested dithered codec")
        self._check_index(worst, K.index_limit(x.dtype))
        return Payload(header=pack_header(self.header_format, n, device=x.device), data=pack_levels_fast(codes, self.k))

    def _frame(self, payload: Payload, ref: torch.Tensor | None, numel: int | None) -> int:
        """The payload's count ``n``, its frame checked (PayloadError): the header, ``n`` against
        ``numel`` and ``ref``'s length, the data's length; ``ref`` checked."""
        return frame_counted(self, payload, numel, lambda n: levels_nbytes(n, self.k),
                             lambda n: f"{n} codes of {self.k} levels", ref=ref,
                             ref_needs="NestedDitheredCodec: the receiver's side information y, close to x")

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, numel: int | None = None) -> torch.Tensor:
        """Eq. (7) against the side information ``ref``."""
        n = self._frame(payload, ref, numel)
        self._need_generator(generator, "decode")
        K = kernels_for(ref, self.kernel_family)
        if K is None:
            return self.decode_reference(payload, ref=ref, generator=generator)
        codes = unpack_levels_fast(payload.data.to(ref.device), self.k, n, K.code_dtype(self.code_bits),
                                   codec=self.name)
        return K.nested_decode(codes, ref, self.alpha, self.delta1, self.delta2, draw_key(generator))

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (same bytes on the CPU)."""
        self._need_generator(generator, "encode")
        n, x64 = finite_float64(x, "nested dithered")
        codes = self.indices(x64, self.dither(n, generator, device=x.device))
        return Payload(header=pack_header(self.header_format, n, device=x.device), data=pack_levels(codes, self.k))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        n = self._frame(payload, ref, numel)
        self._need_generator(generator, "decode")
        codes = unpack_levels(payload.data.to(ref.device), self.k, n, codec=self.name)
        u = self.dither(n, generator, device=ref.device)
        return self.reconstruct(codes, u, ref.detach()).to(ref.dtype)
