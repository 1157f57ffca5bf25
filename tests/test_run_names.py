"""Flow run names and tags that say what runs: read back from the Prefect API after real (small) runs.
(A train run's name and tags: tests/test_train_flow.py, on the run it makes anyway.)"""

from __future__ import annotations

import pytest

from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.flows.run_names import train_name, train_tags


def test_train_names_and_tags_say_mode_shards_parity_model_and_dataset():
    oracle = TrainConfig(dataset_dir="/data/criteo", mode="oracle", output_dir="o", plan_dir="p", num_shards=2,
                         parity=1, kills=["shard:0@3"])
    assert train_name(oracle) == "train-oracle-k2-r1"
    assert train_tags(oracle) == ["mode:oracle", "model:dlrm", "dataset:criteo", "parity", "kills"]
    remote = {"dataset_dir": "/w/demo/dataset", "mode": "remote", "num_shards": 4, "parity": 0}  # from a deployment
    assert train_name(remote) == "train-remote-k4-r0"
    assert train_tags(remote) == ["mode:remote", "model:dlrm", "dataset:demo"]
    assert train_name({"mode": "local", "resume": True}) == "train-local-resume"
    deepfm = {**remote, "model": "deepfm", "resume": True}
    assert train_name(deepfm) == "train-remote-k4-r0-deepfm-resume" and "model:deepfm" in train_tags(deepfm)


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
    assert recovery.name == "recover-data-shard-0"
    assert parent is not None
