"""One rank of the Lightning integration test (tests/test_lightning.py), under
``torchrun --standalone --nproc-per-node 2``: for each case (a strategy spec, JSON), fit a tiny
regression for two epochs with a ModelCheckpoint per epoch (run A), then fit a fresh model from
the first epoch's checkpoint (run B), and write what each rank saw to OUT/<case>-rank<r>.json.

    torchrun --standalone --nproc-per-node 2 tests/lightning_run.py OUT '{"name": "dpsgd", ...}' ...

A spec: ``name`` (the case), ``algorithm`` (a LowbitStrategy name, or ``"ddp"`` for Lightning's
plain DDPStrategy), ``options``, and optionally ``precision``, ``accumulate``, ``clip``,
``epochs``, ``sync_dist`` (log the loss with ``sync_dist=True``), ``resume`` (default true),
``drop_side_rank`` (that rank deletes its lowbit file before the resume), ``overflow_at`` (rank 1's
loss is inf at that batch of the first epoch), ``noreplay`` (also resume once more, as run C,
without the hook's replay of the saved bucket layout: the counterfactual), ``async_checkpoint``
(first fit with the ModelCheckpoint, expecting the refusal; run A then fits without it and
saves ``final.ckpt`` after fit).
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
    def __init__(self, replay=True):
        self.losses, self.bytes, self.layouts = [], [], []
        self.replay = replay

    def on_train_start(self, trainer, module):
        if not self.replay:  # the counterfactual: resume in DDP's fresh bucket layout
            trainer.strategy.hook_state._replay = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.bytes.append(int(getattr(trainer.strategy, "bytes_sent", 0)))
        state = getattr(trainer.strategy, "hook_state", None)
        self.layouts.append(None if state is None else {str(i): v for i, v in state.bucket_layout.items()})


def fit(spec, out, seed, ckpt=None, replay=True, checkpoint=True):
    if spec["algorithm"] == "ddp":
        strategy = "ddp"
    else:
        strategy = LowbitStrategy(spec["algorithm"], **spec.get("options", {}))
    rec = Record(replay)
    folder = os.path.join(out, spec["name"] + ("-ckpt" if checkpoint else "-final"))
    os.makedirs(folder, exist_ok=True)
    callbacks = [rec]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=folder, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    precision = {"precision": spec.get("precision", "32-true")}
    if precision["precision"] == "16-mixed":  # Lightning turns the flag into bf16 on CPU; the plugin is fp16
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=spec.get("epochs", 2),
                      **precision, accumulate_grad_batches=spec.get("accumulate", 1),
                      gradient_clip_val=spec.get("clip"), callbacks=callbacks, enable_progress_bar=False,
                      logger=False, enable_model_summary=False, num_sanity_val_steps=0,
                      enable_checkpointing=checkpoint)
    model = Net(seed, sync_dist=spec.get("sync_dist", False), overflow_at=spec.get("overflow_at"))
    try:
        trainer.fit(model, data(), ckpt_path=ckpt)
    except Exception as e:  # noqa: BLE001 -- the case expects a refusal: recorded, the test judges it
        return {"error": f"{type(e).__name__}: {e}", "files": sorted(os.listdir(folder)), "bytes": rec.bytes}
    if not checkpoint:
        trainer.save_checkpoint(os.path.join(folder, "final.ckpt"))
    params = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    return {"losses": rec.losses, "bytes": rec.bytes, "params": params.tolist(), "layouts": rec.layouts,
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
        result = {}
        if spec.get("async_checkpoint"):
            refused = fit(spec, out, seed=1)
            result.update(refused=refused.get("error"), refused_files=refused["files"],
                          refused_bytes=refused["bytes"])
            result["a"] = fit(spec, out, seed=1, checkpoint=False)
            torch.distributed.barrier()
            result["saved_after_fit"] = sorted(os.listdir(os.path.join(out, spec["name"] + "-final")))
        else:
            result["a"] = fit(spec, out, seed=1)
        if spec.get("noreplay"):
            result["c"] = fit(spec, out, seed=2, ckpt=result["a"]["ckpt"], replay=False, checkpoint=False)
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
