"""The deployments of prefect.yaml on a real Prefect server, run by a process worker, as a user runs them.

The README's deployment block, run as written (tests/prefect_deployments.py: the server, the pool, ``prefect
deploy --all``, the worker): the ``prefect deployment run 'pipeline/demo'`` command must complete; the Prefect
API shows what a user sees in the UI; the README's daily example, two nights of the ``daily/nightly``
deployment, runs on the same server and worker (one server and one worker for the module: starting them and
``prefect deploy --all`` cost about 40 CPU seconds).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prefect_deployments import (
    POOL,
    REPO,
    RUN_TIMEOUT_S,
    api,
    readme_command,
    readme_deployment_block,
    readme_server_command,
    shell_words,
    tail,
    ui_api_url,
    wait_for_final_state,
)

PIPELINE_SUBFLOWS = {"generate", "preprocess", "profile", "plan", "compare-caches", "train"}


def _declared_deployments() -> set[tuple[str, str]]:
    """(entrypoint, name) of every deployment prefect.yaml declares."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return {(d["entrypoint"], d["name"]) for d in spec["deployments"]}



def test_the_readme_block_is_the_server_the_profile_setting_and_what_the_test_runs():
    """What the test replaces (``prefect config set``, then the server on port 4200) and what it runs verbatim.
    The setting comes first and names the server's port: ``prefect server start --port 4300`` without it gave a
    UI that asked port 4200's API and showed "No flow runs" (issue 46 item 8)."""
    commands = [c.split()[:3] for c in readme_deployment_block()]
    assert commands == [["prefect", "config", "set"], ["prefect", "server", "start"],
                        ["prefect", "work-pool", "create"], ["prefect", "deploy", "--all"],
                        ["prefect", "worker", "start"], ["prefect", "deployment", "run"]]
    assert readme_command("prefect config set") == "prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api"
    assert readme_command("prefect server start") == "prefect server start --port 4200"
    assert readme_server_command(4300) == ["prefect", "server", "start", "--port", "4300"]
    assert readme_command("prefect work-pool create") == f"prefect work-pool create {POOL} --type process"
    assert readme_command("prefect worker start") == f"prefect worker start --pool {POOL}"


def test_the_prefect_yaml_header_gives_the_readme_deployment_command():
    header = [line.removeprefix("#").strip() for line in (REPO / "prefect.yaml").read_text().splitlines()
              if line.startswith("#   prefect deployment run")]
    assert [shell_words(line) for line in header] == [shell_words(readme_command("prefect deployment run"))]


@pytest.mark.slow
def test_every_deployment_is_created_from_prefect_yaml(prefect_server, prefect_worker):
    # The README's server (on another port than 4200, with the setting it gives first): its UI asks its own API.
    assert ui_api_url(prefect_server.api_url.removesuffix("/api")) == prefect_server.api_url
    with api(prefect_server.api_url) as client:
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
def test_the_readme_pipeline_deployment_command_completes_on_the_worker(prefect_server, prefect_worker):
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
                    f"{tail(prefect_worker)}")
    found = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert found, out
    assert "Flow run finished successfully in 'Completed'" in out, out[-3000:]
    run = wait_for_final_state(prefect_server.api_url, found.group(1), prefect_worker)
    assert run.state.type == StateType.COMPLETED, f"{run.state!r}\nworker log:\n{tail(prefect_worker)}"
    assert run.parameters == {"config": config}

    with api(prefect_server.api_url) as client:
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

    with api(prefect_server.api_url) as client:
        every = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["recover-shard"])))
        chains = {r.id: ancestors(client, r) for r in every}
    recoveries = [r for r in every if chains[r.id] and chains[r.id][-1] == ("pipeline", run.id)]
    assert recoveries, f"no recover-shard flow run under the pipeline run {run.id}: {chains}"
    assert all(chains[r.id][0][0] == "train" and len(chains[r.id]) == 2 for r in recoveries), chains
    assert all(r.state.type == StateType.COMPLETED for r in recoveries)
    parity_run = json.loads((work_dir / "runs" / "oracle-parity1" / "summary.json").read_text())
    assert parity_run["state_sha256"] == summary["state_sha256"]
    assert parity_run["parity"]["kills"] and parity_run["parity"]["verify"]["ok"] is True


