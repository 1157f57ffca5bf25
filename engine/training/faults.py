"""Failure injection: SIGKILL the Dask worker process that hosts an embedding shard.

``--kill shard:I@ITER`` kills the worker of data shard ``I`` when iteration ``ITER`` starts;
``--kill parity:J@ITER`` the worker of parity shard ``J``. The process id comes from the
worker itself (``client.run(os.getpid, workers=[addr])``) and the signal is sent from the
trainer's machine, so the workers must run there (a LocalCluster, or workers started locally).
Nothing tells the trainer about the kill: it finds out when a call to the dead actor fails.

A shard may be named again at a later iteration (``--kill shard:0@30 --kill shard:0@121``): each
kill SIGKILLs the worker that hosts the shard at its iteration, after a rebuild the replacement's, so
a run can lose more than R members in all, never more than R at once. A kill whose shard has no live
worker then (it is still being rebuilt) kills nothing: it is logged and recorded
(:attr:`FaultInjector.missed`).
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


@dataclass(frozen=True)
class FaultKind:
    """A kind of kill: ``NAME:INDEX@ITER`` SIGKILLs the worker of that shard when iteration ITER starts."""

    name: str  # as a kill names it: shard:0@10
    index: str  # the letter of its index in the syntax: shard:I@ITER
    target: str  # what it kills, as the run's reports name it: "data shard"
    parity: bool  # a parity shard (member K + index), else a data shard (member index)


# The kinds of kill, declared once: the syntax, the parser, the checks, the reports and the options follow.
FAULT_KINDS = {kind.name: kind for kind in (FaultKind("shard", "I", "data shard", parity=False),
                                            FaultKind("parity", "J", "parity shard", parity=True))}
KILL_FORMS = tuple(f"{kind.name}:{kind.index}@ITER" for kind in FAULT_KINDS.values())
KILL_SYNTAX = " or ".join(KILL_FORMS)  # shard:I@ITER or parity:J@ITER
KILL_METAVAR = "|".join(KILL_FORMS)  # the option's metavar: shard:I@ITER|parity:J@ITER
_KILL = re.compile(rf"^({'|'.join(FAULT_KINDS)}):(\d+)@(\d+)$")


class FaultSpecError(UserInputError):
    """A --kill argument is malformed or names a shard or iteration that does not exist."""


@dataclass(frozen=True)
class Kill:
    kind: str  # a name of FAULT_KINDS: "shard" | "parity"
    index: int
    iteration: int

    def member(self, k: int) -> int:
        return k + self.index if FAULT_KINDS[self.kind].parity else self.index

    @property
    def target(self) -> str:
        """What it kills, as the run's reports name it: ``data shard I`` or ``parity shard J``."""
        return f"{FAULT_KINDS[self.kind].target} {self.index}"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}@{self.iteration}"


@dataclass(frozen=True)
class KillNames:
    """How a kill's error names the settings: ``dlrmflow train``'s options (the default), or a config's
    fields (the pipeline's: ``KillNames(kill="", shard="shards", parity="parity", iterations="train_iterations")``)."""

    kill: str = "--kill"  # before each kill the message quotes
    shard: str = "--shards"  # the setting that counts the data shards
    parity: str = "--parity"  # the setting that counts the parity shards
    iterations: str | None = None  # the setting that counts the iterations (None: not named)

    def of(self, kill: object) -> str:
        return f"{self.kill} {kill}" if self.kill else str(kill)


CLI_NAMES = KillNames()  # as dlrmflow train names them


def parse_kill(text: str, names: KillNames = CLI_NAMES) -> Kill:
    match = _KILL.match(text.strip())
    if not match:
        raise FaultSpecError(f"kills: {names.of(repr(text))}: expected {KILL_SYNTAX} (e.g. shard:0@10)")
    return Kill(match[1], int(match[2]), int(match[3]))


def check_kills(kills: Sequence[str], *, num_shards: int, parity: int, iterations: int | None,
                names: KillNames = CLI_NAMES) -> list[Kill]:
    """The rule for ``--kill`` (the ``kills`` setting), wherever kills are given: each parses, names a
    shard of the group (data shards ``0..num_shards-1``, parity shards ``0..parity-1``) and an iteration
    of the run (``iterations``: None while the count is not known yet), and no kill is named twice. A
    shard may be named at several iterations: each kill takes the worker that hosts it then (after a
    rebuild, the replacement's). ``names``: how the messages name the settings (the CLI's options unless
    given)."""
    parsed = [parse_kill(k, names) for k in kills]
    for kill in parsed:
        limit, setting = (parity, names.parity) if FAULT_KINDS[kill.kind].parity else (num_shards, names.shard)
        if kill.index >= limit:
            raise FaultSpecError(f"kills: {names.of(kill)}: there is no {kill.kind} {kill.index} with {setting} "
                                 f"{limit}")
        if iterations is not None and kill.iteration >= iterations:
            counted = f", with {names.iterations} {iterations}" if names.iterations else ""
            raise FaultSpecError(f"kills: {names.of(kill)}: iteration {kill.iteration} is past the last one "
                                 f"({iterations - 1}{counted})")
    seen: dict[Kill, Kill] = {}
    for kill in parsed:
        first = seen.setdefault(kill, kill)
        if first is not kill:
            raise FaultSpecError(f"kills: {names.of(first)} and {names.of(kill)} name the same kill twice "
                                 f"(a shard may be killed again at another iteration)")
    return parsed


