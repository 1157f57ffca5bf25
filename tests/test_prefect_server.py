"""The deployments of prefect.yaml on a real Prefect server, run by a process worker, as a user runs them.

The README's deployment block, run as written: the test starts ``prefect server start`` on a free
loopback port with its own PREFECT_HOME (so it never touches ~/.prefect, nor the session's
``prefect_harness`` server) and gives the children PREFECT_API_URL in their environment (for the
README's ``prefect config set``); then it runs the README's next lines verbatim in a shell with the
venv's ``bin`` first on PATH (what ``source .venv/bin/activate`` does): ``prefect work-pool create``,
``prefect deploy --all``, ``prefect worker start``, the ``prefect deployment run 'pipeline/demo'``
command, which must complete, and the daily example's two nights of ``daily/nightly``. It checks through
the Prefect API what a user sees in the UI.

They run in a copy of the project root (``prefect.yaml`` and the ``flows/`` its entrypoints name), as
a user's clone: the README's relative ``work_dir`` then lands in the test's temporary directory, not in
this checkout's ``runs/``. This process's settings change only inside ``temporary_settings`` while it
reads the API.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from process_helpers import stop_process_groups

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
README_SECTION = "### Prefect server, UI and deployments"
POOL = "dlrmflow"
START_TIMEOUT_S = 180  # a cold server start migrates a fresh SQLite database; 2 busy cores are slow
RUN_TIMEOUT_S = 420
PIPELINE_SUBFLOWS = {"generate", "preprocess", "profile", "plan", "compare-caches", "train"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_deployment_block(heading: str = README_SECTION) -> list[str]:
    """The shell commands of the first block under the README's ``heading`` (the Prefect deployment block):
    continuation lines joined (their backslash-newline kept, as a shell reads them), a ``# ...`` comment
    after a command left out."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    commands, pending = [], ""
    for line in block.splitlines():
        if line.endswith("\\"):
            pending += line + "\n"
            continue
        commands.append(pending + re.sub(r"\s+# .*$", "", line))
        pending = ""
    return commands


def readme_command(prefix: str) -> str:
    """The README block's one command that starts with ``prefix``."""
    [command] = [c for c in readme_deployment_block() if c.startswith(prefix)]
    return command


def shell_words(command: str) -> list[str]:
    """The words a POSIX shell makes of ``command`` (a backslash-newline joins two lines)."""
    return shlex.split(command.replace("\\\n", ""))


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


