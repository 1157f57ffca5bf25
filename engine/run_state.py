"""What a training run leaves behind: its final state (``final_state/``), its canonical hash, ``summary.json``.

The final state is a dict (what :func:`load_state` returns)::

    format_version       1 (the dict's layout)
    mode                 "local" | "remote" | "lru" | "oracle"
    model                "dlrm" | "wide-deep" | "deepfm" | "dcn-v2"
    model_config         the model's architecture (its config dataclass of dlrmflow.engine.models) as a dict
    dense                the model's parameters (state_dict: name -> tensor)
    dense_optimizer      the dense optimizer's state_dict (SGD: no state; Adam: step, exp_avg, exp_avg_sq)
    embedding            {"rows": float32 [total_rows, dim + state_width] in global id order,
                          "dim", "optimizer", "state_width", "own_accumulator_columns", "table_offsets",
                          "cardinalities"}

Each embedding row is the row layout of :mod:`dlrmflow.engine.serving.embedding_rows`: ``dim``
weights, then ``state_width`` optimizer values. ``dim`` is the model's row width: every per-id
parameter of the model (``embedding_dim`` values, plus the first-order weight of Wide & Deep and
DeepFM in the last weight column; docs/models.md). Column by column (``D = embedding_dim``)::

    model                  optimizer   columns
    dlrm, dcn-v2           adagrad     v_0..v_{D-1}, a_v                 (width D + 1)
    wide-deep, deepfm      adagrad     v_0..v_{D-1}, w, a_v, a_w         (width D + 3)
    dlrm, dcn-v2           sgd         v_0..v_{D-1}                      (width D)
    wide-deep, deepfm      sgd         v_0..v_{D-1}, w                   (width D + 1)

``v`` the embedding, ``w`` the first-order weight, ``a_v`` the row-wise Adagrad accumulator the
embedding values share (sum over steps of the mean of their squared gradients), ``a_w`` the first-order
weight's own (sum of its squared gradients): ``own_accumulator_columns`` (1 for Wide & Deep and DeepFM)
weights at the end of the row keep one each. A state that does not record ``own_accumulator_columns``
was written with one accumulator shared by all ``dim`` weights (Wide & Deep and DeepFM: width D + 2);
it scores as before but cannot be continued from (``--init-from`` names the layouts).

On disk (a run writes it; no process ever holds every row)::

    RUN_DIR/final_state/
        manifest.json    format_version 2, the state SHA-256, total_rows, width, dtype, K and, per file,
                         its rows, bytes, SHA-256 and the pid and host of the process that wrote it
        dense.pt         everything but the rows (torch.load(..., weights_only=True) reads it), written by
                         trainer 0
        shard-<k>.npy    float32 [n_local, width]: shard k's rows (row id on shard id % K at local index
                         id // K), written by the worker that holds shard k (the local mode: K = 1, by
                         the trainer)
        parity-<p>.npy   with --parity: parity shard p's rows, written by its worker (``dlrmflow verify``)

The shards write into ``final_state.<token>.tmp/``, the run renames it into place when it records
the summary (:func:`commit_state_dir`). :func:`load_state`, :func:`load_dense`, :func:`state_rows` and
:func:`state_sha256` read that directory; :func:`save_sharded_state` writes a state held whole (tests) in
the same layout.

The state hash is SHA-256 over, in this order: every dense parameter (sorted by name), every
dense-optimizer state entry (by parameter index, then key, sorted), then the embedding rows;
each entry contributes its name, dtype, shape and raw bytes. Equal hashes mean equal bits.
:class:`StateDigest` computes the same value with the rows fed a chunk at a time in global id order
(the run streams them from its shards; :func:`state_sha256` from the files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.row_files import ROW_CHUNK, ShardedRows, file_sha256, shard_file, write_rows_file

FORMAT_VERSION = 1  # the state dict's layout
STATE_DIR_FORMAT_VERSION = 2  # final_state/ (manifest.json + dense.pt + one rows file per shard)
STATE_DIR = "final_state"
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.pt"
SUMMARY_FILE = "summary.json"
ITERATIONS_FILE = "iterations.csv"
ROWS_ENTRY = "embedding/rows"

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


class StateFormatError(UserInputError):
    """A run directory's final state is missing, incomplete or not in a format this version reads."""


def _dense_entries(state: dict[str, Any]):
    """(name, value) of every hashed entry but the embedding rows, in canonical order."""
    for name in sorted(state["dense"]):
        yield f"dense/{name}", state["dense"][name]
    opt_state = state["dense_optimizer"].get("state", {})
    for index in sorted(opt_state):
        for key in sorted(opt_state[index]):
            yield f"dense_optimizer/{index}/{key}", opt_state[index][key]


