"""Raw files -> a shuffled Parquet dataset with frequency-ordered categorical ids.

The job runs in parallel stages over a Dask cluster (or in-process without one). No task holds
more than a block, a bucket or a vocabulary partition, whatever the number of rows:

0. **split** (one task per ``.gz`` input): decompress it into a plain file cut where a single reader
   would cut its blocks, so its pieces parse in parallel (gzip cannot be entered mid-stream).
1. **parse** (one task per piece, a byte range of a plain file): parse and validate lines, transform
   dense values, draw each row's output bucket (the first pass of a two-pass shuffle), and write the
   block ordered by bucket. Per table it writes the block's distinct values in value order with
   their counts, and the (value, bucket) pairs present; a row's categorical column holds its value's
   code in its bucket's *slice* (the block's values present in that bucket). Rejected lines go to a
   per-block file with their reasons.
2. **vocabulary**, per table split into value ranges of about PARTITION_PAIRS pairs:
   (a) one task per partition adds up its values' counts over every block, applies
   ``min_frequency`` and ranks them (frequency, ties by value); the driver adds up the partitions'
   count histograms into each partition's id offsets; (b) one task per partition writes the ids of
   its values for every (bucket, block) slice, bucket-major, and its part of the dataset's vocabulary
   (datasets/vocabulary.py). With ``--vocabulary`` (an earlier dataset), the values it has keep their
   ids and only the new ones are ranked, after them.
3. **write** (one task per output part): read the bucket's rows from every block and the bucket's
   ids from every partition, map slice codes to ids, permute the rows with a generator seeded by
   (seed, part) -- the second pass of the shuffle -- and write ``part-NNNNN.parquet``.

Everything is written under a hidden ``.NAME.partial`` directory next to the output and
renamed into place at the end, so an interrupted run never leaves a dataset that looks
complete. Rerunning with unchanged inputs (path, size, mtime) and parameters finds the same
fingerprint in ``meta.json`` and skips the work (:meth:`PreprocessConfig.saved_result
<dlrmflow.datasets.preprocess_config.PreprocessConfig.saved_result>`).

The result depends only on the inputs and parameters (including ``block_bytes``, which fixes
the pieces), never on the number of workers or of vocabulary partitions.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from dlrmflow.datasets.formats import ParsedBlock, RawFormat, get_format, parse_block
from dlrmflow.datasets.meta import META_FILE, ROW_GROUP_ROWS, DatasetMeta, PartFile, write_meta
from dlrmflow.datasets.preprocess_config import PreprocessConfig, PreprocessResult
from dlrmflow.datasets.vocabulary import (
    ParentVocabulary,
    VocabularyFile,
    content_digest,
    load_parent,
    read_range,
    refuse_processed_inputs,
    value_order,
    value_range,
    vocabulary_record,
    write_partition,
)
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.run_lock import output_lock
from dlrmflow.engine.up_to_date import file_identity

GZIP_EXPANSION_ESTIMATE = 4  # compressed Criteo text expands about 4x; only sizes the shuffle


@dataclass(frozen=True)
class PreprocessParams:
    """What the tasks need of a :class:`PreprocessConfig` (:meth:`~PreprocessConfig.params`; checked there)."""

    fmt: str
    seed: int
    min_frequency: int
    max_rows_per_table: int | None
    max_reject_fraction: float
    block_bytes: int


@dataclass(frozen=True)
class Piece:
    """A unit of parse work: bytes [start, stop) of a plain file, or a whole gzip file."""

    index: int
    file_index: int
    path: str
    start: int
    stop: int
    gzip: bool
    first_order: int  # position of its first block within its file (orders blocks for line numbers)


@dataclass
class BlockResult:
    """What the parse stage reports for one block (a piece yields one or more blocks)."""

    file_index: int
    order: int  # block position within its file
    ipc_path: str  # the rows, ordered by bucket; categorical columns as slice codes (see _encode_table)
    n_lines: int
    n_rows: int
    bucket_offsets: list[int]
    uniques_path: str  # + ".NAME.arrow": table NAME's distinct values of the block, ascending, with counts
    slices_path: str  # per table: the (value code, bucket) pairs present, see _encode_table
    slice_bounds: list[int]  # table k's pairs are slices_path's entries [slice_bounds[k], slice_bounds[k + 1])
    distinct: list[int]  # per table: the block's distinct values
    samples: list[list]  # per table: a few of its values, evenly spaced in value order (for the splitters)
    reject_path: str | None
    rejects_by_reason: dict[str, int]


# --------------------------------------------------------------------------- inputs


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _open_text(path: Path):
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def check_inputs(inputs: list[str | os.PathLike], fmt: RawFormat) -> list[Path]:
    """Every input exists, is non-empty and (for CSV formats) starts with the format's header."""
    if not inputs:
        raise UserInputError("no input files given")
    paths = []
    for raw in inputs:
        path = Path(raw)
        if not path.exists():
            raise UserInputError(f"input file {str(path)!r} does not exist")
        if not path.is_file():
            raise UserInputError(f"input {str(path)!r} is not a file")
        if path.stat().st_size == 0:
            raise UserInputError(f"input file {str(path)!r} is empty")
        try:
            with _open_text(path) as f:
                first = f.readline().decode("utf-8-sig").rstrip("\r\n")
                has_second = bool(f.readline()) if fmt.has_header else True
        except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
            raise UserInputError(f"cannot read input file {str(path)!r}: {exc}") from None
        if fmt.has_header:
            if first != fmt.header_line:
                raise UserInputError(f"{path}: the header does not match format {fmt.name!r}: "
                                     f"{header_difference(fmt, first)}")
            if not has_second:
                raise UserInputError(f"input file {str(path)!r} has a header but no data rows")
        paths.append(path)
    return paths


