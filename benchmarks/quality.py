"""Model quality against DeepCTR-Torch: the four models trained by dlrmflow and by DeepCTR-Torch 0.3.0 on the
same rows, held-out AUC and log loss side by side over several seeds, with the constant prediction's log loss
as the floor a model must beat (and, on generated labels, the true probability's as the best reachable).

Data: each ``--sources`` entry (benchmarks/quality_data.py) or ``--dataset DIR``, any preprocessed dataset
(`dlrmflow preprocess` output):

    generator      ``--rows`` rows of the project's generator (dlrmflow.datasets.synthetic, tables at ``--scale``)
    first-order    ``--rows`` rows of another generator whose click depends on a few ids of two tables alone
    pairwise       the same generator, the click a product of two tables' per-id effects (at 400,000 rows one
                   epoch is too short: whether a model learns the product depends on its seed; at 2,000,000
                   every DeepFM seed of either library does, RESULTS.md)
    criteo-sample  the 200 real Criteo Kaggle rows the tests ship (use a small ``--batch-size``, e.g. 16)

The last ``--eval-fraction`` of the rows are held out. Both libraries train one epoch over the same training
rows in the same order (dlrmflow: every whole batch before the held-out rows; DeepCTR-Torch: those rows,
``shuffle=False``) with the same batch size, and are scored on the same held-out rows by the same AUC and
log-loss functions (``dlrmflow.engine.training.metrics``). Every ``--seeds`` entry is one run of each
library on the same data (the seed sets each library's initialisation); a cell shows the mean over the
seeds and their range.

    dlrmflow        DeepCTR-Torch
    dlrm            (none: DeepCTR-Torch has no DLRM; its row shows dlrmflow's figures only)
    wide-deep       WDL(dnn_hidden_units=--dnn of wide-deep, 400-400-400)
    deepfm          DeepFM(dnn_hidden_units=400-400-400)
    dcn-v2          DCN(cross_parameterization="matrix", cross_num=3, dnn 500-500-500, no linear part)

Settings mirrored on the DeepCTR-Torch side: embedding dim 16 (dlrmflow's default), no L2 regularisation,
no dropout or batch norm (dlrmflow has none), the mean log loss per batch (DeepCTR-Torch's ``fit`` sums
it: a custom loss keeps the gradient's scale), and the optimizers' families: the embeddings by Adagrad
(dlrmflow: ``--embedding-optimizer``, by default one accumulator per value for these three models, or
row-wise; DeepCTR-Torch: torch.optim.Adagrad, one per value) at ``--embedding-lr``, the dense parameters by
``--dense-optimizer`` (SGD or Adam) at ``--lr``. DeepCTR-Torch initialises itself (``init_std`` 1e-4, its DNN
weights N(0, 1e-4)); dlrmflow's hidden layers start as ``--hidden-init`` says (default auto: DeepCTR-Torch's
rule under Adam, Glorot's under SGD; docs/models.md).

``--deepctr-from FILE`` takes DeepCTR-Torch's figures from an earlier run's ``--json-out`` instead of training
it again (the same data and settings; a seed the file does not hold is run).

The goal (issue 47), per source and model: dlrmflow's mean held-out log loss no worse than DeepCTR-Torch's
by more than the seeds' spread (the larger range of the two), and its mean AUC at least DeepCTR-Torch's minus
0.001; the ``goal`` column says whether both hold.

A second table checks the first goal of issue 31 (first seed, sources with enough rows): each model trained
by dlrmflow with every default but the model (batch 128, SGD 0.01 for the dense part, the model's Adagrad 0.01
for the rows) and ``--eval-every 10`` for 50 iterations; it shows the first evaluation whose held-out log
loss is below the constant prediction's.

    .venv/bin/pip install -e '.[bench]'      # DeepCTR-Torch without its dependencies (pyproject.toml)
    .venv/bin/python benchmarks/quality.py [--sources generator,first-order,pairwise] [--rows 400000]
        [--batch-size 2048] [--seeds 0,1,2] [--models dlrm,...]
    .venv/bin/python benchmarks/quality.py --sources criteo-sample --batch-size 16 --seeds 0,1,2
    .venv/bin/python benchmarks/quality.py --dataset DIR --seeds 0,1,2
    .venv/bin/python benchmarks/quality.py ... --deepctr-from EARLIER.json   # dlrmflow's runs only, compared
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.models import HIDDEN_INIT_SETTINGS, MODELS
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.metrics import log_loss, roc_auc

sys.path.insert(0, str(Path(__file__).parent))
from quality_data import SOURCES, click_probability, source_dataset  # noqa: E402

EMBEDDING_DIM = 16  # dlrmflow's default
DNN = {"wide-deep": (400, 400, 400), "deepfm": (400, 400, 400), "dcn-v2": (500, 500, 500)}  # the published sizes
CROSS_LAYERS = 3
EARLY_ITERATIONS, EARLY_EVAL_EVERY, EARLY_BATCH = 50, 10, 128
AUC_MARGIN = 0.001  # the goal: dlrmflow's mean AUC at least DeepCTR-Torch's minus this
# The settings that must be equal for DeepCTR-Torch's recorded figures to stand for a new run's (--deepctr-from).
DEEPCTR_SETTINGS = ("rows", "scale", "data_seed", "dataset", "batch_size", "dense_optimizer", "lr", "embedding_lr",
                    "eval_fraction", "eval_batch_size")


def read_rows(dataset: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Every row of the dataset in its stored order: labels, dense, sparse ids; the tables' sizes."""
    stream = BatchStream(dataset, 1 << 16)
    batches = list(stream)
    return (np.concatenate([b.labels for b in batches]), np.concatenate([b.dense for b in batches]),
            np.concatenate([b.sparse for b in batches]), list(stream.meta.cardinalities))