@dataclass
class PrefectServer:
    api_url: str
    env: dict[str, str]  # for child processes: this server, an isolated PREFECT_HOME, the venv first on PATH
    log_dir: Path
    project: Path  # the copy of the project root the commands run in

    def shell(self, command: str, timeout: float = 300) -> str:
        """Run ``command`` as a user types it, in the project root; fail with its output if it fails."""
        done = subprocess.run(["bash", "-c", command], cwd=self.project, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            pytest.fail(f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done.stdout + done.stderr

    def start(self, name: str, command: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        """Start ``command`` in the background, in the project root; its output goes to ``NAME.log``."""
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.project,
                                    env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return proc, log


def _child_env(home: Path) -> dict[str, str]:
    # No PREFECT_* setting of this process (the test harness, the user's profile) leaks into the children;
    # no DLRMFLOW_DASK_ADDRESS either: the flow runs start their own LocalCluster.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DLRMFLOW_DASK_ADDRESS"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_COLORS="false",
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent))
    return env


def _project_copy(base: Path) -> Path:
    """A project root as a clone has it, for what the deployments need: prefect.yaml and flows/."""
    project = base / "project"
    project.mkdir()
    (project / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
    (project / "flows").symlink_to(REPO / "flows", target_is_directory=True)
    return project


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[PrefectServer]:
    base = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = _child_env(base / "home")
    server = PrefectServer(api_url, {**env, "PREFECT_API_URL": api_url}, base, _project_copy(base))
    log = base / "server.log"
    with open(log, "wb") as out:
        # --no-scheduler: the nightly schedule must not create runs on the test server (one at 02:00 UTC
        # would start the full-size pipeline in the project directory).
        proc = subprocess.Popen([str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                 str(port), "--no-ui", "--analytics-off", "--no-scheduler"],
                                cwd=base, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prefect server did not become healthy at {api_url}:\n{_tail(log)}")
            time.sleep(1)
        yield server
    finally:
        stop_process_groups([proc])


@pytest.fixture(scope="module")
def worker(prefect_server) -> Iterator[Path]:
    """The pool, every deployment of prefect.yaml, and a process worker polling the pool, each made by the
    README's own command; yields the worker's log."""
    prefect_server.shell(readme_command("prefect work-pool create"))
    prefect_server.shell(readme_command("prefect deploy --all"))
    # Poll every 2 s instead of 10 s: the test waits for the run.
    proc, log = prefect_server.start("worker", readme_command("prefect worker start"),
                                     env={"PREFECT_WORKER_QUERY_SECONDS": "2"})
    try:
        yield log
    finally:
        # The worker turns SIGTERM into SIGINT and stops its flow runs; a hung one gets SIGKILL.
        stop_process_groups([proc], signal.SIGINT)


def _declared_deployments() -> set[tuple[str, str]]:
    """(entrypoint, name) of every deployment prefect.yaml declares."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return {(d["entrypoint"], d["name"]) for d in spec["deployments"]}


@contextmanager
def _api(url: str):
    """A client of the test server; this process's own Prefect settings are back as they were afterwards."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def _wait_for_final_state(url: str, run_id: str, worker_log: Path):
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with _api(url) as client:
        while True:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            if time.monotonic() > deadline:
                pytest.fail(f"flow run {run_id} still {run.state_name} after {RUN_TIMEOUT_S} s; worker log:\n"
                            f"{_tail(worker_log)}")
            time.sleep(2)


def test_the_readme_block_is_the_server_the_profile_setting_and_what_the_test_runs():
    """What the test replaces (the server on port 4200, ``prefect config set``) and what it runs verbatim."""
    commands = [c.split()[:3] for c in readme_deployment_block()]
    assert commands == [["prefect", "server", "start"], ["prefect", "config", "set"],
                        ["prefect", "work-pool", "create"], ["prefect", "deploy", "--all"],
                        ["prefect", "worker", "start"], ["prefect", "deployment", "run"]]
    assert readme_command("prefect config set") == "prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api"
    assert readme_command("prefect work-pool create") == f"prefect work-pool create {POOL} --type process"
    assert readme_command("prefect worker start") == f"prefect worker start --pool {POOL}"


def test_the_prefect_yaml_header_gives_the_readme_deployment_command():
    header = [line.removeprefix("#").strip() for line in (REPO / "prefect.yaml").read_text().splitlines()
              if line.startswith("#   prefect deployment run")]
    assert [shell_words(line) for line in header] == [shell_words(readme_command("prefect deployment run"))]


@pytest.mark.slow
def test_every_deployment_is_created_from_prefect_yaml(prefect_server, worker):
    with _api(prefect_server.api_url) as client:
        deployments = client.read_deployments()
        nightly = client.read_deployment_by_name("daily/nightly")
        demo = client.read_deployment_by_name("pipeline/demo")
    assert {(d.entrypoint, d.name) for d in deployments} == _declared_deployments()
    assert {d.work_pool_name for d in deployments} == {POOL}
    # Every run starts in the project root, whatever directory the worker runs in.
    for d in deployments:
        assert d.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(prefect_server.project)}}
        ], d.name
    [schedule] = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", "UTC", True)
    assert demo.schedules == []


