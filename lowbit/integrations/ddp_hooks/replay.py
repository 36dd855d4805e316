"""The first step after :meth:`LowbitHookState.load_state_dict`: the saved bucket layout out of
a fresh DDP model's buckets, so that a restored run continues bit for bit.

DDP builds a fresh model's buckets in parameter order (one bucket, unless
``find_unused_parameters``) and rebuilds them in the order the gradients arrive after the first
iteration. The hook's randomness (seeded per bucket index), per-bucket error memory, PowerSGD's
warm-start ``Q`` and the quantizer's 512-coordinate blocks all follow the layout, so the first
step of a resumed run would see another layout than the uninterrupted run did. When a real
bucket holds exactly the parameters of some saved buckets in another order, :func:`replay_layout`
gathers each saved bucket's gradients in its saved order into a :class:`GradBucketStandIn`, runs the
hook on them in index order, and writes the averages back into the real bucket. DDP's own
rebuild after that step yields the saved layout again (the same gradient order), so the replay
ends with the first complete step. A real bucket that does not split into saved buckets (other
bucket caps) runs as it is, with a warning: that step differs from the uninterrupted run's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


class GradBucketStandIn:
    """What lowbit's and torch's DDP hooks read of a ``torch.distributed.GradBucket``: ``params``'
    gradients as views of one flat buffer (in their order), filled from ``grad``; the bucket's
    ``index`` and whether it ``is_last``. :meth:`refill` copies ``grad`` in again (a hook
    overwrites its bucket with the average)."""

    def __init__(self, params, grad: torch.Tensor, index: int = 0, last: bool = True) -> None:
        self.params = list(params)
        self.grad = grad
        self._index = index
        self._last = last
        self._buf = grad.clone()
        self._views, at = [], 0
        for p in self.params:
            self._views.append(self._buf[at:at + p.numel()].view(p.shape))
            at += p.numel()

    def refill(self) -> torch.Tensor:
        """Copy the gradient into the buffer again."""
        return self._buf.copy_(self.grad)

    def buffer(self) -> torch.Tensor:
        """The flat buffer."""
        return self._buf

    def index(self) -> int:
        """The bucket's index."""
        return self._index

    def is_last(self) -> bool:
        """Whether it is the last bucket of the iteration."""
        return self._last

    def parameters(self) -> list:
        """The parameters whose gradients it holds."""
        return self.params

    def gradients(self) -> list:
        """The gradients: views of the buffer."""
        return self._views


def replay_layout(state, bucket, run: Callable) -> torch.futures.Future:
    """``run(state, b)`` on the saved buckets ``b`` that make up ``bucket`` (see the module
    docstring), the averages written back into ``bucket``; ``run(state, bucket)`` when its
    layout is the saved one or does not split into saved buckets. Ends the replay with the
    step's last bucket."""
    saved = state._replay
    if bucket.is_last() or state._param_names is None:
        state._replay = None
    if state._param_names is None:
        warnings.warn("the restored hook state knows no model (state.bind_model(model)): this first restored step "
                      "runs the fresh DDP bucket layout and differs from the uninterrupted run", RuntimeWarning,
                      stacklevel=3)
        return run(state, bucket)
    names = state._names(bucket)
    if tuple(names) == saved.get(bucket.index()):
        return run(state, bucket)
    slots = dict(zip(names, zip(bucket.parameters(), bucket.gradients())))
    parts = [(i, lay) for i, lay in sorted(saved.items()) if lay and set(lay) <= slots.keys()]
    if sorted(n for _, lay in parts for n in lay) != sorted(names):
        warnings.warn(f"bucket {bucket.index()} does not split into the saved buckets (other bucket caps?): "
                      "this first restored step runs the fresh layout and differs from the uninterrupted run",
                      RuntimeWarning, stacklevel=3)
        return run(state, bucket)
    laid = [GradBucketStandIn([slots[n][0] for n in lay], torch.cat([slots[n][1].reshape(-1) for n in lay]), i,
                              bucket.is_last() and k == len(parts) - 1) for k, (i, lay) in enumerate(parts)]
    futures = [run(state, b) for b in laid]

    def write_back(_) -> torch.Tensor:
        for b, fut in zip(laid, futures):
            avg, at = fut.wait(), 0  # the saved bucket's average (its error, if any, raised here)
            for name, view in zip(saved[b.index()], b.gradients()):
                slots[name][1].copy_(avg[at:at + view.numel()].view_as(view))
                at += view.numel()
        return bucket.buffer()

    return torch.futures.collect_all(futures).then(write_back)