# ---- the README's daily example: two nights ------------------------------------------------------------

DAILY_SECTION = "### `dlrmflow daily`"


@pytest.mark.slow
def test_the_readme_daily_deployment_runs_two_nights_on_the_worker(prefect_server, prefect_worker):
    """The README's daily example, verbatim: a day file, the ``daily/nightly`` deployment, the next day's file,
    the deployment again. Night 1 trains day 0 from scratch; night 2 keeps day 0's ids, scores day 0's model
    on day 1, then trains day 1 from it; each night publishes the day-by-day table and (night 2) the plot."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, TaskRunFilter, TaskRunFilterName

    from dlrmflow.tasks.reporting import run_dir_label

    commands = readme_deployment_block(DAILY_SECTION)
    assert [c.split()[:3] for c in commands] == [["dlrmflow", "generate", "--rows"],
                                                 ["prefect", "deployment", "run"]] * 2 + [
        ["dlrmflow", "generate", "--rows"], ["dlrmflow", "predict", "runs/daily/days/day_1/run"]]
    assert commands[1] == commands[3]  # the same deployment run, a night apart
    for command in commands:
        try:
            out = prefect_server.shell(command, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{command} still running after {RUN_TIMEOUT_S} s:\n{exc.stdout}\nworker log:\n"
                        f"{tail(prefect_worker)}")
        if command.startswith("prefect deployment run"):
            assert "Flow run finished successfully in 'Completed'" in out, out[-3000:]
    [param] = [arg for arg in shell_words(commands[1]) if arg.startswith("config=")]
    state = prefect_server.project / json.loads(param.removeprefix("config="))["state_dir"]
    day0, day1 = json.loads((state / "history.json").read_text())["days"]
    # Each night handed its model on: the export of its run; the README's predict scored tomorrow's file with it.
    for day in (day0, day1):
        export = json.loads(Path(day["export_dir"], "export.json").read_text())
        assert export["state_sha256"] == day["state_sha256"] and export["file"] == "model.pt", export
    predicted = prefect_server.project / "runs" / "predictions" / "day_2"
    assert json.loads((predicted / "_predict.json").read_text())["rows"] == 10000
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
    assert 0 < day1["new_id_lookup_share"] < 1
    label = run_dir_label(state)
    with api(prefect_server.api_url) as client:
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
    latest = max(table, key=lambda a: a.created).data
    assert f"`{day1['run_dir']}`" in latest and f"`{day1['export_dir']}`" in latest, latest
    what_the_ui_shows_of_two_nights(prefect_server.api_url, state, day0, day1)


def _messages(client, flow_run_id) -> list[str]:
    """A flow run's log (its tasks' lines included, not its subflows'), as the UI's Logs tab shows it."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    entries = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [e.message for e in entries]


