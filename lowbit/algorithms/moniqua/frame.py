"""Moniqua's message framing around the modulo codec: verification, repair requests and
the repair round (the policy is :mod:`lowbit.algorithms.moniqua.verify`'s docstring).

A message is::

    codes | [repair requests] | block hashes | control byte

- *codes*: the packed modulo codes (entropy-coded with ``entropy``); no length header,
  every worker knows ``d``.
- *repair requests* (only when the control byte's bit 2, value 4, is set): per asked neighbour its rank
  (``<H``) and a bit mask of ``ceil(nb / 8)`` bytes of the blocks to repair, then the
  count of entries (``<H``).
- *block hashes* (with ``verify``): one ``<u2`` per block of ``block`` elements, the hash
  of the sender's own grid integers (:meth:`ModuloCodec.decode_hashed`).
- *control byte*: value 4 "requests follow", or 0; any other bit set is a malformed frame.

A repair message is the block mask of the repaired blocks, each block's float32 min and
max, then every value of those blocks as a 16-bit min-max code of its block
(:meth:`ModuloFrame.repair_message`).

With verification, no entropy coding, codes of 1, 2, 4 or 8 bits and a float32/float64
model on a fast path, a message costs one kernel call at each end
(``moniqua_send``/``moniqua_receive`` of :mod:`lowbit.codecs.kernels`): on the thread
runtime the calls, not the elements, were a step's cost. Otherwise the codec's calls.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ...codecs.base import Payload, pack_header
from ...codecs.entropy import entropy_code, entropy_decode
from ...codecs.kernels import empty_output, kernels_for
from ...codecs.modulo import ModuloCodec, check_grid_reach
from ...codecs.packing import packed_nbytes
from ...codecs.rng import draw_key

__all__ = ["ModuloFrame", "Received", "pack_mask", "unpack_mask", "REPAIR_LEVELS"]

#: The repair round's codes: each repaired value as a min-max code of its block on
#: 2^16 - 1 steps (16 bits on the wire).
REPAIR_LEVELS = (1 << 16) - 1


def pack_mask(blocks, nb: int) -> bytes:
    """Bit mask (ceil(nb / 8) bytes, little-endian bit order) of block indices in [0, nb)."""
    out = bytearray(-(-nb // 8))
    for b in blocks:
        out[b >> 3] |= 1 << (b & 7)
    return bytes(out)


def unpack_mask(raw: bytes, nb: int) -> set[int]:
    """The set of block indices whose bit is set in ``raw``, a bitmap of ``nb`` blocks (bit b of byte b // 8)."""
    if len(raw) * 8 < nb:
        raise ValueError(f"a mask of {nb} blocks needs {-(-nb // 8)} bytes, got {len(raw)}")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:nb]
    return set(np.flatnonzero(bits).tolist())


@dataclass
class Received:
    """One neighbour's message, read: its decoded point (line 5, in ``y``'s dtype, the shared
    dither subtracted), the blocks
    whose hashes differ (wrong: left out of the mix), its control byte and its repair requests
    {rank: blocks}; ``mixed``: its line-6 term is already in the caller's ``delta``."""

    x_hat: torch.Tensor
    wrong: list[int]
    ctrl: int
    requests: dict[int, set[int]]
    mixed: bool


