"""Checkpoints: the baseline parity must beat, and what lets a crashed trainer resume.

``--checkpoint-every N`` (modes remote, lru and oracle, with or without ``--parity``): before
iterations ``0, N, 2N, ...`` every embedding shard writes its rows, overlaid with the rows the trainer
holds newer copies of (the pending write-back, the LRU cache, or the oracle's cache once its prefetch
worker is idle, i.e. every eviction before the checkpoint written back), to its own file
``RUN_DIR/checkpoint_rows/<slot>/shard-<k>.npy``, on its worker; then trainer 0 writes
``RUN_DIR/checkpoint.pt`` atomically (temp file + rename) with those files' names and SHA-256s, the
dense parameters, the dense optimizer state, the plan position (the next iteration) and the training
log so far (losses, timings, metrics). No process holds every row. Checkpoints alternate between two
slots (``a``, ``b``): the files of the checkpoint that ``checkpoint.pt`` names stay intact until the
next ``checkpoint.pt`` has replaced it, so a crash at any point leaves one whole checkpoint.
The rows, the traffic and the LRU cache's slots come from the row store's checkpoint view (``held_rows``,
``traffic``, ``cache_state``, ``drop_pending``, ``replace_shards``, ``restart_at``, ``restore_cache``:
:mod:`.stores.base`), the same calls in every mode; a store restarted with the cache it had makes the
uninterrupted run's fetches and write-backs, so a resumed run reports the same traffic totals.
Restoring starts every shard from its own file (it reads it on its worker); the store reads the few
rows it caches from the files too (:class:`~dlrmflow.engine.row_files.ShardedRows`). A checkpoint.pt of
an older version (format 1: every row in the file) is still read.

Two failures use it:

- a lost shard without parity (a call to its actor fails because its worker died): the trainer
  starts K fresh shards from the checkpoint's files, drops its cache, restores the dense state and
  replays the iterations since the checkpoint (:class:`Checkpointer`);
- the trainer itself dies (SIGKILL, a crashed flow-run process): ``dlrmflow resume RUN_DIR``
  starts a new trainer from the checkpoint (with parity, the parity shards are re-encoded from the
  restored data shards, streamed to them).

The oracle's cache is not in the file: at plan position ``t`` the plan alone says which ids are
cached in which slots (replay its prefetches and evictions of ``0 .. t-1``), and the file holds
their values; the prefetch worker then starts at ``t``.

Training is deterministic, so a replay or a resume recomputes the same bits: the run ends
bit-identical to a failure-free one.

A checkpointed run directory::

    run_config.json   written before any work: the TrainConfig, the dataset and plan fingerprints
    UNFINISHED        the run has not finished: removed once summary.json is written
    checkpoint.pt     the last checkpoint (all but the rows; it names its rows files)
    checkpoint_rows/a/, checkpoint_rows/b/   shard-<k>.npy: the rows of the last two checkpoints
    final_state/, summary.json, iterations.csv   as for every run (:mod:`dlrmflow.engine.run_state`)

``dlrmflow train`` refuses an ``--output`` holding an unfinished run with a checkpoint (and names
the ``dlrmflow resume`` command); a resume refuses a run without a checkpoint, a finished run, a
changed dataset or plan, and a configuration other than the one the run started with.
Design notes: docs/checkpoint-resume.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import socket
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from distributed import Client

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.row_files import ShardedRows, as_sharded
from dlrmflow.engine.run_state import ITERATIONS_FILE, PARITY_FILE, STATE_DIR, STATE_FILE, SUMMARY_FILE
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.shards import (
    EmbeddingShard,
    ShardGroup,
    answer,
    is_lost_actor_error,
    remote,
    start_placed_actors,
    wait_all,
)
from dlrmflow.engine.training.prefetch import PrefetchError
from dlrmflow.engine.training.run_dir import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT_VERSION,
    RUN_CONFIG_FILE,
    UNFINISHED_FILE,
    ResumeError,
    check_unfinished,
    read_run_config,
)
from dlrmflow.engine.training.stores.base import ShardRows

CHECKPOINT_ROWS_DIR = "checkpoint_rows"
CHECKPOINT_SLOTS = ("a", "b")  # the rows of a checkpoint go to the slot the current checkpoint.pt does not name
CHECKPOINT_MODES = ("remote", "lru", "oracle")
CHECKPOINT_FILE_VERSION = 2  # checkpoint.pt's: 2 names per-shard rows files; 1 (still read) held every row
# Everything a run writes into its directory before summary.json (the leftovers of a run that stopped).
RUN_FILES = frozenset({STATE_DIR, STATE_FILE, ITERATIONS_FILE, PARITY_FILE, CHECKPOINT_FILE, CHECKPOINT_ROWS_DIR,
                       RUN_CONFIG_FILE, UNFINISHED_FILE})
# Not part of a run's identity: where its directory is now, the resume flag itself, and where the
# data and plan lie (their fingerprints say whether they are the same).
NOT_COMPARED = ("output_dir", "resume", "dataset_dir", "plan_dir")


# ---- shards started from a checkpoint's rows --------------------------------------------------------


class RestoredShard(EmbeddingShard):
    """An embedding shard that starts from a checkpoint's rows instead of the initial ones: created
    empty, then it reads its own rows file (:meth:`~dlrmflow.engine.serving.shards.EmbeddingShard.load_rows`)
    or, from an older checkpoint that held every row, :meth:`restore` receives its rows in an actor
    call, straight from the trainer to the worker (as task arguments they would travel inside the
    graph, via the scheduler)."""

    def __init__(self, spec: RowSpec, shard: int, num_shards: int) -> None:
        super().__init__(spec, shard, num_shards, initialise=False)

    def restore(self, rows: np.ndarray) -> int:
        """All of this shard's rows, copied as bytes."""
        if rows.shape != self.rows.shape or rows.dtype != np.float32:
            raise ValueError(f"shard {self.shard} holds float32 rows of shape {self.rows.shape}, "
                             f"got {rows.dtype} {rows.shape}")
        self.rows.view(np.uint8)[:] = np.ascontiguousarray(rows).view(np.uint8)
        return len(rows)


