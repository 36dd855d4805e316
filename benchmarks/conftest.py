"""The pytest-benchmark twins of ``lowbit bench`` share one torch thread, as the CLI does."""

import pytest

from lowbit.bench.timing import pinned_threads


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with pinned_threads(1):
        yield
