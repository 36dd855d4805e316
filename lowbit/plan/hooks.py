"""The DDP methods' hooks as ``lowbit plan`` measures them: what each sends per bucket for
``n`` workers (:func:`torch_powersgd_ops`, a mirror for lowbit's hooks) and its compute per
bucket (medians of interleaved rounds)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from ..bench.hooks import GradBucketStandIn
from ..comm.ledger import CommRecord
from .methods import POWERSGD_RANK, _race_methods
from .mirror import MirrorTransport
from .profile import Bucket, _sync


def _rec(op: str, nbytes: int, n: int, peers: int = 1) -> CommRecord:
    from ..comm.netmodel import op_messages_and_bytes

    messages, sent = op_messages_and_bytes(op, int(nbytes), n, peers=peers)
    return CommRecord(op, int(nbytes), sent, messages, peers)


def torch_powersgd_ops(params: Sequence[torch.Tensor], n: int, rank: int = POWERSGD_RANK,
                       min_compression_rate: float = 2.0, element_size: int = 4,
                       kind: str = "async") -> list[tuple[str, CommRecord]]:
    """The all-reduces torch's ``powerSGD_hook`` issues for one bucket holding ``params``: the
    uncompressed tensors (1-D ones, and matrices that torch's ``_should_compress`` leaves
    alone) in one, then every ``P`` (rows x rank), then every ``Q`` (columns x rank), each
    waiting for the one before (``kind`` ``"async"``: chained in the hook's futures; ``"sync"``
    where the hook's future is awaited before it returns, as ``lowbit bench race`` runs it on
    gloo, :func:`lowbit.bench.race_worker.powersgd_hook_in_order`)."""
    if kind not in ("sync", "async"):
        raise ValueError(f"kind must be 'sync' or 'async', got {kind!r}")
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    dense, p_elems, q_elems = 0, 0, 0
    for t in params:
        if t.dim() <= 1:
            dense += t.numel()
            continue
        rows, cols = t.shape[0], t.numel() // t.shape[0]
        r = min(rows, cols, rank)
        if _should_compress(rows, cols, r, min_compression_rate)[0]:
            p_elems += rows * r
            q_elems += cols * r
        else:
            dense += t.numel()
    ops = [(kind, _rec("all_reduce", dense * element_size, n))] if dense else []
    if p_elems:
        ops += [(kind, _rec("all_reduce", p_elems * element_size, n)),
                (kind, _rec("all_reduce", q_elems * element_size, n))]
    return ops


def _stand_ins(buckets: list[Bucket]) -> list[GradBucketStandIn]:
    """The profiled buckets as the hooks read them, each refilled with its gradient before a call."""
    return [GradBucketStandIn(b.params, b.grad, b.index, i == len(buckets) - 1) for i, b in enumerate(buckets)]


def _ddp_contender(name: str, n: int | None = None, model: nn.Module | None = None):
    """(hook, state, mirror or None) of DDP method ``name``: on the process group (``n`` None:
    what is timed) or, for lowbit's hooks, on a :class:`MirrorTransport` of ``n`` ranks (what
    records the ops ``n`` workers send). ``model``: lowbit's hook state keys its error memory
    by the model's parameter names, as the race binds it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    from ..integrations.ddp_hooks import make_hook

    race = _race_methods().get(name)
    if race is not None and race.kind == "torch":
        if race.hook is None:
            return dh.allreduce_hook, None, None
        if race.hook == "fp16":
            return dh.fp16_compress_hook, None, None
        if race.hook != "powersgd":
            raise ValueError(f"method {name!r}: torch hook {race.hook!r} is not planned")
        state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2,
                                 use_error_feedback=True, warm_start=True)
        return ph.powerSGD_hook, state, None
    if race is not None:
        hook_name, opts = race.hook, dict(race.options)
    elif name.startswith("lowbit-qsgd-maxnorm-"):  # any bits (repro throughput-model times 2, 4 and 8)
        hook_name, opts = "qsgd-maxnorm", {"bits": int(name.rsplit("-", 1)[1])}
    else:
        raise ValueError(f"method {name!r} is not a DDP method of the race")
    state, hook = make_hook(hook_name, **opts, **({} if model is None else {"model": model}))
    if n is None:
        return hook, state, None
    mirror = MirrorTransport(n, group=state.process_group)
    state._transport = mirror  # the hook's collectives go to n mirrored ranks (LowbitHookState._comm keeps it)
    return hook, state, mirror


