"""Rebuilding the lost members of a coded shard group while training runs: the rebuild thread and
its copy tasks.

On a loss the group has :func:`start_rebuild_thread` called. The thread (1) takes the lost member's
standby replacement, started with the group on a spare worker, or else starts a replacement actor
on a worker that hosts no live member (waiting a little for one, else the least loaded), then (2)
rebuilds the lost members chunk by chunk: a Dask task on the replacement's worker
(:func:`rebuild_chunk_task`) pulls a chunk's stripes from K survivors worker to worker, decodes
and installs them, while training goes on; the tasks of all chunks are submitted at once and run
in chunk order. Only stripes with a row the trainer wrote are copied; the replacements generate the
others from the seed. Under the group's lock the thread then *fixes up* the copied chunks: the
stripes written since the dirty log opened are re-read, decoded and installed, and the chunks join
``rebuilt``. When every chunk is in, the replacements take the lost members' places.

Every change of the recovery state goes through the group's
:class:`~dlrmflow.engine.coding.rebuild_state.RebuildState` (under ``group.lock``), and so does every
decision: which members to rebuild and where, when to fix up, when to start over, when to give up.
:func:`rebuild_lost` is a driver loop (:class:`RebuildDriver`): it asks the state for an instruction,
carries it out with the actors and reports the outcome as an event, which answers with the next
instruction; this module only does the network and the waiting. Why a rebuilt stripe is one
consistent version although the bulk copy runs while training writes, and why copying only the
written stripes is enough: docs/rebuild.md. A further loss during a rebuild starts it over for
everything lost, in a new generation; the replacements' reset names the new rebuild, so an install
from a copy task of the abandoned one (a running task cannot be stopped) changes nothing.

:func:`rebuild_lost` is a plain function (tested without Prefect). With a ``recovery_runner`` (the
train flow's ``recover-shard`` subflow) the rebuild still starts at once and the runner reports it
(:func:`rebuild_while_reporting`).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.group import CodedShardGroup
from dlrmflow.engine.coding.members import member_name, start_member
from dlrmflow.engine.coding.rebuild_state import (
    AwaitChunk,
    ChunkCopied,
    CopyChunks,
    EndCopy,
    FindDead,
    FinishRebuild,
    FixUp,
    GiveUp,
    PlaceReplacements,
    PrepareCopy,
    RebuildStep,
    Rebuilt,
    ReportLoss,
    ReportProgress,
    ResetReplacements,
    StartOver,
)
from dlrmflow.engine.coding.record import rebuild_start_sentence, recovery_sentence
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.dask_internals import local_actor
from dlrmflow.engine.serving.placement import choose_rebuild_worker, least_loaded_worker
from dlrmflow.engine.serving.shards import LostMembersError, answer, call_server, remote, wait_all

FRESH_WORKER_WAIT_S = 10.0  # how long a rebuild waits for a worker that hosts no live member
# Copied chunks wait this long for their fix-up, which then covers all of them at once: a fix-up holds
# the trainer for two round trips to servers busy with the copy, whatever its size.
FIX_UP_INTERVAL_S = 0.5
PACED_CHUNK_S = 0.05  # with a rebuild rate: chunks this long, so the copy's sends come in small pieces
# Copy every stripe, as if every row had been trained, not only those with a row the trainer wrote:
# the worst case (a table trained for an epoch or more), for benchmarks and tests that need many chunks.
REBUILD_EVERY_STRIPE = False
# Knobs for the real-cluster tests: a pause between a bulk copy's survivor reads (writes land in between,
# so the fix-up has work) and after each fix-up (training reads unrebuilt stripes meanwhile).
COPY_PAUSE_S = 0.0
YIELD_S = 0.0


# The rebuild's start and end, as they happen (a plain logger: the train flow routes it to the run's Prefect log).
EVENTS = logging.getLogger(__name__)


def start_rebuild_thread(group: CodedShardGroup) -> threading.Thread:
    """The thread that rebuilds ``group``'s lost members until none is lost (or a loss is fatal)."""
    # Run in a copy of the caller's context: under Prefect the recovery subflow then knows its parent.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(_run, group), name="dlrmflow-recovery", daemon=True)
    thread.start()
    return thread


