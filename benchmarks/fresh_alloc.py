"""What a fresh CPU output costs to allocate and first touch, by size: ``torch.empty(n)``
under torch's ``THP_MEM_ALLOC_ENABLE`` 0 and 1, and lowbit's ``empty_output`` (which
advises buffers of ``HUGE_FROM`` bytes or more as huge pages), each followed by a
``fill_``, against a ``fill_`` of a kept buffer of the same size; medians of 15 calls.

Run: ``python benchmarks/fresh_alloc.py`` (each setting in its own interpreter: torch reads
``THP_MEM_ALLOC_ENABLE`` once).
"""

import os
import subprocess
import sys

SIZES_MB = (4, 8, 16, 20, 32, 40, 80)

CHILD = r"""
import statistics, sys, time, torch
from lowbit.codecs.kernels import empty_output
use_lowbit = sys.argv[1] == "lowbit"
def median_ms(f, calls=15):
    f()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)
row = []
for mb in [int(v) for v in sys.argv[2].split(",")]:
    n = mb * 250_000
    kept = torch.empty(n, dtype=torch.int32)
    new = (lambda: empty_output(n, torch.int32)) if use_lowbit else (lambda: torch.empty(n, dtype=torch.int32))
    row.append(f"{median_ms(lambda: new().fill_(1)):7.2f} ({median_ms(lambda: kept.fill_(1)):.2f})")
print(" ".join(row))
"""


def main() -> None:
    sizes = ",".join(map(str, SIZES_MB))
    print("fresh int32 buffer + fill_, median ms (a kept buffer's fill_ in brackets); one thread")
    print(f"{'allocation':<34}" + " ".join(f"{str(mb) + ' MB':>15}" for mb in SIZES_MB))
    for label, thp, how in (("torch.empty, THP_MEM_ALLOC_ENABLE=0", "0", "torch"),
                            ("torch.empty, THP_MEM_ALLOC_ENABLE=1", "1", "torch"),
                            ("lowbit empty_output", "0", "lowbit")):
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE=thp, OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, "-c", CHILD, how, sizes], env=env, capture_output=True, text=True,
                             check=True)
        print(f"{label:<34}" + " ".join(f"{v:>15}" for v in _cells(out.stdout)))


def _cells(line: str) -> list[str]:
    parts = line.split()
    return [f"{parts[i]} {parts[i + 1]}" for i in range(0, len(parts), 2)]


if __name__ == "__main__":
    main()
