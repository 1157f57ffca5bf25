"""Each Dask private API the engine relies on (engine/serving/dask_internals.py), against a real cluster: a Dask
upgrade that changes one fails here, loudly, rather than as a slow or stuck kill run."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.comm import tcp
from tornado.iostream import StreamClosedError

from dlrmflow.engine.serving import dask_internals
from dlrmflow.engine.serving.cluster import local_cluster
from dlrmflow.engine.serving.dask_internals import (
    MARKED_READ_MAX_BYTES,
    MARKED_READ_MIN_BYTES,
    read_frame_by_the_mark,
)
from dlrmflow.engine.serving.shards import (
    DeadCall,
    LostMembersError,
    ServerCall,
    answer,
    call_server,
    remote,
    wait_all,
)


class Counter:
    """A tiny actor."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, x: int) -> int:
        self.n += x
        return self.n

    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.n

    def fail(self) -> None:
        raise ValueError("the actor's own error")


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        yield cluster, client, sorted(client.scheduler_info()["workers"])


def _actor(client: Client, worker: str):
    future = client.submit(Counter, actor=True, workers=[worker], pure=False)
    return future, future.result()


def test_an_actor_handle_names_its_worker_and_client(cluster):
    _, client, workers = cluster
    _, actor = _actor(client, workers[1])
    assert dask_internals.actor_address(actor) == workers[1]
    assert dask_internals.actor_client(actor) is client
    call = call_server(actor, "add", 2)
    assert isinstance(call, ServerCall) and (call.worker, call.client) == (workers[1], client)
    assert call.result() == 2


def test_a_finished_actor_call_is_read_without_the_event_loop(cluster):
    _, client, workers = cluster
    _, actor = _actor(client, workers[0])
    call = actor.add(5)
    assert call.result() == 5
    assert dask_internals.finished_outcome(call) == (True, 5)
    failed = actor.fail()
    with pytest.raises(ValueError, match="own error"):
        failed.result()
    with pytest.raises(ValueError, match="own error"):
        dask_internals.finished_outcome(failed)
    pending = actor.slow(1.0)
    assert dask_internals.finished_outcome(pending) == (False, None)
    assert answer(pending) == 5
    assert dask_internals.finished_outcome(object()) == (False, None)  # not an ActorFuture: no shortcut


def _probe_local(actor) -> int | None:
    local = dask_internals.local_actor(actor)
    return None if local is None else local.add(0)


def test_a_task_finds_the_actor_its_worker_hosts(cluster):
    _, client, workers = cluster
    _, actor = _actor(client, workers[0])
    actor.add(7).result()
    here = client.submit(_probe_local, actor, workers=[workers[0]], allow_other_workers=False, pure=False)
    there = client.submit(_probe_local, actor, workers=[workers[1]], allow_other_workers=False, pure=False)
    assert here.result() == 7  # the object itself, not a handle
    assert there.result() is None
    assert dask_internals.local_actor(actor) is None  # not on a worker


def test_a_call_to_an_actor_whose_worker_is_gone_is_recognised():
    """Worker processes here: in one process an actor handle can bind to another in-process cluster's worker."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=logging.CRITICAL) as local_cluster, Client(local_cluster) as client:
        _check_lost_actor(client)


def _check_lost_actor(client: Client) -> None:
    worker = sorted(client.scheduler_info()["workers"])[-1]
    future, actor = _actor(client, worker)
    assert actor.add(1).result() == 1
    os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while future.status in ("finished", "pending"):
        assert time.monotonic() < deadline, "Dask never marked the actor's future lost"
        time.sleep(0.01)
    with pytest.raises(RuntimeError) as raised:
        actor.add(1)
    assert dask_internals.is_lost_actor_error(raised.value)
    assert not dask_internals.is_lost_actor_error(RuntimeError("something else"))
    assert dask_internals.is_lost_actor_error(OSError("a broken connection"))
    call = remote(actor, "add", 1)  # what the engine does with it: a call that fails as a lost member's
    assert isinstance(call, DeadCall)
    results, error = wait_all([(3, call)])
    assert results == {} and isinstance(error, LostMembersError) and error.members == {3}


GONE = "tcp://127.0.0.1:9"  # no worker listens there: like a killed worker the scheduler still listed


def test_an_actor_placed_on_a_worker_that_left_fails_its_start_instead_of_waiting_forever(cluster):
    from dlrmflow.engine.serving.shards import WorkerLeftError, started_actors

    _, client, workers = cluster
    futures = [client.submit(Counter, actor=True, workers=[w], pure=False) for w in (workers[0], GONE)]
    with pytest.raises(WorkerLeftError, match=f"worker {GONE} left the Dask cluster before a counter started"):
        started_actors(client, futures, [workers[0], GONE], "a counter", poll_s=0.2)
    assert all(f.cancelled() for f in futures)  # the start gave up on both: a new placement starts afresh
    again = [client.submit(Counter, actor=True, workers=[workers[0]], pure=False)]
    [actor] = started_actors(client, again, workers[:1], "a counter")
    assert actor.add(2).result() == 2


def test_embedding_servers_placed_on_a_worker_that_left_are_placed_again_without_it(cluster, monkeypatch):
    """The scheduler lists a killed worker until it notices the loss: placement may choose it, and the
    start then places every server again from the workers that are left."""
    from dlrmflow.engine.serving import shards as shards_module
    from dlrmflow.engine.serving.embedding_rows import RowSpec

    _, client, workers = cluster
    real, calls = shards_module.cluster_workers, []

    def listing_a_dead_worker(c):
        found = real(c)
        calls.append(len(calls))
        return {GONE: found[workers[0]], workers[0]: found[workers[0]]} if len(calls) == 1 else found  # 2 for 2

    monkeypatch.setattr(shards_module, "cluster_workers", listing_a_dead_worker)
    monkeypatch.setattr(shards_module, "warm_up_workers", lambda *a, **k: None)  # a broadcast would reach GONE
    spec = RowSpec(dim=4, optimizer="adagrad", seed=0, table_offsets=(0, 10), cardinalities=(10, 20))
    group = shards_module.start_shards(client, spec, 2)
    try:
        assert sorted(dask_internals.actor_address(a) for a in group.actors) == workers and len(calls) > 1
    finally:
        group.close()


def test_a_worker_restarted_while_the_clusters_lost_worker_check_runs_comes_back():
    """Dask's SpecCluster closes the nanny of a worker that no worker of its name has replaced
    ``distributed.deploy.lost-worker-timeout`` after its removal: a nanny still restarting it then (a second
    kill, a restart of a trainer left blocked) is closed for good, and the cluster stays a worker short. With
    the timeout at 0 s every restart falls in that window: dlrmflow's cluster brings the worker back each time,
    a plain LocalCluster does not (checked here, so that this test can fail)."""
    def restarts_survived(start_cluster, timeout: float) -> tuple[int, int]:
        """Restarts of the cluster's one worker that brought it back (of 3), and the nannies left."""
        with dask.config.set({"distributed.deploy.lost-worker-timeout": "0s"}), \
                start_cluster() as cluster, Client(cluster) as client:
            restarts = 0
            while restarts < 3:
                try:
                    client.restart_workers(list(client.scheduler_info()["workers"]), timeout=timeout)
                except TimeoutError:
                    break
                restarts += 1
            return restarts, len(cluster.workers)

    assert restarts_survived(lambda: local_cluster(1), timeout=30) == (3, 1)
    plain = restarts_survived(lambda: LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None),
                              timeout=5)
    assert plain == (0, 0)  # the nanny closed during the first restart


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection (AF_UNIX sockets ignore SO_RCVLOWAT)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    return sender, receiver


