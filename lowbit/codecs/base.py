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

from .lanes import Lanes
from .rng import clone_generator


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
            raise PayloadError("wire", f"at least the {header_nbytes}-byte header", f"a buffer of {buf.numel()} bytes")
        return Payload(header=buf[:header_nbytes], data=buf[header_nbytes:])


class PayloadError(ValueError):
    """A payload that no encode of this codec could have produced: a header of the wrong size,
    an element count other than the receiver expects (or beyond what it can hold), data of the
    wrong length, a scale that is not finite or outside the codec's range, codes outside their
    levels. Every codec's ``decode`` raises it (and only it, for a malformed frame) before it
    allocates for or reads the data, so a peer's bytes never drive an out-of-bounds read or a
    huge allocation. A subclass of ValueError. ``codec``: the codec's name; ``expected``/``got``:
    what the frame had to hold and what came; a receiver that knows who sent the payload catches
    it and names the sender."""

    def __init__(self, codec: str, expected: str, got: str, message: str | None = None):
        self.codec, self.expected, self.got = codec, expected, got
        super().__init__(message or f"malformed {codec} payload: expected {expected}, got {got}")


#: Without ``numel=``, the most elements a decode allocates for where the payload's length does
#: not bound the count its header announces (random-k's scatter, PowerSGD's product); also,
#: in bytes times 4, :func:`lowbit.codecs.entropy.entropy_decode`'s default ``max_length``. A
#: receiver that knows the count passes ``numel=`` (exact) instead.
MAX_DECODE_NUMEL = 1 << 28


def _codec_name(codec) -> str:
    return codec if isinstance(codec, str) else getattr(codec, "name", type(codec).__name__)


def frame_header(codec, payload: "Payload", fmt: str | None = None) -> tuple:
    """The fields of ``payload``'s header (struct format ``fmt``, default the codec's
    ``header_format``), after checking it has exactly that format's size (PayloadError)."""
    fmt = codec.header_format if fmt is None else fmt
    need = header_size(fmt)
    got = payload.header.numel()
    if got != need:
        raise PayloadError(_codec_name(codec), f"a {need}-byte header", f"{got} bytes")
    return struct.unpack("<" + fmt, payload.header.cpu().numpy().tobytes())


def check_numel_arg(numel) -> int | None:
    """A decode's ``numel=`` argument: None or an int >= 0 (ValueError naming ``numel``)."""
    if numel is not None and (isinstance(numel, bool) or not isinstance(numel, int) or numel < 0):
        raise ValueError(f"numel must be an int >= 0 (the element count the receiver expects) or None, got {numel!r}")
    return numel


def frame_count(codec, n: int, numel: int | None = None, *, bounded: bool = True,
                ref: torch.Tensor | None = None) -> int:
    """The element count ``n`` a header announces, checked: ``>= 0``; equal to ``numel`` when the
    caller gives it (the count the receiver expects), else to ``ref``'s length when there is a
    ``ref`` (a side-information decode's); without either, at most :data:`MAX_DECODE_NUMEL`
    where the payload's length does not bound it (``bounded=False``). PayloadError otherwise."""
    if check_numel_arg(numel) is not None and n != numel:
        raise PayloadError(_codec_name(codec), f"{numel} elements (numel=, the count the receiver expects)",
                           f"a header announcing {n}")
    if numel is None and isinstance(ref, torch.Tensor) and n != ref.numel():
        raise PayloadError(_codec_name(codec), f"{ref.numel()} elements (the length of ref, the receiver's "
                           "reference)", f"a header announcing {n}")
    if n < 0:
        raise PayloadError(_codec_name(codec), "an element count >= 0", f"a header announcing {n}")
    if not bounded and numel is None and n > MAX_DECODE_NUMEL:
        raise PayloadError(_codec_name(codec), f"at most MAX_DECODE_NUMEL = {MAX_DECODE_NUMEL} elements "
                           "(pass numel= to decode more)", f"a header announcing {n}")
    return n


