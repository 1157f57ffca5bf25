"""Where Dask work runs: a LocalCluster by default, or an existing scheduler.

The address comes from the caller (``--dask-address``/flow parameter) or the environment
variable ``DLRMFLOW_DASK_ADDRESS``. A LocalCluster is sized for the machine: one
single-threaded worker process per core (at most 4), because the heavy steps (Arrow parsing,
NumPy) hold one core each and processes avoid GIL contention.

Flows hold one cluster for their whole run (:func:`dask_scheduler`) and hand its address to
their tasks, which connect with :func:`dask_client`; so a pipeline starts one LocalCluster,
not one per step.

Clients talk to workers directly (``direct_to_workers``): every embedding-server call is an
actor call, and through the scheduler it would take two extra hops (and, with a LocalCluster,
the trainer process's event loop) per call.

:func:`shaped_cluster` puts the embedding servers behind an emulated network
(:mod:`dlrmflow.engine.serving.shaped_link`): a scheduler in this process on the link's root-side address,
and one worker process per server inside the link's namespace, so every fetch and write-back
between the trainer (this process) and a server crosses the shaped link.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster, Nanny
from distributed.core import Status
from distributed.utils import get_mp_context

from dlrmflow.engine.phases import phase_reported, say
from dlrmflow.engine.serving.dask_internals import RestartSafeLocalCluster, read_frames_by_the_mark
from dlrmflow.engine.serving.placement import RESOURCE as SERVER_RESOURCE
from dlrmflow.engine.serving.placement import TRAINER_RESOURCE
from dlrmflow.engine.serving.shaped_link import ShapedLink, shaped_link

ADDRESS_ENV = "DLRMFLOW_DASK_ADDRESS"

# Dask's periodic housekeeping in the clusters dlrmflow starts, made rarer. The defaults (an event-loop
# health check every 20 ms, a system monitor every 500 ms, a statistical profiler sampling every worker
# thread every 10 ms) cost an idle trainer process (which hosts a LocalCluster's scheduler) about 50 ms
# of CPU per second, taken from compute when the trainer and the servers share a few cores; with these,
# about 20 ms (docs/oracle-overhead.md). Nothing dlrmflow does reads the profiles or the tick health. The
# memory monitor (every 100 ms by default: each worker's and nanny's RSS, for the pause/spill/terminate
# thresholds) every second: an idle worker then costs 4 ms of CPU per second, not 8 (40 ms with Dask's
# defaults: benchmarks/idle_cluster.py).
#
# And no MALLOC_TRIM_THRESHOLD_ in the workers' environment: Dask's nannies set it to 64 KiB to hand freed
# memory back to the OS, but any explicit trim threshold also turns off glibc's adaptive mmap threshold, so
# that every NumPy/Arrow temporary over 128 KiB is a fresh mmap whose pages fault in, zeroed, on first
# touch: a preprocess block then costs 2.3x its in-process time (380k page faults instead of 5k per 64 MiB
# block; benchmarks/RESULTS.md). dlrmflow's stages bound their memory by block and partition instead.
HOUSEKEEPING = {
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.profile.enabled": False,
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,  # None: unset (Dask's convention)
}


# Every process that loads the serving layer (the trainer's, the workers forked from its server, a worker that
# hosts an embedding server) reads Dask's large frames once per 256 KB arrived, not once per packet.
read_frames_by_the_mark()

WORKER_LOGGING = "dlrmflow.engine.serving.worker_logging"

# A LocalCluster's worker processes fork from one server process that imported these once (Python's
# forkserver, Dask's ``distributed.worker.multiprocessing-method``), not fresh interpreters: a spawned
# worker imports torch, Dask and the engine anew, about 3 CPU seconds each, so a 4-worker cluster cost
# 12 CPU s and 5.5 s on 2 cores; forked, 0.6 s (benchmarks/cluster_start.py). The server starts with the
# first cluster and ends with this process. A forked worker takes its current directory from the cluster's
# starter, but its environment (and glibc's malloc settings) from the server's start, which is given what a
# nanny gives a spawned worker: an environment variable set later in this process does not reach it (nothing
# dlrmflow's workers run reads one). Imports that fail are skipped there and done by the worker that needs them.
WORKER_IMPORTS = ("dlrmflow", "distributed", "numpy", "pyarrow.parquet", WORKER_LOGGING,
                  "dlrmflow.engine.serving.shards", "dlrmflow.engine.coding.group",
                  "dlrmflow.engine.planning.planner", "dlrmflow.engine.planning.profile",
                  "dlrmflow.datasets.preprocess", "dlrmflow.datasets.synthetic")
# What a worker that trains or scores imports besides WORKER_IMPORTS: torch (1.4 CPU s). Preloaded unless the
# command says its workers never use it (start_worker_server's ``torch``): generating, preprocessing, profiling and
# planning data, and serving rows (the server code imports no torch), which a one-trainer run's cluster only does.
# There the server's start costs 0.6 CPU s instead of 2.0, on the cores the command's own imports and its
# temporary Prefect API start on.
TORCH_IMPORTS = ("torch", "dlrmflow.engine.training.launch")
# What a worker that trains or scores imports besides: torch.optim's first optimizer and
# torch.use_deterministic_algorithms import torch's compiler (torch._dynamo), 1.2 CPU s after each fork. Preloaded
# only where trainer workers will fork (start_worker_server's ``trainers``): a server-only cluster's start would pay
# it for nothing (launch to exit of a one-iteration remote run 1.8 s longer on 2 cores).
TRAINER_IMPORTS = ("torch._inductor.config",)
WORKER_START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


class ForkingNanny(Nanny):
    """A nanny whose every worker start uses :data:`WORKER_START`, its restart of a killed worker included.

    Dask reads the start method from the global configuration at each start: a restart after the cluster's
    start would spawn the replacement, which then imports torch anew (seconds of CPU on the cores the surviving
    trainers and servers use, while a rebuild may wait for it). Set for these nannies only, not for the process:
    other clusters it starts keep Dask's default."""

    async def instantiate(self) -> Status:
        # Global while this start awaits: a start of another cluster's worker in that window (rare: restarts
        # are) may fork too, which only makes it start faster.
        with dask.config.set({"distributed.worker.multiprocessing-method": WORKER_START}):
            return await super().instantiate()