def _entries(state: dict[str, Any]):
    """(name, value) of every hashed entry, in canonical order."""
    yield from _dense_entries(state)
    yield ROWS_ENTRY, state["embedding"]["rows"]


def _hash_entry(digest, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else b"")
    else:
        digest.update(f"{name}|{type(value).__name__}|{value!r}|".encode())


def state_hash(state: dict[str, Any]) -> str:
    """Canonical SHA-256 of all parameter and optimizer-state bytes (see the module docstring)."""
    digest = hashlib.sha256()
    for name, value in _entries(state):
        _hash_entry(digest, name, value)
    return digest.hexdigest()


class StateDigest:
    """:func:`state_hash` with the rows streamed: the entries of ``state`` before the rows (its dense part:
    a state without ``embedding.rows`` will do), then :meth:`rows` for the rows entry's header, then
    :meth:`update` with the float32 rows in global id order, any number at a time."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._digest = hashlib.sha256()
        for name, value in _dense_entries(state):
            _hash_entry(self._digest, name, value)
        self._left: int | None = None

    def rows(self, total_rows: int, width: int) -> StateDigest:
        """The rows entry's header: ``[total_rows, width]`` float32 rows follow."""
        self._digest.update(f"{ROWS_ENTRY}|{torch.float32}|{(int(total_rows), int(width))}|".encode())
        self._left, self._width = int(total_rows), int(width)
        return self

    def update(self, rows: np.ndarray) -> None:
        """The next rows ``[n, width]`` (float32, hashed as bytes)."""
        rows = np.asarray(rows)
        if self._left is None or rows.dtype != np.float32 or rows.ndim != 2 or rows.shape[1] != self._width:
            raise ValueError(f"expected float32 rows of width {getattr(self, '_width', '?')} after rows(), got "
                             f"{rows.dtype} {rows.shape}")
        if len(rows) > self._left:
            raise ValueError(f"{len(rows)} rows given, {self._left} left")
        self._left -= len(rows)
        if len(rows):
            self._digest.update(np.ascontiguousarray(rows).view(np.uint8).reshape(-1).data)

    def hexdigest(self) -> str:
        if self._left:
            raise ValueError(f"{self._left} rows were not hashed yet")
        if self._left is None:
            raise ValueError("the rows were not hashed (call rows() and update())")
        return self._digest.hexdigest()


def streamed_state_hash(state: dict[str, Any], total_rows: int, width: int, chunks: Iterable[np.ndarray]) -> str:
    """:func:`state_hash` of ``state``'s dense part and the rows ``chunks`` give in global id order."""
    digest = StateDigest(state).rows(total_rows, width)
    for chunk in chunks:
        digest.update(chunk)
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


# ---- the directory format ------------------------------------------------------------------------------


