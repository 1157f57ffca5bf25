"""The README's daily example on a real Prefect server: two nights of the ``daily/nightly`` deployment, run by
a process worker (tests/prefect_deployments.py), checked through the Prefect API."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from prefect_deployments import RUN_TIMEOUT_S, api, readme_deployment_block, shell_words, tail

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
                                                 ["prefect", "deployment", "run"]] * 2
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

