"""Parity in the running system: coded data shards, parity shards, and the trainer's coded group.

Layout. Data shard ``i`` of ``K`` is an :class:`CodedShard` (an ``EmbeddingShard`` that also
serves stripes and applies sequenced writes); stripe ``j`` is local row ``j`` of every data
shard, i.e. global ids ``j*K .. j*K + K-1``. Parity shard ``p`` of ``R`` is a
:class:`ParityShard` holding ``ceil(total_rows / K)`` rows of the same width:
``parity_p[j] = XOR_i C[p, i] * data_i[j]`` over the bit patterns (:mod:`.erasure`). Member
index ``s`` names both kinds: ``0..K-1`` data, ``K..K+R-1`` parity.

Write-backs. The trainer is the only writer. Every fetch of a row leaves a copy of what was
fetched in the group (:class:`CheckedOutRows`: "the old row the trainer fetched"); when the row
is written back, the group takes that copy, and the parity change of the whole batch is
``combine_changes`` of its rows' ``old ^ new``: each touched stripe once, computed while the data
shards work on the batch (on a trainer with a core to spare it costs no step time). A write-back batch gets
a sequence number; data shards and parity shards record the numbers they applied and ignore a
batch they have already applied, so a resent batch (after a shard died mid-batch) is applied
exactly once. :meth:`CodedShardGroup.exchange` returns once the data shards have acknowledged
(their answer carries the fetched rows). The parity deltas of up to ``parity_batches``
consecutive batches travel in one message per parity shard (each batch with its number), and
that message's acknowledgement is awaited when the next one is sent: an actor call costs the
trainer and the servers far more than its few kilobytes of deltas, so a message per batch was
most of parity's overhead. Before anything reads parity (a degraded read, a rebuild, verify) the
pending deltas are sent and acknowledged (*settled*). Once settled, data and parity are a
consistent codeword. Deltas still pending live only in the trainer: losing them with the trainer
loses nothing, since a crashed trainer resumes from its checkpoint and re-encodes parity; a parity
shard that dies with deltas pending is rebuilt from the data shards, which hold those batches.

Failures and recovery. A call to a member whose worker died raises ``OSError``: the group marks
the member lost, resends the batch to the survivors (idempotent) and starts a background rebuild
(:mod:`.recovery`, which also argues why every rebuilt stripe is one consistent version although
the bulk copy runs while training writes, and why copying only the stripes with a row the trainer
wrote is enough: a replacement generates the others from the seed). Until a stripe is rebuilt,
reads of a lost data shard's rows are *degraded reads*: decoded from K survivors' stripes, which
come back with the batch's own calls (a surviving data shard reads them after applying the batch,
a surviving parity shard after applying every pending delta; earlier parity messages are
acknowledged first), so they are one consistent version of each stripe, and a degraded read costs
no extra round trip.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed import Client

from dlrmflow.engine import gf256
from dlrmflow.engine.cluster import cluster_workers
from dlrmflow.engine.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.embedding_server import (
    EmbeddingShard,
    ShardGroup,
    answer,
    call_server,
    is_lost_actor_error,
    warm_up_workers,
)
from dlrmflow.engine.erasure import ErasureCode, gather_stripes, xor_bits
from dlrmflow.engine.placement import choose_rebuild_worker, place
from dlrmflow.engine.prefault import prefault_in_background
from dlrmflow.errors import UserInputError

ENCODE_CHUNK_STRIPES = 1 << 16
PARITY_BATCHES = 8  # write-back batches whose parity deltas share one message per parity shard


def num_stripes(spec: RowSpec, k: int) -> int:
    return len(range(0, spec.total_rows, k))


def shard_row_counts(spec: RowSpec, k: int) -> list[int]:
    return [len(range(i, spec.total_rows, k)) for i in range(k)]


def member_name(s: int, k: int) -> str:
    return f"data shard {s}" if s < k else f"parity shard {s - k}"


class LostMembersError(RuntimeError):
    """Calls to these members failed: their workers are gone."""

    def __init__(self, members: set[int], cause: BaseException) -> None:
        self.members = members
        super().__init__(f"members {sorted(members)} lost: {cause!r}")


class _Sequenced:
    """What every member shares: the set of write-back batches it applied, and stripe access.

    ``fresh`` (None, or one flag per stripe): rows still to be generated from ``(seed, id)``. A
    replacement starts with every row fresh and generates a row when something first reads it:
    a rebuild copies only the stripes with a row the trainer wrote, and generating a whole shard
    eagerly costs more than copying it. Owned by the member's actor thread (a rebuild's install
    from a task on the same worker is the race its dirty log covers).

    ``rebuild``: the rebuild this member is the target of (set by :meth:`reset`); an install from
    any other is ignored. A rebuild that starts over (a further loss) cannot stop a copy task that
    is already running, and on a worker with more than one thread that task can install after the
    new rebuild's copy of the same stripes, with a version written over since (``_installing``
    makes the check and the write one step against a concurrent reset)."""

    rows: np.ndarray
    applied: set[int]
    fresh: np.ndarray | None
    rebuild: str = ""
    prefaulting: threading.Thread | None = None
    _installing = threading.Lock()  # one per worker process: installs are few and short

    def _initial_rows(self, local: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _materialise(self, local: np.ndarray | slice) -> None:
        """Generate the fresh rows among ``local`` (local indices inside the member, or a slice)."""
        if self.fresh is None:
            return
        if isinstance(local, slice):
            local = np.arange(len(self.rows))[local]
        local = local[self.fresh[local]]
        if len(local):
            self.rows[local] = self._initial_rows(local)
            self.fresh[local] = False

    def _overwritten(self, local: np.ndarray | slice) -> None:
        if self.fresh is not None:
            self.fresh[local] = False

    def reset(self, rebuild: str = "") -> int:
        """Back to the initial rows, all fresh, as the target of ``rebuild``: a rebuild that starts over
        installs everything else again. The first reset also faults the rows' pages in, in the
        background, while the rebuild's reads are on their way (:mod:`~dlrmflow.engine.prefault`)."""
        with self._installing:
            self.fresh = np.ones(len(self.rows), dtype=bool)
            self.rebuild = rebuild
        if self.prefaulting is None:
            self.prefaulting = prefault_in_background(self.rows)
        return len(self.rows)

    def read_stripes(self, start: int, stop: int) -> np.ndarray:
        """Rows of stripes ``[start, stop)``, not copied: only a rebuild's bulk copy reads them, and a
        stripe written while its bytes are on the way is in the rebuild's dirty log and re-read
        under the lock (see :mod:`dlrmflow.engine.recovery`)."""
        self._materialise(slice(start, stop))
        return self.rows[start:stop]

    def gather(self, stripes: np.ndarray) -> np.ndarray:
        if self.fresh is not None:
            stripes = np.asarray(stripes, dtype=np.int64)
            self._materialise(stripes[(stripes >= 0) & (stripes < len(self.rows))])
        return gather_stripes(self.rows, stripes)

    def install(self, start: int, rows: np.ndarray, rebuild: str = "") -> int:
        """Rebuilt rows of stripes ``start..``: copied as bytes, never as floats (0 rows: another
        rebuild's)."""
        with self._installing:
            if rebuild != self.rebuild:
                return 0
            self.rows.view(np.uint8)[start : start + len(rows)] = np.ascontiguousarray(rows).view(np.uint8)
            self._overwritten(slice(start, start + len(rows)))
        return len(rows)

    def install_stripes(self, stripes: np.ndarray, rows: np.ndarray, rebuild: str = "") -> int:
        """Rebuilt rows of the given stripes, copied as bytes (0 rows: another rebuild's)."""
        with self._installing:
            if rebuild != self.rebuild:
                return 0
            self.rows.view(np.uint8)[stripes] = np.ascontiguousarray(rows).view(np.uint8)
            self._overwritten(stripes)
        return len(stripes)

    def all_local_rows(self) -> np.ndarray:
        self._materialise(slice(None))
        self.fresh = None
        return self.rows.copy()

    def applied_batches(self) -> list[int]:
        return sorted(self.applied)

    def pid(self) -> int:
        return os.getpid()


