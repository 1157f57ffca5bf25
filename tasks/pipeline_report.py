"""The pipeline run's summary artifact: what the run measured, and where each step's own report is.

The summary is one markdown artifact (key ``pipeline-summary-<work dir>``): the measurements as a
table (the same formatter as every table artifact) and one row per step run (its name linked to the
run, its artifacts linked by key, one list item per step so that nothing is cut off at the page's
width), read back from the Prefect API: the pipeline's child flow runs
and theirs (a training run's recover-shard runs), and the artifacts with a key that each one made.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.sorting import FlowRunSort
from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from dlrmflow.tasks import task
from dlrmflow.tasks.reporting import publish_markdown


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A formatted table (see :func:`~dlrmflow.tasks.reporting.format_table`) as a markdown table."""
    if not rows:
        return ""
    headers = list(rows[0])

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(row.get(h, "")) for h in headers) + " |" for row in rows]
    return "\n".join(lines)


def step_runs(parent: UUID | str, depth: int = 2) -> list[dict[str, Any]]:
    """The flow runs started by ``parent`` (and by those, ``depth`` levels down), oldest first, each with
    its id, run name, flow name and the keys of the artifacts it published."""
    found: list[dict[str, Any]] = []
    with get_client(sync_client=True) as client:
        parents = [parent]
        for _ in range(depth):
            if not parents:
                break
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)),
                sort=FlowRunSort.START_TIME_ASC)
            flows = {r.flow_id: client.read_flow(r.flow_id).name for r in runs}
            artifacts = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[r.id for r in runs]))
            ) if runs else []
            for r in runs:
                keys = sorted({a.key for a in artifacts if a.key and a.flow_run_id == r.id})
                found.append({"id": r.id, "name": r.name, "flow": flows[r.flow_id], "keys": keys,
                              "start": r.start_time})
            parents = [r.id for r in runs]
    return sorted(found, key=lambda r: (r["start"] is None, r["start"] or 0))


def _ui(path: str) -> str:
    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}{path}" if base else path


def short_key(key: str, run_name: str) -> str:
    """``key`` without the part it shares with its run's name: a run's keys end in what names the run
    (``train-summary-oracle-k2-r1-demo-oracle-parity1-3f9a0c`` of run ``train-oracle-k2-r1-demo-...``
    -> ``train-summary``), which the step's line says already."""
    parts, name = key.split("-"), run_name.split("-")
    shared = 0
    while shared < min(len(parts) - 1, len(name) - 1) and parts[-1 - shared] == name[-1 - shared]:
        shared += 1
    return "-".join(parts[:len(parts) - shared]) if shared else key


def steps_markdown(steps: list[dict[str, Any]]) -> str:
    """One list item per step run: the step (flow), its run linked, and its artifacts linked by key under it,
    each named by the part of its key that its run's name does not say. A list, not a table: a table's
    row does not wrap in the Prefect UI, and a run's keys make a row wider than the page."""
    lines = []
    for step in steps:
        run = _ui(f"/runs/flow-run/{step['id']}")
        keys = ", ".join(f"[{short_key(k, step['name'])}]({_ui(f'/artifacts/key/{k}')})" for k in step["keys"])
        lines.append(f"- **{step['flow']}**: [{step['name']}]({run})" + (f" — {keys}" if keys else ""))
    return "\n".join(lines) or "no step ran"


@task(name="publish-pipeline-summary")
def publish_pipeline_summary_task(key: str, work_dir: str, table: list[dict[str, Any]]) -> str:
    """The pipeline's summary artifact (measurements and links to each step's run and artifacts); returns its key."""
    run_id = flow_run.get_id()
    steps = step_runs(run_id) if run_id else []
    markdown = (f"### dlrmflow pipeline in `{work_dir}`\n\n{markdown_table(table)}\n\n"
                f"### Steps and their reports\n\n{steps_markdown(steps)}\n")
    return publish_markdown(key, markdown, f"dlrmflow pipeline in {work_dir}: what the run measured, and each "
                            "step's run and artifacts")
