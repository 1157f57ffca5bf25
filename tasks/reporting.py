"""Progress, artifacts and engine events: how engine work shows up in the terminal and the Prefect UI.

This module is the one place that publishes artifacts. Every table goes through one formatter
(:func:`format_table`, :func:`metric_table`): plain-English headers with the unit in brackets,
numbers rounded (counts of 1,000 and more with thousands separators, as text), lists joined into
text, never a Python repr. Every key goes through :func:`artifact_key`; a run's keys and its flow
run's name carry :func:`run_dir_label`, which identifies the run directory, so a run repeated in
its directory (every night) adds versions to its own keys and never to another run's.

The engine reports progress through a plain ``(done, total)`` callback; :class:`FlowProgress` is
that callback for flows: it logs a line and keeps a Prefect progress artifact up to date. The
engine reports events (a kill, a loss, a rebuild) on standard :mod:`logging` loggers under
``dlrmflow.engine``; :func:`engine_events_to_run_log` sends them to a run's Prefect log.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from dlrmflow.engine.phases import ENGINE_LOGGER, engine_events_to
from dlrmflow.engine.training.modes import MODES

# ---- keys ---------------------------------------------------------------------------------------

_NOT_IN_KEY = re.compile(r"[^a-z0-9]+")


def artifact_key(*parts: object) -> str:
    """A Prefect artifact key from ``parts`` (e.g. ``("train-summary", "criteo", "oracle")`` ->
    ``train-summary-criteo-oracle``): lowercase letters, digits and single dashes only, as Prefect requires."""
    text = "-".join(str(p) for p in parts if p not in (None, ""))
    return _NOT_IN_KEY.sub("-", text.lower()).strip("-")


def dataset_label(path: str | Path) -> str:
    """What names a dataset (or run directory) in keys, tags and run names: its directory name, or
    for the pipeline's ``WORK/dataset`` (the same name in every work dir) the work dir's name."""
    path = Path(path)
    name = path.name or path.resolve().name
    if name in ("dataset", "plan", "caches") and path.parent.name:
        return path.parent.name
    return Path(name).stem if path.suffix in (".gz", ".tsv", ".csv", ".txt") else name


def run_dir_label(path: str | Path) -> str:
    """What names a run directory in run names and artifact keys: its name after its parent's (the
    grandparent's when the parent is ``runs``, as in the pipeline's ``WORK/runs/NAME``) and six hex
    digits of its absolute path, so two directories never share a label and a directory keeps its own:
    ``/w/demo/runs/oracle-parity1`` -> ``demo-oracle-parity1-3f9a0c``."""
    resolved = Path(path).expanduser().resolve()
    parent = resolved.parent
    if parent.name == "runs" and parent.parent.name:
        parent = parent.parent
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:6]
    return artifact_key(parent.name, resolved.name, digest)


def train_run_label(mode: str, num_shards: int, parity: int, output_dir: str | Path) -> str:
    """``<mode>[-k<shards>-r<parity>]-<run dir label>``: what a training run's name and keys carry
    (``oracle-k2-r1-demo-oracle-parity1-3f9a0c``; shards and parity only with embedding servers)."""
    servers = MODES[mode].servers if mode in MODES else bool(num_shards)
    return artifact_key(mode, f"k{num_shards}-r{parity}" if servers else "", run_dir_label(output_dir))


# ---- the table formatter -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column of a table: its header in plain English, the source ``key`` and the ``unit``.

    Units: ``""`` (text or a plain number), ``"count"``, ``"ms"``, ``"s"`` (values already in that
    unit), ``"MB"`` (the value is bytes), ``"%"`` (the value is a fraction 0..1), ``"x"`` (a ratio)."""

    header: str
    key: str
    unit: str = ""

    @property
    def title(self) -> str:
        return f"{self.header} ({self.unit})" if self.unit and self.unit != "count" else self.header


def _significant(x: float, digits: int) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return round(x, decimals)


