"""A trainer that dies mid-run resumes from its last checkpoint and ends bit-identical (issue 6).

Engine tests first (no Prefect): a run that raises at a random iteration, then ``resume``, against
an uninterrupted run; every refusal. Then the real thing: SIGKILL of a ``dlrmflow train``
subprocess, ``dlrmflow train`` refusing its --output, ``dlrmflow resume``; and the flow's hook that
names the resume command in the flow run's logs.
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import refusal
from distributed import Client
from test_trainers import assert_bit_identical, make_dataset, small_config

from dlrmflow.engine.run_state import SUMMARY_FILE, load_state, read_summary
from dlrmflow.engine.serving.dask_internals import RestartSafeLocalCluster
from dlrmflow.engine.training import loop as loop_module
from dlrmflow.engine.training.checkpoint_format import checkpoint_iteration
from dlrmflow.engine.training.config import replace
from dlrmflow.engine.training.job import prepare_run, train
from dlrmflow.engine.training.run_directory import CHECKPOINT_FILE, RUN_CONFIG_FILE, UNFINISHED_FILE, ResumeError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    with RestartSafeLocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                 silence_logs=logging.CRITICAL) as c, Client(c) as client:
        yield client


class Crash(RuntimeError):
    """Stands for the trainer dying: raised by the train step of one iteration."""


def crash_at(monkeypatch, iteration: int) -> None:
    step = loop_module.train_step

    def failing_step(t, *args, **kw):
        if t == iteration:
            raise Crash(f"the trainer died at iteration {iteration}")
        return step(t, *args, **kw)

    monkeypatch.setattr(loop_module, "train_step", failing_step)


def losses(run_dir: Path) -> list[str]:
    with (run_dir / "iterations.csv").open() as f:
        return [row["loss"] for row in csv.DictReader(f)]


# ---- engine: crash, resume, compare with the uninterrupted run -------------------------------------


def crash_then_resume(config, tmp_path, monkeypatch, cluster, crash: int, every: int):
    """Train ``config`` into tmp_path/crashed until it crashes at iteration ``crash``, check what the crash
    left (an unfinished run, the last checkpoint), resume it: (crashed config, run dir, resumed summary)."""
    crashed = replace(config, output_dir=str(tmp_path / "crashed"))
    with monkeypatch.context() as patch:
        crash_at(patch, crash)
        with pytest.raises(Crash):
            train(crashed, client=cluster)
    run_dir = tmp_path / "crashed"
    assert (run_dir / UNFINISHED_FILE).is_file() and not (run_dir / SUMMARY_FILE).exists()
    assert checkpoint_iteration(run_dir / CHECKPOINT_FILE) == crash // every * every
    return crashed, run_dir, train(replace(crashed, resume=True), client=cluster)



def test_a_resumed_lru_run_reports_the_uninterrupted_runs_traffic(cluster, tmp_path, monkeypatch):
    """The checkpoint carries the LRU cache's slots: the resumed cache makes the same hits, misses and
    evictions, so fetched and written-back bytes equal the uninterrupted run's (and the bits too)."""
    dataset = make_dataset(tmp_path / "data", 47)
    config = small_config(dataset, tmp_path / "full", "lru", iterations=18, capacity=150, checkpoint_every=4)
    full = train(config, client=cluster)
    _, run_dir, resumed = crash_then_resume(config, tmp_path, monkeypatch, cluster, crash=10, every=4)
    assert resumed["state_sha256"] == full["state_sha256"]
    assert (resumed["bytes_fetched"], resumed["bytes_written_back"]) == (full["bytes_fetched"],
                                                                       full["bytes_written_back"])

