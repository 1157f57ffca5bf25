"""Parity in the running system (engine only, no Prefect): coded shards, exactly-once, verify.

The oracle is the same as for the trainer modes: a run with parity ends bit-identical to the
local run, and its parity shards equal the re-encoding of its data shards, bit for bit.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from distributed import Client
from test_trainers import assert_bit_identical, force_split_exchanges, keep_all_plan, make_dataset, small_config

from dlrmflow.engine.coding import group as group_module
from dlrmflow.engine.coding.checked_out import CheckedOutRows
from dlrmflow.engine.coding.erasure import ErasureCode, xor_bits
from dlrmflow.engine.coding.group import CodedShardGroup
from dlrmflow.engine.coding.members import CodedShard, ParityShard
from dlrmflow.engine.coding.start import place_members, start_coded_shards
from dlrmflow.engine.coding.verify import verify_run_dir
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.row_files import chunk_stripes
from dlrmflow.engine.run_state import STATE_DIR, load_state, read_summary
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.dask_internals import RestartSafeLocalCluster
from dlrmflow.engine.serving.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.serving.shards import EmbeddingShard, ShardGroup
from dlrmflow.engine.training.config import TrainConfigError
from dlrmflow.engine.training.faults import FaultSpecError, parse_kill
from dlrmflow.engine.training.job import prepare_run, train


@pytest.fixture(scope="module")
def client():
    # One worker per member (K = 2 data + R <= 2 parity): separate fault domains.
    with RestartSafeLocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0",
                                 silence_logs=logging.ERROR) as cluster, Client(cluster) as c:
        yield c


def _spec(seed: int, cards=(7, 30, 2, 50), dim=3, optimizer="adagrad") -> RowSpec:
    offsets = tuple(int(x) for x in np.cumsum((0, *cards[:-1])))
    return RowSpec(dim=dim, optimizer=optimizer, seed=seed, table_offsets=offsets, cardinalities=tuple(cards))


# ---- members, without Dask ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_parity_shards_start_as_the_encoding_of_the_initial_shards(seed):
    rng = np.random.default_rng(seed)
    cards = tuple(int(c) for c in rng.integers(1, 40, size=int(rng.integers(1, 4))))
    spec = _spec(seed, cards, optimizer=["sgd", "adagrad"][seed % 2])
    k, r = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    data = [EmbeddingShard(spec, i, k).rows for i in range(k)]
    expected = ErasureCode(k, r).encode(data)
    for p in range(r):
        got = ParityShard(spec, k, r, p).rows
        assert got.shape == expected[p].shape
        assert np.array_equal(got.view(np.uint8), expected[p].view(np.uint8))


def test_a_duplicated_batch_is_applied_once():
    spec = _spec(0)
    k, r = 3, 2
    code = ErasureCode(k, r)
    shard = CodedShard(spec, 1, k)
    parity = ParityShard(spec, k, r, 1)
    rng = np.random.default_rng(0)
    ids = np.array([1, 4, 10], dtype=np.int64)
    new = rng.standard_normal((3, spec.width)).astype(np.float32)
    old = shard.fetch(ids)
    delta = code.combine_changes(np.full(len(ids), 1), ids // k, xor_bits(old, new))
    before = parity.rows.copy()
    for _ in range(3):  # the batch and two resends
        shard.exchange_seq(7, ids, new, ids[:0])
        parity.apply(7, delta.stripes, delta.parity[1])
    assert np.array_equal(shard.fetch(ids), new)
    once = before.copy()
    code.apply_delta(once, delta.parity[1], rows=delta.stripes)
    assert np.array_equal(parity.rows.view(np.uint8), once.view(np.uint8))  # XOR twice would undo it
    assert not np.array_equal(parity.rows.view(np.uint8), before.view(np.uint8))
    assert parity.applied_batches() == shard.applied_batches() == [7]
    # A different batch with the same rows is applied.
    shard.exchange_seq(8, ids, old, ids[:0])
    assert np.array_equal(shard.fetch(ids), old)


class InProcess:
    """A member called in this process, answering as an actor call does (``result()``)."""

    class Done:
        def __init__(self, value) -> None:
            self.value = value

        def result(self):
            return self.value

    def __init__(self, member) -> None:
        self.member = member

    def __getattr__(self, name):
        return lambda *args: self.Done(getattr(self.member, name)(*args))


def _in_process_group(spec: RowSpec, k: int, r: int) -> CodedShardGroup:
    members = [InProcess(CodedShard(spec, i, k)) for i in range(k)]
    members += [InProcess(ParityShard(spec, k, r, p)) for p in range(r)]
    return CodedShardGroup(spec, None, ErasureCode(k, r), members, [None] * (k + r),
                           [f"w{s}" for s in range(k + r)], parity_batches=3)


@pytest.mark.parametrize("seed", range(4))
def test_a_replacement_is_written_only_the_stripes_already_rebuilt(seed):
    """During a rebuild, stripes not rebuilt yet are installed later from the survivors, so a
    write-back sends the replacement of a lost data shard only its rows of rebuilt stripes (the rest
    reaches the surviving shards and parity as usual); before the rebuild has chosen the stripes it
    copies (``rebuilt`` is None), none."""
    spec = RowSpec(dim=2, optimizer="sgd", seed=0, table_offsets=(0,), cardinalities=(20,))
    group = _in_process_group(spec, 2, 1)
    group.batching.parity_batches = 100
    rebuilt = [None, np.random.default_rng(seed).random(10) < 0.5, np.zeros(10, bool), np.ones(10, bool)][seed]
    replacement = CodedShard(spec, 0, 2, initialise=False)  # every row fresh: nothing generated or installed
    state = group.state  # driven by hand: data shard 0 lost, its replacement placed, ``rebuilt`` stripes rebuilt
    assert state.member_lost({0}, None, 0.0) is not None  # no rebuild thread: this group has no starter
    state.replacement_placed(0, "w9", None, InProcess(replacement))
    if rebuilt is not None:  # the rebuild copies the other stripes and generates these: rebuilt at the first fix-up
        state.log_opened(state.generation, np.flatnonzero(~rebuilt))
        state.fixed_up(state.fix_up_begun(state.generation))
    assert (state.rebuilt is None) == (rebuilt is None) and (rebuilt is None or np.array_equal(state.rebuilt, rebuilt))
    ids = np.arange(20, dtype=np.int64)
    group.checked_out.put(ids, init_rows(spec, ids))
    new = np.random.default_rng(0).standard_normal((20, spec.width)).astype(np.float32) + 5
    group.exchange(ids, new, ids[:0])
    written = np.zeros(10, bool) if rebuilt is None else rebuilt
    assert np.array_equal(replacement.rows[written], new[0::2][written])
    assert not replacement.rows[~written].any()  # still fresh: not even generated
    assert np.array_equal(replacement.fresh, ~written)
    assert np.array_equal(group.state.members[1].member.rows, new[1::2])
    assert replacement.applied_batches() == ([1] if written.any() else [])
    assert len(group.batching.pending) == 1  # the whole batch's parity delta, for every stripe


@pytest.mark.parametrize("seed", range(6))
def test_a_replacement_generates_its_fresh_rows_on_first_read(seed):
    """A replacement starts with every row fresh; whatever reads a row (fetch, gather, a bulk read,
    all rows) sees the initial rows, bit for bit, while written and installed rows are kept as they
    came. Parity alike: a delta applied to a fresh stripe lands on its encoding."""
    rng = np.random.default_rng(seed)
    cards = tuple(int(c) for c in rng.integers(1, 40, size=int(rng.integers(1, 4))))
    spec = _spec(seed, cards, optimizer=["sgd", "adagrad"][seed % 2])
    k, r = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    code = ErasureCode(k, r)
    i = int(rng.integers(0, k))
    initial, fresh = CodedShard(spec, i, k), CodedShard(spec, i, k, initialise=False)
    n = len(initial.rows)
    if n == 0:
        assert fresh.all_local_rows().shape == (0, spec.width)
        return
    local = np.unique(rng.integers(0, n, size=max(1, n // 3)))
    ids = local * k + i
    assert np.array_equal(fresh.fetch(ids).view(np.uint8), initial.fetch(ids).view(np.uint8))
    new = rng.standard_normal((len(ids), spec.width)).astype(np.float32)
    written = local[rng.random(len(local)) < 0.5]
    fresh.write_back(written * k + i, new[: len(written)])
    initial.write_back(written * k + i, new[: len(written)])
    stripes = np.unique(rng.integers(0, n + 3, size=5))  # past the end: zero rows
    assert np.array_equal(fresh.gather(stripes).view(np.uint8), initial.gather(stripes).view(np.uint8))
    lo = int(rng.integers(0, n))
    assert np.array_equal(fresh.read_stripes(lo, n).view(np.uint8), initial.read_stripes(lo, n).view(np.uint8))
    installed = rng.standard_normal((2, spec.width)).astype(np.float32)
    for shard in (fresh, initial):
        shard.install_stripes(np.array([0]), installed[:1])
    assert np.array_equal(fresh.local_rows().view(np.uint8), initial.local_rows().view(np.uint8))
    # Parity.
    p = int(rng.integers(0, r))
    parity, fresh_parity = ParityShard(spec, k, r, p), ParityShard(spec, k, r, p, initialise=False)
    old = EmbeddingShard(spec, i, k).rows[written]
    delta = code.combine_changes(np.full(len(written), i), written, xor_bits(old, new[: len(written)]))
    for member in (parity, fresh_parity):
        member.apply(3, delta.stripes, delta.parity[p])
    assert np.array_equal(fresh_parity.gather(stripes).view(np.uint8), parity.gather(stripes).view(np.uint8))
    assert np.array_equal(fresh_parity.all_local_rows().view(np.uint8), parity.all_local_rows().view(np.uint8))
    fresh_parity.reset()
    assert fresh_parity.fresh.all()
    assert np.array_equal(fresh_parity.all_local_rows().view(np.uint8),
                          ParityShard(spec, k, r, p).rows.view(np.uint8))


def test_a_replacement_ignores_the_installs_of_a_rebuild_that_started_over():
    """A rebuild that starts over (a further loss) cannot stop a copy task that already runs: on a
    worker with several threads its install can land after the new rebuild's install of the same
    stripes. The reset at the new rebuild's step 0 names it, and an install of any other changes
    nothing, whatever order they come in."""
    spec = RowSpec(dim=2, optimizer="sgd", seed=0, table_offsets=(0,), cardinalities=(20,))
    rng = np.random.default_rng(7)
    for member, initial in ((CodedShard(spec, 0, 2, initialise=False), CodedShard(spec, 0, 2).rows),
                            (ParityShard(spec, 2, 1, 0, initialise=False), ParityShard(spec, 2, 1, 0).rows)):
        current, stale = (rng.standard_normal((2, spec.width)).astype(np.float32) for _ in range(2))
        member.reset("old")
        assert member.install_stripes(np.array([1, 4]), stale, "old") == 2
        member.reset("new")  # step 0 of the rebuild that started over
        assert member.install_stripes(np.array([1, 4]), current, "new") == 2
        assert member.install_stripes(np.array([1, 4]), stale, "old") == 0  # the old task, landing late
        assert member.install(0, np.tile(stale, (3, 1)), "old") == 0
        expected = initial.copy()
        expected[[1, 4]] = current
        assert np.array_equal(member.all_local_rows().view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("seed", range(8))
def test_a_lost_member_differs_from_its_initial_rows_only_in_the_stripes_a_rebuild_copies(seed):
    """Whatever write-backs ran (some rows written back unchanged) and whichever <= R members are
    lost, a lost member holds anything but its initial rows only in ``stripes_to_copy``: a rebuild
    that copies those and generates the rest is exact. And it copies no more than it must: a data
    shard's stripes without a row the trainer wrote are not copied."""
    rng = np.random.default_rng(100 + seed)
    cards = tuple(int(c) for c in rng.integers(5, 60, size=int(rng.integers(1, 4))))
    spec = _spec(seed, cards)
    k, r = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    group = _in_process_group(spec, k, r)
    held, written = np.zeros(0, np.int64), set()
    for _ in range(int(rng.integers(1, 8))):
        write = held[rng.random(len(held)) < 0.6]
        rows = rng.standard_normal((len(write), spec.width)).astype(np.float32)
        same = rng.random(len(write)) < 0.2  # written back unchanged
        rows[same] = group.checked_out.peek(write[same])
        fetch = np.setdiff1d(np.unique(rng.integers(0, spec.total_rows, size=int(rng.integers(0, 12)))), held)
        group.exchange(write, rows, fetch)
        held = np.union1d(np.setdiff1d(held, write), fetch)
        written |= set(write.tolist())
    with group.lock:
        group.settle()
    members = [m.member for m in group.state.members]
    initial = [CodedShard(spec, i, k).rows for i in range(k)] + [ParityShard(spec, k, r, p).rows for p in range(r)]
    for n_lost in range(1, r + 1):
        lost = sorted(rng.choice(k + r, size=n_lost, replace=False).tolist())
        copied = np.zeros(group.n_stripes, bool)
        copied[group.stripes_to_copy(lost)] = True
        for s in lost:
            changed = (members[s].rows.view(np.uint8) != initial[s].view(np.uint8)).any(axis=1)
            assert not changed[~copied[: len(changed)]].any(), (lost, s)
        if all(s < k for s in lost):
            expected = {i // k for i in written if i % k in lost}
            assert set(np.flatnonzero(copied).tolist()) == expected


def test_a_group_started_from_checkpoint_rows_copies_every_stripe_in_a_rebuild(client):
    """Rows restored from a checkpoint may all differ from their initial values: a rebuild of a
    resumed run copies every stripe the lost member holds."""
    spec = _spec(3)
    rows = np.random.default_rng(3).standard_normal((spec.total_rows, spec.width)).astype(np.float32)
    fresh, restored = start_coded_shards(client, spec, 2, 1), start_coded_shards(client, spec, 2, 1, rows=rows)
    try:
        n = restored.n_stripes
        assert np.array_equal(restored.stripes_to_copy([1]), np.arange(spec.total_rows // 2))
        assert np.array_equal(restored.stripes_to_copy([2]), np.arange(n))
        assert len(fresh.stripes_to_copy([0, 1, 2])) == 0
    finally:
        fresh.close()
        restored.close()


@pytest.mark.parametrize("seed", range(8))
def test_checked_out_rows_match_a_dict(seed):
    """Puts (an id put again: its later row), takes and failed takes against a dict, over tables of a few
    rows to many (the index grows and shrinks through its rebuilds); the index holds only the ids checked
    out, whatever the table."""
    rng = np.random.default_rng(seed)
    total, width = [50, 50, 5_000, 10**12][seed % 4], 3
    store, reference, put = CheckedOutRows(width), {}, 0
    for _ in range(60):
        if reference and rng.random() < 0.4:
            ids = rng.choice(sorted(reference), size=int(rng.integers(1, len(reference) + 1)), replace=False)
            rows = store.take(ids)
            assert np.array_equal(rows, np.stack([reference.pop(int(i)) for i in ids]))
        elif rng.random() < 0.2:
            ids = rng.integers(0, total, size=int(rng.integers(1, 4)))
            if not all(int(i) in reference for i in ids):
                before = store.peek(np.array(sorted(reference), dtype=np.int64))
                with pytest.raises(RuntimeError, match="never fetched"):
                    store.take(ids)
                assert np.array_equal(store.peek(np.array(sorted(reference), dtype=np.int64)), before)
        else:
            ids = rng.integers(0, total, size=int(rng.integers(0, min(total, 600))))
            if rng.random() < 0.7:  # else some id may come twice
                ids = rng.permutation(np.unique(ids))
            rows = rng.standard_normal((len(ids), width)).astype(np.float32)
            store.put(ids, rows)
            put = len(ids)
            reference.update({int(i): row for i, row in zip(ids, rows, strict=True)})  # a repeated id: its last row
        assert len(store) == len(reference)
        held = np.array(sorted(reference), dtype=np.int64)
        assert np.array_equal(store.peek(held), np.array([reference[int(i)] for i in held]).reshape(-1, width))
        assert len(store.index.keys) <= max(16, 8 * (len(reference) + put))  # by the rows held (and last put)
    missing = next(i for i in range(total + 1) if i not in reference)
    if missing < total:
        with pytest.raises(RuntimeError, match=f"write-back of row {missing}, which was never fetched"):
            store.take(np.array([missing]))


def test_a_read_does_not_check_rows_out():
    """``read`` returns what ``fetch`` does, without keeping the rows as old rows of write-backs: a read
    row written back without a fetch is refused, as a row never fetched is."""
    spec = _spec(2)
    group = _in_process_group(spec, 2, 1)
    ids = np.array([0, 3, 7, 40], dtype=np.int64)
    read = group.read(ids)
    assert len(group.checked_out) == 0 and group.bytes_fetched == len(ids) * spec.row_bytes
    out = np.empty((len(ids), spec.width), dtype=np.float32)
    assert group.read(ids, out) is out and np.array_equal(out, read)
    fetched = group.fetch(ids[:2])
    assert np.array_equal(fetched, read[:2]) and len(group.checked_out) == 2
    group.write_back(ids[:2], fetched + 1)
    with pytest.raises(RuntimeError, match="write-back of row 7, which was never fetched"):
        group.write_back(ids[2:], read[2:])
    assert len(group.checked_out) == 0


# ---- the write path's two directions, without Dask -------------------------------------------------


class Mortal(InProcess):
    """A member whose worker dies once ``dies_at`` (a method name) is set and that method is called: that
    call (run first when ``runs``: the batch applied, its answer lost) and every later one fail as a call
    to a dead worker does, with OSError."""

    class Lost:
        def result(self):
            raise OSError("the worker is gone")

    def __init__(self, member) -> None:
        super().__init__(member)
        self.dies_at, self.runs, self.dead = None, False, False

    def __getattr__(self, name):
        call = super().__getattr__(name)

        def maybe_lost(*args):
            if name == self.dies_at and not self.dead:
                self.dead = True
                if self.runs:
                    call(*args)
            return self.Lost() if self.dead else call(*args)

        return maybe_lost


def _mortal_group(spec: RowSpec, k: int, r: int, split: bool) -> CodedShardGroup:
    """An in-process group whose data shards can die; ``split``: every shard's fetch of rows the batch does
    not write goes apart (whatever the sizes and the link's rate), else never."""
    group = _in_process_group(spec, k, r)
    group.state.members[:k] = group.actors[:] = [Mortal(m.member) for m in group.state.members[:k]]
    group.overlap_min_bytes, group.overlap_max_rate = (0, float("inf")) if split else (1 << 62, 0.0)
    return group


def _recorded_calls(monkeypatch) -> list[tuple[int, str, tuple]]:
    """Every call the coded group makes to a data shard: (shard, method, arguments)."""
    made: list[tuple[int, str, tuple]] = []
    original_remote = group_module.remote

    def recording(actor, method, *args):
        if isinstance(actor.member, CodedShard):
            made.append((actor.member.shard, method, args))
        return original_remote(actor, method, *args)

    monkeypatch.setattr(group_module, "remote", recording)
    return made


def _trainer_steps(rng, spec: RowSpec, steps: int, held: np.ndarray):
    """A trainer's exchanges: ``(write, rows, fetch)``, each writing back some rows it holds and fetching
    distinct ids, some of them just written; the ids it holds after each are the fetched ones and those
    it did not write."""
    for _ in range(steps):
        write = held[rng.random(len(held)) < 0.7]
        rows = rng.standard_normal((len(write), spec.width)).astype(np.float32)
        others = rng.choice(spec.total_rows, size=int(rng.integers(1, 60)), replace=False)
        fetch = np.union1d(others, write[rng.random(len(write)) < 0.5])
        rng.shuffle(fetch)
        yield write, rows, fetch
        held = np.union1d(np.setdiff1d(held, write), fetch)


def test_a_sizeable_exchange_on_a_slow_link_sends_each_shard_a_fetch_and_a_batch(monkeypatch):
    """Each data shard moving ``overlap_min_bytes`` both ways gets the fetch of the ids the batch does not
    write as a call of its own, sent before the batches, and its batch (``exchange_seq``) with the written
    ids it fetches, read after their write; a small exchange, or one on a fast link, one call per shard."""
    monkeypatch.setattr(ShardGroup, "overlap_max_rate", float("inf"))  # the link seems slow, whatever it does
    made = _recorded_calls(monkeypatch)
    spec = RowSpec(dim=16, optimizer="sgd", seed=0, table_offsets=(0,), cardinalities=(4000,))
    k, per_shard = 2, ShardGroup.overlap_min_bytes // spec.row_bytes  # rows each way that make a shard sizeable
    group = _in_process_group(spec, k, 1)
    rng = np.random.default_rng(0)
    ids = rng.permutation(spec.total_rows)
    write, others = ids[: 2 * k * per_shard], ids[2 * k * per_shard : 4 * k * per_shard]
    group.exchange(ids[:0], np.zeros((0, spec.width), np.float32), write)  # checked out: one call per shard
    assert [(s, m) for s, m, _ in made] == [(0, "exchange_seq"), (1, "exchange_seq")]
    made.clear()
    new = rng.standard_normal((len(write), spec.width)).astype(np.float32)
    fetch = np.concatenate([others, write[:10]])
    got = group.exchange(write, new, fetch)
    assert [(s, m) for s, m, _ in made] == [(0, "fetch"), (1, "fetch"), (0, "exchange_seq"), (1, "exchange_seq")]
    for s, method, args in made:
        if method == "fetch":  # the rows of ids this exchange does not write, no others
            assert np.array_equal(np.sort(args[0]), np.sort(others[others % k == s]))
        else:
            assert np.array_equal(np.sort(args[3]), np.sort(write[:10][write[:10] % k == s]))
    assert np.array_equal(got[: len(others)].view(np.uint32), init_rows(spec, others).view(np.uint32))
    assert np.array_equal(got[len(others) :].view(np.uint32), new[:10].view(np.uint32))  # read after the write
    made.clear()  # about per_shard / 2 rows written to each shard: under overlap_min_bytes
    group.exchange(others[:per_shard], init_rows(spec, others[:per_shard]), ids[-2 * k * per_shard :])
    assert sorted(m for _, m, _ in made) == ["exchange_seq", "exchange_seq"]
    monkeypatch.setattr(ShardGroup, "overlap_max_rate", 0.0)  # any link is fast
    made.clear()
    group.exchange(others[per_shard:], init_rows(spec, others[per_shard:]), write)
    assert sorted(m for _, m, _ in made) == ["exchange_seq", "exchange_seq"]


@pytest.mark.parametrize("seed", range(4))
def test_a_split_exchange_fetches_and_writes_what_one_call_per_shard_does(seed, monkeypatch):
    """The same exchanges through a group that sends every fetch apart it can and one that never does: the
    same rows fetched, bit for bit (an id written and fetched in one exchange as written), the same rows and
    parity on every member, and the group made the split calls."""
    rng = np.random.default_rng(seed)
    spec = _spec(seed, tuple(int(c) for c in rng.integers(20, 80, size=3)), optimizer=["sgd", "adagrad"][seed % 2])
    k, r = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    made = _recorded_calls(monkeypatch)
    split, whole = _mortal_group(spec, k, r, split=True), _mortal_group(spec, k, r, split=False)
    home = init_rows(spec, np.arange(spec.total_rows))
    for write, rows, fetch in _trainer_steps(rng, spec, 10, np.zeros(0, np.int64)):
        home[write] = rows
        for group in (split, whole):
            got = group.exchange(write, rows, fetch)
            assert np.array_equal(got.view(np.uint32), home[fetch].view(np.uint32))
    assert "fetch" in {m for _, m, _ in made}
    for group in (split, whole):
        with group.lock:
            group.settle()
    for a, b in zip(split.state.members, whole.state.members, strict=True):
        assert np.array_equal(a.member.rows.view(np.uint8), b.member.rows.view(np.uint8))
    assert split.verify()["ok"]


@pytest.mark.parametrize(("dies_at", "runs"), [("fetch", False), ("exchange_seq", True), ("exchange_seq", False)])
def test_a_split_exchange_whose_shard_dies_is_resent_with_the_same_result(dies_at, runs, monkeypatch):
    """A data shard's worker dies during a split exchange, at its fetch call or at its batch (applied or
    not): the exchange is resent to the survivors with the same batch number, its rows fetched are those of
    an exchange without a loss, and so is every later read (the lost shard's by degraded reads)."""
    rng = np.random.default_rng(11)
    spec = _spec(1, (40, 70, 30))
    made = _recorded_calls(monkeypatch)
    group, reference = _mortal_group(spec, 2, 1, split=True), _mortal_group(spec, 2, 1, split=False)
    steps = list(_trainer_steps(rng, spec, 8, np.zeros(0, np.int64)))
    for t, (write, rows, fetch) in enumerate(steps):
        if t == 4:
            group.state.members[1].dies_at, group.state.members[1].runs = dies_at, runs
        seq = group.batching.seq + (len(write) > 0)
        made.clear()
        got = group.exchange(write, rows, fetch)
        if t == 4:  # the batch went out split, and again (same number) to the survivor after the loss
            assert {(s, m) for s, m, _ in made} >= {(1, "fetch"), (1, "exchange_seq"), (0, "fetch")}
            assert [a[0] for s, m, a in made if m == "exchange_seq" and s == 0] == [seq, seq]
        assert np.array_equal(got.view(np.uint32), reference.exchange(write, rows, fetch).view(np.uint32)), t
    assert group.state.lost == {1} and group.degraded_rows > 0
    everything = np.arange(spec.total_rows)
    got, expected = group.fetch(everything), reference.fetch(everything)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert group.state.members[0].member.applied_batches() == reference.state.members[0].member.applied_batches()


# ---- whole runs ------------------------------------------------------------------------------------


def _run(tmp_path, dataset, name, mode, client=None, plan=None, **kw):
    config = small_config(dataset, tmp_path / name, mode, iterations=14, batch_size=16, **kw)
    with torch.random.fork_rng():
        return train(config, client=client, setup=prepare_run(config, plan=plan))


@pytest.mark.parametrize("seed", range(3))
def test_parity_runs_are_bit_identical_and_verify(client, tmp_path, monkeypatch, seed):
    # Remote's write-backs travel with its fetches (lru writes through apart from them, this oracle plan
    # keeps every row to the end): there, every data shard's fetch apart from its batch, even for these
    # small batches.
    split = seed == 0
    if split:
        force_split_exchanges(monkeypatch)
    methods, original_remote = [], group_module.remote
    monkeypatch.setattr(group_module, "remote",
                        lambda actor, method, *args: methods.append(method) or original_remote(actor, method, *args))
    rng = np.random.default_rng(300 + seed)
    dataset = make_dataset(tmp_path / "data", seed)
    common = dict(embedding_optimizer=["adagrad", "sgd"][seed % 2], embedding_lr=0.05, seed=seed)
    _run(tmp_path, dataset, "local", "local", **common)
    mode = ["remote", "lru", "oracle"][seed]
    extra = {"capacity": 200} if mode == "lru" else {}
    plan = keep_all_plan(dataset, 16, 14, 2) if mode == "oracle" else None
    r, batches = int(rng.integers(1, 3)), [1, 3, 100][seed]
    summary = _run(tmp_path, dataset, "parity", mode, client, plan, num_shards=2, parity=r,
                   rebuild_chunk=int(rng.integers(1, 50)), parity_batches=batches, **extra, **common)
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "parity"), f"{mode} R={r}")
    report = summary["parity"]
    assert report["verify"] == {"ok": True, "stripes": report["verify"]["stripes"], "mismatched_stripes": [0] * r}
    assert report["recoveries"] == [] and report["degraded_rows_read"] == 0
    assert report["write_back_batches"] >= 1 and report["parity_bytes_sent"] > 0
    # Up to `batches` write-back batches per parity message; the rest goes before verify reads parity.
    assert report["parity_messages"] == -(-report["write_back_batches"] // batches)
    assert len(set(report["member_workers"].values())) == 2 + r  # every member on its own worker
    assert ("fetch" in methods) == split  # split only when forced: these batches are small
    assert verify_run_dir(tmp_path / "parity")["ok"]


def test_resending_every_write_back_batch_changes_nothing(client, tmp_path, monkeypatch):
    """Every batch is sent twice to every data shard and every parity message twice to every parity
    shard: the sequence numbers make the second a no-op (without them the parity deltas would XOR
    out and verify would fail)."""
    dataset = make_dataset(tmp_path / "data", 5)
    _run(tmp_path, dataset, "local", "local")
    original_remote = group_module.remote
    sent = {"batches": 0, "parity": 0}

    def twice(actor, method, *args):
        if method in ("exchange_seq", "apply_batches"):
            sent["batches" if method == "exchange_seq" else "parity"] += 1
            original_remote(actor, method, *args).result()  # answered before the resend goes out
        return original_remote(actor, method, *args)

    monkeypatch.setattr(group_module, "remote", twice)
    summary = _run(tmp_path, dataset, "parity", "remote", client, num_shards=2, parity=2, parity_batches=3)
    assert sent["batches"] > 10 and sent["parity"] > 2 * 3
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "parity"), "resent")
    assert summary["parity"]["verify"]["ok"]


