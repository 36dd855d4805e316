"""The kernel families' interfaces (lowbit/codecs/kernels/families.py): every CPU family and
its GPU counterpart conform to the family's Protocol, expose the same functions with the same
arguments, and the CPU-only functions are exactly the documented exceptions."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import lowbit.codecs.kernels as kernels
from lowbit.codecs.kernels import codec_path, cpu_kernels, gpu_kernels, kernels_for, kernels_on
from lowbit.codecs.kernels.families import FAMILIES, Family, protocol_members

KERNELS_DIR = Path(kernels.__file__).parent
CODECS_DIR = KERNELS_DIR.parent
NAMES = sorted(FAMILIES)


def _gpu(name: str):
    pytest.importorskip("triton")
    return gpu_kernels(name)


def _cpu(name: str):
    module = cpu_kernels(name)
    if module is None:
        pytest.skip("numba is not installed")
    return module


@pytest.mark.parametrize("name", NAMES)
def test_the_cpu_module_conforms_to_its_protocol(name):
    fam = FAMILIES[name]
    module = _cpu(name)
    assert isinstance(module, fam.cpu) and isinstance(module, fam.common)
    assert set(module.__all__) == protocol_members(fam.cpu), "the module's __all__ is the family's interface"


@pytest.mark.parametrize("name", NAMES)
def test_the_gpu_module_conforms_to_the_shared_protocol(name):
    fam = FAMILIES[name]
    module = _gpu(name)
    if fam.no_gpu:
        assert module is None and not fam.cpu_only
        assert not (KERNELS_DIR / f"gpu_{name}.py").exists()
        return
    assert module is not None
    assert isinstance(module, fam.common)
    assert set(module.__all__) == protocol_members(fam.common), "the module's __all__ is the family's interface"


@pytest.mark.parametrize("name", NAMES)
def test_the_cpu_only_functions_are_the_documented_exceptions(name):
    fam = FAMILIES[name]
    extra = protocol_members(fam.cpu) - protocol_members(fam.common)
    assert set(fam.cpu_only) == extra
    assert all(len(reason) > 20 for reason in fam.cpu_only.values()), "each exception says why"
    if fam.cpu is not fam.common:
        assert fam.common in fam.cpu.__mro__ and extra  # (issubclass refuses protocols with constants)
    gpu = _gpu(name)
    if gpu is not None:
        # an exception is a real absence: a GPU function the Protocol does not name would go unchecked
        assert not any(hasattr(gpu, f) for f in fam.cpu_only)


def _params(fn) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if params and params[0].name == "self" else params


def _accepts(impl, proto) -> list[str]:
    """Where ``impl`` does not take the arguments the Protocol's ``proto`` states (empty: it does)."""
    problems = []
    have = {p.name: p for p in _params(impl)}
    order = [p.name for p in _params(impl)]
    want = _params(proto)
    for i, p in enumerate(want):
        if p.kind is p.VAR_POSITIONAL:
            if not any(q.kind is q.VAR_POSITIONAL for q in have.values()):
                problems.append(f"no *{p.name}")
            continue
        if p.name not in have:
            problems.append(f"no parameter {p.name!r}")
            continue
        if p.default is p.empty and (i >= len(order) or order[i] != p.name):
            problems.append(f"{p.name!r} is not positional argument {i}")
        if p.default is not p.empty and have[p.name].default is have[p.name].empty:
            problems.append(f"{p.name!r} has no default")
    for q in have.values():
        if q.name not in {p.name for p in want} and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL,
                                                                                             q.VAR_KEYWORD):
            problems.append(f"extra required parameter {q.name!r}")
    return problems


def test_the_argument_check_finds_mismatches():
    def proto(self, x, b, n, dtype=None): ...
    assert not _accepts(lambda x, b, n, dtype=None, stream=None: 0, proto)
    assert _accepts(lambda b, x, n, dtype=None: 0, proto)  # order
    assert _accepts(lambda x, b, dtype=None: 0, proto)  # missing
    assert _accepts(lambda x, b, n, dtype: 0, proto)  # no default
    assert _accepts(lambda x, b, n, dtype=None, extra=0, more_needed=None, *, z: 0, proto)  # extra required


@pytest.mark.parametrize("name", NAMES)
def test_both_sides_take_the_protocols_arguments(name):
    fam = FAMILIES[name]
    sides = [("cpu", _cpu(name), fam.cpu)]
    gpu = _gpu(name)
    if gpu is not None:
        sides.append(("gpu", gpu, fam.common))
    for side, module, proto in sides:
        for member in sorted(protocol_members(proto)):
            spec = getattr(proto, member, None)
            if not callable(spec):
                assert isinstance(getattr(module, member), int), (side, member)  # the flag constants
                continue
            impl = getattr(module, member)
            assert callable(impl), (side, member)
            assert not _accepts(impl, spec), (side, member, _accepts(impl, spec))


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n].common is not FAMILIES[n].cpu])
def test_the_two_sides_agree_on_the_constants(name):
    gpu = _gpu(name)
    if gpu is None:
        pytest.skip("no GPU side")
    cpu = _cpu(name)
    for member in protocol_members(FAMILIES[name].common):
        if not callable(getattr(FAMILIES[name].common, member, None)):
            assert getattr(cpu, member) == getattr(gpu, member)


