"""The algorithm contract: a paper algorithm as its options, an explicit state and phase functions.

An algorithm works on one worker's flat parameter vector ``x`` and its flat
gradient ``g`` (all model parameters in one contiguous buffer), SPMD: every
worker runs the same code. It is split the way optax splits an optimizer:

- the **algorithm object** holds only options: a frozen dataclass whose fields
  are what a user chooses (a codec, gamma, bits...), checked in
  ``__post_init__``. It keeps nothing between steps.
- ``init(x, ctx) -> State`` allocates the worker's memory between steps: a
  :class:`State` dataclass of tensors (replicas, error memory, previous
  iterates) and scalars (a tuned theta, counters). The state checkpoints by
  itself (:meth:`State.state_dict`).
- the **phase functions** ``before_update(state, ctx, k, x, g, lr)`` and
  ``after_update(...)`` take the state and the worker's :class:`Context`
  (rank, neighbours, mixing weights, seed and the transport) and return the
  state to use next. The training loop calls, once per step k::

      loss.backward()                              # g = stochastic gradient at x_k
      s = algo.before_update(s, ctx, k, x, g, lr)  # communicate
      optimizer.step()                             # local update x <- x - lr * d(g)
      s = algo.after_update(s, ctx, k, x, g, lr)   # (algorithms that act after the update)

  Centralized algorithms replace ``g`` by the aggregate of all workers'
  gradients in ``before_update``; decentralized (gossip) algorithms replace
  ``x`` by ``x_{k+1/2}`` (the mixed model) there, so that the optimizer step
  gives ``x_{k+1} = x_{k+1/2} - lr * g_k`` as in D-PSGD.

  ``x`` and ``g`` are the model's own buffers and are written in place. The
  state's tensors may be updated in place too (as a torch optimizer does with
  its moments): a phase function's caller uses only the state it returns.
  Everything an algorithm remembers is in the state: a phase function reads
  no attribute it set on the algorithm object or on the context.

:class:`Worker` binds an algorithm to a context and holds its state: it is
what the training loop (``lowbit.train.loop``) and the wrapper
(``lowbit.integrations.DecentralizedDataParallel``) drive, and what tests use
(``algo.worker(transport, topology)``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..comm.base import Transport
from ..topology import Topology, check_mixing_matrix
from .faults import StepGuard

__all__ = ["Algorithm", "CentralizedAlgorithm", "Context", "GossipAlgorithm", "State", "Worker", "make_worker",
           "tensors_nbytes", "transient"]


def tensors_nbytes(tensors) -> int:
    """Bytes held by an iterable of tensors."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Context:
    """Who a worker is, fixed for a run: what every phase function may read besides its state.

    ``rank`` and ``world_size`` are the transport's. ``seed`` is the run seed that the
    shared randomness of every message derives from
    (``codecs.rng.shared_generator(seed, step, sender)``). For a decentralized algorithm,
    ``topology`` is the graph, ``W`` the symmetric doubly stochastic mixing matrix,
    ``neighbors`` this worker's neighbours in order, ``w_self`` = W_ii and ``w[j]`` = W_ji,
    the weight this worker gives neighbour j's model. A centralized algorithm's context
    has no topology (``neighbors`` empty, ``w_self`` 1)."""

    transport: Transport
    seed: int = 0
    topology: Topology | None = None
    W: np.ndarray | None = None
    neighbors: tuple[int, ...] = ()
    w_self: float = 1.0
    w: Mapping[int, float] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @classmethod
    def make(cls, transport: Transport, topology: Topology | None = None, *, weights: str = "uniform",
             W: np.ndarray | None = None, seed: int = 0) -> "Context":
        """The context of ``transport``'s worker; with a topology, its row of the mixing
        matrix ``W`` (default: ``topology.mixing_matrix(weights)``), checked."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a lowbit.comm.Transport, got {type(transport).__name__}")
        if topology is None:
            if W is not None:
                raise ValueError("W (a mixing matrix) needs a topology")
            return cls(transport, seed)
        if topology.n != transport.world_size:
            raise ValueError(f"topology has {topology.n} workers but the transport has {transport.world_size}")
        W = topology.mixing_matrix(weights) if W is None else np.asarray(W, dtype=np.float64)
        check_mixing_matrix(W)
        rank = transport.rank
        neighbors = tuple(topology.neighbors(rank))
        for j in range(topology.n):
            if j != rank and W[rank, j] != 0 and j not in neighbors:
                raise ValueError(f"W[{rank},{j}] != 0 but {j} is not a neighbour of {rank} on {topology.name}")
        # W is symmetric: W_ji (what i takes from j, in the papers' notation) equals W_ij.
        return cls(transport, seed, topology, W, neighbors, float(W[rank, rank]),
                   {j: float(W[j, rank]) for j in neighbors})


def transient(**kw):
    """A :class:`State` field that is not checkpointed (a thread, a queue, a cache)."""
    return field(metadata={"checkpoint": False}, **kw)


@dataclass
class State:
    """Base of an algorithm's state: a dataclass whose fields are its memory between steps.

    A tensor field (or a dict of tensors) is memory counted by :meth:`nbytes` and saved
    by :meth:`state_dict`; a field that is itself a State (the state of a component, as
    D2's of the gossip it extrapolates around) is saved and counted with its name as a
    prefix; any other field is a scalar saved as it is (python numbers, strings, None,
    lists and dicts of them). A field declared with :func:`transient` is neither saved
    nor counted."""

    def _saved(self):
        return [f for f in dataclasses.fields(self) if f.metadata.get("checkpoint", True)]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor memory by name (a dict field ``f`` gives ``f.<key>``)."""
        out = {}
        for f in self._saved():
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v
            elif isinstance(v, State):
                out.update({f"{f.name}.{k}": t for k, t in v.tensors().items()})
            elif isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values()):
                out.update({f"{f.name}.{k}": t for k, t in v.items()})
        return out

    def nbytes(self) -> int:
        """Bytes of tensor memory: the extra memory this worker keeps between steps."""
        return tensors_nbytes(self.tensors().values())

    def state_dict(self) -> dict:
        """``{"tensors": {name: clone}, "extra": {name: scalar}}``: everything needed to
        continue exactly after a restart."""
        tensors = {k: v.detach().clone() for k, v in self.tensors().items()}
        extra = {}
        for f in self._saved():
            v = getattr(self, f.name)
            if isinstance(v, State):
                extra[f.name] = v.state_dict()["extra"]
                continue
            if f.name in tensors or any(k.startswith(f.name + ".") for k in tensors):
                continue
            if isinstance(v, dict) and not v:
                # an empty dict of tensors (nothing allocated yet) saves as an empty dict
                extra[f.name] = {}
            else:
                extra[f.name] = copy.deepcopy(v)
        return {"tensors": tensors, "extra": extra}

    def load_state_dict(self, state: dict, name: str = "algorithm") -> "State":
        """Copy a :meth:`state_dict` into this state's tensors (same shapes) and scalars;
        returns self."""
        tensors = self.tensors()
        mismatch = set(tensors) ^ set(state["tensors"])
        if mismatch:
            raise ValueError(f"{name} state_dict: tensors {sorted(mismatch)} do not match this algorithm's state")
        for k, t in tensors.items():
            src = state["tensors"][k]
            if src.shape != t.shape:
                raise ValueError(f"{name} state_dict: {k} has shape {tuple(src.shape)}, expected {tuple(t.shape)}")
            t.copy_(src)
        self._load_extra(state.get("extra", {}))
        return self

    def _load_extra(self, extra: dict) -> None:
        for f in self._saved():
            v = getattr(self, f.name)
            if isinstance(v, State):
                v._load_extra(extra.get(f.name, {}))
            elif f.name in extra:
                setattr(self, f.name, copy.deepcopy(extra[f.name]))