def header_difference(fmt: RawFormat, header: str) -> str:
    """Where ``header`` first differs from ``fmt``'s header: the field's position and both names."""
    got, expected = header.split(fmt.delimiter), fmt.fields
    counts = f"expected {len(expected)} fields, got {len(got)}"
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            return f"field {i + 1} is {_short(have)!r}, expected {want!r} ({counts})"
    if len(got) < len(expected):
        return f"it ends after field {len(got)} ({got[-1]!r}) where {expected[len(got)]!r} comes next ({counts})"
    return f"field {len(expected) + 1} is {_short(got[len(expected)])!r}, after the last expected one ({counts})"


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def header_bytes(path: Path, fmt: RawFormat) -> int:
    if not fmt.has_header:
        return 0
    with _open_text(path) as f:
        return len(f.readline())


def split_pieces(paths: list[Path], fmt: RawFormat, block_bytes: int) -> list[Piece]:
    """Cut plain files at line ends about every ``block_bytes``; a gzip file is one piece until
    :func:`split_gzip` cuts it."""
    pieces: list[Piece] = []
    for file_index, path in enumerate(paths):
        if _is_gzip(path):
            pieces.append(Piece(len(pieces), file_index, str(path), 0, -1, True, 0))
            continue
        size = path.stat().st_size
        start = header_bytes(path, fmt)
        order = 0
        with open(path, "rb") as f:
            while start < size:
                stop = min(size, start + block_bytes)
                if stop < size:
                    f.seek(stop)
                    rest = f.readline()  # move the cut to the end of the line it falls in
                    stop += len(rest)
                pieces.append(Piece(len(pieces), file_index, str(path), start, stop, False, order))
                start, order = stop, order + 1
    return pieces


