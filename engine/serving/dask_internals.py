"""Every use of a Dask private API in the engine, each behind one function.

Dask's public API has no way to ask an actor handle where it lives, to read a finished actor call
without a trip through the client's event loop, to find the object behind an actor hosted by the
current worker, or to tell "the actor's worker is gone" from another error, and a LocalCluster's
workers cannot opt out of its check that closes a restarting worker's nanny. These functions do it
through ``distributed`` internals, named in each docstring; ``tests/test_dask_internals.py`` runs
each against a real cluster, so a Dask upgrade that changes one fails there, not in a kill run.
"""

from __future__ import annotations

from typing import Any

from distributed import Actor, Client, LocalCluster
from distributed.deploy.cluster import Cluster

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
