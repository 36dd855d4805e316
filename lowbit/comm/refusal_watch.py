"""A refusal posted by another rank ends this rank's waits, while the refusing rank lives on.

A rank that refuses a peer's payload posts why (``Transport.post_refusal``, the default
group's store) and leaves the run out of step with the others. When its process exits, gloo
ends the others' pending ops and they read the posted text. When it stays alive (its caller
catches the error, or it is slow to exit), nothing but the collective timeout would end them:
torch 2.13's gloo cancels no pending op of a rank from Python, and a timed-out ``wait`` on a
point-to-point receive closes every connection of the group (docs/FAULTS.md, the probes).

:class:`RefusalWatch`, one per gloo transport, is the way out. Each blocking wait of the
transport runs inside ``with watch.waiting(what):``; :meth:`RefusalWatch.track` names the
latest asynchronous collective. A thread wakes every :data:`SLICE_S` seconds (an ``Event``
wait: it sleeps, never spins) and reads the store only when a wait begun before its last look
has not ended, or the work it saw then has not completed. When a refusal is posted it ends
this rank's pending ops of the group (:func:`break_gloo`: a receive on an unused tag whose
wait times out, on which gloo closes the group's connections, as an exit would), and the wait
raises a RuntimeError saying so, the posted text on its second line. The ranks waiting on this
one then fail too (their connections closed, or their own watch), so every rank ends within
about a second of the refusal, or of its first wait after it. A fault-free run never reads
the store (a wait shorter than a slice is never looked at); a wait costs two acquisitions of
an uncontended lock.
"""

from __future__ import annotations

import datetime
import threading
from typing import Callable

import torch
import torch.distributed as dist

from .gloo_gossip import store_text

#: seconds between the watch thread's looks at the waits in progress
SLICE_S = 0.5
#: the default group's store key of ``Transport.post_refusal``
REFUSAL_KEY = "lowbit/refusal"
# the tag of break_gloo's receive: no message carries it
_BREAK_TAG = 0x4C425246


class RefusalWatch:
    """Ends this rank's waits on ``group`` when another rank posts a refusal (see the module doc).

    ``read()``: the posted refusal text, or None. ``breaker()``: ends every pending op of the
    group on this rank (returns once they have been ended). ``rank``: this rank, for messages.
    """

    def __init__(self, read: Callable[[], str | None], breaker: Callable[[], None], rank: int):
        self._read = read
        self._breaker = breaker
        self._rank = rank
        self._lock = threading.Lock()
        self._begun = 0  # waits begun
        self._ended = 0  # waits ended
        self._pending = None  # the latest asynchronous work, until it is seen completed
        self._contexts: dict[str, _Waiting] = {}
        self._stop = threading.Event()
        self._broken = threading.Event()  # set once breaker() has returned
        self._thread: threading.Thread | None = None
        #: the refusal that ended this rank's waits (None while none has)
        self.refusal: str | None = None

    def waiting(self, what: str) -> "_Waiting":
        """The context around one blocking wait (``what``: the op, for the message)."""
        ctx = self._contexts.get(what)
        if ctx is None:
            ctx = self._contexts[what] = _Waiting(self, what)
        return ctx

    def track(self, work) -> None:
        """``work`` (an asynchronous collective's) is watched until it is seen completed."""
        self._pending = work
        if self._thread is None:
            self._start()

    def check(self, what: str, cause: BaseException | None = None) -> None:
        """Raise the refusal error if a refusal has ended this rank's waits, or if ``what`` failed
        with ``cause`` (a connection closed by a rank that stopped) and a refusal is posted;
        once ``breaker`` has returned (nothing of it is left running when the caller goes on)."""
        ended_here = self.refusal is not None  # by this watch (cause: the break itself)
        if not ended_here:
            text = None if cause is None else self._read()
            if text is None:
                return
            self._end(text)
        self._broken.wait()
        first = f"rank {self._rank}: {what} was ended: another rank refused a peer's payload and left the run"
        if cause is not None and not ended_here:
            first += f" ({str(cause).splitlines()[0][:120] if str(cause) else type(cause).__name__})"
        raise RuntimeError(f"{first}\nposted refusal: {self.refusal}") from cause

    def close(self) -> None:
        """Stop the thread (idempotent) and drop the tracked work."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._pending = None

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=f"lowbit-refusal-watch-{self._rank}",
                                            daemon=True)
        self._thread.start()

    def _stuck(self, begun: int, work) -> bool:
        """A wait begun before the last look (``begun`` waits had begun then) has not ended, or
        the work seen then has not completed: something has waited for a slice at least.
        Called with the lock held."""
        if self._ended < begun:
            return True
        return work is not None and self._pending is work and not work.is_completed()

    def _end(self, text: str, begun: int | None = None, work=None) -> bool:
        """Record the refusal ``text`` and end this rank's pending ops, unless they were ended
        already or (``begun`` given: the thread) the wait it saw has ended since. True if ended."""
        with self._lock:
            if self.refusal is not None or (begun is not None and not self._stuck(begun, work)):
                return False
            self.refusal = text
        try:
            self._breaker()
        finally:
            self._broken.set()
        return True

    def _run(self) -> None:
        begun, work = 0, None
        while not self._stop.wait(SLICE_S) and self.refusal is None:
            with self._lock:
                stuck = self._stuck(begun, work)
                if work is not None and self._pending is work and not stuck:
                    self._pending = None  # completed: not kept alive here
                seen = begun, work
                begun, work = self._begun, self._pending
            if stuck and (text := self._read()) is not None and self._end(text, *seen):
                return


class _Waiting:
    """``with watch.waiting(what):`` around one blocking wait."""

    __slots__ = ("watch", "what")

    def __init__(self, watch: RefusalWatch, what: str):
        self.watch, self.what = watch, what

    def __enter__(self) -> None:
        w = self.watch
        with w._lock:
            w._begun += 1
        if w._thread is None:
            w._start()

    def __exit__(self, kind, e, tb) -> bool:
        w = self.watch
        with w._lock:
            w._ended += 1
        if e is None or isinstance(e, RuntimeError):
            w.check(self.what, e)
        return False


def default_store():
    """The default process group's store, or None where this rank can reach none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def read_refusal(limit: int) -> str | None:
    """The refusal some rank posted on the default group's store (``Transport.post_refusal``)."""
    store = default_store()
    try:
        return None if store is None else store_text(store, REFUSAL_KEY, limit) or None
    except RuntimeError:
        return None


def break_gloo(group, peer: int) -> None:
    """End every pending op of gloo ``group`` on this rank (:class:`RefusalWatch`'s breaker): a
    receive from group rank ``peer`` on a tag no message carries, whose wait times out at once;
    gloo answers a timed-out receive by closing every connection of the group's context (its way
    to abandon an op, measured in docs/FAULTS.md), so each pending op of this rank fails, and so
    do the peers' ops that wait on this rank."""
    try:
        work = dist.irecv(torch.empty(1, dtype=torch.uint8), group=group, group_src=peer, tag=_BREAK_TAG)
        work.wait(timeout=datetime.timedelta(milliseconds=1))
    except RuntimeError:  # the expected timeout, or connections already closed
        pass
