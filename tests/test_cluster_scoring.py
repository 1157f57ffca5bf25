"""Held-out rows scored on the Dask cluster, a part per task: the same bits as scoring in one process.

The end-of-run evaluation of a run with a client and a final state, and ``dlrmflow evaluate`` with a
client, score parts of the rows on the workers and merge the parts' summaries exactly; a part that fails
fails the scoring with one error naming the part.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from distributed import Client
from test_trainers import keep_all_plan, make_dataset, small_config

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.training import cluster_scoring
from dlrmflow.engine.training.cluster_scoring import PartScoringError, split_rows
from dlrmflow.engine.training.job import prepare_run, train
from dlrmflow.engine.training.scoring import evaluate_run, scores_on_cluster

WORKERS = 2


@pytest.fixture(scope="module")
def client():
    logging.getLogger("distributed").setLevel(logging.WARNING)
    cluster = local_cluster(WORKERS)
    with cluster, Client(cluster, direct_to_workers=True) as client:
        yield client


@pytest.fixture
def scored_parts(monkeypatch):
    """The parts of every cluster scoring in the test (the real function, counted)."""
    calls: list[int] = []
    real = cluster_scoring.score_on_cluster

    def counted(*args, **kwargs):
        summary, lookups = real(*args, **kwargs)
        calls.append(summary.rows)
        return summary, lookups

    monkeypatch.setattr(cluster_scoring, "score_on_cluster", counted)
    return calls


def test_parts_are_whole_batches_that_cover_the_rows():
    parts = split_rows(1000, 1950, 64, 2)
    assert [(p.start, p.stop) for p in parts] == [(1000, 1256), (1256, 1512), (1512, 1768), (1768, 1950)]
    assert str(parts[1]) == "part 2 of 4 (rows 1256..1511)"
    many = split_rows(0, 10_000, 100, 2, max_part_rows=1000)
    assert len(many) == 10 and all(p.stop - p.start == 1000 for p in many)
    assert [(p.start, p.stop) for p in split_rows(5, 12, 100, 4)] == [(5, 12)]
    assert split_rows(7, 7, 16, 2) == []


@pytest.mark.parametrize("mode", ["remote", "local"])
def test_the_end_of_run_evaluation_on_the_cluster_equals_the_one_in_process(mode, client, tmp_path, monkeypatch,
                                                                             scored_parts):
    """A W = 1 run with its final state: the held-out rows scored from the staged shard files on the
    workers (eval_batch_size 8: 80 rows in 4 parts) give the AUC and log loss bits of the same run scored
    in the trainer's process from the store; the final state is the same."""
    dataset = make_dataset(tmp_path / "data", 5)
    common = dict(eval_fraction=0.2, eval_batch_size=8, num_shards=2)

    monkeypatch.setattr(cluster_scoring, "CLUSTER_MIN_ROWS", 0)
    on_cluster = train(small_config(dataset, tmp_path / "cluster", mode, **common), client=client)
    assert scored_parts == [80]
    monkeypatch.setattr(cluster_scoring, "CLUSTER_MIN_ROWS", 10**12)
    in_process = train(small_config(dataset, tmp_path / "process", mode, **common), client=client)
    assert scored_parts == [80]  # not called again

    assert on_cluster["state_sha256"] == in_process["state_sha256"]
    assert on_cluster["eval_rows"] == in_process["eval_rows"] == 80
    assert 0 < on_cluster["eval_auc"] < 1
    for key in ("eval_auc", "eval_log_loss"):
        assert on_cluster[key] == in_process[key], key
    assert on_cluster["evaluations"] == in_process["evaluations"]


@pytest.mark.parametrize("mode,extra", [("remote", {}), ("lru", {"capacity": 60, "parity": 1}),
                                        ("oracle", {"parity": 1})])
def test_evaluations_every_n_iterations_on_the_cluster_equal_the_ones_in_process(mode, extra, client, tmp_path,
                                                                                 monkeypatch, scored_parts):
    """--eval-every on the cluster: at each evaluation the servers write their rows overlaid with the
    trainer's newer copies, the workers score the held-out rows from them; every evaluation has the bits of
    the one in the trainer's process, the run ends in the same state, and no snapshot is left behind."""
    dataset = make_dataset(tmp_path / "data", 5)
    common = dict(eval_fraction=0.2, eval_batch_size=8, num_shards=2, eval_every=4, **extra)
    plan = keep_all_plan(dataset, 16, 12, 2) if mode == "oracle" else None

    def run(out: str) -> dict:
        config = small_config(dataset, tmp_path / out, mode, **common)
        return train(config, client=client, setup=prepare_run(config, plan=plan))

    monkeypatch.setattr(cluster_scoring, "CLUSTER_MIN_ROWS", 0)
    on_cluster = run("cluster")
    assert scored_parts == [80] * 3  # after iterations 4 and 8, and the final evaluation
    monkeypatch.setattr(cluster_scoring, "CLUSTER_MIN_ROWS", 10**12)
    in_process = run("process")
    assert len(scored_parts) == 3  # not called again

    assert [e["iteration"] for e in on_cluster["evaluations"]] == [4, 8, 12]
    assert on_cluster["evaluations"] == in_process["evaluations"]
    assert on_cluster["state_sha256"] == in_process["state_sha256"]
    assert on_cluster["bytes_fetched"] == in_process["bytes_fetched"]
    assert not (tmp_path / "cluster" / cluster_scoring.EVALUATION_ROWS_DIR).exists()


