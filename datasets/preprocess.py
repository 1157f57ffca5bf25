"""Raw files -> a shuffled Parquet dataset with frequency-ordered categorical ids.

The job runs in three parallel stages over a Dask cluster (or in-process without one):

1. **parse** (one task per input piece: a byte range of a plain file, or a whole ``.gz``
   file processed in pieces of the same size): parse and validate lines, transform dense
   values, draw each row's output bucket (the first pass of a two-pass shuffle), factorize each
   categorical column into piece-local codes, and write the piece as an Arrow IPC file
   ordered by bucket. Rejected lines go to a per-piece file with their reasons.
2. **vocabulary** (one task per table): add up the piece-local counts, order the values by
   frequency (ties by value, so the order is deterministic), apply ``min_frequency``, and
   translate every piece's local codes into final ids (0 = missing or rare).
3. **write** (one task per output part): gather the part's bucket from every piece, map codes
   to ids, permute the rows with a generator seeded by (seed, part) -- the second pass of the
   shuffle -- and write ``part-NNNNN.parquet``.

Everything is written under a hidden ``.NAME.partial`` directory next to the output and
renamed into place at the end, so an interrupted run never leaves a dataset that looks
complete. Rerunning with unchanged inputs (path, size, mtime) and parameters finds the same
fingerprint in ``meta.json`` and skips the work (:meth:`PreprocessConfig.saved_result
<dlrmflow.datasets.preprocess_config.PreprocessConfig.saved_result>`).

The result depends only on the inputs and parameters (including ``block_bytes``, which fixes
the pieces), never on the number of workers.
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
from dlrmflow.datasets.meta import META_FILE, DatasetMeta, PartFile, write_meta
from dlrmflow.datasets.preprocess_config import PreprocessConfig, PreprocessResult
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
    ipc_path: str
    n_lines: int
    n_rows: int
    bucket_offsets: list[int]
    uniques_path: str
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


def _header_bytes(path: Path, fmt: RawFormat) -> int:
    if not fmt.has_header:
        return 0
    with _open_text(path) as f:
        return len(f.readline())


def split_pieces(paths: list[Path], fmt: RawFormat, block_bytes: int) -> list[Piece]:
    """Cut plain files at line ends about every ``block_bytes``; a gzip file is one piece."""
    pieces: list[Piece] = []
    for file_index, path in enumerate(paths):
        if _is_gzip(path):
            pieces.append(Piece(len(pieces), file_index, str(path), 0, -1, True, 0))
            continue
        size = path.stat().st_size
        start = _header_bytes(path, fmt)
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


def _iter_blocks(piece: Piece, block_bytes: int, header_bytes: int) -> Iterator[bytes]:
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


def _cap_values(values: pa.Array, max_rows: int | None) -> pa.Array:
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
) -> tuple[int, list[int], str, str | None]:
    n = len(parsed.labels)
    rng = np.random.default_rng([params.seed, 0x0B0C, *rng_key])
    bucket = rng.integers(0, n_buckets, size=n) if n_buckets > 1 else np.zeros(n, dtype=np.int64)
    order = np.argsort(bucket, kind="stable")
    offsets = np.searchsorted(bucket[order], np.arange(n_buckets + 1)).tolist()
    columns: dict[str, pa.Array] = {"label": pa.array(parsed.labels[order])}
    for j, name in enumerate(fmt.dense):
        columns[name] = pa.array(np.ascontiguousarray(parsed.dense[order, j]))
    uniques: dict[str, pa.Table] = {}
    for name, values in zip(fmt.sparse, parsed.sparse, strict=True):
        encoded = pc.dictionary_encode(_cap_values(values, params.max_rows_per_table))
        codes = _codes(encoded.indices)
        counts = np.bincount(codes + 1, minlength=len(encoded.dictionary) + 1)
        columns[name] = pa.array(codes[order])
        uniques[name] = pa.table({"value": encoded.dictionary, "count": pa.array(counts[1:])})
    table = pa.table(columns)
    with ipc.new_file(f"{stem}.arrow", table.schema) as writer:
        writer.write_table(table)
    uniq_path = f"{stem}.uniques.arrow"
    packed = _pack_uniques(uniques)
    with ipc.new_file(uniq_path, packed.schema) as writer:
        writer.write_table(packed)
    reject_path = None
    if parsed.rejects:
        reject_path = f"{stem}.rejects.json"
        Path(reject_path).write_text(json.dumps(parsed.rejects))
    return n, offsets, uniq_path, reject_path


def _codes(indices: pa.Array) -> np.ndarray:
    """Dictionary indices -> int32 codes with -1 where the value was null (missing)."""
    codes = np.frombuffer(indices.buffers()[1], dtype=np.int32, count=len(indices) + indices.offset)
    codes = codes[indices.offset:].copy()
    if indices.null_count:
        codes[~indices.is_valid().to_numpy(zero_copy_only=False)] = -1
    return codes


def _pack_uniques(uniques: dict[str, pa.Table]) -> pa.Table:
    """All tables' (value, count) lists in one table: columns NAME.value / NAME.count, padded."""
    longest = max((t.num_rows for t in uniques.values()), default=0)
    cols = {}
    for name, t in uniques.items():
        pad = longest - t.num_rows
        cols[f"{name}.value"] = pa.concat_arrays([t["value"].combine_chunks(), pa.nulls(pad, t["value"].type)])
        cols[f"{name}.count"] = pa.concat_arrays([pa.array(t["count"].to_numpy(), pa.int64()),
                                                  pa.nulls(pad, pa.int64())])
    return pa.table(cols)


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
    header = _header_bytes(Path(piece.path), fmt) if piece.gzip else 0
    results = []
    for k, data in enumerate(_iter_blocks(piece, params.block_bytes, header)):
        order = piece.first_order + k
        parsed = parse_block(data, fmt)
        stem = Path(work_dir) / f"f{piece.file_index:05d}-b{order:06d}"
        n, offsets, uniq_path, reject_path = _write_block(
            parsed, fmt, params, n_buckets, (piece.file_index, order), stem
        )
        results.append(BlockResult(
            file_index=piece.file_index, order=order, ipc_path=f"{stem}.arrow", n_lines=parsed.n_lines,
            n_rows=n, bucket_offsets=offsets, uniques_path=uniq_path, reject_path=reject_path,
            rejects_by_reason=dict(Counter(r[1] for r in parsed.rejects)),
        ))
    return results


