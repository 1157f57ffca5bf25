"""The train flow and `dlrmflow train`, in process, under the shared Prefect test harness."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import refusal
from distributed import LocalCluster

from dlrmflow.cli import main
from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine.run_state import load_state, read_summary, state_differences, state_hash
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.tasks.reporting import run_dir_label

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train-flow") / "data"
    rng = np.random.default_rng(7)
    rows, cards = 600, [60, 8, 150]
    sparse = np.stack([np.minimum(rng.zipf(1.3, rows) - 1, c - 1) for c in cards], axis=1)
    dense = rng.standard_normal((rows, 4)).astype(np.float32)
    labels = (dense[:, 0] + rng.standard_normal(rows) > 0.5).astype(np.int8)  # learnable from I1
    write_array_dataset(path, labels, dense, sparse, cards, rows_per_file=200)
    return path


def run_cli(args: list[str], capsys) -> tuple[int, dict | None, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and "--json" in args else None), err


def common(dataset: Path, out: Path) -> list[str]:
    return ["train", str(dataset), "--output", str(out), "--batch-size", "32", "--iterations", "15",
            "--embedding-dim", "4", "--bottom-mlp", "16-4", "--top-mlp", "16-1", "--metrics-every", "5",
            "--lr", "0.05", "--json"]


@pytest.fixture(scope="module")
def local_run(dataset, tmp_path_factory) -> tuple[dict, Path]:
    """``dlrmflow train --mode local --json`` on the common settings, run once for the tests that compare
    other modes with it: its JSON object and its run directory."""
    out = tmp_path_factory.mktemp("train-flow-local") / "local"
    with pytest.MonkeyPatch.context() as patch:  # stdout captured as capsys would (a module fixture cannot use it)
        stdout = io.StringIO()
        patch.setattr(sys, "stdout", stdout)
        code = main([*common(dataset, out), "--mode", "local"])
    assert code == 0
    return json.loads(stdout.getvalue()), out


def test_cli_modes_agree_bit_for_bit(dataset, local_run, tmp_path, capsys):
    local, local_dir = local_run
    code, lru, err = run_cli([*common(dataset, tmp_path / "lru"), "--mode", "lru", "--capacity", "200",
                              "--shards", "3"], capsys)
    assert code == 0, err
    for result, run_dir in ((local, local_dir), (lru, tmp_path / "lru")):
        assert result == {k: v for k, v in read_summary(run_dir).items() if k != "metrics"}
        assert result["iterations"] == 15 and result["eval_rows"] == 60
        assert (run_dir / "iterations.csv").is_file()
    a, b = load_state(local_dir), load_state(tmp_path / "lru")
    assert state_differences(a, b) == []
    assert local["state_sha256"] == lru["state_sha256"] == state_hash(a)
    assert lru["bytes_fetched"] > 0 and local["bytes_fetched"] == 0
    summary = read_summary(local_dir)
    assert [m["iteration"] for m in summary["metrics"]] == [5, 10, 15]


def test_cli_oracle_runs_a_plan_on_an_existing_cluster(dataset, local_run, tmp_path, capsys):
    planner = pytest.importorskip("dlrmflow.engine.planning.planner")
    planner.make_plan(dataset, planner.PlanConfig(batch_size=32, lookahead=3, prefetch_distance=2), tmp_path / "plan")
    local, _ = local_run
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster:
        code, oracle, err = run_cli([*common(dataset, tmp_path / "oracle"), "--mode", "oracle", "--plan",
                                     str(tmp_path / "plan"), "--dask-address", cluster.scheduler_address], capsys)
    assert code == 0, err
    assert oracle["state_sha256"] == local["state_sha256"]
    assert oracle["plan"]["prefetch_distance"] == 2 and oracle["bytes_fetched"] > 0
    assert 0 <= oracle["stall_fraction"] <= 1


def test_human_summary(dataset, tmp_path, capsys):
    code = main([*common(dataset, tmp_path / "run")[:-1], "--mode", "local"])
    out = capsys.readouterr().out
    assert code == 0
    assert "local training: 15 iterations of batch 32" in out and "eval (60 rows)" in out


def test_flow_publishes_metrics_artifacts(dataset, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from dlrmflow.flows.train import train_flow

    state = train_flow(TrainConfig(dataset_dir=str(dataset), mode="local", output_dir=str(tmp_path / "run"),
                                   batch_size=64, iterations=6, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1],
                                   metrics_every=2), return_state=True)
    summary, run_id = state.result(), state.state_details.flow_run_id
    assert summary["iterations"] == 6 and len(summary["metrics"]) == 3
    label = run_dir_label(tmp_path / "run")  # the run directory names the keys: no other run adds to them
    names = [f"train-{what}-local-{label}" for what in ("metrics", "summary", "loss", "time")]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=names), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
        run = client.read_flow_run(run_id)
    assert {a.key for a in artifacts} == set(names)
    # The run says what it runs: its name, and tags for its mode and dataset.
    assert run.name == f"train-local-{label}" and {"mode:local", "dataset:data"} <= set(run.tags)
    table = next(a for a in artifacts if a.key == f"train-metrics-local-{label}").data
    assert '"Iteration time (ms)"' in table and "_ms" not in table
    assert (tmp_path / "run" / "loss.png").is_file() and (tmp_path / "run" / "iteration_time.png").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mode", "local", "--iterations", "99"], "beyond the data"),
        (["--mode", "lru", "--capacity", "3"], "is too small"),
        (["--mode", "lru"], "needs --capacity"),
        (["--mode", "oracle"], "needs --plan"),
        (["--mode", "oracle", "--plan", "/nonexistent/plan"], "does not exist"),
        (["--mode", "local", "--eval-fraction", "1.5"], "eval-fraction"),
    ],
)
def test_bad_input_is_one_clear_line(dataset, tmp_path, capsys, extra, message):
    args = [a for a in common(dataset, tmp_path / "run") if a != "--json"]
    if "--iterations" in extra:
        i = args.index("--iterations")
        del args[i : i + 2]
    code = main([*args, *extra])
    err = refusal(capsys.readouterr().err)
    assert code == 2
    assert err.startswith("dlrmflow train: error:") and message in err
    assert not (tmp_path / "run").exists()


def test_missing_dataset_and_wrong_plan(dataset, tmp_path, capsys):
    code = main(["train", str(tmp_path / "nope"), "--mode", "local", "--output", str(tmp_path / "run")])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    planner = pytest.importorskip("dlrmflow.engine.planning.planner")
    planner.make_plan(dataset, planner.PlanConfig(batch_size=16, lookahead=2), tmp_path / "plan16")
    code = main([*common(dataset, tmp_path / "run"), "--mode", "oracle", "--plan", str(tmp_path / "plan16")])
    assert code == 2 and "batch size 16, not 32" in capsys.readouterr().err


def _run_log(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the run's logs go to the API in batches, in the background: send them now
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [entry.message for entry in logs]


def test_engine_events_from_any_thread_land_in_the_run_log():
    """The engine reports a kill, a loss and a rebuild on plain loggers, from the training thread or a
    thread without a Prefect context (prefetch worker, rebuild thread); the train task routes them to its run."""
    import logging
    import threading

    from prefect import flow, task
    from prefect.context import FlowRunContext

    from dlrmflow.tasks.reporting import engine_events_to_run_log

    @task
    def train_like():
        with engine_events_to_run_log():
            logging.getLogger("dlrmflow.engine.training.faults").info("killed data shard 0 (from the training thread)")
            thread = threading.Thread(target=logging.getLogger("dlrmflow.engine.coding.group").warning,
                                      args=("lost data shard 0 (from a bare thread)",))
            thread.start()
            thread.join()
        logging.getLogger("dlrmflow.engine.training.faults").info("after the task: not routed")

    @flow
    def train_like_flow():
        train_like()
        return FlowRunContext.get().flow_run.id

    messages = _run_log(train_like_flow())
    assert "killed data shard 0 (from the training thread)" in messages
    assert "lost data shard 0 (from a bare thread)" in messages
    assert "after the task: not routed" not in messages


def test_a_phase_inside_a_subflow_lands_in_the_subflow_s_log_only():
    """Issue 46 item 2: the nightly daily run sends the phases of its Dask cluster to its log for the whole night,
    and each day's train flow sends them to its own: "embedding servers: initialising ..." went to both logs
    (the CLI printed it twice, once without the day). The inner run now takes the lines over while it runs."""
    import logging

    from prefect import flow
    from prefect.context import FlowRunContext

    from dlrmflow.tasks.reporting import PHASES_LOGGER, engine_events_to_run_log

    phases = logging.getLogger(PHASES_LOGGER)

    @flow
    def train_like() -> str:
        with engine_events_to_run_log(name=PHASES_LOGGER):
            phases.info("embedding servers: initialising 2 shards (the day's train run)")
        return FlowRunContext.get().flow_run.id

    @flow
    def nightly_like() -> tuple[str, str]:
        with engine_events_to_run_log(name=PHASES_LOGGER):
            phases.info("Dask: starting a LocalCluster (the night's own)")
            inner = train_like()
            phases.info("Dask: closing the LocalCluster (the night's own)")
        return FlowRunContext.get().flow_run.id, inner

    outer, inner = nightly_like()
    outer_log, inner_log = _run_log(outer), _run_log(inner)
    assert "embedding servers: initialising 2 shards (the day's train run)" in inner_log
    assert not any("embedding servers" in line for line in outer_log), outer_log
    assert {"Dask: starting a LocalCluster (the night's own)", "Dask: closing the LocalCluster (the night's own)"} \
        <= set(outer_log)
    assert not any("the night's own" in line for line in inner_log)
    assert not any(type(h).__name__ == "_ToRunLogger" for h in phases.handlers)  # every block undone


@pytest.mark.slow
def test_a_kill_its_detection_and_the_rebuild_are_logged_in_the_train_run(tmp_path):
    """A parity run with a kill: the train flow run's own log says what was killed, when the loss was
    noticed and when the rebuild ended (the recover-shard subflow logs its details too). ~20 s: a real
    LocalCluster of 4 worker processes and a real SIGKILL."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from test_trainers import make_dataset

    from dlrmflow.flows.train import train_flow

    dataset = make_dataset(tmp_path / "kill-data", 23)
    summary = train_flow(TrainConfig(dataset_dir=str(dataset), mode="remote", output_dir=str(tmp_path / "run"),
                                     batch_size=16, iterations=10, embedding_dim=4, bottom_mlp=[8, 4],
                                     top_mlp=[8, 1], num_shards=2, parity=1, kills=["shard:1@4"], metrics_every=1))
    assert summary["parity"]["verify"]["ok"]
    with get_client(sync_client=True) as client:
        name = f"train-remote-k2-r1-{run_dir_label(tmp_path / 'run')}"
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    (run,) = [r for r in runs if r.parameters["config"]["output_dir"] == str(tmp_path / "run")]
    assert {"mode:remote", "parity", "kills"} <= set(run.tags)
    log = "\n".join(_run_log(run.id))
    assert "killed data shard 1: SIGKILL to its Dask worker" in log and "at the start of iteration 4" in log
    # Iterations count from 0 in the log as in iterations.csv: iteration 3's loss, then the kill before iteration 4.
    assert log.index("iteration 3: loss") < log.index("killed data shard 1") < log.index("iteration 4: loss")
    assert "lost data shard 1: rebuilding from parity while training goes on (noticed by the trainer, " in log
    assert "rebuilt data shard 1:" in log
    assert log.index("killed data shard 1") < log.index("lost data shard 1") < log.index("rebuilt data shard 1")


