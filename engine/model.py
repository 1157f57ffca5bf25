"""DLRM, the dense part (facebookresearch/dlrm's ``DLRM_Net`` without its embedding tables).

    dense features ──bottom MLP (ReLU)──► x [B, D]
    embeddings [B, T, D] (looked up by the trainer) ─┐
    dot interaction: Z = [x, e_1..e_T] · [x, e_1..e_T]^T, keep the strict lower triangle,
                     concatenate with x  ──► [B, D + (T+1)T/2]
    top MLP (ReLU, last layer linear) ──► logit; sigmoid gives the click probability

The embedding lookup is not part of the module: the trainer gathers the batch's rows from
wherever they live (local table, embedding servers, cache) and passes them in, so every
trainer mode runs one and the same model code. The loss is binary cross-entropy; it is
computed from the logit (``binary_cross_entropy_with_logits``), which equals BCE of the
sigmoid output without its overflow at large logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dlrmflow.errors import UserInputError


@dataclass(frozen=True)
class DLRMConfig:
    num_dense: int
    num_tables: int
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)  # layer sizes after the input; last = embedding_dim
    top_mlp: tuple[int, ...] = (512, 256, 1)  # the last must be 1

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


def _mlp(sizes: list[int], generator: torch.Generator) -> nn.Sequential:
    """Linear layers with ReLU between them (and after the last one for the bottom MLP: see caller)."""
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        layer = nn.Linear(n_in, n_out)
        # The reference's init: W ~ N(0, sqrt(2 / (in + out))), b ~ N(0, sqrt(1 / out)).
        with torch.no_grad():
            layer.weight.normal_(0.0, float(np.sqrt(2.0 / (n_in + n_out))), generator=generator)
            layer.bias.normal_(0.0, float(np.sqrt(1.0 / n_out)), generator=generator)
        layers += [layer, nn.ReLU()]
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, config: DLRMConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        self.bottom = _mlp([config.num_dense, *config.bottom_mlp], generator)
        top = _mlp([config.interaction_width, *config.top_mlp], generator)
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


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of sigmoid(logits) against 0/1 labels."""
    return F.binary_cross_entropy_with_logits(logits, labels)
