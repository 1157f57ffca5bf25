"""Training state that never meets in one process (engine only, no Prefect).

- The state SHA-256 streamed (the dense entries, then the rows a chunk at a time in global id order,
  from shard arrays, shard actors or shard files) equals the hash of the whole state, for any K,
  any chunk, odd row counts and every bit pattern (-0.0, NaN payloads).
- A run's ``final_state/`` holds one rows file per shard, written by the worker holding the shard,
  ``dense.pt`` written by trainer 0 and a manifest; :func:`load_state` of it equals, bit for bit, the
  whole state gathered as runs did before (``collect_state``), for every mode and W = 1, 2.
- No process gathers every row during a run: the whole-table reads raise, and the run's numpy
  allocations stay far below the table's size (checkpoints, a reload after a lost shard, parity and a
  resume included).
- A parity shard's rows, encoded from the data shards' rows streamed a chunk at a time, are the
  encoding of the data, at a run's start and on a resume.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import Client
from test_parity import InProcess
from test_resume import Crash, crash_at
from test_trainers import assert_bit_identical, make_dataset, small_config

from dlrmflow.engine import row_files
from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.group import CodedShardGroup
from dlrmflow.engine.coding.members import CodedShard, ParityShard, encode_parity_from_members
from dlrmflow.engine.coding.start import start_coded_shards
from dlrmflow.engine.planning import planner
from dlrmflow.engine.row_files import ShardedRows, file_sha256
from dlrmflow.engine.run_state import (
    DENSE_FILE,
    MANIFEST_FILE,
    STATE_DIR,
    load_state,
    read_manifest,
    save_sharded_state,
    state_hash,
    state_sha256,
    streamed_state_hash,
)
from dlrmflow.engine.serving.cluster import cluster_workers, local_cluster
from dlrmflow.engine.serving.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.serving.shards import EmbeddingShard, ShardGroup
from dlrmflow.engine.training import job as run_module
from dlrmflow.engine.training import trainer as rank_module
from dlrmflow.engine.training.checkpoint_format import load_checkpoint
from dlrmflow.engine.training.config import replace
from dlrmflow.engine.training.job import prepare_run, train
from dlrmflow.engine.training.run_directory import CHECKPOINT_FILE
from dlrmflow.engine.training.stores.base import RowStore

CARDS = (400, 5, 1201, 90)  # 1,696 rows: odd, and three chunks of 1 << 9


def odd_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values with -0.0, +-inf and NaNs of several payloads among them."""
    values = rng.standard_normal(shape).astype(np.float32)
    flat = values.reshape(-1).view(np.uint32)
    for pattern in (0x80000000, 0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x00000001):
        flat[rng.integers(0, flat.size, max(1, flat.size // 20))] = pattern
    return values


def random_state(rng: np.random.Generator, total_rows: int, width: int) -> dict:
    dense = {"b.weight": torch.from_numpy(odd_bits(rng, (3, 4))), "a.bias": torch.from_numpy(odd_bits(rng, (4,)))}
    optimizer = {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.from_numpy(odd_bits(rng, (3, 4)))},
                           1: {"step": torch.tensor(7.0), "exp_avg": torch.from_numpy(odd_bits(rng, (4,)))}},
                 "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    return {"format_version": 1, "mode": "remote", "model": "dlrm", "model_config": {}, "dense": dense,
            "dense_optimizer": optimizer,
            "embedding": {"rows": torch.from_numpy(odd_bits(rng, (total_rows, width))), "dim": width,
                          "optimizer": "sgd", "state_width": 0, "table_offsets": [0],
                          "cardinalities": [total_rows]}}


def in_process_shards(rows: np.ndarray, k: int) -> ShardGroup:
    spec = RowSpec(dim=rows.shape[1], optimizer="sgd", seed=0, table_offsets=(0,), cardinalities=(len(rows),))
    shards = []
    for i in range(k):
        shard = EmbeddingShard(spec, i, k, initialise=False)
        shard.rows[:] = rows[i::k]
        shards.append(InProcess(shard))
    return ShardGroup(spec, shards)


# ---- the streamed digest ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_the_streamed_state_hash_equals_the_whole_states(tmp_path, seed):
    rng = np.random.default_rng(seed)
    total, width, k = 2 * int(rng.integers(0, 60)) + 1, int(rng.integers(1, 7)), seed % 4 + 1
    state = random_state(rng, total, width)
    rows = state["embedding"]["rows"].numpy()
    whole = state_hash(state)
    for chunk in (1, 2, 3, 7, 64, 1 << 16):
        view = ShardedRows.from_array(rows, k)
        assert streamed_state_hash(state, total, width, (c for _, c in view.chunks(chunk))) == whole, (k, chunk)
        shards = in_process_shards(rows, k)  # as a run streams them: stripes from every shard, interleaved
        assert streamed_state_hash(state, total, width, shards.row_chunks(chunk)) == whole, (k, chunk)
    # From the files, each shard's rows in its own file.
    save_sharded_state(tmp_path, state, k)
    manifest = read_manifest(tmp_path)
    assert manifest["num_shards"] == k and manifest["state_sha256"] == whole
    assert sorted(p.name for p in (tmp_path / STATE_DIR).iterdir()) == sorted(
        [DENSE_FILE, MANIFEST_FILE, *(f"shard-{i}.npy" for i in range(k))])
    for entry in [*manifest["shards"], manifest["dense"]]:
        assert file_sha256(tmp_path / STATE_DIR / entry["file"]) == entry["sha256"]
    for chunk in (1, 5, 1 << 16):
        assert state_sha256(tmp_path, chunk) == whole
    assert_bit_identical(state, load_state(tmp_path), f"K={k}")
    # Any flipped bit changes it.
    shard = np.load(tmp_path / STATE_DIR / "shard-0.npy", mmap_mode="r+")
    shard.view(np.uint32)[0, 0] ^= 1
    shard.flush()
    del shard
    assert state_sha256(tmp_path) != whole


def test_a_shard_writes_its_rows_overlaid_and_reads_its_file_back(tmp_path):
    rng = np.random.default_rng(3)
    rows = odd_bits(rng, (31, 4))
    group = in_process_shards(rows, 3)
    before = [s.member.rows.copy() for s in group.actors]
    ids = np.array([0, 4, 5, 29], dtype=np.int64)
    newer = odd_bits(rng, (4, 4))
    files = group.save_rows(tmp_path, (ids, newer), chunk=2)
    logical = rows.copy()
    logical[ids] = newer
    view = ShardedRows.from_files(tmp_path, files, 31, 4)
    assert np.array_equal(view.assemble().view(np.uint32), logical.view(np.uint32))
    assert np.array_equal(view[ids[::-1]].view(np.uint32), newer[::-1].view(np.uint32))
    for shard, old in zip(group.actors, before, strict=True):  # the shards' own rows did not change
        assert np.array_equal(shard.member.rows.view(np.uint32), old.view(np.uint32))
        assert shard.member.pid() == os.getpid()
    assert [f["pid"] for f in files] == [os.getpid()] * 3
    group.load_rows(view.files, chunk=3)
    assert np.array_equal(group.all_rows().view(np.uint32), logical.view(np.uint32))
    with pytest.raises(ValueError, match="SHA-256 differs"):
        group.actors[1].member.load_rows(view.files[1][0], "0" * 64)
    with pytest.raises(ValueError, match="holds rows of shape"):
        group.actors[1].member.load_rows(view.files[0][0])


# ---- parity encoded from streamed members ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_parity_encoded_from_streamed_members_is_the_encoding_of_the_data(seed):
    rng = np.random.default_rng(40 + seed)
    cards = tuple(int(c) for c in rng.integers(1, 40, size=int(rng.integers(1, 4))))
    offsets = tuple(int(x) for x in np.cumsum((0, *cards[:-1])))
    spec = RowSpec(dim=3, optimizer=["sgd", "adagrad"][seed % 2], seed=seed, table_offsets=offsets,
                   cardinalities=cards)
    k, r = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    code = ErasureCode(k, r)
    data = [CodedShard(spec, i, k) for i in range(k)]
    if seed % 2:  # trained rows, not the initial ones (a resume's)
        for shard in data:
            shard.rows[:] = odd_bits(rng, shard.rows.shape)
    expected = code.encode([s.rows for s in data])
    n_stripes = len(data[0].rows)
    for p in range(r):
        parity = ParityShard(spec, k, r, p, initialise=False)
        chunk = int(rng.integers(1, 5))
        assert encode_parity_from_members(code, spec.width, [InProcess(s) for s in data], parity, p, n_stripes,
                                          chunk) == n_stripes
        assert np.array_equal(parity.all_local_rows().view(np.uint8), expected[p].view(np.uint8)), (p, chunk)
        if seed % 2 == 0:  # the initial rows: what the parity shard regenerating every data row gets
            assert np.array_equal(parity.rows.view(np.uint8), ParityShard(spec, k, r, p).rows.view(np.uint8))


# ---- runs -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    """Four plain workers (one per member of K = 2 + R = 1, and a spare) and two trainer workers."""
    with local_cluster(4, trainers=2) as cluster, Client(cluster, direct_to_workers=True) as c:
        yield c


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "d", 11, rows=500, cards=CARDS)


