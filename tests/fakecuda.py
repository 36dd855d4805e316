"""A fake CUDA device for tests on a CPU-only torch.

Under ``with fake_cuda():`` tensors can be *on* ``cuda:0`` while every
computation runs on the CPU: a :class:`FakeCudaTensor` is a wrapper subclass
whose ``.device`` is ``cuda:0`` and which holds a plain CPU tensor (``elem``).
What it is for: checking that code keeps every tensor on the device of its
input, as real CUDA would demand. Inside the context

* an op that mixes a fake-cuda tensor with a CPU tensor of dim > 0 raises
  ``RuntimeError: Expected all tensors to be on the same device`` (0-dim CPU
  tensors mix freely, like CPU scalars on real CUDA; so do the copies
  ``copy_`` and the CPU index tensors of ``x[idx]`` / ``x[idx] = v``, which
  real CUDA also accepts);
* factories with ``device="cuda"`` (``torch.zeros(3, device="cuda")``,
  ``torch.tensor(..., device=x.device)``), ``t.to("cuda")``, ``t.cuda()`` and
  ``module.to("cuda")`` give fake-cuda tensors; ``.cpu()`` / ``.to("cpu")``
  give plain CPU tensors (a copy, as on real CUDA);
* ``.numpy()`` (and so ``np.asarray``) of a fake-cuda tensor raises, as on
  real CUDA; ``.item()``, ``float()``, ``.tolist()`` work (a host sync there);
* a CPU ``generator=`` drawing onto the device (``torch.rand(n, generator=g,
  device="cuda")``, ``x.uniform_(generator=g)``, ``torch.randperm(n, generator=g,
  device="cuda")``) raises ``Expected a 'cuda' device type for generator``, as
  on real CUDA: draw on the generator's device and move the result;
* ``torch.cuda.is_available()`` is True and ``device_count()`` is 1.

Not feasible: autograd. torch's autograd records the device stream of every
graph input, which needs a CUDA device guard that a CPU build lacks (it
aborts the process), so any differentiable op on a fake-cuda tensor that
requires grad, with grad mode on, raises NotImplementedError instead.
Parameters may live on the fake device (``module.to("cuda")``) and the
optimizer step (no_grad) works; gradients must come from elsewhere (a CPU
twin of the model). Also not faked: ``torch.Generator(device="cuda")`` still fails (lowbit keeps its
generators on the CPU and moves the draws), nor CUDA streams, events, memory
statistics or ``torch.cuda`` RNG state. Results are the CPU's bit for bit.

torch keeps the mode stacks (``TorchFunctionMode``/``TorchDispatchMode``)
per thread; so that ``run_threads`` workers see the fake device too, threads
*started* inside the context enter the modes in their own ``run``.
Everything is restored on exit, also when the body raises.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FakeCudaTensor", "REAL_CUDA", "fake_cuda", "is_fake_cuda", "no_real_cuda"]

# Whether this torch sees a real GPU (read at import, before any fake_cuda()). The fake device
# stands in for a GPU on CPU-only machines; where a real one exists, fake_cuda() refuses (it would
# patch torch.cuda under code that really uses CUDA) and tests/test_gpu.py checks the real device.
REAL_CUDA = torch.cuda.is_available()
no_real_cuda = pytest.mark.skipif(REAL_CUDA, reason="a real GPU is present: the fake cuda device is for CPU-only "
                                                    "torch; tests/test_gpu.py runs these checks on the GPU")

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten

# Ops that real CUDA runs with CPU tensors among their arguments: copies (all of
# them), indexing (the index tensors, argument 1: x[cpu_idx], x[cpu_idx] = v).
_COPIES = {aten.copy_.default, aten._to_copy.default}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def _check_generator(kwargs) -> None:
    """Raise as real CUDA does when a CPU generator draws onto the (fake) cuda device."""
    gen = kwargs.get("generator")
    if isinstance(gen, torch.Generator) and gen.device.type != "cuda":
        raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{gen.device.type}' (fake_cuda)")


def _check_devices(func, args, kwargs) -> None:
    """Raise as real CUDA does when a CPU tensor of dim > 0 meets a cuda one, or a
    CPU generator draws into a cuda tensor."""
    _check_generator(kwargs)
    if func in _COPIES:
        return
    allowed = {id(t) for t in pytree.tree_leaves(args[1])} if func in _INDEXING else set()
    for t in pytree.arg_tree_leaves(*args, **kwargs):
        if type(t) is torch.Tensor and t.dim() > 0 and id(t) not in allowed:
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two "
                               f"devices, cuda:0 and {t.device}! (fake_cuda: {func})")


class FakeCudaTensor(torch.Tensor):
    """A tensor that says it is on ``cuda:0``; its data is the CPU tensor ``elem``."""

    elem: torch.Tensor
    # No subclass behaviour at the torch-function level: everything goes down to
    # __torch_dispatch__ (the modes below handle what cannot get there).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False):
        if type(elem) is not torch.Tensor or elem.device.type != "cpu":
            raise TypeError(f"FakeCudaTensor wraps a plain CPU tensor, got {type(elem).__name__} on {elem.device}")
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=CUDA, requires_grad=requires_grad)
        r.elem = elem
        return r

    def __repr__(self) -> str:  # the CPU repr, tagged: printing must not need a real device
        return f"FakeCudaTensor({self.elem!r}, device='cuda:0')"

    # Host access that real CUDA refuses / allows (a wrapper has no storage of its own).
    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. "
                        "Use Tensor.cpu() to copy the tensor to host memory first. (fake_cuda)")

    # torch's C++ bindings of these take a device guard, which a CPU build lacks
    # for cuda: read the CPU data (real CUDA syncs and copies to the host here).
    def tolist(self):
        return self.elem.tolist()

    def item(self):
        return self.elem.item()

    def __float__(self):
        return float(self.elem)

    def __int__(self):
        return int(self.elem)

    def __bool__(self):
        return bool(self.elem)

    def __index__(self):
        return self.elem.__index__()

    def __complex__(self):
        return complex(self.elem)

    def __deepcopy__(self, memo):  # torch's default copies storages a wrapper lacks
        if id(self) not in memo:
            with torch.no_grad():
                out = FakeCudaTensor(copy.deepcopy(self.elem, memo), requires_grad=self.requires_grad)
            if getattr(self, "_is_param", False):  # nn.Parameter of a subclass: a flag (see Parameter.__new__)
                out._is_param = True
            memo[id(self)] = out
        return memo[id(self)]

    def __format__(self, spec):
        return self.elem.item().__format__(spec) if self.dim() == 0 else format(repr(self), spec)

    def data_ptr(self) -> int:  # aliasing checks compare pointers: those of the CPU data
        return self.elem.data_ptr()

    def untyped_storage(self):
        return self.elem.untyped_storage()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_devices(func, args, kwargs)
        flat = pytree.arg_tree_leaves(*args, **kwargs)
        dev = kwargs.get("device")
        to_cpu = dev is not None and not _is_cuda(dev)  # .cpu(), .to("cpu"), zeros_like(x, device="cpu")
        if dev is not None:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        uargs, ukwargs = pytree.tree_map(_unwrap, (args, kwargs))
        out = func(*uargs, **ukwargs)
        if to_cpu:
            return out
        if func is aten.copy_.default and type(args[0]) is torch.Tensor:
            return args[0]  # copied into a CPU destination: it stays CPU
        if not isinstance(out, (torch.Tensor, list, tuple)):
            return out  # e.g. .item()'s scalar
        # In-place / out= ops return their (unwrapped) argument: hand back the original.
        back = {id(_unwrap(a)): a for a in flat if isinstance(a, torch.Tensor)}
        return pytree.tree_map(lambda o: back.get(id(o), _wrap(o)) if isinstance(o, torch.Tensor) else o, out)


def _unwrap(t):
    return t.elem if isinstance(t, FakeCudaTensor) else t


def _wrap(t):
    return FakeCudaTensor(t) if type(t) is torch.Tensor else t


def is_fake_cuda(t) -> bool:
    return isinstance(t, FakeCudaTensor)


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # .to(0) / .cuda(0)
        return True
    return torch.device(device).type == "cuda"


def _cpu_device_kwargs(kwargs):
    """``kwargs`` with a cuda ``device=`` replaced by cpu, and whether it was cuda."""
    if _is_cuda(kwargs.get("device")):
        return {**kwargs, "device": torch.device("cpu")}, True
    return kwargs, False


def _to_fake(x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, FakeCudaTensor):
        return x
    if x.device.type != "cpu":
        raise RuntimeError(f"fake_cuda: cannot move a {x.device} tensor to the fake cuda device")
    if x.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(_NO_AUTOGRAD)
    return FakeCudaTensor(x.detach().clone())


# torch's autograd records each graph input's device stream (InputMetadata), which
# needs a CUDA device guard: a CPU build aborts the whole process (std::terminate),
# so refuse first. Functions that build no graph node are let through (``register_hook``:
# a hook on a leaf, as the wrapper's count of backward passes registers; it runs only in a
# backward pass, which stays refused).
_NO_AUTOGRAD = ("fake_cuda: autograd through fake-cuda tensors is not supported (torch's autograd needs a CUDA "
                "device guard, which the CPU build lacks); use torch.no_grad() or compute gradients on the CPU")
_NO_NODE = {"__get__", "__set__", "detach", "detach_", "requires_grad_", "size", "dim", "numel", "stride",
            "element_size", "is_floating_point", "is_contiguous", "__repr__", "__format__", "__len__", "data_ptr",
            "__hash__", "zero_", "untyped_storage", "register_hook"}


def _check_no_autograd(func, args, kwargs) -> None:
    name = getattr(func, "__name__", "")
    if not torch.is_grad_enabled() or name in _NO_NODE:
        return
    if name.endswith("_as"):  # view_as(other), type_as(other): other only gives a shape or dtype
        args, kwargs = args[:1], {}
    for t in pytree.arg_tree_leaves(*args, **kwargs):
        if isinstance(t, FakeCudaTensor) and t.requires_grad:
            raise NotImplementedError(f"{_NO_AUTOGRAD} ({getattr(func, '__name__', func)})")


class _FunctionMode(TorchFunctionMode):
    """Moves to cuda (``Tensor.to``/``Tensor.cuda``) fail in torch's argument
    parsing before any dispatch: handle them here. Factories with a cuda
    ``device=`` run on the CPU and are wrapped."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_no_autograd(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return self._move(args[0], CUDA, None, kwargs.get("non_blocking", False), copy=False)
        if func is torch.Tensor.to:
            parse = {k: v for k, v in kwargs.items() if k not in ("copy", "non_blocking", "memory_format")}
            device, dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args[1:], **parse)
            if _is_cuda(device) or (device is None and isinstance(args[0], FakeCudaTensor)
                                    and not any(isinstance(a, torch.Tensor) for a in args[1:])):
                if device is None:  # .to(dtype) of a fake tensor: stays on the fake device
                    device = CUDA
                return self._move(args[0], device, dtype, non_blocking, copy=kwargs.get("copy", False))
            if len(args) > 1 and isinstance(args[1], FakeCudaTensor):  # .to(other): other's device and dtype
                return self._move(args[0], CUDA, args[1].dtype, non_blocking, copy=kwargs.get("copy", False))
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DATA_DESCRIPTOR and getattr(func, "__name__", "") == "__set__":
            return _set_data(*args)
        if func is torch.Tensor.copy_ and any(isinstance(a, FakeCudaTensor) for a in args[:2]):
            return aten.copy_.default(*args, **kwargs)  # the binding takes a device guard; the op does not
        if func is torch.Tensor.new_tensor and isinstance(args[0], FakeCudaTensor) and (
                kwargs.get("device") is None or _is_cuda(kwargs["device"])):
            dtype = kwargs.get("dtype") or args[0].dtype
            return _wrap(torch.tensor(args[1], dtype=dtype))
        if func in _ATEN_FOR and isinstance(args[0], FakeCudaTensor) and not kwargs:
            return _ATEN_FOR[func](*args)  # bindings that take a device guard: call the op itself
        if func is _GETITEM and isinstance(args[0], FakeCudaTensor):
            return _getitem(*args)
        if func is _SETITEM and isinstance(args[0], FakeCudaTensor):
            return _setitem(*args)
        kwargs, was_cuda = _cpu_device_kwargs(kwargs)
        if was_cuda:
            _check_generator(kwargs)
        out = func(*args, **kwargs)
        if was_cuda:
            out = pytree.tree_map(lambda o: _to_fake(o) if type(o) is torch.Tensor else o, out)
        return out

    @staticmethod
    def _move(x, device, dtype, non_blocking, copy):
        if not _is_cuda(device):
            raise AssertionError(device)
        if isinstance(device, torch.device) and device.index not in (None, 0) or isinstance(device, int) and device:
            raise RuntimeError(f"fake_cuda has one device, cuda:0; got {device}")
        if isinstance(x, FakeCudaTensor):  # already there: only a dtype change (or an explicit copy)
            if dtype is not None and dtype != x.dtype:
                return x.to(dtype=dtype)
            return x.clone() if copy else x
        y = _to_fake(x)
        return y if dtype is None or dtype == y.dtype else y.to(dtype=dtype)


