"""Alpha-beta network model: ledger records -> emulated communication seconds.

Every directed link between two ranks has the same bandwidth B (bits/s) and
latency a (s); links are full duplex and independent of each other. A message
of m bytes over one link costs ``message_seconds(m) = a + 8 m / B``. Messages
of one op that go to distinct peers travel on distinct links in parallel;
messages on the same link go one after another. Collectives use the textbook
ring formulas (Thakur, Rabenseifner & Gropp 2005):

- neighbour exchange: one message per neighbour, each on its own link, all in
  parallel: one message time (``CommRecord.peers`` links);
- ring all-reduce of m bytes on n ranks: each rank sends 2(n-1)/n * m bytes in
  2(n-1) messages; time 2(n-1) * a + 2(n-1)/n * 8 m / B;
- ring all-gather of m bytes per rank: (n-1) messages of m bytes, one after
  another;
- broadcast: binomial tree, ceil(log2 n) rounds of one message;
- gather to one rank: the root's link receives (n-1) m bytes.

Synchronous step (:meth:`NetworkModel.step_seconds`): the ops a rank issues in
one step are blocking calls, each starting when the one before returned, so
their times add up.

Asynchronous pairwise gossip (AD-PSGD, :meth:`NetworkModel.gossip_step_seconds`):
the active worker i sends its request to one neighbour j (link i->j) and waits
for j's reply (link j->i), which j's responder sends once the request has
arrived (lowbit's protocol, :mod:`lowbit.comm.distributed`): a round trip,
``message_seconds(request) + message_seconds(reply)``. The ledger holds the
request on i's ledger and the reply on j's (each a one-peer "neighbor"
record, at its sender's step); the record says neither the peer nor whether
it is a request or a reply. Every message is priced exactly once, as one leg
of the round trip of the exchange it belongs to; replies a worker sends as
the passive side do not delay that worker (a responder thread sends them).
Contention between exchanges (a reply and a request on the same link at the
same time, two requests queued at one responder) is not modelled: which
messages meet on a link depends on timing the ledger does not record.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .ledger import CommRecord

_PREFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
             "ki": 2.0 ** 10, "mi": 2.0 ** 20, "gi": 2.0 ** 30, "ti": 2.0 ** 40}
#: bandwidth units as written (after a decimal k/M/G/T or binary Ki/Mi/Gi/Ti prefix): bits or bytes per second
BANDWIDTH_UNITS = {"bit": 1, "bits": 1, "bit/s": 1, "bits/s": 1, "bps": 1,
                   "B": 8, "B/s": 8, "Bps": 8, "byte": 8, "bytes": 8, "byte/s": 8, "bytes/s": 8}


def parse_bandwidth(text: str | float) -> float:
    """A bandwidth as written -> bits per second: ``100Mbit``, ``1Gbit/s``, ``200Mbps`` (bits),
    ``12.5MB/s``, ``12.5MB``, ``1MiB/s``, ``2GBps`` (bytes: ``B`` is a byte, so ``12.5MB/s`` is
    100 Mbit/s), or a bare number of bit/s. Prefixes k, M, G, T are decimal (any case), Ki, Mi, Gi,
    Ti binary. ``b`` alone (``Mb``, ``Mb/s``) is ambiguous and refused, as is any unit not in
    :data:`BANDWIDTH_UNITS`, with a ValueError naming the valid ones."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*(?:([kmgtKMGT]i?)(?=[a-zA-Z]))?(\S*?)\s*", str(text))
        if not m:
            raise ValueError(f"bandwidth={text!r} is not understood; use e.g. 100Mbit, 1Gbit/s, 200Mbps, 12.5MB/s")
        num, prefix, unit = m.groups()
        if unit == "":
            factor = None if prefix else 1  # "10M": bits or bytes?
        else:  # "bit" in any case; "B" (byte) and "b" (bit, only in bps) as written
            factor = 1 if unit.lower() in ("bit", "bits", "bit/s", "bits/s") else BANDWIDTH_UNITS.get(unit)
        if factor is None:
            raise ValueError(f"bandwidth={text!r}: unit {(prefix or '') + unit!r} is not understood; valid units are "
                             f"{', '.join(BANDWIDTH_UNITS)} (bits for bit/bps, bytes for B/byte), after an optional "
                             f"prefix k, M, G, T (decimal) or Ki, Mi, Gi, Ti (binary), e.g. 100Mbit or 12.5MB/s")
        value = float(num) * _PREFIXES[(prefix or "").lower()] * factor
    if not value > 0 or math.isinf(value):
        raise ValueError(f"bandwidth must be a positive finite number of bits/s, got {text!r}")
    return value


