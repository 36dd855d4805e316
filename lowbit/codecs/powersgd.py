"""PowerSGD's low-rank compressor (Vogels, Karimireddy, Jaggi, "PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization",
NeurIPS 2019), Algorithm 1 for a single worker:

    P = M Q_prev;   P = orthogonalize(P);   Q = M^T P;   M_hat = P Q^T,

one step of subspace (power) iteration, warm-started from the previous step's
``Q``. Since ``P`` has orthonormal columns, ``M_hat = P P^T M`` is the
projection of ``M`` onto ``span(P)``, so ``||M_hat - M|| <= ||M||``; with warm
starts the subspace converges to the top-``r`` singular subspace of a slowly
changing ``M``.

Matrix layout. A flat vector of ``N`` elements is viewed, row-major, as an
``n x m`` matrix with ``n = ceil(sqrt(N))`` rows and ``m = ceil(N / n)``
columns, zero-padded at the end (``n * m - N < n`` zeros); ``decode`` crops
them. The rank used is ``r_eff = min(rank, n, m)`` (a larger rank cannot
capture more). :meth:`PowerSGDCodec.matrix_shape` gives ``(n, m, r_eff)``.

Distributed use. In the paper the workers all-reduce ``P`` (before
orthogonalizing) and then ``Q`` separately, two rounds of communication,
so that the average of the compressed matrices is exact and linear. That
protocol belongs to the algorithm layer; this codec is the point-to-point
version (each payload carries one worker's ``P`` and ``Q``), and
:meth:`PowerSGDCodec.factors` exposes them for that layer.

Precision. The fast path (the default for float32 and half inputs) computes in
float32, as torch's ``powerSGD_hook`` does: ``P = M Q`` and ``Q = M^T P`` are
float32 matrix products read straight from x (the zero padding touches only
the last partial row: no copy of M), the orthogonalization a float32 reduced
QR, and finiteness is checked on the small factors (a NaN or inf in x makes
them non-finite; a float32 overflow with finite x falls back to the float64
reference, which says when Q does not fit float32). Compared with the float64
reference (``encode_with_state_reference``/``decode_reference``, used for
float64 inputs), each factor entry carries a relative error of order
``eps32 sqrt(N)`` (float32 dot products over a row or column), and ``decode``
(float32 ``P Q^T``) adds ``r eps32 max|P||Q|`` per element; the projection
property ``||M_hat|| <= ||M||`` holds up to that rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Codec, CodecKind, Payload, PayloadError, frame_count, frame_header, frame_nbytes, pack_header
from .kernels import cpu_kernels, empty_output, fast_backend
from .quantize import INT32_MAX, check_int_range, check_numel, finite_float64

__all__ = ["PowerSGDCodec", "matrix_shape", "orthogonalize", "times_thin", "transpose_times_thin"]

_F32_MAX = float(torch.finfo(torch.float32).max)
#: ``|P_ij| <= 1`` for orthonormal columns; this much more is float32 QR's rounding
P_SLACK = 1e-3
#: :func:`times_thin` computes ``M q`` as one matrix-vector product per column up to this rank
MV_RANK = 3


# PowerSGD's two products with a thin factor, computed so that the BLAS streams M row by row
# in its own row-major layout. On one thread (MKL sgemm), for a 1000 x 1000 float32 M at
# rank 2: ``M @ q`` 1.1 ms and ``M.T @ P`` 1.2-1.4 ms, against 0.2 ms for one matrix-vector
# product per column of q (``q^T M^T`` is faster from rank 4) and 0.15 ms for ``(P^T M)^T``;
# a 4096 x 1024 M: ``M.T @ P`` 25.9 ms, ``(P^T M)^T`` 0.89 ms. Used by the codec, the
# algorithm and the DDP hook alike.

def times_thin(M: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``M q`` for an ``n x m`` matrix ``M`` and a thin ``m x r`` ``q`` of ``M``'s dtype."""
    r = q.shape[1]
    if r <= MV_RANK:
        qt = q.T.clone(memory_format=torch.contiguous_format)
        return torch.stack([M @ qt[k] for k in range(r)], dim=1)
    return (q.T @ M.T).T