class CodedShard(_Sequenced, EmbeddingShard):
    """A data shard that applies each numbered write-back batch once."""

    def __init__(self, spec: RowSpec, shard: int, num_shards: int, initialise: bool = True) -> None:
        # Not initialised: a rebuild target or a resumed run's shard, every row fresh until installed.
        EmbeddingShard.__init__(self, spec, shard, num_shards, initialise)
        self.applied = set()
        self.fresh = None if initialise else np.ones(len(self.rows), dtype=bool)

    def _initial_rows(self, local: np.ndarray) -> np.ndarray:
        return init_rows(self.spec, local * self.num_shards + self.shard)

    def fetch(self, ids: np.ndarray) -> np.ndarray:
        if self.fresh is not None:
            self._materialise(self._local_index(ids))
        return super().fetch(ids)

    def write_back(self, ids: np.ndarray, rows: np.ndarray) -> int:
        n = super().write_back(ids, rows)
        if self.fresh is not None:
            self._overwritten(np.asarray(ids, dtype=np.int64) // self.num_shards)
        return n

    def local_rows(self) -> np.ndarray:
        return self.all_local_rows()

    def exchange_seq(self, seq: int, write_ids: np.ndarray, write_rows: np.ndarray, fetch_ids: np.ndarray,
                     gather: np.ndarray | None = None):
        """Apply write-back batch ``seq`` (once), fetch rows; with ``gather``, also return this shard's
        rows of those stripes, after the batch (a degraded read's survivor piece): ``(rows, stripes)``."""
        if len(write_ids) and seq not in self.applied:
            self.write_back(write_ids, write_rows)
            self.applied.add(seq)
        rows = self.fetch(fetch_ids)
        return rows if gather is None else (rows, self.gather(gather))


def encode_parity_of_initial_rows(spec: RowSpec, code: ErasureCode, p: int,
                                  stripes: np.ndarray | None = None) -> np.ndarray:
    """Parity shard ``p`` of the initial rows, all of it or its rows of ``stripes`` (rows are a pure
    function of (seed, id), so any process can encode them chunk by chunk without reading the data
    shards)."""
    k = code.k
    if stripes is None:
        stripes = np.arange(num_stripes(spec, k), dtype=np.int64)
    out = np.zeros((len(stripes), spec.width), dtype=np.float32)
    acc_bytes = out.view(np.uint8)
    for lo in range(0, len(stripes), ENCODE_CHUNK_STRIPES):
        hi = min(lo + ENCODE_CHUNK_STRIPES, len(stripes))
        for i in range(k):
            ids = stripes[lo:hi] * k + i
            inside = ids < spec.total_rows  # past a short data shard's end: zero rows, nothing to add
            if inside.any():
                rows = np.ascontiguousarray(init_rows(spec, ids[inside])).view(np.uint8)
                if inside.all():
                    gf256.mul_xor_into(acc_bytes[lo:hi], code.coefficient(p, i), rows)
                else:
                    part = acc_bytes[lo:hi][inside]
                    gf256.mul_xor_into(part, code.coefficient(p, i), rows)
                    acc_bytes[lo:hi][inside] = part
    return out


class ParityShard(_Sequenced):
    """Parity shard ``p``: starts as the encoding of the initial data shards."""

    def __init__(self, spec: RowSpec, k: int, r: int, p: int, initialise: bool = True) -> None:
        self.spec, self.code, self.p = spec, ErasureCode(k, r), p
        if initialise:
            self.rows = encode_parity_of_initial_rows(spec, self.code, p)
        else:  # a rebuild target or a resumed run's parity: every stripe fresh until installed
            self.rows = np.zeros((num_stripes(spec, k), spec.width), dtype=np.float32)
        self.applied = set()
        self.stripes_updated = 0
        self.fresh = None if initialise else np.ones(len(self.rows), dtype=bool)

    def _initial_rows(self, local: np.ndarray) -> np.ndarray:
        return encode_parity_of_initial_rows(self.spec, self.code, self.p, local)

    def apply(self, seq: int, stripes: np.ndarray, delta: np.ndarray) -> int:
        """XOR a write-back batch's delta into the parity rows, once per ``seq``."""
        if seq in self.applied:
            return 0
        stripes = np.asarray(stripes, dtype=np.int64)
        self._materialise(stripes)
        self.code.apply_delta(self.rows, delta, rows=stripes)
        self.applied.add(seq)
        self.stripes_updated += len(stripes)
        return len(stripes)

    def apply_batches(self, seqs: list[int], stripes: list[np.ndarray], deltas: list[np.ndarray]) -> int:
        """:meth:`apply` for several batches that came in one message, in order."""
        return sum(self.apply(*batch) for batch in zip(seqs, stripes, deltas, strict=True))

    def apply_and_gather(self, seqs: list[int], stripes: list[np.ndarray], deltas: list[np.ndarray],
                         gather: np.ndarray) -> np.ndarray:
        """:meth:`apply_batches`, then the parity rows of stripes ``gather`` (for a degraded read)."""
        self.apply_batches(seqs, stripes, deltas)
        return self.gather(gather)


class CheckedOutRows:
    """The trainer's copy of each row as it was fetched (the *old* row of its next write-back).

    ``pos`` (a row's place in ``buf``, -1 when not checked out) has one entry per table row, so it is
    int32: 4 bytes per row, where the rows themselves are 20-300 (it bounds ``buf`` to 2^31 rows,
    which are rows in the trainer's cache)."""

    def __init__(self, total_rows: int, width: int) -> None:
        self.pos = np.full(total_rows, -1, dtype=np.int32)
        self.buf = np.empty((0, width), dtype=np.float32)
        self.free = np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return int((self.pos >= 0).sum())

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes + self.pos.nbytes)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        pos = self.pos[ids]
        new = pos < 0
        n_new = int(new.sum())
        if n_new > len(self.free):
            start = len(self.buf)
            grow = min(max(n_new - len(self.free), start), np.iinfo(np.int32).max - start)
            if grow < n_new - len(self.free):
                raise RuntimeError(f"more than {np.iinfo(np.int32).max:,} rows checked out at once")
            self.buf = np.concatenate([self.buf, np.empty((grow, self.buf.shape[1]), np.float32)])
            self.free = np.concatenate([self.free, np.arange(start, start + grow, dtype=np.int32)])
        pos[new] = self.free[-n_new:] if n_new else pos[new]
        if n_new:
            self.free = self.free[:-n_new]
        self.pos[ids] = pos
        self.buf.view(np.uint8)[pos] = np.ascontiguousarray(rows).view(np.uint8)

    def take(self, ids: np.ndarray) -> np.ndarray:
        pos = self.pos[ids]
        if (pos < 0).any():
            raise RuntimeError(f"write-back of row {int(ids[pos < 0][0])}, which was never fetched: "
                               "its parity delta cannot be computed")
        rows = self.buf[pos]
        self.pos[ids] = -1
        self.free = np.concatenate([self.free, pos])
        return rows


