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
are both answered by their responders. ``gossip_close`` sends a DONE header to
every neighbour and joins the responder, which stops once every neighbour has
sent DONE (a finished rank keeps answering those still training), or, once it
has heard another rank's fault (a faulty rank sends no DONE), raises it at
once, its responder left answering requests with the fault.
A fault (``gossip_fault``) is a FAULT header (kind, the fault word, its step)
sent to every neighbour; a responder that hears one forwards it once to its
other neighbours (``isend``: two responders forwarding to each other do not
wait on each other), and from then on a rank answers every request with a
FAULT header instead of a reply, and its worker raises ``GossipFault`` at its
next gossip or in ``gossip_close``.

:class:`GlooGossip` is the transport's part that runs it (its ``_gossip_*`` steps); it uses
the transport's ``rank``, ``group``, ``_gossip_peers``, ``_beat`` and ``_check_stated``.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from .base import GossipFault
from .liveness import DIAGNOSE_S

# message tags on the gossip group, and header kinds
_TAG_REQ, _TAG_REQ_DATA, _TAG_REP, _TAG_REP_DATA = 701, 702, 703, 704
_KIND_REQUEST, _KIND_DONE, _KIND_FAULT, _KIND_REPLY = 1, 2, 3, 4


class GlooGossip:
    """The asynchronous gossip steps of a ``torch.distributed`` transport (see the module doc):
    a responder thread per rank on a gloo group of its own, faults forwarded once."""

    def _gossip_open(self, neighbors, handler, clock):
        if self.group is not None:
            raise ValueError("asynchronous gossip runs on the default process group (process_group=None)")
        self._g_group = dist.new_group(backend="gloo")  # collective: every rank opens
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
        # set when the responder ends (every neighbour sent DONE) or hears a fault: gossip_close
        # waits on it (a faulty neighbour never sends DONE; this rank's responder stays up to
        # answer the others' requests with the fault)
        self._g_wake = threading.Event()
        self._g_thread = threading.Thread(target=self._responder, args=(tuple(neighbors),),
                                          name=f"lowbit-gossip-responder-{self.rank}", daemon=True)
        self._g_thread.start()

    def _responder(self, neighbors) -> None:
        """Answer requests until every neighbour has sent DONE."""
        g, open_peers = self._g_group, set(neighbors)
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
                if kind == _KIND_FAULT:
                    self._heard_fault(n, step, src)
                    continue
                req = torch.empty(self._check_stated(n, src, "gossip request"), dtype=torch.uint8)
                if n:
                    dist.recv(req, src=src, group=g, tag=_TAG_REQ_DATA)
                fault = self._g_fault
                if fault is not None:  # a rank that stopped answers with the fault, not a reply
                    dist.send(torch.tensor([_KIND_FAULT, fault[0], fault[1]], dtype=torch.int64), dst=src, group=g,
                              tag=_TAG_REP)
                    continue
                reply = self._g_handler(src, step, req).detach().cpu().contiguous()
                dist.send(torch.tensor([_KIND_REPLY, reply.numel(), step], dtype=torch.int64), dst=src, group=g,
                          tag=_TAG_REP)
                if reply.numel():
                    dist.send(reply, dst=src, group=g, tag=_TAG_REP_DATA)
        except BaseException as e:  # noqa: BLE001 - re-raised on the worker's own thread
            self._g_error = e
        finally:
            self._g_wake.set()

    def _heard_fault(self, word: int, step: int, src: int) -> None:
        """The responder heard a FAULT header from ``src``: keep the first, forward it once to the
        other neighbours (not after DONE: their responders may have stopped)."""
        if not (0 <= word < 1 << 62 and 0 <= step < 1 << 62):
            raise RuntimeError(f"rank {self.rank}: rank {src} sent a gossip fault header with word {word} and step "
                               f"{step}, outside [0, 2^62): a corrupt or hostile peer")
        with self._g_lock:
            if self._g_fault is not None:
                return
            self._g_fault = (word, step, src)
            self._g_wake.set()
            if self._g_done:
                return
            hdr = torch.tensor([_KIND_FAULT, word, step], dtype=torch.int64)
            for j in self._gossip_peers or ():
                if j != src:
                    self._g_sends.append(dist.isend(hdr, dst=j, group=self._g_group, tag=_TAG_REQ))

    def _raise_fault(self) -> None:
        """Raise the fault this rank heard as a GossipFault, once (not one this rank sent), after
        its forwards are out (this process may exit right after)."""
        fault = self._g_fault
        if fault is not None and not self._g_fault_known:
            self._g_fault_known = True
            with self._g_lock:
                sends, self._g_sends = self._g_sends, []
            for w in sends:
                try:
                    w.wait()
                except RuntimeError:  # that neighbour is gone: nothing to tell it
                    pass
            raise GossipFault(*fault)

    def _gossip_fault(self, word, step):
        with self._g_lock:
            self._g_fault_known = True
            if self._g_fault is not None or self._g_done:
                return
            self._g_fault = (word, step, self.rank)
            hdr = torch.tensor([_KIND_FAULT, word, step], dtype=torch.int64)
            sends = [dist.isend(hdr, dst=j, group=self._g_group, tag=_TAG_REQ) for j in self._gossip_peers]
        for w in sends:  # sent before this rank raises (its process may exit right after)
            w.wait()

    def _check_responder(self) -> None:
        if self._g_error is not None:
            raise RuntimeError(f"rank {self.rank}: the gossip responder failed: {self._g_error!r}") from self._g_error

    def _gossip(self, peer, make, step):
        self._beat()
        self._raise_fault()  # a fault first: the responder may have failed on the faulty rank's exit
        self._check_responder()
        g = self._g_group
        buf = make()
        send = buf.detach().cpu().contiguous()
        try:
            dist.send(torch.tensor([_KIND_REQUEST, send.numel(), step], dtype=torch.int64), dst=peer, group=g,
                      tag=_TAG_REQ)
            if send.numel():
                dist.send(send, dst=peer, group=g, tag=_TAG_REQ_DATA)
            hdr = torch.empty(3, dtype=torch.int64)
            dist.recv(hdr, src=peer, group=g, tag=_TAG_REP)
        except RuntimeError:
            # the partner is gone: if it (or a rank before it) stopped on a fault, its FAULT header
            # came first; give this rank's responder up to DIAGNOSE_S to take it, then raise that
            self._g_thread.join(DIAGNOSE_S)
            self._raise_fault()
            raise
        kind, n, fstep = (int(v) for v in hdr.tolist())
        if kind == _KIND_FAULT:  # the partner stopped: its fault
            self._heard_fault(n, fstep, peer)
            self._raise_fault()
            raise GossipFault(n, fstep, peer)  # this rank had raised an earlier one: the partner's
        if kind != _KIND_REPLY:
            raise RuntimeError(f"rank {self.rank}: unexpected gossip reply header {hdr.tolist()} from rank {peer}")
        reply = torch.empty(self._check_stated(n, peer, "gossip reply"), dtype=torch.uint8)
        if reply.numel():
            dist.recv(reply, src=peer, group=g, tag=_TAG_REP_DATA)
        return reply.to(buf.device)

    def _gossip_close(self):
        g = self._g_group
        with self._g_lock:  # no fault is forwarded after DONE
            self._g_done = True
            for j in self._gossip_peers:
                dist.send(torch.tensor([_KIND_DONE, 0, 0], dtype=torch.int64), dst=j, group=g, tag=_TAG_REQ)
        self._g_wake.wait()
        if self._g_fault is None or self._g_fault[2] == self.rank:
            self._g_thread.join()  # ended: every neighbour sent DONE (or the responder failed)
            for w in self._g_sends:  # forwards went out before DONE: the neighbours' responders take them
                w.wait()
        # else another rank's fault: raised now, without waiting on forwards to neighbours that may
        # have stopped listening (this process may exit or go on; the responder answers with it)
        self._g_sends = []
        self._raise_fault()
        self._check_responder()