@pytest.mark.slow
def test_the_readme_pipeline_deployment_command_completes_on_the_worker(prefect_server, worker):
    """The README's ``prefect deployment run 'pipeline/demo' --watch ...``, verbatim: it exits 0 once the
    run completed (``--watch`` exits 1 for any other end), with every step a completed subflow run. Its
    ``kills`` SIGKILL a data shard's worker during the parity run: a completed ``recover-shard`` flow run
    hangs under that run's ``train`` flow run, and the run still ends bit-identical to the one without."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.objects import StateType

    from dlrmflow.datasets.meta import read_meta

    command = readme_command("prefect deployment run 'pipeline/demo'")
    [param] = [arg for arg in shell_words(command) if arg.startswith("config=")]
    config = json.loads(param.removeprefix("config="))
    work_dir = prefect_server.project / config["work_dir"]
    try:
        out = prefect_server.shell(command, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command} still watching after {RUN_TIMEOUT_S} s:\n{exc.stdout}\nworker log:\n"
                    f"{_tail(worker)}")
    found = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert found, out
    assert "Flow run finished successfully in 'Completed'" in out, out[-3000:]
    run = _wait_for_final_state(prefect_server.api_url, found.group(1), worker)
    assert run.state.type == StateType.COMPLETED, f"{run.state!r}\nworker log:\n{_tail(worker)}"
    assert run.parameters == {"config": config}

    with _api(prefect_server.api_url) as client:
        assert run.deployment_id == client.read_deployment_by_name("pipeline/demo").id
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
        names = {s.id: client.read_flow(s.flow_id).name for s in subflows}
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=list(names))))
    assert PIPELINE_SUBFLOWS <= set(names.values()), names
    assert all(s.state.type == StateType.COMPLETED for s in subflows), {names[s.id]: s.state for s in subflows}
    [profile_run] = [i for i, n in names.items() if n == "profile"]
    by_key = {a.key: a for a in artifacts if a.key}
    # Keys name the dataset by the work dir's name (runs/nightly-demo: skew-profile-nightly-demo).
    profile_key, coverage_key = (f"{what}-{work_dir.name}" for what in ("skew-profile", "skew-coverage"))
    assert by_key[profile_key].type == "table" and by_key[profile_key].flow_run_id == profile_run
    assert by_key[coverage_key].type == "markdown" and by_key[coverage_key].flow_run_id == profile_run
    # The run wrote where its parameters said, relative to the project root: the dataset and its skew report.
    assert read_meta(work_dir / "dataset").rows == config["rows"]
    assert (work_dir / "dataset" / "profile.json").is_file() and (work_dir / "dataset" / "coverage.png").is_file()
    summary = json.loads((work_dir / "runs" / "oracle" / "summary.json").read_text())
    assert summary["iterations"] == config["train_iterations"]

    # The kill: a real SIGKILL, noticed by the oracle trainer in its prefetch thread; the recovery is
    # recorded as a child of the training run, which is a child of this pipeline run.
    assert config["kills"], "the README's deployment example no longer kills a shard"

    def ancestors(client, flow_run) -> list[tuple[str, object]]:
        """(flow name, run id) of every flow run above ``flow_run``, nearest first, via parent task runs."""
        chain = []
        while flow_run.parent_task_run_id is not None:
            flow_run = client.read_flow_run(client.read_task_run(flow_run.parent_task_run_id).flow_run_id)
            chain.append((client.read_flow(flow_run.flow_id).name, flow_run.id))
        return chain

    with _api(prefect_server.api_url) as client:
        every = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["recover-shard"])))
        chains = {r.id: ancestors(client, r) for r in every}
    recoveries = [r for r in every if chains[r.id] and chains[r.id][-1] == ("pipeline", run.id)]
    assert recoveries, f"no recover-shard flow run under the pipeline run {run.id}: {chains}"
    assert all(chains[r.id][0][0] == "train" and len(chains[r.id]) == 2 for r in recoveries), chains
    assert all(r.state.type == StateType.COMPLETED for r in recoveries)
    parity_run = json.loads((work_dir / "runs" / "oracle-parity1" / "summary.json").read_text())
    assert parity_run["state_sha256"] == summary["state_sha256"]
    assert parity_run["parity"]["kills"] and parity_run["parity"]["verify"]["ok"] is True


DAILY_SECTION = "### `dlrmflow daily`"


@pytest.mark.slow
def test_the_readme_daily_deployment_runs_two_nights_on_the_worker(prefect_server, worker):
    """The README's daily example, verbatim: a day file, the ``daily/nightly`` deployment, the next day's file,
    the deployment again. Night 1 trains day 0 from scratch; night 2 keeps day 0's ids, scores day 0's model
    on day 1, then trains day 1 from it; each night publishes the day-by-day table and (night 2) the plot."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, TaskRunFilter, TaskRunFilterName

    from dlrmflow.tasks.reporting import run_dir_label

    commands = readme_deployment_block(DAILY_SECTION)
    assert [c.split()[:3] for c in commands] == [["dlrmflow", "generate", "--rows"],
                                                 ["prefect", "deployment", "run"]] * 2
    assert commands[1] == commands[3]  # the same deployment run, a night apart
    for command in commands:
        try:
            out = prefect_server.shell(command, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{command} still running after {RUN_TIMEOUT_S} s:\n{exc.stdout}\nworker log:\n"
                        f"{_tail(worker)}")
        if command.startswith("prefect deployment run"):
            assert "Flow run finished successfully in 'Completed'" in out, out[-3000:]
    [param] = [arg for arg in shell_words(commands[1]) if arg.startswith("config=")]
    state = prefect_server.project / json.loads(param.removeprefix("config="))["state_dir"]
    day0, day1 = json.loads((state / "history.json").read_text())["days"]
    assert (day0["day"], day1["day"]) == ("day_0", "day_1")
    # Night 1: day 0 from scratch. Night 2: day 1 kept day 0's ids and grew; its model continued day 0's
    # (oracle, parity verified), scored on day 1 before training on it.
    assert day0["next_day_auc"] is None and day0["new_ids"] == day0["embedding_rows"] > 0
    summary0, summary1 = (json.loads(Path(d["run_dir"], "summary.json").read_text()) for d in (day0, day1))
    assert summary0["init_from"] is None and summary1["init_from"]["run_dir"] == day0["run_dir"]
    assert summary1["mode"] == "oracle" and summary1["parity"]["verify"]["ok"] is True
    meta1 = json.loads(Path(day1["dataset"], "meta.json").read_text())
    assert meta1["vocabulary"]["parent"]["fingerprint"] == summary0["dataset_fingerprint"]
    assert day1["new_ids"] == sum(meta1["cardinalities"]) - day0["embedding_rows"] > 0
    assert 0 < day1["next_day_auc"] < 1 and day1["next_day_log_loss"] > 0 and day1["next_day_constant_log_loss"] > 0
    assert 0 < day1["new_id_lookup_share"] < 1 and (state / "next_day_auc.png").stat().st_size > 0
    label = run_dir_label(state)
    with _api(prefect_server.api_url) as client:
        table = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"daily-{label}"])))
        plot = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"daily-auc-{label}"])))
        tasks = {t.name: t for prefix in ("evaluate", "publish-daily-report")  # the pipeline's runs are here too
                 for t in client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=prefix)))
                 if t.name.startswith(prefix)}
    # The UI's task run pages reject a flow_run input: the evaluation's and the report's inputs are none.
    assert {name.rsplit("-", 1)[0] for name in tasks} == {"evaluate", "publish-daily-report"}, tasks
    assert all(i.input_type == "task_run" for t in tasks.values() for group in t.task_inputs.values()
               for i in group), {name: t.task_inputs for name, t in tasks.items()}
    assert len(table) == 2 and all(a.type == "markdown" for a in table)  # one version a night
    assert any("| day_1 |" in a.data for a in table) and len(plot) == 1


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_a_recovery_runner_called_from_a_bare_thread_starts_a_child_of_the_training_run():
    """The cause of the recover-shard nesting gap, in process and in seconds: the oracle trainer notices
    a loss in its prefetch worker, a plain thread whose context is empty. The runner made inside the
    task brings the task's context along; calling the bare runner from such a thread makes an orphan."""
    import threading

    from prefect import flow, get_client, task
    from prefect.context import FlowRunContext

    from dlrmflow.engine.coding.record import RecoveryRecord
    from dlrmflow.flows.recovery import recovery_runner, run_recovery_subflow

    def rebuild(progress=None):  # what rebuild_lost returns (a record of a rebuild that took 0.01 s), and the run
        record = RecoveryRecord(members=[0], detected_at=0.0, rebuilt_at=0.01, rows_rebuilt=8, chunks=1)
        return record.as_dict(k=2, start=0.0) | {"recovery_run": FlowRunContext.get().flow_run.id}

    @task
    def train_like(bound: bool):
        runner = recovery_runner() if bound else run_recovery_subflow
        results = []
        # Like engine/training/prefetch.py's worker: a thread that does not copy its creator's context.
        thread = threading.Thread(target=lambda: results.append(runner(rebuild, {"lost": ["data shard 0"],
                                                                                  "stripes": 8, "chunk": 8})))
        thread.start()
        thread.join()
        return results[0]["recovery_run"]

    @flow(name="train")
    def train_like_flow(bound: bool):
        return FlowRunContext.get().flow_run.id, train_like(bound)

    with get_client(sync_client=True) as client:
        for bound in (True, False):
            train_run, recovery_run = train_like_flow(bound)
            recovery = client.read_flow_run(recovery_run)
            assert client.read_flow(recovery.flow_id).name == "recover-shard"
            assert recovery.state.is_completed()
            if bound:
                assert recovery.parent_task_run_id is not None, "recover-shard run is not a subflow run"
                assert client.read_task_run(recovery.parent_task_run_id).flow_run_id == train_run
            else:  # Prefect finds no parent in the thread's context: a top-level run
                assert recovery.parent_task_run_id is None
