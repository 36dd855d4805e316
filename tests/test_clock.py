"""The emulated clock (lowbit.train.run.step_clock / emulated_clock) and the network
model's pricing of one step, on hand-built ledgers with numbers worked out by hand.

Network of the hand-built cases: 8192 bit/s and 0.25 s latency, messages of 512 bytes:
one message takes 0.25 + 512 * 8 / 8192 = 0.75 s, a round trip 1.5 s (all exact in binary).
"""

import math

import pytest
import torch

from lowbit.comm.ledger import CommRecord, Ledger
from lowbit.comm.netmodel import NetworkModel
from lowbit.train.config import TrainConfig
from lowbit.train.loop import WorkerResult
from lowbit.train.run import emulated_clock, overlaps_compute, step_clock, train

NET = NetworkModel(bandwidth=8192.0, latency=0.25)
M = 512  # bytes: one message 0.75 s
GOSSIP = CommRecord("neighbor", M, M, 1, 1)  # a request or a reply, as Transport.gossip records them


def _worker(rank: int, compute: list[float]) -> WorkerResult:
    return WorkerResult(rank=rank, params=torch.zeros(1), ledger_rows=[], compute_seconds=compute,
                        extra_memory_bytes=0, nominal_bits_per_element=32.0, report={})


def _ledger(rank: int, n: int, steps: dict[int, list[CommRecord]]) -> Ledger:
    led = Ledger(rank=rank, world_size=n)
    for k, recs in steps.items():
        led.records[k].extend(recs)
    return led


def _cfg(algorithm: str, workers: int, steps: int) -> TrainConfig:
    return TrainConfig(algorithm=algorithm, workers=workers, steps=steps, bandwidth="8192", latency="0.25s")


# ---- the network model of one step --------------------------------------------------
def test_message_and_exchange_seconds():
    assert NET.message_seconds(M) == 0.75
    assert NET.message_seconds(0) == 0.25  # latency alone
    assert NET.exchange_seconds(M, M, 2) == 1.5  # request, then the reply on the link back
    assert NET.exchange_seconds(M, 1024, 3) == 0.75 + 1.25
    assert NET.exchange_seconds(M, M, 1) == 0.0
    for bad in (-1, float("inf"), float("nan"), "512"):
        with pytest.raises(ValueError, match="nbytes"):
            NET.message_seconds(bad)


def test_synchronous_step_neighbours_in_parallel_ops_in_series():
    two_peers = CommRecord("neighbor", M, 2 * M, 2, 2)  # D-PSGD on a ring: two links at once
    assert NET.step_seconds([two_peers], 3) == 0.75
    assert NET.step_seconds([two_peers, two_peers], 3) == 1.5  # the second exchange starts after the first
    # ring all-reduce of 1536 bytes on 4 ranks: 6 latencies + 6/4 * 1536 * 8 / 8192 s
    assert NET.step_seconds([CommRecord("all_reduce", 1536, 2304, 6, 1)], 4) == 6 * 0.25 + 2.25
    assert NET.step_seconds([], 3) == 0.0


def test_gossip_step_is_one_round_trip_whatever_the_replies():
    # the worker's own request alone, or with the replies its responder sent in the same step:
    # the replies are the second legs of their requesters' round trips, not this worker's time
    for recs in ([GOSSIP], [GOSSIP, GOSSIP], [GOSSIP, GOSSIP, GOSSIP]):
        assert NET.gossip_step_seconds(recs, 3) == 1.5
    assert NET.gossip_step_seconds([], 3) == 0.0  # no neighbour, nothing sent
    assert NET.gossip_step_seconds([GOSSIP], 1) == 0.0
    small = CommRecord("neighbor", 128, 128, 1, 1)
    assert NET.gossip_step_seconds([small], 2) == 2 * (0.25 + 0.125)


def test_gossip_step_rejects_what_it_cannot_price():
    with pytest.raises(ValueError, match="one size"):
        NET.gossip_step_seconds([GOSSIP, CommRecord("neighbor", 128, 128, 1, 1)], 3)
    with pytest.raises(ValueError, match="one-peer gossip"):
        NET.gossip_step_seconds([CommRecord("neighbor", M, 2 * M, 2, 2)], 3)
    with pytest.raises(ValueError, match="one-peer gossip"):
        NET.gossip_step_seconds([CommRecord("all_reduce", M, M, 2, 1)], 3)


# ---- the clock of a run ---------------------------------------------------------------
def test_overlap_only_for_the_asynchronous_algorithms():
    assert overlaps_compute("adpsgd") and overlaps_compute("moniqua-async")
    for name in ("dpsgd", "moniqua", "allreduce", "d2", "choco"):
        assert not overlaps_compute(name)


