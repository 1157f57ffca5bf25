"""Real failures: SIGKILL of the Dask worker hosting a shard, recovery from parity while training runs.

Every recovered run must end bit-identical to the failure-free local run, and its parity must
verify. Engine tests first (no Prefect), then the CLI / flow (recover-shard subflow runs).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from distributed import Client
from test_trainers import assert_bit_identical, force_split_exchanges, keep_all_plan, make_dataset, small_config

from dlrmflow.engine.coding import group as group_module
from dlrmflow.engine.coding import rebuild as rebuild_module
from dlrmflow.engine.coding import start as start_module
from dlrmflow.engine.coding.erasure import TooManyErasuresError
from dlrmflow.engine.coding.members import CodedShard, shard_row_counts
from dlrmflow.engine.coding.verify import verify_run_dir
from dlrmflow.engine.run_state import STATE_DIR, SUMMARY_FILE, load_state
from dlrmflow.engine.serving import shards as shards_module
from dlrmflow.engine.serving.cluster import cluster_workers
from dlrmflow.engine.serving.dask_internals import RestartSafeLocalCluster
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.placement import place
from dlrmflow.engine.serving.shards import EmbeddingShard, remote, wait_all
from dlrmflow.engine.training import faults as faults_module
from dlrmflow.engine.training import loop as loop_module
from dlrmflow.engine.training import trainer as rank_module
from dlrmflow.engine.training.job import prepare_run, train

ITERATIONS = 14
WORKERS = 4  # K = 2 data shards + up to R = 2 parity shards, one worker each


class Cluster:
    """A LocalCluster of WORKERS processes, started afresh if a killed worker did not come back."""

    def __init__(self) -> None:
        self.cluster = self.client = None

    def get(self) -> Client:
        if self.client is not None:
            try:
                self.client.wait_for_workers(WORKERS, timeout=10)  # the nanny restarts what a test killed
                self.client.run(os.getpid)  # and every listed worker answers (a killed one may still be listed)
                return self.client
            except (TimeoutError, OSError):  # WorkerStartTimeoutError is a TimeoutError; a dead worker's comm, OSError
                self.close()
        self.cluster = RestartSafeLocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                                               dashboard_address=":0", silence_logs=logging.CRITICAL)
        self.client = Client(self.cluster)
        return self.client

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.cluster.close()
        self.cluster = self.client = None


@pytest.fixture(scope="module")
def clusters():
    holder = Cluster()
    yield holder
    holder.close()


@pytest.fixture
def cluster(clusters):
    return clusters.get()


def _run(tmp_path, dataset, name, mode, client=None, **kw):
    plan = keep_all_plan(dataset, 16, ITERATIONS, 2) if mode == "oracle" else None
    if mode == "lru":
        kw["capacity"] = 200
    config = small_config(dataset, tmp_path / name, mode, iterations=ITERATIONS, batch_size=16,
                          embedding_lr=0.05, **kw)
    with torch.random.fork_rng():
        return train(config, client=client, setup=prepare_run(config, plan=plan))


def _check_recovered(tmp_path, summary, killed: set[str]) -> None:
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "run"), str(killed))
    report = summary["parity"]
    assert report["verify"]["ok"] and verify_run_dir(tmp_path / "run")["ok"]
    assert {k["kill"].split("@")[0] for k in report["kills"]} == killed
    lost = {name for rec in report["recoveries"] for name in rec["lost"]}
    names = {f"{'data shard' if k.startswith('shard') else 'parity shard'} {k.split(':')[1]}" for k in killed}
    assert lost == names
    assert all(rec["rebuilt_s"] is not None and rec["seconds"] >= 0 for rec in report["recoveries"])
    # Each record says what showed the loss: a failed call naming the members it lost.
    assert all(rec["causes"] and all("lost" in c for c in rec["causes"]) for rec in report["recoveries"])
    # Kill and detection times share the report's clock: a loss is noticed after the first kill.
    assert report["recoveries"][0]["detected_s"] >= min(k["at_s"] for k in report["kills"]) > 0


@pytest.mark.parametrize("seed", range(3))
def test_kill_one_data_shard_with_one_parity_shard(cluster, tmp_path, seed, monkeypatch):
    """Also with a fix-up after every chunk, and with one fix-up for all of them at the end; remote with
    each data shard's fetch apart from its batch (a kill can then land between the two calls)."""
    interval = [0.0, rebuild_module.FIX_UP_INTERVAL_S, 600.0][seed]
    monkeypatch.setattr(rebuild_module, "FIX_UP_INTERVAL_S", interval)
    rng = np.random.default_rng(400 + seed)
    dataset = make_dataset(tmp_path / "data", seed)
    _run(tmp_path, dataset, "local", "local", seed=seed)
    mode = ["remote", "lru", "oracle"][seed]
    if mode == "remote":  # the only mode whose write-backs travel with fetches here
        force_split_exchanges(monkeypatch)
    shard, at = int(rng.integers(0, 2)), int(rng.integers(0, ITERATIONS))
    summary = _run(tmp_path, dataset, "run", mode, cluster, seed=seed, num_shards=2, parity=1,
                   kills=(f"shard:{shard}@{at}",), rebuild_chunk=int(rng.integers(1, 40)),
                   parity_batches=int(rng.integers(1, 2 * ITERATIONS)))
    _check_recovered(tmp_path, summary, {f"shard:{shard}"})
    (record,) = summary["parity"]["recoveries"]
    # Only the stripes with a row the trainer wrote were copied; the rest the replacement generates.
    rows = shard_row_counts(prepare_run(small_config(dataset, tmp_path, "local")).spec, 2)
    assert record["stripes"] + record["stripes_generated"] == max(rows) and record["restarts"] == 0
    assert record["rows_rebuilt"] <= rows[shard]
    # The replacement was the standby started with the group on the spare worker (4 workers, 3 members).
    assert record["new_workers"][f"data shard {shard}"] == summary["parity"]["standby_worker"] is not None
    assert summary["parity"]["kills"][0]["worker"] != summary["parity"]["standby_worker"]
    if mode == "remote":  # it writes back every iteration (the caches only at eviction)
        assert (record["stripes"] > 0) == (at > 0)
    if interval == 0:
        assert record["fix_ups"] == record["chunks"]
    elif interval == 600:
        assert record["fix_ups"] == min(1, record["chunks"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_kill_two_shards_with_two_parity_shards(cluster, tmp_path, seed):
    rng = np.random.default_rng(500 + seed)
    dataset = make_dataset(tmp_path / "data", 10 + seed)
    _run(tmp_path, dataset, "local", "local")
    members = ["shard:0", "shard:1", "parity:0", "parity:1"]
    killed = [members[i] for i in rng.choice(4, size=2, replace=False)]
    kills = tuple(f"{m}@{int(rng.integers(0, ITERATIONS))}" for m in killed)
    summary = _run(tmp_path, dataset, "run", ["remote", "lru"][seed], cluster, num_shards=2, parity=2, kills=kills,
                   rebuild_chunk=int(rng.integers(1, 40)), parity_batches=int(rng.integers(1, 2 * ITERATIONS)))
    _check_recovered(tmp_path, summary, set(killed))


def test_a_rate_limited_rebuild_takes_its_time_in_small_chunks_and_ends_exact(cluster, tmp_path, monkeypatch):
    """--rebuild-rate caps a rebuild: the bulk copy of B bytes lasts at least B / rate, in chunks of
    about PACED_CHUNK_S each, while training goes on (degraded reads); the run still ends exact.
    Every stripe is copied (as in a table whose every row was trained), so B is the whole shard."""
    monkeypatch.setattr(rebuild_module, "REBUILD_EVERY_STRIPE", True)
    dataset = make_dataset(tmp_path / "data", 23)
    _run(tmp_path, dataset, "local", "local")
    spec = prepare_run(small_config(dataset, tmp_path, "local")).spec
    lost_bytes = shard_row_counts(spec, 2)[0] * spec.row_bytes
    rate = lost_bytes / 0.5 / 1e6  # MB/s for a copy of at least 0.5 s
    summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1, kills=("shard:0@2",),
                   rebuild_rate=rate)
    _check_recovered(tmp_path, summary, {"shard:0"})
    (record,) = summary["parity"]["recoveries"]
    assert record["copy_seconds"] >= 0.5
    # The pacing is done inside the copy tasks (one after the other, on the replacement's worker), and the
    # copy's wall time holds theirs; within a task, reads and installs are parts of its time.
    assert 0.499 <= record["copy_task_seconds"] <= record["copy_seconds"]
    assert 0 < record["copy_read_wait_seconds"] + record["copy_install_seconds"] <= record["copy_task_seconds"]
    chunk = int(rate * 1e6 * rebuild_module.PACED_CHUNK_S / spec.row_bytes)
    assert record["chunks"] == -(-record["stripes"] // chunk) >= 10
    assert summary["parity"]["degraded_rows_read"] > 0


def test_rows_not_yet_rebuilt_are_served_by_degraded_reads(cluster, tmp_path, monkeypatch):
    """A slow rebuild (tiny chunks, long pauses) so that training reads the lost shard's rows while
    most stripes are not rebuilt yet: those reads are decoded from survivors + parity. Every stripe
    is copied (unwritten ones are otherwise rebuilt at once: the replacement generates them)."""
    monkeypatch.setattr(rebuild_module, "REBUILD_EVERY_STRIPE", True)
    monkeypatch.setattr(rebuild_module, "YIELD_S", 0.05)
    monkeypatch.setattr(rebuild_module, "FIX_UP_INTERVAL_S", 0.0)  # a fix-up (and a pause) after each chunk
    dataset = make_dataset(tmp_path / "data", 20)
    _run(tmp_path, dataset, "local", "local")
    summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1, kills=("shard:0@2",),
                   rebuild_chunk=2)
    _check_recovered(tmp_path, summary, {"shard:0"})
    assert summary["parity"]["degraded_rows_read"] > 0
    assert summary["parity"]["recoveries"][0]["chunks"] > 20


@pytest.mark.parametrize("kill", ["shard:1@1", "parity:0@1"])
def test_stripes_written_during_a_bulk_copy_are_fixed_up(cluster, tmp_path, monkeypatch, kill):
    """The bulk copy of a chunk runs while training writes: a pause between the survivors' reads
    lets batches land between them (so the copy decodes mixed versions of those stripes); the
    stripes those batches logged are re-read under the lock and the run still ends exact. A
    rebuilt parity shard also gets the deltas still pending before the fix-up overwrites those
    stripes (applied after it, they would count twice)."""
    monkeypatch.setattr(rebuild_module, "COPY_PAUSE_S", 0.3)
    copying = threading.Event()
    submit_copies, step = rebuild_module.submit_copies, loop_module.train_step

    def flagged_copy(*args, **kwargs):
        copying.set()
        return submit_copies(*args, **kwargs)

    def step_during_copy(*args, **kwargs):  # once the loss is noticed, train only while the copy runs
        if lost.is_set():
            assert copying.wait(60), "the rebuild never started its bulk copy"
            time.sleep(0.1)
        return step(*args, **kwargs)

    lost, start_thread = threading.Event(), start_module.start_rebuild_thread

    def flagged_start(group):
        lost.set()
        return start_thread(group)

    monkeypatch.setattr(start_module, "start_rebuild_thread", flagged_start)
    monkeypatch.setattr(rebuild_module, "submit_copies", flagged_copy)
    monkeypatch.setattr(loop_module, "train_step", step_during_copy)
    dataset = make_dataset(tmp_path / "data", 30)
    _run(tmp_path, dataset, "local", "local")
    summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1, kills=(kill,),
                   rebuild_chunk=10**6, parity_batches=5)
    _check_recovered(tmp_path, summary, {kill.split("@")[0]})
    (record,) = summary["parity"]["recoveries"]
    assert record["chunks"] == 1 and record["stripes_fixed_up"] > 0


