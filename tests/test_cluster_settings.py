"""Process-wide settings dlrmflow chooses for the machines it shares: OpenMP's wait policy and Dask's
housekeeping in the clusters it starts (docs/oracle-overhead.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import dask
import pytest

from dlrmflow.engine.serving.cluster import HOUSEKEEPING, local_cluster


def _policy_seen_by_a_fresh_process(env: dict[str, str]) -> str:
    code = "import dlrmflow, os; print(os.environ['OMP_WAIT_POLICY'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_idle_openmp_threads_sleep_unless_the_environment_says_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_seen_by_a_fresh_process(env) == "PASSIVE"
    assert _policy_seen_by_a_fresh_process({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


@pytest.mark.slow
def test_a_local_clusters_scheduler_and_workers_run_the_rarer_housekeeping():
    from distributed import Client

    with local_cluster(1) as cluster, Client(cluster) as client:
        [seen] = client.run(lambda: {key: dask.config.get(key) for key in HOUSEKEEPING}).values()
        tick = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.periodic_callbacks["tick"].callback_time)
    assert seen == HOUSEKEEPING
    assert tick == 500  # ms: the scheduler in this process read the setting when it started