@dataclass(frozen=True)
class ModuloFrame:
    """The frame of one worker's messages: ``bits`` per code, hashes per ``block`` elements
    (with ``verify``), ``entropy`` coding of the codes or None, at most ``peers`` repair
    requests per message, errors naming worker ``rank`` (the reader)."""

    bits: int
    block: int
    verify: bool
    entropy: str | None
    peers: int
    rank: int

    def nblocks(self, d: int) -> int:
        return -(-d // self.block)

    def block_elements(self, blocks, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices (int64, ascending) of the elements of the given blocks of a d-element
        vector, and for each the rank of its block among the blocks in order (which min and
        max of a repair it is coded against). Its cost is the blocks' size, not d."""
        ids = torch.tensor(sorted(b for b in set(blocks) if 0 <= b < self.nblocks(d)), dtype=torch.int64)
        elem = (ids[:, None] * self.block + torch.arange(self.block)).flatten()
        seg = torch.arange(ids.numel()).repeat_interleave(self.block)
        if ids.numel() and elem[-1] >= d:  # only the last block can be short
            keep = elem < d
            elem, seg = elem[keep], seg[keep]
        return elem.to(device), seg.to(device)

    def _malformed(self, sender: int, why: str, what: str = "message") -> ValueError:
        return ValueError(f"moniqua: worker {self.rank} got a malformed {what} from worker {sender}: {why}")

    def kernels(self, y: torch.Tensor, x_dtype: torch.dtype):
        """The one-call kernels (``moniqua_send``/``moniqua_receive``) where they apply to a step's
        ``y`` and model dtype, else None (the codec's calls). Chosen once per step and handed to
        :meth:`send` and every :meth:`receive`."""
        fits = self.verify and self.entropy is None and self.bits in (1, 2, 4, 8) and y.is_contiguous()
        return kernels_for(y, "modulo") if fits and x_dtype in (torch.float32, torch.float64) else None

    # ---- the sender -------------------------------------------------------------------
    def send(self, codec: ModuloCodec, y: torch.Tensor, generator, requests: dict[int, set[int]],
             K) -> tuple[torch.Tensor, torch.Tensor]:
        """Line 3 and 4: the message of ``y`` (the codes, my ``requests`` {neighbour: blocks},
        the hashes and the control byte) and my own decoded point; ``K``: :meth:`kernels`."""
        nb = self.nblocks(y.numel())
        head, ctrl = b"", 0
        if requests:  # ask these neighbours for a repair of these blocks of this step's edge
            head = b"".join(struct.pack("<H", j) + pack_mask(requests[j], nb) for j in sorted(requests))
            head += struct.pack("<H", len(requests))
            ctrl |= 4
        if K is not None:
            return self._send_fused(K, codec, y, generator, head, ctrl, nb)
        payload = codec.encode(y, generator=generator)
        x_hat, hashes = self._decode(codec, payload, y)
        wire = self._pack(payload)
        if self.verify:
            trailer = head + hashes.numpy().astype("<u2").tobytes() + bytes([ctrl])
            wire = torch.cat([wire, torch.frombuffer(bytearray(trailer), dtype=torch.uint8).to(wire.device)])
        return wire, x_hat

    def _send_fused(self, K, codec: ModuloCodec, y: torch.Tensor, generator, head: bytes, ctrl: int, nb: int):
        d = y.numel()
        nbytes = packed_nbytes(d, codec.bits)
        msg = torch.empty(nbytes + len(head) + 2 * nb + 1, dtype=torch.uint8, device=y.device)
        if head:
            msg[nbytes:nbytes + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(y.device)
        x_hat = empty_output(d, y.dtype, y.device)
        stochastic = codec.rounding == "stochastic"
        try:
            K.moniqua_send(y, codec.B_theta, codec.levels, stochastic, draw_key(generator) if stochastic else 0,
                           codec.bits, self.block, msg, nbytes + len(head), ctrl, x_hat)
        except OverflowError as e:
            raise _overflow(e) from None
        return msg, x_hat

    def _pack(self, payload: Payload) -> torch.Tensor:
        """The codes (the length header is known to every worker), entropy-coded if asked."""
        if self.entropy is None:
            return payload.data
        kw = {"symbol_bits": self.bits} if self.entropy == "ans" and self.bits in (1, 2, 4, 8) else {}
        blob = entropy_code(payload.data, self.entropy, **kw)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(payload.data.device)

    def _decode(self, codec: ModuloCodec, payload: Payload, y: torch.Tensor):
        """Eq. (5) against ``y``, and (when verifying) the hash of each block's grid
        integers; a grid too fine for the models' magnitude is a clear error."""
        if not self.verify:
            return codec.decode(payload, ref=y), None
        try:
            return codec.decode_hashed(payload, ref=y, block=self.block)
        except OverflowError as e:
            raise _overflow(e) from None

    # ---- the receiver -------------------------------------------------------------------
    def receive(self, codec: ModuloCodec, msgs: dict[int, torch.Tensor], y: torch.Tensor, K, *,
                v: torch.Tensor | None, x_hat_i: torch.Tensor, w: dict[int, float],
                delta: torch.Tensor) -> dict[int, Received]:
        """Read each neighbour's message (``msgs``: {sender: message}) against my ``y``; where the
        one-call kernel runs and every block of a message is right, its line-6 term
        ``w[j] (x_hat_j - x_hat_i)`` (``x_hat_j - v`` with the shared dither ``v``) is added to
        ``delta`` (``Received.mixed``); ``K``: :meth:`kernels`. With ``K`` the kernels of every
        message are launched before the one host read that serves them all."""
        d = y.numel()
        if K is None:
            return {j: self._receive_decoded(codec, buf, y, j, v) for j, buf in msgs.items()}
        nb, need = self.nblocks(d), packed_nbytes(d, codec.bits)
        tail = 2 * nb + 1
        x_hats, found = {}, []
        for j, buf in msgs.items():
            if buf.numel() < need + tail:
                raise self._malformed(j, f"{buf.numel()} bytes, shorter than the {need} bytes of codes of {d} "
                                         f"elements at {codec.bits} bits and the {tail}-byte verification trailer")
            x_hats[j] = empty_output(d, y.dtype, y.device)
            found.append(K.moniqua_receive(buf, codec.bits, codec.B_theta, codec.levels, y, self.block, x_hats[j], v,
                                           x_hat_i, w[j], delta))
        out = {}
        for (j, buf), f in zip(msgs.items(), K.to_host(found)):  # one host read
            ctrl = int(f[nb])
            body, requests = self._requests(buf[:-tail], ctrl, nb, j)
            self._check_codes(body, d, j)
            try:
                check_grid_reach(float(f[nb + 1:].max()), codec.B_theta, codec.levels)
            except OverflowError as e:
                raise _overflow(e) from None
            wrong = np.flatnonzero(f[:nb]).tolist()
            out[j] = Received(_undither(x_hats[j], v), wrong, ctrl, requests, mixed=not wrong)
        return out

    def _receive_decoded(self, codec: ModuloCodec, buf: torch.Tensor, y: torch.Tensor, sender: int,
                         v: torch.Tensor | None) -> Received:
        """One message read with the codec's calls (no one-call kernel)."""
        ctrl, requests, sent = 0, {}, None
        if self.verify:
            buf, sent, ctrl, requests = self.parse(buf, self.nblocks(y.numel()), sender)
        x_hat, mine = self._decode(codec, self.codes(buf, y.numel(), y.device, sender), y)
        wrong = np.flatnonzero(mine.numpy() != sent).tolist() if self.verify else []
        return Received(_undither(x_hat, v), wrong, ctrl, requests, mixed=False)

    def parse(self, buf: torch.Tensor, nb: int, sender: int):
        """Split a verified message from ``sender`` into (codes, block hashes, control byte, requests
        {rank: blocks}); a ValueError naming the sender for any malformed frame."""
        tail = nb * 2 + 1
        if buf.numel() < tail:
            raise self._malformed(sender, f"{buf.numel()} bytes, shorter than its {tail}-byte verification trailer")
        raw = buf[-tail:].cpu().numpy()
        hashes, ctrl = raw[:-1].view("<u2"), int(raw[-1])
        body, requests = self._requests(buf[:-tail], ctrl, nb, sender)
        return body, hashes, ctrl, requests

    def _requests(self, buf: torch.Tensor, ctrl: int, nb: int, sender: int) -> tuple[torch.Tensor, dict[int, set[int]]]:
        """A verified message without its trailer, split by its control byte ``ctrl`` into (codes,
        repair requests {rank: blocks})."""
        if ctrl & ~4:
            raise self._malformed(sender, f"control byte {ctrl:#04x} has unknown bits set")
        requests: dict[int, set[int]] = {}
        if ctrl & 4:
            if buf.numel() < 2:
                raise self._malformed(sender, "the repair-request flag is set but the request count is missing")
            (count,) = struct.unpack("<H", buf[-2:].cpu().numpy().tobytes())
            entry = 2 + -(-nb // 8)
            if count < 1 or count > self.peers or buf.numel() < 2 + entry * count:
                raise self._malformed(sender, f"{count} repair request(s) do not fit (1..{self.peers} entries of "
                                              f"{entry} bytes in {buf.numel() - 2} bytes)")
            req = buf[-2 - entry * count:-2].cpu().numpy().tobytes()
            buf = buf[:-2 - entry * count]
            for e in range(count):
                (r,) = struct.unpack("<H", req[e * entry:e * entry + 2])
                blocks = unpack_mask(req[e * entry + 2:(e + 1) * entry], nb)
                if nb % 8 and req[(e + 1) * entry - 1] >> (nb % 8):
                    raise self._malformed(sender, f"a repair request names blocks beyond the {nb} blocks")
                requests.setdefault(r, set()).update(blocks)
        return buf, requests

    def codes(self, body: torch.Tensor, n: int, device, sender: int) -> Payload:
        """The codes of ``sender``'s message (of exactly the size n elements need; ValueError otherwise)."""
        need = packed_nbytes(n, self.bits)
        if self.entropy is not None:
            try:
                raw = entropy_decode(body, self.entropy, max_length=need)
            except ValueError as e:
                raise self._malformed(sender, str(e)) from None
            body = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        self._check_codes(body, n, sender)
        return Payload(header=pack_header(ModuloCodec.header_format, n), data=body.to(device))

    def _check_codes(self, body: torch.Tensor, n: int, sender: int) -> None:
        """``body`` is exactly the packed codes of ``n`` elements (a ValueError naming the sender otherwise)."""
        need = packed_nbytes(n, self.bits)
        if body.numel() != need:
            raise self._malformed(sender, f"{body.numel()} bytes of codes, {n} elements at {self.bits} bits need "
                                          f"{need}")

    # ---- the repair round ---------------------------------------------------------------------
    def repair_message(self, x: torch.Tensor, blocks: set[int]) -> torch.Tensor:
        """The block mask of ``blocks``, then each block's float32 min and max (in block order),
        then every value of those blocks as a 16-bit min-max code of its block (nearest, in
        float64): a value comes back within (max - min) / (2 (2^16 - 1)) of its float32 value
        (:data:`REPAIR_LEVELS`), then rounded to float32, for 2 bytes instead of fp32's 4. A
        block's codes depend on that block's values alone."""
        d = x.numel()
        mask = torch.frombuffer(bytearray(pack_mask(blocks, self.nblocks(d))), dtype=torch.uint8).to(x.device)
        elem, seg = self.block_elements(blocks, d, x.device)
        v = x.detach()[elem].to(torch.float32).to(torch.float64)
        inf = torch.full((len(blocks),), math.inf, dtype=torch.float64, device=x.device)
        lo, hi = inf.scatter_reduce(0, seg, v, "amin"), (-inf).scatter_reduce(0, seg, v, "amax")
        lo, hi = lo.to(torch.float32), hi.to(torch.float32)  # exact: the values are float32
        span = (hi - lo).to(torch.float64)
        scale = torch.where(span > 0, REPAIR_LEVELS / torch.where(span > 0, span, 1.0), 0.0)
        codes = torch.round((v - lo.to(torch.float64)[seg]) * scale[seg]).clamp_(0, REPAIR_LEVELS)
        body = codes.to(torch.int32).to(torch.int16)  # two's complement of the low 16 bits, little-endian
        return torch.cat([mask, torch.stack([lo, hi], 1).flatten().view(torch.uint8), body.view(torch.uint8)])

    def read_repair(self, buf: torch.Tensor, d: int, device, sender: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A repair message as (the indices of the elements of the blocks it carries, ascending;
        their float32 values): :meth:`block_elements` of its mask, then the values."""
        nb = self.nblocks(d)
        mask_nbytes = -(-nb // 8)
        if buf.numel() < mask_nbytes:
            raise self._malformed(sender, f"{buf.numel()} bytes, shorter than its {mask_nbytes}-byte block mask",
                                  "repair message")
        blocks = unpack_mask(buf[:mask_nbytes].cpu().numpy().tobytes(), nb)
        elem, seg = self.block_elements(blocks, d, device)
        m = seg.numel()
        if buf.numel() != mask_nbytes + 8 * len(blocks) + 2 * m:
            raise self._malformed(sender, f"{buf.numel() - mask_nbytes} bytes after the mask for {len(blocks)} "
                                          f"block(s) of {m} elements (8 bytes of min and max per block and 2 per "
                                          f"element)", "repair message")
        raw = buf[mask_nbytes:].to(device).clone()
        bounds = raw[:8 * len(blocks)].view(torch.float32).reshape(-1, 2).to(torch.float64)
        codes = (raw[8 * len(blocks):].view(torch.int16).to(torch.int64) & 0xFFFF).to(torch.float64)
        lo, span = bounds[:, 0][seg], (bounds[:, 1] - bounds[:, 0])[seg]
        return elem, (lo + codes * (span / REPAIR_LEVELS)).to(torch.float32)


def _undither(x_hat: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
    return x_hat if v is None else x_hat - v


def _overflow(e: OverflowError) -> ValueError:
    return ValueError(f"moniqua verification: {e}, or run with --no-verify")
