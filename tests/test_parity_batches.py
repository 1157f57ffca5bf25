"""The write path's state without threads or a cluster: events in, actions out.

A pure-NumPy model carries out :class:`ParityBatching`'s actions as
:class:`~dlrmflow.engine.coding.group.CodedShardGroup` does, with :class:`RebuildState` as the member
table: write-back batches and the message that is due after them, degraded reads (the pending deltas
go out with the read; the read's parity shards answer at once, the others later; the batch resent
after a loss), messages that land before their acknowledgement is awaited, a parity shard whose
worker dies (noticed when a call to it fails) and its replacement, settles. Each parity member (or
replacement) records every batch number it was sent and applies each number once, as the actors do.

The tests run every order of a few such events, and random traces; after every event: every batch's
deltas left ``pending`` once, in order, and reached every parity shard that had a target then, once
(never resent: a resent batch carries no delta twice); a message carries at most ``parity_batches``
batches, one more for each failed wait for acknowledgements since the previous message; a parity
shard read along with a message has applied every batch before the read; the counters match. After a
settle nothing is pending or unacknowledged and every parity shard that never died holds the encoding
of the data, bit for bit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dlrmflow.engine.coding.erasure import ErasureCode, xor_bits
from dlrmflow.engine.coding.parity_batches import AwaitAcks, ParityBatching, SendParity, WrittenRows
from dlrmflow.engine.coding.rebuild_state import RebuildState

WIDTH = 2  # float32 values per row


class Lost(Exception):
    """Calls to these members failed: their workers are gone (LostMembersError in the group)."""

    def __init__(self, members: set[int]) -> None:
        super().__init__(sorted(members))
        self.members = members


class Parity:
    """A parity member or a replacement: applies each batch number once, records every number it got."""

    def __init__(self, code: ErasureCode, rows: np.ndarray) -> None:
        self.code, self.rows = code, rows.copy()
        self.applied: set[int] = set()
        self.received: list[int] = []  # every batch number delivered, repeats included
        self.dead = False

    def apply(self, seqs, stripes, deltas) -> None:
        for seq, rows, delta in zip(seqs, stripes, deltas, strict=True):
            self.received.append(seq)
            if seq not in self.applied:
                self.code.apply_delta(self.rows, delta, rows=rows)
                self.applied.add(seq)


class Call:
    """A message on its way: it lands at the latest when awaited, unless its member died first."""

    def __init__(self, target: Parity, message: SendParity, gather: np.ndarray | None) -> None:
        self.target, self.message, self.gather = target, message, gather
        self.landed = False

    def land(self) -> None:
        if not self.landed and not self.target.dead:
            self.target.apply(list(self.message.seqs), list(self.message.stripes), list(self.message.parity))
            self.landed = True

    def result(self):
        self.land()
        if not self.landed:
            raise OSError("the actor's worker is gone")
        return None if self.gather is None else self.target.rows[self.gather].copy()


def wait_all(calls) -> tuple[dict, Lost | None]:
    """:func:`~dlrmflow.engine.serving.shards.wait_all`: every answer, and the members whose call failed."""
    results, lost = {}, set()
    for s, call in calls:
        try:
            results[s] = call.result()
        except OSError:
            lost.add(s)
    return results, (Lost(lost) if lost else None)


class System:
    """K data + R parity members (data shard 0 lost from the start: reads of its rows are degraded) and
    the trainer's write path, driven as CodedShardGroup drives it; the model checks every event."""

    def __init__(self, k: int, r: int, n_rows: int, parity_batches: int, seed: int) -> None:
        self.k, self.r, self.n_rows = k, r, n_rows
        self.code = ErasureCode(k, r)
        self.rng = np.random.default_rng(seed)
        self.data = self.rng.standard_normal((n_rows, WIDTH)).astype(np.float32)  # what the data shards hold
        parity = [Parity(self.code, rows) for rows in self.encoding()]
        self.originals = {k + p: member for p, member in enumerate(parity)}
        self.rebuild = RebuildState(self.code, len(range(0, n_rows, k)), [None] * k + parity, [None] * (k + r),
                                    [f"w{s}" for s in range(k + r)])
        self.rebuild.member_lost({0}, None, 0.0)  # no replacement: every read of its rows is degraded
        self.state = ParityBatching(self.code, n_rows, parity_batches)
        self.incarnations: list[Parity] = list(parity)  # every parity member and replacement ever placed
        # What the model expects, from the actions alone.
        self.taken: list[int] = []  # batch numbers in the order they left ``pending``
        self.sent_to: dict[int, list[int]] = {id(m): [] for m in parity}  # numbers in messages to each incarnation
        self.batch_bytes: dict[int, int] = {}  # delta bytes of each batch, over every parity shard
        self.written = np.zeros(n_rows, dtype=bool)
        self.messages = 0  # send_begun calls that took batches
        self.failed_since_message = 0  # failed waits for acknowledgements since the last message
        self.settles = 0

    def encoding(self) -> list[np.ndarray]:
        return self.code.encode([self.data[i :: self.k] for i in range(self.k)])

    # ---- the driver (CodedShardGroup's part, step for step) --------------------------------------
    def on_lost(self, members: set[int]) -> None:
        self.rebuild.member_lost(members, None, 0.0)

    def send(self, gather: np.ndarray | None = None, to: tuple[int, ...] = ()) -> list[tuple[int, Call]]:
        """``_send_pending``: one call per message that ``send_begun`` returns."""
        k = self.k
        reachable = [s for s in range(k, k + self.r) if self.rebuild.target(s) is not None]
        before = [seq for seq, _ in self.state.pending]
        messages = self.state.send_begun(reachable, gather_from=to)
        self.record_messages(before, messages, reachable, to)
        return [(m.member, Call(self.rebuild.target(m.member), m, gather if m.gather else None)) for m in messages]

    def await_acks(self) -> None:
        action = self.state.acks_awaited()
        assert isinstance(action, AwaitAcks) and not self.state.unsettled
        _, error = wait_all(list(action.calls))
        if error:
            raise error

    def send_parity(self) -> None:
        self.await_acks()
        self.state.sent(self.send())

    def settle(self) -> None:
        self.send_parity()
        self.await_acks()

    def write(self, degraded: bool = False, resend: bool = False) -> None:
        """``exchange``: a write-back batch (with a degraded read when ``degraded``: the pending deltas go
        out with it; ``resend``: a data shard died mid-batch, so the batch goes again with the same number)."""
        ids = np.unique(self.rng.integers(0, self.n_rows, size=int(self.rng.integers(1, self.n_rows))))
        new = self.rng.standard_normal((len(ids), WIDTH)).astype(np.float32)
        same = self.rng.random(len(ids)) < 0.2
        new[same] = self.data[ids[same]]  # written back unchanged
        changes = xor_bits(self.data[ids], new)
        seq_before = self.state.seq
        seq = self.state.batch_written(ids, changes)
        assert seq == seq_before + 1
        self.data[ids] = new  # the data shards apply it (a resend changes nothing there: same number)
        self.written[ids] = True
        self.batch_bytes[seq] = self.r * len(np.unique(ids // self.k)) * WIDTH * 4
        for attempt in range(1 + (degraded and resend)):
            while degraded:  # ``_exchange_once`` until no call fails; a loss is handled, then the batch resent
                try:
                    self.degraded_read(ids // self.k, resent=attempt > 0)
                    break
                except Lost as exc:
                    self.on_lost(exc.members)
        self.state.combine_pending()
        if self.state.parity_due():
            try:
                self.send_parity()
            except Lost as exc:
                self.failed_since_message += 1
                self.on_lost(exc.members)

    def degraded_read(self, stripes: np.ndarray, resent: bool) -> None:
        """The parity half of a degraded read: earlier messages acknowledged, then the pending deltas go out
        with the read; the read's parity shards answer with the batch, the others are acknowledged later."""
        stripes = np.unique(stripes)
        survivors = self.rebuild.survivors()
        self.await_acks()
        now, later = [], []
        for s, call in self.send(gather=stripes, to=survivors):
            (now if s in survivors else later).append((s, call))
        self.state.sent(later)
        if resent:
            assert not any(call.message.seqs for _, call in now + later), "a resent batch sent deltas again"
        self.state.combine_pending()
        results, error = wait_all(now)
        self.check_read(results, stripes)
        if error:
            raise error

    def read_current(self) -> None:
        """A fix-up's read: every pending delta goes out with it, and every call is awaited at once."""
        stripes = np.unique(self.rng.integers(0, len(range(0, self.n_rows, self.k)), size=3))
        survivors = self.rebuild.survivors()
        self.await_acks()
        results, error = wait_all(self.send(gather=stripes, to=survivors))
        self.check_read(results, stripes)
        if error:
            raise error

    # ---- events from outside ----------------------------------------------------------------------
    def kill(self, p: int) -> None:
        """The worker of parity member ``k + p``'s current target dies (noticed when a call to it fails)."""
        target = self.rebuild.target(self.k + p)
        if target is not None:
            target.dead = True

    def replace(self) -> None:
        """The rebuild places a fresh replacement for every noticed parity loss without one."""
        for s in sorted(self.rebuild.lost):
            if s >= self.k and s not in self.rebuild.replacement:
                replacement = Parity(self.code, np.zeros_like(self.originals[s].rows))
                self.incarnations.append(replacement)
                self.sent_to[id(replacement)] = []
                assert self.rebuild.replacement_placed(s, f"spare{len(self.incarnations)}", None, replacement)

    def land(self) -> None:
        """Every message on its way lands (its acknowledgement is still to be awaited)."""
        for _, call in self.state.unsettled:
            call.land()

    def settled(self) -> None:
        """``settle`` as the group's callers use it: a loss is handled and the settle tried again."""
        for _ in range(3):
            try:
                self.settle()
                break
            except Lost as exc:
                self.failed_since_message += bool(self.state.pending)  # the wait before the message failed
                self.on_lost(exc.members)
        else:
            raise AssertionError("settle kept failing")
        self.settles += 1
        assert self.state.settled and self.state.pending == [] and self.state.unsettled == []
        assert self.taken == list(range(1, self.state.seq + 1))
        encoding = self.encoding()
        for s, member in self.originals.items():
            if not member.dead:
                assert member.received == self.taken, s
                assert np.array_equal(member.rows.view(np.uint32), encoding[s - self.k].view(np.uint32)), s

    # ---- what the model expects -------------------------------------------------------------------
    def record_messages(self, before: list[int], messages: list[SendParity], reachable: list[int],
                        to: tuple[int, ...]) -> None:
        """``send_begun`` took every pending batch, in order, into one message per reachable parity member."""
        assert self.state.pending == []
        if before:
            assert len(before) <= self.state.parity_batches + self.failed_since_message, before
            self.messages += 1
            self.failed_since_message = 0
        self.taken += before
        expected = [s for s in reachable if before or s in to]
        assert [m.member for m in messages] == expected
        for m in messages:
            assert list(m.seqs) == before and m.gather == (m.member in to)
            assert len(m.stripes) == len(m.parity) == len(before)
            self.sent_to[id(self.rebuild.target(m.member))].extend(m.seqs)

    def check_read(self, results: dict[int, np.ndarray], stripes: np.ndarray) -> None:
        """A parity shard that never died, read along with a message, holds the encoding of the data."""
        encoding = self.encoding()
        for s, rows in results.items():
            if rows is not None and self.rebuild.target(s) is self.originals.get(s):
                assert np.array_equal(rows.view(np.uint32), encoding[s - self.k][stripes].view(np.uint32)), s

    def check(self) -> None:
        state = self.state
        pending = [seq for seq, _ in state.pending]
        assert self.taken + pending == list(range(1, state.seq + 1))  # each batch left pending once, in order
        assert len(pending) < state.parity_batches + self.failed_since_message
        members = [s for s, _ in state.unsettled]
        assert len(members) == len(set(members))  # at most one unacknowledged message per member
        for member in self.incarnations:  # each batch sent once to each member, in order
            sent = self.sent_to[id(member)]
            assert sent == sorted(set(sent)), sent
            assert member.received == sorted(set(member.received)) and set(member.received) <= set(sent)
        for s, member in self.originals.items():
            if not member.dead:  # it got every batch taken so far: landed, or on its way
                assert self.sent_to[id(member)] == self.taken, s
        combined = self.taken + [seq for seq, batch in state.pending if not isinstance(batch, tuple)]
        assert state.write_batches == state.seq == len(self.batch_bytes)
        assert state.parity_messages == self.messages
        assert state.parity_bytes == sum(self.batch_bytes[seq] for seq in combined)
        assert np.array_equal(state.written_rows(), np.flatnonzero(self.written))

    def run(self, event: str) -> None:
        if event == "write":
            self.write()
        elif event == "degraded":
            self.write(degraded=True)
        elif event == "resent":
            self.write(degraded=True, resend=True)
        elif event == "read":
            try:
                self.read_current()
            except Lost as exc:
                self.on_lost(exc.members)
        elif event.startswith("kill"):
            self.kill(int(event[4:]))
        elif event == "replace":
            self.replace()
        elif event == "land":
            self.land()
        elif event == "settle":
            self.settled()
        else:
            raise ValueError(event)
        self.check()


def _distinct_orders(events: list[str]) -> list[tuple[str, ...]]:
    return sorted(set(itertools.permutations(events)))


@pytest.mark.parametrize("parity_batches", [1, 2])
def test_every_order_of_batches_a_degraded_read_a_loss_and_a_replacement(parity_batches):
    """K = 2, R = 2: three batches, a batch with a degraded read resent after a loss, parity shard 0's
    worker dying, a replacement, messages landing early, in every order; then a settle."""
    orders = _distinct_orders(["write"] * 3 + ["resent", "kill0", "replace", "land"])
    assert len(orders) == 840
    for order in orders:
        system = System(2, 2, 10, parity_batches, seed=1)
        for event in order:
            system.run(event)
        system.run("settle")
        assert system.state.seq == 4


def test_every_order_of_batches_reads_settles_and_a_loss():
    """K = 2, R = 2, a message every 2 batches: three batches, a fix-up's read, a settle, parity shard 1's
    worker dying, messages landing early, in every order; then a settle."""
    orders = _distinct_orders(["write"] * 3 + ["read", "settle", "kill1", "land"])
    for order in orders:
        system = System(2, 2, 9, 2, seed=2)
        for event in order:
            system.run(event)
        system.run("settle")
        assert system.settles == 2


@pytest.mark.parametrize("seed", range(30))
def test_random_traces(seed):
    """K = 3, R = 2, 1-4 batches a message: random traces of every event; a parity shard (or its
    replacement) dies at most once at a time besides the lost data shard, so R is never exceeded."""
    rng = np.random.default_rng(500 + seed)
    system = System(3, 2, int(rng.integers(4, 20)), int(rng.integers(1, 5)), seed=seed)
    events = ["write", "write", "write", "degraded", "resent", "read", "land", "settle", "kill", "replace"]
    for _ in range(80):
        event = events[int(rng.integers(0, len(events)))]
        if event == "kill":  # parity member 3 + p's target dies, unless the other one is lost or dying
            p = int(rng.integers(0, 2))
            other = system.rebuild.target(4 - p)
            if other is None or other.dead or 4 - p in system.rebuild.lost:
                continue
            event = f"kill{p}"
        system.run(event)
    system.run("settle")


def test_a_message_every_parity_batches_batches_and_its_actions():
    code = ErasureCode(2, 2)
    state = ParityBatching(code, 6, parity_batches=2)
    rng = np.random.default_rng(0)
    ids = [np.array([0, 3]), np.array([1, 2, 5])]
    for n, batch in enumerate(ids, start=1):
        assert not state.parity_due()
        assert state.batch_written(batch, rng.standard_normal((len(batch), WIDTH)).astype(np.float32)) == n
    assert state.parity_due() and state.write_batches == 2 and state.parity_bytes == 0
    assert state.written_rows().tolist() == [0, 1, 2, 3, 5]
    messages = state.send_begun([2, 3])
    assert [(m.member, m.seqs, m.gather) for m in messages] == [(2, (1, 2), False), (3, (1, 2), False)]
    assert [m.stripes[0].tolist() for m in messages] == [[0, 1]] * 2  # rows 0 and 3: stripes 0 and 1
    assert state.parity_messages == 1 and state.parity_bytes == 2 * (2 + 3) * WIDTH * 4
    assert state.pending == [] and state.settled  # nothing unsettled until the calls are reported sent
    state.sent([(2, "call2"), (3, "call3")])
    assert not state.settled
    with pytest.raises(RuntimeError, match="2 earlier messages are unacknowledged"):
        state.send_begun([2, 3])
    assert state.acks_awaited() == AwaitAcks(((2, "call2"), (3, "call3")))
    assert state.settled and state.acks_awaited() == AwaitAcks(())
    # A lost parity shard with no replacement gets nothing; a read's parity shard gets a gather alone.
    assert state.send_begun([3], gather_from=(1, 3)) == [SendParity(3, (), (), (), True)]
    assert state.parity_messages == 1
    state.batch_written(np.array([4]), np.ones((1, WIDTH), np.float32))
    (message,) = state.send_begun([3])
    assert message.seqs == (3,) and state.parity_messages == 2


def test_a_failed_wait_keeps_the_deltas_for_the_next_message():
    """The wait for the previous message's acknowledgements fails (a parity shard lost): the deltas stay
    pending, and the next message carries one batch more than ``parity_batches``."""
    system = System(2, 2, 8, 1, seed=3)
    system.run("write")  # message 1 on its way
    system.run("kill0")  # its member dies before it lands
    system.run("write")  # awaiting message 1 fails: batch 2 stays pending
    assert [seq for seq, _ in system.state.pending] == [2] and system.rebuild.target(2) is None
    system.run("write")
    assert system.taken == [1, 2, 3] and system.state.parity_messages == 2
    assert system.sent_to[id(system.originals[3])] == [1, 2, 3]
    system.run("settle")


def test_stripes_to_copy():
    state = ParityBatching(ErasureCode(3, 1), 10, parity_batches=8)  # 4 stripes; data shard 0 holds one more row
    state.batch_written(np.array([1, 9]), np.zeros((2, WIDTH), np.float32))
    assert state.stripes_to_copy([1]).tolist() == [0]
    assert state.stripes_to_copy([0]).tolist() == [3]
    assert state.stripes_to_copy([2]).tolist() == []
    assert state.stripes_to_copy([3]).tolist() == [0, 3]  # a parity shard: every stripe with a written row


def test_stripes_to_copy_once_every_row_counts_as_written():
    """A group started from checkpoint rows: every stripe a lost member holds is copied (a short data shard
    has no row in the last stripe), whatever is written later."""
    state = ParityBatching(ErasureCode(3, 1), 10, parity_batches=8)
    state.mark_all_written()
    state.batch_written(np.array([1]), np.zeros((1, WIDTH), np.float32))
    assert state.stripes_to_copy([0]).tolist() == [0, 1, 2, 3]
    assert state.stripes_to_copy([1, 2]).tolist() == [0, 1, 2]
    assert state.stripes_to_copy([3]).tolist() == [0, 1, 2, 3]
    assert state.written_rows().tolist() == list(range(10)) and state.written.nbytes == 0


def _stripes_from_flags(written: np.ndarray, columns, k: int) -> np.ndarray:
    """Stripes with a written row in one of ``columns``, from one flag per table row."""
    copy = np.zeros(len(range(0, len(written), k)), dtype=bool)
    for column in columns:
        rows = written[column::k]
        copy[: len(rows)] |= rows
    return np.flatnonzero(copy)


@pytest.mark.parametrize("seed", range(40))
def test_written_rows_match_a_flag_per_row(seed):
    """Whatever rows are written (some twice, in one batch or more), in each of its forms (sorted ids,
    merged now and then; a bitmap past ``sparse_limit``; nothing once every row is written): the rows and
    the stripes of any columns are those a flag per row gives, the same arrays, dtype included."""
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 5)) if seed % 4 == 0 else int(rng.integers(0, 300))
    sparse_limit = [None, 0, 3, 40, 10**9][seed % 5]
    rows = WrittenRows(total, sparse_limit)
    rows.MERGE_MIN = [1, 4, 1 << 16][seed % 3]
    flags = np.zeros(total, dtype=bool)
    for _ in range(int(rng.integers(0, 25))):
        if total and rng.random() < 0.95:
            ids = rng.integers(0, total, size=int(rng.integers(1, max(2, total // 3))))
            rows.add(ids)
            flags[ids] = True
        else:
            rows.mark_all()
            flags[:] = True
        assert np.array_equal(rows.rows(), np.flatnonzero(flags))
        for k in range(1, 6):
            for columns in ([c] for c in range(k)):
                assert_same_array(rows.stripes(columns, k), _stripes_from_flags(flags, columns, k))
            columns = sorted(set(rng.integers(0, k, size=int(rng.integers(0, k + 1))).tolist()))
            assert_same_array(rows.stripes(columns, k), _stripes_from_flags(flags, columns, k))
            assert_same_array(rows.stripes(list(range(k)), k), _stripes_from_flags(flags, range(k), k))
        if flags.all():
            assert rows.all and rows.nbytes == 0
        elif rows.bits is None:
            assert rows.nbytes <= 8 * (2 * flags.sum() + rows.MERGE_MIN)  # ids merged, and as many recent
        else:
            assert rows.nbytes == (total + 7) // 8


def test_written_rows_of_a_bitmap_spanning_several_chunks():
    """The bitmap's stripes are found a chunk at a time: the same as from a flag per row for any K."""
    total = (1 << 23) + 12345
    for k in (1, 3, 8, 10):
        rng = np.random.default_rng(k)
        rows, flags = WrittenRows(total, sparse_limit=0), np.zeros(total, dtype=bool)
        ids = rng.integers(0, total, 50_000)
        rows.add(ids)
        flags[ids] = True
        assert rows.bits is not None
        for columns in ([0], [k - 1], list(range(k))):
            assert_same_array(rows.stripes(columns, k), _stripes_from_flags(flags, columns, k))


def assert_same_array(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and np.array_equal(got, expected), (got, expected)
