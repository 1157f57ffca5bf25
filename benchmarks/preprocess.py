"""Preprocessing throughput: dlrmflow (Dask) vs a plain single-process pandas implementation.

Both do the same transform on the same generated raw Criteo TSV: dense log(max(x,0)+1) as
float32, categorical hex -> ids ordered by frequency (0 = missing), seeded shuffle, Parquet.
The pandas baseline does no per-row validation (dlrmflow does), so it is a generous baseline.

    .venv/bin/python benchmarks/preprocess.py [--rows 2000000] [--workers 2] [--repeats 3]

Prints rows/s of each (median over repeats) and the ratio. Cluster start-up is measured and
printed separately: a pipeline pays it once for all its steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from dlrmflow.datasets.formats import CRITEO_DENSE, CRITEO_SPARSE
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.datasets.synthetic import generate
from dlrmflow.engine.serving.cluster import local_cluster


def pandas_preprocess(src: Path, out: Path, seed: int = 0) -> int:
    names = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
    dtype = {"label": "int8", **{c: "float64" for c in CRITEO_DENSE}, **{c: "string" for c in CRITEO_SPARSE}}
    df = pd.read_csv(src, sep="\t", header=None, names=names, dtype=dtype)
    for c in CRITEO_DENSE:
        df[c] = np.log1p(df[c].fillna(0).clip(lower=0)).astype("float32")
    for c in CRITEO_SPARSE:
        codes, uniques = pd.factorize(df[c])  # -1 = missing
        counts = np.bincount(codes[codes >= 0], minlength=len(uniques))
        values = np.array([int(u, 16) for u in uniques], dtype=np.int64)
        rank = np.lexsort((values, -counts))  # by count desc, then value
        ids = np.empty(len(uniques), dtype=np.int32)
        ids[rank] = np.arange(1, len(uniques) + 1, dtype=np.int32)
        df[c] = np.where(codes >= 0, ids[np.maximum(codes, 0)], 0).astype("int32")
    df = df.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "part-00000.parquet", index=False)
    return len(df)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dlrmflow-bench"))
    args = ap.parse_args()

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"criteo-{args.rows}.tsv"
    if not src.exists():
        print(f"generating {args.rows:,} rows -> {src} ...", file=sys.stderr)
        generate(src, args.rows, seed=0, scale=1.0)
    size_mb = src.stat().st_size / 1e6
    print(f"input: {src} ({args.rows:,} rows, {size_mb:,.0f} MB), {os.cpu_count()} cores")

    t0 = time.perf_counter()
    cluster = local_cluster(args.workers)
    from distributed import Client

    client = Client(cluster)
    startup = time.perf_counter() - t0

    ours, base = [], []
    for r in range(args.repeats):
        out = work / "ours"
        t0 = time.perf_counter()
        summary = preprocess([src], out, client=client, force=True)
        ours.append(time.perf_counter() - t0)
        assert summary["rows"] == args.rows
        shutil.rmtree(out)
        t0 = time.perf_counter()
        n = pandas_preprocess(src, work / "pandas")
        base.append(time.perf_counter() - t0)
        assert n == args.rows
        shutil.rmtree(work / "pandas")
        print(f"  repeat {r + 1}: dlrmflow {ours[-1]:.2f} s, pandas {base[-1]:.2f} s", file=sys.stderr)
    client.close()
    cluster.close()

    o, b = statistics.median(ours), statistics.median(base)
    print(f"\n{'implementation':<44} {'median s':>9} {'rows/s':>12}")
    print(f"{'dlrmflow preprocess, Dask ' + str(args.workers) + ' workers':<44} {o:>9.2f} {args.rows / o:>12,.0f}")
    print(f"{'pandas, single process (no validation)':<44} {b:>9.2f} {args.rows / b:>12,.0f}")
    print(f"speed-up vs pandas: {b / o:.2f}x   (LocalCluster start-up, paid once per flow: {startup:.1f} s)")


if __name__ == "__main__":
    main()
