"""Moniqua: decentralized SGD whose models travel as modulo codes (Lu & De Sa, "Moniqua:
Modulo Quantized Communication in Decentralized SGD", ICML 2020), with Theorem 3's slack
matrix, Theorem 2's theta, and section 6's shared randomness, verification and entropy coding.

Per worker i at step k (Algorithm 1; B_theta = 2 theta / (1 - 2 delta), Lemma 2)::

    3: q_{k,i}  = Q_delta((x_{k,i} / B_theta) mod 1)                   (sent)
    4: xh_{k,i} = (q_{k,i} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (local biased term)
    5: xh_{k,j} = (q_{k,j} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (neighbour j, decoded against x_{k,i})
    6: x_{k+1/2,i} = x_{k,i} + gamma sum_j (xh_{k,j} - xh_{k,i}) W_ji
    7: x_{k+1,i} = x_{k+1/2,i} - alpha_k g_{k,i}                        (the optimizer step)

Decoding is exact to delta B_theta while |x_{k,j} - x_{k,i}| < theta element-wise.

Use it by name (``lowbit train --algorithm moniqua --bits 2``, ``DecentralizedDataParallel(model,
opt, "moniqua", bits=2)``) or as a class::

    from lowbit.algorithms import Moniqua
    worker = Moniqua(bits=2).worker(transport, make_topology("ring", n))

The defaults need no tuning: ``theta="auto"`` measures theta from the blocks verification
finds wrong, ``gamma=None`` picks the slack matrix's gamma from the grid step and W
(:func:`default_gamma`), and at 1 bit the codes round to nearest after a shared subtractive
dither (nearest rounding alone would move nothing between models within one grid cell).

The package, one concern per module:

- :mod:`~lowbit.algorithms.moniqua.algorithm`: :class:`Moniqua` (options and the step, lines
  3-6 marked in the code; line 6 is :func:`~lowbit.algorithms.moniqua.algorithm.mix`),
  :class:`MoniquaState`, :func:`default_gamma`;
- :mod:`~lowbit.algorithms.moniqua.theta`: theta fixed, following alpha_k, or ``"auto"``
  (Theorem 2's form, its constant measured), and theta's floor;
- :mod:`~lowbit.algorithms.moniqua.verify`: per-block verification and the 16-bit repair of
  the blocks found wrong;
- :mod:`~lowbit.algorithms.moniqua.frame`: the message on the wire (:class:`ModuloFrame`:
  codes, repair requests, block hashes, control byte; the repair message). The codec itself,
  which knows nothing of ranks or neighbours, is :class:`lowbit.codecs.ModuloCodec`.

Measured results (accuracy, wire bits per element, theta reached) are in ``docs/RESULTS.md``.
"""

from .algorithm import (GAMMA_NOISE, GAMMA_NOISE_1BIT, GAMMA_NOISE_INDEPENDENT, Moniqua, MoniquaSaved, MoniquaState,
                        default_gamma, default_rounding, mix)
from .frame import REPAIR_LEVELS, ModuloFrame
from .theta import (THETA_EVERY, THETA_EVERY_OPT, THETA_OPT, THETA_SCHEDULE_OPT, THETA_FLOOR_GROWTH, THETA_FLOOR_SPREAD, THETA_FLOOR_ULPS, THETA_RUNAWAY,
                    THETA_SCHEDULES, THETA_SHRINK, THETA_START, THETA_TARGET, agreement_due, check_theta,
                    floor_from_votes, floor_vote, theta_floor)
from .verify import VERIFY_BLOCK, VERIFY_CODE_BITS, default_verify_block

__all__ = ["Moniqua", "MoniquaState", "MoniquaSaved", "ModuloFrame", "REPAIR_LEVELS", "default_gamma",
           "default_rounding", "default_verify_block", "mix", "check_theta", "agreement_due", "theta_floor",
           "floor_vote", "floor_from_votes", "GAMMA_NOISE", "GAMMA_NOISE_1BIT", "GAMMA_NOISE_INDEPENDENT",
           "THETA_EVERY", "THETA_FLOOR_GROWTH", "THETA_FLOOR_SPREAD", "THETA_FLOOR_ULPS", "THETA_RUNAWAY",
           "THETA_SCHEDULES", "THETA_SHRINK", "THETA_START", "THETA_TARGET", "VERIFY_BLOCK", "VERIFY_CODE_BITS",
           "THETA_OPT", "THETA_EVERY_OPT", "THETA_SCHEDULE_OPT"]
