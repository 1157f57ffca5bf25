"""Scoring held-out rows in one process against on a 2-worker Dask LocalCluster (issue 42, item 2).

One model, one set of rows, both ways: ``dlrmflow evaluate``'s scoring (``evaluate_run``) of a finished
run's final model on ROWS synthetic rows (``bench_data.synthetic_dataset``), its embedding rows read by id
from the run's ``final_state/`` shard files, memory-mapped:

- in process: this process scores every batch (torch with its default threads, every core, or
  ``--threads``);
- cluster: the rows cut into parts of whole batches, a part per Dask task on a LocalCluster of WORKERS
  single-threaded worker processes (dlrmflow's own, :func:`~dlrmflow.engine.serving.cluster.local_cluster`),
  the parts' summaries merged in this process. The cluster starts once, before the rounds (not timed); each
  timed round includes sending the model, the tasks and the merge.

The model is the Criteo Kaggle DLRM (sparse dim 16, bottom 13-512-256-64-16, top 367-512-256-1) after a few
training iterations on the dataset's first batches (the run's state must exist; what it learned does not
matter here). Rounds alternate (in process, cluster), REPEATS of each; it prints every round, the medians
in rows/s side by side, the ratio cluster / in process (the issue's goal: at least 1.6x), and the AUC and
log loss of both, which must be equal bit for bit (exit status 1 otherwise).

``--periodic``: ``train --eval-every``'s evaluations between iterations instead, ROWS held-out rows after
a few training batches, a ``remote`` run with ``--parity 1`` on the LocalCluster: once with its
evaluations in the trainer's process, once on the cluster (the servers write their rows overlaid with the
trainer's, the workers score them); every evaluation is timed (the snapshot and its removal included) and
both runs' evaluations and final state must be equal bit for bit.

    .venv/bin/python benchmarks/evaluation.py [--rows 1000000] [--scale 0.01] [--workers 2] [--repeats 3]
    .venv/bin/python benchmarks/evaluation.py --periodic [--rows 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_data import synthetic_dataset
from distributed import Client

from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.scoring import evaluate_run

BATCH = 4096  # dlrmflow evaluate's default batch size


def finished_run(dataset: Path, run_dir: Path, iterations: int) -> Path:
    """A local-mode run of ``iterations`` batches on ``dataset`` with its final state (reused when present)."""
    if (run_dir / "summary.json").is_file():
        return run_dir
    config = TrainConfig(dataset_dir=str(dataset), mode="local", output_dir=str(run_dir), batch_size=BATCH,
                         iterations=iterations, eval_fraction=0.0, metrics_every=iterations)
    train(config)
    return run_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows scored")
    parser.add_argument("--scale", type=float, default=0.01, help="Criteo Kaggle table sizes x SCALE")
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes (one thread each)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each way")
    parser.add_argument("--iterations", type=int, default=20, help="training iterations of the scored model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in process (default: torch's)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dlrmflow-bench-evaluation")
    parser.add_argument("--periodic", action="store_true", help="time train --eval-every's evaluations instead")
    args = parser.parse_args()
    if args.periodic:
        return periodic(args)

    logging.getLogger("distributed").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = synthetic_dataset(args.work / f"data-{args.rows}-{args.scale:g}", args.rows, args.scale)
    run_dir = finished_run(dataset, args.work / f"run-{args.rows}-{args.scale:g}-{args.iterations}", args.iterations)
    print(f"{args.rows:,} rows at scale {args.scale:g}, batch {BATCH}, Criteo DLRM; {os.cpu_count()} cores "
          f"({platform.machine()}), torch {torch.__version__} with {torch.get_num_threads()} threads in process, "
          f"{args.workers} single-threaded Dask workers; load average {os.getloadavg()[0]:.2f} (1 min)", flush=True)

    results: dict[str, list[dict]] = {"in process": [], "cluster": []}
    seconds: dict[str, list[float]] = {"in process": [], "cluster": []}
    cluster = local_cluster(args.workers)
    with cluster, Client(cluster, direct_to_workers=True) as client:
        for round_ in range(args.repeats):
            for way in ("in process", "cluster"):
                start = time.perf_counter()
                result = evaluate_run(run_dir, dataset, batch_size=BATCH,
                                      client=client if way == "cluster" else None)
                took = time.perf_counter() - start
                seconds[way].append(took)
                results[way].append(result)
                print(f"  round {round_ + 1} {way:>10}: {took:7.2f} s  {result['rows'] / took:10,.0f} rows/s",
                      flush=True)

    median = {way: statistics.median(s) for way, s in seconds.items()}
    rate = {way: args.rows / m for way, m in median.items()}
    print(f"\n{'':>12} {'median s':>9} {'rows/s':>10} {'AUC':>20} {'log loss':>20}")
    for way in ("in process", "cluster"):
        r = results[way][0]
        print(f"{way:>12} {median[way]:9.2f} {rate[way]:10,.0f} {r['auc']!r:>20} {r['log_loss']!r:>20}")
    ratio = rate["cluster"] / rate["in process"]
    print(f"cluster / in process: {ratio:.2f}x (goal: at least 1.6x); load average now "
          f"{os.getloadavg()[0]:.2f} (1 min): other processes on these cores slow both ways, a multi-threaded "
          "process more")
    figures = {(r["auc"], r["log_loss"], r["constant_log_loss"], r["rows"]) for rs in results.values() for r in rs}
    equal = len(figures) == 1
    print(f"AUC and log loss equal bit for bit in every round, both ways: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


def periodic(args: argparse.Namespace) -> int:
    """--periodic (module docstring): the same run twice, its evaluations timed one by one."""
    from dlrmflow.engine.training import cluster_scoring, trainer

    logging.getLogger("distributed").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    train_rows = (2 * args.repeats + 1) * BATCH
    total = args.rows + train_rows
    dataset = synthetic_dataset(args.work / f"data-{total}-{args.scale:g}", total, args.scale)
    print(f"train --mode remote --parity 1 --eval-every 1: {args.repeats} evaluations of {args.rows:,} held-out "
          f"rows each way, batch {BATCH}, Criteo DLRM at scale {args.scale:g}; {os.cpu_count()} cores, "
          f"{args.workers} single-threaded Dask workers; load average {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    real = trainer.periodic_evaluation
    seconds: dict[str, list[float]] = {"in process": [], "cluster": []}
    summaries = {}
    cluster = local_cluster(args.workers)
    with cluster, Client(cluster, direct_to_workers=True) as client:
        for way, least in (("in process", 10**12), ("cluster", 0)):
            def timed(*a, way=way, **kw):
                start = time.perf_counter()
                result = real(*a, **kw)
                seconds[way].append(time.perf_counter() - start)
                print(f"  {way:>10} evaluation {len(seconds[way])}: {seconds[way][-1]:7.2f} s  "
                      f"{args.rows / seconds[way][-1]:10,.0f} rows/s", flush=True)
                return result

            cluster_scoring.CLUSTER_MIN_ROWS, trainer.periodic_evaluation = least, timed
            try:
                config = TrainConfig(dataset_dir=str(dataset), mode="remote", parity=1, num_shards=2,
                                     output_dir=str(args.work / f"periodic-{way.replace(' ', '-')}"),
                                     batch_size=BATCH, eval_batch_size=BATCH, iterations=args.repeats + 1,
                                     eval_every=1, eval_fraction=args.rows / total, metrics_every=1000,
                                     save_state=False)
                summaries[way] = train(config, client=client)
            finally:
                trainer.periodic_evaluation = real

    median = {way: statistics.median(s) for way, s in seconds.items()}
    print(f"\n{'':>12} {'median s':>9} {'rows/s':>10}")
    for way in ("in process", "cluster"):
        print(f"{way:>12} {median[way]:9.2f} {args.rows / median[way]:10,.0f}")
    print(f"cluster / in process: {median['in process'] / median['cluster']:.2f}x (goal: at least 1.6x)")
    a, b = summaries["in process"], summaries["cluster"]
    equal = a["evaluations"] == b["evaluations"] and a["state_sha256"] == b["state_sha256"]
    print(f"every evaluation and the final state equal bit for bit: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
