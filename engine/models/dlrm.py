"""DLRM (Naumov et al. 2019, arXiv:1906.00091), the dense part: facebookresearch/dlrm's ``DLRM_Net``
without its embedding tables.

    dense features ──bottom MLP (ReLU)──► x [B, D]
    embeddings [B, T, D] (looked up by the trainer) ─┐
    dot interaction: Z = [x, e_1..e_T] · [x, e_1..e_T]^T, keep the strict lower triangle,
                     concatenate with x  ──► [B, D + (T+1)T/2]
    top MLP (ReLU, last layer linear) ──► logit; sigmoid gives the click probability

An id's embedding row is its D-vector ``e`` and nothing else (``row_width(D) = D``). Defaults: the
reference's Criteo Kaggle architecture (``dlrm_s_criteo_kaggle.sh``: sparse dim 16, bottom
13-512-256-64-16, top 367-512-256-1; :func:`criteo_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models.layers import ModelConfigError, mlp


@dataclass(frozen=True)
class DLRMConfig:
    num_dense: int
    num_tables: int
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)  # layer sizes after the input; last = embedding_dim
    top_mlp: tuple[int, ...] = (512, 256, 1)  # the last must be 1
    name: ClassVar[str] = "dlrm"

    def __post_init__(self) -> None:
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise UserInputError(
                f"the bottom MLP must end in the embedding dim {self.embedding_dim} (dot interaction), "
                f"got {list(self.bottom_mlp)}"
            )
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise UserInputError(
                f"the top MLP must end in 1 output (the click logit), got {list(self.top_mlp)}"
            )
        if self.num_tables < 1:
            raise UserInputError("DLRM needs at least one categorical feature")

    @property
    def interaction_width(self) -> int:
        features = self.num_tables + 1
        return self.embedding_dim + features * (features - 1) // 2


def criteo_config(num_dense: int = 13, num_tables: int = 26) -> DLRMConfig:
    """The Criteo Kaggle architecture: sparse dim 16, bottom 13-512-256-64-16, top 367-512-256-1."""
    return DLRMConfig(num_dense, num_tables, 16, (512, 256, 64, 16), (512, 256, 1))


def row_width(embedding_dim: int) -> int:
    return embedding_dim


def config_from(settings: Any, num_dense: int, num_tables: int) -> DLRMConfig:
    """The architecture ``settings`` (a TrainConfig) asks for, on data with these feature counts."""
    if not num_dense:
        raise ModelConfigError("dataset_dir: the dataset has no dense features; DLRM's bottom MLP needs at least "
                               "one (--model wide-deep, deepfm and dcn-v2 train without)")
    return DLRMConfig(num_dense, num_tables, settings.embedding_dim, tuple(settings.bottom_layers),
                      tuple(settings.top_mlp))


# Rows keep facebookresearch/dlrm's rule, uniform in +-sqrt(1/n) per table (RowSpec.init_std None).
ROW_INIT_STD = None
# A row is the embedding alone: no per-id first-order weight.
FIRST_ORDER_COLUMNS = 0


class DLRM(nn.Module):
    def __init__(self, config: DLRMConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        self.bottom = mlp([config.num_dense, *config.bottom_mlp], generator)
        top = mlp([config.interaction_width, *config.top_mlp], generator)
        self.top = top[:-1]  # no ReLU after the logit layer
        features = config.num_tables + 1
        rows, cols = torch.tril_indices(features, features, offset=-1)
        # Flat positions of the strict lower triangle in a [F, F] matrix, in the reference's
        # order (row i, then j < i); index_select's backward is deterministic.
        self.register_buffer("tril_flat", rows * features + cols, persistent=False)

    def interact(self, x: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        features = torch.cat([x.unsqueeze(1), embeddings], dim=1)  # [B, T+1, D]
        z = torch.bmm(features, features.transpose(1, 2))  # [B, T+1, T+1]
        return torch.cat([x, z.flatten(1).index_select(1, self.tril_flat)], dim=1)

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Click logits [B] from dense features [B, num_dense] and embeddings [B, T, D]."""
        x = self.bottom(dense)
        return self.top(self.interact(x, embeddings)).squeeze(1)


MODEL = DLRM
