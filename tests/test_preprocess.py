"""Preprocessing: exact transform vs a brute-force reference, shuffle, rejects, idempotence, kills."""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from dlrmflow.datasets.meta import DatasetError, read_meta
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.engine.errors import UserInputError


def _read_dataset(path: Path) -> tuple[dict[str, np.ndarray], object]:
    meta = read_meta(path)
    tables = [pq.read_table(path / f.name) for f in meta.files]
    cols = {c: np.concatenate([t[c].to_numpy() for t in tables]) for c in tables[0].column_names}
    return cols, meta


def _row_multiset(cols: dict[str, np.ndarray]) -> Counter:
    names = sorted(cols)
    return Counter(zip(*[cols[n].view(np.uint32) if cols[n].dtype == np.float32 else cols[n] for n in names],
                       strict=True))


def _brute_force_criteo_csv(path: Path) -> tuple[dict[str, np.ndarray], list[int]]:
    """The whole transform in plain Python: log1p dense, ids by (count desc, value asc)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    cols: dict[str, np.ndarray] = {"label": np.array([int(r["label"]) for r in rows], np.int8)}
    for j in range(1, 14):
        cols[f"I{j}"] = np.array(
            [0.0 if r[f"I{j}"] == "" else math.log1p(max(float(r[f"I{j}"]), 0.0)) for r in rows], np.float32)
    cards = []
    for k in range(1, 27):
        values = [int(r[f"C{k}"], 16) if r[f"C{k}"] else None for r in rows]
        counts = Counter(v for v in values if v is not None)
        ranked = sorted(counts, key=lambda v: (-counts[v], v))
        ids = {v: i + 1 for i, v in enumerate(ranked)}
        cols[f"C{k}"] = np.array([0 if v is None else ids[v] for v in values], np.int32)
        cards.append(len(ranked) + 1)
    return cols, cards


def test_real_criteo_sample_matches_brute_force(data_dir, tmp_path):
    src = data_dir / "criteo_kaggle_sample.csv"
    summary = preprocess([src], tmp_path / "ds", fmt="criteo-csv")
    cols, meta = _read_dataset(tmp_path / "ds")
    want, cards = _brute_force_criteo_csv(src)
    assert summary["rows"] == meta.rows == 200 and meta.rejected_rows == 0
    assert meta.cardinalities == cards
    assert _row_multiset(cols) == _row_multiset(want)
    # Schema: int8 label, float32 dense, int32 ids.
    schema = pq.read_schema(tmp_path / "ds" / meta.files[0].name)
    assert str(schema.field("label").type) == "int8"
    assert all(str(schema.field(f"I{j}").type) == "float" for j in range(1, 14))
    assert all(str(schema.field(f"C{k}").type) == "int32" for k in range(1, 27))
    assert meta.dense_columns == [f"I{j}" for j in range(1, 14)]
    assert meta.transform["seed"] == 0 and len(meta.fingerprint) == 64


def test_real_avazu_sample_cardinalities_match_brute_force(data_dir, tmp_path):
    src = data_dir / "avazu_sample.csv"
    preprocess([src], tmp_path / "ds", fmt="avazu")
    cols, meta = _read_dataset(tmp_path / "ds")
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    assert meta.rows == len(rows) == 100
    assert meta.label_column == "label" and meta.dense_columns == []
    for name, card in zip(meta.sparse_columns[:-2], meta.cardinalities, strict=False):
        assert card == len({r[name] for r in rows}) + 1, name
    assert meta.cardinalities[-2] == len({r["hour"][6:] for r in rows}) + 1  # hours of day seen
    assert sorted(Counter(cols["label"]).items()) == sorted(Counter(int(r["click"]) for r in rows).items())
    # The most frequent value of each column gets id 1.
    for name in meta.sparse_columns[:-2]:
        top = Counter(r[name] for r in rows).most_common(1)[0][1]
        assert np.count_nonzero(cols[name] == 1) == top, name


def _write_criteo_tsv(path: Path, n: int, seed: int, bad: dict[int, str] | None = None) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        dense = [str(x) if x >= 0 else "" for x in rng.integers(-1, 50, 13)]
        cats = [f"{x:08x}" for x in rng.integers(0, 40, 26) * 2654435761 % (1 << 32)]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *dense, *cats]))
    for i, text in (bad or {}).items():
        lines[i] = text
    path.write_text("\n".join(lines) + "\n")
    return lines


def test_shuffle_is_deterministic_by_seed_and_preserves_rows(tmp_path):
    src = tmp_path / "day_0"
    _write_criteo_tsv(src, 1200, seed=1)
    kw = dict(fmt="criteo", block_bytes=16 << 10)  # many blocks and output parts
    preprocess([src], tmp_path / "a", seed=5, **kw)
    preprocess([src], tmp_path / "b", seed=5, **kw)
    preprocess([src], tmp_path / "c", seed=6, **kw)
    a, meta_a = _read_dataset(tmp_path / "a")
    b, _ = _read_dataset(tmp_path / "b")
    c, meta_c = _read_dataset(tmp_path / "c")
    assert len(meta_a.files) > 1
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["C1"], c["C1"])  # another order ...
    assert _row_multiset(a) == _row_multiset(c)  # ... of the same rows
    assert meta_a.fingerprint != meta_c.fingerprint
    # Not the input order: even with one block and one part, the rows are permuted.
    single = preprocess([src], tmp_path / "d", seed=5, fmt="criteo", block_bytes=1 << 30)
    d, _ = _read_dataset(tmp_path / "d")
    in_file_order = np.array([np.log1p(float(x)) if x else 0.0 for x in
                              (line.split("\t")[1] for line in src.read_text().splitlines())], np.float32)
    assert single["files"] == 1
    assert not np.array_equal(d["I1"], in_file_order)
    assert np.array_equal(np.sort(d["I1"]), np.sort(in_file_order))


def test_several_files_and_gzip_give_the_same_rows(tmp_path):
    _write_criteo_tsv(tmp_path / "day_0", 700, seed=2)
    _write_criteo_tsv(tmp_path / "day_1", 500, seed=3)
    with open(tmp_path / "day_1", "rb") as f, gzip.open(tmp_path / "day_1.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    preprocess([tmp_path / "day_0", tmp_path / "day_1"], tmp_path / "plain", block_bytes=8 << 10)
    preprocess([tmp_path / "day_0", tmp_path / "day_1.gz"], tmp_path / "gz", block_bytes=8 << 10)
    plain, meta_p = _read_dataset(tmp_path / "plain")
    gz, meta_g = _read_dataset(tmp_path / "gz")
    assert meta_p.rows == meta_g.rows == 1200
    assert meta_p.cardinalities == meta_g.cardinalities
    assert _row_multiset(plain) == _row_multiset(gz)


def test_rejected_rows_are_quarantined_with_file_line_and_reason(tmp_path):
    src = tmp_path / "day_0"
    bad = {5: "0\t1\t2", 777: "1\t" + "\t".join(["zz"] * 39), 1500: "\t".join(["0"] * 14 + ["xyz"] * 26),
           2999: ""}
    lines = _write_criteo_tsv(src, 3000, seed=4, bad=bad)
    summary = preprocess([src], tmp_path / "ds", block_bytes=16 << 10)  # bad lines fall in different blocks
    meta = read_meta(tmp_path / "ds")
    assert summary["rows"] == meta.rows == 2996 and meta.rejected_rows == 4
    assert meta.rejected_by_reason == {
        "C1: not an 8-digit hex hash": 1, "I1: non-integer dense value": 1,
        "empty line": 1, "expected 40 fields, got 3": 1,
    }
    with open(tmp_path / "ds" / "rejected" / "rejected.csv", newline="") as f:
        rejected = list(csv.DictReader(f))
    assert [(int(r["line"]), r["text"]) for r in rejected] == [(i + 1, lines[i]) for i in sorted(bad)]
    assert all(r["file"] == str(src) for r in rejected)


def test_too_many_rejects_fail_with_a_clear_message_and_keep_the_evidence(tmp_path):
    src = tmp_path / "day_0"
    _write_criteo_tsv(src, 200, seed=5, bad={i: "garbage" for i in range(0, 200, 50)})  # 2%
    with pytest.raises(UserInputError, match=r"4 of 200 input rows \(2.00%\) were rejected, above "
                                             r"--max-reject-fraction 1%"):
        preprocess([src], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
    kept = tmp_path / "ds.rejected.csv"
    assert len(kept.read_text().strip().splitlines()) == 1 + 4
    assert not list(tmp_path.glob(".ds.partial*"))
    # The same input passes with a looser threshold.
    assert preprocess([src], tmp_path / "ds", max_reject_fraction=0.05)["rejected_rows"] == 4


def test_wrong_format_hints_at_the_format(data_dir, tmp_path):
    with pytest.raises(UserInputError, match="is --format 'criteo' right"):
        preprocess([data_dir / "criteo_kaggle_sample.csv"], tmp_path / "ds", fmt="criteo")


@pytest.mark.parametrize("problem", ["missing", "empty", "header", "header-only", "directory"])
def test_bad_input_files_are_clear_errors(problem, data_dir, tmp_path):
    path = tmp_path / "input.csv"
    fmt = "criteo-csv"
    if problem == "empty":
        path.write_text("")
    elif problem == "header":
        path.write_text("a,b,c\n1,2,3\n")
    elif problem == "header-only":
        path.write_text((data_dir / "criteo_kaggle_sample.csv").read_text().splitlines()[0] + "\n")
    elif problem == "directory":
        path.mkdir()
    message = {"missing": "does not exist", "empty": "is empty", "header": "header does not match",
               "header-only": "no data rows", "directory": "is not a file"}[problem]
    with pytest.raises(UserInputError, match=message):
        preprocess([path], tmp_path / "ds", fmt=fmt)


@pytest.mark.parametrize("kwargs, message", [
    (dict(fmt="parquet"), "unknown format"),
    (dict(min_frequency=0), "--min-frequency"),
    (dict(max_rows_per_table=1), "--max-rows-per-table"),
    (dict(max_reject_fraction=1.5), "--max-reject-fraction"),
])
def test_bad_parameters_are_clear_errors(kwargs, message, data_dir, tmp_path):
    with pytest.raises(UserInputError, match=message):
        preprocess([data_dir / "criteo_kaggle_sample.csv"], tmp_path / "ds", **kwargs)


def test_min_frequency_and_hash_cap(data_dir, tmp_path):
    src = data_dir / "criteo_kaggle_sample.csv"
    full, _ = _brute_force_criteo_csv(src)
    preprocess([src], tmp_path / "minf", fmt="criteo-csv", min_frequency=3)
    cols, meta = _read_dataset(tmp_path / "minf")
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    for k in range(1, 27):
        counts = Counter(r[f"C{k}"] for r in rows if r[f"C{k}"])
        frequent = sum(1 for c in counts.values() if c >= 3)
        assert meta.cardinalities[k - 1] == frequent + 1
        rare_or_missing = sum(c for c in counts.values() if c < 3) + sum(1 for r in rows if not r[f"C{k}"])
        assert np.count_nonzero(cols[f"C{k}"] == 0) == rare_or_missing
    preprocess([src], tmp_path / "cap", fmt="criteo-csv", max_rows_per_table=8)
    cols, meta = _read_dataset(tmp_path / "cap")
    assert max(meta.cardinalities) <= 8
    for k in range(1, 27):
        folded = {int(r[f"C{k}"], 16) % 7 for r in rows if r[f"C{k}"]}
        assert meta.cardinalities[k - 1] == len(folded) + 1
        assert cols[f"C{k}"].max() < 8


def test_rerun_with_unchanged_inputs_skips_and_changes_redo(data_dir, tmp_path):
    src = tmp_path / "sample.csv"
    shutil.copyfile(data_dir / "criteo_kaggle_sample.csv", src)
    first = preprocess([src], tmp_path / "ds", fmt="criteo-csv")
    part = tmp_path / "ds" / read_meta(tmp_path / "ds").files[0].name
    stamp = part.stat().st_mtime_ns
    again = preprocess([src], tmp_path / "ds", fmt="criteo-csv")
    assert not first["skipped"] and again["skipped"] and part.stat().st_mtime_ns == stamp
    assert again["fingerprint"] == first["fingerprint"]
    # Another seed is another dataset; so is a touched input.
    reseeded = preprocess([src], tmp_path / "ds", fmt="criteo-csv", seed=1)
    assert not reseeded["skipped"] and reseeded["fingerprint"] != first["fingerprint"]
    os.utime(src, ns=(time.time_ns(), time.time_ns()))
    assert not preprocess([src], tmp_path / "ds", fmt="criteo-csv", seed=1)["skipped"]
    assert preprocess([src], tmp_path / "ds", fmt="criteo-csv", seed=1, force=True)["skipped"] is False
    # Any other parameter is another dataset too.
    assert preprocess([src], tmp_path / "ds", fmt="criteo-csv", seed=1)["skipped"]
    refolded = preprocess([src], tmp_path / "ds", fmt="criteo-csv", seed=1, max_rows_per_table=8)
    assert not refolded["skipped"]
    # A dataset made from the same inputs that lost a part file is made again.
    (tmp_path / "ds" / read_meta(tmp_path / "ds").files[0].name).unlink()
    again = preprocess([src], tmp_path / "ds", fmt="criteo-csv", seed=1, max_rows_per_table=8)
    assert not again["skipped"] and again["fingerprint"] == refolded["fingerprint"]
    assert read_meta(tmp_path / "ds").rows == refolded["rows"]


def test_refuses_to_overwrite_what_is_not_a_dataset(data_dir, tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(UserInputError, match="not a dlrmflow dataset; refusing to overwrite"):
        preprocess([data_dir / "criteo_kaggle_sample.csv"], tmp_path / "precious", fmt="criteo-csv")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_incomplete_dataset_is_refused_by_readers(data_dir, tmp_path):
    preprocess([data_dir / "criteo_kaggle_sample.csv"], tmp_path / "ds", fmt="criteo-csv")
    meta = read_meta(tmp_path / "ds")
    (tmp_path / "ds" / meta.files[0].name).unlink()
    with pytest.raises(DatasetError, match="incomplete"):
        read_meta(tmp_path / "ds")
    with pytest.raises(DatasetError, match="meta.json is missing"):
        read_meta(tmp_path)


KILL_SCRIPT = """
import sys
from dlrmflow.datasets.preprocess import preprocess
preprocess([sys.argv[1]], sys.argv[2], block_bytes=1 << 20)
"""


@pytest.mark.slow
def test_killed_run_leaves_nothing_that_looks_complete(tmp_path):
    from dlrmflow.datasets.synthetic import generate

    src = tmp_path / "day_0"
    generate(src, 120_000, seed=3, scale=0.01)
    out = tmp_path / "ds"
    partial = tmp_path / ".ds.partial"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(src), str(out)])
    deadline = time.monotonic() + 60
    while not list(partial.glob("_work/*.arrow")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make the input larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    with pytest.raises(DatasetError):
        read_meta(out)
    # The next run cleans up the leftovers and completes.
    summary = preprocess([src], out, block_bytes=1 << 20)
    assert summary["rows"] == 120_000 and not partial.exists()
    assert json.loads((out / "meta.json").read_text())["rows"] == 120_000


def test_capped_integer_values_stay_integers_when_some_are_missing():
    """A capped table's blocks must all fold to int64: a block with a missing value once gave float64, and
    the vocabulary could not put it together with a block without one."""
    from dlrmflow.datasets import preprocess as pp

    with_missing = pp.cap_values(pa.array([5, None, 7], pa.int32()), 4)
    without = pp.cap_values(pa.array([5, 6, 7], pa.int32()), 4)
    assert with_missing.type == without.type == pa.int64()
    assert with_missing.to_pylist() == [5 % 3, None, 7 % 3] and without.to_pylist() == [5 % 3, 6 % 3, 7 % 3]


def _reference_parts(paths: list[Path], *, seed: int, min_frequency: int, cap: int | None, block_bytes: int,
                     kept: list[dict] | None = None, kept_cards: list[int] | None = None):
    """The whole job in one process, plainly: the same blocks and bucket draws (they define the
    shuffle; a ``.gz`` file read by one reader), one Counter per table over every row, ids by (count
    desc, value asc), each part's rows gathered in block order and permuted. -> ({part: columns}, cards)."""
    from dlrmflow.datasets import preprocess as pp
    from dlrmflow.datasets.formats import get_format, parse_block

    fmt = get_format("criteo")
    n_buckets = pp.n_buckets_for(paths, block_bytes)
    blocks = []
    for piece in pp.split_pieces(paths, fmt, block_bytes):
        header = pp.header_bytes(Path(piece.path), fmt) if piece.gzip else 0
        for k, data in enumerate(pp.iter_blocks(piece, block_bytes, header)):
            parsed = parse_block(data, fmt)
            rng = np.random.default_rng([seed, 0x0B0C, piece.file_index, piece.first_order + k])
            n = len(parsed.labels)
            bucket = rng.integers(0, n_buckets, size=n) if n_buckets > 1 else np.zeros(n, np.int64)
            values = [pp.cap_values(v, cap).to_pylist() for v in parsed.sparse]
            blocks.append((parsed, bucket, values))
    ids, cards = [], []
    for t in range(len(fmt.sparse)):
        counts = Counter(v for _, _, values in blocks for v in values[t] if v is not None)
        known = kept[t] if kept else {}
        first = kept_cards[t] if kept else 1
        ranked = sorted((v for v, c in counts.items() if c >= min_frequency and v not in known),
                        key=lambda v: (-counts[v], v))
        ids.append({**known, **{v: first + i for i, v in enumerate(ranked)}})
        cards.append(first + len(ranked))
    parts = {}
    for b in range(n_buckets):
        cols: dict[str, list] = {}
        for parsed, bucket, values in blocks:
            rows = np.flatnonzero(bucket == b)
            cols.setdefault("label", []).append(parsed.labels[rows])
            for j, name in enumerate(fmt.dense):
                cols.setdefault(name, []).append(parsed.dense[rows, j])
            for t, name in enumerate(fmt.sparse):
                cols.setdefault(name, []).append(np.array([ids[t].get(values[t][r], 0) for r in rows], np.int32))
        merged = {name: np.concatenate(arrays) for name, arrays in cols.items()}
        n = len(merged["label"])
        if n:
            perm = np.random.default_rng([seed, 0x5348, b]).permutation(n)
            parts[f"part-{b:05d}.parquet"] = {name: a[perm] for name, a in merged.items()}
    return parts, cards


