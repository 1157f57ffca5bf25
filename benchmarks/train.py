"""Training speed of the four modes, side by side, on the same data in one run; optionally for several
models (``--models dlrm,wide-deep,deepfm,dcn-v2``), with their held-out AUC and log loss after the
same iterations.

    local    all rows in the trainer (the reference: the speed to match)
    remote   parameter-server baseline: every iteration fetches its rows and writes them back
    lru      on-demand LRU cache with the oracle's cache size, write-back on eviction
    oracle   the lookahead plan: background prefetch P iterations ahead, write-back of evictions

Two configurations (26 tables, Criteo Kaggle's sizes scaled down; (a) uses the synthetic Criteo
rows of ``dlrmflow.datasets.synthetic``, skewed like the real data):

    a  Criteo Kaggle architecture: dim 16, bottom 13-512-256-64-16, top 367-512-256-1, batch 4096
    b  embedding-bound: dim 64, bottom 13-64-64, top 415-64-1, batch 16384, ids with a milder skew
       (Zipf 0.9 per table), so embedding traffic, not the MLPs, dominates the iteration

With ``--models``, every model runs every mode on the same data and plan: DLRM with the configuration's
architecture, the others with their published layer sizes (docs/models.md) at the configuration's
embedding dim; a second table puts the models side by side (local and oracle iteration time, eval
AUC and log loss after the same iterations).

Every mode runs ``--repeats`` times, in rotated order. Per mode the table shows: the mean
iteration time (the train step: gather, compute, update, scatter; median over rounds), the median
and 10th percentile of all iterations of all rounds (on a shared machine the p10 is the least
disturbed estimate), their ratio to local, the stall fraction (time compute waited for embedding
traffic / iteration time), bytes fetched and written back, eval AUC, and whether the final
state's SHA-256 equals local's (it must: bit-identical training). The embedding servers are Dask
actors on a LocalCluster of 2 worker processes on the same machine as the trainer.

    .venv/bin/python benchmarks/train.py [--configs a,b] [--models dlrm,...] [--iterations N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_data import synthetic_dataset
from distributed import Client

from dlrmflow.datasets import synthetic
from dlrmflow.datasets.meta import read_meta
from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine.planning.planner import PlanConfig, load_plan, make_plan
from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import train

CONFIGS = {
    "a": dict(name="criteo-arch", scale=0.05, batch=4096, dim=16, bottom=(512, 256, 64, 16), top=(512, 256, 1),
              iterations=40),
    "b": dict(name="embedding-bound", scale=0.1, batch=16384, dim=64, bottom=(64, 64), top=(64, 1),
              iterations=30, zipf=0.9),
    # `make run`'s data and model (dlrmflow demo: generated rows at scale 0.05, batch 2048, the default DLRM);
    # its lookahead, L = 200, is --lookahead's to give.
    "demo": dict(name="demo", scale=0.05, batch=2048, dim=16, bottom=(512, 256, 64, 16), top=(512, 256, 1),
                 iterations=100),
    # (a)'s model on small, strongly skewed tables: most of a batch's rows come back within L iterations, so
    # the oracle fetches several times fewer bytes than `remote` (a speed-up limit above 5x behind a slow link).
    "skewed": dict(name="skewed", scale=0.01, batch=4096, dim=16, bottom=(512, 256, 64, 16), top=(512, 256, 1),
                   iterations=20, zipf=1.4),
    # Bagpipe's regime at its hardest (issue 45, item 2): MLPerf-like rows of dim 128 (512 bytes) on tiny,
    # skewed tables (scale 0.0002: 6,765 rows), so a batch's 2,048 x 26 ids hit a few thousand rows that
    # almost all come back within L = 20 iterations: `remote` moves every one of them each iteration, the
    # oracle about a sixteenth as many (its initial fill included), so behind a slow link `remote` waits most
    # of the time while the oracle's traffic hides behind compute.
    "c": dict(name="mlperf-rows", scale=0.0002, batch=2048, dim=128, bottom=(512, 256, 128), top=(512, 256, 1),
              iterations=50, zipf=1.1),
}
MODES = ("local", "remote", "lru", "oracle")
MODELS = ("dlrm", "wide-deep", "deepfm", "dcn-v2")
EVAL_BATCHES = 2




def zipf_dataset(path: Path, rows: int, scale: float, exponent: float, seed: int = 0) -> Path:
    """Ids of each table (Criteo Kaggle sizes x ``scale``) drawn with P(r) ~ (r + 1)^-exponent: a
    milder skew than the synthetic Criteo rows, so a batch touches many distinct rows. Dense
    features are standard normal; the label depends on the first one (a learnable signal)."""
    params = {"rows": rows, "scale": scale, "exponent": exponent, "seed": seed}
    stamp = path / "bench-params.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return path
    rng = np.random.default_rng(seed)
    cards = synthetic.table_cardinalities(scale)
    sparse = np.empty((rows, len(cards)), dtype=np.int32)
    for k, card in enumerate(cards):
        cdf = np.cumsum(np.arange(1, card + 1, dtype=np.float64) ** -exponent)
        sparse[:, k] = np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(rows), side="right"), card - 1)
    dense = rng.standard_normal((rows, synthetic.N_DENSE)).astype(np.float32)
    labels = (dense[:, 0] + rng.standard_normal(rows) > 1.0).astype(np.int8)
    write_array_dataset(path, labels, dense, sparse, cards)
    stamp.write_text(json.dumps(params))
    return path


def config_dataset(key: str, iterations: int, work: Path) -> Path:
    """Config ``key``'s dataset for ``iterations`` training batches and the held-out ones, made in ``work``."""
    cfg = CONFIGS[key]
    rows = cfg["batch"] * (iterations + EVAL_BATCHES)
    if "zipf" in cfg:
        return zipf_dataset(work / f"data-{key}", rows, cfg["scale"], cfg["zipf"])
    return synthetic_dataset(work / f"data-{key}", rows, cfg["scale"])


