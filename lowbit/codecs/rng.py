"""Shared randomness: every random draw of a codec comes from a generator
seeded by (run seed, step, sender, stream), so a receiver can regenerate the
sender's dither without it being sent."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(run_seed: int, step: int, sender: int, stream: int = 0) -> int:
    """A 63-bit seed that depends on all four integers (blake2b of their bytes)."""
    for name, v in (("run_seed", run_seed), ("step", step), ("sender", sender), ("stream", stream)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    raw = b"".join(int(v).to_bytes(8, "little", signed=False) for v in (run_seed, step, sender, stream))
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def shared_generator(run_seed: int, step: int, sender: int, stream: int = 0, device="cpu") -> torch.Generator:
    """The generator both ends of a message derive for (run_seed, step, sender, stream)."""
    return make_generator(derive_seed(run_seed, step, sender, stream), device)


def clone_generator(generator: torch.Generator) -> torch.Generator:
    """A new generator on the same device in the same state (the receiver's copy)."""
    g = torch.Generator(device=generator.device)
    g.set_state(generator.get_state())
    return g


# --- counter-based uniforms: the fast paths' randomness ---------------------------------
#
# A codec draws ONE 63-bit key from the generator it is given (one call of
# ``torch.randint`` on the generator's device, so a CPU generator never
# synchronises with a GPU). Element ``i`` of that draw then gets the uniform
#
#     h = mix32(mix32(i XOR k0) + k1)  (mod 2^32),     u_i = (h >> 8) * 2^-24  in [0, 1 - 2^-24],
#
# with ``k0``/``k1`` the low/high 32 bits of the key and ``mix32`` the
# "lowbias32" integer hash (xor-shift / multiply, full avalanche). The same
# integers come out of the numba kernels (CPU), the Triton kernels (CUDA) and
# :func:`counter_uniforms` (plain torch, the reference): the draws of a message
# are the same on every device, thread count and code path, cost no transfer,
# and a receiver that clones the sender's generator regenerates them exactly.
# A uniform has 24 bits, so it is exact in float32 and float64; stochastic
# rounding with it is unbiased up to 2^-24 of a grid step.

MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B
_M32 = 0xFFFFFFFF
UNIFORM_SCALE = 2.0 ** -24


def draw_key(generator: torch.Generator | None) -> int:
    """One 63-bit key from ``generator`` (torch's global CPU generator if None): the
    seed of every counter-based uniform one encode draws."""
    if generator is None:
        return int(torch.randint(0, 2**63 - 1, (1,)))
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=generator.device))


def split_key(key: int) -> tuple[int, int]:
    """``(k0, k1)``: the low and high 32 bits of a key."""
    return key & _M32, (key >> 32) & _M32


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2^32`` for int64 ``h`` in [0, 2^32), without int64 overflow."""
    lo = (h * (c & 0xFFFF)) & _M32
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(h: torch.Tensor) -> torch.Tensor:
    """The lowbias32 finaliser: an invertible mix of 32-bit integers (held in int64)
    whose every output bit depends on every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, MIX_C1)
    h = h ^ (h >> 15)
    h = _mul32(h, MIX_C2)
    return h ^ (h >> 16)


def counter_hash(key: int, n: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Tensor:
    """The 32-bit hashes of elements ``start..start+n-1`` under ``key`` (int64 tensor):
    the plain reference of what the kernels compute."""
    k0, k1 = split_key(key)
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return mix32((mix32(i ^ k0) + k1) & _M32)


def counter_uniforms(key: int, n: int, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``u_0..u_{n-1}`` in [0, 1) for ``key``, as the fast kernels draw them (exact in
    float32 and float64)."""
    return (counter_hash(key, n, device) >> 8).to(dtype) * UNIFORM_SCALE
