"""Failure injection: the kill is a SIGKILL of the worker's process, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dlrmflow.engine.training.faults import FaultInjector, FaultSpecError, check_kills, parse_kill


class Workers:
    """Stands in for the Dask client: ``run(os.getpid, workers=[a])`` answers with the pid of the
    process that plays worker ``a``, and counts the calls."""

    def __init__(self, processes: dict[str, subprocess.Popen]) -> None:
        self.processes, self.calls, self.asked = processes, 0, []

    def run(self, function, workers):
        assert function is os.getpid
        self.calls += 1
        self.asked += workers
        for a in workers:
            if a not in self.processes or self.processes[a].poll() is not None:
                raise OSError(f"Timed out trying to connect to {a}")  # what a dead worker's address gives
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


def test_the_same_shard_may_be_killed_at_several_iterations_but_no_kill_twice():
    kills = check_kills(["shard:0@3", "shard:0@9", "parity:0@3", "parity:0@5"], num_shards=2, parity=1,
                        iterations=12)
    assert [str(k) for k in kills] == ["shard:0@3", "shard:0@9", "parity:0@3", "parity:0@5"]
    with pytest.raises(FaultSpecError) as error:
        check_kills(["shard:0@3", "shard:1@4", " shard:0@3"], num_shards=2, parity=1, iterations=12)
    message = str(error.value)
    assert "\n" not in message and "--kill shard:0@3 and --kill shard:0@3 name the same kill twice" in message
    with pytest.raises(FaultSpecError, match="parity:0@2 and --kill parity:0@2"):
        check_kills(["parity:0@2", "shard:0@2", "parity:0@2"], num_shards=2, parity=1, iterations=None)


def test_a_shard_killed_again_after_its_rebuild_takes_its_replacement_s_worker():
    """``shard:0@3`` kills the worker of data shard 0; the rebuild moves it to worker b; ``shard:0@6``
    kills b's process (its pid looked up an iteration ahead), and the dead worker is never asked again."""
    first, replacement, other = _sleeper(), _sleeper(), _sleeper()
    try:
        workers = Workers({"tcp://a": first, "tcp://b": replacement, "tcp://c": other})
        table = ["tcp://a", "tcp://c"]
        injector = FaultInjector(check_kills(["shard:0@3", "shard:0@6"], num_shards=2, parity=0, iterations=8),
                                 workers, table.__getitem__, k=2)
        for t in range(4):
            injector.before_iteration(t)
        assert first.wait(10) == -signal.SIGKILL and replacement.poll() is None
        injector.before_iteration(4)  # the rebuild has not finished: the table still names a
        table[0] = "tcp://b"  # it has: the replacement on b takes shard 0's place
        injector.before_iteration(5)
        assert workers.asked == ["tcp://a", "tcp://b"]  # each looked up an iteration ahead, a once
        injector.before_iteration(6)
        assert workers.asked == ["tcp://a", "tcp://b"]  # the kill's iteration sends nothing
        assert replacement.wait(10) == -signal.SIGKILL and other.poll() is None
        assert [(e["kill"], e["worker"], e["pid"]) for e in injector.log] == [
            ("shard:0@3", "tcp://a", first.pid), ("shard:0@6", "tcp://b", replacement.pid)]
        assert injector.missed == [] and injector.pids == {}
    finally:
        for process in (first, replacement, other):
            process.kill()
            process.wait()


