"""The recovery state of a coded shard group, and the only code that changes it.

:class:`RebuildState` holds which members are lost, their replacements, which stripes the
replacements hold (``rebuilt``), the dirty log of stripes written during a bulk copy, and the
generation (bumped by every loss). Events come in as named transitions (:meth:`member_lost`,
:meth:`replacement_placed`, :meth:`log_opened`, :meth:`write_logged`, :meth:`chunk_copied`,
:meth:`fix_up_begun` / :meth:`fixed_up`, :meth:`rebuild_finished`, ...); what the caller must do
comes out as return values (:class:`StartRebuild`, :class:`FixUp`). No network, no threads: the
caller holds the group's lock around every call, and the write path and the rebuild thread read the
state through its queries (:meth:`target`, :meth:`is_rebuilt`, :meth:`survivors`). Attributes are
read-only outside this class.

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
from typing import Any

import numpy as np

from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.record import RecoveryRecord
from dlrmflow.engine.errors import UserInputError

Standby = tuple[str, Any, Any]  # (worker, actor future, actor): a fresh replacement started in advance


@dataclass(frozen=True)
class StartRebuild:
    """Action: no rebuild thread owns the lost members; start one."""


@dataclass(frozen=True)
class FixUp:
    """Action: re-read ``stripes`` (logged since the log opened, in the stripes about to join ``rebuilt``)
    from the survivors, decode and install them on the replacements, then report :meth:`RebuildState.fixed_up`
    in the same lock hold."""

    generation: int
    stripes: np.ndarray
    joining: np.ndarray  # one flag per stripe: those that join ``rebuilt`` once fixed up
    copied: int  # stripes copied since the last fix-up


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
    def member_lost(self, members: set[int], cause: BaseException | None, now: float) -> StartRebuild | None:
        """Members (or replacements being rebuilt) are gone: everything lost is rebuilt from the start, in
        a new generation. ``cause`` (the failure that showed it) goes into the recovery's record. Losing
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
        self.fatal = self.fatal or RuntimeError("the shard group is closed")

    def released(self) -> None:
        """The group is closed and its rebuild thread gone: drop every actor handle."""
        self.members, self.member_futures, self.replacement, self.replacement_future = [], [], {}, {}
        self.standby = {}

    # ---- a rebuild ---------------------------------------------------------------------------------
    def rebuild_begun(self) -> tuple[list[int], int, list[int]] | None:
        """The rebuild thread starts (over): ``(lost, generation, members still without a replacement)``,
        or None when nothing is lost (the thread ends; a later loss starts a new one)."""
        self.raise_if_fatal()
        if not self.lost:
            self.recovering = False
            return None
        lost = sorted(self.lost)
        return lost, self.generation, [s for s in lost if s not in self.replacement]

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
        self.recoveries[-1].stripes_generated = self.n_stripes - len(to_copy)
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
        return FixUp(generation, logged[joining[logged]], joining, len(copied))

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
