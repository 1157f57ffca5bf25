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


def running_children(parent: psutil.Process | None = None) -> list[tuple[psutil.Process, list[str]]]:
    """The children of ``parent`` (this process by default) that still run, each with its command line.

    A child may end between the listing of the children and the reading of its command line (one that
    only runs a moment, such as a Prefect server start that Prefect retries on another port, or anything
    run with ``subprocess.run``); more often so on busy cores. Such a child is left out, not an error."""
    found = []
    for child in (parent if parent is not None else psutil.Process()).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append((child, child.cmdline()))
        except psutil.NoSuchProcess:  # ended meanwhile (psutil.ZombieProcess is one too)
            pass
    return found