def _read_trickled(payload: bytes, chunk: int, close_after: int | None = None) -> tuple[bytes | Exception, int, int]:
    """``read_frame_by_the_mark`` of ``len(payload)`` bytes that arrive ``chunk`` bytes at a time (a slow
    link's packets; the sender stops and closes after ``close_after`` bytes): (what it returned or raised,
    how many reads it asked tornado for, the socket's SO_RCVLOWAT afterwards)."""
    from tornado.iostream import IOStream

    sender, receiver = _tcp_pair()

    def trickle() -> None:
        end = len(payload) if close_after is None else close_after
        for i in range(0, end, chunk):
            sender.sendall(payload[i:min(i + chunk, end)])
            time.sleep(0.0002)
        if close_after is not None:
            sender.close()

    async def read() -> tuple[bytes | Exception, int, int]:
        stream = IOStream(receiver)
        reads = 0
        plain = stream.read_into

        def counted(buf, partial=False):
            nonlocal reads
            reads += 1
            return plain(buf, partial=partial)

        stream.read_into = counted
        writer = threading.Thread(target=trickle)
        writer.start()
        try:
            got: bytes | Exception = bytes(await asyncio.wait_for(read_frame_by_the_mark(stream, len(payload)), 30))
        except Exception as exc:  # noqa: BLE001  (the test inspects it)
            got = exc
        writer.join()
        mark = receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) if stream.socket is not None else None
        stream.close()
        return got, reads, mark

    try:
        return asyncio.run(read())
    finally:
        sender.close()


def test_a_frame_that_trickles_in_packet_by_packet_is_read_whole_in_a_few_wakes():
    """1 MB arriving 1,448 bytes at a time (a TCP packet's payload): the bytes intact, in far fewer reads than the
    724 packets (each wait ends once 256 KB, or the frame's rest, has arrived), and the mark back to 1."""
    payload = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    got, reads, mark = _read_trickled(payload, 1448)
    assert got == payload
    assert reads < 40, reads
    assert mark == 1


def test_a_frame_shorter_than_the_mark_and_one_below_the_minimum_are_read_whole():
    for size in (MARKED_READ_MIN_BYTES - 1, MARKED_READ_MIN_BYTES + 1000, MARKED_READ_MAX_BYTES + 7):
        payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        got, _, _ = _read_trickled(payload, 60_000)
        assert got == payload, size


def test_a_connection_closed_mid_frame_ends_the_read_with_an_error_not_a_wait():
    payload = b"y" * (1 << 20)
    started = time.monotonic()
    got, _, _ = _read_trickled(payload, 1448, close_after=300_000)
    assert isinstance(got, StreamClosedError), got
    assert time.monotonic() - started < 10


def test_the_serving_layer_reads_dask_frames_by_the_mark():
    """Loading the serving layer installs it (the trainer's process; workers forked from its server)."""
    import dlrmflow.engine.serving.cluster  # noqa: F401

    assert tcp.read_bytes_rw is read_frame_by_the_mark
    assert "read_bytes_rw" in tcp.TCP.read.__code__.co_names, "Dask's TCP comm no longer reads frames through it"
