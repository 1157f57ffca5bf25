"""Fault tolerance side by side: no protection, checkpoint + replay (two intervals), parity R = 1, 2.

One run, same data, same kill (SIGKILL of the Dask worker hosting data shard 0 when iteration
``--kill-at`` starts). Every mode trains ``--iterations`` cached iterations (``--cache lru``, the default:
write-backs on the training step's path; ``--cache oracle``: the lookahead plan, whose prefetch worker
does the write-backs, with their parity, in the background) twice: failure-free
(its overhead), and with the kill (its recovery); ``none`` cannot recover, so it only has the
failure-free run, which is the baseline of every ratio.

Modes: none, checkpoint every N (``--checkpoint-every``), parity R = 1 and R = 2, R = 1 with the
rebuild capped at ``--paced-rate`` MB/s (``--rebuild-rate``: it trades a longer rebuild for training
during it), and R = 1 copying every stripe (``R=1 copy all``). A rebuild copies only the stripes with a
row the trainer wrote back and the replacement generates the rest from the seed; early in a run (a
kill at 150 of a fresh table) most rows are unwritten, while a table whose every row has been trained
copies them all: ``copy all`` is that worst case, on the same kill. The last two equal R = 1 until a
failure, so they share its failure-free runs.

Reported per mode:

- ms/iteration failure-free: the median train step plus the checkpoint writes spread over the
  iterations (median over ``--repeats`` failure-free runs in rotated order), and its overhead vs none;
  also per round (each mode's run against the none run of the same round, which ran minutes apart at
  most): the median and the range of those ratios, which show how much of a few percent is noise;
- time to recover: parity, detection -> every lost stripe rebuilt (training runs meanwhile);
  checkpoint, detection -> reloaded and replayed back to the iteration that failed; for parity also
  the time before the copy (settling the last batch, resetting the replacements, choosing the
  stripes to copy), the bulk copy's wall time, the copy tasks' own time on the replacement's worker within it (the
  rest is their dispatch through the scheduler and the fix-ups), and the tasks' wait for the
  survivors' answers and their decode + install;
- throughput during recovery: new iterations finished per second between detection and
  recovered, relative to the same run's rate before the kill (a checkpoint replay trains no new
  iteration); and the same counting the part of each iteration that falls inside that window
  (iteration j runs from the end of j - 1 to its own end), since a rebuild shorter than a few
  steps holds few whole ones: one that ends before the step that noticed the loss does reads 0%;
- total time lost: wall time of the failure run minus the median failure-free run (noisy; on one
  machine it includes the nanny restarting the killed worker process, which competes for the cores);
- memory overhead: parity rows on the servers + the trainer's copies of fetched rows (parity),
  or the checkpoint file (checkpoint), relative to the embedding table;
- parity traffic (bytes of deltas, only at eviction) and whether the final state is
  bit-identical to the failure-free run (it must be: equal SHA-256).

    .venv/bin/python benchmarks/fault_tolerance.py [--scale 0.05] [--iterations 200] [--kill-at 150]

The cluster (``--cluster processes``, the default) is a ``dask scheduler`` and K + 3 ``dask worker
--no-nanny`` processes on this machine: a killed worker stays dead, as a lost machine does, and the
scheduler is not in the trainer's process. Each kill run gets a fresh cluster; the failure-free runs
share one. ``--cluster local`` uses a LocalCluster instead, whose nanny restarts the killed worker
process (a Python start-up that competes for the same cores during the recovery).

Numbers come from one shared 2-core machine with other work running: treat them as noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from bench_data import synthetic_dataset
from distributed import Client

from dlrmflow.engine.coding import REBUILD_CHUNK
from dlrmflow.engine.coding import rebuild as recovery
from dlrmflow.engine.planning.planner import PlanConfig, make_plan
from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import prepare_run, train

MODES: tuple[str, ...] = ()  # set in main(): none, checkpoint/N for each N, parity R=1, R=2, R=1 rate-limited


def paced_mode(rate: float) -> str:
    return f"R=1 @{rate:g}MB/s"


def rebuild_rate(mode: str) -> float:
    return float(mode.split("@")[1].removesuffix("MB/s")) if "@" in mode else 0.0


COPY_ALL = "R=1 copy all"  # recovery.REBUILD_EVERY_STRIPE: every stripe copied, as if every row were trained


@contextlib.contextmanager
def copying_every_stripe(mode: str) -> Iterator[None]:
    """The rebuild thread runs in this process: set its module switch for ``mode``'s kill run."""
    before = recovery.REBUILD_EVERY_STRIPE
    recovery.REBUILD_EVERY_STRIPE = mode == COPY_ALL
    try:
        yield
    finally:
        recovery.REBUILD_EVERY_STRIPE = before




