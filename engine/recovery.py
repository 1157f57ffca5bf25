"""Rebuilding lost members of a :class:`~dlrmflow.engine.parity.CodedShardGroup` while training runs.

On a loss the group calls :func:`start_recovery_thread`. The thread (1) takes the lost member's
standby replacement, started with the group on a spare worker, or else starts a replacement actor
for every lost member on a worker that hosts no live member (a fresh worker: with a LocalCluster
the nanny restarts the killed worker, which then qualifies; it waits a little for one and
otherwise takes the least loaded worker), then (2) rebuilds the lost members chunk by
chunk. The bulk of a chunk never passes through the trainer: a Dask task on the replacement's
worker (:func:`rebuild_chunk_task`) pulls the chunk's stripes from K survivors worker to worker,
decodes and installs them, while training goes on. The tasks of all chunks are submitted at once
and run in chunk order; the thread takes each as it finishes. When every chunk is installed the
replacements take the lost members' places and reads go to them. Meanwhile the trainer reads
rows of stripes not yet rebuilt by degraded reads.

Only stripes with a row the trainer wrote are copied (as a file system resilvers only the blocks
in use). Every row starts as a pure function of ``(seed, id)``, the trainer is the only writer, and
it marks every row it writes back (``group.written``). A data row never written holds its initial
value, and a parity row whose stripe has no written row holds the encoding of initial values; a
rebuild's installs only restore values. So a lost data shard differs from its initial rows only in
the stripes where its rows were written, a lost parity shard only in those with any written row,
and the replacement, which starts with every row *fresh* (generated from the seed when first read,
see ``parity._Sequenced``), needs the others from nowhere. A resumed run marks every row (its rows
came from a checkpoint). How much this saves depends on the run: early in training most rows are
unwritten; once every row has been trained every stripe is copied (``REBUILD_EVERY_STRIPE``
measures that case).

Why every rebuilt stripe is one consistent version, although the bulk read runs while training
writes (optimistic copy + fix-up, as in a database's fuzzy checkpoint):

0. Under the group's lock, the thread settles the last batch (every acknowledgement in, parity
   included) and sets every replacement back to fresh. The stripes with no written row of a lost
   member need no copy: the replacement generates them. They join ``group.rebuilt`` at the first
   fix-up (step 3), like a copied chunk: until then the trainer reads them by degraded reads and
   sends a data replacement nothing, since its worker is busy taking in the first chunk (its
   answers came 10-20 ms late). The others are copied.
1. Under the same lock hold it opens a *dirty log*. Every write-back batch appends the stripes it
   touches to the log, under the same lock, before it sends anything. So no batch is in flight
   when the log opens, and every batch after it is logged (until the rebuild ends).
2. A task copies a chunk (no lock). A stripe that is not in the log when the task has finished
   was written by no batch between the log's opening and the end of the copy: every survivor's
   copy of it is the same version, so its decode is exact. A stripe in the log may have been read
   half before, half after a batch: its decode, and whatever the install wrote over, is not
   trusted.
3. Under the lock again (strictly between two batches), the thread re-reads the logged stripes
   of the chunks copied since the last fix-up from the survivors (the pending parity deltas go
   out with the re-read and land first: :func:`_fix_up`), decodes them and installs them on the
   replacements. Now every stripe of those chunks is the current version; they join
   ``group.rebuilt``, and from then on every batch writes its rows of them through to the
   replacement, so a rebuilt stripe stays current. A fix-up waits up to FIX_UP_INTERVAL_S for
   more copied chunks (the trainer's wait for it is two round trips, whatever its size); that is
   still exact, since a stripe not logged by the fix-up was not written since the log opened. A
   data replacement gets only the writes of rebuilt stripes: anything else it would hold is
   overwritten by a later install, and its process is the rebuild's busiest (sending it every
   write made the trainer's steps wait on it). A parity replacement gets every delta (they come
   per batch, not per stripe): on a stripe not to be copied it lands on the generated encoding, on
   one still to be copied the install overwrites it in the same way. A fix-up with no logged
   stripe needs no round trip at all.

The trainer waits only for step 3 (a few logged stripes, at most every FIX_UP_INTERVAL_S), not for
the bulk copy. A further loss during a rebuild restarts it from step 0 for everything lost (the
decode of a chunk needs one fixed set of survivors), and the replacements' reset names the new
rebuild: they ignore installs of any other, from a copy task of the abandoned one that is still
running (a task cannot be stopped once it runs); more than R lost is fatal (TooManyErasuresError).

:func:`rebuild_lost` is a plain function (tested without Prefect). The train flow reports each
rebuild in the ``recover-shard`` subflow through ``group.recovery_runner``; the rebuild starts at
once and does not wait for the subflow to start (:func:`_rebuild_while_reporting`).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlrmflow.engine.cluster import cluster_workers
from dlrmflow.engine.embedding_server import answer, call_server
from dlrmflow.engine.erasure import ErasureCode, stripe_chunks
from dlrmflow.engine.parity import (
    CodedShardGroup,
    LostMembersError,
    _wait_all,
    member_name,
    remote,
    start_member,
)
from dlrmflow.engine.placement import choose_rebuild_worker, least_loaded_worker

FRESH_WORKER_WAIT_S = 10.0  # how long a rebuild waits for a worker that hosts no live member
YIELD_S = 0.0  # pause after a fix-up (tests raise it to catch degraded reads)
# Copied chunks wait this long for their fix-up (step 3), which then covers all of them at once: a
# fix-up holds the trainer for two round trips to servers busy with the copy, whatever its size.
FIX_UP_INTERVAL_S = 0.5
PACED_CHUNK_S = 0.05  # with a rebuild rate: chunks this long, so the copy's sends come in small pieces
COPY_PAUSE_S = 0.0  # pause between a bulk copy's survivor reads (tests raise it: writes land in between)
# Copy every stripe, as if every row had been trained, not only those with a row the trainer wrote:
# the benchmark's worst case (a table trained for an epoch or more), and tests that need many chunks.
REBUILD_EVERY_STRIPE = False


def start_recovery_thread(group: CodedShardGroup) -> threading.Thread:
    # Run in a copy of the caller's context: under Prefect the recovery subflow then knows its parent.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(_run, group), name="dlrmflow-recovery", daemon=True)
    thread.start()
    return thread


def _run(group: CodedShardGroup) -> None:
    try:
        with group.lock:
            info = {"lost": [member_name(s, group.code.k) for s in sorted(group.lost)],
                    "stripes": group.n_stripes, "chunk": chunk_stripes(group, len(group.lost))}
        if group.recovery_runner is not None:
            _rebuild_while_reporting(group, info)
        else:
            rebuild_lost(group)
    except BaseException as exc:  # noqa: BLE001 - the trainer re-raises it at its next call
        with group.lock:
            group.fatal = group.fatal or exc
            group.recovering = False


class _LateProgress:
    """The rebuild's progress callback, which a report attaches to once it has started: it keeps the
    latest count and passes it on (and every later one) from then on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: Callable[[int, int], None] | None = None
        self._last: tuple[int, int] | None = None

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self._last, target = (done, total), self._target
        if target is not None:
            target(done, total)

    def attach(self, target: Callable[[int, int], None] | None) -> None:
        with self._lock:
            self._target, last = target, self._last
        if target is not None and last is not None:
            target(*last)


