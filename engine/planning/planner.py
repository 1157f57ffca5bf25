"""The oracle cacher: a lookahead plan of prefetches, evictions and cache slots for a batch stream.

For ``BatchStream(dataset_dir, batch_size, drop_last=...)`` and a window ``L`` the plan says, per
iteration ``t``, which rows to prefetch for ``t`` (with the cache slot each goes to) and which to
write back after ``t`` (see :mod:`dlrmflow.engine.planning.lookahead` for the rules and the capacity bound).

Two implementations that must agree exactly (the tests check it):

- :func:`plan_sequential`: the reference, one forward pass over the whole stream;
- :func:`plan_chunked`: the Dask job; tasks are (chunk of iterations) x (group of tables), each
  reading an ``L``-iteration halo before and after its chunk. Tables are independent (a row
  belongs to one table), so splitting by tables needs no halo at all.

Both end with the same sequential passes on the driver: the capacity bound (Belady within the
window) and slot assignment, which replays the trainer's timing and rejects any stale read. The reference
runs them over the whole plan (:func:`assemble_plan`); the Dask job streams (:func:`assemble_stream`): task
results spooled to disk in pieces as tasks finish, then the passes piece by piece in iteration order and
the plan files written as iterations finish, so the driver never holds the whole plan.
A plan directory holds Parquet files of consecutive iterations plus ``plan.json``; it is written
to a temporary directory and renamed, so an interrupted run never leaves a plan that looks complete.
Design notes: docs/planner.md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, ValidationInfo, field_validator, model_validator

from dlrmflow.datasets.meta import read_meta
from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.config_model import ConfigModel
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.phases import phase_reported
from dlrmflow.engine.planning.lookahead import (
    IdMap,
    PlanConsistencyError,
    RangeDecisions,
    assign_slots,
    coverage,
    decide_range,
    farthest_first_drops,
    iter_id_batches,
    occupancy,
    repeated_id,
)
from dlrmflow.engine.up_to_date import saved_result

PLAN_FILE = "plan.json"
PLAN_FORMAT_VERSION = 1
ITERATIONS_PER_FILE = 512
# Iterations per Parquet row group of a plan file: what a reader of the plan holds at once (a trainer reads a
# row group at a time, not a file). At Terabyte's batches an iteration prefetches up to ~100k ids (2.4 MB).
ROW_GROUP_ITERATIONS = 8
# The streamed plan's grain: the driver spools task results and writes row groups in pieces of this many
# iterations, so what it holds does not grow with the dataset (nor with the chunk size).
SPOOL_ITERATIONS = 64
# Ids are sorted within an iteration and slots come off a FIFO queue in runs: delta encoding
# stores both in a quarter of the plain size, faster than any general-purpose compression.
DELTA_ENCODED = {
    f"{c}.list.element": "DELTA_BINARY_PACKED" for c in ("prefetch_ids", "prefetch_slots", "evict_ids")
}

Progress = Callable[[int, int], None]


class PlanError(UserInputError):
    """A plan configuration or plan directory is invalid."""


class PlanMismatchError(PlanError):
    """A plan was made for another dataset, batch size or window."""


class CapacityError(PlanError):
    """A cache capacity cannot hold what one iteration needs: the oracle plan's (an iteration plus its
    prefetches in flight), the LRU cache's (an iteration's distinct rows), or ``--capacity`` itself.
    The one capacity error of dlrmflow: the planner, the trainer's checks and the row stores raise it."""


def _window_error(distance: Any, lookahead: Any) -> PlanError:
    return PlanError(
        f"prefetch_distance: --prefetch-distance: prefetch distance P={distance} must lie in 1..L "
        f"(--lookahead L={lookahead}): "
        "a row evicted after iteration t can be needed again at t+L+1, and that fetch is issued "
        "when iteration t+L+1-P starts; with P > L that is before t's write-back (a stale read)"
    )


class PlanConfig(ConfigModel):
    """What a plan is made with, declared once: the planner's settings, which ``plan.json`` records (these
    five keys, as when this was a dataclass: every plan made since loads). Frozen; ``PlanConfig(32, 6, 2)``
    still takes its values in field order. A bad value raises :class:`PlanError` naming the field and
    its option (``batch_size: --batch-size: the batch size must be >= 1, got 0``)."""

    error = PlanError
    setting = "plan setting"

    batch_size: int = Field(ge=1, title="batch size", description="rows per iteration")
    lookahead: int = Field(200, ge=1, title="lookahead window L",
                           description="L: keep a row cached when it is used again within L iterations")
    prefetch_distance: int = Field(1, ge=1, title="prefetch distance P",
                                   description="P: iterations ahead a fetch is issued, 1 <= P <= L")
    capacity: int | None = Field(None, ge=1, title="cache capacity",
                                 description="cache rows (default: unbounded; with a bound, the rows used farthest "
                                             "ahead leave)")
    drop_last: bool = Field(False, description="drop a final partial batch")

    def __init__(self, *args: Any, **values: Any) -> None:
        fields = list(PlanConfig.model_fields)
        if len(args) > len(fields):
            raise TypeError(f"PlanConfig takes at most {len(fields)} positional values, got {len(args)}")
        super().__init__(**dict(zip(fields, args, strict=False)), **values)

    @field_validator("prefetch_distance", mode="before")
    @classmethod
    def _in_the_window(cls, value: Any, info: ValidationInfo) -> Any:
        """1 <= P <= L, checked before P's own bound so that the message says why (a stale read)."""
        lookahead = info.data.get("lookahead")
        if isinstance(value, int) and isinstance(lookahead, int) and not 1 <= value <= lookahead:
            raise _window_error(value, lookahead)
        return value

    @model_validator(mode="after")
    def _distance_within_lookahead(self) -> PlanConfig:
        if self.prefetch_distance > self.lookahead:  # values the field check above did not see as ints
            raise _window_error(self.prefetch_distance, self.lookahead)
        return self

    def settings(self) -> PlanConfig:
        """Just the planner's settings (those of a :class:`PlanJobConfig` without its paths)."""
        return PlanConfig(**{name: getattr(self, name) for name in PlanConfig.model_fields})

    def record(self) -> dict[str, Any]:
        """The settings as ``plan.json`` records them."""
        return {name: getattr(self, name) for name in PlanConfig.model_fields}


