"""CLI fuzz (issue 13): random combinations of option values end either in a finished run
or in a one-line error with a non-zero exit code, never a traceback."""

from __future__ import annotations

import random

from lowbit.algorithms import ALGORITHMS
from lowbit.cli import main

VALUES = {
    "--task": ["quadratic", "digits-mlp", "nope"],
    "--algorithm": [*ALGORITHMS, "nope"],
    "--bits": ["0", "1", "2", "8", "9", "-1", "x"],
    "--workers": ["1", "2", "3", "0", "-2"],
    "--topology": ["ring", "complete", "torus", "star", "nope"],
    "--steps": ["1", "2", "0"],
    "--lr": ["0.1", "-1", "nan", "inf", "1e9", "0"],
    "--momentum": ["0", "0.9", "1", "nan", "-0.5"],
    "--weight-decay": ["0", "-1", "nan", "inf"],
    "--theta": ["0.5", "auto", "0", "-1", "nan", "1e-30", "nope"],
    "--gamma": ["0.5", "0", "2", "nan"],
    "--codec": ["fp32", "minmax", "sign", "nope"],
    "--rounding": ["nearest", "stochastic", "nope"],
    "--k": ["0.5", "3", "1e9", "0", "nan", "2.5"],
    "--entropy": ["zlib", "ans", "nope"],
    "--sum-dtype": ["int8", "int64", "nope"],
    "--eval-every": ["1", "0"],
    "--batch-size": ["1", "0"],
    "--dim": ["4", "0"],
    "--slow": ["0:2", "9:2", "x", "0:nan"],
    "--verify-block": ["1", "0"],
    "--scales": ["2,6", "x", "0,40"],
    "--levels": ["1", "0", "-1"],
    "--noise": ["0.1", "nan", "-1"],
    "--delta": ["0.1", "0", "nan"],
    "--nested-fraction": ["0.5", "1", "nan"],
    "--stall-timeout": ["10", "0", "nan"],
    "--lr-schedule": ["cosine", "nope"],
    "--split": ["label", "nope"],
    "--bandwidth": ["1Gbit", "fast"],
    "--latency": ["0ms", "-1ms"],
    "--rank": ["1", "0"],
}


def test_random_option_combinations_end_cleanly(capsys):
    rng = random.Random(20261123)
    outcomes = {"finished": 0, "error": 0}
    for _ in range(60):
        argv = ["train", "--no-progress", "--hidden", "8", "--steps", "2", "--workers", "2"]
        for opt in rng.sample(sorted(VALUES), rng.randrange(1, 6)):
            argv += [opt, rng.choice(VALUES[opt])]
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: a bad value of a typed option
            code = e.code
        out, err = capsys.readouterr()
        assert "Traceback" not in err + out, argv
        if code == 0:
            outcomes["finished"] += 1
        else:
            assert isinstance(code, int) and code > 0, (argv, code)
            lines = [line for line in err.splitlines() if line.startswith("lowbit: error:")
                     or line.startswith("usage:") or line.startswith("lowbit train: error:")]
            assert lines, (argv, err)
            if not err.startswith("usage:"):  # argparse prints a usage line, then one error line
                assert len(err.strip().splitlines()) == 1, (argv, err)
            outcomes["error"] += 1
    assert outcomes["finished"] > 0 and outcomes["error"] > 0, outcomes
