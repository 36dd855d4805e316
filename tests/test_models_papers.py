"""The NDQSG paper's (002) models: exact parameter counts and forward shapes."""

import pytest
import torch

from lowbit.models import CifarNet, LeNetTF, _maxpool_same, cifarnet, count_parameters, lenet_tf


def test_lenet_tf_matches_paper_002():
    m = lenet_tf()
    # 32 bits x 1,663,370 = the paper's 53,227.8 Kbits baseline
    assert count_parameters(m) == 1_663_370
    assert [tuple(p.shape) for p in m.parameters()] == [
        (32, 1, 5, 5), (32,), (64, 32, 5, 5), (64,), (512, 3136), (512,), (10, 512), (10,)]
    assert m(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_cifarnet_matches_tf_tutorial():
    m = cifarnet()
    assert count_parameters(m) == 1_068_298  # the paper's 34,185.5 Kbits / 32
    assert [tuple(p.shape) for p in m.parameters()] == [
        (64, 3, 5, 5), (64,), (64, 64, 5, 5), (64,), (384, 2304), (384,), (192, 384), (192,), (10, 192), (10,)]
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_cifarnet_uses_the_central_crop():
    torch.manual_seed(0)
    m = cifarnet().eval()
    x = torch.randn(2, 3, 32, 32)
    y = torch.randn(2, 3, 32, 32)
    y[..., 4:28, 4:28] = x[..., 4:28, 4:28]  # same centre, different border
    with torch.no_grad():
        assert torch.equal(m(x), m(y))
        assert torch.equal(m(x), m(x[..., 4:28, 4:28]))
    with pytest.raises(ValueError, match="at least 24x24"):
        m(torch.randn(1, 3, 20, 20))


def test_maxpool_same_is_tensorflows():
    # TF 'SAME', k=3, s=2 on 4 cells: windows [0,3) and [2,4)+pad; the pad is at the end only
    x = torch.tensor([[[[9.0, 5.0, 2.0, 3.0]]]]).expand(1, 1, 4, 4).clone()
    x[..., 0, :] = -100.0  # row 0 is only in the first row window
    out = _maxpool_same(x)
    assert out.shape == (1, 1, 2, 2)
    assert out[0, 0, 1].tolist() == [9.0, 3.0]  # window cols 2..3 (torch padding=1: cols 1..3, max 5)
    assert _maxpool_same(torch.randn(1, 1, 5, 7)).shape == (1, 1, 3, 4)


@pytest.mark.parametrize("bad", [{"size": 30}, {"size": 0}, {"classes": 1}])
def test_lenet_tf_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        LeNetTF(**bad)


def test_cifarnet_rejects_bad_crop():
    with pytest.raises(ValueError, match="crop"):
        CifarNet(crop=0)


def test_paper_tasks_train_on_synthetic_data(tmp_path):
    from test_data import _write_cifar, _write_mnist

    from lowbit.train import TrainConfig, train
    from lowbit.train.tasks import TASKS

    folder = _write_mnist(str(tmp_path / "m"), n_train=64, n_test=16)
    for name in ("fashion-lenet-tf", "mnist-lenet-tf", "kmnist-lenet-tf"):
        assert count_parameters(TASKS[name](data_dir=folder).make_model()) == 1_663_370
    _write_cifar(str(tmp_path / "c"), n=8, batches=1)
    assert count_parameters(TASKS["cifar10-cifarnet"](data_dir=str(tmp_path / "c")).make_model()) == 1_068_298
    cfg = TrainConfig(task="mnist-lenet-tf", data_dir=folder, workers=2, steps=2, algorithm="dpsgd", eval_every=2)
    assert cfg.lr > 0 and cfg.batch_size >= 1
    assert train(cfg) is not None
