"""Flow run names and tags that say what a run does, so runs can be told apart in the Prefect UI.

Each ``*_run_name`` is a flow's ``flow_run_name`` callable: Prefect calls it with no arguments when
the run starts, inside the run's context, so it reads the run's parameters there
(:func:`prefect.runtime.flow_run.get_parameters`; models when called in process, dicts when they
come from a deployment: :func:`_field` reads both). Tags go on the run with :func:`tag_this_run`
(the train flow: mode, dataset, parity) or on every run started within ``prefect.tags(...)``
(the pipeline's steps: the work dir's dataset).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import get_client
from prefect.runtime import flow_run

from dlrmflow.engine.planning.planner import PlanConfig
from dlrmflow.tasks.reporting import artifact_key, dataset_label, run_dir_label, train_run_label


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _params() -> dict[str, Any]:
    return flow_run.get_parameters() or {}


def train_name(config: Any) -> str:
    """``train-<mode>`` for a local run, else ``train-<mode>-k<shards>-r<parity>``; then the run directory's
    label (:func:`~dlrmflow.tasks.reporting.run_dir_label`: ``demo-oracle-parity1-3f9a0c``, so two runs in two
    directories never share a name); then ``-w<W>`` with W > 1 trainers, the model unless it is DLRM
    (``-deepfm``) and ``-resume`` when resuming."""
    mode = _field(config, "mode", "local")
    name = "train-" + train_run_label(mode, _field(config, "num_shards", 0), _field(config, "parity", 0),
                                      _field(config, "output_dir", "") or ".")
    model = _field(config, "model", "dlrm")
    trainers = _field(config, "trainers", 1)
    return artifact_key(name, f"w{trainers}" if trainers > 1 else "", "" if model == "dlrm" else model,
                        "resume" if _field(config, "resume") else "")


def train_tags(config: Any) -> list[str]:
    """``mode:<mode>``, ``model:<model>``, ``dataset:<dataset>`` and, with parity shards, ``parity`` (and
    ``kills`` with kills); ``trainers:<W>`` with W > 1 trainers."""
    tags = [f"mode:{_field(config, 'mode', 'local')}", f"model:{_field(config, 'model', 'dlrm')}",
            f"dataset:{dataset_label(_field(config, 'dataset_dir', ''))}"]
    if _field(config, "parity", 0):
        tags.append("parity")
    if _field(config, "trainers", 1) > 1:
        tags.append(f"trainers:{_field(config, 'trainers')}")
    if _field(config, "kills"):
        tags.append("kills")
    return tags


def train_run_name() -> str:
    return train_name(_params().get("config"))


def recover_run_name() -> str:
    """``recover-data-shard-0-<training run>`` (every lost member, in order; then the training run's label,
    its ``run`` parameter)."""
    params = _params()
    return artifact_key("recover", *params.get("lost", []), params.get("run", ""))


def recover_tags(lost: list[str]) -> list[str]:
    """``recovery`` and ``lost:<member>`` for each member lost (``lost:data-shard-0``)."""
    return ["recovery", *(f"lost:{artifact_key(member)}" for member in lost)]


def verify_run_name() -> str:
    return artifact_key("verify", Path(str(_params().get("run_dir", ""))).name)


def export_run_name() -> str:
    """``export-<run dir label>-to-<target>``."""
    params = _params()
    return artifact_key("export", run_dir_label(params.get("run_dir", "")), "to", params.get("to", "torchrec"))


def generate_run_name() -> str:
    params = _params()
    return artifact_key("generate", dataset_label(params.get("output", "")), f"{params.get('rows', 0)}rows")


def preprocess_run_name() -> str:
    return artifact_key("preprocess", dataset_label(_field(_params().get("config"), "output", "")))


def profile_run_name() -> str:
    return artifact_key("profile", dataset_label(_field(_params().get("config"), "dataset_dir", "")))


def plan_run_name() -> str:
    """``plan-<dataset>-b<B>-l<L>``."""
    config = _params().get("config")
    return artifact_key("plan", dataset_label(_field(config, "dataset_dir", "")), f"b{_field(config, 'batch_size')}",
                        f"l{_field(config, 'lookahead', PlanConfig.default('lookahead'))}")


def compare_caches_run_name() -> str:
    params = _params()
    return artifact_key("compare-caches", dataset_label(params.get("dataset_dir", "")),
                        f"b{params.get('batch_size')}")


def pipeline_run_name() -> str:
    """``pipeline-<work dir label>`` (:func:`~dlrmflow.tasks.reporting.run_dir_label`)."""
    config = _params().get("config")
    return artifact_key("pipeline", run_dir_label(str(_field(config, "work_dir", "runs/demo"))))


def pipeline_tags(config: Any) -> list[str]:
    """``pipeline``, ``dataset:<work dir name>`` and what the run does: ``parity`` (``kills`` with kills),
    ``link:<rate>mbit`` with an emulated link, ``model:<model>``, ``trainers:<W>`` with W > 1."""
    tags = ["pipeline", f"dataset:{artifact_key(Path(str(_field(config, 'work_dir', 'runs/demo'))).resolve().name)}",
            f"model:{_field(config, 'model', 'dlrm')}"]
    if _field(config, "parity", 0):
        tags.append("parity")
        if _field(config, "kills"):
            tags.append("kills")
    if _field(config, "link_rate", 0):
        tags.append(f"link:{_field(config, 'link_rate')}mbit")
    if (_field(config, "trainers", 1) or 1) > 1:
        tags.append(f"trainers:{_field(config, 'trainers')}")
    return tags


def tag_this_run(tags: list[str]) -> None:
    """Add ``tags`` to the current flow run (its own tags kept): a flow's tags that depend on its parameters."""
    run_id = flow_run.get_id()
    if run_id is None:
        return
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(run_id).tags or []
        client.update_flow_run(run_id, tags=sorted({*current, *tags}))


