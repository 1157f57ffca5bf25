"""Parsing of the raw formats: the real samples field by field, and every kind of bad line."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from dlrmflow.datasets.formats import FORMATS, _parse_validating, hex8_words_to_int, parse_block


def _body(path) -> bytes:
    return path.read_bytes().split(b"\n", 1)[1]


def _csv_rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_criteo_sample_fields_parse_exactly(data_dir):
    path = data_dir / "criteo_kaggle_sample.csv"
    block = parse_block(_body(path), FORMATS["criteo-csv"])
    rows = _csv_rows(path)
    assert block.n_lines == len(rows) == 200 and not block.rejects
    # Row 2 of the file (first data row): label 0, I2=3, I3=260.0, I1 empty, C1=05db9164, C19 empty.
    assert block.labels[0] == 0
    assert block.dense[0, 0] == 0.0  # I1 missing -> 0
    assert block.dense[0, 1] == np.float32(math.log1p(3))
    assert block.dense[0, 2] == np.float32(math.log1p(260))
    assert block.sparse[0][0].as_py() == 0x05DB9164
    assert block.sparse[18][0].as_py() is None
    # Second data row has I2 = -1: negatives become 0 before the log.
    assert rows[1]["I2"] == "-1" and block.dense[1, 1] == 0.0
    # Every field of every row equals a plain-Python reading of the CSV.
    for i, row in enumerate(rows):
        assert block.labels[i] == int(row["label"])
        for j in range(13):
            text = row[f"I{j + 1}"]
            want = 0.0 if text == "" else math.log1p(max(float(text), 0.0))
            assert block.dense[i, j] == np.float32(want), (i, j)
        for k in range(26):
            text = row[f"C{k + 1}"]
            assert block.sparse[k][i].as_py() == (None if text == "" else int(text, 16)), (i, k)


def test_avazu_sample_fields_and_time_features(data_dir):
    path = data_dir / "avazu_sample.csv"
    block = parse_block(_body(path), FORMATS["avazu"])
    rows = _csv_rows(path)
    assert block.n_lines == len(rows) == 100 and not block.rejects
    fmt = FORMATS["avazu"]
    assert len(fmt.sparse) == 24 and block.dense.shape == (100, 0)
    for i, row in enumerate(rows):
        assert block.labels[i] == int(row["click"])
        for k, name in enumerate(fmt.sparse[:-2]):
            assert block.sparse[k][i].as_py() == row[name]
    # 14102100 is 2014-10-21 00h, a Tuesday (Monday = 0).
    assert rows[0]["hour"] == "14102100"
    assert block.sparse[-2][0].as_py() == "0" and block.sparse[-1][0].as_py() == "1"


def _criteo_line(label="0", dense=None, cats=None) -> str:
    dense = dense if dense is not None else ["1"] * 13
    cats = cats if cats is not None else ["05db9164"] * 26
    return "\t".join([label, *dense, *cats])


def test_every_kind_of_bad_line_is_rejected_with_its_line_number():
    good = _criteo_line()
    lines = [
        good,
        "0\t1\t2",  # wrong field count
        _criteo_line(dense=["1"] * 12 + ["x1"]),  # non-integer dense
        _criteo_line(dense=["2.5"] + ["1"] * 12),  # a float in the integer format
        _criteo_line(cats=["05db916g"] + ["05db9164"] * 25),  # non-hex
        _criteo_line(cats=["05db91"] + ["05db9164"] * 25),  # wrong hash length
        _criteo_line(label="2"),
        _criteo_line(label=""),
        "",  # empty line
        good,
    ]
    block = parse_block(("\n".join(lines) + "\n").encode(), FORMATS["criteo"])
    assert block.n_lines == 10 and len(block.labels) == 2
    reasons = {line: why for line, why, _ in block.rejects}
    assert reasons == {
        2: "expected 40 fields, got 3",
        3: "I13: non-integer dense value",
        4: "I1: non-integer dense value",
        5: "C1: not an 8-digit hex hash",
        6: "C1: not an 8-digit hex hash",
        7: "label: label must be 0 or 1",
        8: "label: label must be 0 or 1",
        9: "empty line",
    }
    texts = {line: text for line, _, text in block.rejects}
    assert texts[3] == lines[2] and texts[2] == lines[1]


def test_fast_path_equals_validating_path_on_clean_data(data_dir):
    body = _body(data_dir / "criteo_kaggle_sample.csv")
    fast = parse_block(body, FORMATS["criteo-csv"])
    slow = _parse_validating(body, FORMATS["criteo-csv"])
    assert np.array_equal(fast.labels, slow.labels)
    assert np.array_equal(fast.dense.view(np.uint32), slow.dense.view(np.uint32))
    assert all(a.equals(b) for a, b in zip(fast.sparse, slow.sparse, strict=True))


def test_criteo_csv_accepts_integral_floats_and_rejects_fractions():
    header_free = "\n".join([
        ",".join(["1", "260.0", "-1", *["0"] * 11, *["05db9164"] * 26]),
        ",".join(["1", "2.5", *["0"] * 12, *["05db9164"] * 26]),
        ",".join(["1", "inf", *["0"] * 12, *["05db9164"] * 26]),
    ]) + "\n"
    block = parse_block(header_free.encode(), FORMATS["criteo-csv"])
    assert len(block.labels) == 1
    assert block.dense[0, 0] == np.float32(math.log1p(260)) and block.dense[0, 1] == 0.0
    assert [(line, why) for line, why, _ in block.rejects] == [
        (2, "I1: non-integer dense value"), (3, "I1: non-integer dense value")]


@pytest.mark.parametrize("case", ["%08x", "%08X"])
def test_swar_hex_decoder_matches_python(case):
    values = np.random.default_rng(7).integers(0, 1 << 32, 5000)
    words = np.frombuffer("".join(case % v for v in values).encode(), dtype="<u8")
    decoded, ok = hex8_words_to_int(words)
    assert ok.all() and np.array_equal(decoded, values)


def test_swar_hex_decoder_rejects_every_non_hex_byte():
    # Put each of the 256 byte values at each of the 8 positions of an otherwise valid hash.
    hexdigits = set(b"0123456789abcdefABCDEF")
    cases, expected = [], []
    for byte in range(256):
        for pos in range(8):
            text = bytearray(b"0123abcd")
            text[pos] = byte
            cases.append(bytes(text))
            expected.append(byte in hexdigits)
    _, ok = hex8_words_to_int(np.frombuffer(b"".join(cases), dtype="<u8"))
    assert ok.tolist() == expected


def test_integer_dense_transform_is_the_float_transform_bit_for_bit():
    """The clean path's table lookup gives exactly transform_dense's bits, on both sides of the table's end."""
    from dlrmflow.datasets.formats import _LOG1P_TABLE_SIZE, transform_dense, transform_dense_integers

    rng = np.random.default_rng(7)
    edge = _LOG1P_TABLE_SIZE
    values = np.concatenate([
        np.arange(-5, 2000), np.arange(edge - 50, edge + 50), rng.integers(-(1 << 40), 1 << 40, 20_000),
        rng.integers(0, edge, 20_000), np.array([(1 << 53) + 1, (1 << 62), -(1 << 62)]),
    ]).astype(np.int64)
    got = transform_dense_integers(values.copy())
    want = transform_dense(values.astype(np.float64))
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
