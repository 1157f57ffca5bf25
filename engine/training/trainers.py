"""W data-parallel trainers (``--trainers W``): processes on Dask workers, synchronised by torch.distributed.

The driver (:func:`run_trainers`, in the process that holds the Dask client and started the embedding
servers) places one trainer per worker process (:func:`~dlrmflow.engine.serving.placement.place_trainers`),
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
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlrmflow.engine.batches import global_ids
from dlrmflow.engine.coding.erasure import TooManyErasuresError
from dlrmflow.engine.coding.group import CodedShardGroup
from dlrmflow.engine.coding.start import start_coded_shards
from dlrmflow.engine.coding.verify import parity_report
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models import bce_loss, build_model
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.dask_internals import bind_actor
from dlrmflow.engine.serving.placement import WORKER_LOG, place_trainers
from dlrmflow.engine.serving.shards import ShardGroup, start_shards
from dlrmflow.engine.training.checkpoint import (
    CHECKPOINT_FILE,
    Checkpointer,
    config_sha256,
    load_resume_point,
    restore_dense,
    resume_command,
    start_placed_shards,
)
from dlrmflow.engine.training.collectives import TrainerGroup, sum_in_rank_order
from dlrmflow.engine.training.common import TrainLog, collect_state, deterministic_torch, evaluate, make_dense_optimizer
from dlrmflow.engine.training.faults import FaultInjector, kills_since
from dlrmflow.engine.training.prefetch import PrefetchError
from dlrmflow.engine.training.stores_w import BatchSplit, LrppRows, LruRowsW, RemoteRowsW

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


def start_servers(setup: Any, client, rows: np.ndarray | None):
    """Trainer 0's embedding servers, as one trainer's are (:func:`~dlrmflow.engine.training.run.make_store`):
    coded with parity, placed for checkpoints, plain otherwise; from ``rows`` when resuming."""
    config = setup.config
    if config.parity:
        return start_coded_shards(client, setup.spec, config.num_shards, config.parity, rows=rows,
                                  rebuild_chunk=config.rebuild_chunk, parity_batches=config.parity_batches,
                                  rebuild_rate=config.rebuild_rate * 1e6)
    if config.checkpoint_every:
        return start_placed_shards(client, setup.spec, config.num_shards, rows)
    return start_shards(client, setup.spec, config.num_shards)


def share_servers(group: TrainerGroup, shards: ShardGroup | None, spec) -> ShardGroup:
    """Every trainer's handle on trainer 0's servers (a plain group of the same actors). With parity the
    coded group has one client, trainer 0: the others get a group of no actors (they never call one)."""
    handle = [None]
    if group.rank == 0:
        handle = [None if isinstance(shards, CodedShardGroup) else
                  ShardGroup(spec, list(shards.actors), worker_of=list(shards.worker_of))]
    dist.broadcast_object_list(handle, src=0)
    if group.rank == 0:
        return shards
    if handle[0] is None:
        return ShardGroup(spec, [])
    for actor in handle[0].actors:
        bind_actor(actor)  # here, in the task's thread: the prefetch thread cannot
    return handle[0]


def make_trainer_store(setup: Any, device: torch.device, shards: ShardGroup, group: TrainerGroup, *,
                       start: int = 0, rows: np.ndarray | None = None):
    config = setup.config
    gateway = bool(config.parity)
    if config.mode == "remote":
        return RemoteRowsW(setup.spec, device, shards, group, gateway=gateway)
    if config.mode == "lru":
        return LruRowsW(setup.spec, device, shards, group, config.capacity)
    return LrppRows(setup.spec, device, shards, group, setup.plan, setup.iterations, gateway=gateway, start=start,
                    rows=rows)


def trainer_step(t: int, batch, split: BatchSplit, next_union: np.ndarray, model: torch.nn.Module,
                 params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, spec, store,
                 group: TrainerGroup, device: torch.device, clock: dict[str, float]) -> torch.Tensor:
    """One iteration of one trainer (module docstring); returns the trainers' mean loss. Adds to ``clock``
    the seconds of forward and backward (``compute``) and of the dense gradients' gather (``dense_sync``)."""
    rows = batch.labels.shape[0] // group.size
    lo, hi = group.rank * rows, (group.rank + 1) * rows
    dense = torch.tensor(batch.dense[lo:hi], device=device)
    labels = torch.tensor(batch.labels[lo:hi], device=device)
    block = store.gather(t, split)
    start = time.perf_counter()
    weights = block[:, : spec.dim].clone().requires_grad_(True)
    embeddings = weights.index_select(0, torch.from_numpy(split.inverse).to(device))
    loss = bce_loss(model(dense, embeddings.view(rows, -1, spec.dim)), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
    gathered = time.perf_counter()
    parts = group.all_gather_equal(flat, "dense gradients")
    clock["compute"] += gathered - start
    clock["dense_sync"] += time.perf_counter() - gathered
    mean = sum_in_rank_order(parts)
    offset = 0
    for p in params:
        p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    optimizer.step()
    store.update(t, split, next_union, block, weights.grad)
    return mean[-1]


def train_rank(setup: Any, rank: int, size: int, init_method: str, progress_topic: str | None = None
               ) -> dict[str, Any]:
    """One trainer process's whole run (a Dask task). Trainer 0 also owns what one trainer owns: the
    servers (started here, through this worker's client), the kills, the checkpoints, the evaluation and
    the final state, which its result carries; it sends its progress as events on ``progress_topic``."""
    from distributed import get_client, get_worker

    torch.set_num_threads(_worker_threads())
    config, n, lead = setup.config, setup.iterations, rank == 0
    device = torch.device(config.device)
    output = Path(config.output_dir)
    worker = get_worker()
    WORKER_LOG.info("dlrmflow trainer %d of %d: rows %d..%d of every batch of %d, %d threads", rank, size,
                    rank * config.batch_size // size, (rank + 1) * config.batch_size // size - 1, config.batch_size,
                    torch.get_num_threads())
    group = TrainerGroup(rank, size, init_method)
    store = shards = None
    try:
        resumed = load_resume_point(output, config.model_dump(), setup.spec, n) if config.resume else None
        rows = None if resumed is None else resumed.pop("rows").numpy()
        start_at = 0 if resumed is None else int(resumed["iteration"])
        shards = share_servers(group, start_servers(setup, get_client(), rows) if lead else None, setup.spec)
        with deterministic_torch(device):
            model = build_model(setup.model_config, seed=config.seed).to(device)
            optimizer = make_dense_optimizer(config, model)
            log = TrainLog.empty(n)
            if resumed is not None:
                restore_dense(resumed, model, optimizer)
                log = TrainLog.restore(n, resumed["log"], device)
            store = make_trainer_store(setup, device, shards, group, start=start_at, rows=rows)
            del rows
            injector = FaultInjector(setup.kills, get_client(), lambda s: shards.worker_of[s], config.num_shards) \
                if setup.kills and lead else None
            checkpoints = None
            if config.checkpoint_every:
                checkpoints = Checkpointer(output, config.checkpoint_every, None, reload_on_loss=False,
                                           config_sha256=config_sha256(config.model_dump()),
                                           resumed_at=None if resumed is None else start_at)
            clock = _train_loop(setup, group, model, optimizer, store, device, log, injector, checkpoints,
                                worker, progress_topic if lead else None)
            start = time.perf_counter()
            try:
                store.finish()
            except PrefetchError as exc:  # the oracle's worker met the fatal loss first: name the loss
                if isinstance(exc.__cause__, TooManyErasuresError):
                    raise exc.__cause__ from None
                raise
            group.barrier()  # every trainer's rows are home before trainer 0 reads them
            result = {**log.result(), "flush_seconds": time.perf_counter() - start}  # train_seconds counts it
            outcome: dict[str, Any] = {
                "rank": rank, "worker": worker.address, "threads": torch.get_num_threads(), "log": result,
                "sync_seconds": clock.pop("row_sync"), "seconds": clock, "bytes_fetched": int(store.bytes_fetched),
                "bytes_written": int(store.bytes_written), "bytes_to_trainers": dict(group.bytes_sent)}
            if lead:
                outcome["metrics"] = evaluate(setup, model, store, device)
                outcome["state"] = collect_state(setup, model, optimizer, store)
                kills = injector.log if injector else []
                if config.parity:
                    report = parity_report(shards, output if config.save_state else None)
                    outcome["parity"] = {**report, "kills": kills_since(kills, shards.started_at)}
                if checkpoints is not None:
                    outcome["checkpoint"] = {**checkpoints.report, "kills": kills_since(kills, checkpoints.begin)}
                    if resumed is not None:
                        outcome["checkpoint"]["resumed_from"] = start_at
            group.barrier()  # the servers stay up until trainer 0 has read them
        return outcome
    finally:
        if store is not None:
            store.close()
        elif shards is not None:
            shards.close()
        group.close()


def _train_loop(setup, group, model, optimizer, store, device, log: TrainLog, injector, checkpoints, worker,
                topic: str | None) -> dict[str, Any]:
    """Iterations ``log.start .. n-1`` of one trainer. Where its time went: ``row_sync`` per iteration (the
    row gradients' collectives and barriers), and in all: ``compute`` (forward, backward), ``dense_sync``
    (the dense gradients' gather, waiting for the slowest trainer included) and ``batches`` (reading the
    global batch and splitting it)."""
    config, n, offsets = setup.config, setup.iterations, setup.stream.offsets
    params = list(model.parameters())
    sync_seconds = np.zeros(n)
    clock = {"compute": 0.0, "dense_sync": 0.0, "batches": 0.0}
    log.begin = time.perf_counter()
    batches = setup.stream.iter_range(log.start, n)
    batch = next(batches)
    split = BatchSplit.of(log.start, global_ids(batch.sparse, offsets), group.size, group.rank)
    last_report = 0.0
    for t in range(log.start, n):
        if checkpoints is not None and t % config.checkpoint_every == 0 and t != checkpoints.saved_at:
            store.quiesce()
            group.barrier()  # every trainer's writes home and gradients applied: trainer 0 reads one state
            if group.rank == 0:
                checkpoints.before_iteration(t, store, model, optimizer, log)
            else:
                checkpoints.saved_at = t
            group.barrier()  # nobody writes before trainer 0 has read
        if injector is not None:
            injector.before_iteration(t)
        reading = time.perf_counter()
        following = next(batches) if t + 1 < n else None
        next_split = None if following is None else BatchSplit.of(
            t + 1, global_ids(following.sparse, offsets), group.size, group.rank)
        clock["batches"] += time.perf_counter() - reading
        start, stall, sync = time.perf_counter(), store.stall_seconds, store.sync_seconds
        loss = trainer_step(t, batch, split, EMPTY_IDS if next_split is None else next_split.union, model,
                            params, optimizer, setup.spec, store, group, device, clock)
        log.record(t, loss, time.perf_counter() - start, store.stall_seconds - stall)
        sync_seconds[t] = store.sync_seconds - sync
        row = log.metrics_row(t + 1, config.metrics_every, n)
        if topic is not None and (row or time.perf_counter() - last_report > REPORT_SECONDS):
            worker.log_event(topic, {"done": t + 1, "metrics": row})
            last_report = time.perf_counter()
        batch, split = following, next_split
    return {**clock, "row_sync": sync_seconds}


def run_trainers(setup: Any, client, *, progress: Callable[[int, int], None] | None = None,
                 on_metrics: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run ``setup.config.trainers`` trainers on the cluster of ``client``; every trainer's result, in
    rank order (module docstring)."""
    size = setup.config.trainers
    workers = place_trainers(cluster_workers(client), size)
    port = client.submit(_free_port, workers=[workers[0]], pure=False).result()
    host = workers[0].split("://", 1)[-1].rsplit(":", 1)[0]
    init_method = f"tcp://{host}:{port}"
    run_id = uuid.uuid4().hex[:12]
    topic = f"dlrmflow-trainers-{run_id}"
    reports: queue.Queue = queue.Queue()
    client.subscribe_topic(topic, lambda event: reports.put(event[1]))  # (time, message), on the client's loop
    futures = [client.submit(train_rank, setup, rank, size, init_method, topic,
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
    what = (f"trainer {rank} of {config.trainers} (Dask worker {worker}) died after iteration {done} of "
            f"{setup.iterations}")
    if config.checkpoint_every and (Path(config.output_dir) / CHECKPOINT_FILE).exists():
        return f"{what}; continue the run from its last checkpoint with `{resume_command(config.output_dir)}`"
    return f"{what}; the run stopped and {config.output_dir} holds no result: run it again"
