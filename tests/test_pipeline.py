"""The pipeline flow end to end (what `make run` runs), its skipping, and parameter validation."""

from __future__ import annotations

import pytest
from cli_helpers import run_json

from dlrmflow.cli import main
from dlrmflow.engine.batch_stream import batches_ending_by
from dlrmflow.engine.serving import shaped_link
from dlrmflow.flows.pipeline import PipelineConfig
from dlrmflow.flows.pipeline_config import PipelineConfigError, training_batches

pytestmark = pytest.mark.usefixtures("prefect_harness")

# Whether this machine can build the emulated network link (root or CAP_NET_ADMIN, iproute2).
LINK_BUILDABLE = shaped_link.unavailable_reason() is None
SMALL = ["--rows", "30000", "--scale", "0.01", "--batch-size", "512", "--lookahead", "20",
         "--train-iterations", "6", "--parity", "0", "--link-rate", "0"]


@pytest.mark.slow
def test_pipeline_runs_every_step_then_skips_what_is_up_to_date(tmp_path, capsys, monkeypatch):
    argv = ["demo", "--work-dir", str(tmp_path / "demo"), *SMALL, "--link-rate", "20"]
    first = run_json(capsys, argv)
    assert first["preprocess"]["rows"] == 30000 and not first["generated"]["skipped"]
    assert first["profile"]["top1pct_share"] >= 0.9  # the generator's calibrated skew
    assert first["plan"]["batch_size"] == 512 and first["plan"]["lookahead"] == 20
    train = first["train"]
    assert train["remote"]["iterations"] == train["oracle"]["iterations"] == 6
    # The cached run is the reference run, bit for bit; the summary says so.
    assert train["oracle"]["state_sha256"] == train["remote"]["state_sha256"]
    summary = {row["what"]: row for row in first["summary"]}
    assert summary["final state, oracle vs remote"]["value"] == "bit-identical"
    assert {"mode", "median_iteration_ms", "stall_fraction"} <= set(train["oracle"])
    # remote and oracle again with their servers behind the default 20 Mbit/s emulated link: the same bits.
    link = "iteration time behind a 20 Mbit/s link, oracle vs remote (median)"
    if LINK_BUILDABLE:
        assert train["remote_link"]["state_sha256"] == train["oracle_link"]["state_sha256"] == \
            train["oracle"]["state_sha256"]
        assert summary[link]["value"].endswith(" ms") and summary[link]["ratio"].endswith(("faster", "slower"))
        assert summary["final state behind the link, vs unshaped"]["value"] == "bit-identical"
    else:
        assert summary[link]["value"] == "skipped" and summary[link]["ratio"]

    second = run_json(capsys, argv)
    assert second["generated"]["skipped"] and second["preprocess"]["skipped"]
    assert second["profile"]["skipped"] and second["plan"]["skipped"]
    assert all(run["skipped"] for run in second["train"].values())
    # A changed training parameter redoes training only. Where the link cannot be built (here: no `ip`
    # command), its row says why in one line, and the pipeline succeeds.
    monkeypatch.setattr(shaped_link, "IP_COMMAND", "dlrmflow-no-such-ip")
    third = run_json(capsys, [*argv, "--train-iterations", "5"])
    assert third["plan"]["skipped"] and not third["train"]["oracle"]["skipped"]
    assert third["train"]["oracle"]["iterations"] == 5
    assert "oracle_link" not in third["train"]
    assert {row["what"]: row for row in third["summary"]}[link] == {
        "what": link, "value": "skipped", "baseline": "",
        "ratio": "a shaped link needs the `dlrmflow-no-such-ip` command (iproute2), which is not on PATH"}


@pytest.mark.parametrize("argv, field", [
    (["--rows", "0"], "rows"),
    (["--scale", "0"], "scale"),
    (["--prefetch-distance", "300", "--lookahead", "200"], "prefetch_distance"),
    (["--parity", "5"], "parity"),
    (["--link-rate", "-1"], "link_rate"),
    (["--kill", "shard:0@3", "--parity", "0"], "kills need parity"),
    # The README's first deployment example: 100 iterations of 2048 rows, but 200,000 rows leave 87 batches.
    (["--rows", "200000", "--scale", "0.01"], "train_iterations: 100 batches of batch_size 2048 need 204,800 "
     "training rows, but rows 200,000 leave 180,000 after the 10% held out for evaluation (87 batches)"),
    (["--rows", "4", "--batch-size", "1", "--train-iterations", "1"], "rows: 4 rows are too few"),
    (["--kill", "shard:2@3"], "kills: shard:2@3: there is no shard 2 with shards 2"),
    (["--kill", "parity:0@100"], "kills: parity:0@100: iteration 100 is past the last one (99, with "
     "train_iterations 100)"),
])
def test_invalid_parameters_fail_before_any_work_naming_the_field(argv, field, tmp_path, capsys):
    assert main(["demo", "--work-dir", str(tmp_path / "w"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dlrmflow demo: error: invalid pipeline parameters") and field in err
    assert "--" not in err  # the config's fields, as a deployment's parameters name them, not the CLI's options
    assert not (tmp_path / "w").exists()


def test_training_batches_is_the_trainers_count_of_whole_batches_before_the_held_out_rows():
    for rows in [*range(6, 60), 199, 200, 201, 180_000, 200_000]:  # up to 5 rows none is held out: refused
        for batch_size in (1, 2, 3, 7, 512, 2048):
            held_out_start = rows - int(round(0.1 * rows))
            batches = -(-rows // batch_size)  # engine/training/job.py: every batch of the stream that ends in time
            fit = sum(1 for t in range(batches) if min((t + 1) * batch_size, rows) <= held_out_start)
            assert training_batches(rows, batch_size) == fit, (rows, batch_size)
    assert training_batches(200_000, 2048) == 87


def test_batches_ending_by_counts_the_streams_batches_that_end_in_time():
    for n_rows in range(0, 40):
        for batch_size in (1, 2, 3, 7, 16):
            for drop_last in (False, True):
                n_batches = n_rows // batch_size if drop_last else -(-n_rows // batch_size)
                for end in range(0, n_rows + 2):
                    fit = sum(1 for t in range(n_batches) if min((t + 1) * batch_size, n_rows) <= end)
                    assert batches_ending_by(n_rows, batch_size, end, drop_last=drop_last) == fit


@pytest.mark.slow
def test_raw_inputs_too_small_for_the_training_fail_after_preprocess_naming_the_fields(tmp_path, data_dir):
    """Their rows are known only once preprocessed: the pipeline stops then, before profile, plan, training.
    Slow (about 10 s): a LocalCluster and a real preprocess."""
    from dlrmflow.flows.pipeline import pipeline_flow

    config = PipelineConfig(work_dir=str(tmp_path / "w"), raw_inputs=[str(data_dir / "criteo_kaggle_sample.csv")],
                            format="criteo-csv", batch_size=64, train_iterations=3)
    with pytest.raises(PipelineConfigError) as failed:
        pipeline_flow(config)
    assert str(failed.value) == (
        "train_iterations: 3 batches of batch_size 64 need 192 training rows, but raw_inputs (200 rows once "
        "preprocessed) leave 180 after the 10% held out for evaluation (2 batches): lower train_iterations or "
        "batch_size, or give more rows")
    assert (tmp_path / "w" / "dataset" / "meta.json").is_file()
    assert not (tmp_path / "w" / "dataset" / "profile.json").exists() and not (tmp_path / "w" / "plan").exists()


def test_config_model_rejects_unknown_fields():
    with pytest.raises(ValueError, match="extra"):
        PipelineConfig(rowz=5)
