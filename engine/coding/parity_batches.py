"""The trainer's write path as state, and the only code that changes it: batches, parity deltas, messages.

:class:`ParityBatching` numbers the write-back batches (``seq``), records the rows written back
(``written``, a :class:`WrittenRows`), keeps the batches whose parity deltas are not sent yet
(``pending``) and the parity messages whose acknowledgements are not awaited yet (``unsettled``),
decides when a message is due (every ``parity_batches`` batches), and counts batches, messages and
delta bytes. Events come in as named transitions (:meth:`~ParityBatching.batch_written`,
:meth:`~ParityBatching.send_begun`, :meth:`~ParityBatching.sent`, :meth:`~ParityBatching.acks_awaited`);
what the caller must do comes out as return values (:class:`SendParity`, :class:`AwaitAcks`). No
network, no threads, no locks: :class:`~dlrmflow.engine.coding.group.CodedShardGroup` holds its lock
around every call, carries out the actions, and reads who receives a member's traffic from
:class:`~dlrmflow.engine.coding.rebuild_state.RebuildState` (the member table lives there alone).
Attributes are read-only outside this class, but for ``parity_batches`` (configuration); a group
started from checkpoint rows marks every row written (:meth:`~ParityBatching.mark_all_written`).

The rules, argued in docs/rebuild.md:

- Every write-back batch has a sequence number of its own, and every member applies a number once: a
  batch resent after a loss keeps its number (the caller resends what :meth:`~ParityBatching.batch_written`
  numbered), so it is a no-op wherever it already landed.
- A batch's deltas leave ``pending`` once, in order, into one message per parity shard that has a
  target at that moment; they are never sent again. A lost parity shard with no replacement yet gets
  none: its rebuild decodes those batches from the data shards.
- Deltas leave ``pending`` only once every earlier message's acknowledgement was awaited
  (``unsettled`` empty), so a parity shard's messages never overlap, and one read along with a message
  (a degraded read, a fix-up) has applied every batch before its read.
- A message is due once ``parity_batches`` batches are pending. When awaiting the previous message's
  acknowledgements fails (a member lost), the deltas stay pending and go with the next message, which
  then carries one batch more.
- Settled (nothing pending, nothing unsettled): data and parity are one codeword.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlrmflow.engine.coding.erasure import ErasureCode

# A pending batch: (seq, (ids, row changes)) until combined, then (seq, its StripeDelta).
Batch = tuple[int, Any]


@dataclass(frozen=True)
class SendParity:
    """Action: one message to parity member ``member``: apply the deltas of batches ``seqs`` (each batch's
    ``stripes`` and this member's ``parity`` rows of them), each once. With ``gather`` it also returns its
    rows of the read's stripes once they are applied (``apply_and_gather``, awaited with the read);
    without, the caller reports the call :meth:`~ParityBatching.sent` (``apply_batches``) or awaits it
    at once. ``seqs`` may be empty for a gather alone."""

    member: int
    seqs: tuple[int, ...]
    stripes: tuple[Any, ...]
    parity: tuple[Any, ...]
    gather: bool


@dataclass(frozen=True)
class AwaitAcks:
    """Action: wait for the answer of every ``(member, call)`` in ``calls`` (a member whose call failed is
    lost). Whatever the answers, those calls are no longer unsettled."""

    calls: tuple[tuple[int, Any], ...]


def _distinct(ids: np.ndarray) -> np.ndarray:
    """Sorted ``ids`` without repeats (``np.unique`` sorts too, many times slower than ``np.sort``)."""
    return ids[np.concatenate(([True], ids[1:] != ids[:-1]))] if len(ids) else ids


class WrittenRows:
    """The rows of a table of ``total_rows`` that the trainer has written back, as a rebuild asks for them
    (:meth:`stripes`). Only what was written is kept, in whichever of three forms is smaller:

    - sparse: the distinct ids, sorted (``ids``), and the batches added since they were last merged
      (``recent``): 8 bytes per row written, while that is under a bitmap's size (rows written up to
      ``sparse_limit``, a 64th of the table by default);
    - dense: a bitmap of the table (``bits``, ``total_rows / 8`` bytes), once the ids kept (merged and
      recent, a row written twice counted twice) would take more;
    - all: nothing (``all``), once every row counts as written (:meth:`mark_all`, or every bit set).

    So memory is ``min(8 * rows written, total_rows / 8)`` bytes, and none once every row is written
    (the recent batches add at most as many ids as are merged, or ``MERGE_MIN``). A batch costs its own
    size: the recent batches are merged (a sort) only once they hold as many ids as the merged ones, so
    each id is merged a logarithmic number of times, not once per batch."""

    MERGE_MIN = 1 << 16  # recent ids merged at once at the least: a merge of a few ids is mostly overhead

    def __init__(self, total_rows: int, sparse_limit: int | None = None) -> None:
        self.total_rows = total_rows
        # The most ids kept sorted before the bitmap is smaller (8 bytes an id, one bit a row).
        self.sparse_limit = (total_rows + 7) // 8 // 8 if sparse_limit is None else sparse_limit
        self.ids = np.zeros(0, dtype=np.int64)
        self.recent: list[np.ndarray] = []
        self.recent_count = 0
        self.bits: np.ndarray | None = None  # the bitmap, bit ``i % 8`` of byte ``i // 8`` for row ``i``
        self.bits_set = 0
        self.all = False

    @property
    def nbytes(self) -> int:
        bits = 0 if self.bits is None else self.bits.nbytes
        return int(self.ids.nbytes + sum(batch.nbytes for batch in self.recent) + bits)

    def add(self, ids: np.ndarray) -> None:
        """Rows ``ids`` were written back."""
        if self.all:
            return
        ids = np.array(ids, dtype=np.int64)  # a copy: the caller's array may change
        if self.bits is not None:
            self._set_bits(ids)
            return
        self.recent.append(ids)
        self.recent_count += len(ids)
        if len(self.ids) + self.recent_count > self.sparse_limit:
            self._to_bitmap()
        elif self.recent_count >= max(len(self.ids), self.MERGE_MIN):
            self._merge()

    def mark_all(self) -> None:
        """Every row counts as written (the forms above are dropped)."""
        self.all = True
        self.ids, self.recent, self.recent_count, self.bits = np.zeros(0, dtype=np.int64), [], 0, None

    def rows(self) -> np.ndarray:
        """The rows written, sorted (tests and diagnostics: the dense and all forms build it whole)."""
        self._merge()  # first: it may find every row written
        if self.all:
            return np.arange(self.total_rows, dtype=np.int64)
        if self.bits is not None:
            return np.flatnonzero(self._flags(0, self.total_rows)).astype(np.int64)
        return self.ids.copy()

    def stripes(self, columns: list[int], k: int) -> np.ndarray:
        """Stripes (rows ``s * k`` .. ``s * k + k - 1``) where the row of some column of ``columns`` (each
        below ``k``) was written, sorted; a stripe past a column's last row has none of it."""
        if not columns:
            return np.zeros(0, dtype=np.intp)
        self._merge()  # first: it may find every row written
        if self.all:
            return np.arange(max(len(range(c, self.total_rows, k)) for c in columns), dtype=np.intp)
        if self.bits is None:
            ids = self.ids if len(set(columns)) == k else self.ids[np.isin(self.ids % k, columns)]
            return _distinct((ids // k).astype(np.intp))  # sorted, as the ids are
        n_stripes = len(range(0, self.total_rows, k))
        per = 8 * max(1, (1 << 22) // (8 * k))  # stripes a chunk: its first row a multiple of 8 (a whole byte)
        found = [np.zeros(0, dtype=np.intp)]
        for start in range(0, n_stripes, per):
            stop = min(start + per, n_stripes)
            flags = self._flags(start * k, min(stop * k, self.total_rows))
            copy = np.zeros(stop - start, dtype=bool)
            for column in columns:
                rows = flags[column::k]  # the column's rows, one per stripe (a short column: fewer)
                copy[: len(rows)] |= rows
            found.append(np.flatnonzero(copy) + start)
        return np.concatenate(found)

    def _merge(self) -> None:
        if self.recent:
            self.ids = _distinct(np.sort(np.concatenate([self.ids, *self.recent])))
            self.recent, self.recent_count = [], 0
            if len(self.ids) == self.total_rows:
                self.mark_all()

    def _to_bitmap(self) -> None:
        ids = np.concatenate([self.ids, *self.recent])
        self.ids, self.recent, self.recent_count = np.zeros(0, dtype=np.int64), [], 0
        self.bits = np.zeros((self.total_rows + 7) // 8, dtype=np.uint8)
        self._set_bits(ids)

    def _set_bits(self, ids: np.ndarray) -> None:
        unset = ((self.bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1) == 0
        new = _distinct(np.sort(ids[unset]))
        np.bitwise_or.at(self.bits, new >> 3, np.left_shift(1, new & 7).astype(np.uint8))
        self.bits_set += len(new)
        if self.bits_set == self.total_rows:
            self.mark_all()

    def _flags(self, start: int, stop: int) -> np.ndarray:
        """One flag per row of ``start`` .. ``stop - 1`` (``start`` a multiple of 8), from the bitmap."""
        return np.unpackbits(self.bits[start // 8 : (stop + 7) // 8], bitorder="little")[: stop - start].view(bool)


class ParityBatching:
    """The write path's batches, pending deltas and unacknowledged messages (see the module docstring)."""

    def __init__(self, code: ErasureCode, total_rows: int, parity_batches: int) -> None:
        self.code = code
        self.parity_batches = parity_batches  # write-back batches whose deltas travel in one message
        # The rows the trainer has written back: the only rows that may differ from their initial values,
        # so the only ones a rebuild copies.
        self.written = WrittenRows(total_rows)
        self.seq = 0  # the last write-back batch's number (0: none yet; a batch with no write has 0)
        self.pending: list[Batch] = []  # batches whose deltas are not sent yet, in order
        self.unsettled: list[tuple[int, Any]] = []  # (member, call): parity messages sent, not yet acknowledged
        self.write_batches = 0
        self.parity_messages = 0  # per parity shard: up to parity_batches batches each
        self.parity_bytes = 0  # delta bytes, counted over every parity shard

    # ---- queries ----------------------------------------------------------------------------------
    def parity_due(self) -> bool:
        """A parity message is due: ``parity_batches`` batches (or more) are pending."""
        return len(self.pending) >= self.parity_batches

    @property
    def settled(self) -> bool:
        """Every delta sent and every message acknowledged: data and parity are one codeword."""
        return not self.pending and not self.unsettled

    def stripes_to_copy(self, lost: list[int]) -> np.ndarray:
        """Stripes where a member of ``lost`` may hold anything but its initial rows: a lost data
        shard only where the trainer wrote its row, a lost parity shard where it wrote any row of
        the stripe (parity changes with every data row). Every other stripe a replacement generates."""
        k = self.code.k
        columns = range(k) if any(s >= k for s in lost) else sorted(set(lost))
        return self.written.stripes(list(columns), k)

    def written_rows(self) -> np.ndarray:
        """The rows written back so far, sorted (every row of the table once all count as written)."""
        return self.written.rows()

    # ---- events -----------------------------------------------------------------------------------
    def batch_written(self, ids: np.ndarray, changes: np.ndarray) -> int:
        """A write-back batch of rows ``ids`` (not empty) with row changes ``changes`` (``old ^ new``): its
        number, which every send and resend of the batch carries. Its delta is pending."""
        self.seq += 1
        self.written.add(ids)
        self.pending.append((self.seq, (ids.copy(), changes)))  # combined while the shards work
        self.write_batches += 1
        return self.seq

    def mark_all_written(self) -> None:
        """Every row counts as written from now on: rows restored from a checkpoint may all differ from
        their initial values, so a rebuild copies every stripe."""
        self.written.mark_all()

    def combine_pending(self) -> None:
        """Turn each pending batch's row changes into its parity delta (each touched stripe once). The
        caller runs it while the data shards work on a batch; idempotent."""
        k = self.code.k
        for n, (seq, batch) in enumerate(self.pending):
            if isinstance(batch, tuple):
                ids, changes = batch
                delta = self.code.combine_changes(ids % k, ids // k, changes)
                self.parity_bytes += self.code.r * delta.parity[0].nbytes
                self.pending[n] = (seq, delta)

    def send_begun(self, reachable: Collection[int], gather_from: Collection[int] = ()) -> list[SendParity]:
        """Every pending delta goes out now: one message per parity member in ``reachable`` (those with a
        target), in member order; a member in ``gather_from`` gets one even with nothing pending, and reads
        after applying. Nothing is pending afterwards. Only once every earlier message is acknowledged
        (:meth:`acks_awaited` since the last :meth:`sent`): RuntimeError otherwise."""
        if self.unsettled:
            raise RuntimeError(f"parity deltas sent while {len(self.unsettled)} earlier messages are unacknowledged")
        self.combine_pending()
        batches, self.pending = self.pending, []
        seqs = tuple(seq for seq, _ in batches)
        stripes = tuple(delta.stripes for _, delta in batches)
        k, messages = self.code.k, []
        for p in range(self.code.r):
            if k + p not in reachable or not (batches or k + p in gather_from):
                continue
            parity = tuple(delta.parity[p] for _, delta in batches)
            messages.append(SendParity(k + p, seqs, stripes, parity, k + p in gather_from))
        self.parity_messages += bool(batches)
        return messages

    def sent(self, calls: list[tuple[int, Any]]) -> None:
        """Parity messages went out as ``(member, call)``; their acknowledgements are awaited later."""
        self.unsettled += calls

    def acks_awaited(self) -> AwaitAcks:
        """The caller waits for every unsettled message now (before it sends more, or reads parity)."""
        calls, self.unsettled = self.unsettled, []
        return AwaitAcks(tuple(calls))
