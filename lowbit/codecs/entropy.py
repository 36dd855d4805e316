"""Lossless entropy coding of payloads, measured in real bytes.

The Moniqua paper notes that its low-bit codes can be compressed further with
a general-purpose coder (bzip); this module provides that stage for any
codec:

* :func:`empirical_entropy_bits`: the Shannon entropy of a symbol histogram
  (bits per symbol), the lower bound a static model reaches;
* :func:`entropy_code` / :func:`entropy_decode`: bytes -> self-describing
  compressed bytes -> the same bytes, with ``method`` one of

  - ``"zlib"`` (DEFLATE, level 9), ``"bz2"`` (level 9), ``"lzma"`` (raw LZMA2
    stream, preset 6, no container or checksum): the standard library;
  - ``"ans"``: a static-model asymmetric numeral systems coder from the
    ``constriction`` package (imported lazily; ``pip install constriction``).
    The bytes are split into ``symbol_bits``-wide symbols (1, 2, 4 or 8,
    least significant first, the layout of :mod:`lowbit.codecs.packing`, so
    2-bit codes are 2-bit symbols), the symbol histogram is stored in the
    output (counted), and the symbols are coded with the categorical model it
    defines: ``~ n * H`` bits plus the model and a few bytes of coder state.

* :class:`EntropyCodedCodec`: wraps any codec; its payload is the compressed
  wire form of the inner payload, so ``nbytes`` is the measured coded size.

Blob layout (little-endian): one method tag byte (``Z``, ``B``, ``L``, ``A``),
then for zlib/bz2/lzma the compressed stream; for ans ``<BIBH`` (symbol_bits
``b``, original byte count, count width ``w``, number ``k`` of listed
symbols), the histogram, then the ANS words (uint32). The histogram is dense
(``k = 2^b``: all counts, ``w`` bits each) or, when smaller, sparse (the ``k``
symbols with nonzero counts, ``b`` bits each, then their counts, ``w`` bits
each), packed with :func:`~lowbit.codecs.packing.pack_wide`; it is absent
(``w = 0``) for empty data.
"""

from __future__ import annotations

import bz2
import lzma
import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from .base import MAX_DECODE_NUMEL, Codec, Payload, PayloadError, check_flat, frame_header, header_size
from .packing import pack_wide, packed_nbytes, unpack_wide

__all__ = [
    "ENTROPY_METHODS",
    "empirical_entropy_bits",
    "entropy_code",
    "entropy_decode",
    "ans_overhead_nbytes",
    "EntropyCodedCodec",
    "ENTROPY_MAX_LENGTH",
]

ENTROPY_METHODS = ("zlib", "bz2", "lzma", "ans")
_TAGS = {"zlib": b"Z", "bz2": b"B", "lzma": b"L", "ans": b"A"}
_METHOD_OF_TAG = {v[0]: k for k, v in _TAGS.items()}
_SYMBOL_BITS = (1, 2, 4, 8)
_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]
_ANS_HEAD = "BIBH"  # symbol_bits, original byte count, count width w, listed symbols
#: :func:`entropy_decode`'s ``max_length`` when the caller gives none: 2^30 bytes (1 GiB, the
#: float32 values of :data:`~lowbit.codecs.base.MAX_DECODE_NUMEL` elements). A blob announcing
#: or expanding to more is refused before it is allocated; pass ``max_length`` to allow more.
ENTROPY_MAX_LENGTH = 4 * MAX_DECODE_NUMEL
#: ANS symbols decoded per call (the coder's output is int32 per symbol: decoding in chunks keeps
#: the transient at 16 MiB, whatever the blob's length)
_ANS_CHUNK = 1 << 22


def _corrupt(msg: str) -> PayloadError:
    """The error of a malformed blob: a PayloadError (a ValueError) whose message is ``msg``."""
    return PayloadError("entropy", "a blob made by entropy_code", "another", f"malformed entropy payload: {msg}")


def _check_method(method, field: str = "method") -> str:
    if method not in ENTROPY_METHODS:
        raise ValueError(f"{field} must be one of {ENTROPY_METHODS}, got {method!r}")
    return method


def _check_symbol_bits(symbol_bits) -> int:
    if isinstance(symbol_bits, bool) or symbol_bits not in _SYMBOL_BITS:
        raise ValueError(f"symbol_bits must be one of {_SYMBOL_BITS}, got {symbol_bits!r}")
    return int(symbol_bits)


