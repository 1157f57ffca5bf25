"""Stopping the servers and workers a test started as separate processes, and everything they started."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil


def stop_process_groups(procs: list[subprocess.Popen], first_signal: int = signal.SIGTERM,
                        grace_s: float = 20) -> None:
    """Signal each process group, wait, then SIGKILL every survivor, descendants in other groups included.

    A Prefect worker starts each flow run in a process group of its own (with the run's Dask
    LocalCluster under it), so the descendants are collected before anything is signalled."""
    victims: list[psutil.Process] = []
    for proc in procs:
        try:
            victims += [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        try:
            os.killpg(proc.pid, first_signal)
        except ProcessLookupError:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    for proc in procs:
        proc.wait(timeout=10)
