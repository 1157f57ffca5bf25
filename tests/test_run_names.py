"""Flow run names and tags that say what runs: read back from the Prefect API after real (small) runs.
(A train run's name and tags: tests/test_train_flow.py, on the run it makes anyway.)"""

from __future__ import annotations

import re

import pytest

from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.flows.run_names import pipeline_tags, recover_tags, train_name, train_tags
from dlrmflow.tasks.reporting import run_dir_label


def test_train_names_and_tags_say_mode_shards_parity_model_and_dataset(tmp_path):
    oracle = TrainConfig(dataset_dir="/data/criteo", mode="oracle", output_dir=str(tmp_path / "runs" / "o"),
                         plan_dir="p", num_shards=2, parity=1, kills=["shard:0@3"])
    label = run_dir_label(tmp_path / "runs" / "o")
    assert train_name(oracle) == f"train-oracle-k2-r1-{label}"
    assert train_tags(oracle) == ["mode:oracle", "model:dlrm", "dataset:criteo", "parity", "kills"]
    remote = {"dataset_dir": "/w/demo/dataset", "mode": "remote", "num_shards": 4, "parity": 0,
              "output_dir": "/w/demo/runs/remote"}  # from a deployment
    assert train_name(remote) == f"train-remote-k4-r0-{run_dir_label('/w/demo/runs/remote')}"
    assert train_tags(remote) == ["mode:remote", "model:dlrm", "dataset:demo"]
    assert train_name({"mode": "local", "resume": True, "output_dir": "/r/x"}) == \
        f"train-local-{run_dir_label('/r/x')}-resume"
    deepfm = {**remote, "model": "deepfm", "resume": True}
    assert train_name(deepfm).endswith("-deepfm-resume") and "model:deepfm" in train_tags(deepfm)


def test_a_run_dir_label_names_the_directory_and_never_two():
    label = run_dir_label("/w/demo/runs/oracle-parity1")
    assert label.startswith("demo-oracle-parity1-") and len(label.rsplit("-", 1)[1]) == 6  # `runs` skipped
    assert run_dir_label("/tmp/kill").startswith("tmp-kill-")
    assert run_dir_label("/w/demo/runs/oracle-parity1") == label  # the same directory, night after night
    assert run_dir_label("/v/demo/runs/oracle-parity1") != label  # same last components, another directory
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", run_dir_label("/W/Some Dir/Run_1"))  # a valid artifact key


def test_two_train_runs_in_two_directories_never_share_a_name_or_an_artifact_key(tmp_path):
    """A standalone ``dlrmflow train --parity 1 --kill shard:0@3`` run and the demo's parity run: same mode,
    shards and parity, so far both ``train-oracle-k2-r1``, and the standalone run's artifacts became the newest
    versions of the demo's keys. Their run directories tell them apart."""
    from dlrmflow.engine.training.summary import TrainSummary
    from dlrmflow.tasks.train import train_artifact_key

    dirs = [tmp_path / "demo" / "runs" / "oracle-parity1", tmp_path / "kill"]
    configs = [TrainConfig(dataset_dir="/w/demo/dataset", mode="oracle", output_dir=str(d), plan_dir="p",
                           num_shards=2, parity=1) for d in dirs]
    names = [train_name(c) for c in configs]
    assert names[0] != names[1] and all(n.startswith("train-oracle-k2-r1-") for n in names)

    def summary(run_dir):
        return TrainSummary(mode="oracle", dataset="/w/demo/dataset", output_dir=str(run_dir), iterations=6,
                            batch_size=512, num_shards=2, capacity=None, mean_iteration_ms=1.0,
                            median_iteration_ms=1.0, stall_fraction=0.0, bytes_fetched=0, bytes_written_back=0,
                            final_train_loss=0.5, final_train_loss_mean=0.5, eval_auc=None, eval_log_loss=None,
                            state_sha256="0" * 64, metrics_every=50, parity={"parity_shards": 1})

    keys = [train_artifact_key("train-summary", summary(d)) for d in dirs]
    assert keys[0] != keys[1]
    # A run's keys carry what its name carries: the summary links open this run's own artifacts.
    assert [k.removeprefix("train-summary-") for k in keys] == [n.removeprefix("train-") for n in names]
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", k) for k in keys)


def test_the_pipeline_and_recovery_runs_are_tagged():
    from dlrmflow.flows.pipeline_config import PipelineConfig

    config = PipelineConfig(work_dir="/w/Nightly", parity=1, kills=["shard:0@3"], link_rate=20)
    assert pipeline_tags(config) == ["pipeline", "dataset:nightly", "model:dlrm", "parity", "kills", "link:20mbit"]
    assert pipeline_tags({"work_dir": "/w/demo", "parity": 0, "link_rate": 0}) == \
        ["pipeline", "dataset:demo", "model:dlrm"]
    assert recover_tags(["data shard 0", "parity shard 0"]) == ["recovery", "lost:data-shard-0",
                                                                "lost:parity-shard-0"]