@dataclass
class RecoveryRecord:
    """One recovery: what was lost, when it was detected and rebuilt, what it cost."""

    members: list[int]
    detected_at: float
    rebuilt_at: float | None = None
    stripes: int = 0
    rows_rebuilt: int = 0
    chunks: int = 0
    stripes_fixed_up: int = 0  # stripes written during a chunk's bulk copy, re-read under the lock
    stripes_generated: int = 0  # stripes with no row the trainer wrote: the replacements generate them
    placement_seconds: float = 0.0  # detection -> replacement actors started
    copy_seconds: float = 0.0  # bulk copies on workers + fix-ups, wall clock (training runs meanwhile)
    locked_seconds: float = 0.0  # fix-ups under the lock (training waits)
    # Of copy_seconds, the copy tasks' own time on the replacement's worker (the rest: dispatch and fix-ups),
    # and within it the wait for the survivors' answers and the decode + install.
    copy_task_seconds: float = 0.0
    copy_read_wait_seconds: float = 0.0
    copy_install_seconds: float = 0.0
    fix_ups: int = 0
    restarts: int = 0
    workers: dict[int, str] = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)  # the failures that showed each loss (a restart adds one)

    def as_dict(self, k: int, start: float) -> dict[str, Any]:
        return {
            "lost": [member_name(s, k) for s in self.members],
            "detected_s": self.detected_at - start,
            "rebuilt_s": None if self.rebuilt_at is None else self.rebuilt_at - start,
            "seconds": None if self.rebuilt_at is None else self.rebuilt_at - self.detected_at,
            "stripes": self.stripes, "rows_rebuilt": self.rows_rebuilt, "chunks": self.chunks,
            "stripes_fixed_up": self.stripes_fixed_up, "fix_ups": self.fix_ups,
            "stripes_generated": self.stripes_generated,
            "placement_seconds": self.placement_seconds, "copy_seconds": self.copy_seconds,
            "locked_seconds": self.locked_seconds, "copy_task_seconds": self.copy_task_seconds,
            "copy_read_wait_seconds": self.copy_read_wait_seconds, "copy_install_seconds": self.copy_install_seconds,
            "restarts": self.restarts, "new_workers": {member_name(s, k): w for s, w in self.workers.items()},
            "causes": list(self.causes),
        }


