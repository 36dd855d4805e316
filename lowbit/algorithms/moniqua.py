"""Moniqua on D-PSGD: Algorithm 1 of Lu & De Sa, "Moniqua: Modulo Quantized
Communication in Decentralized SGD" (ICML 2020), with the slack matrix of
Theorem 3, theta from Theorem 2, verification and entropy coding (section 6).

Per worker i at step k (line numbers of Algorithm 1)::

    3: q_{k,i}  = Q_delta((x_{k,i} / B_theta) mod 1)                   (sent)
    4: xh_{k,i} = (q_{k,i} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (local biased term)
    5: xh_{k,j} = (q_{k,j} B_theta - x_{k,i}) mod B_theta + x_{k,i}   (neighbour j, decoded against x_{k,i})
    6: x_{k+1/2,i} = x_{k,i} + gamma sum_j (xh_{k,j} - xh_{k,i}) W_ji
    7: x_{k+1,i} = x_{k+1/2,i} - alpha_k g_{k,i}                        (the optimizer step)

with B_theta = 2 theta / (1 - 2 delta) (Lemma 2). Decoding is exact to
delta * B_theta as long as |x_{k,j} - x_{k,i}| < theta element-wise.

**Slack matrix** (Theorem 3): line 6 with ``gamma`` mixes with
``W~ = gamma W + (1 - gamma) I``. gamma = 1 is Algorithm 1; at 1 bit
gamma defaults to :data:`GAMMA_1BIT` = 0.1, measured on digits-mlp (8
workers, ring, 300 steps: gamma 0.05 / 0.1 / 0.2 / 0.3 gave 97.5 / 97.8 /
97.8 / 98.1 % against fp32 D-PSGD's 98.6 %, gamma = 1 diverges); the paper's
5e-3 (CIFAR-10, many epochs) mixes too slowly for a few hundred steps.
At 1 bit only nearest rounding has delta < 1/2 (delta = 1/4, B_theta =
4 theta). Plain nearest rounding is deterministic: models within one grid
cell (2 theta wide) all send the same code and line 6 moves nothing. So the
1-bit default (``rounding=None``, ``shared_randomness=True``) rounds to
nearest after adding a shared subtractive dither v ~ U(-s/2, s/2)^d (s =
B_theta / 2^bits, drawn from the step's shared generator) and subtracts v
after decoding: the error is still <= s / 2 = delta B_theta (Lemma 2 holds
for x + v against y + v), but differences of nearby models are now
unbiased. ``dither=False`` or ``rounding="nearest"`` gives plain nearest.

**Shared randomness** (``shared_randomness``, the default; section 6, "More
efficient Moniqua"): all workers use the same stochastic-rounding offsets u
at step k, so nearby models round alike and their errors cancel in line 6.

**theta.** By hand (a float), optionally following the step size
(``theta_schedule="lr"``: theta_k = theta alpha_k / alpha_0, as Theorem 2's
theta_k is proportional to alpha_k), or ``theta="auto"`` (section 6, "Choosing
theta empirically"): for the first ``theta_warmup`` steps the workers gossip
exactly (fp32 on the wire, counted) and track G_inf, the largest
``||x_{k+1/2} - x_{k+1}||_inf / alpha_k`` they see -- the infinity norm of
the local step direction, which is the stochastic gradient of assumption A5
for plain SGD and also covers momentum and weight decay otherwise. After the
warm-up one all-reduce MAX (8 bytes, counted) makes every worker use the same
G_inf, and Theorem 2 gives

    theta = 2 alpha_0 G_inf C_alpha log(16 n) / (1 - eta rho)

with C_alpha = eta = 1 (the constants of a constant step size: alpha_k /
alpha_{k+t} <= 1), the natural log, alpha_0 the first step size of the run
and rho = rho(W~) (:func:`lowbit.topology.spectral_rho` of the slack matrix
actually used). For gamma < 1 this is Theorem 3's
``2 alpha G_inf log(16 n) / (gamma (1 - rho(W)))`` whenever lambda_2 sets
rho, as it does on rings. See :func:`theorem2_theta`.

**Verification** (``verify``, section 6), per block: the flat vector of d
elements is split into nb = ceil(d / ``verify_block``) blocks of
``verify_block`` consecutive elements (default :data:`VERIFY_BLOCK` = 64,
see below; the last block may be shorter). The message is::

    codes | [requests] | nb x uint16 block hashes | control byte

all little-endian. A block's hash is CRC-32 (masked to its low 16 bits) of
the un-modded grid integers ``m = round(xh / (B_theta / 2^bits))`` (int64)
of the sender's own decode (line 4; it equals the quantized value before the
mod) in that block. The control byte holds 2 alarm bits (bits 0-1) and the
repair-request bit (bit 2). ``requests`` is present only when bit 2 is set:
one entry per neighbour asked, ``uint16`` rank then a bit mask of the blocks
asked (ceil(nb / 8) bytes, bit b of byte b // 8 is block b), then a
``uint16`` count of entries. The codec's 4-byte length header is not sent
(every worker knows d), so verification costs 2 nb + 1 bytes over the codes
(303 bytes per message at d = 9610 and 64-element blocks, 21 at 1024).
The receiver hashes each block of the grid
integers of what it recovered (line 5); a block's hashes agree exactly when
its recovery is right, and a wrong block goes undetected with probability
~2^-16 (CRC-32's low 16 bits of a changed block). Policy on a mismatch
(theta too small for that edge at that step in that block):

* a wrong block's values are never used: that neighbour's term of line 6 is
  left out for the coordinates of that block only, the neighbour's other
  blocks mix normally. :attr:`Moniqua.mismatches` counts wrong *blocks*
  (:attr:`Moniqua.mismatched_messages` the messages with at least one; both
  in ``extra_state``); a warning is issued once per process;
* repair of only the failed blocks: in its next message the receiver lists
  (neighbour, failed blocks). After that step's regular exchange both ends
  of an edge know the union R of the blocks either of them asked of the
  other, and line 6 uses ``x_j - x_i`` (fp32) on R's coordinates of that edge
  (instead of the modulo term, right or not). The fp32 values travel in one
  extra neighbour exchange among the edges with a non-empty R only (counted):
  each worker sends, to each of those neighbours, one buffer: a block mask
  (ceil(nb / 8) bytes) of the union U of its R's over its edges, then the
  fp32 values of U's coordinates (a neighbour whose R is smaller than U
  ignores the rest). Bytes per repair message: ceil(nb / 8) + 4 |U's
  elements|, instead of a whole fp32 model. No collective and no extra round
  on the common path (steps with no pending request), and all workers stay
  in lock step (the request sets are symmetric knowledge of both ends).
* ``grow_theta=True`` (off by default) also grows theta: a worker none of
  whose neighbours' messages was entirely right in a step (every neighbour
  had at least one wrong block; the whole-vector rule on top of blocks)
  raises an alarm; steps are grouped in
  epochs of P = diameter + 1; an alarm of epoch m is flooded over the 2 alarm
  bits (bit m mod 2) of every later message, reaches every worker within
  diameter steps, and all workers double theta at the start of step
  (m + 2) P, in lock step. Off by default because doubling feeds back: on
  digits-mlp the spread of the models is dominated by quantization noise,
  which is proportional to theta, so the mismatch rate does not fall as
  theta grows and theta ran away (0.05 -> 1e5 in 300 steps).

**Block size.** Smaller blocks repair fewer fp32 values but send more hashes
(2 bytes per block on every message, mismatch or not). On digits-mlp (d =
9610, 8 workers, ring, theta 0.05, 300 steps; ``--no-verify`` sends 38.5K
bytes/step at 2 bits, 19.2K at 1 bit) bytes/step with verification were

    verify_block   9610 (one block)  4096   1024   256    128    64     32
    2 bits         208K              197K   173K   108K   81.7K  65.4K  60.6K
    1 bit          498K              437K   304K   150K   106K   78.0K  66.0K

at the same test accuracy (98.3-98.6 % at 2 bits, 97.5 % at 1 bit). Wrong
coordinates are isolated (halving the block from 64 to 32 adds 2-20 % more
wrong blocks), so repairs shrink with the block until the hashes dominate; 64
is the default (a 12.6 % / 25 % tax on the 2-bit / 1-bit codes when nothing
fails). More hashed blocks also mean more chances of a collision: the 1-bit
run at 64 had 24.7K wrong blocks, ~0.4 expected to pass the 16-bit hash.

Pending requests (neighbour -> blocks) are part of ``extra_state``
(``nack``, with the ``verify_block`` they refer to; a checkpoint with another
block size is re-blocked to the blocks covering the same elements, and a
whole-vector one, a list of ranks, asks for every block).

The exact-gossip warm-up of ``theta="auto"`` sends no hashes. With
``verify=False`` the message is the codes alone and nothing is checked.

**Entropy coding** (``entropy``: zlib, bz2, lzma or ans; section 6): the
packed codes are entropy-coded on the wire (:func:`lowbit.codecs.entropy.entropy_code`;
``ans`` models ``bits``-wide symbols); the requests, hashes and control byte follow the coded blob.

Moniqua keeps no state tensors between steps: its extra memory is 0 (Table
1 of the paper); theta, the alarm state, the mismatch counts and the pending
repair requests (block lists) are in :meth:`Moniqua.extra_state`.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from collections import deque

import torch

from ..codecs import IdentityCodec, ModuloCodec
from ..codecs.base import Payload, pack_header
from ..codecs.entropy import ENTROPY_METHODS, entropy_code, entropy_decode
from ..codecs.packing import packed_nbytes
from ..codecs.rng import shared_generator
from ..topology import Topology, slack_matrix, spectral_rho
from .base import GossipAlgorithm

THETA_SCHEDULES = ("constant", "lr")
# gamma of the slack matrix at 1 bit when none is given: measured on digits-mlp,
# 8 workers, ring, 300 steps (see the module docstring).
GAMMA_1BIT = 0.1
# elements per verified block when none is given: measured on digits-mlp (see the module docstring)
VERIFY_BLOCK = 64
_FP32 = IdentityCodec()
_WARNED = False


def _pack_mask(blocks, nb: int) -> bytes:
    """Bit mask (ceil(nb / 8) bytes, little-endian bit order) of block indices in [0, nb)."""
    out = bytearray(-(-nb // 8))
    for b in blocks:
        out[b >> 3] |= 1 << (b & 7)
    return bytes(out)


def _unpack_mask(raw: bytes, nb: int) -> set[int]:
    return {b for b in range(nb) if raw[b >> 3] >> (b & 7) & 1}


def topology_diameter(topology: Topology) -> int:
    """Largest hop distance between two connected workers (0 for one worker)."""
    best = 0
    for s in range(topology.n):
        dist = {s: 0}
        todo = deque([s])
        while todo:
            u = todo.popleft()
            for v in topology.neighbors(u):
                if v not in dist:
                    dist[v] = dist[u] + 1
                    todo.append(v)
        best = max(best, max(dist.values()))
    return best


def theorem2_theta(lr: float, g_inf: float, rho: float, n: int, c_alpha: float = 1.0, eta: float = 1.0) -> float:
    """Theorem 2's a priori bound ``2 alpha G_inf C_alpha log(16 n) / (1 - eta rho)`` (natural log)."""
    if not 0 <= eta * rho < 1:
        raise ValueError(f"eta * rho must be in [0, 1) (a connected topology), got eta={eta}, rho={rho}")
    return 2.0 * lr * g_inf * c_alpha * math.log(16 * n) / (1.0 - eta * rho)


