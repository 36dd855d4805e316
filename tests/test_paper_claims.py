"""The source documents' claims that issues 4 and 5 ask to hold on digits-mlp
(the settings and the measured figures are in docs/RESULTS.md)."""

import pytest

from lowbit.codecs.radix import level_bits
from lowbit.train import TrainConfig, train

pytestmark = pytest.mark.slow  # whole training runs: about a minute together on 2 cores


def _run(**kw):
    return train(TrainConfig(**{"eval_every": 100, **kw})).summary


def test_moniqua_on_d2_learns_one_label_per_worker_data():
    """Figure 2a of Moniqua: with each of 10 workers holding one digit, Moniqua on D2 reaches
    85% while D-PSGD and Moniqua on D-PSGD stay clearly lower (their local models most)."""
    noniid = dict(split="label", workers=10, steps=300, momentum=0.0, weight_decay=0.0, lr=0.5)
    quant = dict(bits=4, theta=0.2, gamma=0.5)
    d2 = _run(algorithm="moniqua-d2", **noniid, **quant)
    dpsgd = _run(algorithm="dpsgd", **noniid)
    moniqua = _run(algorithm="moniqua", **noniid, **quant)
    assert d2["final_test_accuracy"] >= 0.85 and d2["final_local_test_accuracy"] >= 0.85
    for other in (dpsgd, moniqua):
        assert other["final_local_test_accuracy"] <= d2["final_local_test_accuracy"] - 0.05
        assert other["final_train_loss"] >= 2 * d2["final_train_loss"]


def test_one_bit_moniqua_with_the_slack_matrix_is_within_3_points_of_dpsgd():
    dpsgd = _run(algorithm="dpsgd")
    one_bit = _run(algorithm="moniqua", bits=1)  # the slack matrix's default gamma at 1 bit
    assert one_bit["nominal_bits_per_element"] == 1
    assert one_bit["final_test_accuracy"] >= dpsgd["final_test_accuracy"] - 0.03


def test_ndqsg_sends_fewer_bits_than_dqsg_at_the_same_accuracy():
    """Figure 6 of paper 002: DQSG M = 2 against NDQSG Delta1 = 1/3, Delta2 = 3 Delta1 = 1."""
    common = dict(hidden=300, steps=300)
    dqsg = _run(algorithm="dqsg", levels=2, **common)
    ndqsg = _run(algorithm="ndqsg", levels=2, nested_delta1=1 / 3, nested_k=3, nested_fraction=0.5, **common)
    assert ndqsg["nominal_bits_per_element"] < dqsg["nominal_bits_per_element"]
    assert ndqsg["wire_bits_per_element"] < dqsg["wire_bits_per_element"]
    assert ndqsg["final_test_accuracy"] >= dqsg["final_test_accuracy"] - 0.01


def test_ndqsg_defaults_send_fewer_bytes_than_dqsg_defaults_within_a_point():
    """Paper 002 after Theorem 6, at lowbit's defaults (digits, 8 workers, 300 steps): NDQSG with
    no option against DQSG with none, mean accuracy over 3 seeds (docs/RESULTS.md)."""
    dqsg = [_run(algorithm="dqsg", seed=s) for s in range(3)]
    ndqsg = [_run(algorithm="ndqsg", seed=s) for s in range(3)]
    for d, n in zip(dqsg, ndqsg):
        # 0.816 measured: P2's 1-bit nested codes against the 1.6-bit (mixed radix) ternary codes of
        # DQSG M = 1 that P1 still sends (0.75 when ternary codes took 2 bits)
        assert n["bytes_sent"] < 0.85 * d["bytes_sent"]
    mean = lambda runs: sum(r["final_test_accuracy"] for r in runs) / len(runs)  # noqa: E731
    assert mean(ndqsg) >= mean(dqsg) - 0.01


def test_two_scale_trains_at_least_as_well_as_single_scale_at_2_bits():
    """Section 5.3 of paper 004, at its cosine-annealed step size, averaged over 3 seeds
    (with a constant step size both reach AllReduce's accuracy here and this task cannot
    separate them: docs/RESULTS.md)."""
    common = dict(hidden=300, steps=300, lr_schedule="cosine")
    single = [_run(algorithm="maxnorm", bits=2, seed=s, **common) for s in range(3)]
    two = [_run(algorithm="maxnorm-multiscale", scales="2,6", seed=s, **common) for s in range(3)]
    # both at the paper's precision 2: one scale's 7 levels at log2 (sign included), two scales' r = 4
    assert all(r["nominal_bits_per_element"] == pytest.approx(level_bits(7)) for r in single)
    assert all(r["nominal_bits_per_element"] == 4 for r in two)
    mean = lambda runs: sum(r["final_test_accuracy"] for r in runs) / len(runs)  # noqa: E731
    assert mean(two) >= mean(single)