def parse_latency(text: str | float) -> float:
    """'1ms', '150us', '0.15ms', '2s' or a number of seconds -> seconds."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*(s|ms|us|ns)?\s*", str(text), re.I)
        if not m:
            raise ValueError(f"latency={text!r} is not understood; use e.g. 1ms, 150us, 0.002s")
        num, unit = m.groups()
        value = float(num) * {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[(unit or "s").lower()]
    if value < 0 or math.isinf(value):
        raise ValueError(f"latency must be >= 0 seconds, got {text!r}")
    return value


def ring_allreduce_sent_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` on ``n`` ranks."""
    return 0 if n <= 1 else (2 * (n - 1) * nbytes) // n


def op_messages_and_bytes(op: str, nbytes: int, n: int, peers: int = 1, root: bool = False) -> tuple[int, int]:
    """(messages, sent bytes) that one rank puts on the wire for one op."""
    if n <= 1:
        return 0, 0
    if op == "neighbor":
        return peers, peers * nbytes
    if op == "all_reduce":
        return 2 * (n - 1), ring_allreduce_sent_bytes(nbytes, n)
    if op == "all_gather":
        return n - 1, (n - 1) * nbytes
    if op == "broadcast":  # the root's bytes; tree relays are charged to the root's count
        return (math.ceil(math.log2(n)), math.ceil(math.log2(n)) * nbytes) if root else (0, 0)
    if op == "gather":
        return (0, 0) if root else (1, nbytes)
    raise ValueError(f"unknown op {op!r}")


@dataclass(frozen=True)
class NetworkModel:
    """Bandwidth in bits/s and latency in seconds of every link."""

    bandwidth: float
    latency: float

    @classmethod
    def parse(cls, bandwidth: str | float, latency: str | float) -> "NetworkModel":
        return cls(parse_bandwidth(bandwidth), parse_latency(latency))

    def _t(self, nbytes: float) -> float:
        return nbytes * 8.0 / self.bandwidth

    def message_seconds(self, nbytes: float) -> float:
        """One message of ``nbytes`` over one link: latency + 8 * nbytes / bandwidth."""
        if not (isinstance(nbytes, (int, float)) and 0 <= nbytes < math.inf):
            raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
        return self.latency + self._t(nbytes)

    def op_seconds(self, rec: CommRecord, n: int) -> float:
        """Seconds of one op as ``rec`` records it, on ``n`` ranks (see the module doc)."""
        if n <= 1:
            return 0.0
        a, m = self.latency, rec.nbytes
        if rec.op == "neighbor":  # one message per peer, each on its own link, in parallel
            return self.message_seconds(m) if rec.peers else 0.0
        if rec.op == "all_reduce":
            return 2 * (n - 1) * a + self._t(2 * (n - 1) / n * m)
        if rec.op == "all_gather":
            return (n - 1) * (a + self._t(m))
        if rec.op == "broadcast":
            return math.ceil(math.log2(n)) * (a + self._t(m))
        if rec.op == "gather":
            return a + self._t((n - 1) * m)
        raise ValueError(f"unknown op {rec.op!r}")

    def step_seconds(self, records, n: int) -> float:
        """A synchronous step: its ops run one after another (each a blocking call)."""
        return math.fsum(self.op_seconds(r, n) for r in records)

    def exchange_seconds(self, request_nbytes: float, reply_nbytes: float, n: int) -> float:
        """One pairwise gossip exchange as its active side waits for it: the request
        on one link, then the reply on the link back (a round trip)."""
        if n <= 1:
            return 0.0
        return self.message_seconds(request_nbytes) + self.message_seconds(reply_nbytes)

    def gossip_step_seconds(self, records, n: int) -> float:
        """An asynchronous step's communication: the round trip of the worker's own
        exchange. ``records``: the step's ledger records, the worker's request and the
        replies it sent as the passive side, all one-peer "neighbor" messages. They
        must have one size m (lowbit's pairwise exchanges send one payload of one
        size each way, so the reply the worker waits for has size m too); the step
        costs ``exchange_seconds(m, m)``, 0 when it sent nothing (no neighbour)."""
        records = list(records)
        for r in records:
            if r.op != "neighbor" or r.peers != 1:
                raise ValueError(f"an asynchronous step holds only one-peer gossip messages, got {r!r}")
        sizes = {r.nbytes for r in records}
        if len(sizes) > 1:
            raise ValueError(f"the gossip messages of one step must have one size (the ledger does not tell "
                             f"the request from the replies), got sizes {sorted(sizes)}")
        if not sizes:
            return 0.0
        m = sizes.pop()
        return self.exchange_seconds(m, m, n)


