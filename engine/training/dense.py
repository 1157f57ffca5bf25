"""A trainer's dense part beside its rows: deterministic kernels, the dense optimizer, its start from a finished
run, and the final state's layout (its dense part; :mod:`.final_state` writes it)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.run_state import FORMAT_VERSION
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.stores.base import RowStore


@contextlib.contextmanager
def deterministic_torch(device: torch.device):
    """Deterministic kernels for the duration of a run (restores the previous setting)."""
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace (must be set before its first use).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def make_dense_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.dense_optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr)
    return torch.optim.SGD(model.parameters(), lr=config.lr)


def start_from_run(setup: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The dense parameters and the dense optimizer's state of the finished run ``setup.init_from``
    (:mod:`.continuation`); this run's own learning rate (the saved state carries the run's)."""
    from dlrmflow.engine.run_state import load_dense

    state = load_dense(setup.init_from.state_dir)
    model.load_state_dict(state["dense"])
    optimizer.load_state_dict(state["dense_optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = setup.config.lr


def dense_state(setup: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The final state in the layout documented in :mod:`dlrmflow.engine.run_state`, but the embedding rows
    (what dense.pt holds)."""
    spec = setup.spec
    return {
        "format_version": FORMAT_VERSION,
        "mode": setup.config.mode,
        "model": setup.model_config.name,
        "model_config": asdict(setup.model_config),
        "dense": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "dense_optimizer": to_cpu(optimizer.state_dict()),
        "embedding": {
            "dim": spec.dim,
            "optimizer": spec.optimizer,
            "state_width": spec.state_width,
            "own_accumulator_columns": spec.own_accumulator_columns,
            "table_offsets": list(spec.table_offsets),
            "cardinalities": list(spec.cardinalities),
        },
    }


def collect_state(setup: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: RowStore) -> dict:
    """The whole final state, every embedding row gathered into this process (``store.all_rows()``): what a
    run collected before each shard wrote its own file; tests compare the files with it."""
    state = dense_state(setup, model, optimizer)
    rows = torch.from_numpy(np.ascontiguousarray(store.all_rows()))
    state["embedding"] = {"rows": rows, **state["embedding"]}
    return state


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    return obj