def _rebuild_while_reporting(group: CodedShardGroup, info: dict[str, Any]) -> None:
    """Start the rebuild at once, in a thread of its own, and hand ``group.recovery_runner`` (the
    ``recover-shard`` subflow) a callable that waits for it and returns its record.

    The runner used to run the rebuild itself, which therefore began only once the runner had
    started: a Prefect flow run took 0.37 s to start in a CLI kill run, three times the rebuild's
    own 0.11 s, while the trainer read the lost rows by degraded reads. A runner's failure is still
    fatal, as before; this thread returns only after the rebuild has ended, whatever the runner did."""
    progress = _LateProgress()
    outcome: Future = Future()

    def rebuild() -> None:
        try:
            outcome.set_result(rebuild_lost(group, progress))
        except BaseException as exc:  # noqa: BLE001 - raised below and by the report
            outcome.set_exception(exc)

    # In a copy of this thread's context (the train task's, under Prefect): the report's progress
    # callback, called from the rebuild, talks to the Prefect API that context names.
    worker = threading.Thread(target=contextvars.copy_context().run, args=(rebuild,), name="dlrmflow-rebuild",
                              daemon=True)
    worker.start()

    def report(reporter: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        progress.attach(reporter)
        return outcome.result()

    try:
        group.recovery_runner(report, info)
    finally:
        worker.join()
    outcome.result()  # the rebuild's own failure, had the runner returned without asking for it


def _busy_workers(group: CodedShardGroup) -> list[str]:
    """The workers of live members and of current replacements, one entry per member (lock held)."""
    busy = [group.worker_of[s] for s in range(group.code.n_shards) if s not in group.lost]
    return busy + [w for s, w in group.replacement_workers.items() if s in group.replacement]


def choose_worker(group: CodedShardGroup, wait_s: float = FRESH_WORKER_WAIT_S) -> str:
    """A worker hosting no live member, on a host without one if possible (waiting up to ``wait_s``
    for one), else the least loaded."""
    deadline = time.perf_counter() + wait_s
    while True:
        with group.lock:
            busy = _busy_workers(group)
        info = cluster_workers(group.client)
        worker = choose_rebuild_worker(info, busy, group.dead_workers)
        if worker is not None:
            return worker
        if time.perf_counter() > deadline:
            worker = least_loaded_worker(info, busy, group.dead_workers)  # shares a fault domain: better than none
            if worker is None:
                raise RuntimeError(f"no Dask worker to rebuild a lost shard on (waited {wait_s:.0f} s)")
            return worker
        time.sleep(0.1)


def _take_standby(group: CodedShardGroup, s: int) -> tuple[str, Any, Any] | None:
    """Member ``s``'s standby replacement, unless its worker is known dead or now hosts a live member
    or another replacement (two lost members would share a fault domain). Once: taken or dropped.
    A standby whose worker died unnoticed fails its first call (step 0), and the rebuild starts over."""
    with group.lock:
        standby = group.standby.pop(s, None)
        if standby is None:
            return None
        worker, future, _ = standby
        if worker in group.dead_workers or worker in _busy_workers(group) or future.status != "finished":
            return None
        return standby


def _place_replacements(group: CodedShardGroup, need: list[int], generation: int) -> dict[int, tuple[str, Any, Any]]:
    placed = {}
    for s in need:
        standby = _take_standby(group, s)
        if standby is not None:
            placed[s] = standby
            group.replacement_workers[s] = standby[0]
            continue
        while True:
            worker = choose_worker(group)
            future = start_member(group.client, group.spec, group.code, s, worker, initialise=False)
            try:
                placed[s] = (worker, future, _wait_done(group, future, generation, worker))
                break
            except OSError:  # the chosen worker died before the actor started: choose again
                with group.lock:
                    group.dead_workers.add(worker)
        group.replacement_workers[s] = worker
    return placed


# Reads that a chunk's task issued for the next chunk, taken by the next chunk's task: per worker
# process, keyed by (rebuild id, first stripe). Owned by the rebuild tasks on this worker (they run
# one after the other: each depends on the previous one); a task drops what another rebuild left.
_READ_AHEAD: dict[tuple[str, int], dict[int, Any]] = {}


Chunk = tuple[int, int] | np.ndarray  # stripes [start, stop), or a sorted array of stripes


def _read_chunk(survivors: dict[int, Any], chunk: Chunk, pause_s: float) -> dict[int, Any]:
    calls = {}
    for s, actor in survivors.items():  # one after the other when a test stretches the window
        if pause_s and calls:
            time.sleep(pause_s)
        method, args = ("read_stripes", chunk) if isinstance(chunk, tuple) else ("gather", (chunk,))
        calls[s] = call_server(actor, method, *args)
    return calls


def _first(chunk: Chunk) -> int:
    return int(chunk[0])


@dataclass(frozen=True)
class ChunkCopied:
    """What a copy task did, timed on its worker: the rebuild record adds these up, so that a report
    tells the task's own time from its dispatch (submit -> start, through the scheduler)."""

    rows: int
    task_seconds: float  # start -> end of the task on the replacement's worker
    read_wait_seconds: float  # waiting for the survivors' answers (what was not read ahead)
    install_seconds: float  # decode + install on the replacements


def rebuild_chunk_task(k: int, r: int, survivors: dict[int, Any], replacements: dict[int, Any],
                       chunk: Chunk, n_rows: dict[int, int], pause_s: float = 0.0, *,
                       rebuild_id: str = "", next_chunk: Chunk | None = None,
                       previous: Any = None, seconds: float = 0.0) -> ChunkCopied:
    """Runs as a Dask task on a replacement's worker: read the chunk's stripes (``(start, stop)``, or
    a sorted array of stripes) from the survivors (worker to worker), decode the lost members,
    install them on their replacements. ``n_rows``: how many of the chunk's stripes each lost
    member holds (fewer when a data shard ends earlier).

    Before decoding it sends the reads of ``next_chunk``, so they travel while this chunk is
    decoded and installed (two chunks in memory at most). ``previous`` is the previous chunk's
    task: depending on it keeps the tasks in chunk order. No lock is held: the caller fixes up the
    stripes written meanwhile (see the module docstring; a read-ahead is inside the same window).

    Every read and install watches its worker (:class:`~dlrmflow.engine.embedding_server.ServerCall`):
    a read from a killed survivor could otherwise wait for the survivor actor's future in this
    worker's client, which may never settle, and hold this worker's one thread for good.

    ``seconds`` > 0 paces the rebuild (a rate limit): the task lasts at least that long, and the
    next chunk's reads go out at its end, so the survivors' sends are spread out as well."""
    began = time.perf_counter()
    for key in [key for key in _READ_AHEAD if key[0] != rebuild_id]:
        del _READ_AHEAD[key]
    calls = _READ_AHEAD.pop((rebuild_id, _first(chunk)), None) or _read_chunk(survivors, chunk, pause_s)
    if next_chunk is not None and not seconds:
        _READ_AHEAD[(rebuild_id, _first(next_chunk))] = _read_chunk(survivors, next_chunk, pause_s)
    waiting = time.perf_counter()
    pieces = {s: answer(call) for s, call in calls.items()}
    installing = time.perf_counter()
    decoded = ErasureCode(k, r).decode(pieces, sorted(replacements), n_rows=n_rows)
    installs = []
    for s in sorted(replacements):
        if isinstance(chunk, tuple):
            method, args = "install", (chunk[0], decoded[s], rebuild_id)
        else:
            method, args = "install_stripes", (chunk[: n_rows[s]], decoded[s], rebuild_id)
        local = _local_actor(replacements[s])
        if local is not None:  # this worker hosts it: copy in memory, not through a socket to itself
            getattr(local, method)(*args)
        else:
            installs.append(call_server(replacements[s], method, *args))
    for call in installs:
        answer(call)
    installed = time.perf_counter()
    if seconds:
        time.sleep(max(0.0, seconds - (time.perf_counter() - began)))
        if next_chunk is not None:
            _READ_AHEAD[(rebuild_id, _first(next_chunk))] = _read_chunk(survivors, next_chunk, pause_s)
    return ChunkCopied(sum(n_rows.values()), time.perf_counter() - began, installing - waiting, installed - installing)


def _local_actor(actor: Any) -> Any:
    """The object behind ``actor`` when this worker hosts it, else None.

    Installing from this task's thread races with write-backs that the actor's thread applies to
    the same rows; that is the race the dirty log covers: a stripe written meanwhile is logged and
    re-installed under the lock (step 3), and no other stripe is written during the copy."""
    try:
        from distributed import get_worker

        return get_worker().state.actors.get(actor.key)
    except (ValueError, AttributeError):  # not on a worker, or another distributed version
        return None


def _survivors(group: CodedShardGroup, lost: list[int]) -> tuple[int, ...]:
    return group.code.survivors_for([s for s in range(group.code.n_shards) if s not in lost])


def _submit_copies(group: CodedShardGroup, lost: list[int], chunks: list[np.ndarray], worker: str,
                   rebuild_id: str) -> list:
    """Step 2 for every chunk at once: bulk-copy tasks on ``worker``, in chunk order (no lock held).

    They run one after the other on the replacement's worker while the rebuild thread fixes up the
    chunks already copied, so the per-task round trip is paid once, not per chunk; each task sends
    the next chunk's reads before it decodes its own. A chunk of consecutive stripes travels as
    ``(start, stop)`` and is read as a slice (every stripe written: no index array to send)."""
    with group.lock:
        survivors = {s: group.members[s] for s in _survivors(group, lost)}
        replacements = {s: group.replacement[s] for s in lost}
    sent = [(int(c[0]), int(c[-1]) + 1) if int(c[-1]) - int(c[0]) + 1 == len(c) else c for c in chunks]
    futures = []
    for i, (stripes, chunk) in enumerate(zip(chunks, sent, strict=True)):
        # Chunks are sorted: a data shard that ends earlier holds a prefix of each.
        n_rows = {s: int(np.searchsorted(stripes, group.rows_of[s])) for s in lost}
        futures.append(group.client.submit(
            rebuild_chunk_task, group.code.k, group.code.r, survivors, replacements, chunk, n_rows,
            COPY_PAUSE_S, rebuild_id=rebuild_id, next_chunk=sent[i + 1] if i + 1 < len(sent) else None,
            previous=futures[-1] if futures else None, workers=[worker], allow_other_workers=False, pure=False,
            seconds=sum(n_rows.values()) * group.spec.row_bytes / group.rebuild_rate if group.rebuild_rate else 0.0,
            priority=len(chunks) - i))
    return futures


def chunk_stripes(group: CodedShardGroup, n_lost: int) -> int:
    """Stripes per chunk: ``rebuild_chunk``, or fewer with a rate limit, so that a paced chunk lasts
    about PACED_CHUNK_S (a burst of 17 MB per survivor every 0.18 s stalls training more than
    many small ones)."""
    if not group.rebuild_rate:
        return group.rebuild_chunk
    paced = int(group.rebuild_rate * PACED_CHUNK_S / (group.spec.row_bytes * n_lost))
    return max(1, min(group.rebuild_chunk, paced))


class _Superseded(Exception):
    """A new loss (or a fatal one) came in while a chunk was being copied: start over."""


def _wait_done(group: CodedShardGroup, future, generation: int, worker: str, poll_s: float = 0.2) -> Any:
    """The result of a task or actor pinned to ``worker``. Pinned to a worker that died, it would wait
    for it forever, so this also watches for that worker's loss (OSError) and for a new generation."""
    while True:
        try:
            return future.result(timeout=poll_s)
        except TimeoutError:
            if future.done():  # the task's own TimeoutError (or done as the wait ran out): its outcome
                return future.result()
        with group.lock:
            if group.generation != generation or group.fatal is not None:
                raise _Superseded()
        if worker not in cluster_workers(group.client):
            raise OSError(f"the worker {worker} the rebuild uses is gone")


def _fix_up(group: CodedShardGroup, lost: list[int], stripes: np.ndarray, rebuild_id: str) -> None:
    """Step 3 (lock held): re-read, decode and install ``stripes`` written during the bulk copy.

    The data shards hold every batch (the trainer returns from a batch once they acknowledged it);
    the pending parity deltas go out with the re-read, and a surviving parity shard applies them
    before it reads (as in a degraded read), so the re-read is one round trip. A replacement
    parity shard gets them too, and acknowledges them before the install overwrites those stripes.
    With no stripe to fix nothing is read or sent: every delta still unsent is of a logged stripe."""
    if not len(stripes):
        return
    survivors = _survivors(group, lost)
    k = group.code.k
    group._await_acks()  # earlier parity messages land before this read of parity
    calls = [(s, remote(group.members[s], "gather", stripes)) for s in survivors if s < k]
    calls += group._send_pending(gather=stripes, to=survivors)
    results, error = _wait_all(calls)
    if error:
        raise error
    decoded = group.code.decode({s: results[s] for s in survivors}, lost)
    # Stripes past a short data shard's end decode to zero rows that the shard does not hold.
    calls = [(s, remote(group.replacement[s], "install_stripes", stripes[stripes < group.rows_of[s]],
                        decoded[s][stripes < group.rows_of[s]], rebuild_id)) for s in lost]
    _, error = _wait_all(calls)
    if error:
        raise error


def _stripes_to_copy(group: CodedShardGroup, lost: list[int], rebuild_id: str) -> np.ndarray:
    """Step 0 (lock held, every batch settled): every replacement starts over from its initial rows
    (all fresh), as the target of ``rebuild_id`` alone; the stripes to copy are those with a row the
    trainer wrote. Raises LostMembersError."""
    _, error = _wait_all([(s, remote(group.replacement[s], "reset", rebuild_id)) for s in lost])
    if error:
        raise error
    if REBUILD_EVERY_STRIPE:
        return np.arange(group.n_stripes, dtype=np.int64)
    return group.stripes_to_copy(lost)


def rebuild_lost(group: CodedShardGroup, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Rebuild every lost member of ``group`` on replacements; returns what was rebuilt."""
    while True:
        with group.lock:
            group._raise_fatal()
            lost, generation = sorted(group.lost), group.generation
            need = [s for s in lost if s not in group.replacement]
            record = group.recoveries[-1]
            if not lost:  # decided under the lock: a later loss starts a new recovery thread
                group.recovering = False
                return record.as_dict(group.code.k, group.started_at)
        placing = time.perf_counter()
        try:
            placed = _place_replacements(group, need, generation)  # outside the lock: may wait for a fresh worker
        except _Superseded:
            continue
        with group.lock:
            for s, (worker, future, actor) in placed.items():
                if s in group.lost and s not in group.replacement:
                    group.replacement[s], group.replacement_future[s] = actor, future
                    record.workers[s] = worker
            record.placement_seconds += time.perf_counter() - placing
            if group.generation != generation:
                continue
        worker = record.workers.get(lost[0]) or group.replacement_workers[lost[0]]
        with group.lock:
            group._raise_fatal()
            if group.generation != generation:
                continue
            try:
                group._settle()  # no batch in flight when the stripes to copy are chosen and the log opens
                rebuild_id = f"{id(group)}-{generation}-{time.monotonic_ns()}"
                to_copy = _stripes_to_copy(group, lost, rebuild_id)  # step 0
            except LostMembersError as exc:
                group.on_lost(exc.members, exc)
                continue
            # The stripes not to copy hold their initial rows on the replacements, but join group.rebuilt only
            # at the first fix-up (with those written meanwhile re-installed): until then a data replacement
            # gets no call from the trainer, while its worker takes in the first chunk.
            generated = np.ones(group.n_stripes, dtype=bool)
            generated[to_copy] = False
            group.rebuilt = np.zeros(group.n_stripes, dtype=bool) if len(to_copy) else generated
            group.dirty = []  # step 1: from now on every write-back logs its stripes
            record.stripes_generated = group.n_stripes - len(to_copy)
        chunks = [to_copy[a:b] for a, b in stripe_chunks(len(to_copy), chunk_stripes(group, len(lost)))]
        copying = time.perf_counter()
        futures = _submit_copies(group, lost, chunks, worker, rebuild_id)
        complete, copied, done = True, [], 0
        joins_next = generated  # stripes that join group.rebuilt at the next fix-up, besides those copied
        fixed_up = time.perf_counter()
        try:
            for n, (chunk, future) in enumerate(zip(chunks, futures, strict=True)):
                try:
                    task, failure = _wait_done(group, future, generation, worker), None
                except _Superseded:
                    complete = False
                    break
                except Exception as exc:  # noqa: BLE001 - a dead survivor or replacement; found below
                    task, failure = None, exc
                if failure is None:
                    record.chunks += 1
                    record.stripes += len(chunk)
                    record.rows_rebuilt += task.rows
                    record.copy_task_seconds += task.task_seconds
                    record.copy_read_wait_seconds += task.read_wait_seconds
                    record.copy_install_seconds += task.install_seconds
                    copied.append(chunk)
                    # Copied; fixed up (and then read from the replacement) with later chunks, unless a new
                    # loss came in: the locked section below sees it and starts over without copying on.
                    if (n + 1 < len(chunks) and time.perf_counter() - fixed_up < FIX_UP_INTERVAL_S
                            and group.generation == generation):
                        continue
                with group.lock:
                    locked = time.perf_counter()
                    group._raise_fatal()
                    if group.generation != generation:
                        complete = False
                        break
                    try:
                        if failure is not None:
                            dead = group.find_dead()
                            if not dead:
                                raise failure
                            raise LostMembersError(dead, failure)
                        logged = np.unique(np.concatenate(group.dirty)) if group.dirty else np.zeros(0, np.int64)
                        group.dirty = [logged]
                        just_copied = np.concatenate(copied)
                        joining = joins_next.copy()
                        joining[just_copied] = True
                        stripes = logged[joining[logged]]
                        _fix_up(group, lost, stripes, rebuild_id)  # step 3, for every chunk copied since the last one
                    except LostMembersError as exc:
                        group.on_lost(exc.members, exc)  # raises when more than R are lost
                        complete = False
                        break
                    group.rebuilt |= joining
                    joins_next = np.zeros_like(generated)
                    record.stripes_fixed_up += len(stripes)
                    record.locked_seconds += time.perf_counter() - locked
                    record.fix_ups += 1
                done += len(just_copied)
                copied = []
                fixed_up = time.perf_counter()
                if progress is not None:
                    progress(done, len(to_copy))
                time.sleep(YIELD_S)
        finally:
            with group.lock:
                group.dirty = None
            group.client.cancel([f for f in futures if not f.done()])
            record.copy_seconds += time.perf_counter() - copying
        if not complete:
            continue
        with group.lock:
            if group.generation != generation:
                continue
            for s in lost:  # reads go to the rebuilt members from now on
                group.members[s] = group.replacement.pop(s)
                group.member_futures[s] = group.replacement_future.pop(s)
                group.worker_of[s] = record.workers.get(s, group.replacement_workers.get(s, "?"))
            group.actors = group.members[: group.code.k]
            group.futures = group.member_futures[: group.code.k]
            group.lost.clear()
            group.rebuilt = None
            record.rebuilt_at = time.perf_counter()
        # Back to the top: it returns there (under the lock) unless a loss came in meanwhile.
