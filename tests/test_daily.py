"""The daily loop (issue 30): each night preprocesses the new day files with the growing vocabulary, plans,
evaluates the latest model on the new day, trains from it; a night with nothing new says so.

In process, against a temporary Prefect API; tests/test_prefect_server.py runs the README's two nights
through the ``daily/nightly`` deployment on a real server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrmflow.cli import main
from dlrmflow.datasets.synthetic import generate_rows
from dlrmflow.engine.errors import UserInputError
from dlrmflow.flows.daily_config import DailyConfig, day_name, natural_key

pytestmark = pytest.mark.usefixtures("prefect_harness")


def write_day(landing: Path, day: int, rows: int = 3000) -> Path:
    landing.mkdir(parents=True, exist_ok=True)
    path = landing / f"day_{day}.tsv"
    path.write_bytes(generate_rows(0, rows, seed=100 + day, scale=0.002))
    return path


def daily(capsys, landing: Path, state: Path) -> dict:
    capsys.readouterr()
    assert main(["daily", str(landing), "--state-dir", str(state), "--batch-size", "512", "--lookahead", "20",
                 "--embedding-dim", "4", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_night_with_nothing_new_says_so_and_writes_nothing(tmp_path, capsys):
    """The days in the landing are all in the history: nothing to do (the two nights themselves run in
    tests/test_prefect_server.py, through the deployment)."""
    landing, state = tmp_path / "landing", tmp_path / "state"
    write_day(landing, 0, rows=10)
    state.mkdir()
    row = {"day": "day_0", "rows": 10}
    (state / "history.json").write_text(json.dumps({"days": [row]}))
    before = sorted(p.name for p in state.iterdir())
    result = daily(capsys, landing, state)
    assert result["new_days"] == [] and result["days"] == [row] and result["report"] is None
    assert main(["daily", str(landing), "--state-dir", str(state)]) == 0
    assert "nothing new: 1 day(s) already processed" in capsys.readouterr().out
    assert sorted(p.name for p in state.iterdir()) == before


def test_days_go_in_natural_order_and_a_landing_must_exist(tmp_path):
    assert sorted(["day_10", "day_2", "day_1"], key=natural_key) == ["day_1", "day_2", "day_10"]
    for name in ("day_10.tsv", "day_2.tsv", "day_2.tsv.params.json", ".hidden", "day_3"):
        (tmp_path / name).write_text("")
    config = DailyConfig(landing=str(tmp_path), state_dir=str(tmp_path / "s"))
    assert [p.name for p in config.day_files()] == ["day_2.tsv", "day_3", "day_10.tsv"]
    assert [day_name(p) for p in config.day_files()] == ["day_2", "day_3", "day_10"]
    assert day_name(Path("day_0.tsv.gz")) == "day_0" and day_name(Path("day.2.csv")) == "day.2"
    assert [p.name for p in DailyConfig(landing=str(tmp_path / "day_1*"), state_dir="s").day_files()] == [
        "day_10.tsv"]
    with pytest.raises(UserInputError, match="landing: .* does not exist"):
        DailyConfig(landing=str(tmp_path / "nowhere"), state_dir="s").day_files()


def test_bad_daily_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    state = tmp_path / "state"
    cases = [
        ([str(tmp_path / "nowhere")], "landing: "),
        ([str(tmp_path), "--batch-size", "0"], "batch_size"),
        ([str(tmp_path), "--lookahead", "2", "--prefetch-distance", "3"], "prefetch_distance: 3 must be <= lookahead"),
    ]
    (tmp_path / "day_1.tsv").write_text("")
    (tmp_path / "day_1.tsv.gz").write_text("")
    cases.append(([str(tmp_path)], "day_1.tsv and day_1.tsv.gz are both day 'day_1'"))
    for argv, error in cases:
        capsys.readouterr()
        assert main(["daily", *argv, "--state-dir", str(state)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and error in err[0], (argv, err)
    assert not state.exists()
