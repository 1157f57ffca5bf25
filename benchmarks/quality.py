"""Model quality against DeepCTR-Torch: the four models trained by dlrmflow and by DeepCTR-Torch 0.3.0 on the
same generated rows, held-out AUC and log loss side by side, with the constant prediction's log loss as
the floor a model must beat.

Data: ``--rows`` synthetic Criteo rows (``dlrmflow.datasets.synthetic``, preprocessed as `dlrmflow
preprocess` writes them: ids by popularity rank, dense log(1 + x)); the last ``--eval-fraction`` are held
out. Both libraries train one epoch over the same training rows in the same order (dlrmflow: every whole
batch before the held-out rows; DeepCTR-Torch: those rows, ``shuffle=False``) with the same batch size,
and are scored on the same held-out rows by the same AUC and log-loss functions
(``dlrmflow.engine.training.metrics``).

    dlrmflow        DeepCTR-Torch
    dlrm            (none: DeepCTR-Torch has no DLRM; its row shows dlrmflow's figures only)
    wide-deep       WDL(dnn_hidden_units=--dnn of wide-deep, 400-400-400)
    deepfm          DeepFM(dnn_hidden_units=400-400-400)
    dcn-v2          DCN(cross_parameterization="matrix", cross_num=3, dnn 500-500-500, no linear part)

Settings mirrored on the DeepCTR-Torch side: embedding dim 16 (dlrmflow's default), no L2 regularisation,
no dropout or batch norm (dlrmflow has none), the mean log loss per batch (DeepCTR-Torch's ``fit`` sums
it: a custom loss keeps the gradient's scale), and the optimizers' families: the embeddings by Adagrad
(dlrmflow: row-wise, one accumulator per row; DeepCTR-Torch: torch.optim.Adagrad, one per value) at
``--embedding-lr``, the dense parameters by ``--dense-optimizer`` (SGD or Adam) at ``--lr``. DeepCTR-Torch
initialises itself (``init_std`` 1e-4, its DNN weights N(0, 1e-4)).

A second table checks the first goal of issue 31: each model trained by dlrmflow with every default but
the model (batch 128, SGD 0.01 for the dense part, row-wise Adagrad 0.01 for the rows) and
``--eval-every 10`` for 50 iterations; it shows the first evaluation whose held-out log loss is below the
constant prediction's.

    .venv/bin/pip install -e '.[bench]'      # DeepCTR-Torch without its dependencies (pyproject.toml)
    .venv/bin/python benchmarks/quality.py [--rows 1000000] [--batch-size 4096] [--models dlrm,...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.models import MODELS
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.metrics import log_loss, roc_auc

sys.path.insert(0, str(Path(__file__).parent))
from bench_data import synthetic_dataset  # noqa: E402

EMBEDDING_DIM = 16  # dlrmflow's default
DNN = {"wide-deep": (400, 400, 400), "deepfm": (400, 400, 400), "dcn-v2": (500, 500, 500)}  # the published sizes
CROSS_LAYERS = 3
EARLY_ITERATIONS, EARLY_EVAL_EVERY = 50, 10


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


def run_deepctr(name: str, rows, train_rows: int, eval_start: int, args) -> dict[str, Any]:
    labels, dense, sparse, cards = rows
    model, features = deepctr_model(name, dense.shape[1], cards, args.seed)
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


def run_dlrmflow(name: str, dataset: Path, work: Path, args, **settings: Any) -> dict[str, Any]:
    out = work / f"dlrmflow-{name}"
    shutil.rmtree(out, ignore_errors=True)
    arch = {"dnn": DNN[name]} if name in DNN else {}
    if name == "dcn-v2":
        arch["cross_layers"] = CROSS_LAYERS
    base = dict(dataset_dir=str(dataset), mode="local", output_dir=str(out), model=name, save_state=False,
                eval_fraction=args.eval_fraction, seed=args.seed, metrics_every=100, **arch)
    summary = train(TrainConfig(**{**base, **settings}))
    return {"auc": summary["eval_auc"], "logloss": summary["eval_log_loss"], "summary": summary,
            "train_seconds": summary["train_seconds"]}


def first_below(evaluations: list[dict[str, Any]], floor: float) -> int | None:
    return next((e["iteration"] for e in evaluations if e["logloss"] < floor), None)


def figure(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="generated rows (default 1,000,000)")
    parser.add_argument("--scale", type=float, default=0.001,
                        help="table sizes: Criteo Kaggle's x SCALE (default 0.001: 133,381 rows in all)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all four)")
    parser.add_argument("--batch-size", type=int, default=4096, help="both libraries (default 4096, BARS's)")
    parser.add_argument("--dense-optimizer", choices=("sgd", "adam"), default="adam")
    parser.add_argument("--lr", type=float, default=1e-3, help="dense learning rate (default 1e-3, BARS's Adam)")
    parser.add_argument("--embedding-lr", type=float, default=0.01, help="Adagrad's rate for the embeddings")
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--eval-batch-size", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-deepctr", action="store_true", help="dlrmflow's runs only")
    parser.add_argument("--skip-early", action="store_true", help="not the 50-iteration check of the defaults")
    parser.add_argument("--work-dir", default="/tmp/dlrmflow-bench-quality")
    parser.add_argument("--json-out", help="also write every figure to this JSON file")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(min(os.cpu_count() or 1, torch.get_num_threads()))

    work = Path(args.work_dir)
    dataset = synthetic_dataset(work / f"data-{args.rows}-{args.scale}", args.rows, args.scale, seed=args.seed)
    rows = read_rows(dataset)
    labels = rows[0]
    eval_start = len(labels) - int(round(args.eval_fraction * len(labels)))
    train_rows = (eval_start // args.batch_size) * args.batch_size  # dlrmflow's whole batches
    rate = float(labels[:train_rows].mean())
    floor = log_loss(labels[eval_start:], np.full(len(labels) - eval_start, rate))
    print(f"{len(labels):,} rows: {train_rows:,} trained ({train_rows // args.batch_size} iterations of batch "
          f"{args.batch_size:,}), {len(labels) - eval_start:,} held out; click rate {rate:.4f}, constant "
          f"prediction's held-out log loss {floor:.4f}", flush=True)

    results: dict[str, Any] = {"rows": len(labels), "train_rows": train_rows, "eval_rows": len(labels) - eval_start,
                               "batch_size": args.batch_size, "constant_logloss": floor, "models": {}}
    settings = dict(batch_size=args.batch_size, dense_optimizer=args.dense_optimizer, lr=args.lr,
                    embedding_lr=args.embedding_lr, embedding_optimizer="adagrad")
    for name in models:
        entry = results["models"][name] = {}
        entry["dlrmflow"] = run_dlrmflow(name, dataset, work, args, **settings)
        entry["dlrmflow"].pop("summary")
        print(f"{name}: dlrmflow {entry['dlrmflow']}", flush=True)
        if name != "dlrm" and not args.skip_deepctr:
            entry["deepctr"] = run_deepctr(name, rows, train_rows, eval_start, args)
            print(f"{name}: DeepCTR-Torch {entry['deepctr']}", flush=True)
        if not args.skip_early:
            early = run_dlrmflow(name, dataset, work, args, iterations=EARLY_ITERATIONS, eval_every=EARLY_EVAL_EVERY)
            entry["early"] = {"evaluations": early["summary"]["evaluations"],
                              "first_below_constant": first_below(early["summary"]["evaluations"], floor)}
            print(f"{name}: defaults, first {EARLY_ITERATIONS} iterations {entry['early']}", flush=True)

    print(f"\nOne epoch, batch {args.batch_size:,}, dense {args.dense_optimizer} {args.lr:g}, embeddings Adagrad "
          f"{args.embedding_lr:g}; constant prediction's log loss {floor:.4f}")
    print("| model | dlrmflow AUC | DeepCTR-Torch AUC | dlrmflow log loss | DeepCTR-Torch log loss | "
          "dlrmflow s | DeepCTR-Torch s |")
    print("|---|---|---|---|---|---|---|")
    for name, entry in results["models"].items():
        ours, theirs = entry["dlrmflow"], entry.get("deepctr") or {}
        print(f"| {name} | {figure(ours['auc'])} | {figure(theirs.get('auc'))} | {figure(ours['logloss'])} | "
              f"{figure(theirs.get('logloss'))} | {ours['train_seconds']:.0f} | "
              f"{figure(theirs.get('train_seconds'), 0)} |")
    if not args.skip_early:
        print(f"\nEvery default (batch 128), --eval-every {EARLY_EVAL_EVERY}: held-out log loss after "
              f"10..{EARLY_ITERATIONS} iterations (constant: {floor:.4f})")
        for name, entry in results["models"].items():
            losses = ", ".join(f"{e['logloss']:.4f}" for e in entry["early"]["evaluations"])
            first = entry["early"]["first_below_constant"]
            print(f"| {name} | {losses} | below the constant from iteration {first if first else 'never'} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
