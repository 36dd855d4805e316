"""Faults under torchrun (tests/test_faults.py runs it): every rank prints one JSON line per case,
``{"case", "rank", "error", "at", "end"}``: the error it ended the case with (None: it finished),
the wall-clock time (time.time(), one clock: the processes share the machine) when it reached the
fault's step (None if it never did: an asynchronous rank may be stopped before) and when it ended.

python -m torch.distributed.run --nproc-per-node N tests/faults_torchrun.py MODE [ALGORITHM ...]

MODE ``sync``: for each algorithm, under DecentralizedDataParallel, rank 1 injects NaN into its
gradient at step 2 (``nan``; ``late``, for the asynchronous algorithms: rank 1 reaches its step 2
only once every other rank has taken all its steps and gone on to close its gossip, the order in
which a rank could once end normally); then rank 1 skips optimizer.step() at step 2 (as a GradScaler does on an
inf gradient); then the training loop (lowbit train's run_worker) with a non-finite loss on
rank 1 at step 2; then the all-gather algorithms with a payload one byte short on rank 1. The
ranks agree on every fault, so the process group stays usable for the next case.
MODE ``loop``: the training loop's case alone, for each algorithm named (to repeat one case).
MODE ``payload``: rank 1 sends naive's neighbours a payload one byte short at step 2; the others
name it (then every process leaves: the hostile rank is still waiting).
"""

import json
import os
import sys
import time

import torch
from torch import nn

from lowbit.algorithms import ALGORITHMS
from lowbit.comm import init_from_env
from lowbit.integrations import DecentralizedDataParallel

STEPS, AT, BAD = 5, 2, 1
OPTIONS = {"grandk-maxnorm": {"k": 0.5}, "grandk-maxnorm-multiscale": {"k": 0.5}}


def emit(case, rank, error, at):
    # one write of one line (under PIPE_BUF): the ranks share torchrun's stdout, and a print's
    # buffered writes could interleave with another rank's
    sys.stdout.flush()
    os.write(1, (json.dumps({"case": case, "rank": rank, "error": error, "at": at, "end": time.time()}) + "\n").encode())


def _late(t, name, last):
    """Mode ``late``: rank BAD waits at its faulty step until every other rank has taken its last
    step (``last``: called by them before close(); the store, no sleep)."""
    from torch.distributed import distributed_c10d

    store, key = distributed_c10d._get_default_store(), f"test/late/{name}"
    if last and t.rank != BAD and store.add(f"{key}/n", 1) == t.world_size - 1:
        store.set(f"{key}/all", "1")
    if not last and t.rank == BAD:
        store.wait([f"{key}/all"])


def wrapper_case(t, name, mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    m = DecentralizedDataParallel(net, opt, name, transport=t, **OPTIONS.get(name, {}))
    t0 = None
    try:
        for k in range(STEPS):
            opt.zero_grad()
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * t.rank + k))
            net(x).pow(2).mean().backward()
            if k == AT:
                if mode == "late":
                    _late(t, name, last=False)
                t0 = time.time()
                if t.rank == BAD and mode in ("nan", "late"):
                    net[0].weight.grad[0, 0] = float("nan")
                if t.rank == BAD and mode == "skip":
                    continue
                if t.rank == BAD and mode == "short":
                    orig = t.all_gather_async
                    t.all_gather_async = lambda w: orig(w[:-1])
            opt.step()
        if mode == "late":
            _late(t, name, last=True)
        m.close()
        return None, t0
    except Exception as e:  # noqa: BLE001 - reported
        m._close(agree=False)  # the hooks off; no agreement after an error
        return f"{type(e).__name__}: {e}", t0
    finally:
        t.__dict__.pop("all_gather_async", None)


def loop_case(t, name):
    from lowbit.train import TrainConfig
    from lowbit.train.loop import run_worker
    from lowbit.train.tasks import TASKS

    cfg = TrainConfig(algorithm=name, workers=t.world_size, steps=STEPS, task="quadratic", eval_every=100,
                      **OPTIONS.get(name, {}))
    calls = {"n": 0, "t0": None}
    task_cls = TASKS[cfg.task]
    orig = task_cls.loss

    def loss(self, model, batch):
        out = orig(self, model, batch)
        if calls["n"] == AT:
            calls["t0"] = time.time()
            if t.rank == BAD:
                out = out * float("inf")
        calls["n"] += 1
        return out

    task_cls.loss = loss
    try:
        run_worker(t, cfg, evaluate=False)
        return None, calls["t0"]
    except Exception as e:  # noqa: BLE001 - reported
        return f"{type(e).__name__}: {e}", calls["t0"]
    finally:
        task_cls.loss = orig
        # run_worker does not finish the algorithm after an error (under lowbit train the process
        # then exits): close an asynchronous algorithm's gossip here, as its finish() would
        try:
            t.gossip_close()
        except Exception:  # noqa: BLE001 - the fault it may raise was reported above
            pass


def main():
    mode, names = sys.argv[1], sys.argv[2:]
    t = init_from_env(timeout_s=60)
    t.max_message_bytes = 1 << 20
    if mode == "sync":
        for name in names:
            emit(f"nan/{name}", t.rank, *wrapper_case(t, name, "nan"))
        for name in ("dpsgd", "choco", "qsgd", "maxnorm", "powersgd"):
            if name in names:
                emit(f"skip/{name}", t.rank, *wrapper_case(t, name, "skip"))
        for name in ("dpsgd", "choco", "qsgd", "moniqua"):
            if name in names:
                emit(f"loop/{name}", t.rank, *loop_case(t, name))
        for name in ("qsgd", "terngrad", "onebit-ef", "dqsg"):
            if name in names:
                emit(f"short/{name}", t.rank, *wrapper_case(t, name, "short"))
        for name in ("adpsgd", "moniqua-async"):
            if name in names:
                emit(f"late/{name}", t.rank, *wrapper_case(t, name, "late"))
        for name in ("moniqua-async",):
            if name in names:
                emit(f"loop/{name}", t.rank, *loop_case(t, name))
    elif mode == "loop":
        for name in names:
            emit(f"loop/{name}", t.rank, *loop_case(t, name))
    else:
        orig = t.neighbor_exchange
        if t.rank == BAD:
            t.neighbor_exchange = lambda buf, nb: orig(buf[:-1] if t.ledger.step == AT else buf, nb)
        emit("payload/naive", t.rank, *wrapper_case(t, "naive", "payload"))
    sys.stdout.flush()
    os._exit(0)  # see docs/FAULTS.md "A torch teardown abort"; a hostile rank may still be waiting


if __name__ == "__main__":
    main()
