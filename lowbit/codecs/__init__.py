"""Codecs: flat float tensor -> wire payload (real, packed bytes) -> tensor::

    codec = make_codec("qsgd-maxnorm", bits=3)        # or QSGDMaxNormCodec(bits=3)
    payload = codec.encode(x, generator=g)            # payload.nbytes: what travels
    x_hat = codec.decode(payload)

The registry (:data:`CODECS`) is computed from :data:`REGISTERED`, one line per codec class;
each class declares its name and capabilities (:class:`Codec`), from which the lists elsewhere
are computed (:func:`codec_names`: the replica baselines' codecs, the DDP hooks' wire methods).

Names. One spelling per codec and algorithm, the same in the registry, the DDP hooks, the CLI
(``--codec``, ``--algorithm``) and the docs: lowercase, words joined by hyphens
(``qsgd-maxnorm``, ``bagua-minmax``, ``grandk-maxnorm``). Former spellings (:data:`RENAMED`:
``half``, ``qsgd_maxnorm``...) still work, with a DeprecationWarning naming the current one.
A new codec usable everywhere: its module (the class, its name and capabilities), its kernels
(:mod:`lowbit.codecs.kernels`), and one line of :data:`REGISTERED`.
"""

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

#: The registry, one line per codec class; each class declares its name and capabilities
#: (:class:`Codec`). The order is the listing order (the replica baselines' list starts with it).
REGISTERED: tuple[type[Codec], ...] = (
    MinMaxCodec,
    UniformCodec,
    IdentityCodec,
    HalfCodec,
    SignCodec,
    TernGradCodec,
    ModuloCodec,
    DitheredCodec,
    NestedDitheredCodec,
    QSGDCodec,
    PowerSGDCodec,
    EntropyCodedCodec,
    QSGDMaxNormCodec,
    MultiScaleMaxNormCodec,
    RandKCodec,
    BaguaMinMaxCodec,
)

#: name -> codec class, computed from :data:`REGISTERED`
CODECS: dict[str, type[Codec]] = {cls.name: cls for cls in REGISTERED}

#: Former spellings: accepted with a DeprecationWarning naming the current name
RENAMED = {"half": "fp16", "qsgd_maxnorm": "qsgd-maxnorm", "qsgd_maxnorm_multiscale": "qsgd-maxnorm-multiscale",
           "bagua_minmax": "bagua-minmax"}

#: The capabilities a codec class declares, which :func:`codec_names` selects on
CAPABILITIES = ("summable", "gatherable", "float_wire", "replica_safe", "kernel_family")


def codec_name(name: str) -> str:
    """The registry name ``name`` (lowercase, words joined by hyphens: ``qsgd-maxnorm``); a former
    spelling of :data:`RENAMED` gives the current one with a DeprecationWarning naming it; a
    ValueError naming the valid names otherwise."""
    if name in CODECS:
        return name
    if name in RENAMED:
        import warnings

        warnings.warn(f"codec name {name!r} is deprecated: use {RENAMED[name]!r}", DeprecationWarning, stacklevel=3)
        return RENAMED[name]
    raise ValueError(f"unknown codec {name!r}; valid names: {', '.join(CODECS)}")


def codec_names(*among: str, **capabilities) -> tuple[str, ...]:
    """Registry names, in registry order, of the codecs whose classes declare every given
    capability with the given value (e.g. ``codec_names(replica_safe=True)``; names of
    :data:`CAPABILITIES`); ``among``: only these names (checked: a ValueError for one that is
    not registered), in the order given. No arguments: every name."""
    unknown = sorted(set(capabilities) - set(CAPABILITIES))
    if unknown:
        raise ValueError(f"unknown capability {', '.join(unknown)}; valid: {', '.join(CAPABILITIES)}")
    bad = [n for n in among if n not in CODECS]
    if bad:
        raise ValueError(f"unknown codec(s) {', '.join(map(repr, bad))}; valid names: {', '.join(CODECS)}")
    return tuple(n for n in (among or CODECS)
                 if all(getattr(CODECS[n], k) == v for k, v in capabilities.items()))


def make_codec(name: str, **kwargs) -> Codec:
    """Build a registered codec by name, e.g. ``make_codec("modulo", bits=2, theta=0.5)``."""
    return CODECS[codec_name(name)](**kwargs)


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
    "REGISTERED",
    "RENAMED",
    "CAPABILITIES",
    "codec_name",
    "codec_names",
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
    "BaguaMinMaxCodec",
]
