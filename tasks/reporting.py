"""Progress and artifacts: how long engine work shows up in the terminal and the Prefect UI.

The engine reports progress through a plain ``(done, total)`` callback; :class:`FlowProgress`
is that callback for flows: it logs a line (at most every few seconds, and at the end) and
keeps a Prefect progress artifact up to date.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)


class FlowProgress:
    def __init__(self, what: str, *, min_interval_s: float = 2.0) -> None:
        self.what = what
        self.logger = get_run_logger()
        self.artifact_id = create_progress_artifact(0.0, description=what)
        self.min_interval_s = min_interval_s
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self.min_interval_s:
            return
        self._last = now
        percent = 100.0 * done / total if total else 100.0
        update_progress_artifact(self.artifact_id, percent)
        self.logger.info("%s: %d/%d (%.0f%%)", self.what, done, total, percent)


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    create_table_artifact(rows, key=key, description=description)


def publish_plot(key: str, png: str | Path, description: str) -> None:
    """A markdown artifact with the plot embedded (data URI) and its path on disk."""
    png = Path(png)
    data = base64.b64encode(png.read_bytes()).decode()
    create_markdown_artifact(
        f"### {description}\n\n![{png.name}](data:image/png;base64,{data})\n\nFile: `{png.resolve()}`\n",
        key=key,
        description=description,
    )
