"""The synthetic data generator: its skew and cardinality calibration, and how fast it writes.

    .venv/bin/python benchmarks/generate.py [ROWS[:SCALE] ...]        # the skew table
    .venv/bin/python benchmarks/generate.py --cardinalities [SCALE ...]  # distinct values per table
    .venv/bin/python benchmarks/generate.py --solve                      # re-derive TAIL_SHARES
    .venv/bin/python benchmarks/generate.py --speed [ROWS]               # throughput

The skew table is ``top1pct_share`` (the share of all accesses taken by the top 1% of embedding
rows, as the profile computes it) of the first ROWS generated rows at SCALE (seed 0), by brute
force: the table in :mod:`dlrmflow.datasets.synthetic`'s docstring.

The cardinality table (default SCALE 0.1) counts, by brute force from the generated ranks (no
text), each table's distinct values in the first round(SCALE x 45,840,617) rows (seed 0), the rows
of Criteo Kaggle at that scale, against SCALE x the published Kaggle cardinality and the exact
expectation (``expected_distinct``); and the top1pct_share of those rows. SCALE 0.1 takes ~10 s of
one core; SCALE 1.0 ~2 minutes and ~0.6 GB.

The throughput is ``generate_rows`` per core (CPU time, so other load on the machine matters
less), then whole files in process and on a 2-worker LocalCluster, plain and gzip.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dlrmflow.datasets.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    HEAD_EXPONENT,
    KAGGLE_ROWS,
    TAIL_SHARE,
    TAIL_SHARES,
    TAIL_SPACE,
    WIDE_TAIL_TABLES,
    expected_distinct,
    generate,
    generate_rows,
    measure_skew,
    solve_tail_shares,
    table_cardinalities,
)

CALIBRATION_SIZES = [
    (50_000, 0.01), (100_000, 0.01), (1_000_000, 0.01), (100_000, 0.1), (1_000_000, 0.1),
    (100_000, 1.0), (1_000_000, 1.0), (10_000_000, 1.0),
]


def print_skew_table(argv: list[str]) -> None:
    sizes = [(int(a.split(":")[0]), float(a.split(":")[1]) if ":" in a else 1.0) for a in argv] or CALIBRATION_SIZES
    print(f"HEAD_EXPONENT = {HEAD_EXPONENT}, TAIL_SHARE = {TAIL_SHARE}, wide tails over {TAIL_SPACE} n")
    print(f"    {'rows':>12} {'scale':>6} {'embedding rows':>15} {'top1pct_share':>14}")
    for n, s in sizes:
        r = measure_skew(n, scale=s)
        print(f"    {n:>12,} {s:>6} {r['embedding_rows']:>15,} {r['top1pct_share']:>14.3f}", flush=True)


def print_cardinalities(argv: list[str]) -> None:
    """Per table: distinct values measured at scale x KAGGLE_ROWS rows vs scale x published."""
    for scale in [float(a) for a in argv] or [0.1]:
        rows = round(scale * KAGGLE_ROWS)
        began = time.perf_counter()
        r = measure_skew(rows, scale=scale)
        seconds = time.perf_counter() - began
        expected = expected_distinct(rows, scale)
        cards = table_cardinalities(scale)
        print(f"scale {scale}, {rows:,} rows (seed 0), counted in {seconds:.0f} s: "
              f"{r['embedding_rows']:,} embedding rows, top1pct_share {r['top1pct_share']:.3f}")
        print(f"    {'table':>5} {'s x Kaggle':>12} {'distinct':>12} {'ratio':>7} {'expected':>13} {'tail':>8}")
        worst = 0.0
        for k, (base, seen) in enumerate(zip(CRITEO_KAGGLE_CARDINALITIES, r["distinct"], strict=True)):
            target = scale * base
            # tables under 5 values at this scale: no integer lies within 10% of the target, so the
            # rounded size (table_cardinalities) is the goal
            off = abs(seen - target) / target if target >= 5 else float(seen != cards[k])
            worst = max(worst, off)
            tail = f"{TAIL_SHARES[k]:.4f}" + ("w" if k in WIDE_TAIL_TABLES else "")
            print(f"    {'C' + str(k + 1):>5} {target:>12,.1f} {seen:>12,} {seen / target:>7.3f} "
                  f"{expected[k]:>13,.1f} {tail:>8}", flush=True)
        total = scale * sum(CRITEO_KAGGLE_CARDINALITIES)
        print(f"    {'all':>5} {total:>12,.1f} {sum(r['distinct']):>12,} {sum(r['distinct']) / total:>7.3f} "
              f"{expected.sum():>13,.1f}")
        print(f"    largest deviation from the target: {100 * worst:.2f}% (w: wide-tail table)\n", flush=True)


def print_solved_shares() -> None:
    began = time.perf_counter()
    solved = solve_tail_shares(1.0)
    print(f"solve_tail_shares(1.0) in {time.perf_counter() - began:.1f} s (TAIL_SHARES: the module's)")
    for k in WIDE_TAIL_TABLES:
        print(f"    C{k + 1:<3} {solved[k]:.5g}  TAIL_SHARES {TAIL_SHARES[k]:.5g}  "
              f"({'same' if math.isclose(solved[k], TAIL_SHARES[k], rel_tol=5e-5) else 'DIFFERENT'})")


def print_speed(rows: int) -> None:
    from dlrmflow.engine.serving.cluster import dask_client

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
    elif argv[:1] == ["--cardinalities"]:
        print_cardinalities(argv[1:])
    elif argv[:1] == ["--solve"]:
        print_solved_shares()
    elif argv[:1] == ["--speed"]:
        print_speed(int(argv[1]) if len(argv) > 1 else 2_000_000)
    else:
        print_skew_table(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
