"""Each row store's checkpoint view (engine only, no Prefect): ``logical_rows``, ``traffic``,
``drop_pending`` / ``replace_shards`` / ``restart_at``, for the local, remote, LRU and oracle stores.

The stores are driven directly with a fixed sequence of id batches and a deterministic row update
(no model), so every expected value is computed independently: the rows from the update applied to
``init_rows``, the traffic from the batches (remote), an LRU simulation, or the plan (oracle).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster
from test_trainers import EMPTY, FakePlanConfig, ListPlan, Step, _spec, lru_simulation

from dlrmflow.engine.serving.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.checkpoint_format import checkpoint_rows, load_checkpoint, save_checkpoint
from dlrmflow.engine.training.row_updates import apply_update
from dlrmflow.engine.training.shard_restore import restore_checkpoint, start_placed_shards
from dlrmflow.engine.training.stores.base import RowStore
from dlrmflow.engine.training.stores.local import LocalRows
from dlrmflow.engine.training.stores.lru import LruRows
from dlrmflow.engine.training.stores.oracle import OracleRows, spare_slots
from dlrmflow.engine.training.stores.remote import RemoteRows

MODES = ("local", "remote", "lru", "oracle")
SHARD_MODES = ("remote", "lru", "oracle")
ITERATIONS = 10
CHECKPOINT_AT = 4
FAILED_AT = 7  # the recovery test trains on past the checkpoint before it reloads it
SHARDS = 2
DISTANCE = 2  # the oracle's prefetch distance P
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.CRITICAL) as cluster, Client(cluster) as c:
        yield c


def id_batches(spec: RowSpec, seed: int = 0) -> list[np.ndarray]:
    """Sorted distinct ids per iteration: mostly from 40 hot rows (so rows are reused and cached rows
    are hit), a few from the whole table."""
    rng = np.random.default_rng(seed)
    return [np.unique(np.concatenate([rng.integers(0, 40, 12), rng.integers(0, spec.total_rows, 4)]))
            for _ in range(ITERATIONS)]


def lru_capacity(uses: list[np.ndarray]) -> int:
    """Room for the largest batch and a few more rows: small enough that the LRU cache evicts."""
    return max(len(u) for u in uses) + 5


def window_plan(uses: list[np.ndarray], distance: int) -> ListPlan:
    """A valid lookahead plan with evictions: prefetch each row not cached for its use, evict after ``t``
    every cached row not used in ``t+1 .. t+distance`` (everything after the last iteration). A row
    evicted after ``t`` is next used at ``t+distance+1`` or later, so it is home before it is fetched
    again; every prefetch takes a new slot, so no slot is reused while its row is in flight."""
    cached: set[int] = set()
    steps, next_slot = [], 0
    for t, ids in enumerate(uses):
        new = np.array(sorted(set(ids.tolist()) - cached), dtype=np.int64)
        slots = np.arange(next_slot, next_slot + len(new), dtype=np.int64)
        next_slot += len(new)
        cached |= set(new.tolist())
        soon = set(np.concatenate([EMPTY, *uses[t + 1: t + 1 + distance]]).tolist()) if t < len(uses) - 1 else set()
        evict = np.array(sorted(cached - soon), dtype=np.int64)
        cached -= set(evict.tolist())
        steps.append(Step(t, new, slots, evict))
    return ListPlan(FakePlanConfig(batch_size=1, prefetch_distance=distance), steps, max(next_slot, 1))


def gradient(block: torch.Tensor, t: int, spec: RowSpec) -> torch.Tensor:
    """The row gradient of iteration ``t``: deterministic, a function of the rows, and nonzero."""
    return block[:, : spec.dim] * 0.5 + float(t + 1)


def reference_rows(spec: RowSpec, uses: list[np.ndarray], upto: int) -> np.ndarray:
    """Every row after iterations ``0 .. upto-1``, computed without a store."""
    rows = init_rows(spec, np.arange(spec.total_rows))
    for t in range(upto):
        block = torch.from_numpy(rows[uses[t]])
        apply_update(spec, block, gradient(block, t, spec))
        rows[uses[t]] = block.numpy()
    return rows


def drive(store: RowStore, uses: list[np.ndarray], first: int, stop: int) -> list[np.ndarray]:
    """Iterations ``first .. stop-1`` (gather, update); the rows gathered."""
    seen = []
    for t in range(first, stop):
        gathered = store.gather(t, BatchSplit.of(t, uses[t].reshape(-1, 1), 1, 0), EMPTY)
        seen.append(gathered.rows.numpy().copy())
        store.update(gathered, gradient(gathered.rows, t, store.spec), store.spec.lr)
    return seen


def make_store(mode: str, client: Client, spec: RowSpec, uses: list[np.ndarray],
               rows: np.ndarray | None = None) -> RowStore:
    """A fresh store; a shard store's shards start from ``rows`` when given (a checkpoint's)."""
    if mode == "local":
        return LocalRows(spec, CPU)
    shards = start_placed_shards(client, spec, SHARDS, rows)
    assert len(shards.worker_of) == SHARDS  # declared on ShardGroup, filled where the shards were placed
    if mode == "remote":
        return RemoteRows(spec, CPU, shards)
    if mode == "lru":
        return LruRows(spec, CPU, shards, lru_capacity(uses))
    return OracleRows(spec, CPU, shards, window_plan(uses, DISTANCE), ITERATIONS)


def expected_traffic(mode: str, spec: RowSpec, uses: list[np.ndarray], upto: int) -> dict[str, int]:
    """What a checkpoint before iteration ``upto`` records, from the batches alone."""
    if mode == "local":
        fetched = written = 0
    elif mode == "remote":  # every row of every batch both ways; the pending write-back counts as written
        fetched = written = sum(len(u) for u in uses[:upto])
    elif mode == "lru":  # the rows still cached are not written yet
        fetched, written, _ = lru_simulation(uses[:upto], lru_capacity(uses))
    else:  # the plan's prefetches and evictions before ``upto``, not the rows fetched ahead
        steps = window_plan(uses, DISTANCE).steps[:upto]
        fetched, written = sum(len(s.prefetch_ids) for s in steps), sum(len(s.evict_ids) for s in steps)
    return {"bytes_fetched": fetched * spec.row_bytes, "bytes_written": written * spec.row_bytes}


def assert_rows_equal(got: np.ndarray, want: np.ndarray, label: str) -> None:
    assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), label


# ---- the plan and the simulation the expectations come from ------------------------------------------


def test_the_window_plan_evicts_and_the_lru_cache_is_too_small_to_keep_everything():
    spec = _spec()
    uses = id_batches(spec)
    plan = window_plan(uses, DISTANCE)
    assert sum(len(s.evict_ids) for s in plan.steps[:CHECKPOINT_AT]) > 0
    assert sum(len(s.prefetch_ids) for s in plan.steps[CHECKPOINT_AT:]) > 0
    fetched, evicted, cached = lru_simulation(uses[:CHECKPOINT_AT], lru_capacity(uses))
    assert evicted > 0 and cached > 0 and fetched == evicted + cached


# ---- the checkpoint view ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_logical_rows_and_traffic_at_a_checkpoint_and_after_finish(client, mode):
    spec = _spec()
    uses = id_batches(spec)
    store = make_store(mode, client, spec, uses)
    try:
        drive(store, uses, 0, CHECKPOINT_AT)
        before = store.traffic()
        rows = store.logical_rows()
        assert_rows_equal(rows, reference_rows(spec, uses, CHECKPOINT_AT), f"{mode}: rows at the checkpoint")
        assert before == expected_traffic(mode, spec, uses, CHECKPOINT_AT), mode
        assert store.traffic() == before, f"{mode}: reading the logical rows is not traffic"
        rows[:] = 0  # a fresh array: the store's rows are not the caller's
        assert_rows_equal(store.logical_rows(), reference_rows(spec, uses, CHECKPOINT_AT), mode)

        drive(store, uses, CHECKPOINT_AT, ITERATIONS)
        store.finish()
        final = reference_rows(spec, uses, ITERATIONS)
        assert_rows_equal(store.logical_rows(), final, f"{mode}: logical rows after finish")
        assert_rows_equal(store.all_rows(), final, f"{mode}: the home's rows after finish")
        # After finish nothing is pending: the checkpoint view's traffic is the store's counters, and
        # every row fetched was written back once.
        assert store.traffic() == {"bytes_fetched": store.bytes_fetched, "bytes_written": store.bytes_written}
        if mode == "local":
            assert store.traffic() == {"bytes_fetched": 0, "bytes_written": 0}
        else:
            assert store.bytes_fetched == store.bytes_written > 0, mode
    finally:
        store.close()


@pytest.mark.parametrize("mode", MODES)
def test_restart_at_a_checkpoint_continues_as_the_uninterrupted_run(client, mode):
    """A fresh store whose home holds a checkpoint's rows, restarted at its iteration: the same gathers,
    the same final rows and (but for the LRU cache, which starts cold) the same traffic."""
    spec = _spec()
    uses = id_batches(spec)
    whole = make_store(mode, client, spec, uses)
    try:
        blocks = drive(whole, uses, 0, ITERATIONS)
        whole.finish()
        final, totals = whole.all_rows(), whole.traffic()
    finally:
        whole.close()

    first = make_store(mode, client, spec, uses)
    try:
        drive(first, uses, 0, CHECKPOINT_AT)
        rows, traffic = first.logical_rows(), first.traffic()
    finally:
        first.close()

    resumed = make_store(mode, client, spec, uses, rows)
    try:
        resumed.restart_at(CHECKPOINT_AT, rows)
        resumed.home.count_from(traffic)
        assert_rows_equal(resumed.logical_rows(), rows, f"{mode}: restarted at the checkpoint's rows")
        for t, (got, want) in enumerate(zip(drive(resumed, uses, CHECKPOINT_AT, ITERATIONS), blocks[CHECKPOINT_AT:],
                                            strict=True), start=CHECKPOINT_AT):
            assert_rows_equal(got, want, f"{mode}: gather at iteration {t}")
        resumed.finish()
        assert_rows_equal(resumed.all_rows(), final, f"{mode}: final rows")
        if mode != "lru":
            assert resumed.traffic() == totals, mode
    finally:
        resumed.close()


@pytest.mark.parametrize("mode", SHARD_MODES)
def test_a_reloaded_checkpoint_replays_on_the_same_store(client, tmp_path, mode):
    """The checkpoint module's save and restore use only the checkpoint view: train past the checkpoint,
    reload it into fresh shards (what the store held dropped), replay, end with the uninterrupted rows."""
    spec = _spec()
    uses = id_batches(spec)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "checkpoint.pt"
    store = make_store(mode, client, spec, uses)
    try:
        drive(store, uses, 0, CHECKPOINT_AT)
        save_checkpoint(path, CHECKPOINT_AT, store, model, optimizer)
        saved = load_checkpoint(path)
        rows = checkpoint_rows(path, saved)  # the shards' files, each written by its worker
        writers = [f["pid"] for f in saved["rows_files"]["files"]]
        assert writers == [s.pid().result() for s in store.shards.actors] and os.getpid() not in writers, mode
        assert_rows_equal(rows.assemble(), reference_rows(spec, uses, CHECKPOINT_AT), mode)
        assert saved["traffic"] == expected_traffic(mode, spec, uses, CHECKPOINT_AT), mode

        drive(store, uses, CHECKPOINT_AT, FAILED_AT)
        old = store.shards
        assert restore_checkpoint(path, client, store, model, optimizer) == CHECKPOINT_AT
        assert store.shards is not old
        assert_rows_equal(store.logical_rows(), reference_rows(spec, uses, CHECKPOINT_AT), f"{mode}: reloaded")
        drive(store, uses, CHECKPOINT_AT, ITERATIONS)
        store.finish()
        assert_rows_equal(store.all_rows(), reference_rows(spec, uses, ITERATIONS), f"{mode}: after the replay")
    finally:
        store.close()


def test_the_oracle_caches_spare_rows_for_p_minus_1_iterations_within_the_capacity():
    """A quarter more than P - 1 iterations of the plan's mean prefetches; none at P = 1; never past --capacity."""
    def plan(distance: int, prefetched: int = 1000, iterations: int = 10, num_slots: int = 300) -> ListPlan:
        made = ListPlan(FakePlanConfig(1, prefetch_distance=distance), [Step(t, EMPTY, EMPTY, EMPTY)
                                                                      for t in range(iterations)], num_slots)
        made.steps[0] = Step(0, np.arange(prefetched), np.arange(prefetched), EMPTY)
        return made

    assert spare_slots(plan(1), None) == 0
    assert spare_slots(plan(2), None) == 125  # 1.25 x 100 rows an iteration
    assert spare_slots(plan(3, prefetched=999), None) == 250  # ceil(1.25 x 2 x 99.9)
    assert spare_slots(plan(3), 400) == 100  # within --capacity
    assert spare_slots(plan(3), 300) == 0