class Optimizers:
    """Two optimizers as one: DeepCTR-Torch's fit calls only ``zero_grad`` and ``step``."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def mean_log_loss(pred: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """DeepCTR-Torch's fit asks for a sum; the mean keeps the gradient's scale equal to dlrmflow's."""
    return F.binary_cross_entropy(pred, target, reduction="mean")


def deepctr_model(name: str, num_dense: int, cards: list[int], seed: int):
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DCN, WDL, DeepFM

    features = [SparseFeat(f"C{k}", vocabulary_size=n, embedding_dim=EMBEDDING_DIM) for k, n in enumerate(cards)]
    features += [DenseFeat(f"I{j}", 1) for j in range(num_dense)]
    none = dict(l2_reg_linear=0.0, l2_reg_embedding=0.0, l2_reg_dnn=0.0, dnn_dropout=0.0, seed=seed)
    if name == "wide-deep":
        return WDL(features, features, dnn_hidden_units=DNN[name], **none), features
    if name == "deepfm":
        return DeepFM(features, features, dnn_hidden_units=DNN[name], **none), features
    return DCN([], features, cross_num=CROSS_LAYERS, cross_parameterization="matrix", dnn_hidden_units=DNN[name],
               l2_reg_cross=0.0, **none), features


def run_deepctr(name: str, rows, train_rows: int, eval_start: int, args, seed: int) -> dict[str, Any]:
    labels, dense, sparse, cards = rows
    model, features = deepctr_model(name, dense.shape[1], cards, seed)
    embedding = [p for n, p in model.named_parameters() if "embedding_dict" in n]
    ids = {id(p) for p in embedding}
    dense_params = [p for p in model.parameters() if id(p) not in ids]
    dense_optimizer = (torch.optim.Adam(dense_params, lr=args.lr) if args.dense_optimizer == "adam"
                       else torch.optim.SGD(dense_params, lr=args.lr))
    model.compile(Optimizers(torch.optim.Adagrad(embedding, lr=args.embedding_lr), dense_optimizer),
                  loss=mean_log_loss)

    def inputs(lo: int, hi: int) -> dict[str, np.ndarray]:
        x = {f"C{k}": sparse[lo:hi, k].astype(np.float32) for k in range(sparse.shape[1])}
        x.update({f"I{j}": dense[lo:hi, j] for j in range(dense.shape[1])})
        return {f.name: x[f.name] for f in features}

    start = time.perf_counter()
    model.fit(inputs(0, train_rows), labels[:train_rows].astype(np.float32), batch_size=args.batch_size, epochs=1,
              verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    p = model.predict(inputs(eval_start, len(labels)), batch_size=args.eval_batch_size).ravel()
    y = labels[eval_start:]
    return {"auc": roc_auc(y, p), "logloss": log_loss(y, p), "train_seconds": seconds}


def run_dlrmflow(name: str, dataset: Path, work: Path, args, seed: int, **settings: Any) -> dict[str, Any]:
    out = work / f"dlrmflow-{name}"
    shutil.rmtree(out, ignore_errors=True)
    arch = {"dnn": DNN[name]} if name in DNN else {}
    if name == "dcn-v2":
        arch["cross_layers"] = CROSS_LAYERS
    if name in DNN:  # DLRM reads no --hidden-init (and refuses one)
        arch["hidden_init"] = args.hidden_init
    base = dict(dataset_dir=str(dataset), mode="local", output_dir=str(out), model=name, save_state=False,
                eval_fraction=args.eval_fraction, seed=seed, metrics_every=100, **arch)
    summary = train(TrainConfig(**{**base, **settings}))
    return {"auc": summary["eval_auc"], "logloss": summary["eval_log_loss"], "summary": summary,
            "train_seconds": summary["train_seconds"]}


def first_below(evaluations: list[dict[str, Any]], floor: float) -> int | None:
    return next((e["iteration"] for e in evaluations if e["logloss"] < floor), None)


def figure(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def spread(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Mean, lowest and highest of ``key`` over the seeds' runs."""
    values = [float(r[key]) for r in runs]
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def cell(stats: dict[str, float] | None) -> str:
    """``mean (min-max)``, or the one value of a single seed."""
    if stats is None:
        return "-"
    if stats["min"] == stats["max"]:
        return figure(stats["mean"])
    return f"{figure(stats['mean'])} ({figure(stats['min'])}-{figure(stats['max'])})"


def goal_met(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Issue 47's goal (module docstring): log loss within the seeds' spread, AUC within AUC_MARGIN."""
    loss, auc = ours["logloss"], ours["auc"]
    allowed = max(loss["max"] - loss["min"], theirs["logloss"]["max"] - theirs["logloss"]["min"])
    return (loss["mean"] <= theirs["logloss"]["mean"] + allowed
            and auc["mean"] >= theirs["auc"]["mean"] - AUC_MARGIN)


def recorded_deepctr(path: str, args) -> dict[str, Any]:
    """The sources of an earlier ``--json-out`` whose DeepCTR-Torch runs stand for this run's: SystemExit naming
    the first setting that differs."""
    earlier = json.loads(Path(path).read_text())
    for key in DEEPCTR_SETTINGS:
        if earlier["settings"].get(key) != vars(args).get(key):
            raise SystemExit(f"--deepctr-from {path}: recorded with {key} {earlier['settings'].get(key)!r}, this run "
                             f"{vars(args).get(key)!r}")
    return earlier["sources"]


def compare_on(source: str, dataset: Path, work: Path, models: list[str], seeds: list[int], args,
               recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every model, both libraries, every seed on one dataset; the figures and their spreads. ``recorded``: this
    source's figures from --deepctr-from, whose DeepCTR-Torch runs are taken as they are."""
    rows = read_rows(dataset)
    labels = rows[0]
    eval_start = len(labels) - int(round(args.eval_fraction * len(labels)))
    train_rows = (eval_start // args.batch_size) * args.batch_size  # dlrmflow's whole batches
    if train_rows == 0:
        raise SystemExit(f"{source}: {eval_start} training rows hold no batch of {args.batch_size} (lower "
                         "--batch-size)")
    rate = float(labels[:train_rows].mean())
    held_out = labels[eval_start:]
    floor = log_loss(held_out, np.full(len(held_out), rate))
    probability = click_probability(dataset)
    best = None if probability is None else log_loss(held_out, probability[eval_start:])
    print(f"\n{source} ({dataset}): {len(labels):,} rows: {train_rows:,} trained ({train_rows // args.batch_size} "
          f"iterations of batch {args.batch_size:,}), {len(held_out):,} held out; click rate {rate:.4f}, constant "
          f"prediction's held-out log loss {floor:.4f}"
          + ("" if best is None else f", the true probability's {best:.4f}"), flush=True)
    result: dict[str, Any] = {"dataset": str(dataset), "rows": len(labels), "train_rows": train_rows,
                              "eval_rows": len(held_out), "batch_size": args.batch_size, "click_rate": rate,
                              "constant_logloss": floor, "best_logloss": best, "seeds": seeds, "models": {}}
    settings = dict(batch_size=args.batch_size, dense_optimizer=args.dense_optimizer, lr=args.lr,
                    embedding_lr=args.embedding_lr, embedding_optimizer=args.embedding_optimizer)
    for name in models:
        entry = result["models"][name] = {"dlrmflow": [], "deepctr": []}
        for seed in seeds:
            ours = run_dlrmflow(name, dataset, work, args, seed, **settings)
            ours.pop("summary")
            entry["dlrmflow"].append({"seed": seed, **ours})
            print(f"{source} {name} seed {seed}: dlrmflow {ours}", flush=True)
            if name != "dlrm" and not args.skip_deepctr:
                earlier = [r for r in ((recorded or {}).get("models", {}).get(name, {}).get("deepctr", []))
                           if r["seed"] == seed]
                theirs = ({k: v for k, v in earlier[0].items() if k != "seed"} if earlier
                          else run_deepctr(name, rows, train_rows, eval_start, args, seed))
                entry["deepctr"].append({"seed": seed, **theirs})
                print(f"{source} {name} seed {seed}: DeepCTR-Torch{' (recorded)' if earlier else ''} {theirs}",
                      flush=True)
        for library in ("dlrmflow", "deepctr"):
            if entry[library]:
                entry[f"{library}_spread"] = {key: spread(entry[library], key) for key in ("auc", "logloss",
                                                                                           "train_seconds")}
        if entry["deepctr"]:
            entry["goal_met"] = goal_met(entry["dlrmflow_spread"], entry["deepctr_spread"])
        if not args.skip_early and train_rows >= EARLY_ITERATIONS * EARLY_BATCH:
            early = run_dlrmflow(name, dataset, work, args, seeds[0], iterations=EARLY_ITERATIONS,
                                 eval_every=EARLY_EVAL_EVERY)
            entry["early"] = {"evaluations": early["summary"]["evaluations"],
                              "first_below_constant": first_below(early["summary"]["evaluations"], floor)}
            print(f"{source} {name}: defaults, first {EARLY_ITERATIONS} iterations {entry['early']}", flush=True)
    return result


def print_tables(source: str, result: dict[str, Any], args) -> None:
    best = result["best_logloss"]
    print(f"\n{source}: one epoch, batch {result['batch_size']:,}, dense {args.dense_optimizer} {args.lr:g}, "
          f"embeddings Adagrad {args.embedding_lr:g}; seeds {', '.join(map(str, result['seeds']))}: mean (lowest-"
          f"highest); constant prediction's log loss {result['constant_logloss']:.4f}"
          + ("" if best is None else f", the true probability's {best:.4f}"))
    print("| model | dlrmflow AUC | DeepCTR-Torch AUC | dlrmflow log loss | DeepCTR-Torch log loss | AUC difference "
          "| log loss difference | goal | dlrmflow s | DeepCTR-Torch s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, entry in result["models"].items():
        ours, theirs = entry["dlrmflow_spread"], entry.get("deepctr_spread")
        difference = {key: None if theirs is None else ours[key]["mean"] - theirs[key]["mean"]
                      for key in ("auc", "logloss")}
        goal = "-" if "goal_met" not in entry else ("met" if entry["goal_met"] else "not met")
        print(f"| {name} | {cell(ours['auc'])} | {cell(theirs and theirs['auc'])} | {cell(ours['logloss'])} | "
              f"{cell(theirs and theirs['logloss'])} | {figure(difference['auc'], 4)} | "
              f"{figure(difference['logloss'], 4)} | {goal} | {ours['train_seconds']['mean']:.0f} | "
              f"{figure(theirs and theirs['train_seconds']['mean'], 0)} |")
    early = {name: entry["early"] for name, entry in result["models"].items() if "early" in entry}
    if early:
        print(f"\nEvery default (batch {EARLY_BATCH}), --eval-every {EARLY_EVAL_EVERY}: held-out log loss after "
              f"10..{EARLY_ITERATIONS} iterations (constant: {result['constant_logloss']:.4f})")
        for name, entry in early.items():
            losses = ", ".join(f"{e['logloss']:.4f}" for e in entry["evaluations"])
            first = entry["first_below_constant"]
            print(f"| {name} | {losses} | below the constant from iteration {first if first else 'never'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default="generator",
                        help=f"comma-separated data sources: {', '.join(SOURCES)} (default: generator)")
    parser.add_argument("--dataset", help="a preprocessed dataset directory, in place of --sources")
    parser.add_argument("--rows", type=int, default=1_000_000, help="generated rows (default 1,000,000)")
    parser.add_argument("--scale", type=float, default=0.001,
                        help="table sizes: Criteo Kaggle's x SCALE (default 0.001: 133,381 rows in all)")
    parser.add_argument("--data-seed", type=int, default=0, help="the generated rows' seed (default 0)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all four)")
    parser.add_argument("--batch-size", type=int, default=4096, help="both libraries (default 4096, BARS's)")
    parser.add_argument("--dense-optimizer", choices=("sgd", "adam"), default="adam")
    parser.add_argument("--lr", type=float, default=1e-3, help="dense learning rate (default 1e-3, BARS's Adam)")
    parser.add_argument("--embedding-lr", type=float, default=0.01, help="Adagrad's rate for the embeddings")
    parser.add_argument("--embedding-optimizer", choices=("auto", "adagrad", "adagrad-per-value"), default="auto",
                        help="dlrmflow's row update: auto (dlrmflow's default: row-wise for dlrm, per value for the "
                             "others), adagrad (row-wise) or adagrad-per-value (as DeepCTR-Torch's Adagrad)")
    parser.add_argument("--hidden-init", choices=HIDDEN_INIT_SETTINGS, default="auto",
                        help="dlrmflow's hidden layers (wide-deep, deepfm, dcn-v2; default auto)")
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--eval-batch-size", type=int, default=16384)
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds, one run each (default 0)")
    parser.add_argument("--skip-deepctr", action="store_true", help="dlrmflow's runs only")
    parser.add_argument("--deepctr-from", metavar="FILE",
                        help="DeepCTR-Torch's figures from an earlier --json-out of the same data and settings")
    parser.add_argument("--skip-early", action="store_true", help="not the 50-iteration check of the defaults")
    parser.add_argument("--work-dir", default="/tmp/dlrmflow-bench-quality")
    parser.add_argument("--json-out", help="also write every figure to this JSON file")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    sources = [s for s in args.sources.split(",") if s]
    if not args.dataset and (not sources or any(s not in SOURCES for s in sources)):
        parser.error(f"--sources: choose from {', '.join(SOURCES)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds: at least one seed")
    torch.set_num_threads(min(os.cpu_count() or 1, torch.get_num_threads()))

    work = Path(args.work_dir)
    if args.dataset:
        datasets = {f"dataset {args.dataset}": Path(args.dataset)}
    else:
        datasets = {s: source_dataset(s, work, args.rows, args.scale, args.data_seed) for s in sources}
    recorded = recorded_deepctr(args.deepctr_from, args) if args.deepctr_from else {}
    results: dict[str, Any] = {"settings": vars(args), "sources": {}}
    for source, dataset in datasets.items():
        results["sources"][source] = compare_on(source, dataset, work, models, seeds, args, recorded.get(source))
        if args.json_out:  # after every source: a long run keeps what it measured
            Path(args.json_out).write_text(json.dumps(results, indent=1, default=float))
    for source, result in results["sources"].items():
        print_tables(source, result, args)


if __name__ == "__main__":
    main()