class FaultInjector:
    """Kills the workers named by ``kills`` at the start of their iterations; logs what it did.

    ``worker_of(member)``: the address of the worker that hosts the member now (its replacement's once a
    rebuild finished; None if it has none). Each kill looks it up at its own iteration, so a shard killed
    again after its rebuild takes the replacement's worker. The pid is looked up an iteration ahead and
    cached per address; an address this injector killed is never asked or signalled again: while the
    member's table still names it, the member is being rebuilt and has no live worker, and the kill
    finds none (:attr:`missed`: logged and recorded, the run goes on). A failed look-up never stops the
    run either: the kill is recorded as missed (a look-up ahead that failed is not tried again at the
    kill: a dead worker's address waits out Dask's connect timeout)."""

    def __init__(self, kills: list[Kill], client: Any, worker_of, k: int) -> None:
        self.kills, self.client, self.worker_of, self.k = kills, client, worker_of, k
        self.log: list[dict[str, Any]] = []  # the kills done
        self.missed: list[dict[str, Any]] = []  # the kills that found no live worker to kill
        self.fired: set[Kill] = set()
        self.pids: dict[str, int] = {}  # worker address -> its process id, looked up an iteration ahead
        self.killed: set[str] = set()  # the worker addresses this injector killed
        self.unreachable: dict[str, Exception] = {}  # worker address -> why its look-up ahead failed

    def before_iteration(self, t: int) -> None:
        for kill in self.kills:
            if kill.iteration == t and kill not in self.fired:  # once, also when a checkpoint replays t
                self.fired.add(kill)
                self.kill(kill)
            elif kill.iteration == t + 1 and kill not in self.fired:
                # A real failure sends nothing: asked at the kill, the pid would add a round trip to the
                # Dask worker to the iteration the kill slows down. A member being rebuilt now may have
                # its replacement's worker by then: the kill looks it up again (one round trip).
                address = self._live_worker(kill)
                if address is not None:
                    try:
                        self._pid(address)
                    except Exception as exc:  # noqa: BLE001 - the kill reports it
                        self.unreachable[address] = exc

    def _live_worker(self, kill: Kill) -> str | None:
        """The address of the worker hosting ``kill``'s member now; None while it has none (its table
        still names a worker this injector killed: the rebuild has not finished)."""
        address = self.worker_of(kill.member(self.k))
        return None if address is None or address in self.killed else address

    def _pid(self, address: str) -> int:
        if address not in self.pids:
            self.pids[address] = self.client.run(os.getpid, workers=[address])[address]
        return self.pids[address]

    def kill(self, kill: Kill) -> None:
        address = self._live_worker(kill)
        if address is None:
            dead = self.worker_of(kill.member(self.k))
            self._missed(kill, dead, f"it has no live worker: its worker {dead} is dead and no rebuild has given "
                                     f"it a new one yet")
            return
        try:
            if address in self.unreachable:
                raise self.unreachable.pop(address)
            pid = self._pid(address)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # the worker at that address was restarted since the look-up
                self.pids.pop(address)
                pid = self._pid(address)
                os.kill(pid, signal.SIGKILL)
        except Exception as exc:  # noqa: BLE001 - a failed injection is reported, never the run's failure
            self.pids.pop(address, None)
            self._missed(kill, address, f"its worker did not give its pid or take the signal ({exc!r})")
            return
        self.pids.pop(address)  # that process is gone: a later kill asks whatever runs there then
        self.killed.add(address)
        self.log.append({"kill": str(kill), "worker": address, "pid": pid, "at": time.perf_counter()})
        EVENTS.info("killed %s: SIGKILL to its Dask worker %s (pid %d) at the start of iteration %d",
                    kill.target, address, pid, kill.iteration)

    def _missed(self, kill: Kill, address: str | None, why: str) -> None:
        self.missed.append({"kill": str(kill), "worker": address, "why": why, "at": time.perf_counter()})
        EVENTS.warning("kill %s found nothing to kill at the start of iteration %d: %s", kill, kill.iteration, why)


def kills_since(log: list[dict[str, Any]], origin: float) -> list[dict[str, Any]]:
    """The kills done (:attr:`FaultInjector.log`), each with ``at_s`` on the clock of its report
    (``clock_origin``), so that a recovery's ``detected_s`` minus it is how long the loss went unnoticed."""
    return [{**{k: v for k, v in kill.items() if k != "at"}, "at_s": kill["at"] - origin} for kill in log]
