"""Codecs: flat float tensor -> wire payload (real, packed bytes) -> tensor."""

from __future__ import annotations

from .base import (MAX_DECODE_NUMEL, Codec, CodecKind, Payload, PayloadError, SummableCodec, agree_scale, check_flat,
                   header_size, is_summable, pack_header, unpack_header)
from .identity import IdentityCodec
from .minmax import MinMaxCodec
from .modulo import ModuloCodec, centered_mod
from .packing import pack_bits, pack_wide, packed_nbytes, unpack_bits, unpack_wide
from .quantize import ROUNDINGS, error_bound, round_to_int
from .rng import clone_generator, derive_seed, make_generator, shared_generator
from .uniform import UniformCodec
from .dithered import DitheredCodec
from .entropy import ENTROPY_METHODS, EntropyCodedCodec, empirical_entropy_bits, entropy_code, entropy_decode
from .lowp import HalfCodec
from .maxnorm import MultiScaleMaxNormCodec, QSGDMaxNormCodec
from .randk import RandKCodec, global_index_seed
from .nested import NestedDitheredCodec, choose_nested_parameters
from .powersgd import PowerSGDCodec
from .qsgd import QSGDCodec
from .sign import SignCodec
from .terngrad import TernGradCodec
from .bagua_minmax import BaguaMinMaxCodec

CODECS: dict[str, type[Codec]] = {
    "fp32": IdentityCodec,
    "uniform": UniformCodec,
    "minmax": MinMaxCodec,
    "modulo": ModuloCodec,
    "dithered": DitheredCodec,
    "nested": NestedDitheredCodec,
    "qsgd": QSGDCodec,
    "terngrad": TernGradCodec,
    "sign": SignCodec,
    "half": HalfCodec,
    "powersgd": PowerSGDCodec,
    "entropy": EntropyCodedCodec,
    "qsgd_maxnorm": QSGDMaxNormCodec,
    "qsgd_maxnorm_multiscale": MultiScaleMaxNormCodec,
    "randk": RandKCodec,
    "bagua_minmax": BaguaMinMaxCodec,
}


def make_codec(name: str, **kwargs) -> Codec:
    """Build a registered codec by name, e.g. ``make_codec("modulo", bits=2, theta=0.5)``."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; valid names: {sorted(CODECS)}")
    return CODECS[name](**kwargs)


__all__ = [
    "Codec",
    "CodecKind",
    "Payload",
    "PayloadError",
    "MAX_DECODE_NUMEL",
    "check_flat",
    "header_size",
    "pack_header",
    "unpack_header",
    "IdentityCodec",
    "UniformCodec",
    "MinMaxCodec",
    "ModuloCodec",
    "centered_mod",
    "CODECS",
    "make_codec",
    "pack_bits",
    "unpack_bits",
    "pack_wide",
    "unpack_wide",
    "packed_nbytes",
    "ROUNDINGS",
    "round_to_int",
    "error_bound",
    "derive_seed",
    "make_generator",
    "shared_generator",
    "clone_generator",
    "DitheredCodec",
    "NestedDitheredCodec",
    "choose_nested_parameters",
    "QSGDCodec",
    "TernGradCodec",
    "SignCodec",
    "HalfCodec",
    "PowerSGDCodec",
    "EntropyCodedCodec",
    "ENTROPY_METHODS",
    "empirical_entropy_bits",
    "entropy_code",
    "entropy_decode",
    "SummableCodec",
    "agree_scale",
    "is_summable",
    "QSGDMaxNormCodec",
    "MultiScaleMaxNormCodec",
    "RandKCodec",
    "global_index_seed",
]
