"""Moniqua on D-PSGD: Algorithm 1 of Lu & De Sa, "Moniqua: Modulo Quantized
Communication in Decentralized SGD" (ICML 2020), with the slack matrix of
Theorem 3, theta from Theorem 2, verification and entropy coding (section 6).

Per worker i at step k (line numbers of Algorithm 1)::

    3: q_{k,i}  = Q_delta((x_{k,i} / B_theta) mod 1)                   (sent)
    4: xh_{k,i} = (q_{k,i} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (local biased term)
    5: xh_{k,j} = (q_{k,j} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (neighbour j, decoded against x_{k,i})
    6: x_{k+1/2,i} = x_{k,i} + gamma sum_j (xh_{k,j} - xh_{k,i}) W_ji
    7: x_{k+1,i} = x_{k+1/2,i} - alpha_k g_{k,i}                        (the optimizer step)

with B_theta = 2 theta / (1 - 2 delta) (Lemma 2). Decoding is exact to
delta * B_theta as long as |x_{k,j} - x_{k,i}| < theta element-wise.

**Slack matrix** (Theorem 3): line 6 with ``gamma`` mixes with
``W~ = gamma W + (1 - gamma) I``. gamma = 1 is Algorithm 1. Why a default
gamma < 1 matters: with shared randomness, x_hat_j - x_hat_i is x_j - x_i
rounded up or down to a grid step s = B_theta / 2^bits, so every step line 6
adds to the models' differences a noise of variance about gamma^2 s |x_j -
x_i|. On an eigenvector of W with eigenvalue lambda, line 6 multiplies a
difference by 1 - g (g = gamma (1 - lambda)) and adds that noise times g, so
the noise it keeps has variance g / (2 - g) times the noise of one step: it
grows without bound as g nears 2 and is largest on the smallest eigenvalue
lambda_min(W) (-1/3 on rings with 1/3 weights, 0 on a complete graph). The
distance this noise keeps between neighbours is proportional to s, i.e. to
theta itself (s = theta at 2 bits, 2 theta at 1 bit): past a gamma, no theta
is large enough, and ``theta="auto"`` doubles theta without end (a runaway).
On digits-mlp, 300 steps, 2 bits, the former default gamma = min(1, 2.5 (1 -
rho(W))) (0.49 on a ring of 8) ran away on rings of 3, 4, 5 and 6 workers
(gamma 1, 1, 1, 0.83) and on a complete graph of 8 (gamma 1): test accuracy
0.78-0.96, local models 0.33-0.75. The default, :func:`default_gamma`, holds
g / (2 - g) at r = R theta / s on the slowest mode, R = :data:`GAMMA_NOISE` =
0.75 (:data:`GAMMA_NOISE_1BIT` = 0.4 at 1 bit): ``gamma = min(1, (2 r / (1 +
r)) / (1 - lambda_min(W)))``. That is 0.64 at 2 bits and 0.25 at 1 bit on
rings of 4 or more, 0.86 and 0.33 on a complete graph, 1 at 3 bits and more on rings.
R was measured (`lowbit train --task T --workers 8 --steps 300
--algorithm moniqua --bits B --gamma G --seed S`, ring of 8). At 2 bits on
fashion-lenet (`--eval-every 100`), gamma 0.35 / 0.42 / 0.5 reached 83.6 /
83.9 / 84.5 % at seed 0 (fp32 D-PSGD 84.6 %); over seeds 0, 1, 2 gamma 0.5
reached 84.18 % on average and 0.65 84.70 % (fp32 D-PSGD 84.83 %), at
4.15-4.19 wire bits per element, while 0.8 (R = 1.14) let theta grow to 0.34
(seed 1: 82.0 %): R = 0.75 (gamma 0.64) was the default from then on (the
former default was R = 0.5, gamma 0.5). At 1 bit a larger gamma helps
fashion-lenet but costs wire on digits: on fashion-lenet gamma 0.2 / 0.25 /
0.3 reached 83.27 / 83.76 / 83.54 % over three seeds, but on digits-mlp gamma
0.3 sent 2.27 wire bits per element at seed 2 and 0.25 sent 2.1998 (1.0999
times the nominal bits times the fan-out, at issue 11's 1.1 limit; 0.2:
2.14), and gamma 0.4 on a ring of 3 sent 2.28, while the repair was fp32 (a
wrong block's repair cost 32 times its 1-bit codes): R was 0.3 at 1 bit
(gamma 0.2). With the 16-bit repair, gamma 0.25 (R = 0.4) sent 2.10 / 2.11 /
2.14 on digits (seeds 0 / 1 / 2; 97.68 % on average against fp32 D-PSGD's
98.24 %) and reached 83.45 / 83.65 / 84.15 % on fashion-lenet (2.09-2.10 wire
bits; fp32 D-PSGD 84.83 %), so R = 0.4 at 1 bit. Without shared randomness
(``--no-shared-randomness``, digits-mlp, 2 bits) R = 0.75 let the local models
drift apart (consensus distance 9.9e6, 89.4 %) where R = 0.5 had held them
(0.975): :data:`GAMMA_NOISE_INDEPENDENT` keeps 0.5 there.
With these, `lowbit train --task digits-mlp --algorithm moniqua --steps 300
--workers N [--topology T] --bits B` on rings of 3, 4, 6 and 8 workers, a
complete graph of 8, the exponential graph of 8 and a torus of 16, at 1, 2
and 3 bits, stayed at 97.2-98.6 % test accuracy and at 1.03-1.12 times the
nominal wire bits times the fan-out (seed 0, with the fp32 repair and R =
0.3 at 1 bit; the most, 1.12, at 1 bit on a ring of 4). Again with the 16-bit
repair and R = 0.4 at 1 bit, at 1 and 2 bits: 97.8-98.6 % and 1.036-1.064
times (the most, 1.064, at 1 bit on a ring of 6; a ring of 4 1.061). gamma = 0.7 on a ring of 4 (g / (2 - g)
= 0.87) still held; gamma 1 there (2.0) and 0.83 on a ring of 6 (1.25) ran
away.
The paper's Theorem 3 gamma (and its 5e-3 on CIFAR-10) mixes far too slowly for
a few hundred steps.
At 1 bit only nearest rounding has delta < 1/2 (delta = 1/4, B_theta =
4 theta). Plain nearest rounding is deterministic: models within one grid
cell (2 theta wide) all send the same code and line 6 moves nothing. So the
1-bit default (``rounding=None``, ``shared_randomness=True``) rounds to
nearest after adding a shared subtractive dither v ~ U(-s/2, s/2)^d (s =
B_theta / 2^bits, drawn from the step's shared generator) and subtracts v
after decoding: the error is still <= s / 2 = delta B_theta (Lemma 2 holds
for x + v against y + v), but differences of nearby models are now
unbiased. ``dither=False`` or ``rounding="nearest"`` gives plain nearest.

**Shared randomness** (``shared_randomness``, the default; section 6, "More
efficient Moniqua"): all workers use the same stochastic-rounding offsets u
at step k, so nearby models round alike and their errors cancel in line 6.

**theta.** By hand (a float), optionally following the step size
(``theta_schedule="lr"``: theta_k = theta alpha_k / alpha_0, as Theorem 2's
theta_k is proportional to alpha_k), or ``theta="auto"`` (section 6, "Choosing
theta empirically", with the paper's third method, verification, as the
measurement). Theorem 2's theta_k = alpha_k 2 G_inf C_alpha log(16 n) /
(1 - eta rho) bounds ``max ||x_i - x_j||_inf`` by a worst case: from G_inf
measured over a warm-up it gave theta 1.15 on fashion-lenet, where the model
did not learn, and 2.9 on digits (96.1 % against 98.6 %). The distance itself
cannot be measured from the codes either: a recovered difference is only
known to one grid step, which is theta at 2 bits. What verification does
measure, exactly, is whether theta was large enough, block by block. So
``"auto"`` keeps Theorem 2's form, theta_k = alpha_k C, and measures its
constant C (the bound on ``max ||x_i - x_j||_inf / alpha_k``) instead of
taking the worst case:

* starts from A4 (equal models): in one step two workers drift apart by at
  most alpha_0 (|g_i| + |g_j|), so theta_0 = :data:`THETA_START` (2) alpha_0
  max_i ||g_{0,i}||_inf, agreed by one all-reduce MAX (8 bytes, counted);
* then after each of the first ``theta_every`` (:data:`THETA_EVERY`, 10) steps
  (momentum makes the first steps grow: on digits-mlp, 176 of 252 wrong
  blocks came in the first 20 steps when the first agreement waited for step
  10), and every ``theta_every`` steps after that, all workers sum
  the blocks they found wrong since the last agreement, out of the blocks
  checked (one all-reduce SUM, 16 bytes, counted, which also agrees theta's
  floor, below): more than :data:`THETA_TARGET` (0.1 %) wrong doubles theta,
  none shrinks it by :data:`THETA_SHRINK` (0.8), in between keeps it;
* follows alpha_k between agreements (theta_k = theta alpha_k / alpha_0, as in
  Theorem 2);
* never goes below its floor F (next paragraph).

It needs verification, and relies on the default gamma and on shared
randomness: were the quantization noise to keep the models' distance above
theta whatever theta, doubling would not stop the wrong blocks and theta
runs away. On digits-mlp (same run) ``--gamma 1`` took theta to 667, with
644 wrong blocks and 83.6 % accuracy (with the former default gamma,
``--no-shared-randomness`` took it to 2.6). A run whose theta grew
:data:`THETA_RUNAWAY` (256) times theta_0 says so in its warning. Measured on
digits-mlp (8 workers, ring, 300 steps, the defaults: ``lowbit train --task
digits-mlp --workers 8 --steps 300 --algorithm moniqua --bits B``): 2 bits
ended at theta 0.044 with 59 wrong blocks, 4.15 wire bits per element per
step (4 nominal), 98.33 %; 1 bit sent 2.10 bits (2 nominal), 98.05 % (fp32
D-PSGD: 98.6 %; ``docs/RESULTS.md``, the decentralized table; with the fp32
repair and R = 0.3 at 1 bit: theta 0.027, 78 wrong blocks, 4.18 bits and 2.14).

**theta's floor.** Where the models agree to the last bit (the quadratic
task: every worker minimises the same function), no block is ever wrong and
shrinking would go on without end: ``lowbit train --task quadratic --workers
8 --topology ring --steps 2000 --seed 0 --algorithm moniqua --bits 2`` took
theta to 4.9e-18 and failed (issue 28), its grid integers beyond 2^53. Theorem
2's theta_k bounds the models' distance; below what the weights resolve it
bounds nothing. So theta_k never goes below F, the smallest power of two at
least every worker's :func:`theta_floor` of its largest weight M_i =
||x_i||_inf. With eps the machine epsilon of the model's dtype (2^-23 for
float32: weights near M lie ulp(M) <= eps M apart), the floor f is the
larger of two bounds:

* resolution: a decoded value is stored in the model's dtype, which rounds it
  by up to ulp(M) / 2 <= eps M / 2 on top of Lemma 2's error bound
  delta B_theta. The floor keeps that rounding within 1/8 of the bound:
  delta B_theta >= :data:`THETA_FLOOR_ULPS` (4) eps M, i.e. theta >= 4 eps M
  (1 - 2 delta) / (2 delta); at 2 bits (stochastic, delta = 1/4) and at 1 bit
  (nearest, delta = 1/4) theta >= 4 eps M. In grid steps s = B_theta / 2^bits:
  s >= 4 eps M / (delta 2^bits), 4 ulps of M with stochastic rounding, 8 with
  nearest. A finer grid is finer than the weights and sends nothing more.
* verification: the grid integers m ~ x 2^bits / B_theta must be exact in
  float64 (|m| <= 2^53) for equal hashes to prove a block right, and for the
  codec to take x at all. The floor keeps them :data:`THETA_FLOOR_GROWTH`
  (2^10) times inside: B_theta >= 2^10 M 2^bits / (2^53 - 2^bits), so the
  models may grow 1024-fold before the next agreement. For float32 models the
  first bound is the larger (|m| <= M / s <= 2^21 there); for float64 models
  (eps = 2^-52) this one.

F must be the same on every worker, and costs no byte more. Each worker adds
to the agreement's SUM, beside its wrong blocks, 2^(16 k_i)
(:func:`floor_vote`; 16 is :data:`THETA_FLOOR_SPREAD`, more from 2^16
workers), 2^(E + k_i) being the smallest power of two >= its f_i and
2^(E - 1) <= theta_k < 2^E. Whatever the order and the rounding of the
additions, 2^(16 K) <= sum <= n 2^(16 K) < 2^(16 (K + 1)) for the largest
k_i = K and fewer than 2^16 workers n, so the sum's binary exponent divided by
16 is K on every worker, and F = 2^(E + K) (:func:`floor_from_votes`; max_i
f_i <= F < 2 max_i f_i). The blocks checked, which the agreement summed
before, every worker knows: each checks every block of every message it gets,
so all together checked its own count times the neighbours of all workers
over its own. The agreement still sends 16 bytes: a run whose floor never
binds is what it was, bit for bit (the parameters and ledgers of
``tests/test_behaviour_pinned.py``'s 15 Moniqua cases, compared before and
after). After each agreement a theta with theta alpha_k / alpha_0 < F is
raised to it (a shrink stops at F; a doubling then doubles from F), and
between agreements theta_k = max(theta alpha_k / alpha_0, F), for a decaying
step size. ``report()["theta_floor"]`` is F (0 before the first agreement,
and where every f_i is 2^63 or more below theta_k). The command above then
finishes: theta = F = 2^-25 = 3.0e-8 from about step 480 (M = 0.05, 4 eps M =
2.4e-8), final loss 1.8e-15 (as at step 1475 of the failed run), 45 s (35 s
to the failure before, this 2-core machine). Where the models differ it does
not bind: ``lowbit train --task digits-mlp --algorithm moniqua --steps 200``
ended at theta 0.033 with F = 9.5e-7.

**Verification** (``verify``, section 6), per block: the flat vector of d
elements is split into nb = ceil(d / ``verify_block``) blocks of
``verify_block`` consecutive elements (default :data:`VERIFY_BLOCK` = 256,
see below; the last block may be shorter). The message is::

    codes | [requests] | nb x uint16 block hashes | control byte

all little-endian. A block's hash is the 16-bit hash of
:meth:`~lowbit.codecs.ModuloCodec.decode_hashed` of the un-modded grid
integers ``m = code - 2^bits k`` of the sender's own decode (line 4; ``k`` the
lattice index eq. (5) picks, so ``m`` is the quantized value before the mod)
in that block. The control byte holds 2 alarm bits (bits 0-1) and the
repair-request bit (bit 2). ``requests`` is present only when bit 2 is set:
one entry per neighbour asked, ``uint16`` rank then a bit mask of the blocks
asked (ceil(nb / 8) bytes, bit b of byte b // 8 is block b), then a
``uint16`` count of entries. The codec's 4-byte length header is not sent
(every worker knows d), so verification costs 2 nb + 1 bytes over the codes
(77 bytes per message at d = 9610 and 256-element blocks, 21 at 1024).
The receiver hashes each block of the grid
integers of what it recovered (line 5); a block's hashes agree exactly when
its recovery is right, and a wrong block goes undetected with probability
~2^-16 (a 16-bit hash of a changed block). Policy on a mismatch
(theta too small for that edge at that step in that block):

* a wrong block's values are never used: that neighbour's term of line 6 is
  left out for the coordinates of that block only, the neighbour's other
  blocks mix normally. :attr:`MoniquaState.mismatches` counts wrong *blocks*
  (:attr:`MoniquaState.mismatched_messages` the messages with at least one;
  both checkpointed); ``lowbit train`` logs one warning per run with the
  totals (:meth:`Moniqua.run_warning`, logger ``lowbit``), each mismatch is a
  DEBUG record of ``lowbit.algorithms.moniqua``;
* repair of only the failed blocks: in its next message the receiver lists
  (neighbour, failed blocks). After that step's regular exchange both ends
  of an edge know the union R of the blocks either of them asked of the
  other, and line 6 uses ``x_j - x_i`` on R's coordinates of that edge
  (instead of the modulo term, right or not), both ends' values as the
  repair carries them. The values travel in one
  extra neighbour exchange among the edges with a non-empty R only (counted):
  each worker sends, to each of those neighbours, one buffer: a block mask
  (ceil(nb / 8) bytes) of the union U of its R's over its edges, each of U's
  blocks' float32 min and max, then U's coordinates as 16-bit min-max codes
  of their block (:meth:`~lowbit.codecs.modulo_frame.ModuloFrame.repair_message`:
  within (max - min) / 131070 of the float32 value; a neighbour whose R is
  smaller than U ignores the rest). Bytes per repair message: ceil(nb / 8) +
  8 |U's blocks| + 2 |U's elements|, instead of a whole fp32 model (the
  repair was fp32 until a 16-bit one halved its cost; a block's codes depend
  on that block alone, so both ends of an edge use the same quantized
  values, with opposite signs, and line 6 still keeps the average). No collective and no extra round
  on the common path (steps with no pending request), and all workers stay
  in lock step (the request sets are symmetric knowledge of both ends).
* ``grow_theta=True`` (off by default) also grows theta: a worker none of
  whose neighbours' messages was entirely right in a step (every neighbour
  had at least one wrong block; the whole-vector rule on top of blocks)
  raises an alarm; steps are grouped in
  epochs of P = diameter + 1; an alarm of epoch m is flooded over the 2 alarm
  bits (bit m mod 2) of every later message, reaches every worker within
  diameter steps, and all workers double theta at the start of step
  (m + 2) P, in lock step. Off by default because doubling feeds back: on
  digits-mlp the spread of the models is dominated by quantization noise,
  which is proportional to theta, so the mismatch rate does not fall as
  theta grows and theta ran away (0.05 -> 1e5 in 300 steps).

**Block size.** Smaller blocks repair fewer values but send more hashes
(2 bytes per block on every message, mismatch or not). With theta fixed at
0.05 and gamma = 1 (wrong blocks in most messages) 32-64 were best, at 60-65K
bytes per step against 38.5K unverified. Once theta and gamma keep wrong blocks
rare (the defaults), the hashes dominate. On digits-mlp (d = 9610, 8
workers, ring, 300 steps, defaults, ``lowbit train --task digits-mlp
--workers 8 --steps 300 --algorithm moniqua --bits B --verify-block V``)
the wire bits per element per step (nominal 4 at 2 bits, 2 at 1 bit, to two
neighbours) were

    verify_block        64      256     1024
    2 bits              4.54    4.23    4.22     (98.3 / 98.1 / 98.1 %)
    1 bit               2.63    2.45    2.56     (98.3 % each)

(before ``auto`` agreed after each of its first steps, which then took 256
to 4.18 and 2.17), so 256 is the default :data:`VERIFY_BLOCK` at 2 bits and
more (hashes cost 1/16 bit per element; 77 bytes of trailer per message at d =
9610). :func:`default_verify_block` keeps the hashes at most 1/32 of the code
bits: 512 elements at 1 bit. At 1 bit with the default gamma, 256 and 512 sent
2.18 / 2.20 / 2.18 and 2.14 / 2.18 / 2.14 wire bits per element (seeds 0 / 1 /
2, same accuracy: ``lowbit train --task digits-mlp --workers 8 --steps 300
--seed S --algorithm moniqua --bits 1 --verify-block V``). More
hashed blocks also mean more chances of a collision: each wrong block passes
the 16-bit hash with probability ~2^-16.

Pending requests (neighbour -> blocks) are part of the checkpointed state
(:attr:`MoniquaState.nack`; a run resumes with the same ``verify_block``).

The exact-gossip warm-up of ``theta="auto"`` sends no hashes. With
``verify=False`` the message is the codes alone and nothing is checked.

**Entropy coding** (``entropy``: zlib, bz2, lzma or ans; section 6): the
packed codes are entropy-coded on the wire (:func:`lowbit.codecs.entropy.entropy_code`;
``ans`` models ``bits``-wide symbols); the requests, hashes and control byte follow the coded blob.

Moniqua keeps no state tensors between steps: its extra memory is 0 (Table
1 of the paper); theta, the alarm state, the mismatch counts and the pending
repair requests (block lists) are the scalars of :class:`MoniquaState`.

The code follows Algorithm 1: :meth:`Moniqua.before_update` sets theta_k
(:meth:`Moniqua._theta_k`), sends (:meth:`Moniqua._send`, lines 3-4), reads the
neighbours' messages (:meth:`Moniqua._receive`, line 5 and verification),
fetches the blocks asked for (:meth:`Moniqua._repair`) and mixes
(:meth:`Moniqua._mix`, line 6). The message format is
:class:`~lowbit.codecs.modulo_frame.ModuloFrame`'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..codecs import ModuloCodec
from ..codecs.entropy import ENTROPY_METHODS
from ..codecs.modulo import GRID_LIMIT
from ..codecs.modulo_frame import ModuloFrame
from ..codecs.rng import shared_generator
from ..topology import Topology
from .base import GossipAlgorithm, State, transient
from .gossip import check_gamma

THETA_SCHEDULES = ("constant", "lr")
# theta="auto" (module docstring): every THETA_EVERY steps all workers agree on the fraction of blocks
# recovered wrong since the last agreement; above THETA_TARGET theta doubles, at zero it shrinks by
# THETA_SHRINK. The first theta is THETA_START times the first step's largest gradient entry, times alpha_0.
THETA_EVERY = 10
THETA_TARGET = 1e-3
THETA_SHRINK = 0.8
THETA_START = 2.0
# theta="auto" grown this many times theta_0: the run's warning says the noise, not the gradients, sets the distance
THETA_RUNAWAY = 256.0
# theta="auto"'s floor (module docstring, "theta's floor"): Lemma 2's error bound delta B_theta is at least
# THETA_FLOOR_ULPS ulps of the largest weight, and the grid integers stay THETA_FLOOR_GROWTH times below 2^53
THETA_FLOOR_ULPS = 4.0
THETA_FLOOR_GROWTH = 2.0 ** 10
# ... agreed in the agreement's sum as 2^(THETA_FLOOR_SPREAD k) per worker (k: its floor's binary exponent)
THETA_FLOOR_SPREAD = 16
# R of default_gamma: the rounding noise allowed per unit of theta / s, at 1 bit and above (module docstring)
GAMMA_NOISE_1BIT = 0.4
GAMMA_NOISE = 0.75
# ... and above 1 bit without shared randomness, where independent rounding adds noise even between equal models
GAMMA_NOISE_INDEPENDENT = 0.5
# elements per verified block when none is given: measured on digits-mlp (see the module docstring)
VERIFY_BLOCK = 256
# ... and at least this many code bits per 16-bit hash (the hashes cost at most 1/32 of the codes)
VERIFY_CODE_BITS = 512
_log = logging.getLogger(__name__)


def topology_diameter(topology: Topology) -> int:
    """Largest hop distance between two connected workers (0 for one worker)."""
    best = 0
    for s in range(topology.n):
        dist = {s: 0}
        todo = deque([s])
        while todo:
            u = todo.popleft()
            for v in topology.neighbors(u):
                if v not in dist:
                    dist[v] = dist[u] + 1
                    todo.append(v)
        best = max(best, max(dist.values()))
    return best


def agreement_due(k: int, every: int) -> bool:
    """theta="auto" agrees after step k: after each of the first ``every`` steps (theta_0 comes
    from one gradient, and momentum grows the steps that follow), then every ``every`` steps."""
    return k < every or (k + 1) % every == 0


def default_gamma(codec: ModuloCodec, W, shared: bool = True) -> float:
    """The slack matrix's gamma when none is given (module docstring, "Slack matrix"):
    ``min(1, g / (1 - lambda_min(W)))`` with ``g = 2 r / (1 + r)``, ``r = R theta / s``,
    ``s = B_theta / 2^bits`` the grid step and R = :data:`GAMMA_NOISE` (:data:`GAMMA_NOISE_1BIT`
    at 1 bit, :data:`GAMMA_NOISE_INDEPENDENT` above 1 bit when the rounding is not ``shared``).
    It keeps the
    noise that rounding adds to the models' differences, in W's slowest-decaying mode,
    at ``g / (2 - g) = r`` grid steps squared per unit of distance: well inside theta.
    1 where W mixes nothing (one worker: W = [[1]])."""
    R = GAMMA_NOISE_1BIT if codec.bits == 1 else GAMMA_NOISE if shared else GAMMA_NOISE_INDEPENDENT
    r = R * codec.theta * codec.levels / codec.B_theta
    gap = 1.0 - float(np.linalg.eigvalsh(np.asarray(W, dtype=np.float64)).min())
    return min(1.0, (2.0 * r / (1.0 + r)) / gap) if gap > 0 else 1.0


def default_verify_block(bits: int) -> int:
    """Elements per verified block when none is given: :data:`VERIFY_BLOCK`, or more where the
    codes are so narrow that a block's 16-bit hash would cost more than 1/32 of its code bits
    (512 at 1 bit; module docstring, "Block size")."""
    return max(VERIFY_BLOCK, VERIFY_CODE_BITS // bits)


def theta_floor(codec: ModuloCodec, peak: float, eps: float) -> float:
    """The smallest theta ``theta="auto"`` takes for a model whose largest ``|weight|`` is ``peak``,
    held in a dtype of machine epsilon ``eps`` (2^-23 for float32; module docstring, "theta's
    floor"): the larger of the theta whose Lemma 2 error bound ``delta B_theta`` is
    :data:`THETA_FLOOR_ULPS` ``eps peak`` (a finer grid is finer than the weights themselves) and
    the theta whose grid integers ``peak 2^bits / B_theta`` stay :data:`THETA_FLOOR_GROWTH` times
    inside the codec's range ``(2^53 / 2^bits - 1) B_theta`` (where verification's hashes hold).
    ``codec``'s bits and rounding count, not its theta; 0 for ``peak`` 0."""
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