def _write_tied_tsv(path: Path, n: int, seed: int) -> None:
    """Criteo TSV whose tables have many equal counts (few values, some missing) and a few bad lines."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        dense = [str(x) if x >= 0 else "" for x in rng.integers(-1, 9, 13)]
        pool = 3 + (i % 26) * 7
        cats = [f"{x:08x}" if x else "" for x in (rng.integers(0, pool, 26) * 2654435761 % (1 << 32))]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *dense, *cats]))
    for i in range(7, n, 401):
        lines[i] = "1\tnot\ta\trow"
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("seed, min_frequency, cap", [(0, 1, None), (3, 4, None), (5, 2, 13)])
def test_partitioned_vocabulary_matches_a_single_process_reference(seed, min_frequency, cap, tmp_path, monkeypatch):
    from dlrmflow.datasets import preprocess as pp

    _write_tied_tsv(tmp_path / "day_0", 1300, seed=seed)
    _write_tied_tsv(tmp_path / "day_1", 800, seed=seed + 1)
    with open(tmp_path / "day_1", "rb") as f, gzip.open(tmp_path / "day_1.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    inputs = [tmp_path / "day_0", tmp_path / "day_1.gz"]
    monkeypatch.setattr(pp, "PARTITION_PAIRS", 800)  # several value ranges per table, most of them tied
    summary = preprocess(inputs, tmp_path / "ds", block_bytes=32 << 10, seed=seed, min_frequency=min_frequency,
                         max_rows_per_table=cap, max_reject_fraction=0.05)
    expected, cards = _reference_parts(inputs, seed=seed, min_frequency=min_frequency, cap=cap,
                                       block_bytes=32 << 10)
    meta = read_meta(tmp_path / "ds")
    assert meta.rejected_rows == summary["rejected_rows"] == 4 + 2  # quarantined, as ever
    assert meta.cardinalities == cards
    assert [f.name for f in meta.files] == sorted(expected) and len(expected) > 1
    for f in meta.files:
        table = pq.read_table(tmp_path / "ds" / f.name)
        for name, want in expected[f.name].items():
            assert np.array_equal(table[name].to_numpy(), want), (f.name, name)


def _stored_vocabulary(dataset: Path) -> list[dict]:
    """Each table's {raw value: id} as the dataset's vocabulary files hold them."""
    meta = read_meta(dataset)
    out = []
    for name in meta.sparse_columns:
        pairs: dict = {}
        for f in meta.vocabulary["tables"][name]:
            t = feather.read_table(dataset / f["name"])
            values = t["value"].to_pylist()
            assert values == sorted(values) and values[0] == f["first"] and values[-1] == f["last"]
            pairs.update(zip(values, t["id"].to_pylist(), strict=True))
        out.append(pairs)
    return out


@pytest.mark.parametrize("seed, min_frequency, cap", [(0, 1, None), (3, 3, None), (5, 2, 13)])
def test_a_vocabulary_kept_from_the_day_before_keeps_its_ids_and_grows(seed, min_frequency, cap, tmp_path,
                                                                        monkeypatch):
    """Day 1 preprocessed with day 0's dataset as its vocabulary: every id of day 0 kept, values new on day 1
    numbered after them by day 1's counts (ties by value), min_frequency on the new ones; a capped table
    folds into its existing rows. Checked against the single-process reference given day 0's ids."""
    from dlrmflow.datasets import preprocess as pp

    _write_tied_tsv(tmp_path / "day_0", 1100, seed=seed)
    _write_tied_tsv(tmp_path / "day_1", 900, seed=seed + 10)
    monkeypatch.setattr(pp, "PARTITION_PAIRS", 500)  # several ranges per table, unlike the day before's
    settings = dict(block_bytes=32 << 10, seed=seed, min_frequency=min_frequency, max_rows_per_table=cap,
                    max_reject_fraction=0.05)
    preprocess([tmp_path / "day_0"], tmp_path / "ds0", **settings)
    day0 = _stored_vocabulary(tmp_path / "ds0")
    monkeypatch.setattr(pp, "PARTITION_PAIRS", 800)
    preprocess([tmp_path / "day_1"], tmp_path / "ds1", vocabulary=tmp_path / "ds0", **settings)
    meta0, meta1 = read_meta(tmp_path / "ds0"), read_meta(tmp_path / "ds1")
    expected, cards = _reference_parts([tmp_path / "day_1"], seed=seed, min_frequency=min_frequency, cap=cap,
                                       block_bytes=32 << 10, kept=day0, kept_cards=meta0.cardinalities)
    assert meta1.cardinalities == cards
    assert all(c1 >= c0 for c0, c1 in zip(meta0.cardinalities, meta1.cardinalities, strict=True))
    assert sum(meta1.cardinalities) > sum(meta0.cardinalities) or cap  # new values did arrive
    if cap:
        assert max(meta1.cardinalities) <= cap
    assert meta1.vocabulary["parent"] == {"dataset": str((tmp_path / "ds0").resolve()),
                                          "fingerprint": meta0.fingerprint}
    day1 = _stored_vocabulary(tmp_path / "ds1")
    for t, (old, new) in enumerate(zip(day0, day1, strict=True)):
        assert {v: new[v] for v in old} == old, t  # every id of day 0, unchanged
        assert sorted(new.values()) == list(range(1, cards[t]))  # contiguous, nothing lost
    for f in meta1.files:
        table = pq.read_table(tmp_path / "ds1" / f.name)
        for name, want in expected[f.name].items():
            assert np.array_equal(table[name].to_numpy(), want), (f.name, name)


