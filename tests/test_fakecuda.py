"""The fake CUDA device of tests/fakecuda.py: it claims cuda, computes on the CPU,
and refuses what real CUDA refuses."""

import threading

import numpy as np
import pytest
import torch
from torch import nn

from fakecuda import FakeCudaTensor, fake_cuda, is_fake_cuda, no_real_cuda

pytestmark = no_real_cuda


def test_mixing_a_cuda_and_a_cpu_tensor_raises():
    with fake_cuda():
        x = torch.arange(4.0, device="cuda")
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(4)
        with pytest.raises(RuntimeError, match="same device"):
            torch.ones(4).add_(x)  # a CPU destination too
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([x, torch.zeros(2)])
        with pytest.raises(RuntimeError, match="same device"):
            x[torch.tensor([0, 1])] = torch.tensor([5.0, 6.0])  # index_put_ values must be on the device
        # the typical bug the device tests look for: a buffer made without device=
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(4) + x
        # what real CUDA allows: CPU 0-dim tensors, Python scalars, copies, CPU index tensors
        assert is_fake_cuda(x * torch.tensor(2.0)) and is_fake_cuda(x + 1)
        y = torch.empty(4, device="cuda")
        y.copy_(torch.ones(4))
        z = torch.empty(4)
        z.copy_(x)
        assert type(z) is torch.Tensor and torch.equal(z, torch.arange(4.0))
        assert torch.equal(x[torch.tensor([3, 1])].cpu(), torch.tensor([3.0, 1.0]))


def test_factories_and_moves_give_fake_cuda_tensors():
    with fake_cuda():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        made = [torch.zeros(3, device="cuda"), torch.empty(2, dtype=torch.int64, device="cuda:0"),
                torch.arange(5, device=torch.device("cuda")), torch.tensor([1, 2], device="cuda"),
                torch.full((2,), 7.0, device="cuda"), torch.ones(3).to("cuda"), torch.ones(3).cuda(),
                torch.ones(3).to(device="cuda", dtype=torch.float64)]
        for t in made:
            assert is_fake_cuda(t) and t.device == torch.device("cuda", 0) and t.is_cuda
        x = made[0]
        derived = [x + 1, x.new_zeros(2), torch.zeros_like(x), x.to(torch.float64), x.double(), x[1:], x.view(3, 1),
                   torch.stack([x, x]), ~(x > 0), (x >= 0).nonzero(), x.clone()]
        assert all(is_fake_cuda(t) for t in derived)
        assert x.to("cuda") is x and x.cuda() is x  # already there: no copy
        back = x.cpu()
        assert type(back) is torch.Tensor and back.device.type == "cpu"
        assert type(x.to("cpu")) is torch.Tensor and type(torch.zeros_like(x, device="cpu")) is torch.Tensor
        # views share the data, as on a device
        v = x[1:]
        v.add_(5)
        assert x.tolist() == [0.0, 5.0, 5.0] and float(x.sum()) == 10.0 and int(x[1]) == 5
        with pytest.raises(RuntimeError):
            torch.Generator(device="cuda")  # not faked: lowbit's generators stay on the CPU


def test_a_cpu_generator_drawing_onto_the_device_raises_as_on_cuda():
    """Real CUDA refuses a CPU generator for a cuda draw; the fake device does too. The
    right way, drawing on the generator's device and moving, gives the CPU's numbers."""
    g = torch.Generator().manual_seed(0)
    with fake_cuda():
        x = torch.zeros(4, device="cuda")
        draws = [lambda: torch.rand(3, generator=g, device="cuda"), lambda: torch.randn(3, generator=g, device=x.device),
                 lambda: torch.randperm(5, generator=g, device="cuda"), lambda: x.uniform_(generator=g),
                 lambda: torch.bernoulli(x + 0.5, generator=g)]
        for draw in draws:
            with pytest.raises(RuntimeError, match="'cuda' device type for generator"):
                draw()
        moved = torch.rand(3, generator=torch.Generator().manual_seed(1)).to("cuda")
        assert is_fake_cuda(moved) and torch.equal(moved.cpu(), torch.rand(3, generator=torch.Generator().manual_seed(1)))
        assert is_fake_cuda(torch.rand_like(x))  # no generator: the device's own, as on CUDA


def test_host_access_follows_cuda_rules():
    with fake_cuda():
        x = torch.arange(3.0, device="cuda")
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        with pytest.raises(TypeError, match="numpy"):
            np.asarray(x)
        assert x.cpu().numpy().tolist() == [0.0, 1.0, 2.0]
        assert x[2].item() == 2.0 and f"{x[1]:.1f}" == "1.0"


def test_module_on_fake_cuda_matches_cpu_without_autograd():
    """Autograd cannot run on fake tensors (see fakecuda's docstring): it is refused with
    NotImplementedError instead of aborting the process; the forward pass without grad
    and the optimizer step (momentum) give the CPU's numbers exactly."""
    torch.manual_seed(0)
    cpu = nn.Linear(4, 3)
    inp = torch.randn(5, 4)
    with fake_cuda():
        dev = nn.Linear(4, 3)
        dev.load_state_dict(cpu.state_dict())
        dev.to("cuda")
        assert all(is_fake_cuda(p) and isinstance(p, nn.Parameter) and p.requires_grad for p in dev.parameters())
        with pytest.raises(NotImplementedError, match="autograd"):
            dev(inp.cuda())
        with torch.no_grad():
            assert torch.equal(dev(inp.cuda()).cpu(), cpu(inp))
        cpu(inp).pow(2).sum().backward()
        for p, q in zip(dev.parameters(), cpu.parameters()):
            p.grad = q.grad.cuda()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3) for m in (dev, cpu)]
        for _ in range(3):
            for o in opts:
                o.step()
        for p, q in zip(dev.parameters(), cpu.parameters()):
            assert is_fake_cuda(p) and torch.equal(p.detach().cpu(), q.detach())
        # .data assignment keeps the CPU data in step (FlatParams relies on it)
        flat = torch.zeros(3 * 4, device="cuda")
        w = dev.weight
        w.data = flat.view(3, 4)
        flat.fill_(2.0)
        assert float(w.detach().sum()) == 24.0


def test_threads_started_inside_see_the_fake_device():
    seen = []
    with fake_cuda():
        th = threading.Thread(target=lambda: seen.append(torch.zeros(2, device="cuda")))
        th.start()
        th.join()
    assert is_fake_cuda(seen[0])


def test_everything_is_restored_after_the_context_also_after_an_exception():
    before = (torch.cuda.is_available, torch.cuda._lazy_init, threading.Thread.run,
              torch.__future__.get_overwrite_module_params_on_conversion())
    with pytest.raises(ZeroDivisionError):
        with fake_cuda():
            assert torch.cuda.is_available()
            1 / 0
    for _ in range(2):  # and after a normal exit
        after = (torch.cuda.is_available, torch.cuda._lazy_init, threading.Thread.run,
                 torch.__future__.get_overwrite_module_params_on_conversion())
        assert after == before
        assert torch.cuda.is_available() is False
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")  # the real, CPU-only behaviour again
        with pytest.raises((RuntimeError, AssertionError)):
            torch.ones(2).to("cuda")
        with fake_cuda():
            pass
    with fake_cuda():
        with pytest.raises(RuntimeError, match="already active"):
            with fake_cuda():
                pass


def test_wrapper_refuses_non_cpu_or_subclass_data():
    with pytest.raises(TypeError):
        FakeCudaTensor(torch.empty(2, device="meta"))
