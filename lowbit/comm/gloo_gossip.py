"""Asynchronous pairwise gossip over ``torch.distributed`` (gloo): the protocol behind
:meth:`~lowbit.comm.base.Transport.gossip` on :class:`~lowbit.comm.distributed.TorchDistributedTransport`.

Asynchronous pairwise gossip (``Transport.gossip``, AD-PSGD) runs on a
separate gloo process group created by ``gossip_open`` (CPU buffers, whatever
the default backend): a background *responder* thread per rank loops on
``recv`` from any source (tag ``_TAG_REQ``) for a 3-int64 header (kind,
length, step), receives the request bytes from that sender, runs the
handler and sends the reply back (tags ``_TAG_REP``/``_TAG_REP_DATA``, a
3-int64 header of the same form, then the bytes). The
active side is the worker's own thread: send header and bytes, receive the
reply. Nothing waits on a global barrier; two ranks asking each other at once
are both answered by their responders.

How a session ends is agreed through the default group's store, under keys of
the gossip group's name (the same on every rank): the session's one *outcome*,
set once (``compare_set``: the first writer wins) to ``fault WORD STEP RANK``,
``failed RANK ...`` or ``closed``. ``gossip_close`` sends a DONE header to
every neighbour (its responder keeps answering those still training), counts
this rank closed in the store (the last of all the ranks to close sets
``closed``) and waits for the outcome (its responder wakes it; the store is
read every ``_POLL_S`` meanwhile): ``closed`` (then the responder has every
DONE and stops), or another rank's fault, raised even by a rank that had taken
all its steps before the faulty one reached its fault.
A fault (``gossip_fault``) is posted as the outcome first, then sent as a FAULT
header (kind, the fault word, its step) to every neighbour; a responder that
hears one forwards it once to its other neighbours (``isend``: two responders
forwarding to each other do not wait on each other; not after this rank's DONE),
and from then on a rank answers every request with a FAULT header instead of a
reply, and its worker raises ``GossipFault`` at its next gossip or in
``gossip_close``: the fault the store holds, so every rank raises the same one
even when two ranks fail at once. An exchange that fails at any of its
messages (the partner gone: it may have read the posted fault and left), or a
responder that fails, raises the posted fault if there is one, and otherwise
posts ``failed``, so that the ranks waiting in ``gossip_close`` end too. The
FAULT headers are only a wake-up (the outcome is posted before anyone is
told): one to a neighbour already gone is dropped, never this rank's error.

:class:`GlooGossip` is the transport's part that runs it (its ``_gossip_*`` steps); it uses
the transport's ``rank``, ``world_size``, ``group``, ``_gossip_peers``, ``_beat``, ``_store``
and ``_check_stated``.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist

from .base import GossipFault


def store_text(store, key: str, limit: int) -> str | None:
    """The text ``store`` holds under ``key`` (its first ``limit`` bytes, decoded), or None while
    the key is unset (checked first: ``get`` would wait for it)."""
    if not store.check([key]):
        return None
    return store.get(key)[:limit].decode("utf-8", "replace")

# message tags on the gossip group, and header kinds
_TAG_REQ, _TAG_REQ_DATA, _TAG_REP, _TAG_REP_DATA = 701, 702, 703, 704
_KIND_REQUEST, _KIND_DONE, _KIND_FAULT, _KIND_REPLY = 1, 2, 3, 4
# how often gossip_close reads the store while it waits for the session's outcome (its responder
# wakes it at once for a fault a neighbour sends; the store tells it of the others' closing)
_POLL_S = 0.05
_MAX_WORD = 1 << 62


class GlooGossip:
    """The asynchronous gossip steps of a ``torch.distributed`` transport (see the module doc):
    a responder thread per rank on a gloo group of its own, faults forwarded once, the end of a
    session agreed through the default group's store."""

    def _gossip_open(self, neighbors, handler, clock):
        if self.group is not None:
            raise ValueError("asynchronous gossip runs on the default process group (process_group=None)")
        if self._store() is None:
            raise RuntimeError("asynchronous gossip needs the default process group's store, which this rank "
                               "cannot reach")
        self._g_group = dist.new_group(backend="gloo")  # collective: every rank opens
        self._g_key = f"lowbit/gossip/{self._g_group.group_name}/"  # the same name on every rank
        self._g_handler = handler
        self._g_error: BaseException | None = None
        # faults: the first one this rank sent or heard, (word, step, src); whether this rank's
        # worker has sent or raised it; the forwarding sends in flight; whether DONE has gone out
        # (after it, nothing more is sent to the neighbours: their responders may have stopped)
        self._g_fault: tuple[int, int, int] | None = None
        self._g_fault_known = False
        self._g_sends: list = []
        self._g_done = False
        self._g_lock = threading.Lock()
        # set when the responder ends or hears a fault: gossip_close waits on it (and the store)
        self._g_wake = threading.Event()
        self._g_ended: list = [None]  # the fault this session ended on (its responder's, once replaced)
        self._g_thread = threading.Thread(target=self._responder, args=(tuple(neighbors),),
                                          name=f"lowbit-gossip-responder-{self.rank}", daemon=True)
        self._g_thread.start()

    # ---- the session's outcome, in the store ---------------------------------
    def _post_outcome(self, text: str) -> str:
        """Set the session's outcome to ``text`` unless a rank set it first; the outcome set."""
        out = self._store().compare_set(self._g_key + "outcome", "", text)
        return out.decode("utf-8", "replace") if isinstance(out, bytes) else str(out)

    def _outcome(self) -> str | None:
        return store_text(self._store(), self._g_key + "outcome", 256)

    def _fault_of(self, text: str | None) -> tuple[int, int, int] | None:
        """The (word, step, rank) of an outcome ``fault WORD STEP RANK``; None for another outcome;
        a RuntimeError for a fault outcome that no rank of this run could have written."""
        if text is None or not text.startswith("fault "):
            return None
        parts = text.split()
        try:
            word, step, rank = (int(v) for v in parts[1:])
        except ValueError:
            word = step = rank = -1
        if not (0 <= word < _MAX_WORD and 0 <= step < _MAX_WORD and 0 <= rank < self.world_size):
            raise RuntimeError(f"rank {self.rank}: the gossip's posted outcome {text[:80]!r} is not a fault of "
                               f"this run's {self.world_size} ranks: a corrupt or hostile peer")
        return word, step, rank

    # ---- the responder ----------------------------------------------------------
    def _responder(self, neighbors) -> None:
        """Answer requests until every neighbour has sent DONE. A responder left answering after
        its session ended on a fault (gossip_close raised it) keeps to that session: once the
        transport has opened another, it answers its requests with the old session's fault and
        touches nothing of the new one."""
        g, wake, ended, handler = self._g_group, self._g_wake, self._g_ended, self._g_handler
        open_peers = set(neighbors)
        try:
            while open_peers:
                hdr = torch.empty(3, dtype=torch.int64)
                src = dist.recv(hdr, src=None, group=g, tag=_TAG_REQ)
                kind, n, step = (int(v) for v in hdr.tolist())
                if src not in neighbors or kind not in (_KIND_DONE, _KIND_FAULT, _KIND_REQUEST):
                    raise RuntimeError(f"rank {self.rank}: unexpected gossip header {hdr.tolist()} from rank {src}")
                if kind == _KIND_DONE:
                    open_peers.discard(src)
                    continue
                current = self._g_group is g
                if kind == _KIND_FAULT:
                    if current:
                        self._heard_fault(n, step, src)
                    continue
                req = torch.empty(self._check_stated(n, src, "gossip request"), dtype=torch.uint8)
                if n:
                    dist.recv(req, src=src, group=g, tag=_TAG_REQ_DATA)
                fault = self._g_fault if current else ended[0]
                if fault is not None:  # a rank that stopped answers with the fault, not a reply
                    dist.send(torch.tensor([_KIND_FAULT, fault[0], fault[1]], dtype=torch.int64), dst=src, group=g,
                              tag=_TAG_REP)
                    continue
                reply = handler(src, step, req).detach().cpu().contiguous()
                dist.send(torch.tensor([_KIND_REPLY, reply.numel(), step], dtype=torch.int64), dst=src, group=g,
                          tag=_TAG_REP)
                if reply.numel():
                    dist.send(reply, dst=src, group=g, tag=_TAG_REP_DATA)
        except BaseException as e:  # noqa: BLE001 - re-raised on the worker's own thread
            if self._g_group is g:
                self._g_error = e
        finally:
            wake.set()

    def _heard_fault(self, word: int, step: int, src: int) -> None:
        """The responder heard a FAULT header from ``src``: keep the first, forward it once to the
        other neighbours (not after DONE: their responders may have stopped)."""
        if not (0 <= word < _MAX_WORD and 0 <= step < _MAX_WORD):
            raise RuntimeError(f"rank {self.rank}: rank {src} sent a gossip fault header with word {word} and step "
                               f"{step}, outside [0, 2^62): a corrupt or hostile peer")
        with self._g_lock:
            if self._g_fault is not None:
                return
            self._g_fault = (word, step, src)
            self._g_wake.set()
            if self._g_done:
                return
            self._g_sends += self._tell(word, step, [j for j in self._gossip_peers or () if j != src])

    def _tell(self, word: int, step: int, peers) -> list:
        """Send a FAULT header to each of ``peers`` (``isend``); the sends begun. Only a wake-up:
        the fault is the session's outcome in the store already (posted before anyone is told),
        so a neighbour that is gone (the ranks that read the outcome raise it and leave) is
        skipped: it has nothing to learn, and a rank whose exchange with it fails reads the store."""
        hdr, sends = torch.tensor([_KIND_FAULT, word, step], dtype=torch.int64), []
        for j in peers:
            try:
                sends.append(dist.isend(hdr, dst=j, group=self._g_group, tag=_TAG_REQ))
            except RuntimeError:  # that neighbour is gone
                pass
        return sends

    @staticmethod
    def _drain(sends) -> None:
        """Wait for FAULT headers :meth:`_tell` began (this process may exit right after); one to a
        neighbour gone meanwhile is dropped (see :meth:`_tell`)."""
        for w in sends:
            try:
                w.wait()
            except RuntimeError:  # that neighbour is gone: nothing to tell it
                pass

    def _raise_fault(self) -> None:
        """Raise the fault this rank heard as a GossipFault, once (not one this rank sent), after
        its forwards are out (this process may exit right after): the one the store holds (the
        first any rank posted), which is the one heard unless two ranks failed at once."""
        fault = self._g_fault
        if fault is not None and not self._g_fault_known:
            self._g_fault_known = True
            with self._g_lock:
                sends, self._g_sends = self._g_sends, []
            self._drain(sends)
            try:
                posted = self._fault_of(self._outcome())
            except RuntimeError:  # the store is gone (or holds no fault of this run): the one heard
                posted = None
            raise GossipFault(*(posted or fault))

    def _gossip_fault(self, word, step):
        with self._g_lock:
            known, self._g_fault_known = self._g_fault_known, True
            if self._g_done:
                return
            first = self._fault_of(self._post_outcome(f"fault {word} {step} {self.rank}"))
            if first is not None and first[2] != self.rank:  # another rank's fault came first
                self._g_fault = self._g_fault or first
                if known:
                    return
                raise GossipFault(*first)  # this rank raises it too, as every rank does
            if self._g_fault is not None:  # heard one that lost the race to the store: told already
                return
            self._g_fault = (word, step, self.rank)
            sends = self._tell(word, step, self._gossip_peers)
        self._drain(sends)  # sent before this rank raises (its process may exit right after)

    def _check_responder(self) -> None:
        """A failed responder (a neighbour gone mid-message: it may have left on the posted fault)
        ends this rank's gossip as a failed exchange does: the posted fault if there is one."""
        if self._g_error is not None:
            self._failed(self._g_error, "its gossip responder failed")
            raise RuntimeError(f"rank {self.rank}: the gossip responder failed: {self._g_error!r}") from self._g_error

    # ---- the active side ---------------------------------------------------------
    def _gossip(self, peer, make, step):
        self._beat()
        self._raise_fault()  # a fault first: the responder may have failed on the faulty rank's exit
        self._check_responder()
        g = self._g_group
        buf = make()
        send = buf.detach().cpu().contiguous()
        hdr = torch.empty(3, dtype=torch.int64)
        with self._exchange(peer, step):
            dist.send(torch.tensor([_KIND_REQUEST, send.numel(), step], dtype=torch.int64), dst=peer, group=g,
                      tag=_TAG_REQ)
            if send.numel():
                dist.send(send, dst=peer, group=g, tag=_TAG_REQ_DATA)
            dist.recv(hdr, src=peer, group=g, tag=_TAG_REP)
        kind, n, fstep = (int(v) for v in hdr.tolist())
        if kind == _KIND_FAULT:  # the partner stopped: its fault
            self._heard_fault(n, fstep, peer)
            self._raise_fault()
            raise GossipFault(n, fstep, peer)  # this rank had raised an earlier one: the partner's
        if kind != _KIND_REPLY:
            raise RuntimeError(f"rank {self.rank}: unexpected gossip reply header {hdr.tolist()} from rank {peer}")
        reply = torch.empty(self._check_stated(n, peer, "gossip reply"), dtype=torch.uint8)
        if reply.numel():
            with self._exchange(peer, step):  # the partner may leave between its header and its bytes
                dist.recv(reply, src=peer, group=g, tag=_TAG_REP_DATA)
        return reply.to(buf.device)

    @contextlib.contextmanager
    def _exchange(self, peer: int, step: int):
        """Around the messages of an exchange with ``peer``: one that fails (the partner gone, e.g.
        on the posted fault) raises the posted fault, else posts that the session failed."""
        try:
            yield
        except RuntimeError as e:
            self._failed(e, f"its exchange with rank {peer} at step {step} failed")
            raise

    def _failed(self, err: BaseException, what: str) -> None:
        """This rank's gossip failed with ``err`` (a partner gone): raise the fault posted, if any
        (the partner stopped on it: posted before it told anyone); else post that the session
        failed, so that no rank waits for it in gossip_close (the caller raises ``err``)."""
        posted = self._post_outcome(f"failed {self.rank}: {what}: {str(err).splitlines()[0][:120] if str(err) else ''}")
        fault = self._fault_of(posted)
        if fault is not None:
            with self._g_lock:
                self._g_fault = self._g_fault or fault
            self._raise_fault()

    # ---- the end of the session --------------------------------------------------
    def _gossip_close(self):
        g, failed = self._g_group, None
        with self._g_lock:  # no fault is forwarded after DONE (the forwards issued before go first)
            self._g_done = True
        # (not under the lock: a DONE waits for the neighbour's responder, which may be waiting for
        # its own main thread's lock, held while it sends its DONE to this rank)
        for j in self._gossip_peers:
            try:
                dist.send(torch.tensor([_KIND_DONE, 0, 0], dtype=torch.int64), dst=j, group=g, tag=_TAG_REQ)
            except RuntimeError as e:  # that neighbour is gone
                failed = failed or (e, f"its DONE to rank {j} failed")
        if failed is not None:
            self._failed(*failed)
            raise failed[0]
        store = self._store()
        store.set(f"{self._g_key}closed/{self.rank}", "1")
        if store.add(self._g_key + "closed", 1) == self.world_size:
            self._post_outcome("closed")
        outcome = self._await_outcome()
        fault = self._fault_of(outcome)
        if fault is not None:
            with self._g_lock:
                self._g_fault = self._g_fault or fault  # the responder answers requests with it
                self._g_ended[0] = self._g_fault
            self._raise_fault()  # unless this rank sent or raised it already
            return  # the responder stays, answering those still training with the fault
        if outcome != "closed":
            raise RuntimeError(f"rank {self.rank}: the asynchronous gossip ended without every rank closing it: "
                               f"rank {outcome[len('failed '):]}")
        self._g_thread.join()  # every rank sent its DONE before it counted itself closed
        for w in self._g_sends:  # forwards went out before DONE: the neighbours' responders take them
            w.wait()
        self._g_sends = []
        self._check_responder()

    def _await_outcome(self) -> str:
        """Wait for the session's outcome: a fault this rank's responder hears wakes it at once, the
        store is read every ``_POLL_S``; a failed responder posts that the session failed. At most
        the store's timeout (the process group's), then a TimeoutError naming the ranks not closed."""
        store = self._store()
        deadline = time.monotonic() + store.timeout.total_seconds()
        while True:
            self._g_wake.clear()  # (set for good once the responder has ended)
            outcome = self._outcome()
            if outcome is not None:
                return outcome
            self._check_responder()
            if time.monotonic() > deadline:
                left = [r for r in range(self.world_size) if not store.check([f"{self._g_key}closed/{r}"])]
                raise TimeoutError(f"rank {self.rank}: waited {store.timeout.total_seconds():g} s (the process "
                                   f"group's timeout) in gossip_close for rank(s) {left} to close their gossip")
            self._g_wake.wait(_POLL_S)
