"""``lowbit repro train-tables``: its rows are docs/RESULTS.md's, each runs what ``lowbit train`` runs."""

import re
import shlex
from pathlib import Path

import pytest
from repro_quick import run_quick

import lowbit.train
from lowbit.cli import main
from lowbit.repro import tables

RESULTS_MD = Path(__file__).resolve().parents[1] / "docs" / "RESULTS.md"


def _section_table(text: str, heading: str) -> tuple[str, list[list[str]]]:
    """The text of the section under ``heading`` (to the next heading) and its first markdown table."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r"#+ " + re.escape(heading), line)]
    assert len(starts) == 1, f"RESULTS.md has {len(starts)} sections headed {heading!r}"
    section = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("#"):
            break
        section.append(line)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section if line.startswith("|")]
    return "\n".join(section), [r for r in rows if not set("".join(r)) <= set("-")]


@pytest.mark.parametrize("table", tables.TABLES, ids=lambda t: t.heading[:40])
def test_results_md_table_is_the_declared_rows_and_columns(table):
    section, rows = _section_table(RESULTS_MD.read_text(), table.heading)
    assert rows[0] == ["OPTIONS", *table.columns]
    assert [r[0] for r in rows[1:]] == [f"`{o}`" for o in table.rows]
    assert all(len(r) == len(rows[0]) for r in rows)
    assert "lowbit repro train-tables" in section
    assert f"`{table.command()}`" in section


def test_every_row_is_the_config_lowbit_train_runs(monkeypatch):
    """The OPTIONS go through ``lowbit train``'s own parser: same config, defaults included."""
    seen = []
    monkeypatch.setattr(lowbit.train, "train", lambda cfg, **kw: seen.append(cfg))
    for table in tables.TABLES:
        for options in table.rows:
            for seed in table.seeds:
                line = f"{table.common} --seed {seed} {options}"
                assert main(["train", *shlex.split(line), "--no-progress"]) == 0
                assert tables.train_config(line).to_dict() == seen[-1].to_dict(), line


def test_train_config_reads_options_as_the_command_line_does():
    cfg = tables.train_config("--task digits-mlp --algorithm moniqua --bits 1 --theta 0.05 --no-verify --rank 1")
    assert (cfg.bits, cfg.theta, cfg.verify, cfg.powersgd_rank, cfg.lr) == (1, 0.05, False, 1, 0.1)
    assert tables.train_config("--algorithm moniqua --theta auto", steps=2).steps == 2


def test_train_config_rejects_unknown_and_bad_options():
    with pytest.raises(ValueError, match="no option --not-an-option"):
        tables.train_config("--algorithm dpsgd --not-an-option 3")
    with pytest.raises(ValueError, match="not valid lowbit train options"):
        tables.train_config("--bits two")
    with pytest.raises(ValueError, match="bits"):
        tables.train_config("--bits 0")


def test_every_table_column_is_defined_and_every_table_has_rows():
    for t in tables.TABLES:
        assert t.rows and len(set(t.rows)) == len(t.rows), t.heading
        assert all(c in tables.COLUMNS for c in t.columns), t.heading
    assert len({t.heading for t in tables.TABLES}) == len(tables.TABLES)


def test_quick_writes_every_table_and_shares_identical_runs(tmp_path_factory):
    out, res = run_quick("train-tables", tmp_path_factory)
    text = (out / "table.md").read_text()
    assert [t["heading"] for t in res["tables"]] == [t.heading for t in tables.TABLES]
    for t in tables.TABLES:
        _, rows = _section_table(text, t.heading)
        assert [r[0] for r in rows[1:]] == [f"`{o}`" for o in t.rows]
    by_heading = {t["heading"]: {r["options"]: r["runs"] for r in t["rows"]} for t in res["tables"]}
    digits = by_heading["The decentralized family on digits-mlp (8 workers, ring, 300 steps)"]
    seeds = by_heading["Accuracy and wire bits against fp32 D-PSGD: digits-mlp, seeds 0, 1, 2"]
    # seed 0 of the targets table is the decentralized table's row, run once
    assert seeds["--algorithm dpsgd"][0] == digits["--algorithm dpsgd"][0]
    assert [r["config"]["seed"] for r in seeds["--algorithm moniqua --bits 1"]] == [0, 1, 2]
    assert all((r["config"]["steps"], r["config"]["task"]) == (2, "digits-mlp")
               for t in res["tables"] for row in t["rows"] for r in row["runs"])
    # the budget column: 8 x bytes a worker sends per step / d against nominal bits x 2 ring neighbours
    r = seeds["--algorithm moniqua --bits 2"][1]
    assert tables._budget_ratio(r) == pytest.approx(r["wire_bits_per_element"] / (2 * 2))