def test_a_replacement_that_dies_mid_rebuild_is_replaced_and_the_run_ends_exact(cluster, tmp_path, monkeypatch):
    """SIGKILL the worker the rebuild copies onto while its copy tasks run: the rebuild notices
    (the tasks are pinned to a worker that is gone), starts over on another worker, ends exact.
    Every stripe is copied: an lru run killed at iteration 3 may have written no row yet, and a rebuild
    with nothing to copy would finish before it noticed (the loss would then be a second recovery)."""
    monkeypatch.setattr(rebuild_module, "REBUILD_EVERY_STRIPE", True)
    monkeypatch.setattr(rebuild_module, "COPY_PAUSE_S", 0.2)  # the copy is still running when the kill lands
    submit_copies, killed = rebuild_module.submit_copies, []

    def submit_then_kill(group, lost, chunks, worker, rebuild_id):
        futures = submit_copies(group, lost, chunks, worker, rebuild_id)
        if not killed:
            pid = cluster.run(os.getpid, workers=[worker])[worker]
            os.kill(pid, signal.SIGKILL)
            killed.append(worker)
        return futures

    monkeypatch.setattr(rebuild_module, "submit_copies", submit_then_kill)
    dataset = make_dataset(tmp_path / "data", 31)
    _run(tmp_path, dataset, "local", "local")
    summary = _run(tmp_path, dataset, "run", "lru", cluster, num_shards=2, parity=1, kills=("shard:0@3",))
    _check_recovered(tmp_path, summary, {"shard:0"})
    (record,) = summary["parity"]["recoveries"]
    assert killed and record["restarts"] >= 1
    assert killed[0] not in record["new_workers"].values()