def test_a_kill_of_a_shard_still_being_rebuilt_finds_no_worker_and_the_run_goes_on(caplog):
    """The second kill comes before the rebuild of the first finished: the member's table still names
    the worker killed, which is neither asked (a dead address waits out Dask's connect timeout) nor
    signalled again; the kill is logged and recorded as missed. A kill whose look-up fails likewise."""
    first, other = _sleeper(), _sleeper()
    try:
        workers = Workers({"tcp://a": first, "tcp://c": other})
        table = ["tcp://a", "tcp://c", "tcp://gone"]
        kills = check_kills(["shard:0@1", "shard:0@2", "parity:0@2"], num_shards=2, parity=1, iterations=4)
        injector = FaultInjector(kills, workers, table.__getitem__, k=2)
        with caplog.at_level("WARNING", logger="dlrmflow.engine.training.faults"):
            for t in range(4):
                injector.before_iteration(t)
        assert first.wait(10) == -signal.SIGKILL and other.poll() is None
        assert workers.asked == ["tcp://a", "tcp://gone"]  # parity 0's look-up ahead failed: not asked again
        assert [e["kill"] for e in injector.log] == ["shard:0@1"]
        assert [(e["kill"], e["worker"]) for e in injector.missed] == [("shard:0@2", "tcp://a"),
                                                                      ("parity:0@2", "tcp://gone")]
        assert "no live worker" in injector.missed[0]["why"] and "OSError" in injector.missed[1]["why"]
        assert [r.getMessage().split(": ")[0] for r in caplog.records] == [
            "kill shard:0@2 found nothing to kill at the start of iteration 2",
            "kill parity:0@2 found nothing to kill at the start of iteration 2"]
    finally:
        for process in (first, other):
            process.kill()
            process.wait()


# ---- a real run: the same shard killed twice ---------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    from test_recovery import Cluster  # a LocalCluster of 4 worker processes (torch etc.: imported here)

    holder = Cluster()
    yield holder.get()
    holder.close()


def test_a_shard_killed_again_after_its_rebuild_is_rebuilt_again_and_the_run_ends_bit_identical(
        cluster, tmp_path, monkeypatch):
    """``--kill shard:0@3 --kill shard:0@9`` with K = 2, R = 1 (remote: every iteration fetches and writes
    back, so both rebuilds copy written stripes): the first kill takes data shard 0's worker, the standby
    on the spare worker takes its place; the second takes that replacement's worker, and shard 0 is
    rebuilt again on a worker started since. Two recovery records, and the final state is bit for bit
    (SHA-256 included) the failure-free run's. Before the second kill's look-up ahead (iteration 8) the
    loop waits for the first rebuild to finish: a kill that finds its shard still being rebuilt kills
    nothing (tested above)."""
    from test_recovery import _check_recovered, _run
    from test_trainers import make_dataset

    from dlrmflow.engine.training import faults as faults_module
    from dlrmflow.engine.training import trainer as rank_module

    groups, injectors = [], []
    start, before_iteration = rank_module.start_coded_shards, faults_module.FaultInjector.before_iteration

    def capture(*args, **kw):
        groups.append(start(*args, **kw))
        return groups[-1]

    def after_the_first_rebuild(self, t):
        injectors.append(self)
        if t == 8:
            state, deadline = groups[-1].state, time.monotonic() + 120
            while True:
                with groups[-1].lock:
                    if state.recoveries and state.recoveries[-1].rebuilt_at is not None and not state.lost:
                        break
                assert time.monotonic() < deadline, "the first kill's rebuild did not finish"
                time.sleep(0.02)
        return before_iteration(self, t)

    monkeypatch.setattr(rank_module, "start_coded_shards", capture)
    monkeypatch.setattr(faults_module.FaultInjector, "before_iteration", after_the_first_rebuild)
    dataset = make_dataset(tmp_path / "data", 41)
    local = _run(tmp_path, dataset, "local", "local")
    summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1,
                   kills=("shard:0@3", "shard:0@9"), rebuild_chunk=8)
    _check_recovered(tmp_path, summary, {"shard:0"})
    assert summary["state_sha256"] == local["state_sha256"]
    report = summary["parity"]
    first_kill, second_kill = report["kills"]
    first, second = report["recoveries"]
    assert (first_kill["kill"], second_kill["kill"]) == ("shard:0@3", "shard:0@9")
    assert first["lost"] == second["lost"] == ["data shard 0"] and first["restarts"] == second["restarts"] == 0
    assert first["stripes"] > 0 and second["stripes"] > 0  # written stripes were copied, both times
    # The second kill took the first replacement's worker (the standby's), and the second replacement is
    # on neither dead worker; it is shard 0's worker at the end.
    assert second_kill["worker"] == first["new_workers"]["data shard 0"] == report["standby_worker"]
    assert first_kill["worker"] != second_kill["worker"] != first_kill["worker"]
    assert second["new_workers"]["data shard 0"] not in {first_kill["worker"], second_kill["worker"]}
    assert report["member_workers"]["data shard 0"] == second["new_workers"]["data shard 0"]
    assert first_kill["at_s"] <= first["detected_s"] <= first["rebuilt_s"] <= second_kill["at_s"] <= \
        second["detected_s"] <= second["rebuilt_s"]
    assert injectors and injectors[-1].missed == []


