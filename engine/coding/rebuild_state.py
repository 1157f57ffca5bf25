"""The recovery state of a coded shard group, and the only code that changes it.

:class:`RebuildState` holds which members are lost, their replacements, which stripes the
replacements hold (``rebuilt``), the dirty log of stripes written during a bulk copy, the
generation (bumped by every loss) and the rebuild thread's current :class:`Attempt`. It owns them
alone: the write path and the rebuild thread change them only through its transitions, with the
group's lock held around every call, and read them through its queries (:meth:`target`,
:meth:`is_rebuilt`, :meth:`survivors`). Attributes are read-only outside this class. No network,
no threads, no clocks: times come in as arguments.

Who reports what:

- the write path: a member whose worker died (:meth:`member_lost`, which may return
  :class:`StartRebuild`), the stripes a batch touches (:meth:`write_logged`);
- the rebuild thread: the outcome of each instruction the state gave it. Its driver
  (:func:`~dlrmflow.engine.coding.rebuild.rebuild_lost`) asks :meth:`attempt_begun` what to do,
  carries the instruction out with the actors, and reports the outcome as an event
  (:meth:`replacements_started`, :meth:`replacements_reset`, :meth:`copy_task_done`,
  :meth:`fix_up_done`, ...), which answers with the next instruction. Every decision (which members
  to rebuild, where the copy runs, when to fix up, when to start over, when to give up) is made
  here; the driver only does the network and the waiting;
- the rebuild thread's own death: :meth:`rebuild_failed` (fatal; the trainer re-raises it).

A worker that dies is a member lost: everything lost is rebuilt from the start in a new generation,
and the running attempt, at its next event, sees that generation and starts over (:class:`StartOver`).
Losing more than R is fatal (TooManyErasuresError, kept in ``fatal``, and raised where the loss is
reported): the thread gives up (:class:`GiveUp`) at its next check. So the thread ends in :class:`Rebuilt` or a
clear error, and starts over only after a loss: finitely many losses, finitely many attempts.

An instruction with ``in_hold`` set is carried out with the lock still held, in the hold of the
transition that returned it, and its outcome reported in that same hold: nothing the trainer does
comes in between (a fix-up is exact only so). The others are carried out without the lock, and the
driver takes it again to report their outcome.

The invariants, argued in docs/rebuild.md:

- A stripe is in ``rebuilt`` only when every lost member's replacement holds its current version;
  from then on every write-back batch writes its rows of that stripe through to the replacement.
- The dirty log opens when no batch is in flight, and every batch after it appends the stripes it
  touches before it sends anything. A stripe copied and not in the log at the fix-up was written by
  no batch since the log opened, so its decode is exact; a logged one is re-read under the lock.
- Every transition of a rebuild names its generation; one of an older generation (a rebuild that a
  further loss superseded) changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dlrmflow.engine.coding.erasure import ErasureCode, stripe_chunks
from dlrmflow.engine.coding.record import RecoveryRecord
from dlrmflow.engine.errors import UserInputError

Standby = tuple[str, Any, Any]  # (worker, actor future, actor): a fresh replacement started in advance


class GroupClosedError(RuntimeError):
    """The group was closed (its run stopped, for whatever reason) before a rebuild in flight ended."""


@dataclass(frozen=True)
class StartRebuild:
    """Action: no rebuild thread owns the lost members; start one."""


@dataclass(frozen=True)
class ChunkCopied:
    """What a copy task did, timed on its worker (:meth:`RebuildState.copy_task_done` adds it to the
    record, so that a report tells the task's own time from its dispatch: submit -> start, through
    the scheduler)."""

    rows: int
    task_seconds: float  # start -> end of the task on the replacement's worker
    read_wait_seconds: float  # waiting for the survivors' answers (what was not read ahead)
    install_seconds: float  # decode + install on the replacements


# ---- the rebuild thread's instructions --------------------------------------------------------------
@dataclass(frozen=True)
class Rebuilt:
    """Instruction (in the hold): nothing is lost; the thread ends with ``record``'s report (a later loss
    starts a new thread)."""

    in_hold: ClassVar[bool] = True
    record: RecoveryRecord


@dataclass(frozen=True)
class GiveUp:
    """Instruction (in the hold): raise ``error`` (a fatal loss, or a copy task's failure with every
    member alive); the thread ends, and the trainer re-raises it."""

    in_hold: ClassVar[bool] = True
    error: BaseException


@dataclass(frozen=True)
class StartOver:
    """Instruction: take the lock again and ask :meth:`RebuildState.attempt_begun` (a loss may come in
    meanwhile: it is rebuilt by this thread)."""

    in_hold: ClassVar[bool] = False


@dataclass(frozen=True)
class PlaceReplacements:
    """Instruction: start a replacement for each member of ``need`` (the lost members ``lost`` that have
    none), waiting for a fresh worker if need be; report :meth:`RebuildState.replacements_started`, or
    :meth:`RebuildState.placement_superseded` when the wait saw a new generation."""

    in_hold: ClassVar[bool] = False
    generation: int
    lost: tuple[int, ...]
    need: tuple[int, ...]


@dataclass(frozen=True)
class PrepareCopy:
    """Instruction: take the lock again for steps 0 and 1 and report :meth:`RebuildState.reset_begun`."""

    in_hold: ClassVar[bool] = False
    generation: int


@dataclass(frozen=True)
class ResetReplacements:
    """Instruction (in the hold): steps 0 and 1. Settle every batch, reset the replacements of ``lost``
    to fresh as the target of a new rebuild id, and report the stripes to copy and the chunk size
    (:meth:`RebuildState.replacements_reset`), or the members found lost
    (:meth:`RebuildState.reset_failed`)."""

    in_hold: ClassVar[bool] = True
    generation: int
    lost: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class CopyChunks:
    """Instruction: step 2. Submit the copy tasks of every chunk at once, in order, on ``worker``; then
    carry out ``then``."""

    in_hold: ClassVar[bool] = False
    generation: int
    lost: tuple[int, ...]
    chunks: tuple[np.ndarray, ...]
    worker: str
    then: AwaitChunk | EndCopy


@dataclass(frozen=True)
class AwaitChunk:
    """Instruction: wait for chunk ``n``'s copy task; report :meth:`RebuildState.copy_task_done`,
    :meth:`RebuildState.copy_task_failed` or :meth:`RebuildState.copy_task_superseded`."""

    in_hold: ClassVar[bool] = False
    generation: int
    n: int


@dataclass(frozen=True)
class FixUp:
    """Instruction (in the hold): step 3. Re-read ``stripes`` (logged since the log opened, in the stripes
    about to join ``rebuilt``) from the survivors, decode and install them on the replacements of
    ``lost``, then report :meth:`RebuildState.fix_up_done` (which calls :meth:`RebuildState.fixed_up`)
    or :meth:`RebuildState.fix_up_failed`."""

    in_hold: ClassVar[bool] = True
    generation: int
    stripes: np.ndarray
    joining: np.ndarray  # one flag per stripe: those that join ``rebuilt`` once fixed up
    copied: int  # stripes copied since the last fix-up
    lost: tuple[int, ...] = ()


@dataclass(frozen=True)
class FindDead:
    """Instruction (in the hold): a copy task failed with ``failure``; ask every member and replacement
    and report those that do not answer (:meth:`RebuildState.dead_found`)."""

    in_hold: ClassVar[bool] = True
    generation: int
    failure: BaseException


@dataclass(frozen=True, eq=False)
class ReportLoss:
    """Instruction (in the hold): ``members`` are gone, as ``cause`` showed: tell the group
    (``CodedShardGroup.on_lost``, which logs it and reports :meth:`RebuildState.member_lost`; raises
    TooManyErasuresError past R), then carry out ``then``."""

    in_hold: ClassVar[bool] = True
    members: set[int]
    cause: BaseException
    then: StartOver | EndCopy
    during: str = "rebuilding"  # what the rebuild was doing when it noticed (the record's "noticed by")


@dataclass(frozen=True)
class ReportProgress:
    """Instruction: ``done`` of ``total`` stripes to copy are copied and fixed up: tell the progress
    callback, pause (training reads the stripes not yet rebuilt meanwhile), then carry out ``then``."""

    in_hold: ClassVar[bool] = False
    done: int
    total: int
    then: AwaitChunk | EndCopy


@dataclass(frozen=True)
class EndCopy:
    """Instruction: the copy stops (every chunk fixed up, or abandoned). Close the log
    (:meth:`RebuildState.log_closed`), cancel the copy tasks still running, and report
    :meth:`RebuildState.copy_ended` with the copy's wall-clock time."""

    in_hold: ClassVar[bool] = False
    generation: int


