"""Planner throughput: the Dask oracle cacher vs its sequential reference vs a re-implementation of Bagpipe's rule.

All on one dataset (default: 2M rows, 26 tables shaped like Criteo Kaggle's, ids drawn from
Zipf(1.2) per table, written with ``write_array_dataset``; or ``--dataset DIR``), batch 4096, L=200:

- baseline: a re-implementation of Bagpipe's oracle decision rule, not Bagpipe's code (NumPy,
  sequential; per table per batch: unique, latest-use tracker, cache indicator, keep/evict), on
  batches already in memory, with the per-batch unique inside the timing and done outside it. It
  takes dlrmflow's window L, which is Bagpipe's ``lookahead_value`` L+1 (see docs/planner.md). An
  eviction scan over whole tables is replaced by the equivalent "evict the rows of this batch that
  are not kept".
- decide: dlrmflow's decision pass alone, same in-memory batches.
- sequential: ``plan_sequential`` + ``write_plan`` end to end (reads Parquet, writes the plan).
- dask-1 / dask-2: ``plan_chunked`` + ``write_plan`` (what ``make_plan`` does) on one LocalCluster of
  2 workers, as 1 task and as 2 tasks (one per table group): 1 and 2 workers busy, end to end.

The end-to-end configurations take turns round by round, so load from other processes hits them
alike. Every plan is checked equal to the sequential one, and fetch counts equal the baseline's.
Throughput is ids/s (rows x tables in the stream) and iterations/s: medians over ``--repeats``
after one warm-up round (the first run in a process also pays imports and first touches of the
per-id arrays; it is printed separately). Then the cache-policy comparison at 0.1%, 1%, 5% of rows.

    .venv/bin/python benchmarks/plan.py [--rows 2000000] [--dataset DIR] [--repeats 3]

``--memory DATASET ...``: instead, the driver's peak memory of ``dlrmflow plan`` (``make_plan`` on a
2-worker LocalCluster, as the CLI runs it) per dataset, side by side with the whole-plan driver it replaced
(every task's result gathered, ``assemble_plan``, ``write_plan``: what ``make_plan`` did before the plan
streamed). Each run is a fresh process: its tracemalloc peak (Python and NumPy allocations while planning)
and its RSS high-water mark (``ru_maxrss``, the whole process: imports and the Dask client included).

    .venv/bin/python benchmarks/plan.py --memory DS_1M DS_3M [--lookahead 200] [--batch-size 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import deque
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from distributed import Client

from dlrmflow.datasets.meta import read_meta
from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.planning import planner
from dlrmflow.engine.planning.cache_policies import compare_dataset
from dlrmflow.engine.planning.lookahead import decide_range, iter_id_batches
from dlrmflow.engine.planning.planner import PlanConfig, plan_chunked, plan_sequential, write_plan
from dlrmflow.engine.serving.cluster import local_cluster

CRITEO_KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]


def zipf_dataset(path: Path, rows: int, exponent: float = 1.2, seed: int = 0) -> Path:
    """Ids r of each table drawn with P(r) ~ (r+1)^-exponent (hot rows first, as preprocess orders them)."""
    params = {"rows": rows, "exponent": exponent, "seed": seed, "cards": CRITEO_KAGGLE_CARDINALITIES}
    stamp = path / "zipf-params.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return path
    rng = np.random.default_rng(seed)
    sparse = np.empty((rows, len(CRITEO_KAGGLE_CARDINALITIES)), dtype=np.int32)
    for k, card in enumerate(CRITEO_KAGGLE_CARDINALITIES):
        cdf = np.cumsum(np.arange(1, card + 1, dtype=np.float64) ** -exponent)
        sparse[:, k] = np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(rows), side="right"), card - 1)
    dense = rng.random((rows, 13), dtype=np.float32)
    write_array_dataset(path, (rng.random(rows) < 0.25).astype(np.int8), dense, sparse, CRITEO_KAGGLE_CARDINALITIES)
    stamp.write_text(json.dumps(params))
    return path


def bagpipe_decisions(batches: list[list[np.ndarray]], cards: list[int], window: int,
                      uniques: list[list[np.ndarray]] | None = None) -> int:
    """Bagpipe's oracle decision rule, re-implemented with dlrmflow's window (it admits batches up to
    ``t + window``: Bagpipe's ``lookahead_value`` window+1); returns rows fetched.
    ``batches[t][k]``: table k's local ids at t."""
    latest = [np.full(c, -1, dtype=np.int64) for c in cards]
    cached = [np.zeros(c, dtype=bool) for c in cards]
    window_queue: deque[list[np.ndarray]] = deque()
    admitted, fetched = 0, 0
    for t in range(len(batches)):
        while admitted < len(batches) and admitted <= t + window:  # batch enters the lookahead window
            u = [np.unique(col) for col in batches[admitted]] if uniques is None else uniques[admitted]
            for k, ids in enumerate(u):
                latest[k][ids] = admitted
            window_queue.append(u)
            admitted += 1
        for k, ids in enumerate(window_queue.popleft()):
            fetched += int(np.count_nonzero(~cached[k][ids]))
            keep = latest[k][ids] > t  # used again within the window (everything up to t+L is admitted)
            cached[k][ids] = keep
    return fetched


def median_time(fn, repeats: int) -> tuple[list[float], object]:
    """(seconds of each of 1 + repeats calls, the last result)."""
    times, result = [], None
    for _ in range(repeats + 1):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def same_plan(a, b) -> bool:
    fields = ("prefetch_offsets", "prefetch_ids", "prefetch_slots", "evict_offsets", "evict_ids")
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields)


