"""Reference codecs to compare lowbit's against: plain torch, computed the way the
papers' public code computes them (written here from those descriptions).

Each reference sends what that code sends: unpacked int8 / uint8 / bool codes
or floats, plus float32 scales. None packs bits, none validates its input
beyond what torch does, and all compute in the input's dtype (float32 here).

* :class:`QSGDReference` -- GRACE's QSGD: ``norm = ||x||_2``; the level
  ``|x_i| / norm * s`` is rounded down or up with probability its fractional
  part; the signed level is sent as int8 (``s < 128``) with the float32 norm.
* :class:`TernGradReference` -- GRACE's TernGrad: clip to ``2.5`` standard
  deviations (the paper's Section 3.3), ``scale = max |g|``, keep ``sign(g_i)``
  with probability ``|g_i| / scale``; int8 ternary codes plus the float32 scale.
  (lowbit's TernGradCodec does not clip: the reference does that extra work.)
* :class:`SignSGDReference` -- GRACE's signSGD: ``x_i >= 0`` as a bool tensor
  (one byte each); decode ``2 b - 1``.
* :class:`QSGDMaxNormReference` -- the max-norm paper's QSGDMaxNorm for one
  worker: ``W = ||x||_2``, ``s = 2^(bits-1) - 1`` levels, stochastic rounding of
  ``s |x_i| / W``; int8 signed codes plus the float32 ``W``.
* :class:`GlobalRandKMaxNormReference` -- the max-norm paper's GlobalRandKMaxNorm for one
  worker: the ``k`` coordinates ``torch.randperm(d)[:k]`` of a generator seeded alike on
  every worker, QSGDMaxNorm on them (int8 codes plus the float32 ``W``, and the int32 ``d``);
  the receiver draws the same permutation again to scatter the values back, times ``d / k``.
* :class:`MoniquaReference` -- PowerGossip-style Moniqua: ``B = 2 theta / (1 - 2
  delta)``, ``delta = 2^-bits``; codes ``floor(L ((x / B) mod 1) + u) mod L`` with
  ``L = 2^bits`` as uint8; the receiver with ``y`` returns
  ``y + ((q B / L - y + B/2) mod B) - B/2``.
* :class:`HalfReference` -- torch's ``fp16_compress_hook`` compute: ``x.to(float16)``,
  and back with ``buffer.copy_(h)`` into a buffer kept from call to call (the hook
  decompresses in place into the bucket's buffer). The hook also divides the fp16
  tensor by the world size (``div_``): that is the averaging, which lowbit does
  outside its codec (its DDP hook divides ``x`` before encoding), so it is left out
  of both sides.
* :class:`PowerSGDReference` -- torch's ``powerSGD_hook`` compute for one worker:
  ``M`` the ``n x m`` matrix view (lowbit's layout), ``P = M Q``, orthogonalize
  ``P`` with torch's own ``_orthogonalize`` helper, ``Q = M^T P``, decode
  ``P Q^T``, in float32, with ``Q`` kept from call to call (the hook's warm
  start).

The interface: ``encode(x, generator=g)`` returns the wire as a tuple of
tensors, ``decode(wire, ref=None)`` the reconstruction, :func:`wire_nbytes` the
bytes the tuple would occupy on the wire.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

__all__ = ["Reference", "QSGDReference", "TernGradReference", "SignSGDReference", "QSGDMaxNormReference",
           "GlobalRandKMaxNormReference", "MoniquaReference", "HalfReference", "PowerSGDReference", "wire_nbytes"]

Wire = tuple[torch.Tensor, ...]


def wire_nbytes(wire: Wire) -> int:
    """Bytes the reference's tensors occupy as sent (``numel * element_size`` each)."""
    return sum(t.numel() * t.element_size() for t in wire)


