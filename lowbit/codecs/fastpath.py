"""The encode and decode a codec with a kernel family and a float64 reference shares.

A :class:`FastPathCodec` writes two pairs of methods: ``encode_fast``/``decode_fast``, given
the kernel module of its ``kernel_family`` for the tensor's backend
(:func:`~lowbit.codecs.kernels.kernels_for`), and ``encode_reference``/``decode_reference``,
plain torch in float64 that makes the same bytes and values. :meth:`FastPathCodec.encode` and
:meth:`FastPathCodec.decode` choose between them: the kernels where the backend has them, the
reference elsewhere. Tests hold each pair to the other.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from .base import Codec, Payload
from .kernels import kernels_for
from .quantize import check_numel

__all__ = ["FastPathCodec"]


class FastPathCodec(Codec):
    """A codec whose encode and decode run its kernel family's functions where the tensor's
    backend has them, and its float64 reference elsewhere (the same bytes)."""

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        n = check_numel(x)
        K = kernels_for(x, self.kernel_family)
        if K is None:
            return self.encode_reference(x, generator=generator)
        return self.encode_fast(K, x, n, generator)

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
        K = kernels_for(payload.data, self.kernel_family)
        if K is None:
            return self.decode_reference(payload, dtype=dtype, numel=numel)
        return self.decode_fast(K, payload, dtype, numel)

    @abstractmethod
    def encode_fast(self, K, x: torch.Tensor, n: int, generator: torch.Generator | None) -> Payload:
        """:meth:`encode` with the kernel module ``K``; ``x`` is checked flat and ``n`` long."""

    @abstractmethod
    def decode_fast(self, K, payload: Payload, dtype: torch.dtype | None, numel: int | None) -> torch.Tensor:
        """:meth:`decode` with the kernel module ``K``."""

    @abstractmethod
    def encode_reference(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """The float64 whole-tensor reference of :meth:`encode` (the same bytes)."""

    @abstractmethod
    def decode_reference(self, payload: Payload, *, ref: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
                         numel: int | None = None) -> torch.Tensor:
        """The float64 whole-tensor reference of :meth:`decode`."""
