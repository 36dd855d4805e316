"""The one hook function, :func:`lowbit_hook`: the bucket through its state's wire method."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...algorithms.feedback import compensate, remember
from ...comm.base import then
from ...comm.netmodel import op_messages_and_bytes
from .algorithm import algorithm_step
from .floats import float_allreduce, write_average
from .gathered import allgather
from .maxnorm import int_allreduce, randk_allreduce
from .powersgd import powersgd_step
from .replay import replay_layout
from .state import LowbitHookState, _layer_sizes, _offsets, _signature


def lowbit_hook(state: LowbitHookState, bucket) -> torch.futures.Future:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, lowbit_hook)``.

    Asynchrony. The one big transfer of a bucket (the float, integer, gathered or
    ``Q`` tensor) is the transport's ``all_reduce_async`` / ``all_gather_async``
    (``async_op=True``), decoded in a ``.then`` callback, so DDP overlaps it with the
    rest of the backward pass. The small rounds before it (the 4-byte norm MAX and
    the scale-index MIN of the max-norm codecs, PowerSGD's ``P``) are done
    synchronously inside the hook, as in the algorithms: a later round needs the
    earlier one's result to encode, and waiting inside a future callback can
    deadlock a backend with few worker threads.

    Cost: every family works in the bucket's own dtype; without error memory the fp32, fp16
    and bf16 hooks divide the bucket in place and all-reduce their wire in place, as torch's
    do. ``lowbit bench hooks`` times each hook's own compute against torch's
    ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and
    ``powerSGD_hook`` (docs/RESULTS.md, "DDP hooks against torch's").
    """
    if not isinstance(state, LowbitHookState):
        raise ValueError(f"state must be a LowbitHookState, got {type(state).__name__}")
    if state._replay is not None:  # the first step after load_state_dict: the saved buckets
        return replay_layout(state, bucket, run_bucket)
    return run_bucket(state, bucket)


def run_bucket(state: LowbitHookState, bucket) -> torch.futures.Future:
    """One bucket (a ``GradBucket`` or :class:`~.replay.GradBucketStandIn`) through the state's wire method."""
    t = state._comm()
    world, rank = t.world_size, t.rank
    buf = bucket.buffer()
    bidx = bucket.index()
    is_last = bucket.is_last()
    sig = _signature(bucket)
    names = state._names(bucket) if state._param_names is not None else None
    if names is not None:  # the layout a restored run replays (LowbitHookState.state_dict)
        state.bucket_layout[bidx] = tuple(names)
    state.bucket_bytes[bidx] = 0
    state.bucket_numel[bidx] = buf.numel()
    fp32_msgs, fp32_sent = op_messages_and_bytes("all_reduce", 4 * buf.numel(), world)
    state.fp32_bytes_sent += fp32_sent
    codec = state.codec
    ef = state.error_feedback
    x = buf.detach()  # every family works in the bucket's dtype, as torch's hooks do
    layout = mem = None
    if ef:
        if state.per_parameter:
            layout = list(zip(names if names is not None else state._names(bucket), _offsets(bucket)))
        mem = state._load_memory(bucket, buf)
        x = compensate(x, mem, out=x)  # p = g + e in the bucket, which the average overwrites anyway
    t.set_step(state.step)
    try:
        if state.method == "allreduce-float":
            fut, own = float_allreduce(t, codec, x, scratch=not ef,  # without memory: x is the bucket
                                       checked=state.nonfinite == "raise")
        elif state.method == "allreduce-int":
            fut, own = int_allreduce(state, t, codec, x, state._generator(rank, bidx))
        elif state.method == "allreduce-randk":
            fut, own = randk_allreduce(state, t, codec, x, bidx, state._generator(rank, bidx))
        elif state.method == "allgather":
            fut, own = allgather(state, t, codec, x, bidx, _layer_sizes(bucket, x.numel()) if state.per_layer else None)
        elif state.method == "algorithm":
            fut, own = algorithm_step(state, t, codec, x, bidx, sig, buf.dtype)
        else:
            fut, own = powersgd_step(state, t, codec, x, bidx, sig, bucket)
    finally:
        state._drain(t, bidx)
        state._finish_bucket(is_last)
    state._check_saving(bidx, fp32_sent, world)

    def write(avg):
        if ef:
            state._store_memory(bidx, sig, layout, remember(mem, x, own()))  # e = p - C(p), in place
        return write_average(buf, avg)  # the average, cast to the bucket's dtype

    return then(fut, write)


# DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation)
lowbit_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