def test_a_kill_that_comes_while_its_shard_is_still_rebuilt_kills_nothing_and_the_run_ends_bit_identical(
        cluster, tmp_path, monkeypatch):
    """``--kill shard:0@3 --kill shard:0@4`` with a slow rebuild (every stripe copied, two stripes a chunk,
    a pause after each): at iteration 4 data shard 0 is still being rebuilt. Its table still names the
    worker killed at 3, which the second kill neither asks for a pid (a dead address waits out Dask's
    connect timeout) nor signals: it is recorded as missed, and the run goes on to end bit-identical with
    one recovery."""
    from test_recovery import _check_recovered, _run
    from test_trainers import make_dataset

    from dlrmflow.engine.coding import rebuild as rebuild_module
    from dlrmflow.engine.training import faults as faults_module
    from dlrmflow.engine.training import trainer as rank_module

    monkeypatch.setattr(rebuild_module, "REBUILD_EVERY_STRIPE", True)
    monkeypatch.setattr(rebuild_module, "YIELD_S", 0.05)
    monkeypatch.setattr(rebuild_module, "FIX_UP_INTERVAL_S", 0.0)  # a fix-up (and a pause) after each chunk
    groups, injectors = [], []
    start, before_iteration = rank_module.start_coded_shards, faults_module.FaultInjector.before_iteration

    def capture(*args, **kw):
        groups.append(start(*args, **kw))
        return groups[-1]

    def noticed_first(self, t):
        injectors.append(self)
        if t == 4:  # the loss is noticed (the trainer's calls of iteration 3 met it), not yet rebuilt
            state, deadline = groups[-1].state, time.monotonic() + 60
            while not state.recoveries:
                assert time.monotonic() < deadline, "the kill at iteration 3 went unnoticed"
                time.sleep(0.01)
            assert state.recoveries[0].rebuilt_at is None, "the rebuild finished before the second kill"
        return before_iteration(self, t)

    monkeypatch.setattr(rank_module, "start_coded_shards", capture)
    monkeypatch.setattr(faults_module.FaultInjector, "before_iteration", noticed_first)
    dataset = make_dataset(tmp_path / "data", 42)
    local = _run(tmp_path, dataset, "local", "local")
    began = time.monotonic()
    summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1,
                   kills=("shard:0@3", "shard:0@4"), rebuild_chunk=2)
    assert time.monotonic() - began < 60  # no wait for the dead worker's address
    _check_recovered(tmp_path, summary, {"shard:0"})
    assert summary["state_sha256"] == local["state_sha256"]
    (kill,) = summary["parity"]["kills"]
    (record,) = summary["parity"]["recoveries"]
    assert kill["kill"] == "shard:0@3" and record["lost"] == ["data shard 0"] and record["chunks"] > 20
    (missed,) = injectors[-1].missed
    assert missed["kill"] == "shard:0@4" and missed["worker"] == kill["worker"] and "no live worker" in missed["why"]
