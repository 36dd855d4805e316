"""Models for ``lowbit plan``, in plain torch, with synthetic inputs: ResNet-50, VGG-16 and a
transformer the size of GPT-2 small.

Every entry of :data:`PLAN_MODELS` follows the contract of ``lowbit plan --model
module:function``: called as ``fn(batch_size=B)`` it returns ``(model, batch, loss_fn)``, where
``model`` is an ``nn.Module``, ``batch`` a tensor or a tuple/list/dict of tensors (one
worker's minibatch) and ``loss_fn(model, batch)`` the scalar training loss.

- ``resnet50``: ResNet-50 for 32x32 CIFAR-10 images (3x3 stem, no max-pool, bottlenecks
  [3, 4, 6, 3], 10 classes): 23,520,842 parameters, the count paper 004 states.
- ``resnet50-imagenet``: ResNet-50 for 224x224 ImageNet images (7x7 stem, max-pool,
  1000 classes): 25,557,032 parameters.
- ``vgg16``: VGG-16 with BatchNorm for CIFAR-10 (13 3x3 convolutions, one 512 -> 10
  classifier): 14,728,266 parameters, the count paper 004 states.
- ``gpt2-small``: a GPT-2 small decoder (12 layers, width 768, 12 heads, 50,257-token
  vocabulary, 1,024 positions, input and output embeddings tied): 124,439,808 parameters,
  trained on next-token prediction of random tokens, ``seq_len`` tokens per sequence.

The inputs are random (a fixed seed): what ``plan`` measures is time, which does not depend on
the values of images or tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PLAN_MODELS", "resnet50", "resnet50_imagenet", "vgg16", "gpt2_small", "ResNet50", "VGG16", "GPT2"]


def _check_batch(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016, bottleneck blocks [3, 4, 6, 3]). ``imagenet=False``: the
    CIFAR form (3x3 stem, no max-pool); ``imagenet=True``: the 7x7 stride-2 stem and max-pool."""

    def __init__(self, classes: int = 10, imagenet: bool = False):
        super().__init__()
        if imagenet:
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(inplace=True))
        layers, cin = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for b in range(blocks):
                layers.append(_Bottleneck(cin, planes, stride if b == 0 else 1))
                cin = planes * _Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """VGG-16 with BatchNorm for 32x32 images (Simonyan & Zisserman 2015, configuration D),
    one linear classifier on the 512 features."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers, cin = [], 3
        for v in _VGG16:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """A GPT-2 decoder (Radford et al. 2019): token and position embeddings, pre-norm blocks
    of causal self-attention and a 4x MLP, a final LayerNorm, the output projection tied to
    the token embedding. Defaults: GPT-2 small."""

    def __init__(self, vocab: int = 50257, positions: int = 1024, width: int = 768, layers: int = 12,
                 heads: int = 12):
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}")
        self.positions = positions
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        t = tokens.shape[1]
        if t > self.positions:
            raise ValueError(f"sequence length {t} exceeds the model's {self.positions} positions")
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def _classification_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _next_token_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _images(batch_size: int, size: int, classes: int):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, size, size, generator=g),
            torch.randint(classes, (batch_size,), generator=g))


def resnet50(batch_size: int = 128):
    """ResNet-50 for CIFAR-10 and a batch of random 32x32 images: ``(model, batch, loss_fn)``."""
    return ResNet50(10), _images(_check_batch(batch_size), 32, 10), _classification_loss


def resnet50_imagenet(batch_size: int = 32):
    """ResNet-50 for ImageNet and a batch of random 224x224 images: ``(model, batch, loss_fn)``."""
    return ResNet50(1000, imagenet=True), _images(_check_batch(batch_size), 224, 1000), _classification_loss


def vgg16(batch_size: int = 128):
    """VGG-16 (BatchNorm) for CIFAR-10 and a batch of random 32x32 images: ``(model, batch, loss_fn)``."""
    return VGG16(10), _images(_check_batch(batch_size), 32, 10), _classification_loss


def gpt2_small(batch_size: int = 8, seq_len: int = 1024):
    """GPT-2 small and a batch of ``batch_size`` random sequences of ``seq_len`` tokens (at most
    1024): ``(model, batch, loss_fn)``, the loss next-token cross-entropy."""
    _check_batch(batch_size)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 2 <= seq_len <= 1025:
        raise ValueError(f"seq_len must be an int in [2, 1025] (1024 positions, one token predicted), got {seq_len!r}")
    model = GPT2()
    tokens = torch.randint(50257, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return model, tokens, _next_token_loss


#: ``lowbit plan --task`` names of these models -> (function, default batch size, what it is)
PLAN_MODELS = {
    "resnet50": (resnet50, 128, "ResNet-50, CIFAR-10 form (32x32 images, 10 classes), 23.5M parameters"),
    "resnet50-imagenet": (resnet50_imagenet, 32, "ResNet-50, ImageNet form (224x224 images), 25.6M parameters"),
    "vgg16": (vgg16, 128, "VGG-16 with BatchNorm, CIFAR-10 form, 14.7M parameters"),
    "gpt2-small": (gpt2_small, 8, "GPT-2 small decoder (1024-token sequences by default), 124M parameters"),
}


def count(model: nn.Module) -> int:
    """The number of parameters of ``model`` (tied parameters once)."""
    return sum(p.numel() for p in model.parameters())

