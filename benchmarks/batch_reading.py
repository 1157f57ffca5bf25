"""What one of W trainers spends per iteration on its batch: reading the whole global batch and splitting it
(before issue 33), against reading its own slice and splitting it with the run's slices (now).

For each configuration (benchmarks/train.py's datasets: ``a`` the Criteo architecture's batch of 4096,
``b`` the embedding-bound one's 16384) and each W, in this one process, one trainer after another
(``rank`` 0 .. W-1) times what the training loop does between two steps for every iteration:

- whole: read the global batch (``BatchStream``), its global ids, ``BatchSplit.of`` (one sort of the
  whole batch's ids);
- slice: read its slice (``BatchStream.sliced``), its global ids, ``BatchSlices.split`` (the batch's
  distinct ids and their trainers, as ``prepare_trainers`` wrote them before the run).

It prints the median ms per iteration over every iteration and rank, the ratio slice / whole, and the
issue's goal (at most 1/W). Both ways must give the same split (checked, exit status 1 otherwise).

    .venv/bin/python benchmarks/batch_reading.py [--configs a,b] [--trainers 2,4] [--iterations 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from train import CONFIGS, config_dataset

from dlrmflow.engine.batch_stream import BatchStream, global_ids
from dlrmflow.engine.planning.holders import slice_masks
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.trainer_slices import BatchSlices, SliceWriter


def write_slices(dataset: Path, batch: int, size: int, iterations: int, directory: Path) -> BatchSlices:
    directory.mkdir(parents=True, exist_ok=True)
    stream = BatchStream(dataset, batch, sparse_only=True)
    writer = SliceWriter(directory, size)
    for t, b in enumerate(stream.iter_range(0, iterations)):
        writer.add(t, *slice_masks(global_ids(b.sparse, stream.offsets), size))
    writer.close()
    return BatchSlices.load(directory, size)


def time_whole(dataset: Path, batch: int, size: int, rank: int, iterations: int) -> tuple[list[float], list]:
    stream = BatchStream(dataset, batch)
    times, splits = [], []
    batches = stream.iter_range(0, iterations)
    for t in range(iterations):
        start = time.perf_counter()
        b = next(batches)
        split = BatchSplit.of(t, global_ids(b.sparse, stream.offsets), size, rank)
        times.append(time.perf_counter() - start)
        splits.append(split)
    return times, splits


def time_slice(dataset: Path, batch: int, size: int, rank: int, iterations: int, slices: BatchSlices
               ) -> tuple[list[float], list]:
    stream = BatchStream(dataset, batch).sliced(rank, size)
    times, splits = [], []
    batches = stream.iter_range(0, iterations)
    for t in range(iterations):
        start = time.perf_counter()
        b = next(batches)
        split = slices.split(t, rank, global_ids(b.sparse, stream.offsets))
        times.append(time.perf_counter() - start)
        splits.append(split)
    return times, splits


def same(a: BatchSplit, b: BatchSplit) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("union", "users", "inverse"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="a,b", help="comma-separated: a, b (default a,b)")
    parser.add_argument("--trainers", default="2,4", help="comma-separated trainer counts W (default 2,4)")
    parser.add_argument("--iterations", type=int, default=20, help="batches per run (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every (config, W) (default 3)")
    parser.add_argument("--work-dir", default="/tmp/dlrmflow-bench-trainers", help="datasets (shared with trainers.py)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object instead")
    args = parser.parse_args()
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
          file=sys.stderr)
    rows, bad = [], []
    for key in args.configs.split(","):
        batch = CONFIGS[key]["batch"]
        dataset = config_dataset(key, args.iterations, Path(args.work_dir))
        for size in (int(w) for w in args.trainers.split(",")):
            slices = write_slices(dataset, batch, size, args.iterations, Path(args.work_dir) / f"slices-{key}-{size}")
            whole, alone = [], []
            for _ in range(args.repeats):
                for rank in range(size):
                    t_whole, s_whole = time_whole(dataset, batch, size, rank, args.iterations)
                    t_alone, s_alone = time_slice(dataset, batch, size, rank, args.iterations, slices)
                    whole += t_whole
                    alone += t_alone
                    bad += [f"[{key}] W={size} rank {rank} iteration {t}: the splits differ"
                            for t, (a, b) in enumerate(zip(s_whole, s_alone, strict=True)) if not same(a, b)]
            row = {"config": key, "batch": batch, "trainers": size, "whole_ms": 1e3 * float(np.median(whole)),
                   "slice_ms": 1e3 * float(np.median(alone)), "whole_mean_ms": 1e3 * float(np.mean(whole)),
                   "slice_mean_ms": 1e3 * float(np.mean(alone))}
            row["ratio"] = row["slice_ms"] / row["whole_ms"]
            rows.append(row)
            print(f"[{key}] W={size}: whole {row['whole_ms']:.1f} ms, slice {row['slice_ms']:.1f} ms", file=sys.stderr)
    if args.json:
        print(json.dumps({"rows": rows, "mismatches": bad}, indent=2))
    else:
        header = (f"{'cfg':<4}{'batch':>7}{'W':>3}{'whole ms':>10}{'slice ms':>10}{'slice/whole':>13}{'goal 1/W':>10}"
                  f"{'':>9}{'mean: whole':>12}{'slice':>7}")
        print(header + "\n" + "-" * len(header))
        for r in rows:
            verdict = "met" if r["ratio"] <= 1 / r["trainers"] else "NOT met"
            print(f"{r['config']:<4}{r['batch']:>7}{r['trainers']:>3}{r['whole_ms']:10.1f}{r['slice_ms']:10.1f}"
                  f"{r['ratio']:13.2f}{1 / r['trainers']:10.2f} {verdict:<8}{r['whole_mean_ms']:12.1f}"
                  f"{r['slice_mean_ms']:7.1f}")
        print("per trainer per iteration (median over iterations, ranks and rounds): whole = read the global batch\n"
              "and split it (before); slice = read its own slice and split it with the run's slices (now); mean:\n"
              "the first iteration of a run also decodes a block of up to 2^20 rows from parquet, the whole block\n"
              "either way (only the arrays made from it are the slice's)")
        print(*(bad or ["splits: the same both ways for every iteration and rank"]), sep="\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
