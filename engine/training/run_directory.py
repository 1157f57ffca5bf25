"""A checkpointed run directory: its files' names, its ``run_config.json`` and ``UNFINISHED`` marker, and the
checks of ``dlrmflow resume RUN_DIR`` that need only the directory.

A checkpointed run directory::

    run_config.json   written before any work: the TrainConfig, the dataset and plan fingerprints
    UNFINISHED        the run has not finished: removed once summary.json is written
    checkpoint.pt     the last checkpoint (all but the rows; it names its rows files)
    checkpoint_rows/a/, checkpoint_rows/b/   shard-<k>.npy: the rows of the last two checkpoints
    final_state/, summary.json, iterations.csv   as for every run (:mod:`dlrmflow.engine.run_state`)

No torch, Dask or Prefect: the CLI refuses a directory that cannot be resumed in a fraction of a second
(its ``check``), before the heavy imports. The checks that read the checkpoint itself (its iteration) or
know the final state's files are :mod:`.run_directory_checks`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models import ADDED_ARCHITECTURE, MODEL_SETTINGS

RUN_CONFIG_FILE = "run_config.json"
UNFINISHED_FILE = "UNFINISHED"
CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_ROWS_DIR = "checkpoint_rows"
SUMMARY_FILE = "summary.json"  # run_state.SUMMARY_FILE: that module loads torch, and it is below training/
CHECKPOINT_FORMAT_VERSION = 1  # run_config.json's
# Not part of a run's identity: where its directory is now, the resume flag itself, and where the
# data and plan lie (their fingerprints say whether they are the same).
NOT_COMPARED = ("output_dir", "resume", "dataset_dir", "plan_dir")


def _hidden_init_before(config: dict[str, Any]) -> str:
    # Before --hidden-init the models that read it started their hidden layers as ADDED_ARCHITECTURE says; a model
    # that reads none (DLRM) has the default.
    reads = "hidden_init" in MODEL_SETTINGS[config.get("model", "dlrm")]
    return ADDED_ARCHITECTURE["hidden_init"] if reads else "auto"


# Settings added to TrainConfig after runs had recorded their configuration, each with the value that a
# configuration recorded without it ran with: such a run resumes as it started (read_run_config fills the value
# in), and its checkpoint's configuration SHA-256 still matches (comparable_config leaves a setting out at that value).
ADDED_SETTINGS = {"hidden_init": _hidden_init_before}


class ResumeError(UserInputError):
    """A run directory cannot be resumed, or holds an unfinished run a new run would overwrite."""


def resume_command(run_dir: str | os.PathLike) -> str:
    """The command that resumes the run in ``run_dir``, quoted for a shell."""
    return f"dlrmflow resume {shlex.quote(str(run_dir))}"


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a TrainConfig (as a dict) that a resumed run must share with its start, as JSON: an added
    setting at the value of a configuration recorded without it is left out (:data:`ADDED_SETTINGS`)."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in NOT_COMPARED
                                  and not (k in ADDED_SETTINGS and v == ADDED_SETTINGS[k](config))}))


def config_sha256(config: dict[str, Any]) -> str:
    """The fingerprint of a TrainConfig (as a dict) that a checkpoint records: a resume with another
    configuration is refused."""
    return hashlib.sha256(json.dumps(comparable_config(config), sort_keys=True).encode()).hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def start_run_dir(run_dir: str | os.PathLike, config: dict[str, Any], *, dataset_fingerprint: str,
                  plan_fingerprint: str | None, iterations: int) -> None:
    """Before any work of a fresh checkpointed run: its configuration, then the unfinished marker."""
    run_dir = Path(run_dir)
    (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)  # another run's, left in the directory: not this run's state
    shutil.rmtree(run_dir / CHECKPOINT_ROWS_DIR, ignore_errors=True)
    saved = {k: v for k, v in config.items() if k not in ("output_dir", "resume")}
    for key in ("dataset_dir", "plan_dir"):  # a resume from another working directory finds them
        if saved.get(key):
            saved[key] = str(Path(saved[key]).resolve())
    _write_json(run_dir / RUN_CONFIG_FILE, {
        "format_version": CHECKPOINT_FORMAT_VERSION, "config": json.loads(json.dumps(saved)),
        "config_sha256": config_sha256(config), "dataset_fingerprint": dataset_fingerprint,
        "plan_fingerprint": plan_fingerprint, "iterations": iterations,
    })
    _write_json(run_dir / UNFINISHED_FILE, {"pid": os.getpid(), "host": socket.gethostname(),
                                            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def finish_run_dir(run_dir: str | os.PathLike) -> None:
    """After summary.json is written: the run is finished."""
    (Path(run_dir) / UNFINISHED_FILE).unlink(missing_ok=True)


def read_run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``RUN_DIR/run_config.json``, checked for its format (ResumeError: no such directory, no checkpointed run)."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_CONFIG_FILE
    if not path.is_file():
        if not run_dir.exists():
            raise ResumeError(f"{run_dir} does not exist")
        if not run_dir.is_dir():
            raise ResumeError(f"{run_dir} is a file, not a run directory")
        raise ResumeError(f"{run_dir} has no {RUN_CONFIG_FILE}: nothing to resume (only runs trained with "
                          "--checkpoint-every can be resumed)")
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResumeError(f"{path} is not valid JSON: {exc}") from exc
    if info.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ResumeError(f"{path} has format_version {info.get('format_version')!r}; expected "
                          f"{CHECKPOINT_FORMAT_VERSION}")
    recorded = info["config"]
    info["config"] = {**{k: before(recorded) for k, before in ADDED_SETTINGS.items()}, **recorded}
    return info


def check_unfinished(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run_config.json of an unfinished run with a checkpoint; ResumeError for every other directory
    (missing, not a run's, a finished run, a run that stopped before its first checkpoint)."""
    run_dir = Path(run_dir)
    info = read_run_config(run_dir)
    if not (run_dir / UNFINISHED_FILE).is_file():
        if (run_dir / SUMMARY_FILE).is_file():
            raise ResumeError(f"{run_dir} holds a finished run ({SUMMARY_FILE} is written): nothing to resume")
        raise ResumeError(f"{run_dir} holds no unfinished run ({UNFINISHED_FILE} is missing): nothing to resume")
    if not (run_dir / CHECKPOINT_FILE).is_file():
        raise ResumeError(f"{run_dir} has no {CHECKPOINT_FILE}: the run stopped before its first checkpoint; "
                          "start it again with `dlrmflow train`")
    return info
