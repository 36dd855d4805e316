"""Behaviour pinned bit for bit (issue 12: "the trained parameters of every algorithm on
digits-mlp ... are bit-identical before and after the redesign", "the ledgers are identical").

Every algorithm ``lowbit train`` offers, and its main variants, runs on digits-mlp with the
thread backend, 4 workers, 50 steps and seed 0, in this process, through
:func:`lowbit.train.train` (the function ``lowbit train`` calls). Each case is compared
exactly with its record in ``tests/data/behaviour_pinned.json``:

- ``params_sha256``: per rank, the sha256 of the worker's final flat parameters as bytes
  (``model.parameters()`` order, float32); digits-mlp has no buffers
  (:func:`test_the_pinned_model_has_no_buffers`), so this is the whole model state;
- ``ledger``: per rank, bytes sent, messages and the sha256 of the ledger's rows
  (step, op, buffer bytes, bytes sent, messages, peers), in step order;
- ``bytes_sent``, ``messages_sent`` and ``wire_bits_per_element``: the run summary's.

A case whose run is not the same from one run to the next pins only what is (its
``pinned`` field in the record says which: ``all``, or ``ledger`` for the parts above
without the parameters). Write mode runs every case twice and refuses to write a record
that claims more than the two runs agree on. Today every case pins ``all``: the thread
runtime adds in rank order, and it runs the asynchronous algorithms (adpsgd,
moniqua-async) on a seeded virtual-time schedule (:mod:`lowbit.comm.inprocess`), so they
too repeat bit for bit, in one process and across processes.

Floating-point results are reproducible only on the build that made them: the tests
SKIP, with the reason, where ``torch.__version__`` or ``platform.machine()`` differs
from the record's.

Regenerate the record (every case, twice: 166 s on the loaded 2-core machine where it was
made) after a change of behaviour that is meant, saying which cases changed and why::

    LOWBIT_PIN_BEHAVIOUR=write python -m pytest tests/test_behaviour_pinned.py

One case per algorithm is the default subset (``-m "not slow"``: 36 s there); the other
cases are marked ``slow`` (``python -m pytest tests/test_behaviour_pinned.py``, all 89
cases: 89-107 s there).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import pytest
import torch

from lowbit.algorithms import ALGORITHMS
from lowbit.train import TrainConfig, make_task, train

RECORD = Path(__file__).parent / "data" / "behaviour_pinned.json"
MODE_VAR = "LOWBIT_PIN_BEHAVIOUR"
WRITE = os.environ.get(MODE_VAR) == "write"
REGENERATE = f"{MODE_VAR}=write python -m pytest tests/test_behaviour_pinned.py"

# The run every case shares (issue 12's "What must hold").
FIXED = dict(task="digits-mlp", backend="thread", workers=4, steps=50, seed=0, device="cpu")

ALL, LEDGER = "all", "ledger"  # what a case pins: everything, or all but the parameters
LEDGER_FIELDS = ("ledger", "bytes_sent", "messages_sent", "wire_bits_per_element")
FIELDS = {ALL: ("parameters", "params_sha256", *LEDGER_FIELDS), LEDGER: LEDGER_FIELDS}


class Case:
    """One pinned run: ``algorithm`` with ``options`` (``TrainConfig`` fields, as
    ``lowbit train`` takes them) on top of :data:`FIXED`. ``default``: in the
    representative subset (one per algorithm) that runs when slow tests are deselected."""

    def __init__(self, id: str, algorithm: str, default: bool = False, pinned: str = ALL, **options):
        self.id, self.algorithm, self.default, self.pinned = id, algorithm, default, pinned
        self.options = {"algorithm": algorithm, **options}

    def config(self) -> TrainConfig:
        return TrainConfig(**FIXED, **self.options)

    def param(self):
        return pytest.param(self, id=self.id, marks=() if self.default else pytest.mark.slow)


def _variants(algorithm: str, codecs: list[str | None], minmax_bits: bool = True, **options) -> list[Case]:
    """One case per codec of a replica-gossip algorithm (None: its default, the representative
    case), and the min-max codec at 1 and 8 bits besides the default 2."""
    out = [Case(f"{algorithm}-{c or 'default'}", algorithm, default=c is None, **options,
                **({} if c is None else {"codec": c})) for c in codecs]
    if minmax_bits:
        out += [Case(f"{algorithm}-minmax-{b}bit", algorithm, codec="minmax", bits=b, **options) for b in (1, 8)]
    return out


CASES: list[Case] = [
    Case("allreduce", "allreduce", default=True),
    Case("dpsgd", "dpsgd", default=True),
    Case("d2", "d2", default=True, momentum=0.0),
    *_variants("naive", [None, "minmax", "fp32"]),
    # Moniqua: 2 bits, theta auto (verification on), its 1- and 8-bit forms, no verification
    # (a fixed theta), each entropy coder, independent rounding, theta ~ lr, D2, async.
    Case("moniqua", "moniqua", default=True),
    Case("moniqua-1bit", "moniqua", bits=1),
    Case("moniqua-8bit", "moniqua", bits=8),
    Case("moniqua-no-verify", "moniqua", verify=False, theta=0.5),
    *(Case(f"moniqua-entropy-{e}", "moniqua", entropy=e) for e in ("zlib", "bz2", "lzma", "ans")),
    Case("moniqua-no-shared-randomness", "moniqua", shared_randomness=False),
    Case("moniqua-theta-schedule-lr", "moniqua", verify=False, theta=0.5, theta_schedule="lr", lr_schedule="cosine"),
    Case("moniqua-gamma", "moniqua", gamma=0.5),
    Case("moniqua-d2", "moniqua-d2", default=True, momentum=0.0),
    Case("moniqua-d2-1bit", "moniqua-d2", momentum=0.0, bits=1),
    Case("moniqua-async", "moniqua-async", default=True),
    Case("moniqua-async-2bit", "moniqua-async", bits=2, theta=0.5),
    Case("adpsgd", "adpsgd", default=True),
    # The replica-gossip baselines, each of their codecs.
    *_variants("choco", [None, "uniform", "fp32", "half", "sign", "terngrad"]),
    Case("choco-gamma", "choco", gamma=0.25),
    *_variants("dcd", [None, "uniform", "fp32", "half", "sign", "terngrad"]),
    *_variants("ecd", [None, "uniform", "terngrad", "fp32"]),
    *_variants("deepsqueeze", [None, "uniform", "fp32", "half", "sign", "terngrad"]),
    # Bagua's low precision decentralized SGD: its codecs, peer selection, hierarchy, interval, buckets.
    *_variants("lowprec-decentralized", [None, "minmax", "fp32"]),
    Case("lowprec-decentralized-shift-one", "lowprec-decentralized", peer_selection="shift_one"),
    Case("lowprec-decentralized-hierarchical-node2", "lowprec-decentralized", node_size=2),
    # (without the hierarchy node_size has no effect: this case equals the default, node_size 1)
    Case("lowprec-decentralized-flat-node2", "lowprec-decentralized", node_size=2, hierarchical=False),
    Case("lowprec-decentralized-interval2", "lowprec-decentralized", communication_interval=2),
    Case("lowprec-decentralized-buckets", "lowprec-decentralized", bucket_bytes=4096),
    # The centralized family.
    Case("dqsg", "dqsg", default=True),
    Case("dqsg-8bit", "dqsg", bits=8),
    Case("dqsg-ps", "dqsg", server="ps"),
    Case("ndqsg", "ndqsg", default=True),
    Case("ndqsg-8bit", "ndqsg", bits=8),
    Case("ndqsg-ps", "ndqsg", server="ps"),
    Case("ndqsg-fixed-delta1", "ndqsg", nested_delta1=0.05, nested_fraction=0.25),
    Case("qsgd", "qsgd", default=True),
    Case("qsgd-8bit", "qsgd", bits=8),
    Case("qsgd-ps", "qsgd", server="ps"),
    Case("terngrad", "terngrad", default=True),
    Case("onebit-ef", "onebit-ef", default=True),
    Case("maxnorm", "maxnorm", default=True),
    Case("maxnorm-1bit", "maxnorm", bits=1),
    Case("maxnorm-8bit", "maxnorm", bits=8),
    Case("maxnorm-multiscale", "maxnorm-multiscale", default=True),
    Case("maxnorm-multiscale-1-4", "maxnorm-multiscale", scales="1,4"),
    Case("grandk-maxnorm", "grandk-maxnorm", default=True, k=0.1),
    Case("grandk-maxnorm-k1000", "grandk-maxnorm", k=1000),
    Case("grandk-maxnorm-8bit", "grandk-maxnorm", k=0.1, bits=8),
    Case("grandk-maxnorm-multiscale", "grandk-maxnorm-multiscale", default=True, k=0.1),
    Case("powersgd", "powersgd", default=True),
    Case("powersgd-rank1", "powersgd", powersgd_rank=1),
    Case("powersgd-rank4", "powersgd", powersgd_rank=4),
]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def observe(case: Case) -> dict:
    """Run ``case`` in-process as ``lowbit train`` runs it; what the record pins of it."""
    run = train(case.config())
    workers = sorted(run.workers, key=lambda w: w.rank)
    return {
        "parameters": run.summary["parameters"],
        "params_sha256": [_sha256(w.params.detach().cpu().contiguous().numpy().tobytes()) for w in workers],
        "ledger": {
            "bytes_sent": [sum(row[3] for row in w.ledger_rows) for w in workers],
            "messages": [sum(row[4] for row in w.ledger_rows) for w in workers],
            "rows_sha256": [_sha256(json.dumps([list(row) for row in w.ledger_rows]).encode()) for w in workers],
        },
        "bytes_sent": run.summary["bytes_sent"],
        "messages_sent": run.summary["messages_sent"],
        "wire_bits_per_element": run.summary["wire_bits_per_element"],
    }


def _build() -> dict:
    return {"torch": torch.__version__, "machine": platform.machine()}


_WRITTEN: dict[str, dict] = {}


@pytest.fixture(scope="module")
def record():
    """The stored record (compare mode), or the dict write mode fills and writes at the end."""
    if WRITE:
        yield None
        missing = [c.id for c in CASES if c.id not in _WRITTEN]
        if missing:
            raise RuntimeError(f"{MODE_VAR}=write needs every case in one run (no -m or -k); these did not run: "
                               f"{', '.join(missing)}. Nothing was written.")
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        head = {"about": f"tests/test_behaviour_pinned.py's record; regenerate with: {REGENERATE}",
                **_build(), "fixed": FIXED}
        cases = ",\n".join(f"  {json.dumps(c.id)}: {json.dumps(_WRITTEN[c.id])}" for c in CASES)  # a case a line
        RECORD.write_text(json.dumps(head, indent=1)[:-2] + ',\n "cases": {\n' + cases + "\n }\n}\n")
        return
    if not RECORD.exists():
        pytest.fail(f"{RECORD} is missing; write it with: {REGENERATE}")
    data = json.loads(RECORD.read_text())
    differ = {k: (data.get(k), v) for k, v in _build().items() if data.get(k) != v}
    if differ:
        pytest.skip("the record was made on another build (floating-point results are reproducible only on the "
                    "same one): " + ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in differ.items())
                    + f"; regenerate with {REGENERATE} on a build that behaves as the record's")
    if data.get("fixed") != FIXED:
        pytest.fail(f"the record's fixed settings {data.get('fixed')} are not this file's {FIXED}; "
                    f"regenerate with: {REGENERATE}")
    yield data


def _pinned(obs: dict, pinned: str) -> dict:
    return {k: obs[k] for k in FIELDS[pinned]}


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_behaviour_is_pinned(case: Case, record):
    if WRITE:
        first, second = observe(case), observe(case)
        differ = sorted(k for k in FIELDS[case.pinned] if first[k] != second[k])
        if differ:
            pytest.fail(f"{case.id}: two runs differ in {', '.join(differ)}, which pinned={case.pinned!r} claims; "
                        f"pin less of this case (pinned={LEDGER!r}) and say why")
        _WRITTEN[case.id] = {"options": case.options, "pinned": case.pinned, **_pinned(first, case.pinned)}
        return
    stored = record["cases"].get(case.id)
    if stored is None:
        pytest.fail(f"case {case.id} has no record; regenerate with: {REGENERATE}")
    assert stored["options"] == case.options and stored["pinned"] == case.pinned, (
        f"case {case.id} is defined as {case.options} (pinned={case.pinned!r}) but recorded as "
        f"{stored['options']} (pinned={stored['pinned']!r}); regenerate with: {REGENERATE}")
    got = _pinned(observe(case), case.pinned)
    want = {k: stored[k] for k in FIELDS[case.pinned]}
    differ = sorted(k for k in want if got[k] != want[k])
    assert not differ, (f"{case.id}: behaviour changed in {', '.join(differ)}:\n"
                        + "\n".join(f"  {k}: recorded {want[k]}, now {got[k]}" for k in differ))


def test_every_algorithm_and_codec_has_a_case():
    """Every algorithm of the registry ``lowbit train`` offers, and each codec it takes
    (``--codec``; none given is its first), is pinned by at least one case."""
    have = {(c.algorithm, c.options.get("codec")) for c in CASES}
    missing = [name for name in ALGORITHMS if not any(a == name for a, _ in have)]
    assert not missing, f"algorithms with no pinned case: {missing}"
    for name, cls in ALGORITHMS.items():
        codecs = tuple(getattr(cls, "codecs", ()))
        taken = {codec or (codecs[0] if codecs else None) for a, codec in have if a == name}
        assert set(codecs) <= taken, f"{name}: codecs with no pinned case: {sorted(set(codecs) - taken)}"


def test_the_default_subset_is_one_case_per_algorithm():
    defaults = [c.algorithm for c in CASES if c.default]
    assert sorted(defaults) == sorted(ALGORITHMS), (
        f"default cases {sorted(defaults)} are not one per algorithm {sorted(ALGORITHMS)}")
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def test_the_pinned_model_has_no_buffers():
    """The record hashes parameters only: that is the whole state of digits-mlp's model."""
    model = make_task(FIXED["task"]).make_model()
    assert list(model.buffers()) == [], "digits-mlp's model has buffers now: hash them too"
