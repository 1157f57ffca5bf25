"""The oracle trainer's background worker: executes a lookahead plan ahead of compute.

Protocol between compute (main thread) and the worker, for prefetch distance ``P``:

- the worker issues the fetches of iteration ``t`` once iterations ``0 .. t-P-1`` have
  finished computing, in one round trip per shard that first writes back the evictions of
  those iterations not yet written (in steady state: of ``t-P-1``) and then fetches. That is
  the plan contract, and it is what guarantees no stale read: a row evicted after ``u`` is
  home before any fetch issued for ``t >= u + P + 1`` (same shard, write applied first).
  The same round trip fetches rows of ``t + 1 .. t + P - 1`` early (into spare cache slots), and
  a round trip with nothing of its own to fetch is not made: its write-backs ride the next one
  (the state's rules);
- compute waits until iteration ``t``'s rows are in the cache (that wait is the stall),
  computes, and hands the worker iteration ``t``'s evictions (ids and slots).

The worker also keeps its own view of the cache (id -> slot, from prefetch until the row is
written back; it picks the slots, and compute learns them with the rows) and refuses a plan step
that would fetch a row whose newer copy is still cached or in flight, or hold more rows than the
cache: a bad plan fails loudly instead of training on a stale row. Any exception in the worker is
re-raised in the main thread by the next :meth:`PrefetchWorker.wait_ready` /
:meth:`PrefetchWorker.join` (no hang, no silent fallback).

A checkpoint before iteration ``t`` first waits until the worker is idle (:meth:`PrefetchWorker.wait_idle`,
which has it send the write-backs it holds): with iterations ``0 .. t-1`` done it has then written back
every eviction before ``t`` and prefetched ``t .. t+P`` (and maybe rows of later iterations), and has no
round trip in flight. A worker made with ``start=t`` and the
slots the plan implies at ``t`` continues from there (a resume, or a replay after a lost shard).

On CPU the worker moves rows with NumPy on the cache's memory (disjoint rows from compute's);
on a GPU it copies on a side CUDA stream and hands compute a CUDA event to wait on.

The worker is split in two: every decision (the plan cursor and the prefetch distance rule, the
worker's view of the cache, the pending evictions, the checks that raise :class:`PlanViolation`, and
for several trainers who fetches and who writes each row) lives in the pure state object of
:mod:`.prefetch_state` (:class:`~.prefetch_state.PrefetchState`, changed only by named events that
return actions, tested without threads in tests/test_prefetch_state.py); the classes here are its thin
drivers: the thread and its condition variable, the shard round trips, the cache copies (NumPy, or a CUDA
side stream and events) and the trainer group's collective. Each driver step asks the state what to do
and reports what it did.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.prefetch_state import (
    EMPTY_IDS,
    CopyOut,
    Done,
    Exchange,
    Finished,
    PartitionedPrefetchState,
    PlanViolation,
    PrefetchState,
    ReadPlan,
    SharedExchange,
    WaitForDone,
)

__all__ = ["EMPTY_IDS", "WAIT_POLL_SECONDS", "Done", "PartitionedPrefetchWorker", "PlanViolation", "PrefetchError",
           "PrefetchWorker", "Ready"]

WAIT_POLL_SECONDS = 1.0  # how often a waiting thread re-checks that the other side is alive


class PrefetchError(RuntimeError):
    """The prefetch worker failed; the cause is chained."""


@dataclass
class Ready:
    plan: Any  # the IterationPlan of this iteration
    event: torch.cuda.Event | None  # GPU: compute waits on it before reading the new rows
    ids: np.ndarray  # the rows fetched into the cache for it
    slots: np.ndarray  # their slots
    holders: np.ndarray | None  # several trainers: their holders (bit w: trainer w)
    fetched_bytes: int  # what this worker fetched from the shards for it


class PrefetchWorker:
    """Drives a :class:`~.prefetch_state.PrefetchState` from a background thread (module docstring)."""

    def __init__(
        self,
        plan_iterations: Iterator[Any],
        iterations: int,
        distance: int,
        cache: torch.Tensor,
        home: Any,
        *,
        start: int = 0,
        cached: tuple[np.ndarray, np.ndarray] | None = None,
        spare_slots: int = 0,
    ) -> None:
        """``home``: where rows go and come from, ``home.exchange(write_ids, write_rows, fetch_ids, out=)`` (the
        store's :class:`~.stores.homes.ShardHome`, which counts the traffic); ``start``: the first iteration to
        prepare (``plan_iterations`` begins there); ``cached``: the (ids, slots) already in the cache at
        ``start``, whose write-backs are all applied; ``spare_slots``: the last rows of ``cache``, beyond the
        plan's slots, for rows fetched early (the state's)."""
        self.spare_slots = spare_slots
        self.state = self._new_state(iterations, distance, cache.shape[0] - spare_slots, start, cached)
        self.plans = plan_iterations
        self.cache = cache
        self.home = home
        self.row_bytes = 4 * cache.shape[1]
        self.cuda = cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(cache.device) if self.cuda else None
        self.cache_np = None if self.cuda else cache.numpy()
        self._no_rows = np.zeros((0, cache.shape[1]), dtype=np.float32)
        self._cond = threading.Condition()  # held around every call into the state
        self._ready: dict[int, Ready] = {}
        self._error: BaseException | None = None
        self._error_at = ""
        self._finished = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dlrmflow-prefetch", daemon=True)

    def _new_state(self, iterations: int, distance: int, num_slots: int, start: int,
                   cached: tuple[np.ndarray, np.ndarray] | None) -> PrefetchState:
        return PrefetchState(iterations, distance, num_slots, start=start, cached=cached,
                             spare_slots=self.spare_slots)

    def cached(self) -> tuple[np.ndarray, np.ndarray]:
        """The worker's view of the cache: every id in it (sorted) and its slot. A row occupies its slot from
        prefetch until its eviction is taken for write-back. Call it while the worker is idle
        (:meth:`wait_idle`)."""
        return self.state.directory.cached()

    @property
    def peak_held(self) -> int:
        """The most rows the worker's view held at once, rows fetched early into spare slots not counted."""
        return self.state.peak_held

    @property
    def doing(self) -> str:
        """What the worker is doing (empty: waiting), for a message about it."""
        return self.state.doing

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
            self.state.evictions_posted(done)
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
            self.state.flush_requested()  # the write-backs it holds go home now
            self._cond.notify_all()
            while not (self._finished or self.state.idle()):
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise PrefetchError("the prefetch worker stopped while a checkpoint waited for it")
                self._cond.wait(WAIT_POLL_SECONDS)
        if self.cuda:
            self.stream.synchronize()  # its last copies into the cache have landed

    def bytes_fetched_ahead(self) -> int:
        """Bytes fetched for iterations prepared but not yet handed to compute."""
        with self._cond:
            ahead = sum(r.fetched_bytes for r in self._ready.values())
            return ahead + self.state.rows_fetched_ahead * self.row_bytes

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the worker to stop (after an error in compute) and wait for it, at most ``timeout`` seconds
        (None: as long as it takes); whether it stopped."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the main thread
            with self._cond:
                self._error_at = self.state.doing
                self._error = exc
                self._cond.notify_all()
        else:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _next_action(self) -> ReadPlan | CopyOut | Exchange | SharedExchange | None:
        """The state's next action; a :class:`WaitForDone` is waited out here and answered with the evictions
        compute posted (a :class:`CopyOut`). None: stop, or nothing left to do."""
        with self._cond:
            while True:
                action = self.state.next_action()
                if isinstance(action, Finished):
                    return None
                if not isinstance(action, WaitForDone):
                    return action
                notified = False
                while not self.state.has_posted() and not self._stop and not self.state.flush_wanted:
                    if not notified:
                        notified = True
                        self._cond.notify_all()  # a checkpoint may be waiting for this
                    self._cond.wait(WAIT_POLL_SECONDS)
                if self._stop:
                    return None
                if self.state.has_posted():
                    return self.state.evictions_taken()
                # else a checkpoint wants the held write-backs: the state issues them next

    def _loop(self) -> None:
        taken: list[np.ndarray] = []  # rows copied out of the cache, to go home in the next exchange that sends
        event = None  # the last copy into the cache (GPU): later than every earlier one, on the same stream
        while (action := self._next_action()) is not None:
            if isinstance(action, ReadPlan):
                step = next(self.plans)
                with self._cond:
                    self.state.plan_read(step)
            elif isinstance(action, CopyOut):
                taken.append(self._copy_out(action))
            else:
                rows = self._no_rows  # unless it sends the write-backs taken so far
                if action.sends_writes:
                    if action.t is None and len(taken) == 1:
                        rows = taken[0]
                    elif taken:
                        rows = np.concatenate(taken)
                    taken = []
                copied = self._exchange(action.t, action, rows)
                event = event if copied is None else copied
                with self._cond:
                    self.state.exchanged(action)
                    if action.t is not None:
                        ids, slots, holders, fetched = action.handed_over()
                        self._ready[action.t] = Ready(action.plan, event, ids, slots, holders, fetched * self.row_bytes)
                        self._cond.notify_all()

    def _copy_out(self, take: CopyOut) -> np.ndarray:
        """The rows of ``take.slots``, copied out of the cache after compute's last update of them."""
        if not len(take.ids):
            return self._no_rows
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(take.done.event)  # after compute's last update of these rows
                index = torch.from_numpy(take.slots).to(self.cache.device)
                return self.cache.index_select(0, index).cpu().numpy()
        return self.cache_np[take.slots]

    def _exchange(self, t: int | None, exchange: Exchange, write_rows: np.ndarray) -> torch.cuda.Event | None:
        """One round trip to the shards: write back, then fetch iteration ``t``'s rows into their slots."""
        write_ids, ids, slots = exchange.write_ids, exchange.fetch_ids, exchange.fetch_slots
        if not len(ids) and not len(write_ids):
            return None
        rows = torch.empty((len(ids), self.cache.shape[1]), dtype=torch.float32, pin_memory=self.cuda)
        self.home.exchange(write_ids, write_rows, ids, out=rows.numpy())
        return self._into_cache(slots, rows) if len(ids) else None

    def _into_cache(self, slots: np.ndarray, rows: torch.Tensor) -> torch.cuda.Event | None:
        """``rows`` (host memory, pinned on a GPU) into the cache's ``slots``; on a GPU through the side stream,
        returning the event compute waits on before it reads them."""
        if not self.cuda:
            self.cache_np[slots] = rows.numpy()
            return None
        with torch.cuda.stream(self.stream):
            # A plan's slots can be read-only (Arrow buffers); torch wants a writable array.
            slots = np.require(slots, requirements="W")
            index = torch.from_numpy(slots).to(self.cache.device, non_blocking=True)
            self.cache.index_copy_(0, index, rows.to(self.cache.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        return event


class PartitionedPrefetchWorker(PrefetchWorker):
    """The oracle's prefetch worker for one of W trainers sharing one plan: it writes home the evicted rows it
    is the writer of, fetches the prefetched rows it is the fetcher of and hands each to its holders
    (point to point, over the trainer group's prefetch process group), and keeps the rows it holds
    (the LRPP cache, :class:`~.stores.oracle.LrppRows`). Who holds, fetches and writes what is the state's
    (:class:`~.prefetch_state.PartitionedPrefetchState`)."""

    def __init__(self, *args, group: TrainerGroup, gateway: bool = False, **kwargs) -> None:
        self.group, self.gateway = group, gateway
        super().__init__(*args, **kwargs)

    def _new_state(self, iterations: int, distance: int, num_slots: int, start: int,
                   cached: tuple[np.ndarray, np.ndarray] | None) -> PartitionedPrefetchState:
        return PartitionedPrefetchState(iterations, distance, num_slots, size=self.group.size,
                                        rank=self.group.rank, gateway=self.gateway, start=start, cached=cached)

    def _exchange(self, t: int | None, exchange: SharedExchange, write_rows: np.ndarray) -> torch.cuda.Event | None:
        """One round trip to the shards for this trainer's share, then the rows it fetched go to their
        other holders and the rows it holds come from their fetchers."""
        rank, width = self.group.rank, self.cache.shape[1]
        here = exchange.fetched_here
        fetched = np.empty((len(here), width), dtype=np.float32)
        if len(here) or len(exchange.write_ids):
            self.home.exchange(exchange.write_ids, write_rows, here, out=fetched)
        event = None
        if len(exchange.prefetch_ids):
            fetcher, holders = exchange.fetcher, exchange.holders
            by_me = fetcher == rank
            mine = (holders >> rank) & 1 == 1
            sends = {h: torch.from_numpy(fetched[(holders[by_me] >> h) & 1 == 1])
                     for h in range(self.group.size) if h != rank}
            counts = {u: int(np.count_nonzero(mine & (fetcher == u))) for u in range(self.group.size) if u != rank}
            parts = self.group.send_rows(sends, counts, width, "prefetched rows", prefetch=True).wait()
            held = torch.empty((len(exchange.fetch_ids), width), dtype=torch.float32, pin_memory=self.cuda)
            values, held_fetcher = held.numpy(), fetcher[mine]
            values[held_fetcher == rank] = fetched[mine[by_me]]
            for u, part in parts.items():
                values[held_fetcher == u] = part.numpy()
            event = self._into_cache(exchange.fetch_slots, held) if len(values) else None
        return event
