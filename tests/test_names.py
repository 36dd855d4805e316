"""One name and one default per concept (issue 30 part 4, 5; issue 31 part 4, codec side):
the codec registry computed from the classes' capabilities, one spelling across the codecs,
hooks and CLI (former spellings warned), one default ``bits`` per quantizer, typed hook options,
units parsed as written, options a method ignores refused on the CLI, settings that save
nothing refused or warned, and Bagua's ``model.with_bagua``."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
from torch import nn

from lowbit.algorithms import ALGORITHMS, from_options
from lowbit.algorithms.gossip import REPLICA_CODECS
from lowbit.cli import main
from lowbit.codecs import (CAPABILITIES, CODECS, REGISTERED, RENAMED, Codec, HalfCodec, QSGDMaxNormCodec, codec_name,
                           codec_names, make_codec)
from lowbit.comm import launch, run_threads
from lowbit.comm.netmodel import parse_bandwidth
from lowbit.integrations.ddp_hooks import HOOKS, LowbitHookState, make_hook, wire_method
from lowbit.integrations.ddp_hooks.names import RENAMED_HOOKS, hook_names
from lowbit.integrations.ddp_hooks.options import HookOptions, QSGDMaxNormHook, SignHook


# --- the registry, from the classes --------------------------------------------------------

def test_the_registry_is_the_classes_names():
    assert list(CODECS) == [cls.name for cls in REGISTERED] and len(set(CODECS)) == len(REGISTERED)
    for name, cls in CODECS.items():
        assert issubclass(cls, Codec)
        assert name == name.lower() and "_" not in name and " " not in name, "one spelling: lowercase, hyphens"
        for cap in ("summable", "gatherable", "float_wire", "replica_safe"):
            assert isinstance(getattr(cls, cap), bool), (name, cap)
        assert cls.kernel_family is None or isinstance(cls.kernel_family, str)


def test_capability_queries_compute_the_lists():
    assert REPLICA_CODECS == codec_names(replica_safe=True) and REPLICA_CODECS[0] == "minmax"
    assert set(codec_names(float_wire=True)) == {"fp32", "fp16"}
    assert set(codec_names(summable=True)) == {"qsgd-maxnorm", "qsgd-maxnorm-multiscale", "randk"}
    for name in codec_names(gatherable=True):  # a gatherable codec travels in a hook by all-gather
        cls = CODECS[name]
        codec = cls(**{"dithered": {"levels": 1}, "qsgd": {"levels": 1}, "uniform": {"step": 0.01}}.get(name, {}))
        assert wire_method(codec) == "allgather", name
    for cls in ALGORITHMS.values():  # every algorithm's explicit list names registered codecs
        assert set(cls.codecs) <= set(CODECS), cls.name
    with pytest.raises(ValueError, match="unknown capability colour; valid: " + ", ".join(CAPABILITIES)):
        codec_names(colour=True)
    with pytest.raises(ValueError, match="unknown codec"):
        codec_names("minmax", "half")


def test_a_side_information_codec_is_refused_naming_the_hookable_ones():
    with pytest.raises(ValueError, match="no DDP hook: supported are minmax, uniform, fp32, fp16"):
        wire_method(make_codec("modulo", bits=2, theta=0.5))


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_a_former_codec_spelling_warns_naming_the_new_one(old, new):
    with pytest.warns(DeprecationWarning, match=f"{old!r} is deprecated: use {new!r}"):
        assert codec_name(old) == new
    with pytest.warns(DeprecationWarning):
        assert type(make_codec(old)) is CODECS[new]
    with pytest.raises(ValueError, match="valid names: minmax, uniform"):
        codec_name("nope")


def test_an_algorithm_takes_the_former_codec_spelling_with_a_warning():
    with pytest.warns(DeprecationWarning, match="'half' is deprecated: use 'fp16'"):
        algo = from_options("choco", codec="half")
    assert algo == from_options("choco", codec="fp16") and algo.codec == HalfCodec()


def test_codec_defaults_are_the_fields():
    assert QSGDMaxNormCodec.default_options() == {"bits": 3, "norm": "l2", "bucket": None}
    assert HalfCodec.default_options() == {"dtype": "fp16"}


# --- one default bits per quantizer --------------------------------------------------------

def test_one_default_bits_for_the_max_norm_quantizer():
    """The codec, its hook and the algorithm (whose bits is the paper's precision, one less than
    the codec's bits) build the same quantizer by default: QSGD-MN 2."""
    codec = QSGDMaxNormCodec()
    assert codec.precision == 2
    assert ALGORITHMS["maxnorm"]().inner == codec
    assert make_hook("qsgd-maxnorm", bucket=None)[0].codec == codec
    assert make_hook("maxnorm", bucket=None)[0].codec == codec
    assert QSGDMaxNormHook().codec() == codec


# --- typed hook options --------------------------------------------------------------------

def test_hook_names_are_one_spelling():
    for name in hook_names():
        assert name == name.lower() and "_" not in name, name
    codec_hooks = set(HOOKS) - {"bf16"}  # bf16: the fp16 codec's other dtype, as torch names its hook
    assert codec_hooks <= set(CODECS) | {"grandk-fp32"}


def test_a_hook_option_it_does_not_take_is_named_with_those_it_takes():
    with pytest.raises(ValueError, match=r"hook 'sign' does not take option\(s\) bits; it takes: scale "):
        make_hook("sign", bits=2)
    with pytest.raises(ValueError, match=r"dtype \(set by the name 'bf16'\)"):
        make_hook("bf16", dtype="fp16")
    with pytest.raises(ValueError, match="bits must be an int in 2..32"):
        make_hook("qsgd-maxnorm", bits=1)
    with pytest.raises(ValueError, match="norm must be one of"):
        QSGDMaxNormHook(norm="l3")
    with pytest.raises(ValueError, match="give them to SignHook"):
        make_hook(SignHook(), scale="mean_abs")


def test_typed_options_are_dataclasses_with_the_codec_defaults():
    for cls, fixed in HOOKS.values():
        assert issubclass(cls, HookOptions) and dataclasses.is_dataclass(cls)
        opts = cls(**fixed)
        assert wire_method(opts.codec()) == make_hook(opts)[0].method
    state = make_hook(QSGDMaxNormHook(bits=5), seed=2)[0]
    assert state.codec == QSGDMaxNormCodec(bits=5, bucket=512) and state.seed == 2


@pytest.mark.parametrize("old", sorted(RENAMED_HOOKS))
def test_a_former_hook_name_warns_naming_the_new_one(old):
    new = RENAMED_HOOKS[old][0]
    with pytest.warns(DeprecationWarning, match=f"hook name {old!r} is deprecated: use {new!r}"):
        state = make_hook(old)[0]
    if RENAMED_HOOKS[old][1] is None:  # a plain rename: the same hook
        assert state.codec == make_hook(new)[0].codec


# --- settings that save nothing ------------------------------------------------------------

def test_sum_dtype_int16_is_refused():
    with pytest.raises(ValueError, match="sum_dtype=int16: neither gloo nor NCCL"):
        make_hook("maxnorm", sum_dtype="int16")
    assert make_hook("maxnorm", sum_dtype="int32")[0].sum_dtype == torch.int32


def _eight_bit_maxnorm(transport):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    out = {}
    for name, kw in (("saves", {}), ("int32", {"sum_dtype": "int32"})):
        model = DDP(nn.Linear(64, 64))
        state, hook = make_hook("maxnorm", bits=8, **kw)
        model.register_comm_hook(state, hook)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model(torch.randn(4, 64, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
        out[name] = ([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                     state.bytes_sent, state.fp32_bytes_sent)
    return out


def test_a_hook_that_saves_nothing_warns_once_with_the_reason():
    """8-bit max-norm codes summed unpacked in int32 take as many bytes as fp32: one warning,
    saying why; in the summable lanes (the default) the same codes cost less, and no warning."""
    res = launch(2, _eight_bit_maxnorm, timeout_s=120)[0]
    msgs, sent, fp32 = res["int32"]
    assert sent >= fp32 > 0 and len(msgs) == 1
    assert "saves nothing here" in msgs[0] and "as many bits per element as a float32" in msgs[0]
    msgs, sent, fp32 = res["saves"]
    assert sent < fp32 and msgs == []


# --- units and the CLI ---------------------------------------------------------------------

@pytest.mark.parametrize("text,bits", [("12.5MB/s", 1e8), ("12.5MB", 1e8), ("100Mbit/s", 1e8), ("100Mbps", 1e8),
                                       ("1Gbit/s", 1e9), ("1GB/s", 8e9), ("1MiB/s", 8 * 2**20), ("2Bps", 16),
                                       ("100 Mbit", 1e8), ("1Kibit", 1024)])
def test_bandwidth_units_as_written(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["12.5Mb/s", "12.5Mb", "10M", "1MBPS", "5 furlongs"])
def test_an_ambiguous_or_unknown_unit_is_refused_naming_the_valid_ones(text):
    with pytest.raises(ValueError, match="valid units are bit, bits, bit/s"):
        parse_bandwidth(text)


@pytest.mark.parametrize("argv,message", [
    (["--algorithm", "dpsgd", "--bits", "2"], "algorithm 'dpsgd' does not take option(s) bits"),
    (["--algorithm", "moniqua", "--rank", "2"], "algorithm 'moniqua' does not take option(s) powersgd_rank"),
    (["--bandwidth", "12.5Mb/s"], "unit 'Mb/s' is not understood"),
])
def test_the_cli_refuses_what_the_library_refuses(argv, message, capsys):
    assert main(["train", "--no-progress", "--steps", "1", "--workers", "2", *argv]) == 2
    assert message in capsys.readouterr().err


# --- Bagua ---------------------------------------------------------------------------------

def _bagua_bytes(t, hierarchical):
    import lowbit.bagua as bagua

    torch.manual_seed(0)
    m = nn.Linear(128, 64)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ddp = m.with_bagua([opt], bagua.LowPrecisionDecentralizedAlgorithm(hierarchical=hierarchical, node_size=2),
                       transport=t)
    sent = []
    for _ in range(3):
        m(torch.randn(4, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
        sent.append(ddp.bytes_sent)
    ddp.close()
    return type(ddp).__name__, sent[-1] - sent[-2]


def _bagua_run(hierarchical):
    """Rank 0's (wrapper class, bytes of a step) and the hierarchical warnings of both ranks:
    recorded around the whole threaded run (``warnings.catch_warnings`` is process-wide, so
    two threads recording at once would take each other's warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_threads(2, functools.partial(_bagua_bytes, hierarchical=hierarchical))[0]
    return (*res, [str(w.message) for w in caught if "hierarchical=True" in str(w.message)])


def test_with_bagua_is_a_method_and_warns_when_hierarchical_on_one_node_costs_fp32():
    (kind, hier_bytes, hier_warn), (_, flat_bytes, flat_warn) = _bagua_run(True), _bagua_run(False)
    assert kind == "DecentralizedDataParallel"
    assert len(hier_warn) == 2 and "hierarchical=False" in hier_warn[0] and flat_warn == []  # once per rank
    n = sum(p.numel() for p in nn.Linear(128, 64).parameters())
    assert hier_bytes == 4 * n  # fp32 inside the node: a ring all-reduce of 2 ranks sends the model once
    assert 2 * n <= flat_bytes < 2 * n * 1.01  # 8 bits to each of the two ring neighbours, and headers
