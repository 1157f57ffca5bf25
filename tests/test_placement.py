"""Actor placement by worker resources: properties on random clusters (no Dask cluster needed).

Random worker sets (hosts, workers per host, which advertise ``embedding_server``, whether the info
carries a host or only the address does) are checked against what a placement must do: only
eligible workers, as many distinct hosts and then workers as possible, round robin past that, the
same answer whatever the dict order; and a rebuild goes to a free worker, on a host without live
members when there is one.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.serving.placement import (
    RESOURCE,
    NoWorkersError,
    choose_rebuild_worker,
    eligible_workers,
    least_loaded_worker,
    place,
    shared_host_warning,
    where_placed,
)


@st.composite
def clusters(draw) -> dict[str, dict]:
    """A scheduler_info()["workers"] dict: 1-5 hosts, 1-4 workers each, random resources."""
    info = {}
    for h in range(draw(st.integers(1, 5))):
        host = f"10.0.0.{h + 1}"
        for w in range(draw(st.integers(1, 4))):
            address = f"tcp://{host}:{40000 + w}"
            resources = {RESOURCE: 1} if draw(st.booleans()) else {}
            if draw(st.booleans()):
                resources["GPU"] = 1  # another resource: must not make a worker eligible
            entry = {"resources": resources, "name": f"h{h}w{w}"}
            if draw(st.booleans()):  # the scheduler reports the host; without it the address says
                entry["host"] = host
            info[address] = entry
    return info


def host(address: str) -> str:
    return address.split("//")[1].rsplit(":", 1)[0]


def reference_eligible(info: dict[str, dict]) -> set[str]:
    with_resource = {a for a, w in info.items() if w["resources"].get(RESOURCE)}
    return with_resource or set(info)


@given(clusters(), st.integers(1, 12), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_placement_spreads_over_hosts_then_workers_on_eligible_workers(info, n, rnd):
    placed = place(info, n)
    eligible = reference_eligible(info)
    eligible_hosts = {host(a) for a in eligible}
    assert len(placed.workers) == n and set(placed.workers) <= eligible
    assert placed.hosts == [host(w) for w in placed.workers]
    assert placed.by_resource == any(w["resources"].get(RESOURCE) for w in info.values())
    # As many distinct hosts, and distinct workers, as the eligible workers allow.
    assert len(set(placed.hosts)) == min(n, len(eligible_hosts))
    assert len(set(placed.workers)) == min(n, len(eligible))
    if len(eligible_hosts) >= n:
        assert not placed.shares_host and not placed.shares_worker and placed.warning() is None
    if n > len(eligible):  # round robin: every eligible worker holds floor or ceil of n / workers
        counts = Counter(placed.workers)
        assert set(counts) == eligible and max(counts.values()) - min(counts.values()) <= 1
    assert placed.shares_worker == (len(set(placed.workers)) < n)
    assert placed.shares_host == (len(set(placed.hosts)) < n)
    assert (placed.warning() is None) == (not placed.shares_host)
    # Deterministic: the same answer whatever order the scheduler lists the workers in.
    shuffled = list(info.items())
    rnd.shuffle(shuffled)
    assert place(dict(shuffled), n) == placed


@given(clusters(), st.integers(0, 6), st.integers(0, 3), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_a_rebuild_goes_to_a_free_worker_on_a_host_without_live_members(info, n_busy, n_dead, rnd):
    eligible = sorted(reference_eligible(info))
    # Live members' workers (maybe two on one worker, maybe one already gone) and killed workers.
    busy = [rnd.choice(eligible) for _ in range(n_busy)] + ["tcp://10.0.9.9:1"] * (n_busy > 3)
    dead = rnd.sample(sorted(info), min(n_dead, len(info)))
    chosen = choose_rebuild_worker(info, busy, dead)
    free = [w for w in eligible if w not in busy and w not in dead]
    if not free:
        assert chosen is None
    else:
        assert chosen in free
        busy_hosts = {host(b) for b in busy}
        if any(host(w) not in busy_hosts for w in free):
            assert host(chosen) not in busy_hosts
    shuffled = list(info.items())
    rnd.shuffle(shuffled)
    assert choose_rebuild_worker(dict(shuffled), busy, dead) == chosen

    fallback = least_loaded_worker(info, busy, dead)
    live = [w for w in eligible if w not in dead]
    if not live:
        assert fallback is None
    else:
        assert fallback in live
        assert busy.count(fallback) == min(busy.count(w) for w in live)


def test_a_cluster_without_the_resource_uses_every_worker_like_before():
    """A LocalCluster: one host, no resources; members go round robin over the sorted workers."""
    info = {f"tcp://127.0.0.1:{port}": {"host": "127.0.0.1", "resources": {}} for port in (41003, 41001, 41002)}
    workers = sorted(info)
    for n in range(1, 8):
        placed = place(info, n)
        assert placed.workers == [workers[s % 3] for s in range(n)]
        assert not placed.by_resource and placed.shares_host == (n > 1) and placed.shares_worker == (n > 3)


def test_a_worker_with_zero_of_the_resource_is_not_eligible():
    info = {"tcp://a:1": {"resources": {RESOURCE: 0}}, "tcp://b:1": {"resources": {RESOURCE: 1}},
            "tcp://c:1": {"resources": {}}}
    assert eligible_workers(info) == ["tcp://b:1"]
    assert place(info, 3).workers == ["tcp://b:1"] * 3


def test_no_workers_is_a_clear_user_error():
    with pytest.raises(UserInputError, match="no workers to host embedding servers") as caught:
        place({}, 2)
    assert isinstance(caught.value, NoWorkersError)
    with pytest.raises(ValueError, match="at least one member"):
        place({"tcp://a:1": {}}, 0)
    assert choose_rebuild_worker({}, [], []) is None and least_loaded_worker({}, [], []) is None


def test_host_comes_from_the_address_when_the_info_has_none():
    info = {"tcp://[::1]:5000": {"resources": {}}, "tcp://[::1]:5001": {"resources": {}},
            "tls://node-b.example:7000": {"resources": {}}}
    placed = place(info, 2)
    assert sorted(placed.hosts) == ["::1", "node-b.example"] and not placed.shares_host
    # A rebuild avoids the host of a live member, even one whose worker the scheduler no longer lists.
    assert choose_rebuild_worker(info, ["tcp://[::1]:5999"]) == "tls://node-b.example:7000"


def test_the_log_says_which_host_runs_each_member_and_warns_only_on_a_cluster_of_hosts():
    """The run's log names each member's host, grouped by host; members sharing a host are a warning when
    the cluster spans hosts (a machine's failure takes several), never on a one-host LocalCluster."""
    names = ["data shard 0", "data shard 1", "parity shard 0"]
    two_hosts = {"tcp://10.0.0.2:1": {"host": "10.0.0.2", "resources": {RESOURCE: 1}},
                 "tcp://10.0.0.3:1": {"host": "10.0.0.3", "resources": {RESOURCE: 1}},
                 "tcp://10.0.0.4:1": {"host": "10.0.0.4", "resources": {"trainer": 1}}}
    placed = place(two_hosts, 3)
    assert where_placed(names, placed.workers, two_hosts) == \
        "2 hosts: 10.0.0.2 (data shard 0, parity shard 0), 10.0.0.3 (data shard 1)"
    assert shared_host_warning(placed, two_hosts) == \
        "3 embedding-server members on 2 workers: one worker failure can take several members"
    three = {**two_hosts, "tcp://10.0.0.5:1": {"host": "10.0.0.5", "resources": {RESOURCE: 1}}}
    assert shared_host_warning(place(three, 3), three) is None
    local = {f"tcp://127.0.0.1:{port}": {"host": "127.0.0.1", "resources": {}} for port in (41001, 41002, 41003)}
    placed = place(local, 3)
    assert where_placed(names, placed.workers, local) == \
        "1 host: 127.0.0.1 (data shard 0, data shard 1, parity shard 0)"
    assert placed.shares_host and shared_host_warning(placed, local) is None