def test_a_standby_whose_worker_died_with_the_shard_is_passed_over(cluster, tmp_path, monkeypatch):
    """The spare worker that holds the standby replacements is killed with the shard: the rebuild
    does not use (or gives up) the dead standby, starts a replacement elsewhere, and ends exact."""
    spare, start_standbys = [], start_module.start_standbys

    def recording_standbys(*args, **kwargs):
        standbys = start_standbys(*args, **kwargs)
        spare.extend({worker for worker, _, _ in standbys.values()})
        return standbys

    inject = faults_module.FaultInjector.kill

    def kill_spare_too(self, kill):
        os.kill(self.client.run(os.getpid, workers=spare)[spare[0]], signal.SIGKILL)
        return inject(self, kill)

    monkeypatch.setattr(start_module, "start_standbys", recording_standbys)
    monkeypatch.setattr(faults_module.FaultInjector, "kill", kill_spare_too)
    dataset = make_dataset(tmp_path / "data", 33)
    _run(tmp_path, dataset, "local", "local")
    summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1, kills=("shard:1@4",))
    _check_recovered(tmp_path, summary, {"shard:1"})
    (record,) = summary["parity"]["recoveries"]
    assert len(spare) == 1 and record["new_workers"]["data shard 1"] != spare[0]


def test_a_shard_that_dies_mid_write_back_is_recovered_exactly(cluster, tmp_path, monkeypatch):
    """SIGKILL data shard 1's worker after a write-back batch was sent to the data shards but before
    their answers are read, with parity deltas still pending in the trainer: some members applied
    the batch, the dead one maybe; the resend, the pending deltas and the rebuild still give the
    exact rows."""
    dataset = make_dataset(tmp_path / "data", 21)
    _run(tmp_path, dataset, "local", "local")
    groups = []
    start = rank_module.start_coded_shards

    def capture(*args, **kw):
        groups.append(start(*args, **kw))
        return groups[-1]

    original_wait_all = group_module.wait_all
    state = {"calls": 0, "killed": None}

    def kill_then_wait(calls):
        state["calls"] += 1
        group = groups[-1]
        # A batch's calls to the 2 data shards, its parity delta pending (sent with later batches'):
        if state["killed"] is None and group.batching.seq >= 6 and len(calls) == 2 and group.batching.pending:
            address = group.worker_of[1]
            pid = cluster.run(os.getpid, workers=[address])[address]
            os.kill(pid, signal.SIGKILL)
            state["killed"] = pid
        return original_wait_all(calls)

    monkeypatch.setattr(rank_module, "start_coded_shards", capture)
    monkeypatch.setattr(group_module, "wait_all", kill_then_wait)
    summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1)
    assert state["killed"] is not None
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "run"), "mid write-back")
    assert summary["parity"]["verify"]["ok"]
    assert [r["lost"] for r in summary["parity"]["recoveries"]] == [["data shard 1"]]


