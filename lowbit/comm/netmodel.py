"""Alpha-beta network model: ledger records -> emulated communication seconds.

A message of m bytes over one link costs ``latency + m / bandwidth``.
Collectives use the textbook ring formulas (Thakur, Rabenseifner & Gropp 2005):

- ring all-reduce of m bytes on n ranks: each rank sends 2(n-1)/n * m bytes in
  2(n-1) messages; time 2(n-1) * latency + 2(n-1)/n * m / bandwidth;
- ring all-gather of m bytes per rank: (n-1) messages of m bytes;
- neighbour exchange: one message per neighbour, the links in parallel;
- broadcast: binomial tree, ceil(log2 n) rounds of one message;
- gather to one rank: the root's link receives (n-1) m bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .ledger import CommRecord

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str | float) -> float:
    """'100Mbit', '1gbit', '200mbps', '12.5MB' (bytes) or a number of bit/s -> bits per second."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([kmgt]?)(bit|bps|b/s|b|byte|bytes|B)?\s*", str(text), re.I)
        if not m:
            raise ValueError(f"bandwidth={text!r} is not understood; use e.g. 100Mbit, 1Gbit, 12.5MB")
        num, prefix, unit = m.groups()
        value = float(num) * _UNITS[prefix.lower()]
        if unit is not None and (unit in ("B", "byte", "bytes") or unit.lower() in ("byte", "bytes")):
            value *= 8
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

    def op_seconds(self, rec: CommRecord, n: int) -> float:
        if n <= 1:
            return 0.0
        a, m = self.latency, rec.nbytes
        if rec.op == "neighbor":
            return a + self._t(m) if rec.peers else 0.0
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
        """Ops of one step run one after another."""
        return sum(self.op_seconds(r, n) for r in records)
