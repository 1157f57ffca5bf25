"""What a training run leaves behind: ``final_state.pt``, its canonical hash, ``summary.json``.

``RUN_DIR/final_state.pt`` (``torch.load(..., weights_only=True)`` reads it) is a dict::

    format_version       1
    mode                 "local" | "remote" | "lru" | "oracle"
    model                "dlrm" | "wide-deep" | "deepfm" | "dcn-v2" (absent in states written before
                         --model existed: those are DLRM's)
    model_config         the model's architecture (its config dataclass of dlrmflow.engine.models) as a dict
    dense                the model's parameters (state_dict: name -> tensor)
    dense_optimizer      the dense optimizer's state_dict (SGD: no state; Adam: step, exp_avg, exp_avg_sq)
    embedding            {"rows": float32 [total_rows, dim + state_width] in global id order,
                          "dim", "optimizer", "state_width", "table_offsets", "cardinalities"}

Each embedding row is the row layout of :mod:`dlrmflow.engine.serving.embedding_rows`: ``dim``
weights, then the optimizer state (row-wise Adagrad: one accumulator; SGD: nothing). ``dim`` is
the model's row width: every per-id parameter of the model (``embedding_dim`` values, plus the
first-order weight of Wide & Deep and DeepFM in the last weight column; docs/models.md).

The state hash is SHA-256 over, in this order: every dense parameter (sorted by name), every
dense-optimizer state entry (by parameter index, then key, sorted), then the embedding rows;
each entry contributes its name, dtype, shape and raw bytes. Equal hashes mean equal bits.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
STATE_FILE = "final_state.pt"
SUMMARY_FILE = "summary.json"
ITERATIONS_FILE = "iterations.csv"

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def _entries(state: dict[str, Any]):
    """(name, value) of every hashed entry, in canonical order."""
    for name in sorted(state["dense"]):
        yield f"dense/{name}", state["dense"][name]
    opt_state = state["dense_optimizer"].get("state", {})
    for index in sorted(opt_state):
        for key in sorted(opt_state[index]):
            yield f"dense_optimizer/{index}/{key}", opt_state[index][key]
    yield "embedding/rows", state["embedding"]["rows"]


def state_hash(state: dict[str, Any]) -> str:
    """Canonical SHA-256 of all parameter and optimizer-state bytes (see the module docstring)."""
    digest = hashlib.sha256()
    for name, value in _entries(state):
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else b"")
        else:
            digest.update(f"{name}|{type(value).__name__}|{value!r}|".encode())
    return digest.hexdigest()


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern (so -0.0 != 0.0 and a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = _INT_VIEW.get(a.dtype)
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    a, b = a.reshape(-1), b.reshape(-1)
    return torch.equal(a.view(view), b.view(view)) if view is not None else torch.equal(a, b)


def state_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the entries whose bits differ between two final states (empty: bit-identical)."""
    ea, eb = dict(_entries(a)), dict(_entries(b))
    diffs = sorted(set(ea) ^ set(eb))
    for name in sorted(set(ea) & set(eb)):
        x, y = ea[name], eb[name]
        same = bit_equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        if not same:
            diffs.append(name)
    return diffs


def save_state(run_dir: str | os.PathLike, state: dict[str, Any]) -> Path:
    path = Path(run_dir) / STATE_FILE
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_state(run_dir_or_file: str | os.PathLike) -> dict[str, Any]:
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / STATE_FILE
    return torch.load(path, map_location="cpu", weights_only=True)


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
