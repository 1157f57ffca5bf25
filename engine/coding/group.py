"""The trainer's coded shard group: the write path (write-backs, parity deltas, degraded reads).

Write-backs. The trainer is the only writer. Every fetch of a row leaves a copy of what was fetched
in the group (:class:`~dlrmflow.engine.coding.checked_out.CheckedOutRows`); when the row is
written back, the group takes that copy, and the parity change of the whole batch is
``combine_changes`` of its rows' ``old ^ new``: each touched stripe once, computed while the data
shards work on the batch. A write-back batch gets a sequence number; data and parity shards record
the numbers they applied and ignore a batch they have already applied, so a resent batch (after a
shard died mid-batch) is applied exactly once. :meth:`CodedShardGroup.exchange` returns once the data
shards have acknowledged (their answer carries the fetched rows); as in the plain group, a shard's
fetch of rows the batch does not write may travel as a call of its own, so that on a slow link those
rows come down while the batch goes up (:meth:`CodedShardGroup._exchange_once`). The parity deltas of up to
``parity_batches`` consecutive batches travel in one message per parity shard (an actor call costs
far more than its deltas), and that message's acknowledgement is awaited when the next one is sent.
Before anything reads parity (a degraded read, a rebuild, verify) the pending deltas are sent and
acknowledged (:meth:`~CodedShardGroup.settle`). Once settled, data and parity are a consistent
codeword. Deltas still pending live only in the trainer: losing them with the trainer loses nothing,
since a crashed trainer resumes from its checkpoint and re-encodes parity; a parity shard that dies
with deltas pending is rebuilt from the data shards, which hold those batches. The batch numbers, the
rows written, the pending deltas, the messages not yet acknowledged and when a message is due are
:class:`~dlrmflow.engine.coding.parity_batches.ParityBatching`'s, a pure state object changed only by
its events; this class is its driver: it holds the lock, makes the actor calls its actions name, and
reports what happened.

Failures. A call to a member whose worker died raises ``OSError``: the group marks the member lost
(:class:`~dlrmflow.engine.coding.rebuild_state.RebuildState`, which alone changes the recovery
state), resends the batch to the survivors (idempotent) and has a rebuild thread started
(:mod:`dlrmflow.engine.coding.rebuild`; docs/rebuild.md argues why it is exact). Until a stripe
is rebuilt, reads of a lost data shard's rows are *degraded reads*: decoded from K survivors'
stripes, which come back with the batch's own calls (a surviving data shard reads them after
applying the batch, a surviving parity shard after applying every pending delta; earlier parity
messages are acknowledged first), so they are one consistent version of each stripe, and a degraded
read costs no extra round trip.

Every method that touches the state runs under ``lock`` (an RLock the rebuild thread shares).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client

from dlrmflow.engine import row_files
from dlrmflow.engine.coding import PARITY_BATCHES, REBUILD_CHUNK
from dlrmflow.engine.coding.checked_out import CheckedOutRows
from dlrmflow.engine.coding.erasure import ErasureCode, xor_bits
from dlrmflow.engine.coding.members import member_name, num_stripes, shard_row_counts
from dlrmflow.engine.coding.parity_batches import ParityBatching, SendParity
from dlrmflow.engine.coding.rebuild_state import RebuildState
from dlrmflow.engine.coding.record import noticed_by
from dlrmflow.engine.row_files import chunk_stripes, interleave, parity_file
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.shards import (
    LostMembersError,
    ShardGroup,
    release_actors,
    remote,
    wait_all,
)

RecoveryRunner = Callable[[Callable[..., dict], dict], Any]

# Losses and rebuilds, as they happen (a plain logger: the train flow routes it to the run's Prefect log).
EVENTS = logging.getLogger(__name__)


def _exchanging(write_ids: np.ndarray, fetch_ids: np.ndarray, check_out: bool) -> str:
    """What an exchange does, in words (the record's "noticed by")."""
    if len(write_ids):
        return "writing back and fetching a batch's rows" if len(fetch_ids) else "writing back a batch's rows"
    return "fetching a batch's rows" if check_out else "reading rows (an evaluation)"


class CodedShardGroup(ShardGroup):
    """K coded data shards + R parity shards; the trainer's side of write-backs, verify and recovery.

    Same interface as :class:`ShardGroup` (the trainer modes do not know about parity).
    ``start_rebuild(group)`` starts the thread that rebuilds lost members (without it, as in tests that
    drive the state by hand, a lost member stays lost)."""

    def __init__(self, spec: RowSpec, client: Client | None, code: ErasureCode, members: list, futures: list,
                 workers: list[str], *, rebuild_chunk: int = REBUILD_CHUNK, parity_batches: int = PARITY_BATCHES,
                 rebuild_rate: float = 0.0, recovery_runner: RecoveryRunner | None = None,
                 start_rebuild: Callable[[CodedShardGroup], threading.Thread] | None = None) -> None:
        super().__init__(spec, members[: code.k], futures[: code.k])
        self.client, self.code = client, code
        self.n_stripes = num_stripes(spec, code.k)
        self.rows_of = shard_row_counts(spec, code.k) + [self.n_stripes] * code.r
        self.state = RebuildState(code, self.n_stripes, members, futures, workers)
        # Batch numbers, rows written, pending deltas, unacknowledged parity messages, when one is due.
        self.batching = ParityBatching(code, spec.total_rows, parity_batches)
        self.worker_of = list(workers)  # the ShardGroup view of the member table (see _member_table_changed)
        self.checked_out = CheckedOutRows(spec.width)
        self.lock = threading.RLock()
        self.degraded_rows = 0
        self.rebuild_chunk = rebuild_chunk
        self.rebuild_rate = rebuild_rate  # bytes of rebuilt rows per second (0: as fast as it goes)
        self.recovery_runner = recovery_runner
        self.start_rebuild = start_rebuild
        self.recovery_thread: threading.Thread | None = None
        self.shared_workers = False  # True when the cluster had fewer workers than members
        self.started_at = time.perf_counter()

    def mark_all_written(self) -> None:
        """Every row counts as written back (:meth:`ParityBatching.mark_all_written`): a group started from
        checkpoint rows, any of which may differ from its initial value."""
        with self.lock:
            self.batching.mark_all_written()

    def _member_table_changed(self) -> None:
        self.actors = self.state.members[: self.code.k]
        self.futures = self.state.member_futures[: self.code.k]
        self.worker_of = list(self.state.worker_of)

    # ---- the write-back path ------------------------------------------------------------------
    def exchange(self, write_ids, write_rows, fetch_ids, out=None):
        return self._exchange(write_ids, write_rows, fetch_ids, out, check_out=True)

    def read(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` into ``out`` (or a new array), as :meth:`fetch` reads them, but not checked out:
        for reads the trainer never writes back (evaluation, a mid-run view), which would otherwise keep a
        copy of every row they read for the rest of the run. Counted as fetched bytes, as a fetch is."""
        return self._exchange(np.zeros(0, dtype=np.int64), np.zeros((0, self.spec.width), dtype=np.float32), ids,
                              out, check_out=False)

    def _exchange(self, write_ids, write_rows, fetch_ids, out, *, check_out: bool) -> np.ndarray:
        """:meth:`exchange`; ``check_out``: the fetched rows are kept as the old rows of their write-backs."""
        write_ids = np.asarray(write_ids, dtype=np.int64)
        fetch_ids = np.asarray(fetch_ids, dtype=np.int64)
        write_rows = np.asarray(write_rows, dtype=np.float32)
        if out is None:
            out = np.empty((len(fetch_ids), self.spec.width), dtype=np.float32)
        with self.lock:
            self.state.raise_if_fatal()
            seq = 0
            if len(write_ids):
                changes = xor_bits(self.checked_out.take(write_ids), write_rows)
                seq = self.batching.batch_written(write_ids, changes)  # resends carry the same number
                self.state.write_logged(write_ids // self.code.k)  # a rebuild copying: it re-reads these
            while True:
                try:
                    self._exchange_once(seq, write_ids, write_rows, fetch_ids, out)
                    break
                except LostMembersError as exc:  # raises TooManyErasuresError past R; else resend
                    self.on_lost(exc.members, exc, _exchanging(write_ids, fetch_ids, check_out))
            if self.batching.parity_due():
                try:
                    self.send_parity()
                except LostMembersError as exc:
                    self.on_lost(exc.members, exc, "sending parity deltas")
            if check_out and len(fetch_ids):
                self.checked_out.put(fetch_ids, out)
        self.bytes_written += len(write_ids) * self.spec.row_bytes
        self.bytes_fetched += len(fetch_ids) * self.spec.row_bytes
        return out

    def held_by_trainer(self, ids: np.ndarray, rows: np.ndarray) -> None:
        with self.lock:
            self.checked_out.put(np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=np.float32))

    def stripes_to_copy(self, lost: list[int]) -> np.ndarray:
        """Stripes where a member of ``lost`` may hold anything but its initial rows
        (:meth:`ParityBatching.stripes_to_copy`): every other stripe a replacement generates."""
        return self.batching.stripes_to_copy(lost)

    def _exchange_once(self, seq, write_ids, write_rows, fetch_ids, out) -> None:
        """One round trip: every data shard's write-back and fetch; with rows of a lost data shard to
        read (a *degraded read*), the survivors' stripes for their decode come in the same round trip:
        a surviving data shard gathers them after applying this batch, a surviving parity shard after
        applying the pending deltas (this batch's included).

        A data shard that is not lost gets, as in :meth:`ShardGroup.exchange`, the fetch of the ids
        this batch does not write as a call of its own, sent before every ``exchange_seq`` call, when
        both directions are worth it (:meth:`ShardGroup._split_fetches`): those rows come down the link
        while the batch goes up. It needs no order with the batch: it reads no row the batch writes, and
        every earlier batch was acknowledged (a resent one's calls all answered or failed) before this
        call. A lost shard's reads (its replacement's rebuilt stripes, degraded reads) keep to one call:
        which stripes a replacement holds changes as its rebuild goes, and a loss is too rare for the
        saving to matter. A member that dies during either call is lost for the whole round trip, which
        is then resent (the batch with the same ``seq``, every fetch again)."""
        k, state = self.code.k, self.state
        start = time.perf_counter()
        plan, degraded = [], []
        for i, (w, f) in enumerate(zip(self.split_by_shard(write_ids), self.split_by_shard(fetch_ids), strict=True)):
            w, f = w[1], f[1]
            target = state.target(i)
            alone = None
            if i in state.lost:  # rebuilt stripes come from the replacement, the rest by degraded reads
                rebuilt = state.is_rebuilt(fetch_ids[f] // k)  # none while no replacement exists
                if not rebuilt.all():
                    degraded.append((i, f[~rebuilt]))
                f = f[rebuilt]
                if target is None:
                    continue  # the write reaches parity; the rebuild decodes it from survivors
                # Only rebuilt stripes are written to the replacement: the others reach parity, and
                # the rebuild installs them later from survivors (re-read if written during the copy).
                w = w[state.is_rebuilt(write_ids[w] // k)]
            else:
                f, alone = self._split_fetches(write_ids[w], fetch_ids, f)
            plan.append((i, target, w, f, alone))
        stripes, survivors = None, ()
        if degraded:
            stripes = np.unique(np.concatenate([fetch_ids[f] // k for _, f in degraded]))
            survivors = state.survivors()
            self.await_acks()  # earlier parity messages land before this read of parity
        # The fetches apart go out first: on a link, a request sent after a batch waits behind its rows.
        fetches = [(i, remote(target, "fetch", self._wire(fetch_ids[alone])), alone)
                   for i, target, _, _, alone in plan if alone is not None]
        calls = []
        for i, target, w, f, _ in plan:
            gather = stripes if i in survivors else None
            if len(w) or len(f) or gather is not None:
                rows = np.ascontiguousarray(write_rows[w])
                calls.append((i, remote(target, "exchange_seq", seq, self._wire(write_ids[w]), rows,
                                        self._wire(fetch_ids[f]), gather), f))
        if stripes is not None:  # the other parity shards' acknowledgements are awaited later
            later = []
            for s, call in self._send_pending(gather=stripes, to=survivors):
                if s in survivors:
                    calls.append((s, call, None))
                else:
                    later.append((s, call))
            self.batching.sent(later)
        self.batching.combine_pending()
        results, error = wait_all([(s, c) for s, c, _ in calls])
        fetched, fetch_error = wait_all([(s, c) for s, c, _ in fetches])  # (a member has two calls)
        error = LostMembersError.joined(error, fetch_error)
        if error:
            raise error
        for s, _, alone in fetches:
            out[alone] = fetched[s]
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
            decoded = self.code.decode(pieces, sorted(state.lost))
            for i, f in degraded:
                out[f] = decoded[i][np.searchsorted(stripes, fetch_ids[f] // k)]
                self.degraded_rows += len(f)
        self._rate_exchange(write_ids, fetch_ids, bool(fetches), time.perf_counter() - start)

    # ---- parity messages ----------------------------------------------------------------------
    def send_parity(self) -> None:
        """Send the pending deltas, one message per parity shard, once the previous message is
        acknowledged (lock held; raises LostMembersError)."""
        self.await_acks()
        self.batching.sent(self._send_pending())

    def _send_pending(self, gather: np.ndarray | None = None, to: tuple[int, ...] = ()) -> list[tuple[int, Any]]:
        """Calls that hand every parity shard the pending deltas (:meth:`ParityBatching.send_begun`); those
        in ``to`` also return their rows of stripes ``gather`` once the deltas are applied. A parity shard
        that is lost, and not yet replaced, gets nothing: its rebuild decodes these batches from the data shards."""
        k = self.code.k
        reachable = [s for s in range(k, k + self.code.r) if self.state.target(s) is not None]
        return [(message.member, self._parity_call(message, gather))
                for message in self.batching.send_begun(reachable, gather_from=to)]

    def _parity_call(self, message: SendParity, gather: np.ndarray | None) -> Any:
        """The actor call that carries ``message`` to its member's target."""
        target = self.state.target(message.member)
        seqs, stripes, parity = list(message.seqs), list(message.stripes), list(message.parity)
        if message.gather:
            return remote(target, "apply_and_gather", seqs, stripes, parity, gather)
        return remote(target, "apply_batches", seqs, stripes, parity)

    def await_acks(self) -> None:
        """Wait for the acknowledgement of every parity message sent (lock held; raises LostMembersError)."""
        _, error = wait_all(list(self.batching.acks_awaited().calls))
        if error:
            raise error

    def settle(self) -> None:
        """Send the pending parity deltas and wait for every acknowledgement (lock held); raises
        LostMembersError. Afterwards data and parity are one codeword."""
        self.send_parity()
        self.await_acks()

    def read_current(self, stripes: np.ndarray, survivors: tuple[int, ...]) -> dict[int, np.ndarray]:
        """The survivors' rows of ``stripes`` as of now (lock held), in one round trip: the pending parity
        deltas go out with the read and a surviving parity shard applies them before it reads (as in a
        degraded read); a replacement parity shard gets them too. Raises LostMembersError."""
        k = self.code.k
        self.await_acks()  # earlier parity messages land before this read of parity
        calls = [(s, remote(self.state.members[s], "gather", stripes)) for s in survivors if s < k]
        calls += self._send_pending(gather=stripes, to=survivors)
        results, error = wait_all(calls)
        if error:
            raise error
        return {s: results[s] for s in survivors}

    # ---- failures ---------------------------------------------------------------------------------
    def on_lost(self, members: set[int], cause: BaseException | None = None, during: str = "calling it") -> None:
        """Members (or replacements being rebuilt) are gone: restart the rebuild of everything lost
        (:meth:`RebuildState.member_lost`). Called with the lock held; losing more than R raises
        TooManyErasuresError (and keeps it). ``during``: what the calling thread was doing, for the record's
        "noticed by" (:func:`~dlrmflow.engine.coding.record.noticed_by`). Reports the loss on this module's
        logger (the run's log under Prefect)."""
        names = [member_name(s, self.code.k) for s in sorted(members)]
        noticed = noticed_by(during, names, cause)
        EVENTS.warning("lost %s: rebuilding from parity while training goes on (noticed by %s)", ", ".join(names),
                       noticed)
        if self.state.member_lost(set(members), cause, time.perf_counter(), noticed) and \
                self.start_rebuild is not None:
            self.recovery_thread = self.start_rebuild(self)

    def finish_rebuild(self, generation: int) -> bool:
        """Every lost member of ``generation`` is rebuilt: its replacement takes its place (lock held).
        False when a further loss superseded that generation."""
        if not self.state.rebuild_finished(generation, time.perf_counter()):
            return False
        self._member_table_changed()
        return True

    def find_dead(self) -> set[int]:
        """Members (or replacements) whose workers do not answer. Called with the lock held."""
        dead = set()
        try:
            self.settle()
        except LostMembersError as exc:
            dead |= exc.members
        calls = [(s, remote(self.state.target(s), "pid")) for s in range(self.code.n_shards)
                 if self.state.target(s) is not None]
        _, error = wait_all(calls)
        return dead | (set() if error is None else error.members)

    def probe(self) -> None:
        """Ping every member so a dead one is noticed (the end of a run touches all of them)."""
        with self.lock:
            self.state.raise_if_fatal()
            try:
                self.settle()
            except LostMembersError as exc:
                self.on_lost(exc.members, exc, "checking every shard at the end of training")
                return
            calls = [(s, remote(self.state.target(s), "applied_batches")) for s in range(self.code.n_shards)
                     if self.state.target(s) is not None]
            _, error = wait_all(calls)
            if error:
                self.on_lost(error.members, error, "checking every shard at the end of training")

    def wait_recovered(self, timeout: float = 600.0) -> None:
        """Block until no member is lost (every rebuild finished); re-raise a fatal loss."""
        self.probe()
        deadline = time.perf_counter() + timeout
        while True:
            with self.lock:
                self.state.raise_if_fatal()
                if not self.state.lost:
                    return
                thread = self.recovery_thread
            if thread is not None:
                thread.join(0.05)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the rebuild of {sorted(self.state.lost)} did not finish in {timeout} s")

    # ---- whole-group reads --------------------------------------------------------------------
    def _on_members(self, calls: Callable[[], list[tuple[int, Any]]]) -> dict[int, Any]:
        """The answers of ``calls()`` (actor calls of members, made under the lock once no member is lost
        and every parity delta is acknowledged); a member lost meanwhile is rebuilt, then all are asked
        again."""
        while True:
            self.wait_recovered()
            with self.lock:
                try:
                    self.settle()
                except LostMembersError as exc:
                    self.on_lost(exc.members, exc, "reading every shard (final state, verify)")
                    continue
                results, error = wait_all(calls())
                if error is None:
                    return results
                self.on_lost(error.members, error, "reading every shard (final state, verify)")

    def all_rows(self) -> np.ndarray:
        rows = self._on_members(lambda: [(s, remote(self.state.members[s], "local_rows")) for s in range(self.code.k)])
        out = np.empty((self.spec.total_rows, self.spec.width), dtype=np.float32)
        for s in range(self.code.k):
            out[s :: self.code.k] = rows[s]
        return out

    def read_stripes(self, start: int, stop: int) -> np.ndarray:
        rows = self._on_members(lambda: [(s, remote(self.state.members[s], "read_stripes", start, stop))
                                         for s in range(self.code.k)])
        return interleave([rows[s] for s in range(self.code.k)], self.spec.width)

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        per = chunk_stripes(self.code.k, chunk or row_files.ROW_CHUNK)
        for start in range(0, self.n_stripes, per):
            yield self.read_stripes(start, min(start + per, self.n_stripes))

    def save_rows(self, directory: str | Path, overlay: tuple[np.ndarray, np.ndarray] | None = None, *,
                  chunk: int | None = None) -> list[dict[str, Any]]:
        files = self._on_members(lambda: list(enumerate(self._save_calls(directory, overlay, chunk,
                                                                         self.state.members[: self.code.k]))))
        return [files[s] for s in range(self.code.k)]

    def save_parity(self, directory: str | Path, *, chunk: int | None = None) -> dict[str, Any]:
        """Every parity shard writes its rows to ``directory/parity-<p>.npy`` on its worker (after the
        pending deltas): the manifest's parity entry (``k``, ``r``, the files)."""
        chunk = chunk or row_files.ROW_CHUNK
        k = self.code.k
        files = self._on_members(lambda: [(s, remote(self.state.members[s], "save_rows",
                                                     str(Path(directory) / parity_file(s - k)), None, None, chunk))
                                          for s in range(k, self.code.n_shards)])
        return {"k": k, "r": self.code.r, "files": [files[s] for s in range(k, self.code.n_shards)]}

    def stats(self):
        self.wait_recovered()
        return super().stats()

    def verify(self, chunk: int | None = None) -> dict[str, Any]:
        """Recompute parity from the data shards and compare bit for bit with the parity shards, a chunk
        of stripes at a time (no process holds more than two chunks of the members' rows)."""
        per = chunk_stripes(self.code.n_shards, chunk or row_files.ROW_CHUNK)
        mismatched = [np.zeros(0, dtype=np.int64)] * self.code.r
        for start in range(0, self.n_stripes, per):
            stop = min(start + per, self.n_stripes)
            rows = self._on_members(lambda start=start, stop=stop: [
                (s, remote(self.state.members[s], "read_stripes", start, stop)) for s in range(self.code.n_shards)])
            found = self.code.verify([rows[s] for s in range(self.code.k)],
                                     [rows[s] for s in range(self.code.k, self.code.n_shards)])
            mismatched = [np.concatenate([m, f + start]) for m, f in zip(mismatched, found, strict=True)]
        return {"ok": all(len(m) == 0 for m in mismatched), "stripes": self.n_stripes,
                "mismatched_stripes": [int(len(m)) for m in mismatched], "first_mismatches": [m[:5].tolist()
                                                                                      for m in mismatched]}

    def close(self) -> None:
        with self.lock:
            self.state.closed()
        if self.recovery_thread is not None:
            self.recovery_thread.join(30)
        with self.lock:
            state = self.state
            held = [*state.member_futures, *state.replacement_future.values(),
                    *(future for _, future, _ in state.standby.values())]
            handles = [*state.members, *state.replacement.values(), *(actor for _, _, actor in state.standby.values())]
            state.released()
        release_actors(held, handles)  # the members, replacements and standbys end now (ShardGroup.close)
        super().close()

    def summary(self) -> dict[str, Any]:
        state = self.state
        return {
            "parity_shards": self.code.r,
            "write_back_batches": self.batching.write_batches,
            "parity_messages": self.batching.parity_messages,  # per parity shard: up to parity_batches batches each
            "parity_bytes_sent": int(self.batching.parity_bytes),
            "degraded_rows_read": int(self.degraded_rows),
            "checked_out_rows_bytes": self.checked_out.nbytes,
            "parity_rows_bytes": int(self.code.r * self.n_stripes * self.spec.row_bytes),
            "member_workers": {member_name(s, self.code.k): w for s, w in enumerate(state.worker_of)},
            "members_share_workers": self.shared_workers,  # then one kill can take several members
            "standby_worker": next((w for w, _, _ in state.standby.values()), None),  # its standbys left
            "recoveries": [r.as_dict(self.code.k, self.started_at) for r in state.recoveries],
            "clock_origin": self.started_at,  # perf_counter() that the *_s times count from
        }
