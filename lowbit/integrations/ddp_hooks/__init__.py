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

The hooks are adapters over the centralized algorithms. Every family talks to a
:class:`~lowbit.comm.distributed.TorchDistributedTransport` on the state's process
group, whose ``all_reduce_async`` / ``all_gather_async`` return futures, and calls the
exchange its algorithm calls: the algorithm waits for the future, the hook returns
``future.then(write into the bucket)``. The shared exchanges are
:func:`~lowbit.algorithms.allreduce.allreduce_average` (``floats``),
:func:`~lowbit.algorithms.maxnorm.maxnorm_exchange` with
:func:`~lowbit.algorithms.maxnorm.agree_scale_by` (``maxnorm``),
:func:`~lowbit.algorithms.compressed.gathered_exchange` with
:func:`~lowbit.algorithms.compressed.decode_average` (``gathered``) and
:func:`~lowbit.algorithms.compressed.power_step` (``powersgd``); the hook adds only what is
its own: the codec and randomness per bucket, the bit-plane MIN of scale indices, the
random-k selection per bucket, PowerSGD per gradient tensor, error memory per parameter.

How each codec travels (``WIRE_METHODS``):

* ``allreduce-float`` -- fp32 (:class:`IdentityCodec`; the exact reference) and
  fp16/bf16 (:class:`HalfCodec`): each rank divides by the world size, casts to the
  wire dtype (the codec's overflow check applies), one SUM all-reduce, cast back.
* ``allreduce-int`` -- summable codecs (QSGDMaxNorm, multi-scale, GlobalRandK around
  them): the max-norm algorithm's exchange; the codec's scale rounds (MAX all-reduce of the float32 norm; for the
  multi-scale codec a MIN of the per-coordinate scale indices), then one SUM
  all-reduce of the integer codes, packed in summable lanes (:mod:`lowbit.codecs.lanes`:
  int64 words of ``log2(2 N s + 1)``-bit lanes that the SUM adds without a carry)
  wherever those are smaller than ``codec.sum_dtype(world_size)`` (int16 is
  widened to int32: neither gloo nor NCCL reduces int16), else in it, then ``decode_sum``.
  The MIN of the scale indices travels as ``N - 1`` packed bit-planes (plane ``p``
  holds ``index >= p``) combined by bitwise AND, which is exactly the MIN, when
  that is narrower than one uint8 per coordinate (``N <= 8`` scales; for the
  paper's two scales one bit per coordinate, its ``ceil(log2 N)``) and the backend
  has a bitwise AND (gloo; NCCL has none); otherwise a uint8 MIN all-reduce. Unpacked,
  integers on the wire take whole bytes (the paper's section on framework support):
  ``bits=4`` (codes -7..7) would sum in int8 up to 18 ranks and ``bits=8`` in int32;
  in lanes ``bits=2`` takes 2.37/3.2/4.27/5.33 bits per element on 2/4/8/16 ranks,
  ``bits=4`` 4.92/6.4/7.11 on 2/4/8 (int8 from 16 on), ``bits=8`` 9.14 on 2.
* ``allreduce-randk`` -- :class:`RandKCodec` with ``send_indices=False``: every
  rank keeps the same ``k`` coordinates of a bucket, chosen from the seed
  ``derive_seed(seed, step, bucket_index, GLOBAL_RANDK_STREAM)`` (the codec's own
  ``seed`` field is replaced by it), and the kept values travel as the inner
  codec does (a summable inner codec: the seeded random-k codec is itself summable and
  travels as ``allreduce-int``, as the GlobalRandK algorithm's; fp32/fp16 floats for an
  identity/half inner codec, all-gather otherwise, the average scattered back, times
  ``d / k`` when ``rescale``).
* ``allgather`` -- codecs whose codes cannot be added (QSGD, TernGrad, sign, DQSG
  dithered, min-max, uniform, RandK with explicit indices): every rank all-gathers
  the packed wire payloads (``payload.to_wire()``, header included) and decodes all
  of them, a subtractive-dither decode with the sender's regenerated generator
  ``shared_generator(seed, step, sender, stream)``, then averages.
* ``powersgd`` -- PowerSGD's distributed rank-r step (Vogels et al., Algorithm 1),
  the codec giving the rank (:class:`PowerSGDCodec`'s own layout, the whole vector
  as one near-square matrix, has no low-rank structure for a bucket of unrelated
  tensors, so the hook delegates to the paper's per-tensor form, as torch's
  PowerSGD hook does): each gradient with 2+ dims is an ``n x m`` matrix ``M``
  (``shape[0]`` rows) compressed when ``(n + m) r < n m``; ``P = M Q`` of all of them,
  together with the uncompressed vectors (biases), in one all-reduce; each ``P``
  orthogonalised (QR, the same on every rank); ``Q = M^T P`` averaged by a second
  all-reduce; output ``P Q^T``. The averaged ``Q`` warm-starts the bucket's next step
  (the first ``Q`` is drawn from the shared seed, the same on every rank). The step is
  the algorithm's (``algorithms.compressed.power_step``, the matrices of the bucket at
  once, the vectors riding in the first all-reduce).
* ``algorithm`` -- a centralized algorithm (an instance) that runs its own step on the
  bucket over the state's process group (NDQSG), one algorithm state per bucket,
  synchronously (its future is complete when the hook returns).

Quantization as the papers do it (:func:`hook_codec`, applied by :func:`make_hook`). A DDP
bucket holds up to 25 MB of gradients of many layers; one norm (QSGD, QSGDMaxNorm) or one
``max |g|`` (TernGrad) for all of it makes a typical ``|g_i| / scale`` about ``1 / sqrt(n)``,
so nearly every code is 0 and the rest are huge: a variance ``~ sqrt(n) / s`` times
``||g||^2`` (40 at n = 79k, s = 7), which left a 79k-parameter CNN under Adam at 4 bits
2 to 5 points of test accuracy below fp32 DDP (a user's run ended at chance). So :func:`make_hook` gives the QSGD codec and the
single-scale max-norm codec (also inside a global random-k) one norm per ``bucket`` =
:data:`HOOK_BUCKET` = 512 consecutive coordinates (QSGD's bucketing; for the max-norm codec
each bucket's norm is shared by the MAX all-reduce, ``4 ceil(n / 512)`` bytes, counted in the
ledger), and TernGrad one message and scale per parameter (``per_layer``) with the gradient
clipped at ``clip`` = :data:`HOOK_CLIP` = 2.5 standard deviations (TernGrad's section 3.3).
``bucket=None``, ``clip=None``, ``per_layer=False`` send the algorithm's own codec, as
``lowbit train`` does (its algorithms are unchanged). The multi-scale codecs keep one norm.
``tests/test_hooks_train.py`` trains the CNN with each hook within 1 point of torch's DDP.

Mixed precision. The fp16 and bf16 hooks refuse a bucket that does not cast to finite
16-bit values (an inf or NaN gradient, or an fp16 overflow) with a clear ValueError. Under
``torch.amp.GradScaler`` such a gradient is expected (the scaler skips the step and lowers
its scale): ``make_hook("fp16", nonfinite="propagate")`` casts as torch's
``fp16_compress_hook`` does, unchecked, so the inf or NaN reaches every rank's average and
the scaler sees it (:class:`LowbitHookState`; the quantized hooks, whose codes have no inf
or NaN, refuse the option).

Asynchrony. The one big transfer of a bucket (the float, integer, gathered or
``Q`` tensor) is the transport's ``all_reduce_async`` / ``all_gather_async``
(``async_op=True``), decoded in a ``.then`` callback, so DDP overlaps it with the
rest of the backward pass. The small rounds before it (the 4-byte norm MAX and
the scale-index MIN of the max-norm codecs, PowerSGD's ``P``) are done
synchronously inside the hook, as in the algorithms: a later round needs the
earlier one's result to encode, and waiting inside a future callback can
deadlock a backend with few worker threads.

Randomness. Rank ``r``'s stochastic rounding / dither for bucket ``b`` at step ``k``
comes from ``shared_generator(seed, k, r, HOOK_STREAM + b)``; ``seed`` must be the
same on every rank. The step counter ``state.step`` advances once per iteration,
when the hook has processed the bucket with ``bucket.is_last()``.

Error feedback (``error_feedback=True``; the default for the biased sign and
PowerSGD codecs, False for the others): rank ``m`` compresses
``x_m = g_m + e_m`` and keeps ``e_m <- x_m - D(C(x_m))``, where ``D(C(x_m))`` is its
own contribution to the average (for PowerSGD, ``P Q_m^T`` with its own ``Q_m``, and
its own vectors as sent in float32). The memory is kept in the bucket's dtype (as
torch's PowerSGD hook keeps it; a float64 memory of an older checkpoint is cast).
The memory is keyed

* per parameter (by name) when the state knows the model
  (``LowbitHookState(..., model=ddp_model)`` or :meth:`LowbitHookState.bind_model`):
  a bucket's memory is assembled from, and split back into, the memories of its
  parameters, so DDP's bucket rebuild after the first iteration, and restoring a
  checkpoint into a freshly built DDP model, keep the memory exactly;
* otherwise per bucket index, with the bucket's signature (its parameters'
  shapes in bucket order): when DDP's rebuild changes a bucket's size or layout,
  that bucket's memory is RESET to zero (counted in ``state.memory_resets``), never
  misapplied.

PowerSGD's warm-start ``Q`` is always per bucket and is re-drawn on a signature
change (counted in ``state.powersgd_resets``).

Bytes. ``state.bytes_sent`` and ``state.messages`` count what this rank puts on the
wire, read from the transport's ledger (:meth:`~lowbit.comm.ledger.Ledger.drain`, after
each bucket), which counts as for every algorithm
(:func:`lowbit.comm.netmodel.op_messages_and_bytes`: an all-reduce of ``m`` bytes as the
ring's ``2(n-1)/n * m``, an all-gather of ``m`` bytes per rank as ``(n-1) m``).
``state.fp32_bytes_sent`` counts what plain fp32 all-reduce of the same buckets would
have sent; ``state.last_step_bytes`` is the latest complete iteration's total and
``state.bucket_bytes[b]`` the latest bytes of bucket ``b``.

Pickling (checkpoints): the state pickles without its process group (restored as
the default group, or set ``state.process_group`` again), without its transport and without the
parameter-identity map (call :meth:`LowbitHookState.bind_model` with the new
model after unpickling, when the memory is per parameter). A restored run
continues exactly as the original when the new DDP model meets the same buckets
(the randomness, per-bucket memories and PowerSGD's ``Q`` follow the bucket
layout); DDP without ``find_unused_parameters`` starts a fresh model with one
bucket and rebuilds after the first iteration, so there the first restored step
differs (per-parameter error memory still carries over exactly).

Cost: every family works in the bucket's own dtype; without error memory the fp32, fp16
and bf16 hooks divide the bucket in place and all-reduce their wire in place, as torch's
do. ``lowbit bench hooks`` times each hook's own compute against torch's
``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and
``powerSGD_hook`` (docs/RESULTS.md, "DDP hooks against torch's").

Layout: one module per wire family, as torch's ``ddp_comm_hooks``: ``floats``
(``allreduce-float``), ``maxnorm`` (``allreduce-int``, ``allreduce-randk``), ``gathered``
(``allgather``), ``powersgd``, ``algorithm``; ``state`` (:class:`LowbitHookState`,
:func:`wire_method`), ``hook`` (:func:`lowbit_hook`) and ``names`` (:func:`make_hook`,
:data:`HOOKS`, :func:`hook_table`).
"""

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
