"""Prefect's console lines of a flow run, held until the run's input check has passed.

A flow that checks its input as its first task (the train flow) says so on a plain logger once the check
passed (``INPUT_CHECKED`` of :mod:`dlrmflow.flows.train`). Until then :class:`HeldConsole` keeps the
run's console lines back: a run refused for its input prints nothing but the CLI's one error line, as
when the CLI checked the input itself; any other run shows every line, in order, from the moment its
check passed (or at its end, when it stopped before that for another reason).
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from dlrmflow.engine.errors import UserInputError


class HeldConsole:
    """``with HeldConsole(checked):`` holds what Prefect's console handlers get until a record on the logger
    ``checked``; :attr:`checked` then says that the input check passed."""

    def __init__(self, checked: logging.Logger) -> None:
        self.checked = False
        self.signal = checked
        self.lock = threading.Lock()
        self.held: list[tuple[logging.Handler, logging.LogRecord]] = []
        self.filters: list[tuple[logging.Handler, logging.Filter]] = []
        self.listener = _Listener(self.release)
        self.saved = (checked.level, checked.propagate)

    def hold(self, handler: logging.Handler, record: logging.LogRecord) -> bool:
        """Whether ``handler`` shows ``record`` now; a record it does not show yet is held."""
        with self.lock:
            if not self.checked:
                self.held.append((handler, record))
            return self.checked

    def release(self, show: bool = True) -> None:
        """The check passed (or the run ended): show the held records (``show``), hold nothing more."""
        with self.lock:
            held, self.held = self.held, []
            self.checked = True
        for handler, record in held if show else ():
            handler.handle(record)

    def __enter__(self) -> HeldConsole:
        from prefect.logging.handlers import PrefectConsoleHandler

        for handler in logging.getLogger().handlers:
            if isinstance(handler, PrefectConsoleHandler):
                held = _Hold(self, handler)
                handler.addFilter(held)
                self.filters.append((handler, held))
        self.signal.setLevel(logging.INFO)  # heard whatever Prefect's console level is
        self.signal.propagate = False  # a signal, not a console line
        self.signal.addHandler(self.listener)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.signal.removeHandler(self.listener)
        self.signal.setLevel(self.saved[0])
        self.signal.propagate = self.saved[1]
        refused = isinstance(exc, UserInputError) and not self.checked
        for handler, held in self.filters:
            handler.removeFilter(held)
        self.release(show=not refused)  # a run refused for its input: the CLI's one error line says it all


class _Hold(logging.Filter):
    """On one console handler: its records wait in the :class:`HeldConsole` until the check passed."""

    def __init__(self, console: HeldConsole, handler: logging.Handler) -> None:
        super().__init__()
        self.console, self.handler = console, handler

    def filter(self, record: logging.LogRecord) -> bool:
        return self.console.hold(self.handler, record)


class _Listener(logging.Handler):
    """On the signal logger: its first record releases the console."""

    def __init__(self, release) -> None:
        super().__init__(logging.INFO)
        self.release = release

    def emit(self, record: logging.LogRecord) -> None:
        self.release()
