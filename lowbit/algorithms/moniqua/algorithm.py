"""Moniqua's algorithm: Algorithm 1 of the paper, one worker's step, with the slack matrix of
Theorem 3 (``gamma``), shared randomness and the 1-bit shared dither (section 6).

The step is :meth:`Moniqua.before_update`; each line of Algorithm 1 is marked where it is
computed. Line 6 lives in :func:`mix` alone: on the fast path the one-call receive kernel
(``moniqua_receive`` of :mod:`lowbit.codecs.kernels`) adds each neighbour's term of the same
sum while it decodes (``tests/test_fastpath.py`` checks it is this arithmetic, bit for bit),
and :func:`mix` then adds ``gamma`` times the sum to the model.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import numpy as np
import torch

from ...codecs import ModuloCodec
from ...codecs.entropy import ENTROPY_METHODS
from ...codecs.rng import shared_generator
from ..base import GossipAlgorithm, State, transient
from ..config import BITS, GAMMA, ROUNDING, Option, reads
from . import theta as th
from .frame import ModuloFrame
from .theta import THETA_EVERY, THETA_EVERY_OPT, THETA_OPT, THETA_SCHEDULE_OPT
from .verify import VERIFY_BLOCK_OPT, VERIFY_OPT, Heard, Sent, default_verify_block, mismatch_note, receive, repair

#: R of :func:`default_gamma`: the rounding noise allowed per unit of theta / s, at 1 bit and above
GAMMA_NOISE_1BIT = 0.4
GAMMA_NOISE = 0.75
#: ... and above 1 bit without shared randomness, where independent rounding adds noise even between equal models
GAMMA_NOISE_INDEPENDENT = 0.5


def _check_entropy(entropy) -> None:
    if entropy is None:
        return
    if entropy not in ENTROPY_METHODS:
        raise ValueError(f"entropy must be None or one of {ENTROPY_METHODS}, got {entropy!r}")
    if entropy == "ans" and importlib.util.find_spec("constriction") is None:
        raise ValueError("entropy='ans' needs the optional 'constriction' package (pip install constriction); "
                         "zlib, bz2 and lzma need nothing extra")


SHARED_RANDOMNESS_OPT = Option("shared_randomness", True, "Moniqua: all workers use the same stochastic-rounding "
                               "offsets each step", bool)
ENTROPY_OPT = Option("entropy", None, "entropy-code Moniqua's payload: zlib, bz2, lzma or ans", str | None,
                     _check_entropy)


def default_gamma(codec: ModuloCodec, W, shared: bool = True) -> float:
    """The slack matrix's gamma when none is given: ``min(1, g / (1 - lambda_min(W)))`` with
    ``g = 2 r / (1 + r)``, ``r = R theta / s``, ``s = B_theta / 2^bits`` the grid step and R =
    :data:`GAMMA_NOISE` (:data:`GAMMA_NOISE_1BIT` at 1 bit, :data:`GAMMA_NOISE_INDEPENDENT` above
    1 bit when the rounding is not ``shared``).

    Why: with shared randomness, xh_j - xh_i is x_j - x_i rounded to a grid step s, so line 6
    adds to the models' differences a noise of variance about gamma^2 s |x_j - x_i| per step.
    On W's eigenvector of eigenvalue lambda, a difference is multiplied by 1 - g' (g' = gamma
    (1 - lambda)) and the noise kept has g' / (2 - g') times one step's variance: unbounded as g'
    nears 2, largest at lambda_min(W). This gamma holds g' / (2 - g') at r on that mode, so the
    noise's distance stays well inside theta (past it no theta is large enough, and
    ``theta="auto"`` runs away). 1 where W mixes nothing (one worker: W = [[1]])."""
    R = GAMMA_NOISE_1BIT if codec.bits == 1 else GAMMA_NOISE if shared else GAMMA_NOISE_INDEPENDENT
    r = R * codec.theta * codec.levels / codec.B_theta
    gap = 1.0 - float(np.linalg.eigvalsh(np.asarray(W, dtype=np.float64)).min())
    return min(1.0, (2.0 * r / (1.0 + r)) / gap) if gap > 0 else 1.0


def default_rounding(bits: int) -> str:
    """Stochastic rounding (the paper's experiments), except at 1 bit where only
    nearest rounding has delta < 1/2."""
    return "nearest" if bits == 1 else "stochastic"


@dataclass
class MoniquaSaved(State):
    """What a Moniqua worker checkpoints: scalars only (Table 1 of the paper: no extra tensor)."""

    # theta; theta_k = theta alpha_k / alpha_0 when it follows alpha_k; None until "auto" sets it
    theta: float | None = None
    theta_start: float | None = None  # theta="auto": theta_0
    lr0: float | None = None  # alpha_0
    # theta="auto": the blocks recovered wrong, and checked, since the last agreement
    window: list[int] = field(default_factory=lambda: [0, 0])
    # neighbour -> its blocks I recovered wrong at the last step (asked for and repaired at this one)
    nack: dict[int, list[int]] = field(default_factory=dict)
    mismatches: int = 0  # wrong blocks this worker detected (and did not use)
    mismatched_messages: int = 0  # messages with at least one wrong block
    floor: float = 0.0  # theta="auto": the floor agreed at the last agreement (0: none yet, or none binds)

    def _load_extra(self, extra: dict) -> None:
        if extra.get("pending_alarms") or extra.get("theta_doublings"):
            raise ValueError("moniqua state_dict: a checkpoint of a run with grow_theta (theta doubled on alarms), "
                             "an option lowbit no longer has; it cannot be resumed")
        super()._load_extra(extra)


@dataclass
class MoniquaState(MoniquaSaved):
    """A Moniqua worker's memory between steps: what it checkpoints (:class:`MoniquaSaved`), then
    the caches :meth:`Moniqua.init` derives from the options and the context (never saved)."""

    gamma: float = transient(default=1.0)  # the slack matrix's gamma: the option, or default_gamma of this W
    frame: ModuloFrame | None = transient(default=None)  # this worker's message format
    codec: ModuloCodec | None = transient(default=None)  # the codec of the last theta_k (validated once per theta_k)
    own_floor: float = transient(default=0.0)  # theta="auto": this worker's theta_floor at an agreement
    degrees: tuple[int, int] = transient(default=(0, 0))  # (my neighbours, all workers' neighbours summed)


def mix(gamma: float, ctx, x: torch.Tensor, sent: Sent, heard: Heard, exact: dict) -> None:
    """Line 6 with the slack matrix: x += gamma sum_j W_ji (xh_{k,j} - xh_{k,i}), block by block
    where a block was wrong (left out) or repaired ((x_j - x_i) from the repair instead).

    A neighbour with such blocks adds its term to every element and then puts the elements of
    those blocks back: the sum ``delta`` starts at +0 and never holds -0, so leaving a term out
    there is adding a zero, and the work on those blocks is their size, not the model's."""
    delta = heard.delta
    if not heard.mixed or exact:  # else the one-call kernels have summed every term already
        delta.zero_()
        for j in ctx.neighbors:
            w, out = ctx.w[j], heard.wrong.get(j)
            if j in exact:
                at, ex = exact[j]
                delta[at] = delta[at].add_(ex, alpha=w)
                out = at if out is None else torch.cat([out, at])
            if out is None:  # every block right: w_j (xh_j - xh_i), the kernels' arithmetic
                delta.add_(heard.x_hat[j].to(x.dtype), alpha=w).sub_(sent.x_hat_i, alpha=w)
            else:
                kept = delta[out]
                delta.add_(heard.x_hat[j].to(x.dtype) - sent.x_hat_i, alpha=w)
                delta[out] = kept
    x.add_(delta, alpha=gamma)


@dataclass(frozen=True)
class Moniqua(GossipAlgorithm):
    """Decentralized SGD that sends each model to its neighbours at ``bits`` bits per element.

    Each step a worker averages its model with its neighbours' (D-PSGD), but sends only the
    low-order part of each weight (:class:`~lowbit.codecs.ModuloCodec`): a neighbour recovers
    the rest from its own, nearby model. This needs the models to stay within ``theta`` of
    each other, element by element, which Moniqua keeps checking.

    Parameters (the options, in plain words; the package docstring has the paper's symbols):
        bits: bits sent per element (1 to 8). 2 is the paper's main setting.
        theta: the largest difference between two neighbours' weights that decoding tolerates.
            ``"auto"`` (default) starts from the first gradient and follows the step size,
            doubling where verification finds blocks decoded wrong; a number fixes it.
        rounding: ``"stochastic"`` or ``"nearest"`` rounding of the sent codes (None: nearest
            at 1 bit, stochastic above).
        theta_schedule: with a fixed theta, ``"lr"`` scales it with the step size.
        theta_every: steps between two agreements of ``theta="auto"``.
        shared_randomness: every worker rounds with the same random draws each step, so that
            nearby models round alike (default True).
        gamma: how far each step moves towards the neighbours' average, in (0, 1]; None picks
            it from the grid step and the topology when a worker starts (:func:`default_gamma`).
        verify: send a 16-bit hash per block of ``verify_block`` elements so the receiver can
            tell a wrong decode; wrong blocks are left out of the mix and resent in 16 bits.
        entropy: also entropy-code the codes (``"zlib"``, ``"bz2"``, ``"lzma"``, ``"ans"``).
        dither: add a shared random offset before rounding (None: on at 1 bit with the default
            rounding and shared randomness); :attr:`dithered` says what a run does.
        verify_block: elements per verified block (None: :func:`default_verify_block`);
            :attr:`block` says what a run uses.

    In the paper: Algorithm 1 (``bits`` sets the quantizer Q_delta, ``theta`` the a priori
    bound theta_k), Theorem 3's slack matrix (``gamma``), section 6's shared randomness,
    verification and entropy coding.
    """

    bits: int = reads(BITS, default=2)
    theta: float | str = reads(THETA_OPT, default="auto")
    rounding: str | None = reads(ROUNDING, default=None)
    theta_schedule: str = reads(THETA_SCHEDULE_OPT, default="constant")
    theta_every: int = reads(THETA_EVERY_OPT, default=THETA_EVERY)
    shared_randomness: bool = reads(SHARED_RANDOMNESS_OPT, default=True)
    gamma: float | None = reads(GAMMA, default=None)
    verify: bool = reads(VERIFY_OPT, default=True)
    entropy: str | None = reads(ENTROPY_OPT, default=None)
    dither: bool | None = None
    verify_block: int | None = reads(VERIFY_BLOCK_OPT, default=None)

    name = "moniqua"

    def __post_init__(self):
        super().__post_init__()  # each option's own check
        self.codec  # validates bits, rounding and delta < 1/2
        if self.auto_theta and not self.verify:
            raise ValueError("theta='auto' (the default) follows the blocks verification finds wrong: it needs "
                             "verify=True; without verification give theta a number (--theta)")
        if self.dither is not None and not isinstance(self.dither, bool):
            raise ValueError(f"dither must be True, False or None, got {self.dither!r}")
        if self.dithered and (self.codec.rounding != "nearest" or not self.shared_randomness):
            raise ValueError("dither=True needs rounding='nearest' and shared_randomness=True "
                             "(the receiver subtracts the sender's dither)")

    # ---- the options as a run uses them ------------------------------------------------
    @property
    def auto_theta(self) -> bool:
        """theta is tuned (``theta="auto"``)."""
        return isinstance(self.theta, str) and self.theta == "auto"

    @property
    def codec(self) -> ModuloCodec:
        """The modulo codec of ``bits`` and ``rounding`` (theta 1 until "auto" sets it)."""
        return ModuloCodec(bits=self.bits, theta=1.0 if self.auto_theta else float(self.theta),
                           rounding=self.rounding or default_rounding(self.bits))

    @property
    def dithered(self) -> bool:
        """Whether the codes round x plus a shared subtractive dither (``dither``, or its default)."""
        if self.dither is None:  # the 1-bit default: nearest rounding of a shared subtractive dither
            return self.rounding is None and self.bits == 1 and bool(self.shared_randomness)
        return self.dither

    @property
    def block(self) -> int:
        """Elements per verified block (``verify_block``, or :func:`default_verify_block`)."""
        return self.verify_block if self.verify_block is not None else default_verify_block(self.bits)

    def nominal_bits_per_element(self):
        return float(self.bits)

    def init(self, x, ctx):
        codec = self.codec
        frame = ModuloFrame(bits=self.bits, block=self.block, verify=self.verify, entropy=self.entropy,
                            peers=len(ctx.neighbors), rank=ctx.rank)
        gamma = self.gamma if self.gamma is not None else default_gamma(codec, ctx.W, self.shared_randomness)
        degrees = (len(ctx.neighbors), sum(len(ctx.topology.neighbors(u)) for u in range(ctx.topology.n)))
        return MoniquaState(theta=None if self.auto_theta else float(self.theta), gamma=float(gamma),
                            frame=frame, codec=codec, degrees=degrees)

    # ---- one step: Algorithm 1, lines 3-6 -------------------------------------------------
    def before_update(self, state, ctx, k, x, g, lr):
        """Lines 3-6 in place on x (x <- x_{k+1/2}); the optimizer then takes line 7. With
        ``theta="auto"`` the first call sets theta_0 from ``g`` (D2 passes the step it took,
        u_0), and every ``theta_every`` steps the workers agree on the blocks found wrong."""
        if state.lr0 is None:
            state.lr0 = lr
        if state.theta is None:
            th.start_theta(state, ctx, g)
        codec = self._theta_k(state, lr)
        sent = self._send(state, ctx, k, x, codec)                                       # lines 3, 4
        received = ctx.transport.neighbor_exchange(sent.wire, ctx.neighbors)
        heard = receive(state, ctx, k, x, codec, sent, received, self.verify)            # line 5, verified
        exact = repair(state.frame, ctx, x, heard.repair)
        mix(state.gamma, ctx, x, sent, heard, exact)                                     # line 6
        state.nack = heard.nack
        if self.auto_theta and th.agreement_due(k, self.theta_every):
            state.own_floor = th.theta_floor(codec, th.peak(x), torch.finfo(x.dtype).eps)
            self._agree_theta(state, ctx)
            self._hold_floor(state, lr)
        return state

    def _theta_k(self, state: MoniquaState, lr: float) -> ModuloCodec:
        """The codec of theta_k (:func:`~lowbit.algorithms.moniqua.theta.theta_k`)."""
        return th.theta_k(state, lr, self.theta_schedule == "lr" or self.auto_theta)

    _agree_theta = staticmethod(th.agree_theta)
    _hold_floor = staticmethod(th.hold_floor)

    def _send(self, state: MoniquaState, ctx, k: int, x: torch.Tensor, codec: ModuloCodec) -> Sent:
        """Line 3, q_{k,i} = Q_delta((y / B_theta) mod 1) with my repair requests in the frame, and
        line 4, xh_{k,i}; y = x, or x + v with the shared dither v (1 bit)."""
        # Shared randomness ("More efficient Moniqua", section 6): every worker draws the
        # same rounding offsets u at step k, so nearby models round alike.
        gen = shared_generator(ctx.seed, k, 0 if self.shared_randomness else ctx.rank + 1)
        y, v = x.detach(), None
        if self.dithered:  # shared subtractive dither, uniform over one grid cell, added in float64
            y = y.to(torch.float64)
            step = codec.B_theta / codec.levels
            v = (torch.rand(y.shape, generator=gen, dtype=torch.float64, device=gen.device).to(y.device) - 0.5) * step
            y = y + v
        asked = {j: set(blocks) for j, blocks in state.nack.items() if blocks}  # repair what I recovered wrong
        K = state.frame.kernels(y, x.dtype)
        wire, x_hat_i = state.frame.send(codec, y, gen, asked, K)
        x_hat_i = (x_hat_i if v is None else x_hat_i - v).to(x.dtype)
        return Sent(wire, y, v, x_hat_i, K, asked)

    # ---- what a run reports ------------------------------------------------------------------
    @classmethod
    def run_warning(cls, report):
        notes = [n for n in (mismatch_note(report), th.runaway_note(report)) if n]
        return "moniqua: " + "; ".join(notes) if notes else None

    def report(self, state):
        out = {"theta": float(state.theta), "mismatched_blocks": int(state.mismatches),
               "mismatched_messages": int(state.mismatched_messages)}
        if state.theta_start is not None:
            out["theta_start"] = float(state.theta_start)
        if self.auto_theta:
            out["theta_floor"] = float(state.floor)
        return out