def test_losing_more_shards_than_parity_is_a_clear_error_and_writes_no_model(cluster, tmp_path):
    dataset = make_dataset(tmp_path / "data", 22)
    with pytest.raises(TooManyErasuresError) as error:
        _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, parity=1,
             kills=("shard:0@2", "parity:0@3"))
    message = str(error.value)
    assert "data shards 0" in message and "parity shards 0" in message and "at most 1" in message
    assert "survivors (data shards 1)" in message
    for name in (STATE_DIR, SUMMARY_FILE):
        assert not (tmp_path / "run" / name).exists()


def test_a_rebuild_starts_at_once_and_its_report_waits_for_it(monkeypatch):
    """With a recovery runner (the recover-shard subflow, which takes a while to start), the rebuild
    does not wait for it: it runs from the start, the runner's callable waits for its record and
    gets every progress count from the latest on; a failed rebuild fails the report and the thread."""
    started, finish = threading.Event(), threading.Event()

    def rebuild_lost(group, progress=None):
        started.set()
        progress(1, 3)
        assert finish.wait(10)
        progress(3, 3)
        if group.fail:
            raise TooManyErasuresError(2, 1, [0, 1], [2])
        return {"lost": ["data shard 0"]}

    monkeypatch.setattr(rebuild_module, "rebuild_lost", rebuild_lost)
    for fail in (False, True):
        started.clear(), finish.clear()
        seen, reported = [], []

        def runner(rebuild, info):
            assert started.wait(10), "the rebuild waited for its report to start"
            assert info == {"lost": ["data shard 0"]}
            finish.set()
            reported.append(rebuild(lambda done, total: seen.append((done, total))))  # noqa: B023

        group = type("Group", (), {"recovery_runner": staticmethod(runner), "fail": fail})()
        if not fail:
            rebuild_module.rebuild_while_reporting(group, {"lost": ["data shard 0"]})
            assert reported == [{"lost": ["data shard 0"]}] and seen[-1] == (3, 3)
        else:
            with pytest.raises(TooManyErasuresError):
                rebuild_module.rebuild_while_reporting(group, {"lost": ["data shard 0"]})
            assert reported == []


def test_a_slow_call_asks_the_scheduler_early_then_sparsely_and_fails_once_its_worker_is_unlisted(monkeypatch):
    """The watch of a member call: the first look-up after WATCH_FIRST_S (a call that had to reconnect
    to a killed worker is noticed by it), later ones every WATCH_S (each is a round trip to the
    scheduler); a listed worker keeps the call waiting, an unlisted one fails it with OSError."""
    from dlrmflow.engine.serving import shards as embedding_server

    waits: list[float] = []
    listings = iter([{"w": {}}, {"w": {}}, {}])

    class Unanswered:  # an actor call that never answers
        def done(self) -> bool:
            return False

        def result(self, timeout: float) -> None:
            waits.append(timeout)
            raise TimeoutError

    asked: list[float | None] = []

    def listing(client, timeout=None):
        asked.append(timeout)
        return next(listings)

    monkeypatch.setattr(embedding_server, "cluster_workers", listing)
    call = embedding_server.ServerCall(Unanswered(), "w", client=object())
    with pytest.raises(OSError, match="no longer lists"):
        call.result()
    assert waits == [embedding_server.WATCH_FIRST_S] + 2 * [embedding_server.WATCH_S]
    assert embedding_server.WATCH_FIRST_S < embedding_server.WATCH_S
    assert asked == 3 * [embedding_server.SCHEDULER_SILENCE_SECONDS]  # a silent scheduler cannot hold it longer