class Reference(ABC):
    """A reference codec: ``name``, ``encode(x, generator=)``, ``decode(wire, ref=)``;
    ``needs_ref``: decode needs the receiver's own value (Moniqua)."""

    name = "reference"
    needs_ref = False

    @abstractmethod
    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Wire:
        """The wire: a tuple of tensors."""

    @abstractmethod
    def decode(self, wire: Wire, *, ref: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction of ``encode``'s input."""


def _stochastic_levels(scaled: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``floor(scaled)`` plus one with probability ``scaled - floor(scaled)`` (in place on a copy)."""
    low = scaled.floor()
    u = torch.rand(scaled.shape, generator=generator, dtype=scaled.dtype, device=scaled.device)
    return low.add_((u < scaled - low).to(scaled.dtype))


class _NormLevels(Reference):
    """QSGD's code, as both QSGD papers write it: ``sign(x) * level`` (int8), the level of
    ``|x| / ||x||_2 * levels`` rounded stochastically, and the L2 norm; decoded as
    ``codes * norm / levels``. A subclass says its ``levels``."""

    def encode(self, x, *, generator=None):
        norm = torch.linalg.vector_norm(x)
        lv = _stochastic_levels(x.abs() / norm * self.levels, generator)
        return (lv.mul_(x.sign()).to(torch.int8), norm.reshape(1))

    def decode(self, wire, *, ref=None):
        codes, norm = wire
        return codes.to(norm.dtype) * (norm / self.levels)


def _check_levels(levels: int, name: str, hi: int) -> int:
    if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= hi:
        raise ValueError(f"{name} must be an integer in [1, {hi}] (int8 codes), got {levels!r}")
    return levels


@dataclass(frozen=True)
class QSGDReference(_NormLevels):
    levels: int
    name = "GRACE QSGD"

    def __post_init__(self) -> None:
        _check_levels(self.levels, "levels", 127)



@dataclass(frozen=True)
class TernGradReference(Reference):
    clip_sigmas: float = 2.5
    name = "GRACE TernGrad"

    def encode(self, x, *, generator=None):
        c = self.clip_sigmas * torch.sqrt(((x - x.mean()) ** 2).mean())
        g = torch.maximum(torch.minimum(x, c), -c)
        mag = g.abs()
        scale = mag.max()
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device) * scale
        codes = torch.where(u < mag, g.sign(), torch.zeros((), dtype=x.dtype, device=x.device))
        return (codes.to(torch.int8), scale.reshape(1))

    def decode(self, wire, *, ref=None):
        codes, scale = wire
        return codes.to(scale.dtype) * scale


@dataclass(frozen=True)
class SignSGDReference(Reference):
    name = "GRACE signSGD"

    def encode(self, x, *, generator=None):
        return (x >= 0,)

    def decode(self, wire, *, ref=None):
        (b,) = wire
        return b.to(torch.float32) * 2 - 1


@dataclass(frozen=True)
class QSGDMaxNormReference(_NormLevels):
    bits: int
    name = "max-norm paper QSGDMaxNorm"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in [2, 8] (int8 codes), got {self.bits!r}")

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1


@dataclass(frozen=True)
class GlobalRandKMaxNormReference(Reference):
    bits: int
    k: int
    seed: int = 1
    name = "max-norm paper GlobalRandK"

    def __post_init__(self) -> None:
        QSGDMaxNormReference(self.bits)  # validates bits
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")

    def _indices(self, d: int, device) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)  # the step's seed, shared by every worker
        return torch.randperm(d, generator=g)[:min(self.k, d)].to(device)

    def encode(self, x, *, generator=None):
        idx = self._indices(x.numel(), x.device)
        codes, W = QSGDMaxNormReference(self.bits).encode(x[idx], generator=generator)
        return (codes, W, torch.tensor([x.numel()], dtype=torch.int32))

    def decode(self, wire, *, ref=None):
        codes, W, d = wire
        d = int(d)
        idx = self._indices(d, codes.device)
        out = torch.zeros(d, dtype=W.dtype, device=codes.device)
        out[idx] = QSGDMaxNormReference(self.bits).decode((codes, W)) * (d / idx.numel())
        return out


@dataclass(frozen=True)
class MoniquaReference(Reference):
    bits: int
    theta: float
    name = "PowerGossip Moniqua"
    needs_ref = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in [2, 8] (uint8 codes, delta = 2^-bits < 1/2), "
                             f"got {self.bits!r}")
        if not (isinstance(self.theta, (int, float)) and 0 < self.theta < math.inf):
            raise ValueError(f"theta must be a finite number > 0, got {self.theta!r}")

    @property
    def B(self) -> float:
        return 2 * self.theta / (1 - 2 * 2.0 ** -self.bits)

    def encode(self, x, *, generator=None):
        L = 1 << self.bits
        z = torch.remainder(x / self.B, 1.0) * L
        return (torch.remainder(_stochastic_levels(z, generator), L).to(torch.uint8),)

    def decode(self, wire, *, ref=None):
        if ref is None:
            raise ValueError("MoniquaReference.decode needs ref, the receiver's own model y")
        (codes,) = wire
        B, L = self.B, 1 << self.bits
        q = codes.to(ref.dtype) * (B / L)
        return torch.remainder(q - ref + B / 2, B).sub_(B / 2).add_(ref)


@dataclass
class HalfReference(Reference):
    """Decodes into a float32 buffer kept between calls (the hook's bucket buffer)."""

    name = "torch fp16_compress_hook"
    _buffer: torch.Tensor | None = field(default=None, repr=False)

    def encode(self, x, *, generator=None):
        return (x.to(torch.float16),)

    def decode(self, wire, *, ref=None):
        (h,) = wire
        if self._buffer is None or self._buffer.shape != h.shape or self._buffer.device != h.device:
            self._buffer = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        return self._buffer.copy_(h)


@dataclass
class PowerSGDReference(Reference):
    """Keeps ``Q`` between calls (the hook's warm start); its first ``Q`` is drawn from
    the first ``encode``'s generator, standard normal, as the hook draws it."""

    rank: int
    name = "torch powerSGD_hook"
    _q: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {self.rank!r}")

    def encode(self, x, *, generator=None):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        from ..codecs.powersgd import matrix_shape

        N = x.numel()
        n, m = matrix_shape(N)
        r = min(self.rank, n, m)
        if self._q is None or self._q.shape != (m, r) or self._q.device != x.device:
            self._q = torch.randn(m, r, generator=generator, dtype=x.dtype,
                                  device=generator.device if generator is not None else "cpu").to(x.device)
        M = torch.nn.functional.pad(x, (0, n * m - N)).view(n, m)
        P = M @ self._q
        _orthogonalize(P.unsqueeze(0))  # in place, torch's helper (Gram-Schmidt for rank <= 2, else QR)
        Q = M.t() @ P
        self._q = Q
        return (P, Q, torch.tensor([N], dtype=torch.int32))

    def decode(self, wire, *, ref=None):
        P, Q, N = wire
        return (P @ Q.t()).flatten()[: int(N[0])]