@pytest.fixture(scope="module")
def plan(dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "p"
    planner.make_plan(dataset, planner.PlanConfig(batch_size=16, lookahead=4, prefetch_distance=2), out)
    return out


def _config(dataset, plan, out, mode, **kw):
    extra = {"capacity": 300} if mode == "lru" else {"plan_dir": str(plan)} if mode == "oracle" else {}
    return small_config(dataset, out, mode, iterations=14, embedding_lr=0.05, num_shards=2, **extra, **kw)


CASES = [("local", 1, {}), ("remote", 1, {}), ("lru", 1, {}), ("oracle", 1, {}), ("oracle", 1, {"parity": 1}),
         ("remote", 2, {}), ("lru", 2, {}), ("oracle", 2, {"checkpoint_every": 5})]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "trainers", "extra"), CASES, ids=lambda x: str(x))
def test_each_shard_writes_its_own_file_and_the_state_is_the_whole_one(client, dataset, plan, tmp_path, monkeypatch,
                                                                       mode, trainers, extra):
    config = _config(dataset, plan, tmp_path / "run", mode, trainers=trainers, **extra)
    setup = prepare_run(config)
    setup.whole_state = True  # trainer 0 also gathers the whole state, as runs did before
    whole = {}
    record = run_module._record

    def capture(setup, output, results):
        whole["state"] = results[0].pop("whole_state")
        return record(setup, output, results)

    monkeypatch.setattr(run_module, "_record", capture)
    summary = train(config, client=client, setup=setup)
    run_dir = tmp_path / "run"
    state = load_state(run_dir)
    assert_bit_identical(whole["state"], state, f"{mode} W={trainers} {extra}")
    digest = state_hash(whole["state"])
    manifest = read_manifest(run_dir)
    assert summary["state_sha256"] == digest == manifest["state_sha256"] == state_sha256(run_dir, 100)
    # One file per shard, each written by the process holding the shard; dense.pt by trainer 0.
    servers = mode != "local"
    assert manifest["num_shards"] == (2 if servers else 1)
    assert (manifest["total_rows"], manifest["width"]) == tuple(state["embedding"]["rows"].shape)
    files = sorted(p.name for p in (run_dir / STATE_DIR).iterdir())
    parity = [f"parity-{p}.npy" for p in range(extra.get("parity", 0))]
    assert files == sorted([DENSE_FILE, MANIFEST_FILE, *parity, *(f"shard-{i}.npy" for i in
                                                                  range(manifest["num_shards"]))])
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    pids = client.run(os.getpid)
    trainer_pids = {pids[w] for w, info in cluster_workers(client).items()
                    if (info.get("resources") or {}).get("trainer")}
    writers = [entry["pid"] for entry in manifest["shards"]]
    if servers:
        assert set(writers) <= set(pids.values()) - trainer_pids and len(set(writers)) == 2, writers
    else:
        assert writers == [os.getpid()]
    assert manifest["dense"]["pid"] in ({os.getpid()} if trainers == 1 else trainer_pids)
    for entry in [*manifest["shards"], manifest["dense"], *manifest.get("parity", {}).get("files", [])]:
        assert file_sha256(run_dir / STATE_DIR / entry["file"]) == entry["sha256"], entry["file"]
    if "parity" in extra:
        assert summary["parity"]["verify"]["ok"]
        assert [f["pid"] for f in manifest["parity"]["files"]][0] in set(pids.values()) - trainer_pids
    if "checkpoint_every" in extra:
        saved = load_checkpoint(run_dir / CHECKPOINT_FILE)
        assert [f["pid"] for f in saved["rows_files"]["files"]] == writers  # the same shards wrote both