def test_verify_run_dir_finds_a_flipped_bit(client, tmp_path):
    dataset = make_dataset(tmp_path / "data", 6)
    _run(tmp_path, dataset, "run", "remote", client, num_shards=2, parity=1)
    run_dir = tmp_path / "run"
    reported: list[tuple[int, int]] = []
    result = verify_run_dir(run_dir, chunk=8, progress=lambda done, total: reported.append((done, total)))
    assert result["ok"] and result["files_ok"] and result["state_sha256_ok"], result
    stripes, per = result["stripes"], chunk_stripes(3, 8)  # K + R = 3 members: a report after each chunk
    assert reported == [(min(done, stripes), stripes) for done in range(per, stripes + per, per)]
    assert result["state_sha256"] == read_summary(run_dir)["state_sha256"]
    # One bit of row 11 = stripe 5 of data shard 1, flipped in the file shard 1's worker wrote.
    shard = np.load(run_dir / STATE_DIR / "shard-1.npy", mmap_mode="r+")
    shard.view(np.int32)[5, 0] ^= 1
    shard.flush()
    del shard
    result = verify_run_dir(run_dir, chunk=8)
    assert not result["ok"] and result["mismatched_stripes"] == [1] and result["first_mismatches"] == [[5]]
    assert result["damaged_files"] == ["shard-1.npy"] and not result["state_sha256_ok"]
    with pytest.raises(UserInputError, match="holds no final state"):
        verify_run_dir(tmp_path / "data")
    _run(tmp_path, dataset, "plain", "remote", client, num_shards=2)
    with pytest.raises(UserInputError, match="trained without --parity"):
        verify_run_dir(tmp_path / "plain")