@pytest.mark.parametrize("answers", [[], [False, True], [False, False, True, False]])
def test_a_slow_call_to_a_listed_worker_that_stops_answering_probes_fails_after_three_misses_in_a_row(
        monkeypatch, answers):
    """A machine that failed outright stays listed by the scheduler until Dask's TCP timeout (30 s and more): a
    call still unanswered PROBE_SECONDS after it began probes its worker directly, and fails with OSError (the
    member's loss) once SILENT_PROBES probes in a row went unanswered; an answer starts the count again."""
    from dlrmflow.engine.serving import shards as embedding_server
    from dlrmflow.engine.serving.cluster import SILENT_PROBES

    monkeypatch.setattr(embedding_server, "PROBE_SECONDS", 0.0)
    monkeypatch.setattr(embedding_server, "WATCH_S", 0.001)
    monkeypatch.setattr(embedding_server, "cluster_workers", lambda client, timeout=None: {"w": {}})
    probes = iter(answers)
    asked: list[list[str]] = []

    def probe(client, workers):
        asked.append(workers)
        return set(workers) if next(probes, False) else set()

    class Unanswered:
        def done(self) -> bool:
            return False

        def result(self, timeout: float) -> None:
            raise TimeoutError

    monkeypatch.setattr(embedding_server, "probe_workers", probe)
    with pytest.raises(OSError, match="stopped answering .no answer to 3 probes in a row, each given 3 s"):
        embedding_server.ServerCall(Unanswered(), "w", client=object()).result()
    last_answer = max((i for i, a in enumerate(answers) if a), default=-1)
    assert len(asked) == last_answer + 1 + SILENT_PROBES and set(map(tuple, asked)) == {("w",)}


def test_a_slow_call_answered_before_the_probes_give_up_returns_its_answer(monkeypatch):
    from dlrmflow.engine.serving import shards as embedding_server

    monkeypatch.setattr(embedding_server, "PROBE_SECONDS", 0.0)
    monkeypatch.setattr(embedding_server, "WATCH_S", 0.001)
    monkeypatch.setattr(embedding_server, "cluster_workers", lambda client, timeout=None: {"w": {}})
    monkeypatch.setattr(embedding_server, "probe_workers", lambda client, workers: set())

    class AnsweredLate:  # the answer lands after two unanswered probes
        waits = 0

        def done(self) -> bool:
            return self.waits > 2

        def result(self, timeout: float | None = None) -> str:
            self.waits += 1
            if self.waits <= 2:
                raise TimeoutError
            return "rows"

    assert embedding_server.ServerCall(AnsweredLate(), "w", client=object()).result() == "rows"


@pytest.mark.parametrize("silence", [TimeoutError(), OSError("Timed out trying to connect"), ConnectionRefusedError()])
def test_a_slow_call_whose_scheduler_does_not_answer_fails_without_losing_its_member(monkeypatch, silence):
    """The scheduler's machine failed while a member call was slow: the scheduler's silence says nothing of the
    member, so the call fails with SchedulerSilentError, which is no OSError (the members' loss, which would
    start a rebuild that needs the scheduler)."""
    from dlrmflow.engine.serving import shards as embedding_server
    from dlrmflow.engine.serving.cluster import SchedulerSilentError

    class Unanswered:
        def done(self) -> bool:
            return False

        def result(self, timeout: float) -> None:
            raise TimeoutError

    def silent(client, timeout=None):
        raise silence

    monkeypatch.setattr(embedding_server, "cluster_workers", silent)
    with pytest.raises(SchedulerSilentError, match="did not answer within 30 s whether the worker w is there") as err:
        embedding_server.ServerCall(Unanswered(), "w", client=object()).result()
    assert not isinstance(err.value, OSError)


@pytest.mark.parametrize("outcome", ["rows", ValueError("bad ids"), TimeoutError("the call's own")])
def test_a_call_answered_as_its_wait_runs_out_gives_its_own_outcome(monkeypatch, outcome):
    """A wait that times out just as the answer lands must not pass for a lost worker: a TimeoutError
    is an OSError, which marks the member lost (a live member was, and with R = 1 a kill then lost
    two). The caller gets the call's own result or error, and the scheduler is not asked."""
    from dlrmflow.engine.serving import shards as embedding_server

    class AnsweredAsTheWaitEnded:
        def __init__(self) -> None:
            self.asked = 0

        def done(self) -> bool:
            return self.asked > 0

        def result(self, timeout: float | None = None):
            self.asked += 1
            if self.asked == 1:
                raise TimeoutError  # the wait's
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

    def no_scheduler(client):
        raise AssertionError("the scheduler was asked about a call that had answered")

    monkeypatch.setattr(embedding_server, "cluster_workers", no_scheduler)
    call = embedding_server.ServerCall(AnsweredAsTheWaitEnded(), "w", client=object())
    if isinstance(outcome, BaseException):
        with pytest.raises(type(outcome)) as raised:
            call.result()
        assert raised.value is outcome
    else:
        assert call.result() == outcome