def format_value(value: Any, unit: str = "") -> Any:
    """``value`` as a table cell in ``unit``: a rounded number (kept a number), or readable text.

    None -> ``""``; booleans -> ``yes``/``no``; lists -> their items joined by ``, ``; mappings ->
    ``key: value`` pairs joined by ``; ``; counts -> int, as text with thousands separators from 1,000
    (``"146,072"``); ms/s/x -> 3 significant digits (at least the integer part); MB -> bytes / 1e6, 3
    significant digits; % -> fraction * 100, one decimal; a plain number -> 4 significant digits
    (thousands separated from 10,000 on)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(str(format_value(v, unit)) for v in value)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {format_value(v, unit)}" for k, v in value.items())
    if not isinstance(value, (int, float)):
        return str(value)
    if unit == "count":
        return _grouped(int(value), 1000)
    if unit == "%":
        return round(100.0 * value, 1)
    if unit == "MB":
        return _significant(value / 1e6, 3)
    if unit in ("ms", "s", "x"):
        return _significant(float(value), 3)
    if isinstance(value, int):
        return _grouped(value, 10_000)
    return _grouped(_significant(value, 4), 10_000)


def _grouped(value: int | float, from_: int) -> int | float | str:
    """``value`` with thousands separators (text) when ``abs(value) >= from_``, else the number itself."""
    if not math.isfinite(value) or abs(value) < from_:
        return value
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,}"


def _readable_unit(value: Any, unit: str) -> tuple[Any, str]:
    """A duration under a second in ms, under a millisecond in µs (``0.0000387 s`` -> ``38.7 µs``)."""
    if unit in ("s", "ms") and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
        ms = value * 1000 if unit == "s" else value
        if abs(ms) < 1:
            return ms * 1000, "µs"
        if abs(ms) < 1000 and unit == "s":
            return ms, "ms"
    return value, unit


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> list[dict[str, Any]]:
    """``rows`` (dicts keyed by source keys) as a table: one dict per row, keyed by the columns' titles."""
    return [{c.title: format_value(row.get(c.key), c.unit) for c in columns} for row in rows]


METRIC_COLUMNS = (Column("Metric", "metric"), Column("Value", "value"), Column("Unit", "unit"))


def metric_table(items: Sequence[tuple[str, Any, str]]) -> list[dict[str, Any]]:
    """A table of ``(what, value, unit)`` items, one per row: Metric | Value | Unit (the layout of every
    one-record table; values formatted as :func:`format_value` does). A duration under a second is given
    in ms, under a millisecond in µs, so that no value reads 0.0000387 s."""
    readable = [(what, *_readable_unit(value, unit)) for what, value, unit in items]
    rows = [{"metric": what, "value": format_value(value, "ms" if unit == "µs" else unit),
             "unit": "" if unit == "count" else unit} for what, value, unit in readable]
    return [{c.title: row[c.key] for c in METRIC_COLUMNS} for row in rows]


def publish_table(key: str, table: list[dict[str, Any]], description: str) -> str:
    """Publish a table made by :func:`format_table` or :func:`metric_table`; returns its key."""
    create_table_artifact(table, key=key, description=description)
    return key


def publish_plot(key: str, png: str | Path, description: str) -> str:
    """A markdown artifact with the plot embedded (a data URI: the Prefect UI renders markdown images,
    and the run's files may not be reachable from the browser) and its path on disk; returns its key."""
    png = Path(png)
    data = base64.b64encode(png.read_bytes()).decode()
    create_markdown_artifact(
        f"### {description}\n\n![{png.name}](data:image/png;base64,{data})\n\nFile: `{png.resolve()}`\n",
        key=key,
        description=description,
    )
    return key


def publish_markdown(key: str, markdown: str, description: str) -> str:
    create_markdown_artifact(markdown, key=key, description=description)
    return key


# ---- progress ----------------------------------------------------------------------------------------

# Marks a run-log record as progress (``logger.info(..., extra=PROGRESS)``): ``dlrmflow COMMAND --json``
# shows such lines on stderr while it keeps Prefect's other console lines below WARNING back.
PROGRESS = {"dlrmflow_progress": True}


def is_progress(record: logging.LogRecord) -> bool:
    """Whether ``record`` is a progress line (:data:`PROGRESS`)."""
    return bool(getattr(record, "dlrmflow_progress", False))