class PlanJobConfig(PlanConfig):
    """One ``dlrmflow plan`` run (the plan flow's parameter): the dataset, the plan directory, the plan's
    settings and how the work is cut into Dask tasks. Up to date (:meth:`saved_result`) when the plan
    directory's ``plan.json`` records this dataset's fingerprint and these settings."""

    setting = "plan setting"
    option_names = {"dataset_dir": "DATASET_DIR", "output_dir": "--output"}

    dataset_dir: str = Field(description="a preprocessed dataset directory")
    output_dir: str = Field(description="the plan directory to write")
    chunk_iterations: int | None = Field(None, ge=1, description="iterations per Dask task (default max(16L, 1024))")

    @field_validator("dataset_dir", "output_dir", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    def saved_result(self) -> PlanResult | None:
        """The plan in ``output_dir`` (as a skipped result) when it was made for this dataset, as it is now,
        with these settings; None when the plan must be made."""
        try:
            dataset_fingerprint = read_meta(self.dataset_dir).fingerprint
        except UserInputError:
            return None
        expect = {"format_version": PLAN_FORMAT_VERSION, "dataset_fingerprint": dataset_fingerprint, **self.record()}
        saved = saved_result(Path(self.output_dir) / PLAN_FILE, expect)
        return None if saved is None else PlanResult.of(saved, self.output_dir, skipped=True)

    def is_up_to_date(self) -> bool:
        return self.saved_result() is not None


@dataclass(frozen=True)
class PlanResult:
    """A plan directory's record (``plan.json``), where it is and, when made now, how fast it was made;
    :meth:`as_dict` is what ``dlrmflow plan --json`` prints."""

    output: str
    config: PlanConfig
    dataset_fingerprint: str
    num_iterations: int
    num_rows: int
    num_slots: int
    counts: dict[str, int]  # ids, prefetched_rows, evicted_rows, peak_occupancy
    files: list[dict[str, Any]] = field(default_factory=list)
    seconds: float | None = None
    dask_workers: int | None = None
    skipped: bool = False  # an earlier plan, up to date

    @classmethod
    def of(cls, record: dict[str, Any], output: str | os.PathLike, **made: Any) -> PlanResult:
        """From ``plan.json``'s contents (``record``); ``made``: seconds, dask_workers, skipped."""
        config = PlanConfig(**{name: record[name] for name in PlanConfig.model_fields})
        return cls(str(output), config, record["dataset_fingerprint"], record["num_iterations"], record["num_rows"],
                   record["num_slots"], record["counts"], record.get("files", []), **made)

    @property
    def ids_per_second(self) -> float | None:
        return self.counts["ids"] / self.seconds if self.seconds else None

    @property
    def iterations_per_second(self) -> float | None:
        return self.num_iterations / self.seconds if self.seconds else None

    def as_dict(self) -> dict[str, Any]:
        return {"format_version": PLAN_FORMAT_VERSION, "dataset_fingerprint": self.dataset_fingerprint,
                **self.config.record(), "num_iterations": self.num_iterations, "num_rows": self.num_rows,
                "num_slots": self.num_slots, "counts": self.counts, "files": self.files, "output": self.output,
                "seconds": self.seconds, "dask_workers": self.dask_workers, "ids_per_second": self.ids_per_second,
                "iterations_per_second": self.iterations_per_second, "skipped": self.skipped}


@dataclass(frozen=True)
class IterationPlan:
    t: int
    prefetch_ids: np.ndarray  # int64 global ids to fetch for iteration t (sorted ascending)
    prefetch_slots: np.ndarray  # int64 cache slot of each prefetched id (same order)
    evict_ids: np.ndarray  # int64 global ids to write back after iteration t computed (sorted)


@dataclass
class PlanArrays:
    """A whole plan in memory (what :func:`write_plan` stores): CSR arrays over iterations."""

    config: PlanConfig
    dataset_fingerprint: str
    num_iterations: int
    num_rows: int  # total embedding rows of the dataset
    num_slots: int
    peak_occupancy: int
    ids_read: int  # ids in the stream (rows x tables): the throughput unit
    prefetch_offsets: np.ndarray
    prefetch_ids: np.ndarray
    prefetch_slots: np.ndarray
    evict_offsets: np.ndarray
    evict_ids: np.ndarray

    def iteration(self, t: int) -> IterationPlan:
        a, b = self.prefetch_offsets[t], self.prefetch_offsets[t + 1]
        c, d = self.evict_offsets[t], self.evict_offsets[t + 1]
        return IterationPlan(t, self.prefetch_ids[a:b], self.prefetch_slots[a:b], self.evict_ids[c:d])

    def summary(self) -> dict[str, Any]:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "dataset_fingerprint": self.dataset_fingerprint,
            **self.config.record(),
            "num_iterations": self.num_iterations,
            "num_rows": self.num_rows,
            "num_slots": self.num_slots,
            "counts": {
                "ids": self.ids_read,
                "prefetched_rows": len(self.prefetch_ids),
                "evicted_rows": len(self.evict_ids),
                "peak_occupancy": self.peak_occupancy,
            },
        }


# ---- computing a plan ---------------------------------------------------------------------


def open_stream(dataset_dir: str | os.PathLike, config: PlanConfig) -> BatchStream:
    return BatchStream(dataset_dir, config.batch_size, drop_last=config.drop_last, sparse_only=True)


def decide_chunk(
    dataset_dir: str, config: PlanConfig, first: int, stop: int, table_lo: int, table_hi: int
) -> RangeDecisions:
    """One task: the decisions for iterations ``first..stop-1`` of tables ``table_lo..table_hi-1``."""
    stream = open_stream(dataset_dir, config)
    n, window, num_rows = len(stream), config.lookahead, stream.meta.total_embedding_rows
    batches = iter_id_batches(stream, max(0, first - window), min(n, stop + window), range(table_lo, table_hi),
                              reuse_buffer=True)  # decide_range keeps no batch past its turn
    bounds = [*stream.meta.table_offsets, num_rows]
    return decide_range(
        batches, first=first, stop=stop, num_iterations=n, window=window,
        distance=config.prefetch_distance, candidates=config.capacity is not None,
        num_rows=num_rows, id_range=(bounds[table_lo], bounds[table_hi]),
    )


def plan_sequential(dataset_dir: str | os.PathLike, config: PlanConfig) -> PlanArrays:
    """The reference: one pass over every iteration and table, then the driver passes."""
    stream = open_stream(dataset_dir, config)
    n_tables = len(stream.meta.sparse_columns)
    return assemble_plan(stream, config, decide_chunk(str(dataset_dir), config, 0, len(stream), 0, n_tables))


def default_chunk_iterations(config: PlanConfig) -> int:
    # A chunk reads 2L halo iterations besides its own: keep that a small share (<= 1/8) of its
    # work. Table groups already give every worker a task, so chunks are only for long streams.
    return max(16 * config.lookahead, 1024)