def frame_nbytes(codec, data: torch.Tensor, need: int, what) -> torch.Tensor:
    """``data`` holds exactly ``need`` bytes, the size of ``what`` (e.g. "1000 codes of 2 bits", or
    a callable returning it: formatted only for the error); PayloadError otherwise."""
    if data.numel() != need:
        name = _codec_name(codec)
        what = what() if callable(what) else what
        raise PayloadError(name, f"{need} data bytes for {what}", f"{data.numel()}",
                           f"malformed {name} payload: {what} need exactly {need} data bytes, got {data.numel()}")
    return data


def frame_counted(codec, payload: "Payload", numel: int | None, nbytes, what, *, ref: torch.Tensor | None = None,
                  ref_needs: str | None = None) -> int:
    """The count ``n`` of a payload whose header holds only it, the frame checked: the header,
    :func:`frame_count` (``numel``, ``ref``), ``ref`` by :func:`check_ref` when ``ref_needs`` is
    given, then ``nbytes(n)`` data bytes, the size of ``what(n)`` (:func:`frame_nbytes`)."""
    (n,) = frame_header(codec, payload)
    frame_count(codec, n, numel, ref=ref)
    if ref_needs is not None:
        check_ref(ref, n, ref_needs)
    frame_nbytes(codec, payload.data, nbytes(n), lambda: what(n))
    return n


def frame_scale(codec, value: float, field: str, limit: float, low: float = 0.0) -> float:
    """A scale a header carries: finite and in ``[low, limit]`` (the values the codec's encode
    sends); PayloadError naming ``field`` otherwise. A NaN fails every comparison."""
    if not low <= value <= limit:
        raise PayloadError(_codec_name(codec), f"{field} in [{low:.9g}, {limit:.9g}]", f"{value!r}")
    return value


def frame_scales(codec, values: torch.Tensor, field: str, limit: float, low: float = 0.0) -> float:
    """:func:`frame_scale` for a tensor of scales (one reduction, one host read); returns the
    largest (0.0 for none). A NaN makes both ends NaN, which fails the check."""
    if not values.numel():
        return 0.0
    lo, hi = torch.aminmax(values.to(torch.float64))
    lo, hi = float(lo), float(hi)
    if not (low <= lo and hi <= limit):
        bad = values[~((values >= low) & (values <= limit))][0]
        raise PayloadError(_codec_name(codec), f"every {field} in [{low:.9g}, {limit:.9g}]", f"{float(bad)!r}")
    return hi


#: A scale above this (half float32's largest value) gets its decode's output checked: a lying
#: payload's code a level past the top (bit-packed codes of 127, 255 or > 2^16 levels can hold one)
#: times such a scale can pass float32's largest value.
NEAR_F32_MAX = float(torch.finfo(torch.float32).max) / 2


def frame_output(codec, out: torch.Tensor, scale_max: float) -> torch.Tensor:
    """``out``, a decode's output, after checking it is finite when ``scale_max`` (the largest
    scale the frame carried) is above :data:`NEAR_F32_MAX` (one pass, only then); PayloadError
    otherwise: codes beyond their levels."""
    if scale_max > NEAR_F32_MAX and out.numel() and not bool(torch.isfinite(out).all()):
        raise PayloadError(_codec_name(codec), "codes within their levels (a finite decode)",
                           f"codes beyond them: a decode past float32 with a scale of {scale_max:.6g}")
    return out