@dataclass(frozen=True)
class FinishRebuild:
    """Instruction (in the hold): every chunk is fixed up: the replacements take the lost members' places
    (``CodedShardGroup.finish_rebuild``, which reports :meth:`RebuildState.rebuild_finished`; nothing
    when a loss superseded ``generation``), then carry out ``then``."""

    in_hold: ClassVar[bool] = True
    generation: int
    then: StartOver


RebuildStep = (Rebuilt | GiveUp | StartOver | PlaceReplacements | PrepareCopy | ResetReplacements | CopyChunks
               | AwaitChunk | FixUp | FindDead | ReportLoss | ReportProgress | EndCopy | FinishRebuild)


@dataclass
class Attempt:
    """The rebuild thread's attempt at rebuilding ``lost`` in ``generation`` (a further loss makes it
    start over in a new one): its record, where it copies, and how far it is."""

    generation: int
    lost: tuple[int, ...]
    record: RecoveryRecord
    worker: str = ""  # where the copy tasks run: the first lost member's replacement's worker
    chunks: tuple[np.ndarray, ...] = ()
    total: int = 0  # stripes to copy
    next_chunk: int = 0  # the chunk whose copy task is awaited (or reported) next
    done: int = 0  # stripes copied and fixed up
    complete: bool = False  # every chunk fixed up: the replacements may take the lost members' places