def config_for(mode: str, args, dataset: Path, out: Path, capacity: int, kill: bool) -> TrainConfig:
    extra: dict = {"capacity": capacity} if args.cache == "lru" else {"plan_dir": str(Path(args.work) / "plan")}
    if mode.startswith("checkpoint"):
        extra["checkpoint_every"] = int(mode.split("/")[1])
    elif "R=" in mode:
        extra.update(parity=int(mode.split("R=")[1][0]), rebuild_chunk=args.rebuild_chunk,
                     rebuild_rate=rebuild_rate(mode))
    if kill:
        extra["kills"] = (f"shard:0@{args.kill_at}",)
    return TrainConfig(dataset_dir=str(dataset), mode=args.cache, output_dir=str(out), batch_size=args.batch,
                       iterations=args.iterations, num_shards=args.shards,
                       embedding_dim=args.dim, bottom_mlp=(64, args.dim), top_mlp=(64, 1), eval_fraction=0.0,
                       metrics_every=args.iterations, save_state=False, device=args.device, **extra)


@contextlib.contextmanager
def process_cluster(n_workers: int, cores: list[int] | None = None) -> Iterator[Client]:
    """``dask scheduler`` + ``n_workers`` x ``dask worker --no-nanny --nthreads 1``, each its own process
    (pinned to ``cores`` when given)."""
    # ``python -m distributed.cli...`` rather than the ``dask`` script: it works wherever distributed
    # imports from (a venv, or a ``pip install --target`` directory on PYTHONPATH).
    scheduler_cli = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    worker_cli = [sys.executable, "-m", "distributed.cli.dask_worker"]
    home = Path(tempfile.mkdtemp(prefix="dlrmflow-bench-cluster-"))
    scheduler_file = home / "scheduler.json"
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> None:
        with open(home / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, cwd=home, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True,
                                          preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None))

    try:
        start("scheduler", [*scheduler_cli, "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                            "--scheduler-file", str(scheduler_file)])
        deadline = time.monotonic() + 120
        while not scheduler_file.is_file():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"dask scheduler did not start; see {home / 'scheduler.log'}")
            time.sleep(0.2)
        for i in range(n_workers):
            start(f"w{i}", [*worker_cli, "--scheduler-file", str(scheduler_file), "--nthreads", "1",
                            "--no-nanny", "--host", "127.0.0.1", "--no-dashboard", "--name", f"w{i}",
                            "--local-directory", str(home / f"w{i}")])
        with Client(scheduler_file=str(scheduler_file), timeout="60s", direct_to_workers=True) as client:
            client.wait_for_workers(n_workers, timeout=120)
            yield client
    finally:
        stop_processes(procs[::-1])  # workers first: a worker whose scheduler is gone hangs in close


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process group, give them ``grace_s`` together, then SIGKILL what is left."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def cluster_for(kind: str, n_workers: int, cores: list[int] | None = None) -> Iterator[Client]:
    if kind == "processes":
        with process_cluster(n_workers, cores) as client:
            yield client
        return
    with local_cluster(n_workers) as cluster, Client(cluster, direct_to_workers=True) as client:
        logging.getLogger("distributed").setLevel(logging.CRITICAL)
        yield client


STALL_DUMP_S = 30.0  # a run this long prints every thread's stack to stderr (set by --stall-dump)


def run_once(config: TrainConfig, client: Client) -> dict:
    finished: list[float] = []
    # A run takes seconds; one that stalls (a lost worker noticed only by a 30 s network timeout, say)
    # leaves its stacks in the log, to show where it waits.
    faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=False, file=sys.stderr)
    try:
        summary = train(config, client=client, progress=lambda done, total: finished.append(time.perf_counter()))
    finally:
        faulthandler.cancel_dump_traceback_later()
    summary["finished_at"] = finished
    return summary


