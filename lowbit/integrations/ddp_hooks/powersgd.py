"""PowerSGD per gradient tensor of a bucket (method ``powersgd``), with the algorithm's power step
(``algorithms.compressed.power_p``, ``power_q``, ``power_product``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...algorithms.compressed import power_p, power_product, power_q
from ...codecs.powersgd import PowerSGDCodec
from ...codecs.rng import derive_seed, make_generator
from .state import _offsets, _ok, _ok_future

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


def powersgd_step(state, codec: PowerSGDCodec, x, world, group, bidx, sig, bucket):
    """Vogels et al., Algorithm 1, per gradient tensor of the bucket (as the paper and torch's
    PowerSGD hook do); vectors travel uncompressed in the first all-reduce."""
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
    first = torch.cat([power_p(M, q).reshape(-1) for M, q in zip(Ms, qs)]
                      + [(x[off:off + size] / world).to(torch.float32) for off, size in dense])
    state._count("all_reduce", first.numel() * 4, world, bidx)
    dist.all_reduce(first, group=group)
    p_hats, q_own, pos = [], [], 0
    for M, (_, n, _, r) in zip(Ms, mats):
        p_hat, q_m = power_q(M, first[pos:pos + n * r].view(n, r))  # P summed: orthogonalize ignores 1/N
        p_hats.append(p_hat)
        q_own.append(q_m.to(torch.float32))
        pos += n * r
    dense_avg = first[pos:].to(torch.float64)
    second = torch.cat([q.reshape(-1) for q in q_own]) if q_own else x.new_empty(0, dtype=torch.float32)

    def assemble(qs_used, dense_part) -> torch.Tensor:
        out = torch.empty(x.numel(), dtype=torch.float64, device=x.device)
        for (off, n, m, _), ph, q in zip(mats, p_hats, qs_used):
            out[off:off + n * m] = power_product(ph, q)
        pos = 0
        for off, size in dense:
            out[off:off + size] = dense_part[pos:pos + size]
            pos += size
        return out

    own_dense = torch.cat([x[off:off + size] for off, size in dense]) if dense else x.new_empty(0)
    own = lambda: assemble(q_own, own_dense.to(torch.float32).to(torch.float64))  # noqa: E731

    def finish(f):
        if f is not None:
            _ok(f)
        q_avg, pos = [], 0
        for (_, _, m, r) in mats:
            q_avg.append((second[pos:pos + m * r].view(m, r).to(torch.float64) / world).to(torch.float32))
            pos += m * r
        state.powersgd_q[bidx] = (sig, [q.clone() for q in q_avg])
        return assemble(q_avg, dense_avg)

    if second.numel() == 0:  # nothing low-rank in this bucket: the first all-reduce was all
        return _ok_future(finish(None)), own
    state._count("all_reduce", second.numel() * 4, world, bidx)
    fut = dist.all_reduce(second, group=group, async_op=True).get_future()
    return fut.then(finish), own
