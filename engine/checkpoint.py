"""The baseline parity must beat: periodic checkpoints of everything, reload + replay after a loss.

``--checkpoint-every N`` (modes remote and lru): before iterations ``0, N, 2N, ...`` the trainer
writes ``RUN_DIR/checkpoint.pt`` atomically (temp file + rename) with every embedding row (the
shards' rows overlaid with the rows the trainer holds newer copies of: the pending write-back
or the LRU cache), the dense parameters, the dense optimizer state and the plan position (the
next iteration). When a shard's worker dies (a call to it fails), the trainer reloads the file,
starts K fresh shards holding its rows, drops its cache, restores the dense state and replays
the iterations since the checkpoint. Training is deterministic, so the replay recomputes the
same bits and the run ends bit-identical to a failure-free one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from distributed import Client

from dlrmflow.engine.embedding_rows import RowSpec
from dlrmflow.engine.embedding_server import EmbeddingShard, ShardGroup
from dlrmflow.engine.trainer_modes import LruRows, RemoteRows, SlotDirectory

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_MODES = ("remote", "lru")


class RestoredShard(EmbeddingShard):
    """An embedding shard that starts from given rows (a checkpoint's) instead of the initial ones."""

    def __init__(self, spec: RowSpec, shard: int, num_shards: int, rows: np.ndarray) -> None:
        self.spec, self.shard, self.num_shards = spec, shard, num_shards
        self.rows = np.array(rows, dtype=np.float32, copy=True)
        self.rows_fetched = self.rows_written = 0


def start_placed_shards(client: Client, spec: RowSpec, k: int, rows: np.ndarray | None = None) -> ShardGroup:
    """K shards, round robin over the live workers, remembering where each is (``worker_of``)."""
    workers = sorted(client.scheduler_info()["workers"])
    placed = [workers[i % len(workers)] for i in range(k)]
    if rows is None:
        futures = [client.submit(EmbeddingShard, spec, i, k, actor=True, workers=[w], pure=False)
                   for i, w in enumerate(placed)]
    else:
        futures = [client.submit(RestoredShard, spec, i, k, np.ascontiguousarray(rows[i::k]), actor=True,
                                 workers=[w], pure=False) for i, w in enumerate(placed)]
    group = ShardGroup(spec, [f.result() for f in futures], futures)
    group.worker_of = placed
    return group


def is_lost_shard(exc: BaseException) -> bool:
    """A failed call to an actor whose worker died."""
    return isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and "Worker holding Actor was lost" in str(exc))


def logical_rows(store) -> np.ndarray:
    """Every row's current value: the shards' rows overlaid with the trainer's newer copies."""
    rows = store.shards.all_rows()
    if isinstance(store, RemoteRows):
        rows[store._pending_ids] = store._pending_rows
    elif isinstance(store, LruRows):
        ids = store.directory.cached_ids()
        rows[ids] = store._rows_in_slots(store.directory.slot_of[ids])
    return rows


def save_checkpoint(path: Path, t: int, store, model: torch.nn.Module, optimizer) -> dict[str, Any]:
    start = time.perf_counter()
    state = {"iteration": t, "rows": torch.from_numpy(logical_rows(store)),
             "dense": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
             "dense_optimizer": optimizer.state_dict()}
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return {"iteration": t, "seconds": time.perf_counter() - start, "bytes": path.stat().st_size}


def restore_checkpoint(path: Path, client: Client, store, model: torch.nn.Module, optimizer) -> int:
    """Reload ``path`` into fresh shards, an empty cache and the dense model; the iteration to replay from."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    old = store.shards
    store.shards = start_placed_shards(client, store.spec, old.num_shards, state["rows"].numpy())
    old.close()  # the survivors hold newer rows than the checkpoint: drop them
    if isinstance(store, RemoteRows):
        store._pending_ids, store._pending_rows = store._pending_ids[:0], store._pending_rows[:0]
    elif isinstance(store, LruRows):
        store.cache.zero_()
        store.directory = SlotDirectory(store.spec.total_rows, store.capacity)
        store.last_used[:] = -1
    model.load_state_dict(state["dense"])
    optimizer.load_state_dict(state["dense_optimizer"])
    return int(state["iteration"])


def checkpoint_train_loop(setup, model, optimizer, store, device, progress, on_metrics, injector, client,
                          run_dir) -> dict[str, Any]:
    """The trainer's loop with checkpoints and reload + replay (same log as the plain loop)."""
    from dlrmflow.engine.trainer import train_step

    config, n, offsets = setup.config, setup.iterations, setup.stream.offsets
    every, path = config.checkpoint_every, Path(run_dir) / CHECKPOINT_FILE
    losses: list[Any] = [None] * n
    iteration_seconds, stall_seconds = np.zeros(n), np.zeros(n)
    report: dict[str, Any] = {"every": every, "file": str(path), "checkpoints": [], "recoveries": []}
    window: list[dict[str, Any]] = []
    begin = time.perf_counter()
    report["clock_origin"] = begin  # perf_counter() that detected_s counts from
    t, saved_at, done, batches, replaying = 0, -1, 0, None, None
    while True:
        try:
            if t >= n:
                store.finish()
                store.shards.stats()  # touch every shard: a loss not yet noticed is noticed here
                break
            if t % every == 0 and t != saved_at:
                report["checkpoints"].append(save_checkpoint(path, t, store, model, optimizer))
                saved_at = t
            if batches is None:
                batches = setup.stream.iter_range(t, n)
            batch = next(batches)
            if injector is not None:
                injector.before_iteration(t)
            start, stall_before = time.perf_counter(), store.stall_seconds
            losses[t] = train_step(t, batch, offsets, model, optimizer, setup.spec, store, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            iteration_seconds[t] = time.perf_counter() - start
            stall_seconds[t] = store.stall_seconds - stall_before
            t += 1
        except Exception as exc:
            if not is_lost_shard(exc):
                raise
            detected = time.perf_counter()
            failed_at = t
            t = restore_checkpoint(path, client, store, model, optimizer)
            batches = None
            replaying = {"failed_at": failed_at, "replay_from": t, "detected_s": detected - begin,
                         "reload_seconds": time.perf_counter() - detected, "_detected": detected}
            report["recoveries"].append(replaying)
            continue
        if replaying is not None and t >= replaying["failed_at"]:
            replaying["seconds"] = time.perf_counter() - replaying.pop("_detected")  # detection -> caught up
            replaying = None
        if t > done:  # progress and metrics once per iteration, not again on a replay
            done = t
            if progress is not None:
                progress(t, n)
            if t % config.metrics_every == 0 or t == n:
                lo = window[-1]["iteration"] if window else 0
                row = {"iteration": t, "loss": float(torch.stack(losses[lo:t]).mean()),
                       "iteration_ms": 1e3 * float(iteration_seconds[lo:t].mean()),
                       "stall_ms": 1e3 * float(stall_seconds[lo:t].mean())}
                window.append(row)
                if on_metrics is not None:
                    on_metrics(row)
    return {
        "losses": torch.stack(losses).cpu().numpy().astype(np.float64),
        "iteration_seconds": iteration_seconds,
        "stall_seconds": stall_seconds,
        "train_seconds": time.perf_counter() - begin,
        "metrics": window,
        "checkpoint": report,
    }
