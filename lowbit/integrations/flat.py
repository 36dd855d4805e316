"""All parameters of a module in one contiguous buffer, parameters as views.

Algorithms then encode and send one flat vector per step instead of one
tensor per parameter. Gradients live in a second flat buffer; ``p.grad`` of
each parameter is a view into it, so an algorithm that rewrites the flat
gradient in place changes what the optimizer sees.
"""

from __future__ import annotations

import torch
from torch import nn


class FlatParams:
    """``module``'s trainable parameters (or, with ``params``, those of them
    that ``params`` lists, in the module's order) as views of one flat buffer
    ``data``, their gradients as views of ``grad``."""

    def __init__(self, module: nn.Module, params=None):
        trainable = [p for p in module.parameters() if p.requires_grad]
        if params is not None:
            chosen = {id(p) for p in params}
            known = {id(p) for p in trainable}
            if not chosen <= known:
                raise ValueError(f"params holds {len(chosen - known)} tensor(s) that are not trainable parameters "
                                 "of module")
            trainable = [p for p in trainable if id(p) in chosen]
        if not trainable:
            raise ValueError("the module has no trainable parameters" if params is None else "params is empty")
        params = trainable
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"all parameters must share one dtype and device, got {dtypes} on {devices}")
        self.params = params
        n = sum(p.numel() for p in params)
        self.data = torch.empty(n, dtype=params[0].dtype, device=params[0].device)
        self.grad = torch.zeros_like(self.data)
        offset = 0
        for p in params:
            k = p.numel()
            self.data[offset:offset + k].copy_(p.data.reshape(-1))
            p.data = self.data[offset:offset + k].view_as(p)
            p.grad = self.grad[offset:offset + k].view_as(p)
            offset += k

    def __len__(self) -> int:
        return self.data.numel()

    def zero_grad(self) -> None:
        self.grad.zero_()

    def check_aliasing(self) -> None:
        """Raise if something replaced a parameter or gradient (e.g. zero_grad(set_to_none=True))."""
        base, gbase = self.data.data_ptr(), self.grad.data_ptr()
        size = self.data.numel() * self.data.element_size()
        for p in self.params:
            if p.grad is None or not (gbase <= p.grad.data_ptr() < gbase + size):
                raise RuntimeError("a parameter's .grad no longer points into the flat gradient buffer; "
                                   "call FlatParams.zero_grad() instead of optimizer.zero_grad(set_to_none=True)")
            if not (base <= p.data.data_ptr() < base + size):
                raise RuntimeError("a parameter no longer points into the flat parameter buffer")