def in_memory_loops(stream: BatchStream, meta, args, rows: list) -> int:
    """The re-implemented Bagpipe rule (unique inside and outside the timing) and dlrmflow's pass, in memory."""
    n_iter = len(stream)
    batches = [ids_.copy() for _, ids_ in iter_id_batches(stream, 0, n_iter)]
    offsets = stream.offsets
    local = [[b[k] - offsets[k] for k in range(len(offsets))] for b in batches]
    uniques = [[np.unique(col) for col in b] for b in local]
    cards = meta.cardinalities
    note = "in memory, no Parquet, no plan written"
    times, anchor_fetched = median_time(lambda: bagpipe_decisions(local, cards, args.lookahead), args.repeats)
    rows.append(("Bagpipe's rule (re-implemented), unique inside", times, note))
    times, _ = median_time(lambda: bagpipe_decisions(local, cards, args.lookahead, uniques), args.repeats)
    rows.append(("Bagpipe's rule (re-implemented), unique outside", times, note))

    def decide():
        return decide_range(enumerate(batches), first=0, stop=n_iter, num_iterations=n_iter,
                            window=args.lookahead, distance=args.prefetch_distance, candidates=False,
                            num_rows=meta.total_embedding_rows)

    times, decisions = median_time(decide, args.repeats)
    rows.append(("dlrmflow decision pass", times, note))
    assert len(decisions.prefetch_ids) == anchor_fetched, "decision pass and the re-implemented Bagpipe rule disagree"
    return anchor_fetched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows of the generated Zipf(1.2) dataset")
    ap.add_argument("--dataset", default=None, help="plan this preprocessed dataset instead")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lookahead", type=int, default=200)
    ap.add_argument("--prefetch-distance", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--chunk-iterations", type=int, default=None,
                    help="iterations per Dask task (default max(16L, 1024)); smaller chunks read more halo")
    ap.add_argument("--skip-compare", action="store_true", help="skip the cache-policy comparison")
    ap.add_argument("--skip-in-memory", action="store_true",
                    help="skip the in-memory loops (they hold every batch in memory: ~16 bytes per id)")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dlrmflow-bench-plan"))
    ap.add_argument("--memory", nargs="+", default=None, metavar="DATASET",
                    help="driver peak memory of `dlrmflow plan`, whole plan vs streamed, on these datasets")
    ap.add_argument("--memory-child", choices=["whole", "streamed"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    config = PlanConfig(args.batch_size, args.lookahead, args.prefetch_distance)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, Path(args.dataset), config, Path(args.work_dir))))
        return
    if args.memory:
        memory_table([Path(d) for d in args.memory], args)
        return

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.dataset:
        dataset = Path(args.dataset)
        source = f"{dataset}"
    else:
        start = time.perf_counter()
        dataset = zipf_dataset(work / f"zipf-{args.rows}", args.rows)
        source = f"generated Zipf(1.2), Criteo Kaggle cardinalities ({time.perf_counter() - start:.1f} s to make)"
    meta = read_meta(dataset)
    config = PlanConfig(args.batch_size, args.lookahead, args.prefetch_distance)
    stream = BatchStream(dataset, args.batch_size, sparse_only=True)
    n_iter, ids = len(stream), meta.rows * len(meta.sparse_columns)
    print(f"dataset: {dataset} ({source})")
    print(f"  load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"  {meta.rows:,} rows x {len(meta.sparse_columns)} tables = {ids:,} ids, {meta.total_embedding_rows:,} "
          f"embedding rows; batch {args.batch_size}, L={args.lookahead}, P={args.prefetch_distance}: "
          f"{n_iter} iterations; {os.cpu_count()} CPUs (shared: numbers are noisy)")

    rows = []  # (name, seconds, first seconds, note)

    # -- decision loops on in-memory batches ---------------------------------------------------------
    anchor_fetched = None if args.skip_in_memory else in_memory_loops(stream, meta, args, rows)

    # -- end to end: Parquet in, plan directory out; the configurations take turns, so that a
    # change in the machine's load hits them alike. One 2-worker cluster: "1 worker" is one task.
    with local_cluster(max(args.workers)) as cluster, Client(cluster) as client:
        runs = {"sequential reference (end to end)": lambda: (plan_sequential(dataset, config), "sequential")}
        for n in args.workers:
            runs[f"dask, {n} worker{'s' if n > 1 else ''} (end to end)"] = (
                lambda n=n: (plan_chunked(dataset, config, client=client, table_groups=n,
                                        chunk_iterations=args.chunk_iterations), f"dask-{n}"))
        times: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        reference = None
        for _ in range(args.repeats + 1):
            for name, run in runs.items():
                workers_before = client.run(time.process_time)
                cpu_start, start = time.process_time(), time.perf_counter()
                plan, tag = run()
                write_plan(plan, work / f"plan-{tag}")
                times[name].append(time.perf_counter() - start)
                workers_after = client.run(time.process_time)
                busiest = max(workers_after[w] - workers_before[w] for w in workers_after)
                # CPU on the critical path: this process (driver + scheduler) and the busiest worker.
                cpu[name].append(time.process_time() - cpu_start + (0 if name.startswith("seq") else busiest))
                reference = reference or plan
                assert same_plan(plan, reference), f"{name} differs from the sequential reference"
    print("\nend-to-end seconds per round (round 1 = warm-up), wall / critical-path CPU:")
    for name, ts in times.items():
        print(f"  {name:40} " + " ".join(f"{x:.2f}/{c:.2f}" for x, c in zip(ts, cpu[name], strict=True)))
    for name, ts in times.items():
        note = "reads Parquet, writes the plan" + ("" if name.startswith("seq") else "; cluster start not timed")
        rows.append((name, ts, note, cpu[name]))
    assert anchor_fetched is None or len(reference.prefetch_ids) == anchor_fetched

    def median(ts: list[float]) -> float:
        return statistics.median(ts[1:])

    seq = next(median(r[1]) for r in rows if r[0].startswith("sequential"))
    anchor = None if anchor_fetched is None else median(rows[0][1])
    print()
    print(f"{'':48} {'median s':>8} {'M ids/s':>7} {'iter/s':>6} {'vs seq':>6} {'vs baseline':>11} "
          f"{'best s':>6} {'1st s':>6} {'cpu s':>6} {'M ids/cpu s':>11}")
    for name, ts, note, *cpu_ts in rows:
        sec = median(ts)
        vs_anchor = "-" if anchor is None else f"{anchor / sec:.2f}x"
        cpu_sec = median(cpu_ts[0]) if cpu_ts else None
        cpu_cols = f"{cpu_sec:6.2f} {ids / cpu_sec / 1e6:11.1f}" if cpu_sec else f"{'-':>6} {'-':>11}"
        print(f"{name:48} {sec:8.3f} {ids / sec / 1e6:7.1f} {n_iter / sec:6.0f} {seq / sec:5.2f}x "
              f"{vs_anchor:>11} {min(ts[1:]):6.3f} {ts[0]:6.3f} {cpu_cols}   {note}")
    print("cpu s: CPU seconds on the critical path (this process + the busiest worker): the wall time on an\n"
          "otherwise idle machine with a core per worker; wall times here include waiting for other tenants")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    counts = reference.summary()["counts"]
    same = "" if anchor_fetched is None else f" (= the re-implemented Bagpipe rule's {anchor_fetched:,})"
    print(f"\nplan: {counts['prefetched_rows']:,} rows prefetched{same}, "
          f"peak cache {counts['peak_occupancy']:,} rows; every Dask plan equals the sequential one")
    for tag in ["sequential", *(f"dask-{n}" for n in args.workers)]:
        shutil.rmtree(work / f"plan-{tag}", ignore_errors=True)

    if args.skip_compare:
        return
    total = meta.total_embedding_rows
    capacities = ["0.1%", "1%", "5%"]
    start = time.perf_counter()
    report = compare_dataset(dataset, args.batch_size, capacities, window=args.lookahead,
                             distance=args.prefetch_distance, embedding_dim=16)
    seconds = time.perf_counter() - start
    print(f"\ncache policies ({report['uses']:,} row uses, up to {report['max_batch_rows']:,} rows per iteration, "
          f"embedding dim 16; {seconds:.1f} s to simulate):")
    print(f"{'capacity':>18} {'policy':>7} {'rows fetched':>14} {'GB fetched':>10} {'hit rate':>9}")
    for r in report["rows"]:
        cap = "-" if r["capacity"] is None else f"{r['capacity']:,} ({100 * r['capacity'] / total:.1f}%)"
        if r["rows_fetched"] is None:
            print(f"{cap:>18} {r['policy']:>7} {'infeasible':>14}   ({r['note']})")
        else:
            print(f"{cap:>18} {r['policy']:>7} {r['rows_fetched']:>14,} {r['bytes_fetched'] / 1e9:>10.3f} "
                  f"{100 * r['hit_rate']:>8.1f}%")


