"""Real network shaping on one Linux host: every rank behind its own rate-limited link.

:class:`ShapedNetwork` builds, for ``n`` ranks, one private network namespace
per rank plus a *hub* namespace holding a bridge. Rank ``r``'s namespace has
one interface (:data:`IFNAME`) with address ``10.231.0.(r+1)/24``, the end of a
veth pair whose other end is a port of the hub's bridge; its egress is shaped
by a token bucket (``tc qdisc ... tbf``) at the given rate. So each rank sends
at most ``bandwidth`` bits/s in total, whatever its peers, as in the
alpha-beta model of :mod:`lowbit.comm.netmodel` when a rank talks to one peer
at a time (with several neighbours the model gives each its own link, the
shaped host shares one among them). This kernel has no ``netem``: latency is
added in user space, per message, by
:class:`~lowbit.comm.distributed.TorchDistributedTransport` (``latency_s``).

:meth:`ShapedNetwork.enter` switches the calling *thread* into a rank's
namespace (``setns``); processes and sockets created meanwhile stay there. The
launcher uses it to start rank ``r`` inside namespace ``r`` and to host the
rendezvous store inside rank 0's. Everything is deleted on exit, also after a
failure. Needs Linux, root (CAP_SYS_ADMIN / CAP_NET_ADMIN), ``ip`` and ``tc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import uuid

IFNAME = "lbnet0"
SUBNET = "10.231.0"
MAX_RANKS = 250
TBF_BURST = "256kb"  # smaller bursts starve TCP on a fast host
_CLONE_NEWNET = 0x40000000


def shaping_unavailable_reason() -> str | None:
    """Why real shaping cannot run here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return f"it needs Linux network namespaces, this is {sys.platform}"
    if os.geteuid() != 0:
        return "it needs root (network namespaces and tc); run as root or drop --shape-bandwidth/--shape-latency"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"the {' and '.join(missing)} command(s) (iproute2) are not installed"
    return None


def check_shaping(option: str = "shape_bandwidth") -> None:
    """Raise ValueError naming ``option`` when real shaping cannot run here."""
    reason = shaping_unavailable_reason()
    if reason is not None:
        raise ValueError(f"{option}: real network shaping is not available: {reason}")


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"network shaping: `{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET) failed: {os.strerror(err)}")


class ShapedNetwork:
    """``n`` namespaced ranks, each behind a link of ``bandwidth_bps`` bits/s (a context manager)."""

    def __init__(self, n: int, bandwidth_bps: float):
        if not isinstance(n, int) or not 1 <= n <= MAX_RANKS:
            raise ValueError(f"n must be an integer in 1..{MAX_RANKS}, got {n!r}")
        if not bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps!r}")
        check_shaping()
        self.n = n
        self.bandwidth_bps = float(bandwidth_bps)
        tag = uuid.uuid4().hex[:8]
        self.hub = f"lowbit-{tag}-hub"
        self.namespaces = [f"lowbit-{tag}-r{r}" for r in range(n)]
        self._made: list[str] = []

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self) -> "ShapedNetwork":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        hub = self.hub
        _run("ip", "netns", "add", hub)
        self._made.append(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        rate = f"{int(round(self.bandwidth_bps))}bit"
        for r, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            port = f"p{r}"
            _run("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _run("ip", "-n", hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", hub, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # A link is a steady pipe in the model: no slow-start restart after an idle step.
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", "tbf",
                 "rate", rate, "burst", TBF_BURST, "latency", "200ms")

    def close(self) -> None:
        """Delete every namespace made (their veths go with them); idempotent."""
        while self._made:
            ns = self._made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    @contextlib.contextmanager
    def enter(self, rank: int):
        """Run the block with the calling thread inside rank ``rank``'s namespace."""
        if not 0 <= rank < self.n:
            raise ValueError(f"rank must be in 0..{self.n - 1}, got {rank}")
        with open("/proc/thread-self/ns/net") as home, open(f"/var/run/netns/{self.namespaces[rank]}") as target:
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())
