"""What a LocalCluster's start costs: workers forked from a server that imported the engine, vs spawned.

Each sample is a fresh process that starts ``--clusters`` LocalClusters of ``--workers`` workers one
after the other, runs one task on every worker that imports what an embedding server and a trainer
import, and closes each cluster; in the last one it SIGKILLs a worker and times its replacement (the
nanny restarts it by the same method) until the replacement has run that task. The two start methods
alternate, ``--repeats`` samples each; the table gives medians of the wall seconds of each cluster
(start, first task, close), of the replacement, and of the CPU seconds the whole machine spent per
sample (``/proc/stat``: the forked workers are not this process's children, so only a machine-wide
count sees them; quiet machines only).

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
    import dlrmflow.engine.training.launch  # noqa: F401 - what a trainer imports

    return 1


def one_sample(method: str, workers: int, clusters: int) -> dict[str, object]:
    """In this process: the wall seconds of each of ``clusters`` LocalClusters started by ``method``, and of
    a killed worker's replacement (from the SIGKILL until the nanny's new worker has run the task)."""
    import os
    import signal

    from distributed import Client

    import dlrmflow.engine.serving.cluster as cluster

    cluster.WORKER_START = method
    walls = []
    for i in range(clusters):
        start = time.perf_counter()
        with cluster.local_cluster(workers) as local, Client(local) as client:
            client.run(_worker_task)
            walls.append(time.perf_counter() - start)
            if i == clusters - 1:
                victim, pid = next(iter(client.run(os.getpid).items()))
                killed = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                while victim in client.scheduler_info()["workers"] or len(client.scheduler_info()["workers"]) < workers:
                    time.sleep(0.01)
                client.run(_worker_task)
                replacement = time.perf_counter() - killed
    return {"walls": walls, "replacement": replacement}


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
    samples: dict[str, list[tuple[float, dict]]] = {"spawn": [], "forkserver": []}
    for i in range(args.repeats):
        for method in samples:
            before = busy_cpu_seconds()
            out = subprocess.run([sys.executable, __file__, "--one", method, "--workers", str(args.workers),
                                  "--clusters", str(args.clusters)], capture_output=True, text=True, check=True).stdout
            samples[method].append((busy_cpu_seconds() - before, json.loads(out.strip().splitlines()[-1])))
            print(f"sample {i + 1}/{args.repeats} {method}: {samples[method][-1][0]:.1f} CPU s", file=sys.stderr)
    print(f"{args.workers} workers, {args.clusters} clusters per sample, medians of {args.repeats} samples")
    print("| start method | first cluster s | later clusters s | killed worker's replacement s "
          "| machine CPU s per sample |")
    print("|---|---|---|---|---|")
    for method, runs in samples.items():
        first = statistics.median(run["walls"][0] for _, run in runs)
        later = statistics.median(w for _, run in runs for w in run["walls"][1:]) if args.clusters > 1 \
            else float("nan")
        replacement = statistics.median(run["replacement"] for _, run in runs)
        cpu = statistics.median(c for c, _ in runs)
        print(f"| {method} | {first:.2f} | {later:.2f} | {replacement:.2f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
