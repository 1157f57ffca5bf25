"""Fast start: a bad option is refused before Prefect, torch, Dask or pandas load; progress reaches stderr
with --json (the temporary Prefect API's early start: tests/test_prefect_startup.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlrmflow.datasets.synthetic import generate_rows

HEAVY = ("torch", "dask", "distributed", "prefect", "pandas")

# In a fresh interpreter: main() on ARGV, then what it returned and which heavy packages were imported.
PROBE = """
import json, sys
from dlrmflow import cli
status = cli.main(json.loads(sys.argv[1]))
print(json.dumps([status, sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[2])))]))
"""


@pytest.mark.parametrize(("argv", "error"), [
    (["train", "DATA", "--output", "X", "--mode", "remote", "--trainers", "0"],
     "dlrmflow train: error: trainers: --trainers must be >= 1, got 0"),
    (["train", "DATA", "--output", "X", "--mode", "remote", "--batch-size", "0", "--json"],
     "dlrmflow train: error: batch_size: --batch-size must be >= 1, got 0"),
    (["generate", "--rows", "0", "--output", "X"], "dlrmflow generate: error: --rows must be >= 1, got 0"),
    (["plan", "DATA", "--batch-size", "0", "--output", "X"], "dlrmflow plan: error: "),
    (["demo", "--rows", "0"], "dlrmflow demo: error: "),
    (["resume", "X"], "dlrmflow resume: error: X does not exist"),
    (["train", "DATA", "--output", "X", "--mode", "local", "--init-from", "Y"],
     "dlrmflow train: error: --init-from Y: no such run"),
    (["train", "DATA", "--output", "X", "--mode", "local", "--init-from", "."],
     "dlrmflow train: error: --init-from . holds no finished run"),
    (["resume", "."], "dlrmflow resume: error: . has no run_config.json: nothing to resume"),
])
def test_a_bad_option_is_refused_before_any_heavy_import(tmp_path, argv, error):
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    status, heavy = json.loads(done.stdout)
    assert status == 2
    assert done.stderr.startswith(error) and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert heavy == [], f"imported before the options were checked: {heavy}"


def test_the_console_script_ends_with_the_command_s_status_after_its_atexit_hooks_and_output(tmp_path):
    """run_command (the ``dlrmflow`` script) skips the interpreter's teardown, not what an exit must do: the
    command's status, its output and every atexit hook (Prefect's log flush is one) with its output."""
    code = ("import atexit, sys; from dlrmflow import cli; atexit.register(lambda: print('hook ran')); "
            "sys.argv = ['dlrmflow'] + sys.argv[1:]; cli.run_command()")
    done = subprocess.run([sys.executable, "-c", code, "generate", "--rows", "0", "--output", "X"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == "dlrmflow generate: error: --rows must be >= 1, got 0\n"
    assert done.stdout == "hook ran\n"


def _dlrmflow(argv: list[str], cwd) -> tuple[dict, str]:
    """``dlrmflow ARGV --json`` as a user runs it, against the test harness's Prefect API: its one JSON
    object (stdout holds nothing else) and its stderr."""
    import os

    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run([sys.executable, "-m", "dlrmflow.cli", *argv, "--json"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON object, got {lines!r}"
    return json.loads(lines[0]), done.stderr


@pytest.mark.usefixtures("prefect_harness")
def test_json_keeps_stdout_to_one_object_and_shows_progress_on_stderr(tmp_path):
    """preprocess and a remote train with --json: one JSON object on stdout; on stderr the steps, the Dask
    cluster (preprocess's too), the server initialisation, the iterations and the final evaluation; summary.json
    records the start-up (launch to the first iteration) and the finish with its phases."""
    raw = tmp_path / "day_0.tsv"
    raw.write_bytes(generate_rows(0, 3000, seed=0, scale=0.001))  # what `dlrmflow generate` writes
    prep, err = _dlrmflow(["preprocess", str(raw), "--output", str(tmp_path / "ds")], tmp_path)
    assert prep["rows"] == 3000
    assert "preprocess steps: " in err and "(100%)" in err
    assert "Dask: starting a LocalCluster: done in" in err  # the wait for the cluster is said too
    run, err = _dlrmflow(["train", str(tmp_path / "ds"), "--output", str(tmp_path / "run"), "--mode", "remote",
                          "--shards", "2", "--batch-size", "64", "--iterations", "10", "--embedding-dim", "4",
                          "--bottom-mlp", "8-4", "--top-mlp", "8-1"], tmp_path)
    for line in ("Dask: starting a LocalCluster ...", "embedding servers: initialising 2 shards ...",
                 "embedding servers: initialising 2 shards: done in",
                 "trainer: importing torch's compiler settings (deterministic algorithms): done in",
                 "remote training iterations: 10/10 (100%)", "final evaluation: done in",
                 "final evaluation rows: ", "final state: the servers write their rows: done in",
                 "Dask: closing the LocalCluster: done in"):
        assert line in err, f"{line!r} not on stderr:\n{err}"
    assert "Beginning flow run" not in err  # Prefect's other INFO lines stay back with --json
    assert 0 < run["startup_seconds"] < 600 and run["finish_seconds"] >= 0
    assert set(run["finish"]) == {"flush", "evaluation", "state", "write"}
    assert sum(run["finish"].values()) == pytest.approx(run["finish_seconds"], abs=1e-3)


def test_a_long_phase_reports_its_progress_at_most_once_an_interval_and_always_at_the_end(caplog):
    import logging

    from dlrmflow.engine.phases import PhaseProgress

    with caplog.at_level(logging.INFO, logger="dlrmflow.engine.phases"):
        every = PhaseProgress("rows", 30, interval_s=0.0)
        for done in (10, 20, 30):
            every(done)
        seldom = PhaseProgress("more rows", 30, interval_s=3600.0)
        for done in (10, 20, 30):
            seldom(done)
    assert [r.getMessage() for r in caplog.records] == [
        "rows: 10/30 (33%)", "rows: 20/30 (67%)", "rows: 30/30 (100%)", "more rows: 30/30 (100%)"]