class RebuildState:
    """Who serves each member, what is lost, and how far its rebuild is (see the module docstring)."""

    def __init__(self, code: ErasureCode, n_stripes: int, members: list, futures: list, workers: list[str]) -> None:
        self.code, self.n_stripes = code, n_stripes
        # The member table: member s's actor, its future (holding it keeps the actor alive), its worker.
        self.members, self.member_futures, self.worker_of = list(members), list(futures), list(workers)
        self.lost: set[int] = set()
        self.replacement: dict[int, Any] = {}
        self.replacement_future: dict[int, Any] = {}
        self.replacement_workers: dict[int, str] = {}
        # Replacements started in advance on a spare worker, one per member, all fresh: a rebuild takes
        # its member's instead of starting an actor while training waits.
        self.standby: dict[int, Standby] = {}
        self.dead_workers: set[str] = set()
        # While a rebuild runs: True for the stripes every lost member's replacement holds (never
        # written, or installed); None until the rebuild knows which (nothing is read from replacements).
        self.rebuilt: np.ndarray | None = None
        self.dirty: list[np.ndarray] | None = None  # while the log is open: stripes written since it opened
        self.copied: list[np.ndarray] = []  # chunks copied since the last fix-up
        self.joins_next: np.ndarray | None = None  # stripes joining ``rebuilt`` at the next fix-up, besides those
        self.generation = 0
        self.recoveries: list[RecoveryRecord] = []
        self.fatal: BaseException | None = None
        self.recovering = False  # a rebuild thread owns the lost members
        self.attempt: Attempt | None = None  # that thread's current attempt

    # ---- queries ----------------------------------------------------------------------------------
    def target(self, s: int) -> Any:
        """Who receives member ``s``'s traffic now: itself, its replacement, or nobody yet (None)."""
        if s not in self.lost:
            return self.members[s]
        return self.replacement.get(s)

    def is_rebuilt(self, stripes: np.ndarray) -> np.ndarray:
        """One flag per stripe: every replacement holds its current version (none while no rebuild knows)."""
        if self.rebuilt is None:
            return np.zeros(len(stripes), dtype=bool)
        return self.rebuilt[stripes]

    def survivors(self, lost: set[int] | list[int] | None = None) -> tuple[int, ...]:
        """The K members a decode of ``lost`` (default: every lost member) reads from."""
        lost = self.lost if lost is None else set(lost)
        return self.code.survivors_for([s for s in range(self.code.n_shards) if s not in lost])

    def busy_workers(self) -> list[str]:
        """The workers of live members and of current replacements, one entry per member."""
        busy = [self.worker_of[s] for s in range(self.code.n_shards) if s not in self.lost]
        return busy + [w for s, w in self.replacement_workers.items() if s in self.replacement]

    def current_record(self) -> RecoveryRecord:
        return self.recoveries[-1]

    def is_current(self, generation: int) -> bool:
        """No loss came in since ``generation`` and nothing is fatal."""
        return generation == self.generation and self.fatal is None

    def raise_if_fatal(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    # ---- losses -----------------------------------------------------------------------------------
    def member_lost(self, members: set[int], cause: BaseException | None, now: float,
                    noticed_by: str = "") -> StartRebuild | None:
        """Members (or replacements being rebuilt) are gone: everything lost is rebuilt from the start, in
        a new generation. ``cause`` (the failure that showed it) and ``noticed_by`` (in words, what noticed
        it: :func:`~dlrmflow.engine.coding.record.noticed_by`) go into the recovery's record. Losing
        more than R raises TooManyErasuresError, which stays fatal."""
        for s in members:
            self.dead_workers.add(self.replacement_workers.get(s) if s in self.replacement else self.worker_of[s])
            self.replacement.pop(s, None)  # a replacement that died starts over
            self.replacement_future.pop(s, None)
            if s not in self.lost:
                self.member_futures[s] = None  # release the dead actor's future (no recomputation)
        lost = self.lost | set(members)
        try:
            self.code.survivors_for([s for s in range(self.code.n_shards) if s not in lost])
        except UserInputError as exc:
            self.fatal, self.lost = exc, lost
            raise
        self.lost = lost
        self.generation += 1
        self.rebuilt, self.dirty, self.copied, self.joins_next = None, None, [], None
        if self.recoveries and self.recoveries[-1].rebuilt_at is None:
            record = self.recoveries[-1]
            record.members = sorted(lost)
            record.restarts += 1
        else:
            record = RecoveryRecord(sorted(lost), now)
            self.recoveries.append(record)
        if cause is not None:
            record.causes.append(str(cause))
            record.noticed_by.append(noticed_by)
        if self.recovering:  # the running rebuild sees the new generation and starts over
            return None
        self.recovering = True
        return StartRebuild()

    def worker_died(self, worker: str) -> None:
        """A worker chosen for a replacement died before the replacement started."""
        self.dead_workers.add(worker)

    def rebuild_failed(self, exc: BaseException) -> None:
        """The rebuild thread died with ``exc``: fatal (the trainer re-raises it at its next call)."""
        self.fatal = self.fatal or exc
        self.recovering = False

    def closed(self) -> None:
        self.fatal = self.fatal or GroupClosedError("the shard group is closed")

    def released(self) -> None:
        """The group is closed and its rebuild thread gone: drop every actor handle."""
        self.members, self.member_futures, self.replacement, self.replacement_future = [], [], {}, {}
        self.standby = {}

    # ---- a rebuild ---------------------------------------------------------------------------------
    def standbys_set(self, standby: dict[int, Standby]) -> None:
        self.standby = dict(standby)

    def take_standby(self, s: int) -> Standby | None:
        """Member ``s``'s standby, unless its worker is known dead or now hosts a live member or another
        replacement (two lost members would share a fault domain). Once: taken or dropped."""
        standby = self.standby.pop(s, None)
        if standby is None or standby[0] in self.dead_workers or standby[0] in self.busy_workers():
            return None
        return standby

    def replacement_placed(self, s: int, worker: str, future: Any, actor: Any) -> bool:
        """A replacement actor for member ``s`` started on ``worker``; taken unless ``s`` is no longer lost
        or already has one."""
        if s not in self.lost or s in self.replacement:
            return False
        self.replacement[s], self.replacement_future[s] = actor, future
        self.replacement_workers[s] = worker
        self.recoveries[-1].workers[s] = worker
        return True

    def log_opened(self, generation: int, to_copy: np.ndarray) -> bool:
        """Steps 0 and 1 (every batch settled, every replacement reset): the rebuild copies ``to_copy``
        (sorted stripes) and the replacements generate every other stripe; those join ``rebuilt`` at the
        first fix-up, or at once when nothing is to be copied. From now on every batch logs its stripes."""
        if not self.is_current(generation):
            return False
        generated = np.ones(self.n_stripes, dtype=bool)
        generated[to_copy] = False
        self.rebuilt = np.zeros(self.n_stripes, dtype=bool) if len(to_copy) else generated
        self.joins_next = generated if len(to_copy) else np.zeros(self.n_stripes, dtype=bool)
        self.dirty, self.copied = [], []
        record = self.recoveries[-1]
        record.stripes_total, record.stripes_copied = self.n_stripes, len(to_copy)
        record.stripes_generated = self.n_stripes - len(to_copy)
        return True

    def write_logged(self, stripes: np.ndarray) -> None:
        """A write-back batch touches ``stripes`` (before anything is sent)."""
        if self.dirty is not None:
            self.dirty.append(stripes)

    def chunk_copied(self, generation: int, stripes: np.ndarray) -> bool:
        """A copy task installed ``stripes`` (no lock was held while it read and installed)."""
        if not self.is_current(generation) or self.dirty is None:
            return False
        self.copied.append(np.asarray(stripes, dtype=np.int64))
        return True

    def fix_up_begun(self, generation: int) -> FixUp | None:
        """Step 3: the stripes to re-read before the chunks copied since the last fix-up (and the generated
        stripes, at the first) join ``rebuilt``: those of them in the log. None when superseded."""
        if not self.is_current(generation) or self.dirty is None:
            return None
        logged = np.unique(np.concatenate(self.dirty)) if self.dirty else np.zeros(0, np.int64)
        self.dirty = [logged]  # the log stays open: a stripe logged now may be in a chunk copied later
        joining = self.joins_next.copy()
        copied = np.concatenate(self.copied) if self.copied else np.zeros(0, np.int64)
        joining[copied] = True
        return FixUp(generation, logged[joining[logged]], joining, len(copied), tuple(sorted(self.lost)))

    def fixed_up(self, fix: FixUp) -> bool:
        """The fix-up's stripes are installed (in the lock hold of :meth:`fix_up_begun`): its stripes join
        ``rebuilt``, and from now on writes of them go through to the replacements."""
        if not self.is_current(fix.generation) or self.rebuilt is None:
            return False
        self.rebuilt |= fix.joining
        self.joins_next = np.zeros(self.n_stripes, dtype=bool)
        self.copied = []
        return True

    def log_closed(self) -> None:
        """The rebuild stops copying (finished, superseded or failed): batches stop logging."""
        self.dirty, self.copied = None, []

    def rebuild_finished(self, generation: int, now: float) -> bool:
        """Every stripe is rebuilt: the replacements take the lost members' places, reads go to them."""
        if generation != self.generation:
            return False
        record = self.recoveries[-1]
        for s in sorted(self.lost):
            self.members[s] = self.replacement.pop(s)
            self.member_futures[s] = self.replacement_future.pop(s)
            self.worker_of[s] = record.workers.get(s, self.replacement_workers.get(s, "?"))
        self.lost.clear()
        self.rebuilt, self.dirty, self.copied, self.joins_next = None, None, [], None
        record.rebuilt_at = now
        return True

    # ---- the rebuild thread: events in, instructions out --------------------------------------------
    def attempt_begun(self) -> Rebuilt | PlaceReplacements | GiveUp:
        """The rebuild thread starts (over): give up on a fatal loss; end when nothing is lost (a later loss
        starts a new thread); else rebuild everything lost, in the current generation, placing a
        replacement for each lost member without one (a replacement that survived a restart is kept)."""
        if self.fatal is not None:
            return GiveUp(self.fatal)
        if not self.lost:
            self.recovering, self.attempt = False, None
            return Rebuilt(self.recoveries[-1])
        lost = tuple(sorted(self.lost))
        self.attempt = Attempt(self.generation, lost, self.recoveries[-1])
        return PlaceReplacements(self.generation, lost, tuple(s for s in lost if s not in self.replacement))

    def placement_superseded(self, place: PlaceReplacements) -> Rebuilt | PlaceReplacements | GiveUp:
        """Waiting for a replacement, the thread saw a further loss (or a fatal one): start over at once,
        in this hold."""
        return self.attempt_begun()

    def replacements_started(self, place: PlaceReplacements, placed: dict[int, Standby],
                             seconds: float) -> StartOver | PrepareCopy:
        """``placed``: a started replacement ``(worker, future, actor)`` for each member of ``place.need``,
        after ``seconds``. Taken as the members' replacements; start over if a loss came in meanwhile. The
        copy tasks run on the first lost member's replacement's worker (they install there in memory)."""
        attempt = self._attempt(place.generation)
        for s, (worker, future, actor) in placed.items():
            self.replacement_placed(s, worker, future, actor)
        attempt.record.placement_seconds += seconds
        if self.generation != place.generation:
            return StartOver()
        attempt.worker = self.replacement_workers[attempt.lost[0]]
        return PrepareCopy(place.generation)

    def reset_begun(self, prepare: PrepareCopy) -> GiveUp | StartOver | ResetReplacements:
        """The lock is held again for steps 0 and 1: unless a loss came in since the placement."""
        if self.fatal is not None:
            return GiveUp(self.fatal)
        if self.generation != prepare.generation:
            return StartOver()
        return ResetReplacements(prepare.generation, self._attempt(prepare.generation).lost)

    def reset_failed(self, reset: ResetReplacements, members: set[int], cause: BaseException) -> ReportLoss:
        """Settling or resetting found ``members`` lost: report them, then start over."""
        return ReportLoss(members, cause, StartOver(), "settling the parity before the copy")

    def replacements_reset(self, reset: ResetReplacements, to_copy: np.ndarray, chunk: int) -> CopyChunks:
        """Steps 0 and 1 done (same hold): the replacements are fresh and the rebuild copies ``to_copy`` (sorted
        stripes) in chunks of ``chunk`` stripes; the log opens (:meth:`log_opened`). With nothing to copy, the
        copy is complete as soon as it ends."""
        attempt = self._attempt(reset.generation)
        self.log_opened(reset.generation, to_copy)
        attempt.chunks = tuple(to_copy[a:b] for a, b in stripe_chunks(len(to_copy), chunk))
        attempt.total, attempt.next_chunk, attempt.done = len(to_copy), 0, 0
        attempt.complete = not attempt.chunks
        first = AwaitChunk(reset.generation, 0) if attempt.chunks else EndCopy(reset.generation)
        return CopyChunks(reset.generation, attempt.lost, attempt.chunks, attempt.worker, first)

    def copy_task_done(self, wait: AwaitChunk, copied: ChunkCopied, since_fix_up: float,
                       interval: float) -> AwaitChunk | FixUp | EndCopy | GiveUp:
        """Chunk ``wait.n``'s copy task installed it (``copied``), ``since_fix_up`` seconds after the last
        fix-up (or the submission). Its fix-up waits for later chunks while they come within ``interval``
        (a fix-up holds the trainer for two round trips, whatever its size); the last chunk's does not.
        Otherwise fix up every chunk copied since the last fix-up now, in this hold."""
        attempt = self._awaited(wait)
        chunk = attempt.chunks[wait.n]
        record = attempt.record
        record.chunks += 1
        record.stripes += len(chunk)
        record.rows_rebuilt += copied.rows
        record.copy_task_seconds += copied.task_seconds
        record.copy_read_wait_seconds += copied.read_wait_seconds
        record.copy_install_seconds += copied.install_seconds
        if wait.n + 1 < len(attempt.chunks) and since_fix_up < interval and self.generation == wait.generation:
            self.chunk_copied(wait.generation, chunk)
            attempt.next_chunk = wait.n + 1
            return AwaitChunk(wait.generation, wait.n + 1)
        if self.fatal is not None:
            return GiveUp(self.fatal)
        if self.generation != wait.generation:
            return EndCopy(wait.generation)
        self.chunk_copied(wait.generation, chunk)
        fix = self.fix_up_begun(wait.generation)
        return EndCopy(wait.generation) if fix is None else fix

    def copy_task_failed(self, wait: AwaitChunk, failure: BaseException) -> GiveUp | EndCopy | FindDead:
        """Chunk ``wait.n``'s copy task failed: a survivor or a replacement died, or something else went
        wrong. Unless a loss came in meanwhile (then start over), find out which members died."""
        self._awaited(wait)
        if self.fatal is not None:
            return GiveUp(self.fatal)
        if self.generation != wait.generation:
            return EndCopy(wait.generation)
        return FindDead(wait.generation, failure)

    def copy_task_superseded(self, wait: AwaitChunk) -> EndCopy:
        """Waiting for a copy task, the thread saw a further loss (or a fatal one): stop copying."""
        self._awaited(wait)
        return EndCopy(wait.generation)

    def dead_found(self, find: FindDead, dead: set[int], cause: BaseException) -> GiveUp | ReportLoss:
        """``dead``: the members and replacements that did not answer after ``find.failure`` (``cause``
        names them). None: the failure was not a loss, and is fatal. Else report them and stop copying."""
        if not dead:
            return GiveUp(find.failure)
        return ReportLoss(dead, cause, EndCopy(find.generation), "copying stripes from the survivors")

    def fix_up_done(self, fix: FixUp, locked_seconds: float) -> ReportProgress:
        """The fix-up's stripes are installed (same hold; :meth:`fixed_up`), the lock held ``locked_seconds``
        so far. Report the progress, then wait for the next chunk, or end a complete copy."""
        attempt = self._attempt(fix.generation)
        self.fixed_up(fix)
        record = attempt.record
        record.stripes_fixed_up += len(fix.stripes)
        record.locked_seconds += locked_seconds
        record.fix_ups += 1
        attempt.done += fix.copied
        n = attempt.next_chunk + 1
        if n < len(attempt.chunks):
            attempt.next_chunk = n
            return ReportProgress(attempt.done, attempt.total, AwaitChunk(fix.generation, n))
        attempt.complete = True
        return ReportProgress(attempt.done, attempt.total, EndCopy(fix.generation))

    def fix_up_failed(self, fix: FixUp, members: set[int], cause: BaseException) -> ReportLoss:
        """The fix-up found ``members`` lost: report them, and stop copying."""
        return ReportLoss(members, cause, EndCopy(fix.generation), "fixing up the copied stripes")

    def copy_ended(self, end: EndCopy, seconds: float) -> FinishRebuild | StartOver | GiveUp:
        """The copy stopped after ``seconds`` (the log is closed, the tasks still running cancelled). A complete
        one finishes the rebuild, unless the state went fatal since its last fix-up (a loss past R adds a member
        without a replacement and keeps the generation: finishing would swap in replacements that are not
        there); otherwise the thread then looks again at what is lost."""
        attempt = self._attempt(end.generation)
        attempt.record.copy_seconds += seconds
        if not attempt.complete:
            return StartOver()
        if self.fatal is not None:
            return GiveUp(self.fatal)
        return FinishRebuild(end.generation, StartOver())

    def _attempt(self, generation: int) -> Attempt:
        """The attempt of ``generation``, which gave the instruction being reported."""
        attempt = self.attempt
        if attempt is None or attempt.generation != generation:
            raise RuntimeError(f"an outcome reported for generation {generation}, which has no attempt running")
        return attempt

    def _awaited(self, wait: AwaitChunk) -> Attempt:
        attempt = self._attempt(wait.generation)
        if wait.n != attempt.next_chunk:
            raise RuntimeError(f"chunk {wait.n} reported where chunk {attempt.next_chunk} was awaited")
        return attempt