class _DerivedOptions:
    """``Algorithm.options``: the names of the options the class's fields read, in field order."""

    def __get__(self, obj, cls) -> tuple[str, ...]:
        from .config import options_of

        if not dataclasses.is_dataclass(cls):  # the class itself, while @dataclass builds it
            return ()
        return tuple(o.name for o in options_of(cls))


@dataclass(frozen=True)
class Algorithm:
    """Base of every algorithm: options (the dataclass fields of a subclass), ``init``
    and the phase functions. See the module docstring."""

    name: ClassVar[str] = "algorithm"
    family: ClassVar[str] = ""  # "centralized" or "decentralized"
    # False for asynchronous algorithms (AD-PSGD family): no step is a global
    # barrier, so the training loop evaluates only before the first step and
    # after finish().
    synchronous: ClassVar[bool] = True
    # Codec names (lowbit.codecs.CODECS) a run may choose with --codec; the
    # first is the default. Empty: the algorithm sends one fixed format.
    codecs: ClassVar[tuple[str, ...]] = ()
    # The options (names in lowbit.algorithms.options.AlgorithmOptions) that from_config
    # reads: what lowbit train, the wrapper and the hooks let a user set for it. Derived from
    # the fields that read options (lowbit.algorithms.config.reads).
    options: ClassVar[tuple[str, ...]] = _DerivedOptions()
    # True when before_update reads only x (with k, lr, its state and the context), never g,
    # and writes only x and its state (a gossip step x_{k+1/2} = sum_j W_ji x_j): x_k is final
    # once the forward starts, so DecentralizedDataParallel may run it on a copy of x_k on a
    # background thread while forward and backward compute (passing g=None), and copy the
    # result into the parameters at the optimizer step; the same arithmetic, bit for bit.
    overlap: ClassVar[bool] = False

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ValueError for combinations of this algorithm's options with the run's (``cfg``
        a ``lowbit.train.TrainConfig``: workers, momentum...) that it cannot take. Called before
        any worker starts, after ``from_config(cfg)`` has checked the options themselves."""

    def __post_init__(self):
        """The checks of the fields that hold an option's value (:func:`~lowbit.algorithms.config.check_fields`);
        a subclass with checks of its own calls this first."""
        from .config import check_fields

        check_fields(self)

    @classmethod
    def from_config(cls, cfg) -> "Algorithm":
        """This algorithm with the options of ``cfg`` (a
        :class:`~lowbit.algorithms.options.AlgorithmOptions`, e.g. a run's TrainConfig):
        it reads only the ones named in :attr:`options`, as its fields declare
        (:func:`~lowbit.algorithms.config.values_from`)."""
        from .config import values_from

        return cls(**values_from(cls, cfg))

    def init(self, x: torch.Tensor, ctx: Context) -> State:
        """The state before step 0, for the initial flat parameters ``x``."""
        return State()

    def before_update(self, state: State, ctx: Context, k: int, x: torch.Tensor, g: torch.Tensor,
                      lr: float) -> State:
        """Communication before the local optimizer step (in place on x or g)."""
        return state

    def after_update(self, state: State, ctx: Context, k: int, x: torch.Tensor, g: torch.Tensor,
                     lr: float) -> State:
        """Work after the local optimizer step (in place on x)."""
        return state

    def finish(self, state: State, ctx: Context) -> State:
        """Called once after the last step, before the final evaluation (an
        asynchronous algorithm drains its in-flight traffic here)."""
        return state

    def report(self, state: State) -> dict[str, int | float]:
        """Figures of this run worth reporting (e.g. Moniqua's final theta and its
        mismatch counters). A run's summary sums the int entries over workers
        (counters) and takes the float entries from rank 0 (settings all share)."""
        return {}

    @classmethod
    def run_warning(cls, report: dict) -> str | None:
        """What a whole run's combined :meth:`report` should warn the user of (logged
        once per run by :func:`lowbit.train.run.summarize`), or None."""
        return None

    def nominal_bits_per_element(self) -> float:
        """Bits per element of the code before any framing (the paper's count)."""
        return 32.0

    def worker_bits_per_element(self, state: State | None, ctx: Context) -> float:
        """The nominal bits per element of the worker with ``state`` and ``ctx``, where they
        depend on the vector's length (PowerSGD's factors, GlobalRandK's kept fraction) or on
        the worker's rank (NDQSG's two groups): by default :meth:`nominal_bits_per_element`."""
        return self.nominal_bits_per_element()

    def extra_memory_bytes(self, state: State) -> int:
        """Bytes of state a worker keeps between steps beyond the model and the
        optimizer: by default the state's tensors."""
        return state.nbytes()

    def worker(self, transport: Transport, topology: Topology | None = None, *, weights: str = "uniform",
               W: np.ndarray | None = None, seed: int = 0) -> "Worker":
        """This algorithm bound to ``transport``'s worker (see :func:`make_worker`)."""
        return make_worker(self, transport, topology, weights=weights, W=W, seed=seed)


@dataclass(frozen=True)
class GossipAlgorithm(Algorithm):
    """Base of the decentralized family: a worker mixes with its neighbours on a
    topology, by its row of the mixing matrix (``ctx.neighbors``, ``ctx.w``)."""

    family: ClassVar[str] = "decentralized"


@dataclass(frozen=True)
class CentralizedAlgorithm(Algorithm):
    """Base of the centralized family: every worker ends a step with the same aggregate."""

    family: ClassVar[str] = "centralized"


class Worker:
    """One worker running an algorithm: the algorithm (options), its :class:`Context` and
    its :class:`State`, with the per-step calls the training loop and the wrapper make."""

    def __init__(self, algorithm: Algorithm, ctx: Context):
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"algorithm must be a lowbit.algorithms.Algorithm, got {type(algorithm).__name__}")
        if algorithm.family == "decentralized" and ctx.topology is None:
            raise ValueError(f"{algorithm.name} is decentralized: its context needs a topology")
        if algorithm.family == "centralized" and ctx.topology is not None:
            raise ValueError(f"topology is for decentralized algorithms; {algorithm.name} is centralized")
        self.algorithm = algorithm
        self.ctx = ctx
        self.state: State | None = None
        # the ranks' agreement on faults and steps (lowbit.algorithms.faults), driven by the loop and the wrapper
        self.guard = StepGuard(ctx.transport)

    # what the loop and the wrapper read
    @property
    def name(self) -> str:
        return self.algorithm.name

    @property
    def family(self) -> str:
        return self.algorithm.family

    @property
    def synchronous(self) -> bool:
        return self.algorithm.synchronous

    @property
    def transport(self) -> Transport:
        return self.ctx.transport

    @property
    def acts_after_update(self) -> bool:
        """Whether the algorithm has an ``after_update`` of its own (which may communicate): its
        drivers agree on faults before it (``guard.agree(k, 1)``)."""
        return type(self.algorithm).after_update is not Algorithm.after_update

    @property
    def agrees_before_update(self) -> bool:
        """Whether the drivers agree on faults before the update too (``guard.agree(k, 0)``):
        where the algorithm has a ``before_update`` of its own, or no ``after_update`` (then
        that is the step's only agreement). One agreement per step otherwise: before the step's
        first communication."""
        return type(self.algorithm).before_update is not Algorithm.before_update or not self.acts_after_update

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def neighbors(self) -> tuple[int, ...]:
        return self.ctx.neighbors

    def __getattr__(self, name: str) -> Any:
        # the algorithm's options read through the worker (worker.codec, worker.gamma)
        if name in ("algorithm", "ctx", "state", "guard"):
            raise AttributeError(name)
        return getattr(self.algorithm, name)

    def setup(self, x: torch.Tensor) -> None:
        """Allocate the state for the initial flat parameters ``x``."""
        self.state = self.algorithm.init(x, self.ctx)

    def _ready(self) -> State:
        if self.state is None:
            raise RuntimeError(f"{self.name}: call setup(x) before the first step")
        return self.state

    def before_update(self, k: int, x: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        self.state = self.algorithm.before_update(self._ready(), self.ctx, k, x, g, lr)

    def after_update(self, k: int, x: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        self.state = self.algorithm.after_update(self._ready(), self.ctx, k, x, g, lr)

    def finish(self) -> None:
        self.state = self.algorithm.finish(self._ready(), self.ctx)

    def report(self) -> dict[str, int | float]:
        return self.algorithm.report(self._ready())

    def run_warning(self, report: dict) -> str | None:
        return self.algorithm.run_warning(report)

    def nominal_bits_per_element(self) -> float:
        return self.algorithm.worker_bits_per_element(self.state, self.ctx)

    def extra_memory_bytes(self) -> int:
        return self.algorithm.extra_memory_bytes(self._ready())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self._ready().tensors()

    def state_dict(self) -> dict:
        return self._ready().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state = self._ready().load_state_dict(state, self.name)

    def __repr__(self) -> str:
        return f"Worker({self.algorithm!r}, rank={self.rank}/{self.world_size})"


def make_worker(algorithm: Algorithm, transport: Transport, topology: Topology | None = None, *,
                weights: str = "uniform", W: np.ndarray | None = None, seed: int = 0) -> Worker:
    """Bind ``algorithm`` to ``transport``'s worker: a decentralized algorithm on
    ``topology`` with mixing matrix ``W`` (default ``topology.mixing_matrix(weights)``),
    randomness from the run ``seed``. Call ``setup(x)`` on the result before the first step."""
    return Worker(algorithm, Context.make(transport, topology, weights=weights, W=W, seed=seed))
