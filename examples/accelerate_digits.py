"""Train scikit-learn's digits MLP with Hugging Face Accelerate on 2 CPU processes, under a lowbit
algorithm (:func:`lowbit.integrations.accelerate.lowbit_prepare`) or plain ``accelerator.prepare``,
and print each rank's bytes sent and test accuracy.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_digits.py \\
        --algorithm plain                                  # accelerator.prepare alone (torch DDP)
    ... examples/accelerate_digits.py --algorithm maxnorm bits=4        # options as NAME=VALUE
    ... examples/accelerate_digits.py --algorithm moniqua bits=2 theta=0.5
"""

import argparse
import gc
import json

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowbit.integrations.accelerate import lowbit_prepare
from lowbit.train.tasks import DigitsMLP


def value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="moniqua", help="a lowbit algorithm or hook name, or plain")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("options", nargs="*", help="NAME=VALUE options of the algorithm")
    args = p.parse_args()
    options = {k: value(v) for k, v in (o.split("=", 1) for o in args.options)}
    accelerator = Accelerator()
    torch.manual_seed(0)
    task = DigitsMLP()
    net = task.make_model()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(TensorDataset(task.X_train, task.y_train), batch_size=32, shuffle=True)
    if args.algorithm == "plain":
        model, opt, loader = accelerator.prepare(net, opt, loader)
        comm = None
    else:
        model, opt, loader, comm = lowbit_prepare(accelerator, net, opt, loader, algorithm=args.algorithm, **options)
    steps = 0
    for _ in range(args.epochs):
        for x, y in loader:
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            steps += 1
    with torch.no_grad():
        acc = float((net(task.X_test.to(accelerator.device)).argmax(1).cpu() == task.y_test).float().mean())
    sent = comm.bytes_sent if comm is not None else 0
    rows = accelerator.gather(torch.tensor([[float(sent), acc]], device=accelerator.device))
    if accelerator.is_main_process:
        for rank, (b, a) in enumerate(rows.tolist()):
            print(f"{args.algorithm} rank {rank}: bytes_sent {int(b)}  test accuracy {a:.4f}  steps {steps}")
    if comm is not None and hasattr(comm, "close"):
        comm.close()
    # torch's gloo teardown can abort a process at interpreter exit after the work is done
    # (docs/FAULTS.md): every rank here, Accelerate's references dropped and collected, before
    # the process group is destroyed
    accelerator.wait_for_everyone()
    del model, opt, loader, comm
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
