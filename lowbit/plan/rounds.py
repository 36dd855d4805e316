"""What a step's rounds cost on the real transport of this host (:func:`calibrate`), and how the
plan prices a round with it (:class:`RoundCosts`).

A *round* (:class:`Round`) is one call a method's step makes on its transport, as the
:class:`~lowbit.plan.mirror.MirrorTransport` recorded it (tracked by the ledger or not: the
decentralized wrapper's fault agreement is a 40-byte all-gather outside the ledger), or one
all-reduce torch's DDP issues. Without a calibration the network model prices it: its messages,
and the framing rounds the real transport adds (a neighbour exchange states its sizes in a first
point-to-point round; an all-gather whose shape is not fixed agrees on the sizes first).

:func:`calibrate` launches ``processes`` real processes on this host (gloo; over loopback, or over
the ``tc tbf`` links of :class:`~lowbit.comm.shaping.ShapedNetwork` at a given rate) and, in each,
replays every method's steps, in passes of one step of each method in turn, each begun with the
ranks together (an untimed barrier): the model's own step
(forward, backward, SGD; no communication), then the method's rounds in order on the real
transport, each timed, the method's own compute (as the plan measured it) spent as CPU time
before the last one. The ranks thus arrive at a round as they do in training: a round's time
holds the transport's own CPU time (copies, gloo's threads, futures' callbacks) and the wait
for a peer that computed longer or was not scheduled. It also times the model's step on one
process alone (the others wait; at the start of each pass) against the same step with every
process at once (in the replay): the factor by which ``processes`` processes sharing this host's
cores slow compute. A round's price is the network model's time on the target network plus
what the calibration measured beyond the model's time on the calibration's link (never less
than the model), and the plan's compute (forward, backward, the methods' own compute) is
multiplied by the factor. On the calibration's own link a round costs what it measured.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..comm.ledger import CommRecord
from ..comm.netmodel import NetworkModel, op_messages_and_bytes

#: what a round can be: the transport's calls, and the all-reduce torch's DDP issues itself
CALLS = ("torch_all_reduce", "all_reduce", "all_reduce_async", "all_gather", "all_gather_fixed",
         "all_gather_async", "neighbor_exchange", "broadcast", "gather", "barrier")
#: bytes of a stated size (an int64), the framing rounds' message
_SIZE_BYTES = 8


@dataclass(frozen=True)
class Round:
    """One call of a step: ``call`` (one of :data:`CALLS`), ``nbytes`` the buffer handed to it
    (a neighbour exchange: each message's), ``peers`` the neighbours of an exchange."""

    call: str
    nbytes: int
    peers: int = 1

    def __post_init__(self):
        if self.call not in CALLS:
            raise ValueError(f"call must be one of {', '.join(CALLS)}, got {self.call!r}")


def _r(op: str, nbytes: int, n: int, peers: int = 1) -> CommRecord:
    messages, sent = op_messages_and_bytes(op, int(nbytes), n, peers=peers)
    return CommRecord(op, int(nbytes), sent, messages, peers)


def model_records(r: Round, n: int) -> list[CommRecord]:
    """The messages the network model prices for round ``r`` on ``n`` ranks, the real
    transport's framing rounds included (its size round before an exchange's payload, the size
    agreement before an all-gather whose shape is not fixed)."""
    if r.call in ("torch_all_reduce", "all_reduce", "all_reduce_async"):
        return [_r("all_reduce", r.nbytes, n)]
    if r.call == "all_gather_fixed":
        return [_r("all_gather", r.nbytes, n)]
    if r.call in ("all_gather", "all_gather_async"):
        return [_r("all_gather", _SIZE_BYTES, n), _r("all_gather", r.nbytes, n)]
    if r.call == "neighbor_exchange":
        return [_r("neighbor", _SIZE_BYTES, n, r.peers), _r("neighbor", r.nbytes, n, r.peers)]
    if r.call == "broadcast":
        return [_r("broadcast", r.nbytes, n)]
    if r.call == "gather":
        return [_r("all_gather", _SIZE_BYTES, n), _r("gather", r.nbytes, n)]
    return [_r("all_reduce", 0, n)]  # a barrier: one empty ring round


def model_seconds(r: Round, n: int, net: NetworkModel) -> float:
    """The network model's seconds for round ``r`` on ``n`` ranks (:func:`model_records`)."""
    return net.step_seconds(model_records(r, n), n)


@dataclass
class RoundCosts:
    """A calibration's result (:func:`calibrate`): ``processes`` processes of this host on
    ``link`` (``rate`` bits/s, None: loopback; ``latency_s`` per message, measured there), per
    method the rounds of its step as replayed (``rounds``) and each one's seconds (``seconds``:
    the mean over the ranks of each rank's median), and the compute factor
    (``compute_shared_seconds / compute_solo_seconds``: the model's step with every process
    computing at once, over the step of one process alone)."""

    processes: int
    link: str
    rate: float | None
    latency_s: float
    rounds: dict = field(default_factory=dict)  # method -> [Round, ...] as replayed
    seconds: dict = field(default_factory=dict)  # method -> [seconds, ...]
    compute_solo_seconds: float = 0.0
    compute_shared_seconds: float = 0.0

    @property
    def compute_factor(self) -> float:
        """How much slower the model's step runs with ``processes`` processes on this host's cores."""
        if not self.compute_solo_seconds > 0:
            return 1.0
        return self.compute_shared_seconds / self.compute_solo_seconds

    @property
    def network(self) -> NetworkModel:
        """The calibration's link as the network model sees it (loopback: no bandwidth limit)."""
        return NetworkModel(math.inf if self.rate is None else float(self.rate), self.latency_s)

    def _extra(self, method: str, i: int) -> float:
        r = self.rounds[method][i]
        return max(0.0, self.seconds[method][i] - model_seconds(r, self.processes, self.network))

    def extra_seconds(self, method: str, rounds: Sequence[Round]) -> list[float]:
        """What each of ``rounds`` (one step of ``method``) took beyond the network model's time
        on the calibration's link (>= 0): the replayed round at the same place of the method's
        step where the step has the same calls; else the replayed round of the same call (and
        neighbours) nearest in size, of any method (0 where none was replayed)."""
        mine = self.rounds.get(method)
        if mine is not None and [r.call for r in mine] == [r.call for r in rounds]:
            return [self._extra(method, i) for i in range(len(rounds))]
        every = [(m, i, r) for m, rs in self.rounds.items() for i, r in enumerate(rs)]
        out = []
        for r in rounds:
            same = [e for e in every if e[2].call == r.call and e[2].peers == r.peers] or \
                   [e for e in every if e[2].call == r.call]
            if not same:
                out.append(0.0)
                continue
            m, i, _ = min(same, key=lambda e: abs(math.log((e[2].nbytes + 1) / (r.nbytes + 1))))
            out.append(self._extra(m, i))
        return out

    def to_json(self) -> dict:
        """The calibration as plain JSON values."""
        return {"processes": self.processes, "link": self.link, "latency_s": self.latency_s,
                "compute_solo_seconds": self.compute_solo_seconds,
                "compute_shared_seconds": self.compute_shared_seconds, "compute_factor": self.compute_factor,
                "rounds": {m: [{"call": r.call, "nbytes": r.nbytes, "peers": r.peers, "seconds": s,
                                "model_seconds": model_seconds(r, self.processes, self.network)}
                               for r, s in zip(rs, self.seconds[m])] for m, rs in self.rounds.items()}}


def ddp_rounds(method: str, ops) -> list[Round]:
    """The rounds of DDP method ``method``'s ops (``(kind, CommRecord)``, as the plan records
    them): torch's own all-reduces, or the transport's calls of lowbit's hooks (synchronous or
    asynchronous, as the mirror saw them)."""
    if not method.startswith("lowbit-"):
        return [Round("torch_all_reduce", r.nbytes) for _, r in ops]
    return [Round(r.op + ("_async" if k == "async" else ""), r.nbytes) for k, r in ops]


def method_steps(prof, n: int) -> tuple[dict, dict]:
    """Each method's rounds in one step on ``n`` workers as a
    :class:`~lowbit.plan.profile.Profile` recorded them (a DDP method's ops bucket after bucket;
    a decentralized method's most common step: every call of its transport, the untracked ones
    too, on the ring the plan measured for ``n``), and each method's own compute per step (its
    hook's; the wrapper's beyond a plain step): :func:`calibrate`'s ``steps`` and ``work``."""
    from collections import Counter

    from .methods import GOSSIP_RING

    steps = {m: ddp_rounds(m, [op for bops in ops[n] for op in bops]) for m, ops in prof.hook_ops.items()}
    work = {m: math.fsum(prof.hook_seconds[m]) for m in prof.hook_ops}
    for m, g in prof.gossip.items():
        ring = g[min(n, GOSSIP_RING)]
        seen = Counter(tuple(rs) for rs in ring.get("rounds") or [()])
        steps[m], work[m] = list(seen.most_common(1)[0][0]), ring["overhead_seconds"]
    return steps, work


def step_seconds(method: str, rounds: Sequence[Round], n: int, net: NetworkModel,
                 costs: RoundCosts | None) -> list[float]:
    """Seconds of each of ``rounds`` (one step of ``method``) on ``n`` ranks of ``net``: the
    network model's, plus what the calibration measured beyond it
    (:meth:`RoundCosts.extra_seconds`) when there is one."""
    base = [model_seconds(r, n, net) for r in rounds]
    if costs is None:
        return base
    return [b + e for b, e in zip(base, costs.extra_seconds(method, rounds))]


# --- the calibration's processes ----------------------------------------------------------------


def _peers(rank: int, processes: int, wanted: int) -> list[int]:
    """The neighbours of a replayed exchange: the other rank of two, else both ring neighbours."""
    if processes == 2 or wanted <= 1 and processes % 2 == 0:
        return [rank ^ 1]
    return [(rank - 1) % processes, (rank + 1) % processes]


def _buffer(nbytes: int) -> torch.Tensor:
    if nbytes % 4 == 0 and nbytes > 0:
        return torch.zeros(nbytes // 4)
    return torch.zeros(max(nbytes, 1), dtype=torch.uint8)


def _runner(transport, r: Round):
    """A function that runs round ``r`` once on the real ``transport``."""
    import torch.distributed as dist

    if r.call == "neighbor_exchange":
        peers, buf = _peers(transport.rank, transport.world_size, r.peers), torch.zeros(r.nbytes, dtype=torch.uint8)
        return lambda: transport.neighbor_exchange(buf, peers)
    x = _buffer(r.nbytes)
    if r.call == "torch_all_reduce":
        return lambda: dist.all_reduce(x, async_op=True).wait()
    if r.call in ("all_reduce_async", "all_gather_async"):
        fn = getattr(transport, r.call)
        return lambda: fn(x).wait()
    if r.call in ("broadcast", "gather"):
        fn = getattr(transport, r.call)
        return lambda: fn(x, 0)
    if r.call == "barrier":
        return transport.barrier
    return lambda fn=getattr(transport, r.call): fn(x)


def _ping(transport, samples: int) -> float:
    """Median seconds of a 4-byte SUM all-reduce on this launch's process group."""
    import torch.distributed as dist

    x = torch.zeros(1)
    times = []
    for i in range(10 + samples):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _calibration_worker(transport, spec: dict) -> dict:
    from .workload import load_workload

    w = load_workload(**spec["workload"])
    model, batch = w.model, w.batch
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def compute() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        w.loss_fn(model, batch).backward()
        opt.step()
        return time.perf_counter() - t0

    seqs = [[Round(*r) for r in seq] for seq in spec["sequences"]]
    runners = [[_runner(transport, r) for r in seq] for seq in seqs]
    warmup, passes = spec["warmup"], spec["repeats"]
    with transport.untracked():
        ping = _ping(transport, spec["ping_samples"])
        solo, shared, times = [], [], [[[] for _ in seq] for seq in seqs]
        # passes: in each, the model's step on one process alone (the others wait), then one step
        # of every method in turn, so that a burst of other load falls on every method alike
        i, t_timed = 0, None
        while i < warmup + passes:
            if i == warmup + 1:  # one timed pass done: as many more as fit in the budget
                took = time.perf_counter() - t_timed
                want = min(spec["max_repeats"], max(passes, int(spec["budget_seconds"] / max(took, 1e-9))))
                passes = int(transport.all_reduce(torch.tensor([want], dtype=torch.int64), "max").item())
            if i == warmup:
                t_timed = time.perf_counter()
            transport.barrier()
            if transport.rank == 0:
                t = compute()
                if i >= warmup:
                    solo.append(t)
            transport.barrier()
            for s, seq in enumerate(runners):
                transport.barrier()  # each step starts with the ranks together, not where the last method left them
                t = compute()
                if i >= warmup:
                    shared.append(t)
                for j, run in enumerate(seq):
                    if j == len(seq) - 1:
                        _cpu_work(spec["work"][s])
                    t0 = time.perf_counter()
                    run()
                    if i >= warmup:
                        times[s][j].append(time.perf_counter() - t0)
            i += 1
        transport.barrier()
    return {"ping": ping, "solo": solo, "shared": shared,
            "rounds": [[statistics.median(t) for t in seq] for seq in times]}


def _cpu_work(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` of its own CPU time (a method's own compute,
    replayed at its place: wall time grows where the process waits for a core)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def calibrate(workload: dict, steps: dict, processes: int = 2, rate: float | None = None, repeats: int = 10,
              warmup: int = 2, ping_samples: int = 50, work: dict | None = None, budget_seconds: float = 5.0,
              max_repeats: int = 60) -> RoundCosts:
    """Replay each method's step (``steps``: method -> the rounds of one step, in order) on
    ``processes`` real gloo processes of this host, over loopback (``rate`` None) or behind
    ``tc tbf`` links of ``rate`` bits/s: ``warmup`` untimed passes, then timed ones, each pass one
    step of every method in turn (interleaved, so that other load on the host falls on every
    method alike; module doc): ``repeats`` of them, or more, up to ``max_repeats``, where the
    first timed pass says they fit in ``budget_seconds`` (a round of a small model costs about a
    millisecond and one in five took 3-8 ms on this host's 2 cores: a median needs dozens).
    ``work``: method -> seconds of the method's own compute (its hook's, or the wrapper's beyond a plain step, as the
    plan measured it), replayed as that much CPU time of the process right before the step's
    last round (where encoding happens), so that the round waits for a peer still encoding.
    ``workload``: :func:`~lowbit.plan.workload.load_workload`'s keyword arguments (a task or a
    ``module:function`` each process can import). A round's figure is the mean over the ranks of
    each rank's median; the latency per message is measured there too (a 4-byte all-reduce over
    its ``2 (processes - 1)`` messages, as :func:`~lowbit.plan.race.measure_latency`)."""
    from ..comm import launch

    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 2:
        raise ValueError(f"processes must be an int >= 2 (a round needs a peer), got {processes!r}")
    for name, v, lo in (("repeats", repeats, 1), ("warmup", warmup, 0), ("max_repeats", max_repeats, repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    methods = list(steps)
    # an exchange is replayed with the neighbours a ring of these processes has (1 on 2, else 2)
    replayed = {m: [Round(r.call, int(r.nbytes), min(int(r.peers), 1 if processes == 2 else 2)) for r in steps[m]]
                for m in methods}
    work = dict(work or {})
    if any(not (isinstance(v, (int, float)) and 0 <= v < math.inf) for v in work.values()):
        raise ValueError(f"work must map methods to CPU seconds >= 0, got {work!r}")
    if not (isinstance(budget_seconds, (int, float)) and 0 <= budget_seconds < math.inf):
        raise ValueError(f"budget_seconds must be a number >= 0, got {budget_seconds!r}")
    spec = {"workload": dict(workload), "sequences": [[(r.call, r.nbytes, r.peers) for r in replayed[m]]
                                                      for m in methods],
            "work": [float(work.get(m, 0.0)) for m in methods], "repeats": repeats, "warmup": warmup,
            "ping_samples": ping_samples, "budget_seconds": float(budget_seconds), "max_repeats": max_repeats}
    if rate is None:
        res = launch(processes, _calibration_worker, spec)
    else:
        from ..comm.shaping import ShapedNetwork

        with ShapedNetwork(processes, rate) as net:
            res = launch(processes, _calibration_worker, spec, network=net)
    seconds = {m: [statistics.fmean(x["rounds"][s][j] for x in res) for j in range(len(replayed[m]))]
               for s, m in enumerate(methods)}
    return RoundCosts(processes, "loopback" if rate is None else f"{rate:g} bit/s", rate,
                      max(x["ping"] for x in res) / (2 * (processes - 1)), replayed, seconds,
                      statistics.median(res[0]["solo"]), statistics.median(statistics.median(x["shared"]) for x in res))
