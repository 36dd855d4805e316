"""DDP's idioms under DecentralizedDataParallel, with DDP's meaning (issue 30, item 3):
``optimizer.step(closure)``, GradScaler's skipped steps, clipping of the averaged gradient,
``no_sync()`` for accumulation, and checkpoints that ``torch.load(weights_only=True)`` reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowbit.comm import run_threads
from lowbit.integrations import DecentralizedDataParallel

N, BATCH = 2, 8


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _batch(rank, k):
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(BATCH, 5, generator=g) + rank, torch.randint(0, 3, (BATCH,), generator=g)


def _loss(model, rank, k):
    x, y = _batch(rank, k)
    return nn.functional.cross_entropy(model(x), y)


# ---- optimizer.step(closure) ------------------------------------------------------------------
@pytest.mark.parametrize("algorithm,overlap", [("dpsgd", True), ("dpsgd", False), ("allreduce", False),
                                               ("moniqua", False)])
def test_step_with_closure_equals_backward_then_step(algorithm, overlap):
    options = {"bits": 2, "theta": 2.0} if algorithm == "moniqua" else {}

    def run(t, closure):
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        ddp = DecentralizedDataParallel(net, opt, algorithm, transport=t, overlap=overlap, **options)
        losses = []
        for k in range(4):
            if closure:
                def fn(k=k):
                    opt.zero_grad()
                    loss = _loss(ddp, t.rank, k)
                    loss.backward()
                    return loss
                with torch.no_grad():  # the closure runs with gradients enabled, as torch's optimizers run it
                    losses.append(float(opt.step(fn)))
            else:
                opt.zero_grad()
                loss = _loss(ddp, t.rank, k)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return ddp.flat.data.clone(), losses, ddp.bytes_sent, ddp.stats()["overlapped"]

    plain = run_threads(N, lambda t: run(t, False))
    closed = run_threads(N, lambda t: run(t, True))
    for (x, losses, sent, ov), (x2, losses2, sent2, ov2) in zip(plain, closed):
        assert torch.equal(x, x2) and losses == losses2 and sent == sent2 and sent > 0 and ov == ov2


def test_closure_through_ddp_step_and_keyword():
    def fn(t):
        net = Net()
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        ddp = DecentralizedDataParallel(net, opt, "dpsgd", transport=t)

        def closure():
            opt.zero_grad()
            loss = _loss(net, t.rank, ddp.step_count)
            loss.backward()
            return loss

        a = ddp.step(closure)
        b = opt.step(closure=closure)
        return isinstance(a, torch.Tensor), isinstance(b, torch.Tensor), ddp.step_count

    assert run_threads(N, fn) == [(True, True, 2)] * N


def test_optimizer_that_reevaluates_the_closure_is_refused():
    def fn(t):
        net = Net()
        opt = torch.optim.LBFGS(net.parameters(), lr=0.1, max_iter=3)
        DecentralizedDataParallel(net, opt, "dpsgd", transport=t, overlap=False)

        def closure():
            opt.zero_grad()
            loss = _loss(net, t.rank, 0)
            loss.backward()
            return loss

        with pytest.raises(RuntimeError, match="more than once per step"):
            opt.step(closure)
        return True

    assert run_threads(N, fn) == [True] * N