def split_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` items in ``parts`` contiguous, nearly equal ranges (no empty one)."""
    parts = max(1, min(parts, total))
    cuts = [round(i * total / parts) for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def plan_chunked(
    dataset_dir: str | os.PathLike,
    config: PlanConfig,
    *,
    client: Any = None,
    chunk_iterations: int | None = None,
    table_groups: int | None = None,
    progress: Progress | None = None,
) -> PlanArrays:
    """The plan as a Dask job over (iteration chunk, table group) tasks; in-process without a client.

    The whole plan in memory, for tests and benchmarks: :func:`make_plan` streams the same plan to disk."""
    sink = _MemorySink()
    with tempfile.TemporaryDirectory(prefix="dlrmflow-plan-spool-") as spool:
        stream, stats = _stream_plan(dataset_dir, config, sink, Path(spool), client=client,
                                     chunk_iterations=chunk_iterations, table_groups=table_groups, progress=progress)
    pf_offsets, pf_ids, slots, ev_offsets, ev_ids = sink.arrays()
    n = len(stream)
    rows = stream.stop_row - stream.start_row if not config.drop_last else n * config.batch_size
    return PlanArrays(
        config, stream.meta.fingerprint, n, stream.meta.total_embedding_rows, stats.num_slots, stats.peak_occupancy,
        rows * len(stream.meta.sparse_columns), pf_offsets, pf_ids, slots, ev_offsets, ev_ids,
    )


def _stream_plan(
    dataset_dir: str | os.PathLike,
    config: PlanConfig,
    sink: PlanSink,
    spool_dir: Path,
    *,
    client: Any = None,
    chunk_iterations: int | None = None,
    table_groups: int | None = None,
    progress: Progress | None = None,
    iterations_per_file: int | None = None,
) -> tuple[BatchStream, _Stats]:
    """Decide every (chunk, table group) task, spooling each result to ``spool_dir`` as it finishes (the
    driver keeps only per-iteration counts), then assemble the chunks in order into ``sink``.
    Progress: one step per task finished, then one per chunk assembled (a reporter with ``in_stages`` is told
    those two stages and their sizes first: :meth:`~dlrmflow.tasks.reporting.FlowProgress.in_stages`)."""
    stream = open_stream(dataset_dir, config)
    n, n_tables = len(stream), len(stream.meta.sparse_columns)
    chunk = chunk_iterations or default_chunk_iterations(config)
    if chunk < 1:
        raise PlanError(f"chunk_iterations must be >= 1, got {chunk}")
    if table_groups is None:
        from dlrmflow.engine.serving.cluster import cluster_workers  # Dask: imported when a plan is made

        table_groups = len(cluster_workers(client)) if client is not None else 1
    chunks = split_ranges(n, -(-n // chunk)) or [(0, 0)]  # equal chunks of at most ``chunk`` iterations
    groups = split_ranges(n_tables, table_groups)
    tasks = [(c, g) for c in range(len(chunks)) for g in range(len(groups))]
    where = str(Path(dataset_dir).resolve())  # workers of an existing cluster may run elsewhere
    args = [(where, config, *chunks[c], *groups[g]) for c, g in tasks]
    total = len(tasks) + len(chunks)  # a step per task finished, then per chunk assembled
    in_stages = getattr(progress, "in_stages", None)
    if in_stages is not None:  # a reporter that counts each stage in its own unit, as the phase announces them
        in_stages([("plan tasks decided", len(tasks)), ("plan chunks assembled", len(chunks))])
    spool, counts = _Spool(spool_dir, chunks, len(groups), config.prefetch_distance), _Counts(n)

    def finished(i: int, piece_of: Callable[[int, int], RangeDecisions], done: int) -> None:
        """Task ``i`` is done: spool its pieces one at a time (``piece_of(lo, hi)``), count them."""
        chunk, group = tasks[i]
        for p in spool.of_chunk[chunk]:
            piece = piece_of(*spool.pieces[p])
            counts.add(piece)
            spool.put(p, group, piece)
            del piece
        if progress:
            progress(done, total)

    distance = config.prefetch_distance
    # The first step ends with the first task: a task decides a whole chunk of one table group, which can
    # take a minute, so the phase says at once what it is doing.
    with phase_reported(f"plan: deciding {n:,} iterations in {len(tasks)} tasks ({len(chunks)} chunks x "
                        f"{len(groups)} table groups)"):
        if client is None:
            for i, a in enumerate(args):
                d = decide_chunk(*a)
                finished(i, lambda lo, hi, d=d: slice_decisions(d, lo, hi, distance), i + 1)
                del d
        else:
            from distributed import as_completed

            futures = [client.submit(decide_chunk, *a, pure=False) for a in args]
            position = {future.key: i for i, future in enumerate(futures)}
            released: set[str] = set()
            try:
                for done, future in enumerate(as_completed(futures), start=1):
                    if future.status == "error":
                        future.result()  # a task's error is re-raised here
                    # The result stays on its worker: the driver fetches it a piece at a time, then lets it go.
                    finished(position[future.key], lambda lo, hi, f=future: client.submit(
                        slice_decisions, f, lo, hi, distance, pure=False).result(), done)
                    released.add(future.key)
                    future.release()
            finally:
                client.cancel([f for f in futures if f.key not in released])
    stats = assemble_stream(
        config, n, spool.pieces, spool.take, counts, sink,
        iterations_per_file=iterations_per_file or ITERATIONS_PER_FILE,
        capacity_error=lambda base: capacity_error(stream, config, base),
        progress=(lambda c: progress(len(tasks) + c, total)) if progress else None,
        pieces_of_chunk=spool.of_chunk,
    )
    return stream, stats


def _interleave(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-iteration concatenation of CSR lists (each part's ids for t follow the previous part's)."""
    counts = np.sum([c for c, _ in parts], axis=0)
    out = np.empty(int(counts.sum()), dtype=np.int64)
    dest_start = np.cumsum(counts) - counts
    for part_counts, ids in parts:
        src_start = np.cumsum(part_counts) - part_counts
        out[np.repeat(dest_start - src_start, part_counts) + np.arange(len(ids))] = ids
        dest_start = dest_start + part_counts
    return counts, out


def merge_table_groups(parts: list[RangeDecisions]) -> RangeDecisions:
    """One chunk's decisions from its table groups (ascending tables, so ids stay sorted)."""
    if len(parts) == 1:
        return parts[0]
    pf_counts, pf_ids = _interleave([(p.prefetch_counts, p.prefetch_ids) for p in parts])
    ev_counts, ev_ids = _interleave([(p.evict_counts, p.evict_ids) for p in parts])
    return RangeDecisions(
        parts[0].first, parts[0].stop, pf_counts, pf_ids, ev_counts, ev_ids,
        *(np.concatenate([getattr(p, f) for p in parts]) for f in ("cand_ids", "cand_start", "cand_end")),
    )


def concat_chunks(chunks: list[RangeDecisions]) -> RangeDecisions:
    def cat(field: str) -> np.ndarray:
        return np.concatenate([getattr(c, field) for c in chunks])

    fields = ("prefetch_counts", "prefetch_ids", "evict_counts", "evict_ids", "cand_ids", "cand_start", "cand_end")
    return RangeDecisions(chunks[0].first, chunks[-1].stop, *(cat(f) for f in fields))


def _add_events(counts: np.ndarray, ids: np.ndarray, times: np.ndarray, new_ids: np.ndarray):
    all_t = np.concatenate([np.repeat(np.arange(len(counts)), counts), times])
    all_ids = np.concatenate([ids, new_ids])
    order = np.lexsort((all_ids, all_t))
    return np.bincount(all_t, minlength=len(counts)).astype(np.int64), all_ids[order]


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def assemble_plan(stream: BatchStream, config: PlanConfig, d: RangeDecisions) -> PlanArrays:
    """Driver passes: capacity bound (Belady within the window), then slots, then the plan."""
    n, distance, capacity = len(stream), config.prefetch_distance, config.capacity
    pf_counts, pf_ids, ev_counts, ev_ids = d.prefetch_counts, d.prefetch_ids, d.evict_counts, d.evict_ids
    num_rows = stream.meta.total_embedding_rows
    if capacity is not None and n:
        occ = occupancy(pf_counts, ev_counts, distance)
        base = occ - coverage(d.cand_start, d.cand_end, n)  # what no choice of evictions can lower
        if base.max() > capacity:
            raise capacity_error(stream, config, base)
        drop = farthest_first_drops(occ - capacity, d.cand_start, d.cand_end, d.cand_ids)
        if drop.any():  # give up the kept gap (p, t): evict after p, prefetch again for t
            pf_counts, pf_ids = _add_events(pf_counts, pf_ids, d.cand_end[drop] + distance + 1, d.cand_ids[drop])
            ev_counts, ev_ids = _add_events(ev_counts, ev_ids, d.cand_start[drop] - 1, d.cand_ids[drop])
    peak = int(occupancy(pf_counts, ev_counts, distance).max()) if n else 0
    num_slots = capacity if capacity is not None else peak
    pf_offsets, ev_offsets = _offsets(pf_counts), _offsets(ev_counts)
    slots, replay_peak = assign_slots(
        pf_offsets, pf_ids, ev_offsets, ev_ids, distance=distance, num_slots=num_slots
    )
    if replay_peak != peak:
        raise RuntimeError(f"slot replay peaks at {replay_peak} rows, the occupancy count at {peak}")
    rows = stream.stop_row - stream.start_row if not config.drop_last else n * config.batch_size
    return PlanArrays(
        config, stream.meta.fingerprint, n, num_rows, num_slots, peak, rows * len(stream.meta.sparse_columns),
        pf_offsets, pf_ids, slots, ev_offsets, ev_ids,
    )


def capacity_error(stream: BatchStream, config: PlanConfig, base: np.ndarray) -> CapacityError:
    """Name the first iteration that alone overflows the cache, else the first window that does."""
    capacity, distance = config.capacity, config.prefetch_distance
    need = f"the smallest capacity this stream allows with P={distance} is {int(base.max())} rows"
    for t, ids in iter_id_batches(stream, 0, len(stream)):  # only on this error path: a full pass
        own = len(np.unique(ids))
        if own > capacity:
            return CapacityError(
                f"capacity {capacity} rows is too small: iteration {t} alone uses {own} unique rows "
                f"(batch size {config.batch_size}); {need}"
            )
    u = int(np.argmax(base > capacity))
    last = min(u + distance, len(stream) - 1)
    return CapacityError(
        f"capacity {capacity} rows is too small: while iteration {u} computes, its rows and those of "
        f"iterations {u + 1}..{last} (prefetch distance {distance}) must all be cached, {int(base[u])} rows; "
        f"{need}, or lower the prefetch distance"
    )


# ---- streaming assembly: the driver passes chunk by chunk ---------------------------------------


_DECISION_FIELDS = ("prefetch_counts", "prefetch_ids", "evict_counts", "evict_ids", "cand_ids", "cand_start",
                    "cand_end")


class _Spool:
    """Task results on disk until the in-order pass takes them, in pieces of at most ``SPOOL_ITERATIONS``
    iterations: the driver holds one task's result only while it writes it out, then pieces."""

    def __init__(self, directory: Path, chunks: list[tuple[int, int]], groups: int, distance: int) -> None:
        self.directory, self.groups, self.distance = directory, groups, distance
        directory.mkdir(parents=True, exist_ok=True)
        self.pieces: list[tuple[int, int]] = []
        self.of_chunk: list[range] = []
        for lo, hi in chunks:
            start = len(self.pieces)
            self.pieces += [(a, min(a + SPOOL_ITERATIONS, hi)) for a in range(lo, hi, SPOOL_ITERATIONS)] or [(lo, hi)]
            self.of_chunk.append(range(start, len(self.pieces)))

    def _path(self, piece: int, group: int) -> Path:
        return self.directory / f"piece-{piece:08d}-{group:04d}.npz"

    def put(self, piece: int, group: int, d: RangeDecisions) -> None:
        np.savez(self._path(piece, group), first=d.first, stop=d.stop,
                 **{f: getattr(d, f) for f in _DECISION_FIELDS})

    def take(self, piece: int) -> RangeDecisions:
        parts = []
        for g in range(self.groups):
            path = self._path(piece, g)
            with np.load(path) as z:
                parts.append(RangeDecisions(int(z["first"]), int(z["stop"]), *(z[f] for f in _DECISION_FIELDS)))
            path.unlink()
        return merge_table_groups(parts)


def slice_decisions(d: RangeDecisions, lo: int, hi: int, distance: int) -> RangeDecisions:
    """Iterations ``lo .. hi-1`` of ``d``: their prefetches and evictions, and the candidate intervals their
    uses close (an interval ends ``P+1`` before that use). Runs where ``d`` is (a worker)."""
    pf_off, ev_off = _offsets(d.prefetch_counts), _offsets(d.evict_counts)
    a, b = lo - d.first, hi - d.first
    use = d.cand_end + distance + 1
    cand = (use >= lo) & (use < hi)
    return RangeDecisions(
        lo, hi, d.prefetch_counts[a:b], d.prefetch_ids[pf_off[a] : pf_off[b]], d.evict_counts[a:b],
        d.evict_ids[ev_off[a] : ev_off[b]], d.cand_ids[cand], d.cand_start[cand], d.cand_end[cand],
    )


class _Counts:
    """Per-iteration counts over the whole stream (8 bytes an iteration each): occupancy and the capacity's
    lower bound (what no choice of evictions can lower) before any row is assigned a slot."""

    def __init__(self, n: int) -> None:
        self.prefetch = np.zeros(n, dtype=np.int64)
        self.evict = np.zeros(n, dtype=np.int64)
        self.cover = np.zeros(n + 1, dtype=np.int64)  # candidate intervals starting - ending at each time

    def add(self, d: RangeDecisions) -> None:
        self.prefetch[d.first : d.stop] += d.prefetch_counts
        self.evict[d.first : d.stop] += d.evict_counts
        n = len(self.prefetch)
        self.cover += np.bincount(d.cand_start, minlength=n + 1)[: n + 1]
        self.cover -= np.bincount(d.cand_end + 1, minlength=n + 1)[: n + 1]


class _SlotReplay:
    """:func:`~dlrmflow.engine.planning.lookahead.assign_slots`, fed one iteration at a time: the same FIFO of
    free slots (a ring of ``num_slots``) and the same order of steps, so the same slots. The rows cached map to
    their slots in an :class:`IdMap`: what it holds follows the rows cached at once (at most ``num_slots``), not
    the embedding rows, and it goes with the replay when the plan is written."""

    def __init__(self, n: int, distance: int, num_slots: int) -> None:
        self.n, self.distance, self.num_slots = n, distance, num_slots
        self.cached = IdMap()  # row -> its slot, for the rows fetched and not yet written back
        self.ring = np.arange(num_slots + 1, dtype=np.int64)  # one spare: head == tail means empty
        self.head, self.free = 0, num_slots
        self.peak = 0
        self.evicts: dict[int, np.ndarray] = {}  # iterations issued, not yet written back

    def _next_free(self, k: int) -> np.ndarray:
        """The ``k`` slots at the front of the free queue (left there)."""
        return self.ring[(self.head + np.arange(k)) % len(self.ring)] if k else np.zeros(0, np.int64)

    def _put(self, slots: np.ndarray) -> None:
        size = len(self.ring)
        tail = (self.head + self.free) % size
        self.ring[(tail + np.arange(len(slots))) % size] = slots
        self.free += len(slots)

    def release(self, v: int) -> None:
        ids = self.evicts.pop(v)
        at, held = self.cached.lookup(ids, -1)
        if (held < 0).any():
            raise PlanConsistencyError(f"iteration {v} evicts row {int(ids[held < 0][0])}, which is not cached")
        twice = repeated_id(ids)
        if twice is not None:
            raise PlanConsistencyError(f"iteration {v} evicts row {twice} twice")
        self.cached.remove(at)
        self._put(held)

    def issue(self, t: int, ids: np.ndarray, evict_ids: np.ndarray) -> np.ndarray:
        """Iteration ``t``'s slots; first the write-backs that precede its fetch (those of ``t-P-1``)."""
        self.evicts[t] = evict_ids
        if t > self.distance:
            self.release(t - self.distance - 1)
        twice = repeated_id(ids)
        if twice is None and self.free >= len(ids):  # then one probe per id checks and places it
            slots = self._next_free(len(ids))
            present = self.cached.add_absent(ids, slots)
            if not present.size:
                self.head = (self.head + len(ids)) % len(self.ring)
                self.free -= len(ids)
                if t >= min(self.distance, self.n - 1):  # assign_slots' checkpoints: after 0..P, then each step
                    self.peak = max(self.peak, self.num_slots - self.free)
                return slots
        else:
            present = np.flatnonzero(self.cached.lookup(ids, -1)[1] >= 0)
        if present.size:
            x = int(ids[present.min()])
            after = [v for v in sorted(self.evicts) if v >= t - self.distance - 1 and x in self.evicts[v]]
            raise PlanConsistencyError(
                f"row {x} is prefetched for iteration {t} (issued when iteration {t - self.distance} starts) "
                f"while it is still cached"
                + (f": it is written back only after iteration {after[0]}" if after else "")
                + f"; with prefetch distance {self.distance} that fetch would read a stale row"
            )
        if twice is not None:
            raise PlanConsistencyError(f"row {twice} is prefetched twice for iteration {t}")
        raise RuntimeError(f"iteration {t}: {len(ids)} prefetches but only {self.free} free slots")

    def finish(self) -> None:
        for v in sorted(self.evicts):
            self.release(v)
        if self.free != self.num_slots:
            raise PlanConsistencyError(f"{self.num_slots - self.free} rows stay cached after the last iteration")


class PlanSink:
    """Where the assembled plan goes, a row group of consecutive iterations at a time."""

    def write(self, first: int, stop: int, prefetch_offsets: np.ndarray, prefetch_ids: np.ndarray,
              prefetch_slots: np.ndarray, evict_offsets: np.ndarray, evict_ids: np.ndarray) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _MemorySink(PlanSink):
    """Collects the whole plan (what :func:`plan_chunked` returns, for tests and benchmarks)."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []

    def write(self, first, stop, prefetch_offsets, prefetch_ids, prefetch_slots, evict_offsets, evict_ids) -> None:
        self.parts.append((np.diff(prefetch_offsets), prefetch_ids, prefetch_slots, np.diff(evict_offsets), evict_ids))

    def arrays(self) -> tuple[np.ndarray, ...]:
        if not self.parts:
            return (np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64),
                    np.zeros(0, np.int64))
        pf_counts, pf_ids, slots, ev_counts, ev_ids = (np.concatenate(c) for c in zip(*self.parts, strict=True))
        return _offsets(pf_counts), pf_ids, slots, _offsets(ev_counts), ev_ids


PLAN_SCHEMA = pa.schema([("t", pa.int64()), ("prefetch_ids", pa.list_(pa.int64())),
                         ("prefetch_slots", pa.list_(pa.int64())), ("evict_ids", pa.list_(pa.int64()))])


class _DirectorySink(PlanSink):
    """Parquet files of ``iterations_per_file`` consecutive iterations (the last one shorter), each written
    row group by row group as its iterations come."""

    def __init__(self, directory: Path, num_iterations: int, iterations_per_file: int) -> None:
        self.directory, self.n, self.per_file = directory, num_iterations, iterations_per_file
        self.files: list[dict[str, Any]] = []
        self.writer: pq.ParquetWriter | None = None

    def write(self, first, stop, prefetch_offsets, prefetch_ids, prefetch_slots, evict_offsets, evict_ids) -> None:
        file_first = first - first % self.per_file
        if stop > file_first + self.per_file:
            raise ValueError(f"iterations {first}..{stop - 1} cross a plan file boundary")
        if not self.files or self.files[-1]["first"] != file_first:
            self.close()
            file_stop = min(file_first + self.per_file, self.n)
            name = f"iterations-{file_first:08d}-{file_stop:08d}.parquet"
            self.writer = pq.ParquetWriter(self.directory / name, PLAN_SCHEMA, use_dictionary=False,
                                           compression="none", column_encoding=DELTA_ENCODED)
            self.files.append({"name": name, "first": file_first, "stop": file_stop})
        self.writer.write_table(pa.table({
            "t": pa.array(np.arange(first, stop), pa.int64()),
            "prefetch_ids": _list_array(prefetch_offsets, prefetch_ids),
            "prefetch_slots": _list_array(prefetch_offsets, prefetch_slots),
            "evict_ids": _list_array(evict_offsets, evict_ids),
        }, schema=PLAN_SCHEMA), row_group_size=ROW_GROUP_ITERATIONS)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@dataclass
class _Stats:
    """What the streamed assembly tells ``plan.json`` besides the stream's own numbers."""

    num_slots: int
    peak_occupancy: int
    prefetched_rows: int
    evicted_rows: int


def _no_ids() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass
class _Intervals:
    """Candidate intervals of the capacity bound: row ``ids[i]`` kept cached over times ``start[i] ..
    end[i]`` between two of its uses, unless the bound gives that up (see
    :mod:`~dlrmflow.engine.planning.lookahead`). Three int64 arrays of one length, in the order they came."""

    ids: np.ndarray = field(default_factory=_no_ids)
    start: np.ndarray = field(default_factory=_no_ids)
    end: np.ndarray = field(default_factory=_no_ids)

    @classmethod
    def of(cls, d: RangeDecisions) -> _Intervals:
        """The candidate intervals a piece's uses close."""
        return cls(*(a.astype(np.int64, copy=False) for a in (d.cand_ids, d.cand_start, d.cand_end)))

    def where(self, mask: np.ndarray) -> _Intervals:
        return _Intervals(self.ids[mask], self.start[mask], self.end[mask])

    def joined(self, other: _Intervals) -> _Intervals:
        """These intervals, then ``other``'s."""
        return _Intervals(np.concatenate([self.ids, other.ids]), np.concatenate([self.start, other.start]),
                          np.concatenate([self.end, other.end]))


class _BlockBound:
    """The capacity bound (:func:`farthest_first_drops`) one block of time at a time, making the drops that one
    pass over the whole stream makes.

    Its choice at time ``u`` depends only on the kept intervals that contain ``u`` and on the dropped ones
    still running at ``u``. So a block ``[a, b)`` needs the intervals starting in it, those kept across ``a``
    and the over-capacity counts less the dropped intervals still running; it hands on to the next block
    those kept or dropped across ``b``. Blocks come in time order, each once."""

    def __init__(self, over: np.ndarray) -> None:
        self.over = over  # per time: occupancy less the capacity, every candidate kept (counted before any drop)
        self.pool = _Intervals()  # loaded, starting at or after the next block's start: not reached yet
        self.kept = _Intervals()  # kept across the next block's start
        # Dropped and still running at the next block's start (a drop's id is no longer needed).
        self.dropped_start, self.dropped_end = _no_ids(), _no_ids()

    def add(self, d: RangeDecisions) -> None:
        """A piece's candidate intervals join the pool, to be bounded with the block where they start."""
        self.pool = self.pool.joined(_Intervals.of(d))

    def drops(self, a: int, b: int) -> _Intervals:
        """The intervals to give up so that no time in ``a .. b-1`` is over capacity. Every interval starting
        before ``b`` must be in the pool by now: the block takes them, with those kept across ``a``."""
        starting = self.pool.start < b
        block = self.kept.joined(self.pool.where(starting))
        self.pool = self.pool.where(~starting)
        drop = self._choose(a, b, block)
        self._hand_on(b, block, drop)
        return block.where(drop)

    def _excess(self, a: int, b: int) -> np.ndarray:
        """Rows over capacity at times ``a .. b-1`` after the drops of earlier blocks: ``over`` was counted
        with every candidate kept, and a dropped interval frees its row at each of its times."""
        live = self.dropped_end >= a
        start, end = self.dropped_start[live], self.dropped_end[live]
        return self.over[a:b] - coverage(np.maximum(start, a) - a, np.minimum(end, b - 1) - a, b - a)

    def _choose(self, a: int, b: int, block: _Intervals) -> np.ndarray:
        """Which of ``block``'s intervals to drop (a bool mask): :func:`farthest_first_drops` over the times
        the block's intervals span, shifted to start at 0, with no excess outside ``a .. b-1`` so that only
        this block's times make it drop (the times before ``a`` are settled, those from ``b`` on are the next
        blocks')."""
        excess = self._excess(a, b)
        if not (excess > 0).any():
            return np.zeros(len(block.ids), dtype=bool)
        origin = min(a, int(block.start.min())) if len(block.start) else a
        span = max(b, int(block.end.max()) + 1 if len(block.end) else b) - origin
        over = np.zeros(span, dtype=np.int64)
        over[a - origin : b - origin] = excess
        return farthest_first_drops(over, block.start - origin, block.end - origin, block.ids)

    def _hand_on(self, b: int, block: _Intervals, drop: np.ndarray) -> None:
        """Keep what the next block needs: the intervals kept across ``b`` and the dropped ones still running
        there; an interval ending before ``b`` can no longer change any block's choice."""
        running = block.end >= b
        self.kept = block.where(~drop & running)
        still = self.dropped_end >= b
        gone = drop & running
        self.dropped_start = np.concatenate([self.dropped_start[still], block.start[gone]])
        self.dropped_end = np.concatenate([self.dropped_end[still], block.end[gone]])


def _slots_from_counts(
    config: PlanConfig, n: int, counts: _Counts, capacity_error: Callable[[np.ndarray], Exception]
) -> tuple[int, np.ndarray | None]:
    """What the whole stream's counts decide before any piece is read: the plan's slot count (the capacity,
    else the peak occupancy: the FIFO of free slots starts as ``0 .. num_slots-1``, so the count comes before
    the first slot) and, with a capacity, the rows over it at each time with every candidate kept (None
    without one). A capacity that no choice of evictions can meet raises ``capacity_error(base)`` here,
    before anything is assigned, so that the error is the one :func:`assemble_plan` raises."""
    capacity = config.capacity
    if not n:
        return (capacity if capacity is not None else 0), None
    occ = occupancy(counts.prefetch, counts.evict, config.prefetch_distance)
    if capacity is None:
        return int(occ.max()), None
    base = occ - np.cumsum(counts.cover[:n])  # what no choice of evictions can lower
    if base.max() > capacity:
        raise capacity_error(base)
    return capacity, occ - capacity


class _StreamAssembly:
    """The driver passes of :func:`assemble_stream` as state, and the steps that change it.

    The spooled pieces come in (:meth:`load_before`) to per-iteration lists of fetches and write-backs, and
    their candidate intervals to the capacity bound (``bound``; None without a capacity); the bound's drops
    add a write-back and a fetch to those lists (:meth:`bound_block`); an iteration whose lists can no longer
    change is final, gets its slots from the slot replay and goes out with its row group
    (:meth:`finish_before`). Attributes are read-only outside this class."""

    def __init__(
        self,
        config: PlanConfig,
        n: int,
        pieces: list[tuple[int, int]],
        take_piece: Callable[[int], RangeDecisions],
        counts: _Counts,
        sink: PlanSink,
        *,
        iterations_per_file: int,
        capacity_error: Callable[[np.ndarray], Exception],
        progress: Callable[[int], None] | None,
        pieces_of_chunk: list[range] | None,
    ) -> None:
        self.n, self.window, self.distance = n, config.lookahead, config.prefetch_distance
        # Per-iteration counts of the whole stream; the bound's drops are added to them, so that the final
        # occupancy check counts the plan as written.
        self.counts = counts
        num_slots, over = _slots_from_counts(config, n, counts, capacity_error)
        self.bound = _BlockBound(over) if over is not None else None
        self.replay = _SlotReplay(n, self.distance, num_slots)
        self.pieces, self.take_piece = pieces, take_piece
        self.next_piece = 0  # the first piece not taken yet
        self.progress = progress
        # The last piece of each chunk -> how many chunks are taken whole once it is.
        self.chunks_taken = {r[-1]: k + 1 for k, r in enumerate(pieces_of_chunk or []) if len(r)}
        # Iteration -> its sorted ids from the pieces, then the ids the bound's drops add: loaded, not final.
        self.prefetch: dict[int, list[np.ndarray]] = {}
        self.evict: dict[int, list[np.ndarray]] = {}
        self.finished = 0  # iterations 0 .. finished-1 have their slots
        self.unwritten: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, slots, write-backs) of each
        self.sink, self.iterations_per_file = sink, iterations_per_file
        self.stats = _Stats(num_slots, 0, 0, 0)

    # ---- pieces in ----------------------------------------------------------------------------------
    def load_before(self, stop: int) -> None:
        """Take, in order, every piece that starts before ``stop`` and is not taken yet. The spool gives a
        piece up when it is taken, so each is read once and only when the passes reach it."""
        while self.next_piece < len(self.pieces) and self.pieces[self.next_piece][0] < stop:
            piece = self.next_piece
            self._add_piece(self.take_piece(piece))
            self.next_piece += 1
            if self.progress and piece in self.chunks_taken:
                self.progress(self.chunks_taken[piece])

    def _add_piece(self, d: RangeDecisions) -> None:
        """A piece's fetches and write-backs join its iterations' lists (views of its arrays, which live until
        its last iteration is final); its candidate intervals go to the bound."""
        pf_off, ev_off = _offsets(d.prefetch_counts), _offsets(d.evict_counts)
        for i, t in enumerate(range(d.first, d.stop)):
            self.prefetch.setdefault(t, []).append(d.prefetch_ids[pf_off[i] : pf_off[i + 1]])
            self.evict.setdefault(t, []).append(d.evict_ids[ev_off[i] : ev_off[i + 1]])
        if self.bound is not None:
            self.bound.add(d)

    # ---- the capacity bound -------------------------------------------------------------------------
    def bound_block(self, a: int, b: int) -> None:
        """Bound times ``a .. b-1`` (with a capacity only, once every piece within ``L`` iterations past ``b`` is
        loaded). Each interval ``[s, e]`` dropped gives up a kept gap: its row is written back after ``s-1``
        and fetched again for the use that closes the interval, ``e+P+1``."""
        dropped = self.bound.drops(a, b)
        fetch_for = dropped.end + self.distance + 1
        np.add.at(self.counts.evict, dropped.start - 1, 1)
        np.add.at(self.counts.prefetch, fetch_for, 1)
        for x, v, t in zip(dropped.ids.tolist(), (dropped.start - 1).tolist(), fetch_for.tolist(), strict=True):
            self.evict[v].append(np.array([x], np.int64))
            self.prefetch.setdefault(t, []).append(np.array([x], np.int64))

    def final_after(self, b: int) -> int:
        """How many iterations are final (their lists can no longer change) once the block ending at ``b`` is
        bounded. A drop of ``[s, e]`` adds to iterations ``s-1`` and ``e+P+1``, and an interval can be dropped by
        any block it reaches (the kept ones are handed on), so it is decided once a block ends past ``e``. An
        interval starting at ``v+1`` ends by ``v+L-P-1``, so iteration ``v`` is final once ``b > v+L-P-1``; an
        interval fetching for ``v`` ends at ``v-P-1``, before that. At the stream's end every interval is
        decided."""
        return self.n if b == self.n else max(0, b - self.window + self.distance + 1)

    # ---- iterations out -----------------------------------------------------------------------------
    def finish_before(self, stop: int) -> None:
        """Give the iterations before ``stop`` their slots, in order, and write them out a row group at a time."""
        while self.finished < stop:
            self._finish(self.finished)
            if self._row_group_ends():
                self._write_row_group()

    def _finish(self, t: int) -> None:
        """Iteration ``t`` is final: merge its lists and replay :func:`assign_slots`' step for it."""
        prefetch_ids = _merged(self.prefetch.pop(t))
        evict_ids = _merged(self.evict.pop(t))
        slots = self.replay.issue(t, prefetch_ids, evict_ids)
        self.unwritten.append((prefetch_ids, slots, evict_ids))
        self.stats.prefetched_rows += len(prefetch_ids)
        self.stats.evicted_rows += len(evict_ids)
        self.finished += 1

    def _row_group_ends(self) -> bool:
        """A row group ends at a plan file's end (the sink writes no row group across two files), after
        ``SPOOL_ITERATIONS`` iterations (what the driver holds does not grow with the file size) and at the
        stream's end."""
        done = self.finished
        return done % self.iterations_per_file == 0 or done % SPOOL_ITERATIONS == 0 or done == self.n

    def _write_row_group(self) -> None:
        """The finished iterations not yet written go to the sink as one row group."""
        rows = self.unwritten
        pf_off = _offsets(np.array([len(ids) for ids, _, _ in rows], np.int64))
        ev_off = _offsets(np.array([len(ids) for _, _, ids in rows], np.int64))
        self.sink.write(self.finished - len(rows), self.finished, pf_off, _cat([ids for ids, _, _ in rows]),
                        _cat([slots for _, slots, _ in rows]), ev_off, _cat([ids for _, _, ids in rows]))
        self.unwritten = []

    def close(self) -> _Stats:
        """After the last piece: the iterations left, the sink closed, and the checks that every row is written
        back at the end and that the replay peaked where the counts (the drops added) say."""
        self.finish_before(self.n)
        self.sink.close()
        self.replay.finish()
        peak = int(occupancy(self.counts.prefetch, self.counts.evict, self.distance).max()) if self.n else 0
        if self.replay.peak != peak:
            raise RuntimeError(f"slot replay peaks at {self.replay.peak} rows, the occupancy count at {peak}")
        self.stats.peak_occupancy = peak
        return self.stats


def assemble_stream(
    config: PlanConfig,
    n: int,
    pieces: list[tuple[int, int]],
    take_piece: Callable[[int], RangeDecisions],
    counts: _Counts,
    sink: PlanSink,
    *,
    iterations_per_file: int,
    capacity_error: Callable[[np.ndarray], Exception],
    progress: Callable[[int], None] | None = None,
    pieces_of_chunk: list[range] | None = None,
) -> _Stats:
    """The driver passes of :func:`assemble_plan`, piece by piece in iteration order, with the same result.

    ``pieces`` are consecutive iteration ranges (the spool's; ``take_piece(i)`` gives piece ``i``'s decisions,
    once); ``progress(k)`` is called when the ``k``-th chunk (``pieces_of_chunk``) is taken whole. ``counts``
    holds every piece's per-iteration counts, so the capacity check and the unbounded plan's slot count come
    first, as in :func:`assemble_plan`. The driver holds the pieces that reach ``L`` iterations past the block
    it bounds, the intervals kept across that block, the slot state (sized by the rows cached, not the embedding
    rows) and one row group of finished iterations: nothing that grows with the stream but the counts.

    Without a capacity nothing is dropped, so an iteration is final as soon as its piece is in. With one, each
    piece is a block of time for the bound (:class:`_BlockBound`), and the iterations it makes final follow.
    """
    assembly = _StreamAssembly(config, n, pieces, take_piece, counts, sink,
                               iterations_per_file=iterations_per_file, capacity_error=capacity_error,
                               progress=progress, pieces_of_chunk=pieces_of_chunk)
    for a, b in pieces:
        if a >= b:  # an empty stream's one piece
            continue
        if assembly.bound is None:
            assembly.load_before(b)
            assembly.finish_before(b)
        else:
            # An interval starting in the block is closed by a use before b+L, and a piece carries the
            # intervals its uses close: load every piece up to there.
            assembly.load_before(min(n, b + config.lookahead))
            assembly.bound_block(a, b)
            assembly.finish_before(assembly.final_after(b))
    return assembly.close()


def _merged(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)


# ---- plan directories ---------------------------------------------------------------------------


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int64()), pa.array(values, pa.int64()))


def _summary(config: PlanConfig, stream: BatchStream, stats: _Stats) -> dict[str, Any]:
    n = len(stream)
    rows = stream.stop_row - stream.start_row if not config.drop_last else n * config.batch_size
    return {
        "format_version": PLAN_FORMAT_VERSION,
        "dataset_fingerprint": stream.meta.fingerprint,
        **config.record(),
        "num_iterations": n,
        "num_rows": stream.meta.total_embedding_rows,
        "num_slots": stats.num_slots,
        "counts": {
            "ids": rows * len(stream.meta.sparse_columns),
            "prefetched_rows": stats.prefetched_rows,
            "evicted_rows": stats.evicted_rows,
            "peak_occupancy": stats.peak_occupancy,
        },
    }


def _write_atomically(output_dir: str | os.PathLike, fill: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Fill a temporary directory beside ``output_dir`` (``fill`` returns plan.json's contents, which is written
    last), then rename it into place: an interrupted run leaves no plan and keeps the old one."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise PlanError(f"plan output {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / PLAN_FILE).is_file():
        raise PlanError(f"refusing to overwrite {str(out)!r}: it is not empty and holds no {PLAN_FILE}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        summary = fill(tmp)
        (tmp / PLAN_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def write_plan(
    plan: PlanArrays, output_dir: str | os.PathLike, *, iterations_per_file: int | None = None
) -> dict[str, Any]:
    """Write a whole ``plan`` held in memory as a plan directory (atomically); return the ``plan.json`` contents."""
    iterations_per_file = iterations_per_file or ITERATIONS_PER_FILE

    def fill(tmp: Path) -> dict[str, Any]:
        sink = _DirectorySink(tmp, plan.num_iterations, iterations_per_file)
        for first in range(0, plan.num_iterations, iterations_per_file):
            stop = min(first + iterations_per_file, plan.num_iterations)
            pf = plan.prefetch_offsets[first : stop + 1]
            ev = plan.evict_offsets[first : stop + 1]
            sink.write(first, stop, pf, plan.prefetch_ids[pf[0] : pf[-1]], plan.prefetch_slots[pf[0] : pf[-1]],
                       ev, plan.evict_ids[ev[0] : ev[-1]])
        sink.close()
        return {**plan.summary(), "files": sink.files}

    return _write_atomically(output_dir, fill)


def make_plan(
    dataset_dir: str | os.PathLike,
    config: PlanConfig,
    output_dir: str | os.PathLike,
    *,
    client: Any = None,
    chunk_iterations: int | None = None,
    table_groups: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Plan ``dataset_dir`` (a Dask job when ``client`` is given) into ``output_dir``; the plan.json contents.

    Streams: each task's decisions are spooled to disk as it finishes, and the chunks are assembled in
    order into Parquet files of consecutive iterations, so the driver never holds the whole plan."""

    def fill(tmp: Path) -> dict[str, Any]:
        stream = open_stream(dataset_dir, config)
        sink = _DirectorySink(tmp, len(stream), ITERATIONS_PER_FILE)
        spool = tmp / ".spool"
        stream, stats = _stream_plan(dataset_dir, config, sink, spool, client=client,
                                     chunk_iterations=chunk_iterations, table_groups=table_groups, progress=progress)
        shutil.rmtree(spool, ignore_errors=True)
        return {**_summary(config, stream, stats), "files": sink.files}

    return _write_atomically(output_dir, fill)


class Plan:
    """A loaded plan directory; :meth:`iterations` streams it file by file."""

    def __init__(self, directory: Path, info: dict[str, Any]) -> None:
        self.directory = directory
        self.info = info
        self.config = PlanConfig(
            batch_size=info["batch_size"], lookahead=info["lookahead"],
            prefetch_distance=info["prefetch_distance"], capacity=info["capacity"], drop_last=info["drop_last"],
        )
        self.dataset_fingerprint: str = info["dataset_fingerprint"]
        self.num_iterations: int = info["num_iterations"]
        self.num_slots: int = info["num_slots"]
        self.counts: dict[str, int] = info["counts"]

    def iterations(self, first: int = 0, stop: int | None = None) -> Iterator[IterationPlan]:
        """Iterations ``first .. stop-1`` (default: to the end), reading only the files that hold them, a row
        group (:data:`ROW_GROUP_ITERATIONS` iterations; more in plans written before it) at a time: a trainer
        holds a few iterations of the plan, never a file's worth. A file's row groups hold its iterations in
        order, so the row groups before ``first`` are skipped unread."""
        stop = self.num_iterations if stop is None else min(stop, self.num_iterations)
        for f in self.info["files"]:
            if f["stop"] <= first:
                continue
            if f["first"] >= stop:
                return
            parquet = pq.ParquetFile(self.directory / f["name"])
            group_first = f["first"]
            for g in range(parquet.num_row_groups):
                group_stop = group_first + parquet.metadata.row_group(g).num_rows
                if group_stop > first:
                    yield from _iterations_of(parquet.read_row_group(g), first, stop)
                group_first = group_stop
                if group_first >= stop:
                    return

    def __repr__(self) -> str:
        return f"Plan({str(self.directory)!r}, {self.config}, iterations={self.num_iterations}, slots={self.num_slots})"


def _iterations_of(table: pa.Table, first: int, stop: int) -> Iterator[IterationPlan]:
    """The iterations of a row group of a plan file within ``first .. stop-1``."""
    ts = table.column("t").to_numpy()
    lists = [table.column(c).combine_chunks() for c in ("prefetch_ids", "prefetch_slots", "evict_ids")]
    offsets = [a.offsets.to_numpy() for a in lists]
    values = [a.values.to_numpy() for a in lists]
    for i, t in enumerate(ts.tolist()):
        if t >= stop:
            return
        if t >= first:
            yield IterationPlan(t, *(v[o[i] : o[i + 1]] for v, o in zip(values, offsets, strict=True)))


def load_plan(
    plan_dir: str | os.PathLike,
    *,
    dataset_dir: str | os.PathLike | None = None,
    batch_size: int | None = None,
    lookahead: int | None = None,
    prefetch_distance: int | None = None,
) -> Plan:
    """Open a plan directory; refuse it (PlanMismatchError) if made for another dataset or setting."""
    directory = Path(plan_dir)
    if not directory.is_dir():
        raise PlanError(f"plan directory {str(directory)!r} does not exist (make one with `dlrmflow plan`)")
    path = directory / PLAN_FILE
    if not path.is_file():
        raise PlanError(
            f"{str(directory)!r} is not a complete plan: {PLAN_FILE} is missing "
            "(an interrupted `dlrmflow plan` leaves none; run it again)"
        )
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path} is not valid JSON: {exc}") from exc
    if info.get("format_version") != PLAN_FORMAT_VERSION:
        raise PlanError(f"{path} has format_version {info.get('format_version')!r}; expected {PLAN_FORMAT_VERSION}")
    missing = [f["name"] for f in info.get("files", []) if not (directory / f["name"]).is_file()]
    if missing:
        raise PlanError(f"plan {str(directory)!r} is incomplete: missing {', '.join(missing)}")
    plan = Plan(directory, info)
    if dataset_dir is not None:
        meta = read_meta(dataset_dir)
        if meta.fingerprint != plan.dataset_fingerprint:
            raise PlanMismatchError(
                f"plan {str(directory)!r} was made for another dataset (fingerprint "
                f"{plan.dataset_fingerprint[:12]}…, {str(dataset_dir)!r} has {meta.fingerprint[:12]}…); "
                "make a new plan for this dataset"
            )
    for name, wanted, have in (
        ("batch size", batch_size, plan.config.batch_size),
        ("lookahead window", lookahead, plan.config.lookahead),
        ("prefetch distance", prefetch_distance, plan.config.prefetch_distance),
    ):
        if wanted is not None and wanted != have:
            raise PlanMismatchError(f"plan {str(directory)!r} was made for {name} {have}, not {wanted}")
    return plan
