"""Where each mode's CPU goes per iteration: the trainer's threads and the embedding servers.

One process, one LocalCluster of 2 workers; modes run in rotated order for ``--rounds`` rounds on a
dataset and plan made beforehand (``dlrmflow generate/preprocess/plan``). Around every training loop
it reads the CPU time of each thread of this process (``/proc/self/task/*/stat``) and of each worker
process, and prints, per mode, the median iteration time, the stall fraction and the CPU
milliseconds per iteration of: the main thread, torch's intra-op worker threads, the Dask IO loop
(client and scheduler), the oracle's prefetch thread and the servers together. On a machine whose
cores compute already fills, background CPU adds to the iteration: this is what the oracle has to
keep below ``remote``'s stall. Bit-exactness is checked too: every run must end with one SHA-256.

First it counts the oracle's round trips (exchanges sent) per iteration on the plan, replayed through the
prefetch worker's state with no data moved: as built (rows of ``t + 1`` fetched early, write-backs held
until an exchange fetches) beside one exchange per iteration (the rule before).

    .venv/bin/python benchmarks/oracle_overhead.py DATASET_DIR PLAN_DIR [--rounds 3] [--iterations 40]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from dlrmflow.datasets.meta import read_meta
from dlrmflow.engine.planning.planner import load_plan
from dlrmflow.engine.serving.cluster import dask_client
from dlrmflow.engine.training import loop, run
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.prefetch_state import Done, Exchange, Finished, PrefetchState, ReadPlan, WaitForDone
from dlrmflow.engine.training.stores.oracle import spare_slots

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds() -> dict[tuple[int, str], float]:
    """CPU seconds (user + system) of every thread of this process, keyed by (thread id, name)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[(int(tid), names.get(int(tid), comm))] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def thread_group(name: str) -> str:
    """Threads grouped by role: torch's OpenMP workers are unnamed native threads (named after the binary)."""
    if name.startswith("dlrmflow-prefetch"):
        return "prefetch"
    if name in ("MainThread", "IO loop"):
        return name
    return "torch workers" if name.startswith("python") else "other"


class OneExchangePerIteration(PrefetchState):
    """The rule before: every iteration's exchange is sent, nothing is fetched early."""

    fetches_early = False


def round_trips(dataset_dir: str, plan_dir: str, iterations: int, state_class: type[PrefetchState]) -> int:
    """Exchanges the oracle's worker sends over ``iterations`` of the plan (compute posting each iteration's
    evictions when the worker asks for them; the order of events does not change the exchanges)."""
    plan = load_plan(plan_dir)
    total_rows = sum(read_meta(dataset_dir).cardinalities)
    iterations = min(iterations, plan.num_iterations)
    spare = spare_slots(plan, None) if state_class.fetches_early else 0
    state = state_class(iterations, plan.config.prefetch_distance, total_rows, plan.num_slots, spare_slots=spare)
    steps, evictions, sent = plan.iterations(0, iterations), {}, 0
    while not isinstance(action := state.step(), Finished):
        if isinstance(action, ReadPlan):
            step = next(steps)
            evictions[step.t] = np.asarray(step.evict_ids, dtype=np.int64)
            state.plan_read(step)
        elif isinstance(action, WaitForDone):
            evict = evictions.pop(action.t)
            state.evictions_posted(Done(action.t, evict, state.slot_of[evict], None))
            state.evictions_taken()
        else:
            assert isinstance(action, Exchange)
            sent += bool(action.sends_writes and (len(action.fetch_ids) or len(action.write_ids)))
            state.exchanged(action)
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset_dir")
    parser.add_argument("plan_dir")
    parser.add_argument("--modes", default="local,remote,oracle")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=2048)
    args = parser.parse_args()
    modes = args.modes.split(",")
    now, before = (round_trips(args.dataset_dir, args.plan_dir, args.iterations, cls)
                   for cls in (PrefetchState, OneExchangePerIteration))
    print(f"oracle round trips (exchanges sent) per iteration over {args.iterations} iterations: "
          f"{now / args.iterations:.2f} (one per iteration, the rule before: {before / args.iterations:.2f})")
    medians, stalls, shas = defaultdict(list), defaultdict(list), set()
    cpu: dict[str, dict[str, list[float]]] = {m: defaultdict(list) for m in modes}
    train_loop = loop.train_iterations  # wrapped to measure exactly the loop

    with dask_client(n_workers=2) as client, tempfile.TemporaryDirectory() as scratch:
        def measured_loop(setup, *loop_args, **loop_kwargs):
            before, servers_before = thread_cpu_seconds(), client.run(time.process_time)
            result = train_loop(setup, *loop_args, **loop_kwargs)
            after, servers_after = thread_cpu_seconds(), client.run(time.process_time)
            per_iteration = defaultdict(float)
            for key, seconds in after.items():
                per_iteration[thread_group(key[1])] += 1e3 * (seconds - before.get(key, 0.0)) / setup.iterations
            per_iteration["servers"] = 1e3 * sum(servers_after[w] - servers_before[w] for w in servers_after) \
                / setup.iterations
            for group, ms in per_iteration.items():
                cpu[setup.config.mode][group].append(ms)
            return result

        loop.train_iterations = measured_loop
        try:
            for r in range(args.rounds):
                for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
                    output = Path(scratch) / mode
                    config = TrainConfig(dataset_dir=args.dataset_dir, mode=mode, batch_size=args.batch_size,
                                         iterations=args.iterations, output_dir=str(output),
                                         plan_dir=args.plan_dir if mode == "oracle" else None, save_state=False)
                    summary = run.train(config, client=client)
                    medians[mode].append(summary["median_iteration_ms"])
                    stalls[mode].append(summary["stall_fraction"])
                    shas.add(summary["state_sha256"])
                    shutil.rmtree(output, ignore_errors=True)
        finally:
            loop.train_iterations = train_loop

    print(f"{os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}, "
          f"{args.rounds} rounds of {args.iterations} iterations; CPU ms per iteration:")
    groups = ["MainThread", "torch workers", "IO loop", "prefetch", "servers", "other"]
    print(f"{'mode':8s} {'median ms':>9s} {'stall':>6s} " + " ".join(f"{g:>13s}" for g in groups))
    for mode in modes:
        row = " ".join(f"{statistics.median(cpu[mode][g]) if cpu[mode].get(g) else 0.0:13.1f}" for g in groups)
        print(f"{mode:8s} {statistics.median(medians[mode]):9.1f} {statistics.median(stalls[mode]):6.1%} {row}")
    print("final state: " + ("one SHA-256 in every run" if len(shas) == 1 else f"DIFFERENT SHA-256s: {sorted(shas)}"))


if __name__ == "__main__":
    main()
