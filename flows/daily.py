"""The daily loop (the ``daily/nightly`` deployment): each night, the day files not yet processed.

For each new day, in order: preprocess it with the previous day's dataset as its vocabulary (the same raw
value keeps its id; new values take the next ids), plan its lookahead cache, evaluate the latest model on
it before training on it (progressive validation: next-day AUC and log loss), then train the oracle with
parity from that model (``--init-from``). Then publish the day-by-day table and the plot of next-day AUC.

The state directory holds everything a later night needs::

    STATE/days/<day>/dataset, plan, run     one per day file (<day>: the file name without extensions)
    STATE/history.json                      one row per trained day, in order (written after each day)
    STATE/plots/next_day_auc-<night>.png    each night's plot (<night>: its start and days, as its run name)

A day counts as done once its row is in history.json; a night that stopped midway redoes that day (its
preprocess and plan are skipped when up to date). A night with nothing new says so and ends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from prefect import get_run_logger, tags

from dlrmflow.datasets.meta import read_meta
from dlrmflow.datasets.preprocess_config import PreprocessConfig
from dlrmflow.engine.planning.planner import PlanJobConfig
from dlrmflow.engine.serving.cluster import coded_cluster_workers
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.flows.daily_config import DailyConfig, DailyConfigError, day_name
from dlrmflow.flows.dataset import preprocess_flow
from dlrmflow.flows.export import export_flow
from dlrmflow.flows.plan import plan_flow
from dlrmflow.flows.prefect_internals import flow, untraced
from dlrmflow.flows.run_names import daily_run_name, daily_tags, night_label, night_start, tag_this_run
from dlrmflow.flows.train import train_flow
from dlrmflow.tasks.daily import publish_daily_report_task
from dlrmflow.tasks.evaluate import evaluate_task
from dlrmflow.tasks.reporting import reported_dask_scheduler, run_dir_label

HISTORY_FILE = "history.json"


def read_history(state_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(state_dir) / HISTORY_FILE
    if not path.is_file():
        return []
    try:
        return json.loads(path.read_text())["days"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DailyConfigError(f"state_dir: {path} is not a daily history ({exc})") from None


def write_history(state_dir: str | os.PathLike, days: list[dict[str, Any]]) -> None:
    path = Path(state_dir) / HISTORY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"days": days}, indent=2) + "\n")
    os.replace(tmp, path)


def new_days(config: DailyConfig, history: list[dict[str, Any]]) -> list[Path]:
    """The landing's day files not in ``history``, in order."""
    done = {row["day"] for row in history}
    return [p for p in config.day_files() if day_name(p) not in done]


def days_to_train(config: DailyConfig | dict[str, Any]) -> list[str]:
    """The names of the days a night would train now (:func:`new_days`): what its run name carries."""
    config = config if isinstance(config, DailyConfig) else DailyConfig(**config)
    return [day_name(p) for p in new_days(config, read_history(config.state_dir))]


def _train_config(config: DailyConfig, dataset: Path, plan: Path, run: Path, init_from: str | None) -> TrainConfig:
    return TrainConfig(dataset_dir=str(dataset), mode="oracle", output_dir=str(run), batch_size=config.batch_size,
                       plan_dir=str(plan), seed=config.seed, model=config.model, embedding_dim=config.embedding_dim,
                       num_shards=config.shards, parity=config.parity, lr=config.lr, eval_fraction=0.0,
                       init_from=init_from)


