"""The row store protocol: where a trainer's embedding rows live, one store per training mode.

A store is composed of parts, each in its own module:

- a **home** (:mod:`.homes`): the whole table in this process (:class:`~.homes.TableHome`) or the embedding
  shards (:class:`~.homes.ShardHome`); the shard home is the one layer that counts embedding traffic;
- a **cache** (:mod:`.slot_cache`, and the policies of :mod:`.lru` and :mod:`.oracle`): rows held newer than
  the home, in slots of a cache tensor; none for ``local`` and ``remote``;
- with W trainers, the **row-gradient sync** (:mod:`.sync`): how a row's gradients reach the copies of it.

A mode's store (one class per mode and W, each subclassing only :class:`RowStore`) combines them; which
store a mode uses is declared once, in :mod:`dlrmflow.engine.training.modes`.

The iteration calls. The training loop (:mod:`dlrmflow.engine.training.loop`) asks every store, whatever the
mode and the number of trainers W, the same two calls per iteration ``t``:

- ``gather(t, split, next_union)``: an :class:`IterationRows` handle whose ``rows`` are this trainer's distinct
  ids' rows (``split.mine``, sorted) as a fresh ``[U, width]`` tensor on the training device (``split``:
  :class:`~dlrmflow.engine.training.batch_split.BatchSplit`; ``next_union``: iteration ``t + 1``'s ids, for a
  mode that syncs by what comes next);
- ``update(rows, grad, lr)``: the handle back, with the row gradients of its iteration and the row learning
  rate of that iteration (the loop's schedule): apply them and put the rows where the mode keeps them.

The loop does everything else (forward, backward, the dense update) with one code path, so modes can
differ only in where rows are kept and how they move: that is what makes every mode end in the
bits of the reference (``local`` for one trainer, ``remote`` for W). With one trainer a row is
updated once per iteration inside the whole block; with several, a row's gradient is the rank-order sum
over the trainers that used it, applied row-wise (docs/trainers.md).

Every store reports the bytes its home fetched and wrote back (``bytes_fetched``, ``bytes_written``), the
seconds compute waited on embedding traffic (``stall_seconds``) and, with several trainers, the seconds in
row-gradient collectives (``sync_seconds``).

The checkpoint view (:mod:`..checkpoint`), apart from the iteration calls, the same in every mode:

- :meth:`RowStore.held_rows`: the rows the store holds newer copies of than its home (a pending
  write-back, cached rows); the shards write their rows overlaid with these, each its own file, so
  the checkpoint holds every row's *logical* value without any process holding them all;
- :meth:`RowStore.logical_rows`: every row's value as the home would hold it once every write the store
  still holds has landed (for tests and the local store);
- :meth:`RowStore.traffic`: the bytes moved so far, counted as an uninterrupted run counts them;
- :meth:`RowStore.cache_state` / :meth:`RowStore.restore_cache`: what a resumed cache needs;
- :meth:`RowStore.drop_pending`, :meth:`RowStore.replace_shards`, :meth:`RowStore.restart_at`: reload a
  checkpoint into fresh shards and continue from its iteration.

A checkpoint's rows reach a store as anything indexable by an id array (``rows[ids]``): a
:class:`~dlrmflow.engine.row_files.ShardedRows` view of the checkpoint's shard files, which reads only
the rows asked for, or an array.

The end of a run. After :meth:`RowStore.finish` every row is home: :meth:`RowStore.row_chunks` streams
them in global id order a chunk at a time (the state SHA-256), :meth:`RowStore.save_rows` has the home
write them, each shard its own file (the final state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit


def host_buffer(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """A CPU tensor to receive fetched rows (pinned when the rows go on to a GPU)."""
    return torch.empty((rows, width), dtype=torch.float32, pin_memory=device.type == "cuda")


@dataclass
class IterationRows:
    """One iteration's rows, from ``gather`` to ``update``: everything the store needs to take them back.

    ``rows``: this trainer's distinct ids' rows ``[U, width]`` (weights and optimizer state); ``slots``: the
    cache slots they were read from (a cached mode); ``plan``: the iteration's plan (the oracle);
    ``batch_rows``: the rows of the whole batch's distinct ids (the trainer that fetches for all)."""

    t: int
    split: BatchSplit
    next_union: np.ndarray
    rows: torch.Tensor
    slots: torch.Tensor | None = None
    plan: Any = None
    batch_rows: torch.Tensor | None = None


def rule_at(spec: RowSpec, lr: float) -> RowSpec:
    """``spec`` with the row learning rate ``lr`` (the spec itself when it already has it)."""
    return spec if lr == spec.lr else dataclasses.replace(spec, lr=lr)