def test_a_day_preprocessed_with_its_own_dataset_as_vocabulary_gets_the_same_ids(tmp_path):
    _write_tied_tsv(tmp_path / "day_0", 1500, seed=2)
    preprocess([tmp_path / "day_0"], tmp_path / "ds", block_bytes=32 << 10, min_frequency=2,
               max_reject_fraction=0.05)
    before = {f.name: (tmp_path / "ds" / f.name).read_bytes() for f in read_meta(tmp_path / "ds").files}
    preprocess([tmp_path / "day_0"], tmp_path / "again", block_bytes=32 << 10, min_frequency=2,
               max_reject_fraction=0.05, vocabulary=tmp_path / "ds")
    assert {f.name: (tmp_path / "again" / f.name).read_bytes() for f in read_meta(tmp_path / "again").files} == before
    assert read_meta(tmp_path / "again").cardinalities == read_meta(tmp_path / "ds").cardinalities


def test_a_growing_vocabulary_records_its_lineage_and_refuses_a_day_it_already_holds(tmp_path):
    """Each dataset lists the datasets its ids descend from, oldest first, with their table sizes (the layouts
    rows are first initialised in) and inputs; a day file one of them already holds is refused, nothing
    written."""
    run = dict(block_bytes=32 << 10, max_reject_fraction=0.05)
    for day in range(3):
        _write_tied_tsv(tmp_path / f"day_{day}", 600, seed=day)
    preprocess([tmp_path / "day_0"], tmp_path / "ds0", **run)
    preprocess([tmp_path / "day_1"], tmp_path / "ds1", vocabulary=tmp_path / "ds0", **run)
    preprocess([tmp_path / "day_2"], tmp_path / "ds2", vocabulary=tmp_path / "ds1", **run)
    metas = [read_meta(tmp_path / f"ds{d}") for d in range(3)]
    assert metas[0].vocabulary["lineage"] == [] and metas[0].earlier_cardinalities == ()
    assert [e["fingerprint"] for e in metas[2].vocabulary["lineage"]] == [metas[0].fingerprint, metas[1].fingerprint]
    assert metas[2].vocabulary["lineage"][0]["inputs"] == [str((tmp_path / "day_0").resolve())]
    assert metas[2].earlier_cardinalities == (tuple(metas[0].cardinalities), tuple(metas[1].cardinalities))
    assert metas[2].descends_from(metas[0].fingerprint) and not metas[0].descends_from(metas[2].fingerprint)
    for day in (0, 1):
        with pytest.raises(UserInputError, match=f"day_{day} was already preprocessed into .*ds{day}"):
            preprocess([tmp_path / f"day_{day}"], tmp_path / "x", vocabulary=tmp_path / "ds2", **run)
    with pytest.raises(UserInputError, match="day_0 was already preprocessed"):  # among new days, too
        preprocess([tmp_path / "day_2", tmp_path / "day_0"], tmp_path / "x", vocabulary=tmp_path / "ds1", **run)
    shutil.copyfile(tmp_path / "day_1", tmp_path / "day_1_again")  # delivered twice, under another name
    with pytest.raises(UserInputError, match="day_1_again has the content of a file already preprocessed into "
                                             ".*ds1"):
        preprocess([tmp_path / "day_1_again"], tmp_path / "x", vocabulary=tmp_path / "ds2", **run)
    assert not (tmp_path / "x").exists()


