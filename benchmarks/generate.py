"""The synthetic data generator: the skew it gives (its calibration table) and how fast it writes.

    .venv/bin/python benchmarks/generate.py [ROWS[:SCALE] ...]   # the calibration table
    .venv/bin/python benchmarks/generate.py --speed [ROWS]       # throughput

The calibration table is ``top1pct_share`` (the share of all accesses taken by the top 1% of
embedding rows, as the profile computes it) of the first ROWS generated rows at SCALE (seed 0),
by brute force: the table in :mod:`dlrmflow.datasets.synthetic`'s docstring.

The throughput is ``generate_rows`` per core (CPU time, so other load on the machine matters
less), then whole files in process and on a 2-worker LocalCluster, plain and gzip.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dlrmflow.datasets.synthetic import HEAD_EXPONENT, TAIL_SHARE, generate, generate_rows, measure_skew
from dlrmflow.engine.serving.cluster import dask_client

CALIBRATION_SIZES = [
    (50_000, 0.01), (100_000, 0.01), (1_000_000, 0.01), (100_000, 0.1), (1_000_000, 0.1),
    (100_000, 1.0), (1_000_000, 1.0), (10_000_000, 1.0),
]


def print_skew_table(argv: list[str]) -> None:
    sizes = [(int(a.split(":")[0]), float(a.split(":")[1]) if ":" in a else 1.0) for a in argv] or CALIBRATION_SIZES
    print(f"HEAD_EXPONENT = {HEAD_EXPONENT}, TAIL_SHARE = {TAIL_SHARE}")
    print(f"    {'rows':>12} {'scale':>6} {'embedding rows':>15} {'top1pct_share':>14}")
    for n, s in sizes:
        r = measure_skew(n, scale=s)
        print(f"    {n:>12,} {s:>6} {r['embedding_rows']:>15,} {r['top1pct_share']:>14.3f}", flush=True)


def print_speed(rows: int) -> None:
    cpu, wall = [], []
    for i in range(5):
        c0, w0 = time.process_time(), time.perf_counter()
        generate_rows(i * 100_000, 100_000, seed=0)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    print(f"generate_rows, 100,000-row chunks (median of 5): {1e5 / np.median(cpu):,.0f} rows per CPU second, "
          f"{1e5 / np.median(wall):,.0f} rows/s wall")
    with tempfile.TemporaryDirectory() as tmp, dask_client(n_workers=2) as client:
        for name in ("x.tsv", "x.tsv.gz"):
            for label, c in (("in process", None), ("Dask, 2 workers", client)):
                r = generate(Path(tmp) / name, rows, seed=0, client=c)
                print(f"generate {rows:,} rows to {name:8} {label:16}: {r['seconds']:6.2f} s, "
                      f"{rows / r['seconds']:>9,.0f} rows/s, {r['bytes'] / 2**20:8.1f} MiB")


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
    elif argv[:1] == ["--speed"]:
        print_speed(int(argv[1]) if len(argv) > 1 else 2_000_000)
    else:
        print_skew_table(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