class RowStore:
    """The protocol of the per-mode row stores (module docstring), with what most of them share: the
    home's counters and reads. A store sets ``spec``, ``device`` and ``home``; a store whose home is the
    shards has ``home.shards``."""

    spec: RowSpec
    device: torch.device
    home: Any  # a TableHome or a ShardHome (.homes)
    stall_seconds: float = 0.0
    sync_seconds: float = 0.0

    # ---- the iteration calls ------------------------------------------------------------------------

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        """This trainer's rows of iteration ``t`` (``split.mine``), a fresh ``[U, width]`` tensor."""
        raise NotImplementedError

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        """Apply ``gathered``'s gradients ``grad`` (of ``gathered.rows[:, :dim]``) at row learning rate ``lr`` and keep
        the rows."""
        raise NotImplementedError

    def finish(self) -> None:
        """After the last iteration: every row is back in its home (table or shards)."""

    def close(self) -> None:
        """Stop background work (also on errors) and release the home."""
        self.home.close()

    # ---- counters ------------------------------------------------------------------------------------

    @property
    def shards(self) -> ShardGroup:
        """The shard group of a store whose home is the shards."""
        return self.home.shards

    @property
    def bytes_fetched(self) -> int:
        return self.home.bytes_fetched

    @property
    def bytes_written(self) -> int:
        return self.home.bytes_written

    @property
    def peak_cached_rows(self) -> int:
        """The most rows this trainer's cache held at once (0: no cache)."""
        return 0

    # ---- reads outside the iterations -----------------------------------------------------------------

    def read(self, ids: np.ndarray) -> torch.Tensor:
        """Rows of ``ids`` after :meth:`finish` (evaluation), not counted as training traffic."""
        return self.home.read(ids, self.device)

    def current_rows(self, ids: np.ndarray) -> torch.Tensor:
        """Mid-run (the periodic evaluation of one trainer): the rows of sorted distinct ``ids`` as training
        has left them so far, ``[len(ids), width]`` on the device: the home's rows overlaid with
        :meth:`held_rows`. Changes nothing the training reads or counts; waits until background work is idle
        (as a checkpoint does)."""
        held_ids, held = self.held_rows()  # first: waits until no write-back is in flight
        host = self.home.read(ids, torch.device("cpu"))
        at = np.minimum(np.searchsorted(held_ids, ids), max(len(held_ids) - 1, 0))
        newer = np.flatnonzero(held_ids[at] == ids) if len(held_ids) else np.zeros(0, dtype=np.int64)
        host.numpy()[newer] = held[at[newer]]
        return host.to(self.device)

    def all_rows(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in global id order, after :meth:`finish`, in this process: for
        tests and small tables (a run uses :meth:`row_chunks` and :meth:`save_rows`)."""
        return self.home.all_rows()

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        """After :meth:`finish`: every row in global id order, at most ``chunk`` rows at a time (default
        :data:`~dlrmflow.engine.row_files.ROW_CHUNK`); not counted as traffic."""
        return self.home.row_chunks(chunk)

    def save_rows(self, directory: str | Path, *, chunk: int | None = None) -> list[dict[str, Any]]:
        """After :meth:`finish`: the home writes every row into ``directory``, one rows file per shard
        (``shard-<k>.npy``) written by the process that holds the shard; the files' manifest entries."""
        return self.home.save_rows(directory, chunk=chunk)

    # ---- the checkpoint view -------------------------------------------------------------------------

    def quiesce(self) -> None:
        """Before a checkpoint: nothing in flight that :meth:`logical_rows` would miss."""

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows the store holds newer copies of than its home (a pending write-back, cached rows):
        sorted distinct ids and their rows ``[len(ids), width]``, fresh arrays. Sends nothing, is not counted
        as traffic; waits until background work is idle."""
        return np.zeros(0, dtype=np.int64), np.zeros((0, self.spec.width), dtype=np.float32)

    def logical_rows(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in global id order as the home would hold it after every
        write the store still holds has landed: the home's rows overlaid with :meth:`held_rows`; a fresh
        array. Sends nothing and is not counted as traffic; waits until background work is idle."""
        ids, held = self.held_rows()
        rows = self.home.all_rows()
        rows[ids] = held
        return rows

    def traffic(self) -> dict[str, int]:
        """``bytes_fetched`` and ``bytes_written`` so far, counted as an uninterrupted run counts them
        at this point: a write that :meth:`logical_rows` includes counts as written, a row fetched
        ahead for a later iteration not yet as fetched. A run resumed from a checkpoint starts its
        counters from these."""
        return {"bytes_fetched": int(self.bytes_fetched), "bytes_written": int(self.bytes_written)}

    def resume_from(self, traffic: dict[str, int], cache: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """A run resumed from a checkpoint: count on from its ``traffic`` and hold its ``cache`` (values
        from ``rows``, the checkpoint's :meth:`logical_rows`)."""
        self.home.count_from(traffic)
        self.restore_cache(cache, rows)

    def cache_state(self) -> dict[str, np.ndarray] | None:
        """What a store restarted from a checkpoint needs to hold the same rows in the same cache slots
        (:meth:`restore_cache`); None for a store whose cache a checkpoint does not carry."""
        return None

    def restore_cache(self, state: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """After :meth:`restart_at`: cache again the rows :meth:`cache_state` recorded, their values
        taken from ``rows`` (the checkpoint's :meth:`logical_rows`, which hold every cached row's value).
        Nothing is sent or counted: an uninterrupted run fetched them before the checkpoint, and the
        checkpoint's traffic counts that. ``state`` None (a checkpoint without it): the cache stays empty."""

    def drop_pending(self) -> None:
        """Forget, without sending them, the writes the home has not applied (a pending write-back,
        cached rows) and stop background traffic: the first step of reloading a checkpoint, before
        the home is replaced. Only :meth:`restart_at` may follow."""

    def replace_shards(self, shards: ShardGroup) -> ShardGroup:
        """Use ``shards`` from now on (after :meth:`drop_pending`: nothing is sent to the old ones);
        returns the old group, for the caller to close."""
        return self.home.replace(shards)

    def restart_at(self, t: int, rows: np.ndarray) -> None:
        """Continue at iteration ``t`` from ``rows``, every row's value before ``t`` (a checkpoint's
        :meth:`logical_rows`): afterwards :meth:`logical_rows` equals ``rows`` and gathers from ``t`` on
        return what an uninterrupted run's return. Whatever the store held is dropped unsent. A store
        backed by shards expects them to hold ``rows`` already (restored from the checkpoint)."""
        self.drop_pending()
