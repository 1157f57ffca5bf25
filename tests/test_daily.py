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
from dlrmflow.datasets.meta import read_meta
from dlrmflow.datasets.synthetic import generate_rows
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.run_state import read_summary
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


@pytest.mark.slow
def test_two_nights_then_a_night_with_nothing_new(tmp_path, capsys):
    landing, state = tmp_path / "landing", tmp_path / "state"
    write_day(landing, 0)
    first = daily(capsys, landing, state)
    assert first["new_days"] == ["day_0"]
    [day0] = first["days"]
    assert day0["next_day_auc"] is None and day0["new_ids"] == day0["embedding_rows"] > 0
    assert read_summary(day0["run_dir"])["init_from"] is None

    write_day(landing, 1)
    second = daily(capsys, landing, state)
    assert second["new_days"] == ["day_1"]
    day0_again, day1 = second["days"]
    assert day0_again == day0  # night 1's row, as it was
    # Day 1 kept day 0's ids and grew; its model continued day 0's, evaluated on day 1 before training on it.
    meta1 = read_meta(day1["dataset"])
    assert meta1.vocabulary["parent"]["fingerprint"] == read_meta(day0["dataset"]).fingerprint
    assert day1["new_ids"] == sum(meta1.cardinalities) - day0["embedding_rows"] > 0
    summary1 = read_summary(day1["run_dir"])
    assert summary1["init_from"]["run_dir"] == day0["run_dir"] and summary1["mode"] == "oracle"
    assert summary1["parity"]["verify"]["ok"] is True
    assert 0 < day1["next_day_auc"] < 1 and day1["next_day_log_loss"] > 0
    assert day1["next_day_constant_log_loss"] > 0 and 0 < day1["new_id_lookup_share"] < 1
    assert (state / "next_day_auc.png").stat().st_size > 0
    assert json.loads((state / "history.json").read_text())["days"] == [day0, day1]

    third = daily(capsys, landing, state)
    assert third["new_days"] == [] and third["days"] == [day0, day1] and third["report"] is None
    capsys.readouterr()
    assert main(["daily", str(landing), "--state-dir", str(state), "--batch-size", "512", "--lookahead", "20",
                 "--embedding-dim", "4"]) == 0
    assert "nothing new: 2 day(s) already processed" in capsys.readouterr().out


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
