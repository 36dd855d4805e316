"""Models in plain torch for the image tasks.

- :func:`fc300_100`: 784-300-100-10 MLP with ReLU (266,610 parameters).
- :class:`LeNet5`: conv5x5(6, pad 2) - maxpool - conv5x5(16) - maxpool - 120 - 84 - 10,
  ReLU (61,706 parameters on 1x28x28 inputs).
- :class:`ResNetCifar`: the CIFAR ResNet-(6n+2) of He et al. (three stages of
  n basic blocks with 16/32/64 channels, BatchNorm, parameter-free
  "option A" shortcuts: stride-2 subsampling plus zero channels).
  ``resnet(20)`` has 269,722 parameters, ``resnet(110)`` 1,727,962.
- :class:`SmallVGG`: 3x3 conv + BatchNorm + ReLU stacks with max pooling,
  global average pooling and one linear layer.
- :class:`LeNetTF` (``lenet_tf``): the "LeNet" of the NDQSG paper (002), the
  TensorFlow MNIST tutorial net: conv5x5(32, 'same') - maxpool2 - conv5x5(64,
  'same') - maxpool2 - 512 - 10, ReLU (1,663,370 parameters on 1x28x28 inputs).
- :class:`CifarNet` (``cifarnet``): the TensorFlow cifar10 tutorial net:
  conv5x5(64) - maxpool3/2 - LRN - conv5x5(64) - LRN - maxpool3/2 - 384 - 192 - 10,
  ReLU, on the tutorial's 24x24 crops of the 32x32x3 images (1,068,298 parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars of ``model`` (the d of a flat parameter vector)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def fc300_100(in_features: int = 784, classes: int = 10) -> nn.Module:
    """The fully connected 300-100 net (LeCun et al. 1998) used by the max-norm and
    NDQSG papers: ``in_features`` inputs (784 for a flattened 28x28 image), ReLU
    hidden layers of 300 and 100 units, ``classes`` outputs."""
    if in_features < 1 or classes < 2:
        raise ValueError(f"in_features must be >= 1 and classes >= 2, got {in_features}, {classes}")
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, 300), nn.ReLU(), nn.Linear(300, 100), nn.ReLU(),
                         nn.Linear(100, classes))


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998): two 5x5 convolutions (6 and 16 channels) with
    2x2 max-pools, then fully connected 120, 84 and ``classes``. ``in_channels``:
    image channels; ``size``: image side (>= 8; 28 is padded to the classic 32)."""

    def __init__(self, in_channels: int = 1, classes: int = 10, size: int = 28):
        super().__init__()
        if size < 8:
            raise ValueError(f"size must be >= 8, got {size}")
        pad = 2 if size == 28 else 0  # 28x28 padded to the classic 32x32
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=pad)
        self.conv2 = nn.Conv2d(6, 16, 5)
        s = ((size + 2 * pad - 4) // 2 - 4) // 2
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * s * s, 120), nn.Linear(120, 84), nn.Linear(84, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.extra = stride, cout - cin

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.extra:
            short = F.pad(short, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))
        return F.relu(out + short)