class FlowProgress:
    """The engine's ``(done, total)`` progress callback in a flow or task run: a progress artifact and log lines.

    The artifact moves while the work runs: it is updated when at least ``min_interval_s`` passed
    since the last update or the share done grew by ``min_step`` percent, and always at the end
    (``done == total``). :meth:`finish` sets it to 100% for work that ended without reporting its
    last step (skipped as up to date, or nothing to do), so a finished run never shows 0%.
    """

    def __init__(self, what: str, *, min_interval_s: float = 1.0, min_step: float = 10.0) -> None:
        self.what = what
        self.logger = get_run_logger()
        self.artifact_id = create_progress_artifact(0.0, description=what)
        self.min_interval_s, self.min_step = min_interval_s, min_step
        self.percent = 0.0
        self.updates = 0
        self._last = time.monotonic()
        self.stages: list[tuple[str, int]] = []

    def in_stages(self, stages: Sequence[tuple[str, int]]) -> None:
        """The work's steps are stages of their own units, in order (the plan: ``("plan tasks decided", 4)``,
        then ``("plan chunks assembled", 1)``): each line then counts its stage's units (``plan tasks
        decided: 3/4 (75%)``), the last of each stage always; the artifact still counts every step."""
        self.stages = [(what, int(count)) for what, count in stages]

    def _stage_of(self, done: int) -> tuple[str, int, int]:
        """(what, done, total) of the stage step ``done`` falls in (the whole work without stages)."""
        before = 0
        for n, (what, count) in enumerate(self.stages):
            if done <= before + count or n == len(self.stages) - 1:
                return what, done - before, count
            before += count
        return self.what, done, before

    def __call__(self, done: int, total: int) -> None:
        percent = 100.0 * done / total if total else 100.0
        now = time.monotonic()
        what, stage_done, stage_total = self._stage_of(done) if self.stages else (self.what, done, total)
        stage_end = stage_done == stage_total
        if not stage_end and now - self._last < self.min_interval_s and percent - self.percent < self.min_step:
            return
        self._last = now
        self._update(percent)
        self.logger.info("%s: %d/%d (%.0f%%)", what, stage_done, stage_total,
                         100.0 * stage_done / stage_total if stage_total else 100.0, extra=PROGRESS)

    def _update(self, percent: float) -> None:
        if percent == self.percent and self.updates:
            return
        self.percent = percent
        self.updates += 1
        update_progress_artifact(self.artifact_id, percent)

    def finish(self) -> None:
        """The work is done, whatever it reported: the artifact shows 100%."""
        if self.percent < 100.0:
            self._update(100.0)


# ---- engine events in a run's log ---------------------------------------------------------------------

PHASES_LOGGER = "dlrmflow.engine.phases"  # dlrmflow.engine.phases: a phase's start and its seconds


class _ToRunLogger(logging.Handler):
    def __init__(self, run_logger: logging.LoggerAdapter) -> None:
        super().__init__(logging.INFO)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run_logger.log(record.levelno, "%s", record.getMessage(), extra=PROGRESS)  # an engine event or phase
        except Exception:  # a report must not break the training it reports on
            self.handleError(record)


@contextmanager
def engine_events_to_run_log(run_logger: logging.LoggerAdapter | None = None, *,
                             name: str = ENGINE_LOGGER) -> Iterator[None]:
    """Within the block, the engine's events (``dlrmflow.engine`` loggers at INFO and above: a worker
    killed, a shard lost, a rebuild done) go to ``run_logger`` (default: this run's Prefect logger),
    from whatever thread reports them; the Prefect logger carries the run's ids, so the lines land in
    that run's log even from threads without a Prefect context. ``name``: those of one engine logger only
    (``PHASES_LOGGER``: the phases, e.g. of a flow's Dask cluster). A block inside another one on the same
    logger (a subflow's inside its parent's) takes its lines over: they go to the inner run only."""
    handler = _ToRunLogger(run_logger or get_run_logger())
    engine = logging.getLogger(name)
    propagate = engine.propagate
    # Nested (a train flow inside the nightly daily run, both sending the phases): the inner run takes the lines
    # over until its block ends, so each line lands in one run's log and the CLI prints it once.
    outer = [h for h in engine.handlers if isinstance(h, _ToRunLogger)]
    for h in outer:
        engine.removeHandler(h)
    engine.propagate = False  # the run logger prints them too: not twice on the console
    try:
        with engine_events_to(handler, name):
            yield
    finally:
        for h in outer:
            engine.addHandler(h)
        engine.propagate = propagate


@contextmanager
def reported_dask_scheduler(address: str | None = None, **cluster: Any) -> Iterator[str]:
    """:func:`~dlrmflow.engine.serving.cluster.dask_scheduler` in a flow run, its phases (a LocalCluster's
    start and close: seconds each, more on busy cores) in the run's log, so on stderr with ``--json`` too:
    the wait for the cluster is never silent. Not for a flow that already sends the phases (train)."""
    from dlrmflow.engine.serving.cluster import dask_scheduler

    with engine_events_to_run_log(name=PHASES_LOGGER), dask_scheduler(address, **cluster) as scheduler:
        yield scheduler
