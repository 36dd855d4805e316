"""The benchmark reports' one table formatter (lowbit.bench.table): alignment, format specs,
missing values and ranges, and the stand-in GradBucket the hook benchmarks hand to DDP hooks."""

import torch

from lowbit.bench.hooks import GradBucketStandIn
from lowbit.bench.table import Column, header_line, row_line, span_column, table_lines


def test_columns_align_format_and_join_with_one_space():
    cols = [Column("name", 6, "name", left=True), Column("x", 7, "x", ".2f"),
            Column("ms", 5, lambda r: None if r["s"] is None else 1e3 * r["s"], ".1f", missing="never"),
            span_column("range", ".1f", 9)]
    rows = [{"name": "qsgd", "x": 1.234, "s": 0.0125, "range": [0.5, 1.25]},
            {"name": "sign", "x": 10, "s": None, "range": (2, 3)}]
    assert table_lines(cols, rows) == [
        "name         x    ms     range",
        "qsgd      1.23  12.5   0.5-1.2",
        "sign     10.00 never   2.0-3.0",
    ]
    assert header_line(cols) == table_lines(cols, [])[0]
    assert row_line(cols, rows[0]) == table_lines(cols, rows)[1]


def test_a_value_wider_than_its_column_is_written_whole():
    assert row_line([Column("n", 2, "n")], {"n": 123456}) == "123456"


def test_the_grad_bucket_stand_in_views_one_buffer_and_refills_it():
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    g = torch.arange(10, dtype=torch.float32)
    b = GradBucketStandIn(params, g, index=3, last=False)
    assert (b.index(), b.is_last(), b.parameters()) == (3, False, params)
    assert [tuple(v.shape) for v in b.gradients()] == [(2, 3), (4,)]
    assert torch.equal(b.gradients()[1], g[6:])
    b.buffer().zero_()  # a hook overwrites its bucket
    assert float(b.gradients()[0].abs().sum()) == 0.0
    b.refill()
    assert torch.equal(b.buffer(), g) and b.buffer().data_ptr() != g.data_ptr()
