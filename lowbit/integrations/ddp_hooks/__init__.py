"""PyTorch DDP communication hooks: lowbit's centralized algorithms and codecs.

Usage::

    state, hook = make_hook("maxnorm", bits=4, seed=1)         # a lowbit train --algorithm name
    state, hook = make_hook("qsgd-maxnorm", bits=4)            # or a codec hook; or LowbitHookState(codec)
    ddp_model.register_comm_hook(state, hook)
    ...
    state.bytes_sent, state.last_step_bytes                    # the wire cost

``make_hook`` takes every centralized algorithm of ``lowbit train`` by its name, with the
options as ``lowbit train`` names them (:class:`~lowbit.algorithms.options.AlgorithmOptions`:
``bits``, ``k``, ``scales``, ``powersgd_rank``, ``levels``, ``sum_dtype``...; the same
defaults), and sends what the algorithm sends: its codec, rank and code-sum dtype
(:func:`algorithm_codec`); NDQSG, whose two groups no codec path carries, runs as itself on
each bucket. The codec hooks of :data:`HOOKS` name codecs directly (fp16, the l-inf norm...).
One hook function, :func:`lowbit_hook`, serves every codec; the state says which
codec and how its bucket travels. DDP calls the hook once per gradient bucket
with the bucket's flat, *local* gradient; the hook returns a future whose value
is the bucket's gradient averaged over the process group.

The hooks are adapters over the centralized algorithms: every wire family talks to a
:class:`~lowbit.comm.distributed.TorchDistributedTransport` on the state's process group and
calls the exchange its algorithm calls, returning ``future.then(write into the bucket)``.
How each codec travels (:data:`WIRE_METHODS`, :func:`wire_method`, from the codec's declared
capabilities; each family's module says how):

* ``allreduce-float`` -- fp32 and fp16/bf16: divide, cast, one SUM all-reduce (``floats``);
* ``allreduce-int`` -- summable codecs: the max-norm exchange, integer codes summed in
  summable lanes or the sum dtype (``maxnorm``);
* ``allreduce-randk`` -- a global random-k codec: the same ``k`` coordinates on every rank
  (``maxnorm``);
* ``allgather`` -- codecs whose codes cannot be added: all-gather of the packed payloads
  (``gathered``);
* ``powersgd`` -- PowerSGD's rank-r step per gradient matrix (``powersgd``);
* ``algorithm`` -- a centralized algorithm run as itself on each bucket (NDQSG; ``algorithm``).

The papers' quantization (one norm per 512 coordinates, TernGrad per layer and clipped) is
:func:`hook_codec`'s; mixed precision, randomness, error feedback, bytes and pickling are
:class:`LowbitHookState`'s; asynchrony and cost are :func:`lowbit_hook`'s.

Layout: one module per wire family, as torch's ``ddp_comm_hooks``: ``floats``
(``allreduce-float``), ``maxnorm`` (``allreduce-int``, ``allreduce-randk``), ``gathered``
(``allgather``), ``powersgd``, ``algorithm``; ``state`` (:class:`LowbitHookState`,
:func:`wire_method`), ``hook`` (:func:`lowbit_hook`) and ``names`` (:func:`make_hook`,
:data:`HOOKS`, :func:`hook_table`) and ``options`` (the typed hook options)."""

from .hook import lowbit_hook
from .names import HOOKS, algorithm_codec, centralized_names, hook_algorithm, hook_codec, hook_table, make_hook
from .powersgd import POWERSGD_STREAM
from .state import HOOK_BUCKET, HOOK_CLIP, HOOK_STREAM, NONFINITE, WIRE_METHODS, LowbitHookState, wire_method

__all__ = [
    "HOOKS",
    "algorithm_codec",
    "centralized_names",
    "hook_algorithm",
    "hook_codec",
    "HOOK_BUCKET",
    "HOOK_CLIP",
    "HOOK_STREAM",
    "POWERSGD_STREAM",
    "WIRE_METHODS",
    "NONFINITE",
    "LowbitHookState",
    "lowbit_hook",
    "make_hook",
    "hook_table",
    "wire_method",
]
