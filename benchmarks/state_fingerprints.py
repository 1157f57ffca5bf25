"""Fixed-seed training runs and what each ended with: the state SHA-256 and the traffic counters.

A refactoring of the training code must leave every one of these unchanged. The script runs a matrix of
small runs (every mode; W = 1, 2 and 3; parity, shard kills with and without parity, checkpoints; the
four models; a learning-rate schedule; SGD rows) on one LocalCluster in this process, prints one line
per run and writes them as JSON; ``--compare FILE`` reads an earlier JSON and reports every difference
(exit status 1 if any).

    .venv/bin/python benchmarks/state_fingerprints.py --output /tmp/after.json [--compare /tmp/before.json]
        [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_data import synthetic_dataset

from dlrmflow.engine.planning.planner import PlanConfig, load_plan, make_plan
from dlrmflow.engine.serving.cluster import dask_client
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import train

BATCH, BATCH_W3, ITERATIONS, ROWS, SCALE = 256, 255, 30, 256 * 36, 0.002

# name -> the run's settings beyond the common ones ("plan": the run reads the plan)
RUNS: dict[str, dict[str, Any]] = {
    "local": dict(mode="local"),
    "remote": dict(mode="remote"),
    "lru": dict(mode="lru", capacity=3000),
    "oracle": dict(mode="oracle", plan=True),
    "oracle-capacity": dict(mode="oracle", plan="capacity"),
    "oracle-sgd": dict(mode="oracle", plan=True, embedding_optimizer="sgd"),
    "oracle-schedule": dict(mode="oracle", plan=True, lr_num_warmup_steps=5, lr_decay_start_step=10,
                            lr_num_decay_steps=15),
    "remote-parity": dict(mode="remote", parity=1),
    "lru-parity": dict(mode="lru", capacity=3000, parity=1),
    "oracle-parity": dict(mode="oracle", plan=True, parity=1),
    "oracle-parity-kill": dict(mode="oracle", plan=True, parity=1, kills=("shard:1@10",)),
    "remote-parity-kill": dict(mode="remote", parity=1, kills=("parity:0@12",)),
    "remote-checkpoint-kill": dict(mode="remote", checkpoint_every=10, kills=("shard:0@15",)),
    "lru-checkpoint-kill": dict(mode="lru", capacity=3000, checkpoint_every=10, kills=("shard:1@15",)),
    "oracle-checkpoint-kill": dict(mode="oracle", plan=True, checkpoint_every=10, kills=("shard:0@15",)),
    "oracle-parity-checkpoint": dict(mode="oracle", plan=True, parity=1, checkpoint_every=10),
    "wide-deep-oracle": dict(mode="oracle", plan=True, model="wide-deep"),
    "deepfm-oracle": dict(mode="oracle", plan=True, model="deepfm"),
    "dcn-v2-oracle": dict(mode="oracle", plan=True, model="dcn-v2"),
    "w2-remote": dict(mode="remote", trainers=2),
    "w2-lru": dict(mode="lru", capacity=3000, trainers=2),
    "w2-oracle": dict(mode="oracle", plan=True, trainers=2),
    "w2-remote-parity": dict(mode="remote", parity=1, trainers=2),
    "w2-oracle-parity": dict(mode="oracle", plan=True, parity=1, trainers=2),
    "w2-oracle-parity-kill": dict(mode="oracle", plan=True, parity=1, trainers=2, kills=("shard:0@10",)),
    "w2-oracle-checkpoint": dict(mode="oracle", plan=True, trainers=2, checkpoint_every=10),
    "w3-remote": dict(mode="remote", trainers=3, batch_size=BATCH_W3),
    "w3-oracle": dict(mode="oracle", plan="w3", trainers=3, batch_size=BATCH_W3),
    "w3-lru": dict(mode="lru", capacity=3000, trainers=3, batch_size=BATCH_W3),
}


def fingerprint(summary: dict[str, Any]) -> dict[str, Any]:
    """What a refactoring must not change."""
    out = {key: summary.get(key) for key in ("state_sha256", "bytes_fetched", "bytes_written_back",
                                             "peak_cached_rows")}
    trainers = summary.get("trainers")
    if trainers:
        out["per_trainer"] = [{k: t.get(k) for k in ("bytes_fetched", "bytes_written_back", "peak_cached_rows",
                                                                 "bytes_from_trainers")}
                              for t in trainers.get("per_trainer", [])]
        out["between_trainers"] = trainers.get("bytes_between_trainers")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--compare", type=Path)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, dask_client(n_workers=5, trainers=3) as client:
        work = Path(tmp)
        dataset = synthetic_dataset(work / "data", ROWS, SCALE)
        plans = {}
        for key, batch, capacity in ((True, BATCH, None), ("capacity", BATCH, 2500), ("w3", BATCH_W3, None)):
            plan_dir = work / f"plan-{key}"
            make_plan(dataset, PlanConfig(batch, lookahead=20, prefetch_distance=2, capacity=capacity), plan_dir,
                      client=client)
            plans[key] = plan_dir
        for name in names:
            settings = dict(RUNS[name])
            plan = settings.pop("plan", None)
            settings.setdefault("batch_size", BATCH)
            config = TrainConfig(dataset_dir=str(dataset), output_dir=str(work / "runs" / name),
                                 iterations=ITERATIONS, embedding_dim=8, eval_fraction=0.05, metrics_every=10,
                                 num_shards=2, seed=3, plan_dir=str(plans[plan]) if plan else None, **settings)
            if plan:
                load_plan(plans[plan])  # refused here, not mid-run, if it does not load
            start = time.perf_counter()
            summary = train(config, client=client)
            results[name] = fingerprint(summary)
            print(f"{name:26} {results[name]['state_sha256'][:16]}  fetched {results[name]['bytes_fetched']:>10,}"
                  f"  written {results[name]['bytes_written_back']:>10,}  {time.perf_counter() - start:5.1f} s",
                  flush=True)
            args.output.write_text(json.dumps(results, indent=1, sort_keys=True))  # what ran, if a later run fails
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    differ = [name for name in names if name in before and before[name] != results[name]]
    for name in differ:
        print(f"DIFFERS {name}:\n  before {before[name]}\n  after  {results[name]}")
    print(f"{len(names) - len(differ)} of {len(names)} runs unchanged" + (f"; {len(differ)} differ" if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
