"""PowerSGD per gradient tensor of a bucket (method ``powersgd``), with the algorithm's power step
over the transport (``algorithms.compressed.power_step``, ``power_product``).

The method: ````powersgd`` -- PowerSGD's distributed rank-r step (Vogels et al., Algorithm 1),
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
"""

from __future__ import annotations

import torch

from ...algorithms.compressed import power_product, power_step
from ...codecs.powersgd import PowerSGDCodec
from ...codecs.rng import derive_seed, make_generator
from ...comm.base import then
from .state import _offsets

#: stream of the PowerSGD warm-start draws (plus the bucket index).
POWERSGD_STREAM = 0x50535344 << 20  # "PSSD"


def _powersgd_plan(codec: PowerSGDCodec, bucket) -> tuple[list, list]:
    """Split a bucket into low-rank matrices ``(offset, n, m, r)`` -- each gradient with 2+
    dims viewed as ``shape[0] x rest``, rank ``min(rank, n, m)``, when ``(n + m) r < n m`` --
    and dense slices ``(offset, size)`` (vectors, and matrices that rank-r would not shrink)."""
    mats, dense = [], []
    for (off, size), p in zip(_offsets(bucket), bucket.parameters()):
        if p.dim() >= 2 and size:
            n = p.shape[0]
            m = size // n
            r = min(codec.rank, n, m)
            if (n + m) * r < n * m:
                mats.append((off, n, m, r))
                continue
        dense.append((off, size))
    return mats, dense


def powersgd_step(state, t, codec: PowerSGDCodec, x, bidx, sig, bucket):
    """Vogels et al., Algorithm 1, per gradient tensor of the bucket (as the paper and torch's
    PowerSGD hook do) over the transport ``t``: the algorithm's
    :func:`~lowbit.algorithms.compressed.power_step` on the bucket's matrices; vectors travel
    uncompressed in the first all-reduce. The products are in the bucket's dtype, a half
    bucket's in float32."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    world = t.world_size
    mats, dense = _powersgd_plan(codec, bucket)
    entry = state.powersgd_q.get(bidx)
    if entry is not None and entry[0] == sig:
        qs = [q.to(device=x.device) for q in entry[1]]
    else:
        if entry is not None:
            state.powersgd_resets += 1
        gen = make_generator(derive_seed(state.seed, state.step, bidx, POWERSGD_STREAM))
        qs = [torch.randn(m, r, generator=gen, dtype=torch.float32).to(device=x.device) for (_, _, m, r) in mats]
    Ms = [x[off:off + n * m].view(n, m) for (off, n, m, _) in mats]
    rider = torch.cat([(x[off:off + size] / world).to(torch.float32) for off, size in dense]) if dense else None
    fut, p_hats, q_own = power_step(t, Ms, qs, rider)

    def assemble(qs_used, dense_part) -> torch.Tensor:
        out = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        for (off, n, m, _), ph, q in zip(mats, p_hats, qs_used):
            out[off:off + n * m] = power_product(ph, q)
        pos = 0
        for off, size in dense:
            out[off:off + size] = dense_part[pos:pos + size]
            pos += size
        return out

    def own() -> torch.Tensor:  # with the vectors as they were sent (float32)
        own_dense = torch.cat([x[off:off + size] for off, size in dense]) if dense else x.new_empty(0)
        return assemble(q_own, own_dense.to(torch.float32))

    def finish(result) -> torch.Tensor:
        q_avg, dense_sum = result
        state.powersgd_q[bidx] = (sig, [q.clone() for q in q_avg])
        return assemble(q_avg, dense_sum)

    return then(fut, finish), own