_GETITEM, _SETITEM = torch._C.TensorBase.__getitem__, torch._C.TensorBase.__setitem__
_DATA_DESCRIPTOR = torch._C.TensorBase.__dict__["data"]
_ATEN_FOR = {torch.Tensor.__invert__: aten.bitwise_not.default, torch.Tensor.nonzero: aten.nonzero.default,
             torch.nonzero: aten.nonzero.default}


def _set_data(t, value) -> None:
    """``t.data = value``: the wrapper's metadata and its CPU data both follow
    ``value`` (so views such as FlatParams' keep aliasing the right storage).
    A tensor cannot change between fake cuda and CPU this way here (real torch
    allows it): that raises."""
    if isinstance(t, FakeCudaTensor) != isinstance(value, FakeCudaTensor):
        raise NotImplementedError(f"fake_cuda: `.data =` between {t.device} and {value.device} is not supported")
    _DATA_DESCRIPTOR.__set__(t, value)
    if isinstance(t, FakeCudaTensor):
        t.elem = value.elem


def _getitem(x, index):
    """``x[index]`` through aten ops (differentiable, views where torch gives views).
    torch's C++ indexing takes a device guard, which a CPU build lacks for cuda.
    Supported: ints, slices, None, Ellipsis; or tensor indices (long or bool, CPU
    ones allowed as on real CUDA), each in a dimension of its own, beside full
    slices ``:`` only."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) for i in index):
        if not all(isinstance(i, torch.Tensor) or i == slice(None) for i in index):
            raise NotImplementedError(f"fake_cuda: tensor indices mixed with {index} are not supported")
        return aten.index.Tensor(x, [_wrap(i) if isinstance(i, torch.Tensor) else None for i in index])
    if sum(i is Ellipsis for i in index) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(i is not None and i is not Ellipsis for i in index)
    if used > x.dim():
        raise IndexError(f"too many indices for tensor of dimension {x.dim()}")
    out, dim = x, 0
    for i in index:
        if i is Ellipsis:
            dim += x.dim() - used
        elif i is None:
            out = aten.unsqueeze.default(out, dim)
            dim += 1
        elif isinstance(i, slice):
            start, stop, step = i.indices(out.shape[dim])
            if step <= 0:
                raise ValueError("step must be greater than zero")
            out = aten.slice.Tensor(out, dim, start, max(start, stop), step)
            dim += 1
        elif isinstance(i, int) and not isinstance(i, bool):
            n = out.shape[dim]
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {n}")
            out = aten.select.int(out, dim, i)
        else:
            raise NotImplementedError(f"fake_cuda: index {i!r} is not supported")
    return out if out is not x else aten.alias.default(x)


def _setitem(x, index, value) -> None:
    """``x[index] = value``: a copy into the view for basic indices (CPU sources
    allowed, as torch copies across devices); ``index_put_`` for tensor indices,
    whose values must be on the device (or scalars), as real CUDA demands."""
    idx = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) for i in idx):
        if not all(isinstance(i, torch.Tensor) or i == slice(None) for i in idx):
            raise NotImplementedError(f"fake_cuda: tensor indices mixed with {idx} are not supported")
        v = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=x.dtype)
        aten.index_put_.default(x, [_wrap(i) if isinstance(i, torch.Tensor) else None for i in idx], v)
        return
    view = _getitem(x, index)
    if isinstance(value, torch.Tensor):
        aten.copy_.default(view, value)
    else:
        aten.fill_.Scalar(view, value)


class _DispatchMode(TorchDispatchMode):
    """Factories that reach the dispatcher with ``device=cuda`` (from C++, e.g. autograd
    formulas, ``torch.tensor(..., device=)``) run on the CPU and are wrapped."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, FakeCudaTensor) for t in pytree.arg_tree_leaves(*args, **kwargs)):
            return func(*args, **kwargs)  # FakeCudaTensor.__torch_dispatch__ handles it
        kwargs, was_cuda = _cpu_device_kwargs(kwargs)
        if was_cuda:
            _check_generator(kwargs)
        out = func(*args, **kwargs)
        return pytree.tree_map(_wrap, out) if was_cuda else out