def start_worker_server(*, torch: bool = True, trainers: bool = False) -> None:
    """With :data:`WORKER_START` forkserver, start the server now (once per process) with :data:`WORKER_IMPORTS`,
    :data:`TORCH_IMPORTS` with ``torch`` (its workers may train or score: False only where none will), and
    :data:`TRAINER_IMPORTS` with ``trainers`` (its workers will train); and with the environment a nanny gives
    the workers it spawns (Dask's ``pre-spawn-environ`` under :data:`HOUSEKEEPING`: one OpenMP thread, no malloc
    trim threshold), whatever this process's environment holds by then: a LocalCluster started here without
    dlrmflow's settings leaves Dask's in it."""
    if WORKER_START != "forkserver":
        return
    # Dask's start method and the nannies' environment as a LocalCluster of dlrmflow's reads them.
    with dask.config.set({**HOUSEKEEPING, "distributed.worker.multiprocessing-method": WORKER_START}):
        get_mp_context()  # Dask sets its preload list once per process: ours replaces it
        multiprocessing.get_context(WORKER_START).set_forkserver_preload(
            [*worker_imports(torch=torch, trainers=trainers)])
        spawn_env = dask.config.get("distributed.nanny.pre-spawn-environ", {})
        saved = {key: os.environ.get(key) for key in spawn_env}
        try:
            for key, value in spawn_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = str(value)
            multiprocessing.forkserver.ensure_running()  # inherits os.environ now, and only now
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def worker_imports(*, torch: bool = True, trainers: bool = False) -> tuple[str, ...]:
    """What the workers' server imports before it forks them (:func:`start_worker_server`): trainers use torch
    whatever ``torch`` says."""
    return (*WORKER_IMPORTS, *(TORCH_IMPORTS if torch or trainers else ()), *(TRAINER_IMPORTS if trainers else ()))