def test_every_kernel_module_belongs_to_one_family():
    modules = {m.name for m in pkgutil.iter_modules([str(KERNELS_DIR)])}
    expected = {"families"}
    for name, fam in FAMILIES.items():
        expected.add(fam.module_name(name, "numba"))
        if not fam.no_gpu:
            expected.add(fam.module_name(name, "triton"))
    assert modules == expected


def test_the_dispatch_picks_the_family_module():
    x = torch.zeros(3)
    assert kernels_for(x, "qsgd") is cpu_kernels("qsgd") is importlib.import_module(f"{kernels.__name__}.cpu_qsgd")
    assert kernels_for(x) is cpu_kernels("core") is importlib.import_module(f"{kernels.__name__}.cpu")
    with codec_path("reference"):
        assert kernels_for(x, "qsgd") is None
    assert gpu_kernels("lanes") is None  # no GPU side: said in FAMILIES["lanes"].no_gpu
    for bad in ("dither", "plain", "QSGD", ""):
        with pytest.raises(ValueError, match=r"family must be one of \[.*'qsgd'.*\], got"):
            kernels_for(x, bad)
        with pytest.raises(ValueError, match="family must be one of"):
            cpu_kernels(bad)
        with codec_path("reference"), pytest.raises(ValueError, match="family must be one of"):
            kernels_for(x, bad)


def test_the_dispatch_answers_for_one_function(monkeypatch):
    x = torch.zeros(3)
    assert kernels_for(x, "core", "max_abs") is cpu_kernels("core")  # a CPU-only function, on the CPU
    assert kernels_for(x, "maxnorm", "qsgd_encode_buckets") is cpu_kernels("maxnorm")
    for path in ("fast", "reference"):
        with codec_path(path), pytest.raises(ValueError, match=r"op must be one of the 'core' family's functions"):
            kernels_for(x, "core", "qsgd_encode")
    with codec_path("reference"):
        assert kernels_for(x, "core", "max_abs") is None
    pytest.importorskip("triton")
    monkeypatch.setattr(kernels, "fast_backend", lambda t: "triton")  # as for a CUDA tensor
    for name, fam in FAMILIES.items():
        for op in protocol_members(fam.cpu):
            got = kernels_for(x, name, op)
            assert got is (None if op in fam.cpu_only or fam.no_gpu else gpu_kernels(name)), (name, op)


def test_kernels_on_names_the_backend():
    assert kernels_on("numba", "radix") is cpu_kernels("radix")
    assert kernels_on("numba", "core", "within") is cpu_kernels("core")
    assert kernels_on("triton", "lanes") is None and kernels_on("triton", "lanes", "pack") is None
    assert kernels_on("triton", "core", "within") is None  # CPU-only
    with pytest.raises(ValueError, match=r"backend must be one of \('numba', 'triton'\), got 'cuda'"):
        kernels_on("cuda", "core")
    with pytest.raises(ValueError, match="op must be one of the 'lanes' family's functions"):
        kernels_on("triton", "lanes", "select")


def test_a_family_without_a_gpu_side_says_why():
    fam = Family(FAMILIES["lanes"].common, FAMILIES["lanes"].cpu, no_gpu="x")
    assert fam.module_name("lanes", "triton") is None and fam.module_name("lanes", "numba") == "cpu_lanes"
    assert FAMILIES["core"].module_name("core", "triton") == "gpu"
    assert all(len(f.no_gpu) > 20 for f in FAMILIES.values() if f.no_gpu)


def _family_strings(source: str) -> set[str]:
    """The family names a codec module passes to the dispatch: literal arguments of
    kernels_for/cpu_kernels/gpu_kernels and the constants they are given by name."""
    tree = ast.parse(source)
    consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str)}
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("kernels_for", "kernels_on", "cpu_kernels",
                                                                       "gpu_kernels"):
            args = n.args[1:] if n.func.id in ("kernels_for", "kernels_on") else n.args
            for a in args[:1]:
                if isinstance(a, ast.Constant):
                    found.add(a.value)
                elif isinstance(a, ast.Name) and a.id in consts:
                    found.add(consts[a.id])
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "kernel_family" for t in n.targets):
            v = n.value
            if isinstance(v, ast.Constant):
                found.add(v.value)
            elif isinstance(v, ast.Name) and v.id in consts:
                found.add(consts[v.id])
    return found


def test_the_codecs_name_existing_families():
    sources = sorted(p for p in Path(CODECS_DIR.parent).rglob("*.py") if "kernels" not in p.parts)
    used = {}
    for path in sources:
        for fam in _family_strings(path.read_text()):
            used.setdefault(fam, []).append(str(path.relative_to(CODECS_DIR.parent.parent)))
    assert used, "no codec names a kernel family"
    unknown = {f: where for f, where in used.items() if f not in FAMILIES}
    assert not unknown
    assert re.fullmatch(r"[a-z]+", "".join(used)), "family names are lower-case codec module names"


def test_the_family_string_scan_finds_names():
    src = ('F = "qsgd"\nclass C:\n    kernel_family = F\nK = kernels_for(x, "radix")\nJ = cpu_kernels(G)\nG = "lanes"\n'
           'M = kernels_on("triton", "sign", "sign_encode")\n')
    assert _family_strings(src) == {"qsgd", "radix", "lanes", "sign"}
