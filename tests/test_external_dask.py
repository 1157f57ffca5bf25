"""dlrmflow on an existing Dask cluster: a scheduler and five workers started as separate processes.

A user points dlrmflow at a running cluster with ``--dask-address`` or ``DLRMFLOW_DASK_ADDRESS``. The
work must run on that cluster's workers (not on a LocalCluster started on the side) and give exactly
the bytes a LocalCluster run gives. Two of the workers advertise the ``embedding_server`` resource:
embedding-server and parity actors go there and nowhere else; two advertise ``trainer``: the trainers
of ``--trainers 2`` run there, one each; data work goes everywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_json
from dask.utils import key_split
from distributed import Client
from process_helpers import stop_process_groups
from test_trainers import make_dataset

from dlrmflow.datasets.meta import read_meta
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.placement import RESOURCE, TRAINER_RESOURCE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]

DASK = Path(sys.executable).parent / "dask"
START_TIMEOUT_S = 120
WORKERS = {"w0": [], "w1": ["--resources", f"{RESOURCE}=1"], "w2": ["--resources", f"{RESOURCE}=1"],
           "t0": ["--resources", f"{TRAINER_RESOURCE}=1"], "t1": ["--resources", f"{TRAINER_RESOURCE}=1"]}
SERVER_WORKERS = {"w1", "w2"}
TRAINER_WORKERS = {"t0", "t1"}
ACTOR_CLASSES = {"EmbeddingShard", "CodedShard", "ParityShard"}


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


@pytest.fixture(scope="module")
def cluster_home(tmp_path_factory) -> Path:
    """Where the cluster's processes run and write their logs (``NAME.log``)."""
    return tmp_path_factory.mktemp("dask-cluster")


