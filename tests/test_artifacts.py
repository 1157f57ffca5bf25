"""What a person reads in the Prefect UI: the table formatter, artifact keys, the cache-policy sweep
plot, the training plots and progress artifacts that move while the work runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dlrmflow.engine.planning.cache_policies import (
    POLICIES,
    PolicyResult,
    capacity_sweep,
    comparison_lines,
    plot_comparison,
)
from dlrmflow.tasks.recovery import recovery_table
from dlrmflow.tasks.reporting import Column, artifact_key, dataset_label, format_table, format_value, metric_table
from dlrmflow.tasks.train import summary_table

# ---- the formatter --------------------------------------------------------------------------------


def test_numbers_are_rounded_in_their_units_and_large_ones_have_thousands_separators():
    assert format_value(3.81110000944318e-05, "s") == 3.81e-05
    assert format_value(57.51234, "ms") == 57.5
    assert format_value(1234.5678, "ms") == 1235.0
    assert format_value(0.123456, "%") == 12.3
    assert format_value(4_787_404, "MB") == 4.79
    assert format_value(146072.0, "count") == "146,072" and format_value(999, "count") == 999
    assert format_value(0.7312345678, "") == 0.7312
    assert format_value(12, "") == 12 and format_value(1234, "") == 1234 and format_value(123456, "") == "123,456"


def test_a_duration_under_a_second_is_given_in_ms_or_us_in_a_metric_table():
    rows = {row["Metric"]: (row["Value"], row["Unit"]) for row in metric_table(
        [("tiny", 0.0000387, "s"), ("short", 0.0123456, "s"), ("long", 12.345, "s"), ("stall", 0.01, "ms"),
         ("zero", 0.0, "s")])}
    assert rows == {"tiny": (38.7, "µs"), "short": (12.3, "ms"), "long": (12.3, "s"), "stall": (10.0, "µs"),
                    "zero": (0.0, "s")}


def test_no_python_reprs():
    assert format_value(["data shard 0"]) == "data shard 0"
    assert format_value(["data shard 0", "parity shard 0"]) == "data shard 0, parity shard 0"
    assert format_value({"data shard 0": "tcp://a:1"}) == "data shard 0: tcp://a:1"
    assert format_value(None) == "" and format_value(True) == "yes"
    cells = [v for row in metric_table([("Lost", ["data shard 0"], ""), ("Bulk copy", 0.0123456, "s")])
             for v in row.values()]
    assert not any(isinstance(v, str) and (v.startswith(("[", "{", "(")) or "'" in v) for v in cells)


def test_headers_are_plain_english_with_units():
    rows = format_table([{"iteration_ms": 12.3456, "stall_fraction": 0.5, "rows_fetched": 10}],
                        [Column("Iteration time", "iteration_ms", "ms"), Column("Stalled", "stall_fraction", "%"),
                         Column("Rows fetched", "rows_fetched", "count")])
    assert rows == [{"Iteration time (ms)": 12.3, "Stalled (%)": 50.0, "Rows fetched": 10}]
    assert list(metric_table([("Fetched", 2e6, "MB")])[0]) == ["Metric", "Value", "Unit"]


def test_a_recovery_record_is_several_readable_rows():
    record = {"lost": ["data shard 0"], "detected_s": 1.2345678, "seconds": 0.0123456, "rows_rebuilt": 40_000,
              "chunks": 2, "stripes_generated": 3, "new_workers": {"data shard 0": "tcp://127.0.0.1:1"},
              "causes": ["members [0] lost: OSError(\"Unable to contact Actor's worker\")"], "restarts": 0}
    table = recovery_table(record)
    by_metric = {row["Metric"]: row for row in table}
    assert by_metric["Lost"]["Value"] == "data shard 0"
    assert by_metric["Rebuilt after detection"] == {"Metric": "Rebuilt after detection", "Value": 12.3, "Unit": "ms"}
    assert by_metric["Rows copied"]["Value"] == "40,000"
    # A record of an older run (no words for what noticed the loss): its failure, readable.
    assert by_metric["Noticed by"]["Value"] == \
        "a failed call (members [0] lost: OSError: Unable to contact Actor's worker)"
    assert by_metric["New worker of data shard 0"]["Value"] == "tcp://127.0.0.1:1"
    assert len(table) > 10 and all(list(row) == ["Metric", "Value", "Unit"] for row in table)
    json.dumps(table)  # what Prefect stores


def _kill_run_record() -> dict:
    """A rebuild's record as the engine writes it (the issue's kill run: 3,039 of 27,540 stripes copied)."""
    return {"lost": ["data shard 1"], "detected_s": 2.31, "rebuilt_s": 2.405, "seconds": 0.095,
            "stripes_total": 27_540, "stripes_copied": 3_039, "stripes_generated": 24_501, "stripes": 3_039,
            "rows_rebuilt": 2_382, "chunks": 1, "stripes_fixed_up": 0, "fix_ups": 1, "placement_seconds": 0.001,
            "copy_seconds": 0.08, "locked_seconds": 0.002, "copy_task_seconds": 0.05, "copy_read_wait_seconds": 0.01,
            "copy_install_seconds": 0.02, "restarts": 0, "new_workers": {"data shard 1": "tcp://127.0.0.1:9"},
            "causes": ["members [1] lost: OSError(\"Unable to contact Actor's worker\")"],
            "noticed_by": ["the trainer, writing back and fetching a batch's rows: its call to data shard 1 failed "
                           "(OSError: Unable to contact Actor's worker)"]}


def test_one_set_of_recovery_figures_feeds_the_table_the_summary_and_the_log_line():
    """Issue 46 item 5: the table's stripes are the log's (copied + generated = every stripe rebuilt), a fix-up
    pass is not a stripe, and "Noticed by" says in words what noticed the loss, not an exception's text."""
    from dlrmflow.engine.coding.record import rebuild_start_sentence, recovery_figures, recovery_sentence

    record = _kill_run_record()
    rows = {row["Metric"]: row["Value"] for row in recovery_table(record)}
    assert rows["Stripes rebuilt (copied + generated)"] == "27,540"
    assert rows["Stripes copied from the survivors (a row in them was trained)"] == "3,039"
    assert rows["Stripes generated from the seed (no row in them was trained)"] == "24,501"
    assert rows["Fix-up passes (training paused for each)"] == 1
    assert rows["Stripes written during the copy, re-read in the fix-ups"] == 0
    assert "Stripes" not in rows and "Fix-ups" not in rows and "Stripes fixed up" not in rows
    assert rows["Noticed by"].startswith("the trainer, writing back and fetching a batch's rows: its call to "
                                         "data shard 1 failed")
    # The log line and the CLI's: the same figures, the split spelled out.
    assert recovery_sentence(record) == (
        "rebuilt data shard 1: 0.095 s after detection, 27,540 stripes = 3,039 copied from the survivors "
        "(2,382 rows in 1 chunk) + 24,501 generated from the seed; 1 fix-up pass re-read 0 stripes written during "
        "the copy (training waited 0.002 s); 0 restarts")
    start = rebuild_start_sentence(["data shard 1"], 27_540, 8)
    assert start.startswith("rebuilding data shard 1: 27,540 stripes on replacement workers; those with a row the "
                            "trainer wrote are copied") and "those some live member touched" not in start
    # The train summary's rows are the brief form of the same figures.
    brief = {what: value for what, value, _ in recovery_figures(record, brief=True)}
    assert brief["Stripes rebuilt (copied + generated)"] == 27_540 and "Copy chunks" not in brief
    assert set(brief) <= {what for what, _, _ in recovery_figures(record)}
    # An older summary.json (no stripes_total): its copied stripes plus the generated ones.
    old = {k: v for k, v in record.items() if k not in ("stripes_total", "stripes_copied", "noticed_by")}
    assert {row["Metric"]: row["Value"] for row in recovery_table(old)}["Stripes rebuilt (copied + generated)"] \
        == "27,540"


