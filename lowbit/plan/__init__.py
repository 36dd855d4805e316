"""``lowbit plan``: will compression pay for my model on my cluster?

What it measures, on the current device, for one model and one batch:

1. **Forward, backward and optimizer time** of one worker: the model wrapped in torch's own
   ``DistributedDataParallel`` in a one-process group (gloo on the CPU, NCCL on CUDA), default
   buckets (25 MB, the first 1 MB, in reverse parameter order, rebuilt by DDP after its first
   iteration), SGD with momentum; medians over ``repeats`` steps after ``warmup`` steps.
2. **When each DDP bucket becomes ready** during backward: DDP calls a communication hook
   when a bucket's gradients are all computed, so a recording hook (which returns the bucket
   as it is: a one-process average) reads the time of each call from the start of backward
   (CUDA: events on the current stream), and the bucket's parameters.
3. **Each method's own compute** (:data:`METHODS`, the names of ``lowbit bench race``):
   - DDP methods: the method's hook (torch's or lowbit's, as the race configures it) run
     to its result on the one-process group, on each bucket holding the real gradients and
     the bucket's real parameters (PowerSGD factorises each of them), the bucket's refill
     subtracted, medians over rounds that interleave the methods (:func:`_time_hooks`).
   - What a DDP method sends for ``n`` workers: torch's hooks as torch's code issues their
     collectives (:func:`torch_powersgd_ops`); lowbit's hooks run once more on a
     :class:`MirrorTransport` of ``n`` ranks, so that their codes take the integer width
     ``n`` workers need (packed sums included) and their collectives are recorded op by op
     (a mirror's collectives return what ``n`` equal ranks would: the sum is ``n`` times the
     tensor). Whether an op is issued synchronously (inside the hook, blocking backward: the
     scale rounds of the max-norm codecs, PowerSGD's ``P``) or asynchronously (overlapped)
     is read from the transport call.
   - Decentralized methods: lowbit's wrapper
     (:class:`~lowbit.integrations.decentralized.DecentralizedDataParallel`, as the race
     runs them) on a ring of 3 (two neighbours, as on any larger ring; a ring of 2, one
     neighbour, for 2 workers) over a :class:`MirrorTransport`: its step time minus a plain
     step's (interleaved), and every message it sends, from its ledger.

What it models, with lowbit's network model (:mod:`lowbit.comm.netmodel`; every link the
same bandwidth and latency): each *round* of a step (:mod:`lowbit.plan.rounds`: every call of
the transport, the untracked fault agreement too, with the real transport's framing: an
exchange's size round) as rings, all-gathers and neighbour exchanges, and DDP's overlap of
bucket communication with backward (:func:`~lowbit.comm.netmodel.overlap_backward`). A DDP
step is ``forward + max(backward end, communication end) + optimizer``; a decentralized step
is ``forward + backward + optimizer + the wrapper's own compute + its rounds`` (Moniqua, CHOCO
and Bagua's low-precision algorithm do not overlap in the wrapper).

With ``processes`` (``--processes``, CPU; :func:`compare_with_race` always) it also measures
what the model misses: each method's step replayed on that many real gloo processes of this
host (:func:`~lowbit.plan.rounds.calibrate`: the model's step, the method's own compute as CPU
time, its rounds on the real transport); a round then costs the model's time plus what it
took there beyond the model (the transport's CPU time, waits for a peer that computed longer
or waited for a core), and compute is scaled by the measured slow-down of that many processes
sharing this host's cores. Not modelled: stragglers on other hosts, contention of
communication with compute for memory bandwidth, collectives other than rings (NCCL's trees),
how the replayed extra per round changes with the number of workers (taken as constant), and
accuracy (``lowbit bench race`` measures time to accuracy).

The recommendation for a setting is the method with the shortest predicted step when it is at
least ``min_speedup`` times faster than torch's DDP in fp32, and plain DDP
(``torch-ddp-fp32``) otherwise.
"""

from __future__ import annotations

from .hooks import _hook_ops, _rec, _time_hooks, torch_powersgd_ops
from .measure import measure
from .methods import (BASELINE, DDP_METHODS, DEFAULT_BANDWIDTHS, DEFAULT_LATENCY, DEFAULT_WORKERS, GOSSIP_METHODS,
                      METHODS)
from .mirror import MirrorTransport
from .predict import format_plan_report, plan, plot_plan, predict
from .profile import Bucket, Profile, _device
from .race import compare_with_race, format_race_comparison, measure_latency
from .rounds import Round, RoundCosts, calibrate, method_steps
from .workload import Workload, load_model_function, load_workload

__all__ = ["METHODS", "DDP_METHODS", "GOSSIP_METHODS", "BASELINE", "DEFAULT_WORKERS", "DEFAULT_BANDWIDTHS",
           "DEFAULT_LATENCY", "Workload", "load_workload", "load_model_function", "MirrorTransport", "Profile",
           "measure", "predict", "plan", "format_plan_report", "plot_plan", "torch_powersgd_ops",
           "compare_with_race", "measure_latency", "format_race_comparison", "method_steps", "Round", "RoundCosts",
           "calibrate"]
