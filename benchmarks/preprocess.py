"""Preprocessing throughput: dlrmflow (Dask) vs a plain single-process pandas implementation.

Both do the same transform on the same generated raw Criteo TSV: dense log(max(x,0)+1) as
float32, categorical hex -> ids ordered by frequency (0 = missing), seeded shuffle, Parquet.
The pandas baseline does no per-row validation (dlrmflow does), so it is a generous baseline.

    .venv/bin/python benchmarks/preprocess.py [--rows 2000000] [--workers 2] [--repeats 3]

Prints rows/s of each (median over repeats) and the ratio. Cluster start-up is measured and
printed separately: a pipeline pays it once for all its steps.

    .venv/bin/python benchmarks/preprocess.py --scales [--rows 1000000] [--memory-rows 1000000 3000000]
        [--baseline OLD_preprocess.py]

Real cardinalities instead: rows/s at generator scale 0.01 and 1.0 for the same rows, and the peak
anonymous memory of all processes (driver + Dask workers, RssAnon summed, sampled every 50 ms, a fresh
cluster per run) at each of --memory-rows at scale 1.0, with the CPU seconds of all those processes
(robust to a loaded machine where the wall time is not). With --baseline (an older
datasets/preprocess.py, e.g. from `git show REV:datasets/preprocess.py`; it runs on this checkout's
parser and cluster), the same runs of that code, interleaved with this code's, in the same run; with
--dask-trim, this code again on workers with the malloc trim threshold that Dask's nannies set.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
from scale import _rss_anon  # benchmarks/scale.py: one process's RssAnon

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


class AnonMemory:
    """Peak of the summed RssAnon of this process and all its descendants (the Dask workers), sampled; and
    the CPU seconds they spent meanwhile (user + system, per process from the first to the last sample),
    which a loaded machine inflates far less than the wall time."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._cpu: dict[int, list[float]] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def cpu_seconds(self) -> float:
        return sum(last - first for first, last in self._cpu.values())

    def __enter__(self) -> AnonMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while True:
            procs = [me, *me.children(recursive=True)]
            self.peak = max(self.peak, sum(_rss_anon(p.pid) for p in procs))
            for p in procs:
                try:
                    t = p.cpu_times()
                except psutil.Error:  # the process ended
                    continue
                self._cpu.setdefault(p.pid, [t.user + t.system] * 2)[1] = t.user + t.system
            if self._stop.is_set():
                return
            self._stop.wait(self.interval)


def _load_baseline(path: str):
    """An older preprocess module under its own name, importable by the Dask workers started after this
    (they inherit PYTHONPATH; a module pickled by value loses its dataclasses' module)."""
    folder = tempfile.mkdtemp(prefix="dlrmflow-baseline-")
    shutil.copyfile(path, Path(folder) / "baseline_preprocess.py")
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
    return importlib.import_module("baseline_preprocess")


def _input(work: Path, rows: int, scale: float) -> Path:
    src = work / f"criteo-{rows}-s{scale:g}.tsv"
    if not src.exists():
        print(f"generating {rows:,} rows at scale {scale:g} -> {src} ...", file=sys.stderr)
        from distributed import Client

        with local_cluster(2) as cluster, Client(cluster) as client:
            generate(src, rows, seed=0, scale=scale, client=client)
    return src


def _measured_run(run, src: Path, out: Path, workers: int, *, dask_trim: bool = False
                  ) -> tuple[float, int, float, dict]:
    """(seconds, peak anonymous bytes of all processes, their CPU seconds, summary) of one run on a fresh
    cluster (started before the measurement). ``dask_trim``: its workers get the MALLOC_TRIM_THRESHOLD_
    that Dask's nannies set by default and dlrmflow's LocalCluster leaves out (engine/serving/cluster.py)."""
    from distributed import Client

    if dask_trim:
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"  # the workers inherit it; this process's malloc is set up
    try:
        cluster = local_cluster(workers)
    finally:
        os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    with cluster, Client(cluster) as client:
        with AnonMemory() as memory:
            t0 = time.perf_counter()
            summary = run([src], out, client=client, force=True)
            seconds = time.perf_counter() - t0
    shutil.rmtree(out)
    return seconds, memory.peak, memory.cpu_seconds, summary


