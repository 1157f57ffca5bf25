"""Checking parity: at the end of a run (the group's parity shards against its data shards) and
afterwards (a run directory's saved parity against its final rows, ``dlrmflow verify``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from dlrmflow.engine.coding.erasure import ErasureCode
from dlrmflow.engine.coding.group import CodedShardGroup
from dlrmflow.engine.errors import UserInputError

PARITY_FILE = "parity_shards.pt"


def parity_report(group: CodedShardGroup, run_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The end-of-run check: parity recomputed from the data shards equals the parity shards, bit for
    bit. With ``run_dir`` the parity shards are saved next to final_state.pt (``dlrmflow verify``)."""
    result = group.verify()
    if run_dir is not None:
        save_parity(run_dir, group.code, result["parity"])
    report = group.summary()
    report["verify"] = {"ok": result["ok"], "stripes": result["stripes"],
                        "mismatched_stripes": result["mismatched_stripes"]}
    return report


def save_parity(run_dir: str | os.PathLike, code: ErasureCode, parity: list[np.ndarray]) -> Path:
    import torch

    path = Path(run_dir) / PARITY_FILE
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"k": code.k, "r": code.r, "parity": [torch.from_numpy(np.ascontiguousarray(p)) for p in parity]},
               tmp)
    os.replace(tmp, path)
    return path


def verify_run_dir(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Recompute parity from a finished run's embedding rows (final_state.pt, split into the K data
    shards: row id on shard id % K) and compare it with the parity shards it saved."""
    import torch

    from dlrmflow.engine.run_state import STATE_FILE, load_state

    run_dir = Path(run_dir)
    for name in (STATE_FILE, PARITY_FILE):
        if not (run_dir / name).is_file():
            raise UserInputError(f"{run_dir} has no {name}: verify needs a finished run trained with --parity")
    saved = torch.load(run_dir / PARITY_FILE, map_location="cpu", weights_only=True)
    rows = load_state(run_dir)["embedding"]["rows"].numpy()
    code = ErasureCode(int(saved["k"]), int(saved["r"]))
    data = [np.ascontiguousarray(rows[i :: code.k]) for i in range(code.k)]
    mismatches = code.verify(data, [p.numpy() for p in saved["parity"]])
    return {"run_dir": str(run_dir), "k": code.k, "r": code.r, "stripes": int(len(data[0])),
            "ok": all(len(m) == 0 for m in mismatches), "mismatched_stripes": [int(len(m)) for m in mismatches],
            "first_mismatches": [m[:5].tolist() for m in mismatches]}
