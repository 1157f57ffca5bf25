"""The member actors of a coded shard group: K data shards and R parity shards.

Data shard ``i`` of ``K`` is a :class:`CodedShard` (an ``EmbeddingShard`` that also serves stripes
and applies sequenced writes); stripe ``j`` is local row ``j`` of every data shard, i.e. global ids
``j*K .. j*K + K-1``. Parity shard ``p`` of ``R`` is a :class:`ParityShard` holding
``ceil(total_rows / K)`` rows of the same width: ``parity_p[j] = XOR_i C[p, i] * data_i[j]`` over the
bit patterns (:mod:`dlrmflow.engine.coding.erasure`). Member index ``s`` names both kinds: ``0..K-1`` data,
``K..K+R-1`` parity.

A parity shard started by :func:`~dlrmflow.engine.coding.start.start_coded_shards` encodes its rows from
the data shards' rows streamed to it a chunk of stripes at a time (:func:`encode_parity_from_members`,
run on the parity shard's worker), never from every data shard's rows in one process: at a run's start
those are the initial rows, on a resume the checkpoint's. ``ParityShard(initialise=True)`` instead
generates the initial rows of every data shard itself, a chunk at a time (tests, and the rows of a
replacement's fresh stripes).

Each member owns its rows, the set of write-back batches it applied (so a resent batch is applied
once), which of its rows are still *fresh* (to be generated from the seed when first read) and which
rebuild it is the target of. Its actor thread is the only writer of these, except a rebuild's copy
task installing on the same worker, which the rebuild's dirty log covers (docs/rebuild.md).
"""

from __future__ import annotations

import os
import threading

import numpy as np
from distributed import Client, Future

from dlrmflow.engine.coding import gf256
from dlrmflow.engine.coding.erasure import ErasureCode, gather_stripes
from dlrmflow.engine.coding.prefault import prefault_in_background
from dlrmflow.engine.row_files import ROW_CHUNK, chunk_stripes, write_rows_file
from dlrmflow.engine.serving.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.serving.shards import EmbeddingShard, answer, call_server

ENCODE_CHUNK_STRIPES = 1 << 16  # stripes encoded per step (bounds the temporaries)


def num_stripes(spec: RowSpec, k: int) -> int:
    return len(range(0, spec.total_rows, k))


def shard_row_counts(spec: RowSpec, k: int) -> list[int]:
    """Rows of each of the K data shards (the first ``total_rows % K`` hold one more)."""
    return [len(range(i, spec.total_rows, k)) for i in range(k)]


def member_name(s: int, k: int) -> str:
    return f"data shard {s}" if s < k else f"parity shard {s - k}"


