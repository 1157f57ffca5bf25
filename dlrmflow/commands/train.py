"""dlrmflow train: train a DLRM locally, against embedding servers, or with an LRU / oracle cache."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dlrmflow.errors import UserInputError

NAME = "train"
HELP = "train a DLRM (modes: local, remote, lru, oracle); writes final_state.pt and summary.json"


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split("-")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer sizes like 512-256-64-16, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"layer sizes must be positive, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument

    parser.add_argument("dataset", metavar="DATASET_DIR", help="a preprocessed dataset directory")
    parser.add_argument("--mode", required=True, choices=["local", "remote", "lru", "oracle"],
                        help="where embedding rows live: local tables, remote shards (no cache), "
                             "remote + LRU cache, remote + plan-driven cache and prefetch")
    parser.add_argument("--plan", metavar="PLAN_DIR", help="the plan for --mode oracle (`dlrmflow plan`)")
    parser.add_argument("--capacity", type=int, metavar="ROWS", help="cache rows for --mode lru")
    parser.add_argument("--shards", type=int, default=2, metavar="K", help="embedding servers (default 2)")
    parser.add_argument("--iterations", type=int, metavar="N",
                        help="batches to train (default: every batch before the held-out rows)")
    parser.add_argument("--batch-size", type=int, default=128, metavar="B", help="default 128")
    parser.add_argument("--output", required=True, metavar="RUN_DIR", help="where final_state.pt etc. go")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="model and embedding initialisation (default 0)")
    parser.add_argument("--embedding-dim", type=int, default=16, help="default 16")
    parser.add_argument("--bottom-mlp", type=_sizes, metavar="SIZES",
                        help="bottom MLP layer sizes after the input, e.g. 512-256-64-16 (the default, with "
                             "the last = --embedding-dim)")
    parser.add_argument("--top-mlp", type=_sizes, default=[512, 256, 1], metavar="SIZES",
                        help="top MLP layer sizes, ending in 1 (default 512-256-1)")
    parser.add_argument("--embedding-optimizer", choices=["sgd", "adagrad"], default="adagrad",
                        help="row-wise Adagrad (default) or SGD")
    parser.add_argument("--dense-optimizer", choices=["sgd", "adam"], default="sgd", help="default sgd")
    parser.add_argument("--lr", type=float, default=0.01, help="dense learning rate (default 0.01)")
    parser.add_argument("--embedding-lr", type=float, help="embedding learning rate (default: --lr)")
    parser.add_argument("--eval-fraction", type=float, default=0.1, metavar="F",
                        help="the last F of the dataset's rows are held out for AUC / log loss (default 0.1)")
    parser.add_argument("--metrics-every", type=int, default=50, metavar="N",
                        help="log loss and timings every N iterations (default 50)")
    parser.add_argument("--parity", type=int, default=0, metavar="R",
                        help="R erasure-coded parity shards (1: XOR, 2-4: Reed-Solomon; default 0: none); "
                             "a LocalCluster then gets one worker per shard plus a spare")
    parser.add_argument("--kill", action="append", default=[], metavar="shard:I@ITER|parity:J@ITER",
                        help="failure injection (repeatable): SIGKILL the worker of data shard I or parity "
                             "shard J when iteration ITER starts; needs --parity")
    parser.add_argument("--rebuild-chunk", type=int, default=262144, metavar="STRIPES",
                        help="stripes per recovery task (default 262144; bounds the rebuild's memory per chunk)")
    parser.add_argument("--rebuild-rate", type=float, default=0.0, metavar="MB/S",
                        help="cap a rebuild at MB/S of rebuilt rows (default 0: as fast as it goes). On machines "
                             "the trainer shares with the servers, a cap leaves training more of the cores "
                             "while a lost shard is rebuilt, and the rebuild takes longer")
    parser.add_argument("--parity-batches", type=int, default=8, metavar="N",
                        help="write-back batches whose parity deltas go to the parity shards in one message "
                             "(default 8; 1: a message per batch). Fewer messages cost the trainer less; "
                             "pending deltas are sent before anything reads parity")
    parser.add_argument("--checkpoint-every", type=int, metavar="N",
                        help="checkpoint all shards + dense state every N iterations (modes remote, lru, oracle): "
                             "without --parity a lost shard is reloaded and replayed; a crashed run continues "
                             "with `dlrmflow resume RUN_DIR`")
    add_dask_argument(parser)


def flow_parameters(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        dataset_dir=args.dataset, mode=args.mode, output_dir=args.output, batch_size=args.batch_size,
        iterations=args.iterations, num_shards=args.shards, capacity=args.capacity, plan_dir=args.plan,
        device=args.device, seed=args.seed, embedding_dim=args.embedding_dim, bottom_mlp=args.bottom_mlp,
        top_mlp=args.top_mlp, embedding_optimizer=args.embedding_optimizer, dense_optimizer=args.dense_optimizer,
        lr=args.lr, embedding_lr=args.embedding_lr, eval_fraction=args.eval_fraction,
        metrics_every=args.metrics_every, parity=args.parity, kills=args.kill, rebuild_chunk=args.rebuild_chunk,
        parity_batches=args.parity_batches, rebuild_rate=args.rebuild_rate, checkpoint_every=args.checkpoint_every,
        dask_address=args.dask_address,
    )


class TrainingStopped(UserInputError):
    """Training failed after a checkpoint: one line with the cause and the command that resumes the run."""


def config_of(params: dict[str, Any]):
    """The TrainConfig the train flow builds from its parameters."""
    from dataclasses import fields

    from dlrmflow.engine.trainer import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k in names})


def run_training(params: dict[str, Any]) -> dict[str, Any]:
    """Check, then run the train flow. A failure that leaves a resumable run names `dlrmflow resume RUN_DIR`."""
    from dlrmflow.engine.checkpoint import ResumeError, unfinished_run_message
    from dlrmflow.engine.trainer import prepare_run
    from dlrmflow.flows.train import train_flow

    prepare_run(config_of(params))  # every input check (UserInputError), before Prefect or Dask start
    try:
        summary = train_flow(**params)
    except ResumeError:
        raise
    except Exception as exc:
        message = unfinished_run_message(params["output_dir"])
        if message is None:
            raise
        raise TrainingStopped(f"training stopped ({type(exc).__name__}: {exc}); {message}") from exc
    except KeyboardInterrupt:
        message = unfinished_run_message(params["output_dir"])
        if message:
            print(message, file=sys.stderr)
        raise
    summary.pop("metrics", None)  # in summary.json and the Prefect table; keep the JSON line short
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    params = flow_parameters(args)
    if params["bottom_mlp"] is None:
        params["bottom_mlp"] = [512, 256, 64, args.embedding_dim]
    return run_training(params)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def _parity_lines(p: dict[str, Any] | None) -> list[str]:
    if not p:
        return []
    verify = p["verify"]
    lines = [
        f"  parity             R={p['parity_shards']}: {_fmt_bytes(p['parity_bytes_sent'])} of deltas in "
        f"{p['write_back_batches']:,} write-back batches; verify "
        f"{'OK' if verify['ok'] else 'FAILED ' + str(verify['mismatched_stripes'])} ({verify['stripes']:,} stripes)",
    ]
    for kill in p["kills"]:
        lines.append(f"  killed             {kill['kill']} (pid {kill['pid']}) at {kill['at_s']:.3f} s")
    for rec in p["recoveries"]:
        lines.append(f"  recovered          {', '.join(rec['lost'])}: {rec['rows_rebuilt']:,} rows copied in "
                     f"{rec['chunks']} chunks ({rec['stripes_generated']:,} stripes generated from the seed), "
                     f"{rec['seconds']:.3f} s after detection"
                     f"{_noticed(p['kills'], rec['detected_s'])}; training waited {rec['locked_seconds']:.3f} s "
                     f"for it; {p['degraded_rows_read']:,} degraded row reads")
        if rec.get("causes"):  # what showed the loss (a restart of the rebuild adds one)
            lines.append(f"{'':21}noticed by: {'; then '.join(rec['causes'])}")
        if "copy_task_seconds" in rec:  # a summary written before the breakdown was recorded has none
            lines.append(f"{'':21}bulk copy {rec['copy_seconds']:.3f} s: {rec['copy_task_seconds']:.3f} s in copy "
                         f"tasks on the new shards' worker ({rec['copy_read_wait_seconds']:.3f} s waiting for "
                         f"survivors, {rec['copy_install_seconds']:.3f} s decoding and installing)")
    return lines


def _noticed(kills: list[dict[str, Any]], detected_s: float) -> str:
    """How long the latest kill before a detection went unnoticed (a real failure has no kill record)."""
    before = [k["at_s"] for k in kills if k["at_s"] <= detected_s]
    return f" (noticed {detected_s - max(before):.3f} s after the kill)" if before else ""


def _checkpoint_lines(c: dict[str, Any] | None) -> list[str]:
    if not c:
        return []
    lines = [f"  checkpoints        {len(c['checkpoints'])} (every {c['every']} iterations), "
             f"{sum(x['seconds'] for x in c['checkpoints']):.3f} s writing {c['file']}"]
    if c.get("resumed_from") is not None:
        lines.append(f"  resumed            from the checkpoint at iteration {c['resumed_from']}")
    for rec in c["recoveries"]:
        lines.append(f"  recovered          reloaded iteration {rec['replay_from']}, replayed to {rec['failed_at']}: "
                     f"{rec['seconds']:.3f} s after detection{_noticed(c.get('kills', []), rec['detected_s'])}")
    return lines


def summarize(r: dict[str, Any]) -> str:
    auc = "n/a" if r["eval_auc"] is None else f"{r['eval_auc']:.4f}"
    logloss = "n/a" if r["eval_log_loss"] is None else f"{r['eval_log_loss']:.4f}"
    lines = [
        f"{r['mode']} training: {r['iterations']:,} iterations of batch {r['batch_size']:,} on {r['device']}",
        f"  mean iteration     {r['mean_iteration_ms']:.2f} ms (median {r['median_iteration_ms']:.2f} ms)",
        f"  stall              {100 * r['stall_fraction']:.1f}% of iteration time",
        f"  traffic            {_fmt_bytes(r['bytes_fetched'])} fetched, "
        f"{_fmt_bytes(r['bytes_written_back'])} written back",
        f"  train loss         {r['first_train_loss']:.4f} (first) -> {r['final_train_loss_mean']:.4f} "
        f"(mean of the last {r['metrics_every']})",
        f"  eval ({r['eval_rows']:,} rows)   AUC {auc}, log loss {logloss}",
        f"  state SHA-256      {r['state_sha256']}",
        *_parity_lines(r.get("parity")),
        *_checkpoint_lines(r.get("checkpoint")),
        f"  output             {r['output_dir']}/ (final_state.pt, summary.json, iterations.csv)",
    ]
    return "\n".join(lines)
