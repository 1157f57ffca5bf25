"""The daily loop's report: the day-by-day table (markdown) and the plot of next-day AUC over the days."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlrmflow.tasks import task
from dlrmflow.tasks.reporting import artifact_key, publish_markdown, publish_plot, run_dir_label

PLOTS_DIR = "plots"  # STATE/plots/next_day_auc-<night>.png: one file per night, so every version keeps its plot
NO_MODEL = "—"  # a next-day cell of the first day: no model was trained before it (the note under the table)


def _fixed(x: float | None, digits: int = 4) -> str:
    return NO_MODEL if x is None else f"{x:.{digits}f}"


def daily_table(days: list[dict[str, Any]]) -> str:
    """The history as a markdown table, one row per day, and the notes that say what its next-day columns are:
    the model trained through the day before (its own column names it), scored on the day before training on
    it; the first day has none."""
    lines = ["| day | rows | new ids | model scored | next-day AUC | next-day log loss | constant log loss "
             "| lookups of new ids | iterations | training s |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for n, d in enumerate(days):
        share = d.get("new_id_lookup_share")
        scored = f"{days[n - 1]['day']}'s model" if n else "none: the first day"
        lines.append(f"| {d['day']} | {d['rows']:,} | {d['new_ids']:,} | {scored} | {_fixed(d['next_day_auc'])} | "
                     f"{_fixed(d['next_day_log_loss'])} | {_fixed(d['next_day_constant_log_loss'])} | "
                     f"{NO_MODEL if share is None else f'{100 * share:.2f}%'} | {d['iterations']:,} | "
                     f"{d['train_seconds']:.1f} |")
    if days:
        first = days[0]["day"]
        example = f" {days[1]['day']}'s row is {first}'s model on {days[1]['day']}." if len(days) > 1 else ""
        lines += ["", f"Next-day columns: the model trained through the day before (*model scored*), scored on the "
                      f"day's rows before it trains on them (progressive validation).{example} {first} has no model "
                      f"before it: its next-day cells are {NO_MODEL}."]
    return "\n".join(lines)


def latest_model(days: list[dict[str, Any]]) -> str:
    """Where the latest day's model is, in markdown: its run directory, its export, and the command that scores
    tomorrow's file with it."""
    if not days:
        return ""
    last = days[-1]
    export = last.get("export_dir")
    return (f"**The model after {last['day']}**: run directory `{last['run_dir']}`"
            + (f", exported for TorchRec in `{export}`" if export else "")
            + f". Score tomorrow's file with it: `dlrmflow predict {last['run_dir']} TOMORROW_FILE --output OUT`.")


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


def plot_path(state_dir: str | Path, night: str) -> Path:
    """The night's plot file: ``STATE/plots/next_day_auc-<night>.png``."""
    return Path(state_dir) / PLOTS_DIR / f"next_day_auc-{night}.png"


@task(name="publish-daily-report")
def publish_daily_report_task(days: list[dict[str, Any]], state_dir: str, night: str) -> dict[str, str]:
    """The day-by-day table and the next-day AUC plot as artifacts keyed by the state directory; ``night``
    (:func:`~dlrmflow.flows.run_names.night_label`) names this night's version and its plot's own file."""
    label = run_dir_label(state_dir)
    trained = f"the daily loop in {state_dir}, night {night}"
    keys = {"table": publish_markdown(artifact_key("daily", label),
                                      f"### Day by day, after the night {night}\n\n{daily_table(days)}\n\n"
                                      f"{latest_model(days)}", trained)}
    if any(d["next_day_auc"] is not None for d in days):
        png = plot_path(state_dir, night)
        png.parent.mkdir(parents=True, exist_ok=True)
        plot_next_day_auc(days, png)
        keys["plot"] = publish_plot(artifact_key("daily-auc", label), png,
                                    f"next-day AUC over the days, night {night}")
    return keys