def transpose_times_thin(M: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``M^T P`` for an ``n x m`` matrix ``M`` and a thin ``n x r`` ``P`` of ``M``'s dtype."""
    return (P.T @ M).T


def orthogonalize(P: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``P``: the ``Q`` of its reduced QR, in ``P``'s dtype (the codec
    orthogonalizes in float32 on its fast path and float64 in its reference; the PowerSGD
    algorithm and hook pass float64)."""
    return torch.linalg.qr(P, mode="reduced").Q


def _fast_path_on() -> bool:
    """False under ``codec_path("reference")`` / ``LOWBIT_CODEC_PATH=reference``."""
    return fast_backend(torch.empty(0)) is not None


def matrix_shape(numel: int) -> tuple[int, int]:
    """``(n, m)``: ``n = ceil(sqrt(numel))`` rows, ``m = ceil(numel / n)`` columns
    (``(0, 0)`` for an empty vector)."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if numel == 0:
        return 0, 0
    n = math.isqrt(numel - 1) + 1  # ceil(sqrt(numel))
    return n, -(-numel // n)


@dataclass(frozen=True)
class PowerSGDCodec(Codec):
    """Rank-``rank`` PowerSGD compression of a flat vector.

    Header ``<i``: numel. Data: ``P`` (``n x r_eff``) then ``Q``
    (``m x r_eff``), row-major float32, so ``nbytes = 4 + 4 (n + m) r_eff``.
    ``decode = (P Q^T).flatten()[:numel]``, computed in float64 from the
    float32 factors, returned as float32 unless ``dtype`` is given.

    Warm start. The step needs the previous ``Q`` (state). It is explicit:

    * ``init_state(numel, generator)`` draws ``Q0`` (``m x r_eff``, i.i.d.
      standard normal, float32), as the paper does at the first step;
    * ``encode_with_state(x, state=Q, generator=g)`` returns
      ``(payload, new_Q)``; ``new_Q`` is the float32 ``Q`` that was sent,
      i.e. exactly what the receiver has, to pass as ``state`` next time.
      ``state=None`` draws a fresh ``Q0`` from ``generator``;
    * plain ``encode(x, generator=g)`` is ``encode_with_state(x, None, g)[0]``:
      one power step from a random start (a cold start, always usable but
      less accurate than warm-started steps).

    The compressor is biased (and deterministic given ``Q``); the paper uses
    it with error feedback, which the algorithm layer holds. Orthogonalization
    is a reduced QR (Householder), which also copes with rank-deficient ``P``
    (e.g. ``M = 0``). Non-finite inputs and factors beyond float32 raise ValueError.

    Range: finite ``x`` whose factor ``Q`` satisfies ``r_eff (1 + P_SLACK) max |Q| <=``
    float32's largest value (:meth:`q_limit`), so that no entry of ``P Q^T`` can overflow
    (``|P_ij| <= 1``: orthonormal columns); encode raises ValueError naming ``x`` beyond.
    Decode checks the frame first: the header, the count against ``numel`` (without it, at
    most :data:`~lowbit.codecs.base.MAX_DECODE_NUMEL`: the factors' ``4 (n + m) r`` bytes do
    not bound ``n m``), the factors' length, ``P`` finite within ``1 + P_SLACK`` and ``Q``
    finite within :meth:`q_limit`; a PayloadError otherwise.
    """

    rank: int

    name = "powersgd"
    kind = CodecKind.PLAIN
    unbiased = False
    header_format = "i"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", check_int_range(self.rank, "rank", 1, INT32_MAX))

    @property
    def bits(self) -> float:
        """Nominal: the factors are float32. The real rate per element is
        :meth:`bits_for` (``32 (n + m) r_eff / numel``), a function of numel."""
        return 32.0

    def matrix_shape(self, numel: int) -> tuple[int, int, int]:
        """``(n, m, r_eff)`` used for a vector of ``numel`` elements."""
        n, m = matrix_shape(numel)
        return n, m, min(self.rank, n, m)

    def q_limit(self, numel: int) -> float:
        """The largest ``|Q_ij|`` of this codec's range: float32's largest value over
        ``r_eff (1 + P_SLACK)``."""
        return _F32_MAX / (max(1, self.matrix_shape(numel)[2]) * (1 + P_SLACK))

    def data_nbytes(self, numel: int) -> int:
        """Bytes of the factors: ``4 (n + m) r_eff``."""
        n, m, r = self.matrix_shape(numel)
        return 4 * (n + m) * r

    def bits_for(self, numel: int) -> float:
        """Data bits per element for a vector of ``numel`` elements."""
        return 8.0 * self.data_nbytes(numel) / numel if numel else 0.0

    def init_state(self, numel: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """A fresh ``Q0``: ``m x r_eff`` standard normal float32, drawn on the
        generator's device (CPU by default) and moved to ``device``."""
        _, m, r = self.matrix_shape(numel)
        gen_device = generator.device if generator is not None else "cpu"
        q = torch.randn(m, r, generator=generator, dtype=torch.float32, device=gen_device)
        return q if device is None else q.to(device)

    def _check_state(self, state: torch.Tensor, m: int, r: int) -> None:
        if not isinstance(state, torch.Tensor) or not state.is_floating_point():
            raise TypeError(f"state must be a floating-point torch.Tensor (the previous Q), got {type(state).__name__}")
        if tuple(state.shape) != (m, r):
            raise ValueError(f"state must be the previous Q of shape ({m}, {r}) for this numel, got {tuple(state.shape)}")
        if not bool(torch.isfinite(state).all()):
            raise ValueError("state must be finite")

    @staticmethod
    def _fast(x: torch.Tensor) -> bool:
        """The float32 path: float32/half inputs while the codecs' fast path is on (plain torch
        ops, so every device and tensor type computes the same float32 result)."""
        return x.dtype in (torch.float32, torch.float16, torch.bfloat16) and _fast_path_on()

    def encode_with_state(self, x: torch.Tensor, state: torch.Tensor | None = None, *,
                          generator: torch.Generator | None = None) -> tuple[Payload, torch.Tensor]:
        """One warm-started power step: ``(payload, new_state)`` (see the class doc)."""
        N = check_numel(x)
        if N == 0 or not self._fast(x):
            return self.encode_with_state_reference(x, state, generator=generator)
        n, m, r = self.matrix_shape(N)
        if state is None:
            state = self.init_state(N, generator, device=x.device)
        else:
            self._check_state(state, m, r)
        x32 = x.detach().to(torch.float32).contiguous()
        q = state.detach().to(device=x.device, dtype=torch.float32)
        rows = N // m  # complete rows, read in place; the rest (< 2 rows) is zero-padded
        top = x32[: rows * m].view(rows, m)
        tail = torch.zeros((n - rows) * m, dtype=torch.float32, device=x.device)
        tail[: N - rows * m] = x32[rows * m:]
        tail = tail.view(n - rows, m)
        # P = M Q_prev and Q = M^T P, products that stream M row by row (times_thin; Q as
        # P^T M, transpose_times_thin's form, over the two pieces at once)
        row_major = torch.contiguous_format
        P = torch.cat([times_thin(top, q), times_thin(tail, q)])
        P = orthogonalize(P).clone(memory_format=row_major)
        Q = torch.addmm(P[rows:].T @ tail, P[:rows].T, top).T.clone(memory_format=row_major)
        if not bool(torch.isfinite(P).all() & (Q.abs() <= self.q_limit(N)).all()):  # the one host read
            if not bool(torch.isfinite(x).all()):
                raise ValueError("x must be finite for the PowerSGD codec")
            return self.encode_with_state_reference(x, state, generator=generator)  # float32 overflow, range
        header = pack_header(self.header_format, N, device=x.device)
        data = torch.cat([P.reshape(-1), Q.reshape(-1)]).view(torch.uint8)
        return Payload(header=header, data=data), Q

    def encode_with_state_reference(self, x: torch.Tensor, state: torch.Tensor | None = None, *,
                                    generator: torch.Generator | None = None) -> tuple[Payload, torch.Tensor]:
        """The float64 reference of :meth:`encode_with_state`."""
        N, x64 = finite_float64(x, "PowerSGD")
        n, m, r = self.matrix_shape(N)
        header = pack_header(self.header_format, N, device=x.device)
        if N == 0:
            empty = torch.empty(0, dtype=torch.uint8, device=x.device)
            return Payload(header=header, data=empty), torch.empty(0, 0, dtype=torch.float32, device=x.device)
        if state is None:
            state = self.init_state(N, generator, device=x.device)
        else:
            self._check_state(state, m, r)
        M = torch.nn.functional.pad(x64, (0, n * m - N)).view(n, m)
        P = M @ state.detach().to(device=x.device, dtype=torch.float64)
        P = orthogonalize(P)
        P32 = P.to(torch.float32)
        Q = M.T @ P32.to(torch.float64)  # with the P the receiver sees
        if float(Q.abs().max()) > self.q_limit(N):
            raise ValueError(f"x is out of the PowerSGD codec's range: the factor Q = M^T P reaches "
                             f"{float(Q.abs().max()):.6g}, beyond {self.q_limit(N):.6g} = float32's largest value / "
                             f"(rank {r} (1 + {P_SLACK})): it, or P Q^T, does not fit float32 (|x| too large)")
        Q32 = Q.to(torch.float32)
        data = torch.cat([P32.reshape(-1), Q32.reshape(-1)]).view(torch.uint8)
        return Payload(header=header, data=data), Q32.clone()

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """A cold-start step: ``Q0`` is drawn from ``generator``."""
        return self.encode_with_state(x, None, generator=generator)[0]

    def _frame(self, payload: Payload, numel: int | None) -> tuple[int, int, int, int]:
        """``(N, n, m, r_eff)``: the payload's count and matrix shape, its header, count and data
        length checked (PayloadError)."""
        (N,) = frame_header(self, payload)
        frame_count(self, N, numel, bounded=False)
        n, m, r = self.matrix_shape(N)
        frame_nbytes(self, payload.data, 4 * (n + m) * r,
                     lambda: f"the float32 factors of {N} elements ({n}x{m}, rank {r})")
        return N, n, m, r

    def factors(self, payload: Payload, numel: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 factors ``(P, Q)`` (``n x r_eff``, ``m x r_eff``) of a payload, its frame
        checked (PayloadError; ``numel``: the count the receiver expects)."""
        return self._factors(payload, numel)[:2]

    def _factors(self, payload: Payload, numel: int | None, K=None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:meth:`factors` and the count ``N``; ``K``: the CPU kernels where the fast path runs."""
        N, n, m, r = self._frame(payload, numel)
        f = payload.data.clone().view(torch.float32)
        nr = n * r
        if N:
            # (n + m) r values within P's and Q's bounds, compared as float64 (a NaN fails every
            # comparison): on the CPU's fast path one kernel call (about a microsecond), else four
            # numpy reductions (a few; torch's small-tensor calls cost several times more), on
            # other devices one host read
            p_lim, q_lim = 1 + P_SLACK, _F32_MAX / (r * (1 + P_SLACK))  # q_lim: q_limit(N)
            if f.device.type == "cpu" and K is not None:
                ok = K.within(f, nr, p_lim, q_lim)
            elif f.device.type == "cpu":
                a = f.numpy()
                p, q = a[:nr], a[nr:]
                ok = (float(p.max()) <= p_lim and -p_lim <= float(p.min()) and float(q.max()) <= q_lim
                      and -q_lim <= float(q.min()))
            else:
                a = f.abs()
                pmax, qmax = torch.stack([a[:nr].max(), a[nr:].max()]).tolist()
                ok = pmax <= p_lim and qmax <= q_lim
            if not ok:
                a = f.abs()
                pmax, qmax = float(a[:nr].max()), float(a[nr:].max())
                raise PayloadError(self.name, f"factors P within 1 + {P_SLACK} (orthonormal columns) and Q within "
                                   f"{q_lim:.6g}, finite", f"P up to {pmax!r}, Q up to {qmax!r}")
        return f[:nr].view(n, r), f[nr:].view(m, r), N

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        """``(P Q^T).flatten()[:numel]``: float32 products for a float32 result on the fast
        path, else the float64 reference."""
        if dtype not in (None, torch.float32) or not _fast_path_on():
            return self.decode_reference(payload, dtype=dtype, numel=numel)
        P, Q, N = self._factors(payload, numel, cpu_kernels())
        out = empty_output(P.shape[0] * Q.shape[0], torch.float32, P.device).view(P.shape[0], Q.shape[0])
        return torch.mm(P, Q.t(), out=out).reshape(-1)[:N]

    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 reference of :meth:`decode`."""
        P, Q, N = self._factors(payload, numel)
        x = (P.to(torch.float64) @ Q.to(torch.float64).T).reshape(-1)[:N]
        return x.to(torch.float32 if dtype is None else dtype)
