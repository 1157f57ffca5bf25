"""The daily loop (issue 30): what a growing vocabulary costs, and what continuing yesterday's model buys.

    .venv/bin/python benchmarks/daily.py [--days 4] [--rows 200000] [--scale 0.01] [--repeats 3]

On generated day files (one generator vocabulary, a seed per day):

1. **Preprocessing a day with the previous day's vocabulary vs alone**: day 1 preprocessed alone and with
   day 0's dataset as ``--vocabulary``, interleaved, ``--repeats`` times each, a fresh LocalCluster per run
   (started before the measurement): the CPU seconds of all processes (robust on a loaded machine) and the
   wall time, medians and their ratio (goal: at most 1.1x).
2. **The loop itself**: ``dlrmflow daily`` over the days (oracle, parity 1), the day-by-day table it
   publishes: rows, new ids, next-day AUC / log loss of the model trained through the day before, the
   constant-prediction log loss, the share of lookups that met an id new to the model, training time.
3. **Continued vs one day alone, scored on day 2**: the model continued from day 0 through day 1 (the loop's)
   against a model trained on day 1 alone (same settings, fresh start), both scored on day 2 before either
   trained on it (goal: the continued model's log loss is lower).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from preprocess import AnonMemory, _measured_run

from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.datasets.synthetic import generate
from dlrmflow.engine.serving.cluster import local_cluster


def day_files(landing: Path, days: int, rows: int, scale: float) -> list[Path]:
    landing.mkdir(parents=True, exist_ok=True)
    files = [landing / f"day_{d}.tsv" for d in range(days)]
    missing = [(d, f) for d, f in enumerate(files) if not f.exists()]
    if missing:
        from distributed import Client

        with local_cluster(2) as cluster, Client(cluster) as client:
            for d, f in missing:
                print(f"generating day {d}: {rows:,} rows at scale {scale:g} -> {f}", file=sys.stderr)
                generate(f, rows, seed=1 + d, scale=scale, client=client)
    return files


def vocabulary_cost(files: list[Path], work: Path, repeats: int) -> dict[str, list[float]]:
    """Day 1 alone vs with day 0's vocabulary: per run, (wall s, CPU s), interleaved."""
    day0 = work / "vocab-ds0"
    if not (day0 / "meta.json").exists():
        preprocess([files[0]], day0)
    runs = {"alone": preprocess, "with vocabulary": functools.partial(preprocess, vocabulary=day0)}
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for r in range(repeats):
        for name, run in runs.items():
            seconds, _, cpu, summary = _measured_run(run, files[1], work / "vocab-out", 2)
            measured[name].append((seconds, cpu))
            print(f"  repeat {r + 1}: day 1 {name}: {seconds:.2f} s, {cpu:.2f} CPU s, "
                  f"{summary['embedding_rows']:,} embedding rows", file=sys.stderr)
    return measured


def run_loop(landing: Path, state: Path, args: argparse.Namespace) -> list[dict]:
    command = [sys.executable, "-m", "dlrmflow.cli", "daily", str(landing), "--state-dir", str(state),
               "--batch-size", str(args.batch_size), "--json"]
    t0 = time.perf_counter()
    with AnonMemory() as memory:
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"dlrmflow daily failed:\n{done.stderr[-3000:]}")
    print(f"  dlrmflow daily: {time.perf_counter() - t0:.1f} s, {memory.cpu_seconds:.1f} CPU s", file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])["days"]


def one_day_alone(days: list[dict], work: Path, batch_size: int) -> dict:
    """A model trained on day 1 alone (fresh start, the loop's settings but local: the same bits as the
    oracle), scored on day 2."""
    from dlrmflow.engine.training.config import TrainConfig
    from dlrmflow.engine.training.job import train
    from dlrmflow.engine.training.scoring import evaluate_run

    run_dir = work / "day1-alone"
    if not (run_dir / "summary.json").exists():
        train(TrainConfig(dataset_dir=days[1]["dataset"], mode="local", output_dir=str(run_dir),
                          batch_size=batch_size, eval_fraction=0.0))
    return evaluate_run(run_dir, days[2]["dataset"], batch_size=4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--days", type=int, default=4)
    ap.add_argument("--rows", type=int, default=200_000, help="rows per day")
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dlrmflow-bench-daily"))
    args = ap.parse_args()
    if args.days < 3:
        ap.error("--days must be >= 3 (the comparison scores on day 2)")
    work = Path(args.work_dir)
    files = day_files(work / "landing", args.days, args.rows, args.scale)
    print(f"{args.days} days of {args.rows:,} rows at scale {args.scale:g}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")

    measured = vocabulary_cost(files, work, args.repeats)
    wall = {name: statistics.median(s for s, _ in runs) for name, runs in measured.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in measured.items()}
    print("\n1. day 1 preprocessed alone vs with day 0's vocabulary (medians of "
          f"{args.repeats}, a fresh LocalCluster each)")
    print(f"   {'':<18} {'wall s':>8} {'CPU s':>8}")
    for name in measured:
        print(f"   {name:<18} {wall[name]:>8.2f} {cpu[name]:>8.2f}")
    print(f"   ratio              {wall['with vocabulary'] / wall['alone']:>7.2f}x "
          f"{cpu['with vocabulary'] / cpu['alone']:>7.2f}x   (goal <= 1.10x)")

    state = work / "state"
    days = run_loop(work / "landing", state, args)
    from dlrmflow.tasks.daily import daily_table

    print(f"\n2. dlrmflow daily {work / 'landing'} --state-dir {state} --batch-size {args.batch_size}\n")
    print(daily_table(days))

    alone = one_day_alone(days, work, args.batch_size)
    continued = days[2]
    print("\n3. scored on day 2 before training on it")
    print(f"   {'model':<34} {'AUC':>8} {'log loss':>9}")
    print(f"   {'day 0, then day 1 continued':<34} {continued['next_day_auc']:>8.4f} "
          f"{continued['next_day_log_loss']:>9.4f}")
    print(f"   {'day 1 alone':<34} {alone['auc']:>8.4f} {alone['log_loss']:>9.4f}")
    print(f"   constant prediction log loss       {alone['constant_log_loss']:>18.4f}")
    better = continued["next_day_log_loss"] < alone["log_loss"]
    print(f"   continued is {'better' if better else 'NOT better'}: log loss "
          f"{continued['next_day_log_loss'] - alone['log_loss']:+.4f}")


if __name__ == "__main__":
    main()
