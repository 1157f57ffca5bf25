"""Where the trainers run: one in this process, or W data-parallel trainers as processes on Dask workers,
synchronised by torch.distributed.

:func:`run_trainers` runs a group of one in the caller's process. For W > 1 it places one trainer per
worker process (:func:`~dlrmflow.engine.serving.placement.place_trainers`), picks a rendezvous port on rank
0's worker, submits :func:`train_on_worker` to each, relays rank 0's progress to its callbacks, and
watches the trainers' workers: a trainer whose worker dies, or whose machine stops answering the driver's
own probes (:class:`~dlrmflow.engine.serving.cluster.SilentWorkers`), fails the run with
:class:`TrainerLostError`, one line naming the trainer; a trainer that raises fails it with its own error,
and the workers of trainers left blocked in a collective are restarted (:func:`release_blocked_trainers`).
Each trainer runs :func:`~.trainer.train_rank`.

Each trainer reads and trains its slice ``rank * B/W .. (rank + 1) * B/W - 1`` of every global batch. What it
must know of the others' slices (the stores decide from it what to sync, fetch and write) comes from one
pass over the batches' ids before the trainers start (:func:`~.trainer_slices.prepare_trainers`).
Every trainer starts from the same model (same seed) and applies the same mean gradient, so the dense
parameters stay identical; rank 0 returns them. The trainers end with every row home on its server.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.phases import engine_events_to, phase_reported
from dlrmflow.engine.serving.cluster import (
    PROBE_SECONDS,
    PROBE_TIMEOUT_SECONDS,
    SCHEDULER_SILENCE_SECONDS,
    SILENT_PROBES,
    SilentWorkers,
    cluster_workers,
    probe_workers,
    scheduler_answers,
)
from dlrmflow.engine.serving.placement import (
    GPU_RESOURCE,
    TRAINER_RESOURCE,
    WORKER_LOG,
    eligible_workers,
    host_of,
    place_trainers,
    where_placed,
)
from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.run_context import RunContext
from dlrmflow.engine.training.run_directory import CHECKPOINT_FILE, resume_command
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.trainer import train_rank
from dlrmflow.engine.training.trainer_slices import prepare_trainers

EVENTS = logging.getLogger(__name__)  # a dlrmflow.engine logger: the run's log and the CLI's stderr show it
WATCH_SECONDS = 0.5  # how often the driver looks at the trainers' workers and progress
STOP_GRACE_SECONDS = 5.0  # after a failure, how long the other trainers get to stop on their own
CAUSE_WAIT_SECONDS = 2.0  # after a collective failed for a peer that left, how long to wait for that peer's error
RESTART_TIMEOUT_SECONDS = 60.0
REPORT_SECONDS = 0.5  # rank 0 sends progress at most this often (and at every metrics row)


class TrainerLostError(UserInputError):
    """A trainer process died, or its machine stopped answering: the run cannot go on without its slice of the
    batch. ``worker``: the lost trainer's Dask worker."""

    def __init__(self, message: str, worker: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker


class SchedulerLostError(UserInputError):
    """The Dask scheduler stopped answering (its machine failed): its workers, the trainers', close with it."""


class SchedulerWatch:
    """Whether the Dask scheduler still answers, while one trainer trains in this process.

    A lone trainer's calls go straight to its servers' workers, so it trains on without a scheduler and would
    notice its loss only in the run's last steps, which need the cluster (after the client's own connection
    timeout, with its traceback). A thread of its own probes the scheduler (``ask``: whether it answered within
    the probe's timeout) every ``every`` seconds; ``limit`` misses in a row and the scheduler is lost: the
    thread keeps why in :attr:`lost` (it is its only writer), calls ``on_lost`` and asks no more. The trainer
    reads :attr:`lost` between iterations; :meth:`verdict` settles it for an error the run met meanwhile."""

    def __init__(self, ask: Callable[[], bool], every: float = PROBE_SECONDS, limit: int = SILENT_PROBES,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.ask, self.every, self.on_lost = ask, every, on_lost
        self.silent = SilentWorkers(["scheduler"], limit)
        self.lost: str | None = None
        self._probing = threading.Lock()  # the watch's thread, or verdict's caller: one probe at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlrmflow-scheduler-watch", daemon=True)

    def __enter__(self) -> SchedulerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # a probe in flight ends on its own timeout; the daemon thread is not waited for

    def _probe(self) -> bool:
        """One probe; True when the scheduler is lost."""
        with self._probing:
            return self.lost is not None or self._probed()

    def _probed(self) -> bool:
        if self.silent.probed({"scheduler"} if self.ask() else set()):
            self.lost = self.silent.silence()
            if self.on_lost is not None:
                self.on_lost()
            return True
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if self._probe():
                return

    def verdict(self) -> str | None:
        """Whether the scheduler is lost, for an error the run met: the watch's finding, else probes now until
        one is answered (a live scheduler: at once) or the scheduler is lost."""
        if self.lost is None:
            self._stop.set()  # from here this thread probes, and the watch's thread stops
            while not self._probe():
                if self.silent.misses["scheduler"] == 0:
                    return None
        return self.lost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _worker_threads() -> int:
    from distributed import get_worker

    return max(1, get_worker().state.nthreads)


def trainer_device(device: str, rank: int, *, own_gpu: bool, gpus: int) -> torch.device:
    """Where trainer ``rank`` of several trains for ``--device device``: ``cuda`` is the GPU its worker owns
    (``own_gpu``: the worker advertises :data:`GPU_RESOURCE`; it sees that GPU first), else GPU ``rank mod
    gpus`` of the ``gpus`` its process sees (dlrmflow's own LocalCluster: W trainers on fewer GPUs share them)."""
    if not device.startswith("cuda"):
        return torch.device(device)
    if gpus < 1:
        raise UserInputError(f"device: --device {device}: trainer {rank}'s Dask worker sees no CUDA GPU")
    return torch.device("cuda", 0 if own_gpu else rank % gpus)


def train_on_worker(setup: RunSetup, rank: int, size: int, init_method: str, progress_topic: str | None = None
                    ) -> dict[str, Any]:
    """One trainer process's whole run (a Dask task): rank ``rank`` of ``size`` joined at ``init_method``;
    trainer 0 sends its progress as events on ``progress_topic``."""
    from distributed import get_client, get_worker

    torch.set_num_threads(_worker_threads())
    config = setup.config
    worker = get_worker()
    device = trainer_device(config.device, rank, own_gpu=worker.state.total_resources.get(GPU_RESOURCE, 0) > 0,
                            gpus=torch.cuda.device_count() if config.device.startswith("cuda") else 0)
    WORKER_LOG.info("dlrmflow trainer %d of %d on %s: rows %d..%d of every batch of %d, %d threads", rank, size,
                    device, rank * config.batch_size // size, (rank + 1) * config.batch_size // size - 1,
                    config.batch_size, torch.get_num_threads())
    last_report = [0.0]

    def report(done: int, row: dict[str, Any] | None) -> None:
        if progress_topic is not None and (row or time.perf_counter() - last_report[0] > REPORT_SECONDS):
            worker.log_event(progress_topic, {"done": done, "metrics": row})
            last_report[0] = time.perf_counter()

    host = host_of(worker.address, {})
    with _events_to_driver(worker, progress_topic, rank):
        return train_rank(setup, TrainerGroup(rank, size, init_method, address=host),
                          RunContext.on_worker(get_client()), report=report, worker=worker.address, device=device)


class _EventsToDriver(logging.Handler):
    """On a trainer's worker: the engine's events (``dlrmflow.engine`` loggers) sent to the driver on the run's
    topic, which logs them again under the same logger, so that the run's log and the CLI's stderr show
    them as they show one trainer's: trainer 0's (the servers' placement, a loss and its rebuild, the
    checkpoints, the final state) and the others' warnings, named by their trainer."""

    def __init__(self, worker: Any, topic: str, rank: int) -> None:
        super().__init__(logging.INFO if rank == 0 else logging.WARNING)
        self.worker, self.topic, self.prefix = worker, topic, "" if rank == 0 else f"trainer {rank}: "

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.worker.log_event(self.topic, {"log": (record.name, record.levelno,
                                                       self.prefix + record.getMessage())})
        except Exception:  # noqa: BLE001 - a lost event line must not fail the training
            self.handleError(record)


@contextmanager
def _events_to_driver(worker: Any, topic: str | None, rank: int) -> Iterator[None]:
    if topic is None:
        yield
        return
    with engine_events_to(_EventsToDriver(worker, topic, rank)):
        yield


def run_trainers(setup: RunSetup, context: RunContext) -> list[dict[str, Any]]:
    """Run ``setup.config.trainers`` trainers; every trainer's result, in rank order (module docstring).

    ``context``: the caller's. One trainer runs in this process with it; W trainers run on the workers
    of ``context.client``, each with a context of its own (no callbacks: trainer 0's progress comes back
    as events, relayed here to ``context.progress`` and ``context.on_metrics``)."""
    progress, on_metrics, client = context.progress, context.on_metrics, context.client
    if setup.config.trainers == 1:
        return [_train_here(setup, context)]
    if client is None:
        raise ValueError(f"--trainers {setup.config.trainers} needs a Dask client to run the trainers on")
    size = setup.config.trainers
    info = answering_candidates(client, cluster_workers(client))
    workers = place_trainers(info, size, gpu=setup.config.device.startswith("cuda"))
    EVENTS.info("trainers on %s", where_placed([f"trainer {r}" for r in range(size)], workers, info))
    setup = prepare_trainers(setup, setup.config.output_dir)
    port = client.submit(_free_port, workers=[workers[0]], pure=False).result()
    host = workers[0].split("://", 1)[-1].rsplit(":", 1)[0]
    init_method = f"tcp://{host}:{port}"
    run_id = uuid.uuid4().hex[:12]
    topic = f"dlrmflow-trainers-{run_id}"
    reports: queue.Queue = queue.Queue()
    client.subscribe_topic(topic, lambda event: reports.put(event[1]))  # (time, message), on the client's loop
    futures = [client.submit(train_on_worker, setup, rank, size, init_method, topic,
                             workers=[worker], allow_other_workers=False, pure=False, retries=0,
                             key=f"dlrmflow-trainer-{rank}-{run_id}")
               for rank, worker in enumerate(workers)]
    scheduler_lost = False
    try:
        _watch(client, futures, workers, reports, setup, progress, on_metrics)
        return [future.result() for future in futures]
    except SchedulerLostError:
        scheduler_lost = True  # nothing to release, cancel or unsubscribe: its workers close with it
        raise
    except BaseException as exc:
        gone = {exc.worker} if isinstance(exc, TrainerLostError) and exc.worker else set()
        # A peer whose machine is gone leaves the others in a collective until gloo's timeout: no grace.
        release_blocked_trainers(client, futures, workers, grace_s=0.0 if gone else STOP_GRACE_SECONDS, gone=gone)
        raise
    finally:
        if not scheduler_lost:
            client.cancel(futures)
            client.unsubscribe_topic(topic)


def _train_here(setup: RunSetup, context: RunContext) -> dict[str, Any]:
    """The one trainer of ``setup``, in this process; with a Dask client, stopped in one line
    (:class:`SchedulerLostError`) when the scheduler stops answering (:class:`SchedulerWatch`)."""
    progress, on_metrics, client, done = context.progress, context.on_metrics, context.client, 0
    watch = None if client is None else SchedulerWatch(lambda: scheduler_answers(client),
                                                       on_lost=_quiet_client_reconnects)

    def report(t: int, row: dict[str, Any] | None) -> None:
        nonlocal done
        done = t
        if watch is not None and watch.lost is not None:
            raise SchedulerLostError(_scheduler_lost_message(setup, client, done, watch.lost))
        if progress is not None:
            progress(t, setup.iterations)
        if row is not None and on_metrics is not None:
            on_metrics(row)

    with watch or nullcontext():
        try:
            return train_rank(setup, TrainerGroup.alone(), context, report=report)
        except UserInputError:
            raise  # the run's own one line (bad input, a loss it names, or the scheduler's above)
        except Exception:
            lost = None if watch is None else watch.verdict()
            if lost is not None:  # what failed needed the scheduler (the final evaluation, a rebuild, ...)
                raise SchedulerLostError(_scheduler_lost_message(setup, client, done, lost)) from None
            raise


class _NoClientErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def _quiet_client_reconnects() -> None:
    """Once the scheduler is lost, the Dask client's own errors (its reconnection giving up, with a traceback)
    say nothing the run's one line does not: they are not shown. The command ends with that line."""
    logging.getLogger("distributed.client").addFilter(_NoClientErrors())


def answering_candidates(client, info: dict[str, dict]) -> dict[str, dict]:
    """``info`` (the scheduler's workers) less the workers that may run a trainer but do not answer a probe: the
    scheduler lists a machine that failed outright until Dask's TCP timeout, and a trainer placed there (a
    resume started right after a trainer machine's loss) would leave the others waiting for it."""
    candidates = eligible_workers(info, TRAINER_RESOURCE)
    answered = probe_workers(client, candidates)
    silent = [w for w in candidates if w not in answered]
    if silent:
        EVENTS.warning("trainers: not placed on %s: no answer within %.0f s (the scheduler still lists them; their "
                       "machine may have failed)", ", ".join(silent), PROBE_TIMEOUT_SECONDS)
    return {w: i for w, i in info.items() if w not in silent}


def release_blocked_trainers(client, futures, workers: list[str], grace_s: float = STOP_GRACE_SECONDS,
                             gone: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """After the run failed: the workers of trainers still running ``grace_s`` later, restarted; returns them.
    ``gone``: workers taken as lost (their machine stopped answering), never restarted: the scheduler may list
    them still, and a restart would wait for a machine that is not there.

    A trainer whose peer raised can stay blocked in a collective until the gloo timeout (10 minutes), even
    though the peer destroyed its process group (seen with LRPP: trainer 0 in the dense gradients' all_gather
    after trainer 1 raised). Cancelling its Dask task does not stop the thread, which holds the worker: the
    next run's trainer would queue behind it and its peers wait in turn. A peer that died, or a trainer that
    raised, lets the others fail at once; those that did not within ``grace_s`` get a fresh process from
    their nanny (Dask's remedy for a hung worker)."""
    deadline = time.monotonic() + grace_s
    while any(f.status == "pending" for f in futures) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = cluster_workers(client)
    blocked = [w for f, w in zip(futures, workers, strict=True)
               if f.status == "pending" and w in alive and w not in gone]
    if blocked:
        with phase_reported(f"trainers: restarting {len(blocked)} trainer worker(s) still waiting for the "
                            f"failed trainer ({', '.join(blocked)})"):
            try:
                client.restart_workers(blocked, timeout=RESTART_TIMEOUT_SECONDS)
            except Exception as exc:  # noqa: BLE001 - the run's own error matters more; say why and go on
                EVENTS.warning("trainers: could not restart %s (%s: %s); they free themselves after the "
                               "collectives' timeout", ", ".join(blocked), type(exc).__name__, exc)
    return blocked


def _watch(client, futures, workers, reports: queue.Queue, setup: RunSetup, progress, on_metrics) -> None:
    """Until every trainer finished: relay rank 0's reports; raise as soon as a trainer failed or its
    worker is gone (a dead worker's task would wait for it forever: it may run nowhere else)."""
    n, done = setup.iterations, 0

    def relay(report: dict[str, Any]) -> None:
        nonlocal done
        if "log" in report:  # a trainer's event line (_EventsToDriver): logged here as it was there
            name, level, message = report["log"]
            logging.getLogger(name).log(level, "%s", message)
            return
        if report["done"] <= done:
            return
        done = report["done"]
        if progress is not None:
            progress(done, n)
        if report["metrics"] is not None and on_metrics is not None:
            on_metrics(report["metrics"])

    silent, next_probe = SilentWorkers(workers), time.monotonic() + PROBE_SECONDS
    while True:
        try:
            relay(reports.get(timeout=WATCH_SECONDS))
            continue
        except queue.Empty:
            pass
        try:
            alive = cluster_workers(client, timeout=SCHEDULER_SILENCE_SECONDS)
        except Exception as exc:  # noqa: BLE001 - no answer, or a client that gave its scheduler up
            raise SchedulerLostError(_scheduler_lost_message(setup, client, done, exc)) from None
        for rank, worker in enumerate(workers):
            if worker not in alive:
                raise TrainerLostError(_lost_message(setup, rank, worker, done), worker)
        if time.monotonic() >= next_probe:
            lost = silent.probed(probe_workers(client, workers))
            next_probe = time.monotonic() + PROBE_SECONDS
            if lost:
                why = f"its machine stopped answering: {silent.silence()}"
                raise TrainerLostError(_lost_message(setup, lost[0], workers[lost[0]], done, why), workers[lost[0]])
        if any(f.status == "error" for f in futures):
            _raise_the_cause(futures)
        if all(f.status == "finished" for f in futures):
            # Events and results travel separately: the last reports may still be on their way.
            deadline = time.monotonic() + 5.0
            while done < n and time.monotonic() < deadline:
                try:
                    relay(reports.get(timeout=0.1))
                except queue.Empty:
                    pass
            return


def _peer_left(exc: BaseException | None) -> bool:
    """A collective that failed because a peer closed its sockets (it raised or died first): a consequence."""
    text = str(exc)
    return "gloo" in text and ("Connection reset by peer" in text or "Connection closed by peer" in text)


def _raise_the_cause(futures) -> None:
    """Re-raise the error of the trainer that failed first: the first failed trainer (rank order) whose error
    is not :func:`_peer_left`, waiting up to :data:`CAUSE_WAIT_SECONDS` for it; else the first failure."""
    deadline = time.monotonic() + CAUSE_WAIT_SECONDS
    while True:
        failed = [f for f in futures if f.status == "error"]
        causes = [f for f in failed if not _peer_left(f.exception())]
        if causes or time.monotonic() > deadline or not any(f.status == "pending" for f in futures):
            (causes or failed)[0].result()  # re-raises that trainer's error
        time.sleep(0.1)


def _stopped(setup: RunSetup, what: str, resume_when: str) -> str:
    """A stopped run's one line: ``what`` happened, then how to go on: ``dlrmflow resume`` (``resume_when``)
    when the run has a checkpoint, else run it again."""
    config = setup.config
    if config.checkpoint_every and (Path(config.output_dir) / CHECKPOINT_FILE).exists():
        return (f"{what}; continue the run from its last checkpoint with `{resume_command(config.output_dir)}` "
                f"{resume_when}")
    return f"{what}; the run stopped and {config.output_dir} holds no result: run it again"


def _scheduler_lost_message(setup: RunSetup, client, done: int, exc: BaseException | str) -> str:
    address = getattr(client.scheduler, "address", None) or "its address"
    why = (exc if isinstance(exc, str) else f"no answer for {SCHEDULER_SILENCE_SECONDS:.0f} s"
           if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {str(exc).rstrip('.')}")
    trainers = setup.config.trainers
    lost = f"lost the Dask scheduler at {address} after iteration {done} of {setup.iterations} ({why}; its machine "
    if trainers == 1:  # the trainer is this process: the servers' workers are what must run again
        return _stopped(setup, lost + "may have failed)",
                        "(with --dask-address, or $DLRMFLOW_DASK_ADDRESS, naming the new scheduler) once a scheduler "
                        "and its workers run again")
    return _stopped(setup, lost + "may have failed); the trainers' workers close with it",
                    f"(with --dask-address, or $DLRMFLOW_DASK_ADDRESS, naming the new scheduler) once a scheduler "
                    f"and {trainers} workers that may run a trainer (`--resources trainer=1`) run again")


def _lost_message(setup: RunSetup, rank: int, worker: str, done: int, why: str = "") -> str:
    trainers = setup.config.trainers
    lost = f"was lost ({why})" if why else "died"
    return _stopped(setup, f"trainer {rank} of {trainers} (Dask worker {worker}) {lost} after iteration {done} of "
                           f"{setup.iterations}",
                    f"once the cluster has {trainers} workers that may run a trainer (`--resources trainer=1`)")