def what_the_ui_shows_of_two_nights(api_url: str, state: Path, day0: dict, day1: dict) -> None:
    """Issue 46, read back from the server the README's two nights ran on: each night's run has a name and tags
    of its own and its artifact versions name it (item 1); a phase line of a day's training is in that day's
    train run only, once, and no training without held-out rows logs a final evaluation; the evaluation names
    the model it scored (item 2); the day table explains its next-day columns (item 3); a day's train summary has
    no blank row (item 4); plan progress counts what its phase announced (item 6); the plot of each version is a
    file of its own (item 7)."""
    import re
    import time

    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    from dlrmflow.flows.run_names import train_name
    from dlrmflow.tasks.reporting import run_dir_label, train_run_label

    label = run_dir_label(state)
    with api(api_url) as client:
        nights = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["daily"])),
                                       sort=FlowRunSort.START_TIME_ASC)
        trains = {d["day"]: client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[
            train_name({"mode": "oracle", "num_shards": 2, "parity": 1, "output_dir": d["run_dir"]})])))
            for d in (day0, day1)}
        plans = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
            any_=[f"plan-{d}-b512-l20" for d in ("day-0", "day-1")])))
        deadline = time.monotonic() + 30  # a worker's flow run sends its last lines as it exits
        while True:
            logs = {run.id: _messages(client, run.id) for run in [*nights, *sum(trains.values(), []), *plans]}
            if all(any("Finished in state" in m for m in lines) for lines in logs.values()) or \
                    time.monotonic() > deadline:
                break
            time.sleep(1)
        artifacts = {key: client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
                     for key in (f"daily-{label}", f"daily-auc-{label}",
                                 f"train-summary-{train_run_label('oracle', 2, 1, day1['run_dir'])}")}
    # Item 1: two nights, two names: the state, the night's start (UTC) and the day it trained; tags to match.
    assert len(nights) == 2, [n.name for n in nights]
    for night, day in zip(nights, ("day_0", "day_1"), strict=True):
        assert re.fullmatch(rf"daily-{label}-\d{{4}}-\d\d-\d\dT\d{{4}}Z-{day}", night.name), night.name
        assert {"daily", f"state:{label}", f"day:{day}"} <= set(night.tags) and any(
            t.startswith("night:") for t in night.tags), night.tags
    assert nights[0].name != nights[1].name and set(nights[0].tags) != set(nights[1].tags)
    stems = [n.name.removeprefix(f"daily-{label}-") for n in nights]
    table, plot = artifacts[f"daily-{label}"], artifacts[f"daily-auc-{label}"]
    assert sorted(a.description.rsplit(", night ", 1)[1] for a in table) == sorted(stems), [a.description
                                                                                         for a in table]
    # Item 7: the plot's version points at its own file, named by its night, which stays.
    [png] = re.findall(r"File: `([^`]+)`", plot[0].data)
    assert png == str((state / "plots" / f"next_day_auc-{stems[1]}.png").resolve()) and Path(png).stat().st_size > 0
    assert plot[0].description.endswith(f"night {stems[1]}")
    # Item 3: whose model each next-day cell scored, and why day_0's are empty.
    [latest] = [a for a in table if "| day_1 |" in a.data]
    assert "| model scored |" in latest.data and "| day_1 | " in latest.data and "| day_0's model | " in latest.data
    assert "day_1's row is day_0's model on day_1" in latest.data and "day_0 has no model before it" in latest.data
    # Item 2: the nightly runs' logs hold no line of a day's training; each day's train run has each once.
    phases = ("embedding servers: initialising", "parity verify", "final state: the servers write their rows")
    for night in nights:
        assert not [m for m in logs[night.id] if m.startswith(phases)], logs[night.id]
    assert any(m.startswith("day_0's model on day_1: AUC ") for m in logs[nights[1].id]), logs[nights[1].id]
    assert any(m.startswith("day day_1: trained ") and "from day_0's model" in m for m in logs[nights[1].id])
    for day, runs in trains.items():
        [run] = runs
        for phase in phases:
            assert len([m for m in logs[run.id] if m.startswith(phase) and m.endswith(" ...")]) == 1, (day, phase)
        # eval_fraction 0: nothing held out, nothing evaluated, no "final evaluation" line
        assert not [m for m in logs[run.id] if "final evaluation" in m], logs[run.id]
    # Item 4: the day's train summary has no blank row; the evaluation's rows say why there is none.
    [summary] = artifacts[f"train-summary-{train_run_label('oracle', 2, 1, day1['run_dir'])}"]
    rows = {row["Metric"]: row["Value"] for row in (json.loads(summary.data) if isinstance(summary.data, str)
                                                      else summary.data)}
    assert all(v not in ("", None) for v in rows.values()), rows
    assert rows["Held-out evaluation"] == "none: no rows held out (eval fraction 0)" and "Eval AUC" not in rows
    # Item 6: the plan's progress counts tasks, then chunks, as its phase announced them.
    for plan in plans:
        [announced] = [m for m in logs[plan.id] if m.startswith("plan: deciding ") and m.endswith(" ...")]
        tasks, chunks = map(int, re.search(r" in (\d+) tasks \((\d+) chunks x ", announced).groups())
        assert f"plan tasks decided: {tasks}/{tasks} (100%)" in logs[plan.id], logs[plan.id]
        assert f"plan chunks assembled: {chunks}/{chunks} (100%)" in logs[plan.id], logs[plan.id]
        assert not [m for m in logs[plan.id] if "chunks done" in m], logs[plan.id]