def test_what_noticed_a_loss_is_said_in_words_naming_the_thread():
    import threading

    from dlrmflow.engine.coding.record import noticed_by
    from dlrmflow.engine.serving.shards import LostMembersError

    error = LostMembersError({1}, OSError("Unable to contact Actor's worker"))
    assert noticed_by("writing back and fetching a batch's rows", ["data shard 1"], error) == (
        "the trainer, writing back and fetching a batch's rows: its call to data shard 1 failed "
        "(OSError: Unable to contact Actor's worker)")
    said = []
    thread = threading.Thread(target=lambda: said.append(noticed_by("fetching a batch's rows", ["parity shard 0"],
                                                                    None)), name="dlrmflow-prefetch")
    thread.start()
    thread.join()
    assert said == ["the oracle's prefetch thread, fetching a batch's rows: its call to parity shard 0 failed "
                    "(no answer)"]


def test_the_train_summary_table_has_units_and_rounded_numbers():
    summary = {"mode": "oracle", "iterations": 100, "batch_size": 2048, "num_shards": 2, "capacity": 14607,
               "mean_iteration_ms": 57.512345, "median_iteration_ms": 55.0001, "stall_fraction": 0.001234,
               "bytes_fetched": 4_787_404, "bytes_written_back": 4_787_404, "final_train_loss_mean": 0.4712345,
               "eval_rows": 100, "eval_auc": 0.7123456, "eval_log_loss": 0.51234, "state_sha256": "ab" * 32,
               "parity": {"parity_shards": 1, "write_back_batches": 50, "parity_bytes_sent": 123_456_789,
                          "degraded_rows_read": 0, "verify": {"ok": True, "mismatched_stripes": []},
                          "kills": [{"kill": "shard:0@50", "at_s": 3.21987}],
                          "recoveries": [{"lost": ["data shard 0"], "seconds": 0.4567, "rows_rebuilt": 9}]}}
    rows = {row["Metric"]: (row["Value"], row["Unit"]) for row in summary_table(summary)}
    assert rows["Mean iteration time"] == (57.5, "ms")
    assert rows["Stalled (share of iteration time)"] == (0.1, "%")
    assert rows["Fetched"] == (4.79, "MB") and rows["Parity sent"] == (123.0, "MB")
    assert rows["Parity verified"] == ("OK", "")
    assert rows["Killed data shard 0 (iteration 50), after the shards started"] == (3.22, "s")
    assert rows["Recovery 1: Lost"] == ("data shard 0", "")
    assert rows["Eval AUC"] == (0.7123, "")


