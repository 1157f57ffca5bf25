"""The oracle trainer's background worker: executes a lookahead plan ahead of compute.

Protocol between compute (main thread) and the worker, for prefetch distance ``P``:

- the worker issues the fetches of iteration ``t`` once iterations ``0 .. t-P-1`` have
  finished computing, in one round trip per shard that first writes back the evictions of
  those iterations not yet written (in steady state: of ``t-P-1``) and then fetches. That is
  the plan contract, and it is what guarantees no stale read: a row evicted after ``u`` is
  home before any fetch issued for ``t >= u + P + 1`` (same shard, write applied first);
- compute waits until iteration ``t``'s rows are in the cache (that wait is the stall),
  computes, and hands the worker iteration ``t``'s evictions (ids and slots).

The worker also keeps its own view of the cache (id -> slot, from prefetch until the row is
written back) and refuses a plan step that would overwrite a row not yet written back or
fetch a row whose newer copy is still cached or in flight: a bad plan fails loudly instead
of training on a stale row. Any exception in the worker is re-raised in the main thread by
the next :meth:`PrefetchWorker.wait_ready` / :meth:`PrefetchWorker.join` (no hang, no silent
fallback).

A checkpoint before iteration ``t`` first waits until the worker is idle (:meth:`PrefetchWorker.wait_idle`):
with iterations ``0 .. t-1`` done it has then written back every eviction before ``t`` and
prefetched ``t .. t+P``, and has no round trip in flight. A worker made with ``start=t`` and the
slots the plan implies at ``t`` continues from there (a resume, or a replay after a lost shard).

On CPU the worker moves rows with NumPy on the cache's memory (disjoint rows from compute's);
on a GPU it copies on a side CUDA stream and hands compute a CUDA event to wait on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.collectives import TrainerGroup

EMPTY_IDS = np.zeros(0, dtype=np.int64)
WAIT_POLL_SECONDS = 1.0  # how often a waiting thread re-checks that the other side is alive


class PrefetchError(RuntimeError):
    """The prefetch worker failed; the cause is chained."""


class PlanViolation(RuntimeError):
    """A plan step would read a stale row or overwrite a live one."""


@dataclass
class Ready:
    plan: Any  # the IterationPlan of this iteration
    event: torch.cuda.Event | None  # GPU: compute waits on it before reading the new rows


@dataclass
class Done:
    t: int
    evict_ids: np.ndarray
    evict_slots: np.ndarray
    event: torch.cuda.Event | None  # GPU: recorded after the iteration's update of the cache
    writers: np.ndarray | None = None  # several trainers: the trainer that writes each evicted row home


class PrefetchWorker:
    def __init__(
        self,
        plan_iterations: Iterator[Any],
        iterations: int,
        distance: int,
        cache: torch.Tensor,
        shards: ShardGroup,
        total_rows: int,
        *,
        start: int = 0,
        cached: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """``start``: the first iteration to prepare (``plan_iterations`` begins there); ``cached``: the
        (ids, slots) already in the cache at ``start``, whose write-backs are all applied."""
        if distance < 1:
            raise ValueError(f"prefetch distance must be >= 1, got {distance}")
        self.plans = plan_iterations
        self.iterations = iterations
        self.distance = distance
        self.cache = cache
        self.shards = shards
        self.row_bytes = 4 * cache.shape[1]
        self.cuda = cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(cache.device) if self.cuda else None
        self.cache_np = None if self.cuda else cache.numpy()
        # The worker's view: a row occupies its slot from prefetch until its write-back is acknowledged.
        self.slot_of = np.full(total_rows, -1, dtype=np.int64)
        self.owner = np.full(cache.shape[0], -1, dtype=np.int64)
        self.start_at = start
        if cached is not None:
            self.slot_of[cached[0]] = cached[1]
            self.owner[cached[1]] = cached[0]
        self.bytes_fetched = 0
        self.bytes_written = 0
        self.busy_seconds = 0.0  # time spent in shard round trips and cache copies
        self._no_rows = np.zeros((0, cache.shape[1]), dtype=np.float32)
        self._cond = threading.Condition()
        self._ready: dict[int, Ready] = {}
        self._done: deque[Done] = deque()
        self._error: BaseException | None = None
        self._error_at = ""
        self._finished = False
        self._stop = False
        self._waiting = False  # blocked for an iteration's evictions that compute has not posted
        self._thread = threading.Thread(target=self._run, name="dlrmflow-prefetch", daemon=True)

    # ---- main-thread side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            message = f"the prefetch worker failed {self._error_at}: {self._error!r}"
            raise PrefetchError(message) from self._error

    def wait_ready(self, t: int) -> Ready:
        """Block until iteration ``t``'s rows are in the cache; re-raise a worker failure."""
        with self._cond:
            while t not in self._ready:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise PrefetchError(f"the prefetch worker stopped before iteration {t} was ready")
                self._cond.wait(WAIT_POLL_SECONDS)
            return self._ready.pop(t)

    def post_done(self, done: Done) -> None:
        with self._cond:
            self._done.append(done)
            self._cond.notify_all()

    def join(self) -> None:
        """Wait until every posted eviction is written back; re-raise a worker failure."""
        with self._cond:
            while not self._finished:
                self._raise_if_failed()
                if not self._thread.is_alive():
                    break
                self._cond.wait(WAIT_POLL_SECONDS)
            self._raise_if_failed()
        self._thread.join()

    def wait_idle(self) -> None:
        """Block until the worker waits for evictions not yet posted (or has finished): every posted
        eviction is written back and no round trip is in flight. Re-raise a worker failure."""
        with self._cond:
            while not (self._finished or (self._waiting and not self._done)):
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise PrefetchError("the prefetch worker stopped while a checkpoint waited for it")
                self._cond.wait(WAIT_POLL_SECONDS)
        if self.cuda:
            self.stream.synchronize()  # its last copies into the cache have landed

    def bytes_fetched_ahead(self) -> int:
        """Bytes fetched for iterations prepared but not yet handed to compute."""
        with self._cond:
            return sum(len(r.plan.prefetch_ids) for r in self._ready.values()) * self.row_bytes

    def stop(self) -> None:
        """Ask the worker to stop (after an error in compute) and wait for it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # ---- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the main thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        else:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _next_done(self) -> Done | None:
        with self._cond:
            while not self._done and not self._stop:
                if not self._waiting:
                    self._waiting = True
                    self._cond.notify_all()  # a checkpoint may be waiting for this
                self._cond.wait(WAIT_POLL_SECONDS)
            self._waiting = False
            return None if self._stop else self._done.popleft()

    def _loop(self) -> None:
        written = self.start_at  # iterations whose evictions are written back
        for t in range(self.start_at, self.iterations):
            self._error_at = f"while preparing iteration {t}"
            step = next(self.plans)
            if step.t != t:
                raise PlanViolation(f"the plan yielded iteration {step.t} where {t} was expected")
            evicted: list[tuple[np.ndarray, np.ndarray]] = []
            while written < t - self.distance:  # in steady state exactly one: iteration t - P - 1
                done = self._next_done()
                if done is None:
                    return
                evicted.append(self._take_evictions(done))
                written += 1
            self._error_at = f"while writing back evictions and prefetching for iteration {t}"
            ids = np.concatenate([e[0] for e in evicted]) if evicted else EMPTY_IDS
            rows = np.concatenate([e[1] for e in evicted]) if evicted else self._no_rows
            event = self._exchange(t, ids, rows, step.prefetch_ids, step.prefetch_slots)
            with self._cond:
                self._ready[t] = Ready(step, event)
                self._cond.notify_all()
        while written < self.iterations:
            done = self._next_done()
            if done is None:
                return
            self._error_at = f"while writing back the evictions of iteration {done.t}"
            ids, rows = self._take_evictions(done)
            self._exchange(None, ids, rows, EMPTY_IDS, EMPTY_IDS)
            written += 1

    def _take_evictions(self, done: Done) -> tuple[np.ndarray, np.ndarray]:
        """Copy the evicted rows out of the cache and free their slots (in the worker's view).

        The copy goes home in the next exchange, which the shards apply before its fetches; so a
        slot or id freed here may be reused by that same exchange without a stale read."""
        ids, slots = done.evict_ids, done.evict_slots
        if not np.array_equal(self.slot_of[ids], slots):
            raise PlanViolation(f"iteration {done.t}: evicted rows are not where the worker put them")
        if not len(ids):
            return ids, self._no_rows
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(done.event)  # after compute's last update of these rows
                index = torch.from_numpy(slots).to(self.cache.device)
                rows = self.cache.index_select(0, index).cpu().numpy()
        else:
            rows = self.cache_np[slots]
        self.slot_of[ids] = -1
        self.owner[slots] = -1
        return ids, rows

    def _check_prefetch(self, t: int, ids: np.ndarray, slots: np.ndarray) -> None:
        if len(ids) != len(slots):
            raise PlanViolation(f"iteration {t}: {len(ids)} prefetch ids but {len(slots)} slots")
        if len(np.unique(slots)) != len(slots):
            raise PlanViolation(f"iteration {t}: two prefetched rows share a cache slot")
        busy = self.owner[slots] >= 0
        if busy.any():
            raise PlanViolation(
                f"iteration {t}: slot {int(slots[busy][0])} is reused before its row "
                f"(id {int(self.owner[slots[busy][0]])}) was written back"
            )
        live = self.slot_of[ids] >= 0
        if live.any():
            raise PlanViolation(
                f"iteration {t}: id {int(ids[live][0])} is prefetched while its previous copy is still "
                "cached or not yet written back (a stale read)"
            )

    def _exchange(
        self, t: int | None, write_ids: np.ndarray, write_rows: np.ndarray, ids, slots
    ) -> torch.cuda.Event | None:
        """One round trip to the shards: write back, then fetch iteration ``t``'s rows into their slots."""
        ids = np.asarray(ids, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if t is not None:
            self._check_prefetch(t, ids, slots)
        if not len(ids) and not len(write_ids):
            return None
        start = time.perf_counter()
        rows = torch.empty((len(ids), self.cache.shape[1]), dtype=torch.float32, pin_memory=self.cuda)
        self.shards.exchange(write_ids, write_rows, ids, out=rows.numpy())
        event = None
        if len(ids):
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    # A plan's slots can be read-only (Arrow buffers); torch wants a writable array.
                    slots = np.require(slots, requirements="W")
                    index = torch.from_numpy(slots).to(self.cache.device, non_blocking=True)
                    self.cache.index_copy_(0, index, rows.to(self.cache.device, non_blocking=True))
                    event = torch.cuda.Event()
                    event.record(self.stream)
            else:
                self.cache_np[slots] = rows.numpy()
            self.slot_of[ids] = slots
            self.owner[slots] = ids
        self.bytes_fetched += len(ids) * self.row_bytes
        self.bytes_written += len(write_ids) * self.row_bytes
        self.busy_seconds += time.perf_counter() - start
        return event


class PartitionedPrefetchWorker(PrefetchWorker):
    """The oracle's prefetch worker for one of W trainers holding the same cache slots: it writes home
    the evicted rows it is the writer of, fetches the prefetched rows it is the fetcher of, and gathers
    the others' fetches over the trainer group's prefetch process group (:mod:`.stores_w`, the LRPP cache)."""

    def __init__(self, *args, group: TrainerGroup, gateway: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.cuda:
            raise ValueError("several trainers train on the CPU")
        self.group, self.gateway = group, gateway
        self.last_writer = np.full(len(self.slot_of), -1, dtype=np.int16)

    def fetchers(self, ids: np.ndarray) -> np.ndarray:
        """The trainer that fetches each of ``ids``: the one that last wrote it home, else ``id % W``
        (``gateway``: trainer 0, always)."""
        if self.gateway:
            return np.zeros(len(ids), dtype=np.int64)
        last = self.last_writer[ids]
        return np.where(last >= 0, last, ids % self.group.size)

    def _take_evictions(self, done: Done) -> tuple[np.ndarray, np.ndarray]:
        ids, slots = done.evict_ids, done.evict_slots
        if not np.array_equal(self.slot_of[ids], slots):
            raise PlanViolation(f"iteration {done.t}: evicted rows are not where the worker put them")
        mine = done.writers == self.group.rank
        rows = self.cache_np[slots[mine]] if len(ids) else self._no_rows
        self.last_writer[ids] = done.writers
        self.slot_of[ids] = -1
        self.owner[slots] = -1
        return ids[mine], rows

    def _exchange(self, t, write_ids, write_rows, ids, slots):
        ids = np.asarray(ids, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if t is not None:
            self._check_prefetch(t, ids, slots)
        start = time.perf_counter()
        fetcher = self.fetchers(ids)
        mine = ids[fetcher == self.group.rank]
        fetched = np.empty((len(mine), self.cache.shape[1]), dtype=np.float32)
        if len(mine) or len(write_ids):
            self.shards.exchange(write_ids, write_rows, mine, out=fetched)
        if len(ids):
            counts = [int(np.count_nonzero(fetcher == w)) for w in range(self.group.size)]
            parts = self.group.all_gather_rows(torch.from_numpy(fetched), counts, "prefetched rows", prefetch=True)
            for w, part in enumerate(parts):
                self.cache_np[slots[fetcher == w]] = part.numpy()
            self.slot_of[ids] = slots
            self.owner[slots] = ids
        self.bytes_fetched += len(mine) * self.row_bytes
        self.bytes_written += len(write_ids) * self.row_bytes
        self.busy_seconds += time.perf_counter() - start
        return None
