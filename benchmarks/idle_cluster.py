"""CPU an idle Dask LocalCluster takes, with Dask's defaults against dlrmflow's HOUSEKEEPING.

Each setting runs in a fresh process (Dask reads its configuration once per process): a LocalCluster of
``--workers`` worker processes starts, waits ``--settle`` seconds, then each process's CPU time (user + system)
is read over ``--seconds`` idle seconds: every worker's, and that of the process holding the scheduler and
the client. Printed side by side, one row per setting.

    .venv/bin/python benchmarks/idle_cluster.py [--workers 2] [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SETTINGS = {
    "Dask's defaults": "{}",
    "HOUSEKEEPING without the memory monitor's": (
        "{k: v for k, v in HOUSEKEEPING.items() if k != 'distributed.worker.memory.monitor-interval'}"),
    "HOUSEKEEPING": "HOUSEKEEPING",
}

MEASURE = """
import json, sys, time
import dask, psutil
from distributed import Client, LocalCluster
from dlrmflow.engine.serving.cluster import HOUSEKEEPING
workers, settle, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

def cpu(process):
    times = process.cpu_times()
    return times.user + times.system

if __name__ == "__main__":
    with dask.config.set(SETTING), LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                dashboard_address=":0") as cluster, Client(cluster) as client:
        pids = list(client.run(__import__("os").getpid).values())
        time.sleep(settle)
        me, procs = psutil.Process(), [psutil.Process(pid) for pid in pids]
        before = [cpu(p) for p in procs], cpu(me)
        time.sleep(seconds)
        after = [cpu(p) for p in procs], cpu(me)
    print(json.dumps({"workers": [b - a for a, b in zip(before[0], after[0])], "scheduler": after[1] - before[1]}))
"""


def measure(setting: str, workers: int, settle: float, seconds: float) -> dict:
    code = MEASURE.replace("SETTING", setting, 1)
    done = subprocess.run([sys.executable, "-c", code, str(workers), str(settle), str(seconds)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    print(f"an idle LocalCluster of {args.workers} worker processes, CPU seconds over {args.seconds:.0f} s")
    print("| Dask settings | each worker | scheduler and client process | % of a core per worker |")
    print("|---|---|---|---|")
    for name, setting in SETTINGS.items():
        seen = measure(setting, args.workers, args.settle, args.seconds)
        per_worker = ", ".join(f"{w:.2f}" for w in seen["workers"])
        share = 100 * sum(seen["workers"]) / len(seen["workers"]) / args.seconds
        print(f"| {name} | {per_worker} | {seen['scheduler']:.2f} | {share:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
