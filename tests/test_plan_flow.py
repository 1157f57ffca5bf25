"""`dlrmflow plan` and `dlrmflow compare-caches` end to end: CLI -> Prefect flow -> Dask -> files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from cli_helpers import run_json
from test_planner import make_dataset

from dlrmflow.cli import main
from dlrmflow.engine.planning.cache_policies import build_trace, compare_policies
from dlrmflow.engine.planning.planner import PlanConfig, load_plan, plan_sequential

pytestmark = pytest.mark.usefixtures("prefect_harness")




def _artifacts(*keys: str) -> dict[str, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=list(keys))))
    return {k: [a for a in found if a.key == k] for k in keys}


def _flow_run_log(name: str) -> list[str]:
    """The messages of the newest flow run named ``name``, its tasks' included."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])),
                                     sort=FlowRunSort.START_TIME_DESC)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[0].id])))
    return [entry.message for entry in logs]


def _progress_artifacts(description: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])))
    return [a for a in found if a.description == description]


def test_plan_command_writes_the_reference_plan(tmp_path, capsys):
    dataset = make_dataset(tmp_path / "ds", 20, 2000, [30, 500, 4, 1200], rows_per_file=450)
    argv = ["plan", str(dataset), "--batch-size", "32", "--lookahead", "6", "--prefetch-distance", "2",
            "--capacity", "1500", "--output", str(tmp_path / "plan"), "--chunk-iterations", "9"]
    result = run_json(capsys, argv)
    reference = plan_sequential(dataset, PlanConfig(32, 6, 2, capacity=1500))
    assert result["counts"] == reference.summary()["counts"] and result["num_slots"] == 1500
    assert result["dask_workers"] == 2 and result["ids_per_second"] > 0
    plan = load_plan(tmp_path / "plan", dataset_dir=dataset, batch_size=32, lookahead=6)
    for step in plan.iterations():
        want = reference.iteration(step.t)
        assert np.array_equal(step.prefetch_slots, want.prefetch_slots)
        assert np.array_equal(step.evict_ids, want.evict_ids)
    # The progress artifact reached 100% and the summary table was published.
    assert any(a.data == 100.0 for a in _progress_artifacts("plan: tasks decided, then chunks assembled"))
    # Progress in the units the phase announced (issue 46 item 6): 63 iterations in chunks of 9 on 2 workers,
    # "deciding 63 iterations in 14 tasks (7 chunks x 2 table groups)", then 14 tasks decided and 7 chunks
    # assembled, not "plan chunks done: 21/21".
    log = _flow_run_log("plan-ds-b32-l6")
    assert "plan: deciding 63 iterations in 14 tasks (7 chunks x 2 table groups) ..." in log
    assert "plan tasks decided: 14/14 (100%)" in log and "plan chunks assembled: 7/7 (100%)" in log
    assert not any("21/21" in line or "chunks done" in line for line in log), log
    assert _artifacts("lookahead-plan-ds-b32-l6")["lookahead-plan-ds-b32-l6"][0].type == "table"
    # Human summary (a re-run replaces the plan).
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "planned 63 iterations (batch 32, L=6, P=2, capacity 1,500 rows)" in out
    assert re.search(r" [0-9][0-9.,]* ([kMG] )?ids/s, ", out)  # the rate in a unit that suits it (not "0.0 M")


def test_compare_caches_command(tmp_path, capsys):
    dataset = make_dataset(tmp_path / "ds", 21, 1500, [40, 600, 7])
    result = run_json(capsys, ["compare-caches", str(dataset), "--batch-size", "25", "--lookahead", "8",
                            "--capacity", "300", "--capacity", "20%", "--embedding-dim", "8",
                            "--output", str(tmp_path / "out")])
    assert result["capacities"] == [round(0.2 * 647), 300]  # 20% of 40 + 600 + 7 rows, sorted
    expected = compare_policies(build_trace(dataset, 25), [300, 129], window=8, distance=1)
    assert [(r["policy"], r["capacity"], r["rows_fetched"]) for r in result["rows"]] == [
        (r.policy, r.capacity, r.rows_fetched) for r in expected]
    assert json.loads((tmp_path / "out" / "cache_policies.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "out" / "cache_policies.png").read_bytes()[:4] == b"\x89PNG"
    kinds = {k: v[0].type for k, v in _artifacts("cache-policies-ds-b25", "cache-policies-plot-ds-b25").items()}
    assert kinds == {"cache-policies-ds-b25": "table", "cache-policies-plot-ds-b25": "markdown"}
    assert main(["compare-caches", str(dataset), "--batch-size", "25", "--capacity", "300",
                 "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "hit rate" in out


def test_plan_on_an_existing_dask_scheduler(tmp_path, capsys):
    from distributed import LocalCluster

    dataset = make_dataset(tmp_path / "ds", 22, 600, [30, 80])
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        result = run_json(capsys, ["plan", str(dataset), "--batch-size", "16", "--lookahead", "4",
                                "--output", str(tmp_path / "plan"), "--dask-address", cluster.scheduler_address])
    assert result["dask_workers"] == 1
    assert result["counts"] == plan_sequential(dataset, PlanConfig(16, 4)).summary()["counts"]


@pytest.mark.parametrize("argv, message", [
    (["plan", "DS", "--batch-size", "16", "--lookahead", "3", "--prefetch-distance", "4", "--output", "OUT"],
     "stale read"),
    (["plan", "DS", "--batch-size", "16", "--capacity", "5", "--output", "OUT"], "alone uses"),
    (["plan", "/nonexistent/ds", "--batch-size", "16", "--output", "OUT"], "does not exist"),
    (["plan", "DS", "--batch-size", "0", "--output", "OUT"], "batch size must be >= 1"),
    (["compare-caches", "DS", "--batch-size", "16", "--capacity", "lots"], "neither a row count nor a percentage"),
    (["compare-caches", "DS", "--batch-size", "16", "--lookahead", "2", "--prefetch-distance", "3",
      "--capacity", "10"], "stale read"),
])
def test_bad_input_is_one_clear_line_and_exit_2(argv, message, tmp_path, capsys):
    dataset = make_dataset(tmp_path / "ds", 23, 200, [30, 80])
    argv = [{"DS": str(dataset), "OUT": str(tmp_path / "out")}.get(a, a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"dlrmflow {argv[0]}: error:") and message in err[-1]
    assert not (tmp_path / "out").exists()
