"""One trainer's whole run, rank ``r`` of a group of W (W = 1: the only trainer, in the caller's process).

Trainer 0 also owns what one trainer owns: the embedding servers (started through the run's client: plain,
placed for checkpoints, or coded with parity), the kills, the checkpoints, the evaluation and the final
state, which the servers write to the run directory, each its own rows (:mod:`.final_state`); its result
carries the state SHA-256. The other trainers get a handle on trainer 0's servers.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from dlrmflow.engine.coding.erasure import TooManyErasuresError
from dlrmflow.engine.coding.group import CodedShardGroup
from dlrmflow.engine.coding.members import member_name
from dlrmflow.engine.coding.start import start_coded_shards
from dlrmflow.engine.coding.verify import parity_report
from dlrmflow.engine.models import build_model
from dlrmflow.engine.phases import phase_reported
from dlrmflow.engine.row_files import ShardedRows
from dlrmflow.engine.serving.cluster import SCHEDULER_SILENCE_SECONDS, cluster_workers
from dlrmflow.engine.serving.dask_internals import bind_actor
from dlrmflow.engine.serving.placement import host_of, where_placed
from dlrmflow.engine.serving.shards import ShardGroup, start_shards
from dlrmflow.engine.training import loop
from dlrmflow.engine.training.checkpoint import Checkpointer
from dlrmflow.engine.training.checkpoint_format import cache_of, load_resume_point, restore_dense
from dlrmflow.engine.training.cluster_scoring import final_evaluation, periodic_evaluation
from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.dense import collect_state, deterministic_torch, make_dense_optimizer, start_from_run
from dlrmflow.engine.training.faults import FaultInjector, kills_since
from dlrmflow.engine.training.final_state import seal_final_state, write_final_state
from dlrmflow.engine.training.loop import LoopHooks, Report
from dlrmflow.engine.training.modes import MODES
from dlrmflow.engine.training.prefetch import PrefetchError
from dlrmflow.engine.training.run_context import RunContext
from dlrmflow.engine.training.run_directory import config_sha256
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.shard_restore import start_placed_shards
from dlrmflow.engine.training.timing import timed
from dlrmflow.engine.training.train_log import TrainLog

EVENTS = logging.getLogger(__name__)  # a dlrmflow.engine logger: the run's log and the CLI's stderr show it


def start_servers(setup: RunSetup, context: RunContext, rows: ShardedRows | None) -> ShardGroup | None:
    """Trainer 0's embedding servers (None for a mode without servers), started through ``context.client``:
    coded with parity (its rebuilds run by ``context.recovery_runner``), placed for checkpoints, plain
    otherwise; from ``rows`` (a checkpoint's: each shard reads its own file) when resuming."""
    config = setup.config
    if not MODES[config.mode].servers:
        return None
    if context.client is None:
        raise ValueError(f"--mode {config.mode} needs a Dask client to host the embedding servers")
    with phase_reported(f"embedding servers: initialising {config.num_shards} shards"
                        f"{f' and {config.parity} parity shards' if config.parity else ''}"):
        shards = _start_servers(setup, context, rows)
    EVENTS.info("embedding servers on %s", where_placed(server_names(config.num_shards, config.parity),
                                                         shards.worker_of, cluster_workers(context.client)))
    return shards


def peak_rss_bytes() -> int:
    """The most memory this process has held resident so far (the kernel's ru_maxrss): on a trainer's own Dask
    worker (``--trainers W``), what that trainer needed; alone, it includes whatever else the command's
    process holds (its LocalCluster's scheduler)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def server_names(k: int, r: int) -> list[str]:
    """The members of a group of ``k`` data shards and ``r`` parity shards, as the run's reports name them."""
    return [member_name(s, k) for s in range(k + r)]


def server_hosts(shards: ShardGroup | None, k: int, r: int, client: Any) -> list[dict[str, str]] | None:
    """For the run's summary: each member's worker and host at the end of the run (after any rebuild, the
    replacement's)."""
    if shards is None or not shards.worker_of:
        return None
    info = cluster_workers(client, timeout=SCHEDULER_SILENCE_SECONDS)  # a lost scheduler: the run's end says so
    return [{"member": name, "worker": worker, "host": host_of(worker, info)}
            for name, worker in zip(server_names(k, r), shards.worker_of, strict=True)]


def _start_servers(setup: RunSetup, context: RunContext, rows: ShardedRows | None) -> ShardGroup:
    config, client = setup.config, context.client
    if config.parity:
        return start_coded_shards(client, setup.spec, config.num_shards, config.parity, rows=rows,
                                  rebuild_chunk=config.rebuild_chunk, parity_batches=config.parity_batches,
                                  rebuild_rate=config.rebuild_rate * 1e6, recovery_runner=context.recovery_runner)
    if config.checkpoint_every:
        return start_placed_shards(client, setup.spec, config.num_shards, rows)
    return start_shards(client, setup.spec, config.num_shards)


# torch.use_deterministic_algorithms (every run's deterministic_torch) first imports torch's compiler settings,
# which pull in torch._dynamo and torch._inductor: 2-7 s on 2 busy cores, between the servers' start and the
# first iteration. (Importing it in a thread while the servers start saved 2.8 s there, but not beyond the
# noise of startup_seconds on 2 cores: benchmarks/RESULTS.md.)
DETERMINISTIC_IMPORT = "torch._inductor.config"


def share_servers(group: TrainerGroup, shards: ShardGroup | None, spec) -> ShardGroup | None:
    """Every trainer's handle on trainer 0's servers (a plain group of the same actors). With parity the
    coded group has one client, trainer 0: the others get a group of no actors (they never call one)."""
    if group.size == 1:
        return shards
    handle = None
    if group.rank == 0 and not isinstance(shards, CodedShardGroup):
        handle = ShardGroup(spec, list(shards.actors), worker_of=list(shards.worker_of))
    handle = group.broadcast_object(handle)
    if group.rank == 0:
        return shards
    if handle is None:
        return ShardGroup(spec, [])
    for actor in handle.actors:
        bind_actor(actor)  # here, in the task's thread: the prefetch thread cannot
    return handle


def train_rank(setup: RunSetup, group: TrainerGroup, context: RunContext, *, report: Report | None = None,
               worker: str | None = None, device: torch.device | None = None) -> dict[str, Any]:
    """This trainer's run: the loop (:mod:`.loop`) between setting up and recording. ``context.client``: the
    Dask client trainer 0 starts the servers (:func:`start_servers`, which reads ``context``) and injects
    kills through, and every trainer takes checkpoints through; ``report``: trainer 0's progress;
    ``device``: this trainer's (default: the configured one)."""
    config, n, lead = setup.config, setup.iterations, group.rank == 0
    device = torch.device(config.device) if device is None else device
    output = Path(config.output_dir)
    store = shards = None
    try:
        resumed = load_resume_point(output, config.model_dump(), setup.spec, n) if config.resume else None
        rows = None if resumed is None else resumed.pop("rows")  # a view of the checkpoint's shard files
        start_at = 0 if resumed is None else int(resumed["iteration"])
        shards = share_servers(group, start_servers(setup, context, rows) if lead else None,
                               setup.spec)
        if DETERMINISTIC_IMPORT not in sys.modules:  # the first run in this process: seconds, said
            with phase_reported("trainer: importing torch's compiler settings (deterministic algorithms)"):
                importlib.import_module(DETERMINISTIC_IMPORT)
        with deterministic_torch(device):
            model = build_model(setup.model_config, seed=config.seed).to(device)
            optimizer = make_dense_optimizer(config, model)
            log = TrainLog.empty(n)
            if setup.init_from is not None:  # its rows come with the spec (spec.start); a resume's override both
                start_from_run(setup, model, optimizer)
            if resumed is not None:
                restore_dense(resumed, model, optimizer)
                log = TrainLog.restore(n, resumed["log"], device)
            store = MODES[config.mode].make_store(setup, device, shards, group, start=start_at, rows=rows)
            if resumed is not None:
                store.resume_from(resumed["traffic"], cache_of(resumed), rows)
            del rows
            hooks = LoopHooks(report=report if lead else None)
            if config.eval_every and lead:
                hooks.evaluate = lambda t: periodic_evaluation(setup, model, store, device, context.client)
            if setup.kills and lead:
                hooks.injector = FaultInjector(setup.kills, context.client, lambda s: store.shards.worker_of[s],
                                               config.num_shards)
            if config.checkpoint_every:
                hooks.checkpoints = Checkpointer(output, config.checkpoint_every, context.client,
                                                 config_sha256=config_sha256(config.model_dump()),
                                                 reload_on_loss=not config.parity and group.size == 1,
                                                 resumed_at=None if resumed is None else start_at)
            began_at = time.time()  # the first iteration starts (summary.json's startup_seconds)
            clock = loop.train_iterations(setup, group, model, optimizer, store, device, log, hooks)
            ended_at, start = time.time(), time.perf_counter()
            try:
                store.finish()
            except PrefetchError as exc:  # the oracle's worker met the fatal loss first: name the loss
                if isinstance(exc.__cause__, TooManyErasuresError):
                    raise exc.__cause__ from None
                raise
            group.barrier()  # every trainer's rows are home before trainer 0 reads them
            outcome: dict[str, Any] = {
                "rank": group.rank, "worker": worker, "device": str(device), "threads": torch.get_num_threads(),
                "log": {**log.result(), "flush_seconds": time.perf_counter() - start},  # train_seconds counts it
                "sync_seconds": clock.pop("row_sync"), "seconds": clock, "bytes_fetched": int(store.bytes_fetched),
                "bytes_written": int(store.bytes_written), "bytes_to_trainers": dict(group.bytes_sent),
                "bytes_from_trainers": int(sum(group.bytes_received.values())),
                "peak_cached_rows": int(store.peak_cached_rows), "peak_rss_bytes": peak_rss_bytes(),
                "began_at": began_at, "ended_at": ended_at}
            if lead:
                outcome["servers"] = server_hosts(getattr(store, "shards", None), config.num_shards, config.parity,
                                                  context.client)
                finish = outcome["finish"] = {}
                with timed(finish, "state"), phase_reported("final state: the servers write their rows"):
                    if setup.whole_state:  # tests: the whole state gathered here, besides the shards' files
                        outcome["whole_state"] = collect_state(setup, model, optimizer, store)
                    outcome["state"] = write_final_state(setup, model, optimizer, store,
                                                         output if config.save_state else None)
                # After the final state: the cluster's workers score the held-out rows from its staged files.
                # A run with no rows held out evaluates nothing: no phase to report.
                with timed(finish, "evaluation"), (phase_reported("final evaluation")
                                                   if setup.eval_start < setup.meta.rows else nullcontext()):
                    outcome["metrics"] = final_evaluation(setup, model, store, device, context.client,
                                                          outcome["state"])
                kills = hooks.injector.log if hooks.injector else []
                parity_files = None
                if config.parity:
                    with timed(finish, "parity_verify"), phase_reported("parity verify"):
                        staged = outcome["state"]["staged"]
                        report_ = parity_report(store.shards, staged)
                        parity_files = report_.pop("files", None)
                    outcome["parity"] = {**report_, "kills": kills_since(kills, store.shards.started_at)}
                    if hooks.injector and hooks.injector.missed:  # kills that came while their shard had no worker
                        outcome["parity"]["missed_kills"] = kills_since(hooks.injector.missed,
                                                                        store.shards.started_at)
                seal_final_state(outcome["state"], parity_files)
                if hooks.checkpoints is not None:
                    outcome["checkpoint"] = {**hooks.checkpoints.report,
                                             "kills": kills_since(kills, hooks.checkpoints.begin)}
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
