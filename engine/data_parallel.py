"""W data-parallel trainers (``--trainers W``): processes on Dask workers, synchronised by torch.distributed.

The driver (:func:`run_trainers`, in the process that holds the Dask client and started the embedding
servers) places one trainer per worker process (:func:`~dlrmflow.engine.placement.place_trainers`),
picks a rendezvous port on rank 0's worker, submits :func:`train_rank` to each, relays rank 0's
progress to its callbacks, and watches the trainers' workers: a trainer whose worker dies fails the
run at once with :class:`TrainerLostError`, one line naming the trainer.

Each trainer reads the whole global batch (every trainer must know every trainer's rows: the stores
of :mod:`.data_parallel_stores` decide from them what to sync, fetch and write) and trains its slice
``rank * B/W .. (rank + 1) * B/W - 1``. Per iteration::

    block = store.gather(t, split)                        rows of the slice's distinct ids
    loss = BCE(model(dense slice, block[inverse])); backward
    dense grads (and the loss) gathered; mean in rank order -> every trainer's .grad; optimizer step
    store.update(t, split, next batch's ids, block, row grads)   sync, update, write home

Every trainer starts from the same model (same seed) and applies the same mean gradient, so the
dense parameters stay identical; rank 0 returns them. The trainers end with every row home on its
server; the driver reads the final rows from there.
"""

from __future__ import annotations

import queue
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.batches import global_ids
from dlrmflow.engine.cluster import cluster_workers
from dlrmflow.engine.collectives import TrainerGroup, sum_in_rank_order
from dlrmflow.engine.dask_internals import bind_actor
from dlrmflow.engine.data_parallel_stores import BatchSplit, LrppRows, LruRowsW, RemoteRowsW
from dlrmflow.engine.embedding_server import ShardGroup
from dlrmflow.engine.models import bce_loss, build_model
from dlrmflow.engine.placement import place_trainers
from dlrmflow.engine.training import TrainLog, deterministic_torch, make_dense_optimizer
from dlrmflow.errors import UserInputError

WATCH_SECONDS = 0.5  # how often the driver looks at the trainers' workers and progress
REPORT_SECONDS = 0.5  # rank 0 sends progress at most this often (and at every metrics row)
EMPTY_IDS = np.zeros(0, dtype=np.int64)


