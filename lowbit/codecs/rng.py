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