def whole_plan(dataset: Path, config: PlanConfig, output: Path, client: Client) -> dict:
    """``make_plan`` as it was before the plan streamed: every task's result gathered in the driver, the
    driver passes over the whole plan (``assemble_plan``), then ``write_plan``."""
    stream = planner.open_stream(dataset, config)
    n, n_tables = len(stream), len(stream.meta.sparse_columns)
    chunks = planner.split_ranges(n, -(-n // planner.default_chunk_iterations(config))) or [(0, 0)]
    groups = planner.split_ranges(n_tables, len(planner_workers(client)))
    args = [(str(dataset.resolve()), config, c[0], c[1], g[0], g[1]) for c in chunks for g in groups]
    results = client.gather([client.submit(planner.decide_chunk, *a, pure=False) for a in args])
    per_chunk = [planner.merge_table_groups(results[i : i + len(groups)]) for i in range(0, len(results), len(groups))]
    del results
    plan = planner.assemble_plan(stream, config, planner.concat_chunks(per_chunk))
    del per_chunk
    return write_plan(plan, output)


def planner_workers(client: Client) -> dict:
    from dlrmflow.engine.serving.cluster import cluster_workers

    return cluster_workers(client)


def memory_child(variant: str, dataset: Path, config: PlanConfig, output: Path) -> dict:
    """One plan in this process (fresh), on a 2-worker LocalCluster; peak memory of this (the driver) process."""
    with local_cluster(2) as cluster, Client(cluster) as client:
        tracemalloc.start()
        start = time.perf_counter()
        if variant == "whole":
            summary = whole_plan(dataset, config, output, client)
        else:
            summary = planner.make_plan(dataset, config, output, client=client)
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return {"variant": variant, "dataset": str(dataset), "seconds": seconds, "traced_peak": peak,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "iterations": summary["num_iterations"], "prefetched_rows": summary["counts"]["prefetched_rows"],
            "files": [f["name"] for f in summary["files"]]}


def memory_table(datasets: list[Path], args) -> None:
    """Driver peak memory, whole plan (before) vs streamed (now), per dataset: each run a fresh process."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for dataset in datasets:
        for variant in ("whole", "streamed"):
            out = work / f"memplan-{variant}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, __file__, "--memory-child", variant, "--dataset", str(dataset),
                   "--batch-size", str(args.batch_size), "--lookahead", str(args.lookahead),
                   "--prefetch-distance", str(args.prefetch_distance), "--work-dir", str(out)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results.append(json.loads(line))
        a, b = (work / "memplan-whole"), (work / "memplan-streamed")
        assert json.loads((a / "plan.json").read_text()) == json.loads((b / "plan.json").read_text())
        for name in results[-1]["files"]:  # the same plan, file by file
            assert pq.read_table(a / name).equals(pq.read_table(b / name)), name
    print(f"batch {args.batch_size}, L={args.lookahead}, P={args.prefetch_distance}; driver = the planning process "
          "(2 Dask worker processes beside it); every streamed plan equals the whole one")
    print(f"{'dataset':>40} {'rows':>10} {'iters':>6} {'plan':>9} {'seconds':>8} {'traced peak MB':>14} "
          f"{'RSS peak MB':>11}")
    for r in results:
        rows = read_meta(r["dataset"]).rows
        print(f"{Path(r['dataset']).name:>40} {rows:>10,} {r['iterations']:>6} {r['variant']:>9} "
              f"{r['seconds']:>8.2f} {r['traced_peak'] / 2**20:>14.1f} {r['maxrss'] / 2**20:>11.1f}")
    for variant in ("whole", "streamed"):
        rs = [r for r in results if r["variant"] == variant]
        if len(rs) >= 2:
            traced = rs[-1]["traced_peak"] / rs[0]["traced_peak"]
            print(f"{variant}: largest / smallest dataset: traced peak {traced:.2f}x, "
                  f"RSS peak {rs[-1]['maxrss'] / rs[0]['maxrss']:.2f}x")


if __name__ == "__main__":
    main()
