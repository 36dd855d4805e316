"""A transport of ``n`` equal ranks, without a network: what an algorithm or hook sends for
``n`` workers, recorded op by op (:class:`MirrorTransport`)."""

from __future__ import annotations

from ..comm.base import Transport, completed
from ..comm.ledger import CommRecord
from .rounds import Round


class MirrorTransport(Transport):
    """This rank among ``world_size`` ranks that all hold what it holds: a neighbour sends back
    this rank's own buffer, an all-reduce SUM is ``world_size`` times the tensor (MAX, MIN and
    AND the tensor itself), an all-gather ``world_size`` copies. It runs an algorithm's or a
    hook's real code, with the sizes ``world_size`` ranks need, without a network; the ledger
    records every op as any transport does, and :attr:`calls` says for each all-reduce whether
    it was issued synchronously or asynchronously (``(kind, CommRecord)``, ``kind`` ``"sync"``
    or ``"async"``). :attr:`rounds` lists every call as a :class:`~lowbit.plan.rounds.Round`,
    in order, those outside the ledger (:meth:`~lowbit.comm.base.Transport.untracked`) too."""

    def __init__(self, world_size: int, rank: int = 0, group=None):
        super().__init__(rank, world_size)
        self.group = group
        self.calls: list[tuple[str, CommRecord]] = []
        self.rounds: list[Round] = []
        self.max_message_bytes = None

    def _note(self, kind: str, n_before: int) -> None:
        recs = self.ledger.records.get(self.ledger.step, [])
        if self.ledger.tracking and len(recs) > n_before:
            self.calls.append((kind, recs[-1]))

    def _count(self) -> int:
        return len(self.ledger.records.get(self.ledger.step, []))

    def all_reduce(self, t, op="sum"):
        n = self._count()
        out = super().all_reduce(t, op)
        self._note("sync", n)
        return out

    def all_reduce_async(self, t, op="sum", *, inplace=False):
        n = self._count()
        out = super().all_reduce_async(t, op, inplace=inplace)
        self._note("async", n)
        return out

    def all_gather(self, t):
        n = self._count()
        out = super().all_gather(t)
        self._note("sync", n)
        return out

    def all_gather_async(self, t):
        n = self._count()
        out = super().all_gather_async(t)
        self._note("async", n)
        return out

    def _round(self, call: str, t=None, peers: int = 1) -> None:
        self.rounds.append(Round(call, 0 if t is None else t.numel() * t.element_size(), peers))

    def _neighbor_exchange(self, buf, neighbors):
        self._round("neighbor_exchange", buf, len(neighbors))
        return {j: buf.clone() for j in neighbors}

    def _reduced(self, t, op):
        return t * self.world_size if op == "sum" else t.clone()

    def _all_reduce(self, t, op):
        self._round("all_reduce", t)
        return self._reduced(t, op)

    def _all_reduce_async(self, t, op, inplace=False):
        self._round("all_reduce_async", t)
        return completed(self._reduced(t, op))

    def _all_gather(self, t):
        self._round("all_gather", t)
        return [t.clone() for _ in range(self.world_size)]

    def _all_gather_fixed(self, t):
        self._round("all_gather_fixed", t)
        return [t.clone() for _ in range(self.world_size)]

    def _all_gather_async(self, t):
        self._round("all_gather_async", t)
        return completed([t.clone() for _ in range(self.world_size)])

    def _broadcast(self, t, src):
        self._round("broadcast", t)
        return t.clone()

    def _gather(self, t, dst):
        self._round("gather", t)
        return [t.clone() for _ in range(self.world_size)] if self.rank == dst else None

    def _barrier(self) -> None:
        self._round("barrier")

    def post_refusal(self, text: str) -> None:
        """Nothing to post to: no other rank runs."""

    def posted_refusal(self) -> str | None:
        """No other rank refuses anything."""
        return None