@pytest.mark.parametrize("seed", range(4))
def test_resumed_run_ends_bit_identical_to_an_uninterrupted_one(cluster, tmp_path, monkeypatch, seed):
    rng = np.random.default_rng(700 + seed)
    dataset = make_dataset(tmp_path / "data", 40 + seed)
    mode = ["remote", "lru"][seed % 2]
    n, every = 18, int(rng.integers(1, 6))
    crash = int(rng.integers(1, n))
    extra = {"capacity": 200} if mode == "lru" else {}
    config = small_config(dataset, tmp_path / "full", mode, iterations=n, seed=seed, checkpoint_every=every,
                          embedding_lr=0.05, dense_optimizer=["sgd", "adam"][int(rng.integers(0, 2))],
                          metrics_every=int(rng.integers(1, 7)), **extra)
    full = train(config, client=cluster)
    crashed, run_dir, resumed = crash_then_resume(config, tmp_path, monkeypatch, cluster, crash, every)

    assert_bit_identical(load_state(tmp_path / "full"), load_state(run_dir), f"{mode} every {every} crash {crash}")
    assert resumed["state_sha256"] == full["state_sha256"]
    assert losses(run_dir) == losses(tmp_path / "full")  # every iteration's loss, also those before the resume
    assert [m["loss"] for m in resumed["metrics"]] == [m["loss"] for m in full["metrics"]]
    assert [m["iteration"] for m in resumed["metrics"]] == [m["iteration"] for m in full["metrics"]]
    for key in ("eval_auc", "eval_log_loss", "first_train_loss", "final_train_loss_mean", "iterations"):
        assert resumed[key] == full[key], key
    if mode == "remote":  # no cache to warm up again: the same traffic as the uninterrupted run
        assert (resumed["bytes_fetched"], resumed["bytes_written_back"]) == (full["bytes_fetched"],
                                                                           full["bytes_written_back"])
    report = resumed["checkpoint"]
    assert report["resumed_from"] == crash // every * every
    assert [c["iteration"] for c in report["checkpoints"]] == list(range(report["resumed_from"] + every, n, every))
    assert not (run_dir / UNFINISHED_FILE).exists() and read_summary(run_dir) == resumed
    with pytest.raises(ResumeError, match="finished run"):
        prepare_run(replace(crashed, resume=True))


@pytest.mark.parametrize("seed", range(2))
def test_oracle_resumes_at_its_plan_position_bit_identical(cluster, tmp_path, monkeypatch, seed):
    """Crash an oracle run after a checkpoint; the resume rebuilds the cache the plan implies there and
    ends bit-identical (state, every loss, traffic) to the uninterrupted oracle run and to local."""
    from dlrmflow.engine.planning import planner

    rng = np.random.default_rng(900 + seed)
    dataset = make_dataset(tmp_path / "data", 80 + seed)
    n, batch_size = 16, int(rng.integers(8, 20))
    lookahead = int(rng.integers(1, 6))
    distance = int(rng.integers(1, lookahead + 1))
    planner.make_plan(dataset, planner.PlanConfig(batch_size=batch_size, lookahead=lookahead,
                                                  prefetch_distance=distance), tmp_path / "plan")
    every = int(rng.integers(1, 6))
    crash = int(rng.integers(every, n))  # after a checkpoint past 0: the resume starts with a warm cache
    common = dict(iterations=n, batch_size=batch_size, seed=seed, embedding_lr=0.05,
                  embedding_optimizer=["adagrad", "sgd"][seed % 2], dense_optimizer=["sgd", "adam"][seed % 2])
    local = train(small_config(dataset, tmp_path / "local", "local", **common))
    config = small_config(dataset, tmp_path / "full", "oracle", plan_dir=str(tmp_path / "plan"), checkpoint_every=every,
                          num_shards=int(rng.integers(1, 3)), **common)
    full = train(config, client=cluster)
    crashed, run_dir, resumed = crash_then_resume(config, tmp_path, monkeypatch, cluster, crash, every)

    what = f"oracle L={lookahead} P={distance} every {every} crash {crash}"
    assert_bit_identical(load_state(tmp_path / "full"), load_state(run_dir), what)
    assert_bit_identical(load_state(tmp_path / "local"), load_state(run_dir), what)
    assert resumed["state_sha256"] == full["state_sha256"] == local["state_sha256"]
    assert losses(run_dir) == losses(tmp_path / "full") == losses(tmp_path / "local")
    # The cached rows come from the checkpoint, not the shards: the same traffic as the uninterrupted run.
    assert (resumed["bytes_fetched"], resumed["bytes_written_back"]) == (full["bytes_fetched"],
                                                                       full["bytes_written_back"])
    assert resumed["checkpoint"]["resumed_from"] == crash // every * every
    assert not (run_dir / UNFINISHED_FILE).exists()


