"""The trainer's write path as state, and the only code that changes it: batches, parity deltas, messages.

:class:`ParityBatching` numbers the write-back batches (``seq``), marks the rows written back
(``written``), keeps the batches whose parity deltas are not sent yet (``pending``) and the parity
messages whose acknowledgements are not awaited yet (``unsettled``), decides when a message is due
(every ``parity_batches`` batches), and counts batches, messages and delta bytes. Events come in as
named transitions (:meth:`~ParityBatching.batch_written`, :meth:`~ParityBatching.send_begun`,
:meth:`~ParityBatching.sent`, :meth:`~ParityBatching.acks_awaited`); what the caller must do comes out
as return values (:class:`SendParity`, :class:`AwaitAcks`). No network, no threads, no locks:
:class:`~dlrmflow.engine.coding.group.CodedShardGroup` holds its lock around every call, carries out
the actions, and reads who receives a member's traffic from
:class:`~dlrmflow.engine.coding.rebuild_state.RebuildState` (the member table lives there alone).
Attributes are read-only outside this class, but for ``parity_batches`` (configuration) and
``written`` (a group started from checkpoint rows marks every row).

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


class ParityBatching:
    """The write path's batches, pending deltas and unacknowledged messages (see the module docstring)."""

    def __init__(self, code: ErasureCode, total_rows: int, parity_batches: int) -> None:
        self.code = code
        self.parity_batches = parity_batches  # write-back batches whose deltas travel in one message
        self.n_stripes = len(range(0, total_rows, code.k))
        # Rows the trainer has written back (one byte per table row, like ``checked_out.pos``'s four):
        # the only rows that may differ from their initial values, so the only ones a rebuild copies.
        self.written = np.zeros(total_rows, dtype=bool)
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
        copy = np.zeros(self.n_stripes, dtype=bool)
        for column in range(k) if any(s >= k for s in lost) else sorted(lost):
            rows = self.written[column::k]  # data shard ``column``'s rows, one per stripe (a short shard: fewer)
            copy[: len(rows)] |= rows
        return np.flatnonzero(copy)

    # ---- events -----------------------------------------------------------------------------------
    def batch_written(self, ids: np.ndarray, changes: np.ndarray) -> int:
        """A write-back batch of rows ``ids`` (not empty) with row changes ``changes`` (``old ^ new``): its
        number, which every send and resend of the batch carries. Its delta is pending."""
        self.seq += 1
        self.written[ids] = True
        self.pending.append((self.seq, (ids.copy(), changes)))  # combined while the shards work
        self.write_batches += 1
        return self.seq

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