def _run(group: CodedShardGroup) -> None:
    try:
        with group.lock:
            lost = sorted(group.state.lost)
            info = {"lost": [member_name(s, group.code.k) for s in lost], "stripes": group.n_stripes,
                    "chunk": chunk_stripes(group, len(lost))}
        EVENTS.info("%s", rebuild_start_sentence(info["lost"], info["stripes"], info["chunk"]))
        if group.recovery_runner is not None:  # its report says what the rebuild did
            rebuild_while_reporting(group, info)
        else:
            rebuild_lost(group)
    except BaseException as exc:  # noqa: BLE001 - the trainer re-raises it at its next call
        with group.lock:
            group.state.rebuild_failed(exc)


class LateProgress:
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


def rebuild_while_reporting(group: CodedShardGroup, info: dict[str, Any]) -> None:
    """Start the rebuild at once, in a thread of its own, and hand ``group.recovery_runner`` (the
    ``recover-shard`` subflow, slow to start) a callable that waits for it and returns its record.

    A runner's failure is fatal; this returns only after the rebuild has ended, whatever the runner did."""
    progress = LateProgress()
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
    started_at = time.perf_counter()
    worker.start()

    def report(reporter: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        progress.attach(reporter)
        return outcome.result()

    # For the report's own account of its timing: the rebuild started before it (perf_counter) and may have ended.
    report.started_at, report.finished = started_at, outcome.done

    try:
        group.recovery_runner(report, info)
    finally:
        worker.join()
    outcome.result()  # the rebuild's own failure, had the runner returned without asking for it


# ---- replacements ----------------------------------------------------------------------------------


class Superseded(Exception):
    """A new loss (or a fatal one) came in while the rebuild waited: start over."""


def choose_worker(group: CodedShardGroup, wait_s: float = FRESH_WORKER_WAIT_S) -> str:
    """A worker hosting no live member, on a host without one if possible (waiting up to ``wait_s``
    for one), else the least loaded."""
    deadline = time.perf_counter() + wait_s
    while True:
        with group.lock:
            busy, dead = group.state.busy_workers(), set(group.state.dead_workers)
        info = cluster_workers(group.client)
        worker = choose_rebuild_worker(info, busy, dead)
        if worker is not None:
            return worker
        if time.perf_counter() > deadline:
            worker = least_loaded_worker(info, busy, dead)  # shares a fault domain: better than none
            if worker is None:
                raise RuntimeError(f"no Dask worker to rebuild a lost shard on (waited {wait_s:.0f} s)")
            return worker
        time.sleep(0.1)


def wait_done(group: CodedShardGroup, future, generation: int, worker: str, poll_s: float = 0.2) -> Any:
    """The result of a task or actor pinned to ``worker``. Pinned to a worker that died, it would wait
    for it forever, so this also watches for that worker's loss (OSError) and for a new generation
    (:class:`Superseded`).

    It waits on the future's done callback, not on ``future.result(timeout=...)``: under load, Dask's
    ``sync`` can see its timeout expire as the result arrives, cancel its own wait and then raise
    ``UnboundLocalError`` (seen with the 0.2 s poll at a load average of 10+, failing a rebuild)."""
    finished = threading.Event()
    future.add_done_callback(lambda _: finished.set())
    while True:
        if finished.wait(poll_s) or future.done():
            return future.result()  # done: no timeout, no race
        with group.lock:
            if not group.state.is_current(generation):
                raise Superseded()
        if worker not in cluster_workers(group.client):
            raise OSError(f"the worker {worker} the rebuild uses is gone")


def place_replacements(group: CodedShardGroup, need: list[int], generation: int) -> dict[int, tuple[str, Any, Any]]:
    """A started replacement ``(worker, future, actor)`` for each member of ``need``: its standby when
    that is usable (a standby whose worker died unnoticed fails its first call, and the rebuild starts
    over), else a new actor on :func:`choose_worker`'s worker. No lock held while it waits."""
    placed = {}
    for s in need:
        with group.lock:
            standby = group.state.take_standby(s)
        if standby is not None and standby[1].status == "finished":
            placed[s] = standby
            continue
        while True:
            worker = choose_worker(group)
            future = start_member(group.client, group.spec, group.code, s, worker, initialise=False)
            try:
                placed[s] = (worker, future, wait_done(group, future, generation, worker))
                break
            except OSError:  # the chosen worker died before the actor started: choose again
                with group.lock:
                    group.state.worker_died(worker)
    return placed


# ---- the bulk copy ---------------------------------------------------------------------------------

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
    task: depending on it keeps the tasks in chunk order. No lock is held: the rebuild thread fixes
    up the stripes written meanwhile (a read-ahead is inside the same window).

    Every read and install watches its worker (:class:`~dlrmflow.engine.serving.shards.ServerCall`):
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
        # This worker hosts it: copy in memory, not through a socket to itself. The install then races
        # with write-backs the actor's thread applies to the same rows: the race the dirty log covers.
        local = local_actor(replacements[s])
        if local is not None:
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


def submit_copies(group: CodedShardGroup, lost: list[int], chunks: list[np.ndarray], worker: str,
                  rebuild_id: str) -> list:
    """The copy tasks of every chunk at once, on ``worker``, in chunk order (no lock held while they run).

    They run one after the other on the replacement's worker while the rebuild thread fixes up the
    chunks already copied, so the per-task round trip is paid once, not per chunk; each task sends
    the next chunk's reads before it decodes its own. A chunk of consecutive stripes travels as
    ``(start, stop)`` and is read as a slice (no index array to send)."""
    with group.lock:
        survivors = {s: group.state.members[s] for s in group.state.survivors(lost)}
        replacements = {s: group.state.replacement[s] for s in lost}
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
    about PACED_CHUNK_S (many small bursts stall training less than a few large ones)."""
    if not group.rebuild_rate:
        return group.rebuild_chunk
    paced = int(group.rebuild_rate * PACED_CHUNK_S / (group.spec.row_bytes * n_lost))
    return max(1, min(group.rebuild_chunk, paced))


# ---- the steps under the lock ----------------------------------------------------------------------


def reset_replacements(group: CodedShardGroup, lost: list[int], rebuild_id: str) -> np.ndarray:
    """Step 0 (lock held, every batch settled): every replacement starts over from its initial rows
    (all fresh), as the target of ``rebuild_id`` alone; returns the stripes to copy, those with a row
    the trainer wrote. Raises LostMembersError."""
    _, error = wait_all([(s, remote(group.state.replacement[s], "reset", rebuild_id)) for s in lost])
    if error:
        raise error
    if REBUILD_EVERY_STRIPE:
        return np.arange(group.n_stripes, dtype=np.int64)
    return group.stripes_to_copy(lost)


def fix_up(group: CodedShardGroup, lost: list[int], stripes: np.ndarray, rebuild_id: str) -> None:
    """Step 3 (lock held): re-read, decode and install ``stripes`` written during the bulk copy.

    The data shards hold every batch (the trainer returns from a batch once they acknowledged it),
    and :meth:`~CodedShardGroup.read_current` has the parity survivors apply the pending deltas
    before they read. A replacement parity shard gets them too, and acknowledges them before the
    install overwrites those stripes. With no stripe to fix nothing is read or sent: every delta
    still unsent is of a logged stripe."""
    if not len(stripes):
        return
    pieces = group.read_current(stripes, group.state.survivors(lost))
    decoded = group.code.decode(pieces, lost)
    # Stripes past a short data shard's end decode to zero rows that the shard does not hold.
    calls = [(s, remote(group.state.replacement[s], "install_stripes", stripes[stripes < group.rows_of[s]],
                        decoded[s][stripes < group.rows_of[s]], rebuild_id)) for s in lost]
    _, error = wait_all(calls)
    if error:
        raise error


# ---- the driver ------------------------------------------------------------------------------------


class RebuildDriver:
    """Carries out one rebuild thread's instructions with the actors and reports their outcomes to
    ``group.state``, which decides every step. It owns what the state leaves out: the copy tasks'
    futures, the rebuild id that the replacements' reset names, and the clocks behind the record's timings.

    An instruction without ``in_hold`` runs with no lock held, and its outcome is reported in a lock hold
    of its own (:meth:`reported`); the instructions that report answers with ``in_hold`` set run in that
    same hold, until one does not."""

    def __init__(self, group: CodedShardGroup, progress: Callable[[int, int], None] | None = None) -> None:
        self.group, self.state, self.progress = group, group.state, progress
        self.report: dict[str, Any] = {}  # the recovery's record, once rebuilt
        self.copy: CopyChunks | None = None  # the copy running: its tasks are submitted, its log not closed
        self.futures: list = []  # its copy tasks, in chunk order
        self.rebuild_id = ""
        # perf_counter() when the copy was submitted, when its last fix-up ended, when the lock was last taken
        self.copying = self.fixed_up_at = self.locked_at = 0.0
        self.steps: dict[type, Callable[[Any], RebuildStep]] = {
            StartOver: self.start_over, PlaceReplacements: self.place, PrepareCopy: self.prepare_copy,
            CopyChunks: self.copy_chunks, AwaitChunk: self.await_chunk, ReportProgress: self.report_progress,
            EndCopy: self.end_copy, GiveUp: self.give_up, ResetReplacements: self.reset, FixUp: self.fix,
            FindDead: self.find_dead, ReportLoss: self.report_loss, FinishRebuild: self.finish,
        }

    def carry_out(self, step: RebuildStep) -> RebuildStep:
        """Carry out ``step`` (no lock held); the next step."""
        return self.steps[type(step)](step)

    def reported(self, event: Callable[..., RebuildStep], *args: Any) -> RebuildStep:
        """Report an outcome, ``event(*args)``, under the lock, and carry out in that hold what it answers."""
        with self.group.lock:
            self.locked_at = time.perf_counter()
            step = event(*args)
            while step.in_hold and not isinstance(step, Rebuilt):
                step = self.steps[type(step)](step)
            if isinstance(step, Rebuilt):
                self.report = self.rebuilt(step)
            return step

    # ---- without the lock ----------------------------------------------------------------------------
    def start_over(self, step: StartOver) -> RebuildStep:
        return self.reported(self.state.attempt_begun)

    def place(self, step: PlaceReplacements) -> RebuildStep:
        placing = time.perf_counter()
        try:  # outside the lock: may wait for a fresh worker
            placed = place_replacements(self.group, list(step.need), step.generation)
        except Superseded:
            return self.reported(self.state.placement_superseded, step)
        # The placement's time counts the wait for the lock, as the replacements are taken in that hold.
        return self.reported(lambda: self.state.replacements_started(step, placed, time.perf_counter() - placing))

    def prepare_copy(self, step: PrepareCopy) -> RebuildStep:
        return self.reported(self.state.reset_begun, step)

    def copy_chunks(self, step: CopyChunks) -> RebuildStep:
        self.copying = time.perf_counter()
        self.futures = submit_copies(self.group, list(step.lost), list(step.chunks), step.worker,
                                     self.rebuild_id)  # step 2
        self.copy, self.fixed_up_at = step, time.perf_counter()
        return step.then

    def await_chunk(self, step: AwaitChunk) -> RebuildStep:
        try:
            task = wait_done(self.group, self.futures[step.n], step.generation, self.copy.worker)
        except Superseded:
            return self.reported(self.state.copy_task_superseded, step)
        except Exception as exc:  # noqa: BLE001 - a dead survivor or replacement; found in the report's hold
            return self.reported(self.state.copy_task_failed, step, exc)
        return self.reported(self.state.copy_task_done, step, task, time.perf_counter() - self.fixed_up_at,
                             FIX_UP_INTERVAL_S)

    def report_progress(self, step: ReportProgress) -> RebuildStep:
        self.fixed_up_at = time.perf_counter()
        if self.progress is not None:
            self.progress(step.done, step.total)
        time.sleep(YIELD_S)
        return step.then

    def end_copy(self, step: EndCopy) -> RebuildStep:
        seconds = self.close_copy()
        return self.reported(self.state.copy_ended, step, seconds)

    def close_copy(self) -> float:
        """Close the log and cancel the copy tasks still running (a task of an abandoned copy installs
        nothing once the replacements are reset); the copy's wall-clock time."""
        self.copy = None
        with self.group.lock:
            self.state.log_closed()
        self.group.client.cancel([f for f in self.futures if not f.done()])
        return time.perf_counter() - self.copying

    def abandon_copy(self) -> None:
        """After a failure (it propagates): a copy still running is closed, and its time recorded."""
        if self.copy is None:
            return
        end = EndCopy(self.copy.generation)
        seconds = self.close_copy()
        with self.group.lock:
            self.state.copy_ended(end, seconds)  # what it answers is not carried out: the thread ends

    # ---- in the hold of the report that asked for them ---------------------------------------------
    def rebuilt(self, step: Rebuilt) -> dict[str, Any]:
        report = step.record.as_dict(self.group.code.k, self.group.started_at)
        if report["seconds"] is not None:  # with a runner, its recover-shard flow run gives the figures
            EVENTS.info("%s", recovery_sentence(report) if self.group.recovery_runner is None else
                        f"rebuilt {', '.join(report['lost'])}: {report['seconds']:.3f} s after detection (the "
                        f"figures: its recover-shard flow run)")
        return report

    def give_up(self, step: GiveUp) -> RebuildStep:
        raise step.error

    def reset(self, step: ResetReplacements) -> RebuildStep:
        try:
            self.group.settle()  # no batch in flight when the stripes to copy are chosen and the log opens
            self.rebuild_id = f"{id(self.group)}-{step.generation}-{time.monotonic_ns()}"
            to_copy = reset_replacements(self.group, list(step.lost), self.rebuild_id)  # step 0
        except LostMembersError as exc:
            return self.state.reset_failed(step, exc.members, exc)
        return self.state.replacements_reset(step, to_copy, chunk_stripes(self.group, len(step.lost)))  # step 1

    def fix(self, step: FixUp) -> RebuildStep:
        try:
            fix_up(self.group, list(step.lost), step.stripes, self.rebuild_id)  # step 3
        except LostMembersError as exc:
            return self.state.fix_up_failed(step, exc.members, exc)
        return self.state.fix_up_done(step, time.perf_counter() - self.locked_at)

    def find_dead(self, step: FindDead) -> RebuildStep:
        dead = self.group.find_dead()
        return self.state.dead_found(step, dead, LostMembersError(dead, step.failure))

    def report_loss(self, step: ReportLoss) -> RebuildStep:
        self.group.on_lost(step.members, step.cause, step.during)  # raises TooManyErasuresError past R
        return step.then

    def finish(self, step: FinishRebuild) -> RebuildStep:
        self.group.finish_rebuild(step.generation)  # nothing when a loss superseded the generation
        return step.then


def rebuild_lost(group: CodedShardGroup, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Rebuild every lost member of ``group`` on replacements; returns the recovery's record.

    ``group.state`` decides every step (from
    :meth:`~dlrmflow.engine.coding.rebuild_state.RebuildState.attempt_begun` on); the driver carries each
    out with the actors and reports its outcome, which answers with the next."""
    driver = RebuildDriver(group, progress)
    step: RebuildStep = StartOver()
    try:
        while not isinstance(step, Rebuilt):
            step = driver.carry_out(step)
    finally:
        driver.abandon_copy()  # a failure mid-copy: the log closes and the copy tasks stop
    return driver.report
