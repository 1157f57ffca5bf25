"""Process-wide settings dlrmflow chooses for the machines it shares: OpenMP's wait policy and Dask's
housekeeping in the clusters it starts (docs/oracle-overhead.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import terabyte_run_block

from dlrmflow.engine.serving.cluster import HOUSEKEEPING, housekeeping_environment, local_cluster


def _policy_seen_by_a_fresh_process(env: dict[str, str]) -> str:
    code = "import dlrmflow, os; print(os.environ['OMP_WAIT_POLICY'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_idle_openmp_threads_sleep_unless_the_environment_says_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_seen_by_a_fresh_process(env) == "PASSIVE"
    assert _policy_seen_by_a_fresh_process({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


HOUSEKEEPING_SEEN = """
import json, dask
from distributed import Client
from dlrmflow.engine.serving.cluster import HOUSEKEEPING, local_cluster
with local_cluster(1) as cluster, Client(cluster) as client:
    [seen] = client.run(lambda: {key: dask.config.get(key) for key in HOUSEKEEPING}).values()
    tick = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.periodic_callbacks["tick"].callback_time)
print(json.dumps({"seen": seen, "tick": tick}))
"""


@pytest.mark.slow
def test_a_local_clusters_scheduler_and_workers_run_the_rarer_housekeeping():
    """In a process whose environment says nothing of it (the tests' own says it: tests/conftest.py)."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in housekeeping_environment()}
    done = subprocess.run([sys.executable, "-c", HOUSEKEEPING_SEEN], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["seen"] == HOUSEKEEPING
    assert seen["tick"] == 500  # ms: the scheduler in that process read the setting when it started


def test_the_docs_export_is_the_housekeeping_of_dlrmflows_own_clusters():
    """docs/terabyte.md's optional `export` for a user's workers sets what dlrmflow's LocalCluster sets."""
    [export] = [line for line in terabyte_run_block() if line.startswith("export DASK_")]
    assert dict(word.split("=", 1) for word in export.split("#")[0].split()[1:]) == housekeeping_environment()


def _worker_start() -> dict:
    import os
    import sys

    from dlrmflow.engine.serving.cluster import worker_imports

    return {"parent": os.getppid(), "imported": [m for m in worker_imports(trainers=True) if m in sys.modules],
            "threads": __import__("torch").get_num_threads(), "cwd": os.getcwd(),
            "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MALLOC_TRIM_THRESHOLD_")}}


@pytest.mark.slow
def test_workers_fork_from_a_server_that_imported_the_engine_and_start_as_spawned_ones_would(tmp_path, monkeypatch):
    """A LocalCluster's workers come from one forkserver that imported torch and the engine (no worker imports
    them anew), and see what dlrmflow's spawned workers would: one OpenMP thread, the wait policy, no malloc
    trim threshold (even where this process has one: a plain LocalCluster leaves Dask's), and the current
    directory of the cluster's start (a later cluster's, after a chdir)."""
    from distributed import Client

    from dlrmflow.engine.serving.cluster import WORKER_START, worker_imports

    if WORKER_START != "forkserver":
        pytest.skip("this platform has no forkserver: workers are spawned")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    seen = []
    for where in (tmp_path / "a", tmp_path / "b"):
        where.mkdir()
        monkeypatch.chdir(where)
        with local_cluster(2) as cluster, Client(cluster) as client:
            seen.append((where, list(client.run(_worker_start).values())))
    # A worker its nanny restarts after a kill forks from the server too (a replacement comes up in a fraction
    # of a second, without importing torch again).
    with local_cluster(2) as cluster, Client(cluster) as client:
        victim = next(iter(client.run(os.getpid).items()))
        os.kill(victim[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while victim[0] in client.scheduler_info()["workers"] or len(client.scheduler_info()["workers"]) < 2:
            assert time.monotonic() < deadline, "the killed worker was not replaced within 60 s"
            time.sleep(0.1)
        seen.append((tmp_path / "b", list(client.run(_worker_start).values())))
    parents = {w["parent"] for _, workers in seen for w in workers}
    assert len(parents) == 1 and os.getpid() not in parents  # one server, for every cluster and the replacement
    for where, workers in seen:
        for worker in workers:
            assert worker["imported"] == list(worker_imports(trainers=True)) and worker["cwd"] == str(where)
            assert worker["threads"] == 1
            assert worker["env"] == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                                     "MALLOC_TRIM_THRESHOLD_": None}


TORCH_ON_THE_WORKERS = """
import json, sys
from distributed import Client
from dlrmflow import cli
from dlrmflow.engine.serving.cluster import local_cluster
args = cli.build_parser().parse_args(sys.argv[1:])
cli.start_local_cluster_workers_early(args._module, args)
with local_cluster(1) as cluster, Client(cluster) as client:
    [seen] = client.run(lambda: sorted(m for m in ("torch", "torch._inductor.config") if m in sys.modules)).values()
print(json.dumps(seen))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "imported"), [
    (["generate", "--rows", "10", "--output", "g.tsv"], []),
    (["train", "ds", "--mode", "oracle", "--plan", "p", "--output", "r"], []),
    (["train", "ds", "--mode", "remote", "--trainers", "2", "--output", "r"], ["torch", "torch._inductor.config"]),
])
def test_a_commands_workers_import_torch_only_where_they_train(argv, imported):
    """A data command's and a one-trainer run's LocalCluster workers fork from a server that never imported torch
    (1.4 CPU s less at each such command's start, on the cores its own imports use); trainers' do, with torch's
    compiler settings."""
    import json

    done = subprocess.run([sys.executable, "-c", TORCH_ON_THE_WORKERS, *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == imported
