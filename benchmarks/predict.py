"""``dlrmflow predict`` in one process against on a 2-worker Dask LocalCluster, and a task's memory (issue 44).

Rows/s: ``predict_run`` of a finished run's final model (the Criteo Kaggle DLRM after a few iterations, as in
benchmarks/evaluation.py) on ROWS synthetic rows (``bench_data.synthetic_dataset``, already preprocessed),
writing every row's prediction: in this process (the parts one after another, torch with its default
threads), and a part per Dask task on a LocalCluster of WORKERS single-threaded workers (started once, not
timed). Rounds alternate, REPEATS of each; medians side by side, the ratio, and whether every round wrote
the same probability bits and the same AUC and log loss (exit status 1 otherwise).

Memory per task: a fresh process scores one part (PART_ROWS rows, as a task does: ``score_part`` with its
predictions written) of a run at each ``--memory-scales`` table size; its peak RSS while scoring (sampled
every 5 ms) against the process's after the imports and the model's load, and of it the anonymous memory
(the part's own arrays): the pages of the memory-mapped state files it touched count in RSS too, but they
are the kernel's page cache, shared and dropped under pressure, not the task's.

    .venv/bin/python benchmarks/predict.py [--rows 1000000] [--scale 0.01] [--workers 2] [--repeats 3]
                                           [--memory-scales 0.01,1.0]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from bench_data import synthetic_dataset
from distributed import Client
from evaluation import finished_run

from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.training.prediction import predict_run

BATCH = 4096  # dlrmflow predict's default batch size
PART_ROWS = 1 << 18  # rows of the part whose task's memory is measured


def probabilities(out: Path) -> np.ndarray:
    table = pq.read_table(out)
    return table.column("probability").to_numpy()[np.argsort(table.column("row").to_numpy())]


def task_memory(run_dir: str, dataset: str, queue: multiprocessing.Queue) -> None:
    """In a fresh process: the peak RSS (MiB) of scoring one part as a task does, above the RSS after the
    imports and the model's load; and that base."""
    import threading

    import psutil

    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.engine.training.cluster_scoring import DenseModel, InitRows, Part, PredictionParts, score_part
    from dlrmflow.engine.training.continuation import read_finished_run
    from dlrmflow.engine.training.scoring import scoring_setup

    torch.set_num_threads(1)  # as a worker's task
    run, meta = read_finished_run(run_dir), read_meta(dataset)
    dense, config, cards, spec = scoring_setup(run, meta, dataset, run_dir)
    model = DenseModel(config, dense["dense"], spec.dim)
    model.build(torch.device("cpu"))
    me = psutil.Process()

    def now() -> tuple[float, float]:  # RSS, and its anonymous part (not pages of mapped files)
        info = me.memory_info()
        return info.rss / 2**20, (info.rss - info.shared) / 2**20

    base = peak = now()
    scoring = threading.Event()

    def sample() -> None:  # the peaks while the part is scored, every 5 ms
        nonlocal peak
        while not scoring.wait(0.005):
            peak = tuple(max(a, b) for a, b in zip(peak, now(), strict=True))

    sampler = threading.Thread(target=sample)
    sampler.start()
    out = tempfile.mkdtemp()
    try:
        score_part(Part(0, 1, 0, PART_ROWS), model, InitRows(spec), dataset, BATCH, "cpu", tuple(cards),
                   PredictionParts(out))
    finally:
        scoring.set()
        sampler.join()
        shutil.rmtree(out)
    queue.put((base, peak, spec.total_rows, spec.width))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows scored")
    parser.add_argument("--scale", type=float, default=0.01, help="Criteo Kaggle table sizes x SCALE")
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes (one thread each)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each way")
    parser.add_argument("--iterations", type=int, default=20, help="training iterations of the scored model")
    parser.add_argument("--memory-scales", default="0.01,1.0", help="table scales of the memory measurement")
    parser.add_argument("--memory-only", action="store_true", help="only the memory measurement")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dlrmflow-bench-predict")
    args = parser.parse_args()

    logging.getLogger("distributed").setLevel(logging.WARNING)
    if args.memory_only:
        memory(args)
        return 0
    dataset = synthetic_dataset(args.work / f"data-{args.rows}-{args.scale:g}", args.rows, args.scale)
    run_dir = finished_run(dataset, args.work / f"run-{args.rows}-{args.scale:g}-{args.iterations}", args.iterations)
    print(f"{args.rows:,} rows at scale {args.scale:g}, batch {BATCH}, Criteo DLRM; {os.cpu_count()} cores "
          f"({platform.machine()}), torch {torch.__version__} with {torch.get_num_threads()} threads in process, "
          f"{args.workers} single-threaded Dask workers; load average {os.getloadavg()[0]:.2f} (1 min)", flush=True)

    seconds: dict[str, list[float]] = {"in process": [], "cluster": []}
    results: list[tuple] = []
    cluster = local_cluster(args.workers)
    with cluster, Client(cluster, direct_to_workers=True) as client:
        for round_ in range(args.repeats):
            for way in ("in process", "cluster"):
                out = args.work / "out"
                shutil.rmtree(out, ignore_errors=True)
                start = time.perf_counter()
                result = predict_run(run_dir, [dataset], out, batch_size=BATCH,
                                     client=client if way == "cluster" else None)
                took = time.perf_counter() - start
                seconds[way].append(took)
                results.append((result["auc"], result["log_loss"], probabilities(out).tobytes()))
                print(f"  round {round_ + 1} {way:>10}: {took:7.2f} s  {result['rows'] / took:10,.0f} rows/s "
                      f"({result['parts']} parts)", flush=True)
        shutil.rmtree(args.work / "out", ignore_errors=True)

    rate = {way: args.rows / statistics.median(s) for way, s in seconds.items()}
    print(f"\n{'':>12} {'median s':>9} {'rows/s':>10}")
    for way in ("in process", "cluster"):
        print(f"{way:>12} {statistics.median(seconds[way]):9.2f} {rate[way]:10,.0f}")
    print(f"cluster / in process: {rate['cluster'] / rate['in process']:.2f}x (goal: at least 1.6x); load average "
          f"now {os.getloadavg()[0]:.2f} (1 min)")
    equal = len(set(results)) == 1
    print(f"probabilities, AUC and log loss equal bit for bit in every round, both ways: {'yes' if equal else 'NO'}")
    print(f"AUC {results[0][0]!r}, log loss {results[0][1]!r}")

    memory(args)
    return 0 if equal else 1


