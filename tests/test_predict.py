"""``dlrmflow predict``: a finished run's model scores raw files or a dataset into Parquet predictions.

The run here trains on 120 real Criteo rows (tests/data), its held-out quarter scored in batches of 8; the
other 80 rows are "tomorrow's" raw file, with values the run never saw.
"""

from __future__ import annotations

import gzip
import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import run_json
from distributed import Client
from test_trainers import small_config

from dlrmflow.cli import main
from dlrmflow.datasets.formats import get_format
from dlrmflow.datasets.meta import read_meta
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.prediction import (
    SUMMARY_FILE,
    PredictionError,
    check_raw_rows,
    predict_run,
    rows_in_input_order,
    staging_dir,
)
from dlrmflow.engine.training.run_directory import UNFINISHED_FILE
from dlrmflow.engine.training.scoring import evaluate_run

SAMPLE = Path(__file__).parent / "data" / "criteo_kaggle_sample.csv"
AVAZU = Path(__file__).parent / "data" / "avazu_sample.csv"
EVAL_BATCH = 8


@pytest.fixture(scope="module")
def client():
    logging.getLogger("distributed").setLevel(logging.WARNING)
    cluster = local_cluster(2)
    with cluster, Client(cluster, direct_to_workers=True) as client:
        yield client


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Day 0 (the sample's first 120 rows) preprocessed and trained on; day 1 (the other 80) raw."""
    root = tmp_path_factory.mktemp("predict")
    header, *lines = SAMPLE.read_text().splitlines(keepends=True)
    (root / "day0.csv").write_text(header + "".join(lines[:120]))
    (root / "day1.csv").write_text(header + "".join(lines[120:]))
    preprocess([root / "day0.csv"], root / "day0", fmt="criteo-csv")
    summary = train(small_config(root / "day0", root / "run", "local", iterations=5, eval_fraction=0.25,
                                 eval_batch_size=EVAL_BATCH))
    return {"root": root, "dataset": root / "day0", "run": root / "run", "day1": root / "day1.csv",
            "summary": summary}


def predictions(out: Path) -> dict[str, np.ndarray]:
    """Every part of a prediction, by row."""
    table = pq.read_table(out)
    columns = {name: table.column(name).to_numpy() for name in table.column_names}
    order = np.argsort(columns["row"], kind="stable")
    return {name: values[order] for name, values in columns.items()}


def assert_nothing_written(out: Path) -> None:
    assert not out.exists() and not staging_dir(out).exists()


def test_held_out_predictions_are_the_runs_final_evaluation_bit_for_bit(trained, tmp_path):
    summary = trained["summary"]
    result = predict_run(trained["run"], [trained["dataset"]], tmp_path / "out", batch_size=EVAL_BATCH,
                         held_out=True)
    assert (result["auc"], result["log_loss"]) == (summary["eval_auc"], summary["eval_log_loss"])
    assert result["rows"] == summary["eval_rows"] == 30 and result["first_row"] == 90
    written = predictions(tmp_path / "out")
    assert written["row"].tolist() == list(range(90, 120))
    assert written["probability"].dtype == np.float32 and ((written["probability"] > 0) &
                                                           (written["probability"] < 1)).all()
    assert result["new_ids"] == result["new_id_lookups"] == 0


def test_probabilities_on_the_cluster_equal_those_in_process_whatever_the_parts(trained, client, tmp_path):
    """In process: 2 parts; on 2 workers: 4 parts; batches of 5 instead: other parts again. The rows' probability
    bits, labels and the exact metrics are the same, and equal ``dlrmflow evaluate``'s."""
    alone = predict_run(trained["run"], [trained["dataset"]], tmp_path / "alone", batch_size=EVAL_BATCH)
    clustered = predict_run(trained["run"], [trained["dataset"]], tmp_path / "cluster", batch_size=EVAL_BATCH,
                            client=client)
    assert (alone["scored_on"], alone["parts"], clustered["scored_on"], clustered["parts"]) == \
        ("process", 2, "cluster", 4)
    a, c = predictions(tmp_path / "alone"), predictions(tmp_path / "cluster")
    assert a["row"].tolist() == list(range(120))
    assert np.array_equal(a["probability"].view(np.uint32), c["probability"].view(np.uint32))
    assert np.array_equal(a["label"], c["label"])
    for key in ("rows", "auc", "log_loss", "positive_rate", "new_id_lookups"):
        assert alone[key] == clustered[key], key
    evaluated = evaluate_run(trained["run"], trained["dataset"], batch_size=EVAL_BATCH)
    assert (alone["auc"], alone["log_loss"]) == (evaluated["auc"], evaluated["log_loss"])


def test_raw_rows_take_the_ids_preprocess_vocabulary_gives_them(trained, tmp_path):
    """The raw rows read in input order carry exactly the rows of ``preprocess --vocabulary`` (a permutation
    of them: preprocess shuffles), new values included; the prediction of the raw file is in input order."""
    mapped = tmp_path / "mapped"
    preprocess([trained["day1"]], mapped, fmt="criteo-csv", vocabulary=str(trained["dataset"]))
    fmt = get_format("criteo-csv")
    meta = rows_in_input_order([str(trained["day1"])], fmt, mapped, tmp_path / "in_order")
    columns = ["label", *fmt.dense, *fmt.sparse]

    def rows(path: Path) -> np.ndarray:
        files = [path / f.name for f in read_meta(path).files]
        table = pa.concat_tables([pq.read_table(f, columns=columns) for f in files])
        matrix = np.stack([table.column(c).to_numpy().astype(np.float64) for c in columns], axis=1)
        return matrix[np.lexsort(matrix.T[::-1])]

    assert meta.rows == 80
    assert np.array_equal(rows(tmp_path / "in_order"), rows(mapped))
    grown = sum(read_meta(mapped).cardinalities) - sum(read_meta(trained["dataset"]).cardinalities)

    result = predict_run(trained["run"], [trained["day1"]], tmp_path / "out", batch_size=EVAL_BATCH)
    assert result["input_kind"] == "raw" and result["rows"] == 80
    assert result["new_ids"] == grown > 0 and result["new_id_lookups"] > 0
    written = predictions(tmp_path / "out")
    labels = [float(line.split(",")[0]) for line in trained["day1"].read_text().splitlines()[1:]]
    assert written["row"].tolist() == list(range(80)) and written["label"].tolist() == labels
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [SUMMARY_FILE, "part-00000.parquet",
                                                                    "part-00001.parquet"]


def test_a_gzip_file_and_an_empty_output_directory(trained, tmp_path):
    """The same rows gzipped score to the same bits; an existing empty OUT is filled."""
    plain = predict_run(trained["run"], [trained["day1"]], tmp_path / "plain")
    packed = tmp_path / "day1.csv.gz"
    packed.write_bytes(gzip.compress(trained["day1"].read_bytes()))
    (tmp_path / "empty").mkdir()
    zipped = predict_run(trained["run"], [packed], tmp_path / "empty")
    assert plain["auc"] == zipped["auc"] and plain["log_loss"] == zipped["log_loss"]
    assert np.array_equal(predictions(tmp_path / "plain")["probability"],
                          predictions(tmp_path / "empty")["probability"])


def test_predict_on_the_command_line(trained, tmp_path, capsys, prefect_harness):
    """``dlrmflow predict`` on a dataset (``--json``) and on a raw file (the summary); its progress lines (the
    engine's phases logger, which the console shows on stderr: tests/test_fast_start.py)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    phases = logging.getLogger("dlrmflow.engine.phases")
    phases.addHandler(handler)
    level = phases.level
    phases.setLevel(logging.INFO)
    out = tmp_path / "out"
    result = run_json(capsys, ["predict", str(trained["run"]), str(trained["dataset"]), "--output", str(out),
                               "--held-out", "--batch-size", str(EVAL_BATCH), "--score-on", "process"])
    assert result["auc"] == trained["summary"]["eval_auc"] and (out / "part-00000.parquet").is_file()
    assert main(["predict", str(trained["run"]), str(trained["day1"]), "--output", str(tmp_path / "raw")]) == 0
    captured = capsys.readouterr()
    assert "80 rows into" in captured.out and "ids new to the model" in captured.out and "AUC" in captured.out
    phases.removeHandler(handler)
    phases.setLevel(level)
    assert "prediction rows: 80/80 (100%)" in lines, lines


def damaged_run(trained: dict, tmp_path: Path, damage) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    damage(run)
    return run


def truncate_a_shard(run: Path) -> None:
    shard = sorted((run / "final_state").glob("*.npy"))[0]
    shard.write_bytes(shard.read_bytes()[:200])


BAD_INPUTS = {
    "an unfinished run": (lambda run: (run / UNFINISHED_FILE).write_text("{}"), None, "unfinished run"),
    "a corrupt final state": (truncate_a_shard, None, "shard file"),
    "a raw file of another format": (None, AVAZU, "header does not match format 'criteo-csv'"),
    "an OUT that is not empty": (None, None, "is not an empty directory"),
    "a dataset of other ids": (None, "day1-alone", "does not descend from it"),
    "a missing input": (None, "nowhere.csv", "does not exist"),
    "raw input with --held-out": (None, "day1", "--held-out scores the run's own held-out rows"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, trained, tmp_path, capsys):
    damage, given, message = BAD_INPUTS[case]
    run = trained["run"] if damage is None else damaged_run(trained, tmp_path, damage)
    inputs = str(trained["dataset"])
    out = tmp_path / "out"
    extra: list[str] = []
    if given == "day1-alone":
        preprocess([trained["day1"]], tmp_path / "day1", fmt="criteo-csv")
        inputs = str(tmp_path / "day1")
    elif given == "day1":
        inputs, extra = str(trained["day1"]), ["--held-out"]
    elif given is not None:
        inputs = str(given) if Path(given).is_absolute() else str(tmp_path / given)
    if case == "an OUT that is not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["predict", str(run), inputs, "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dlrmflow predict: error: ") and message in err[0], err
    if case == "an OUT that is not empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert_nothing_written(out)


def test_a_raw_file_of_another_format_without_a_header_is_refused(trained):
    """A headerless format (Criteo's TSV) cannot check a header: no row of the file's first lines parses."""
    with pytest.raises(PredictionError, match="no row of its first 81 lines is a 'criteo' row .* trained on "
                                              "--format 'criteo'"):
        check_raw_rows(trained["day1"], get_format("criteo"), "RUN_DIR r")
    check_raw_rows(trained["day1"], get_format("criteo-csv"), "RUN_DIR r")  # its own format passes


def test_a_failure_while_scoring_leaves_nothing(trained, tmp_path):
    """A damaged dense.pt passes the quick checks and fails the model's load: nothing of OUT is left."""
    run = damaged_run(trained, tmp_path, lambda run: (run / "final_state" / "dense.pt").write_bytes(b"garbage"))
    with pytest.raises(PredictionError, match="dense parameters cannot be read"):
        predict_run(run, [trained["day1"]], tmp_path / "out")
    assert_nothing_written(tmp_path / "out")
