"""dlrmflow: train DLRMs with huge embedding tables, fast and fault tolerant.

Subpackages (top-level folders of the repository, fixed by the project card):
``dlrmflow.datasets`` formats, readers and generators; ``dlrmflow.engine`` the algorithms,
importable without Prefect; ``dlrmflow.tasks`` and ``dlrmflow.flows`` the thin Prefect layer.
"""

import os

__version__ = "0.1.0"

# Idle OpenMP threads sleep instead of spinning. libgomp spins after every parallel region by
# default, which on a machine whose cores the trainer shares with the embedding servers (or any other
# process) takes the cores the others need: measured on 2 cores under load, 2-5x slower iterations in
# every mode (docs/oracle-overhead.md). It does not change results (every final state's SHA-256 is the
# same). libgomp reads it once, when torch loads, so it is set here, before anything imports torch; a
# value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The Python API, imported on first use: `import dlrmflow` stays cheap (no torch, no pyarrow).
_API = {"load_model": "dlrmflow.engine.training.trained_model",
        "load_vocabulary": "dlrmflow.datasets.vocabulary_lookup"}


def __getattr__(name: str) -> object:
    """``dlrmflow.load_model`` (a finished run's model: docs/export.md) and ``dlrmflow.load_vocabulary``."""
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__", *_API]
