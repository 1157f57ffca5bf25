"""``python -m dlrmflow.exit_with_parent PID MODULE [ARGS...]``: run ``python -m MODULE ARGS...`` in this
process, and end it once process ``PID``, its parent, is gone, however the parent ended (SIGKILL included).

A daemon thread compares :func:`os.getppid` with ``PID`` every :data:`POLL_S` seconds: a process whose
parent ends is handed to another (init or a subreaper), so its parent id changes. It then sends this
process SIGTERM (a server shuts down cleanly) and, should that not end it within :data:`GRACE_S`
seconds, exits at once. Unlike ``PR_SET_PDEATHSIG`` this watches the parent process, not the parent's
thread that started the child, and works on every POSIX system.

This module imports only the standard library: it runs before ``MODULE`` is loaded.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

POLL_S = 0.5
GRACE_S = 5.0


def watch_parent(parent_pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> None:
    """Block until this process's parent is no longer ``parent_pid``, then end this process."""
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)  # SIGTERM was ignored or shutdown hangs: the process must not outlive its parent


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit("usage: python -m dlrmflow.exit_with_parent PID MODULE [ARGS...]")
    parent_pid, module, args = int(argv[0]), argv[1], argv[2:]
    threading.Thread(target=watch_parent, args=(parent_pid,), name="exit-with-parent", daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