@pytest.mark.parametrize("seed", range(2))
def test_oracle_reloads_its_checkpoint_after_a_lost_shard_and_replays(tmp_path, seed):
    """Without parity, a shard's worker killed mid-run: the oracle store restarts its prefetch worker at
    the checkpoint's plan position on fresh shards, replays, and ends bit-identical to local."""
    from dlrmflow.engine.planning import planner

    rng = np.random.default_rng(950 + seed)
    dataset = make_dataset(tmp_path / "data", 90 + seed)
    lookahead = int(rng.integers(1, 6))
    distance = int(rng.integers(1, lookahead + 1))
    planner.make_plan(dataset, planner.PlanConfig(batch_size=16, lookahead=lookahead, prefetch_distance=distance),
                      tmp_path / "plan")
    n, every = 14, int(rng.integers(1, 6))
    at = int(rng.integers(every, n))
    common = dict(iterations=n, seed=seed, embedding_lr=0.05)
    local = train(small_config(dataset, tmp_path / "local", "local", **common))
    # A cluster of its own: the killed worker's restart (slow on a busy machine) delays no other test.
    with RestartSafeLocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                 silence_logs=logging.CRITICAL) as c, Client(c) as client:
        run = train(small_config(dataset, tmp_path / "run", "oracle", plan_dir=str(tmp_path / "plan"), num_shards=2,
                                 checkpoint_every=every, kills=(f"shard:{int(rng.integers(0, 2))}@{at}",), **common),
                    client=client)
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "run"), f"oracle kill at {at}")
    assert run["state_sha256"] == local["state_sha256"]
    assert losses(tmp_path / "run") == losses(tmp_path / "local")
    (recovery,) = run["checkpoint"]["recoveries"]
    assert 0 < recovery["replay_from"] == at // every * every <= at <= recovery["failed_at"]


@pytest.mark.parametrize("mode", ["remote", "lru", "oracle"])
def test_resume_with_parity_re_encodes_parity_from_the_restored_rows(mode, cluster, tmp_path, monkeypatch):
    """With parity, a resume whose cache starts warm (lru, oracle) must know the cached rows' values as the
    servers hold them: their first write-back's parity delta is computed from them."""
    from dlrmflow.engine.planning import planner

    dataset = make_dataset(tmp_path / "data", 50)
    extra = {}
    if mode == "lru":
        extra = dict(capacity=120)
    elif mode == "oracle":
        planner.make_plan(dataset, planner.PlanConfig(batch_size=16, lookahead=4), tmp_path / "plan")
        extra = dict(plan_dir=str(tmp_path / "plan"))
    config = small_config(dataset, tmp_path / "full", mode, iterations=14, checkpoint_every=4, parity=1,
                          embedding_lr=0.05, **extra)
    full = train(config, client=cluster)
    _, _, resumed = crash_then_resume(config, tmp_path, monkeypatch, cluster, crash=10, every=4)
    assert_bit_identical(load_state(tmp_path / "full"), load_state(tmp_path / "crashed"), "parity resume")
    assert resumed["checkpoint"]["resumed_from"] == 8
    assert resumed["parity"]["verify"]["ok"] and full["parity"]["verify"]["ok"]


# ---- engine: refusals -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crashed_run(cluster, tmp_path_factory):
    """An unfinished lru run: checkpoint at iteration 6 of 12, killed at 7."""
    root = tmp_path_factory.mktemp("crashed")
    dataset = make_dataset(root / "data", 60)
    config = small_config(dataset, root / "run", "lru", capacity=200, checkpoint_every=3, embedding_lr=0.05)
    with pytest.MonkeyPatch.context() as patch:
        crash_at(patch, 7)
        with pytest.raises(Crash):
            train(config, client=cluster)
    return config


def copy_run(config, tmp_path: Path, **changes):
    shutil.copytree(config.output_dir, tmp_path / "run")
    return replace(config, output_dir=str(tmp_path / "run"), **changes)


