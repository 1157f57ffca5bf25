"""Failure injection: the kill is a SIGKILL of the worker's process, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dlrmflow.engine.training.faults import FaultInjector, parse_kill


class Workers:
    """Stands in for the Dask client: ``run(os.getpid, workers=[a])`` answers with the pid of the
    process that plays worker ``a``, and counts the calls."""

    def __init__(self, processes: dict[str, subprocess.Popen]) -> None:
        self.processes, self.calls = processes, 0

    def run(self, function, workers):
        assert function is os.getpid
        self.calls += 1
        return {a: self.processes[a].pid for a in workers}


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_iteration_of_a_kill_sends_nothing_to_the_cluster():
    """The pid is looked up an iteration ahead: at the kill's own iteration only the signal goes out."""
    victim, other = _sleeper(), _sleeper()
    try:
        workers = Workers({"tcp://a": victim, "tcp://b": other})
        injector = FaultInjector([parse_kill("shard:1@5")], workers, ["tcp://b", "tcp://a"].__getitem__, k=2)
        for t in range(5):
            injector.before_iteration(t)
        assert workers.calls == 1 and victim.poll() is None
        injector.before_iteration(5)
        assert workers.calls == 1
        assert victim.wait(10) == -signal.SIGKILL and other.poll() is None
        assert [entry["pid"] for entry in injector.log] == [victim.pid]
        injector.before_iteration(5)  # a checkpoint's replay of the iteration kills nothing again
        assert len(injector.log) == 1
    finally:
        for process in (victim, other):
            process.kill()
            process.wait()


def test_a_worker_restarted_since_the_look_up_is_killed_by_its_new_pid():
    first, restarted = _sleeper(), _sleeper()
    try:
        workers = Workers({"tcp://a": first})
        injector = FaultInjector([parse_kill("parity:0@3")], workers, lambda s: "tcp://a", k=2)
        injector.before_iteration(2)
        first.kill()
        first.wait()
        workers.processes["tcp://a"] = restarted  # same address, new process (a fixed worker port)
        injector.before_iteration(3)
        assert restarted.wait(10) == -signal.SIGKILL
        assert [entry["pid"] for entry in injector.log] == [restarted.pid]
    finally:
        restarted.kill()
        restarted.wait()
