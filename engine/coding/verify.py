"""Checking parity: at the end of a run (the group's parity shards against its data shards) and
afterwards (a run directory's saved parity against its final rows, ``dlrmflow verify``).

Both read a chunk of stripes at a time: the end-of-run check from the members (:meth:`CodedShardGroup.verify`),
``dlrmflow verify`` from the files each member wrote (``final_state/shard-<i>.npy`` and
``parity-<p>.npy``), checking on the way every file's SHA-256 against the manifest and the state
SHA-256 (the rows of a chunk of stripes are consecutive ids).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dlrmflow.engine import row_files
from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.group import CodedShardGroup
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.row_files import RowFileReader, chunk_stripes, file_sha256, interleave
from dlrmflow.engine.run_state import MANIFEST_FILE, STATE_DIR, StateDigest, load_dense, read_manifest

__all__ = ["parity_report", "verify_run_dir"]


def parity_report(group: CodedShardGroup, state_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The end-of-run check: parity recomputed from the data shards equals the parity shards, bit for
    bit. With ``state_dir`` (a final state being written) each parity shard writes its rows there
    (``dlrmflow verify``): the report's ``files`` is the manifest's parity entry."""
    result = group.verify()
    report = group.summary()
    report["verify"] = {"ok": result["ok"], "stripes": result["stripes"],
                        "mismatched_stripes": result["mismatched_stripes"]}
    if state_dir is not None:
        report["files"] = group.save_parity(state_dir)
    return report


def verify_run_dir(run_dir: str | os.PathLike, chunk: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Recompute parity from a finished run's embedding rows and compare it with the parity shards it
    saved in its ``final_state/``, a chunk of stripes at a time (row id on data shard id % K); each file's
    SHA-256 and the state SHA-256 are checked on the same pass (``files_ok``, ``state_sha256_ok``).
    ``progress(done, total)``: stripes checked after each chunk (a pass over a Terabyte-sized state takes
    minutes: it is never silent)."""
    progress = progress or (lambda done, total: None)
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir) if (run_dir / STATE_DIR).is_dir() else None
    if manifest is None:
        raise UserInputError(f"{run_dir} holds no final state ({STATE_DIR}/{MANIFEST_FILE}): verify needs a "
                             "finished run trained with --parity")
    if "parity" not in manifest:
        raise UserInputError(f"{run_dir} was trained without --parity (its {STATE_DIR}/ holds no parity "
                             "shards): verify needs a finished run trained with --parity")
    return _verify_files(run_dir, manifest, chunk or row_files.ROW_CHUNK, progress)


def _result(run_dir: Path, code: ErasureCode, stripes: int, mismatches: list[list[np.ndarray]]) -> dict[str, Any]:
    found = [np.concatenate(m) if m else np.zeros(0, dtype=np.int64) for m in mismatches]
    return {"run_dir": str(run_dir), "k": code.k, "r": code.r, "stripes": int(stripes),
            "ok": all(len(m) == 0 for m in found), "mismatched_stripes": [int(len(m)) for m in found],
            "first_mismatches": [m[:5].tolist() for m in found]}


def _verify_files(run_dir: Path, manifest: dict[str, Any], chunk: int,
                  progress: Callable[[int, int], None]) -> dict[str, Any]:
    directory = Path(manifest["dir"])
    code = ErasureCode(int(manifest["parity"]["k"]), int(manifest["parity"]["r"]))
    if manifest["num_shards"] != code.k:
        raise UserInputError(f"{directory} holds {manifest['num_shards']} data shard files for k={code.k}")
    entries = [*manifest["shards"], *manifest["parity"]["files"]]
    readers = [RowFileReader(directory / e["file"]) for e in entries]
    try:
        stripes = readers[0].shape[0]
        digest = StateDigest(load_dense(directory)).rows(manifest["total_rows"], manifest["width"])
        mismatches: list[list[np.ndarray]] = [[] for _ in range(code.r)]
        per = chunk_stripes(code.n_shards, chunk)
        for start in range(0, stripes, per):
            pieces = [reader.read(per) for reader in readers]
            data = pieces[: code.k]
            digest.update(interleave(data, manifest["width"]))
            for p, found in enumerate(code.verify(data, pieces[code.k :])):
                mismatches[p].append(found + start)
            progress(min(start + per, stripes), stripes)
        bad = [e["file"] for e, reader in zip(entries, readers, strict=True) if reader.sha256() != e["sha256"]]
        if file_sha256(directory / manifest["dense"]["file"]) != manifest["dense"]["sha256"]:
            bad.append(manifest["dense"]["file"])
    finally:
        for reader in readers:
            reader.close()
    result = _result(run_dir, code, stripes, mismatches)
    state = digest.hexdigest()
    result.update({"files_ok": not bad, "damaged_files": bad, "state_sha256": state,
                   "state_sha256_ok": state == manifest["state_sha256"]})
    result["parity_ok"] = result["ok"]
    result["ok"] = result["parity_ok"] and result["files_ok"] and result["state_sha256_ok"]
    return result