def test_a_new_run_refuses_an_unfinished_run_dir_and_names_the_resume_command(crashed_run, tmp_path):
    config = copy_run(crashed_run, tmp_path, checkpoint_every=None)  # any new run, checkpointed or not
    with pytest.raises(ResumeError) as error:
        prepare_run(config)
    assert str(error.value) == (f"{tmp_path / 'run'} holds an unfinished run (checkpoint at iteration 6 of 12): "
                                f"resume it with `dlrmflow resume {tmp_path / 'run'}`, or choose another --output")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr": 0.02}, "another configuration: lr 0.01 (now 0.02)"),
        ({"iterations": 10}, "another configuration: iterations 12 (now 10)"),
        ({"checkpoint_every": 4, "seed": 3}, "checkpoint_every 3 (now 4), seed 0 (now 3)"),
    ],
)
def test_resume_refuses_another_configuration(crashed_run, tmp_path, change, message):
    with pytest.raises(ResumeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare_run(copy_run(crashed_run, tmp_path, resume=True, **change))


def test_resume_refuses_a_run_without_a_checkpoint(crashed_run, tmp_path):
    config = copy_run(crashed_run, tmp_path, resume=True)
    (tmp_path / "run" / CHECKPOINT_FILE).unlink()
    with pytest.raises(ResumeError, match="has no checkpoint.pt: the run stopped before its first checkpoint"):
        prepare_run(config)
    prepare_run(replace(config, resume=False))  # nothing to lose: a new run may start there


def test_resume_refuses_a_changed_dataset(crashed_run, tmp_path):
    config = copy_run(crashed_run, tmp_path, resume=True)
    shutil.copytree(config.dataset_dir, tmp_path / "data")
    make_dataset(tmp_path / "data", 61)  # same shape, other rows
    with pytest.raises(ResumeError, match="the dataset changed since"):
        prepare_run(replace(config, dataset_dir=str(tmp_path / "data")))
    prepare_run(replace(config, dataset_dir=shutil.copytree(config.dataset_dir, tmp_path / "moved")))  # same data


def test_resume_refuses_a_dir_without_a_checkpointed_run(crashed_run, tmp_path):
    config = replace(crashed_run, output_dir=str(tmp_path / "empty"), resume=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResumeError, match="has no run_config.json: nothing to resume"):
        prepare_run(config)
    with pytest.raises(ResumeError, match="does not exist"):
        prepare_run(replace(config, output_dir=str(tmp_path / "nowhere")))


def test_resume_refuses_a_checkpoint_of_another_run(crashed_run, tmp_path, cluster):
    config = copy_run(crashed_run, tmp_path, resume=True)
    other = replace(crashed_run, output_dir=str(tmp_path / "other"), embedding_lr=0.07)
    with pytest.MonkeyPatch.context() as patch:
        crash_at(patch, 7)
        with pytest.raises(Crash):
            train(other, client=cluster)
    shutil.copy(tmp_path / "other" / CHECKPOINT_FILE, tmp_path / "run" / CHECKPOINT_FILE)
    with pytest.raises(ResumeError, match="does not belong to the run"):
        train(config, client=cluster)


def test_resume_refuses_a_checkpoint_of_another_row_layout(crashed_run, tmp_path):
    """Rows one optimizer value wider than this version lays them out (a checkpoint written by a dlrmflow whose
    row layout differed) are refused before any worker starts, naming both layouts."""
    config = copy_run(crashed_run, tmp_path, resume=True)
    path = tmp_path / "run" / CHECKPOINT_FILE
    state = torch.load(path, weights_only=True)
    state["rows_files"]["width"] += 1
    torch.save(state, path)
    with pytest.raises(ResumeError) as error:
        prepare_run(config)
    assert str(error.value) == (
        f"{path} holds rows of 6 values, this version lays the run's rows out in 5 (4 weights, then one Adagrad "
        "accumulator shared by them): the checkpoint was written by a dlrmflow with another row layout; resume it "
        "with that version, or start the run over with `dlrmflow train`")


# ---- the CLI and the flow ---------------------------------------------------------------------------


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    from dlrmflow.cli import main

    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def train_args(dataset: Path, out: Path, address: str) -> list[str]:
    return ["train", str(dataset), "--mode", "remote", "--output", str(out), "--batch-size", "8",
            "--iterations", "40", "--embedding-dim", "4", "--bottom-mlp", "8-4", "--top-mlp", "8-1", "--shards", "2",
            "--checkpoint-every", "3", "--embedding-lr", "0.05", "--dask-address", address]


# A real `dlrmflow train` process (the CLI's main), slowed to 50 ms per iteration so the test can
# catch it mid-run; nothing else differs from the installed `dlrmflow` script.
SLOW_TRAIN = """
import sys, time
from dlrmflow.engine.training import loop
step = loop.train_step
loop.train_step = lambda *a, **k: (time.sleep(0.05), step(*a, **k))[1]
from dlrmflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_sigkill_of_dlrmflow_train_then_dlrmflow_resume(cluster, tmp_path, capsys):
    from prefect.settings import PREFECT_API_URL

    dataset = make_dataset(tmp_path / "data", 70)
    address = cluster.scheduler.address
    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TRAIN, *train_args(dataset, run_dir, address)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while (checkpoint_iteration(run_dir / CHECKPOINT_FILE) or 0) < 6:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint past iteration 0 within 120 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert (run_dir / UNFINISHED_FILE).is_file() and (run_dir / RUN_CONFIG_FILE).is_file()
    assert not (run_dir / SUMMARY_FILE).exists()
    at = checkpoint_iteration(run_dir / CHECKPOINT_FILE)
    assert at > 0 and at % 3 == 0

    code, _, err = cli(train_args(dataset, run_dir, address), capsys)
    assert code == 2
    assert f"holds an unfinished run (checkpoint at iteration {at} of 40): resume it with `dlrmflow resume {run_dir}`" \
        in refusal(err)
    assert checkpoint_iteration(run_dir / CHECKPOINT_FILE) == at  # refused before any work

    code, out, err = cli(["resume", str(run_dir), "--dask-address", address, "--json"], capsys)
    assert code == 0, err
    code, _, err = cli([*train_args(dataset, tmp_path / "full", address), "--json"], capsys)
    assert code == 0, err
    assert_bit_identical(load_state(tmp_path / "full"), load_state(run_dir), "SIGKILL + resume")
    assert losses(run_dir) == losses(tmp_path / "full")
    assert read_summary(run_dir)["checkpoint"]["resumed_from"] == at
    assert read_summary(run_dir)["state_sha256"] == read_summary(tmp_path / "full")["state_sha256"]

    code, _, err = cli(["resume", str(run_dir), "--dask-address", address], capsys)
    assert code == 2 and "holds a finished run" in err


@pytest.mark.usefixtures("prefect_harness")
def test_a_failed_training_names_the_resume_command_in_the_cli_and_the_flow_logs(cluster, tmp_path, capsys,
                                                                                  monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterLevel
    from prefect.logging.handlers import APILogHandler

    dataset = make_dataset(tmp_path / "data", 71)
    run_dir = tmp_path / "run"
    args = train_args(dataset, run_dir, cluster.scheduler.address)
    args[args.index("--iterations") + 1] = "12"
    crash_at(monkeypatch, 8)
    code, _, err = cli(args, capsys)
    command = f"`dlrmflow resume {run_dir}`"
    assert code == 2  # stderr: the flow run's log lines (Prefect's console), then the one error line
    assert err.strip().splitlines()[-1] == (
        "dlrmflow train: error: training stopped (Crash: the trainer died at iteration 8); "
        f"{run_dir} holds an unfinished run (checkpoint at iteration 6 of 12): resume it with {command}")
    APILogHandler().flush()  # send the queued log records to the API now
    deadline = time.monotonic() + 30
    while True:
        with get_client(sync_client=True) as prefect:
            logs = prefect.read_logs(log_filter=LogFilter(level=LogFilterLevel(ge_=logging.ERROR)))
        hits = [log for log in logs if command in log.message and log.flow_run_id is not None]
        if hits or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert hits, "the flow run's logs do not name the resume command"

    monkeypatch.undo()
    code, out, err = cli(["resume", str(run_dir), "--dask-address", cluster.scheduler.address], capsys)
    assert code == 0, err
    assert "resumed            from the checkpoint at iteration 6" in out


def test_a_stop_whose_cause_names_the_resume_command_names_it_once(tmp_path, monkeypatch):
    """A lost trainer's error already says how to resume (engine/training/launch.py): the command's one line
    then names `dlrmflow resume` once, not again after it."""
    import contextlib

    from dlrmflow.commands import console
    from dlrmflow.commands import train as train_command
    from dlrmflow.engine.training.config import TrainConfig
    from dlrmflow.flows import train as train_flow_module

    run_dir = tmp_path / "run"
    command = f"`dlrmflow resume {run_dir}`"

    class Checked(contextlib.nullcontext):
        checked = True

    def stopped(config, dask_address):
        raise RuntimeError(f"trainer 1 of 2 died after iteration 20 of 60; continue the run with {command}")

    monkeypatch.setattr(console, "HeldConsole", lambda *_: Checked())
    monkeypatch.setattr(train_flow_module, "train_flow", stopped)
    monkeypatch.setattr("dlrmflow.engine.training.run_directory_checks.unfinished_run_message",
                        lambda run: f"{run} holds an unfinished run: resume it with {command}")
    config = TrainConfig(dataset_dir=str(tmp_path / "data"), output_dir=str(run_dir), mode="local")
    with pytest.raises(train_command.TrainingStopped) as caught:
        train_command.run_training(config, None)
    assert str(caught.value).count("dlrmflow resume") == 1, caught.value
    assert str(caught.value) == f"training stopped (RuntimeError: trainer 1 of 2 died after iteration 20 of 60; " \
                                f"continue the run with {command})"