def compare_scales(args) -> None:
    """Rows/s at scale 0.01 and 1.0 for the same rows; peak memory at each of --memory-rows (scale 1.0)."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    runs = [(f"{args.rows:,} rows, scale 0.01", args.rows, 0.01)]
    runs += [(f"{n:,} rows, scale 1.0", n, 1.0) for n in sorted({args.rows, *args.memory_rows})]
    impls: dict[str, tuple] = {"this code": (preprocess, False)}
    if args.baseline:
        impls = {"baseline": (_load_baseline(args.baseline).preprocess, False), **impls}
    if args.dask_trim:
        impls["this code, Dask's malloc trim"] = (preprocess, True)
    print(f"{os.cpu_count()} cores, {args.workers} Dask workers, load average {os.getloadavg()[0]:.1f} at the start")
    results: dict[tuple[str, str], list[tuple[float, int, int, float]]] = {}
    for r in range(args.repeats):
        for label, rows, scale in runs:
            src = _input(work, rows, scale)
            for name, (run, trim) in impls.items():  # interleaved: the load of the moment hits both alike
                seconds, peak, cpu, summary = _measured_run(run, src, work / "out", args.workers, dask_trim=trim)
                assert summary["rows"] == rows
                results.setdefault((name, label), []).append((seconds, peak, summary["embedding_rows"], cpu))
                print(f"  repeat {r + 1}: {name}, {label}: {seconds:.2f} s, {rows / seconds:,.0f} rows/s, "
                      f"{cpu:.1f} CPU s, peak {peak / 2**20:,.0f} MiB, load {os.getloadavg()[0]:.1f}",
                      file=sys.stderr)
    print("\n| code | input | embedding rows | median s | rows/s | CPU s (all processes) | rows per CPU s "
          "| peak anon MiB (all processes) |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, label), got in results.items():
        rows = int(label.split()[0].replace(",", ""))
        seconds = statistics.median(g[0] for g in got)
        cpu = statistics.median(g[3] for g in got)
        peak = max(g[1] for g in got)
        print(f"| {name} | {label} | {got[0][2]:,} | {seconds:.2f} | {rows / seconds:,.0f} | {cpu:.1f} "
              f"| {rows / cpu:,.0f} | {peak / 2**20:,.0f} |")
    lo, hi = min(args.memory_rows), max(args.memory_rows)
    for name in impls:
        def med(label, name=name):
            return statistics.median(g[0] for g in results[(name, label)])

        small, full = med(f"{args.rows:,} rows, scale 0.01"), med(f"{args.rows:,} rows, scale 1.0")
        peaks = {n: max(g[1] for g in results[(name, f"{n:,} rows, scale 1.0")]) for n in (lo, hi)}
        print(f"{name}: rows/s at scale 1.0 / at scale 0.01 = {small / full:.2f}x; "
              f"peak memory {hi:,} / {lo:,} rows = {peaks[hi] / peaks[lo]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dlrmflow-bench"))
    ap.add_argument("--scales", action="store_true", help="rows/s at scale 0.01 vs 1.0 and peak memory (see above)")
    ap.add_argument("--memory-rows", type=int, nargs=2, default=[1_000_000, 3_000_000])
    ap.add_argument("--baseline", help="with --scales: an older datasets/preprocess.py to run alongside")
    ap.add_argument("--dask-trim", action="store_true",
                    help="with --scales: also this code on workers with Dask's default MALLOC_TRIM_THRESHOLD_")
    args = ap.parse_args()
    if args.scales:
        compare_scales(args)
        return

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
