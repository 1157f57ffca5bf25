"""Embedding rows on disk, one file per shard, written and read a chunk at a time.

A table of ``total_rows`` rows of ``width`` float32 values lives on K shards: row ``id`` on shard
``id % K`` at local index ``id // K`` (:mod:`dlrmflow.engine.serving.shards`). On disk each shard's
rows are one ``.npy`` file (``[n_local, width]`` float32, local-index order), written by the process
that holds the shard (its Dask worker), never gathered anywhere first: ``final_state/shard-<k>.npy``
of a run (:mod:`dlrmflow.engine.run_state`) and ``checkpoint_rows/<slot>/shard-<k>.npy`` of a
checkpoint (:mod:`dlrmflow.engine.training.checkpoint`). The run directory must be visible at the same
path to every worker: a LocalCluster's workers and workers on this machine share its filesystem; on
several machines it must be a shared filesystem.

Every write and read moves at most ``ROW_CHUNK`` rows at a time (the memory a process needs is a
chunk, not the table), and hashes the file's bytes on the way: :func:`write_rows_file` returns the
file's SHA-256 (what a manifest records), :class:`RowFileReader` checks it.

:class:`ShardedRows` is the read side of a whole table kept as K shard arrays (memory-mapped files,
or arrays): rows by id, by id range, in global order a chunk at a time, or (small tables, tests)
assembled whole.

This module imports only NumPy: shards, coding, training and the run state all use it.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROW_CHUNK = 1 << 16  # rows per step when rows are written, read, hashed or streamed
DTYPE = np.dtype("<f4")
SHARD_FILE = "shard-{}.npy"
PARITY_SHARD_FILE = "parity-{}.npy"


def shard_file(k: int) -> str:
    return SHARD_FILE.format(k)


def parity_file(p: int) -> str:
    return PARITY_SHARD_FILE.format(p)


def local_count(total_rows: int, k: int, num_shards: int) -> int:
    """Rows of shard ``k`` of ``num_shards`` (the first ``total_rows % K`` hold one more)."""
    return len(range(k, total_rows, num_shards))


def chunk_stripes(num_shards: int, chunk_rows: int = ROW_CHUNK) -> int:
    """Stripes (local rows of every shard) per chunk of at most ``chunk_rows`` rows (at least one)."""
    return max(1, chunk_rows // max(1, num_shards))


def _header(n_rows: int, width: int) -> bytes:
    """The ``.npy`` header of a ``[n_rows, width]`` float32 array (format 1.0)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(DTYPE),
                                               "fortran_order": False, "shape": (n_rows, width)})
    return buf.getvalue()