class TrainerLostError(UserInputError):
    """A trainer process died: the run cannot go on without its slice of the batch."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _worker_threads() -> int:
    from distributed import get_worker

    return max(1, get_worker().state.nthreads)


def make_trainer_store(setup: Any, device: torch.device, shards: ShardGroup, group: TrainerGroup):
    config = setup.config
    if config.mode == "remote":
        return RemoteRowsW(setup.spec, device, shards, group)
    if config.mode == "lru":
        return LruRowsW(setup.spec, device, shards, group, config.capacity)
    return LrppRows(setup.spec, device, shards, group, setup.plan, setup.iterations)


def trainer_step(t: int, batch, split: BatchSplit, next_union: np.ndarray, model: torch.nn.Module,
                 params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, spec, store,
                 group: TrainerGroup, device: torch.device) -> torch.Tensor:
    """One iteration of one trainer (module docstring); returns the trainers' mean loss."""
    rows = batch.labels.shape[0] // group.size
    lo, hi = group.rank * rows, (group.rank + 1) * rows
    dense = torch.tensor(batch.dense[lo:hi], device=device)
    labels = torch.tensor(batch.labels[lo:hi], device=device)
    block = store.gather(t, split)
    weights = block[:, : spec.dim].clone().requires_grad_(True)
    embeddings = weights.index_select(0, torch.from_numpy(split.inverse).to(device))
    loss = bce_loss(model(dense, embeddings.view(rows, -1, spec.dim)), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
    mean = sum_in_rank_order(group.all_gather_equal(flat, "dense gradients"))
    offset = 0
    for p in params:
        p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    optimizer.step()
    store.update(t, split, next_union, block, weights.grad)
    return mean[-1]


def train_rank(setup: Any, rank: int, size: int, init_method: str, shards: ShardGroup,
               progress_topic: str | None = None) -> dict[str, Any]:
    """One trainer process's whole run (a Dask task); rank 0's result carries the dense state and sends
    its progress as events on ``progress_topic``."""
    from distributed import get_worker

    torch.set_num_threads(_worker_threads())
    for actor in shards.actors:
        bind_actor(actor)  # here, in the task's thread: the prefetch thread cannot
    config, n = setup.config, setup.iterations
    device = torch.device(config.device)
    group = TrainerGroup(rank, size, init_method)
    store = None
    worker = get_worker()
    reports = progress_topic if progress_topic and rank == 0 else None
    try:
        with deterministic_torch(device):
            model = build_model(setup.model_config, seed=config.seed).to(device)
            optimizer = make_dense_optimizer(config, model)
            params = list(model.parameters())
            store = make_trainer_store(setup, device, shards, group)
            log = TrainLog.empty(n)
            sync_seconds = np.zeros(n)  # per iteration: in the row gradients' collectives and barriers
            offsets = setup.stream.offsets
            batches = setup.stream.iter_range(0, n)
            batch = next(batches)
            split = BatchSplit.of(0, global_ids(batch.sparse, offsets), size, rank)
            last_report = 0.0
            for t in range(n):
                following = next(batches) if t + 1 < n else None
                next_split = None if following is None else BatchSplit.of(
                    t + 1, global_ids(following.sparse, offsets), size, rank)
                start, stall, sync = time.perf_counter(), store.stall_seconds, store.sync_seconds
                loss = trainer_step(t, batch, split, EMPTY_IDS if next_split is None else next_split.union, model,
                                    params, optimizer, setup.spec, store, group, device)
                log.record(t, loss, time.perf_counter() - start, store.stall_seconds - stall)
                sync_seconds[t] = store.sync_seconds - sync
                row = _metrics_row(log, t + 1, config.metrics_every, n)
                if reports is not None and (row or time.perf_counter() - last_report > REPORT_SECONDS):
                    worker.log_event(reports, {"done": t + 1, "metrics": row})
                    last_report = time.perf_counter()
                batch, split = following, next_split
            start = time.perf_counter()
            store.finish()
            group.barrier()  # every trainer's rows are home before the driver reads them
            flush = time.perf_counter() - start
        result = {**log.result(), "flush_seconds": flush}  # train_seconds already counts the flush
        return {
            "rank": rank, "worker": worker.address, "threads": torch.get_num_threads(),
            "log": result, "sync_seconds": sync_seconds,
            "bytes_fetched": int(store.bytes_fetched), "bytes_written": int(store.bytes_written),
            "bytes_to_trainers": dict(group.bytes_sent),
            "dense": {k: v.detach().cpu() for k, v in model.state_dict().items()} if rank == 0 else None,
            "dense_optimizer": optimizer.state_dict() if rank == 0 else None,
        }
    finally:
        if store is not None:
            store.close()
        group.close()


def _metrics_row(log: TrainLog, t: int, every: int, n: int) -> dict[str, Any] | None:
    """The metrics row due after ``t`` iterations (every ``every`` and at the end), appended to the log."""
    if t % every and t != n:
        return None
    lo = log.metrics[-1]["iteration"] if log.metrics else 0
    row = {"iteration": t, "loss": float(torch.stack(log.losses[lo:t]).mean()),
           "iteration_ms": 1e3 * float(log.iteration_seconds[lo:t].mean()),
           "stall_ms": 1e3 * float(log.stall_seconds[lo:t].mean())}
    log.metrics.append(row)
    return row


def run_trainers(setup: Any, client, shards: ShardGroup, *, progress: Callable[[int, int], None] | None = None,
                 on_metrics: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run ``setup.config.trainers`` trainers on the cluster of ``client`` against ``shards``; every
    trainer's result, in rank order (module docstring)."""
    size = setup.config.trainers
    workers = place_trainers(cluster_workers(client), size, servers=shards.worker_of)
    port = client.submit(_free_port, workers=[workers[0]], pure=False).result()
    host = workers[0].split("://", 1)[-1].rsplit(":", 1)[0]
    init_method = f"tcp://{host}:{port}"
    run_id = uuid.uuid4().hex[:12]
    topic = f"dlrmflow-trainers-{run_id}"
    reports: queue.Queue = queue.Queue()
    client.subscribe_topic(topic, lambda event: reports.put(event[1]))  # (time, message), on the client's loop
    futures = [client.submit(train_rank, setup, rank, size, init_method, shards, topic,
                             workers=[worker], allow_other_workers=False, pure=False, retries=0,
                             key=f"dlrmflow-trainer-{rank}-{run_id}")
               for rank, worker in enumerate(workers)]
    try:
        _watch(client, futures, workers, reports, setup, progress, on_metrics)
        return [future.result() for future in futures]
    finally:
        client.cancel(futures)
        client.unsubscribe_topic(topic)


def _watch(client, futures, workers, reports: queue.Queue, setup, progress, on_metrics) -> None:
    """Until every trainer finished: relay rank 0's reports; raise as soon as a trainer failed or its
    worker is gone (a dead worker's task would wait for it forever: it may run nowhere else)."""
    n, done = setup.iterations, 0

    def relay(report: dict[str, Any]) -> None:
        nonlocal done
        if report["done"] <= done:
            return
        done = report["done"]
        if progress is not None:
            progress(done, n)
        if report["metrics"] is not None and on_metrics is not None:
            on_metrics(report["metrics"])

    while True:
        try:
            relay(reports.get(timeout=WATCH_SECONDS))
            continue
        except queue.Empty:
            pass
        alive = cluster_workers(client)
        for rank, worker in enumerate(workers):
            if worker not in alive:
                raise TrainerLostError(_lost_message(setup, rank, worker, done))
        failed = [f for f in futures if f.status == "error"]
        if failed:
            failed[0].result()  # re-raises the trainer's error
        if all(f.status == "finished" for f in futures):
            # Events and results travel separately: the last reports may still be on their way.
            deadline = time.monotonic() + 5.0
            while done < n and time.monotonic() < deadline:
                try:
                    relay(reports.get(timeout=0.1))
                except queue.Empty:
                    pass
            return


def _lost_message(setup: Any, rank: int, worker: str, done: int) -> str:
    config = setup.config
    return (f"trainer {rank} of {config.trainers} (Dask worker {worker}) died after iteration {done} of "
            f"{setup.iterations}; the run stopped and {config.output_dir} holds no result: run it again")
