"""Moniqua's modulo codec (Lu & De Sa, "Moniqua: Modulo Quantized
Communication in Decentralized SGD", ICML 2020): Lemma 1, Lemma 2, eq. (5),
Algorithm 1 lines 3-5.

The sender quantizes ``(x / B_theta) mod 1`` on the circle ``[-1/2, 1/2)``
with ``2^bits`` equally spaced points (spacing ``2^-bits``; the point ``1/2``
is the point ``-1/2``, so all ``2^bits`` codes are used). The receiver, whose
own value ``y`` satisfies ``|x - y| < theta``, recovers

    x_hat = (B_theta * Q_delta((x / B_theta) mod 1) - y) mod B_theta + y      (5)

with ``|x_hat - x| <= delta * B_theta`` (Lemma 2), where
``B_theta = 2 theta / (1 - 2 delta)`` and ``delta`` is the error bound of
``Q_delta`` on the circle: ``2^-bits`` (stochastic) or ``2^-(bits+1)`` (nearest).

Precision: the reference (``encode_reference``/``decode_reference``) and the
CPU fast path compute in float64 whatever the input dtype, so Lemma 2 holds
up to float64 rounding (relative ~1e-16 of ``|x|``), and the two give the
same bytes. The CUDA fast path computes in float32 for float32 input: the
circle coordinate ``z = (x / B_theta) mod 1`` then carries an absolute error of
at most ``eps32 * (|x| / B_theta + 1)`` (``eps32 = 2^-24``), so Lemma 2 holds
with the slack ``B_theta * eps32 * (|x| / B_theta + 2) * 2^bits`` added to
``delta * B_theta``, and the decode adds ``eps32 * (|y| + B_theta)``. Outputs
are cast to ``ref``'s dtype; for float32 this adds at most half an ulp of
``x_hat`` to the error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, frame_counted, pack_header
from .kernels import kernels_for
from .packing import pack_bits, packed_nbytes, unpack_bits
from .quantize import (Rounded, check_int_range, check_numel, check_positive, check_rounding, finite_float64,
                       round_to_int)
from .rng import draw_key, mix32

__all__ = ["ModuloCodec", "centered_mod", "grid_hashes", "GRID_LIMIT", "modulo_range_error"]

_M32 = 0xFFFFFFFF
HASH_SALT = 0x9E3779B9
HASH_STEP = 0x9E3779B1  # position keys K_i = ((i HASH_STEP) ^ HASH_SALT) | 1 (mod 2^32): odd
HASH_HIGH = 0x85EBCA77  # the multiplier of m's high 32 bits
GRID_LIMIT = 2.0 ** 53  # |grid integer| beyond this: not exact in float64, verification could not tell


def centered_mod(z: torch.Tensor, a: float) -> torch.Tensor:
    """The paper's ``z mod a`` (eq. 1): the representative of ``z + a Z`` in
    ``[-a/2, a/2)``, element-wise, for ``a > 0``: ``z - a floor(z (1/a) + 1/2)``, moved
    back into the interval where rounding put it on an end."""
    r = z - a * torch.floor(z * (1.0 / a) + 0.5)
    return torch.where(r >= a / 2, r - a, torch.where(r < -a / 2, r + a, r))


def grid_hashes(m: torch.Tensor, block: int) -> torch.Tensor:
    """The 16-bit hash (int32 tensor) of each block of ``block`` consecutive grid
    integers ``m`` (int64): ``mix32`` of ``sum_i (lo_i K_i + hi_i HASH_HIGH) mod 2^32`` with
    ``lo_i``/``hi_i`` the low/high 32 bits of ``m_i`` and ``K_i`` odd position keys; the
    reference of the kernels' block hash. A block whose grid integers differ in one element
    changes its sum (K_i is odd and a wrong recovery moves ``m_i`` by less than 2^32); in
    several, the sums agree by chance about once in 2^32, and the 16-bit hashes once in 2^16."""
    i = torch.arange(m.numel(), dtype=torch.int64, device=m.device)
    lo, hi = m & _M32, (m >> 32) & _M32
    key = ((i * HASH_STEP) & _M32 ^ HASH_SALT) | 1
    e = ((lo * key) & _M32) + ((hi * HASH_HIGH) & _M32)
    nb = -(-m.numel() // block)
    sums = torch.nn.functional.pad(e, (0, nb * block - m.numel())).view(nb, block).sum(1) & _M32
    return (mix32(sums) & 0xFFFF).to(torch.int32)


def check_grid_reach(reach: float, B: float, levels: int) -> None:
    """An OverflowError when the grid integers of a decode reach ``reach`` (``levels`` times the
    largest lattice index ``|k|``) beyond 2^53, where they are no longer exact."""
    if reach > GRID_LIMIT:
        raise OverflowError(
            f"the grid integers reach {reach:.3g}, beyond 2^53 = {GRID_LIMIT:.3g}: the grid step "
            f"B_theta / 2^bits = {B / levels:.3g} is too fine for models this far from the origin, and "
            f"their hashes could not detect a wrong recovery. Raise theta at least {reach / GRID_LIMIT:.3g}-fold "
            "(with a margin: models move)")


def modulo_limit(B: float, levels: int) -> float:
    """The largest ``|x|`` (and ``|ref|``) the modulo codec takes: ``(2^53 / levels - 1) B``, where
    the grid integers ``x levels / B`` (give or take one window) stay exact in float64."""
    return (GRID_LIMIT / levels - 1.0) * B


def modulo_range_error(arg: str, amax: float, B: float, levels: int) -> ArithmeticError:
    """The error for ``|arg|`` reaching ``amax``, beyond :func:`modulo_limit`: a ValueError for the
    encode's ``x``, an OverflowError (as :func:`check_grid_reach`) for the decode's ``ref``."""
    msg = (f"{arg} is out of the modulo codec's range: |{arg}| reaches {amax:.6g}, beyond "
           f"{modulo_limit(B, levels):.6g} = (2^53 / 2^bits - 1) B_theta (B_theta = {B:.6g}, 2^bits = {levels}), "
           f"where the grid integers |{arg}| 2^bits / B_theta are no longer exact in float64 and the decode "
           "would be wrong: raise theta, or keep the values nearer the origin")
    return ValueError(msg) if arg == "x" else OverflowError(msg)


def _check_range(t: torch.Tensor, arg: str, B: float, levels: int) -> None:
    """The range check of the paths without a kernel flag (the reference; CUDA): one reduction
    (a second only where its max is beyond the range or a NaN, which would hide a value beyond it)."""
    if t.numel():
        lim = modulo_limit(B, levels)  # the CPU decode kernel's bound, to the bit
        if not float(t.detach().abs().max()) <= lim:
            a = t.detach().abs().to(torch.float64)
            far = a > lim  # a NaN is not beyond it
            if bool(far.any()):
                raise modulo_range_error(arg, float(a[far].max()), B, levels)


@dataclass(frozen=True)
class ModuloCodec(Rounded, Codec):
    """Moniqua's modulo quantizer: send only where ``x`` sits within a window of width
    ``B_theta``, and let the receiver, whose own value is close, find which window.

    In plain words: the sender writes each element as "window index + position inside the
    window" and sends only the position, quantized to ``bits`` bits. The receiver's own value
    ``y`` (its copy of the model) picks the window nearest to it. That works whenever the two
    values differ by less than ``theta`` in that element; then the error is at most
    ``delta * B_theta`` (Lemma 2 of the paper), however large ``x`` itself is.

    Parameters:
        bits: bits sent per element, 1 to 8 (``2^bits`` positions inside a window).
        theta: how far apart the sender's and the receiver's values may be, per element, for
            the receiver to decode correctly; the same unit as the values (model weights). A
            larger theta is safer but coarser: the window ``B_theta = 2 theta / (1 - 2 delta)``
            grows with it and so does the error. Moniqua picks it (``theta="auto"``) and checks
            it (verification); :class:`~lowbit.algorithms.Moniqua`'s docstring explains how.
        rounding: ``"stochastic"`` (unbiased, error bound ``delta = 2^-bits`` of the window) or
            ``"nearest"`` (``delta = 2^-(bits+1)``; the only choice at 1 bit).

    Range: ``|x|`` (encode) and ``|ref|`` (decode) at most ``(2^53 / 2^bits - 1) B_theta``
    (:func:`modulo_limit`; 7.1e12 at theta = 0.1 with 8 bits, 9.0e14 with 2 stochastic), where the grid integers
    are exact in float64. Beyond it encode raises ValueError naming ``x`` and decode
    OverflowError naming ``ref`` (as :meth:`decode_hashed` does): never a wrong decode.

    Kind SIDE_INFO: ``decode`` needs ``ref``, the receiver's own value ``y``.
    Header ``<i``: numel; data: codes in ``0..2^bits - 1`` packed ``bits`` each. A payload
    whose header count is not ``ref``'s (or ``numel``'s) or whose data is not exactly
    ``ceil(numel bits / 8)`` bytes is a PayloadError, before any kernel reads it.
    ``decode(payload, ref=y)`` returns ``x_hat`` of eq. (5) in ``y``'s dtype and
    on ``y``'s device; decoding against the sender's own ``x`` gives Algorithm 1
    line 4's local biased term, against the receiver's model line 5.
    """

    bits: int
    theta: float
    rounding: str = "stochastic"

    name = "modulo"
    kind = CodecKind.SIDE_INFO
    header_format = "i"

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int_range(self.bits, "bits", 1, 8))
        object.__setattr__(self, "theta", check_positive(self.theta, "theta"))
        check_rounding(self.rounding)
        if self.delta >= 0.5:
            raise ValueError(
                f"bits={self.bits} with rounding={self.rounding!r} gives delta={self.delta}, but Lemma 2 "
                "needs delta < 1/2 (B_theta = 2 theta / (1 - 2 delta)): use rounding='nearest' or bits >= 2"
            )

    @property
    def levels(self) -> int:
        """Number of points on the circle, ``2^bits``."""
        return 1 << self.bits

    @property
    def delta(self) -> float:
        """Error bound of ``Q_delta`` on the circle ``[-1/2, 1/2)`` (assumption (2))."""
        return 2.0 ** -self.bits if self.rounding == "stochastic" else 2.0 ** -(self.bits + 1)

    @property
    def B_theta(self) -> float:
        """``2 theta / (1 - 2 delta)``."""
        return 2 * self.theta / (1 - 2 * self.delta)

    @property
    def error_bound(self) -> float:
        """Lemma 2: ``|x_hat - x| <= delta * B_theta`` when ``|x - y| < theta``."""
        return self.delta * self.B_theta

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """Algorithm 1 line 3: ``q = Q_delta((x / B_theta) mod 1)``, sent as codes."""
        n = check_numel(x)
        K = kernels_for(x, "modulo")
        if K is None:
            return self.encode_reference(x, generator=generator)
        stochastic = self.rounding == "stochastic"
        if x.device.type != "cpu":  # the CPU kernel checks the range in its pass
            _check_range(x, "x", self.B_theta, self.levels)
        codes = K.modulo_encode(x, self.B_theta, self.levels, stochastic, draw_key(generator) if stochastic else 0)
        return Payload(header=pack_header(self.header_format, n, device=x.device), data=K.pack(codes, self.bits))

    def _frame(self, payload: Payload, ref: torch.Tensor | None, numel: int | None) -> int:
        """The payload's count ``n``, its frame checked (PayloadError): the header, ``n`` against
        ``numel`` and ``ref``'s length, the data's ``ceil(n bits / 8)`` bytes; ``ref`` checked."""
        return frame_counted(self, payload, numel, lambda n: packed_nbytes(n, self.bits),
                             lambda n: f"{n} codes of {self.bits} bits", ref=ref,
                             ref_needs="ModuloCodec: the receiver's own model y with |x - y| < theta")

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, numel: int | None = None) -> torch.Tensor:
        """Eq. (5): ``x_hat = (q B_theta - y) mod B_theta + y`` with ``y = ref``."""
        n = self._frame(payload, ref, numel)
        K = kernels_for(ref, "modulo")
        if K is None:
            return self.decode_reference(payload, ref=ref)
        if ref.device.type != "cpu":  # the CPU kernel checks the range in its pass
            _check_range(ref, "ref", self.B_theta, self.levels)
        codes = K.unpack(payload.data.to(ref.device), self.bits, n)
        return K.modulo_decode(codes, self.B_theta, self.levels, ref)

    def decode_hashed(self, payload: Payload, *, ref: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode`, and the 16-bit hash of each block of ``block`` elements of the
        decoded point's grid integers ``m`` (``x_hat = m B_theta / 2^bits`` up to rounding;
        ``m = code - 2^bits k`` for the lattice index ``k`` eq. (5) picks): two ends that
        decoded a block alike have the same hash. The hashes come back as an int32 CPU
        tensor. OverflowError when ``2^bits |k|`` exceeds 2^53 (the grid integers, and the
        decoded values as grid points, are then not exact in float64, and equal hashes
        would prove nothing)."""
        n = self._frame(payload, ref, None)
        K = kernels_for(ref, "modulo")
        if K is None:
            return self.decode_hashed_reference(payload, ref=ref, block=block)
        return K.modulo_decode_hash(payload.data.to(ref.device), self.bits, n, self.B_theta, self.levels, ref, block)

    def decode_hashed_reference(self, payload: Payload, *, ref: torch.Tensor,
                                block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 whole-tensor reference of :meth:`decode_hashed`."""
        n = self._frame(payload, ref, None)
        codes = unpack_bits(payload.data.to(ref.device), self.bits, n)
        B = self.B_theta
        z = codes.to(torch.float64) * (B / self.levels) - ref.detach().to(torch.float64)
        k = torch.floor(z * (1.0 / B) + 0.5)
        r = z - B * k
        up, down = r >= B / 2, r < -B / 2
        r = torch.where(up, r - B, torch.where(down, r + B, r))
        k = k + up.to(k.dtype) - down.to(k.dtype)
        if n:
            check_grid_reach(float(k.abs().max()) * self.levels, self.B_theta, self.levels)
        x_hat = (r + ref.detach().to(torch.float64)).to(ref.dtype)
        return x_hat, grid_hashes(codes - self.levels * k.to(torch.int64), block).cpu()

    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (same bytes on the CPU)."""
        n, x64 = finite_float64(x, "modulo")
        _check_range(x64, "x", self.B_theta, self.levels)
        z = centered_mod(x64 * (1.0 / self.B_theta), 1.0)
        c = round_to_int(z * self.levels, self.rounding, generator)
        codes = torch.remainder(c, self.levels).to(torch.int64)
        return Payload(header=pack_header(self.header_format, n, device=x.device), data=pack_bits(codes, self.bits))

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
        n = self._frame(payload, ref, numel)
        _check_range(ref, "ref", self.B_theta, self.levels)
        codes = unpack_bits(payload.data.to(ref.device), self.bits, n)
        B = self.B_theta
        q = codes.to(torch.float64) * (B / self.levels)
        y = ref.detach().to(torch.float64)
        return (centered_mod(q - y, B) + y).to(ref.dtype)
