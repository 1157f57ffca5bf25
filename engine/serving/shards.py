"""Embedding servers: K shards of the embedding rows, each a Dask actor on a worker.

Row ``id`` lives on shard ``id % K`` at local index ``id // K``. A shard stores its rows as one
``[n_local, width]`` float32 array in the layout of :mod:`dlrmflow.engine.serving.embedding_rows`
(weights then optimizer state), initialised from ``(seed, id)`` alone. The only traffic is
batched: ``fetch(ids)`` returns the rows as one contiguous array, ``write_back(ids, rows)``
stores them, and ``exchange`` does both in one round trip (write first); all move bytes, never
convert values.

:class:`ShardGroup` is the trainer's side: it splits a sorted id array by shard, calls all
shards concurrently, and reassembles the answers in the caller's order. It counts the bytes
it moved. An exchange with enough to move both ways sends each shard its fetch and its write-back
as two concurrent calls, so that a link's two directions carry them at once
(:meth:`ShardGroup._split_fetches` argues why no fetch can then read a row before its write).

Whole-table reads never meet in one process: each shard writes its own rows to a file
(:meth:`EmbeddingShard.save_rows`; a checkpoint's overlaid with the trainer's newer copies) and starts
again from it (:meth:`EmbeddingShard.load_rows`), and :meth:`ShardGroup.row_chunks` streams the rows in
global id order a chunk of stripes at a time (:mod:`dlrmflow.engine.row_files`). :meth:`ShardGroup.all_rows`
gathers everything, for tests and small tables only.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from distributed import Actor, Client, Future, wait

from dlrmflow.engine import row_files
from dlrmflow.engine.row_files import (
    ROW_CHUNK,
    chunk_stripes,
    interleave,
    local_count,
    read_rows_file,
    shard_file,
    write_rows_file,
)
from dlrmflow.engine.serving.cluster import (
    PROBE_SECONDS,
    SCHEDULER_SILENCE_SECONDS,
    SchedulerSilentError,
    SilentWorkers,
    cluster_workers,
    probe_workers,
)
from dlrmflow.engine.serving.dask_internals import (
    actor_address,
    actor_client,
    finished_outcome,
    is_lost_actor_error,
    release_actor,
)
from dlrmflow.engine.serving.embedding_rows import INIT_CHUNK_ROWS, RowSpec, init_rows
from dlrmflow.engine.serving.placement import WORKER_LOG, Placement, place, shared_host_warning

EVENTS = logging.getLogger(__name__)  # a dlrmflow.engine logger: the run's log and the CLI's stderr show it


class EmbeddingShard:
    """Shard ``shard`` of ``num_shards``: the rows ``shard, shard + K, shard + 2K, ...``."""

    def __init__(self, spec: RowSpec, shard: int, num_shards: int, initialise: bool = True) -> None:
        """``initialise=False``: zero rows, for a shard whose rows arrive later (a rebuild, a checkpoint)."""
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} outside 0..{num_shards - 1}")
        self.spec = spec
        self.shard = shard
        self.num_shards = num_shards
        n_local = len(range(shard, spec.total_rows, num_shards))
        self.rows = np.zeros((n_local, spec.width), dtype=np.float32)
        for lo in range(0, n_local, INIT_CHUNK_ROWS) if initialise else ():
            hi = min(lo + INIT_CHUNK_ROWS, n_local)
            ids = np.arange(lo, hi, dtype=np.int64) * num_shards + shard
            self.rows[lo:hi] = init_rows(spec, ids)
        self.rows_fetched = 0
        self.rows_written = 0
        WORKER_LOG.info("dlrmflow %s %d of %d: %d rows", type(self).__name__, shard, num_shards, n_local)

    def local_index(self, ids: np.ndarray) -> np.ndarray:
        """Local indices of ``ids`` on this shard (ValueError for an id it does not hold)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-d, got shape {ids.shape}")
        if ids.size and (
            (ids % self.num_shards != self.shard).any() or ids.min() < 0 or ids.max() >= self.spec.total_rows
        ):
            raise ValueError(f"ids sent to shard {self.shard} of {self.num_shards} that it does not hold")
        return ids // self.num_shards

    def fetch(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` as one contiguous ``[len(ids), width]`` float32 array."""
        local = self.local_index(ids)
        self.rows_fetched += len(local)
        return self.rows[local]

    def write_back(self, ids: np.ndarray, rows: np.ndarray) -> int:
        """Store ``rows`` ``[len(ids), width]`` for ``ids`` (distinct). Returns the number stored."""
        local = self.local_index(ids)
        rows = np.asarray(rows)
        if rows.dtype != np.float32 or rows.shape != (len(local), self.spec.width):
            raise ValueError(
                f"write_back expects float32 rows of shape ({len(local)}, {self.spec.width}), "
                f"got {rows.dtype} {rows.shape}"
            )
        self.rows[local] = rows
        self.rows_written += len(local)
        return len(local)

    def exchange(self, write_ids: np.ndarray, write_rows: np.ndarray, fetch_ids: np.ndarray) -> np.ndarray:
        """Store ``write_rows`` for ``write_ids``, *then* return the rows of ``fetch_ids``: one round
        trip instead of two, and a row written here is never fetched stale by the same call."""
        if len(write_ids):
            self.write_back(write_ids, write_rows)
        return self.fetch(fetch_ids)

    def local_rows(self) -> np.ndarray:
        """All rows of this shard in local-index order (a copy)."""
        return self.rows.copy()

    def read_stripes(self, start: int, stop: int) -> np.ndarray:
        """Local rows ``[start, stop)`` (in a coded group: stripes), not copied: read them while nothing
        writes (the end of a run, a checkpoint)."""
        return self.rows[start:stop]

    def save_rows(self, path: str, overlay_local: np.ndarray | None = None, overlay_rows: np.ndarray | None = None,
                  chunk: int = ROW_CHUNK) -> dict[str, Any]:
        """Write this shard's rows to ``path`` (a rows file of :mod:`dlrmflow.engine.row_files`), in this
        process, a chunk at a time; with the rows at the sorted local indices ``overlay_local`` replaced by
        ``overlay_rows`` (a checkpoint's newer copies: this shard's own rows do not change). Returns the
        file's manifest entry (its SHA-256 and the writer's pid among them)."""
        overlay = None if overlay_local is None else (overlay_local, overlay_rows)
        return write_rows_file(path, len(self.rows), self.spec.width, self.read_stripes, overlay=overlay, chunk=chunk)

    def load_rows(self, path: str, sha256: str | None = None, chunk: int = ROW_CHUNK) -> int:
        """Every row of this shard from the rows file ``path`` (one it wrote: a checkpoint's), copied as
        bytes a chunk at a time; ValueError when the file holds another shape or, ``sha256`` given, other
        bytes."""
        read_rows_file(path, self.rows, sha256=sha256, chunk=chunk)
        return len(self.rows)

    def pid(self) -> int:
        """The process holding this shard (a test checks who wrote a file)."""
        return os.getpid()

    def stats(self) -> dict[str, int]:
        return {"shard": self.shard, "rows": len(self.rows), "rows_fetched": self.rows_fetched,
                "rows_written": self.rows_written}


_NO_IDS = np.zeros(0, dtype=np.int64)


def _no_rows(spec: RowSpec) -> np.ndarray:
    return np.zeros((0, spec.width), dtype=np.float32)


@dataclass
class ShardGroup:
    """The trainer's handle on K shards: batched, concurrent fetch and write-back."""

    spec: RowSpec
    actors: list
    futures: list = field(default_factory=list)  # hold the actor futures: the actors live as long as they do
    worker_of: list[str] = field(default_factory=list)  # shard k's worker address, where the starter recorded it
    bytes_fetched: int = 0
    bytes_written: int = 0
    link_rates: list[float] = field(default_factory=list, repr=False)  # recent link-rate samples, bytes/s
    # A shard's write-back and fetch travel as two concurrent calls (the link's two directions at once)
    # once each direction moves this many bytes, and while the link seems slower than overlap_max_rate;
    # else one call. A message costs about a millisecond of CPU on each side (docs/oracle-overhead.md):
    # more than overlapping a small transfer saves, or a transfer on a fast link (loopback, a LAN: at
    # 128 Mbit/s, 16 KiB take 1 ms).
    overlap_min_bytes: ClassVar[int] = 16 * 1024
    overlap_max_rate: ClassVar[float] = 16e6  # bytes per second
    RATE_SAMPLES: ClassVar[int] = 8

    @property
    def num_shards(self) -> int:
        return len(self.actors)

    def split_by_shard(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``(shard, positions in ids of the ids it holds)`` for every shard."""
        shard_of = ids % self.num_shards
        return [(k, np.flatnonzero(shard_of == k)) for k in range(self.num_shards)]

    def exchange(
        self,
        write_ids: np.ndarray,
        write_rows: np.ndarray,
        fetch_ids: np.ndarray,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Write rows back and fetch others, all shards concurrently; a fetched id also written here is
        read after its write (the shard applies the write first).

        Per shard, one ``exchange`` call, or, when the shard has at least :attr:`overlap_min_bytes` to
        move in each direction and the link is slow (:meth:`link_is_slow`), two concurrent calls
        (:meth:`_split_fetches`) so that the fetched rows come down the link while the written rows go up.
        Returns the fetched rows ``[len(fetch_ids), width]``
        (into ``out`` if given) once every call has answered, i.e. every write-back is applied: a later
        exchange's fetch, issued after this returns, sees it."""
        write_ids = np.asarray(write_ids, dtype=np.int64)
        fetch_ids = np.asarray(fetch_ids, dtype=np.int64)
        write_rows = np.asarray(write_rows, dtype=np.float32)
        if out is None:
            out = np.empty((len(fetch_ids), self.spec.width), dtype=np.float32)
        start = time.perf_counter()
        plans = []  # per shard with work: (shard, positions written, fetched after the write, fetched alone)
        for (k, w), (_, f) in zip(self.split_by_shard(write_ids), self.split_by_shard(fetch_ids), strict=True):
            if len(w) or len(f):
                plans.append((k, w, *self._split_fetches(write_ids[w], fetch_ids, f)))
        # Every shard's fetch goes out before any write-back: on a link, a request sent after a write-back
        # waits behind its rows in the same queue, and its answer (the other direction) starts that late.
        calls = [(alone, call_server(self.actors[k], "fetch", self._wire(fetch_ids[alone])))
                 for k, _, _, alone in plans if alone is not None]
        for k, w, after, _ in plans:
            if len(w) or len(after):
                rows = np.ascontiguousarray(write_rows[w])
                calls.append((after, call_server(self.actors[k], "exchange", self._wire(write_ids[w]), rows,
                                                 self._wire(fetch_ids[after]))))
        for f, call in calls:
            out[f] = answer(call)
        self._rate_exchange(write_ids, fetch_ids, any(alone is not None for *_, alone in plans),
                            time.perf_counter() - start)
        self.bytes_written += len(write_ids) * self.spec.row_bytes
        self.bytes_fetched += len(fetch_ids) * self.spec.row_bytes
        return out

    def _moves_both_ways(self, written: int | np.ndarray, fetched: int | np.ndarray) -> bool | np.ndarray:
        """Whether a shard that writes ``written`` rows and fetches ``fetched`` (counts, or arrays of them)
        moves at least :attr:`overlap_min_bytes` in each direction: then the two directions are worth a
        message each (:meth:`_split_fetches`), and the exchange's time says something about the link
        (:meth:`_rate_exchange`) rather than about the cost of a message."""
        smaller = np.minimum(written, fetched) * self.spec.row_bytes
        return (smaller > 0) & (smaller >= self.overlap_min_bytes)

    def _rate_exchange(self, write_ids: np.ndarray, fetch_ids: np.ndarray, split: bool, seconds: float) -> None:
        """Rate the link by an exchange that wrote ``write_ids`` and fetched ``fetch_ids`` in ``seconds``
        (``split``: some shard's fetch went apart), when some shard moved :attr:`overlap_min_bytes` each way
        (:meth:`_moves_both_ways`): the time of a smaller exchange is mostly the messages' fixed costs."""
        k = self.num_shards
        by_shard = np.bincount(write_ids % k, minlength=k), np.bincount(fetch_ids % k, minlength=k)
        if self._moves_both_ways(*by_shard).any():
            self._rate_link(len(write_ids) * self.spec.row_bytes, len(fetch_ids) * self.spec.row_bytes, split,
                            seconds)

    def _rate_link(self, written: int, fetched: int, split: bool, seconds: float) -> None:
        """Record the rate an exchange saw: the bytes the link had to carry one after the other (with the
        directions apart, the larger; in one call per shard, both) over its time. Overheads make it lower
        than the link's; both ways of sending measure the same link, so the choice does not feed itself."""
        carried = max(written, fetched) if split else written + fetched
        self.link_rates.append(carried / max(seconds, 1e-9))
        del self.link_rates[: -self.RATE_SAMPLES]

    def link_is_slow(self) -> bool:
        """Whether the link seems slower than :attr:`overlap_max_rate` (the median of the last
        ``RATE_SAMPLES`` exchanges' rates): sending the two directions apart then saves more than the
        second message costs. True until an exchange has been rated. A timing decides only how the rows
        travel, never which rows or in what order a shard applies them (:meth:`_split_fetches`)."""
        return not self.link_rates or float(np.median(self.link_rates)) < self.overlap_max_rate

    def _wire(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` as sent to a shard: int32 when every id fits (the shard reads them as int64). Ids go up
        the link with the written rows, 8 bytes each against a row's ``row_bytes`` (64 for 16 floats);
        halving them shortens the direction that carries the write-backs."""
        return ids.astype(np.int32) if self.spec.total_rows <= np.iinfo(np.int32).max else ids

    def _split_fetches(self, write_ids: np.ndarray, fetch_ids: np.ndarray, f: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray | None]:
        """One shard's fetches (``fetch_ids[f]``) in an exchange that writes ``write_ids`` to it:
        ``(after, alone)``, positions in ``fetch_ids``.

        ``after`` goes in the shard's ``exchange`` call, which writes and then fetches. When both
        directions are worth a message of their own (:attr:`overlap_min_bytes`), the ids this exchange
        does not write are ``alone``, a separate ``fetch`` call whose rows come down the link while the
        written rows go up (else ``alone`` is None). The ordering rule holds without any order between
        the two calls (Dask gives none: each takes its own pooled connection, and the worker's single
        actor thread runs whichever arrives first): ``alone`` holds no row this exchange writes, and every
        earlier exchange's writes were acknowledged, so applied, before this one was issued."""
        if not (self._moves_both_ways(len(write_ids), len(f)) and self.link_is_slow()):
            return f, None
        written = np.isin(fetch_ids[f], write_ids)
        return f[written], (None if written.all() else f[~written])

    def held_by_trainer(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """A resumed trainer's cache starts with ``ids`` holding ``rows``, the values its shards hold too, as
        if it had fetched them: nothing for plain shards (a coded group keeps them as the old rows of their
        write-backs' parity deltas)."""

    def fetch(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` into ``out`` (or a new array) ``[len(ids), width]``, all shards at once."""
        return self.exchange(_NO_IDS, _no_rows(self.spec), ids, out)

    def read(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` for a reader that will not write them back (an evaluation): :meth:`fetch` here; a
        coded group keeps no old rows for them."""
        return self.fetch(ids, out)

    def write_back(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store ``rows`` for ``ids`` on their shards; returns once every shard acknowledged."""
        self.exchange(ids, rows, _NO_IDS)

    def read_stripes(self, start: int, stop: int) -> np.ndarray:
        """Rows of stripes ``[start, stop)`` (local rows ``start .. stop - 1`` of every shard: global ids
        ``start*K .. min(stop*K, total_rows) - 1``) in id order; not counted as traffic."""
        return interleave([answer(call) for call in self._stripe_calls(start, stop)], self.spec.width)

    def _stripe_calls(self, start: int, stop: int) -> list[Any]:
        return [call_server(actor, "read_stripes", start, stop) for actor in self.actors]

    def row_chunks(self, chunk: int | None = None) -> Iterator[np.ndarray]:
        """Every row in global id order, at most ``chunk`` rows (default :data:`~dlrmflow.engine.row_files.ROW_CHUNK`)
        at a time, whole stripes; the next chunk's reads go out before a chunk is handed on. Not counted
        as traffic."""
        per = chunk_stripes(self.num_shards, chunk or row_files.ROW_CHUNK)
        starts = list(range(0, local_count(self.spec.total_rows, 0, self.num_shards), per))
        calls = self._stripe_calls(starts[0], starts[0] + per) if starts else []
        for i in range(len(starts)):
            pieces = [answer(call) for call in calls]
            if i + 1 < len(starts):
                calls = self._stripe_calls(starts[i + 1], starts[i + 1] + per)
            yield interleave(pieces, self.spec.width)

    def save_rows(self, directory: str | Path, overlay: tuple[np.ndarray, np.ndarray] | None = None, *,
                  chunk: int | None = None) -> list[dict[str, Any]]:
        """Every shard writes its rows to ``directory/shard-<k>.npy`` on its worker (``directory`` must be
        that worker's path to it too), concurrently; ``overlay``: sorted global ids and rows written in
        place of the shards' (:meth:`EmbeddingShard.save_rows`). The files' manifest entries, by shard."""
        return [answer(call) for call in self._save_calls(directory, overlay, chunk, self.actors)]

    def _save_calls(self, directory: str | Path, overlay: tuple[np.ndarray, np.ndarray] | None, chunk: int | None,
                    actors: list[Any]) -> list[Any]:
        k, chunk = len(actors), chunk or row_files.ROW_CHUNK
        ids, rows = overlay if overlay is not None else (np.zeros(0, np.int64), np.zeros((0, self.spec.width)))
        ids = np.asarray(ids, dtype=np.int64)
        calls = []
        for i, actor in enumerate(actors):
            mine = np.flatnonzero(ids % k == i)
            local = ids[mine] // k if len(mine) else None
            held = np.ascontiguousarray(np.asarray(rows, dtype=np.float32)[mine]) if len(mine) else None
            calls.append(remote(actor, "save_rows", str(Path(directory) / shard_file(i)), local, held, chunk))
        return calls

    def load_rows(self, files: list[tuple[str, str | None]], *, chunk: int | None = None) -> None:
        """Every shard reads its own rows file (``files[k]``: path and SHA-256), concurrently."""
        chunk = chunk or row_files.ROW_CHUNK
        for call in [call_server(actor, "load_rows", path, sha, chunk)
                     for actor, (path, sha) in zip(self.actors, files, strict=True)]:
            answer(call)

    def all_rows(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in global id order, in this process: for tests and small tables
        (a run streams them with :meth:`row_chunks` and has the shards write them with :meth:`save_rows`)."""
        out = np.empty((self.spec.total_rows, self.spec.width), dtype=np.float32)
        calls = [actor.local_rows() for actor in self.actors]
        for k, call in enumerate(calls):
            out[k :: self.num_shards] = call.result()
        return out

    def stats(self) -> list[dict[str, int]]:
        return [call.result() for call in [actor.stats() for actor in self.actors]]

    def close(self) -> None:
        """Release the actors (their workers drop the rows): now, not when a garbage collection gets to a
        reference cycle that holds the group (on a trainer's long-lived Dask worker, minutes later: the next
        run's servers would sit next to this run's rows)."""
        release_actors(self.futures, self.actors)
        self.actors = []
        self.futures = []


def release_actors(futures: Iterable[Any], handles: Iterable[Any] = ()) -> None:
    """Let the actors end now: tell the scheduler this client no longer wants ``futures`` (None entries
    skipped), and drop the hold each actor handle of ``handles`` has on its actor
    (:func:`~.dask_internals.release_actor`). One already released, or whose client is gone, is passed over."""
    releases = [future.release for future in futures if future is not None]
    releases += [partial(release_actor, actor) for actor in handles]
    for release in releases:
        try:
            release()
        except Exception:  # noqa: BLE001 - the cluster is going away anyway
            pass


# A call not answered after WATCH_FIRST_S has its worker looked up with the scheduler, and again every
# WATCH_S. The first look comes early because a call that had to reconnect to a killed worker is noticed
# only by it; the later ones are sparser because each is a round trip to the scheduler, and a call slower
# than that is a busy server far more often.
WATCH_FIRST_S = 0.05
WATCH_S = 0.2


class ServerCall:
    """A call to an embedding server actor, and the worker it went to.

    Waiting for it also watches that worker. The first call to a killed worker fails at once (its
    pooled connection is broken), but a call that needs a new connection to the dead address
    retries the refused connect until the client's connect timeout runs out (twice while Dask has
    not yet marked the actor lost). The scheduler drops a killed worker quickly, so a call still
    unanswered after WATCH_FIRST_S asks it (and again every WATCH_S), and fails with OSError (as a
    broken connection does) once the worker is gone. A machine that failed outright (its link down: no
    connection breaks) stays listed until Dask's TCP timeout, so a call unanswered for PROBE_SECONDS also
    probes the worker itself, on a connection of its own, every PROBE_SECONDS, and fails with OSError once
    SILENT_PROBES in a row went unanswered. The abandoned attempt ends on its own in the client's loop;
    nothing reads its outcome."""

    __slots__ = ("future", "worker", "client")

    def __init__(self, future: Any, worker: str | None = None, client: Client | None = None) -> None:
        self.future, self.worker, self.client = future, worker, client

    def result(self) -> Any:
        if self.client is None or self.worker is None:
            return answer(self.future)
        wait, silent, next_probe = WATCH_FIRST_S, None, time.monotonic() + PROBE_SECONDS
        while True:
            try:
                return answer(self.future, wait)
            except TimeoutError:
                # Answered as the wait ran out, or the call's own TimeoutError: its outcome, as it is. The wait's
                # TimeoutError is an OSError, which would declare a live member lost.
                if self.future.done():
                    return answer(self.future)
                wait = WATCH_S
                if self.worker not in _listed_workers(self.client, self.worker):
                    raise OSError(f"the worker {self.worker} is gone (the scheduler no longer lists it)") from None
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + PROBE_SECONDS  # from the probe's start: a miss takes 3 s
                    silent = silent or SilentWorkers([self.worker])  # made for the slow calls alone
                    if silent.probed(probe_workers(self.client, [self.worker])):
                        raise OSError(f"the worker {self.worker} stopped answering ({silent.silence()})") from None


def _listed_workers(client: Client, worker: str) -> dict[str, dict]:
    """The workers the scheduler lists, asked about ``worker``; :class:`SchedulerSilentError` when it does not
    answer (a lost scheduler says nothing of the member a call went to)."""
    try:
        return cluster_workers(client, timeout=SCHEDULER_SILENCE_SECONDS)
    except OSError as exc:  # no answer in time, a connection that broke or was refused (TimeoutError too)
        raise SchedulerSilentError(f"the Dask scheduler did not answer within {SCHEDULER_SILENCE_SECONDS:.0f} s "
                                   f"whether the worker {worker} is there ({type(exc).__name__}: {exc})") from exc


def call_server(actor: Any, method: str, *args: Any) -> ServerCall:
    """``actor.method(*args)``, waited for as a :class:`ServerCall` (watching the worker of a Dask actor)."""
    future = getattr(actor, method)(*args)
    if not isinstance(actor, Actor):  # an object called in this process (tests)
        return ServerCall(future)
    return ServerCall(future, actor_address(actor), actor_client(actor))


def answer(call: Any, timeout: float | None = None) -> Any:
    """The result of an actor call (raising its error; TimeoutError after ``timeout`` seconds),
    without a trip through the client's event loop when the answer is already in: ``result()``
    hands every wait to the loop thread, even for a finished call, and a write-back waits on
    K + R of them per batch (:func:`~dlrmflow.engine.serving.dask_internals.finished_outcome`)."""
    if isinstance(call, ServerCall):
        return call.result()
    done, value = finished_outcome(call)
    if done:
        return value
    return call.result() if timeout is None else call.result(timeout=timeout)


class LostMembersError(RuntimeError):
    """Calls to these members (shards, by index) failed: their workers are gone."""

    def __init__(self, members: set[int], cause: BaseException) -> None:
        self.members, self.cause = members, cause
        super().__init__(f"members {sorted(members)} lost: {cause!r}")

    @classmethod
    def joined(cls, *errors: LostMembersError | None) -> LostMembersError | None:
        """One error naming every member that ``errors`` name (None when all are None): the calls of one
        round trip, waited for in groups, fail as one."""
        found = [e for e in errors if e is not None]
        if len(found) < 2:
            return found[0] if found else None
        return cls(set().union(*(e.members for e in found)), found[0].cause)


class DeadCall:
    """A call that could not even be sent: the actor's worker is known to be gone."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause

    def result(self):
        raise OSError(f"the actor's worker is gone: {self.cause}")


def remote(actor: Any, method: str, *args: Any) -> ServerCall | DeadCall:
    """``actor.method(*args)`` (a :class:`ServerCall`), or a call whose ``result()`` raises OSError when
    Dask already knows the worker is lost (it then refuses to even send the call)."""
    try:
        return call_server(actor, method, *args)
    except (OSError, RuntimeError) as exc:
        if is_lost_actor_error(exc):
            return DeadCall(exc)
        raise


def wait_all(calls: list[tuple[int, Any]]) -> tuple[dict[int, Any], LostMembersError | None]:
    """Results of every ``(member, call)`` (waiting for all, even after a failure), and a
    LostMembersError naming the members whose call failed because their worker is gone (or None)."""
    results, lost, cause = {}, set(), None
    for s, call in calls:
        try:
            results[s] = answer(call)
        except OSError as exc:  # CommClosedError is an OSError too: the member's worker is gone
            lost.add(s)
            cause = exc
    return results, (LostMembersError(lost, cause) if lost else None)


def _import(module: str) -> None:
    importlib.import_module(module)


def warm_up_workers(client: Client, module: str = "dlrmflow.engine.serving.shards",
                    workers: list[str] | None = None) -> None:
    """Import the server code on every worker (or on ``workers``) now: a spare that
    later hosts a rebuilt or restored shard then starts it at once instead of importing while
    training waits. Every worker means every worker that answers a probe: the scheduler lists a machine
    that failed outright until Dask's TCP timeout, and a call to it would wait that long, then fail."""
    if workers is None:
        workers = sorted(probe_workers(client, list(cluster_workers(client))))
    client.run(_import, module, workers=workers)


class WorkerLeftError(OSError):
    """A worker left the cluster before the actor placed on it started."""

    def __init__(self, worker: str, what: str) -> None:
        super().__init__(f"worker {worker} left the Dask cluster before {what} started on it")
        self.worker = worker


def started_actors(client: Client, futures: list[Future], workers: list[str], what: str,
                   poll_s: float = 1.0) -> list[Actor]:
    """The actors of ``futures`` (``futures[i]`` pinned to ``workers[i]``), once all started. A worker that
    leaves the cluster first raises :class:`WorkerLeftError`: the scheduler lists a killed worker until it
    notices the loss, and an actor pinned there would wait for that worker forever."""
    while True:
        try:
            wait(futures, timeout=poll_s)
        except TimeoutError:
            alive = cluster_workers(client)
            gone = [w for f, w in zip(futures, workers, strict=True) if not f.done() and w not in alive]
            if gone:
                client.cancel(futures)
                raise WorkerLeftError(gone[0], what) from None
            continue
        return [f.result() for f in futures]


def place_avoiding(client: Client, n: int, avoid: Collection[str] = ()) -> Placement:
    """Workers for ``n`` actors, none of ``avoid``, by :func:`~dlrmflow.engine.serving.placement.place`:
    those with the ``embedding_server`` resource when any has it; distinct hosts, then distinct workers,
    then round robin."""
    return place({w: info for w, info in cluster_workers(client).items() if w not in avoid}, n)


def start_placed_actors(client: Client, n: int, submit: Callable[[int, str], Future], what: str, *,
                        warm_up: str = "dlrmflow.engine.serving.shards", avoid: Collection[str] | None = None
                        ) -> tuple[Placement, list[Future], list[Actor]]:
    """``n`` actors, actor ``i`` submitted by ``submit(i, worker)`` pinned to the worker
    :func:`place_avoiding` gives it (none of ``avoid``), once all started. First every worker imports
    ``warm_up`` (spares included: a rebuild or restore may use them), or with ``avoid`` only the chosen
    ones (a worker just lost may still be listed, and a call to it waits out Dask's connect timeout).
    When a chosen worker leaves the cluster before its actor started (:func:`started_actors`), all are
    placed again without it."""
    gone: set[str] = set(avoid or ())
    while True:
        placement = place_avoiding(client, n, gone)
        chosen_only = avoid is not None or len(gone) > 0
        warm_up_workers(client, warm_up, workers=sorted(set(placement.workers)) if chosen_only else None)
        futures = [submit(i, worker) for i, worker in enumerate(placement.workers)]
        try:
            actors = started_actors(client, futures, placement.workers, what)
        except WorkerLeftError as exc:
            gone.add(exc.worker)
            continue
        warning = shared_host_warning(placement, cluster_workers(client)) if avoid is None else None
        if warning:
            EVENTS.warning("placement: %s", warning)
        return placement, futures, actors


def start_shards(client: Client, spec: RowSpec, num_shards: int) -> ShardGroup:
    """Start ``num_shards`` EmbeddingShard actors, spread by :func:`start_placed_actors` (workers with the
    ``embedding_server`` resource when any has it; distinct hosts, then workers; placed again, without it,
    when a chosen worker leaves the cluster first)."""
    if num_shards < 1:
        raise ValueError(f"need at least one shard, got {num_shards}")
    placement, futures, actors = start_placed_actors(
        client, num_shards,
        lambda k, worker: client.submit(EmbeddingShard, spec, k, num_shards, actor=True, workers=[worker], pure=False),
        "an embedding server")
    return ShardGroup(spec, actors, futures, worker_of=list(placement.workers))
