"""A finished run's model for TorchRec: ``dlrmflow export RUN_DIR --to torchrec --output DIR`` (docs/export.md).

DLRM: ``model.pt``, the state dict of TorchRec's ``torchrec.models.dlrm.DLRM`` (checked against TorchRec
1.8.0): its ``EmbeddingBagCollection`` has one table per sparse feature, ``t_<feature>`` reading the feature
of the dataset's column name, every table the run's final rows' weights (their first ``dim`` values: the
optimizer state stays behind); the dense arch is the bottom MLP, the over arch the top MLP. Both models
compute the same function, except that TorchRec orders the pairwise dot products as the upper triangle of
the interaction matrix (``triu_indices``) and dlrmflow as the lower triangle (facebookresearch/dlrm's order):
the over arch's first layer gets its columns permuted to match (:func:`interaction_permutation`).

Wide & Deep, DeepFM, DCN-v2 (TorchRec has none of them): ``model.pt2``, a ``torch.export`` program of the
whole model, its tables included (``embeddings.<feature>.weight``): ``(dense [n, num_dense] float32, sparse
[n, num_tables] int64 ids) -> click logits [n]``; ``torch.export.load(path).module()`` runs it, without
dlrmflow.

Both: ``export.json`` (what the export holds: the model, its features in order, TorchRec's constructor
arguments or the program's inputs, the run and its state SHA-256) and, when the run's dataset keeps one, its
vocabulary (``vocabulary.json`` and its files: ``dlrmflow.load_vocabulary(DIR)`` maps raw values to ids).

The final state is checked against its manifest's SHA-256 first (every row read once). Everything is written
into a directory beside DIR and renamed into place at the end: a failed export leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dlrmflow.engine.training.export_checks import EXPORT_FILE, ExportError, check_output, check_target
from dlrmflow.engine.training.trained_model import TrainedModel, load_model

TORCHREC_STATE_FILE = "model.pt"
PROGRAM_FILE = "model.pt2"
EXPORT_FORMAT_VERSION = 1
TORCHREC_DLRM = "torchrec.models.dlrm.DLRM"
TORCHREC_TABLES = "sparse_arch.embedding_bag_collection.embedding_bags"


def table_name(feature: str) -> str:
    """The TorchRec table that reads ``feature`` (TorchRec's examples name theirs ``t_<feature>``)."""
    return f"t_{feature}"


def interaction_permutation(num_tables: int) -> np.ndarray:
    """For each pairwise dot product in TorchRec's order (the strict upper triangle of the ``[T + 1, T + 1]``
    interaction matrix, row-major), its position in dlrmflow's (the strict lower triangle, row-major)."""
    features = num_tables + 1
    lower_rows, lower_cols = np.tril_indices(features, k=-1)
    position = {(int(i), int(j)): p for p, (i, j) in enumerate(zip(lower_rows, lower_cols, strict=True))}
    upper_rows, upper_cols = np.triu_indices(features, k=1)
    # z[i, j] = <f_i, f_j> = z[j, i]: TorchRec's (i, j) above the diagonal is dlrmflow's (j, i) below it.
    return np.array([position[(int(j), int(i))] for i, j in zip(upper_rows, upper_cols, strict=True)], np.int64)


def _linear_layers(sequential: nn.Sequential) -> list[nn.Linear]:
    return [m for m in sequential if isinstance(m, nn.Linear)]


def torchrec_dlrm_state(model: TrainedModel, tables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of TorchRec's DLRM for a dlrmflow DLRM (module docstring); ``tables``: feature name ->
    its weights ``[cardinality, dim]``."""
    dense = model.model
    state = {f"{TORCHREC_TABLES}.{table_name(f)}.weight": w for f, w in tables.items()}
    for i, layer in enumerate(_linear_layers(dense.bottom)):
        state[f"dense_arch.model._mlp.{i}._linear.weight"] = layer.weight.detach().clone()
        state[f"dense_arch.model._mlp.{i}._linear.bias"] = layer.bias.detach().clone()
    top = _linear_layers(dense.top)
    for i, layer in enumerate(top):
        prefix = "over_arch.model.1" if i == len(top) - 1 else f"over_arch.model.0._mlp.{i}._linear"
        weight = layer.weight.detach().clone()
        if i == 0:
            dim = model.config.embedding_dim
            order = torch.from_numpy(dim + interaction_permutation(model.num_tables))
            weight = torch.cat([weight[:, :dim], weight.index_select(1, order)], dim=1)
        state[f"{prefix}.weight"] = weight
        state[f"{prefix}.bias"] = layer.bias.detach().clone()
    return state


def torchrec_dlrm_arguments(model: TrainedModel, features: tuple[str, ...]) -> dict[str, Any]:
    """TorchRec's ``EmbeddingBagConfig`` and ``DLRM`` constructor arguments for the exported state dict."""
    config = model.config
    return {"class": TORCHREC_DLRM,
            "tables": [{"name": table_name(f), "feature_names": [f], "num_embeddings": n,
                        "embedding_dim": config.embedding_dim, "pooling": "SUM"}
                       for f, n in zip(features, model.cardinalities, strict=True)],
            "dense_in_features": config.num_dense,
            "dense_arch_layer_sizes": list(config.bottom_mlp),
            "over_arch_layer_sizes": list(config.top_mlp)}


class ProgramModel(nn.Module):
    """The whole model for ``torch.export``: a table per feature, looked up by id, then the dense part."""

    def __init__(self, model: TrainedModel, tables: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.features = list(tables)
        self.embeddings = nn.ModuleDict({f: nn.Embedding.from_pretrained(w, freeze=True) for f, w in tables.items()})
        self.model = model.model

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        rows = torch.stack([self.embeddings[f](sparse[:, k]) for k, f in enumerate(self.features)], dim=1)
        return self.model(dense, rows)


def export_program(model: TrainedModel, tables: dict[str, torch.Tensor], path: Path) -> None:
    """``model`` and its tables as a ``torch.export`` program with a dynamic batch size, saved at ``path``."""
    program_model = ProgramModel(model, tables).eval()
    batch = torch.export.Dim("batch", min=1)
    example = (torch.zeros(2, model.num_dense), torch.zeros(2, model.num_tables, dtype=torch.int64))
    with torch.no_grad():
        program = torch.export.export(program_model, example,
                                      dynamic_shapes={"dense": {0: batch}, "sparse": {0: batch}})
    torch.export.save(program, path)


def _tables(model: TrainedModel, features: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {f: torch.from_numpy(model.table_rows(k)) for k, f in enumerate(features)}


def export_run(run_dir: str | os.PathLike, output: str | os.PathLike, *, to: str = "torchrec") -> dict[str, Any]:
    """Export the finished run ``run_dir`` into the directory ``output`` (module docstring); what was written."""
    started = time.perf_counter()
    check_target(to)
    target = check_output(output)
    model = load_model(run_dir, verify=True)
    features = model.features
    if features.sparse is None:
        raise ExportError(f"RUN_DIR {run_dir}: the dataset it trained on is gone or was rewritten, so its feature "
                          "names and vocabulary are unknown")
    if model.model_name == "dlrm" and len(model.config.top_mlp) < 2:
        raise ExportError(f"RUN_DIR {run_dir}: TorchRec's DLRM needs an over arch of two layers or more; this "
                          f"run's top MLP is {list(model.config.top_mlp)}")
    fingerprint, vocabulary = _dataset_vocabulary(model)
    staged = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.partial"
    made = [p for p in reversed(target.parents) if not p.exists()]  # removed again if the export fails
    staged.mkdir(parents=True)
    try:
        tables = _tables(model, features.sparse)
        description: dict[str, Any] = {
            "format_version": EXPORT_FORMAT_VERSION, "to": to, "model": model.model_name,
            "architecture": _plain(asdict(model.config)), "run_dir": model.run_dir, "state_sha256": model.state_sha256,
            "dataset": model.features.dataset, "dataset_fingerprint": fingerprint,
            "dense_features": list(features.dense), "sparse_features": list(features.sparse),
            "cardinalities": list(model.cardinalities), "embedding_dim": model.dim}
        if model.model_name == "dlrm":
            torch.save(torchrec_dlrm_state(model, tables), staged / TORCHREC_STATE_FILE)
            description |= {"file": TORCHREC_STATE_FILE, "format": f"{TORCHREC_DLRM} state dict",
                            "torchrec": torchrec_dlrm_arguments(model, features.sparse)}
        else:
            export_program(model, tables, staged / PROGRAM_FILE)
            description |= {"file": PROGRAM_FILE, "format": "torch.export program",
                            "program": {"inputs": ["dense float32 [n, num_dense]", "sparse int64 [n, num_tables]"],
                                        "output": "click logits float32 [n]"}}
        files = [description["file"]]
        if vocabulary is not None:
            from dlrmflow.datasets.vocabulary_lookup import write_vocabulary

            files += write_vocabulary(vocabulary, staged)
        description |= {"vocabulary": "vocabulary.json" if vocabulary is not None else None,
                        "files": sorted([*files, EXPORT_FILE])}
        (staged / EXPORT_FILE).write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        for directory in reversed(made):
            directory.rmdir()
        raise
    return {"run_dir": model.run_dir, "output": str(target), "to": to, "model": model.model_name,
            "format": description["format"], "tables": model.num_tables,
            "embedding_rows": int(sum(model.cardinalities)), "embedding_dim": model.dim,
            "files": description["files"], "bytes": sum((target / f).stat().st_size for f in description["files"]),
            "vocabulary": vocabulary is not None, "state_sha256": model.state_sha256,
            "seconds": time.perf_counter() - started}


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _dataset_vocabulary(model: TrainedModel) -> tuple[str, Any]:
    """The fingerprint of the run's dataset and its vocabulary (None when it keeps none: written from arrays)."""
    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.datasets.vocabulary_lookup import load_vocabulary

    meta = read_meta(model.features.dataset)
    return meta.fingerprint, None if meta.vocabulary is None else load_vocabulary(model.features.dataset)