def test_a_train_summary_row_appears_only_with_a_value_or_says_why_it_has_none():
    """Issue 46 item 4: a day's training holds nothing out (no Eval AUC, log loss, best evaluation: one row
    says so); a remote kill run has no cache (its "Cache rows" says so); no row of the table is blank."""
    summary = {"mode": "remote", "iterations": 14, "batch_size": 16, "num_shards": 2, "capacity": None,
               "mean_iteration_ms": 5.0, "median_iteration_ms": 5.0, "stall_fraction": 0.1, "bytes_fetched": 10,
               "bytes_written_back": 10, "final_train_loss_mean": 0.5, "eval_rows": 0, "eval_auc": None,
               "eval_log_loss": None, "best_evaluation_iteration": None, "state_sha256": "ab" * 32,
               "parity": {"parity_shards": 1, "write_back_batches": 5, "parity_bytes_sent": 100,
                          "degraded_rows_read": 3, "verify": {"ok": True, "mismatched_stripes": []},
                          "kills": [{"kill": "shard:1@10", "at_s": 1.0}], "recoveries": [_kill_run_record()]}}
    table = summary_table(summary)
    rows = {row["Metric"]: row["Value"] for row in table}
    assert all(row["Value"] not in ("", None) for row in table), [r for r in table if r["Value"] in ("", None)]
    assert not {"Eval AUC", "Eval log loss", "Best evaluation (lowest log loss), after iterations"} & set(rows)
    assert rows["Held-out evaluation"] == "none: no rows held out (eval fraction 0)"
    assert rows["Cache rows"] == "none: remote mode has no cache"
    assert rows["Recovery 1: Stripes rebuilt (copied + generated)"] == "27,540"
    assert rows["Recovery 1: Noticed by"].startswith("the trainer, ")


