"""Moniqua's verification and repair (section 6 of the paper, "verification", made per block).

The vector of d elements is split into blocks of ``verify_block`` elements
(:func:`default_verify_block`). Each message carries a 16-bit hash per block of the sender's
grid integers (line 4); the receiver hashes what it recovered (line 5), and a block whose
hashes differ was decoded wrong (theta was below that edge's distance there):

- a wrong block is never used: that neighbour's term of line 6 is left out on that block's
  coordinates only, and the block is counted (:attr:`MoniquaState.mismatches`);
- the receiver asks for it in its next message; at that step both ends of the edge mix the
  union R of the blocks either asked from a repair round (one extra neighbour exchange among
  the edges with requests only: each value as a 16-bit min-max code of its block,
  :meth:`~lowbit.algorithms.moniqua.frame.ModuloFrame.repair_message`), with opposite signs,
  so line 6 keeps the models' average.

Pending requests are checkpointed (:attr:`MoniquaState.nack`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...codecs import ModuloCodec
from ..config import Option, int_at_least
from .frame import ModuloFrame

#: elements per verified block when none is given (2 bytes of hash per block on every message)
VERIFY_BLOCK = 256
#: ... and at least this many code bits per 16-bit hash (the hashes cost at most 1/32 of the codes)
VERIFY_CODE_BITS = 512
_log = logging.getLogger("lowbit.algorithms.moniqua")


def _check_verify(v) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"verify must be True or False, got {v!r}")


VERIFY_OPT = Option("verify", True, "Moniqua: send a hash of the quantized model; the receiver checks what it "
                    "recovered", bool, _check_verify)
VERIFY_BLOCK_OPT = Option("verify_block", None, "Moniqua verification: elements per hashed block (a failed block is "
                          "repaired alone; default by bits: 512 at 1 bit, 256 above)", int | None,
                          int_at_least("verify_block", 1, "elements per hashed block"))


def default_verify_block(bits: int) -> int:
    """Elements per verified block when none is given: :data:`VERIFY_BLOCK`, or more where the
    codes are so narrow that a block's 16-bit hash would cost more than 1/32 of its code bits
    (512 at 1 bit)."""
    return max(VERIFY_BLOCK, VERIFY_CODE_BITS // bits)


@dataclass
class Sent:
    """What a worker sent at step k: the wire message, y (x, or x + v with the shared dither v),
    xh_{k,i} (line 4, v subtracted, in x's dtype), the one-call kernels and my repair requests."""

    wire: torch.Tensor
    y: torch.Tensor
    v: torch.Tensor | None
    x_hat_i: torch.Tensor
    K: object
    asked: dict[int, set[int]]


@dataclass
class Heard:
    """What a worker read at step k: each neighbour's xh_{k,j} (line 5), the indices of the
    elements of its blocks verified wrong (``wrong``; absent: none), the blocks of each edge to
    mix from the repair this step (``repair``: asked by either end), the blocks to ask next step
    (``nack``), and line 6's sum ``delta`` when the one-call kernels built it already (``mixed``)."""

    delta: torch.Tensor
    repair: dict[int, set[int]]
    mixed: bool = True
    x_hat: dict[int, torch.Tensor] = field(default_factory=dict)
    wrong: dict[int, torch.Tensor] = field(default_factory=dict)
    nack: dict[int, list[int]] = field(default_factory=dict)


def receive(state, ctx, k: int, x: torch.Tensor, codec: ModuloCodec, sent: Sent, received: dict,
            verify: bool) -> Heard:
    """Line 5 for each neighbour j, xh_{k,j} decoded against my y, verified block by block: a
    wrong block is counted, left out of this step's mix and asked for next step. Each edge's
    blocks to mix from the repair now: those I asked for and those the neighbour asked of me."""
    frame, d = state.frame, x.numel()
    nb = frame.nblocks(d)
    heard = Heard(delta=torch.zeros_like(x), repair={j: set(b) for j, b in sent.asked.items()})
    got = frame.receive(codec, {j: received[j] for j in ctx.neighbors}, sent.y, sent.K, v=sent.v,
                        x_hat_i=sent.x_hat_i, w=ctx.w, delta=heard.delta)
    for j in ctx.neighbors:
        r = got[j]
        heard.mixed = heard.mixed and r.mixed
        if ctx.rank in r.requests:
            heard.repair.setdefault(j, set()).update(r.requests[ctx.rank])
        if verify:
            state.window[1] += nb
            if r.wrong:  # never use a wrong block: leave it out of this step's mix
                _mismatch(state, ctx, k, j, len(r.wrong), nb)
                heard.nack[j] = sorted(r.wrong)
                heard.wrong[j] = frame.block_elements(r.wrong, d, x.device)[0]
        heard.x_hat[j] = r.x_hat
    return heard


def repair(frame: ModuloFrame, ctx, x: torch.Tensor, blocks: dict[int, set[int]]) -> dict:
    """The repair round, only on the edges (and blocks) with a request: {j: (the indices of the
    blocks' elements, (x_j - x_i) there)} (one counted neighbour exchange). Both values are as
    the repair codes carry them (a block's codes depend on that block alone), so the two ends
    of an edge add opposite terms and line 6 keeps the models' average. A neighbour's repair
    that lacks a block of the edge (both ends ask for the same ones) is a malformed message."""
    asked = {j: b for j, b in blocks.items() if b}
    if not asked:
        return {}
    d = x.numel()
    msg = frame.repair_message(x, set().union(*asked.values()))
    got = ctx.transport.neighbor_exchange(msg, sorted(asked))
    mine_at, mine = frame.read_repair(msg, d, x.device, ctx.rank)
    exact = {}
    for j, b in asked.items():
        at, theirs = frame.read_repair(got[j], d, x.device, j)
        elem = frame.block_elements(b, d, x.device)[0]
        pos = torch.searchsorted(at, elem)
        if pos.numel() and (int(pos.max()) >= at.numel() or not torch.equal(at[pos], elem)):
            raise frame._malformed(j, f"it lacks blocks of the repair both ends asked for ({sorted(b)})",
                                   "repair message")
        exact[j] = (elem, theirs[pos].to(x.dtype) - mine[torch.searchsorted(mine_at, elem)].to(x.dtype))
    return exact


def _mismatch(state, ctx, k: int, j: int, bad: int, nb: int) -> None:
    state.mismatches += bad
    state.window[0] += bad
    state.mismatched_messages += 1
    _log.debug("moniqua: worker %d recovered %d of %d blocks of worker %d wrong at step %d (theta %g)",
               ctx.rank, bad, nb, j, k, state.theta)


def mismatch_note(report: dict) -> str | None:
    """The warning of a run whose verification found blocks recovered wrong."""
    if not report.get("mismatched_blocks"):
        return None
    return (f"{report['mismatched_blocks']} blocks in {report['mismatched_messages']} messages were "
            f"recovered wrong (theta {report['theta']:g} was below the models' distance there); "
            f"verification left them out of their step's mix and repaired them the step after")
