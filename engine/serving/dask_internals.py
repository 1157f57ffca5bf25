"""Every use of a Dask private API in the engine, each behind one function.

Dask's public API has no way to ask an actor handle where it lives, to read a finished actor call
without a trip through the client's event loop, to find the object behind an actor hosted by the
current worker, or to tell "the actor's worker is gone" from another error, a LocalCluster's
workers cannot opt out of its check that closes a restarting worker's nanny, and its TCP comm wakes for every
packet of a frame that trickles in over a slow link. These functions do it
through ``distributed`` internals, named in each docstring; ``tests/test_dask_internals.py`` runs
each against a real cluster, so a Dask upgrade that changes one fails there, not in a kill run.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from distributed import Actor, Client, LocalCluster
from distributed.comm import tcp
from distributed.deploy.cluster import Cluster
from distributed.protocol.utils import host_array
from tornado.iostream import IOStream

LOST_ACTOR_MESSAGE = "Worker holding Actor was lost"  # distributed.actor.Actor.__getattr__'s RuntimeError


def actor_address(actor: Actor) -> str:
    """The address of the worker hosting ``actor``. Relies on ``Actor._address``."""
    return actor._address


def actor_client(actor: Actor) -> Client | None:
    """The client ``actor``'s calls go through (None on a worker that has not bound one yet).
    Relies on ``Actor._client``."""
    return actor._client


def finished_outcome(call: Any) -> tuple[bool, Any]:
    """``(True, value)`` for an actor call already answered, raising its error if it failed;
    ``(False, None)`` when it is not answered yet, or ``call`` is not an ``ActorFuture``.

    Reads the outcome without ``result()``, which hands every wait to the client's event-loop thread
    even for a finished call. Relies on ``distributed.actor.ActorFuture._out`` (an ``_OK`` or
    ``_Error`` with ``unwrap()``, set once the call is done)."""
    out = getattr(call, "_out", None)
    if out is None or not call.done():
        return False, None
    return True, out.unwrap()


def local_actor(actor: Actor) -> Any:
    """The object behind ``actor`` when the current worker hosts it, else None (also outside a worker).
    Relies on ``get_worker().state.actors`` (the worker state's map from key to actor object)."""
    from distributed import get_worker

    try:
        return get_worker().state.actors.get(actor.key)
    except (ValueError, AttributeError):  # not on a worker, or a Dask without these internals: no shortcut
        return None


def is_lost_actor_error(exc: BaseException) -> bool:
    """An actor call failed because the actor's worker is gone: a broken connection (OSError, which
    CommClosedError is too), or Dask refusing to send to a worker it knows is lost. Relies on the
    wording of the RuntimeError that ``distributed.actor.Actor.__getattr__`` raises then."""
    return isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and LOST_ACTOR_MESSAGE in str(exc))


def bind_actor(actor: Any) -> None:
    """Bind an actor handle unpickled on a worker to that worker and its client, from a task's thread.

    A handle binds on its first call, and only from a task's thread (``get_worker`` knows no other);
    a call first made from another thread of the task (the oracle's prefetch thread) would find
    neither. Relies on ``Actor._try_bind_worker_client``."""
    if isinstance(actor, Actor):
        actor._try_bind_worker_client()


def release_actor(actor: Any) -> None:
    """Drop the reference an actor handle holds on its actor: a handle bound to a client holds a future of the
    actor's key (``Actor._future``), which keeps the actor alive while the handle lives, in whatever process
    it was unpickled. Releasing it ends that hold now (the actor ends once no future of it is held)."""
    future = getattr(actor, "_future", None) if isinstance(actor, Actor) else None
    if future is not None:
        future.release()


class RestartSafeLocalCluster(LocalCluster):
    """A LocalCluster that leaves its workers' lives to their nannies: a worker that leaves (killed, or
    restarted by ``Client.restart_workers``) is started again by its nanny, and the cluster never closes that
    nanny.

    Dask's SpecCluster, on each worker's removal, checks ``distributed.deploy.lost-worker-timeout`` (15 s) later
    whether a worker of that name is connected, and if none is, closes its nanny for good. A nanny that is
    restarting that worker at that moment (a second kill of the same worker, the restart of a trainer left
    blocked by a failed run) is then closed mid-restart: the cluster stays one worker short and the restart
    times out. Here the nanny restarts its worker itself, so the check is left out. Relies on
    ``SpecCluster._update_worker_status`` (distributed.deploy.spec) and its base's in ``Cluster``."""

    def _update_worker_status(self, op: str, msg: Any) -> None:
        Cluster._update_worker_status(self, op, msg)  # SpecCluster's bookkeeping without its lost-worker check


# Dask's own frame read, as this module found it (read_frames_by_the_mark replaces it afterwards).
_DASK_READ_BYTES_RW = tcp.read_bytes_rw
# A frame of at least this many bytes is read by the mark (below: one read is all it takes).
MARKED_READ_MIN_BYTES = 64 * 1024
# The most bytes a read waits for: epoll wakes once this much has arrived (or the frame's rest, if less).
MARKED_READ_MAX_BYTES = 256 * 1024


async def read_frame_by_the_mark(stream: Any, n: int) -> memoryview:
    """``n`` bytes of a Dask TCP frame from ``stream``, waking once per :data:`MARKED_READ_MAX_BYTES` arrived
    instead of once per packet.

    Behind a slow link a frame trickles in one packet at a time, and tornado's ``IOStream`` wakes for each
    (about 100 µs of Python per 1.5 KB: 118,542 wakes in one `remote` run at 50 Mbit/s, a second of CPU per
    iteration; benchmarks/RESULTS.md). Before each wait the socket's ``SO_RCVLOWAT`` is set to the bytes still
    missing, at most :data:`MARKED_READ_MAX_BYTES`: never more than the sender still owes, so the wait always
    ends (a closed connection wakes it too), and back to 1 afterwards. Small frames and TLS streams take
    Dask's own read.

    Relies on: ``distributed.comm.tcp.read_bytes_rw(stream, n)``, the function ``TCP.read`` calls for each frame
    (looked up as that module's global), ``distributed.protocol.utils.host_array``, tornado's
    ``IOStream.read_into(buf, partial=True)`` and ``IOStream.socket``."""
    sock = getattr(stream, "socket", None)
    if n < MARKED_READ_MIN_BYTES or sock is None or type(stream) is not IOStream:
        return await _DASK_READ_BYTES_RW(stream, n)
    buf = host_array(n)
    got = 0
    try:
        while got < n:
            with contextlib.suppress(OSError):  # a socket that refuses it: the plain wait, per packet
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(n - got, MARKED_READ_MAX_BYTES))
            got += await stream.read_into(buf[got:], partial=True)
    finally:
        if stream.socket is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return buf


def read_frames_by_the_mark() -> None:
    """Every Dask TCP frame this process reads from now on is read by :func:`read_frame_by_the_mark`
    (idempotent). Called where the engine's serving layer loads, so the trainer's process, its LocalCluster's
    workers (forked from a server that loaded it) and any worker that hosts an embedding server read this way.
    Relies on what :func:`read_frame_by_the_mark` names."""
    tcp.read_bytes_rw = read_frame_by_the_mark