def memory(args: argparse.Namespace) -> None:
    """The memory of a task scoring a part, at each of ``--memory-scales`` (module docstring)."""
    print(f"\nmemory of a task scoring {PART_ROWS:,} rows (a fresh process; peaks while scoring, sampled "
          "every 5 ms, against its memory after the imports and the model):")
    context = multiprocessing.get_context("spawn")
    for scale in (float(s) for s in args.memory_scales.split(",")):
        rows = max(PART_ROWS, 2 * BATCH * 2)
        data = synthetic_dataset(args.work / f"data-{rows}-{scale:g}", rows, scale)
        run = finished_run(data, args.work / f"run-{rows}-{scale:g}-2", 2)
        queue = context.Queue()
        child = context.Process(target=task_memory, args=(str(run), str(data), queue))
        child.start()
        (base, base_anon), (peak, peak_anon), total_rows, width = queue.get()
        child.join()
        table_mib = total_rows * width * 4 / 2**20
        print(f"  scale {scale:g}: table {total_rows:,} rows x {width} ({table_mib:,.0f} MiB on disk): RSS "
              f"{base:,.0f} -> {peak:,.0f} MiB (+{peak - base:,.0f}), of it anonymous {base_anon:,.0f} -> "
              f"{peak_anon:,.0f} MiB (+{peak_anon - base_anon:,.0f}); the rest: pages of the mapped files",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
