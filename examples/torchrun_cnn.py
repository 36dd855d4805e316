"""A small CNN on scikit-learn's 8x8 digits, trained on n workers with any
lowbit algorithm through DecentralizedDataParallel.

    torchrun --standalone --nproc-per-node 4 examples/torchrun_cnn.py --algorithm moniqua --bits 2 --steps 200
    torchrun --standalone --nproc-per-node 4 examples/torchrun_cnn.py --steps 100 --checkpoint ckpt
    torchrun --standalone --nproc-per-node 4 examples/torchrun_cnn.py --steps 200 --resume ckpt
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 examples/torchrun_cnn.py --steps 2000 \
        --checkpoint ckpt --checkpoint-every 50

--checkpoint DIR writes one file per rank (DIR/rank{r}.pt, atomically and
checksummed; the one before is kept as rank{r}.pt.prev) after the last step
and, with --checkpoint-every K, every K steps. --resume DIR continues from it
up to --steps (the total), giving the same model as one uninterrupted run.
With --checkpoint-every, a (re)started run first resumes by itself from the
newest step that every rank has a good checkpoint of: under torchrun
--max-restarts a worker killed mid-run costs at most K steps. Checkpoints
hold only tensors and plain values (torch.load(..., weights_only=True) reads
them). The model and the training loop are plain torch (opt.zero_grad(),
backward, opt.step()); only the wrapper is lowbit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.codecs.rng import derive_seed
from lowbit.integrations import DecentralizedDataParallel


class DigitsCNN(nn.Module):
    """conv3x3(1->8) - BatchNorm - ReLU - conv3x3(8->16) - ReLU - maxpool2 - linear(256->10)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def load_digits_split(seed: int):
    """Digits as (N, 1, 8, 8) in [0, 1]; a fixed 80/20 train/test split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


def _theta(s: str):
    return s if s == "auto" else float(s)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="moniqua", help="a lowbit algorithm (lowbit.algorithms.ALGORITHMS)")
    p.add_argument("--bits", type=int, default=None, help="bits per element (algorithms that take bits)")
    p.add_argument("--theta", type=_theta, default=None, help="Moniqua's theta: a number > 0 or 'auto'")
    p.add_argument("--topology", default=None, help="ring, torus, complete, star, exponential (decentralized)")
    p.add_argument("--buffers", default="local", choices=("local", "average"),
                   help="BatchNorm statistics of the evaluated model: this rank's (default, as the wrapper) "
                        "or the workers' average")
    p.add_argument("--steps", type=int, default=200, help="total steps (a resumed run continues up to it)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--checkpoint", default=None, help="directory to write rank{r}.pt into after the last step")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every K steps, and resume from the newest good one at start (0: off)")
    p.add_argument("--resume", default=None, help="directory of a --checkpoint to continue from")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps must be >= 0, got {args.steps}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.eval_every < 1:
        p.error(f"--eval-every must be >= 1, got {args.eval_every}")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_every and not args.checkpoint:
        p.error("--checkpoint-every needs --checkpoint DIR")
    return args


@torch.no_grad()
def evaluate(model, data):
    model.eval()
    x, y = data
    out = model(x)
    model.train()
    return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # CUDA when present: torchrun's LOCAL_RANK picks this rank's GPU (the transport then uses NCCL)
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
              if torch.cuda.is_available() else torch.device("cpu"))
    torch.manual_seed(args.seed)  # the same x_0 on every rank (the wrapper also broadcasts rank 0's)
    model = DigitsCNN().to(device)  # before wrapping: the wrapper flattens the parameters where they are
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    options = {k: v for k, v in (("bits", args.bits), ("theta", args.theta)) if v is not None}
    ddp = DecentralizedDataParallel(model, opt, args.algorithm, topology=args.topology, buffers=args.buffers,
                                    seed=args.seed, **options)
    rank, n = ddp.rank, ddp.world_size
    if args.resume:  # collective: every rank must resume the same step
        ddp.load_checkpoint(os.path.join(args.resume, f"rank{rank}.pt"))
    elif args.checkpoint_every:  # a restart (torchrun --max-restarts) continues from the newest good checkpoint
        step = ddp.resume_latest(os.path.join(args.checkpoint, f"rank{rank}.pt"))
        if step is not None and rank == 0:
            print(f"resumed from step {step} ({args.checkpoint})", flush=True)

    train, test = ((x.to(device), y.to(device)) for x, y in load_digits_split(args.seed))
    shard_x, shard_y = train[0][rank::n], train[1][rank::n]  # iid shards

    def report(k: int) -> None:
        avg = ddp.averaged_module()  # collective: every rank calls it
        if rank == 0:
            tr_loss, tr_acc = evaluate(avg, train)
            te_loss, te_acc = evaluate(avg, test)
            print(f"step {k:5d}  train loss {tr_loss:.4f}  train acc {tr_acc:.4f}  test acc {te_acc:.4f}  "
                  f"sent {ddp.bytes_sent / 1e3:.1f} kB/rank", flush=True)

    if rank == 0:
        print(f"{args.algorithm} on {n} workers, {len(ddp.flat)} parameters, from step {ddp.step_count}", flush=True)
    t0 = time.perf_counter()
    with ddp:
        while ddp.step_count < args.steps:
            k = ddp.step_count
            if k % args.eval_every == 0:
                report(k)
            # the batch depends on (seed, rank, step) only, so a resumed run sees the same data
            gen = torch.Generator().manual_seed(derive_seed(args.seed, k, rank, stream=1))
            idx = torch.randint(len(shard_y), (args.batch_size,), generator=gen).to(device)
            opt.zero_grad()
            F.cross_entropy(model(shard_x[idx]), shard_y[idx]).backward()
            opt.step()  # the wrapper's hooks on the optimizer communicate around the update
            if args.checkpoint_every and ddp.step_count % args.checkpoint_every == 0 and ddp.algorithm.synchronous:
                ddp.save_checkpoint(os.path.join(args.checkpoint, f"rank{rank}.pt"))
        report(ddp.step_count)
        # a fingerprint of each rank's parameters (resumed and uninterrupted runs print the same)
        digest = int(hashlib.sha256(ddp.flat.data.detach().cpu().numpy().tobytes()).hexdigest()[:15], 16)
        with ddp.transport.untracked():
            digests = ddp.transport.gather(torch.tensor([digest], dtype=torch.int64, device=device), 0)
        if rank == 0:
            print(f"done in {time.perf_counter() - t0:.1f} s; parameters sha256[:15] per rank: "
                  + " ".join(f"{int(d):015x}" for d in digests), flush=True)
    if args.checkpoint:  # after close(): a consistent cut for asynchronous algorithms too
        ddp.save_checkpoint(os.path.join(args.checkpoint, f"rank{rank}.pt"))
        print(f"rank {rank}: checkpoint at step {ddp.step_count} in {args.checkpoint}/rank{rank}.pt", flush=True)


if __name__ == "__main__":
    main()
