"""Shared by the ``lowbit repro`` tests: run an experiment's ``--quick`` version once."""

import json

import torch

from lowbit.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def run_quick(name: str, tmp_path_factory) -> tuple:
    """``lowbit repro NAME --quick`` into a fresh folder: (folder, results.json as a dict)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp(name)
    assert main(["repro", name, "--out", str(out), "--quick"]) == 0
    return out, json.loads((out / "results.json").read_text())
