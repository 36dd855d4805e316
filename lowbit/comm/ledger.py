"""The ledger: what one rank sent, per step, as the transport really sent it."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommRecord:
    """One collective or exchange as seen by one rank.

    ``op``: "neighbor", "all_reduce", "all_gather", "broadcast", "gather".
    ``nbytes``: the size of the buffer this rank handed to the op.
    ``sent_bytes`` / ``messages``: what this rank put on the wire for it
    (for all-reduce, the ring algorithm's share; see :mod:`lowbit.comm.netmodel`).
    ``peers``: how many links carried those messages in parallel.
    """

    op: str
    nbytes: int
    sent_bytes: int
    messages: int
    peers: int = 1


@dataclass
class Ledger:
    """Bytes and messages sent by one rank, grouped by step."""

    rank: int
    world_size: int
    step: int = 0
    records: dict[int, list[CommRecord]] = field(default_factory=lambda: defaultdict(list))
    tracking: bool = True
    # Asynchronous gossip records from a background responder thread while the
    # worker's own thread records its requests: appends go through one lock.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, rec: CommRecord, force: bool = False) -> None:
        """Append ``rec`` at the current step. ``force``: count it even inside
        :meth:`Transport.untracked` (a background thread's gossip reply is
        training traffic whatever the worker's own thread is doing)."""
        if self.tracking or force:
            with self._lock:
                self.records[self.step].append(rec)

    def drain(self) -> list[CommRecord]:
        """Every record so far, in step order, removed from the ledger (a consumer that keeps
        its own totals, as the DDP hook's state, reads them this way)."""
        with self._lock:
            recs = [r for s in sorted(self.records) for r in self.records[s]]
            self.records.clear()
        return recs

    @property
    def bytes_sent(self) -> int:
        return sum(r.sent_bytes for recs in self.records.values() for r in recs)

    @property
    def messages_sent(self) -> int:
        return sum(r.messages for recs in self.records.values() for r in recs)

    def step_bytes(self, step: int) -> int:
        return sum(r.sent_bytes for r in self.records.get(step, ()))

    def steps(self) -> list[int]:
        return sorted(self.records)

    def to_rows(self) -> list[tuple]:
        """Flat picklable form: (step, op, nbytes, sent_bytes, messages, peers)."""
        return [(s, r.op, r.nbytes, r.sent_bytes, r.messages, r.peers) for s in self.steps() for r in self.records[s]]

    @classmethod
    def from_rows(cls, rank: int, world_size: int, rows) -> "Ledger":
        led = cls(rank=rank, world_size=world_size)
        for s, op, nbytes, sent, msgs, peers in rows:
            led.records[s].append(CommRecord(op, nbytes, sent, msgs, peers))
        return led
