"""Moniqua's theta: the a priori bound of Algorithm 1 (line 3's B_theta = 2 theta / (1 - 2 delta)).

- A fixed theta (a number), optionally following the step size (``theta_schedule="lr"``:
  theta_k = theta alpha_k / alpha_0, as Theorem 2's theta_k is proportional to alpha_k).
- ``theta="auto"`` (section 6, "Choosing theta empirically", with verification as the
  measurement): keeps Theorem 2's form theta_k = alpha_k C and measures C. theta_0 =
  :data:`THETA_START` alpha_0 max_i ||g_{0,i}||_inf (one all-reduce MAX, 8 bytes); after each of
  the first ``theta_every`` steps and every ``theta_every`` steps after, one all-reduce SUM (16
  bytes) of the blocks found wrong since the last agreement: more than :data:`THETA_TARGET` of
  those checked doubles theta, none shrinks it by :data:`THETA_SHRINK`.
- theta's floor F: where the models agree to the last bit nothing is ever wrong and shrinking
  would go on until the grid integers pass 2^53. theta_k never goes below the smallest power of
  two at least every worker's :func:`theta_floor` of its largest weight, agreed inside the same
  16-byte sum (:func:`floor_vote`, :func:`floor_from_votes`).

The functions here act on a :class:`~lowbit.algorithms.moniqua.MoniquaState`; the step that
calls them is :meth:`Moniqua.before_update <lowbit.algorithms.moniqua.Moniqua.before_update>`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...codecs import ModuloCodec
from ...codecs.modulo import GRID_LIMIT
from ..config import Option, int_at_least, one_of, parse_theta

THETA_SCHEDULES = ("constant", "lr")
#: theta="auto": steps between two agreements (after each of the first THETA_EVERY steps)
THETA_EVERY = 10
#: ... above this fraction of the blocks checked found wrong, theta doubles; at none it shrinks by THETA_SHRINK
THETA_TARGET = 1e-3
THETA_SHRINK = 0.8
#: theta_0 is THETA_START times the first step's largest gradient entry, times alpha_0
THETA_START = 2.0
#: theta grown this many times theta_0: the run's warning says the noise, not the gradients, sets the distance
THETA_RUNAWAY = 256.0
#: the floor: Lemma 2's error bound delta B_theta is at least THETA_FLOOR_ULPS ulps of the largest weight,
#: and the grid integers stay THETA_FLOOR_GROWTH times below 2^53
THETA_FLOOR_ULPS = 4.0
THETA_FLOOR_GROWTH = 2.0 ** 10
#: ... agreed in the agreement's sum as 2^(THETA_FLOOR_SPREAD k) per worker (k: its floor's binary exponent)
THETA_FLOOR_SPREAD = 16


def check_theta(theta, *, auto: bool = True):
    """``theta`` if it is a finite number > 0, or ``"auto"`` where ``auto`` allows it; a
    ValueError naming theta and its range otherwise."""
    if auto and isinstance(theta, str) and theta == "auto":
        return theta
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and math.isfinite(theta) and theta > 0):
        either = " or 'auto'" if auto else ""
        raise ValueError(f"theta must be a finite number > 0{either}, got {theta!r}")
    return theta


THETA_OPT = Option("theta", None, "Moniqua's a priori bound theta (> 0), or 'auto' (the default of moniqua and "
                   "moniqua-d2: follows the blocks verification finds wrong)", float | str | None, check_theta,
                   {"type": parse_theta})
THETA_SCHEDULE_OPT = Option("theta_schedule", "constant", "constant, or lr (theta_k ~ lr_k)", str,
                            one_of("theta_schedule", THETA_SCHEDULES))
THETA_EVERY_OPT = Option("theta_every", THETA_EVERY, "--theta auto: steps between two theta agreements", int,
                         int_at_least("theta_every", 1, "steps between two theta agreements"))


def agreement_due(k: int, every: int) -> bool:
    """theta="auto" agrees after step k: after each of the first ``every`` steps (theta_0 comes
    from one gradient, and momentum grows the steps that follow), then every ``every`` steps."""
    return k < every or (k + 1) % every == 0


def theta_floor(codec: ModuloCodec, peak: float, eps: float) -> float:
    """The smallest theta ``theta="auto"`` takes for a model whose largest ``|weight|`` is ``peak``,
    held in a dtype of machine epsilon ``eps`` (2^-23 for float32): the larger of the theta whose
    Lemma 2 error bound ``delta B_theta`` is :data:`THETA_FLOOR_ULPS` ``eps peak`` (a finer grid is
    finer than the weights themselves) and the theta whose grid integers ``peak 2^bits / B_theta``
    stay :data:`THETA_FLOOR_GROWTH` times inside the codec's range ``(2^53 / 2^bits - 1) B_theta``
    (where verification's hashes hold). ``codec``'s bits and rounding count, not its theta; 0 for
    ``peak`` 0."""
    levels = codec.levels
    B = max(THETA_FLOOR_ULPS * eps * peak / codec.delta, THETA_FLOOR_GROWTH * peak * levels / (GRID_LIMIT - levels))
    return B * (1.0 - 2.0 * codec.delta) / 2.0


def _floor_spread(n: int) -> int:
    """p of the floor's votes ``2^(p k)`` among ``n`` workers: n < 2^p, so that the sum of n votes
    stays below the next power ``2^(p (K + 1))`` of the largest, ``2^(p K)``."""
    return max(THETA_FLOOR_SPREAD, n.bit_length())


def floor_vote(floor: float, theta: float, n: int) -> float:
    """One worker's term of the agreement's sum for its ``floor`` (:func:`theta_floor`), among ``n``
    workers whose theta is ``theta``: ``2^(p k)``, p = 16 (more from 65536 workers), ``2^(E + k)``
    the smallest power of two >= ``floor`` and ``2^(E - 1) <= theta < 2^E``; 0 where the floor is
    0 or more than 2^(1022 / p) below theta (it cannot bind), and k at most ``1023 / p - 1``
    (theta then rises that far, and again at the next agreement)."""
    if not (floor > 0.0 and math.isfinite(floor)):
        return 0.0
    p = _floor_spread(n)
    m, e = math.frexp(floor)
    k = (e - 1 if m == 0.5 else e) - math.frexp(theta)[1]
    if k < -(1022 // p):
        return 0.0
    return math.ldexp(1.0, p * min(k, 1023 // p - 1))


def floor_from_votes(total: float, theta: float, n: int) -> float:
    """The agreed floor from the sum ``total`` of the ``n`` workers' :func:`floor_vote` terms:
    ``2^(E + K)`` with ``2^(p K)`` the largest vote, i.e. the smallest power of two at least
    every worker's floor; 0 when every vote was 0. Exact on every worker whatever the order and
    rounding of the additions: ``2^(p K) <= total < 2^(p (K + 1))``."""
    if not total > 0.0:
        return 0.0
    K = (math.frexp(total)[1] - 1) // _floor_spread(n)
    return math.ldexp(1.0, math.frexp(theta)[1] + K)


def peak(x: torch.Tensor) -> float:
    """``max |x|`` (0 for an empty tensor): one reduction and one host read."""
    return float(torch.linalg.vector_norm(x.detach(), math.inf)) if x.numel() else 0.0


def theta_k(state, lr: float, follows_lr: bool) -> ModuloCodec:
    """The codec of theta_k: theta, or theta alpha_k / alpha_0 where it ``follows_lr``
    (``theta_schedule="lr"`` and ``"auto"``), at least the floor ``"auto"`` agreed last."""
    theta = state.theta
    if follows_lr and state.lr0 > 0 and lr > 0:
        theta = state.theta * lr / state.lr0
    theta = max(theta, state.floor)  # theta="auto": never below its agreed floor (0 otherwise)
    if state.codec.theta != theta:  # a new theta_k: a new codec (validated once)
        state.codec = dataclasses.replace(state.codec, theta=theta)
    return state.codec


def start_theta(state, ctx, g: torch.Tensor | None) -> None:
    """theta="auto", first step: from equal models (A4) two workers drift apart by at most
    alpha_0 (|g_i| + |g_j|) in a step; theta_0 = THETA_START alpha_0 max_i ||g_i||_inf, agreed
    by one all-reduce MAX (8 bytes, counted)."""
    g_inf = float(g.abs().max()) if g is not None and g.numel() else 0.0
    agreed = float(ctx.transport.all_reduce(torch.tensor([g_inf], dtype=torch.float64), "max")[0])
    theta = THETA_START * agreed * state.lr0
    # no gradient, or a first step size of 0: nothing to bound yet (verification moves it from there)
    state.theta = theta if theta > 0 and math.isfinite(theta) else 1.0
    state.theta_start = state.theta


def agree_theta(state, ctx) -> None:
    """theta="auto", every ``theta_every`` steps: one all-reduce SUM (16 bytes, counted) of the
    blocks recovered wrong since the last agreement and of the workers' :func:`floor_vote`
    terms; theta doubles when more than THETA_TARGET of the blocks checked were wrong and
    shrinks by THETA_SHRINK when none was, and the floor is agreed (:func:`floor_from_votes`).
    The blocks checked are not sent: every worker checks every block of every message it
    gets, so all workers checked mine times the neighbours of all over mine."""
    theta = state.codec.theta  # agreed: the reference of the floor's votes
    vote = floor_vote(state.own_floor, theta, ctx.world_size)
    sums = ctx.transport.all_reduce(torch.tensor([state.window[0], vote], dtype=torch.float64), "sum")
    wrong, votes = sums.tolist()
    mine, every = state.degrees
    checked = state.window[1] * every // mine if mine else 0
    if checked > 0 and wrong > THETA_TARGET * checked:
        state.theta *= 2.0
    elif checked > 0 and wrong == 0:
        state.theta *= THETA_SHRINK
    state.floor = floor_from_votes(votes, theta, ctx.world_size)
    state.window = [0, 0]


def hold_floor(state, lr: float) -> None:
    """theta="auto", after an agreement: theta_k = theta alpha_k / alpha_0 at least the agreed
    floor (a floor that binds raises theta to it; doubling then doubles theta_k)."""
    if state.floor <= 0.0:
        return
    if state.lr0 > 0 and lr > 0:
        if state.theta * lr / state.lr0 < state.floor:
            state.theta = state.floor * state.lr0 / lr
    elif state.theta < state.floor:
        state.theta = state.floor


def runaway_note(report: dict) -> str | None:
    """The warning of a ``theta="auto"`` run whose theta grew :data:`THETA_RUNAWAY` times theta_0."""
    start = report.get("theta_start")
    if start and report["theta"] >= THETA_RUNAWAY * start:
        return (f"theta='auto' grew {report['theta'] / start:.3g}-fold from {start:.3g}: the quantization "
                f"noise keeps the models apart whatever theta (too large a --gamma for this topology, or "
                f"--no-shared-randomness); a smaller --gamma mixes less noise in")
    return None