def coded_cluster_workers(num_shards: int, parity: int) -> int | None:
    """The workers of a LocalCluster for a run with ``parity`` parity shards: one per data and parity shard
    (separate fault domains) plus a spare, so that a rebuild starts at once on a fresh worker; None (the
    default size) without parity."""
    return num_shards + parity + 1 if parity else None


def resolve_address(address: str | None) -> str | None:
    return address or os.environ.get(ADDRESS_ENV) or None


def local_cluster(n_workers: int | None = None, memory_limit: str = "auto", *, host: str | None = None,
                  trainers: int = 0) -> LocalCluster:
    """A LocalCluster of ``n_workers`` single-threaded worker processes (None: one per core, at most 4; 0:
    a scheduler alone), its scheduler in this process listening on ``host`` (None: Dask's default).

    ``trainers`` > 1: as many more worker processes advertising the ``trainer`` resource, each with an
    equal share of the cores as threads (a trainer computes with its worker's threads)."""
    workers = n_workers if n_workers is not None else max(1, min(os.cpu_count() or 1, 4))
    # The scheduler lives in this process; its INFO chatter (workers joining and leaving) would
    # drown the flow's own progress lines in the terminal and the Prefect logs.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    # Read when the scheduler, the worker server and the nannies start; the nannies pass HOUSEKEEPING to their
    # workers. (A nanny's later restart of a killed worker: ForkingNanny.)
    with dask.config.set({**HOUSEKEEPING, "distributed.worker.multiprocessing-method": WORKER_START}):
        start_worker_server(trainers=trainers > 1)  # no-op once the server runs (the CLI starts it first)
        cluster = RestartSafeLocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            worker_class=ForkingNanny,
            dashboard_address=":0",  # a free port: never collides with another cluster's 8787
            memory_limit=memory_limit,
            silence_logs=logging.ERROR,
            preload=[WORKER_LOGGING],  # no heartbeat traceback from a worker (engine/serving/worker_logging.py)
            host=host,
        )
        if trainers > 1:
            add_trainer_workers(cluster, trainers)
    return cluster


