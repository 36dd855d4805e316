"""The house rules of issue 31, checked on the tree as it is: they hold for every change.

- no module of the package is over :data:`MAX_MODULE_LINES` lines;
- every module docstring says what the module is and how to use it in at most
  :data:`MAX_DOCSTRING_LINES` lines (measured results belong in docs/RESULTS.md, beside their command);
- ``docs/ARCHITECTURE.md`` is an overview of at most :data:`MAX_ARCHITECTURE_LINES` lines and
  ``docs/RESULTS.md`` carries at most :data:`MAX_DATED_NOTES` dated notes (history is git's);
- only ``lowbit/__main__.py`` imports the command line (``lowbit.cli``): the library's layers do not;
- no module asks ``isinstance`` of a concrete transport: a transport states its capabilities.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lowbit"
MAX_MODULE_LINES = 500
MAX_DOCSTRING_LINES = 60
MAX_ARCHITECTURE_LINES = 300
MAX_DATED_NOTES = 12
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")

MODULES = sorted(PACKAGE.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_package_has_modules():
    assert len(MODULES) > 50, f"found only {len(MODULES)} modules under {PACKAGE}"


def test_no_module_is_over_the_line_limit():
    long = {_rel(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


def test_module_docstrings_are_short():
    long = {}
    for p in MODULES:
        doc = ast.get_docstring(_tree(p), clean=False)
        if doc is not None and len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            long[_rel(p)] = len(doc.splitlines())
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines: {long}"


def test_architecture_is_an_overview():
    lines = len((ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines())
    assert lines <= MAX_ARCHITECTURE_LINES, f"docs/ARCHITECTURE.md has {lines} lines, at most {MAX_ARCHITECTURE_LINES}"


def test_results_state_the_present():
    dates = DATE.findall((ROOT / "docs" / "RESULTS.md").read_text())
    assert len(dates) <= MAX_DATED_NOTES, (
        f"docs/RESULTS.md has {len(dates)} dated notes, at most {MAX_DATED_NOTES}: history goes to git or CHANGELOG.md")


def _imported_modules(tree: ast.Module, path: Path) -> set[str]:
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_only_main_imports_the_command_line():
    offenders = [_rel(p) for p in MODULES if p.name not in ("cli.py", "__main__.py")
                 and "lowbit.cli" in _imported_modules(_tree(p), p)]
    assert not offenders, f"modules importing lowbit.cli (move what they need out of the command line): {offenders}"


def _concrete_transports() -> set[str]:
    from lowbit.comm.base import Transport

    seen, todo = set(), [Transport]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("lowbit.") and sub.__name__ not in seen:
                seen.add(sub.__name__)
                todo.append(sub)
    return seen


def test_the_scan_knows_the_transports():
    import lowbit.comm  # noqa: F401  (imports every transport)

    assert {"ThreadTransport", "TorchDistributedTransport"} <= _concrete_transports()


def test_no_isinstance_on_a_concrete_transport():
    import lowbit.comm  # noqa: F401

    concrete = _concrete_transports()
    hits = []
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                hits += [f"{_rel(path)}:{node.lineno} {k.id}" for k in kinds
                         if isinstance(k, ast.Name) and k.id in concrete]
    assert not hits, f"isinstance of a concrete transport (ask the transport for a capability instead): {hits}"
