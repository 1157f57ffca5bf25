"""Skip a step whose inputs and parameters are unchanged: the one rule every step uses.

A step that writes an output also writes a JSON *record* of what it was made from: ``meta.json``
of a dataset (its ``fingerprint``), ``profile.json`` and ``plan.json`` (the dataset fingerprint and
their parameters), a training run's ``summary.json``, a generated file's ``FILE.params.json``. A
later run computes what it would record now (``expect``) and, when :func:`saved_result` finds the
record holding the same values, reuses the saved result instead of redoing the work.

Inputs enter ``expect`` by identity, not content: :func:`file_identity` (path, size, modification
time) for raw files, the dataset's fingerprint for everything derived from a dataset. Several
values fold into one key with :func:`fingerprint`. No Prefect here: the engine-level steps
(``preprocess``) skip themselves too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def fingerprint(what: Any) -> str:
    """SHA-256 (hex) of ``what`` as JSON with sorted keys: equal values, equal fingerprints."""
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def file_identity(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Each file's absolute path, size and modification time (ns): what says a raw input is unchanged."""
    out = []
    for path in paths:
        stat = Path(path).stat()
        out.append({"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return out


def saved_result(record: str | os.PathLike, expect: Mapping[str, Any]) -> dict[str, Any] | None:
    """The JSON object saved at ``record`` if the step that wrote it ran with what ``expect`` describes
    (every key of ``expect`` has an equal value there; a missing key reads as None); None when the
    record is missing, is not a readable JSON object, or differs in any of those keys (then the step
    runs again)."""
    path = Path(record)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(saved, dict):
        return None
    return saved if all(saved.get(key) == value for key, value in expect.items()) else None