def empirical_entropy_bits(codes) -> float:
    """Shannon entropy ``-sum p log2 p`` of the histogram of integer ``codes``
    (any shape, any integer dtype), in bits per symbol; 0.0 for an empty or
    constant tensor."""
    if isinstance(codes, np.ndarray):
        codes = torch.from_numpy(codes)
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be an integer torch.Tensor, got {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.numel() == 0:
        return 0.0
    _, counts = torch.unique(codes.reshape(-1), return_counts=True)
    p = counts.to(torch.float64) / codes.numel()
    return max(0.0, float(-(p * torch.log2(p)).sum()))


def _as_bytes(data) -> bytes:
    if isinstance(data, Payload):
        data = data.to_wire()
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"data must be a 1-D uint8 tensor, got {data.dtype} with shape {tuple(data.shape)}")
        return data.cpu().numpy().tobytes()
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"data must be a 1-D uint8 array, got {data.dtype} with shape {data.shape}")
        return data.tobytes()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"data must be a Payload, bytes or a 1-D uint8 tensor, got {type(data).__name__}")


def _constriction():
    try:
        import constriction  # noqa: PLC0415  (optional dependency, imported lazily)
    except ImportError as e:
        raise ImportError(
            "method='ans' needs the optional 'constriction' package (pip install constriction); "
            "the methods 'zlib', 'bz2' and 'lzma' need nothing extra"
        ) from e
    return constriction


def _ans_model(counts: np.ndarray):
    c = _constriction()
    return c.stream.model.Categorical(counts.astype(np.float64), perfect=False)


def _to_symbols(raw: bytes, b: int) -> np.ndarray:
    d = np.frombuffer(raw, dtype=np.uint8)
    if b == 8:
        return d.astype(np.int32)
    shifts = np.arange(0, 8, b, dtype=np.uint8)
    return ((d[:, None] >> shifts) & ((1 << b) - 1)).astype(np.int32).reshape(-1)


