"""Bagua's low precision decentralized SGD (``LowPrecisionDecentralizedAlgorithm``;
source document ``seeds/001``), per worker i at step t::

    1: g_t = grad F_i(x_t)                                                (the loop)
    2: x_{t+1/2} = sum_j W_ij xh_t^(j) - gamma g_t   (xh^(i) = x_t; the text's
                   ``x_{t+1}`` inside the sum is a known slip for the replicas xh^(j))
    3: z_t = x_{t+1/2} - x_t,  Q(z_t)      (min-max quantizer, 8 bits by default)
    4: x_{t+1} = x_t + Q(z_t)
    5: send Q(z_t) to the peers; xh_{t+1}^(j) = xh_t^(j) + Q(z_t^(j))

which is DCD-PSGD (Tang et al. 2018, Algorithm 1) with Bagua's quantizer; the
code is :class:`~lowbit.algorithms.dcd.DCDPSGD`'s. Bagua's own kernel does the
same on a ring with W_ij = 1/3 (left, self, right): ``t += (left + right) / 3
- 5/3 weight`` turns the optimizer's ``x_t - gamma g`` into z_t.

Q: ``MinMaxCodec(bits, rounding)``: [min, max] split into 2^bits - 1 equal
intervals; ``rounding="nearest"`` is Bagua's deterministic rounding,
``"stochastic"`` the unbiased variant (randomness from
``shared_generator(seed, k, rank)``).

Peer selection (Bagua's ``peer_selection_mode``):

* ``"all"``: every topology neighbour, weights W of the topology (on a ring
  with uniform weights: Bagua's left/self/right 1/3). Extra memory: one
  replica per neighbour, degree x d.
* ``"shift_one"``: n must be even. At step k worker r exchanges with exactly
  one peer, Bagua's pairing of the lower half {0..n/2-1} with the upper half::

      r <  n/2:  peer = n/2 + (k + r) mod (n/2)
      r >= n/2:  peer = (r - n/2 - k) mod (n/2)

  (a perfect matching at every k; each lower rank meets every upper rank once
  every n/2 steps), and mixes with W_k: 1/2 self, 1/2 peer, as Bagua's
  shift_one averaging does. Bagua implements shift_one only at full
  precision; with quantized differences a replica of a peer can be exact
  only if the peer's difference is taken against what *this* worker last
  received. So in shift_one worker i keeps, for each of the n/2 workers it
  can be paired with, the replica xh^(j) (j's model as i knows it) and the
  mirror m^(j) (i's model as j knows it), and at the end of step k, with
  p = peer(k + 1), the peer of the next mix::

      z = x_{t+1/2} - m^(p);  x_{t+1} = m^(p) + Q(z);  m^(p) = x_{t+1};  send Q(z) to p
      xh^(p) <- xh^(p) + Q(z^(p))

  so that at step k + 1 the mix (x + xh^(p)) / 2 uses p's exact model. With
  "all" on a fixed neighbour set every m^(j) is x_t and this is step 3-5
  above. Extra memory: 2 x n/2 x d = n x d.

Replicas start from x_0 sent once, uncompressed, in :meth:`setup` (counted at step 0),
instead of Bagua's assumption that all workers start equal.
"""

from __future__ import annotations

import torch

from ..codecs import Codec, MinMaxCodec
from ..codecs.quantize import check_rounding
from .dcd import DCDPSGD, exchange_compressed, exchange_initial_models

PEER_SELECTIONS = ("all", "shift_one")


def shift_one_peer(rank: int, n: int, step: int) -> int:
    """Bagua's shift_one peer of ``rank`` at communication step ``step`` (n even)."""
    if n < 2 or n % 2:
        raise ValueError(f"peer_selection='shift_one' needs an even number of workers >= 2, got {n}")
    h = n // 2
    if rank < h:
        return h + (step + rank) % h
    return (rank - h - step) % h


class LowPrecisionDecentralized(DCDPSGD):
    name = "lowprec-decentralized"
    codecs = ("minmax", "fp32")

    @classmethod
    def check_config(cls, cfg):
        if cfg.peer_selection not in PEER_SELECTIONS:
            raise ValueError(f"peer_selection must be one of {PEER_SELECTIONS}, got {cfg.peer_selection!r}")
        if cfg.peer_selection == "shift_one":
            shift_one_peer(0, cfg.workers, 0)  # n even

    @classmethod
    def from_config(cls, cfg, transport, topology):
        codec = cfg.make_codec(cls.codecs)
        return cls(transport, topology, bits=cfg.bits, rounding=cfg.rounding or "nearest", codec=codec,
                   peer_selection=cfg.peer_selection, weights=cfg.weights, seed=cfg.seed)

    def __init__(self, transport, topology, *, bits: int = 8, rounding: str = "nearest",
                 peer_selection: str = "all", codec: Codec | None = None, weights: str = "uniform",
                 seed: int = 0):
        if peer_selection not in PEER_SELECTIONS:
            raise ValueError(f"peer_selection must be one of {PEER_SELECTIONS}, got {peer_selection!r}")
        check_rounding(rounding)
        base = MinMaxCodec(bits=bits, rounding=rounding)  # validates bits (1..8)
        super().__init__(transport, topology, codec=codec if codec is not None else base,
                         weights=weights, seed=seed)
        self.bits = bits
        self.rounding = rounding
        self.peer_selection = peer_selection
        if peer_selection == "shift_one":
            n = self.world_size
            shift_one_peer(self.rank, n, 0)  # n even
            h = n // 2
            self.partners = tuple(range(h, n)) if self.rank < h else tuple(range(h))
            self.mirrors: dict[int, torch.Tensor] = {}

    def peer(self, k: int) -> int:
        return shift_one_peer(self.rank, self.world_size, k)

    def state_tensors(self):
        out = super().state_tensors()
        if self.peer_selection == "shift_one":
            out.update({f"mirror_{j}": m for j, m in sorted(self.mirrors.items())})
        return out

    def setup(self, x):
        if self.peer_selection == "all":
            return super().setup(x)
        self.replicas = exchange_initial_models(self, x, self.partners)
        self.mirrors = {j: x.detach().clone() for j in self.partners}

    def before_update(self, k, x, g, lr):
        if self.peer_selection == "all":
            return super().before_update(k, x, g, lr)
        x.mul_(0.5).add_(self.replicas[self.peer(k)], alpha=0.5)       # step 2 with W_k

    def after_update(self, k, x, g, lr):
        if self.peer_selection == "all":
            return super().after_update(k, x, g, lr)
        p = self.peer(k + 1)
        m = self.mirrors[p]
        q, received = exchange_compressed(self, self.codec, k, x - m, (p,))  # step 3
        x.copy_(m + q)                                                       # step 4
        m.copy_(x)
        self.replicas[p].add_(received[p])                                   # step 5