class ResNetCifar(nn.Module):
    """The CIFAR ResNet of He et al. 2016 (section 4.2): ``depth`` = 6n + 2 layers in
    three stages of n basic blocks (16, 32, 64 channels), identity shortcuts padded
    with zero channels (option A), global average pooling and a ``classes``-way
    linear layer. ``in_channels``: image channels."""

    def __init__(self, depth: int = 20, classes: int = 10, in_channels: int = 3):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"depth must be 6n+2 with n >= 1 (8, 14, 20, 32, 44, 56, 110, ...), got {depth}")
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                blocks.append(_Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(x.mean((2, 3)))


def resnet(depth: int = 20, classes: int = 10) -> ResNetCifar:
    """:class:`ResNetCifar` of ``depth`` layers (20, 32, 44, 56, 110, ...) for 3-channel images."""
    return ResNetCifar(depth, classes)


class SmallVGG(nn.Module):
    """Default layout (32, M, 64, M, 128, 128, M, 256, M): 4 pools take 32x32 to 2x2."""

    def __init__(self, layout=(32, "M", 64, "M", 128, 128, "M", 256, "M"), classes: int = 10, in_channels: int = 3):
        super().__init__()
        layers, cin = [], in_channels
        for v in layout:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            elif isinstance(v, int) and v >= 1:
                layers += [nn.Conv2d(cin, v, 3, padding=1, bias=False), nn.BatchNorm2d(v), nn.ReLU()]
                cin = v
            else:
                raise ValueError(f"layout entries must be positive channel counts or 'M', got {v!r}")
        if cin == in_channels:
            raise ValueError("layout must contain at least one convolution")
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


class LeNetTF(nn.Module):
    """Paper 002's "LeNet": two 5x5 'same' convolutions (32 and 64 channels), each
    followed by ReLU and a 2x2 max-pool, then fully connected 512 and ``classes``.
    ``size`` must be a multiple of 4 (28 gives 7x7x64 = 3136 features)."""

    def __init__(self, in_channels: int = 1, classes: int = 10, size: int = 28):
        super().__init__()
        if size < 4 or size % 4:
            raise ValueError(f"size must be a positive multiple of 4, got {size}")
        if in_channels < 1 or classes < 2:
            raise ValueError(f"in_channels must be >= 1 and classes >= 2, got {in_channels}, {classes}")
        self.conv1 = nn.Conv2d(in_channels, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * (size // 4) ** 2, 512)
        self.fc2 = nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def lenet_tf(in_channels: int = 1, classes: int = 10, size: int = 28) -> LeNetTF:
    """:class:`LeNetTF` (1,663,370 parameters on 28x28 grey images, 10 classes)."""
    return LeNetTF(in_channels, classes, size)


def _maxpool_same(x: torch.Tensor) -> torch.Tensor:
    """3x3 max-pool with stride 2 and TensorFlow's 'SAME' padding: output ceil(h/2) x ceil(w/2),
    the padding (of -inf, so never selected) split with the extra cell at the bottom/right."""
    h, w = x.shape[-2:]
    ph, pw = max((-(-h // 2) - 1) * 2 + 3 - h, 0), max((-(-w // 2) - 1) * 2 + 3 - w, 0)
    x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=float("-inf"))
    return F.max_pool2d(x, 3, 2)


class CifarNet(nn.Module):
    """The TensorFlow cifar10 tutorial net. Inputs larger than ``crop`` (the 32x32
    CIFAR images) are cut to their central ``crop`` x ``crop`` window, the
    tutorial's evaluation input (it trains on random crops of the same size; here
    the crop is always central, no augmentation). Local response normalisation as
    ``tf.nn.lrn(depth_radius=4, bias=1, alpha=0.001/9, beta=0.75)``: a window of 9
    channels, which is torch's ``LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1)``
    (torch divides alpha by the window size)."""

    def __init__(self, in_channels: int = 3, classes: int = 10, crop: int = 24):
        super().__init__()
        if crop < 1:
            raise ValueError(f"crop must be >= 1, got {crop}")
        if in_channels < 1 or classes < 2:
            raise ValueError(f"in_channels must be >= 1 and classes >= 2, got {in_channels}, {classes}")
        self.crop = crop
        self.conv1 = nn.Conv2d(in_channels, 64, 5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.lrn = nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0)
        s = -(-(-(-crop // 2)) // 2)  # two 'SAME' stride-2 pools: ceil(ceil(crop/2)/2)
        self.fc1 = nn.Linear(64 * s * s, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, classes)

    def forward(self, x):
        h, w = x.shape[-2:]
        if h < self.crop or w < self.crop:
            raise ValueError(f"inputs must be at least {self.crop}x{self.crop}, got {h}x{w}")
        top, left = (h - self.crop) // 2, (w - self.crop) // 2
        x = x[..., top:top + self.crop, left:left + self.crop]
        x = self.lrn(_maxpool_same(F.relu(self.conv1(x))))
        x = _maxpool_same(self.lrn(F.relu(self.conv2(x))))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


def cifarnet(in_channels: int = 3, classes: int = 10, crop: int = 24) -> CifarNet:
    """:class:`CifarNet` (1,068,298 parameters on 24x24 crops of CIFAR-10)."""
    return CifarNet(in_channels, classes, crop)
