"""Raw input formats and the parsing of one block of lines into validated columns.

Three formats, all line oriented:

* ``criteo``: the Criteo Kaggle / Terabyte raw files (``train.txt``, ``day_0 .. day_23``):
  tab separated, no header, 40 fields: label, I1-I13 integers (may be negative or empty),
  C1-C26 8-hex-digit hashes or empty.
* ``criteo-csv``: the same fields comma separated with a header ``label,I1..I13,C1..C26``
  (DeepCTR's sample layout); dense values may be written as floats (``260.0``).
* ``avazu``: CSV with a 24-column header; ``click`` is the label, every other column but ``id``
  is categorical, and ``hour`` (YYMMDDHH) also yields ``hour_of_day`` and ``weekday``.

:func:`parse_block` turns the bytes of whole lines into a :class:`ParsedBlock`: the label, the
transformed dense matrix, one raw-value array per categorical table, and the rejected lines
with their reasons. It never drops a line silently: every input line is either a row or a
rejection, and ``n_lines`` counts both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]
AVAZU_HEADER = (
    "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,"
    "device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
).split(",")
AVAZU_SPARSE = [c for c in AVAZU_HEADER if c not in ("id", "click")] + ["hour_of_day", "weekday"]

# Bytes that are hex digits map to their value, every other byte to 255 (caught as invalid).
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_HEX_SHIFTS = np.array([28, 24, 20, 16, 12, 8, 4, 0], dtype=np.int64)


@dataclass(frozen=True)
class RawFormat:
    name: str
    delimiter: str
    fields: list[str]  # the columns of one input line, in order
    has_header: bool
    label: str
    dense: list[str]
    sparse: list[str]  # output categorical tables, in order
    hex_sparse: bool  # categorical values are 8-hex-digit hashes (parsed to integers)

    @property
    def header_line(self) -> str:
        return self.delimiter.join(self.fields)


FORMATS: dict[str, RawFormat] = {
    "criteo": RawFormat("criteo", "\t", ["label", *CRITEO_DENSE, *CRITEO_SPARSE], False, "label",
                        CRITEO_DENSE, CRITEO_SPARSE, True),
    "criteo-csv": RawFormat("criteo-csv", ",", ["label", *CRITEO_DENSE, *CRITEO_SPARSE], True, "label",
                            CRITEO_DENSE, CRITEO_SPARSE, True),
    "avazu": RawFormat("avazu", ",", AVAZU_HEADER, True, "click", [], AVAZU_SPARSE, False),
}


def get_format(name: str) -> RawFormat:
    from dlrmflow.engine.errors import UserInputError

    try:
        return FORMATS[name]
    except KeyError:
        raise UserInputError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}") from None


@dataclass
class ParsedBlock:
    """The rows of one block that passed validation, plus what was rejected and why."""

    n_lines: int
    labels: np.ndarray  # int8 [n]
    dense: np.ndarray  # float32 [n, D], transformed
    sparse: list[pa.Array]  # per table: int64 hash values (criteo) or strings (avazu); null = missing
    rejects: list[tuple[int, str, str]] = field(default_factory=list)  # (1-based line in block, reason, text)


def transform_dense(values: np.ndarray) -> np.ndarray:
    """The facebookresearch/dlrm dense transform: negatives -> 0, then log(x + 1), as float32.

    ``values`` is float64 with NaN for missing (-> 0). log1p runs in float64 and rounds once.
    """
    x = np.nan_to_num(values, nan=0.0)
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)


_LOG1P_TABLE_SIZE = 1 << 16  # Criteo's integer features are mostly small: their transform is a table lookup
_log1p_table: np.ndarray | None = None


def transform_dense_integers(values: np.ndarray) -> np.ndarray:
    """:func:`transform_dense` of integer features (missing ones given as 0), bit for bit: values
    below 2**16 read ``np.log1p`` of their float64 from a table, the rest compute it (every element goes
    through the same float64 log1p either way; a test compares both)."""
    global _log1p_table
    if _log1p_table is None:
        _log1p_table = np.log1p(np.arange(_LOG1P_TABLE_SIZE, dtype=np.float64)).astype(np.float32)
    x = np.maximum(values, 0)
    small = x < _LOG1P_TABLE_SIZE
    out = _log1p_table[np.where(small, x, 0)]
    if not small.all():
        big = ~small
        out[big] = np.log1p(x[big].astype(np.float64)).astype(np.float32)
    return out


_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)


def _bytes_in_range(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per byte of uint64 words (every byte < 0x80): high bit set iff lo <= byte <= hi."""
    ge_lo = (x + np.uint64(0x80 - lo) * _ONES) & _HIGHS
    gt_hi = (x + np.uint64(0x7F - hi) * _ONES) & _HIGHS
    return ge_lo & ~gt_hi


