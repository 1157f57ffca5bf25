"""Where embedding-server and parity actors go: on separate machines when the cluster has them.

A cluster says which workers may host embedding servers with a Dask worker resource::

    dask worker tcp://scheduler:8786 --resources "embedding_server=1"

When any worker advertises ``embedding_server`` only those workers are eligible; when none does (a
LocalCluster, a plain cluster) every worker is, so the embedded default works unchanged. Members
(K data + R parity shards) are spread over distinct hosts first, then distinct workers, then round
robin: one machine failure takes at most one member whenever the eligible workers span at least as
many hosts as there are members, and the placement says when it cannot promise that.

Everything here is a pure function of the scheduler's worker info (``client.scheduler_info()
["workers"]``: address -> {"host", "resources", ...}), so it is tested without a cluster. Actors are
then submitted with ``workers=[address]``, which the scheduler treats as a hard restriction
(``Scheduler.valid_workers``). No ``resources=`` goes with the submit: a resource is held only while
the actor's constructor runs, adds nothing to an explicit address, and would leave the actor
unschedulable on a cluster where no worker advertises it.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from distributed.comm import get_address_host

from dlrmflow.engine.errors import UserInputError

RESOURCE = "embedding_server"
# What a worker hosts says so in the worker's own log: under distributed's logger, a `dask worker` process
# prints these lines with its own (a LocalCluster dlrmflow starts keeps its workers quiet).
WORKER_LOG = logging.getLogger("distributed.dlrmflow")
TRAINER_RESOURCE = "trainer"  # workers that may run a trainer process (``--trainers W``)
# Dask's convention for a worker that owns a GPU (`dask worker --resources GPU=1`, or dask-cuda's
# LocalCUDACluster(resources={"GPU": 1})): the GPU the worker's process sees first is its own.
GPU_RESOURCE = "GPU"
ROLES = (RESOURCE, TRAINER_RESOURCE)

WorkerInfo = Mapping[str, Mapping[str, Any]]  # address -> the scheduler's info on that worker


class NoWorkersError(UserInputError):
    """The Dask cluster has no worker that may host an embedding server."""


def host_of(address: str, worker_info: WorkerInfo) -> str:
    """The machine of a worker: its reported host, else the host part of its address (a dead worker)."""
    return (worker_info.get(address) or {}).get("host") or get_address_host(address)


def advertises(info: Mapping[str, Any], resource: str) -> bool:
    return (info.get("resources") or {}).get(resource, 0) > 0


def eligible_workers(worker_info: WorkerInfo, resource: str = RESOURCE) -> list[str]:
    """Workers advertising ``resource`` when any does; else those advertising no other dlrmflow role
    (:data:`ROLES`) when there are any, else every worker; sorted."""
    advertised = [a for a, info in worker_info.items() if advertises(info, resource)]
    if advertised:
        return sorted(advertised)
    neutral = [a for a, info in worker_info.items() if not any(advertises(info, r) for r in ROLES if r != resource)]
    return sorted(neutral or worker_info)


def place_trainers(worker_info: WorkerInfo, n: int, servers: Collection[str] = (), *, gpu: bool = False
                   ) -> list[str]:
    """One distinct worker per trainer (a trainer is a process: two in one worker would share it), from the
    workers :func:`eligible_workers` allows for :data:`TRAINER_RESOURCE`, spread across hosts: with ``gpu``
    (``--device cuda``) those advertising a :data:`GPU_RESOURCE` first; then those hosting no embedding server
    (``servers``)."""
    eligible = eligible_workers(worker_info, TRAINER_RESOURCE)
    tiers: dict[tuple[bool, bool], list[str]] = defaultdict(list)
    for address in eligible:
        no_gpu = gpu and not advertises(worker_info.get(address) or {}, GPU_RESOURCE)
        tiers[no_gpu, address in servers].append(address)
    order = [a for tier in sorted(tiers) for a in spread_order(worker_info, tiers[tier])]
    if len(order) < n:
        raise NoWorkersError(
            f"trainers: --trainers {n} needs {n} Dask worker processes, one per trainer; the cluster has "
            f"{len(order)} that may run one (start workers with --resources {TRAINER_RESOURCE}=1)")
    return order[:n]


def spread_order(worker_info: WorkerInfo, addresses: Collection[str]) -> list[str]:
    """``addresses`` interleaved across hosts: each host's first worker, then each host's second, ...

    Any prefix of this order uses as many distinct hosts, then workers, as it can."""
    by_host: dict[str, list[str]] = defaultdict(list)
    for address in sorted(addresses):
        by_host[host_of(address, worker_info)].append(address)
    order = []
    for rank in range(max(map(len, by_host.values()), default=0)):
        order += [by_host[h][rank] for h in sorted(by_host) if rank < len(by_host[h])]
    return order


@dataclass(frozen=True)
class Placement:
    workers: list[str]  # member i -> worker address
    hosts: list[str]  # member i -> host of that worker
    by_resource: bool  # only the workers advertising the resource were eligible

    @property
    def shares_worker(self) -> bool:
        return len(set(self.workers)) < len(self.workers)

    @property
    def shares_host(self) -> bool:
        return len(set(self.hosts)) < len(self.hosts)

    def warning(self) -> str | None:
        """What one failure can take, when it can take more than one member; None otherwise."""
        if self.shares_worker:
            return (f"{len(self.workers)} embedding-server members on {len(set(self.workers))} workers: "
                    "one worker failure can take several members")
        if self.shares_host:
            return (f"{len(self.hosts)} embedding-server members on {len(set(self.hosts))} hosts: "
                    "one machine failure can take several members")
        return None


def where_placed(names: list[str], workers: list[str], worker_info: WorkerInfo) -> str:
    """Which host each of ``names`` runs on (``workers``: each one's worker address), by host:
    ``2 hosts: 10.0.0.2 (data shard 0, parity shard 0), 10.0.0.3 (data shard 1)``: what the run's log says
    so that a user knows which machine's failure takes what."""
    by_host: dict[str, list[str]] = defaultdict(list)
    for name, worker in zip(names, workers, strict=True):
        by_host[host_of(worker, worker_info)].append(name)
    hosts = ", ".join(f"{host} ({', '.join(on)})" for host, on in sorted(by_host.items()))
    return f"{len(by_host)} host{'s' if len(by_host) != 1 else ''}: {hosts}"


def shared_host_warning(placement: Placement, worker_info: WorkerInfo) -> str | None:
    """:meth:`Placement.warning` on a cluster that spans several hosts; None on a one-host cluster (a
    LocalCluster), where every member shares the machine and the user knows it."""
    if len({host_of(w, worker_info) for w in worker_info}) < 2:
        return None
    return placement.warning()


def place(worker_info: WorkerInfo, n: int, resource: str = RESOURCE) -> Placement:
    """Workers for ``n`` members: eligible ones only, distinct hosts first, then distinct workers."""
    if n < 1:
        raise ValueError(f"need at least one member to place, got {n}")
    eligible = eligible_workers(worker_info, resource)
    if not eligible:
        raise NoWorkersError("the Dask cluster has no workers to host embedding servers")
    order = spread_order(worker_info, eligible)
    workers = [order[i % len(order)] for i in range(n)]
    by_resource = any(advertises(info, resource) for info in worker_info.values())
    return Placement(workers, [host_of(w, worker_info) for w in workers], by_resource)


def choose_rebuild_worker(worker_info: WorkerInfo, busy: Collection[str], dead: Collection[str] = (),
                          resource: str = RESOURCE) -> str | None:
    """An eligible worker for a rebuilt member that hosts no live member (``busy``) and is not ``dead``:
    one on a host without live members when there is one. None when every eligible worker is busy."""
    busy_hosts = Counter(host_of(w, worker_info) for w in busy)
    free = [w for w in eligible_workers(worker_info, resource) if w not in busy and w not in dead]
    return min(free, key=lambda w: (busy_hosts[host_of(w, worker_info)], w), default=None)


def least_loaded_worker(worker_info: WorkerInfo, busy: Collection[str], dead: Collection[str] = (),
                        resource: str = RESOURCE) -> str | None:
    """The fallback when no free worker turned up: the live eligible worker with the fewest members
    (then the fewest on its host). It shares a fault domain with a live member: better than nothing."""
    on_worker = Counter(busy)
    busy_hosts = Counter(host_of(w, worker_info) for w in busy)
    live = [w for w in eligible_workers(worker_info, resource) if w not in dead]
    return min(live, key=lambda w: (on_worker[w], busy_hosts[host_of(w, worker_info)], w), default=None)