def test_a_call_to_a_killed_worker_fails_even_when_it_must_reconnect(cluster):
    """The first call to a killed worker fails at once (its pooled connection is broken), but a call
    that has to open a new connection to the dead address retries the refused connect for the
    client's whole connect timeout, and then waits for the actor's future while Dask has not marked
    it lost: a kill run stalled for 60 s that way (a second call issued just after the first
    failed). Here the handle's future is one Dask never heard of, so that wait never ends; a member
    call watches its worker and fails soon after the scheduler drops it."""
    from distributed.actor import Actor

    spec = RowSpec(dim=3, optimizer="sgd", seed=0, table_offsets=(0,), cardinalities=(10,))
    worker = sorted(cluster_workers(cluster))[0]
    actor = cluster.submit(EmbeddingShard, spec, 0, 1, actor=True, workers=[worker], pure=False).result()
    assert actor.stats().result()  # the actor is up
    os.kill(cluster.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while worker in cluster_workers(cluster):
        assert time.monotonic() < deadline, "the scheduler never noticed the kill"
        time.sleep(0.05)
    handle = Actor(EmbeddingShard, worker, f"never-scheduled-{worker}")  # not marked lost: must reconnect
    outcome: list = []
    waiter = threading.Thread(target=lambda: outcome.append(wait_all(
        [(0, remote(handle, "stats"))])), daemon=True)
    waiter.start()
    waiter.join(20)
    assert not waiter.is_alive(), "the call waited for a worker the scheduler no longer lists"
    (results, error), = outcome
    assert results == {} and error.members == {0} and "no longer lists" in str(error)


def test_a_copy_task_whose_survivor_died_fails_instead_of_holding_its_worker(cluster):
    """A rebuild's copy task reads from survivors worker to worker. A read from a killed survivor can
    wait for the survivor actor's future in the worker's own client, which never settles (seen:
    a copy task abandoned by its rebuild held its worker's one thread for good, and the next run's
    shards, placed there, waited for ever). Here the survivor handle's future is one Dask never heard
    of; the task watches the survivors' workers and fails soon after the scheduler drops the dead one."""
    from distributed.actor import Actor

    spec = RowSpec(dim=3, optimizer="sgd", seed=0, table_offsets=(0,), cardinalities=(10,))
    # Workers that answer: one an earlier test killed may be restarting (seen under load: listed, then
    # closed by its nanny while this test connected to it).
    pids = cluster.run(os.getpid, on_error="ignore")
    dead, copier = sorted(pids)[:2]
    replacement = cluster.submit(CodedShard, spec, 0, 1, False, actor=True, workers=[copier],
                                 pure=False).result()
    os.kill(pids[dead], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while dead in cluster_workers(cluster):
        assert time.monotonic() < deadline, "the scheduler never noticed the kill"
        time.sleep(0.05)

    def copy_from_dead_survivor(replacement):  # the handle is made on the worker: no task dependency on it
        survivor = Actor(CodedShard, dead, f"never-scheduled-{dead}")
        return rebuild_module.rebuild_chunk_task(1, 1, {1: survivor}, {0: replacement}, (0, 10), {0: 10})

    task = cluster.submit(copy_from_dead_survivor, replacement, workers=[copier], allow_other_workers=False,
                          pure=False)
    with pytest.raises(OSError, match="no longer lists"):
        task.result(timeout=20)  # unwatched: a TimeoutError here, and the copier's thread stays taken


@pytest.mark.parametrize("seed", range(2))
def test_checkpoint_baseline_reloads_replays_and_ends_bit_identical(cluster, tmp_path, seed):
    rng = np.random.default_rng(600 + seed)
    dataset = make_dataset(tmp_path / "data", 30 + seed)
    _run(tmp_path, dataset, "local", "local", seed=seed)
    every, at = int(rng.integers(1, 6)), int(rng.integers(1, ITERATIONS))
    summary = _run(tmp_path, dataset, "run", ["remote", "lru"][seed], cluster, seed=seed, num_shards=2,
                   checkpoint_every=every, kills=(f"shard:{int(rng.integers(0, 2))}@{at}",))
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "run"), f"checkpoint {every}")
    report = summary["checkpoint"]
    assert [c["iteration"] for c in report["checkpoints"]] == list(range(0, ITERATIONS, every))
    (recovery,) = report["recoveries"]
    assert recovery["replay_from"] == at // every * every <= at <= recovery["failed_at"]
    assert recovery["seconds"] >= recovery["reload_seconds"] > 0
    (kill,) = report["kills"]
    assert recovery["detected_s"] >= kill["at_s"] > 0