def step_ms(summary: dict) -> float:
    """Failure-free cost of one iteration: median train step + checkpoint writes per iteration."""
    writes = sum(c["seconds"] for c in summary.get("checkpoint", {}).get("checkpoints", []))
    return summary["median_iteration_ms"] + 1e3 * writes / summary["iterations"]


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=step_ms)[len(runs) // 2]


def recovery_numbers(mode: str, failed: dict, kill_at: int) -> dict:
    """Time to recover and the new-iteration rate during it, from the failure run's records."""
    report = failed.get("checkpoint") if mode.startswith("checkpoint") else failed.get("parity")
    (rec,) = report["recoveries"]
    origin = report["clock_origin"]
    detected = origin + rec["detected_s"]
    recovered = detected + rec["seconds"]
    ends = np.asarray(failed["finished_at"])
    if mode.startswith("checkpoint"):
        new_iterations, progress = 0, 0.0  # the replay redoes iterations that were already done
    else:
        new_iterations = int(((detected <= ends) & (ends <= recovered)).sum())
        # Iteration j runs from the end of j - 1 to its own end: the share of each inside the window.
        starts, stops = ends[:-1], ends[1:]
        inside = np.clip(np.minimum(stops, recovered) - np.maximum(starts, detected), 0.0, None)
        progress = float((inside / (stops - starts)).sum())
    rate = new_iterations / rec["seconds"] if rec["seconds"] > 0 else float("nan")
    (kill,) = report["kills"]
    before = np.diff(ends[: kill_at + 1])
    normal_rate = 1.0 / float(np.median(before))
    return {"recover_s": rec["seconds"], "during_rate": rate, "during_vs_normal": rate / normal_rate,
            "during_progress_vs_normal": progress / rec["seconds"] / normal_rate if rec["seconds"] > 0 else np.nan,
            "unnoticed_s": rec["detected_s"] - kill["at_s"],
            "iterations_during": new_iterations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=0.05, help="Criteo Kaggle table sizes x SCALE")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=150)
    parser.add_argument("--checkpoint-every", default="20,100",
                        help="checkpoint intervals to compare (default 20,100: the kill at 150 replays 10 and 50 "
                             "iterations; 100 costs about what parity costs per iteration)")
    parser.add_argument("--rebuild-chunk", type=int, default=REBUILD_CHUNK)
    parser.add_argument("--paced-rate", type=float, default=100.0, metavar="MB/S",
                        help="also run R=1 with the rebuild capped at MB/S (--rebuild-rate; default 100; 0: skip)")
    parser.add_argument("--cache", choices=["lru", "oracle"], default="lru",
                        help="lru (default): write-backs on the step's path; oracle: in the prefetch worker")
    parser.add_argument("--cluster", choices=["processes", "local"], default="processes",
                        help="processes: dask scheduler + dask worker --no-nanny processes, a fresh cluster per kill "
                             "(default); local: one LocalCluster whose nanny restarts a killed worker")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="failure-free runs per mode (default 5)")
    parser.add_argument("--work", default="/tmp/dlrmflow-bench-fault")
    parser.add_argument("--trainer-cores", type=int, default=0,
                        help="give the trainer the first N cores (and torch N threads) and the Dask processes the "
                             "rest, as if they ran on machines of their own (default 0: everything shares every core)")
    parser.add_argument("--torch-threads", type=int, default=0, metavar="N",
                        help="the trainer's torch threads (default: torch's own choice, or N = --trainer-cores); "
                             "on shared cores 1 thread loses less to the rebuild than 2 (see benchmarks/RESULTS.md)")
    parser.add_argument("--device", default="cpu",
                        help="the trainer's torch device (cuda: model and cache on the GPU; the embedding servers "
                             "and their parity stay on the Dask workers' CPUs)")
    parser.add_argument("--stall-dump", type=float, default=30.0, metavar="S",
                        help="a training run that takes longer than S seconds prints every thread's stack to "
                             "stderr, once (default 30)")
    args = parser.parse_args()
    global STALL_DUMP_S, MODES
    STALL_DUMP_S = args.stall_dump
    server_cores = partition_cores(args.trainer_cores, args.cluster, args.torch_threads)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: no CUDA GPU is available")
        print(f"trainer's model and cache on {torch.cuda.get_device_name(torch.device(args.device))}", flush=True)
    MODES = ("none", *(f"checkpoint/{int(n)}" for n in args.checkpoint_every.split(",")), "parity R=1",
             "parity R=2", *([paced_mode(args.paced_rate)] if args.paced_rate else []), COPY_ALL)
    work = Path(args.work)
    rows = args.batch * args.iterations
    start = time.perf_counter()
    dataset = synthetic_dataset(work / "data", rows, args.scale)
    probe = prepare_run(TrainConfig(dataset_dir=str(dataset), mode="lru", output_dir=str(work / "x"),
                                    batch_size=args.batch, iterations=args.iterations, capacity=10**9,
                                    eval_fraction=0.0, embedding_dim=args.dim))
    capacity = 2 * probe.checks["max_distinct_rows_per_batch"]
    table_bytes = probe.spec.total_rows * probe.spec.row_bytes
    if args.cache == "oracle":
        plan = make_plan(dataset, PlanConfig(args.batch, lookahead=20, prefetch_distance=2), work / "plan")
        cache = f"oracle cache (plan L=20, P=2: {plan['num_slots']:,} slots)"
    else:
        cache = f"LRU cache {capacity:,} rows"
    print(f"data: {rows:,} rows, {probe.spec.total_rows:,} embedding rows x {probe.spec.row_bytes} B = "
          f"{table_bytes / 1e6:.1f} MB; {cache}; K={args.shards}; kill shard:0@{args.kill_at}; "
          f"ready in {time.perf_counter() - start:.1f} s", flush=True)
    results = {}
    # One worker per member (K data + 2 parity) plus a spare for the rebuild.
    n_workers = args.shards + 3
    # A rebuild rate changes nothing until a failure: the rate-limited mode shares R=1's failure-free runs.
    free_modes = [mode for mode in MODES if not rebuild_rate(mode) and mode != COPY_ALL]
    free: dict[str, list[dict]] = {mode: [] for mode in free_modes}
    with cluster_for(args.cluster, n_workers, server_cores) as client:
        run_once(config_for("none", args, dataset, work / "warmup", capacity, False), client)
        for round_ in range(args.repeats):
            for mode in free_modes[round_ % len(free_modes):] + free_modes[: round_ % len(free_modes)]:
                out = work / f"run-{slug(mode)}-free"
                free[mode].append(run_once(config_for(mode, args, dataset, out, capacity, False), client))
                show(mode, "free", free[mode][-1])
        for mode in MODES:
            runs = free[mode if mode in free else "parity R=1"]
            results[mode] = {False: median_run(runs), "rounds": runs,
                             "free_seconds": float(np.median([r["train_seconds"] for r in runs]))}
            if mode != "none" and args.cluster == "local":
                client.wait_for_workers(n_workers, timeout=60)  # the nanny restarted the killed one
                with copying_every_stripe(mode):
                    results[mode][True] = run_once(config_for(mode, args, dataset, work / f"run-{slug(mode)}-kill",
                                                              capacity, True), client)
                show(mode, "kill", results[mode][True])
    if args.cluster == "processes":  # a killed worker stays dead: each kill run on a fresh cluster
        for mode in MODES[1:]:
            with cluster_for(args.cluster, n_workers, server_cores) as client:
                run_once(config_for("none", args, dataset, work / "warmup", capacity, False), client)
                with copying_every_stripe(mode):
                    results[mode][True] = run_once(config_for(mode, args, dataset, work / f"run-{slug(mode)}-kill",
                                                              capacity, True), client)
                show(mode, "kill", results[mode][True])
    print_table(results, table_bytes, args.kill_at)