def _peak(x: torch.Tensor) -> float:
    """``max |x|`` (0 for an empty tensor): one reduction and one host read."""
    return float(torch.linalg.vector_norm(x.detach(), math.inf)) if x.numel() else 0.0


def check_theta(theta, *, auto: bool = True):
    """``theta`` if it is a finite number > 0, or ``"auto"`` where ``auto`` allows it; a
    ValueError naming theta and its range otherwise."""
    if auto and isinstance(theta, str) and theta == "auto":
        return theta
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and math.isfinite(theta) and theta > 0):
        either = " or 'auto'" if auto else ""
        raise ValueError(f"theta must be a finite number > 0{either}, got {theta!r}")
    return theta


def default_rounding(bits: int) -> str:
    """Stochastic rounding (the paper's experiments), except at 1 bit where only
    nearest rounding has delta < 1/2."""
    return "nearest" if bits == 1 else "stochastic"


@dataclass
class MoniquaState(State):
    """A Moniqua worker's memory between steps: scalars only (Table 1: no extra tensor), all
    checkpointed, then the caches that :meth:`Moniqua.init` derives from the options and the
    context (not checkpointed)."""

    # theta; theta_k = theta alpha_k / alpha_0 when it follows alpha_k; None until "auto" sets it
    theta: float | None = None
    theta_start: float | None = None  # theta="auto": theta_0
    lr0: float | None = None  # alpha_0
    # theta="auto": the blocks recovered wrong, and checked, since the last agreement
    window: list[int] = field(default_factory=lambda: [0, 0])
    # neighbour -> its blocks I recovered wrong at the last step (asked for and repaired at this one)
    nack: dict[int, list[int]] = field(default_factory=dict)
    # grow_theta: epochs with an alarm whose doubling is due later
    pending_alarms: list[int] = field(default_factory=list)
    mismatches: int = 0  # wrong blocks this worker detected (and did not use)
    mismatched_messages: int = 0  # messages with at least one wrong block
    theta_doublings: int = 0  # grow_theta's doublings
    floor: float = 0.0  # theta="auto": the floor agreed at the last agreement (0: none yet, or none binds)
    gamma: float = transient(default=1.0)  # the slack matrix's gamma: the option, or default_gamma of this W
    period: int = transient(default=1)  # P = diameter + 1: steps per alarm epoch
    frame: ModuloFrame | None = transient(default=None)  # this worker's message format
    codec: ModuloCodec | None = transient(default=None)  # the codec of the last theta_k (validated once per theta_k)
    own_floor: float = transient(default=0.0)  # theta="auto": this worker's theta_floor at an agreement
    degrees: tuple[int, int] = transient(default=(0, 0))  # (my neighbours, all workers' neighbours summed)