def default_rounding(bits: int) -> str:
    """Stochastic rounding (the paper's experiments), except at 1 bit where only
    nearest rounding has delta < 1/2."""
    return "nearest" if bits == 1 else "stochastic"


class Moniqua(GossipAlgorithm):
    name = "moniqua"

    @classmethod
    def check_config(cls, cfg):
        ModuloCodec(bits=cfg.bits, theta=1.0 if cfg.theta in (None, "auto") else cfg.theta,
                    rounding=cfg.rounding or default_rounding(cfg.bits))
        _check_entropy(cfg.entropy)

    @classmethod
    def from_config(cls, cfg, transport, topology):
        return cls(transport, topology, bits=cfg.bits, theta=0.5 if cfg.theta is None else cfg.theta,
                   rounding=cfg.rounding, theta_schedule=cfg.theta_schedule, theta_warmup=cfg.theta_warmup,
                   shared_randomness=cfg.shared_randomness, gamma=cfg.gamma, verify=cfg.verify,
                   entropy=cfg.entropy, weights=cfg.weights, seed=cfg.seed,
                   verify_block=cfg.verify_block)

    def nominal_bits_per_element(self):
        return float(self.codec.bits)

    def __init__(self, transport, topology, *, bits: int = 2, theta: float | str = 0.5,
                 rounding: str | None = None, theta_schedule: str = "constant", theta_warmup: int = 20,
                 shared_randomness: bool = True, gamma: float | None = None, verify: bool = True,
                 entropy: str | None = None, dither: bool | None = None, grow_theta: bool = False,
                 verify_block: int = VERIFY_BLOCK, **kw):
        super().__init__(transport, topology, **kw)
        self.auto_theta = theta == "auto"
        if not self.auto_theta and not (isinstance(theta, (int, float)) and not isinstance(theta, bool)
                                        and math.isfinite(theta) and theta > 0):
            raise ValueError(f"theta must be a finite number > 0 or 'auto', got {theta!r}")
        if theta_schedule not in THETA_SCHEDULES:
            raise ValueError(f"theta_schedule must be one of {THETA_SCHEDULES}, got {theta_schedule!r}")
        if isinstance(theta_warmup, bool) or not isinstance(theta_warmup, int) or theta_warmup < 1:
            raise ValueError(f"theta_warmup must be an integer >= 1, got {theta_warmup!r}")
        if dither is None:  # the 1-bit default: nearest rounding of a shared subtractive dither
            dither = rounding is None and bits == 1 and bool(shared_randomness)
        if rounding is None:
            rounding = default_rounding(bits)
        # validates bits, rounding and delta < 1/2
        self.codec = ModuloCodec(bits=bits, theta=1.0 if self.auto_theta else float(theta), rounding=rounding)
        if gamma is None:
            gamma = GAMMA_1BIT if self.codec.bits == 1 else 1.0
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
        if not isinstance(verify, bool):
            raise ValueError(f"verify must be True or False, got {verify!r}")
        if isinstance(verify_block, bool) or not isinstance(verify_block, int) or verify_block < 1:
            raise ValueError(f"verify_block must be an integer >= 1 (elements per hashed block), got {verify_block!r}")
        self.verify_block = verify_block
        _check_entropy(entropy)
        if not isinstance(dither, bool):
            raise ValueError(f"dither must be True, False or None, got {dither!r}")
        if dither and (rounding != "nearest" or not shared_randomness):
            raise ValueError("dither=True needs rounding='nearest' and shared_randomness=True "
                             "(the receiver subtracts the sender's dither)")
        self.dither = dither
        if not isinstance(grow_theta, bool):
            raise ValueError(f"grow_theta must be True or False, got {grow_theta!r}")
        self.grow_theta = grow_theta
        self.gamma = float(gamma)
        self.theta: float | None = None if self.auto_theta else float(theta)
        self.theta_schedule = theta_schedule
        self.theta_warmup = theta_warmup
        self.shared_randomness = bool(shared_randomness)
        self.verify = verify
        self.entropy = entropy
        # rho of the matrix line 6 mixes with (Theorem 2 / 3)
        self.rho = spectral_rho(slack_matrix(self.W, self.gamma))
        self.period = topology_diameter(topology) + 1  # P: steps per alarm epoch
        self.mismatches = 0  # wrong blocks this worker detected (and did not use)
        self.mismatched_messages = 0  # messages with at least one wrong block
        self.theta_doublings = 0
        self._pending: set[int] = set()  # epochs with a raised alarm whose doubling is due later
        self._nack: dict[int, set[int] | None] = {}  # neighbour -> its blocks recovered wrong (repaired next step)
        self._lr0: float | None = None
        self._g_inf = 0.0
        self._tracked = 0  # warm-up steps tracked so far (theta="auto")
        self._x_half: torch.Tensor | None = None

    # ---- theta -----------------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        """True while ``theta="auto"`` has not fixed theta yet (exact gossip)."""
        return self.theta is None

    def theta_at(self, lr: float) -> float:
        """theta_k: constant, or theta * alpha_k / alpha_0."""
        if self.theta is None:
            raise RuntimeError("theta='auto' is still in its warm-up: no theta yet")
        if self._lr0 is None:
            self._lr0 = lr
        if self.theta_schedule == "lr" and self._lr0 > 0:
            return self.theta * lr / self._lr0
        return self.theta

    def _track(self, direction_inf: float) -> None:
        """One warm-up step's ||step direction||_inf; after ``theta_warmup`` of them the
        workers agree on G_inf (all-reduce MAX) and set theta from Theorem 2."""
        self._g_inf = max(self._g_inf, float(direction_inf))
        self._tracked += 1
        if self._tracked >= self.theta_warmup:
            agreed = self.transport.all_reduce(torch.tensor([self._g_inf], dtype=torch.float64), "max")
            self._g_inf = float(agreed[0])
            theta = theorem2_theta(self._lr0, self._g_inf, self.rho, self.world_size)
            self.theta = theta if theta > 0 else 1e-12  # zero gradients: models stay equal, any theta works

    # ---- alarms (verification) ---------------------------------------------------
    def _apply_due_doublings(self, k: int) -> None:
        for m in sorted(self._pending):
            if (m + 2) * self.period <= k:
                self._pending.discard(m)
                self.theta *= 2.0
                self.theta_doublings += 1

    def _alarm_bits(self) -> int:
        bits = 0
        for m in self._pending:
            bits |= 1 << (m % 2)
        return bits

    def _receive_alarm_bits(self, k: int, bits: int) -> None:
        e = k // self.period
        for p in (0, 1):
            if bits >> p & 1:
                m = e if e % 2 == p else e - 1
                if m >= 0:
                    self._pending.add(m)

    def _mismatch(self, k: int, j: int, bad: int, nb: int) -> None:
        self.mismatches += bad
        self.mismatched_messages += 1
        global _WARNED
        if not _WARNED:  # once per process (thread workers share it)
            _WARNED = True
            warnings.warn(f"moniqua: worker {self.rank} recovered a wrong model from worker {j} at step {k} "
                          f"in {bad} of {nb} blocks (theta={self.theta:g} is smaller than their distance there); "
                          f"those blocks are left out of this step's mix and mixed in fp32 next step "
                          f"(Moniqua.mismatches counts wrong blocks)", RuntimeWarning, stacklevel=3)

    # ---- the exchange --------------------------------------------------------------
    def gossip(self, k: int, x: torch.Tensor, lr: float) -> None:
        """Line 3-6 in place on x (exact fp32 gossip during an auto-theta warm-up)."""
        if self._lr0 is None:
            self._lr0 = lr
        if self.warming_up:
            self._exact_gossip(x)
            return
        self._apply_due_doublings(k)
        self._modulo_gossip(k, x, lr)

    def _exact_gossip(self, x: torch.Tensor) -> None:
        payload = _FP32.encode(x)
        received = self.transport.neighbor_exchange(payload.to_wire(), self.neighbors)
        own = _FP32.decode(payload).to(x.dtype)
        delta = torch.zeros_like(x)
        for j in self.neighbors:
            xj = _FP32.decode(_FP32.payload_from_wire(received[j])).to(x.dtype)
            delta.add_(xj - own, alpha=self.w[j])
        x.add_(delta, alpha=self.gamma)

    def _pack(self, payload: Payload) -> torch.Tensor:
        """The codes (the length header is known to every worker), entropy-coded if asked."""
        if self.entropy is None:
            return payload.data
        kw = {"symbol_bits": self.codec.bits} if self.entropy == "ans" and self.codec.bits in (1, 2, 4, 8) else {}
        blob = entropy_code(payload.data, self.entropy, **kw)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(payload.data.device)

    def _unpack(self, body: torch.Tensor, n: int, device, sender: int) -> Payload:
        """The codes of ``sender``'s message (of exactly the size n elements need; ValueError otherwise)."""
        need = packed_nbytes(n, self.codec.bits)
        if self.entropy is not None:
            try:
                raw = entropy_decode(body, self.entropy, max_length=need)
            except ValueError as e:
                raise ValueError(f"moniqua: worker {self.rank} got a malformed message from worker {sender}: {e}") from None
            body = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        if body.numel() != need:
            raise ValueError(f"moniqua: worker {self.rank} got a malformed message from worker {sender}: "
                             f"{body.numel()} bytes of codes, {n} elements at {self.codec.bits} bits need {need}")
        return Payload(header=pack_header(self.codec.header_format, n), data=body.to(device))

    def _parse_trailer(self, buf: torch.Tensor, nb: int, sender: int):
        """Split a verified message from ``sender`` into (codes, block hashes, control byte, requests
        {rank: blocks}); a ValueError naming the sender for any malformed frame."""
        def bad(why: str) -> ValueError:
            return ValueError(f"moniqua: worker {self.rank} got a malformed message from worker {sender}: {why}")

        tail = nb * 2 + 1
        if buf.numel() < tail:
            raise bad(f"{buf.numel()} bytes, shorter than its {tail}-byte verification trailer")
        raw = buf[-tail:].cpu().numpy().tobytes()
        *hashes, ctrl = struct.unpack(f"<{nb}HB", raw)
        buf = buf[:-tail]
        if ctrl & ~7:
            raise bad(f"control byte {ctrl:#04x} has unknown bits set")
        requests: dict[int, set[int]] = {}
        if ctrl & 4:
            if buf.numel() < 2:
                raise bad("the repair-request flag is set but the request count is missing")
            (count,) = struct.unpack("<H", buf[-2:].cpu().numpy().tobytes())
            entry = 2 + -(-nb // 8)
            if count < 1 or count > len(self.neighbors) or buf.numel() < 2 + entry * count:
                raise bad(f"{count} repair request(s) do not fit (1..{len(self.neighbors)} entries of {entry} bytes "
                          f"in {buf.numel() - 2} bytes)")
            req = buf[-2 - entry * count:-2].cpu().numpy().tobytes()
            buf = buf[:-2 - entry * count]
            for e in range(count):
                (r,) = struct.unpack("<H", req[e * entry:e * entry + 2])
                blocks = _unpack_mask(req[e * entry + 2:(e + 1) * entry], nb)
                if nb % 8 and req[(e + 1) * entry - 1] >> (nb % 8):
                    raise bad(f"a repair request names blocks beyond the {nb} blocks")
                requests.setdefault(r, set()).update(blocks)
        return buf, hashes, ctrl, requests

    def _blocks(self, d: int) -> int:
        return -(-d // self.verify_block)

    def _block_mask(self, blocks, d: int, device) -> torch.Tensor:
        """Element mask (bool, length d) of the given block indices."""
        per_block = torch.zeros(self._blocks(d), dtype=torch.bool)
        per_block[sorted(b for b in blocks if b < per_block.numel())] = True
        return per_block.repeat_interleave(self.verify_block)[:d].to(device)

    def _decode(self, codec: ModuloCodec, payload: Payload, y: torch.Tensor):
        """Eq. (5) against ``y``, and (when verifying) the hash of each block's grid
        integers; a grid too fine for the models' magnitude is a clear error."""
        if not self.verify:
            return codec.decode(payload, ref=y), None
        try:
            return codec.decode_hashed(payload, ref=y, block=self.verify_block)
        except OverflowError as e:
            raise ValueError(f"moniqua verification: {e}, or run with --no-verify") from None

    def _modulo_gossip(self, k: int, x: torch.Tensor, lr: float) -> None:
        codec = dataclasses.replace(self.codec, theta=self.theta_at(lr))
        # Shared randomness ("More efficient Moniqua", section 6): every worker draws the
        # same rounding offsets u at step k, so nearby models round alike.
        sender = 0 if self.shared_randomness else self.rank + 1
        gen = shared_generator(self.seed, k, sender)
        y = x.detach().to(torch.float64)  # decode in float64 so the grid integers are exact
        step = codec.B_theta / codec.levels
        d = x.numel()
        nb = self._blocks(d)
        mask_nbytes = -(-nb // 8)
        v = None
        if self.dither:  # shared subtractive dither, uniform over one grid cell
            v = (torch.rand(y.shape, generator=gen, dtype=torch.float64, device=y.device) - 0.5) * step
            y = y + v
        payload = codec.encode(y, generator=gen)                                   # line 3
        x_hat_i64, hashes = self._decode(codec, payload, y)                        # line 4
        wire = self._pack(payload)
        # my requests, sent in this message (None: every block, from a whole-vector checkpoint)
        asked_of = {j: set(range(nb)) if b is None else {c for c in b if c < nb} for j, b in self._nack.items()}
        asked_of = {j: b for j, b in asked_of.items() if b}
        if self.verify:
            trailer = b""
            ctrl = self._alarm_bits()
            if asked_of:  # ask these neighbours for an fp32 repair of these blocks of this step's edge
                ctrl |= 4
                trailer = b"".join(struct.pack("<H", j) + _pack_mask(asked_of[j], nb) for j in sorted(asked_of))
                trailer += struct.pack("<H", len(asked_of))
            trailer += struct.pack(f"<{nb}HB", *hashes.tolist(), ctrl)
            wire = torch.cat([wire, torch.frombuffer(bytearray(trailer), dtype=torch.uint8).to(wire.device)])
        received = self.transport.neighbor_exchange(wire, self.neighbors)
        x_hat_i = (x_hat_i64 if v is None else x_hat_i64 - v).to(x.dtype)
        # blocks of each edge mixed exactly this step: asked by me or by the neighbour (both ends know both)
        repair = {j: set(b) for j, b in asked_of.items()}
        nack: dict[int, set[int]] = {}
        recovered: dict[int, torch.Tensor] = {}
        good: dict[int, torch.Tensor | None] = {}  # element mask of the blocks verified right (None: all)
        for j in self.neighbors:
            buf = received[j]
            if self.verify:
                buf, sent_hashes, ctrl, requests = self._parse_trailer(buf, nb, j)
                self._receive_alarm_bits(k, ctrl & 3)
                if self.rank in requests:
                    repair.setdefault(j, set()).update(requests[self.rank])
            x_hat_j64, mine = self._decode(codec, self._unpack(buf, d, x.device, j), y)  # line 5
            good[j] = None
            if self.verify:
                bad = (mine != torch.tensor(sent_hashes, dtype=mine.dtype)).nonzero().flatten().tolist()
                if bad:  # never use a wrong block: leave it out of this step's mix
                    self._mismatch(k, j, len(bad), nb)
                    nack[j] = set(bad)
                    good[j] = ~self._block_mask(bad, d, x.device)
            recovered[j] = x_hat_j64 if v is None else x_hat_j64 - v
        exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        repair = {j: b for j, b in repair.items() if b}
        if repair:  # the fp32 repair round, only on edges (and blocks) where a mismatch was detected a step earlier
            union = set().union(*repair.values())
            x32 = x.detach().to(torch.float32)
            sel = self._block_mask(union, d, x.device)
            body = x32[sel].cpu().contiguous().view(torch.uint8)
            msg = torch.cat([torch.frombuffer(bytearray(_pack_mask(union, nb)), dtype=torch.uint8), body])
            got = self.transport.neighbor_exchange(msg.to(x.device), sorted(repair))
            for j, blocks in repair.items():
                if got[j].numel() < mask_nbytes:
                    raise ValueError(f"moniqua: worker {self.rank} got a malformed repair message from worker {j}: "
                                     f"{got[j].numel()} bytes, shorter than its {mask_nbytes}-byte block mask")
                theirs = _unpack_mask(got[j][:mask_nbytes].cpu().numpy().tobytes(), nb)
                their_mask = self._block_mask(theirs, d, x.device)
                if got[j].numel() != mask_nbytes + 4 * int(their_mask.sum()):
                    raise ValueError(f"moniqua: worker {self.rank} got a malformed repair message from worker {j}: "
                                     f"{got[j].numel() - mask_nbytes} bytes of values for "
                                     f"{int(their_mask.sum())} fp32 elements")
                vals = torch.zeros(d, dtype=torch.float32, device=x.device)
                vals[their_mask] = got[j][mask_nbytes:].cpu().clone().view(torch.float32).to(x.device)
                m = self._block_mask(blocks, d, x.device)
                exact[j] = (m, (vals.to(x.dtype) - x32.to(x.dtype)) * m)
        delta = torch.zeros_like(x)
        for j in self.neighbors:
            term = recovered[j].to(x.dtype) - x_hat_i
            keep = good[j]
            if j in exact:
                m, ex = exact[j]
                keep = ~m if keep is None else keep & ~m
                delta.add_(ex, alpha=self.w[j])
            delta.add_(term if keep is None else term * keep, alpha=self.w[j])
        self._nack = nack
        if self.grow_theta and self.neighbors and len(nack) == len(self.neighbors):
            self._pending.add(k // self.period)  # no neighbour's message was right: theta is far too small
        x.add_(delta, alpha=self.gamma)                                             # line 6

    # ---- the algorithm contract -------------------------------------------------------
    def before_update(self, k, x, g, lr):
        self.gossip(k, x, lr)
        if self.warming_up:
            self._x_half = x.detach().clone()

    def after_update(self, k, x, g, lr):
        if self._x_half is not None:
            if lr > 0:
                self._track(float((self._x_half - x).abs().max()) / lr)
            self._x_half = None

    def report(self):
        return {"theta": float(self.theta), "mismatched_blocks": int(self.mismatches),
                "mismatched_messages": int(self.mismatched_messages), "theta_doublings": int(self.theta_doublings)}

    def extra_state(self) -> dict:
        return {"theta": self.theta, "lr0": self._lr0, "g_inf": self._g_inf, "tracked": self._tracked,
                "mismatches": self.mismatches, "theta_doublings": self.theta_doublings,
                "pending_alarms": sorted(self._pending), "mismatched_messages": self.mismatched_messages,
                "verify_block": self.verify_block,
                "nack": [[j, None if blocks is None else sorted(blocks)] for j, blocks in sorted(self._nack.items())]}

    def load_extra_state(self, extra: dict) -> None:
        if not extra:
            return
        self.theta = extra["theta"]
        self._lr0 = extra["lr0"]
        self._g_inf = extra["g_inf"]
        self._tracked = extra["tracked"]
        self.mismatches = extra["mismatches"]
        self.theta_doublings = extra["theta_doublings"]
        self._pending = set(extra["pending_alarms"])
        self.mismatched_messages = extra.get("mismatched_messages", 0)
        self._nack = {}
        saved_block = extra.get("verify_block")
        for entry in extra["nack"]:
            if isinstance(entry, int):  # a whole-vector checkpoint: repair every block of the edge
                self._nack[entry] = None  # None: every block (the length is known at the next step)
                continue
            j, blocks = entry
            if blocks is None:
                self._nack[int(j)] = None
                continue
            if saved_block != self.verify_block:  # re-block: the new blocks covering the saved ones
                blocks = {c for b in blocks for c in range(b * saved_block // self.verify_block,
                                                           ((b + 1) * saved_block - 1) // self.verify_block + 1)}
            self._nack[int(j)] = set(blocks)


def _check_entropy(entropy) -> None:
    if entropy is None:
        return
    if entropy not in ENTROPY_METHODS:
        raise ValueError(f"entropy must be None or one of {ENTROPY_METHODS}, got {entropy!r}")
    if entropy == "ans":
        try:
            import constriction  # noqa: F401, PLC0415
        except ImportError:
            raise ValueError("entropy='ans' needs the optional 'constriction' package (pip install constriction); "
                             "zlib, bz2 and lzma need nothing extra") from None