@pytest.mark.usefixtures("prefect_harness")
def test_flow_runs_are_named_and_tagged(tmp_path):
    import threading

    from prefect import flow, get_client, task
    from prefect.context import FlowRunContext
    from test_planner import make_dataset

    from dlrmflow.engine.coding.record import RecoveryRecord
    from dlrmflow.flows.plan import compare_caches_flow
    from dlrmflow.flows.recovery import recovery_runner

    dataset = make_dataset(tmp_path / "clicks", 3, 400, [20, 60])
    compare_caches_flow(str(dataset), 20, [40, 80], lookahead=4, output_dir=str(tmp_path / "caches"))

    def rebuild(progress=None):
        return RecoveryRecord(members=[0], detected_at=0.0, rebuilt_at=0.01).as_dict(k=2, start=0.0)

    @task
    def train_like():
        runner = recovery_runner("clicks-oracle-parity1")
        thread = threading.Thread(target=runner, args=(rebuild, {"lost": ["data shard 0"], "stripes": 8, "chunk": 8}))
        thread.start()
        thread.join()

    @flow
    def train_like_flow():
        train_like()
        return FlowRunContext.get().flow_run.id

    parent = train_like_flow()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        by_flow = {}
        for run in runs:
            by_flow.setdefault(client.read_flow(run.flow_id).name, []).append(run)
    assert "compare-caches-clicks-b20" in {r.name for r in by_flow["compare-caches"]}
    (recovery,) = [r for r in by_flow["recover-shard"] if r.parameters.get("run") == "clicks-oracle-parity1"]
    assert recovery.name == "recover-data-shard-0-clicks-oracle-parity1"
    assert set(recovery.tags) >= {"recovery", "lost:data-shard-0"}
    assert parent is not None


@pytest.mark.usefixtures("prefect_harness")
def test_no_new_object_of_the_train_flow_is_taken_for_a_recovery_s_result():
    """Prefect links a subflow's result, and the dicts and lists in it, to the subflow run by ``id()``.
    The engine keeps only its own copy of a rebuild's record; were the linked objects freed, a new list
    of the train flow (the report task's ``wait_for``) could reuse an address and become a ``flow_run``
    input of that task, which the UI's task run pages reject. Not one of many new objects is linked."""
    import gc

    from prefect import flow
    from prefect.utilities.engine import get_state_for_result

    from dlrmflow.engine.coding.record import RecoveryRecord
    from dlrmflow.flows.recovery import recovery_runner

    def rebuild(progress=None):
        record = RecoveryRecord(members=[0], detected_at=0.0, rebuilt_at=0.01, rows_rebuilt=8, chunks=1)
        return record.as_dict(k=2, start=0.0)

    @flow
    def train_like_flow() -> int:
        runner = recovery_runner("clicks-remote-parity1")
        for _ in range(3):
            runner(rebuild, {"lost": ["data shard 0"], "stripes": 8, "chunk": 8})  # the result is dropped
        gc.collect()
        fresh = [[] for _ in range(2000)] + [{} for _ in range(2000)] + [[i, i] for i in range(2000)]
        return sum(get_state_for_result(obj) is not None for obj in fresh)

    assert train_like_flow() == 0


def test_two_nights_of_the_daily_loop_never_share_a_name_or_tags():
    """Issue 46 item 1: both nights were ``daily-<state label>`` with the same tags. A night's name and tags carry
    its start (UTC) and the days it trains."""
    from datetime import UTC, datetime, timedelta, timezone

    from dlrmflow.flows.run_names import daily_name, daily_tags, night_label

    config = {"state_dir": "/w/ui/state", "model": "dlrm"}
    label = run_dir_label("/w/ui/state")
    first, second = datetime(2026, 11, 28, 2, 0, tzinfo=UTC), datetime(2026, 11, 29, 2, 0, tzinfo=UTC)
    names = [daily_name(config, first, ["day_0"]), daily_name(config, second, ["day_1", "day_2"])]
    assert names == [f"daily-{label}-2026-11-28T0200Z-day_0", f"daily-{label}-2026-11-29T0200Z-day_1-day_2"]
    assert daily_name(config, first, ["day_0"]) != daily_name(config, first, ["day_1"])  # same minute, other days
    tags = [daily_tags(config, first, ["day_0"]), daily_tags(config, second, ["day_1", "day_2"])]
    assert tags[0] == ["daily", f"state:{label}", "model:dlrm", "night:2026-11-28", "day:day_0"]
    assert tags[1][-3:] == ["night:2026-11-29", "day:day_1", "day:day_2"]
    # A night of many days, of none, of days not known (the run fails and says why); a start in another zone.
    days = [f"day_{d}" for d in range(24)]
    assert night_label(first, days) == "2026-11-28T0200Z-day_0-to-day_23"
    assert night_label(first, []) == "2026-11-28T0200Z-nothing-new" and night_label(first, None) == "2026-11-28T0200Z"
    paris = datetime(2026, 11, 28, 3, 0, tzinfo=timezone(timedelta(hours=1)))
    assert night_label(paris, ["day 7/b"]) == "2026-11-28T0200Z-day-7-b"  # UTC, and safe as a file name


@pytest.mark.usefixtures("prefect_harness")
def test_a_task_run_carries_none_of_the_tags_its_flow_run_gets_from_the_context():
    """Tags describe flow runs (the pipeline's `dataset:...`, `link:...` on each step's run); a task run inside one
    carries none (dlrmflow.tasks.task), so Prefect asks the API for no tag concurrency limits before it starts."""
    from prefect import flow, get_client, tags
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId
    from prefect.context import FlowRunContext

    from dlrmflow.tasks import task

    @task(name="a-step")
    def step(x: int) -> int:
        return x + 1

    @flow
    def steps() -> object:
        assert step(1) == 2
        return FlowRunContext.get().flow_run.id

    with tags("dataset:steps", "link:20mbit"):
        run_id = steps()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        [task_run] = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(
            any_=[run_id])))
    assert {"dataset:steps", "link:20mbit"} <= set(run.tags)
    assert task_run.name.startswith("a-step") and task_run.tags == []
