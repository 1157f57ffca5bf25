"""The checkpoint on disk: ``checkpoint.pt`` and the rows files it names, written and read.

Before iteration ``t`` every embedding shard writes its rows, overlaid with the rows the store holds
newer copies of (its checkpoint view, :class:`CheckpointedStore`), to its own file
``RUN_DIR/checkpoint_rows/<slot>/shard-<k>.npy``, on its worker; then trainer 0 writes
``RUN_DIR/checkpoint.pt`` atomically (temp file + rename) with those files' names and SHA-256s, the dense
parameters, the dense optimizer state, the plan position (the next iteration), the store's traffic and
cache slots, and the training log so far. No process holds every row. Checkpoints alternate between two
slots (``a``, ``b``): the files of the checkpoint that ``checkpoint.pt`` names stay intact until the next
``checkpoint.pt`` has replaced it, so a crash at any point leaves one whole checkpoint.

This module imports neither Dask nor the row stores (it types a store by :class:`CheckpointedStore`):
``prepare_run`` reads a checkpoint's iteration through it, and the stores import ``prepare_run``'s module.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dlrmflow.engine.row_files import ShardedRows
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.training.run_directory import CHECKPOINT_FILE, CHECKPOINT_ROWS_DIR, ResumeError, config_sha256

if TYPE_CHECKING:
    from dlrmflow.engine.serving.shards import ShardGroup
    from dlrmflow.engine.training.train_log import TrainLog

CHECKPOINT_SLOTS = ("a", "b")  # the rows of a checkpoint go to the slot the current checkpoint.pt does not name
CHECKPOINT_FILE_VERSION = 2  # checkpoint.pt's layout: the rows are in per-shard files it names


class CheckpointedStore(Protocol):
    """What the checkpoint code asks of a row store: its checkpoint view (:mod:`.stores.base`), the same
    calls in every mode with embedding servers."""

    spec: RowSpec

    @property
    def shards(self) -> ShardGroup: ...

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]: ...

    def traffic(self) -> dict[str, int]: ...

    def cache_state(self) -> dict[str, np.ndarray] | None: ...

    def quiesce(self) -> None: ...

    def finish(self) -> None: ...

    def drop_pending(self) -> None: ...

    def replace_shards(self, shards: ShardGroup) -> ShardGroup: ...

    def restart_at(self, t: int, rows: ShardedRows) -> None: ...

    def restore_cache(self, state: dict[str, np.ndarray] | None, rows: ShardedRows) -> None: ...


def rows_slot(path: Path) -> str:
    """The slot of ``checkpoint_rows/`` the next checkpoint writes its rows to: the one the checkpoint
    at ``path`` does not name."""
    current = None
    try:
        current = load_checkpoint(path, mmap=True)["rows_files"]["dir"]
    except (FileNotFoundError, ResumeError):
        pass
    first, second = CHECKPOINT_SLOTS
    return second if current == f"{CHECKPOINT_ROWS_DIR}/{first}" else first


def save_checkpoint(path: Path, t: int, store: CheckpointedStore, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, log: TrainLog | None = None,
                    config_sha256: str | None = None) -> dict[str, Any]:
    """Write the checkpoint taken before iteration ``t``: every shard writes its rows overlaid with the
    store's held rows to its own file in the free slot, then ``path`` (checkpoint.pt) names them, with the
    store's traffic, the dense state and the training log. What it cost: seconds and bytes."""
    start = time.perf_counter()
    path = Path(path)
    relative = f"{CHECKPOINT_ROWS_DIR}/{rows_slot(path)}"
    directory = path.parent.resolve() / relative
    shutil.rmtree(directory, ignore_errors=True)  # the checkpoint before last's: checkpoint.pt names the other slot
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
    cache = state["cache"]
    return None if cache is None else {k: v.numpy() for k, v in cache.items()}


def load_checkpoint(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """checkpoint.pt as saved (its rows are only named: :func:`checkpoint_rows` reads them); ResumeError
    for a file that is not a checkpoint of this format."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise ResumeError(f"{path} cannot be read as a checkpoint ({exc}); delete it to start the run over") from exc
    version = state.get("format_version") if isinstance(state, dict) else None
    if version != CHECKPOINT_FILE_VERSION:
        raise ResumeError(f"{path} has format_version {version!r}, this version reads {CHECKPOINT_FILE_VERSION}; "
                          "delete it to start the run over")
    return state


def checkpoint_rows(path: Path, state: dict[str, Any]) -> ShardedRows:
    """The rows of the checkpoint ``state`` loaded from ``path``: a view of its shard files, memory-mapped (a
    shard started from it reads its own file, a store reads the rows it caches)."""
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


def restore_dense(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The dense parameters and the dense optimizer's state of a loaded checkpoint, into ``model`` and
    ``optimizer``."""
    model.load_state_dict(state["dense"])
    optimizer.load_state_dict(state["dense_optimizer"])


def check_row_layout(path: Path, state: dict[str, Any], spec: RowSpec) -> None:
    """ResumeError when the rows of the checkpoint ``state`` (loaded from ``path``) are not as wide as ``spec``
    lays a row out: a checkpoint written by a dlrmflow with another row layout (its optimizer state)."""
    width = int(state["rows_files"]["width"])
    if width != spec.width:
        raise ResumeError(f"{path} holds rows of {width} values, this version lays the run's rows out in "
                          f"{spec.width} ({spec.describe_layout()}): the checkpoint was written by a dlrmflow "
                          "with another row layout; resume it with that version, or start the run over with "
                          "`dlrmflow train`")


def load_resume_point(run_dir: str | os.PathLike, config: dict[str, Any], spec: RowSpec,
                      iterations: int) -> dict[str, Any]:
    """The checkpoint a resume starts from, checked against the run it belongs to; its ``rows`` a
    :class:`~dlrmflow.engine.row_files.ShardedRows` view (:func:`checkpoint_rows`)."""
    path = Path(run_dir) / CHECKPOINT_FILE
    state = load_checkpoint(path)
    if state["config_sha256"] != config_sha256(config) or state["log"] is None:
        raise ResumeError(f"{path} does not belong to the run in {run_dir} (another configuration); "
                          "start a new run with `dlrmflow train`")
    check_row_layout(path, state, spec)
    rows = checkpoint_rows(path, state)
    if rows.shape != (spec.total_rows, spec.width) or not 0 <= state["iteration"] < iterations:
        raise ResumeError(f"{path} does not fit the run: rows {rows.shape}, iteration "
                          f"{state['iteration']} of {iterations}")
    state["rows"] = rows
    return state
