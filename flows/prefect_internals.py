"""Every use of Prefect behaviour that Prefect does not document as API, in one place.

Each function names what it relies on. ``tests/test_prefect_internals.py`` exercises each one against
the installed Prefect, so an upgrade that changes them fails there, loudly, instead of as a recovery
flow run that silently loses its parent or its logs. (The engine's Dask counterpart is
:mod:`dlrmflow.engine.dask_internals`; the engine never imports Prefect, hence two modules.)
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from prefect.context import TaskRunContext

T = TypeVar("T")

RunInContext = Callable[..., Any]


def capture_run_context() -> RunInContext:
    """A caller ``run(fn, *args)`` that runs ``fn(*args)`` in the Prefect run context of *this* call.

    A flow called inside another flow run becomes its child only when Prefect finds the parent's
    ``FlowRunContext`` in the calling thread's context; a plain ``threading.Thread`` starts with an
    empty one, so a flow called there is a top-level run. ``run`` brings the captured context along,
    whichever thread calls it.

    Relies on: Prefect keeping its run contexts (``FlowRunContext``, ``TaskRunContext``, the client
    and settings contexts) in :mod:`contextvars` (``ContextModel.__var__``), so that
    :func:`contextvars.copy_context` carries them. Each call runs in a copy of the captured context:
    one ``Context`` cannot be entered by two threads at once.
    """
    captured = contextvars.copy_context()

    def run(fn: Callable[..., T], *args: Any) -> T:
        return captured.copy().run(fn, *args)

    return run


@contextmanager
def outside_task_run() -> Iterator[None]:
    """Within the block, no task run is current (the flow run still is), and afterwards the one before is.

    A flow called from inside a task run then logs and publishes artifacts as its own flow run,
    not as that task run. Relies on: ``TaskRunContext.__var__``, the private ``ContextVar`` behind
    ``TaskRunContext.get()``; Prefect has no public way to leave a task run's context.
    """
    token = TaskRunContext.__var__.set(None)
    try:
        yield
    finally:
        TaskRunContext.__var__.reset(token)
