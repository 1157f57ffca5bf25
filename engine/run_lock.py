"""A lock on an output path while a run writes it: a lock file next to the path that names its holder.

``preprocess`` (a dataset directory) and ``train`` (a run directory) take it before they look at or
write their output, so two runs never write one output at once: the second is refused with one line
that names the first (its pid, host and start time) and the lock file.

The lock file is ``PARENT/.NAME.lock`` (next to the output, not in it: a dataset directory is
swapped into place whole). It is created atomically (``O_CREAT | O_EXCL``) and removed when the
holder leaves the ``with`` block, whatever the exit. A holder that died without removing it (SIGKILL)
leaves a stale lock: one whose pid no longer runs on this host is taken over. A lock held from
another host cannot be checked and is never taken over; the message says which file to delete once
that run is known to be gone. Two processes that find the same stale lock at the same instant may
both take it over; that window is the time between an ``unlink`` and the next ``open``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dlrmflow.engine.errors import UserInputError


class OutputLockedError(UserInputError):
    """Another run holds the lock on the output (it is being written now)."""


def lock_path(output: str | os.PathLike) -> Path:
    """The lock file of ``output``: ``.NAME.lock`` in the same directory."""
    output = Path(output)
    return output.parent / f".{output.name}.lock"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # runs, as another user
        return True
    return True


def _read_holder(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names; None if the file is gone; {} if it cannot be read (being written)."""
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _is_stale(holder: dict[str, Any]) -> bool:
    """The holder's process is known to be gone: same host, pid not running."""
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_running(pid)


def _try_create(path: Path, what: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
    return True


def acquire(output: str | os.PathLike, what: str) -> Path:
    """Take the lock on ``output`` (its parent directory must exist); the lock file. ``what`` names the
    run in a refusal (e.g. ``preprocess``). Raises OutputLockedError when a live run holds it."""
    path = lock_path(output)
    for _ in range(3):
        if _try_create(path, what):
            return path
        holder = _read_holder(path)
        if holder is None:  # released in between: try again
            continue
        if holder and _is_stale(holder):
            path.unlink(missing_ok=True)
            continue
        break
    who = (f"{holder.get('what', 'a run')} (pid {holder.get('pid')} on {holder.get('host')}, since "
           f"{holder.get('started')})") if holder else "another run"
    raise OutputLockedError(f"{output} is being written by {who}; wait for it to finish, or delete {path} "
                            "if that run is gone")


def release(path: Path) -> None:
    """Remove the lock file if this process still holds it."""
    holder = _read_holder(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


@contextmanager
def output_lock(output: str | os.PathLike, what: str) -> Iterator[Path]:
    """Hold the lock on ``output`` for the ``with`` block (see the module docstring)."""
    path = acquire(output, what)
    try:
        yield path
    finally:
        release(path)
