"""The one skip rule (:mod:`dlrmflow.engine.up_to_date`): an unchanged input and parameters skip, any change reruns.

Per step: generate (below), preprocess (``tests/test_preprocess.py``), profile, plan and training
runs in the pipeline (``tests/test_pipeline.py``, which reruns with a changed parameter).
"""

from __future__ import annotations

import json
import os

import pytest

from dlrmflow.engine.up_to_date import file_identity, fingerprint, saved_result


def test_fingerprint_depends_on_values_not_on_key_order():
    a = fingerprint({"inputs": [{"path": "/x", "size": 3}], "params": {"seed": 0, "scale": 1.0}})
    assert a == fingerprint({"params": {"scale": 1.0, "seed": 0}, "inputs": [{"size": 3, "path": "/x"}]})
    assert a != fingerprint({"inputs": [{"path": "/x", "size": 3}], "params": {"seed": 1, "scale": 1.0}})
    assert a != fingerprint({"inputs": [{"path": "/x", "size": 4}], "params": {"seed": 0, "scale": 1.0}})
    assert len(a) == 64 and int(a, 16) >= 0


def test_file_identity_changes_with_size_and_modification_time(tmp_path):
    path = tmp_path / "raw.tsv"
    path.write_text("1\t2\n")
    first = file_identity([path])
    assert first == [{"path": str(path.resolve()), "size": 4, "mtime_ns": path.stat().st_mtime_ns}]
    assert file_identity([str(path)]) == first
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert file_identity([path]) != first
    path.write_text("1\t2\n3\n")
    assert file_identity([path])[0]["size"] == 6


def test_saved_result_matches_every_expected_key(tmp_path):
    record = tmp_path / "plan.json"
    saved = {"dataset_fingerprint": "abc", "batch_size": 8, "capacity": None, "rows": 5}
    record.write_text(json.dumps(saved))
    assert saved_result(record, {"dataset_fingerprint": "abc", "batch_size": 8, "capacity": None}) == saved
    assert saved_result(record, {}) == saved
    assert saved_result(record, {"dataset_fingerprint": "abd", "batch_size": 8}) is None  # another input
    assert saved_result(record, {"dataset_fingerprint": "abc", "batch_size": 16}) is None  # another parameter
    assert saved_result(record, {"lookahead": 4}) is None  # a parameter the record does not name
    assert saved_result(record, {"lookahead": None}) == saved  # ... unless it is None (the old default)


@pytest.mark.parametrize("text", [None, "", "{not json", "[1, 2]", "\udcff"])
def test_a_missing_or_unreadable_record_reruns(tmp_path, text):
    record = tmp_path / "summary.json"
    if text is not None:
        record.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert saved_result(record, {"mode": "local"}) is None
    assert saved_result(tmp_path, {}) is None  # a directory is no record


def test_generate_skips_an_unchanged_file_and_reruns_after_any_change(tmp_path):
    from dlrmflow.tasks.dataset import generate_record, generated_file_is_current

    output = tmp_path / "day_0.tsv"
    params = {"rows": 10, "seed": 0, "scale": 0.01}
    assert generated_file_is_current(str(output), params) is None  # nothing there yet
    output.write_text("x" * 100)
    assert generated_file_is_current(str(output), params) is None  # a file without a record
    result = {"rows": 10, "bytes": 100}
    generate_record(str(output)).write_text(json.dumps({"params": params, "bytes": 100, "result": result}))
    assert generated_file_is_current(str(output), params) == result
    assert generated_file_is_current(str(output), {**params, "seed": 1}) is None
    assert generated_file_is_current(str(output), {**params, "rows": 11}) is None
    output.write_text("x" * 99)  # the file changed since
    assert generated_file_is_current(str(output), params) is None