def test_group_verify_reports_a_corrupted_parity_shard(client):
    spec = _spec(1)
    group = start_coded_shards(client, spec, 2, 1)
    try:
        assert group.verify()["ok"]
        ids = np.arange(0, spec.total_rows, 7, dtype=np.int64)
        rows = group.fetch(ids)
        group.write_back(ids, rows + 1)
        assert group.verify()["ok"]
        assert np.array_equal(group.all_rows()[ids], rows + 1)
        # A write that bypasses the group (no parity delta) is caught.
        group.state.members[0].write_back(np.array([0]), np.zeros((1, spec.width), np.float32)).result()
        result = group.verify()
        assert not result["ok"] and result["mismatched_stripes"] == [1]
        assert not np.array_equal(init_rows(spec, np.array([0])), np.zeros((1, spec.width), np.float32))
    finally:
        group.close()


def test_placement_sees_every_worker_whatever_the_clients_cached_identity(client):
    """The client's periodic refresh caches an identity without workers; ``scheduler_info()`` can
    return that cache if the refresh lands just after its own fetch. Held open here, the window
    must not hide the workers from placement."""
    client.sync(client._update_scheduler_info)  # what the periodic refresh stores
    assert client._scheduler_identity["workers"] == {}
    assert len(cluster_workers(client)) == 4
    assert len(place_members(client, 3)[0]) == 3