def _no_whole_table(monkeypatch) -> None:
    """Every read of the whole table into this process raises while a test trains."""

    def refuse(*args, **kw):
        raise AssertionError("every embedding row gathered into one process")

    for owner, name in ((ShardGroup, "all_rows"), (CodedShardGroup, "all_rows"), (RowStore, "logical_rows"),
                        (RowStore, "all_rows"),
                        (rank_module, "collect_state")):
        monkeypatch.setattr(owner, name, refuse)


@pytest.mark.slow
def test_no_process_gathers_the_table_during_a_run(dataset, plan, tmp_path, monkeypatch):
    """Checkpoints, a reload after a lost shard, parity and a resume, with the whole-table reads refused and
    numpy's allocations in this process (the one trainer) traced: its peak stays far below the table."""
    big = make_dataset(tmp_path / "big", 12, rows=400, cards=(200_000, 7, 3))
    monkeypatch.setattr(row_files, "ROW_CHUNK", 1 << 11)  # this process's chunks: the shards' too
    common = dict(embedding_dim=31, bottom_mlp=(8, 31), embedding_lr=0.05, num_shards=2, iterations=12)
    table = 200_010 * 32 * 4
    runs = [("remote", dict(checkpoint_every=4, kills=("shard:1@6",))),
            ("oracle", dict(parity=1, kills=("shard:0@5",))),
            ("lru", dict(capacity=300, checkpoint_every=4))]
    oracle_plan = tmp_path / "plan"
    planner.make_plan(big, planner.PlanConfig(batch_size=16, lookahead=4, prefetch_distance=2), oracle_plan)
    reference = train(small_config(big, tmp_path / "local", "local", **common))["state_sha256"]
    with local_cluster(5) as cluster, Client(cluster, direct_to_workers=True) as client:
        for mode, extra in runs:
            extra = {**extra, **({"plan_dir": str(oracle_plan)} if mode == "oracle" else {})}
            config = small_config(big, tmp_path / mode, mode, **common, **extra)
            with monkeypatch.context() as patch:
                _no_whole_table(patch)
                tracemalloc.start()
                try:
                    if mode == "lru":  # crash after a checkpoint, then resume
                        crash_at(patch, 9)
                        with pytest.raises(Crash):
                            train(config, client=client)
                        patch.undo()
                        _no_whole_table(patch)
                        summary = train(replace(config, resume=True), client=client)
                    else:
                        summary = train(config, client=client)
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
            assert summary["state_sha256"] == reference, mode
            assert peak < table / 3, f"{mode}: {peak:,} bytes of numpy arrays at the peak, the table is {table:,}"
    assert load_state(tmp_path / "lru")["embedding"]["rows"].shape == (200_010, 32)


