"""Train scikit-learn's digits MLP with PyTorch Lightning on 2 CPU processes, under a lowbit
algorithm or Lightning's own DDP, and print each rank's bytes sent and test accuracy.

    python examples/lightning_digits.py --algorithm ddp             # Lightning's DDPStrategy
    python examples/lightning_digits.py --algorithm allreduce       # lowbit's fp32 hook
    python examples/lightning_digits.py --algorithm maxnorm bits=4  # options as NAME=VALUE
    python examples/lightning_digits.py --algorithm moniqua bits=2 theta=0.5

Lightning's ``devices=2`` on CPU starts the second process itself (it re-runs this script).
"""

import argparse
import gc
import json

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowbit.integrations.lightning import LowbitStrategy
from lowbit.train.tasks import DigitsMLP


def value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class Digits(LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.net = DigitsMLP().make_model()
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main():
    train_and_report(parse())
    # torch's gloo teardown can abort a process at interpreter exit after the work is done
    # (docs/FAULTS.md): the trainer, its DDP model and the hook are gone (train_and_report's
    # locals) and collected before the process group is destroyed
    gc.collect()
    torch.distributed.destroy_process_group()


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="moniqua", help="a lowbit algorithm or hook name, or ddp")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--precision", default="32-true")
    p.add_argument("options", nargs="*", help="NAME=VALUE options of the algorithm")
    return p.parse_args()


def train_and_report(args):
    options = {k: value(v) for k, v in (o.split("=", 1) for o in args.options)}
    seed_everything(0, verbose=False)
    task = DigitsMLP()
    train = DataLoader(TensorDataset(task.X_train, task.y_train), batch_size=32, shuffle=True)
    strategy = "ddp" if args.algorithm == "ddp" else LowbitStrategy(args.algorithm, **options)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                      precision=args.precision, enable_progress_bar=False, logger=False,
                      enable_model_summary=False, enable_checkpointing=False)
    model = Digits(args.lr)
    trainer.fit(model, train)
    with torch.no_grad():
        acc = float((model.net(task.X_test).argmax(1) == task.y_test).float().mean())
    sent = getattr(trainer.strategy, "bytes_sent", 0)
    row = torch.tensor([float(sent), acc])
    rows = [torch.zeros_like(row) for _ in range(trainer.world_size)]
    torch.distributed.all_gather(rows, row)
    if trainer.is_global_zero:
        for rank, (b, a) in enumerate(rows):
            print(f"{args.algorithm} rank {rank}: bytes_sent {int(b)}  test accuracy {a:.4f}  "
                  f"steps {trainer.global_step}")
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
