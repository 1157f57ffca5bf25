"""Every use of Prefect behaviour that Prefect does not document as API, in one place.

Each function names what it relies on. ``tests/test_prefect_internals.py`` exercises each one against
the installed Prefect, so an upgrade that changes them fails there, loudly, instead of as a recovery
flow run that silently loses its parent or its logs. (The engine's Dask counterpart is
:mod:`dlrmflow.engine.serving.dask_internals`; the engine never imports Prefect, hence two modules.)
"""

from __future__ import annotations

import contextvars
import os
import subprocess
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from prefect.context import TaskRunContext
from prefect.utilities.annotations import quote

from dlrmflow.engine.errors import UserInputError

T = TypeVar("T")

RunInContext = Callable[..., Any]


def untraced(*values: Any) -> tuple[Any, ...]:
    """``values`` quoted (``prefect.utilities.annotations.quote``), for a task called by a flow that ran
    subflows. Prefect links a subflow's result, and the values one level inside it, to that subflow run by
    their ``id()`` in the flow run's context (``link_state_to_result``) and never forgets them: a later
    task's argument that is one of those values, or a new object that reuses a freed one's address,
    becomes a ``flow_run`` input of that task, which the UI's task run pages reject. Quoted arguments are
    not traced (nor hashed into a cache key)."""
    return tuple(quote(value) for value in values)


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


class TemporaryApiError(UserInputError):
    """Prefect's temporary local API did not start: one line that says how, and names the way out."""


class UnexpectedServerCommand(RuntimeError):
    """Prefect launched its server with a command :func:`server_command` does not know (Prefect changed)."""


# What to do without a temporary API: run a server and point every command at it.
SERVER_WAY_OUT = ("start one with `prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api "
                  "(`prefect config set PREFECT_API_URL=...`)")


def prepare_temporary_api(timeout_s: float) -> None:
    """Make the temporary local API that Prefect starts on its first API call without ``PREFECT_API_URL``
    wait up to ``timeout_s`` for the server, end the server with this process, and fail in one line.

    Starts nothing: the server starts when Prefect first needs it, so a command that fails
    on its input first costs no server. Once started it runs under :mod:`dlrmflow.exit_with_parent`,
    which ends it when this process is gone (Prefect stops it only from an ``atexit`` hook, which a
    killed process never runs). A server that does not answer in time is stopped, and
    :class:`TemporaryApiError` raised where Prefect wanted it.

    Relies on: ``prefect.server.api.server.SubprocessASGIServer``, a per-port singleton whose port-None
    instance is the server every ``get_client()`` (and the events client) without an API URL starts
    with ``.start()`` and then uses; ``start(timeout)`` launches it through
    ``self._run_uvicorn_command()``, which calls ``subprocess.Popen(args=[sys.executable, "-m",
    "uvicorn", ...])`` through that module's ``subprocess``; :func:`server_command` refuses any other
    command, so a change fails loudly. Both methods are replaced on this one instance only.
    """
    from prefect.server.api import server as server_module

    server = server_module.SubprocessASGIServer()  # registers the default server; starts nothing
    if server.running or getattr(server, "dlrmflow_prepared", False):
        return
    launch = type(server)._run_uvicorn_command
    start = type(server).start

    def run_uvicorn_command(self: Any) -> subprocess.Popen[Any]:
        real = server_module.subprocess
        server_module.subprocess = _SubprocessExitingWithParent(real)
        try:
            return launch(self)
        finally:
            server_module.subprocess = real

    def start_or_explain(self: Any, timeout: float | None = None) -> None:
        wait_s = max(timeout or 0, timeout_s, 0.1)  # 0 or None would mean Prefect's own default
        try:
            start(self, timeout=wait_s)
        except Exception as exc:
            process = self.server_process
            exited = process is not None and process.poll() is not None
            self.stop()
            if isinstance(exc, UnexpectedServerCommand):
                raise
            how = f"its server exited with status {process.returncode}" if exited else \
                f"it did not answer within {wait_s:g} s"
            raise TemporaryApiError(f"the temporary local Prefect API did not start ({how}); {SERVER_WAY_OUT}, "
                                    "or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") from exc

    starting = threading.Lock()  # one start at a time: start_temporary_api_now's thread and Prefect's call
    failed: list[BaseException] = []

    def start_once(self: Any, timeout: float | None = None) -> None:
        with starting:  # Prefect marks the server running before it answers: wait for the start under way
            if failed:
                raise failed[0]
            if self.running:
                return
            try:
                start_or_explain(self, timeout)
            except BaseException as exc:
                failed.append(exc)  # the failure is the command's, wherever Prefect next asks for the API
                raise

    server._run_uvicorn_command = types.MethodType(run_uvicorn_command, server)
    server.start = types.MethodType(start_once, server)
    server.dlrmflow_prepared = True


def start_temporary_api_now() -> None:
    """Start the temporary local API (prepared by :func:`prepare_temporary_api`) in a thread, now: its
    seconds of start-up overlap the command's own imports and set-up instead of following them. A start
    that fails fails where Prefect first asks for the API (one line, as :func:`prepare_temporary_api` makes it).

    Relies on: the same ``SubprocessASGIServer`` singleton as :func:`prepare_temporary_api`, whose
    ``start`` that function made safe to call from two threads."""
    from prefect.server.api import server as server_module

    server = server_module.SubprocessASGIServer()
    if server.running or not getattr(server, "dlrmflow_prepared", False):
        return

    def start() -> None:
        try:
            server.start()
        except BaseException:
            # Its stop() took the server out of Prefect's registry: put it back, so that Prefect's own start()
            # raises this failure (one line) instead of starting an unprepared server.
            server_module.SubprocessASGIServer._instances.setdefault(None, server)

    threading.Thread(target=start, name="dlrmflow-temporary-api", daemon=True).start()


def server_command(args: Sequence[str]) -> list[str]:
    """``[python, -m, uvicorn, ARGS...]`` as ``[python, -m, dlrmflow.exit_with_parent, THIS_PID, uvicorn, ARGS...]``."""
    if list(args[1:3]) != ["-m", "uvicorn"]:
        raise UnexpectedServerCommand(f"unexpected Prefect server command {list(args)[:3]} (see "
                                      "flows/prefect_internals.py: prepare_temporary_api)")
    return [args[0], "-m", "dlrmflow.exit_with_parent", str(os.getpid()), *args[2:]]


class _SubprocessExitingWithParent:
    """Stands in for the ``subprocess`` module while Prefect launches its server: ``Popen`` runs the
    command under :mod:`dlrmflow.exit_with_parent`; every other name is the real module's."""

    def __init__(self, real: types.ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def Popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:  # noqa: N802 - subprocess's name
        return self._real.Popen(server_command(args), **kwargs)