def start_placed_shards(client: Client, spec: RowSpec, k: int, rows: np.ndarray | ShardedRows | None = None, *,
                        avoid: Collection[str] | None = None) -> ShardGroup:
    """K shards placed like every group's (:func:`~dlrmflow.engine.serving.placement.place`), remembering where
    each is (``worker_of``). At a run's start every worker is warmed up (spares included: a restore
    may use them); a restore passes ``avoid``.

    After a loss the scheduler may list the dead worker for a while: a shard placed there would
    wait for it forever, and a broadcast to it fails or waits out Dask's connect timeout. So a
    restore places away from ``avoid`` (the workers of the shards that stopped answering) and warms
    up only the workers it chose (:func:`~dlrmflow.engine.serving.shards.start_placed_actors`, which also
    places again without a chosen worker that leaves before its shard started)."""
    shard_class = EmbeddingShard if rows is None else RestoredShard
    placement, futures, actors = start_placed_actors(
        client, k, lambda i, w: client.submit(shard_class, spec, i, k, actor=True, workers=[w], pure=False),
        "an embedding server", avoid=avoid)
    group = ShardGroup(spec, actors, futures, worker_of=list(placement.workers))
    rows = as_sharded(rows)
    if rows is not None and rows.files is not None and rows.num_shards == k:
        group.load_rows(rows.files)  # each shard reads its own file
    elif rows is not None:
        for call in [actor.restore(rows.local_rows(i, k)) for i, actor in enumerate(group.actors)]:
            answer(call)
    return group


def workers_not_answering(group: ShardGroup) -> set[str]:
    """The workers of ``group``'s shards whose actors are lost (a call fails as a lost worker's does)."""
    _, error = wait_all([(i, remote(actor, "stats")) for i, actor in enumerate(group.actors)])
    return set() if error is None else {group.worker_of[i] for i in error.members}