def config_data(key: str, args, work: Path, client: Client | None = None) -> dict[str, Any]:
    """Config ``key``'s dataset and its plan (L and P from ``args``), made in ``work``: paths, the plan,
    the iteration count, the dataset's meta and how long each took."""
    cfg = CONFIGS[key]
    iterations = args.iterations or cfg["iterations"]
    rows = cfg["batch"] * (iterations + EVAL_BATCHES)
    start = time.perf_counter()
    dataset = config_dataset(key, iterations, work)
    data_seconds = time.perf_counter() - start
    plan_dir = work / f"plan-{key}"
    start = time.perf_counter()
    make_plan(dataset, PlanConfig(cfg["batch"], lookahead=args.lookahead, prefetch_distance=args.distance),
              plan_dir, client=client)
    return {"key": key, "cfg": cfg, "iterations": iterations, "rows": rows, "dataset": dataset,
            "plan_dir": plan_dir, "plan": load_plan(plan_dir), "meta": read_meta(dataset),
            "data_seconds": data_seconds, "plan_seconds": time.perf_counter() - start}


def run_config(key: str, args, client: Client, work: Path) -> list[dict]:
    data = config_data(key, args, work, client)
    cfg, iterations, dataset, plan_dir, plan, meta = (data[k] for k in ("cfg", "iterations", "dataset", "plan_dir",
                                                                      "plan", "meta"))
    print(f"\n[{key}] {cfg['name']}: {data['rows']:,} rows, {meta.total_embedding_rows:,} embedding rows of dim "
          f"{cfg['dim']}, batch {cfg['batch']}, {iterations} iterations "
          f"(data ready in {data['data_seconds']:.1f} s)", flush=True)
    print(f"[{key}] plan L={args.lookahead} P={args.distance}: {plan.num_slots:,} cache slots "
          f"({100 * plan.num_slots / meta.total_embedding_rows:.1f}% of rows), made in "
          f"{data['plan_seconds']:.1f} s (offline, not in the times below)", flush=True)
    results = []
    for model in args.models:
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for round_ in range(args.repeats):
            # Rotate the order each round so that no mode always runs first (cold caches, load drift).
            order = MODES[round_ % len(MODES):] + MODES[: round_ % len(MODES)]
            for mode in order:
                runs[mode].append(train_once(key, model, mode, cfg, iterations, dataset, plan_dir, plan, args,
                                             client, work))
        results += [combine(key, mode, runs[mode]) for mode in MODES]
    return results