@dataclass
class _Sent:
    """What :meth:`Moniqua._send` sent at step k: the wire message, y (x, or x + v with the shared
    dither v), xh_{k,i} (line 4, v subtracted, in x's dtype), the one-call kernels and my requests."""

    wire: torch.Tensor
    y: torch.Tensor
    v: torch.Tensor | None
    x_hat_i: torch.Tensor
    K: object
    asked: dict[int, set[int]]


@dataclass
class _Heard:
    """What :meth:`Moniqua._receive` read: each neighbour's xh_{k,j} (line 5), the element mask of
    its blocks verified right (None: all), the blocks of each edge to mix from the repair this step
    (``repair``: asked by either end), the blocks to ask next step (``nack``), and line 6's sum
    ``delta`` when the one-call kernels built it already (``mixed``)."""

    delta: torch.Tensor
    repair: dict[int, set[int]]
    mixed: bool = True
    x_hat: dict[int, torch.Tensor] = field(default_factory=dict)
    good: dict[int, torch.Tensor | None] = field(default_factory=dict)
    nack: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Moniqua(GossipAlgorithm):
    """Decentralized SGD that sends each model to its neighbours at ``bits`` bits per element.

    Each step a worker averages its model with its neighbours' (D-PSGD), but sends only the
    low-order part of each weight (:class:`~lowbit.codecs.ModuloCodec`): a neighbour recovers
    the rest from its own, nearby model. This needs the models to stay within ``theta`` of
    each other, element by element, which Moniqua keeps checking.

    Parameters (the options, in plain words; the module docstring has the paper's symbols):
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
        grow_theta: double theta when no neighbour's message decodes right (an alarm).
        verify_block: elements per verified block (None: :func:`default_verify_block`);
            :attr:`block` says what a run uses.

    In the paper: Algorithm 1 (``bits`` sets the quantizer Q_delta, ``theta`` the a priori
    bound theta_k), Theorem 3's slack matrix (``gamma``), section 6's shared randomness,
    verification and entropy coding.
    """

    bits: int = 2
    theta: float | str = "auto"
    rounding: str | None = None
    theta_schedule: str = "constant"
    theta_every: int = THETA_EVERY
    shared_randomness: bool = True
    gamma: float | None = None
    verify: bool = True
    entropy: str | None = None
    dither: bool | None = None
    grow_theta: bool = False
    verify_block: int | None = None

    name = "moniqua"
    options = ("bits", "theta", "rounding", "theta_schedule", "theta_every", "shared_randomness", "gamma",
               "verify", "entropy", "verify_block")

    def __post_init__(self):
        check_theta(self.theta)
        if self.theta_schedule not in THETA_SCHEDULES:
            raise ValueError(f"theta_schedule must be one of {THETA_SCHEDULES}, got {self.theta_schedule!r}")
        if isinstance(self.theta_every, bool) or not isinstance(self.theta_every, int) or self.theta_every < 1:
            raise ValueError(f"theta_every must be an integer >= 1 (steps between two theta agreements), "
                             f"got {self.theta_every!r}")
        self.codec  # validates bits, rounding and delta < 1/2
        if self.gamma is not None:
            check_gamma(self.gamma)
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True or False, got {self.verify!r}")
        if self.auto_theta and not self.verify:
            raise ValueError("theta='auto' (the default) follows the blocks verification finds wrong: it needs "
                             "verify=True; without verification give theta a number (--theta)")
        block = self.verify_block
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"verify_block must be an integer >= 1 (elements per hashed block), got {block!r}")
        _check_entropy(self.entropy)
        if self.dither is not None and not isinstance(self.dither, bool):
            raise ValueError(f"dither must be True, False or None, got {self.dither!r}")
        if self.dithered and (self.codec.rounding != "nearest" or not self.shared_randomness):
            raise ValueError("dither=True needs rounding='nearest' and shared_randomness=True "
                             "(the receiver subtracts the sender's dither)")
        if not isinstance(self.grow_theta, bool):
            raise ValueError(f"grow_theta must be True or False, got {self.grow_theta!r}")

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

    @classmethod
    def from_config(cls, cfg):
        return cls(bits=cfg.bits, theta="auto" if cfg.theta is None else cfg.theta, rounding=cfg.rounding,
                   theta_schedule=cfg.theta_schedule, theta_every=cfg.theta_every,
                   shared_randomness=cfg.shared_randomness, gamma=cfg.gamma, verify=cfg.verify,
                   entropy=cfg.entropy, verify_block=cfg.verify_block)

    def nominal_bits_per_element(self):
        return float(self.bits)

    def init(self, x, ctx):
        codec = self.codec
        frame = ModuloFrame(bits=self.bits, block=self.block, verify=self.verify, entropy=self.entropy,
                            peers=len(ctx.neighbors), rank=ctx.rank)
        gamma = self.gamma if self.gamma is not None else default_gamma(codec, ctx.W, self.shared_randomness)
        degrees = (len(ctx.neighbors), sum(len(ctx.topology.neighbors(u)) for u in range(ctx.topology.n)))
        return MoniquaState(theta=None if self.auto_theta else float(self.theta), gamma=float(gamma),
                            period=topology_diameter(ctx.topology) + 1, frame=frame, codec=codec, degrees=degrees)

    # ---- one step: Algorithm 1, lines 3-6 -------------------------------------------------
    def before_update(self, state, ctx, k, x, g, lr):
        """Lines 3-6 in place on x (x <- x_{k+1/2}); the optimizer then takes line 7. With
        ``theta="auto"`` the first call sets theta_0 from ``g`` (D2 passes the step it took,
        u_0), and every ``theta_every`` steps the workers agree on the blocks found wrong."""
        if state.lr0 is None:
            state.lr0 = lr
        if state.theta is None:
            self._start_theta(state, ctx, g)
        self._apply_due_doublings(state, k)
        codec = self._theta_k(state, lr)
        sent = self._send(state, ctx, k, x, codec)                                       # lines 3, 4
        received = ctx.transport.neighbor_exchange(sent.wire, ctx.neighbors)
        heard = self._receive(state, ctx, k, x, codec, sent, received)                   # line 5
        exact = self._repair(state.frame, ctx, x, heard.repair)
        self._mix(state, ctx, x, sent, heard, exact)                                     # line 6
        state.nack = heard.nack
        if self.grow_theta and ctx.neighbors and len(heard.nack) == len(ctx.neighbors):
            _add(state.pending_alarms, k // state.period)  # no neighbour's message was right: theta far too small
        if self.auto_theta and agreement_due(k, self.theta_every):
            state.own_floor = theta_floor(codec, _peak(x), torch.finfo(x.dtype).eps)
            self._agree_theta(state, ctx)
            self._hold_floor(state, lr)
        return state

    def _theta_k(self, state: MoniquaState, lr: float) -> ModuloCodec:
        """The codec of theta_k: theta, or theta alpha_k / alpha_0 (``theta_schedule="lr"`` and ``"auto"``),
        at least the floor ``"auto"`` agreed last."""
        theta = state.theta
        if (self.theta_schedule == "lr" or self.auto_theta) and state.lr0 > 0 and lr > 0:
            theta = state.theta * lr / state.lr0
        theta = max(theta, state.floor)  # theta="auto": never below its agreed floor (0 otherwise)
        if state.codec.theta != theta:  # a new theta_k: a new codec (validated once)
            state.codec = dataclasses.replace(state.codec, theta=theta)
        return state.codec

    def _send(self, state: MoniquaState, ctx, k: int, x: torch.Tensor, codec: ModuloCodec) -> _Sent:
        """Line 3, q_{k,i} = Q_delta((y / B_theta) mod 1) with my repair requests and alarm bits in
        the frame, and line 4, xh_{k,i}; y = x, or x + v with the shared dither v (1 bit)."""
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
        wire, x_hat_i = state.frame.send(codec, y, gen, asked, _alarm_bits(state.pending_alarms), K)
        x_hat_i = (x_hat_i if v is None else x_hat_i - v).to(x.dtype)
        return _Sent(wire, y, v, x_hat_i, K, asked)

    def _receive(self, state: MoniquaState, ctx, k: int, x: torch.Tensor, codec: ModuloCodec, sent: _Sent,
                 received: dict) -> _Heard:
        """Line 5 for each neighbour j, xh_{k,j} decoded against my y, verified block by block: a
        wrong block is counted, left out of this step's mix and asked for next step. Each edge's
        blocks to mix from the repair now: those I asked for and those the neighbour asked of me."""
        frame, d = state.frame, x.numel()
        nb = frame.nblocks(d)
        heard = _Heard(delta=torch.zeros_like(x), repair={j: set(b) for j, b in sent.asked.items()})
        got = frame.receive(codec, {j: received[j] for j in ctx.neighbors}, sent.y, sent.K, v=sent.v,
                            x_hat_i=sent.x_hat_i, w=ctx.w, delta=heard.delta)
        for j in ctx.neighbors:
            r = got[j]
            heard.mixed = heard.mixed and r.mixed
            self._receive_alarm_bits(state, k, r.ctrl & 3)
            if ctx.rank in r.requests:
                heard.repair.setdefault(j, set()).update(r.requests[ctx.rank])
            heard.good[j] = None
            if self.verify:
                state.window[1] += nb
                if r.wrong:  # never use a wrong block: leave it out of this step's mix
                    self._mismatch(state, ctx, k, j, len(r.wrong), nb)
                    heard.nack[j] = sorted(r.wrong)
                    heard.good[j] = ~frame.block_mask(r.wrong, d, x.device)
            heard.x_hat[j] = r.x_hat
        return heard

    @staticmethod
    def _repair(frame: ModuloFrame, ctx, x: torch.Tensor, repair: dict[int, set[int]]) -> dict:
        """The repair round, only on the edges (and blocks) with a request: {j: (element mask m of
        the blocks, (x_j - x_i) m)} (one counted neighbour exchange; none on most steps). Both
        values are as the repair codes carry them (a block's codes depend on that block alone), so
        the two ends of an edge add opposite terms and line 6 keeps the models' average."""
        repair = {j: b for j, b in repair.items() if b}
        if not repair:
            return {}
        d = x.numel()
        msg = frame.repair_message(x, set().union(*repair.values()))
        got = ctx.transport.neighbor_exchange(msg, sorted(repair))
        mine = frame.read_repair(msg, d, x.device, ctx.rank).to(x.dtype)
        exact = {}
        for j, blocks in repair.items():
            m = frame.block_mask(blocks, d, x.device)
            exact[j] = (m, (frame.read_repair(got[j], d, x.device, j).to(x.dtype) - mine) * m)
        return exact

    @staticmethod
    def _mix(state: MoniquaState, ctx, x: torch.Tensor, sent: _Sent, heard: _Heard, exact: dict) -> None:
        """Line 6 with the slack matrix: x += gamma sum_j W_ji (xh_{k,j} - xh_{k,i}), block by block
        where a block was wrong (left out) or repaired ((x_j - x_i) from the repair instead)."""
        delta = heard.delta
        if not heard.mixed or exact:  # else the one-call kernels have summed every term already
            delta.zero_()
            for j in ctx.neighbors:
                keep, w = heard.good[j], ctx.w[j]
                if j in exact:
                    m, ex = exact[j]
                    keep = ~m if keep is None else keep & ~m
                    delta.add_(ex, alpha=w)
                if keep is None:  # every block right: w_j (xh_j - xh_i)
                    delta.add_(heard.x_hat[j].to(x.dtype), alpha=w).sub_(sent.x_hat_i, alpha=w)
                else:
                    delta.add_((heard.x_hat[j].to(x.dtype) - sent.x_hat_i) * keep, alpha=w)
        x.add_(delta, alpha=state.gamma)

    # ---- theta="auto" ----------------------------------------------------------------------
    @staticmethod
    def _start_theta(state: MoniquaState, ctx, g: torch.Tensor | None) -> None:
        """theta="auto", first step: from equal models (A4) two workers drift apart by at most
        alpha_0 (|g_i| + |g_j|) in a step; theta_0 = THETA_START alpha_0 max_i ||g_i||_inf, agreed
        by one all-reduce MAX (8 bytes, counted)."""
        g_inf = float(g.abs().max()) if g is not None and g.numel() else 0.0
        agreed = float(ctx.transport.all_reduce(torch.tensor([g_inf], dtype=torch.float64), "max")[0])
        theta = THETA_START * agreed * state.lr0
        # no gradient, or a first step size of 0: nothing to bound yet (verification moves it from there)
        state.theta = theta if theta > 0 and math.isfinite(theta) else 1.0
        state.theta_start = state.theta

    @staticmethod
    def _agree_theta(state: MoniquaState, ctx) -> None:
        """theta="auto", every ``theta_every`` steps: one all-reduce SUM (16 bytes, counted) of the
        blocks recovered wrong since the last agreement and of the workers' :func:`floor_vote`
        terms; theta doubles when more than THETA_TARGET of the blocks checked were wrong and
        shrinks by THETA_SHRINK when none was, and the floor is agreed (:func:`floor_from_votes`).
        The blocks checked are not sent: every worker checks every block of every message it
        gets, so all workers checked mine times the neighbours of all over mine."""
        theta_k = state.codec.theta  # agreed: the reference of the floor's votes
        vote = floor_vote(state.own_floor, theta_k, ctx.world_size)
        sums = ctx.transport.all_reduce(torch.tensor([state.window[0], vote], dtype=torch.float64), "sum")
        wrong, votes = sums.tolist()
        mine, every = state.degrees
        checked = state.window[1] * every // mine if mine else 0
        if checked > 0 and wrong > THETA_TARGET * checked:
            state.theta *= 2.0
        elif checked > 0 and wrong == 0:
            state.theta *= THETA_SHRINK
        state.floor = floor_from_votes(votes, theta_k, ctx.world_size)
        state.window = [0, 0]

    @staticmethod
    def _hold_floor(state: MoniquaState, lr: float) -> None:
        """theta="auto", after an agreement: theta_k = theta alpha_k / alpha_0 at least the agreed
        floor (a floor that binds raises theta to it; doubling then doubles theta_k)."""
        if state.floor <= 0.0:
            return
        if state.lr0 > 0 and lr > 0:
            if state.theta * lr / state.lr0 < state.floor:
                state.theta = state.floor * state.lr0 / lr
        elif state.theta < state.floor:
            state.theta = state.floor

    # ---- grow_theta's alarms (verification) ---------------------------------------------------
    @staticmethod
    def _apply_due_doublings(state: MoniquaState, k: int) -> None:
        for m in sorted(state.pending_alarms):
            if (m + 2) * state.period <= k:
                state.pending_alarms.remove(m)
                state.theta *= 2.0
                state.theta_doublings += 1

    @staticmethod
    def _receive_alarm_bits(state: MoniquaState, k: int, bits: int) -> None:
        e = k // state.period
        for p in (0, 1):
            if bits >> p & 1:
                m = e if e % 2 == p else e - 1
                if m >= 0:
                    _add(state.pending_alarms, m)

    @staticmethod
    def _mismatch(state: MoniquaState, ctx, k: int, j: int, bad: int, nb: int) -> None:
        state.mismatches += bad
        state.window[0] += bad
        state.mismatched_messages += 1
        _log.debug("moniqua: worker %d recovered %d of %d blocks of worker %d wrong at step %d (theta %g)",
                   ctx.rank, bad, nb, j, k, state.theta)

    # ---- what a run reports ------------------------------------------------------------------
    @classmethod
    def run_warning(cls, report):
        notes = []
        if report.get("mismatched_blocks"):
            notes.append(f"{report['mismatched_blocks']} blocks in {report['mismatched_messages']} messages were "
                         f"recovered wrong (theta {report['theta']:g} was below the models' distance there); "
                         f"verification left them out of their step's mix and repaired them the step after")
        start = report.get("theta_start")
        if start and report["theta"] >= THETA_RUNAWAY * start:
            notes.append(f"theta='auto' grew {report['theta'] / start:.3g}-fold from {start:.3g}: the quantization "
                         f"noise keeps the models apart whatever theta (too large a --gamma for this topology, or "
                         f"--no-shared-randomness); a smaller --gamma mixes less noise in")
        return "moniqua: " + "; ".join(notes) if notes else None

    def report(self, state):
        out = {"theta": float(state.theta), "mismatched_blocks": int(state.mismatches),
               "mismatched_messages": int(state.mismatched_messages), "theta_doublings": int(state.theta_doublings)}
        if state.theta_start is not None:
            out["theta_start"] = float(state.theta_start)
        if self.auto_theta:
            out["theta_floor"] = float(state.floor)
        return out


def _add(epochs: list[int], m: int) -> None:
    if m not in epochs:
        epochs.append(m)


def _alarm_bits(epochs: list[int]) -> int:
    bits = 0
    for m in epochs:
        bits |= 1 << (m % 2)
    return bits


def _check_entropy(entropy) -> None:
    if entropy is None:
        return
    if entropy not in ENTROPY_METHODS:
        raise ValueError(f"entropy must be None or one of {ENTROPY_METHODS}, got {entropy!r}")
    if entropy == "ans" and importlib.util.find_spec("constriction") is None:
        raise ValueError("entropy='ans' needs the optional 'constriction' package (pip install constriction); "
                         "zlib, bz2 and lzma need nothing extra")