def n_buckets_for(paths: list[Path], block_bytes: int) -> int:
    total = sum(p.stat().st_size * (GZIP_EXPANSION_ESTIMATE if _is_gzip(p) else 1) for p in paths)
    return max(1, -(-total // block_bytes))


# --------------------------------------------------------------------------- stage 1: parse


def iter_blocks(piece: Piece, block_bytes: int, header_bytes: int) -> Iterator[bytes]:
    if not piece.gzip:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            yield f.read(piece.stop - piece.start)
        return
    with gzip.open(piece.path, "rb") as f:
        _read_gzip(f, header_bytes, piece.path)
        carry = b""
        while True:
            chunk = _read_gzip(f, block_bytes, piece.path)
            if not chunk:
                if carry:
                    yield carry
                return
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            carry = data[cut:]
            yield data[:cut]


def _read_gzip(f, size: int, path: str) -> bytes:
    """``f.read(size)``; a truncated or corrupt gzip stream is a UserInputError naming the file."""
    try:
        return f.read(size)
    except (EOFError, OSError, zlib.error) as exc:
        raise UserInputError(f"input file {path!r} is not a complete gzip file ({exc}): it is truncated or "
                             "corrupt") from None


def cap_values(values: pa.Array, max_rows: int | None) -> pa.Array:
    """The hash cap: raw values fold into max_rows - 1 buckets (row 0 stays missing/rare)."""
    if max_rows is None:
        return values
    if pa.types.is_integer(values.type):
        # Nulls filled first: with nulls to_numpy gives float64, and one block's float values would not
        # concatenate with another's integers in the vocabulary.
        folded = pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy(zero_copy_only=False)
    else:
        import pandas as pd

        text = values.to_numpy(zero_copy_only=False)
        folded = pd.util.hash_array(np.where(pd.isna(text), "", text).astype(object)).astype(np.int64)
        folded &= (1 << 62) - 1
    mask = values.is_null().to_numpy(zero_copy_only=False)
    return pa.array(np.where(mask, 0, folded % (max_rows - 1)), mask=mask)


def _write_block(
    parsed: ParsedBlock,
    fmt: RawFormat,
    params: PreprocessParams,
    n_buckets: int,
    rng_key: tuple[int, int],
    stem: Path,
) -> BlockResult:
    """Write one parsed block: its rows in bucket order, and per table its distinct values and slice pairs."""
    n = len(parsed.labels)
    rng = np.random.default_rng([params.seed, 0x0B0C, *rng_key])
    bucket = rng.integers(0, n_buckets, size=n) if n_buckets > 1 else np.zeros(n, dtype=np.int64)
    order = np.argsort(bucket, kind="stable")
    row_bucket = bucket[order]
    offsets = np.searchsorted(row_bucket, np.arange(n_buckets + 1)).tolist()
    columns: dict[str, pa.Array] = {"label": pa.array(parsed.labels[order])}
    for j, name in enumerate(fmt.dense):
        columns[name] = pa.array(np.ascontiguousarray(parsed.dense[order, j]))
    pairs, distinct, samples = [], [], []
    for name, values in zip(fmt.sparse, parsed.sparse, strict=True):
        enc = _encode_table(cap_values(values, params.max_rows_per_table), order, row_bucket)
        columns[name] = pa.array(enc.slice_codes)
        # One small file per table: a vocabulary task opens only its table's (a wide file costs ~1 ms an open).
        uniques = pa.table({"value": enc.values, "count": pa.array(enc.counts)})
        with ipc.new_file(f"{stem}.uniques.{name}.arrow", uniques.schema) as writer:
            writer.write_table(uniques)
        pairs.append(enc.pairs)
        distinct.append(len(enc.values))
        samples.append(enc.values.take(_sample_positions(len(enc.values))).to_pylist())
    table = pa.table(columns)
    with ipc.new_file(f"{stem}.arrow", table.schema) as writer:
        writer.write_table(table)
    np.save(f"{stem}.slices.npy", np.concatenate(pairs))
    reject_path = None
    if parsed.rejects:
        reject_path = f"{stem}.rejects.json"
        Path(reject_path).write_text(json.dumps(parsed.rejects))
    return BlockResult(
        file_index=rng_key[0], order=rng_key[1], ipc_path=f"{stem}.arrow", n_lines=parsed.n_lines, n_rows=n,
        bucket_offsets=offsets, uniques_path=f"{stem}.uniques", slices_path=f"{stem}.slices.npy",
        slice_bounds=np.concatenate([[0], np.cumsum([len(x) for x in pairs])]).tolist(), distinct=distinct,
        samples=samples, reject_path=reject_path, rejects_by_reason=dict(Counter(r[1] for r in parsed.rejects)),
    )


SAMPLES_PER_BLOCK = 16  # values per table and block offered for choosing the vocabulary's partition bounds
PAIR_SHIFT = 32  # a slice pair is value_code << PAIR_SHIFT | bucket
BUCKET_MASK = (1 << PAIR_SHIFT) - 1


def _sample_positions(n: int) -> pa.Array:
    return pa.array(np.unique(np.linspace(0, n - 1, min(n, SAMPLES_PER_BLOCK)).astype(np.int64)), pa.int64())


@dataclass
class EncodedTable:
    """One table of one block. ``values`` (distinct, ascending) and ``counts``; ``pairs``: the sorted
    distinct (value code, bucket) pairs of its rows, value code = position in ``values``; ``slice_codes``
    (rows in bucket order): the row's value's position among its bucket's values (-1: missing).

    A bucket's rows of this block thus carry codes into a *slice* dictionary of that bucket alone,
    so a write task needs the ids of its own bucket's slices only, never a whole block's map."""

    values: pa.Array
    counts: np.ndarray
    pairs: np.ndarray
    slice_codes: np.ndarray


def _encode_table(values: pa.Array, order: np.ndarray, row_bucket: np.ndarray) -> EncodedTable:
    encoded = pc.dictionary_encode(values)
    codes = _codes(encoded.indices)
    # Value order (not first appearance): a vocabulary partition is then a contiguous code range.
    dictionary = encoded.dictionary
    by_value = value_order(dictionary)
    rank = np.empty(len(by_value), dtype=np.int64)
    rank[by_value] = np.arange(len(by_value))
    counts = np.bincount(codes + 1, minlength=len(by_value) + 1)[1:][by_value]
    row_codes = codes[order]
    valid = row_codes >= 0
    pairs, local = _slice_pairs(rank[row_codes[valid]], row_bucket[valid])
    slice_codes = np.full(len(row_codes), -1, dtype=np.int32)
    slice_codes[valid] = local
    return EncodedTable(dictionary.take(pa.array(by_value)), counts.astype(np.int64), pairs, slice_codes)


def _slice_pairs(row_rank: np.ndarray, bucket: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct (value rank, bucket) pairs, sorted; each row's position among its bucket's values).
    The pairs by hashing (linear in the rows), then a sort of the distinct pairs only, which are far fewer
    than the rows of a skewed table."""
    keyed = pc.dictionary_encode(pa.array((row_rank << PAIR_SHIFT) | bucket))
    distinct_keys = keyed.dictionary.to_numpy()
    sorted_at = np.argsort(distinct_keys)
    pairs = distinct_keys[sorted_at]
    position = np.empty(len(pairs), dtype=np.int64)
    position[sorted_at] = np.arange(len(pairs))
    # Each pair's position among its bucket's pairs (stable sort keeps value order within a bucket).
    pair_bucket = pairs & BUCKET_MASK
    by_bucket = np.argsort(pair_bucket, kind="stable")
    grouped = pair_bucket[by_bucket]
    local = np.empty(len(pairs), dtype=np.int32)
    local[by_bucket] = np.arange(len(pairs)) - np.searchsorted(grouped, grouped, side="left")
    return pairs, local[position[keyed.indices.to_numpy()]]


def _codes(indices: pa.Array) -> np.ndarray:
    """Dictionary indices -> int32 codes with -1 where the value was null (missing)."""
    codes = np.frombuffer(indices.buffers()[1], dtype=np.int32, count=len(indices) + indices.offset)
    codes = codes[indices.offset:].copy()
    if indices.null_count:
        codes[~indices.is_valid().to_numpy(zero_copy_only=False)] = -1
    return codes


def parse_piece(
    piece: Piece, fmt_name: str, params: PreprocessParams, n_buckets: int, work_dir: str
) -> list[BlockResult] | UserInputError:
    """Stage 1 for one piece (runs on a worker). An unreadable input (a truncated gzip file) is
    returned, not raised: the caller raises it, where a Dask worker would log it with a traceback."""
    try:
        return _parse_piece(piece, fmt_name, params, n_buckets, work_dir)
    except UserInputError as exc:
        return exc


def _parse_piece(
    piece: Piece, fmt_name: str, params: PreprocessParams, n_buckets: int, work_dir: str
) -> list[BlockResult]:
    fmt = get_format(fmt_name)
    header = header_bytes(Path(piece.path), fmt) if piece.gzip else 0
    results = []
    for k, data in enumerate(iter_blocks(piece, params.block_bytes, header)):
        order = piece.first_order + k
        parsed = parse_block(data, fmt)
        stem = Path(work_dir) / f"f{piece.file_index:05d}-b{order:06d}"
        results.append(_write_block(parsed, fmt, params, n_buckets, (piece.file_index, order), stem))
    return results


def split_gzip(
    piece: Piece, fmt_name: str, params: PreprocessParams, n_buckets: int, work_dir: str
) -> list[Piece] | UserInputError:
    """Stage 0 for a ``.gz`` input: decompress it once (gzip cannot be entered mid-stream) into a plain
    file cut exactly where one reader cuts its blocks, so the pieces parse in parallel and the dataset is
    the one a single reader makes. Errors are returned, as by :func:`parse_piece`."""
    try:
        header = header_bytes(Path(piece.path), get_format(fmt_name))
        target = Path(work_dir) / f"f{piece.file_index:05d}.text"
        pieces, at = [], 0
        with open(target, "wb") as out:
            for k, data in enumerate(iter_blocks(piece, params.block_bytes, header)):
                out.write(data)
                pieces.append(Piece(piece.index, piece.file_index, str(target), at, at + len(data), False, k))
                at += len(data)
        return pieces
    except UserInputError as exc:
        return exc


def _parse_all(
    client, pieces: list[Piece], fmt_name: str, params: PreprocessParams, n_buckets: int, work: str,
    step: Callable[[], None], grow: Callable[[int], None],
) -> list[BlockResult]:
    """Stage 1 (and 0): parse every piece; a ``.gz`` input is split first and its pieces parsed as soon
    as its split ends. Every task runs to its end before the first error is raised, so none still writes
    into the work directory that the caller then removes."""
    args = (fmt_name, params, n_buckets, work)
    blocks: list[BlockResult] = []
    errors: list[UserInputError] = []

    def take(result) -> list[Piece]:
        step()
        if isinstance(result, UserInputError):
            errors.append(result)
        elif result and isinstance(result[0], Piece):
            grow(len(result))
            return result
        else:
            blocks.extend(result)
        return []

    def task(piece: Piece) -> Callable:
        return split_gzip if piece.gzip else parse_piece

    if client is None:
        todo = list(pieces)
        while todo:
            piece = todo.pop(0)
            todo[:0] = take(task(piece)(piece, *args))
    else:
        from distributed import as_completed

        running = as_completed([client.submit(task(p), p, *args, pure=False) for p in pieces])
        for future in running:
            for piece in take(future.result()):
                running.add(client.submit(parse_piece, piece, *args, pure=False))
    if errors:
        raise errors[0]
    return blocks


# --------------------------------------------------------------------------- stage 2: vocabulary
#
# Each table is split into value ranges (partitions) sized so that a task gathers about
# PARTITION_PAIRS entries, whatever the number of rows. Ranges, not hashes: ids are ordered by
# (count desc, value asc), so within one count the values of partition p all come before those of
# p + 1, and a value's id is (values with a higher count, anywhere) + (values with its count in
# earlier partitions) + (its rank among its count in its partition). The first two come from each
# partition's count histogram (at most sqrt(2 x rows) distinct counts), so no process ever holds a
# whole table: 2a counts each partition, the driver adds the histograms up, 2b gives the ids.

PARTITION_PAIRS = 1 << 20  # (value, bucket) pairs per vocabulary partition: bounds a task's memory
MAX_SAMPLED_BLOCKS = 1024  # blocks whose samples choose the partition bounds (the result never depends on them)


@dataclass(frozen=True)
class VocabPart:
    """Partition ``index`` of table ``table`` (its position ``k`` among the tables): values in [lo, hi)
    (None: unbounded)."""

    table: str
    k: int
    index: int
    lo: Any
    hi: Any


def plan_partitions(blocks: list[BlockResult], tables: list[str]) -> list[list[VocabPart]]:
    """Per table, its partitions: as many as its slice pairs need, bounded at sampled value quantiles."""
    step = -(-len(blocks) // MAX_SAMPLED_BLOCKS)
    plan = []
    for k, name in enumerate(tables):
        pairs = sum(b.slice_bounds[k + 1] - b.slice_bounds[k] for b in blocks)
        wanted = max(1, -(-pairs // PARTITION_PAIRS))
        pool = sorted({v for b in blocks[::step] for v in b.samples[k]})
        bounds = sorted({pool[len(pool) * j // wanted] for j in range(1, wanted)}) if pool else []
        edges = [None, *bounds, None]
        plan.append([VocabPart(name, k, i, edges[i], edges[i + 1]) for i in range(len(edges) - 1)])
    return plan


def _block_uniques(path: str, table: str) -> tuple[pa.Array, pa.Array]:
    """One block's (distinct values ascending, counts) for ``table`` (memory-mapped)."""
    with pa.memory_map(f"{path}.{table}.arrow") as source:
        t = ipc.open_file(source).read_all()
    return t["value"].combine_chunks(), t["count"].combine_chunks()


def count_partition(part: VocabPart, uniques_paths: list[str], params: PreprocessParams, work_dir: str,
                    parent: ParentVocabulary | None = None):
    """Stage 2a: add up one partition's counts over every block, rank its values (count desc, value asc),
    keep the ranked values on disk and return (their path, the histogram: counts descending, values per count).

    With a ``parent`` vocabulary, its values in this range keep their ids (``prev_id``; they are in the
    file whether this data has them or not) and only the values new to it are ranked and counted in the
    histogram."""
    values, counts = [], []
    for path in uniques_paths:
        v, c = _block_uniques(path, part.table)
        a, b = value_range(v, part.lo, part.hi)
        values.append(v.slice(a, b - a))
        counts.append(c.slice(a, b - a))
    totals = pa.table({"value": pa.concat_arrays(values), "count": pa.concat_arrays(counts)}).group_by(
        "value").aggregate([("count", "sum")])
    known_values, known_ids = (None, None) if parent is None else read_range(
        parent.directory, parent.files[part.table], part.lo, part.hi)
    if known_values is not None:
        known_values = known_values.cast(totals["value"].type)
        totals = totals.filter(pc.is_null(pc.index_in(totals["value"], value_set=known_values)))
    totals = totals.filter(pc.greater_equal(totals["count_sum"], params.min_frequency))
    ranked = totals.sort_by([("count_sum", "descending"), ("value", "ascending")])
    count = ranked["count_sum"].to_numpy()
    first = np.searchsorted(-count, -count, side="left")  # where each value's count class starts
    ranked = pa.table({"value": ranked["value"].combine_chunks(), "count": count,
                       "tie_rank": np.arange(len(count), dtype=np.int64) - first,
                       "prev_id": np.full(len(count), -1, dtype=np.int64)})
    if known_values is not None:
        n = len(known_values)
        known = pa.table({"value": known_values, "count": np.zeros(n, np.int64), "tie_rank": np.zeros(n, np.int64),
                          "prev_id": known_ids})
        ranked = pa.concat_tables([ranked, known])
    path = str(Path(work_dir) / f"vocab-{part.table}-p{part.index:05d}.arrow")
    with ipc.new_file(path, ranked.schema) as writer:
        writer.write_table(ranked)
    classes, sizes = np.unique(count, return_counts=True)
    return path, (classes[::-1].tolist(), sizes[::-1].tolist())


def id_bases(histograms: list[tuple[list[int], list[int]]], first_id: int = 1) -> list[dict[int, int]]:
    """Per partition of one table: count -> the id of its first value of that count (the ranked values'
    ids start at ``first_id``: 1, or the next id after a kept vocabulary)."""
    per_count: dict[int, int] = Counter()
    for classes, sizes in histograms:
        per_count.update(dict(zip(classes, sizes, strict=True)))
    higher, above = {}, 0
    for c in sorted(per_count, reverse=True):
        higher[c], above = above, above + per_count[c]
    bases, earlier = [], Counter()
    for classes, sizes in histograms:
        bases.append({c: first_id + higher[c] + earlier[c] for c in classes})
        earlier.update(dict(zip(classes, sizes, strict=True)))
    return bases


def map_partition(
    part: VocabPart,
    ranked_path: str,
    bases: dict[int, int],
    blocks: list[BlockResult],
    n_buckets: int,
    work_dir: str,
    dataset_dir: str,
) -> tuple[str, str, VocabularyFile | None]:
    """Stage 2b: the ids of this partition's values in every (bucket, block) slice, bucket-major, so a
    write task reads one contiguous range; and the partition's vocabulary file in the dataset. Returns
    (ids path, offsets path: slice (b, i) is ids[offsets[b * B + i]:offsets[b * B + i + 1]], the file)."""
    with pa.memory_map(ranked_path) as source:
        ranked = ipc.open_file(source).read_all()
    count, prev_id = ranked["count"].to_numpy(), ranked["prev_id"].to_numpy()
    new = prev_id < 0
    ids = prev_id.copy()
    ids[new] = np.array([bases[c] for c in count[new].tolist()], dtype=np.int64) + ranked["tie_rank"].to_numpy()[new]
    value_set = ranked["value"].combine_chunks()
    vocabulary_file = write_partition(dataset_dir, part.table, part.index, value_set, ids)
    ids_here = np.append(ids.astype(np.int32), np.int32(0))
    chunks, lens = [], np.zeros((len(blocks), n_buckets), dtype=np.int64)
    find = _PositionsIn(value_set)  # built once: a lookup per block would cost blocks x partition values
    for i, block in enumerate(blocks):
        v, _ = _block_uniques(block.uniques_path, part.table)
        a, b = value_range(v, part.lo, part.hi)
        # Values under min_frequency are not in the set: index -1 picks the appended 0.
        pos = find(v.slice(a, b - a))
        block_ids = ids_here[pos]
        pairs = np.load(block.slices_path, mmap_mode="r")[block.slice_bounds[part.k]:block.slice_bounds[part.k + 1]]
        lo, hi = np.searchsorted(pairs, [a << PAIR_SHIFT, b << PAIR_SHIFT])
        sel = np.asarray(pairs[lo:hi])
        bucket = sel & BUCKET_MASK
        by_bucket = np.argsort(bucket, kind="stable")  # value order kept within a bucket
        chunks.append(block_ids[(sel[by_bucket] >> PAIR_SHIFT) - a])
        lens[i] = np.bincount(bucket, minlength=n_buckets)
    ids = _bucket_major(chunks, lens)
    stem = Path(work_dir) / f"map-{part.table}-p{part.index:05d}"
    np.save(f"{stem}.ids.npy", ids)
    np.save(f"{stem}.offsets.npy", np.concatenate([[0], np.cumsum(lens.T.ravel())]))
    return f"{stem}.ids.npy", f"{stem}.offsets.npy", vocabulary_file


class _PositionsIn:
    """Each query value's position in ``values`` (-1 when absent), for many queries against one set: integer
    values are sorted once and searched (``pc.index_in`` would hash the whole set again for every query)."""

    def __init__(self, values: pa.Array) -> None:
        self.values = values
        self.sorted = None
        if pa.types.is_integer(values.type):
            arr = values.to_numpy()
            self.order = np.argsort(arr, kind="stable")
            self.sorted = arr[self.order]

    def __call__(self, query: pa.Array) -> np.ndarray:
        if self.sorted is None:
            return pc.fill_null(pc.index_in(query, value_set=self.values), -1).to_numpy(zero_copy_only=False)
        q = query.to_numpy()
        if len(self.sorted) == 0:
            return np.full(len(q), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.sorted, q), len(self.sorted) - 1)
        return np.where(self.sorted[at] == q, self.order[at], -1)


def _bucket_major(chunks: list[np.ndarray], lens: np.ndarray) -> np.ndarray:
    """Block-major segments (block i's chunk: its buckets in order, ``lens[i, b]`` each) -> bucket-major."""
    flat = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    src_start = np.concatenate([[0], np.cumsum(lens.ravel())[:-1]])
    dst_start = np.concatenate([[0], np.cumsum(lens.T.ravel())[:-1]]).reshape(lens.T.shape).T.ravel()
    dest = np.repeat(dst_start - src_start, lens.ravel()) + np.arange(len(flat))
    out = np.empty(len(flat), dtype=np.int32)
    out[dest] = flat
    return out


# --------------------------------------------------------------------------- stage 3: write


def _slice_lookup(part: int, n_blocks: int, maps: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """One table's ids for bucket ``part``: (lookup, start of each block's slice in it). A block's slice
    dictionary is its values in ascending order, so it is the partitions' fragments in partition order."""
    segs, lens = [], np.zeros((n_blocks, len(maps)), dtype=np.int64)
    for p, (ids_path, offsets_path) in enumerate(maps):
        offsets = np.load(offsets_path, mmap_mode="r")[part * n_blocks:(part + 1) * n_blocks + 1]
        segs.append(np.load(ids_path, mmap_mode="r")[offsets[0]:offsets[-1]])
        lens[:, p] = np.diff(offsets)
    starts = np.concatenate([[0], np.cumsum(lens.ravel())[:-1]]).reshape(lens.shape)
    lookup = np.zeros(int(lens.sum()) + 1, dtype=np.int32)  # the extra last entry: missing -> 0
    for p, seg in enumerate(segs):
        within = np.arange(len(seg)) - np.repeat(np.concatenate([[0], np.cumsum(lens[:, p])[:-1]]), lens[:, p])
        lookup[np.repeat(starts[:, p], lens[:, p]) + within] = seg
    return lookup, starts[:, 0]


def write_part(
    part: int,
    blocks: list[BlockResult],
    fmt_name: str,
    maps_paths: dict[str, list[tuple[str, str]]],
    params: PreprocessParams,
    out_dir: str,
) -> tuple[str, int]:
    """Stage 3 for one output part: gather bucket ``part`` from every block, map its slice codes to ids
    (reading this bucket's ids only), permute, write."""
    fmt = get_format(fmt_name)
    lookups = {name: _slice_lookup(part, len(blocks), maps) for name, maps in maps_paths.items()}
    pieces = []
    for i, block in enumerate(blocks):
        lo, hi = block.bucket_offsets[part], block.bucket_offsets[part + 1]
        if hi == lo:
            continue
        with pa.memory_map(block.ipc_path) as source:
            t = ipc.open_file(source).read_all().slice(lo, hi - lo)
        cols = {"label": t["label"]}
        for name in fmt.dense:
            cols[name] = t[name]
        for name in fmt.sparse:
            codes = t[name].to_numpy()
            lookup, starts = lookups[name]
            cols[name] = pa.array(lookup[np.where(codes >= 0, starts[i] + codes, len(lookup) - 1)])
        pieces.append(pa.table(cols))
    name = f"part-{part:05d}.parquet"
    if not pieces:
        return name, 0
    table = pa.concat_tables(pieces)
    perm = np.random.default_rng([params.seed, 0x5348, part]).permutation(table.num_rows)
    table = table.take(pa.array(perm))
    # Dictionary pages cost 2-3x the write time and buy little for id columns.
    pq.write_table(table, Path(out_dir) / name, compression="snappy", use_dictionary=False,
                   row_group_size=ROW_GROUP_ROWS)
    return name, table.num_rows


# --------------------------------------------------------------------------- the job


def _map(client, fn: Callable, items: list, *args, progress: Callable[[], None] | None = None) -> list:
    """fn(item, *args) for every item, in parallel on ``client`` when given; results in order."""
    if client is None:
        out = []
        for item in items:
            out.append(fn(item, *args))
            if progress:
                progress()
        return out
    from distributed import as_completed

    futures = client.map(fn, items, *[[a] * len(items) for a in args], pure=False)
    for _ in as_completed(futures):
        if progress:
            progress()
    return client.gather(futures)


def _vocabularies(
    client, blocks: list[BlockResult], tables: list[str], params: PreprocessParams, work: str, dataset_dir: str,
    parent: ParentVocabulary | None, step: Callable[[], None], grow: Callable[[int], None],
) -> tuple[list[int], dict[str, list[tuple[str, str]]], dict[str, list[VocabularyFile]]]:
    """Stage 2 for every table: (cardinalities including row 0, per table its partitions' id maps, per
    table its vocabulary files)."""
    plan = plan_partitions(blocks, tables)
    parts = [part for table_parts in plan for part in table_parts]
    grow(2 * (len(parts) - len(tables)))
    counted = _map(client, count_partition, parts, [b.uniques_path for b in blocks], params, work, parent,
                   progress=step)
    bases: list[dict[int, int]] = []
    cardinalities = []
    at = 0
    for k, table_parts in enumerate(plan):
        histograms = [hist for _, hist in counted[at:at + len(table_parts)]]
        first_id = parent.cardinalities[k] if parent else 1
        bases += id_bases(histograms, first_id)
        cardinalities.append(first_id + sum(sum(sizes) for _, sizes in histograms))
        at += len(table_parts)
    mapped = _map_pairs(client, parts, [path for path, _ in counted], bases, blocks, work, dataset_dir, step)
    maps_paths: dict[str, list[tuple[str, str]]] = {name: [] for name in tables}
    files: dict[str, list[VocabularyFile]] = {name: [] for name in tables}
    for part, (ids_path, offsets_path, vocabulary_file) in zip(parts, mapped, strict=True):
        maps_paths[part.table].append((ids_path, offsets_path))
        if vocabulary_file is not None:
            files[part.table].append(vocabulary_file)
    return cardinalities, maps_paths, files


def _map_pairs(client, parts, ranked_paths, bases, blocks, work, dataset_dir, step) -> list[tuple]:
    """map_partition for every partition (each with its own ranked file and bases)."""
    n_buckets = len(blocks[0].bucket_offsets) - 1
    items = list(zip(parts, ranked_paths, bases, strict=True))
    return _map(client, _map_item, items, blocks, n_buckets, work, dataset_dir, progress=step)


def _map_item(item, blocks, n_buckets, work, dataset_dir):
    part, ranked_path, bases = item
    return map_partition(part, ranked_path, bases, blocks, n_buckets, work, dataset_dir)


def _partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def _rejects_csv(
    blocks: list[BlockResult], paths: list[Path], fmt: RawFormat, target: Path
) -> list[dict[str, Any]]:
    """Write every rejected line (file, 1-based line number, reason, text); return the first few."""
    examples: list[dict[str, Any]] = []
    header_lines = 1 if fmt.has_header else 0
    line_base: dict[tuple[int, int], int] = {}
    per_file = sorted(blocks, key=lambda b: (b.file_index, b.order))
    seen: dict[int, int] = {}
    for b in per_file:
        line_base[(b.file_index, b.order)] = header_lines + seen.get(b.file_index, 0)
        seen[b.file_index] = seen.get(b.file_index, 0) + b.n_lines
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")  # the csv module's default is CRLF
        w.writerow(["file", "line", "reason", "text"])
        for b in per_file:
            if not b.reject_path:
                continue
            for line, reason, text in json.loads(Path(b.reject_path).read_text()):
                row = [str(paths[b.file_index]), line_base[(b.file_index, b.order)] + line, reason, text]
                w.writerow(row)
                if len(examples) < 5:
                    examples.append(dict(zip(["file", "line", "reason", "text"], row, strict=True)))
    return examples


def preprocess(
    inputs: list[str | os.PathLike],
    output: str | os.PathLike,
    *,
    client=None,
    progress: Callable[[int, int], None] | None = None,
    force: bool = False,
    fmt: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Preprocess ``inputs`` into the dataset directory ``output``; returns the result as a dict (what
    ``dlrmflow preprocess --json`` prints). ``settings``: the other fields of :class:`PreprocessConfig`
    (``fmt``: its ``format``), with its defaults. Shorthand for :func:`run_preprocess`.

    Raises UserInputError for bad inputs/parameters or too many rejected rows.
    """
    if fmt is not None:
        settings["format"] = fmt
    config = PreprocessConfig(inputs=list(inputs), output=output, **settings)
    return run_preprocess(config, client=client, progress=progress, force=force).as_dict()


def run_preprocess(
    config: PreprocessConfig,
    *,
    client=None,
    progress: Callable[[int, int], None] | None = None,
    force: bool = False,
) -> PreprocessResult:
    """Preprocess ``config.inputs`` into the dataset directory ``config.output`` (on Dask when ``client`` is
    given), unless it is up to date and not ``force``. Raises UserInputError for bad inputs or too many
    rejected rows."""
    started = time.perf_counter()
    params = PreprocessParams(**config.params())
    raw_format = get_format(params.fmt)
    # Absolute paths: the work may run on Dask workers started in another directory.
    output = Path(config.output).resolve()
    paths = [p.resolve() for p in check_inputs(config.inputs, raw_format)]
    identity = file_identity(paths)
    parent = None if config.vocabulary is None else load_parent(
        config.vocabulary, source_format=raw_format.name, max_rows_per_table=params.max_rows_per_table,
        sparse_columns=raw_format.sparse)
    if parent is not None:
        refuse_processed_inputs(paths, parent)
    fp = config.fingerprint(identity)

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"cannot create the directory of --output {str(output)!r}: {exc}") from exc
    with output_lock(output, "preprocess"):  # two runs never write one output at once
        return _preprocess_locked(paths, output, config, raw_format, identity, fp, parent, started, client,
                                  progress, force)


def _preprocess_locked(
    paths: list[Path],
    output: Path,
    config: PreprocessConfig,
    raw_format: RawFormat,
    identity: list[dict[str, Any]],
    fp: str,
    parent: ParentVocabulary | None,
    started: float,
    client,
    progress: Callable[[int, int], None] | None,
    force: bool,
) -> PreprocessResult:
    """The work of :func:`run_preprocess` once it holds the lock on ``output``."""
    params = PreprocessParams(**config.params())
    fmt, seed, min_frequency = params.fmt, params.seed, params.min_frequency
    max_rows_per_table, max_reject_fraction, block_bytes = (params.max_rows_per_table,
                                                            params.max_reject_fraction, params.block_bytes)
    if output.exists():
        if not (output / META_FILE).is_file():
            if output.is_dir() and not any(output.iterdir()):
                output.rmdir()
            else:
                raise UserInputError(
                    f"output {str(output)!r} exists and is not a dlrmflow dataset; refusing to overwrite it"
                )
        elif not force and (earlier := config.saved_result()) is not None:  # else made again
            return replace(earlier, seconds=round(time.perf_counter() - started, 3))

    partial = _partial_dir(output)
    if partial.exists():
        shutil.rmtree(partial)  # leftovers of an interrupted run
    work = partial / "_work"
    work.mkdir(parents=True)

    pieces = split_pieces(paths, raw_format, block_bytes)
    n_buckets = n_buckets_for(paths, block_bytes)
    n_tables = len(raw_format.sparse)
    total_steps = len(pieces) + 2 * n_tables + n_buckets  # grows once the partitions are known
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total_steps)

    def grow(extra: int) -> None:
        nonlocal total_steps
        total_steps += extra

    try:
        parsed = _parse_all(client, pieces, raw_format.name, params, n_buckets, str(work), step, grow)
        blocks = sorted(parsed, key=lambda b: (b.file_index, b.order))
        rows = sum(b.n_rows for b in blocks)
        reasons: Counter[str] = Counter()
        for b in blocks:
            reasons.update(b.rejects_by_reason)
        rejected = sum(reasons.values())
        lines = rows + rejected
        reject_csv = partial / "rejected" / "rejected.csv"
        examples = _rejects_csv(blocks, paths, raw_format, reject_csv) if rejected else []
        if lines and rejected / lines > max_reject_fraction:
            kept = output.parent / f"{output.name}.rejected.csv"
            shutil.copyfile(reject_csv, kept)
            hint = ""
            if all(r.startswith("expected ") for r in reasons):
                hint = f" (every rejection is a field-count mismatch: is --format {fmt!r} right?)"
            first = "; ".join(f"{e['file']}:{e['line']}: {e['reason']}" for e in examples[:3])
            raise UserInputError(
                f"{rejected} of {lines} input rows ({100 * rejected / lines:.2f}%) were rejected, above "
                f"--max-reject-fraction {100 * max_reject_fraction:g}%{hint}. First: {first}. "
                f"All rejected rows with reasons: {kept}"
            )
        if rows == 0:
            raise UserInputError("the inputs hold no valid rows")

        cardinalities, maps_paths, vocabulary_files = _vocabularies(
            client, blocks, raw_format.sparse, params, str(work), str(partial), parent, step, grow)
        written = _map(
            client, write_part, list(range(n_buckets)), blocks, raw_format.name, maps_paths, params,
            str(partial), progress=step,
        )
        shutil.rmtree(work)
        meta = DatasetMeta(
            source_format=raw_format.name,
            rows=rows,
            label_column="label",
            dense_columns=list(raw_format.dense),
            sparse_columns=list(raw_format.sparse),
            cardinalities=cardinalities,
            files=[PartFile(name, n) for name, n in written if n > 0],
            rejected_rows=rejected,
            rejected_by_reason=dict(sorted(reasons.items())),
            transform={
                "dense": "log(max(x, 0) + 1) as float32; missing -> 0",
                "categorical": "contiguous ids by descending frequency (ties by value); 0 = missing or rare" + (
                    "; the ids of the vocabulary's dataset kept, new values after them" if parent else ""),
                "min_frequency": min_frequency,
                "max_rows_per_table": max_rows_per_table,
                "shuffle": "two-pass: seeded bucket per row, then seeded permutation per part",
                "seed": seed,
                "block_bytes": block_bytes,
            },
            inputs=identity,
            fingerprint=fp,
            extra={"input_lines": lines, "reject_examples": examples,
                   "input_digests": {str(path): content_digest(path) for path in paths}},
            vocabulary=vocabulary_record(vocabulary_files, parent),
        )
        for name, n in written:
            if n == 0 and (partial / name).exists():
                (partial / name).unlink()
        write_meta(partial, meta)
        _swap_into_place(partial, output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return PreprocessResult.of(meta, output, skipped=False, seconds=time.perf_counter() - started)


def _swap_into_place(partial: Path, output: Path) -> None:
    old = output.parent / f".{output.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if output.exists():
        os.replace(output, old)
    os.replace(partial, output)
    if old.exists():
        shutil.rmtree(old)