class _DeadCall:
    """A call that could not even be sent: the actor's worker is known to be gone."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause

    def result(self):
        raise OSError(f"the actor's worker is gone: {self.cause}")


def remote(actor, method: str, *args):
    """``actor.method(*args)`` (a :class:`ServerCall`), or a call whose ``result()`` raises OSError when
    Dask already knows the worker is lost (it then refuses to even send the call)."""
    try:
        return call_server(actor, method, *args)
    except (OSError, RuntimeError) as exc:
        if is_lost_actor_error(exc):
            return _DeadCall(exc)
        raise


def _wait_all(calls: list[tuple[int, Any]]) -> tuple[dict[int, Any], LostMembersError | None]:
    """Results of every call (waiting for all, even after a failure); members whose call failed."""
    results, lost, cause = {}, set(), None
    for s, call in calls:
        try:
            results[s] = answer(call)
        except OSError as exc:  # CommClosedError is an OSError too: the member's worker is gone
            lost.add(s)
            cause = exc
    return results, (LostMembersError(lost, cause) if lost else None)


class CodedShardGroup(ShardGroup):
    """K coded data shards + R parity shards; the trainer's side of write-backs, verify and recovery.

    Same interface as :class:`ShardGroup` (the trainer modes do not know about parity)."""

    def __init__(self, spec: RowSpec, client: Client, code: ErasureCode, members: list, futures: list,
                 workers: list[str], *, rebuild_chunk: int = 262144, parity_batches: int = PARITY_BATCHES,
                 rebuild_rate: float = 0.0,
                 recovery_runner: Callable[[Callable[[], dict], dict], dict] | None = None) -> None:
        super().__init__(spec, members[: code.k], futures[: code.k])
        self.client, self.code = client, code
        self.members, self.member_futures, self.worker_of = list(members), list(futures), list(workers)
        self.checked_out = CheckedOutRows(spec.total_rows, spec.width)
        # Rows the trainer has written back (one byte per table row, like ``checked_out.pos``'s four):
        # the only rows that may differ from their initial values, so the only ones a rebuild copies.
        self.written = np.zeros(spec.total_rows, dtype=bool)
        self.lock = threading.RLock()
        self.seq = 0
        self.parity_bytes = 0
        self.write_batches = 0
        self.degraded_rows = 0
        self.rebuild_chunk = rebuild_chunk
        self.parity_batches = parity_batches
        self.rebuild_rate = rebuild_rate  # bytes of rebuilt rows per second (0: as fast as it goes)
        self.parity_messages = 0
        self.recovery_runner = recovery_runner
        self.n_stripes = num_stripes(spec, code.k)
        self.rows_of = shard_row_counts(spec, code.k) + [self.n_stripes] * code.r
        # Recovery state (guarded by the lock).
        self.lost: set[int] = set()
        self.replacement: dict[int, Any] = {}
        self.replacement_future: dict[int, Any] = {}
        self.replacement_workers: dict[int, str] = {}
        # Replacements started in advance on a spare worker, one per member, all fresh (rows are
        # generated when first read, so one costs a byte per row until used): a rebuild takes its
        # member's instead of starting an actor while training waits. (worker, future, actor).
        self.standby: dict[int, tuple[str, Any, Any]] = {}
        self.dead_workers: set[str] = set()
        # While a rebuild runs: True for the stripes every lost member's replacement holds (never
        # written, or installed); None until the rebuild knows which (nothing is read from replacements).
        self.rebuilt: np.ndarray | None = None
        # (seq, (ids, row changes) or its StripeDelta once combined) of batches whose deltas are not sent yet
        self.pending: list[tuple[int, Any]] = []
        self.unsettled: list[tuple[int, Any]] = []  # parity messages sent but not yet acknowledged
        self.dirty: list[np.ndarray] | None = None  # while a rebuild copies a chunk: stripes written since
        self.generation = 0
        self.recoveries: list[RecoveryRecord] = []
        self.fatal: BaseException | None = None
        self.recovery_thread: threading.Thread | None = None
        self.shared_workers = False  # True when the cluster had fewer workers than members
        self.recovering = False  # a recovery thread owns the lost members (set and cleared under the lock)
        self.started_at = time.perf_counter()

    # ---- the write-back path ------------------------------------------------------------------
    def exchange(self, write_ids, write_rows, fetch_ids, out=None):
        write_ids = np.asarray(write_ids, dtype=np.int64)
        fetch_ids = np.asarray(fetch_ids, dtype=np.int64)
        write_rows = np.asarray(write_rows, dtype=np.float32)
        if out is None:
            out = np.empty((len(fetch_ids), self.spec.width), dtype=np.float32)
        with self.lock:
            self._raise_fatal()
            seq = 0
            if len(write_ids):
                self.seq += 1
                seq = self.seq
                changes = xor_bits(self.checked_out.take(write_ids), write_rows)
                self.written[write_ids] = True
                if self.dirty is not None:  # a rebuild is copying a chunk: it re-reads these stripes
                    self.dirty.append(write_ids // self.code.k)
                self.pending.append((seq, (write_ids.copy(), changes)))  # combined while the shards work
                self.write_batches += 1
            while True:
                try:
                    self._exchange_once(seq, write_ids, write_rows, fetch_ids, out)
                    break
                except LostMembersError as exc:
                    self.on_lost(exc.members, exc)  # raises TooManyErasuresError past R; else resend
            if len(self.pending) >= self.parity_batches:
                try:
                    self._send_parity()
                except LostMembersError as exc:
                    self.on_lost(exc.members, exc)
            if len(fetch_ids):
                self.checked_out.put(fetch_ids, out)
        self.bytes_written += len(write_ids) * self.spec.row_bytes
        self.bytes_fetched += len(fetch_ids) * self.spec.row_bytes
        return out

    def stripes_to_copy(self, lost: list[int]) -> np.ndarray:
        """Stripes where a member of ``lost`` may hold anything but its initial rows: a lost data
        shard only where the trainer wrote its row, a lost parity shard where it wrote any row of
        the stripe (parity changes with every data row). Every other stripe a replacement generates."""
        k = self.code.k
        copy = np.zeros(self.n_stripes, dtype=bool)
        for column in range(k) if any(s >= k for s in lost) else sorted(lost):
            rows = self.written[column::k]  # data shard ``column``'s rows, one per stripe (a short shard: fewer)
            copy[: len(rows)] |= rows
        return np.flatnonzero(copy)

    def _combine_pending(self) -> None:
        """Turn each pending batch's row changes into its parity delta (each touched stripe once).
        Called while the data shards work on a batch, so on a trainer with cores to spare the delta
        costs the step nothing; idempotent."""
        k = self.code.k
        for n, (seq, batch) in enumerate(self.pending):
            if isinstance(batch, tuple):
                ids, changes = batch
                delta = self.code.combine_changes(ids % k, ids // k, changes)
                self.parity_bytes += self.code.r * delta.parity[0].nbytes
                self.pending[n] = (seq, delta)

    def _target(self, s: int):
        """Who receives member ``s``'s traffic now: itself, its replacement, or nobody yet."""
        if s not in self.lost:
            return self.members[s]
        return self.replacement.get(s)

    def _rebuilt(self, stripes: np.ndarray) -> np.ndarray:
        if self.rebuilt is None:
            return np.zeros(len(stripes), dtype=bool)
        return self.rebuilt[stripes]

    def _exchange_once(self, seq, write_ids, write_rows, fetch_ids, out) -> None:
        """One round trip: every data shard's write-back and fetch; with rows of a lost data shard to
        read (a *degraded read*), the survivors' stripes for their decode come in the same round trip:
        a surviving data shard gathers them after applying this batch, a surviving parity shard after
        applying the pending deltas (this batch's included)."""
        k = self.code.k
        plan, degraded = [], []
        for i, (w, f) in enumerate(zip(self._split(write_ids), self._split(fetch_ids), strict=True)):
            w, f = w[1], f[1]
            target = self._target(i)
            if i in self.lost:  # rebuilt stripes come from the replacement, the rest by degraded reads
                rebuilt = self._rebuilt(fetch_ids[f] // k)  # none while no replacement exists
                if not rebuilt.all():
                    degraded.append((i, f[~rebuilt]))
                f = f[rebuilt]
                if target is None:
                    continue  # the write reaches parity; the rebuild decodes it from survivors
                # Only rebuilt stripes are written to the replacement: the others reach parity, and
                # the rebuild installs them later from survivors (re-read if written during the copy).
                w = w[self._rebuilt(write_ids[w] // k)]
            plan.append((i, target, w, f))
        stripes, survivors = None, ()
        if degraded:
            stripes = np.unique(np.concatenate([fetch_ids[f] // k for _, f in degraded]))
            survivors = self.code.survivors_for([s for s in range(self.code.n_shards) if s not in self.lost])
            self._await_acks()  # earlier parity messages land before this read of parity
        calls = []
        for i, target, w, f in plan:
            gather = stripes if i in survivors else None
            if len(w) or len(f) or gather is not None:
                rows = np.ascontiguousarray(write_rows[w])
                calls.append((i, remote(target, "exchange_seq", seq, write_ids[w], rows, fetch_ids[f], gather), f))
        if stripes is not None:  # the other parity shards' acknowledgements are awaited later
            for s, call in self._send_pending(gather=stripes, to=survivors):
                if s in survivors:
                    calls.append((s, call, None))
                else:
                    self.unsettled.append((s, call))
        self._combine_pending()
        results, error = _wait_all([(s, c) for s, c, _ in calls])
        if error:
            raise error
        pieces = {}
        for s, _, f in calls:
            if s in survivors:
                if s >= k:
                    pieces[s] = results[s]
                    continue
                results[s], pieces[s] = results[s]
            if len(f):
                out[f] = results[s]
        if degraded:
            decoded = self.code.decode(pieces, sorted(self.lost))
            for i, f in degraded:
                out[f] = decoded[i][np.searchsorted(stripes, fetch_ids[f] // k)]
                self.degraded_rows += len(f)

    # ---- failures ---------------------------------------------------------------------------------
    def _send_parity(self) -> None:
        """Send the pending deltas, one message per parity shard, once the previous message is
        acknowledged (lock held; raises LostMembersError)."""
        self._await_acks()
        self.unsettled += self._send_pending()

    def _send_pending(self, gather: np.ndarray | None = None, to: tuple[int, ...] = ()) -> list[tuple[int, Any]]:
        """Calls that hand every parity shard the pending deltas; those in ``to`` also return their
        rows of stripes ``gather`` once the deltas are applied. A parity shard that is lost, and not
        yet replaced, gets nothing: its rebuild decodes these batches from the data shards."""
        self._combine_pending()
        batches, self.pending = self.pending, []
        seqs, stripes = [seq for seq, _ in batches], [delta.stripes for _, delta in batches]
        k, calls = self.code.k, []
        for p in range(self.code.r):
            target = self._target(k + p)
            if target is None or not (batches or k + p in to):
                continue
            parity = [delta.parity[p] for _, delta in batches]
            if k + p in to:
                calls.append((k + p, remote(target, "apply_and_gather", seqs, stripes, parity, gather)))
            else:
                calls.append((k + p, remote(target, "apply_batches", seqs, stripes, parity)))
        self.parity_messages += bool(batches)
        return calls

    def _await_acks(self) -> None:
        calls, self.unsettled = self.unsettled, []
        _, error = _wait_all(calls)
        if error:
            raise error

    def _settle(self) -> None:
        """Send the pending parity deltas and wait for every acknowledgement (lock held); raises
        LostMembersError."""
        self._send_parity()
        self._await_acks()

    def _raise_fatal(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    def on_lost(self, members: set[int], cause: BaseException | None = None) -> None:
        """Members (or replacements being rebuilt) are gone: restart the rebuild of everything lost.
        ``cause``: the failure that showed it, kept in the recovery's record (the report says why).

        Called with the lock held. Losing more than R raises TooManyErasuresError (and keeps it)."""
        now = time.perf_counter()
        for s in members:
            dead = self.replacement_workers.get(s) if s in self.replacement else self.worker_of[s]
            self.dead_workers.add(dead)
            self.replacement.pop(s, None)  # a replacement that died starts over
            self.replacement_future.pop(s, None)
            if s not in self.lost:
                self.member_futures[s] = None  # release the dead actor's future (no recomputation)
        lost = self.lost | set(members)
        try:
            self.code.survivors_for([s for s in range(self.code.n_shards) if s not in lost])
        except UserInputError as exc:
            self.fatal = exc
            self.lost = lost
            raise
        self.lost = lost
        self.generation += 1
        self.rebuilt = None
        if self.recoveries and self.recoveries[-1].rebuilt_at is None:
            record = self.recoveries[-1]
            record.members = sorted(lost)
            record.restarts += 1
        else:
            record = RecoveryRecord(sorted(lost), now)
            self.recoveries.append(record)
        if cause is not None:
            record.causes.append(str(cause))
        if not self.recovering:  # else the running rebuild sees the new generation and starts over
            from dlrmflow.engine.recovery import start_recovery_thread

            self.recovering = True
            self.recovery_thread = start_recovery_thread(self)

    def find_dead(self) -> set[int]:
        """Members (or replacements) whose workers do not answer. Called with the lock held."""
        dead = set()
        try:
            self._settle()
        except LostMembersError as exc:
            dead |= exc.members
        calls = [(s, remote(self._target(s), "pid")) for s in range(self.code.n_shards)
                 if self._target(s) is not None]
        _, error = _wait_all(calls)
        return dead | (set() if error is None else error.members)

    def probe(self) -> None:
        """Ping every member so a dead one is noticed (the end of a run touches all of them)."""
        with self.lock:
            self._raise_fatal()
            try:
                self._settle()
            except LostMembersError as exc:
                self.on_lost(exc.members, exc)
                return
            calls = [(s, remote(self._target(s), "applied_batches")) for s in range(self.code.n_shards)
                     if self._target(s) is not None]
            _, error = _wait_all(calls)
            if error:
                self.on_lost(error.members, error)

    def wait_recovered(self, timeout: float = 600.0) -> None:
        """Block until no member is lost (every rebuild finished); re-raise a fatal loss."""
        self.probe()
        deadline = time.perf_counter() + timeout
        while True:
            with self.lock:
                self._raise_fatal()
                if not self.lost:
                    return
                thread = self.recovery_thread
            if thread is not None:
                thread.join(0.05)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the rebuild of {sorted(self.lost)} did not finish in {timeout} s")

    # ---- whole-group reads --------------------------------------------------------------------
    def member_rows(self, s: int) -> np.ndarray:
        return self.members[s].all_local_rows().result()

    def all_rows(self) -> np.ndarray:
        while True:  # a member lost while its rows are read is rebuilt, then read again
            self.wait_recovered()
            with self.lock:
                calls = [(s, remote(self.members[s], "local_rows")) for s in range(self.code.k)]
                rows, error = _wait_all(calls)
                if error is None:
                    break
                self.on_lost(error.members, error)
        out = np.empty((self.spec.total_rows, self.spec.width), dtype=np.float32)
        for s in range(self.code.k):
            out[s :: self.code.k] = rows[s]
        return out

    def stats(self):
        self.wait_recovered()
        return super().stats()

    def verify(self) -> dict[str, Any]:
        """Recompute parity from the data shards and compare bit for bit with the parity shards."""
        self.wait_recovered()
        with self.lock:
            self._settle()
            calls = [self.members[s].all_local_rows() for s in range(self.code.n_shards)]
            rows = [c.result() for c in calls]
        data, parity = rows[: self.code.k], rows[self.code.k :]
        mismatches = self.code.verify(data, parity)
        return {"ok": all(len(m) == 0 for m in mismatches), "stripes": self.n_stripes,
                "mismatched_stripes": [int(len(m)) for m in mismatches], "data": data, "parity": parity}

    def close(self) -> None:
        with self.lock:
            self.fatal = self.fatal or RuntimeError("the shard group is closed")
        if self.recovery_thread is not None:
            self.recovery_thread.join(30)
        self.members, self.member_futures, self.replacement, self.replacement_future = [], [], {}, {}
        self.standby = {}
        super().close()

    def summary(self) -> dict[str, Any]:
        return {
            "parity_shards": self.code.r,
            "write_back_batches": self.write_batches,
            "parity_messages": self.parity_messages,  # per parity shard: up to parity_batches batches each
            "parity_bytes_sent": int(self.parity_bytes),
            "degraded_rows_read": int(self.degraded_rows),
            "checked_out_rows_bytes": self.checked_out.nbytes,
            "parity_rows_bytes": int(self.code.r * self.n_stripes * self.spec.row_bytes),
            "member_workers": {member_name(s, self.code.k): w for s, w in enumerate(self.worker_of)},
            "members_share_workers": self.shared_workers,  # then one kill can take several members
            "standby_worker": next((w for w, _, _ in self.standby.values()), None),  # its standbys left
            "recoveries": [r.as_dict(self.code.k, self.started_at) for r in self.recoveries],
            "clock_origin": self.started_at,  # perf_counter() that the *_s times count from
        }


# ---- placement -------------------------------------------------------------------------------------


def place_members(client: Client, n: int) -> tuple[list[str], bool]:
    """Workers for the ``n`` members by :func:`~dlrmflow.engine.placement.place`: those with the
    ``embedding_server`` resource when any has it; distinct hosts, then distinct workers, then round robin.

    Returns the addresses and whether some members share a worker."""
    placement = place(cluster_workers(client), n)
    return placement.workers, placement.shares_worker


def start_member(client: Client, spec: RowSpec, code: ErasureCode, s: int, worker: str, *, initialise: bool):
    if s < code.k:
        future = client.submit(CodedShard, spec, s, code.k, initialise, actor=True, workers=[worker],
                               pure=False)
    else:
        future = client.submit(ParityShard, spec, code.k, code.r, s - code.k, initialise, actor=True,
                               workers=[worker], pure=False)
    return future


def start_coded_shards(client: Client, spec: RowSpec, num_shards: int, parity: int, *,
                       rebuild_chunk: int = 262144, parity_batches: int = PARITY_BATCHES, rebuild_rate: float = 0.0,
                       recovery_runner=None,
                       rows: np.ndarray | None = None) -> CodedShardGroup:
    """K coded data shards and R parity shards: parity = the encoding of the initial rows, or of
    ``rows`` ``[total_rows, width]`` when given (a resumed run's checkpoint)."""
    code = ErasureCode(num_shards, parity)
    workers, shared = place_members(client, code.n_shards)
    warm_up_workers(client, "dlrmflow.engine.recovery")  # every worker, spares included: a rebuild starts at once
    futures = [start_member(client, spec, code, s, w, initialise=rows is None) for s, w in enumerate(workers)]
    actors = [f.result() for f in futures]
    if rows is not None:
        data = [np.ascontiguousarray(rows[i :: code.k]) for i in range(code.k)]
        pieces = [*data, *code.encode(data)]  # shorter data shards count as zero-padded, as in the group
        for call in [actors[s].install(0, piece) for s, piece in enumerate(pieces)]:
            call.result()
    group = CodedShardGroup(spec, client, code, actors, futures, workers, rebuild_chunk=rebuild_chunk,
                            parity_batches=parity_batches, rebuild_rate=rebuild_rate, recovery_runner=recovery_runner)
    if rows is not None:
        group.written[:] = True  # rows from a checkpoint: any of them may differ from its initial value
    group.shared_workers = shared
    group.standby = start_standbys(client, spec, code, actors, workers)
    return group


def start_standbys(client: Client, spec: RowSpec, code: ErasureCode, members: list,
                   busy: list[str]) -> dict[int, tuple[str, Any, Any]]:
    """A fresh replacement for every member (``members``, on workers ``busy``) on a worker that hosts
    none, if there is one (else none: a rebuild then starts its replacement when it needs it)."""
    spare = choose_rebuild_worker(cluster_workers(client), busy)
    if spare is None:
        return {}
    futures = [start_member(client, spec, code, s, spare, initialise=False) for s in range(code.n_shards)]
    standby = {s: (spare, future, future.result()) for s, future in enumerate(futures)}
    client.submit(open_links, members, workers=[spare], allow_other_workers=False, pure=False).result()
    return standby


def open_links(members: list) -> int:
    """Runs as a Dask task on the standbys' worker: one call to every member, so that the worker's
    client and its connections to the members' workers exist before a rebuild's first reads need
    them (opened then, they held those reads back 5-10 ms)."""
    opened, _ = _wait_all([(s, remote(member, "pid")) for s, member in enumerate(members)])
    return len(opened)  # a member already lost is left out: its rebuild does without this


# ---- verify ----------------------------------------------------------------------------------------

PARITY_FILE = "parity_shards.pt"


def parity_report(group: CodedShardGroup, run_dir=None) -> dict[str, Any]:
    """The end-of-run check: parity recomputed from the data shards equals the parity shards, bit for
    bit. With ``run_dir`` the parity shards are saved next to final_state.pt (``dlrmflow verify``)."""
    result = group.verify()
    if run_dir is not None:
        save_parity(run_dir, group.code, result["parity"])
    report = group.summary()
    report["verify"] = {"ok": result["ok"], "stripes": result["stripes"],
                        "mismatched_stripes": result["mismatched_stripes"]}
    return report


def save_parity(run_dir, code: ErasureCode, parity: list[np.ndarray]):
    from pathlib import Path

    import torch

    path = Path(run_dir) / PARITY_FILE
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"k": code.k, "r": code.r, "parity": [torch.from_numpy(np.ascontiguousarray(p)) for p in parity]},
               tmp)
    os.replace(tmp, path)
    return path


def verify_run_dir(run_dir) -> dict[str, Any]:
    """Recompute parity from a finished run's embedding rows (final_state.pt, split into the K data
    shards: row id on shard id % K) and compare it with the parity shards it saved."""
    from pathlib import Path

    import torch

    from dlrmflow.engine.run_state import STATE_FILE, load_state

    run_dir = Path(run_dir)
    for name in (STATE_FILE, PARITY_FILE):
        if not (run_dir / name).is_file():
            raise UserInputError(f"{run_dir} has no {name}: verify needs a finished run trained with --parity")
    saved = torch.load(run_dir / PARITY_FILE, map_location="cpu", weights_only=True)
    rows = load_state(run_dir)["embedding"]["rows"].numpy()
    code = ErasureCode(int(saved["k"]), int(saved["r"]))
    data = [np.ascontiguousarray(rows[i :: code.k]) for i in range(code.k)]
    mismatches = code.verify(data, [p.numpy() for p in saved["parity"]])
    return {"run_dir": str(run_dir), "k": code.k, "r": code.r, "stripes": int(len(data[0])),
            "ok": all(len(m) == 0 for m in mismatches), "mismatched_stripes": [int(len(m)) for m in mismatches],
            "first_mismatches": [m[:5].tolist() for m in mismatches]}