@contextlib.contextmanager
def _thread_modes():
    """The fake device's modes on the current thread (they are thread-local in torch)."""
    with _FunctionMode(), _DispatchMode():
        yield


_LOCK = threading.Lock()
_ACTIVE = [0]


@contextlib.contextmanager
def fake_cuda():
    """Pretend ``cuda:0`` exists (see the module docstring). Not re-entrant. Refused
    where torch sees a real GPU (:data:`REAL_CUDA`)."""
    if REAL_CUDA:
        raise RuntimeError("fake_cuda() is for CPU-only torch; this torch sees a real GPU (use it: tests/test_gpu.py)")
    with _LOCK:
        if _ACTIVE[0]:
            raise RuntimeError("fake_cuda() is already active")
        _ACTIVE[0] = 1
    cuda = torch.cuda
    saved = {name: getattr(cuda, name) for name in ("_lazy_init", "is_available", "device_count",
                                                    "current_device", "synchronize")}
    thread_run = threading.Thread.run
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()

    def run(self):  # threads started in the context (run_threads workers) see the fake device too
        with _thread_modes():
            thread_run(self)

    try:
        cuda._lazy_init = lambda: None  # torch.zeros(..., device="cuda") calls it while parsing arguments
        cuda.is_available = lambda: True
        cuda.device_count = lambda: 1
        cuda.current_device = lambda: 0
        cuda.synchronize = lambda device=None: None
        threading.Thread.run = run
        # module.to("cuda") would otherwise set param.data = <fake tensor> on the CPU
        # Parameter object (a CPU python object with a cuda impl): make it build new ones.
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        with _thread_modes():
            yield
    finally:
        threading.Thread.run = thread_run
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        for name, fn in saved.items():
            setattr(cuda, name, fn)
        _ACTIVE[0] = 0
