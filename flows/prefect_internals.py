"""Every use of Prefect behaviour that Prefect does not document as API, in one place.

Each function names what it relies on. ``tests/test_prefect_internals.py`` exercises each one against
the installed Prefect, so an upgrade that changes them fails there, loudly, instead of as a recovery
flow run that silently loses its parent or its logs. (The engine's Dask counterpart is
:mod:`dlrmflow.engine.serving.dask_internals`; the engine never imports Prefect, hence two modules.)
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from dlrmflow.engine.errors import UserInputError

# Prefect loads in each function that uses it, not here: a command launches its temporary API (TemporaryApi) before
# Prefect's 1.2 s of imports in its own process.

T = TypeVar("T")

RunInContext = Callable[..., Any]


def flow_runs_end_without_waiting_for_heartbeats() -> None:
    """Every flow run, and each subflow run, ends as soon as its flow function does.

    Prefect 3's synchronous flow engine (``FlowRunEngine.run_context``) joins its heartbeat thread at each
    run's end, and that thread sleeps in steps of 1 s: measured here, a flow with nothing in it took 1.17 s,
    0.23 s without the join; a flow with one subflow 2.2 s, 0.68 s. The asynchronous engine does not join
    (``join_on_exit=False``): the thread, a daemon, sees the run's end within a second and stops without
    sending another heartbeat. Applied by :func:`flow`, with which every dlrmflow flow is made, so it holds in
    every process that runs one (the CLI, the tests, a deployment's flow run); idempotent.

    Relies on: ``prefect.flow_engine._send_heartbeats(engine, join_on_exit=...)``, a context manager looked
    up as that module's global each time a run starts."""
    from prefect import flow_engine

    original = flow_engine._send_heartbeats
    if hasattr(original, "unjoined"):
        return

    @contextmanager
    def unjoined(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
        with original(engine, join_on_exit=False):
            yield

    unjoined.unjoined = original  # type: ignore[attr-defined]  # what it wraps
    flow_engine._send_heartbeats = unjoined


def flow(*args: Any, **kwargs: Any) -> Any:
    """``prefect.flow`` (same arguments, bare or called), its runs ending as soon as their function does
    (:func:`flow_runs_end_without_waiting_for_heartbeats`). Every flow of ``dlrmflow.flows`` is made with it."""
    import prefect

    flow_runs_end_without_waiting_for_heartbeats()
    return prefect.flow(*args, **kwargs)


def untraced(*values: Any) -> tuple[Any, ...]:
    """``values`` quoted (``prefect.utilities.annotations.quote``), for a task called by a flow that ran
    subflows. Prefect links a subflow's result, and the values one level inside it, to that subflow run by
    their ``id()`` in the flow run's context (``link_state_to_result``) and never forgets them: a later
    task's argument that is one of those values, or a new object that reuses a freed one's address,
    becomes a ``flow_run`` input of that task, which the UI's task run pages reject. Quoted arguments are
    not traced (nor hashed into a cache key)."""
    from prefect.utilities.annotations import quote

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
    from prefect.context import TaskRunContext

    token = TaskRunContext.__var__.set(None)
    try:
        yield
    finally:
        TaskRunContext.__var__.reset(token)


class TemporaryApiError(UserInputError):
    """Prefect's temporary local API did not start: one line that says how, and names the way out."""


# What to do without a temporary API: run a server and point every command at it.
SERVER_WAY_OUT = ("start one with `prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api "
                  "(`prefect config set PREFECT_API_URL=...`)")


# Prefect's temporary server, as ``prefect.server.api.server.SubprocessASGIServer._run_uvicorn_command``
# launches it: uvicorn serving Prefect's app factory, without the UI, in ephemeral mode (port and host added).
SERVER_MODULE_ARGS = ["uvicorn", "--factory", "prefect.server.api.server:create_app", "--log-level", "error",
                      "--lifespan", "on"]
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
# dlrmflow's one addition: no block types registered at each start (a quarter of the server's start-up CPU).
# A command's flows use no blocks (no result storage), and a `prefect server start` on the same database
# registers them.
SERVER_ENV_ADDED = {"PREFECT_API_BLOCKS_REGISTER_ON_START": "false"}
PORT_IN_USE_STATUS = 3  # uvicorn's exit status when it cannot bind (Prefect's start retries another port)


class TemporaryApi:
    """The temporary local Prefect API of one ``dlrmflow`` command without ``PREFECT_API_URL``: Prefect's own
    server command, started by dlrmflow at the command's launch (:meth:`start`), not at the first flow call.

    Prefect starts the same server itself when a client first needs an API (``SubprocessASGIServer``), but
    only after importing its whole server package in the command's process (2.6 CPU seconds); the server
    process imports it anyway. Here the command's process starts the server, goes on with its own imports on
    the other core, and waits for it (:meth:`wait_until_answering`) just before its flow makes the first
    call. The server runs under :mod:`dlrmflow.exit_with_parent`, which ends it when the command is gone,
    however it ended (Prefect stops its own only from an ``atexit`` hook, which a killed process never runs).

    Owns the server process; :meth:`stop` sends it SIGTERM and does not wait (exit_with_parent's grace
    covers a server still shutting down when the command exits). Relies on: Prefect's server command
    (:data:`SERVER_MODULE_ARGS`, :data:`SERVER_ENV`; ``tests/test_prefect_internals.py`` compares them with
    what ``SubprocessASGIServer`` launches) and :func:`use_api_everywhere`.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._settings: contextlib.AbstractContextManager[None] | None = None  # entered while it answers

    @property
    def answering(self) -> bool:
        """Whether it answered and this process's Prefect points at it."""
        return self._settings is not None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, *, pass_settings: bool = True) -> None:
        """Launch the server on a free port; returns at once. Its environment is the command's, with this
        process's Prefect settings (a profile's database, for one) as Prefect passes them to its own.

        ``pass_settings=False``: launched without loading Prefect here (a command's first step, 1.2 s before
        Prefect's imports would end); the server then reads its settings from the same sources as this process
        (the environment, the profile, ``prefect.toml`` in the same directory), so only settings changed
        within this process (``temporary_settings``) would not reach it: for a process that has not loaded
        Prefect yet."""
        self.port = _free_port()
        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent  # prefect.__module_path__
        settings: dict[str, str] = {}
        if pass_settings:
            from prefect.settings import get_current_settings

            settings = get_current_settings().to_environment_variables(exclude_unset=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dlrmflow.exit_with_parent", str(os.getpid()), *SERVER_MODULE_ARGS,
             "--app-dir", str(prefect_dir.parent), "--host", "127.0.0.1", "--port", str(self.port)],
            env={**os.environ, **SERVER_ENV, **settings, **SERVER_ENV_ADDED},
            stdout=subprocess.DEVNULL)  # stdout is the command's (--json: one object); errors go to stderr

    def wait_until_answering(self) -> None:
        """Block until the server answers ``/health``, then point this process's Prefect at it. A server that
        exits or does not answer within the timeout is stopped and :class:`TemporaryApiError` raised."""
        if self.answering:
            return
        import httpx

        deadline = time.monotonic() + self.timeout_s
        with httpx.Client() as client:
            while True:
                status = self.process.poll() if self.process is not None else None
                if status is not None and status != PORT_IN_USE_STATUS:
                    raise TemporaryApiError(f"the temporary local Prefect API did not start (its server exited "
                                            f"with status {status}); {SERVER_WAY_OUT}")
                if time.monotonic() >= deadline:
                    self._end_server()
                    raise TemporaryApiError(
                        f"the temporary local Prefect API did not start (it did not answer within "
                        f"{self.timeout_s:g} s); {SERVER_WAY_OUT}, "
                        "or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
                if status == PORT_IN_USE_STATUS:  # another process took the port meanwhile: as Prefect does
                    self.start()
                    continue
                try:
                    if client.get(f"{self.url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        settings = use_api_everywhere(self.url)
        settings.__enter__()
        self._settings = settings

    def stop(self) -> None:
        """Send what Prefect still holds for the server (logs, events: at most 5 s each), SIGTERM the server (no
        wait) and give this process's Prefect its settings back. Call it in the thread that called
        :meth:`wait_until_answering`."""
        if self._settings is not None:
            drain_prefect_workers(timeout_s=5)
            self._settings.__exit__(None, None, None)
            self._settings = None
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def _end_server(self) -> None:
        """A server that did not answer: SIGTERM it and wait until it is gone (SIGKILL after 5 s)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def drain_prefect_workers(timeout_s: float) -> None:
    """Block until Prefect's background workers have sent the logs and events they hold (each at most
    ``timeout_s``): a server stopped before then makes them print "Error logging to API" at exit.

    Relies on: ``APILogWorker`` and ``EventsWorker``, the queue services behind Prefect's API log handler and
    its events client, and their ``drain_all`` (what Prefect's own ``atexit`` hooks call)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)


@contextmanager
def use_api_everywhere(url: str) -> Iterator[None]:
    """Within the block, every thread's Prefect uses the API at ``url``: this thread's settings context (and
    the copies taken of it) through ``temporary_settings``, and every thread without a context of its own
    (Prefect's log and event workers, a plain ``threading.Thread``) through the process-global one.

    Relies on: ``prefect.context.GLOBAL_SETTINGS_CONTEXT``, the module attribute that
    ``SettingsContext.get()`` falls back to when the current ``contextvars`` context holds none (Prefect's
    test harness replaces it the same way); it is put back afterwards, whatever it was.
    """
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}) as settings:
        before = prefect.context.GLOBAL_SETTINGS_CONTEXT
        prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.SettingsContext(
            profile=before.profile, settings=settings)
        try:
            yield
        finally:
            prefect.context.GLOBAL_SETTINGS_CONTEXT = before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
