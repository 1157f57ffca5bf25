"""The row store protocol: where a trainer's embedding rows live, one implementation per training mode.

The training loop (:mod:`dlrmflow.engine.training.loop`) asks every store, whatever the mode and the
number of trainers W, the same two calls per iteration ``t``:

- ``gather(t, split)``: the rows of this trainer's distinct ids (``split.mine``, sorted) as a fresh
  ``[U, width]`` tensor on the training device (``split``: :class:`~dlrmflow.engine.training.batch_split.BatchSplit`);
- ``update(t, split, next_union, block, grad)``: apply the row gradients of iteration ``t`` and put the
  rows where the mode keeps them (``next_union``: iteration ``t + 1``'s ids, for a mode that syncs
  by what comes next).

The loop does everything else (forward, backward, the dense update) with one code path, so modes can
differ only in where rows are kept and how they move: that is what makes every mode end in the
bits of the reference (``local`` for one trainer, ``remote`` for W). With one trainer a row is
updated once per iteration inside the whole block (:class:`OneTrainerRows`); with several, a row's
gradient is the rank-order sum over the trainers that used it, applied row-wise
(:class:`RowsForTrainers`, docs/trainers.md).

Every store counts the bytes it fetches and writes back, the seconds compute waited on embedding
traffic (``stall_seconds``) and, with several trainers, the seconds in row-gradient collectives
(``sync_seconds``).

The checkpoint view. A checkpoint (:mod:`..checkpoint`) asks each store, through the same calls
whatever the mode, for:

- :meth:`RowStore.held_rows`: the rows the store holds newer copies of than its home (a pending
  write-back, cached rows); the shards write their rows overlaid with these, each its own file, so
  the checkpoint holds every row's *logical* value without any process holding them all;
- :meth:`RowStore.logical_rows`: every row's value as the home (table or shards) would hold it
  once every write the store still holds has landed (the home's rows overlaid with
  :meth:`RowStore.held_rows`: one array of every row, for tests and the local store);
- :meth:`RowStore.traffic`: the bytes moved so far, counted as an uninterrupted run counts them;
- :meth:`RowStore.restart_at`: continue at iteration ``t`` from a checkpoint's rows, after
  :meth:`RowStore.drop_pending` forgot what the store held and :meth:`ShardRows.replace_shards`
  swapped in shards restored from the checkpoint.

A checkpoint's rows reach a store as anything indexable by an id array (``rows[ids]``): a
:class:`~dlrmflow.engine.row_files.ShardedRows` view of the checkpoint's shard files, which reads only
the rows asked for, or an array.

The end of a run. After :meth:`RowStore.finish` every row is home: :meth:`RowStore.row_chunks` streams
them in global id order a chunk at a time (the state SHA-256), :meth:`RowStore.save_rows` has the home
write them, each shard its own file (the final state).

Which store a mode uses is declared once, in :mod:`dlrmflow.engine.training.modes`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec, apply_update
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import PendingGather, TrainerGroup
from dlrmflow.engine.training.schedule import LrSchedule


def host_buffer(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """A CPU tensor to receive fetched rows (pinned when the rows go on to a GPU)."""
    return torch.empty((rows, width), dtype=torch.float32, pin_memory=device.type == "cuda")


class RowStore:
    """The protocol (and the shared counters) of the per-mode row stores (module docstring)."""

    spec: RowSpec
    device: torch.device
    # The learning-rate schedule of the row updates (the run sets it: train_rank); constant by default.
    schedule: LrSchedule = LrSchedule()

    def spec_at(self, t: int) -> RowSpec:
        """The row spec whose ``lr`` is iteration ``t``'s: what every update of ``t``'s gradients uses."""
        if self.schedule.constant:
            return self.spec
        return dataclasses.replace(self.spec, lr=self.schedule.lr(self.spec.lr, t))

    def __init__(self, spec: RowSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.bytes_fetched = 0
        self.bytes_written = 0
        self.stall_seconds = 0.0
        self.sync_seconds = 0.0

    @property
    def peak_cached_rows(self) -> int:
        """The most rows this trainer's cache held at once (0: no cache)."""
        return 0

    def gather(self, t: int, split: BatchSplit) -> torch.Tensor:
        """This trainer's rows of iteration ``t`` (``split.mine``), a fresh ``[U, width]`` tensor."""
        raise NotImplementedError

    def update(self, t: int, split: BatchSplit, next_union: np.ndarray, block: torch.Tensor,
               grad: torch.Tensor) -> None:
        """Apply iteration ``t``'s gradients ``grad`` (of ``block[:, :dim]``) and keep the rows."""
        raise NotImplementedError

    def quiesce(self) -> None:
        """Before a checkpoint: nothing in flight that :meth:`logical_rows` would miss."""

    def resume_from(self, traffic: dict[str, int], cache: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """A run resumed from a checkpoint: count on from its ``traffic`` and hold its ``cache`` (values
        from ``rows``, the checkpoint's :meth:`logical_rows`)."""
        self.bytes_fetched, self.bytes_written = traffic["bytes_fetched"], traffic["bytes_written"]
        self.restore_cache(cache, rows)

    def finish(self) -> None:
        """After the last iteration: every row is back in its home (table or shards)."""

    def read(self, ids: np.ndarray) -> torch.Tensor:
        """Rows of ``ids`` after :meth:`finish` (evaluation), not counted as training traffic."""
        raise NotImplementedError

    def current_rows(self, ids: np.ndarray) -> torch.Tensor:
        """Mid-run (the periodic evaluation of one trainer): the rows of sorted distinct ``ids`` as training
        has left them so far, ``[len(ids), width]`` on the device. Changes nothing the training reads or
        counts; waits until background work is idle (as a checkpoint does)."""
        raise NotImplementedError

    def all_rows(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in global id order, after :meth:`finish`, in this process: for
        tests and small tables (a run uses :meth:`row_chunks` and :meth:`save_rows`)."""
        raise NotImplementedError

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        """After :meth:`finish`: every row in global id order, at most ``chunk`` rows at a time (default
        :data:`~dlrmflow.engine.row_files.ROW_CHUNK`); not counted as traffic."""
        raise NotImplementedError

    def save_rows(self, directory: str | Path, *, chunk: int | None = None) -> list[dict[str, Any]]:
        """After :meth:`finish`: the home writes every row into ``directory``, one rows file per shard
        (``shard-<k>.npy``) written by the process that holds the shard; the files' manifest entries."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop background work (also on errors)."""

    # ---- the checkpoint view -------------------------------------------------------------------------

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows the store holds newer copies of than its home (a pending write-back, cached rows):
        sorted distinct ids and their rows ``[len(ids), width]``, fresh arrays. :meth:`logical_rows` is the
        home's rows overlaid with them. Sends nothing, is not counted as traffic; waits until background
        work is idle."""
        return np.zeros(0, dtype=np.int64), np.zeros((0, self.spec.width), dtype=np.float32)

    def logical_rows(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in global id order as the home would hold it after every
        write the store still holds (a pending write-back, cached rows) has landed; a fresh array.
        Sends nothing and is not counted as traffic; waits until background work is idle."""
        raise NotImplementedError

    def traffic(self) -> dict[str, int]:
        """``bytes_fetched`` and ``bytes_written`` so far, counted as an uninterrupted run counts them
        at this point: a write that :meth:`logical_rows` includes counts as written, a row fetched
        ahead for a later iteration not yet as fetched. A run resumed from a checkpoint starts its
        counters from these."""
        return {"bytes_fetched": int(self.bytes_fetched), "bytes_written": int(self.bytes_written)}

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

    def restart_at(self, t: int, rows: np.ndarray) -> None:
        """Continue at iteration ``t`` from ``rows``, every row's value before ``t`` (a checkpoint's
        :meth:`logical_rows`): afterwards :meth:`logical_rows` equals ``rows`` and gathers from ``t`` on
        return what an uninterrupted run's return. Whatever the store held is dropped unsent. A store
        backed by shards expects them to hold ``rows`` already (restored from the checkpoint)."""
        raise NotImplementedError


class OneTrainerRows(RowStore):
    """A store of the only trainer: every row of the batch is its own, updated once per iteration inside
    the whole block (the reference's order of operations), then put back with :meth:`scatter`."""

    def gather(self, t: int, split: BatchSplit) -> torch.Tensor:
        return self.gather_ids(t, split.mine)

    def gather_ids(self, t: int, ids: np.ndarray) -> torch.Tensor:
        """The rows of ``ids`` (sorted) for iteration ``t``."""
        raise NotImplementedError

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        """Take the updated ``block`` of ``ids`` back."""
        raise NotImplementedError

    def update(self, t: int, split: BatchSplit, next_union: np.ndarray, block: torch.Tensor,
               grad: torch.Tensor) -> None:
        apply_update(self.spec_at(t), block, grad)
        self.scatter(t, split.mine, block)


class ShardRows(OneTrainerRows):
    """A store whose rows live on embedding shards (every mode but ``local``): the shards are the
    home, the store holds at most some newer copies."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup) -> None:
        RowStore.__init__(self, spec, device)  # not the next class in an MRO with RowsForTrainers
        self.shards = shards

    def all_rows(self) -> np.ndarray:
        return self.shards.all_rows()

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        return self.shards.row_chunks(chunk)

    def save_rows(self, directory: str | Path, *, chunk: int | None = None) -> list[dict[str, Any]]:
        return self.shards.save_rows(directory, chunk=chunk)

    def current_rows(self, ids: np.ndarray) -> torch.Tensor:
        """The shards' rows overlaid with :meth:`held_rows`: a plain read of the shards (not :meth:`read`,
        which may drop a pending write-back), counted nowhere."""
        held_ids, held = self.held_rows()  # first: waits until no write-back is in flight
        host = host_buffer(len(ids), self.spec.width, self.device)
        self.shards.fetch(ids, out=host.numpy())
        at = np.minimum(np.searchsorted(held_ids, ids), max(len(held_ids) - 1, 0))
        newer = np.flatnonzero(held_ids[at] == ids) if len(held_ids) else np.zeros(0, dtype=np.int64)
        host.numpy()[newer] = held[at[newer]]
        return host.to(self.device)

    def logical_rows(self) -> np.ndarray:
        """The shards' rows overlaid with :meth:`held_rows` (every row in this process: tests)."""
        ids, held = self.held_rows()
        rows = self.shards.all_rows()
        rows[ids] = held
        return rows

    def close(self) -> None:
        self.shards.close()

    def replace_shards(self, shards: ShardGroup) -> ShardGroup:
        """Use ``shards`` from now on (after :meth:`drop_pending`: nothing is sent to the old ones);
        returns the old group, for the caller to close."""
        old, self.shards = self.shards, shards
        return old

    def restart_at(self, t: int, rows: np.ndarray) -> None:
        """The shards hold ``rows``: drop whatever the store holds."""
        self.drop_pending()


class SlotDirectory:
    """Which global id sits in which cache slot (both directions), as dense arrays."""

    def __init__(self, total_rows: int, num_slots: int) -> None:
        self.slot_of = np.full(total_rows, -1, dtype=np.int64)
        self.owner = np.full(num_slots, -1, dtype=np.int64)
        self.held = self.peak = 0  # rows cached now, and the most at once (counted as they come and go)

    def place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self.held += int(np.count_nonzero(self.slot_of[ids] < 0))
        self.peak = max(self.peak, self.held)
        self.slot_of[ids] = slots
        self.owner[slots] = ids

    def remove(self, ids: np.ndarray) -> np.ndarray:
        slots = self.slot_of[ids]
        self.held -= int(np.count_nonzero(slots >= 0))
        self.slot_of[ids] = -1
        self.owner[slots] = -1
        return slots

    def cached_ids(self) -> np.ndarray:
        """Every cached id, sorted."""
        return np.sort(self.owner[self.owner >= 0])


class CachedRows(ShardRows):
    """Shared by the LRU and oracle stores: a cache tensor of rows plus a slot directory."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup, num_slots: int) -> None:
        super().__init__(spec, device, shards)
        self.cache = torch.zeros((num_slots, spec.width), dtype=torch.float32, device=device)
        self.directory = SlotDirectory(spec.total_rows, num_slots)
        self._slots: torch.Tensor | None = None  # slots of the current iteration's ids
        self._earlier_peak = 0  # the peak of the directories before the current one (a reload starts afresh)

    @property
    def peak_cached_rows(self) -> int:
        return max(self._earlier_peak, self.directory.peak)

    def _slots_of(self, t: int, ids: np.ndarray) -> np.ndarray:
        slots = self.directory.slot_of[ids]
        if (slots < 0).any():
            missing = ids[slots < 0]
            raise RuntimeError(
                f"iteration {t}: {len(missing)} rows are not in the cache (first id {int(missing[0])}); "
                "the cache schedule does not match the batch stream"
            )
        return slots

    def _rows_in_slots(self, slots: np.ndarray) -> np.ndarray:
        return self.cache.index_select(0, torch.from_numpy(slots).to(self.device)).cpu().numpy()

    def _exchange_slots(
        self, write_ids: np.ndarray, write_slots: np.ndarray, fetch_ids: np.ndarray, fetch_slots: np.ndarray
    ) -> None:
        """Send the cached rows of ``write_ids`` home and fetch ``fetch_ids`` into ``fetch_slots``, in
        one synchronous round trip per shard (the shards apply the writes first)."""
        if not len(write_ids) and not len(fetch_ids):
            return
        rows = self._rows_in_slots(write_slots)
        host = host_buffer(len(fetch_ids), self.spec.width, self.device)
        self.shards.exchange(write_ids, rows, fetch_ids, out=host.numpy())
        if len(fetch_ids):
            self.cache.index_copy_(0, torch.from_numpy(fetch_slots).to(self.device), host.to(self.device))
        self.bytes_written += len(write_ids) * self.spec.row_bytes
        self.bytes_fetched += len(fetch_ids) * self.spec.row_bytes

    def _write_back_all(self) -> None:
        """Send every cached row home (the end of a run) and empty the cache."""
        ids = self.directory.cached_ids()
        self._exchange_slots(ids, self.directory.slot_of[ids], ids[:0], ids[:0])
        self.directory.remove(ids)

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        assert self._slots is not None
        self.cache.index_copy_(0, self._slots, block)

    def _empty_cache(self) -> None:
        """No row cached: a fresh directory and a zeroed cache."""
        self._earlier_peak = self.peak_cached_rows
        self.directory = SlotDirectory(self.spec.total_rows, len(self.cache))
        self.cache.zero_()

    def read(self, ids: np.ndarray) -> torch.Tensor:
        host = host_buffer(len(ids), self.spec.width, self.device)
        self.shards.fetch(ids, out=host.numpy())
        return host.to(self.device)

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every cached row (a cached row is at least as new as its shard's)."""
        ids = self.directory.cached_ids()
        return ids, self._rows_in_slots(self.directory.slot_of[ids])


class RowsForTrainers(RowStore):
    """What every W-trainer store shares: the trainer group, gradient gathering. Its counters are this
    trainer's own; a resumed trainer counts from the resume (the checkpoint holds trainer 0's)."""

    def __init__(self, spec: RowSpec, device: torch.device, group: TrainerGroup) -> None:
        self.spec, self.device, self.group = spec, device, group
        self.sync_seconds = 0.0  # time in the row gradients' collectives (and the remote modes' barrier)

    def resume_from(self, traffic: dict[str, int], cache: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """Nothing: see the class docstring; a cache restarts as the mode's restart rule says."""

    def _gather_gradients(self, split: BatchSplit, mask: np.ndarray, grad: torch.Tensor, kind: str, *,
                          async_op: bool = False) -> tuple[list[np.ndarray], list | PendingGather]:
        """Every trainer's gradients of its rows that ``mask`` selects: (ids per trainer, rows per trainer)."""
        ids = split.held(mask)
        mine = mask[split.where[split.rank]]
        rows = grad[torch.from_numpy(np.flatnonzero(mine))]
        gathered = self.group.all_gather_rows(rows, [len(i) for i in ids], kind, async_op=async_op)
        return ids, gathered


class ServersCurrentRows(RowsForTrainers):
    """A W-trainer store whose servers hold every row's value after each iteration (nothing it keeps is newer):
    its checkpoint view and its reads are the servers'."""

    shards: ShardGroup

    def quiesce(self) -> None:
        """Nothing to wait for: every write went home in its iteration."""

    def finish(self) -> None:
        """Nothing to write: every write went home in its iteration."""

    def read(self, ids: np.ndarray) -> torch.Tensor:
        host = host_buffer(len(ids), self.spec.width, self.device)
        self.shards.fetch(ids, out=host.numpy())
        return host.to(self.device)

    def all_rows(self) -> np.ndarray:
        return self.shards.all_rows()

    logical_rows = all_rows

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        return self.shards.row_chunks(chunk)

    def save_rows(self, directory: str | Path, *, chunk: int | None = None) -> list[dict[str, Any]]:
        return self.shards.save_rows(directory, chunk=chunk)

    def traffic(self) -> dict[str, int]:
        return {"bytes_fetched": int(self.bytes_fetched), "bytes_written": int(self.bytes_written)}

    def cache_state(self) -> None:
        """None: a resumed trainer starts with nothing cached (a cached copy equals its server's, so the bits
        do not change; an LRU cache's misses do)."""
        return None

    def _write_through(self, ids: np.ndarray, rows: torch.Tensor) -> float:
        """Write ``rows`` home, then wait until every trainer's writes of this iteration are home, so that no
        trainer reads a server before them; returns the seconds spent writing (the barrier counts as sync)."""
        start = time.perf_counter()
        self.shards.write_back(ids, rows.cpu().numpy())
        written = time.perf_counter()
        self.group.barrier()
        self.sync_seconds += time.perf_counter() - written
        return written - start