def evaluate_run_name() -> str:
    """``evaluate-<run dir label>-on-<dataset>``."""
    params = _params()
    return artifact_key("evaluate", run_dir_label(params.get("run_dir", "")), "on",
                        dataset_label(params.get("dataset_dir", "")))


def night_label(when: datetime, days: list[str] | None) -> str:
    """What tells one night of the daily loop from another: the night's start, UTC, to the minute, and the days
    it trains (``2026-11-29T0200Z-day_1-day_2``; more than three: ``day_0-to-day_23``; none: ``nothing-new``).
    Also the stem of the night's plot file, so its characters are safe in a file name."""
    stamp = when.astimezone(UTC).strftime("%Y-%m-%dT%H%MZ")
    if days is None:  # not known (the landing cannot be read: the run fails and says why)
        return stamp
    if not days:
        trained = "nothing-new"
    elif len(days) <= 3:
        trained = "-".join(days)
    else:
        trained = f"{days[0]}-to-{days[-1]}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{stamp}-{trained}")


def night_start() -> datetime:
    """When this flow run was due to start (a deployment's schedule: 02:00 UTC; a run started by hand: then),
    in UTC; now outside a run."""
    when = flow_run.scheduled_start_time if flow_run.get_id() else None
    return datetime.now(UTC) if when is None else datetime.fromtimestamp(when.timestamp(), UTC)


def daily_name(config: Any, when: datetime, days: list[str] | None) -> str:
    """``daily-<state dir label>-<night>``: ``daily-ui-state-75b85f-2026-11-29T0200Z-day_1-day_2``."""
    return f"daily-{run_dir_label(_field(config, 'state_dir', ''))}-{night_label(when, days)}"


def daily_tags(config: Any, when: datetime, days: list[str]) -> list[str]:
    """``daily``, ``state:<label>``, ``model:<model>``, ``night:<date>`` and ``day:<day>`` for each day trained."""
    return ["daily", f"state:{run_dir_label(_field(config, 'state_dir', ''))}", f"model:{_field(config, 'model')}",
            f"night:{when.astimezone(UTC):%Y-%m-%d}", *(f"day:{day}" for day in days)]


def daily_run_name() -> str:
    """:func:`daily_name` of this run: its config, its start, the landing's days not yet in the history."""
    from dlrmflow.flows.daily import days_to_train

    config = _params().get("config")
    try:
        days = days_to_train(config)
    except Exception:  # a bad landing or history: the run itself fails and says why; its name names no day
        days = None
    return daily_name(config, night_start(), days)
