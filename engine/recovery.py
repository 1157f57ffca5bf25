"""Rebuilding lost members of a :class:`~dlrmflow.engine.parity.CodedShardGroup` while training runs.

On a loss the group calls :func:`start_recovery_thread`. The thread (1) starts a replacement
actor for every lost member on a worker that hosts no live member (a fresh worker: with a
LocalCluster the nanny restarts the killed worker, which then qualifies; it waits a little for
one and otherwise takes the least loaded worker), then (2) rebuilds the lost members chunk by
chunk: read the chunk's stripes from K survivors, decode, install on the replacements. Each
chunk is read, decoded and installed while holding the group's lock, i.e. strictly between two
write-back batches; see :mod:`.parity` for why that makes every stripe one consistent version.
Between chunks the lock is released, so training continues, and the trainer reads rows of
stripes not yet rebuilt by degraded reads. When every chunk is installed the replacements take
the lost members' places and reads go to them.

A further loss during a rebuild restarts it from stripe 0 for everything lost (the decode of
a chunk needs one fixed set of survivors); more than R lost is fatal (TooManyErasuresError).

:func:`rebuild_lost` is a plain function (tested without Prefect); the train flow wraps it in
the ``recover-shard`` subflow through ``group.recovery_runner``.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

from dlrmflow.engine.erasure import rows_in_stripes, stripe_chunks
from dlrmflow.engine.parity import (
    CodedShardGroup,
    LostMembersError,
    _wait_all,
    member_name,
    remote,
    start_member,
)

FRESH_WORKER_WAIT_S = 10.0  # how long a rebuild waits for a worker that hosts no live member
YIELD_S = 0.0005  # pause between chunks, so the trainer gets the lock (Python locks are not fair)


def start_recovery_thread(group: CodedShardGroup) -> threading.Thread:
    # Run in a copy of the caller's context: under Prefect the recovery subflow then knows its parent.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(_run, group), name="dlrmflow-recovery", daemon=True)
    thread.start()
    return thread


def _run(group: CodedShardGroup) -> None:
    try:
        with group.lock:
            info = {"lost": [member_name(s, group.code.k) for s in sorted(group.lost)],
                    "stripes": group.n_stripes, "chunk": group.rebuild_chunk}
        if group.recovery_runner is not None:
            group.recovery_runner(lambda progress=None: rebuild_lost(group, progress), info)
        else:
            rebuild_lost(group)
    except BaseException as exc:  # noqa: BLE001 - the trainer re-raises it at its next call
        with group.lock:
            group.fatal = group.fatal or exc
            group.recovering = False


def choose_worker(group: CodedShardGroup, wait_s: float = FRESH_WORKER_WAIT_S) -> str:
    """A worker hosting no live member (waiting up to ``wait_s`` for one), else the least loaded."""
    deadline = time.perf_counter() + wait_s
    while True:
        with group.lock:
            busy = [group.worker_of[s] for s in range(group.code.n_shards) if s not in group.lost]
            busy += [w for s, w in group.replacement_workers.items() if s in group.replacement]
        workers = sorted(group.client.scheduler_info()["workers"])
        free = [w for w in workers if w not in busy and w not in group.dead_workers]
        if free:
            return free[0]
        if time.perf_counter() > deadline:
            if not workers:
                raise RuntimeError(f"no Dask worker to rebuild a lost shard on (waited {wait_s:.0f} s)")
            return min(workers, key=busy.count)  # shares a fault domain with a live member: better than nothing
        time.sleep(0.1)


def _place_replacements(group: CodedShardGroup, need: list[int]) -> dict[int, tuple[str, Any, Any]]:
    placed = {}
    for s in need:
        worker = choose_worker(group)
        future = start_member(group.client, group.spec, group.code, s, worker, initialise=False)
        placed[s] = (worker, future, future.result())
        group.replacement_workers[s] = worker
    return placed


def _rebuild_chunk(group: CodedShardGroup, lost: list[int], start: int, stop: int) -> int:
    """Read ``[start, stop)`` from K survivors, decode the lost members, install. Lock held."""
    code = group.code
    survivors = code.survivors_for([s for s in range(code.n_shards) if s not in lost])
    pieces, error = _wait_all([(s, remote(group.members[s], "read_stripes", start, stop)) for s in survivors])
    if error:
        raise error
    n_rows = {s: rows_in_stripes(group.rows_of[s], start, stop) for s in lost}
    decoded = code.decode(pieces, lost, n_rows=n_rows)
    _, error = _wait_all([(s, remote(group.replacement[s], "install", start, decoded[s])) for s in lost])
    if error:
        raise error
    return sum(n_rows.values())


def rebuild_lost(group: CodedShardGroup, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Rebuild every lost member of ``group`` on replacements; returns what was rebuilt."""
    while True:
        with group.lock:
            group._raise_fatal()
            lost, generation = sorted(group.lost), group.generation
            need = [s for s in lost if s not in group.replacement]
            record = group.recoveries[-1]
            if not lost:  # decided under the lock: a later loss starts a new recovery thread
                group.recovering = False
                return record.as_dict(group.code.k, group.started_at)
        placed = _place_replacements(group, need)  # outside the lock: may wait for a fresh worker
        with group.lock:
            for s, (worker, future, actor) in placed.items():
                if s in group.lost and s not in group.replacement:
                    group.replacement[s], group.replacement_future[s] = actor, future
                    record.workers[s] = worker
            if group.generation != generation:
                continue
            group.cursor = 0
        chunks = stripe_chunks(group.n_stripes, group.rebuild_chunk)
        complete = True
        for start, stop in chunks:
            with group.lock:
                group._raise_fatal()
                if group.generation != generation:
                    complete = False
                    break
                try:
                    rows = _rebuild_chunk(group, lost, start, stop)
                except LostMembersError as exc:
                    group.on_lost(exc.members)  # raises when more than R are lost
                    complete = False
                    break
                group.cursor = stop
                record.chunks += 1
                record.stripes += stop - start
                record.rows_rebuilt += rows
            if progress is not None:
                progress(stop, group.n_stripes)
            time.sleep(YIELD_S)
        if not complete:
            continue
        with group.lock:
            if group.generation != generation:
                continue
            for s in lost:  # reads go to the rebuilt members from now on
                group.members[s] = group.replacement.pop(s)
                group.member_futures[s] = group.replacement_future.pop(s)
                group.worker_of[s] = record.workers.get(s, group.replacement_workers.get(s, "?"))
            group.actors = group.members[: group.code.k]
            group.futures = group.member_futures[: group.code.k]
            group.lost.clear()
            group.cursor = 0
            record.rebuilt_at = time.perf_counter()
        # Back to the top: it returns there (under the lock) unless a loss came in meanwhile.
