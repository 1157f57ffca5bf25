"""The driver's own probes of the trainers' workers (engine/training/launch.py): a trainer whose machine fails
outright is taken as lost after a few unanswered probes, not after Dask's TCP timeout.

:class:`SilentWorkers` is the decision, tested without a network on random answer sequences;
:func:`answering_workers` is the probe, tested against a live worker, a port that refuses and a listener that
never answers (a machine whose link is down looks the same: nothing comes back). :class:`SchedulerWatch`, a lone
trainer's watch on the scheduler, is tested on schedulers that answer a given number of questions."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest

from dlrmflow.engine.serving.cluster import SilentWorkers, answering_workers, scheduler_answers
from dlrmflow.engine.training.launch import SILENT_PROBES, SchedulerWatch, answering_candidates


def test_a_trainer_is_lost_after_exactly_its_limit_of_misses_in_a_row_on_random_answers():
    rng = random.Random(7)
    for _ in range(200):
        workers = [f"tcp://10.0.0.{i}:1" for i in range(rng.randint(1, 4))]
        limit = rng.randint(1, 4)
        silent, streak = SilentWorkers(workers, limit), dict.fromkeys(workers, 0)
        for _ in range(rng.randint(1, 30)):
            answered = {w for w in workers if rng.random() < 0.6}
            lost = silent.probed(answered)
            for w in workers:
                streak[w] = 0 if w in answered else streak[w] + 1
            assert lost == [rank for rank, w in enumerate(workers) if streak[w] >= limit]


def test_an_answer_starts_the_count_again():
    silent = SilentWorkers(["a", "b"], limit=3)
    assert silent.probed({"b"}) == [] and silent.probed({"b"}) == []
    assert silent.probed({"a", "b"}) == []  # a answered: its two misses are forgotten
    assert silent.probed({"b"}) == [] and silent.probed({"b"}) == [] and silent.probed({"b"}) == [0]
    assert SilentWorkers(["a"]).limit == SILENT_PROBES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_probe_hears_a_live_worker_and_neither_a_refusing_port_nor_a_silent_listener_which_gets_no_trainer():
    from distributed import Client, LocalCluster

    silent = socket.socket()  # accepts connections in the kernel, never reads: a reply that never comes
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    refusing = f"tcp://127.0.0.1:{_free_port()}"
    quiet = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    try:
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            info = client.scheduler_info()["workers"]
            [live] = info
            began = time.monotonic()
            answered = client.sync(answering_workers, [live, refusing, quiet], 1.0, client.connection_args)
            took = time.monotonic() - began
            # Placement: a worker the scheduler still lists but that does not answer gets no trainer.
            listed = {**info, quiet: {"resources": {"trainer": 1}}, live: {**info[live], "resources": {"trainer": 1}}}
            placeable = answering_candidates(client, listed)
            scheduler_answered = scheduler_answers(client)  # a scheduler answers the same probe
    finally:
        silent.close()
    assert answered == {live} and scheduler_answered
    assert list(placeable) == [live]
    assert took < 10  # the silent listener cost its timeout, not a TCP timeout (a bound on the mechanism)


def test_the_probe_of_no_workers_is_empty():
    assert asyncio.run(answering_workers([], 1.0, {})) == set()


@pytest.mark.parametrize("limit", [0, -1])
def test_a_limit_below_one_is_refused(limit):
    with pytest.raises(ValueError, match="at least one"):
        SilentWorkers(["a"], limit)


class Scheduler:
    """A scheduler as :class:`SchedulerWatch` probes it: answers ``answers`` probes, then none."""

    def __init__(self, answers: int) -> None:
        self.answers, self.asked, self.lost_calls = answers, 0, 0

    def ask(self) -> bool:
        self.asked += 1
        return self.asked <= self.answers

    def on_lost(self) -> None:
        self.lost_calls += 1


def _settled(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("answers,limit", [(0, 1), (1, 3), (5, 2)])
def test_the_scheduler_is_lost_after_its_limit_of_misses_in_a_row_and_is_probed_no_more(answers, limit):
    scheduler = Scheduler(answers)
    with SchedulerWatch(scheduler.ask, every=0.01, limit=limit, on_lost=scheduler.on_lost) as watch:
        assert _settled(lambda: watch.lost is not None)
        assert watch.lost == f"no answer to {limit} probes in a row, each given 3 s"
        time.sleep(0.1)
        assert scheduler.asked == answers + limit and scheduler.lost_calls == 1  # the thread stopped there
        assert watch.verdict() == watch.lost  # an error the run met then: the loss, with no more probes
        assert scheduler.asked == answers + limit


def test_nothing_is_lost_while_the_scheduler_answers_and_the_watch_stops_when_left():
    scheduler = Scheduler(answers=10**9)
    with SchedulerWatch(scheduler.ask, every=0.01) as watch:
        assert _settled(lambda: scheduler.asked >= 5)
        assert watch.lost is None and watch.verdict() is None  # a live scheduler: the run's error is its own
    left = scheduler.asked
    time.sleep(0.1)
    assert scheduler.asked <= left + 1 and watch.lost is None


def test_a_verdict_probes_at_once_until_an_answer_or_the_loss():
    silent = Scheduler(answers=0)
    with SchedulerWatch(silent.ask, every=3600, limit=3) as watch:  # the watch's first probe: in an hour
        assert watch.verdict() == "no answer to 3 probes in a row, each given 3 s" and silent.asked == 3
    answering = Scheduler(answers=1)
    with SchedulerWatch(answering.ask, every=3600) as watch:
        assert watch.verdict() is None and answering.asked == 1
