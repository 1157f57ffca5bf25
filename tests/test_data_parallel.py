"""Several data-parallel trainers (``--trainers W``): the specification.

- The W-trainer reference is ``remote`` with the same W: each trainer fetches its slice's rows, a
  row's gradient is the trainers' gradients summed in rank order over the trainers that used it,
  divided by W, and the row is updated once. ``lru`` (independent per-trainer caches) and
  ``oracle`` (Bagpipe's LRPP cache) end bit-identical to it, over random W, K, B, L, P, capacities
  and both embedding optimizers.
- LRPP fetches each prefetched row from its server once, whatever the number of trainers that
  use it, and hands it to its other holders only; it writes each evicted row home once; each trainer's
  cache peaks at the rows it holds (engine/planning/holders.py).
- The building blocks: the rank-order sum only adds the holders' rows; a row's update does not
  depend on the block it sits in.
- A trainer whose process dies fails the run in one line naming it, and the other trainers stop.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import pytest
import torch
from distributed import Client
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trainers import _plan_with_capacity, make_dataset, small_config

from dlrmflow.cli import main
from dlrmflow.engine.batch_stream import BatchStream, global_ids
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.planning import planner
from dlrmflow.engine.planning.holders import holder_counts, slice_masks
from dlrmflow.engine.run_state import bit_equal, load_state
from dlrmflow.engine.serving.cluster import cluster_workers, local_cluster
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.placement import NoWorkersError, place_trainers
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.checkpoint_format import checkpoint_iteration
from dlrmflow.engine.training.collectives import sum_in_rank_order, sum_over_users
from dlrmflow.engine.training.config import TrainConfig, TrainConfigError
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.launch import TrainerLostError, trainer_device
from dlrmflow.engine.training.row_updates import apply_update, apply_update_rowwise, rowwise_adagrad_update
from dlrmflow.engine.training.run_directory import CHECKPOINT_FILE
from dlrmflow.engine.training.run_setup import prepare_run
from dlrmflow.engine.training.trainer_slices import BatchSlices, SliceWriter

CARDS = (400, 5, 1200, 90)  # larger tables than test_trainers': LRU caches and capped plans evict

# ---- building blocks ---------------------------------------------------------------------------------


def test_the_sum_over_users_adds_only_holders_in_rank_order():
    rng = np.random.default_rng(0)
    size, ids = 3, np.arange(50)
    parts = []
    for _ in range(size):
        held = np.sort(rng.choice(ids, 30, replace=False))
        parts.append((held, torch.from_numpy(rng.standard_normal((30, 4)).astype(np.float32))))
    parts[1][1][0] = -0.0  # a holder's -0.0 stays -0.0 when it is the only one
    everyone = np.unique(np.concatenate([p[0] for p in parts]))
    got = sum_over_users(everyone, parts, size)
    for i, x in enumerate(everyone):
        total = None
        for held, rows in parts:
            if x in held:
                row = rows[int(np.searchsorted(held, x))]
                total = row.clone() if total is None else total + row
        assert torch.equal(got[i], total / size), x
        assert torch.equal(torch.signbit(got[i]), torch.signbit(total / size))
    with pytest.raises(ValueError, match="no holder"):
        sum_over_users(np.array([1000]), parts, size)


def test_the_dense_mean_is_the_rank_order_sum_divided():
    parts = [torch.tensor([1e8, 1.0]), torch.tensor([1.0, 1e8]), torch.tensor([-1e8, -1e8])]
    assert torch.equal(sum_in_rank_order(parts), ((parts[0] + parts[1]) + parts[2]) / 3)
    assert torch.equal(sum_in_rank_order(parts[:1]), parts[0])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_a_rows_update_does_not_depend_on_the_block_it_sits_in(optimizer):
    """Vectorised kernels round a fused multiply-add in their body, not in their tail: the row-wise
    update must give a row the same bits at any position, in a block of any size."""
    spec = RowSpec(dim=13, optimizer=optimizer, seed=0, table_offsets=(0,), cardinalities=(1000,), lr=0.037)
    rng = np.random.default_rng(1)
    rows = torch.from_numpy(rng.standard_normal((97, spec.width)).astype(np.float32)).abs()
    grads = torch.from_numpy(rng.standard_normal((97, spec.dim)).astype(np.float32))
    whole = apply_update_rowwise(spec, rows.clone(), grads)
    for _ in range(20):
        pick = rng.permutation(97)[: int(rng.integers(1, 97))]
        index = torch.from_numpy(pick)
        part = apply_update_rowwise(spec, rows[index].clone(), grads[index])
        assert torch.equal(part, whole[index])


@settings(max_examples=80, deadline=None)
@given(dim=st.integers(2, 20), own=st.integers(0, 3), rows=st.integers(1, 70), seed=st.integers(0, 2**32 - 1),
       lr=st.sampled_from([0.01, 0.037, 1.0]))
def test_the_row_wise_and_the_vectorised_update_agree_on_the_own_accumulator_columns(dim, own, rows, seed, lr):
    """With first-order columns (``own_accumulator_columns``), both updates give those weights and their own
    accumulators the same bits, and the row-wise update gives every column of a row the same bits wherever
    the row sits. The shared columns are the vectorised kernel's (a fused multiply-add in its body), so there
    the two may differ in the last bit, as they always did; with no own columns the vectorised update is
    row-wise Adagrad over the whole row, bit for bit (DLRM's and DCN-v2's rows)."""
    own = min(own, dim - 1)
    spec = RowSpec(dim=dim, optimizer="adagrad", seed=0, table_offsets=(0,), cardinalities=(1000,), lr=lr,
                   own_accumulator_columns=own)
    assert (spec.state_width, spec.width) == (1 + own, dim + 1 + own)
    rng = np.random.default_rng(seed)
    block = torch.from_numpy(rng.standard_normal((rows, spec.width)).astype(np.float32)).abs()
    grads = torch.from_numpy(rng.standard_normal((rows, dim)).astype(np.float32))
    grads[torch.from_numpy(rng.random((rows, dim)) < 0.2)] = 0.0  # ids whose weight the batch left alone
    vectorised = apply_update(spec, block.clone(), grads)
    rowwise = apply_update_rowwise(spec, block.clone(), grads)
    shared = dim - own
    assert bit_equal(vectorised[:, shared:dim], rowwise[:, shared:dim])
    assert bit_equal(vectorised[:, dim + 1:], rowwise[:, dim + 1:])
    for _ in range(5):
        index = torch.from_numpy(rng.permutation(rows)[: int(rng.integers(1, rows + 1))])
        assert bit_equal(apply_update_rowwise(spec, block[index].clone(), grads[index]), rowwise[index])
    if own == 0:
        expected = block.clone()
        rowwise_adagrad_update(expected[:, :dim], expected[:, dim], grads, lr, spec.eps)
        assert bit_equal(vectorised, expected)


def test_a_batch_split_gives_each_trainer_its_slice():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 60, size=(12, 4))
    for size in (1, 2, 3, 4):
        for rank in range(size):
            split = BatchSplit.of(5, ids, size, rank)
            rows = 12 // size
            assert np.array_equal(split.mine[split.inverse].reshape(rows, 4), ids[rank * rows:(rank + 1) * rows])
            assert np.array_equal(split.union, np.unique(ids))
            for w in range(size):
                assert np.array_equal(split.union[split.users[w]], np.unique(ids[w * rows:(w + 1) * rows]))
            assert np.array_equal(split.first_user(), np.argmax(split.users, axis=0))


def test_a_trainer_splits_its_slice_alone_as_it_would_split_the_whole_batch(tmp_path):
    """What prepare_trainers writes (each batch's distinct ids and their trainers) and a trainer's own slice
    give the split that reading the whole global batch gives."""
    rng = np.random.default_rng(8)
    for size in (2, 3, 4):
        batches = [rng.integers(0, int(rng.integers(5, 80)), size=(size * int(rng.integers(1, 6)), 3))
                   for _ in range(6)]
        directory = tmp_path / f"w{size}"
        directory.mkdir()
        writer = SliceWriter(directory, size)
        for t, ids in enumerate(batches):
            writer.add(t, *slice_masks(ids, size))
        writer.close()
        slices = BatchSlices.load(directory, size)
        for t, ids in enumerate(batches):
            rows = len(ids) // size
            for rank in range(size):
                whole, alone = BatchSplit.of(t, ids, size, rank), slices.split(t, rank, ids[rank * rows:][:rows])
                for field in ("union", "users", "inverse"):
                    assert np.array_equal(getattr(alone, field), getattr(whole, field)), (size, t, rank, field)
                assert all(np.array_equal(a, b) for a, b in zip(alone.uniq, whole.uniq, strict=True))
                assert all(np.array_equal(a, b) for a, b in zip(alone.where, whole.where, strict=True))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_sliced_stream_reads_each_trainer_its_rows_of_every_batch(tmp_path, drop_last):
    dataset = make_dataset(tmp_path / "data", 9, rows=203, cards=CARDS)
    for size in (2, 3):
        whole = list(BatchStream(dataset, 6 * size, drop_last=drop_last))
        for rank in range(size):
            # a block of 5 batches at a time: slices are taken across blocks' edges too
            mine = list(BatchStream(dataset, 6 * size, drop_last=drop_last,
                                    read_rows_at_once=30 * size).sliced(rank, size))
            assert [b.index for b in mine] == [b.index for b in whole]
            for a, b in zip(mine, whole, strict=True):
                rows = len(b.labels) // size
                for field in ("dense", "sparse", "labels"):
                    assert np.array_equal(getattr(a, field), getattr(b, field)[rank * rows:(rank + 1) * rows])
    with pytest.raises(ValueError, match="slice 2 of 2"):
        BatchStream(dataset, 4).sliced(2, 2)


def test_a_last_batch_that_does_not_split_into_the_trainers_is_refused_in_one_line(tmp_path):
    dataset = make_dataset(tmp_path / "data", 9, rows=203, cards=CARDS)  # 203 = 16 * 12 + 11
    config = small_config(dataset, tmp_path / "out", "remote", batch_size=12, trainers=2, eval_fraction=0.0,
                          iterations=None)
    with pytest.raises(TrainConfigError, match="the last of the 17 batches has 11 rows, which do not split into 2 "
                                               "equal slices .* use --iterations 16"):
        prepare_run(config)


def run_batches(dataset, batch_size: int, iterations: int):
    """The global ids of a run's first ``iterations`` batches."""
    stream = BatchStream(dataset, batch_size, sparse_only=True)
    return [global_ids(b.sparse, stream.offsets) for b in stream.iter_range(0, iterations)]


def test_trainers_go_to_distinct_trainer_workers_away_from_the_servers():
    info = {f"tcp://h{h}:{p}": {"host": f"h{h}", "resources": {}} for h in range(2) for p in range(3)}
    assert place_trainers(info, 2, servers=["tcp://h0:0", "tcp://h1:0"]) == ["tcp://h0:1", "tcp://h1:1"]
    info["tcp://h1:2"]["resources"] = {"trainer": 1}
    info["tcp://h0:2"]["resources"] = {"trainer": 1}
    assert place_trainers(info, 2) == ["tcp://h0:2", "tcp://h1:2"]
    with pytest.raises(NoWorkersError, match="--trainers 3 needs 3 Dask worker processes.*trainer=1"):
        place_trainers(info, 3)


def test_with_a_gpu_resource_trainers_go_to_the_gpu_workers_first():
    info = {f"tcp://h{h}:{p}": {"host": f"h{h}", "resources": {}} for h in range(2) for p in range(3)}
    info["tcp://h1:1"]["resources"] = {"GPU": 1}
    assert place_trainers(info, 2, gpu=True) == ["tcp://h1:1", "tcp://h0:0"]
    assert place_trainers(info, 2) == ["tcp://h0:0", "tcp://h1:0"]  # on the CPU a GPU worker is any worker
    info["tcp://h0:2"]["resources"] = {"GPU": 1}
    assert place_trainers(info, 2, gpu=True, servers=["tcp://h1:1"]) == ["tcp://h0:2", "tcp://h1:1"]


def test_each_trainer_takes_its_workers_gpu_else_shares_the_gpus_its_process_sees():
    assert trainer_device("cpu", 3, own_gpu=True, gpus=2) == torch.device("cpu")
    assert [trainer_device("cuda", w, own_gpu=False, gpus=2) for w in range(4)] == [
        torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert [trainer_device("cuda", w, own_gpu=False, gpus=1) for w in range(3)] == [torch.device("cuda", 0)] * 3
    assert trainer_device("cuda", 3, own_gpu=True, gpus=4) == torch.device("cuda", 0)  # its own: seen first
    with pytest.raises(UserInputError, match="device: --device cuda: trainer 1's Dask worker sees no CUDA GPU"):
        trainer_device("cuda", 1, own_gpu=False, gpus=0)


@pytest.mark.parametrize(("change", "message"), [
    (dict(batch_size=10, trainers=3), "trainers: --batch-size 10 does not split into 3"),
    (dict(mode="local", trainers=2), "trainers: --trainers 2 needs embedding servers"),
    (dict(mode="lru", capacity=100, trainers=2, parity=1), "trainers: --mode lru with --parity is not supported"),
    (dict(trainers=2, checkpoint_every=5, kills=("shard:0@3",)), "kills: --kill with --trainers 2 needs --parity"),
    (dict(trainers=2, device="cuda:1"), "trainers: --device cuda:1 names one GPU, for one trainer; with "
                                        "--trainers 2 use --device cuda"),
    (dict(device="gpu"), "device: --device string should match"),
    (dict(trainers=0), "trainers: --trainers must be >= 1"),
])
def test_bad_trainer_settings_name_the_field(tmp_path, change, message):
    values = dict(dataset_dir=str(tmp_path), mode="remote", output_dir=str(tmp_path / "out"), batch_size=12)
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig(**{**values, **change})


# ---- trainers on a cluster ---------------------------------------------------------------------------


DEFAULT_SPLIT = (ShardGroup.overlap_min_bytes, ShardGroup.overlap_max_rate)


def _split_exchanges(min_bytes: int, max_rate: float) -> None:
    """On a worker: when its trainers' exchanges send each shard's fetch and write-back apart
    (``ShardGroup.overlap_min_bytes`` and ``overlap_max_rate``; 0 and inf: always)."""
    ShardGroup.overlap_min_bytes, ShardGroup.overlap_max_rate = min_bytes, max_rate


@pytest.fixture(scope="module")
def client():
    """Four plain workers (servers: up to four coded members, one per worker) and three trainer workers."""
    with local_cluster(4, trainers=3) as cluster, Client(cluster, direct_to_workers=True) as c:
        yield c


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_lru_and_lrpp_are_bit_identical_to_the_w_trainer_reference(client, tmp_path, seed):
    rng = np.random.default_rng(500 + seed)
    size = [2, 3, 2, 3][seed]
    dataset = make_dataset(tmp_path / "data", 40 + seed, rows=600, cards=CARDS)
    batch_size = size * int(rng.integers(3, 9))
    lookahead = int(rng.integers(1, 8))
    distance = int(rng.integers(1, lookahead + 1))
    _plan_with_capacity(planner, dataset, tmp_path / "plan",
                        dict(batch_size=batch_size, lookahead=lookahead, prefetch_distance=distance), rng)
    whole = seed % 2 == 0
    iterations = None if whole else int(rng.integers(3, min(540 // batch_size, 24) + 1))
    common = dict(batch_size=batch_size, iterations=iterations, eval_fraction=0.0 if whole else 0.1, seed=seed,
                  embedding_optimizer=["adagrad", "sgd"][seed % 2], dense_optimizer=["adam", "sgd"][seed // 2],
                  embedding_lr=0.05, trainers=size, num_shards=int(rng.integers(1, 4)))
    capacity = int(rng.integers(4 * batch_size, 8 * batch_size))
    runs = {"remote": train(small_config(dataset, tmp_path / "remote", "remote", **common), client=client)}
    split = seed % 2 == 1  # the caches' write-backs and fetches as concurrent calls on every trainer
    try:
        if split:  # on the workers, and here (where a run may start its shards)
            client.run(_split_exchanges, 0, float("inf"))
            _split_exchanges(0, float("inf"))
        for mode, kw in (("lru", {"capacity": capacity}), ("oracle", {"plan_dir": str(tmp_path / "plan")})):
            runs[mode] = train(small_config(dataset, tmp_path / mode, mode, **kw, **common), client=client)
    finally:
        if split:
            client.run(_split_exchanges, *DEFAULT_SPLIT)
            _split_exchanges(*DEFAULT_SPLIT)
    label = f"seed {seed}: W={size} B={batch_size} L={lookahead} P={distance} K={common['num_shards']}"
    reference = load_state(tmp_path / "remote")
    for mode in ("lru", "oracle"):
        assert runs[mode]["state_sha256"] == runs["remote"]["state_sha256"], f"{mode} vs remote, {label}"
        state = load_state(tmp_path / mode)
        assert torch.equal(state["embedding"]["rows"], reference["embedding"]["rows"]), f"{mode} rows, {label}"
    # LRPP: each prefetched row fetched from its server once and handed to its other holders (the trainers
    # whose slices use it while it is cached); written home once.
    plan = planner.load_plan(tmp_path / "plan")
    row_bytes = 4 * (4 + (1 if common["embedding_optimizer"] == "adagrad" else 0))
    oracle = runs["oracle"]
    n = oracle["iterations"]
    prefetched = sum(len(s.prefetch_ids) for s in plan.iterations() if s.t < n)
    assert oracle["bytes_fetched"] == prefetched * row_bytes == oracle["bytes_written_back"], label
    counts = holder_counts(plan.iterations(), run_batches(dataset, batch_size, n), size=size, distance=distance,
                           iterations=n)
    between = oracle["trainers"]["bytes_between_trainers"]
    handed = between["prefetched rows"] // row_bytes  # each holder but the fetcher, if it holds it, receives it
    assert counts.holders - prefetched <= handed <= counts.holders < prefetched * size, label
    assert set(between) <= {"prefetched rows", "dense gradients", "sync_now", "sync_later"}
    # Write-through LRU caches write what the reference writes; they read less.
    assert runs["lru"]["bytes_written_back"] == runs["remote"]["bytes_written_back"]
    assert runs["lru"]["bytes_fetched"] <= runs["remote"]["bytes_fetched"]
    assert [t["rank"] for t in oracle["trainers"]["per_trainer"]] == list(range(size))
    # Per trainer: the oracle's cache peaks at the rows it holds (the holders replay: fetched for t once
    # t - P - 1's evictions are out), below the plan's; an LRU cache within its capacity; remote holds none;
    # what the trainers received from each other is, in total, what they sent.
    per_trainer = {mode: run["trainers"]["per_trainer"] for mode, run in runs.items()}
    assert [t["peak_cached_rows"] for t in per_trainer["oracle"]] == counts.peak_holders_only, label
    assert oracle["peak_cached_rows"] == max(counts.peak_holders_only) <= counts.peak_every_row
    assert all(0 < t["peak_cached_rows"] <= capacity for t in per_trainer["lru"])
    assert all(t["peak_cached_rows"] == 0 for t in per_trainer["remote"])
    for mode, run in runs.items():
        received = sum(t["bytes_from_trainers"] for t in per_trainer[mode])
        assert received == sum(run["trainers"]["bytes_between_trainers"].values()) > 0, (mode, label)
        assert [t["bytes_from_servers"] for t in per_trainer[mode]] == [t["bytes_fetched"] for t in per_trainer[mode]]
    assert len({t["worker"] for t in oracle["trainers"]["per_trainer"]}) == size


@pytest.mark.slow
def test_a_learning_rate_schedule_keeps_w_trainers_bit_identical(client, tmp_path):
    """MLPerf DLRM's warm-up and decay with W = 2: lru and LRPP (whose sync_later rows are updated an
    iteration late, at the rate of the iteration whose gradient they apply) end bit-identical to remote."""
    rng = np.random.default_rng(77)
    dataset = make_dataset(tmp_path / "data", 41, rows=600, cards=CARDS)
    _plan_with_capacity(planner, dataset, tmp_path / "plan", dict(batch_size=12, lookahead=4, prefetch_distance=2),
                        rng)
    common = dict(batch_size=12, iterations=30, eval_fraction=0.1, embedding_optimizer="adagrad",
                  dense_optimizer="adam", embedding_lr=0.05, trainers=2, num_shards=2, lr_num_warmup_steps=5,
                  lr_decay_start_step=12, lr_num_decay_steps=10)
    runs = {mode: train(small_config(dataset, tmp_path / mode, mode, **kw, **common), client=client)
            for mode, kw in (("remote", {}), ("lru", {"capacity": 60}),
                             ("oracle", {"plan_dir": str(tmp_path / "plan")}))}
    assert runs["lru"]["state_sha256"] == runs["oracle"]["state_sha256"] == runs["remote"]["state_sha256"]
    assert runs["oracle"]["trainers"]["bytes_between_trainers"].get("sync_later"), "no row was synced late"


@pytest.mark.slow
def test_w_trainers_follow_the_mean_gradient_of_the_whole_batch(client, tmp_path):
    """Up to rounding, W trainers averaging their slices' gradients train as one trainer on the whole
    batch (the same learning rates): this is what the division by W is for."""
    dataset = make_dataset(tmp_path / "data", 7, rows=400, cards=CARDS)
    common = dict(batch_size=24, iterations=10, embedding_optimizer="sgd", dense_optimizer="sgd", lr=0.05)
    train(small_config(dataset, tmp_path / "one", "local", **common))
    train(small_config(dataset, tmp_path / "two", "remote", trainers=2, **common), client=client)
    one, two = load_state(tmp_path / "one"), load_state(tmp_path / "two")
    assert not torch.equal(one["embedding"]["rows"], two["embedding"]["rows"])  # other sums, other roundings
    torch.testing.assert_close(two["embedding"]["rows"], one["embedding"]["rows"], rtol=0, atol=1e-5)
    for name, value in one["dense"].items():
        torch.testing.assert_close(two["dense"][name], value, rtol=0, atol=1e-5)


def _trainer_pids(client) -> dict[str, int]:
    workers = [a for a, info in cluster_workers(client).items() if (info.get("resources") or {}).get("trainer")]
    return client.run(os.getpid, workers=workers)


@pytest.mark.slow
def test_a_killed_trainer_fails_the_run_in_one_line_and_the_others_stop(client, tmp_path):
    dataset = make_dataset(tmp_path / "data", 8, rows=600, cards=CARDS)
    config = small_config(dataset, tmp_path / "run", "remote", batch_size=12, iterations=45, trainers=2)
    servers = [a for a, info in cluster_workers(client).items() if not (info.get("resources") or {}).get("trainer")]
    victim = place_trainers(cluster_workers(client), 2, servers=servers)[1]
    pid = _trainer_pids(client)[victim]

    killed = []

    def kill_at_five(done: int, total: int) -> None:  # progress comes at most every half second
        if done >= 5 and not killed:
            killed.append(done)
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(TrainerLostError) as error:
        train(config, client=client, progress=kill_at_five)
    message = str(error.value)
    assert "\n" not in message
    assert f"trainer 1 of 2 (Dask worker {victim}) died after iteration" in message
    assert "run it again" in message
    assert not (tmp_path / "run").exists()  # a failed run leaves no directory it created
    # The surviving trainer's collectives fail as its peer's sockets close: its worker is free again.
    deadline = time.monotonic() + 60
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(client.processing().values()), client.processing()
    client.wait_for_workers(7, timeout=60)  # the nanny restarted the killed worker


def test_the_cli_refuses_a_batch_that_does_not_split_in_one_line(tmp_path, capsys):
    """(The README's `--trainers 2` example runs the CLI end to end: tests/test_readme.py.)"""
    dataset = make_dataset(tmp_path / "data", 9, rows=300, cards=CARDS)
    code = main(["train", str(dataset), "--mode", "remote", "--batch-size", "15", "--trainers", "2",
                 "--output", str(tmp_path / "bad")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dlrmflow train: error: trainers: --batch-size 15 does not split into 2 equal slices (--trainers 2); "
        "use a multiple of 2"]
    assert not (tmp_path / "bad").exists()


def _fail_trainer_one_at(t: int | None) -> None:
    """On a worker: trainer 1 raises as iteration ``t`` starts (None: trains again)."""
    from dlrmflow.engine.training import loop

    original = getattr(loop, "_unpatched_train_step", loop.train_step)
    loop._unpatched_train_step = original

    def failing(step, *args):
        if t is not None and step == t and args[8].rank == 1:  # args[8]: the trainer group
            raise RuntimeError(f"trainer 1 failed at iteration {step}")
        return original(step, *args)

    loop.train_step = original if t is None else failing


@pytest.mark.slow
def test_a_trainer_that_raises_fails_the_run_with_its_error_and_frees_the_cluster(client, tmp_path):
    """The run fails with the raising trainer's own error, not a peer's collective failing after it; and a peer
    left waiting in a collective (LRPP's trainer 0 in the dense gradients' all_gather) does not hold its worker:
    the next run on the cluster starts at once and ends in the bits of the run before the failure."""
    dataset = make_dataset(tmp_path / "data", 13, rows=600, cards=CARDS)
    planner.make_plan(dataset, planner.PlanConfig(batch_size=12, lookahead=5, prefetch_distance=2), tmp_path / "plan")
    common = dict(batch_size=12, iterations=20, trainers=2, plan_dir=str(tmp_path / "plan"))
    before = train(small_config(dataset, tmp_path / "before", "oracle", **common), client=client)

    def took_too_long(*_):
        raise TimeoutError("a run waited for a trainer blocked by the failed run")

    previous = signal.signal(signal.SIGALRM, took_too_long)
    signal.alarm(180)
    try:
        client.run(_fail_trainer_one_at, 3)
        try:
            with pytest.raises(RuntimeError, match="^trainer 1 failed at iteration 3$"):
                train(small_config(dataset, tmp_path / "failed", "oracle", **common), client=client)
        finally:
            client.run(_fail_trainer_one_at, None)
        after = train(small_config(dataset, tmp_path / "after", "oracle", **common), client=client)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert after["state_sha256"] == before["state_sha256"]
    client.wait_for_workers(7, timeout=60)


@pytest.mark.slow
def test_a_w_trainer_run_needs_a_cluster_with_enough_workers(tmp_path):
    dataset = make_dataset(tmp_path / "data", 10, rows=200, cards=CARDS)
    with local_cluster(1) as cluster, Client(cluster) as c, pytest.raises(NoWorkersError, match="--trainers 2"):
        train(small_config(dataset, tmp_path / "run", "remote", trainers=2, iterations=4), client=c)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_parity_kills_and_checkpoints_work_with_several_trainers(client, tmp_path, caplog):
    """With parity, trainer 0 alone talks to the coded group (its one client): shards killed mid-run
    are rebuilt and the run ends in the failure-free run's bits, parity verified; checkpoints too. Trainer 0's
    events (where the servers are, the loss and its rebuild) reach the driver's log, as one trainer's do."""
    caplog.set_level(logging.INFO, logger="dlrmflow.engine")
    dataset = make_dataset(tmp_path / "data", 11, rows=600, cards=CARDS)
    planner.make_plan(dataset, planner.PlanConfig(batch_size=24, lookahead=4, prefetch_distance=2), tmp_path / "plan")
    common = dict(batch_size=24, iterations=20, trainers=2, embedding_lr=0.05, dense_optimizer="adam")
    plan = {"plan_dir": str(tmp_path / "plan")}
    runs = {name: train(small_config(dataset, tmp_path / name, name.split("-")[0], **kw, **common), client=client)
            for name, kw in (("oracle", plan),
                             ("oracle-parity", {**plan, "parity": 2, "kills": ("shard:1@5", "parity:0@12")}),
                             ("remote-parity", {"parity": 1, "kills": ("shard:0@7",)}),
                             ("oracle-checkpoint", {**plan, "checkpoint_every": 5}))}
    for name, run in runs.items():
        assert run["state_sha256"] == runs["oracle"]["state_sha256"], name
    for name in ("oracle-parity", "remote-parity"):
        parity = runs[name]["parity"]
        assert parity["verify"]["ok"], name
        lost = [member for recovery in parity["recoveries"] for member in recovery["lost"]]
        assert len(lost) == len(parity["kills"]) >= 1, name  # a loss during a rebuild joins that rebuild
    assert runs["oracle-parity"]["bytes_fetched"] == runs["oracle"]["bytes_fetched"]  # one fetch per row either way
    assert [c["iteration"] for c in runs["oracle-checkpoint"]["checkpoint"]["checkpoints"]] == [0, 5, 10, 15]
    # The runs' servers end with them (their futures released at the end, not at a later garbage collection).
    def actors() -> list[str]:
        return [key for keys in client.run(lambda dask_worker: list(dask_worker.state.actors)).values() for key in keys]

    deadline = time.monotonic() + 20
    while actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not actors(), actors()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("dlrmflow.engine")]
    assert any(line.startswith("embedding servers on 1 host: ") for line in said), said
    assert any(line.startswith("lost data shard 0") for line in said), said


@pytest.mark.slow
def test_a_killed_trainer_names_the_resume_and_the_resumed_run_is_bit_identical(client, tmp_path):
    dataset = make_dataset(tmp_path / "data", 12, rows=900, cards=CARDS)
    planner.make_plan(dataset, planner.PlanConfig(batch_size=24, lookahead=5, prefetch_distance=2), tmp_path / "plan")
    common = dict(batch_size=24, iterations=30, trainers=2, plan_dir=str(tmp_path / "plan"), checkpoint_every=5)
    whole = train(small_config(dataset, tmp_path / "whole", "oracle", **common), client=client)
    config = small_config(dataset, tmp_path / "run", "oracle", **common)
    servers = [a for a, info in cluster_workers(client).items() if not (info.get("resources") or {}).get("trainer")]
    victim = place_trainers(cluster_workers(client), 2, servers=servers)[1]
    pid = _trainer_pids(client)[victim]

    killed = []

    def kill_at(done: int, total: int) -> None:  # progress comes at most every half second: not every iteration
        if done >= 13 and not killed:
            killed.append(done)
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(TrainerLostError, match=f"trainer 1 of 2 .*; continue the run from its last checkpoint with "
                                               f"`dlrmflow resume {tmp_path / 'run'}`"):
        train(config, client=client, progress=kill_at)
    # The progress that triggered the kill lags the trainers (it comes at most every half second), so the kill
    # landed at iteration killed[0] or later: the run left the checkpoint of some iteration from then on.
    left = checkpoint_iteration(tmp_path / "run" / CHECKPOINT_FILE)
    assert left in range(5, common["iterations"], 5) and left + 5 >= killed[0], (left, killed)
    # No wait for the killed worker's replacement: the cluster's third trainer worker is free.
    resumed = train(TrainConfig(**{**config.model_dump(), "resume": True}), client=client)
    assert resumed["checkpoint"]["resumed_from"] == left  # the last checkpoint before the kill
    assert resumed["state_sha256"] == whole["state_sha256"]