def test_synchronous_clock_waits_for_the_slowest_and_does_not_overlap():
    two = CommRecord("neighbor", M, 2 * M, 2, 2)
    ledgers = [_ledger(0, 3, {0: [two], 1: [two]}),
               _ledger(1, 3, {0: [two, two], 1: [two]}),  # step 0: two exchanges, 1.5 s
               _ledger(2, 3, {0: [two], 1: [two]})]
    workers = [_worker(0, [0.125, 2.0]), _worker(1, [0.5, 0.25]), _worker(2, [0.25, 0.25])]
    clock = step_clock(_cfg("dpsgd", 3, 2), workers, ledgers)
    assert clock.rank is None
    assert clock.compute == [0.5, 2.0]  # the slowest worker's compute of each step
    assert clock.comm == [1.5, 0.75]  # the slowest communication of each step
    assert clock.seconds == [2.0, 2.75]  # compute + communication: 2.0 > max(2.0, 0.75)
    assert emulated_clock(_cfg("dpsgd", 3, 2), workers, ledgers) == ([0.5, 2.0], [1.5, 0.75])


def test_asynchronous_clock_overlaps_and_is_the_slowest_workers_own():
    # every worker's step: its request (and maybe replies it sent), round trip 1.5 s
    ledgers = [_ledger(0, 3, {0: [GOSSIP], 1: [GOSSIP, GOSSIP]}),
               _ledger(1, 3, {0: [GOSSIP, GOSSIP, GOSSIP], 1: [GOSSIP]}),
               _ledger(2, 3, {0: [GOSSIP], 1: [GOSSIP]})]
    # per step max(compute, 1.5): rank 0 1.5 + 2.0 = 3.5; rank 1 3.0; rank 2 1.75 + 1.5 = 3.25
    workers = [_worker(0, [0.5, 2.0]), _worker(1, [0.25, 0.25]), _worker(2, [1.75, 1.0])]
    cfg = _cfg("adpsgd", 3, 2)
    clock = step_clock(cfg, workers, ledgers)
    assert clock.rank == 0
    assert clock.compute == [0.5, 2.0] and clock.comm == [1.5, 1.5] and clock.seconds == [1.5, 2.0]
    compute, comm = emulated_clock(cfg, workers, ledgers)
    assert compute == [0.5, 2.0]
    assert comm == [1.0, 0.0]  # the communication not hidden behind compute
    # results and ledgers are matched by rank, not by position
    clock2 = step_clock(cfg, workers[::-1], ledgers)
    assert clock2.rank == 0 and clock2.seconds == [1.5, 2.0]


def test_asynchronous_clock_without_neighbours_is_compute():
    ledgers = [_ledger(0, 1, {})]
    clock = step_clock(_cfg("adpsgd", 1, 2), [_worker(0, [0.5, 0.25])], ledgers)
    assert clock.comm == [0.0, 0.0] and clock.seconds == [0.5, 0.25]


def test_asynchronous_clock_needs_one_message_size():
    ledgers = [_ledger(0, 2, {0: [GOSSIP]}), _ledger(1, 2, {0: [CommRecord("neighbor", 128, 128, 1, 1)]})]
    with pytest.raises(ValueError, match="one size"):
        step_clock(_cfg("adpsgd", 2, 1), [_worker(0, [0.5]), _worker(1, [0.5])], ledgers)


def test_adpsgd_run_is_priced_by_the_model():
    """A real AD-PSGD run: every gossip message is one fp32 model (plus the wire header);
    the summary's clock is the slowest worker's sum of max(compute, round trip)."""
    cfg = TrainConfig(algorithm="adpsgd", workers=3, steps=4, eval_every=4, bandwidth="20Mbit", latency="0.15ms")
    run = train(cfg)
    sizes = {row[2] for w in run.workers for row in w.ledger_rows}
    assert len(sizes) == 1
    (m,) = sizes
    assert m >= 4 * run.summary["parameters"]
    rtt = 2 * (0.15e-3 + m * 8 / 20e6)
    per_worker = [math.fsum(max(c, rtt) for c in w.compute_seconds) for w in run.workers]
    s = run.summary
    assert s["emulated_seconds"] == pytest.approx(max(per_worker), rel=1e-12)
    assert s["emulated_seconds"] == pytest.approx(s["emulated_compute_seconds"] + s["emulated_comm_seconds"])
    # every request and every reply went on the wire and is in some ledger: 2 per exchange
    assert s["messages_sent"] == 2 * cfg.workers * cfg.steps