def pack_header(fmt: str, *values, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pack scalar header fields with a ``struct`` format (little-endian) into uint8."""
    raw = struct.pack("<" + fmt, *values)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def unpack_header(fmt: str, header: torch.Tensor) -> tuple:
    """Inverse of :func:`pack_header`."""
    return struct.unpack("<" + fmt, bytes(header.cpu().numpy().tobytes()))


def header_size(fmt: str) -> int:
    """Bytes of a little-endian struct header of format ``fmt``."""
    return struct.calcsize("<" + fmt)


class Codec(ABC):
    """Base class of every codec.

    Subclasses are frozen dataclasses and set the class attributes below.
    Each also provides ``bits``, the nominal number of bits per element of the
    data part, as a dataclass field or a property. (It is declared here by
    annotation only: a class attribute would become the default of a
    subclass's ``bits`` field.) Its default options are its dataclass field defaults
    (:meth:`default_options`): the one default of each option, read by every entry point.

    Capabilities, declared by each class, from which the registries are computed
    (:func:`lowbit.codecs.codec_names`, the DDP hooks' wire methods, the gossip baselines'
    codec list): ``name`` (the registry name, lowercase with hyphens), ``summable`` (integer
    codes that a SUM all-reduce adds: :class:`SummableCodec`), ``gatherable`` (the payload's
    length depends on the input's length only, so ranks' payloads can be all-gathered),
    ``float_wire`` (the wire is the values as floats: a plain float all-reduce carries it),
    ``replica_safe`` (a neighbour can keep an exact replica of what it decodes: the replica
    baselines CHOCO, DCD, DeepSqueeze) and ``kernel_family`` (the family of
    :func:`~lowbit.codecs.kernels.kernels_for` its fast path calls; None: none of its own).
    """

    bits: float

    name: str = "codec"
    kind: CodecKind = CodecKind.PLAIN
    unbiased: bool = False
    header_format: str = ""  # struct format of the fixed header
    dither_on_decode: bool = False  # decode regenerates the sender's dither (needs ``generator``)
    summable: bool = False
    gatherable: bool = False
    float_wire: bool = False
    replica_safe: bool = False
    kernel_family: str | None = None

    @classmethod
    def default_options(cls) -> dict:
        """The codec's options and their defaults (its dataclass fields; a field without a
        default is left out)."""
        import dataclasses

        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    @classmethod
    def from_options(cls, opts) -> "Codec":
        """This codec as ``--codec NAME`` builds it from the options ``opts`` (an
        ``AlgorithmOptions``: ``bits``, ``rounding``, ``delta``...); by default with no
        argument. A codec that needs arguments overrides it."""
        return cls()

    @property
    def header_nbytes(self) -> int:
        """Bytes of the fixed header."""
        return header_size(self.header_format)

    @abstractmethod
    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Payload:
        """Encode a flat floating-point tensor."""

    @abstractmethod
    def decode(self, payload: Payload, *, ref: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Decode. ``ref``: the receiver's reference, for side-information codecs.
        ``generator``: for codecs whose ``dither_on_decode`` is True, a generator
        seeded as the sender's was for this message (shared randomness), not yet
        drawn from; other codecs ignore it. ``numel`` (every codec's decode takes it):
        the element count the receiver expects, checked against the header.

        Every decode checks the frame before it allocates for or reads the data: the
        header's size, the count (against ``numel``, or what the data's length allows),
        the data's length, the scales (finite, in the range encode sends); a frame that
        fails is a :class:`PayloadError` naming the codec."""

    def roundtrip(self, x: torch.Tensor, *, generator=None, ref=None) -> torch.Tensor:
        """``decode(encode(x))``; a codec with ``dither_on_decode`` decodes with a copy
        of ``generator`` taken before encoding, as a receiver would regenerate it."""
        receiver = clone_generator(generator) if self.dither_on_decode and generator is not None else None
        return self.decode(self.encode(x, generator=generator), ref=ref, generator=receiver)

    def payload_from_wire(self, buf: torch.Tensor) -> Payload:
        """The payload a transport's buffer carries: ``header || data`` split at the header's size
        (PayloadError naming the codec when the buffer is shorter)."""
        if isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1 \
                and buf.numel() < self.header_nbytes:
            raise PayloadError(self.name, f"at least the {self.header_nbytes}-byte header",
                               f"a buffer of {buf.numel()} bytes")
        return Payload.from_wire(buf, self.header_nbytes)


def check_ref(ref: torch.Tensor | None, n: int, needs: str) -> None:
    """A side-information decode's reference: present, flat, floating, ``n`` long.
    ``needs`` says what the codec expects of it (shown when it is missing)."""
    if ref is None:
        raise ValueError(f"decode needs ref= ({needs})")
    check_flat(ref, "ref")
    if ref.numel() != n:
        raise ValueError(f"ref must have the payload's {n} elements, got shape {tuple(ref.shape)}")


def check_flat(x: torch.Tensor, arg: str = "x") -> None:
    """Raise a TypeError or ValueError naming ``arg`` unless ``x`` is a 1-D floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{arg} must be a flat (1-D) tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{arg} must be a floating-point tensor, got {x.dtype}")


# --- summable codecs: integer codes that many workers add up (all-reduce) --------------

SCALE_REDUCE_OPS = ("max", "min")
SUM_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def check_world_size(world_size) -> int:
    """``world_size`` must be an int (not bool) >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return world_size


class SummableCodec(Codec):
    """A codec whose integer codes from many workers may be summed before one decode.

    Protocol for ``M`` workers holding flat tensors ``x_1..x_M`` of one length:

    1. Agree on the scale, one all-reduce per round ``r = 0, 1, ...``: worker ``m``
       contributes ``codec.shared_scale(x_m, agreed)`` (``agreed``: the tuple of the
       previous rounds' results) and everyone receives the element-wise
       ``codec.scale_reduce_ops[r]`` (``"max"`` or ``"min"``) over the workers.
       ``scale`` below is the agreed tensor when there is one round and the tuple of
       the agreed tensors otherwise (:func:`agree_scale` is the in-process version).
    2. Each worker computes ``q_m = codec.encode_int(x_m, scale, generator)`` (int64, or
       ``dtype=codec.sum_dtype(M)`` directly) and the workers sum them (all-reduce SUM) in
       ``codec.sum_dtype(M)``, which is wide enough that the sum cannot overflow.
    3. Everyone computes ``codec.decode_sum(sum, scale, M)``: the AVERAGE of the
       ``M`` decodes, from the integer sum alone.

    ``encode``/``decode`` remain the single-message form: with ``scale=`` given, a
    payload carries exactly ``encode_int``'s codes and the agreed scale in its header.
    ``max_code`` bounds ``|code|``; :meth:`sum_dtype` follows from it.
    """

    summable = True


    kind: CodecKind = CodecKind.SUMMABLE
    scale_reduce_ops: tuple[str, ...] = ("max",)

    @property
    def scale_reduce_op(self) -> str:
        """How the first (for most codecs the only) scale round is combined: ``"max"`` or ``"min"``."""
        return self.scale_reduce_ops[0]

    @property
    @abstractmethod
    def max_code(self) -> int:
        """The largest ``|code|`` that :meth:`encode_int` can produce."""

    @abstractmethod
    def shared_scale(self, x: torch.Tensor, agreed: tuple = ()) -> torch.Tensor:
        """This worker's statistic for scale round ``len(agreed)``."""

    @abstractmethod
    def encode_int(self, x: torch.Tensor, scale, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The integer codes of ``x`` against the agreed ``scale``, as ``dtype`` (int64 by
        default; a signed integer dtype holding ``+-max_code``, checked by :meth:`code_dtype`,
        e.g. the sum dtype: no int64 codes to convert)."""

    def code_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """``dtype`` for :meth:`encode_int`'s codes: a signed integer dtype whose range holds
        ``+-max_code``; otherwise a ValueError naming ``dtype``."""
        if not isinstance(dtype, torch.dtype) or dtype not in SUM_DTYPES or torch.iinfo(dtype).max < self.max_code:
            fit = [d for d in SUM_DTYPES if torch.iinfo(d).max >= self.max_code]
            raise ValueError(f"dtype must be a signed integer dtype holding codes up to +-{self.max_code} "
                             f"({', '.join(map(str, fit))}), got {dtype!r}")
        return dtype

    @abstractmethod
    def decode_sum(self, int_sum: torch.Tensor, scale, world_size: int, *, numel: int | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The average of the ``world_size`` workers' decodes, from the sum of their codes.
        ``numel``: the decoded length, needed only by codecs whose codes are shorter than
        the input (random-k); ``dtype``: float32 unless given."""

    @abstractmethod
    def scale_nbytes(self, numel: int) -> int:
        """Bytes one worker contributes to the scale rounds for an input of ``numel`` elements."""

    def sum_dtype(self, world_size: int, dtype: torch.dtype | None = None) -> torch.dtype:
        """The narrowest of int8/int16/int32/int64 that holds the sum of ``world_size`` codes
        (any codes: ``world_size * max_code`` in magnitude). With ``dtype`` given, check that
        it is wide enough and return it. Raises ValueError when it (or int64) is too narrow."""
        m = check_world_size(world_size)
        need = m * self.max_code
        if dtype is not None:
            if dtype not in SUM_DTYPES:
                raise ValueError(f"dtype must be one of {[str(d) for d in SUM_DTYPES]}, got {dtype}")
            if need > torch.iinfo(dtype).max:
                raise ValueError(
                    f"dtype={dtype} would overflow: the sum of world_size={m} codes of bits={self.bits} "
                    f"can reach {need} > {torch.iinfo(dtype).max}; use {_narrowest_holding(need)}"
                )
            return dtype
        for d in SUM_DTYPES:
            if need <= torch.iinfo(d).max:
                return d
        raise ValueError(
            f"bits={self.bits} with world_size={m}: the sum of codes can reach {need}, which does not "
            f"fit int64 (max {torch.iinfo(torch.int64).max}); use fewer bits or fewer workers"
        )


    def sum_lanes(self, world_size: int, dtype: torch.dtype | None = None, *,
                  plain: torch.dtype | None = None) -> Lanes | None:
        """The summable lanes (:class:`~lowbit.codecs.lanes.Lanes`: the codes of ``world_size``
        workers packed into int64 words that one SUM all-reduce adds exactly) when they take
        fewer bits per element than the plain sum, else None. ``dtype``: a sum dtype the
        caller asked for (checked as :meth:`sum_dtype` does); then the codes travel in it,
        unpacked, and this is None. ``plain``: the dtype the codes would otherwise be summed
        in (default ``sum_dtype(world_size)``; a transport without int16 widens it). Whether
        the lanes pay for a given number of codes: :meth:`Lanes.pays` ``(plain, numel)``."""
        narrowest = self.sum_dtype(world_size, dtype)
        if dtype is not None or 2 * world_size * self.max_code + 1 > torch.iinfo(torch.int64).max:
            return None
        lanes = Lanes(self.max_code, world_size)
        return lanes if lanes.pays(narrowest if plain is None else plain) else None


def _narrowest_holding(need: int) -> str:
    for d in SUM_DTYPES:
        if need <= torch.iinfo(d).max:
            return str(d)
    return "fewer bits or fewer workers (not even int64 holds it)"


def is_summable(codec: Codec) -> bool:
    """True when ``codec`` implements :class:`SummableCodec` and its kind is SUMMABLE
    (a wrapper such as random-k is summable only for some configurations)."""
    return isinstance(codec, SummableCodec) and codec.kind is CodecKind.SUMMABLE


def reduce_scale(op: str, stats) -> torch.Tensor:
    """Element-wise ``op`` (``"max"``/``"min"``) over the workers' statistics: what the
    scale all-reduce computes."""
    if op not in SCALE_REDUCE_OPS:
        raise ValueError(f"op must be one of {SCALE_REDUCE_OPS}, got {op!r}")
    stats = list(stats)
    if not stats:
        raise ValueError("stats must hold at least one worker's statistic")
    s = torch.stack(stats)
    return s.amax(0) if op == "max" else s.amin(0)


def agree_scale(codec: SummableCodec, xs):
    """In-process stand-in for the scale all-reduce rounds over the workers' inputs ``xs``:
    the agreed tensor (one round) or tuple of agreed tensors (several rounds)."""
    if not is_summable(codec):
        raise ValueError(f"{type(codec).__name__} is not summable (kind {codec.kind.value})")
    xs = list(xs)
    agreed: list[torch.Tensor] = []
    for op in codec.scale_reduce_ops:
        agreed.append(reduce_scale(op, [codec.shared_scale(x, tuple(agreed)) for x in xs]))
    return agreed[0] if len(agreed) == 1 else tuple(agreed)
