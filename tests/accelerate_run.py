"""One rank of the Accelerate integration test (tests/test_accelerate.py), under
``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2``: for each case (JSON:
``name``, ``algorithm`` (None: plain ``accelerator.prepare``), ``options``, ``clip``), train a tiny
regression for two epochs with gradient accumulation 2 and write what this rank saw to
OUT/<case>-rank<r>.json."""

import json
import os
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowbit.integrations.accelerate import lowbit_prepare

LR = 0.1


def run(accelerator, spec):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.1 * torch.randn(64, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)  # 4 batches per rank and epoch
    if spec["algorithm"] is None:
        model, opt, loader = accelerator.prepare(net, opt, loader)
        comm = None
    else:
        model, opt, loader, comm = lowbit_prepare(accelerator, net, opt, loader, algorithm=spec["algorithm"],
                                                  **spec.get("options", {}))
    dtypes = {}
    net[0].register_forward_hook(lambda m, i, o: dtypes.__setitem__("inner", str(o.dtype)))
    losses, sent, grad = [], [], None
    for _ in range(2):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                out = model(xb)
                dtypes["output"] = str(out.dtype)
                loss = nn.functional.mse_loss(out, yb)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if spec.get("clip"):
                        accelerator.clip_grad_norm_(model.parameters(), spec["clip"])
                    grad = torch.cat([p.grad.flatten() for p in net.parameters()]).tolist()
                opt.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
            sent.append(comm.bytes_sent if comm is not None else 0)
    if comm is not None and hasattr(comm, "close"):
        comm.close()
    params = torch.cat([p.detach().flatten() for p in net.parameters()])
    return {"losses": losses, "bytes": sent, "params": params.tolist(), "grad": grad, "numel": params.numel(),
            "dtypes": dtypes}


def main():
    out = sys.argv[1]
    accelerator = Accelerator(gradient_accumulation_steps=2)
    assert accelerator.num_processes == 2, accelerator.distributed_type
    for arg in sys.argv[2:]:
        spec = json.loads(arg)
        result = run(accelerator, spec)
        with open(os.path.join(out, f"{spec['name']}-rank{accelerator.process_index}.json"), "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    # not end_training(): torch's teardown at exit sometimes aborts a process after the work is
    # done ("terminate called without an active exception", docs/FAULTS.md), which is not tested here
    os._exit(0)


if __name__ == "__main__":
    main()