def overlap_backward(backward: float, buckets) -> tuple[float, float]:
    """DDP's overlap of gradient communication with backward, bucket by bucket.

    ``backward``: seconds of backward alone (no hook). ``buckets``: in the order DDP calls its
    hook, ``(ready, compute, sync, comm)``: ``ready`` the second of backward (alone) at which
    the bucket's gradients are all computed; ``compute`` the hook's own compute (encode and
    decode, on the thread or stream that runs backward); ``sync`` the seconds of the rounds the
    hook waits for before it can encode (e.g. a norm's MAX all-reduce); ``comm`` the seconds of
    what it then issues asynchronously (one or more collectives, one after another).

    One network and one compute stream, each doing one thing at a time. At bucket ``i``,
    backward has been delayed by ``D`` (the compute and waiting of the hooks before it), so the
    hook starts at ``ready_i + D``; its synchronous rounds start when the network is free
    (after the previous bucket's communication, as a process group runs its collectives in
    order) and backward waits for them; then the hook computes, and its asynchronous
    communication starts when issued and the network is free. Returns ``(backward end,
    communication end)``, seconds from the start of backward; the step's backward part is their
    maximum (DDP waits for every bucket before the optimizer)."""
    delay, net, last_ready = 0.0, 0.0, 0.0
    for i, b in enumerate(buckets):
        if len(b) != 4:
            raise ValueError(f"buckets[{i}] must be (ready, compute, sync, comm), got {b!r}")
        ready, compute, sync, comm = (float(v) for v in b)
        if not all(math.isfinite(v) and v >= 0 for v in (ready, compute, sync, comm)):
            raise ValueError(f"buckets[{i}]: times must be finite and >= 0, got {b!r}")
        if ready < last_ready:
            raise ValueError(f"buckets[{i}]: ready={ready} is before the previous bucket's {last_ready}; "
                             "give the buckets in the order they become ready")
        last_ready = ready
        t = ready + delay
        if sync > 0:
            start = max(t, net)
            net = start + sync
            delay += net - t
            t = net
        t += compute
        delay += compute
        if comm > 0:
            net = max(t, net) + comm
    if not (math.isfinite(backward) and backward >= last_ready):
        raise ValueError(f"backward={backward} must be finite and no earlier than the last bucket's ready time "
                         f"{last_ready}")
    return backward + delay, net