def run_day(config: DailyConfig, path: Path, previous: dict[str, Any] | None, address: str) -> dict[str, Any]:
    """One day on the Dask cluster at ``address``: preprocess, plan, evaluate the latest model on it, train
    from it, export the new model for TorchRec (``days/<day>/export``); its history row."""
    logger = get_run_logger()
    name = day_name(path)
    where = Path(config.state_dir).resolve() / "days" / name
    dataset, plan, run = where / "dataset", where / "plan", where / "run"
    logger.info("day %s (%s): preprocess%s", name, path, f" with {previous['day']}'s vocabulary" if previous else "")
    preprocess_flow(PreprocessConfig(inputs=[str(path)], output=str(dataset), format=config.format, seed=config.seed,
                                     min_frequency=config.min_frequency, max_rows_per_table=config.max_rows_per_table,
                                     vocabulary=previous["dataset"] if previous else None),
                    dask_address=address)
    meta = read_meta(dataset)
    plan_flow(PlanJobConfig(dataset_dir=str(dataset), output_dir=str(plan), batch_size=config.batch_size,
                            lookahead=config.lookahead, prefetch_distance=config.prefetch_distance),
              dask_address=address)
    evaluation = None
    if previous is not None:  # yesterday's model on today's data, before it trains on it; on the night's
        # cluster when the day is large enough to gain from it (scoring.scores_on_cluster's rows)
        from dlrmflow.engine.training.cluster_scoring import CLUSTER_MIN_ROWS

        score_on = "cluster" if meta.rows >= CLUSTER_MIN_ROWS else "process"
        evaluation = evaluate_task(*untraced(previous["run_dir"], str(dataset), config.batch_size, "cpu", address,
                                             score_on))
    summary = train_flow(_train_config(config, dataset, plan, run, previous["run_dir"] if previous else None),
                         address)
    exported = export_flow(str(run), str(where / "export"))  # the day's model, handed on (docs/export.md)
    total_ids = sum(meta.cardinalities)
    return {
        "day": name, "file": str(path), "dataset": str(dataset), "run_dir": str(run), "rows": meta.rows,
        "export_dir": exported["output"],
        "embedding_rows": total_ids, "new_ids": total_ids - (previous["embedding_rows"] if previous else 0),
        "next_day_auc": evaluation["auc"] if evaluation else None,
        "next_day_log_loss": evaluation["log_loss"] if evaluation else None,
        "next_day_constant_log_loss": evaluation["constant_log_loss"] if evaluation else None,
        "new_id_lookup_share": evaluation["new_id_lookup_share"] if evaluation else None,
        "iterations": summary["iterations"], "train_seconds": summary["train_seconds"],
        "final_train_loss": summary["final_train_loss_mean"], "state_sha256": summary["state_sha256"],
    }


@flow(name="daily", flow_run_name=daily_run_name)
def daily_flow(config: DailyConfig) -> dict[str, Any]:
    """Process every day file of ``config.landing`` not yet in ``config.state_dir`` (module docstring).

    The run is named for the state directory, the night and the days it trains
    (``daily-<state>-2026-11-29T0200Z-day_1-day_2``: :func:`~dlrmflow.flows.run_names.daily_name`), so no two
    nights share a name, and tagged ``night:<date>`` and ``day:<day>`` for each day it trains."""
    logger = get_run_logger()
    state = Path(config.state_dir)
    history = read_history(state)
    todo = new_days(config, history)
    names = [day_name(p) for p in todo]
    when = night_start()
    night = night_label(when, names)
    tag_this_run(daily_tags(config, when, names))
    if not todo:
        logger.info("nothing new in %s: %d day(s) processed, the latest %s", config.landing, len(history),
                    history[-1]["day"] if history else "none")
        return {"state_dir": str(state), "new_days": [], "days": history, "report": None, "night": night}
    logger.info("%d new day(s) in %s: %s", len(todo), config.landing, ", ".join(names))
    state.mkdir(parents=True, exist_ok=True)
    workers = coded_cluster_workers(config.shards, config.parity)  # one cluster for the night, as train's own
    with reported_dask_scheduler(config.dask_address, n_workers=workers) as address:
        for path in todo:
            with tags(f"day:{day_name(path)}", f"state:{run_dir_label(state)}"):  # the day's subflow runs
                row = run_day(config, path, history[-1] if history else None, address)
            history.append(row)
            write_history(state, history)
            logger.info("day %s: trained %s iterations in %.1f s%s (final train loss %.4f)", row["day"],
                        f"{row['iterations']:,}", row["train_seconds"],
                        f" from {history[-2]['day']}'s model" if len(history) > 1 else " from scratch",
                        row["final_train_loss"])
    report = publish_daily_report_task(*untraced(history, str(state), night))  # the rows hold subflows' results
    return {"state_dir": str(state), "new_days": names, "days": history, "report": report, "night": night}