def test_evaluations_of_local_stay_in_the_trainer(client, tmp_path, monkeypatch, scored_parts):
    """``local``: the trainer holds the table, no server writes it; its periodic evaluations stay in process
    (the final one, from the final state's files, goes to the cluster)."""
    dataset = make_dataset(tmp_path / "data", 5)
    monkeypatch.setattr(cluster_scoring, "CLUSTER_MIN_ROWS", 0)
    summary = train(small_config(dataset, tmp_path / "local", "local", eval_fraction=0.2, eval_batch_size=8,
                                 eval_every=4), client=client)
    assert [e["iteration"] for e in summary["evaluations"]] == [4, 8, 12]
    assert scored_parts == [80]


def test_evaluate_on_the_cluster_equals_evaluate_in_process(client, tmp_path):
    """``dlrmflow evaluate``'s scoring with a client (parts of 2 batches of 50 on 2 workers) gives every
    figure of the one in this process, bit for bit."""
    dataset = make_dataset(tmp_path / "data", 6)
    train(small_config(dataset, tmp_path / "run", "local", iterations=8))
    alone = evaluate_run(tmp_path / "run", dataset, batch_size=50)
    clustered = evaluate_run(tmp_path / "run", dataset, batch_size=50, client=client)
    assert (alone.pop("scored_on"), clustered.pop("scored_on")) == ("process", "cluster")
    assert clustered == alone
    assert alone["rows"] == 400 and 0 < alone["auc"] < 1
    # Other cuts of the rows (other batch sizes, so other parts) merge into the same AUC.
    assert evaluate_run(tmp_path / "run", dataset, batch_size=33, client=client)["auc"] == alone["auc"]


def test_where_evaluate_scores_its_rows(monkeypatch):
    """``--score-on auto``: on a cluster when the user named one (the option or the environment) or the rows are
    many, else in this process; ``cluster`` and ``process`` as they say."""
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    many = cluster_scoring.CLUSTER_MIN_ROWS
    assert not scores_on_cluster("auto", many - 1, None)
    assert scores_on_cluster("auto", many, None)
    assert scores_on_cluster("auto", 10, "tcp://10.0.0.1:8786")
    assert scores_on_cluster("cluster", 10, None) and not scores_on_cluster("process", many, "tcp://10.0.0.1:8786")
    monkeypatch.setenv("DLRMFLOW_DASK_ADDRESS", "tcp://10.0.0.1:8786")
    assert scores_on_cluster("auto", 10, None)
    with pytest.raises(ValueError, match="score_on: expected one of auto, cluster, process"):
        scores_on_cluster("gpu", 10, None)


def test_evaluate_on_the_command_line_scores_on_the_named_cluster(client, tmp_path, capsys, prefect_harness,
                                                                   scored_parts):
    """``dlrmflow evaluate --dask-address`` scores parts on that cluster, with the numbers of the scoring in
    the command's own process (``--score-on process``)."""
    import json

    from dlrmflow.cli import main

    dataset = make_dataset(tmp_path / "data", 8)
    train(small_config(dataset, tmp_path / "run", "local", iterations=4))
    results = {}
    for where in (["--dask-address", client.scheduler.address], ["--score-on", "process"]):
        assert main(["evaluate", str(tmp_path / "run"), str(dataset), "--batch-size", "50", *where, "--json"]) == 0
        results[where[0]] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored_parts == [400]  # the cluster's parts, once
    on_cluster, in_process = results["--dask-address"], results["--score-on"]
    assert (on_cluster.pop("scored_on"), in_process.pop("scored_on")) == ("cluster", "process")
    assert on_cluster == in_process and on_cluster["rows"] == 400


def test_a_part_that_fails_is_one_error_naming_the_part(client, tmp_path):
    """A damaged Parquet file under one part's rows: the scoring fails once, naming that part and the error."""
    dataset = make_dataset(tmp_path / "data", 7)  # 400 rows in files of 150, 150, 100
    train(small_config(dataset, tmp_path / "run", "local", iterations=4))
    Path(dataset / "part-00002.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(PartScoringError) as failed:
        evaluate_run(tmp_path / "run", dataset, batch_size=50, client=client)  # parts of 100 rows
    message = str(failed.value)
    assert "part 4 of 4 (rows 300..399)" in message and "Parquet" in message, message
    assert "\n" not in message and isinstance(failed.value, UserInputError)


def _hold_thread(name: str) -> None:
    from distributed import Event

    Event(name).wait(120)


def test_parts_run_only_on_workers_with_a_free_thread(client, tmp_path):
    """A worker whose only thread runs a task (a trainer of a W > 1 run waiting for trainer 0's evaluation)
    gets no part: one queued behind that task would never start. The scoring runs on the other worker."""
    from distributed import Event

    dataset = make_dataset(tmp_path / "data", 8)
    train(small_config(dataset, tmp_path / "run", "local", iterations=4))
    alone = evaluate_run(tmp_path / "run", dataset, batch_size=50)
    busy_worker = sorted(client.scheduler_info()["workers"])[0]
    release = Event(f"release-{tmp_path.name}", client=client)
    held = client.submit(_hold_thread, release.name, workers=[busy_worker], pure=False)
    try:
        while busy_worker not in {w for w, keys in client.processing().items() if keys}:
            time.sleep(0.05)  # until the scheduler placed it
        assert busy_worker not in cluster_scoring.free_workers(client)
        on_cluster = evaluate_run(tmp_path / "run", dataset, batch_size=50, client=client)
        assert on_cluster == {**alone, "scored_on": "cluster"}
    finally:
        release.set()
        held.result()