def _torch_ops(name: str, b: Bucket, n: int, dev) -> list[tuple[str, CommRecord]]:
    es = b.grad.element_size()
    hook = _race_methods()[name].hook
    if hook is None:  # DDP's own all-reduce of the bucket
        return [("async", _rec("all_reduce", b.numel * es, n))]
    if hook == "fp16":
        return [("async", _rec("all_reduce", b.numel * 2, n))]
    # on gloo (the CPU) the race awaits the hook's chained collectives before backward goes on
    return torch_powersgd_ops(b.params, n, element_size=es, kind="sync" if torch.device(dev).type == "cpu" else "async")


def _run_pass(hook, state, mirror, buckets: list[GradBucketStandIn], dev):
    """One iteration's hook calls, bucket by bucket, each run to its result: (seconds per
    bucket, ops per bucket as the mirror recorded them, or None)."""
    secs, ops = [], []
    for hb in buckets:
        hb.refill()
        if mirror is not None:
            mirror.calls = []
        _sync(dev)
        t0 = time.perf_counter()
        hook(state, hb).wait()
        _sync(dev)
        secs.append(time.perf_counter() - t0)
        ops.append(list(mirror.calls) if mirror is not None else None)
    return secs, ops


def _hook_ops(name: str, buckets: list[Bucket], n: int, dev) -> list[list[tuple[str, CommRecord]]]:
    """What DDP method ``name`` sends for each bucket on ``n`` workers: lowbit's hooks run on a
    mirror of ``n`` ranks (the codes in the width ``n`` workers need, as the hook packs them);
    torch's hooks as torch's code issues them (:func:`torch_powersgd_ops`)."""
    if not name.startswith("lowbit-"):
        return [_torch_ops(name, b, n, dev) for b in buckets]
    hook, state, mirror = _ddp_contender(name, n)
    hbs = _stand_ins(buckets)
    return _run_pass(hook, state, mirror, hbs, dev)[1]


def _time_hooks(buckets: list[Bucket], methods: Sequence[str], dev, rounds: int, warm: int = 3,
                min_run_time: float = 0.02, model: nn.Module | None = None) -> dict:
    """Per DDP method: the hook's time per bucket on the one-process group (the collective a
    local copy): each round times, for every method and bucket, the refill of the bucket and
    the refill plus the hook run to its result (``torch.utils.benchmark``'s blocked_autorange,
    ``min_run_time`` seconds each; the hook's time is the difference), and the figures are
    medians over ``rounds`` rounds that interleave the methods, after ``warm`` untimed passes
    (3: torch's PowerSGD compresses from its third)."""
    from ..bench.timing import measure as timed

    threads = torch.get_num_threads()
    contenders = {}
    for m in methods:
        hook, state, _ = _ddp_contender(m, model=model)
        hbs = _stand_ins(buckets)
        for _ in range(warm):
            _run_pass(hook, state, None, hbs, dev)
        contenders[m] = (hook, state, hbs)
    runs: dict = {m: [] for m in methods}
    for _ in range(rounds):
        for m, (hook, state, hbs) in contenders.items():
            row = []
            for hb in hbs:
                refill = timed(hb.refill, dev, min_run_time, threads, "wall")
                call = timed(lambda hb=hb: (hb.refill(), hook(state, hb).wait()), dev, min_run_time, threads, "wall")
                row.append(max(call - refill, 0.0))
            runs[m].append(row)
    return {m: [statistics.median(r[i] for r in runs[m]) for i in range(len(buckets))] for m in methods}