class SequencedMember:
    """What every member shares: the set of write-back batches it applied, fresh rows, stripe access.

    ``fresh`` (None, or one flag per stripe): rows still to be generated from ``(seed, id)``. A
    replacement starts with every row fresh and generates a row when something first reads it: a
    rebuild copies only the stripes with a row the trainer wrote.

    ``rebuild``: the rebuild this member is the target of (set by :meth:`reset`); an install from any
    other is ignored. A rebuild that starts over (a further loss) cannot stop a copy task that is
    already running, and on a worker with more than one thread that task can install after the new
    rebuild's copy of the same stripes, with a version written over since (``installing`` makes the
    check and the write one step against a concurrent reset)."""

    rows: np.ndarray
    applied: set[int]
    fresh: np.ndarray | None
    rebuild: str = ""
    prefaulting: threading.Thread | None = None
    installing = threading.Lock()  # one per worker process: installs are few and short

    def initial_rows(self, local: np.ndarray) -> np.ndarray:
        """The initial rows at local indices ``local`` (a pure function of the seed)."""
        raise NotImplementedError

    def materialise(self, local: np.ndarray | slice) -> None:
        """Generate the fresh rows among ``local`` (local indices inside the member, or a slice)."""
        if self.fresh is None:
            return
        if isinstance(local, slice):
            local = np.arange(len(self.rows))[local]
        local = local[self.fresh[local]]
        if len(local):
            self.rows[local] = self.initial_rows(local)
            self.fresh[local] = False

    def overwritten(self, local: np.ndarray | slice) -> None:
        """Rows at ``local`` now hold written or installed values: no longer fresh."""
        if self.fresh is not None:
            self.fresh[local] = False

    def reset(self, rebuild: str = "") -> int:
        """Back to the initial rows, all fresh, as the target of ``rebuild``: a rebuild that starts over
        installs everything else again. The first reset also faults the rows' pages in, in the
        background, while the rebuild's reads are on their way (:mod:`~dlrmflow.engine.coding.prefault`)."""
        with self.installing:
            self.fresh = np.ones(len(self.rows), dtype=bool)
            self.rebuild = rebuild
        if self.prefaulting is None:
            self.prefaulting = prefault_in_background(self.rows)
        return len(self.rows)

    def read_stripes(self, start: int, stop: int) -> np.ndarray:
        """Rows of stripes ``[start, stop)``, not copied: only a rebuild's bulk copy reads them, and a
        stripe written while its bytes are on the way is in the rebuild's dirty log and re-read
        under the lock (docs/rebuild.md)."""
        self.materialise(slice(start, stop))
        return self.rows[start:stop]

    def gather(self, stripes: np.ndarray) -> np.ndarray:
        """Rows of ``stripes`` (zero rows past this member's end)."""
        if self.fresh is not None:
            stripes = np.asarray(stripes, dtype=np.int64)
            self.materialise(stripes[(stripes >= 0) & (stripes < len(self.rows))])
        return gather_stripes(self.rows, stripes)

    def install(self, start: int, rows: np.ndarray, rebuild: str = "") -> int:
        """Rebuilt rows of stripes ``start..``: copied as bytes, never as floats (0 rows: another
        rebuild's)."""
        with self.installing:
            if rebuild != self.rebuild:
                return 0
            self.rows.view(np.uint8)[start : start + len(rows)] = np.ascontiguousarray(rows).view(np.uint8)
            self.overwritten(slice(start, start + len(rows)))
        return len(rows)

    def install_stripes(self, stripes: np.ndarray, rows: np.ndarray, rebuild: str = "") -> int:
        """Rebuilt rows of the given stripes, copied as bytes (0 rows: another rebuild's)."""
        with self.installing:
            if rebuild != self.rebuild:
                return 0
            self.rows.view(np.uint8)[stripes] = np.ascontiguousarray(rows).view(np.uint8)
            self.overwritten(stripes)
        return len(stripes)

    def save_rows(self, path: str, overlay_local: np.ndarray | None = None, overlay_rows: np.ndarray | None = None,
                  chunk: int = ROW_CHUNK) -> dict:
        """Write every row (fresh ones generated, a chunk at a time) to the rows file ``path`` in this
        process, as :meth:`EmbeddingShard.save_rows`; the file's manifest entry."""
        overlay = None if overlay_local is None else (overlay_local, overlay_rows)
        return write_rows_file(path, len(self.rows), self.spec.width, self.read_stripes, overlay=overlay, chunk=chunk)

    def all_local_rows(self) -> np.ndarray:
        """Every row (fresh ones generated), a copy."""
        self.materialise(slice(None))
        self.fresh = None
        return self.rows.copy()

    def applied_batches(self) -> list[int]:
        return sorted(self.applied)

    def pid(self) -> int:
        return os.getpid()