def test_preprocess_refuses_a_day_its_vocabulary_holds_in_one_line_before_any_work(tmp_path, capsys):
    from dlrmflow.cli import main

    for day in range(2):
        _write_tied_tsv(tmp_path / f"day_{day}", 300, seed=day)
    preprocess([tmp_path / "day_0"], tmp_path / "ds0", max_reject_fraction=0.05)
    preprocess([tmp_path / "day_1"], tmp_path / "ds1", vocabulary=tmp_path / "ds0", max_reject_fraction=0.05)
    capsys.readouterr()
    assert main(["preprocess", str(tmp_path / "day_0"), "--output", str(tmp_path / "x"), "--vocabulary",
                 str(tmp_path / "ds1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "day_0 was already preprocessed into" in err[0], err
    assert not (tmp_path / "x").exists()


def test_a_vocabulary_that_cannot_serve_is_a_clear_error(tmp_path, data_dir):
    _write_tied_tsv(tmp_path / "day_0", 300, seed=1)
    preprocess([tmp_path / "day_0"], tmp_path / "ds", max_reject_fraction=0.05)
    run = dict(max_reject_fraction=0.05)
    with pytest.raises(UserInputError, match="does not exist"):
        preprocess([tmp_path / "day_0"], tmp_path / "x", vocabulary=tmp_path / "nowhere", **run)
    with pytest.raises(UserInputError, match="max-rows-per-table None, this run has 50"):
        preprocess([tmp_path / "day_0"], tmp_path / "x", vocabulary=tmp_path / "ds", max_rows_per_table=50, **run)
    with pytest.raises(UserInputError, match="'criteo', this run is --format 'criteo-csv'"):
        preprocess([data_dir / "criteo_kaggle_sample.csv"], tmp_path / "x", vocabulary=tmp_path / "ds",
                   fmt="criteo-csv", **run)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    meta["vocabulary"] = None  # as a dataset written from arrays has it
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserInputError, match="keeps no vocabulary"):
        preprocess([tmp_path / "day_0"], tmp_path / "x", vocabulary=tmp_path / "ds", **run)
    assert not (tmp_path / "x").exists()