def dense_part(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the embedding rows (what dense.pt holds)."""
    return {**state, "embedding": {k: v for k, v in state["embedding"].items() if k != "rows"}}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def stage_state_dir(run_dir: str | os.PathLike) -> Path:
    """A new, empty directory in ``run_dir`` for a final state to be written into (absolute: every
    worker writes there), renamed into place by :func:`commit_state_dir`."""
    staged = Path(run_dir).resolve() / f"{STATE_DIR}.{uuid.uuid4().hex[:12]}.tmp"
    staged.mkdir(parents=True)
    return staged


def write_dense(staged: str | os.PathLike, state: dict[str, Any]) -> dict[str, Any]:
    """dense.pt (``state`` without its rows) into a staged state directory; its manifest entry."""
    path = Path(staged) / DENSE_FILE
    torch.save(dense_part(state) if "rows" in state.get("embedding", {}) else state, path)
    return {"file": DENSE_FILE, "bytes": path.stat().st_size, "sha256": file_sha256(path), "pid": os.getpid(),
            "host": socket.gethostname()}


def write_manifest(staged: str | os.PathLike, *, state_sha256: str, total_rows: int, width: int,
                   shards: list[dict[str, Any]], dense: dict[str, Any],
                   parity: dict[str, Any] | None = None) -> dict[str, Any]:
    """manifest.json, the last file of a staged state directory: what it holds and each file's SHA-256."""
    manifest = {"format_version": STATE_DIR_FORMAT_VERSION, "state_sha256": state_sha256,
                "total_rows": int(total_rows), "width": int(width), "dtype": "float32",
                "layout": "row id on shard id % num_shards at local index id // num_shards",
                "num_shards": len(shards), "shards": shards, "dense": dense}
    if parity is not None:
        manifest["parity"] = parity
    _write_json(Path(staged) / MANIFEST_FILE, manifest)
    return manifest


def commit_state_dir(run_dir: str | os.PathLike, staged: str | os.PathLike) -> Path:
    """Rename a staged state directory to ``RUN_DIR/final_state`` (replacing the one there); remove other
    staged directories left behind."""
    run_dir = Path(run_dir)
    target = run_dir / STATE_DIR
    if target.exists():
        shutil.rmtree(target)
    os.replace(staged, target)
    for left in run_dir.glob(f"{STATE_DIR}.*.tmp"):
        shutil.rmtree(left, ignore_errors=True)
    return target


def save_sharded_state(run_dir: str | os.PathLike, state: dict[str, Any], num_shards: int = 1) -> Path:
    """Write a whole ``state`` in the directory format, its rows split over ``num_shards`` files (a state
    held whole: tests and tools; a run's shards write their own files)."""
    rows = state["embedding"]["rows"].detach().cpu().contiguous().numpy()
    view = ShardedRows.from_array(rows, num_shards)
    staged = stage_state_dir(run_dir)
    shards = [write_rows_file(staged / shard_file(k), len(view.shards[k]), view.width,
                              lambda a, b, k=k: view.shards[k][a:b]) for k in range(num_shards)]
    write_manifest(staged, state_sha256=state_hash(state), total_rows=rows.shape[0], width=rows.shape[1],
                   shards=shards, dense=write_dense(staged, state))
    return commit_state_dir(run_dir, staged)


def _state_dir(path: Path) -> Path | None:
    """The final_state/ directory ``path`` names (a run directory, the directory, its manifest), if any."""
    for candidate in (path / STATE_DIR, path, *([path.parent] if path.name == MANIFEST_FILE else [])):
        if (candidate / MANIFEST_FILE).is_file():
            return candidate
    return None


def read_manifest(run_dir_or_state: str | os.PathLike) -> dict[str, Any] | None:
    """The final state's manifest (None: the run has no final_state/ directory)."""
    found = _state_dir(Path(run_dir_or_state))
    if found is None:
        return None
    try:
        manifest = json.loads((found / MANIFEST_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise StateFormatError(f"{found / MANIFEST_FILE} is not valid JSON: {exc}") from exc
    if manifest.get("format_version") != STATE_DIR_FORMAT_VERSION:
        raise StateFormatError(f"{found / MANIFEST_FILE} has format_version {manifest.get('format_version')!r}; "
                               f"this version reads {STATE_DIR_FORMAT_VERSION}")
    manifest["dir"] = str(found)
    return manifest


def _required_manifest(run_dir_or_state: str | os.PathLike) -> dict[str, Any]:
    """:func:`read_manifest`, or StateFormatError when there is no final_state/ directory."""
    manifest = read_manifest(run_dir_or_state)
    if manifest is None:
        raise StateFormatError(f"{run_dir_or_state} holds no final state ({STATE_DIR}/{MANIFEST_FILE})")
    return manifest


def load_dense(run_dir_or_state: str | os.PathLike) -> dict[str, Any]:
    """The final state without its rows (the directory's dense.pt)."""
    manifest = _required_manifest(run_dir_or_state)
    return torch.load(Path(manifest["dir"]) / manifest["dense"]["file"], map_location="cpu", weights_only=True)


def state_rows(run_dir_or_state: str | os.PathLike) -> ShardedRows:
    """The final state's rows as a view (the shard files, memory-mapped)."""
    manifest = _required_manifest(run_dir_or_state)
    return ShardedRows.from_files(manifest["dir"], manifest["shards"], manifest["total_rows"], manifest["width"])


def load_state(run_dir_or_state: str | os.PathLike) -> dict[str, Any]:
    """The whole final state (the dict of the module docstring) of a run directory or its final_state/
    directory, assembled from its shard files: every row in this process, for tests and small runs
    (:func:`state_rows` reads them piecewise)."""
    path = Path(run_dir_or_state)
    state = load_dense(path)
    state["embedding"]["rows"] = torch.from_numpy(state_rows(path).assemble())
    return state


def state_sha256(run_dir_or_state: str | os.PathLike, chunk: int = ROW_CHUNK) -> str:
    """The state hash recomputed from the files, the rows read a chunk at a time in global id order."""
    rows = state_rows(run_dir_or_state)
    return streamed_state_hash(load_dense(run_dir_or_state), rows.total_rows, rows.width,
                               (c for _, c in rows.chunks(chunk)))


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
