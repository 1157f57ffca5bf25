"""Bad input and faults that a user meets (issue 20): each is a quarantined row or one clear line.

- a bad value in any field of a raw line is a rejected row (file, line, reason), never a crashed run;
  the Criteo TSV and CSV readers accept the same dense values (integers within int64);
- a truncated or corrupt gzip input is one line naming the file;
- an output being written is locked: a second run into it is refused, naming the first;
- ``dlrmflow verify`` exits 1 on a parity mismatch;
- ``dlrmflow train`` never writes over a finished run or a foreign directory, and a failed run
  leaves no directory it created;
- the messages and summaries say what they mean (header differences, batch larger than the data,
  the loss window, small rates).
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainers import make_dataset, small_config

from dlrmflow.cli import main
from dlrmflow.datasets.formats import FORMATS, parse_block
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.verify import verify_run_dir
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.row_files import parity_file, write_rows_file
from dlrmflow.engine.run_lock import OutputLockedError, lock_path, output_lock
from dlrmflow.engine.run_state import MANIFEST_FILE, STATE_DIR, save_sharded_state
from dlrmflow.engine.training import loop as loop_module
from dlrmflow.engine.training.job import prepare_run, train
from dlrmflow.engine.training.run_directory_checks import refuse_to_overwrite

DATA = Path(__file__).parent / "data"


def _criteo_lines(n: int = 6) -> list[list[str]]:
    """``n`` valid raw Criteo lines, as fields."""
    rng = np.random.default_rng(5)
    return [[str(i % 2), *(str(int(v)) for v in rng.integers(0, 50, 13)),
             *(f"{int(v):08x}" for v in rng.integers(0, 2**32, 26))] for i in range(n)]


def _tsv(lines: list[list[str]]) -> bytes:
    return ("\n".join("\t".join(f) for f in lines) + "\n").encode()


def _csv(lines: list[list[str]]) -> bytes:
    return ("\n".join(",".join(f) for f in lines) + "\n").encode()


# ---- every field: a bad value is a rejected row --------------------------------------------------


@pytest.mark.parametrize("value, reason", [
    ("99999999999999999999", "I2: dense value outside the 64-bit integer range"),
    ("-99999999999999999999", "I2: dense value outside the 64-bit integer range"),
    ("2.5", "I2: non-integer dense value"),
])
@pytest.mark.parametrize("fmt", ["criteo", "criteo-csv"])
def test_the_criteo_readers_reject_the_same_dense_values(fmt, value, reason):
    lines = _criteo_lines()
    lines[2][2] = value
    data = _tsv(lines) if fmt == "criteo" else _csv(lines)
    parsed = parse_block(data, FORMATS[fmt])
    assert len(parsed.labels) == 5 and [r[:2] for r in parsed.rejects] == [(3, reason)]


def test_a_csv_float_beyond_int64_is_rejected_and_int64_max_is_kept():
    lines = _criteo_lines()
    lines[1][2], lines[3][2] = "1e20", "9223372036854775807"
    out_of_range = "I2: dense value outside the 64-bit integer range"
    # the CSV layout's values are floats: 9223372036854775807 reads as 2^63, just outside
    assert [r[:2] for r in parse_block(_csv(lines), FORMATS["criteo-csv"]).rejects] == [(2, out_of_range),
                                                                                         (4, out_of_range)]
    parsed = parse_block(_tsv(lines[3:]), FORMATS["criteo"])  # the TSV reader's int64 holds the largest exactly
    assert not parsed.rejects and parsed.dense[0, 1] == np.float32(np.log1p(9223372036854775807.0))


@pytest.mark.parametrize("field", [0, 3, 20])  # label, a dense value, a hash
def test_a_line_that_is_not_utf8_is_a_rejected_row(field):
    data = _tsv(_criteo_lines()).split(b"\n")
    fields = data[1].split(b"\t")
    fields[field] = b"\xff\xfe"
    data[1] = b"\t".join(fields)
    parsed = parse_block(b"\n".join(data), FORMATS["criteo"])
    assert len(parsed.labels) == 5 and [r[:2] for r in parsed.rejects] == [(2, "not UTF-8 text")]


def test_an_avazu_value_that_is_not_utf8_is_a_rejected_row():
    lines = (DATA / "avazu_sample.csv").read_bytes().split(b"\n")[1:6]
    fields = lines[2].split(b",")
    fields[5] = b"\xffsite"
    lines[2] = b",".join(fields)
    parsed = parse_block(b"\n".join(lines) + b"\n", FORMATS["avazu"])
    assert len(parsed.labels) == 4 and [r[:2] for r in parsed.rejects] == [(3, "not UTF-8 text")]


def test_an_out_of_range_value_is_quarantined_with_file_line_and_reason(tmp_path):
    lines = _criteo_lines(50)
    lines[0][2] = "99999999999999999999"
    raw = tmp_path / "h.tsv"
    raw.write_bytes(_tsv(lines))
    summary = preprocess([raw], tmp_path / "out", max_reject_fraction=0.05)
    assert summary["rows"] == 49 and summary["rejected_rows"] == 1
    text = Path(summary["rejected_file"]).read_bytes()
    assert b"\r" not in text  # LF line ends
    rows = list(csv.DictReader(text.decode().splitlines()))
    assert [(r["file"], r["line"], r["reason"]) for r in rows] == [
        (str(raw), "1", "I2: dense value outside the 64-bit integer range")]


# ---- unreadable inputs ----------------------------------------------------------------------------


def test_a_truncated_gzip_input_is_a_user_error_naming_the_file(tmp_path):
    raw = tmp_path / "day.gz"
    raw.write_bytes(gzip.compress(_tsv(_criteo_lines(400)))[:-40])
    with pytest.raises(UserInputError, match=f"input file '{raw}' is not a complete gzip file"):
        preprocess([raw], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not lock_path(tmp_path / "out").exists()


def test_a_header_mismatch_says_where_the_headers_differ(tmp_path):
    text = (DATA / "avazu_sample.csv").read_text().split("\n")
    text[0] = text[0].replace("device_model", "device_mdl")
    raw = tmp_path / "day.csv"
    raw.write_text("\n".join(text))
    with pytest.raises(UserInputError, match="field 14 is 'device_mdl', expected 'device_model' "
                                             r"\(expected 24 fields, got 24\)"):
        preprocess([raw], tmp_path / "out", fmt="avazu")


# ---- the output lock ------------------------------------------------------------------------------


def test_a_locked_output_refuses_a_second_run_naming_the_first(tmp_path):
    out = tmp_path / "ds"
    raw = tmp_path / "day.tsv"
    raw.write_bytes(_tsv(_criteo_lines()))
    with output_lock(out, "preprocess"):
        with pytest.raises(OutputLockedError, match=f"is being written by preprocess \\(pid {os.getpid()} on "
                                                    f"{socket.gethostname()}, since .*delete {lock_path(out)}"):
            preprocess([raw], out)
    assert not lock_path(out).exists()
    assert preprocess([raw], out)["rows"] == 6


def test_the_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = tmp_path / "run"
    lock_path(out).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "what": "train"}))
    with output_lock(out, "train") as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()


def test_a_lock_held_on_another_host_is_not_taken_over(tmp_path):
    lock_path(tmp_path / "ds").write_text(json.dumps({"pid": 1, "host": "elsewhere", "what": "preprocess"}))
    with pytest.raises(OutputLockedError, match="pid 1 on elsewhere"):
        with output_lock(tmp_path / "ds", "preprocess"):
            pass


# ---- train: never over a finished run or a foreign directory --------------------------------------


def test_train_refuses_a_finished_run_and_a_foreign_directory(tmp_path):
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text("{}")
    with pytest.raises(UserInputError, match="holds a finished run"):
        refuse_to_overwrite(tmp_path / "done")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("")
    with pytest.raises(UserInputError, match="is not a dlrmflow run directory \\(it holds 'thesis.tex'\\)"):
        refuse_to_overwrite(tmp_path / "mine")
    (tmp_path / "stopped").mkdir()  # the leftovers of a run that stopped: written over
    (tmp_path / "stopped" / "iterations.csv").write_text("")
    refuse_to_overwrite(tmp_path / "stopped")
    refuse_to_overwrite(tmp_path / "missing")


def test_a_failed_run_leaves_no_directory_it_created(tmp_path, monkeypatch):
    dataset = make_dataset(tmp_path / "data", 3)

    def failing_step(*args, **kw):
        raise RuntimeError("the step failed")

    monkeypatch.setattr(loop_module, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="the step failed"):
        train(small_config(dataset, tmp_path / "runs" / "a", "local"))
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob(".*.lock"))


def test_a_batch_larger_than_the_data_names_batch_size_and_the_rows(tmp_path):
    dataset = make_dataset(tmp_path / "data", 3, rows=100)
    config = small_config(dataset, tmp_path / "run", "local", batch_size=128, iterations=None, eval_fraction=0.1)
    with pytest.raises(UserInputError, match="batch_size: --batch-size 128 is larger than the 90 training rows of "
                                             "the dataset, 10 of 100 held out for evaluation"):
        prepare_run(config)


# ---- summaries ------------------------------------------------------------------------------------


def test_summaries_say_what_they_measure():
    from dlrmflow.commands import plan
    from dlrmflow.commands import train as train_command
    from dlrmflow.commands.units import per_second

    assert [per_second(x, "ids") for x in (12.0, 45_600.0, 2.5e6)] == ["12 ids/s", "45.6 k ids/s", "2.5 M ids/s"]
    counts = {"prefetched_rows": 1, "evicted_rows": 1, "peak_occupancy": 1, "ids": 640}
    text = plan.summarize({"counts": counts, "capacity": None, "num_iterations": 4, "batch_size": 16, "lookahead": 2,
                           "prefetch_distance": 1, "num_slots": 1, "seconds": 0.02, "dask_workers": 1,
                           "ids_per_second": 32_000.0, "iterations_per_second": 200.0, "output": "p"})
    assert "32.0 k ids/s, 200 iterations/s" in text
    summary = {"mode": "local", "model": "dlrm", "iterations": 12, "batch_size": 16, "device": "cpu",
               "mean_iteration_ms": 1.0, "median_iteration_ms": 1.0, "stall_fraction": 0.0, "bytes_fetched": 0,
               "bytes_written_back": 0, "first_train_loss": 0.7, "final_train_loss_mean": 0.6, "metrics_every": 50,
               "eval_rows": 10, "eval_auc": None, "eval_log_loss": None, "evaluations": [], "state_sha256": "0",
               "startup_seconds": None, "finish_seconds": 0.5, "finish": {"flush": 0.5}, "output_dir": "run"}
    assert "(mean of the last 12)" in train_command.summarize(summary)


# ---- the CLI: exit statuses and one line ----------------------------------------------------------


@pytest.mark.slow  # ~8 s: the failure must cross a real LocalCluster's worker without a logged traceback
def test_the_cli_answers_a_truncated_gzip_in_one_line(prefect_harness, tmp_path, capsys):
    raw = tmp_path / "day.gz"
    raw.write_bytes(gzip.compress(_tsv(_criteo_lines(400)))[:-40])
    assert main(["preprocess", str(raw), "--output", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"dlrmflow preprocess: error: input file '{raw}' is not a complete gzip file (Compressed "
                       "file ended before the end-of-stream marker was reached): it is truncated or corrupt")
    assert not any("Traceback" in line for line in err)


def test_the_cli_refuses_a_foreign_output_in_one_line(prefect_harness, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    dataset = make_dataset(tmp_path / "data", 3)
    assert main(["train", str(dataset), "--mode", "local", "--output", str(tmp_path / "mine")]) == 2
    assert "is not a dlrmflow run directory" in capsys.readouterr().err.strip().splitlines()[-1]
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def _sharded_parity_run_dir(path: Path) -> Path:
    """A run directory as `dlrmflow train --parity 1` leaves it: final_state/ with K = 2 shard files and
    the parity file, listed in its manifest."""
    path.mkdir()
    rows = np.random.default_rng(1).standard_normal((21, 5)).astype(np.float32)
    dense = {"w": torch.ones(2)}
    save_sharded_state(path, {"dense": dense, "dense_optimizer": {}, "embedding": {"rows": torch.from_numpy(rows)}},
                       2)
    (parity,) = ErasureCode(2, 1).encode([np.ascontiguousarray(rows[i::2]) for i in range(2)])
    entry = write_rows_file(path / STATE_DIR / parity_file(0), len(parity), 5, lambda a, b: parity[a:b])
    manifest = json.loads((path / STATE_DIR / MANIFEST_FILE).read_text())
    manifest["parity"] = {"k": 2, "r": 1, "files": [entry]}
    (path / STATE_DIR / MANIFEST_FILE).write_text(json.dumps(manifest))
    return path


def test_verify_exits_1_on_a_flipped_parity_bit(prefect_harness, tmp_path, capsys):
    run_dir = _sharded_parity_run_dir(tmp_path / "run")
    assert main(["verify", str(run_dir)]) == 0
    parity = np.load(run_dir / STATE_DIR / parity_file(0), mmap_mode="r+")
    parity.view(np.int32)[3, 1] ^= 1 << 7
    parity.flush()
    del parity
    assert not verify_run_dir(run_dir)["ok"]
    capsys.readouterr()
    assert main(["verify", str(run_dir)]) == 1
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out
    assert captured.err.strip().splitlines()[-1] == (f"dlrmflow verify: parity of {run_dir} does not match its "
                                                     "data (1 mismatched stripes)")


def test_verify_names_a_file_that_differs_from_its_manifest(prefect_harness, tmp_path, capsys):
    run_dir = _sharded_parity_run_dir(tmp_path / "run")
    assert main(["verify", str(run_dir)]) == 0
    assert "every file matches its manifest" in capsys.readouterr().out
    manifest = json.loads((run_dir / STATE_DIR / MANIFEST_FILE).read_text())
    manifest["shards"][1]["sha256"] = "0" * 64  # parity still matches: the file is not the one the run wrote
    (run_dir / STATE_DIR / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert main(["verify", str(run_dir)]) == 1
    captured = capsys.readouterr()
    assert "DAMAGED: shard-1.npy" in captured.out
    assert captured.err.strip().splitlines()[-1] == (f"dlrmflow verify: the files of {run_dir} do not match its "
                                                     "manifest (shard-1.npy)")