def test_the_day_table_says_whose_model_each_next_day_cell_scores():
    """Issue 46 item 3: day_0's next-day cells are marked and explained; day_1's row names day_0's model."""
    from dlrmflow.tasks.daily import NO_MODEL, daily_table

    def day(name, auc):
        return {"day": name, "rows": 3000, "new_ids": 10, "next_day_auc": auc, "next_day_log_loss": auc,
                "next_day_constant_log_loss": auc, "new_id_lookup_share": auc and 0.01, "iterations": 6,
                "train_seconds": 1.0}

    table = daily_table([day("day_0", None), day("day_1", 0.6756), day("day_2", 0.7)])
    header, _, first, second, third, blank, note = table.splitlines()
    assert "| model scored | next-day AUC |" in header
    assert first.startswith("| day_0 | 3,000 | 10 | none: the first day | —") and first.count(NO_MODEL) == 4
    assert "| day_0's model | 0.6756 |" in second and "| day_1's model | 0.7000 |" in third
    assert blank == "" and "day_1's row is day_0's model on day_1" in note and "day_0 has no model before it" in note


def test_artifact_keys_are_valid_and_name_the_dataset():
    key = artifact_key("train-summary", "Criteo_Day0", "oracle", "parity1")
    assert key == "train-summary-criteo-day0-oracle-parity1"
    assert artifact_key("skew-profile", "") == "skew-profile"
    assert dataset_label("/x/runs/demo/dataset") == "demo"  # the pipeline's dataset: its work dir names it
    assert dataset_label("/data/criteo") == "criteo"
    assert dataset_label("raw/day_0.tsv") == "day_0"


# ---- plots ----------------------------------------------------------------------------------------


def _sweep_results(capacities: list[int]) -> list[PolicyResult]:
    uses, smallest_feasible = 10_000, capacities[2]
    results = [PolicyResult("none", None, uses, uses, uses)]
    for c in capacities:
        for n, policy in enumerate(POLICIES[1:]):
            feasible = c >= smallest_feasible or policy == "static"
            fetched = max(100, uses - c * (n + 1)) if feasible else None
            results.append(PolicyResult(policy, c, uses, fetched, fetched, "" if feasible else "too small"))
    return results


def test_the_capacity_sweep_has_six_or_more_capacities_around_the_fraction():
    sweep = capacity_sweep(0.1, 146_072)
    assert len(sweep) >= 6 and round(0.1 * 146_072) in sweep and sweep == sorted(sweep)
    assert all(b / a == pytest.approx(2, rel=0.01) for a, b in zip(sweep, sweep[1:], strict=False))
    assert max(capacity_sweep(1.0, 1000)) == 1000 and len(capacity_sweep(1.0, 1000)) >= 6


def test_the_cache_plot_draws_every_policy_as_a_line_over_the_sweep(tmp_path):
    capacities = capacity_sweep(0.1, 146_072)
    results = _sweep_results(capacities)
    lines = comparison_lines(results)
    assert set(lines) == {"no cache", "lru", "static", "oracle", "belady"}
    assert lines["no cache"][0] == [capacities[0], capacities[-1]]  # flat across the whole sweep
    assert lines["static"][0] == capacities
    assert lines["oracle"][0] == capacities[2:]  # infeasible points left out, the line goes on from there
    assert all(len(xs) >= 2 for xs, _ in lines.values())
    png = plot_comparison(results, tmp_path / "caches.png", title="test")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_training_plots_are_written(tmp_path):
    from dlrmflow.tasks import plots

    n = 40
    (tmp_path / "iterations.csv").write_text("iteration,loss,iteration_ms,stall_ms\n" + "".join(
        f"{t},{0.7 - 0.005 * t:.6f},{20 + (15 if t == 12 else 0):.3f},{(12 if t == 12 else 0.5):.3f}\n"
        for t in range(n)))
    columns = plots.read_iterations(tmp_path / "iterations.csv")
    assert columns["iteration"].tolist() == list(range(n))
    kills = [{"kill": "shard:0@12", "at_s": 1.0}]
    for plot, name in ((plots.plot_loss, "loss.png"), (plots.plot_iteration_time, "time.png")):
        assert plot(columns, tmp_path / name, title="t", kills=kills).read_bytes()[:4] == b"\x89PNG"
    evaluations = [{"iteration": t, "auc": 0.6, "logloss": 0.6 - 0.001 * t} for t in (10, 20, 30, 40)]
    held_out = plots.plot_loss(columns, tmp_path / "loss-eval.png", title="t", evaluations=evaluations)
    assert held_out.read_bytes()[:4] == b"\x89PNG"
    assert np.allclose(plots.moving_mean(np.array([1.0, 3.0, 5.0]), 2), [1.0, 2.0, 4.0])