def write_rows_file(path: str | os.PathLike, n_rows: int, width: int, read: Callable[[int, int], np.ndarray], *,
                    overlay: tuple[np.ndarray, np.ndarray] | None = None, chunk: int = ROW_CHUNK) -> dict[str, Any]:
    """Write ``n_rows`` rows of ``width`` float32 values as an ``.npy`` file, ``read(start, stop)`` giving
    rows ``[start, stop)`` a chunk at a time; atomically (a temporary file, then a rename).

    ``overlay``: ``(local indices, rows)``, sorted indices, whose rows are written instead of what
    ``read`` gives (a checkpoint's newer copies); ``read``'s rows are not changed.

    Returns the manifest entry: file name, rows, bytes, SHA-256 of the file, and the writer's pid and host."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    local = rows = None
    if overlay is not None and len(overlay[0]):
        local, rows = np.asarray(overlay[0], dtype=np.int64), np.asarray(overlay[1], dtype=np.float32)
    with tmp.open("wb") as f:
        head = _header(n_rows, width)
        f.write(head)
        digest.update(head)
        for lo in range(0, n_rows, max(1, chunk)):
            hi = min(lo + max(1, chunk), n_rows)
            block = read(lo, hi)
            if block.shape != (hi - lo, width):
                raise ValueError(f"rows [{lo}, {hi}) came back as {block.shape}, not {(hi - lo, width)}")
            if local is not None:
                a, b = np.searchsorted(local, [lo, hi])
                if b > a:
                    block = np.array(block, dtype=DTYPE)
                    block[local[a:b] - lo] = rows[a:b]
            data = np.ascontiguousarray(block, dtype=DTYPE).view(np.uint8).reshape(-1)
            f.write(data.data)
            digest.update(data.data)
    os.replace(tmp, path)
    return {"file": path.name, "rows": int(n_rows), "width": int(width), "bytes": path.stat().st_size,
            "sha256": digest.hexdigest(), "pid": os.getpid(), "host": socket.gethostname()}


def file_sha256(path: str | os.PathLike, block: int = 1 << 20) -> str:
    """A file's SHA-256, read ``block`` bytes at a time into one buffer."""
    digest = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    with Path(path).open("rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


class RowFileReader:
    """Reads a rows file from start to end, ``n`` rows at a time, hashing every byte: after the last row,
    :meth:`sha256` is the file's SHA-256. A context manager."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._f = self.path.open("rb")
        try:
            version = np.lib.format.read_magic(self._f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(self._f)
        except Exception:
            self._f.close()
            raise
        if len(shape) != 2 or fortran or dtype != DTYPE:
            self._f.close()
            raise ValueError(f"{self.path} holds {dtype} {shape}{' (Fortran order)' if fortran else ''}, "
                             "not float32 rows")
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.offset = self._f.tell()
        self._f.seek(0)
        self.digest = hashlib.sha256(self._f.read(self.offset))
        self.done = 0

    def read(self, n: int) -> np.ndarray:
        """The next ``n`` rows (fewer at the end)."""
        n = max(0, min(n, self.shape[0] - self.done))
        out = np.empty((n, self.shape[1]), dtype=DTYPE)
        view = out.view(np.uint8).reshape(-1)
        got = self._f.readinto(view.data) if n else 0
        if got != view.nbytes:
            raise ValueError(f"{self.path} ends after {self.done * self.shape[1] * 4 + got} bytes of rows: it is "
                             "truncated")
        self.digest.update(view.data)
        self.done += n
        return out

    def sha256(self) -> str:
        """The file's SHA-256 (the rows not read yet are read first)."""
        while self.done < self.shape[0]:
            self.read(ROW_CHUNK)
        rest = self._f.read()
        self.digest.update(rest)
        return self.digest.hexdigest()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RowFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_rows_file(path: str | os.PathLike, out: np.ndarray, *, sha256: str | None = None,
                   chunk: int = ROW_CHUNK) -> None:
    """Fill ``out`` ``[n, width]`` with a rows file's rows a chunk at a time, as bytes; ValueError when the
    file holds another shape or (``sha256`` given) other bytes."""
    with RowFileReader(path) as reader:
        if reader.shape != tuple(out.shape):
            raise ValueError(f"{path} holds rows of shape {reader.shape}, not {tuple(out.shape)}")
        for lo in range(0, len(out), max(1, chunk)):
            block = reader.read(max(1, chunk))
            out.view(np.uint8)[lo : lo + len(block)] = block.view(np.uint8)
        if sha256 is not None and reader.sha256() != sha256:
            raise ValueError(f"{path} is not the file its manifest names (SHA-256 differs): it was changed or "
                             "damaged")


def open_rows(path: str | os.PathLike) -> np.ndarray:
    """A rows file memory-mapped read-only (nothing read until indexed)."""
    rows = np.load(path, mmap_mode="r")
    if rows.ndim != 2 or rows.dtype != DTYPE:
        raise ValueError(f"{path} holds {rows.dtype} {rows.shape}, not float32 rows")
    return rows


def interleave(pieces: Sequence[np.ndarray], width: int) -> np.ndarray:
    """Rows of consecutive global ids from each shard's rows of the same stripes (piece ``k``: shard
    ``k``'s rows; the first pieces may hold one row more): ``out[k::K] = pieces[k]``."""
    k = len(pieces)
    out = np.empty((sum(len(p) for p in pieces), width), dtype=DTYPE)
    for i, piece in enumerate(pieces):
        out[i::k] = piece
    return out


class ShardedRows:
    """A read-only view of every row of a table kept as K shard arrays (module docstring): rows by id,
    by id range, in global order a chunk at a time. From files (:meth:`from_files`, memory-mapped: a
    read touches only the rows it returns) or from arrays (:meth:`from_array`).

    ``files``: the shards' file paths and SHA-256s when the view is of files (a shard started from
    them reads its own file)."""

    def __init__(self, shards: Sequence[np.ndarray], total_rows: int, width: int, *,
                 files: Sequence[tuple[str, str | None]] | None = None) -> None:
        self.shards = list(shards)
        self.total_rows, self.width = int(total_rows), int(width)
        self.files = None if files is None else [(str(p), s) for p, s in files]
        k = len(self.shards)
        for i, shard in enumerate(self.shards):
            if tuple(shard.shape) != (local_count(self.total_rows, i, k), self.width):
                raise ValueError(f"shard {i} of {k} holds rows of shape {tuple(shard.shape)}, not "
                                 f"{(local_count(self.total_rows, i, k), self.width)}")

    @classmethod
    def from_files(cls, directory: str | os.PathLike, entries: Sequence[dict[str, Any]], total_rows: int,
                   width: int) -> ShardedRows:
        """The shard files ``entries`` (manifest entries: ``file``, ``sha256``) in ``directory``."""
        directory = Path(directory).resolve()
        paths = [directory / e["file"] for e in entries]
        return cls([open_rows(p) for p in paths], total_rows, width,
                   files=[(str(p), e.get("sha256")) for p, e in zip(paths, entries, strict=True)])

    @classmethod
    def from_array(cls, rows: np.ndarray, num_shards: int = 1) -> ShardedRows:
        """``rows`` ``[total_rows, width]`` in global id order, seen as ``num_shards`` shards (views)."""
        rows = np.asarray(rows)
        return cls([rows[i::num_shards] for i in range(num_shards)], rows.shape[0], rows.shape[1])

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.total_rows, self.width)

    def local_rows(self, k: int, num_shards: int) -> np.ndarray:
        """Shard ``k``'s rows for a table on ``num_shards`` shards (this view's own shard when the counts
        agree, else gathered by id)."""
        if num_shards == self.num_shards:
            return np.ascontiguousarray(self.shards[k])
        return self[np.arange(k, self.total_rows, num_shards, dtype=np.int64)]

    def __getitem__(self, ids: Any) -> np.ndarray:
        """Rows of global ``ids`` (an int array), ``[len(ids), width]``."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((len(ids), self.width), dtype=DTYPE)
        k = self.num_shards
        shard_of = ids % k
        for i in range(k):
            where = np.flatnonzero(shard_of == i)
            if len(where):
                out[where] = self.shards[i][ids[where] // k]
        return out

    def stripes(self, start: int, stop: int) -> np.ndarray:
        """Rows of stripes ``[start, stop)``: global ids ``start*K .. min(stop*K, total_rows) - 1``, in order."""
        return interleave([s[start:stop] for s in self.shards], self.width)

    def chunks(self, chunk: int = ROW_CHUNK) -> Iterator[tuple[int, np.ndarray]]:
        """``(first id, rows)`` of every chunk of at most ``chunk`` rows, in global id order."""
        per = chunk_stripes(self.num_shards, chunk)
        n_stripes = local_count(self.total_rows, 0, self.num_shards)
        for start in range(0, n_stripes, per):
            yield start * self.num_shards, self.stripes(start, min(start + per, n_stripes))

    def assemble(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in one array: for small tables and tests only."""
        out = np.empty(self.shape, dtype=DTYPE)
        for i, shard in enumerate(self.shards):
            out[i :: self.num_shards] = shard
        return out


def as_sharded(rows: Any) -> ShardedRows | None:
    """``rows`` as a :class:`ShardedRows` (an array becomes a view of one shard); None stays None."""
    if rows is None or isinstance(rows, ShardedRows):
        return rows
    return ShardedRows.from_array(np.asarray(rows), 1)
