"""What ``dlrmflow export`` checks before torch loads: the target and the output directory
(:mod:`.model_export` writes the export)."""

from __future__ import annotations

import os
from pathlib import Path

from dlrmflow.engine.errors import UserInputError

TARGETS = ("torchrec",)  # --to
EXPORT_FILE = "export.json"  # what every export holds (docs/export.md)


class ExportError(UserInputError):
    """An export cannot be made: a target this version does not know, an output directory that holds something
    else, a run whose dataset is gone, a model TorchRec cannot hold."""


def check_target(to: str) -> None:
    if to not in TARGETS:
        raise ExportError(f"--to {to!r}: this version exports to {', '.join(TARGETS)}")


def check_output(output: str | os.PathLike) -> Path:
    """``output`` resolved: it must not exist, be empty, or hold an earlier export (replaced at the end)."""
    path = Path(output).resolve()
    if path.exists() and not path.is_dir():
        raise ExportError(f"--output {output} is a file, not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / EXPORT_FILE).is_file():
        raise ExportError(f"--output {output} holds files and no earlier export ({EXPORT_FILE}): choose a new "
                          "directory")
    return path
