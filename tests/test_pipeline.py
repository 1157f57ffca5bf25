"""The pipeline flow end to end (what `make run` runs), its skipping, and parameter validation."""

from __future__ import annotations

import pytest
from cli_helpers import run_json

from dlrmflow.cli import main
from dlrmflow.flows.pipeline import PipelineConfig

pytestmark = pytest.mark.usefixtures("prefect_harness")

SMALL = ["--rows", "30000", "--scale", "0.01", "--batch-size", "512", "--lookahead", "20",
         "--train-iterations", "6", "--parity", "0"]


@pytest.mark.slow
def test_pipeline_runs_every_step_then_skips_what_is_up_to_date(tmp_path, capsys):
    argv = ["demo", "--work-dir", str(tmp_path / "demo"), *SMALL]
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

    second = run_json(capsys, argv)
    assert second["generated"]["skipped"] and second["preprocess"]["skipped"]
    assert second["profile"]["skipped"] and second["plan"]["skipped"]
    assert all(run["skipped"] for run in second["train"].values())
    # A changed training parameter redoes training only.
    third = run_json(capsys, [*argv, "--train-iterations", "5"])
    assert third["plan"]["skipped"] and not third["train"]["oracle"]["skipped"]
    assert third["train"]["oracle"]["iterations"] == 5


@pytest.mark.parametrize("argv, field", [
    (["--rows", "0"], "rows"),
    (["--scale", "0"], "scale"),
    (["--prefetch-distance", "300", "--lookahead", "200"], "prefetch_distance"),
    (["--parity", "5"], "parity"),
    (["--kill", "shard:0@3", "--parity", "0"], "kills need parity"),
])
def test_invalid_parameters_fail_before_any_work_naming_the_field(argv, field, tmp_path, capsys):
    assert main(["demo", "--work-dir", str(tmp_path / "w"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dlrmflow demo: error: invalid pipeline parameters") and field in err
    assert not (tmp_path / "w").exists()


def test_config_model_rejects_unknown_fields():
    with pytest.raises(ValueError, match="extra"):
        PipelineConfig(rowz=5)
