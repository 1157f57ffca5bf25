"""The driver's own probes of the trainers' workers (engine/training/launch.py): a trainer whose machine fails
outright is taken as lost after a few unanswered probes, not after Dask's TCP timeout.

:class:`SilentTrainers` is the decision, tested without a network on random answer sequences;
:func:`answering_workers` is the probe, tested against a live worker, a port that refuses and a listener that
never answers (a machine whose link is down looks the same: nothing comes back)."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import pytest

from dlrmflow.engine.serving.cluster import answering_workers
from dlrmflow.engine.training.launch import SILENT_PROBES, SilentTrainers, answering_candidates


def test_a_trainer_is_lost_after_exactly_its_limit_of_misses_in_a_row_on_random_answers():
    rng = random.Random(7)
    for _ in range(200):
        workers = [f"tcp://10.0.0.{i}:1" for i in range(rng.randint(1, 4))]
        limit = rng.randint(1, 4)
        silent, streak = SilentTrainers(workers, limit), dict.fromkeys(workers, 0)
        for _ in range(rng.randint(1, 30)):
            answered = {w for w in workers if rng.random() < 0.6}
            lost = silent.probed(answered)
            for w in workers:
                streak[w] = 0 if w in answered else streak[w] + 1
            assert lost == [rank for rank, w in enumerate(workers) if streak[w] >= limit]


def test_an_answer_starts_the_count_again():
    silent = SilentTrainers(["a", "b"], limit=3)
    assert silent.probed({"b"}) == [] and silent.probed({"b"}) == []
    assert silent.probed({"a", "b"}) == []  # a answered: its two misses are forgotten
    assert silent.probed({"b"}) == [] and silent.probed({"b"}) == [] and silent.probed({"b"}) == [0]
    assert SilentTrainers(["a"]).limit == SILENT_PROBES


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
    finally:
        silent.close()
    assert answered == {live}
    assert list(placeable) == [live]
    assert took < 10  # the silent listener cost its timeout, not a TCP timeout (a bound on the mechanism)


def test_the_probe_of_no_workers_is_empty():
    assert asyncio.run(answering_workers([], 1.0, {})) == set()


@pytest.mark.parametrize("limit", [0, -1])
def test_a_limit_below_one_is_refused(limit):
    with pytest.raises(ValueError, match="at least one"):
        SilentTrainers(["a"], limit)