def test_a_restore_avoids_the_dead_worker_that_the_scheduler_still_lists(cluster, tmp_path, monkeypatch):
    """After a kill the scheduler may list the dead worker for a while (here: for the rest of the run,
    on a host of its own, so placement would pick it first). A shard placed there would wait for it
    forever; the restore avoids the workers of the shards that stopped answering."""
    killed, inject = [], faults_module.FaultInjector.kill

    def recording_kill(self, kill):
        killed.append(self.worker_of(kill.member(self.k)))
        return inject(self, kill)

    def still_listed(client, n, avoid=()):  # what placement sees (the calls to the shards see the truth)
        listed = {**{w: {"host": "10.255.255.1"} for w in killed}, **cluster_workers(client)}
        return place({w: info for w, info in listed.items() if w not in avoid}, n)

    def took_too_long(*_):
        raise TimeoutError("the restore waited for a dead worker")

    monkeypatch.setattr(faults_module.FaultInjector, "kill", recording_kill)
    monkeypatch.setattr(shards_module, "place_avoiding", still_listed)
    dataset = make_dataset(tmp_path / "data", 32)
    _run(tmp_path, dataset, "local", "local")
    previous = signal.signal(signal.SIGALRM, took_too_long)
    signal.alarm(120)
    try:
        summary = _run(tmp_path, dataset, "run", "remote", cluster, num_shards=2, checkpoint_every=2,
                       kills=("shard:0@3",))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert killed and summary["checkpoint"]["recoveries"]
    assert_bit_identical(load_state(tmp_path / "local"), load_state(tmp_path / "run"), "restored")


# ---- the CLI and the recover-shard subflow ---------------------------------------------------------


def _cli(args, capsys):
    from dlrmflow.cli import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_cli_kill_recover_verify_and_too_many(tmp_path, capsys):
    dataset = make_dataset(tmp_path / "data", 23)
    common = ["train", str(dataset), "--batch-size", "16", "--iterations", str(ITERATIONS), "--embedding-dim", "4",
              "--bottom-mlp", "8-4", "--top-mlp", "8-1", "--shards", "2", "--json"]
    code, out, err = _cli([*common, "--mode", "local", "--output", str(tmp_path / "local")], capsys)
    assert code == 0, err
    code, out, err = _cli([*common, "--mode", "remote", "--output", str(tmp_path / "run"), "--parity", "1",
                           "--kill", "shard:1@5", "--rebuild-chunk", "8", "--parity-batches", "3",
                           "--rebuild-rate", "0.05"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert [r["lost"] for r in summary["parity"]["recoveries"]] == [["data shard 1"]]
    (record,) = summary["parity"]["recoveries"]
    row_bytes = (4 + 1) * 4  # embedding dim 4 + rowwise Adagrad's one state value, float32
    assert record["copy_seconds"] >= record["rows_rebuilt"] * row_bytes / 0.05e6  # the rate cap held
    assert summary["state_sha256"] == json.loads((tmp_path / "local" / SUMMARY_FILE).read_text())["state_sha256"]
    code, out, err = _cli(["verify", str(tmp_path / "run"), "--json"], capsys)
    assert code == 0 and json.loads(out)["ok"], err
    # The rebuild ran as its own flow run, a child of the training run.
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as prefect:
        runs = prefect.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["recover-shard"])))
    assert runs and all(r.state.is_completed() for r in runs)
    assert any(r.parent_task_run_id is not None for r in runs)
    _the_ui_shows_one_set_of_recovery_figures(tmp_path / "run", record)
    # More losses than parity: exit status 2, one line naming the loss, no model on disk.
    code, out, err = _cli([*common, "--mode", "remote", "--output", str(tmp_path / "lost"), "--parity", "1",
                           "--kill", "shard:0@3", "--kill", "shard:1@3"], capsys)
    assert code == 2 and "data shards 0, 1" in err and "rebuilds at most 1" in err
    assert not (tmp_path / "lost" / STATE_DIR).exists()