# --------------------------------------------------------------------------- stage 2: vocabulary


def build_vocabulary(
    table_name: str, uniques_paths: list[str], params: PreprocessParams, work_dir: str
) -> tuple[int, str]:
    """Stage 2 for one table: frequency-ordered ids; writes each block's code -> id map.

    Returns (cardinality including row 0, path of the maps file).
    """
    values, counts, lengths = [], [], []
    for path in uniques_paths:
        with pa.memory_map(path) as source:
            t = ipc.open_file(source).read_all()
        v = t[f"{table_name}.value"].combine_chunks()
        c = t[f"{table_name}.count"].combine_chunks()
        m = len(v) - c.null_count
        values.append(v.slice(0, m))
        counts.append(c.slice(0, m))
        lengths.append(m)
    all_values = pa.concat_arrays(values) if values else pa.array([], pa.int64())
    all_counts = pa.concat_arrays(counts) if counts else pa.array([], pa.int64())
    totals = pa.table({"value": all_values, "count": all_counts}).group_by("value").aggregate(
        [("count", "sum")]
    )
    totals = totals.filter(pc.greater_equal(totals["count_sum"], params.min_frequency))
    # Most frequent first; ties broken by the value itself so the order never depends on chunking.
    ranked = totals.sort_by([("count_sum", "descending"), ("value", "ascending")])["value"].combine_chunks()
    position = pc.index_in(all_values, value_set=ranked)
    ids = (pc.fill_null(position, -1).to_numpy(zero_copy_only=False).astype(np.int32) + 1)
    maps_path = str(Path(work_dir) / f"vocab-{table_name}.npz")
    np.savez(maps_path, ids=ids, lengths=np.asarray(lengths, dtype=np.int64))
    return len(ranked) + 1, maps_path


# --------------------------------------------------------------------------- stage 3: write


def write_part(
    part: int,
    blocks: list[BlockResult],
    fmt_name: str,
    maps_paths: dict[str, str],
    params: PreprocessParams,
    out_dir: str,
) -> tuple[str, int]:
    """Stage 3 for one output part: gather bucket ``part`` from every block, map, permute, write."""
    fmt = get_format(fmt_name)
    maps = {}
    for name, path in maps_paths.items():
        with np.load(path) as z:
            ids, lengths = z["ids"], z["lengths"]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        maps[name] = [ids[bounds[i]:bounds[i + 1]] for i in range(len(lengths))]
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
            # code -1 (missing) picks the appended 0.
            lookup = np.append(maps[name][i], np.int32(0))
            cols[name] = pa.array(lookup[codes])
        pieces.append(pa.table(cols))
    name = f"part-{part:05d}.parquet"
    if not pieces:
        return name, 0
    table = pa.concat_tables(pieces)
    perm = np.random.default_rng([params.seed, 0x5348, part]).permutation(table.num_rows)
    table = table.take(pa.array(perm))
    # Dictionary pages cost 2-3x the write time and buy little for id columns.
    pq.write_table(table, Path(out_dir) / name, compression="snappy", use_dictionary=False)
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
    fp = config.fingerprint(identity)

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"cannot create the directory of --output {str(output)!r}: {exc}") from exc
    with output_lock(output, "preprocess"):  # two runs never write one output at once
        return _preprocess_locked(paths, output, config, raw_format, identity, fp, started, client, progress,
                                  force)


def _preprocess_locked(
    paths: list[Path],
    output: Path,
    config: PreprocessConfig,
    raw_format: RawFormat,
    identity: list[dict[str, Any]],
    fp: str,
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
    total_steps = len(pieces) + n_tables + n_buckets
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total_steps)

    try:
        nested = _map(client, parse_piece, pieces, raw_format.name, params, n_buckets, str(work), progress=step)
        for group in nested:
            if isinstance(group, UserInputError):
                raise group
        blocks = sorted((b for group in nested for b in group), key=lambda b: (b.file_index, b.order))
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

        uniques_paths = [b.uniques_path for b in blocks]
        vocab = _map(client, build_vocabulary, raw_format.sparse, uniques_paths, params, str(work), progress=step)
        cardinalities = [c for c, _ in vocab]
        maps_paths = {name: path for name, (_, path) in zip(raw_format.sparse, vocab, strict=True)}
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
                "categorical": "contiguous ids by descending frequency (ties by value); 0 = missing or rare",
                "min_frequency": min_frequency,
                "max_rows_per_table": max_rows_per_table,
                "shuffle": "two-pass: seeded bucket per row, then seeded permutation per part",
                "seed": seed,
                "block_bytes": block_bytes,
            },
            inputs=identity,
            fingerprint=fp,
            extra={"input_lines": lines, "reject_examples": examples},
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

