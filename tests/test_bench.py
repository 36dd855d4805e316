"""`lowbit bench codecs`: what it reports (not how fast: timings are for the benchmark itself)."""

import pytest

from lowbit.bench import bench_codecs, default_cases
from lowbit.cli import main


def test_rows_cover_every_case_and_report_real_sizes():
    size = 4096
    rows = bench_codecs(size=size, repeats=1)
    assert [r["codec"] for r in rows] == ["memcpy"] + [c.label for c in default_cases()]
    by = {r["codec"]: r for r in rows}
    assert by["memcpy"]["encode_x_memcpy"] == 1.0
    for r in rows:
        assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0
    # bytes per element come from the encoded payload: fp16 is 2 bytes plus its header
    fp16 = next(r for name, r in by.items() if name.startswith("fp16"))
    assert 2.0 < fp16["bytes_per_element"] < 2.0 + 64 / size
    sign = next(r for name, r in by.items() if name.startswith("sign"))
    assert 1 / 8 <= sign["bytes_per_element"] < 1 / 8 + 64 / size


@pytest.mark.parametrize("argv,match", [(["--size", "0"], "size must be >= 1"),
                                        (["--repeats", "0"], "repeats must be >= 1"),
                                        (["--device", "tpu"], "device='tpu' is unknown")])
def test_bad_arguments_are_clear_errors(argv, match, capsys):
    assert main(["bench", "codecs", *argv]) == 2
    assert match in capsys.readouterr().err