def add_trainer_workers(cluster: LocalCluster, count: int) -> None:
    """Start ``count`` worker processes advertising the ``trainer`` resource in ``cluster`` and wait for them."""
    threads = max(1, (os.cpu_count() or 1) // count)
    template = next(iter(cluster.new_worker_spec().values()))
    for i in range(count):
        spec = {**template, "options": {**template["options"], "nthreads": threads,
                                        "resources": {TRAINER_RESOURCE: 1}}}
        cluster.worker_spec[f"trainer-{i}"] = spec
    cluster.scale(len(cluster.worker_spec))
    cluster.wait_for_workers(len(cluster.worker_spec))


@contextmanager
def dask_scheduler(address: str | None = None, *, n_workers: int | None = None, trainers: int = 0) -> Iterator[str]:
    """Yield a scheduler address: ``address`` (or $DLRMFLOW_DASK_ADDRESS), else a new LocalCluster's
    (with ``trainers`` trainer workers when > 1)."""
    address = resolve_address(address)
    if address:
        yield address
        return
    with _reported(lambda: local_cluster(n_workers, trainers=trainers)) as cluster:
        _say_dashboard(cluster.dashboard_link)
        yield cluster.scheduler_address


_ANNOUNCED_DASHBOARDS: set[str] = set()  # said once per process: a flow's tasks join the cluster it started


def _say_dashboard(link: str | None) -> None:
    """Where the cluster's Dask dashboard is (users watch long work there): a LocalCluster's is on a free port."""
    text = link or "none (the scheduler serves no dashboard)"
    if text not in _ANNOUNCED_DASHBOARDS:
        _ANNOUNCED_DASHBOARDS.add(text)
        say(f"Dask dashboard: {text}")


@contextmanager
def _reported(start: Callable[[], LocalCluster]) -> Iterator[LocalCluster]:
    """A LocalCluster from ``start``, its start and its close reported as phases (seconds each)."""
    with phase_reported("Dask: starting a LocalCluster"):
        cluster = start()
    try:
        yield cluster
    finally:
        with phase_reported("Dask: closing the LocalCluster"), _quiet_close():
            cluster.close()


@contextmanager
def _quiet_close() -> Iterator[None]:
    """While a LocalCluster closes, the warnings of its normal shutdown stay out of the terminal: its nannies
    (in this process) kill a worker slow to exit, saying "Worker process still alive after ... killing" (on a
    busy machine, every time). Errors still show."""
    loggers = [logging.getLogger(name) for name in ("distributed.nanny", "distributed.core")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextmanager
def dask_client(address: str | None = None, *, n_workers: int | None = None, trainers: int = 0) -> Iterator[Client]:
    """Yield a Client connected to ``address`` (or $DLRMFLOW_DASK_ADDRESS), else to a new LocalCluster
    (with ``trainers`` trainer workers when > 1)."""
    address = resolve_address(address)
    if not address:
        with _reported(lambda: local_cluster(n_workers, trainers=trainers)) as cluster, \
                Client(cluster, direct_to_workers=True) as client:
            _say_dashboard(client.dashboard_link)
            yield client
        return
    try:
        client = Client(address, timeout="20s", direct_to_workers=True)
    except OSError as exc:
        from dlrmflow.engine.errors import UserInputError

        raise UserInputError(f"cannot reach the Dask scheduler at {address!r}: {exc}") from exc
    with client:
        _say_dashboard(client.dashboard_link)
        yield client


SCHEDULER_SILENCE_SECONDS = 30.0  # a scheduler that does not answer this long is taken as lost


class SchedulerSilentError(RuntimeError):
    """The scheduler did not answer a question within :data:`SCHEDULER_SILENCE_SECONDS`. Not an OSError, which
    the server calls take for their member's loss: its machine, or the link to it, failed, not the member's."""


def cluster_workers(client: Client, timeout: float | None = None) -> dict[str, dict]:
    """The scheduler's info on every worker, keyed by address (as ``client.scheduler_info()["workers"]``);
    ``timeout``: seconds to wait for the answer (None: as long as the connection lives).

    Asked of the scheduler each time, not read from the client's cached identity: the client's
    own periodic refresh stores an identity without workers (``n_workers=0``), and when it lands
    between ``scheduler_info()``'s fetch and its return, the cluster looks empty (seen here:
    "no workers to host embedding servers" on a cluster with five)."""
    return client.sync(client.scheduler.identity, n_workers=-1, callback_timeout=timeout)["workers"]


PROBE_TIMEOUT_SECONDS = 3.0  # a worker's answer to a probe (connection and reply) later than this is a miss
# The scheduler drops the worker of a machine that failed outright (power, link) only after Dask's TCP timeout
# (30 s and more), while the calls to it wait; a trainer's driver, a lone trainer and a call to a server that
# is slow to answer ask the worker (or scheduler) themselves instead.
PROBE_SECONDS = 2.0  # how often a worker (or the scheduler) waited for is probed
SILENT_PROBES = 3  # this many misses in a row: its machine is taken as lost (about 10-12 s)


class SilentWorkers:
    """How many probes in a row each of ``workers`` (Dask addresses, or any names) left unanswered.

    Owned by the code that probes them (the trainers' driver, a lone trainer's watch on the scheduler, a server
    call), the only code that changes it: one :meth:`probed` per round of probes. A worker that answers starts
    again from zero; one that missed ``limit`` in a row is lost (:meth:`probed` returns its index)."""

    def __init__(self, workers: list[str], limit: int = SILENT_PROBES) -> None:
        if limit < 1:
            raise ValueError(f"a worker is lost after at least one missed probe, not {limit}")
        self.workers, self.limit = list(workers), limit
        self.misses = dict.fromkeys(self.workers, 0)

    def probed(self, answered: set[str]) -> list[int]:
        """One round of probes whose answers came from ``answered``; the indices of the workers now lost."""
        for worker in self.workers:
            self.misses[worker] = 0 if worker in answered else self.misses[worker] + 1
        return [index for index, worker in enumerate(self.workers) if self.misses[worker] >= self.limit]

    def silence(self) -> str:
        """What made a worker lost, in words."""
        return f"no answer to {self.limit} probes in a row, each given {PROBE_TIMEOUT_SECONDS:.0f} s"


async def answering_workers(workers: list[str], timeout: float, connection_args: dict[str, Any],
                            **identity_args: Any) -> set[str]:
    """The workers among ``workers`` that answer an ``identity`` call (with ``identity_args``) within ``timeout``
    seconds, asked directly on a connection of its own each (not the scheduler's view, not a pooled connection,
    whose unanswered call could leave a late reply for the next caller)."""
    from distributed.comm import connect
    from distributed.core import send_recv

    async def answers(address: str) -> bool:
        comm = None

        async def ask() -> None:
            nonlocal comm
            comm = await connect(address, timeout=timeout, **connection_args)
            await send_recv(comm, op="identity", reply=True, **identity_args)

        try:
            await asyncio.wait_for(ask(), timeout)
            return True
        except Exception:  # noqa: BLE001 - refused, reset, timed out: every way of not answering is a miss
            return False
        finally:
            if comm is not None:
                comm.abort()

    found = await asyncio.gather(*(answers(address) for address in workers))
    return {address for address, ok in zip(workers, found, strict=True) if ok}


def probe_workers(client: Client, workers: list[str]) -> set[str]:
    """:func:`answering_workers` from synchronous code, on ``client``'s loop and connection arguments, each
    worker given :data:`PROBE_TIMEOUT_SECONDS`."""
    return client.sync(answering_workers, workers, PROBE_TIMEOUT_SECONDS, client.connection_args)


def scheduler_answers(client: Client) -> bool:
    """Whether ``client``'s scheduler answers a probe within :data:`PROBE_TIMEOUT_SECONDS`: asked as
    :func:`answering_workers` asks, on a connection of its own (the client's own would wait for the client's
    reconnection), for its identity without its workers'."""
    address = client.scheduler.address
    return address in client.sync(answering_workers, [address], PROBE_TIMEOUT_SECONDS, client.connection_args,
                                  n_workers=0)


SERVER_START_TIMEOUT_S = 120.0
SERVER_STOP_GRACE_S = 10.0


@dataclass
class ShapedCluster:
    """A running :func:`shaped_cluster`: its scheduler's address, its link, and its server workers' addresses."""

    address: str
    link: ShapedLink
    servers: list[str]


def server_worker_command(link: ShapedLink, scheduler: str, name: str, local_directory: str) -> list[str]:
    """The command of one embedding-server worker: ``dask worker`` inside the link's namespace, listening on the
    namespace's address, advertising the ``embedding_server`` resource, one thread, no nanny (the process
    started is the worker), under :mod:`dlrmflow.exit_with_parent` so that it ends with this process."""
    return link.command([
        sys.executable, "-m", "dlrmflow.exit_with_parent", str(os.getpid()), "distributed.cli.dask_worker",
        scheduler, "--host", link.inside_address, "--nthreads", "1", "--no-nanny", "--no-dashboard",
        "--resources", f"{SERVER_RESOURCE}=1", "--name", name, "--local-directory", local_directory,
        "--death-timeout", "60"])


def _worker_environment() -> dict[str, str]:
    """This process's environment plus what a Dask nanny sets for its workers (one BLAS/OpenMP thread...):
    the servers run as a LocalCluster's would, though without a nanny."""
    env = dict(os.environ)
    env.pop(ADDRESS_ENV, None)
    env.update({k: str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ", {}).items()})
    env.update(housekeeping_environment())
    return env


def housekeeping_environment() -> dict[str, str]:
    """:data:`HOUSEKEEPING`'s intervals and switches as the environment variables a Dask process reads them from
    (``DASK_...``). Not the nannies' environment for their workers: Dask lowercases the names it reads from the
    environment, so no variable can name ``MALLOC_TRIM_THRESHOLD_`` there."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
            for key, value in HOUSEKEEPING.items() if not key.startswith("distributed.nanny.pre-spawn-environ.")}


def _tail(path: Path, lines: int = 5) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in text[-lines:]) or "(no output)"


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every worker (a Dask worker then leaves its scheduler), SIGKILL those still up after the grace."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + SERVER_STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_servers(client: Client, procs: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> list[str]:
    """The server workers' addresses once all have joined; RuntimeError when one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        servers = sorted(a for a, info in cluster_workers(client).items()
                         if (info.get("resources") or {}).get(SERVER_RESOURCE))
        if len(servers) == len(procs):
            return servers
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"an embedding-server worker exited with status {proc.returncode}: {_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(procs) - len(servers)} of {len(procs)} embedding-server workers did not join "
                               f"within {timeout_s:.0f} s: {_tail(logs[0])}")
        time.sleep(0.2)


@contextmanager
def shaped_cluster(rate_bits_per_s: int | None, n_servers: int = 2, *, extra_workers: int = 0, trainers: int = 0,
                   start_timeout_s: float = SERVER_START_TIMEOUT_S) -> Iterator[ShapedCluster]:
    """A Dask cluster whose ``n_servers`` embedding-server workers sit behind a link shaped at
    ``rate_bits_per_s`` (None or 0: the same link unshaped).

    The scheduler runs in this process on the link's root-side address, with ``extra_workers`` ordinary
    worker processes beside it (in this namespace: work that is not an embedding server never crosses
    the link; ``trainers`` > 1 adds that many trainer workers, as :func:`local_cluster` does). The server workers
    run inside the link's namespace (:func:`server_worker_command`). A
    client of the scheduler in this process, talking to workers directly as :func:`dask_client`'s do,
    reaches a server only through the link. Everything is stopped and removed when the block ends;
    :class:`~dlrmflow.engine.serving.shaped_link.LinkUnavailableError` (one line) where the link cannot be built."""
    if n_servers < 1:
        raise ValueError(f"need at least one embedding-server worker, got {n_servers}")
    with ExitStack() as stack:
        link = stack.enter_context(shaped_link(rate_bits_per_s))
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dlrmflow-shaped-")))
        cluster = stack.enter_context(local_cluster(extra_workers, host=link.root_address, trainers=trainers))
        procs: list[subprocess.Popen] = []
        stack.callback(_stop, procs)  # before the scheduler closes and the link goes: unwound first
        logs = [home / f"server-{k}.log" for k in range(n_servers)]
        env = _worker_environment()
        for k, log in enumerate(logs):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(
                    server_worker_command(link, cluster.scheduler_address, f"server-{k}", str(home / f"server-{k}")),
                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=home, start_new_session=True))
        with Client(cluster.scheduler_address, timeout="30s") as client:
            servers = _wait_for_servers(client, procs, logs, start_timeout_s)
        yield ShapedCluster(cluster.scheduler_address, link, servers)


@contextmanager
def shaped_scheduler(rate_bits_per_s: int | None, n_servers: int = 2, *, extra_workers: int = 0,
                     trainers: int = 0) -> Iterator[str]:
    """:func:`shaped_cluster`'s scheduler address: what ``dask_scheduler`` yields, for train_flow and train's client."""
    with shaped_cluster(rate_bits_per_s, n_servers, extra_workers=extra_workers, trainers=trainers) as cluster:
        yield cluster.address
