"""A rank that refuses a peer's payload and stays alive (tests/test_refusal_alive.py runs it):
every rank prints one JSON line, ``{"case", "rank", "error", "at", "end"}``: the error it ended
with (None: the refusing rank, which catches it), the wall-clock time (time.time(): the
processes share the machine) of the refusal on the refusing rank (``at``) and of its own end.
The refusing rank stays alive until every other rank has ended (it waits for them on the
store), then prints; the process group's timeout is 60 s.

python -m torch.distributed.run --nproc-per-node N tests/refusal_alive_torchrun.py MODE

MODE ``wrapper`` (2 processes): naive under DecentralizedDataParallel; rank 1 sends its
neighbours a payload one byte short at step 2; rank 0 refuses it (PeerPayloadError), catches
the error and waits; rank 1 is then waiting in its next collective.
MODE ``transport`` (3 processes): rank 0 posts a refusal (``Transport.post_refusal``) and
waits; rank 1 waits in a neighbour exchange with rank 0 (point to point), rank 2 on an
asynchronous all-reduce's future (which needs ranks 0 and 1).
"""

import datetime
import json
import os
import sys
import time

import torch
from torch import nn
from torch.distributed import distributed_c10d

from lowbit.algorithms.faults import PeerPayloadError, refusal_text
from lowbit.comm import init_from_env
from lowbit.integrations import DecentralizedDataParallel

REFUSER, HOSTILE, AT = 0, 1, 2


def emit(case, rank, error, at):
    sys.stdout.flush()
    os.write(1, (json.dumps({"case": case, "rank": rank, "error": error, "at": at, "end": time.time()}) + "\n").encode())


def stay_alive(t):
    """The refusing rank: alive, holding its transport, until every other rank has ended."""
    store = distributed_c10d._get_default_store()
    store.wait(["test/all_ended"], datetime.timedelta(seconds=45))


def ended(t):
    store = distributed_c10d._get_default_store()
    if store.add("test/ended", 1) == t.world_size - 1:
        store.set("test/all_ended", "1")


def wrapper_case(t):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    orig = t.neighbor_exchange
    if t.rank == HOSTILE:
        t.neighbor_exchange = lambda buf, nb: orig(buf[:-1] if t.ledger.step == AT else buf, nb)
    m = DecentralizedDataParallel(net, opt, "naive", transport=t)
    try:
        for k in range(5):
            opt.zero_grad()
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * t.rank + k))
            net(x).pow(2).mean().backward()
            opt.step()
        m.close()
        return None, None
    except PeerPayloadError as e:
        m._close(agree=False)
        if t.rank != REFUSER:
            return f"{type(e).__name__}: {e}", None
        at = time.time()
        stay_alive(t)  # the user caught it and goes on living
        return None, at
    except Exception as e:  # noqa: BLE001 - reported
        m._close(agree=False)
        return f"{type(e).__name__}: {e}", None


def transport_case(t):
    if t.rank == REFUSER:
        err = PeerPayloadError(f"naive: worker {REFUSER} got a malformed payload from worker {HOSTILE} at step {AT}: "
                               f"a test's refusal", HOSTILE, AT)
        t.post_refusal(refusal_text(err))
        at = time.time()
        stay_alive(t)
        return None, at
    try:
        if t.rank == 1:
            t.neighbor_exchange(torch.zeros(8, dtype=torch.uint8), [REFUSER])
        else:
            t.all_reduce_async(torch.ones(4), "sum").wait()
        return None, None
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}", None


def main():
    mode = sys.argv[1]
    t = init_from_env(timeout_s=60)
    t.max_message_bytes = 1 << 20
    error, at = (wrapper_case if mode == "wrapper" else transport_case)(t)
    emit(mode, t.rank, error, at)
    if t.rank != REFUSER:
        ended(t)
    sys.stdout.flush()
    os._exit(0)  # see docs/FAULTS.md "A torch teardown abort"


if __name__ == "__main__":
    main()
