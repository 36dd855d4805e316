"""The codec contract: flat float tensor -> wire payload (real bytes) -> tensor.

A codec is a small immutable configuration (a frozen dataclass). ``encode``
turns a flat floating-point tensor into a :class:`Payload` whose ``nbytes``
is exactly what crosses the wire; ``decode`` turns it back. Randomness is
always passed in as a ``torch.Generator`` so that a sender and a receiver
can regenerate the same dither from a shared seed (see :mod:`lowbit.codecs.rng`).
"""

from __future__ import annotations

import enum
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class CodecKind(enum.Enum):
    """What ``decode`` needs besides the payload."""

    PLAIN = "plain"  # the payload alone
    SIDE_INFO = "side-information"  # also the receiver's reference ``ref``
    SUMMABLE = "summable"  # integer codes of many workers may be added first


@dataclass(frozen=True)
class Payload:
    """What one encode puts on the wire.

    ``header``: a few fixed-width fields (scales, lengths) as raw bytes.
    ``data``: the packed codes as a 1-D ``uint8`` tensor.
    The wire form is ``header || data``; ``nbytes`` is its exact length.
    """

    header: torch.Tensor
    data: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("header", "data"):
            t = getattr(self, name)
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise TypeError(f"Payload.{name} must be a 1-D uint8 tensor, got {t.dtype} with shape {tuple(t.shape)}")

    @property
    def nbytes(self) -> int:
        return self.header.numel() + self.data.numel()

    def to_wire(self) -> torch.Tensor:
        """The single contiguous ``uint8`` buffer a transport sends."""
        return torch.cat([self.header, self.data.to(self.header.device)])

    @staticmethod
    def from_wire(buf: torch.Tensor, header_nbytes: int) -> "Payload":
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise TypeError(f"wire buffer must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        if buf.numel() < header_nbytes:
            raise ValueError(f"wire buffer of {buf.numel()} bytes is shorter than the {header_nbytes}-byte header")
        return Payload(header=buf[:header_nbytes], data=buf[header_nbytes:])


def pack_header(fmt: str, *values, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pack scalar header fields with a ``struct`` format (little-endian) into uint8."""
    raw = struct.pack("<" + fmt, *values)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def unpack_header(fmt: str, header: torch.Tensor) -> tuple:
    """Inverse of :func:`pack_header`."""
    return struct.unpack("<" + fmt, bytes(header.cpu().numpy().tobytes()))


def header_size(fmt: str) -> int:
    return struct.calcsize("<" + fmt)


class Codec(ABC):
    """Base class of every codec.

    Subclasses are frozen dataclasses and set the class attributes below.
    Each also provides ``bits``, the nominal number of bits per element of the
    data part, as a dataclass field or a property. (It is declared here by
    annotation only: a class attribute would become the default of a
    subclass's ``bits`` field.)
    """

    bits: float

    name: str = "codec"
    kind: CodecKind = CodecKind.PLAIN
    unbiased: bool = False
    header_format: str = ""  # struct format of the fixed header

    @property
    def header_nbytes(self) -> int:
        return header_size(self.header_format)

    @abstractmethod
    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """Encode a flat floating-point tensor."""

    @abstractmethod
    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None) -> torch.Tensor:
        """Decode; ``ref`` is the receiver's reference for side-information codecs."""

    def roundtrip(self, x: torch.Tensor, *, generator=None, ref=None) -> torch.Tensor:
        return self.decode(self.encode(x, generator=generator), ref=ref)

    def payload_from_wire(self, buf: torch.Tensor) -> Payload:
        return Payload.from_wire(buf, self.header_nbytes)


def check_flat(x: torch.Tensor, arg: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{arg} must be a flat (1-D) tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{arg} must be a floating-point tensor, got {x.dtype}")