def is_lost_shard(exc: BaseException) -> bool:
    """A failed call to an actor whose worker died (also when the oracle's prefetch worker made it)."""
    if isinstance(exc, PrefetchError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return is_lost_actor_error(exc)


# ---- the checkpoint file ----------------------------------------------------------------------------


def rows_slot(path: Path) -> str:
    """The slot of ``checkpoint_rows/`` the next checkpoint writes its rows to: the one the checkpoint
    at ``path`` does not name."""
    current = None
    try:
        current = (load_checkpoint(path, mmap=True).get("rows_files") or {}).get("dir")
    except (FileNotFoundError, ResumeError):
        pass
    first, second = CHECKPOINT_SLOTS
    return second if current == f"{CHECKPOINT_ROWS_DIR}/{first}" else first


def save_checkpoint(path: Path, t: int, store: ShardRows, model: torch.nn.Module, optimizer, log=None,
                    config_sha256: str | None = None) -> dict[str, Any]:
    """Write the checkpoint taken before iteration ``t``: every shard writes its rows overlaid with the
    store's held rows (its checkpoint view, :mod:`.stores.base`) to its own file in the free slot, then
    ``path`` (checkpoint.pt) names them, with the store's traffic, the dense state and the training log."""
    start = time.perf_counter()
    path = Path(path)
    relative = f"{CHECKPOINT_ROWS_DIR}/{rows_slot(path)}"
    directory = path.parent.resolve() / relative
    shutil.rmtree(directory, ignore_errors=True)  # an older checkpoint's: checkpoint.pt names the other slot
    directory.mkdir(parents=True)
    files = store.shards.save_rows(directory, store.held_rows())
    state = {"format_version": CHECKPOINT_FILE_VERSION, "iteration": t, "config_sha256": config_sha256,
             "rows_files": {"dir": relative, "total_rows": store.spec.total_rows, "width": store.spec.width,
                            "num_shards": len(files), "files": files},
             "dense": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
             "dense_optimizer": optimizer.state_dict(), "traffic": store.traffic(),
             "cache": _as_tensors(store.cache_state()), "log": None if log is None else log.snapshot(t)}
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return {"iteration": t, "seconds": time.perf_counter() - start,
            "bytes": path.stat().st_size + sum(int(f["bytes"]) for f in files)}


def _as_tensors(arrays: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor] | None:
    """numpy arrays as tensors: ``torch.load(weights_only=True)`` reads tensors, not arrays."""
    return None if arrays is None else {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def cache_of(state: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """A loaded checkpoint's cache state (:meth:`~.stores.base.RowStore.cache_state`); None if it has none."""
    cache = state.get("cache")
    return None if cache is None else {k: v.numpy() for k, v in cache.items()}


def load_checkpoint(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """checkpoint.pt as saved (its rows, format 2, are only named: :func:`checkpoint_rows` reads them)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise ResumeError(f"{path} cannot be read as a checkpoint ({exc}); delete it to start the run over") from exc


def checkpoint_rows(path: Path, state: dict[str, Any]) -> ShardedRows:
    """The rows of the checkpoint ``state`` loaded from ``path``: a view of its shard files (memory-mapped:
    a shard started from it reads its own file, a store reads the rows it caches), or of the rows an
    older checkpoint holds."""
    if "rows_files" not in state:  # format 1: every row in checkpoint.pt
        return ShardedRows.from_array(state["rows"].numpy(), 1)
    info = state["rows_files"]
    try:
        return ShardedRows.from_files(Path(path).parent / info["dir"], info["files"], info["total_rows"],
                                      info["width"])
    except (OSError, ValueError) as exc:
        raise ResumeError(f"the rows files of {path} ({info['dir']}/) cannot be read ({exc}); delete "
                          f"{Path(path).name} to start the run over") from exc


def checkpoint_iteration(path: Path) -> int | None:
    """The iteration a checkpoint file resumes at (memory-mapped: the rows are not read); None if absent."""
    try:
        return int(load_checkpoint(path, mmap=True)["iteration"])
    except FileNotFoundError:
        return None


def restore_dense(state: dict[str, Any], model: torch.nn.Module, optimizer) -> None:
    model.load_state_dict(state["dense"])
    optimizer.load_state_dict(state["dense_optimizer"])


def restore_checkpoint(path: Path, client: Client, store: ShardRows, model: torch.nn.Module, optimizer) -> int:
    """Reload ``path`` into fresh shards, the store (restarted at the checkpoint's iteration, what it
    held dropped) and the dense model; the iteration to replay from."""
    state = load_checkpoint(path)
    t, rows = int(state["iteration"]), checkpoint_rows(path, state)
    store.drop_pending()  # also stops background traffic (the oracle's worker) before the old shards go away
    restored = start_placed_shards(client, store.spec, store.shards.num_shards, rows,
                                   avoid=workers_not_answering(store.shards))
    store.replace_shards(restored).close()  # the survivors hold newer rows than the checkpoint: drop them
    store.restart_at(t, rows)
    store.restore_cache(cache_of(state), rows)
    restore_dense(state, model, optimizer)
    return t


class Checkpointer:
    """The training loop's checkpoint hook: save before iterations 0, N, 2N, ...; on a lost shard
    (without parity) reload the last checkpoint and tell the loop where to replay from."""

    def __init__(self, run_dir: str | os.PathLike, every: int, client: Client | None, *, config_sha256: str,
                 reload_on_loss: bool = True, resumed_at: int | None = None) -> None:
        self.path = Path(run_dir) / CHECKPOINT_FILE
        self.every, self.client, self.config_sha256 = every, client, config_sha256
        self.reload_on_loss = reload_on_loss
        self.saved_at = -1 if resumed_at is None else resumed_at  # the file already holds that iteration
        self.begin = time.perf_counter()
        self.report: dict[str, Any] = {"every": every, "file": str(self.path), "rows_dir": str(self.path.parent /
                                       CHECKPOINT_ROWS_DIR), "checkpoints": [], "recoveries": [],
                                       "clock_origin": self.begin}  # perf_counter() that detected_s counts from
        self._replaying: dict[str, Any] | None = None

    def before_iteration(self, t: int, store, model, optimizer, log, group) -> None:
        """Before iterations 0, N, 2N, ...: every trainer's writes home and gradients applied (the store
        quiesced, a barrier), trainer 0 writes the one checkpoint, and nobody writes before it has read."""
        if t % self.every or t == self.saved_at:
            return
        store.quiesce()
        group.barrier()
        if group.rank == 0:
            self.report["checkpoints"].append(
                save_checkpoint(self.path, t, store, model, optimizer, log, self.config_sha256))
        self.saved_at = t
        group.barrier()

    def before_finish(self, store) -> None:
        """The last write-backs, inside the loop: a loss noticed here is replayed like any other."""
        store.finish()
        store.shards.stats()  # touch every shard: a loss not yet noticed is noticed here

    def can_recover(self, exc: BaseException) -> bool:
        return self.reload_on_loss and is_lost_shard(exc)

    def recover(self, t: int, store, model, optimizer) -> int:
        detected = time.perf_counter()
        replay_from = restore_checkpoint(self.path, self.client, store, model, optimizer)
        self._replaying = {"failed_at": t, "replay_from": replay_from, "detected_s": detected - self.begin,
                           "reload_seconds": time.perf_counter() - detected, "_detected": detected}
        self.report["recoveries"].append(self._replaying)
        return replay_from

    def after_iteration(self, t: int) -> None:
        if self._replaying is not None and t >= self._replaying["failed_at"]:
            # the recovery's time: from detection until the replay caught up with the failed iteration
            self._replaying["seconds"] = time.perf_counter() - self._replaying.pop("_detected")
            self._replaying = None


# ---- the run directory ------------------------------------------------------------------------------


def resume_command(run_dir: str | os.PathLike) -> str:
    return f"dlrmflow resume {shlex.quote(str(run_dir))}"


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a TrainConfig (as a dict) that a resumed run must share with its start, as JSON."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in NOT_COMPARED}))


def config_sha256(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(comparable_config(config), sort_keys=True).encode()).hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def start_run_dir(run_dir: str | os.PathLike, config: dict[str, Any], *, dataset_fingerprint: str,
                  plan_fingerprint: str | None, iterations: int) -> None:
    """Before any work of a fresh checkpointed run: its configuration, then the unfinished marker."""
    run_dir = Path(run_dir)
    (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)  # an earlier finished run's: not this run's state
    shutil.rmtree(run_dir / CHECKPOINT_ROWS_DIR, ignore_errors=True)
    saved = {k: v for k, v in config.items() if k not in ("output_dir", "resume")}
    for key in ("dataset_dir", "plan_dir"):  # a resume from another working directory finds them
        if saved.get(key):
            saved[key] = str(Path(saved[key]).resolve())
    _write_json(run_dir / RUN_CONFIG_FILE, {
        "format_version": CHECKPOINT_FORMAT_VERSION, "config": json.loads(json.dumps(saved)),
        "config_sha256": config_sha256(config), "dataset_fingerprint": dataset_fingerprint,
        "plan_fingerprint": plan_fingerprint, "iterations": iterations,
    })
    _write_json(run_dir / UNFINISHED_FILE, {"pid": os.getpid(), "host": socket.gethostname(),
                                            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def finish_run_dir(run_dir: str | os.PathLike) -> None:
    """After summary.json is written: the run is finished."""
    (Path(run_dir) / UNFINISHED_FILE).unlink(missing_ok=True)


def unfinished_run_message(run_dir: str | os.PathLike | None) -> str | None:
    """``RUN_DIR holds an unfinished run (checkpoint at iteration t of n): resume it with ...``, or
    None when ``run_dir`` holds no unfinished run with a checkpoint."""
    if not run_dir:
        return None
    run_dir = Path(run_dir)
    if not (run_dir / UNFINISHED_FILE).is_file():
        return None
    t = checkpoint_iteration(run_dir / CHECKPOINT_FILE)
    if t is None:
        return None  # stopped before its first checkpoint: nothing to lose, nothing to resume
    try:
        n = read_run_config(run_dir)["iterations"]
    except (ResumeError, KeyError):
        n = "?"
    return (f"{run_dir} holds an unfinished run (checkpoint at iteration {t} of {n}): resume it with "
            f"`{resume_command(run_dir)}`")


def refuse_unfinished_run(run_dir: str | os.PathLike) -> None:
    """A new run must not overwrite an unfinished one that can be resumed."""
    message = unfinished_run_message(run_dir)
    if message:
        raise ResumeError(f"{message}, or choose another --output")


def refuse_to_overwrite(run_dir: str | os.PathLike) -> None:
    """A new run (``dlrmflow train``, not a resume) writes only into a directory that is missing, empty,
    or holds the leftovers of a run that stopped before it finished: never over a finished run
    (``summary.json``) nor into a directory holding anything a run does not write. An unfinished run
    with a checkpoint is refused by :func:`refuse_unfinished_run`."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UserInputError(f"--output {run_dir} is a file, not a run directory")
    if (run_dir / SUMMARY_FILE).is_file():
        raise UserInputError(f"{run_dir} holds a finished run ({SUMMARY_FILE} is written); refusing to write over "
                             f"it: choose another --output, or delete {run_dir} to train it again")
    foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_FILES and not p.name.endswith(".tmp"))
    if foreign:
        raise UserInputError(f"--output {run_dir} exists and is not a dlrmflow run directory (it holds "
                             f"{foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); "
                             "refusing to write into it: choose another --output")


def check_resumable(run_dir: str | os.PathLike, config: dict[str, Any], *, dataset_fingerprint: str,
                    plan_fingerprint: str | None, iterations: int) -> int:
    """Every reason not to resume ``run_dir`` with ``config`` (ResumeError); the checkpoint's iteration."""
    run_dir = Path(run_dir)
    info = check_unfinished(run_dir)  # what the CLI's check already refused, for callers without it
    if info["dataset_fingerprint"] != dataset_fingerprint:
        raise ResumeError(
            f"the dataset changed since {run_dir} started (fingerprint {info['dataset_fingerprint'][:12]}…, now "
            f"{dataset_fingerprint[:12]}…): a resumed run would not be the run that started; start a new one "
            "with `dlrmflow train`")
    if info["plan_fingerprint"] != plan_fingerprint:
        raise ResumeError(
            f"the plan changed since {run_dir} started (fingerprint {str(info['plan_fingerprint'])[:12]}…, now "
            f"{str(plan_fingerprint)[:12]}…): start a new run with `dlrmflow train`")
    saved, now = info["config"], comparable_config(config)
    differ = [k for k in sorted(set(saved) | set(now)) if k not in NOT_COMPARED and saved.get(k) != now.get(k)]
    if differ:
        what = ", ".join(f"{k} {saved.get(k)!r} (now {now.get(k)!r})" for k in differ)
        raise ResumeError(f"{run_dir} was started with another configuration: {what}; resume it as it started "
                          f"with `{resume_command(run_dir)}`, or start a new run")
    if info["iterations"] != iterations:
        raise ResumeError(f"{run_dir} was started for {info['iterations']} iterations, not {iterations}")
    t = checkpoint_iteration(run_dir / CHECKPOINT_FILE)
    if t is None:
        raise ResumeError(f"{run_dir} has no {CHECKPOINT_FILE}: the run stopped before its first checkpoint; "
                          "start it again with `dlrmflow train`")
    return t


def load_resume_point(run_dir: str | os.PathLike, config: dict[str, Any], spec: RowSpec,
                      iterations: int) -> dict[str, Any]:
    """The checkpoint a resume starts from, checked against the run it belongs to; its ``rows`` a
    :class:`~dlrmflow.engine.row_files.ShardedRows` view (:func:`checkpoint_rows`)."""
    path = Path(run_dir) / CHECKPOINT_FILE
    state = load_checkpoint(path)
    if state.get("config_sha256") != config_sha256(config) or state.get("log") is None:
        raise ResumeError(f"{path} does not belong to the run in {run_dir} (another configuration); "
                          "start a new run with `dlrmflow train`")
    rows = checkpoint_rows(path, state)
    if rows.shape != (spec.total_rows, spec.width) or not 0 <= state["iteration"] < iterations:
        raise ResumeError(f"{path} does not fit the run: rows {rows.shape}, iteration "
                          f"{state['iteration']} of {iterations}")
    state["rows"] = rows
    return state