def test_bad_parity_and_kill_options_are_clear_errors(tmp_path):
    dataset = make_dataset(tmp_path / "data", 0)
    out = tmp_path / "never"
    with pytest.raises(TrainConfigError, match="--parity needs embedding servers"):
        prepare_run(small_config(dataset, out, "local", parity=1))
    with pytest.raises(TrainConfigError, match="between 0 and 4"):
        prepare_run(small_config(dataset, out, "remote", parity=5))
    with pytest.raises(TrainConfigError, match="--kill needs --parity"):
        prepare_run(small_config(dataset, out, "remote", kills=("shard:0@1",)))
    with pytest.raises(TrainConfigError, match="--parity-batches must be >= 1, got 0"):
        prepare_run(small_config(dataset, out, "remote", parity=1, parity_batches=0))
    for rate in (-1.0, float("nan")):
        with pytest.raises(TrainConfigError, match="--rebuild-rate must be >= 0 MB/s"):
            prepare_run(small_config(dataset, out, "remote", parity=1, rebuild_rate=rate))
    for spec, match in [("shard0@1", "expected shard:I@ITER"), ("disk:0@1", "expected"),
                        ("shard:2@1", "no shard 2 with --shards 2"), ("parity:1@1", "no parity 1 with --parity 1"),
                        ("shard:0@12", "past the last one")]:
        with pytest.raises(FaultSpecError, match=match):
            prepare_run(small_config(dataset, out, "remote", parity=1, kills=(spec,)))
    with pytest.raises(FaultSpecError, match="same kill twice"):
        prepare_run(small_config(dataset, out, "remote", parity=2, kills=("shard:0@3", "shard:0@3")))
    assert parse_kill(" parity:3@17 ").member(5) == 8
    assert not out.exists()
