"""Bagua's check, counted: for ring sizes 2..8 and input seeds 0..9, whether every
rank's parameters after 10 steps are isclose(atol=1e-5) to the plain reference of
tests/test_bagua.py, with Bagua's MinMaxUInt8 codec (lowbit's default for
lowprec-decentralized) and, for contrast, with lowbit's own min-max codec in its place;
then the hierarchical mode on simulated nodes (thread runtime, node_size), 10 seeds each.

    PYTHONPATH=.:tests python tests/bagua_check.py
"""

import torch
from torch import nn

from lowbit.codecs import MinMaxCodec
from lowbit.comm import run_threads
from lowbit.integrations import DecentralizedDataParallel
from test_bagua import LR, MOMENTUM, STEPS, WD, Net, data, init_state, reference, run_lowbit


def run_with_codec(n, seed, codec):
    init = init_state(seed)

    def worker(t):
        x, y = data(seed, n)[t.rank]
        m = Net()
        m.load_state_dict(init)
        opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
        ddp = DecentralizedDataParallel(m, opt, "lowprec-decentralized", transport=t, hierarchical=False,
                                        codec=codec)
        for _ in range(STEPS):
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            ddp.step()
        return ddp.flat.data.clone()

    return torch.stack(run_threads(n, worker))


def main():
    print("| n | Bagua's codec: seeds passing | max abs deviation "
          "| lowbit's minmax: seeds passing | max abs deviation |")
    print("|---|---|---|---|---|")
    for n in range(2, 9):
        ok_b = ok_m = 0
        dev_b = dev_m = 0.0
        for seed in range(10):
            ref = reference(n, seed)[-1]
            got = run_lowbit(n, seed, hierarchical=False)[0][-1]
            d = float((got - ref).abs().max())
            ok_b += bool(torch.isclose(got, ref, rtol=0, atol=1e-5).all())
            dev_b = max(dev_b, d)
            got = run_with_codec(n, seed, MinMaxCodec(bits=8))
            d = float((got - ref).abs().max())
            ok_m += bool(torch.isclose(got, ref, rtol=0, atol=1e-5).all())
            dev_m = max(dev_m, d)
        print(f"| {n} | {ok_b}/10 | {dev_b:.2e} | {ok_m}/10 | {dev_m:.2e} |")
    print()
    print("| workers | node size | nodes | seeds passing | max abs deviation | leader bytes/step | worker bytes/step |")
    print("|---|---|---|---|---|---|---|")
    for n, L in ((4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 4)):
        ok, dev = 0, 0.0
        for seed in range(10):
            ref = reference(n, seed, node_size=L)[-1]
            traj, _, rows = run_lowbit(n, seed, hierarchical=True, node_size=L)
            ok += bool(torch.isclose(traj[-1], ref, rtol=0, atol=1e-5).all())
            dev = max(dev, float((traj[-1] - ref).abs().max()))
        per_step = [sum(r[3] for r in rows[rank] if r[0] == 0) for rank in (0, 1)]
        print(f"| {n} | {L} | {n // L} | {ok}/10 | {dev:.2e} | {per_step[0]} | {per_step[1]} |")


if __name__ == "__main__":
    main()
