"""The daily loop's report: the day-by-day table (markdown) and the plot of next-day AUC over the days."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from dlrmflow.tasks.reporting import artifact_key, publish_markdown, publish_plot, run_dir_label

AUC_PLOT = "next_day_auc.png"


def _fixed(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def daily_table(days: list[dict[str, Any]]) -> str:
    """The history as a markdown table: one row per day, next-day metrics of the model trained up to the day
    before (none on the first day)."""
    lines = ["| day | rows | new ids | next-day AUC | next-day log loss | constant log loss | lookups of new ids "
             "| iterations | training s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in days:
        share = d.get("new_id_lookup_share")
        lines.append(f"| {d['day']} | {d['rows']:,} | {d['new_ids']:,} | {_fixed(d['next_day_auc'])} | "
                     f"{_fixed(d['next_day_log_loss'])} | {_fixed(d['next_day_constant_log_loss'])} | "
                     f"{'' if share is None else f'{100 * share:.2f}%'} | {d['iterations']:,} | "
                     f"{d['train_seconds']:.1f} |")
    return "\n".join(lines)


def plot_next_day_auc(days: list[dict[str, Any]], path: str | Path) -> Path:
    """Next-day AUC (top) and log loss against the constant prediction's (bottom) per day: the model trained
    through the day before, scored on the day."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [d for d in days if d["next_day_auc"] is not None]
    names = [d["day"] for d in scored]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(names, [d["next_day_auc"] for d in scored], "o-", color="tab:blue")
    top.set_ylabel("next-day AUC")
    top.set_title("The model trained through the day before, on each new day")
    bottom.plot(names, [d["next_day_log_loss"] for d in scored], "o-", color="tab:orange", label="model")
    bottom.plot(names, [d["next_day_constant_log_loss"] for d in scored], "s--", color="tab:gray",
                label="constant prediction")
    bottom.set_ylabel("next-day log loss")
    bottom.set_xlabel("day (scored before training on it)")
    bottom.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@task(name="publish-daily-report")
def publish_daily_report_task(days: list[dict[str, Any]], state_dir: str) -> dict[str, str]:
    """The day-by-day table and the next-day AUC plot as artifacts keyed by the state directory."""
    label = run_dir_label(state_dir)
    keys = {"table": publish_markdown(artifact_key("daily", label), "### Day by day\n\n" + daily_table(days),
                                      f"the daily loop in {state_dir}")}
    if any(d["next_day_auc"] is not None for d in days):
        png = plot_next_day_auc(days, Path(state_dir) / AUC_PLOT)
        keys["plot"] = publish_plot(artifact_key("daily-auc", label), png, "next-day AUC over the days")
    return keys