def _the_ui_shows_one_set_of_recovery_figures(run_dir, record: dict) -> None:
    """Issue 46 item 5, read back from the Prefect API after the CLI's kill run: the recover-shard run's log,
    its table, the train summary's rows and the train run's log give the same stripes (copied + generated =
    every stripe rebuilt), a fix-up pass apart from the stripes it re-read, what noticed the loss in words, and
    the subflow says that the rebuild started before it; no row of the train summary is blank (item 4)."""
    import re

    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    from dlrmflow.flows.run_names import train_name
    from dlrmflow.tasks.reporting import train_run_label

    label = train_run_label("remote", 2, 1, run_dir)
    assert record["stripes_total"] == record["stripes_copied"] + record["stripes_generated"] > 0
    assert record["stripes_copied"] > 0 and record["fix_ups"] >= 1  # a remote run writes back every batch
    [noticed] = record["noticed_by"]  # in words: which thread, doing what, which call failed
    assert re.fullmatch(r"the trainer, [a-z' ]+: its call to data shard 1 failed \(\w+: .+\)", noticed), noticed
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        [recovery] = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["recover-shard"])),
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"recover-data-shard-1-{label}"])))
        [train] = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(
            any_=[train_name({"mode": "remote", "num_shards": 2, "parity": 1, "output_dir": str(run_dir)})])))
        logs = {run.id: [e.message for e in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))] for run in (recovery, train)}
        tables = {key: json.loads(a.data) if isinstance(a.data, str) else a.data for key in
                  (f"shard-recovery-{label}", f"train-summary-{label}")
                  for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))}
    table = {row["Metric"]: row["Value"] for row in tables[f"shard-recovery-{label}"]}
    total, copied, generated = (f"{record[k]:,}" if record[k] >= 1000 else record[k]
                                for k in ("stripes_total", "stripes_copied", "stripes_generated"))
    assert table["Stripes rebuilt (copied + generated)"] == total
    assert table["Stripes copied from the survivors (a row in them was trained)"] == copied
    assert table["Stripes generated from the seed (no row in them was trained)"] == generated
    assert table["Fix-up passes (training paused for each)"] == record["fix_ups"]
    assert "Stripes" not in table and "Fix-ups" not in table and table["Noticed by"] == noticed
    # The train run's log says the rebuild starts (every stripe) and ends; its subflow gives the same figures.
    [start] = [line for line in logs[train.id] if line.startswith("rebuilding data shard 1: ")]
    assert start.startswith(f"rebuilding data shard 1: {record['stripes_total']:,} stripes on replacement workers")
    assert "those some live member touched" not in "\n".join(logs[recovery.id])
    [timing] = [line for line in logs[recovery.id] if line.startswith("the rebuild of data shard 1 ")]
    assert re.search(r"started [0-9.]+ s before this flow run, as soon as the loss was noticed, and (had already "
                     r"ended|is running): this run reports it, so its own duration is not the rebuild's", timing)
    [done] = [line for line in logs[recovery.id] if line.startswith("rebuilt data shard 1: ")]
    assert (f"{record['stripes_total']:,} stripes = {record['stripes_copied']:,} copied from the survivors"
            in done and f"+ {record['stripes_generated']:,} generated from the seed" in done), done
    # The train summary: no blank row; the recovery's brief figures are the table's.
    summary = tables[f"train-summary-{label}"]
    assert all(row["Value"] not in ("", None) for row in summary), [r for r in summary if r["Value"] in ("", None)]
    rows = {row["Metric"]: row["Value"] for row in summary}
    assert rows["Cache rows"] == "none: remote mode has no cache"
    assert rows["Recovery 1: Stripes rebuilt (copied + generated)"] == total
    assert rows["Recovery 1: Noticed by"] == noticed


def test_the_run_report_says_how_long_each_loss_went_unnoticed_and_training_waited():
    from dlrmflow.commands.train import _checkpoint_lines, _parity_lines

    kills = [{"kill": "shard:0@3", "pid": 7, "at_s": 1.0}]
    parity = {"parity_shards": 1, "parity_bytes_sent": 10, "write_back_batches": 2, "degraded_rows_read": 3,
              "verify": {"ok": True, "stripes": 5, "mismatched_stripes": []}, "kills": kills,
              "recoveries": [{"lost": ["data shard 0"], "rows_rebuilt": 4, "chunks": 1, "stripes_generated": 6,
                              "seconds": 0.2, "detected_s": 1.25, "locked_seconds": 0.0126, "causes": [],
                              "copy_seconds": 0.15, "copy_task_seconds": 0.1, "copy_read_wait_seconds": 0.07,
                              "copy_install_seconds": 0.02}]}
    lines = "\n".join(_parity_lines(parity))
    assert ("recovered          data shard 0: 0.200 s after detection, 6 stripes = 0 copied from the survivors "
            "(4 rows in 1 chunk) + 6 generated from the seed; 0 fix-up passes re-read 0 stripes written during the "
            "copy (training waited 0.013 s); 0 restarts" in lines)
    assert "noticed 0.250 s after the kill" in lines
    checkpoint = {"checkpoints": [], "every": 5, "file": "f", "kills": kills,
                  "recoveries": [{"replay_from": 0, "failed_at": 3, "seconds": 0.5, "detected_s": 1.5}]}
    assert "(noticed 0.500 s after the kill)" in "\n".join(_checkpoint_lines(checkpoint))
    parity["kills"] = []  # a real failure: no kill record, nothing to measure from
    assert "noticed" not in "\n".join(_parity_lines(parity))
    parity["recoveries"][0]["causes"] = ["members [0] lost: OSError('gone')"]  # an older record: no words
    assert "noticed by a failed call (members [0] lost: OSError: gone)" in "\n".join(_parity_lines(parity))
    parity["recoveries"][0]["noticed_by"] = ["the trainer, fetching a batch's rows: its call to data shard 0 failed "
                                             "(OSError: gone)"]
    assert "noticed by the trainer, fetching a batch's rows: its call to data shard 0" in \
        "\n".join(_parity_lines(parity))
    assert ("bulk copy 0.150 s: 0.100 s in copy tasks on the new shards' worker (0.070 s waiting for survivors, "
            "0.020 s decoding and installing); 3 degraded row reads" in "\n".join(_parity_lines(parity)))