def partition_cores(trainer_cores: int, cluster: str, torch_threads: int = 0) -> list[int] | None:
    """Pin this process (the trainer) to its first ``trainer_cores`` cores; the cores left for the
    Dask processes (None: no partition). A trainer whose torch threads share cores with the servers
    waits for its slowest thread whenever a server works, which a deployment with servers on their
    own machines does not see. ``torch_threads``: the trainer's torch threads (0: torch's default,
    or ``trainer_cores``)."""
    cores = sorted(os.sched_getaffinity(0))
    if torch_threads < 0:
        raise SystemExit(f"--torch-threads must be 0 (the default) or more, got {torch_threads}")
    print(f"machine: {len(cores)} cores, torch {torch.__version__}", end="")
    if not trainer_cores:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        print(f" ({torch.get_num_threads()} threads); trainer and Dask processes share every core", flush=True)
        return None
    if cluster != "processes":
        raise SystemExit("--trainer-cores needs --cluster processes (a LocalCluster's workers inherit the trainer's)")
    if not 0 < trainer_cores < len(cores):
        raise SystemExit(f"--trainer-cores must be between 1 and {len(cores) - 1} on this machine, got {trainer_cores}")
    os.sched_setaffinity(0, cores[:trainer_cores])
    torch.set_num_threads(torch_threads or trainer_cores)
    print(f"; trainer on cores {cores[0]}-{cores[trainer_cores - 1]} ({torch.get_num_threads()} torch threads), "
          f"Dask scheduler and workers on cores {cores[trainer_cores]}-{cores[-1]}", flush=True)
    return cores[trainer_cores:]


def slug(mode: str) -> str:
    return mode.replace(" ", "").replace("=", "").replace("/", "")


def show(mode: str, what: str, s: dict) -> None:
    print(f"{mode:<11} {what}: step {s['median_iteration_ms']:.1f} ms (median), run {s['train_seconds']:.2f} s, "
          f"sha {s['state_sha256'][:12]}", flush=True)