class CodedShard(SequencedMember, EmbeddingShard):
    """A data shard that applies each numbered write-back batch once."""

    def __init__(self, spec: RowSpec, shard: int, num_shards: int, initialise: bool = True) -> None:
        # Not initialised: a rebuild target or a resumed run's shard, every row fresh until installed.
        EmbeddingShard.__init__(self, spec, shard, num_shards, initialise)
        self.applied = set()
        self.fresh = None if initialise else np.ones(len(self.rows), dtype=bool)

    def initial_rows(self, local: np.ndarray) -> np.ndarray:
        return init_rows(self.spec, local * self.num_shards + self.shard)

    def fetch(self, ids: np.ndarray) -> np.ndarray:
        if self.fresh is not None:
            self.materialise(self.local_index(ids))
        return super().fetch(ids)

    def write_back(self, ids: np.ndarray, rows: np.ndarray) -> int:
        n = super().write_back(ids, rows)
        if self.fresh is not None:
            self.overwritten(np.asarray(ids, dtype=np.int64) // self.num_shards)
        return n

    def local_rows(self) -> np.ndarray:
        return self.all_local_rows()

    def load_rows(self, path: str, sha256: str | None = None, chunk: int = ROW_CHUNK) -> int:
        """Every row from a rows file (a checkpoint's): none is fresh afterwards."""
        n = EmbeddingShard.load_rows(self, path, sha256, chunk)
        self.fresh = None
        return n

    def exchange_seq(self, seq: int, write_ids: np.ndarray, write_rows: np.ndarray, fetch_ids: np.ndarray,
                     gather: np.ndarray | None = None):
        """Apply write-back batch ``seq`` (once), fetch rows; with ``gather``, also return this shard's
        rows of those stripes, after the batch (a degraded read's survivor piece): ``(rows, stripes)``."""
        if len(write_ids) and seq not in self.applied:
            self.write_back(write_ids, write_rows)
            self.applied.add(seq)
        rows = self.fetch(fetch_ids)
        return rows if gather is None else (rows, self.gather(gather))


def encode_parity_of_initial_rows(spec: RowSpec, code: ErasureCode, p: int,
                                  stripes: np.ndarray | None = None) -> np.ndarray:
    """Parity shard ``p`` of the initial rows, all of it or its rows of ``stripes`` (rows are a pure
    function of (seed, id), so any process can encode them chunk by chunk without reading the data
    shards)."""
    k = code.k
    if stripes is None:
        stripes = np.arange(num_stripes(spec, k), dtype=np.int64)
    out = np.zeros((len(stripes), spec.width), dtype=np.float32)
    acc_bytes = out.view(np.uint8)
    for lo in range(0, len(stripes), ENCODE_CHUNK_STRIPES):
        hi = min(lo + ENCODE_CHUNK_STRIPES, len(stripes))
        for i in range(k):
            ids = stripes[lo:hi] * k + i
            inside = ids < spec.total_rows  # past a short data shard's end: zero rows, nothing to add
            if inside.any():
                rows = np.ascontiguousarray(init_rows(spec, ids[inside])).view(np.uint8)
                if inside.all():
                    gf256.mul_xor_into(acc_bytes[lo:hi], code.coefficient(p, i), rows)
                else:
                    part = acc_bytes[lo:hi][inside]
                    gf256.mul_xor_into(part, code.coefficient(p, i), rows)
                    acc_bytes[lo:hi][inside] = part
    return out


def encode_parity_from_members(code: ErasureCode, width: int, data: list, parity, p: int, n_stripes: int,
                               chunk: int = 0) -> int:
    """Encode parity shard ``p``'s rows from the data shards' rows as they are now, streamed: for each
    chunk of ``chunk`` stripes (default: a chunk of rows, :data:`~dlrmflow.engine.row_files.ROW_CHUNK`,
    over the K shards) read the K data shards' rows of those stripes (``data``: their actors; the next
    chunk's reads go out before this chunk is encoded), XOR ``C[p, i] * rows`` together and install the
    result on ``parity`` (its actor, or the member object itself when this process hosts it). At most
    two chunks of data rows are held at once. Returns the stripes encoded."""
    k = code.k
    chunk = chunk or chunk_stripes(k, ROW_CHUNK)

    def reads(start: int) -> list:
        return [call_server(member, "read_stripes", start, min(start + chunk, n_stripes)) for member in data]

    calls = reads(0) if n_stripes else []
    for start in range(0, n_stripes, chunk):
        stop = min(start + chunk, n_stripes)
        pieces = [answer(call) for call in calls]
        if stop < n_stripes:
            calls = reads(stop)
        acc = np.zeros((stop - start, width * 4), dtype=np.uint8)
        for i, piece in enumerate(pieces):  # a shorter data shard adds zero rows past its end
            if len(piece):
                gf256.mul_xor_into(acc[: len(piece)], code.coefficient(p, i),
                                   np.ascontiguousarray(piece).view(np.uint8))
        rows = acc.view(np.float32)
        if isinstance(parity, SequencedMember):
            parity.install(start, rows)
        else:
            answer(call_server(parity, "install", start, rows))
    return n_stripes


class ParityShard(SequencedMember):
    """Parity shard ``p``: starts as the encoding of the initial data shards."""

    def __init__(self, spec: RowSpec, k: int, r: int, p: int, initialise: bool = True) -> None:
        self.spec, self.code, self.p = spec, ErasureCode(k, r), p
        if initialise:
            self.rows = encode_parity_of_initial_rows(spec, self.code, p)
        else:  # a rebuild target or a resumed run's parity: every stripe fresh until installed
            self.rows = np.zeros((num_stripes(spec, k), spec.width), dtype=np.float32)
        self.applied = set()
        self.fresh = None if initialise else np.ones(len(self.rows), dtype=bool)

    def initial_rows(self, local: np.ndarray) -> np.ndarray:
        return encode_parity_of_initial_rows(self.spec, self.code, self.p, local)

    def apply(self, seq: int, stripes: np.ndarray, delta: np.ndarray) -> int:
        """XOR a write-back batch's delta into the parity rows, once per ``seq``."""
        if seq in self.applied:
            return 0
        stripes = np.asarray(stripes, dtype=np.int64)
        self.materialise(stripes)
        self.code.apply_delta(self.rows, delta, rows=stripes)
        self.applied.add(seq)
        return len(stripes)

    def apply_batches(self, seqs: list[int], stripes: list[np.ndarray], deltas: list[np.ndarray]) -> int:
        """:meth:`apply` for several batches that came in one message, in order."""
        return sum(self.apply(*batch) for batch in zip(seqs, stripes, deltas, strict=True))

    def apply_and_gather(self, seqs: list[int], stripes: list[np.ndarray], deltas: list[np.ndarray],
                         gather: np.ndarray) -> np.ndarray:
        """:meth:`apply_batches`, then the parity rows of stripes ``gather`` (for a degraded read)."""
        self.apply_batches(seqs, stripes, deltas)
        return self.gather(gather)


def start_member(client: Client, spec: RowSpec, code: ErasureCode, s: int, worker: str, *,
                 initialise: bool) -> Future:
    """Member ``s``'s actor on ``worker`` (its future; ``initialise=False``: every row fresh)."""
    if s < code.k:
        return client.submit(CodedShard, spec, s, code.k, initialise, actor=True, workers=[worker], pure=False)
    return client.submit(ParityShard, spec, code.k, code.r, s - code.k, initialise, actor=True,
                         workers=[worker], pure=False)

