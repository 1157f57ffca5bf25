"""The trainer on a CUDA GPU keeps every oracle of the CPU suite (skipped without a CUDA GPU).

On the GPU the cache lives in device memory, prefetches land through a side stream and pinned
host buffers, and compute waits on CUDA events: each of those is a new way to read a row before it
arrived or write one back before its update finished. So, on ``--device cuda``:

- ``remote``, ``lru`` and ``oracle`` (real plans) end bit-identical to ``local`` on the same GPU;
- a run with parity whose data shard is SIGKILLed mid-run ends bit-identical to the failure-free
  run, and its parity verifies;
- a checkpointed run killed by a shard loss reloads, replays and ends bit-identical;
- two trainers sharing the one GPU (``--trainers 2 --device cuda``): ``lru`` and ``oracle`` (LRPP, whose
  prefetched rows land in each trainer's GPU cache through its side stream) end bit-identical to the
  two-trainer ``remote`` on the GPU, with and without parity.

GPU results are compared with GPU results: cuBLAS and CPU kernels sum in different orders, so a
GPU run and a CPU run are not expected to match bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_recovery import ITERATIONS, Cluster, _check_recovered
from test_trainers import (
    _plan_with_capacity,
    assert_bit_identical,
    batch_ids,
    keep_all_plan,
    make_dataset,
    small_config,
)

from dlrmflow.engine.planning import planner as plans
from dlrmflow.engine.run_state import load_state
from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.training.job import prepare_run, train

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.cuda
DEVICE = "cuda"


@pytest.fixture(scope="module")
def cluster():
    holder = Cluster()
    yield holder
    holder.close()


def _train(config, client=None, plan=None) -> dict:
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        return train(config, client=client, setup=prepare_run(config, plan=plan))


@pytest.mark.parametrize("seed", range(3))
def test_every_mode_on_the_gpu_is_bit_identical_to_local_on_the_gpu(cluster, tmp_path, seed):
    planner = pytest.importorskip("dlrmflow.engine.planning.planner")
    client = cluster.get()
    rng = np.random.default_rng(700 + seed)
    dataset = make_dataset(tmp_path / "data", 40 + seed, rows=500)
    batch_size = int(rng.integers(4, 32))
    iterations = int(rng.integers(3, min(450 // batch_size, 20) + 1))
    lookahead = int(rng.integers(1, 10))
    distance = int(rng.integers(1, lookahead + 1))
    _plan_with_capacity(planner, dataset, tmp_path / "plan",
                        dict(batch_size=batch_size, lookahead=lookahead, prefetch_distance=distance), rng)
    common = dict(batch_size=batch_size, iterations=iterations, seed=seed, device=DEVICE,
                  embedding_optimizer=["sgd", "adagrad"][seed % 2], dense_optimizer=["adam", "sgd"][seed // 2 % 2],
                  embedding_lr=0.05, num_shards=int(rng.integers(1, 4)))
    most = max(len(ids) for ids in batch_ids(dataset, batch_size, iterations))
    capacity = int(rng.integers(most, 3 * most + 1))
    local = _train(small_config(dataset, tmp_path / "local", "local", **{**common, "num_shards": 1}))
    summaries = {
        "remote": _train(small_config(dataset, tmp_path / "remote", "remote", **common), client),
        "lru": _train(small_config(dataset, tmp_path / "lru", "lru", capacity=capacity, **common), client),
        "oracle": _train(small_config(dataset, tmp_path / "oracle", "oracle", plan_dir=str(tmp_path / "plan"),
                                      **common), client),
    }
    reference = load_state(tmp_path / "local")
    for mode, summary in summaries.items():
        assert_bit_identical(reference, load_state(tmp_path / mode), f"{mode} on {DEVICE} (config seed {seed})")
        assert summary["state_sha256"] == local["state_sha256"]
        assert summary["bytes_fetched"] > 0


def _run(tmp_path, dataset, name, mode, client=None, **kw) -> dict:
    plan = keep_all_plan(dataset, 16, ITERATIONS, 2) if mode == "oracle" else None
    if mode == "lru":
        kw["capacity"] = 200
    config = small_config(dataset, tmp_path / name, mode, iterations=ITERATIONS, batch_size=16, embedding_lr=0.05,
                          device=DEVICE, **kw)
    return _train(config, client, plan)


@pytest.mark.parametrize("mode", ["lru", "oracle"])
def test_a_killed_data_shard_is_rebuilt_and_the_gpu_run_ends_exact(cluster, tmp_path, mode):
    rng = np.random.default_rng(800 + len(mode))
    dataset = make_dataset(tmp_path / "data", 50)
    _run(tmp_path, dataset, "local", "local")
    shard, at = int(rng.integers(0, 2)), int(rng.integers(1, ITERATIONS))
    summary = _run(tmp_path, dataset, "run", mode, cluster.get(), num_shards=2, parity=1,
                   kills=(f"shard:{shard}@{at}",), rebuild_chunk=int(rng.integers(1, 40)))
    _check_recovered(tmp_path, summary, {f"shard:{shard}"})


def test_a_checkpointed_gpu_run_reloads_replays_and_ends_exact(cluster, tmp_path):
    dataset = make_dataset(tmp_path / "data", 51)
    _run(tmp_path, dataset, "local", "local")
    summary = _run(tmp_path, dataset, "run", "lru", cluster.get(), num_shards=2, checkpoint_every=4,
                   kills=("shard:1@9",))
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "run"), "checkpoint on cuda")
    (recovery,) = summary["checkpoint"]["recoveries"]
    assert recovery["replay_from"] == 8


@pytest.fixture(scope="module")
def trainer_client():
    """Three plain workers (servers) and two trainer workers, which share the one GPU."""
    from distributed import Client

    with local_cluster(3, trainers=2) as cluster, Client(cluster, direct_to_workers=True) as client:
        yield client


@pytest.mark.parametrize("parity", [0, 1])
def test_two_trainers_on_one_gpu_end_bit_identical_to_their_remote(trainer_client, tmp_path, parity):
    rng = np.random.default_rng(900 + parity)
    dataset = make_dataset(tmp_path / "data", 60 + parity, rows=500)
    batch_size = 2 * int(rng.integers(3, 9))
    _plan_with_capacity(plans, dataset, tmp_path / "plan", dict(batch_size=batch_size, lookahead=5,
                                                                prefetch_distance=2), rng)
    common = dict(batch_size=batch_size, iterations=int(rng.integers(8, 20)), seed=parity, device=DEVICE,
                  trainers=2, embedding_optimizer=["adagrad", "sgd"][parity], embedding_lr=0.05, num_shards=2,
                  parity=parity)
    modes = {"remote": {}, "oracle": {"plan_dir": str(tmp_path / "plan")}}
    if not parity:  # lru with several trainers and parity is refused (one trainer talks to coded servers)
        modes["lru"] = {"capacity": 4 * batch_size}
    runs = {mode: _train(small_config(dataset, tmp_path / mode, mode, **kw, **common), trainer_client)
            for mode, kw in modes.items()}
    reference = load_state(tmp_path / "remote")
    for mode, run in runs.items():
        assert [t["device"] for t in run["trainers"]["per_trainer"]] == ["cuda:0", "cuda:0"], mode
        assert run["state_sha256"] == runs["remote"]["state_sha256"], f"{mode} vs remote, parity {parity}"
        assert_bit_identical(reference, load_state(tmp_path / mode), f"{mode}, W=2 on one GPU, parity {parity}")
    assert runs["oracle"]["trainers"]["bytes_between_trainers"]["prefetched rows"] > 0
