"""Hostile bytes (issue 13): random and mutated input to the entropy decoder, every codec's
decode and Moniqua's frame parser raises ValueError and nothing else, within bounded memory."""

from __future__ import annotations

import random
import struct
import tracemalloc
import zlib

import pytest
import torch

from lowbit.codecs import (EntropyCodedCodec, HalfCodec, IdentityCodec, MinMaxCodec, ModuloCodec, QSGDCodec,
                           QSGDMaxNormCodec, SignCodec, TernGradCodec, UniformCodec)
from lowbit.codecs.entropy import ENTROPY_METHODS, entropy_code, entropy_decode

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LIMIT = 4096


def _only_value_error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ENTROPY_METHODS), st.binary(max_size=600), st.integers(0, 2000))
def test_entropy_decode_random_bytes(method, body, limit):
    blob = {"zlib": b"Z", "bz2": b"B", "lzma": b"L", "ans": b"A"}[method] + body
    try:
        out = entropy_decode(blob, max_length=limit)
    except ValueError:
        return
    assert len(out) <= limit


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ENTROPY_METHODS), st.binary(min_size=1, max_size=300), st.data())
def test_entropy_decode_mutated_blobs(method, raw, data):
    blob = bytearray(entropy_code(raw, method))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        out = entropy_decode(bytes(blob), max_length=len(raw))
    except ValueError:
        return
    assert len(out) <= len(raw)


@pytest.mark.parametrize("method", ["zlib", "bz2", "lzma"])
def test_decompression_bombs_are_refused_within_bounded_memory(method):
    blob = entropy_code(bytes(50_000_000), method)  # 50 MB of zeros in a few kB
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="more than max_length"):
            entropy_decode(blob, max_length=LIMIT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # bounded by the decoder's own working memory, not by what the blob expands to (50 MB):
    # LZMA preset 6 keeps an 8 MiB dictionary
    assert peak < (9_500_000 if method == "lzma" else 1_000_000)


def test_an_ans_blob_claiming_2_to_the_32_symbols_is_refused_before_decoding():
    blob = b"A" + struct.pack("<BIBH", 8, 2**32 - 1, 32, 1) + bytes([0]) + struct.pack("<I", 2**32 - 1)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="announces 4294967295 bytes"):
            entropy_decode(blob, max_length=LIMIT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


CODECS = [
    pytest.param(IdentityCodec(), id="fp32"), pytest.param(UniformCodec(step=0.1), id="uniform"),
    pytest.param(MinMaxCodec(bits=4), id="minmax"), pytest.param(ModuloCodec(bits=2, theta=0.5), id="modulo"),
    pytest.param(QSGDCodec(levels=4), id="qsgd"), pytest.param(TernGradCodec(), id="terngrad"),
    pytest.param(SignCodec(), id="sign"), pytest.param(HalfCodec(), id="half"),
    pytest.param(QSGDMaxNormCodec(bits=3), id="qsgd_maxnorm"),
    pytest.param(EntropyCodedCodec(MinMaxCodec(bits=4), "zlib", max_decoded_nbytes=LIMIT), id="entropy-zlib"),
    pytest.param(EntropyCodedCodec(MinMaxCodec(bits=4), "ans", max_decoded_nbytes=LIMIT), id="entropy-ans"),
]


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_decode_raises_only_value_error(codec):
    rng = random.Random(1234)
    x = torch.randn(64)
    wire = bytes(codec.encode(x, generator=torch.Generator().manual_seed(0)).to_wire().numpy().tobytes())
    for _ in range(300):
        b = bytearray(wire)
        r = rng.random()
        if r < 0.3:
            b = bytearray(rng.randbytes(rng.randrange(0, 2 * len(b) + 2)))
        elif r < 0.6:
            for _ in range(rng.randrange(1, 4)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
        elif r < 0.8:
            b = b[:rng.randrange(len(b) + 1)]
        else:
            b += rng.randbytes(rng.randrange(1, 10))
        buf = torch.frombuffer(b, dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)

        def decode():
            codec.decode(codec.payload_from_wire(buf), ref=x)

        _only_value_error(decode)


def _moniqua(entropy=None):
    from lowbit.algorithms.moniqua import Moniqua
    from lowbit.comm.inprocess import ThreadWorld
    from lowbit.topology import make_topology

    worker = Moniqua(bits=2, theta=0.5, entropy=entropy, verify_block=16).worker(ThreadWorld(3).transport(0),
                                                                              make_topology("ring", 3))
    worker.setup(torch.zeros(100))
    return worker.state  # its frame: the message format


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_moniqua_frame_parser_random_bytes(raw):
    m = _moniqua()
    d, nb = 100, 7
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    try:
        codes, hashes, ctrl, requests = m.frame.parse(buf, nb, sender=1)
        m.frame.codes(codes, d, "cpu", 1)
    except ValueError as e:
        assert "from worker 1" in str(e)
        return
    assert len(hashes) == nb and ctrl < 8 and all(b < nb for blocks in requests.values() for b in blocks)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.sampled_from(["zlib", "ans"]))
def test_moniqua_entropy_coded_codes_are_bounded(raw, method):
    m = _moniqua(method)
    buf = torch.frombuffer(bytearray(b"Z" + raw if method == "zlib" else b"A" + raw), dtype=torch.uint8)
    try:
        payload = m.frame.codes(buf, 100, "cpu", 2)
    except ValueError as e:
        assert "from worker 2" in str(e)
        return
    assert payload.data.numel() == 25


def test_moniqua_zlib_bomb_from_a_peer_is_refused():
    m = _moniqua("zlib")
    bomb = torch.frombuffer(bytearray(b"Z" + zlib.compress(bytes(10_000_000), 9)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="from worker 2.*more than max_length=25"):
        m.frame.codes(bomb, 100, "cpu", 2)
