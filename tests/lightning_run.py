"""One rank of the Lightning integration test (tests/test_lightning.py), under
``torchrun --standalone --nproc-per-node 2``: for each case (a strategy spec, JSON), fit a tiny
regression for two epochs with a ModelCheckpoint per epoch (run A), then fit a fresh model from
the first epoch's checkpoint (run B), and write what each rank saw to OUT/<case>-rank<r>.json.

    torchrun --standalone --nproc-per-node 2 tests/lightning_run.py OUT '{"name": "dpsgd", ...}' ...

A spec: ``name`` (the case), ``algorithm`` (a LowbitStrategy name, or ``"ddp"`` for Lightning's
plain DDPStrategy), ``options``, and optionally ``precision``, ``accumulate``, ``clip``,
``epochs``, ``sync_dist`` (log the loss with ``sync_dist=True``), ``resume`` (default true),
``drop_side_rank`` (that rank deletes its lowbit file before the resume), ``overflow_at`` (rank 1's
loss is inf at that batch of the first epoch).
"""

import json
import os
import sys
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowbit.integrations.lightning import LowbitStrategy, side_path

warnings.filterwarnings("ignore")  # Lightning's advice on num_workers, sync_dist, ...
LR = 0.1


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.1 * torch.randn(64, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)  # 4 steps per epoch per rank


class Net(LightningModule):
    def __init__(self, seed, sync_dist=False, overflow_at=None):
        super().__init__()
        self.sync_dist = sync_dist  # log the loss with a collective of Lightning's inside training_step
        self.overflow_at = overflow_at  # rank 1's gradient is inf at this batch of the first epoch
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.last_grad = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if (self.global_rank, self.current_epoch, batch_idx) == (1, 0, self.overflow_at):
            loss = loss * float("inf")
        if self.sync_dist:
            self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.last_grad = torch.cat([p.grad.detach().flatten().float() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Record(Callback):
    def __init__(self):
        self.losses, self.bytes = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.bytes.append(int(getattr(trainer.strategy, "bytes_sent", 0)))


def fit(spec, out, seed, ckpt=None):
    if spec["algorithm"] == "ddp":
        strategy = "ddp"
    else:
        strategy = LowbitStrategy(spec["algorithm"], **spec.get("options", {}))
    rec = Record()
    folder = os.path.join(out, spec["name"] + "-ckpt")
    cb = ModelCheckpoint(dirpath=folder, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    precision = {"precision": spec.get("precision", "32-true")}
    if precision["precision"] == "16-mixed":  # Lightning turns the flag into bf16 on CPU; the plugin is fp16
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=spec.get("epochs", 2),
                      **precision, accumulate_grad_batches=spec.get("accumulate", 1),
                      gradient_clip_val=spec.get("clip"), callbacks=[rec, cb], enable_progress_bar=False,
                      logger=False, enable_model_summary=False, num_sanity_val_steps=0)
    model = Net(seed, sync_dist=spec.get("sync_dist", False), overflow_at=spec.get("overflow_at"))
    trainer.fit(model, data(), ckpt_path=ckpt)
    params = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    return {"losses": rec.losses, "bytes": rec.bytes, "params": params.tolist(),
            "grad": model.last_grad.tolist(), "global_step": trainer.global_step,
            "files": sorted(os.listdir(folder)), "ckpt": os.path.join(folder, "epoch=0.ckpt"),
            "numel": params.numel(), "scaler": _qualname(getattr(trainer.precision_plugin, "scaler", None)),
            "scale": _scale(trainer)}


def _scale(trainer):
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return None if scaler is None else float(scaler.get_scale())


def _qualname(obj):
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__name__}"


def main():
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    for arg in sys.argv[2:]:
        spec = json.loads(arg)
        seed_everything(1, verbose=False)
        result = {"a": fit(spec, out, seed=1)}
        if spec.get("resume", True):
            if spec.get("drop_side_rank") == rank:  # this rank lost its lowbit file: every rank starts afresh
                os.remove(side_path(result["a"]["ckpt"], rank))
            result["b"] = fit(spec, out, seed=2, ckpt=result["a"]["ckpt"])
        with open(os.path.join(out, f"{spec['name']}-rank{rank}.json"), "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not a teardown at exit: it sometimes aborts after the work is done (docs/FAULTS.md)


if __name__ == "__main__":
    main()