# ---- progress artifacts ----------------------------------------------------------------------------


@pytest.mark.usefixtures("prefect_harness")
def test_a_progress_artifact_moves_while_the_work_runs_and_ends_at_100():
    from prefect import flow, get_client, task

    from dlrmflow.tasks.reporting import FlowProgress

    def read(artifact_id) -> float:
        with get_client(sync_client=True) as client:
            return _read_artifact(client, artifact_id)

    @task
    def work(steps: int) -> tuple[list[float], float, int]:
        progress = FlowProgress("test steps", min_interval_s=3600)  # only the step size lets updates through
        seen = []
        for done in range(1, steps + 1):
            progress(done, steps)
            seen.append(read(progress.artifact_id))
        return seen, read(progress.artifact_id), progress.updates

    @task
    def skipped() -> float:
        progress = FlowProgress("test skipped")
        progress.finish()  # up to date: the engine reported nothing
        return read(progress.artifact_id)

    @flow
    def progress_flow():
        return work(20), skipped()

    (seen, final, updates), skipped_final = progress_flow()
    assert final == 100.0 and skipped_final == 100.0
    assert 0 < seen[1] < 100  # read back from the API while the work runs
    assert sorted(seen) == seen and len(set(seen)) >= 5 and updates >= 5


def _read_artifact(client, artifact_id) -> float:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
    return artifact.data


# ---- the train report's iterations, the pipeline summary's steps ------------------------------------


def test_metrics_rows_count_iterations_from_0_like_the_plots_and_say_what_they_average():
    from dlrmflow.engine.training.summary import TrainSummary
    from dlrmflow.tasks.train import iterations_text, metrics_description, metrics_rows

    assert iterations_text({"iteration": 3}, 1) == "iteration 2"  # the third iteration: 0, 1, 2
    assert iterations_text({"iteration": 100}, 50) == "iterations 50–99"
    assert iterations_text({"iteration": 6}, 50) == "iterations 0–5"  # the last row: a shorter window
    assert iterations_text({"iteration": 1005}, 500) == "iterations 1,000–1,004"

    def run(iterations, every, metrics):
        return TrainSummary(mode="local", dataset="d", output_dir="/r", iterations=iterations, batch_size=8,
                            num_shards=0, capacity=None, mean_iteration_ms=1.0, median_iteration_ms=1.0,
                            stall_fraction=0.0, bytes_fetched=0, bytes_written_back=0, final_train_loss=0.5,
                            final_train_loss_mean=0.5, eval_auc=None, eval_log_loss=None, state_sha256="0",
                            metrics_every=every, metrics=metrics)

    short = run(6, 50, [{"iteration": 6, "loss": 0.5, "iteration_ms": 1.0, "stall_ms": 0.0}])
    assert [r["iterations"] for r in metrics_rows(short)] == ["0–5"]
    assert "50" not in metrics_description(short) and "6 iterations" in metrics_description(short)
    long = run(120, 50, [{"iteration": t, "loss": 0.5, "iteration_ms": 1.0, "stall_ms": 0.0} for t in (50, 100, 120)])
    assert [r["iterations"] for r in metrics_rows(long)] == ["0–49", "50–99", "100–119"]
    assert "each 50 iterations" in metrics_description(long)


def test_the_pipeline_summary_lists_each_step_with_short_links_that_wrap():
    from dlrmflow.tasks.pipeline_report import short_key, steps_markdown

    name = "train-oracle-k2-r1-demo-oracle-parity1-3f9a0c"
    assert short_key("train-summary-oracle-k2-r1-demo-oracle-parity1-3f9a0c", name) == "train-summary"
    assert short_key("skew-profile-demo", "profile-demo") == "skew-profile"
    assert short_key("other", name) == "other"
    markdown = steps_markdown([{"id": "1", "name": name, "flow": "train",
                                "keys": ["train-metrics-oracle-k2-r1-demo-oracle-parity1-3f9a0c"]}])
    assert "|" not in markdown and markdown.startswith("- **train**: [" + name + "](")
    assert "[train-metrics](" in markdown and "/artifacts/key/train-metrics-oracle-k2-r1-demo-oracle-parity1-3f9a0c)" \
        in markdown