def print_table(results: dict, table_bytes: int, kill_at: int) -> None:
    base = results["none"][False]
    base_ms = step_ms(base)
    header = f"{'':34}" + "".join(f"{m:>15}" for m in MODES)
    lines = [header, "-" * len(header)]

    def row(label, values):
        lines.append(f"{label:34}" + "".join(f"{v:>15}" for v in values))

    def each(fn):
        out = []
        for mode in MODES:
            try:
                out.append(fn(mode, results[mode]))
            except (KeyError, ValueError):
                out.append("n/a")
        return out

    row("ms/iteration (failure-free)", each(lambda m, r: f"{step_ms(r[False]):.1f}"))
    row("overhead vs none", each(lambda m, r: f"{100 * (step_ms(r[False]) / base_ms - 1):+.1f}%"))

    def per_round(r) -> np.ndarray:  # each round's run against that round's none run (neighbours in time)
        return np.array([step_ms(a) / step_ms(b) - 1 for a, b in zip(r["rounds"], results["none"]["rounds"],
                                                                      strict=True)])

    row("  per round, median", each(lambda m, r: f"{100 * np.median(per_round(r)):+.1f}%"))
    row("  per round, range", each(lambda m, r: f"{100 * per_round(r).min():+.0f}..{100 * per_round(r).max():+.0f}%"))
    rec = {m: recovery_numbers(m, results[m][True], kill_at) for m in MODES if m != "none"}
    row("kill -> detected (s)", each(lambda m, r: f"{rec[m]['unnoticed_s']:.3f}"))
    row("time to recover (s)", each(lambda m, r: f"{rec[m]['recover_s']:.3f}"))
    for ref in [m for m in MODES if m.startswith("checkpoint")]:
        speed_up = [f"{rec[ref]['recover_s'] / rec[m]['recover_s']:.1f}x" if m in rec else "n/a" for m in MODES]
        row(f"recovery speed-up vs {ref}", speed_up)
    first = {m: results[m][True][m.startswith("checkpoint") and "checkpoint" or "parity"]["recoveries"][0]
             for m in MODES if m != "none"}
    row("  stripes copied (of all)", each(
        lambda m, r: f"{100 * first[m]['stripes'] / (first[m]['stripes'] + first[m]['stripes_generated']):.1f}%"))
    row("  before the copy (s)", each(
        lambda m, r: f"{first[m]['seconds'] - first[m]['placement_seconds'] - first[m]['copy_seconds']:.3f}"))
    row("  bulk copy on workers (s)", each(lambda m, r: f"{first[m]['copy_seconds']:.3f}"))
    row("    of it, copy tasks running (s)", each(lambda m, r: f"{first[m]['copy_task_seconds']:.3f}"))
    row("    in them, waiting for reads (s)", each(lambda m, r: f"{first[m]['copy_read_wait_seconds']:.3f}"))
    row("    in them, decode + install (s)", each(lambda m, r: f"{first[m]['copy_install_seconds']:.3f}"))
    row("  training blocked by rebuild (s)", each(lambda m, r: f"{first[m]['locked_seconds']:.3f}"))
    row("new iterations during recovery", each(lambda m, r: str(rec[m]["iterations_during"])))
    row("throughput during recovery", each(lambda m, r: f"{100 * rec[m]['during_vs_normal']:.0f}%"))
    row("  counting partial iterations", each(lambda m, r: f"{100 * rec[m]['during_progress_vs_normal']:.0f}%"))
    row("total time lost (s)", each(lambda m, r: f"{r[True]['train_seconds'] - r['free_seconds']:.3f}"))

    def memory(m, r):
        s = r[True]
        if m.startswith("checkpoint"):
            return f"{100 * s['checkpoint']['checkpoints'][-1]['bytes'] / table_bytes:.0f}% disk"
        p = s["parity"]
        return f"{100 * (p['parity_rows_bytes'] + p['checked_out_rows_bytes']) / table_bytes:.0f}%"

    row("memory overhead (of table)", each(memory))
    row("parity delta bytes (MB)", each(lambda m, r: f"{r[False]['parity']['parity_bytes_sent'] / 1e6:.1f}"))
    row("rows written back (MB)", each(lambda m, r: f"{r[False]['bytes_written_back'] / 1e6:.1f}"))
    row("verify (parity == encode(data))", each(lambda m, r: str(r[True]["parity"]["verify"]["ok"])))
    row("final state == failure-free", each(
        lambda m, r: str(r[True]["state_sha256"] == base["state_sha256"]) if True in r else "n/a"))
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
