"""The dataset commands end to end: CLI -> Prefect flow -> Dask -> files, as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_helpers import run_json

from dlrmflow.cli import main
from dlrmflow.datasets.meta import read_meta

pytestmark = pytest.mark.usefixtures("prefect_harness")




def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "dlrmflow.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("generate", "preprocess", "profile", "demo"):
        assert command in out
        sub = subprocess.run([sys.executable, "-m", "dlrmflow.cli", command, "--help"], capture_output=True,
                             text=True, check=True).stdout
        assert "--json" in sub


def test_generate_preprocess_profile(tmp_path, capsys):
    raw = tmp_path / "day_0.tsv"
    gen = run_json(capsys, ["generate", "--rows", "5000", "--output", str(raw), "--scale", "0.001", "--seed", "3"])
    assert gen["rows"] == 5000 and raw.stat().st_size == gen["bytes"] and not gen["skipped"]
    again = run_json(capsys, ["generate", "--rows", "5000", "--output", str(raw), "--scale", "0.001", "--seed", "3"])
    assert again["skipped"] and again["bytes"] == gen["bytes"]
    prep = run_json(capsys, ["preprocess", str(raw), "--output", str(tmp_path / "ds")])
    assert prep["rows"] == 5000 and prep["rejected_rows"] == 0 and not prep["skipped"]
    assert read_meta(tmp_path / "ds").rows == 5000
    prof = run_json(capsys, ["profile", str(tmp_path / "ds")])
    assert prof["samples"] == 5000 and 0 < prof["top1pct_share"] <= 1
    assert (tmp_path / "ds" / "profile.json").is_file() and (tmp_path / "ds" / "coverage.png").is_file()
    # Human summaries.
    assert main(["preprocess", str(raw), "--output", str(tmp_path / "ds")]) == 0
    assert "is up to date (same inputs and parameters): skipped" in capsys.readouterr().out
    assert main(["profile", str(tmp_path / "ds")]) == 0
    assert "top 1% of rows" in capsys.readouterr().out


def test_profile_publishes_artifacts(tmp_path, capsys, data_dir):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    run_json(capsys, ["preprocess", str(data_dir / "criteo_kaggle_sample.csv"), "--format", "criteo-csv",
                   "--output", str(tmp_path / "ds")])
    run_json(capsys, ["profile", str(tmp_path / "ds")])
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["skew-profile-ds", "skew-coverage-ds"])))
    kinds = {a.key: a.type for a in found}
    assert kinds == {"skew-profile-ds": "table", "skew-coverage-ds": "markdown"}


@pytest.mark.parametrize("argv, message", [
    (["preprocess", "/nonexistent/day_0", "--output", "OUT"], "does not exist"),
    (["profile", "/nonexistent/ds"], "does not exist"),
    (["generate", "--rows", "0", "--output", "OUT"], "--rows must be >= 1"),
    (["generate", "--rows", "10", "--scale", "-1", "--output", "OUT"], "--scale must be > 0"),
])
def test_bad_input_is_one_clear_line_and_exit_2(argv, message, tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"dlrmflow {argv[0]}: error:") and message in err[-1]


def test_existing_dask_scheduler_is_used(tmp_path, capsys, monkeypatch, data_dir):
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            monkeypatch.setenv("DLRMFLOW_DASK_ADDRESS", cluster.scheduler_address)
            run_json(capsys, ["preprocess", str(data_dir / "avazu_sample.csv"), "--format", "avazu",
                           "--output", str(tmp_path / "ds")])
            # The work ran on that cluster: its scheduler knows our task prefixes.
            processed = client.run_on_scheduler(
                lambda dask_scheduler: sorted({str(k) for k in dask_scheduler.task_prefixes}))
    assert any("parse_piece" in p for p in processed) and any("write_part" in p for p in processed)