def hex8_words_to_int(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """8 ASCII hex digits packed in little-endian uint64 words -> (int64 values, ok mask).

    SWAR ("SIMD within a register"): all eight digits of a value are validated and decoded
    with a handful of whole-word operations instead of eight table lookups; Criteo files hold
    26 such values per line, so this is the parser's hottest loop.
    """
    ascii_ok = (words & _HIGHS) == 0
    x = np.where(ascii_ok, words, np.uint64(0x3030303030303030))
    digit = _bytes_in_range(x, 0x30, 0x39) | _bytes_in_range(x, 0x41, 0x46) | _bytes_in_range(x, 0x61, 0x66)
    ok = ascii_ok & (digit == _HIGHS)
    # '0'-'9' -> c & 0xF; 'a'-'f' and 'A'-'F' have bit 6 set and c & 0xF in 1..6: add 9.
    nibbles = (x & np.uint64(0x0F0F0F0F0F0F0F0F)) + ((x >> np.uint64(6)) & _ONES) * np.uint64(9)
    # First character is the lowest byte and the most significant nibble: pair bytes into
    # (even << 4 | odd), then read the four pair bytes as a big-endian uint32.
    pairs = ((nibbles & np.uint64(0x000F000F000F000F)) << np.uint64(4)) | (
        (nibbles >> np.uint64(8)) & np.uint64(0x000F000F000F000F)
    )
    four = np.ascontiguousarray(pairs.view(np.uint8).reshape(-1, 8)[:, 0::2])
    return four.view(">u4").ravel().astype(np.int64), ok


def _hex_digits_to_int(digits: np.ndarray) -> np.ndarray:
    """[m, 8] nibble values (each < 16) -> int64 values of the 8-digit hex numbers."""
    packed = (digits[:, 0::2] << 4) | digits[:, 1::2]  # [m, 4] bytes, most significant first
    return np.ascontiguousarray(packed).view(">u4").ravel().astype(np.int64)


def _hex_values(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """8-hex-digit strings -> (int64 values, ok mask). Null (empty) is ok and gives -1."""
    n = len(col)
    valid = np.ones(n, dtype=bool) if col.null_count == 0 else col.is_valid().to_numpy(zero_copy_only=False)
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32, count=n + 1, offset=col.offset * 4)
    data = col.buffers()[2]
    lengths = np.diff(offsets)
    values = np.full(n, -1, dtype=np.int64)
    ok = ~valid | (lengths == 8)
    rows = np.flatnonzero(valid & (lengths == 8))
    if data is None or not len(rows):
        return values, ok
    raw = np.frombuffer(data, dtype=np.uint8)
    digits = _HEX_LUT[raw[offsets[rows][:, None] + np.arange(8)]]
    bad_digit = (digits == 255).any(axis=1)
    ok[rows[bad_digit]] = False
    good = rows[~bad_digit]
    values[good] = _hex_digits_to_int(digits[~bad_digit])
    return values, ok


def dense_in_range(values: np.ndarray) -> np.ndarray:
    """Per float64 value (NaN = missing): missing, or an integral value within int64.

    The one rule for dense values in every format: ``I1..I13`` are integer counts, transformed as
    log(x + 1), and raw Criteo text holds int64 integers; the CSV layout's floats (``260.0``,
    ``1e20``) must be integral and within the same range, so both readers accept the same values.
    """
    finite = np.isfinite(values)
    integral = finite & (values == np.floor(np.where(finite, values, 0.0)))
    return np.isnan(values) | (integral & (values >= -(2.0**63)) & (values < 2.0**63))


def _int64_text_in_range(text: pa.Array, matches: np.ndarray) -> np.ndarray:
    """Per value of ``text`` that ``matches`` the integer pattern: whether int64 holds it."""
    lengths = pc.fill_null(pc.utf8_length(text), 0).to_numpy(zero_copy_only=False)
    in_range = ~matches | (lengths < 19)  # up to 18 digits and a sign: always within int64
    for i in np.flatnonzero(~in_range):
        in_range[i] = -(2**63) <= int(text[i].as_py()) < 2**63
    return in_range


def _dense_values(col: pa.Array, integers_only_text: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dense text -> (float64 values with NaN for missing, well-formed mask, in-range mask).

    Raw Criteo writes integers; the CSV layout writes integral floats (``260.0``). Both must hold
    an integer (``abc``, ``2.5`` are not well formed) within int64 (``99999999999999999999`` and
    ``1e20`` are well formed, but out of range: :func:`dense_in_range`). A value that is not both
    reads as missing.
    """
    target = pa.int64() if integers_only_text else pa.float64()
    try:
        values = pc.cast(col, target).to_numpy(zero_copy_only=False).astype(np.float64)
        ok = np.ones(len(col), dtype=bool)
        in_range = np.ones(len(col), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        # Slow path, only for blocks that hold a malformed or out-of-range value: find which ones.
        pattern = r"^-?[0-9]+$" if integers_only_text else r"^-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"
        matches = pc.fill_null(pc.match_substring_regex(col, pattern), False)
        ok = pc.or_kleene(matches, pc.is_null(col)).to_numpy(zero_copy_only=False)
        in_range = (_int64_text_in_range(col, matches.to_numpy(zero_copy_only=False)) if integers_only_text
                    else np.ones(len(col), dtype=bool))
        usable = pa.array(ok & in_range) if integers_only_text else matches
        values = pc.cast(pc.if_else(usable, col, None), target).to_numpy(zero_copy_only=False).astype(np.float64)
    if not integers_only_text:
        integral = np.isnan(values) | (np.isfinite(values) & (values == np.floor(values)))
        ok &= integral
        in_range = dense_in_range(values) | ~ok
    values[~(ok & in_range)] = np.nan
    return values, ok, in_range


def _avazu_time_features(hour: pa.Array) -> tuple[pa.Array, pa.Array, np.ndarray]:
    """``hour`` YYMMDDHH -> (hour_of_day, weekday) as strings, and an ok mask."""
    text = hour.to_numpy(zero_copy_only=False)
    ok = np.array([isinstance(h, str) and len(h) == 8 and h.isdigit() for h in text], dtype=bool)
    hod = np.full(len(text), None, dtype=object)
    wday = np.full(len(text), None, dtype=object)
    if ok.any():
        good = text[ok]
        yy = np.array([int(h[0:2]) for h in good])
        mm = np.array([int(h[2:4]) for h in good])
        dd = np.array([int(h[4:6]) for h in good])
        hh = np.array([int(h[6:8]) for h in good])
        dates = np.array([f"20{y:02d}-{m:02d}-{d:02d}" for y, m, d in zip(yy, mm, dd, strict=True)])
        valid_date = (mm >= 1) & (mm <= 12) & (dd >= 1) & (dd <= 31) & (hh <= 23)
        days = np.zeros(len(good), dtype=np.int64)
        for i in np.flatnonzero(valid_date):
            try:
                days[i] = np.datetime64(dates[i], "D").astype(np.int64)
            except ValueError:  # e.g. Feb 30
                valid_date[i] = False
        idx = np.flatnonzero(ok)
        ok[idx[~valid_date]] = False
        sel = idx[valid_date]
        hod[sel] = [str(h) for h in hh[valid_date]]
        # 1970-01-01 was a Thursday: (days + 3) % 7 gives Monday = 0.
        wday[sel] = [str(w) for w in (days[valid_date] + 3) % 7]
    return pa.array(hod, type=pa.string()), pa.array(wday, type=pa.string()), ok


def _count_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


# Arrow's parse buffer for clean blocks: 1 MiB stays in cache (2-3x less CPU than one buffer for the block).
CLEAN_READ_BLOCK = 1 << 20


def _read_csv(
    data: bytes, fmt: RawFormat, types: dict[str, pa.DataType], on_invalid, block_size: int = 1 << 30
) -> pa.Table:
    """One Arrow CSV read of ``data``. The validating path keeps the whole block in one buffer, so that
    ``on_invalid`` sees row numbers counted from the block's start."""
    return pa_csv.read_csv(
        pa.py_buffer(data),
        read_options=pa_csv.ReadOptions(column_names=fmt.fields, use_threads=False, block_size=block_size),
        parse_options=pa_csv.ParseOptions(
            delimiter=fmt.delimiter,
            quote_char=False if fmt.name == "criteo" else '"',
            ignore_empty_lines=False,
            invalid_row_handler=on_invalid,
        ),
        convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=True, null_values=[""]),
    )


def _blank_lines_not_utf8(data: bytes, fmt: RawFormat) -> tuple[bytes, list[int]]:
    """``data`` with every line that is not UTF-8 replaced by a line of empty fields (so that it
    still parses as one row, which the caller rejects), and the 1-based numbers of those lines."""
    try:
        data.decode("utf-8")
        return data, []
    except UnicodeDecodeError:
        pass
    lines = data.split(b"\n")
    blank = fmt.delimiter.encode() * (len(fmt.fields) - 1)
    bad = []
    for i, line in enumerate(lines):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            lines[i] = blank
            bad.append(i + 1)
    return b"\n".join(lines), bad


def parse_block(data: bytes, fmt: RawFormat) -> ParsedBlock:
    """Parse whole lines (no header) of ``fmt``; reject malformed lines with a reason.

    Clean Criteo blocks take a fast typed path; a block with anything unusual in it is parsed
    again by the validating path, which finds and explains every bad line.
    """
    if fmt.hex_sparse:
        parsed = _parse_clean_hex_block(data, fmt)
        if parsed is not None:
            return parsed
    return _parse_validating(data, fmt)


def _parse_clean_hex_block(data: bytes, fmt: RawFormat) -> ParsedBlock | None:
    """Typed parse of a block with no malformed line; None as soon as anything is off."""
    types = {fmt.label: pa.int8()}
    types |= {c: pa.int64() if fmt.name == "criteo" else pa.float64() for c in fmt.dense}
    types |= {c: pa.binary(8) for c in fmt.sparse}
    try:
        table = _read_csv(data, fmt, types, lambda row: "error", CLEAN_READ_BLOCK)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    label = table.column(fmt.label).combine_chunks()
    if label.null_count or (len(label) and (pc.min(label).as_py() < 0 or pc.max(label).as_py() > 1)):
        return None
    if fmt.name == "criteo":
        dense_out = np.empty((table.num_rows, len(fmt.dense)), dtype=np.float32)
        for j, name in enumerate(fmt.dense):
            col = pc.fill_null(table.column(name).combine_chunks(), 0)
            dense_out[:, j] = transform_dense_integers(col.to_numpy())
    else:
        dense = np.zeros((table.num_rows, len(fmt.dense)), dtype=np.float64)
        for j, name in enumerate(fmt.dense):
            dense[:, j] = table.column(name).combine_chunks().to_numpy(zero_copy_only=False)
        if not dense_in_range(dense).all():
            return None  # a non-integral or out-of-range float: the validating path names it
        dense_out = transform_dense(dense)
    sparse = []
    for name in fmt.sparse:
        col = table.column(name).combine_chunks()
        n = len(col)
        words = np.frombuffer(col.buffers()[1], dtype="<u8", count=n + col.offset)[col.offset:]
        values, ok = hex8_words_to_int(words)
        valid = None
        if col.null_count:
            valid = col.is_valid().to_numpy(zero_copy_only=False)
            ok |= ~valid
        if not ok.all():
            return None
        sparse.append(pa.array(values, mask=None if valid is None else ~valid))
    return ParsedBlock(
        n_lines=_count_lines(data),
        labels=label.to_numpy(zero_copy_only=False).astype(np.int8),
        dense=dense_out,
        sparse=sparse,
    )


def _parse_validating(data: bytes, fmt: RawFormat) -> ParsedBlock:
    rejects: list[tuple[int, str, str]] = []

    def on_invalid(row: pa_csv.InvalidRow) -> str:
        rejects.append((row.number, f"expected {row.expected_columns} fields, got {row.actual_columns}",
                        row.text))
        return "skip"

    n_lines = _count_lines(data)
    text_data, not_utf8_lines = _blank_lines_not_utf8(data, fmt)
    table = _read_csv(text_data, fmt, {c: pa.string() for c in fmt.fields}, on_invalid)
    n = table.num_rows
    # Line number (1-based, within the block) of every parsed row: the lines not rejected, in order.
    invalid_lines = np.array(sorted(r[0] for r in rejects), dtype=np.int64)
    all_lines = np.arange(1, n_lines + 1, dtype=np.int64)
    row_lines = np.setdiff1d(all_lines, invalid_lines, assume_unique=True) if len(invalid_lines) else all_lines
    assert len(row_lines) == n, "every line is a row or a rejection"

    reasons = np.full(n, None, dtype=object)

    def reject(mask: np.ndarray, reason: str) -> None:
        new = mask & (reasons == None)  # noqa: E711 - elementwise on an object array
        reasons[new] = reason

    if not_utf8_lines:
        reject(np.isin(row_lines, not_utf8_lines), "not UTF-8 text")
    label_col = table.column(fmt.label)
    label_text = label_col.combine_chunks()
    is_zero = pc.equal(label_text, "0").fill_null(False).to_numpy(zero_copy_only=False)
    is_one = pc.equal(label_text, "1").fill_null(False).to_numpy(zero_copy_only=False)
    empty_line = np.ones(n, dtype=bool)
    for c in fmt.fields:
        empty_line &= table.column(c).is_null().to_numpy(zero_copy_only=False)
    reject(empty_line, "empty line")
    reject(~(is_zero | is_one), f"{fmt.label}: label must be 0 or 1")

    dense = np.zeros((n, len(fmt.dense)), dtype=np.float64)
    for j, name in enumerate(fmt.dense):
        values, ok, in_range = _dense_values(table.column(name).combine_chunks(),
                                             integers_only_text=fmt.name == "criteo")
        reject(~ok, f"{name}: non-integer dense value")
        reject(~in_range, f"{name}: dense value outside the 64-bit integer range")
        dense[:, j] = values

    sparse: list[pa.Array] = []
    if fmt.hex_sparse:
        for name in fmt.sparse:
            values, ok = _hex_values(table.column(name).combine_chunks())
            reject(~ok, f"{name}: not an 8-digit hex hash")
            sparse.append(pa.array(values, mask=values < 0))
    else:
        for name in fmt.sparse[:-2]:
            sparse.append(table.column(name).combine_chunks())
        hod, wday, ok = _avazu_time_features(table.column("hour").combine_chunks())
        reject(~ok, "hour: not a valid YYMMDDHH time")
        sparse += [hod, wday]

    bad = np.flatnonzero(reasons != None)  # noqa: E711
    if len(bad):
        lines = data.split(b"\n")
        for i in bad:
            line_no = int(row_lines[i])
            rejects.append((line_no, reasons[i], lines[line_no - 1].decode("utf-8", "replace").rstrip("\r")))
        keep = np.ones(n, dtype=bool)
        keep[bad] = False
        keep_idx = pa.array(np.flatnonzero(keep))
        sparse = [s.take(keep_idx) for s in sparse]
        dense = dense[keep]
        labels = is_one[keep]
    else:
        labels = is_one
    rejects.sort()
    return ParsedBlock(
        n_lines=n_lines,
        labels=labels.astype(np.int8),
        dense=transform_dense(dense),
        sparse=sparse,
        rejects=rejects,
    )