@pytest.fixture(scope="module")
def external_cluster(cluster_home):
    """``dask scheduler`` + 5 x ``dask worker --nthreads 1`` (two with the embedding_server resource, two
    with the trainer resource), each its own OS process on loopback."""
    home = cluster_home
    scheduler_file = home / "scheduler.json"
    env = {k: v for k, v in os.environ.items() if k != "DLRMFLOW_DASK_ADDRESS"}
    # The tests read which tasks each worker executed from its transition log (1000 entries by default).
    env["DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH"] = "1000000"
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(name: str, argv: list[str]) -> None:
        log = home / f"{name}.log"
        logs.append(log)
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(argv, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))

    try:
        # --idle-timeout: should this test process die without its teardown, the cluster goes away by itself.
        start("scheduler", [str(DASK), "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                            "--scheduler-file", str(scheduler_file), "--idle-timeout", "900s"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not scheduler_file.is_file():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                pytest.fail(f"dask scheduler did not start:\n{_tail(logs[0])}")
            time.sleep(0.5)
        for name, extra in WORKERS.items():
            start(name, [str(DASK), "worker", "--scheduler-file", str(scheduler_file), "--nthreads", "1",
                         "--nworkers", "1", "--host", "127.0.0.1", "--no-dashboard", "--name", name,
                         "--local-directory", str(home / name), "--death-timeout", "120", *extra])
        client = Client(scheduler_file=str(scheduler_file), timeout="60s")
        try:
            try:
                client.wait_for_workers(len(WORKERS), timeout=START_TIMEOUT_S)
            except TimeoutError:
                pytest.fail("dask workers did not join:\n" + "\n".join(_tail(log) for log in logs))
            yield client
        finally:
            client.close()
    finally:
        stop_process_groups(procs, grace_s=15)




def _executed_prefixes(client: Client) -> dict[str, set[str]]:
    """Per worker (by name), the task prefixes it executed, from the worker's own transition log."""

    def executed(dask_worker) -> list[str]:
        return sorted({key_split(ev[0]) for ev in dask_worker.state.log if len(ev) > 2 and ev[2] == "executing"})

    names = {addr: w["name"] for addr, w in cluster_workers(client).items()}
    return {names[addr]: set(prefixes) for addr, prefixes in client.run(executed).items()}


def _without_paths(profile: dict) -> dict:
    return {k: v for k, v in profile.items() if k not in ("dataset", "plot")}


def test_dataset_commands_run_on_the_external_workers_and_match_a_local_cluster(
        external_cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    address = external_cluster.scheduler.address
    on_cluster = ["--dask-address", address]
    raws = [tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"]
    for seed, raw in enumerate(raws):
        run_json(capsys, ["generate", "--rows", "8000", "--scale", "0.01", "--seed", str(seed + 1),
                       "--output", str(raw), *on_cluster])
    ext, local = tmp_path / "ds-external", tmp_path / "ds-local"
    prep = run_json(capsys, ["preprocess", *map(str, raws), "--output", str(ext), *on_cluster])
    prof = run_json(capsys, ["profile", str(ext), *on_cluster])
    assert prep["rows"] == 16000 and not prep["skipped"] and prof["samples"] == 16000

    # The work ran on the worker processes started above: their own logs show the tasks.
    executed = _executed_prefixes(external_cluster)
    assert set(executed) == set(WORKERS)
    ran = set().union(*executed.values())
    assert {"chunk_payload", "parse_piece", "count_partition", "map_item", "write_part", "count_table"} <= ran, ran

    # The same commands on the default LocalCluster give the same raw bytes, dataset and profile.
    local_raw = tmp_path / "local_day_0.tsv"
    run_json(capsys, ["generate", "--rows", "8000", "--scale", "0.01", "--seed", "1", "--output", str(local_raw)])
    assert local_raw.read_bytes() == raws[0].read_bytes()
    run_json(capsys, ["preprocess", *map(str, raws), "--output", str(local)])
    local_prof = run_json(capsys, ["profile", str(local)])
    meta_ext, meta_local = read_meta(ext), read_meta(local)
    assert meta_ext.fingerprint == meta_local.fingerprint
    assert meta_ext == meta_local
    for part in meta_ext.files:
        assert (ext / part.name).read_bytes() == (local / part.name).read_bytes(), part.name
    assert _without_paths(prof) == _without_paths(local_prof)


def test_the_environment_variable_selects_the_cluster(external_cluster, tmp_path, capsys, monkeypatch, data_dir):
    """DLRMFLOW_DASK_ADDRESS, without --dask-address, sends the work to the external cluster too."""
    external_cluster.run(lambda dask_worker: dask_worker.state.log.clear())
    monkeypatch.setenv("DLRMFLOW_DASK_ADDRESS", external_cluster.scheduler.address)
    run_json(capsys, ["preprocess", str(data_dir / "avazu_sample.csv"), "--format", "avazu", "--output",
                   str(tmp_path / "ds")])
    ran = set().union(*_executed_prefixes(external_cluster).values())
    assert {"parse_piece", "write_part"} <= ran, ran


def test_relative_paths_work_when_the_workers_run_elsewhere(external_cluster, tmp_path, capsys, monkeypatch, data_dir):
    """The workers' working directory is not the user's: a relative path must mean the user's directory."""
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    shutil.copyfile(data_dir / "avazu_sample.csv", tmp_path / "day.csv")
    on_cluster = ["--dask-address", external_cluster.scheduler.address]
    prep = run_json(capsys, ["preprocess", "day.csv", "--format", "avazu", "--output", "ds", *on_cluster])
    prof = run_json(capsys, ["profile", "ds", *on_cluster])
    assert read_meta(tmp_path / "ds").rows == prep["rows"] == prof["samples"] > 0


def test_embedding_servers_and_parity_run_only_on_the_workers_with_the_resource(
        external_cluster, tmp_path, capsys, monkeypatch):
    """Training against the cluster: every shard actor (data and parity) is constructed on a worker that
    advertises embedding_server, spread over both of them; the plain worker hosts none."""
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    dataset = make_dataset(tmp_path / "data", 0)
    workers = cluster_workers(external_cluster)
    address_of = {w["name"]: a for a, w in workers.items()}
    assert {n for n, a in address_of.items() if workers[a]["resources"].get(RESOURCE)} == SERVER_WORKERS
    common = ["train", str(dataset), "--mode", "remote", "--batch-size", "16", "--iterations", "6",
              "--embedding-dim", "4", "--bottom-mlp", "8-4", "--top-mlp", "8-1",
              "--dask-address", external_cluster.scheduler.address]

    def actors_by_worker() -> dict[str, set[str]]:
        return {name: prefixes & ACTOR_CLASSES for name, prefixes in _executed_prefixes(external_cluster).items()}

    # Two shards, no parity: one on each resource worker.
    external_cluster.run(lambda dask_worker: dask_worker.state.log.clear())
    run_json(capsys, [*common, "--shards", "2", "--output", str(tmp_path / "plain")])
    placed = actors_by_worker()
    assert placed == {"w0": set(), "w1": {"EmbeddingShard"}, "w2": {"EmbeddingShard"}, "t0": set(), "t1": set()}, \
        placed

    # Two data shards + one parity shard: three members on the two resource workers (so they share one).
    external_cluster.run(lambda dask_worker: dask_worker.state.log.clear())
    summary = run_json(capsys, [*common, "--shards", "2", "--parity", "1", "--output", str(tmp_path / "parity")])
    placed = actors_by_worker()
    assert not placed["w0"] | placed["t0"] | placed["t1"], placed
    assert placed["w1"] | placed["w2"] == {"CodedShard", "ParityShard"}, placed
    members = summary["parity"]["member_workers"]
    assert len(members) == 3 and set(members.values()) == {address_of[n] for n in SERVER_WORKERS}, members
    assert summary["parity"]["members_share_workers"] is True
    assert summary["parity"]["verify"]["ok"] is True
    # The servers store, code and rebuild rows; the trainers update them: no server process loads torch.
    loaded = external_cluster.run(lambda: "torch" in sys.modules)
    assert {n: loaded[address_of[n]] for n in SERVER_WORKERS} == dict.fromkeys(SERVER_WORKERS, False), loaded


def test_trainers_run_on_the_trainer_workers_and_their_logs_say_so(external_cluster, cluster_home, tmp_path, capsys,
                                                                    monkeypatch):
    """``--trainers 2``: trainer 0 and trainer 1 each on its own worker advertising ``trainer``, the shards on
    the embedding_server workers, as each worker's own log (its output) says. (That LRPP ends in the
    reference's bits is tests/test_data_parallel.py's.)"""
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    dataset = make_dataset(tmp_path / "data", 3)
    on_cluster = ["--dask-address", external_cluster.scheduler.address]
    run_json(capsys, ["plan", str(dataset), "--batch-size", "16", "--lookahead", "4", "--prefetch-distance", "2",
                      "--output", str(tmp_path / "plan"), *on_cluster])
    logs = {name: (cluster_home / f"{name}.log").read_text(errors="replace") for name in WORKERS}
    lrpp = run_json(capsys, ["train", str(dataset), "--mode", "oracle", "--plan", str(tmp_path / "plan"),
                             "--batch-size", "16", "--iterations", "8", "--embedding-dim", "4", "--bottom-mlp", "8-4",
                             "--top-mlp", "8-1", "--shards", "2", "--trainers", "2",
                             "--output", str(tmp_path / "oracle"), *on_cluster])
    since = {name: (cluster_home / f"{name}.log").read_text(errors="replace")[len(logs[name]):] for name in WORKERS}
    names = {a: w["name"] for a, w in cluster_workers(external_cluster).items()}
    ran = [names[t["worker"]] for t in lrpp["trainers"]["per_trainer"]]
    assert sorted(ran) == sorted(TRAINER_WORKERS), ran
    for rank, name in enumerate(ran):  # each trainer worker's log names its trainer, and no other
        line = f"dlrmflow trainer {rank} of 2 on cpu: rows {8 * rank}..{8 * rank + 7} of every batch"
        assert since[name].count(line) == 1 and "dlrmflow trainer" not in since[name].replace(line, ""), \
            (name, since[name][-2000:])
    assert "dlrmflow trainer" not in since["w0"] + since["w1"] + since["w2"]
    shards = {name: since[name].count("dlrmflow EmbeddingShard") for name in WORKERS}
    assert shards == {"w0": 0, "w1": 1, "w2": 1, "t0": 0, "t1": 0}, shards
    # A prefetched row goes to its other holder only: fewer than W - 1 = 1 copy of every row.
    assert 0 < lrpp["trainers"]["bytes_between_trainers"]["prefetched rows"] < lrpp["bytes_fetched"]