def train_once(key, model, mode, cfg, iterations, dataset, plan_dir, plan, args, client, work) -> dict:
    # DLRM gets the configuration's MLPs; the other models their published layer sizes (engine/models).
    architecture = {"bottom_mlp": cfg["bottom"], "top_mlp": cfg["top"]} if model == "dlrm" else {}
    config = TrainConfig(
        dataset_dir=str(dataset), mode=mode, output_dir=str(work / f"run-{key}-{model}-{mode}"),
        batch_size=cfg["batch"], iterations=iterations, num_shards=args.shards,
        capacity=plan.num_slots if mode == "lru" else None,
        plan_dir=str(plan_dir) if mode == "oracle" else None, device=args.device,
        model=model, embedding_dim=cfg["dim"], **architecture,
        eval_fraction=EVAL_BATCHES / (iterations + EVAL_BATCHES), metrics_every=iterations,
        save_state=False,
    )
    start = time.perf_counter()
    summary = train(config, client=client)
    wall = time.perf_counter() - start
    per_it = np.loadtxt(Path(config.output_dir) / "iterations.csv", delimiter=",", skiprows=1, ndmin=2)
    steady = per_it[len(per_it) // 2 :]
    summary.update(config=key, wall_seconds=wall, steady_iteration_ms=float(steady[:, 2].mean()),
                   steady_stall_fraction=float(steady[:, 3].sum() / steady[:, 2].sum()),
                   iteration_ms=per_it[:, 2].tolist(), stall_ms=per_it[:, 3].tolist())
    print(f"[{key}] {model:<9} {mode:<7} {summary['mean_iteration_ms']:9.1f} ms/iteration "
          f"(median {summary['median_iteration_ms']:.1f}, steady {summary['steady_iteration_ms']:.1f}), "
          f"stall {100 * summary['stall_fraction']:.1f}%, run {wall:.1f} s", flush=True)
    return summary


def combine(key: str, mode: str, runs: list[dict]) -> dict:
    """One row per mode: medians over the rounds of the timing numbers; traffic and hashes are
    deterministic (checked equal across rounds)."""
    out = dict(runs[0])
    for field in ("mean_iteration_ms", "median_iteration_ms", "steady_iteration_ms", "stall_fraction",
                  "steady_stall_fraction", "wall_seconds"):
        out[field] = float(np.median([r[field] for r in runs]))
    out["rounds"] = len(runs)
    out["mean_iteration_ms_each_round"] = [r["mean_iteration_ms"] for r in runs]
    # Pooled over every iteration of every round: the median, and the 10th percentile (the
    # iterations least disturbed by other work on a shared machine).
    pooled = np.concatenate([r["iteration_ms"] for r in runs])
    out["pooled_median_ms"] = float(np.median(pooled))
    out["pooled_p10_ms"] = float(np.percentile(pooled, 10))
    out["pooled_stall_fraction"] = float(sum(sum(r["stall_ms"]) for r in runs) / pooled.sum())
    for r in runs:
        r.pop("iteration_ms"), r.pop("stall_ms")
    out.pop("iteration_ms", None), out.pop("stall_ms", None)
    for field in ("bytes_fetched", "bytes_written_back", "state_sha256"):
        if len({r[field] for r in runs}) != 1:
            raise RuntimeError(f"[{key}] {out['model']} {mode}: {field} differs between rounds")
    return out


def _run_key(r: dict) -> tuple[str, str]:
    return r["config"], r["model"]


def print_table(results: list[dict]) -> None:
    local = {_run_key(r): r for r in results if r["mode"] == "local"}
    header = (f"{'cfg':<4}{'model':<10}{'mode':<8}{'mean ms':>9}{'median':>9}{'p10':>9}{'x local':>9}{'(p10)':>7}"
              f"{'stall %':>9}{'fetched MB':>12}{'written MB':>12}{'eval AUC':>10}  same bits as local")
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        ref = local[_run_key(r)]
        auc = "n/a" if r["eval_auc"] is None else f"{r['eval_auc']:.4f}"
        print(f"{r['config']:<4}{r['model']:<10}{r['mode']:<8}{r['mean_iteration_ms']:9.1f}{r['pooled_median_ms']:9.1f}"
              f"{r['pooled_p10_ms']:9.1f}{r['pooled_median_ms'] / ref['pooled_median_ms']:9.2f}"
              f"{r['pooled_p10_ms'] / ref['pooled_p10_ms']:7.2f}{100 * r['pooled_stall_fraction']:9.1f}"
              f"{r['bytes_fetched'] / 1e6:12.1f}{r['bytes_written_back'] / 1e6:12.1f}{auc:>10}  "
              f"{'yes' if r['state_sha256'] == ref['state_sha256'] else 'NO'}")
    print("mean ms: median over rounds of each run's mean; median / p10: over every iteration of every round;\n"
          "x local: median (and p10) ratio to local; stall %: time compute waited for embeddings / iteration time")
    for key in local:
        m = {r["mode"]: r for r in results if _run_key(r) == key}
        for stat in ("pooled_median_ms", "pooled_p10_ms"):
            o = m["oracle"][stat]
            print(f"[{key[0]} {key[1]}] {stat.split('_')[1]:>6}: oracle {m['remote'][stat] / o:.2f}x faster than "
                  f"remote, {m['lru'][stat] / o:.2f}x faster than lru, {o / m['local'][stat]:.2f}x local's time")


def print_models(results: list[dict]) -> None:
    """The models side by side per configuration: iteration time (local, oracle), held-out AUC and log
    loss after the same iterations (equal in every mode: the states are bit-identical)."""
    by = {(r["config"], r["model"], r["mode"]): r for r in results}
    header = (f"{'cfg':<4}{'model':<10}{'row width':>10}{'dense params':>14}{'local ms':>10}{'oracle ms':>11}"
              f"{'eval AUC':>10}{'log loss':>10}")
    print("\n" + header + "\n" + "-" * len(header))
    for cfg, model in dict.fromkeys((r["config"], r["model"]) for r in results):
        local, oracle = by[cfg, model, "local"], by[cfg, model, "oracle"]
        auc = "n/a" if local["eval_auc"] is None else f"{local['eval_auc']:.4f}"
        loss = "n/a" if local["eval_log_loss"] is None else f"{local['eval_log_loss']:.4f}"
        print(f"{cfg:<4}{model:<10}{local['row_width']:>10}{local['dense_parameters']:>14,}"
              f"{local['pooled_median_ms']:>10.1f}{oracle['pooled_median_ms']:>11.1f}{auc:>10}{loss:>10}")
    print("local / oracle ms: median over every iteration of every round; AUC and log loss on the held-out\n"
          f"rows ({EVAL_BATCHES} batches) after the same iterations")


def _models(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown model {unknown[0] if unknown else text!r}; choose from "
                                         f"{', '.join(MODELS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="a,b", help="comma-separated: a (Criteo arch), b (embedding-bound), "
                                                         "demo, skewed (see CONFIGS)")
    parser.add_argument("--models", default="dlrm", type=_models,
                        help=f"comma-separated models to train in every mode: {', '.join(MODELS)} (default dlrm)")
    parser.add_argument("--iterations", type=int, help="override the per-config iteration count")
    parser.add_argument("--lookahead", type=int, default=20,
                        help="L: the oracle keeps a row across gaps of at most L iterations (default 20)")
    parser.add_argument("--distance", type=int, default=2, help="P (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="embedding servers (default 2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all modes; medians reported (default 3)")
    parser.add_argument("--work-dir", default="/tmp/dlrmflow-bench-train")
    parser.add_argument("--json-out", help="also write every summary to this JSON file")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), device {args.device}, GPU {gpu}")
    print("note: the embedding servers share this machine's CPUs with the trainer; numbers are noisy "
          f"when other work runs (load average now {os.getloadavg()[0]:.1f})")
    results = []
    with local_cluster(n_workers=2) as cluster, Client(cluster) as client:
        for key in args.configs.split(","):
            results += run_config(key.strip(), args, client, work)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    print_table(results)
    if len(args.models) > 1:
        print_models(results)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
