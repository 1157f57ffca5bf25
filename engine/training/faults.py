"""Failure injection: SIGKILL the Dask worker process that hosts an embedding shard.

``--kill shard:I@ITER`` kills the worker of data shard ``I`` when iteration ``ITER`` starts;
``--kill parity:J@ITER`` the worker of parity shard ``J``. The process id comes from the
worker itself (``client.run(os.getpid, workers=[addr])``) and the signal is sent from the
trainer's machine, so the workers must run there (a LocalCluster, or workers started locally).
Nothing tells the trainer about the kill: it finds out when a call to the dead actor fails.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlrmflow.engine.errors import UserInputError

# Each kill, as it happens (a plain logger: the train flow routes it to the run's Prefect log).
EVENTS = logging.getLogger(__name__)
KILL_SYNTAX = "shard:I@ITER or parity:J@ITER"
_KILL = re.compile(r"^(shard|parity):(\d+)@(\d+)$")


class FaultSpecError(UserInputError):
    """A --kill argument is malformed or names a shard or iteration that does not exist."""


@dataclass(frozen=True)
class Kill:
    kind: str  # "shard" | "parity"
    index: int
    iteration: int

    def member(self, k: int) -> int:
        return self.index if self.kind == "shard" else k + self.index

    @property
    def target(self) -> str:
        """What it kills, as the run's reports name it: ``data shard I`` or ``parity shard J``."""
        return f"{'data' if self.kind == 'shard' else 'parity'} shard {self.index}"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}@{self.iteration}"


def parse_kill(text: str) -> Kill:
    match = _KILL.match(text.strip())
    if not match:
        raise FaultSpecError(f"kills: --kill {text!r}: expected {KILL_SYNTAX} (e.g. shard:0@10)")
    return Kill(match[1], int(match[2]), int(match[3]))


def check_kills(kills: Sequence[str], *, num_shards: int, parity: int, iterations: int | None) -> list[Kill]:
    """The rule for ``--kill`` (the ``kills`` setting), wherever kills are given: each parses, names a
    shard of the group (data shards ``0..num_shards-1``, parity shards ``0..parity-1``) and an iteration
    of the run (``iterations``: None while the count is not known yet), and no shard is named twice."""
    parsed = [parse_kill(k) for k in kills]
    for kill in parsed:
        limit = num_shards if kill.kind == "shard" else parity
        if kill.index >= limit:
            what = f"--shards {num_shards}" if kill.kind == "shard" else f"--parity {parity}"
            raise FaultSpecError(f"kills: --kill {kill}: there is no {kill.kind} {kill.index} with {what}")
        if iterations is not None and kill.iteration >= iterations:
            raise FaultSpecError(f"kills: --kill {kill}: iteration {kill.iteration} is past the last one "
                                 f"({iterations - 1})")
    if len({(k.kind, k.index) for k in parsed}) != len(parsed):
        raise FaultSpecError("kills: --kill names the same shard twice")
    return parsed


class FaultInjector:
    """Kills the workers named by ``kills`` at the start of their iterations; logs what it did."""

    def __init__(self, kills: list[Kill], client: Any, worker_of, k: int) -> None:
        self.kills, self.client, self.worker_of, self.k = kills, client, worker_of, k
        self.log: list[dict[str, Any]] = []
        self.fired: set[Kill] = set()
        self.pids: dict[str, int] = {}  # worker address -> its process id, looked up an iteration ahead

    def before_iteration(self, t: int) -> None:
        for kill in self.kills:
            if kill.iteration == t and kill not in self.fired:  # once, also when a checkpoint replays t
                self.fired.add(kill)
                self.kill(kill)
            elif kill.iteration == t + 1 and kill not in self.fired:
                # A real failure sends nothing: asked at the kill, the pid would add a round trip to the
                # Dask worker to the iteration the kill slows down.
                self._pid(self.worker_of(kill.member(self.k)))

    def _pid(self, address: str) -> int:
        if address not in self.pids:
            self.pids[address] = self.client.run(os.getpid, workers=[address])[address]
        return self.pids[address]

    def kill(self, kill: Kill) -> None:
        address = self.worker_of(kill.member(self.k))
        pid = self._pid(address)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # the worker at that address was restarted since the look-up
            self.pids.pop(address)
            pid = self._pid(address)
            os.kill(pid, signal.SIGKILL)
        self.log.append({"kill": str(kill), "worker": address, "pid": pid, "at": time.perf_counter()})
        EVENTS.info("killed %s: SIGKILL to its Dask worker %s (pid %d) at the start of iteration %d",
                    kill.target, address, pid, kill.iteration)


def kills_since(log: list[dict[str, Any]], origin: float) -> list[dict[str, Any]]:
    """The kills done (:attr:`FaultInjector.log`), each with ``at_s`` on the clock of its report
    (``clock_origin``), so that a recovery's ``detected_s`` minus it is how long the loss went unnoticed."""
    return [{**{k: v for k, v in kill.items() if k != "at"}, "at_s": kill["at"] - origin} for kill in log]