def test_a_kill_run_s_report_task_has_the_train_task_as_input_and_no_flow_run(dataset, tmp_path):
    """The report task's input, the run's summary, holds each recover-shard subflow's result; Prefect would
    record that subflow run as a ``flow_run`` input, which the UI's task run pages reject (its Task Runs tab
    said "No task runs", its artifacts' Task Run links were blank). Its one input is the train task."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter

    from dlrmflow.flows.train import train_flow

    state = train_flow(TrainConfig(dataset_dir=str(dataset), mode="remote", output_dir=str(tmp_path / "kill"),
                                   batch_size=32, iterations=6, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1],
                                   num_shards=2, parity=1, kills=["shard:0@3"]), return_state=True)
    summary, run_id = state.result(), state.state_details.flow_run_id
    assert [r["lost"] for r in summary["parity"]["recoveries"]] == [["data shard 0"]]
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
                                      task_run_filter=TaskRunFilter())
    by_name = {t.task_key.split(".")[-1] if t.task_key else t.name: t for t in tasks}
    report = next(t for t in tasks if t.name.startswith("publish-train-report"))
    train = next(t for t in tasks if t.name.startswith("train-dlrm"))
    inputs = [i for group in report.task_inputs.values() for i in group]
    assert inputs and all(i.input_type == "task_run" for i in inputs), (by_name, report.task_inputs)
    assert {i.id for i in inputs} == {train.id}
