"""DeepFM (Guo et al. 2017, arXiv:1703.04247), the dense part.

    rows [B, T, D+1] (looked up by the trainer): row k = [v_k (D values), w_k (1 value)]
    fm    = b + <a, dense> + sum_k w_k + sum_{i<j} <v_i, v_j>     a factorization machine over the T fields
    deep  = DNN([v_1, ..., v_T, dense])                           ReLU hidden layers, one linear output unit
    logit = fm + deep;  sigmoid gives the click probability

The FM and the DNN share the factor vectors ``v_k`` (the paper's point). The pairwise term is
computed in O(T D) by Rendle's identity (Rendle 2010, "Factorization Machines", lemma 3.1):
``sum_{i<j} <v_i, v_j> = 1/2 sum_d ((sum_k v_kd)^2 - sum_k v_kd^2)``.

Every per-id parameter lives in the id's embedding row: its factor vector ``v_k`` and, in the next
column, its first-order weight ``w_k`` (``row_width(D) = D + 1``), both trained by the embedding
optimizer (row-wise Adagrad: one accumulator per row, shared by its D + 1 values); ``a`` and ``b``
are dense parameters. The dense features enter the first-order term linearly and the DNN
concatenated with the embeddings; they have no factor vectors, so the pairwise term is over the
categorical fields. (BARS / FuxiCTR give each numeric field a factor vector scaled by its value.)

Defaults: a 400-400-400 DNN, BARS DeepFM_criteo_x1 (reczoo/BARS, FuxiCTR v1.1.0 ``DeepFM``,
``hidden_units: [400, 400, 400]``; AUC 0.8138 on Criteo_x1). BARS trains with dropout 0.1, batch norm
and an embedding regulariser; this module has none of them, and uses the shared ``--embedding-dim``
(BARS: 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from dlrmflow.engine.models.layers import check_layers, mlp

DEFAULT_DNN = (400, 400, 400)  # BARS DeepFM_criteo_x1: hidden_units [400, 400, 400]


@dataclass(frozen=True)
class DeepFMConfig:
    num_dense: int
    num_tables: int
    embedding_dim: int = 16
    dnn: tuple[int, ...] = DEFAULT_DNN  # hidden layer sizes; the output unit follows
    name: ClassVar[str] = "deepfm"

    def __post_init__(self) -> None:
        check_layers("dnn", self.dnn)

    @property
    def deep_input_width(self) -> int:
        return self.num_tables * self.embedding_dim + self.num_dense


def row_width(embedding_dim: int) -> int:
    return embedding_dim + 1  # the factor vector, then the first-order weight


def config_from(settings: Any, num_dense: int, num_tables: int) -> DeepFMConfig:
    return DeepFMConfig(num_dense, num_tables, settings.embedding_dim, tuple(settings.dnn or DEFAULT_DNN))


def pairwise_interactions(factors: torch.Tensor) -> torch.Tensor:
    """``sum_{i<j} <v_i, v_j>`` [B] of factor vectors [B, T, D], by Rendle's identity."""
    square_of_sum = factors.sum(1).square()
    sum_of_squares = factors.square().sum(1)
    return 0.5 * (square_of_sum - sum_of_squares).sum(1)


class DeepFM(nn.Module):
    def __init__(self, config: DeepFMConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        self.deep = mlp([config.deep_input_width, *config.dnn, 1], generator)[:-1]  # linear output unit
        self.dense_weight = nn.Parameter(torch.empty(config.num_dense))  # a: first-order weights of dense
        self.bias = nn.Parameter(torch.zeros(()))  # b
        with torch.no_grad():
            self.dense_weight.normal_(0.0, float(np.sqrt(2.0 / (config.num_dense + 1))), generator=generator)

    def fm(self, dense: torch.Tensor, factors: torch.Tensor, first_order: torch.Tensor) -> torch.Tensor:
        """The factorization machine [B]: bias, first-order terms, pairwise interactions."""
        return self.bias + dense @ self.dense_weight + first_order.sum(1) + pairwise_interactions(factors)

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Click logits [B] from dense features [B, num_dense] and embedding rows [B, T, D + 1]."""
        dim = self.config.embedding_dim
        factors, first_order = rows[:, :, :dim], rows[:, :, dim]
        deep_input = torch.cat([factors.flatten(1), dense], dim=1)
        return self.fm(dense, factors, first_order) + self.deep(deep_input).squeeze(1)


MODEL = DeepFM