def _from_symbols(sym: np.ndarray, b: int) -> bytes:
    if b == 8:
        return sym.astype(np.uint8).tobytes()
    shifts = np.arange(0, 8, b, dtype=np.uint32)
    s = sym.astype(np.uint32).reshape(-1, 8 // b)
    return (s << shifts).sum(axis=1).astype(np.uint8).tobytes()


def _pack_model(counts: np.ndarray, b: int) -> tuple[int, int, bytes]:
    """``(w, listed, bytes)`` of the smaller histogram form: dense (all
    ``2^b`` counts, ``listed = 2^b``) or sparse (the ``listed`` symbols with a
    nonzero count, ``b`` bits each, then their counts)."""
    k = 1 << b
    w = int(counts.max()).bit_length()
    nz = np.flatnonzero(counts)
    dense_n = packed_nbytes(k, w)
    sparse_n = packed_nbytes(len(nz), b) + packed_nbytes(len(nz), w)
    if sparse_n < dense_n:
        body = pack_wide(torch.from_numpy(nz.astype(np.int64)), b).numpy().tobytes()
        body += pack_wide(torch.from_numpy(counts[nz]), w).numpy().tobytes()
        return w, len(nz), body
    return w, k, pack_wide(torch.from_numpy(counts), w).numpy().tobytes()


def _ans_encode(raw: bytes, symbol_bits: int) -> bytes:
    b = _check_symbol_bits(symbol_bits)
    if len(raw) > 2**32 - 1:
        raise ValueError(f"data of {len(raw)} bytes is too long for the ans header (uint32 length)")
    sym = _to_symbols(raw, b)
    if sym.size == 0:
        return _TAGS["ans"] + struct.pack("<" + _ANS_HEAD, b, 0, 0, 0)
    counts = np.bincount(sym, minlength=1 << b).astype(np.int64)
    w, listed, model = _pack_model(counts, b)
    coder = _constriction().stream.stack.AnsCoder()
    coder.encode_reverse(sym, _ans_model(counts))
    words = coder.get_compressed().astype("<u4").tobytes()
    return b"".join([_TAGS["ans"], struct.pack("<" + _ANS_HEAD, b, len(raw), w, listed), model, words])


def _ans_parse(blob: bytes):
    """``(symbol_bits, n_bytes, counts or None, words_offset)`` of an ans blob."""
    head = 1 + header_size(_ANS_HEAD)
    if len(blob) < head:
        raise _corrupt(f"ans blob of {len(blob)} bytes is shorter than its {head}-byte header")
    b, n_bytes, w, listed = struct.unpack_from("<" + _ANS_HEAD, blob, 1)
    if b not in _SYMBOL_BITS:
        raise _corrupt(f"corrupt ans blob: symbol width {b}, not one of {_SYMBOL_BITS}")
    k = 1 << b
    if w == 0:
        return b, n_bytes, None, head
    if w > 32 or not 1 <= listed <= k:
        raise _corrupt(f"corrupt ans blob: histogram width {w} or size {listed} out of range")

    def take(off: int, count: int, width: int) -> tuple[np.ndarray, int]:
        end = off + packed_nbytes(count, width)
        if len(blob) < end:
            raise _corrupt("corrupt ans blob: truncated histogram")
        buf = torch.frombuffer(bytearray(blob[off:end]), dtype=torch.uint8)
        return unpack_wide(buf, width, count).numpy(), end

    if listed == k:
        counts, end = take(head, k, w)
    else:
        symbols, off = take(head, listed, b)
        values, end = take(off, listed, w)
        counts = np.zeros(k, dtype=np.int64)
        counts[symbols] = values
    return b, n_bytes, counts, end


def ans_overhead_nbytes(blob: bytes) -> int:
    """Bytes of an ``"ans"`` blob that are not the ANS bit stream: tag, header
    and stored histogram (the model)."""
    blob = bytes(blob)
    if not blob or blob[:1] != _TAGS["ans"]:
        raise ValueError("not an 'ans' blob (wrong method tag)")
    return _ans_parse(blob)[3]


def _check_length(n: int, max_length: int, what: str) -> None:
    if n > max_length:
        raise _corrupt(f"{what} {n} bytes, more than max_length={max_length} (the most the receiver expects; "
                       f"default ENTROPY_MAX_LENGTH = {ENTROPY_MAX_LENGTH}): a corrupt or hostile blob")


def _ans_decode(blob: bytes, max_length: int = ENTROPY_MAX_LENGTH) -> bytes:
    b, n_bytes, counts, off = _ans_parse(blob)
    _check_length(n_bytes, max_length, "corrupt ans blob: it announces")
    if counts is None:
        if n_bytes:
            raise _corrupt(f"corrupt ans blob: {n_bytes} bytes announced but no histogram")
        return b""
    n_sym = n_bytes * 8 // b
    if int(counts.sum()) != n_sym:
        raise _corrupt(f"corrupt ans blob: histogram holds {int(counts.sum())} symbols, header says {n_sym}")
    if (len(blob) - off) % 4:
        raise _corrupt("corrupt ans blob: the ANS stream is not a whole number of 32-bit words")
    words = np.frombuffer(blob, dtype="<u4", offset=off).astype(np.uint32)
    model = _ans_model(counts)
    out = bytearray()
    try:
        coder = _constriction().stream.stack.AnsCoder(words)
        for start in range(0, n_sym, _ANS_CHUNK):  # chunks of whole bytes (_ANS_CHUNK is a multiple of 8)
            out += _from_symbols(np.asarray(coder.decode(model, min(_ANS_CHUNK, n_sym - start))), b)
    except (ValueError, RuntimeError) as e:  # constriction's own refusals of a malformed stream
        raise _corrupt(f"corrupt ans blob: {e}") from None
    if not coder.is_empty():
        raise _corrupt("corrupt ans blob: data left over after decoding")
    return bytes(out)


def entropy_code(data, method: str = "bz2", *, symbol_bits: int = 8) -> bytes:
    """Compress ``data`` (a :class:`Payload` -- its wire form --, bytes-like, or a
    1-D uint8 tensor/array) losslessly; returns self-describing bytes whose
    length is the real coded size. ``symbol_bits`` (1, 2, 4 or 8) is the
    symbol width of ``"ans"``; the other methods work on bytes and reject a
    value other than 8."""
    _check_method(method)
    raw = _as_bytes(data)
    if method == "ans":
        return _ans_encode(raw, symbol_bits)
    if symbol_bits != 8:
        raise ValueError(f"symbol_bits applies to method='ans' only, got symbol_bits={symbol_bits!r} with method={method!r}")
    if method == "zlib":
        body = zlib.compress(raw, 9)
    elif method == "bz2":
        body = bz2.compress(raw, 9)
    else:
        body = lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
    return _TAGS[method] + body


def _inflate(decompressor, body: bytes, max_length: int, method: str) -> bytes:
    """Run a zlib/bz2/lzma decompressor on ``body`` without ever producing more than
    ``max_length`` bytes (a decompression bomb is refused after max_length + 1); a stream that
    does not reach its end marker (truncated) or has bytes after it (extended) is refused."""
    out = decompressor.decompress(body, max_length + 1)
    _check_length(len(out), max_length, f"{method} blob expands to at least")
    if not decompressor.eof:
        raise _corrupt(f"corrupt {method} blob: the stream is truncated")
    if decompressor.unused_data:
        raise _corrupt(f"corrupt {method} blob: {len(decompressor.unused_data)} bytes after the end of the stream")
    return out


def entropy_decode(blob, method: str | None = None, *, max_length: int | None = None) -> bytes:
    """Inverse of :func:`entropy_code`. The method is read from the blob's tag;
    if ``method`` is given it must match. ``max_length``: the most bytes the
    caller expects (None: :data:`ENTROPY_MAX_LENGTH`, 2^30 bytes; pass a larger int to
    allow more); a blob that announces or expands to more is refused before more than
    ``max_length + 1`` bytes are produced (a peer's blob cannot force a large
    allocation: an ANS blob's announced length is checked before anything is
    allocated, and its symbols are decoded in chunks). Every malformed blob (a
    truncated or extended stream included) is a
    :class:`~lowbit.codecs.base.PayloadError`, a ValueError."""
    if max_length is None:
        max_length = ENTROPY_MAX_LENGTH
    elif isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0:
        raise ValueError(f"max_length must be an integer >= 0 or None, got {max_length!r}")
    blob = _as_bytes(blob)
    if not blob:
        raise _corrupt("cannot decode an empty blob: every entropy-coded blob starts with a method tag")
    found = _METHOD_OF_TAG.get(blob[0])
    if found is None:
        raise _corrupt(f"unknown method tag {blob[:1]!r}: not a blob made by entropy_code")
    if method is not None and _check_method(method) != found:
        raise _corrupt(f"method={method!r} but the blob was coded with {found!r}")
    body = blob[1:]
    if found == "ans":
        return _ans_decode(blob, max_length)
    try:
        if found == "zlib":
            return _inflate(zlib.decompressobj(), body, max_length, found)
        if found == "bz2":
            return _inflate(bz2.BZ2Decompressor(), body, max_length, found)
        d = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
        return _inflate(d, body, max_length, found)
    except (zlib.error, lzma.LZMAError, OSError, EOFError) as e:
        raise _corrupt(f"corrupt {found} blob: {e}") from None


@dataclass(frozen=True)
class EntropyCodedCodec(Codec):
    """Any codec followed by lossless entropy coding of its wire form.

    Header: none (0 bytes). Data: ``entropy_code(inner.encode(x).to_wire(),
    method)`` as uint8 -- the inner header is coded too, and the blob
    describes itself -- so ``nbytes`` is the measured coded size (which can
    exceed the inner size on incompressible data). ``decode(payload, ref=...,
    **kw)`` decompresses and calls ``inner.decode`` with the same arguments.

    ``symbol_bits`` (``"ans"`` only): the symbol width; None picks the inner
    codec's ``bits`` when it is 1, 2, 4 or 8, else 8 (bytes).
    ``max_decoded_nbytes``: the largest inner wire form the receiver expects
    (None: :data:`ENTROPY_MAX_LENGTH`); a payload that announces or expands to more is
    refused with a PayloadError before it is produced (see :func:`entropy_decode`), and the
    inner payload's frame is the inner codec's to check. ``kind`` and
    ``unbiased`` are the inner codec's; ``bits`` is the inner nominal width
    (an upper bound in spirit; the payload's ``nbytes`` is the truth).
    """

    inner: Codec
    method: str = "bz2"
    symbol_bits: int | None = None
    max_decoded_nbytes: int | None = None

    name = "entropy"
    header_format = ""

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Codec):
            raise ValueError(f"inner must be a Codec instance, got {type(self.inner).__name__}")
        _check_method(self.method)
        if self.symbol_bits is not None:
            if self.method != "ans":
                raise ValueError(f"symbol_bits applies to method='ans' only, got method={self.method!r}")
            object.__setattr__(self, "symbol_bits", _check_symbol_bits(self.symbol_bits))
        m = self.max_decoded_nbytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"max_decoded_nbytes must be an integer >= 0 or None, got {m!r}")

    @property
    def kind(self):  # type: ignore[override]
        return self.inner.kind

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.inner.unbiased

    @property
    def bits(self) -> float:
        return self.inner.bits

    @property
    def effective_symbol_bits(self) -> int:
        if self.symbol_bits is not None:
            return self.symbol_bits
        b = self.inner.bits
        return int(b) if isinstance(b, (int, float)) and math.isfinite(b) and b in _SYMBOL_BITS else 8

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        check_flat(x)
        inner = self.inner.encode(x, generator=generator)
        kw = {"symbol_bits": self.effective_symbol_bits} if self.method == "ans" else {}
        blob = entropy_code(inner, self.method, **kw)
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(x.device)
        return Payload(header=torch.empty(0, dtype=torch.uint8, device=x.device), data=data)

    def inner_payload(self, payload: Payload) -> Payload:
        """The inner codec's payload, decompressed (PayloadError for a malformed blob)."""
        frame_header(self, payload)
        raw = entropy_decode(payload.data, self.method, max_length=self.max_decoded_nbytes)
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return self.inner.payload_from_wire(buf.to(payload.data.device))

    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.inner.decode(self.inner_payload(payload), ref=ref, **kwargs)
