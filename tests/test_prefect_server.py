"""The deployments of prefect.yaml on a real Prefect server, run by a process worker, as a user runs them.

The README's deployment block, run as written (tests/prefect_deployments.py: the server, the pool, ``prefect
deploy --all``, the worker): the ``prefect deployment run 'pipeline/demo'`` command must complete; the Prefect
API shows what a user sees in the UI. (The daily example's two nights: tests/test_daily_deployment.py.)
"""

from __future__ import annotations

import json
import re
import subprocess

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

