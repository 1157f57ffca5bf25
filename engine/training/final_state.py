"""The end of a run on trainer 0: the final state written where it lies and its SHA-256 streamed.

After the store's ``finish`` every row is home (the table, or the embedding shards). Trainer 0 then

- with ``save_state``: has every shard write its own rows file into a staged ``final_state.<token>.tmp/``
  on its worker (:meth:`~.stores.base.RowStore.save_rows`), writes ``dense.pt`` itself, and (after the
  parity shards, with ``--parity``, wrote theirs) the manifest; the driver renames the directory into
  place when it records the run (:func:`~dlrmflow.engine.run_state.commit_state_dir`);
- streams the rows in global id order, a chunk at a time, into the state SHA-256
  (:class:`~dlrmflow.engine.run_state.StateDigest`, after the dense entries): the same value as hashing
  the whole state. With ``save_state`` it reads them from the staged files (memory-mapped), not from the
  servers: a second copy of the table over the trainer's link would cost the link's time (12 s of each
  20 Mbit/s run of the demo); without, from the shards (:meth:`~.stores.base.RowStore.row_chunks`).

No process holds every row at any point. The layout is :mod:`dlrmflow.engine.run_state`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dlrmflow.engine import row_files
from dlrmflow.engine.row_files import ShardedRows
from dlrmflow.engine.run_state import StateDigest, stage_state_dir, write_dense, write_manifest
from dlrmflow.engine.training.dense import dense_state
from dlrmflow.engine.training.stores.base import RowStore


def write_final_state(setup: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: RowStore,
                      run_dir: str | Path | None) -> dict[str, Any]:
    """Trainer 0, after ``store.finish()``: the state SHA-256 (streamed) and, with ``run_dir``, the final
    state written into a staged directory there (module docstring). Returns ``state_sha256``,
    ``dense_parameters``, and with ``run_dir`` the staged directory and the manifest's fields so far
    (:func:`seal_final_state` adds the parity files and writes it)."""
    spec = setup.spec
    dense = dense_state(setup, model, optimizer)
    digest = StateDigest(dense).rows(spec.total_rows, spec.width)
    written: dict[str, Any] = {"dense_parameters": sum(v.numel() for v in dense["dense"].values()), "staged": None}
    if run_dir is None:
        chunks = store.row_chunks()
    else:
        staged = stage_state_dir(run_dir)
        shards = store.save_rows(staged)
        written["staged"] = str(staged)
        written["manifest"] = {"total_rows": spec.total_rows, "width": spec.width, "shards": shards,
                               "dense": write_dense(staged, dense)}
        view = ShardedRows.from_files(staged, shards, spec.total_rows, spec.width)
        chunks = (rows for _, rows in view.chunks(row_files.ROW_CHUNK))  # read now: a test may set it
    for chunk in chunks:
        digest.update(chunk)
    written["state_sha256"] = digest.hexdigest()
    if run_dir is not None:
        written["manifest"]["state_sha256"] = written["state_sha256"]
    return written


def seal_final_state(written: dict[str, Any], parity: dict[str, Any] | None = None) -> None:
    """The staged directory's manifest, its last file (``parity``: the parity shards' files)."""
    if written["staged"] is not None:
        write_manifest(written["staged"], **written.pop("manifest"), parity=parity)
