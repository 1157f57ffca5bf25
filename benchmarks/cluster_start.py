"""What a LocalCluster's start costs: workers forked from a server that imported the engine, vs spawned.

Each sample is a fresh process that starts ``--clusters`` LocalClusters of ``--workers`` workers one
after the other, runs one task on every worker that imports what an embedding server and a trainer
import, and closes each cluster. The two start methods alternate, ``--repeats`` samples each; the
table gives medians of the wall seconds of each cluster (start, first task, close) and of the CPU
seconds the whole machine spent per sample (``/proc/stat``: the forked workers are not this
process's children, so only a machine-wide count sees them; quiet machines only).

    .venv/bin/python benchmarks/cluster_start.py --workers 4 --clusters 3 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def busy_cpu_seconds() -> float:
    """Seconds the machine's cores were busy since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / 100  # USER_HZ


def _worker_task() -> int:
    import dlrmflow.engine.serving.shards  # noqa: F401 - what an embedding server imports
    import dlrmflow.engine.training.workers  # noqa: F401 - what a trainer imports

    return 1


def one_sample(method: str, workers: int, clusters: int) -> list[float]:
    """In this process: the wall seconds of each of ``clusters`` LocalClusters started by ``method``."""
    from distributed import Client

    import dlrmflow.engine.serving.cluster as cluster

    cluster.WORKER_START = method
    walls = []
    for _ in range(clusters):
        start = time.perf_counter()
        with cluster.local_cluster(workers) as local, Client(local) as client:
            client.run(_worker_task)
        walls.append(time.perf_counter() - start)
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--clusters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", choices=["spawn", "forkserver"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_sample(args.one, args.workers, args.clusters)))
        return
    samples: dict[str, list[tuple[float, list[float]]]] = {"spawn": [], "forkserver": []}
    for i in range(args.repeats):
        for method in samples:
            before = busy_cpu_seconds()
            out = subprocess.run([sys.executable, __file__, "--one", method, "--workers", str(args.workers),
                                  "--clusters", str(args.clusters)], capture_output=True, text=True, check=True).stdout
            samples[method].append((busy_cpu_seconds() - before, json.loads(out.strip().splitlines()[-1])))
            print(f"sample {i + 1}/{args.repeats} {method}: {samples[method][-1][0]:.1f} CPU s", file=sys.stderr)
    print(f"{args.workers} workers, {args.clusters} clusters per sample, medians of {args.repeats} samples")
    print("| start method | first cluster s | later clusters s | machine CPU s per sample |")
    print("|---|---|---|---|")
    for method, runs in samples.items():
        first = statistics.median(walls[0] for _, walls in runs)
        later = statistics.median(w for _, walls in runs for w in walls[1:]) if args.clusters > 1 else float("nan")
        cpu = statistics.median(c for c, _ in runs)
        print(f"| {method} | {first:.2f} | {later:.2f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