@pytest.mark.slow
def test_start_coded_shards_streams_parity_from_the_members(client, tmp_path, monkeypatch):
    """At the start (initial rows) and from a checkpoint's shard files (each data shard reads its own),
    the parity shards hold the encoding of the data shards, streamed to them a few stripes at a time."""
    monkeypatch.setattr(row_files, "ROW_CHUNK", 6)  # 3 stripes of K = 2 per chunk
    spec = RowSpec(dim=3, optimizer="adagrad", seed=5, table_offsets=(0, 17), cardinalities=(17, 40))
    group = start_coded_shards(client, spec, 2, 1)
    try:
        assert group.verify(chunk=4)["ok"]
        assert np.array_equal(group.all_rows(), init_rows(spec, np.arange(spec.total_rows)))
    finally:
        group.close()
    rows = odd_bits(np.random.default_rng(1), (spec.total_rows, spec.width))
    whole = ShardedRows.from_array(rows, 2)
    files = [row_files.write_rows_file(tmp_path / f"shard-{i}.npy", len(whole.shards[i]), spec.width,
                                       lambda a, b, i=i: whole.shards[i][a:b]) for i in range(2)]
    group = start_coded_shards(client, spec, 2, 2, rows=ShardedRows.from_files(tmp_path, files, *rows.shape))
    try:
        assert group.verify(chunk=4)["ok"]
        assert np.array_equal(group.all_rows().view(np.uint32), rows.view(np.uint32))
        code = ErasureCode(2, 2)
        expected = code.encode([whole.local_rows(i, 2) for i in range(2)])
        for p in range(2):
            got = group.state.members[2 + p].all_local_rows().result()
            assert np.array_equal(got.view(np.uint8), expected[p].view(np.uint8))
    finally:
        group.close()
