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
optimizer (row-wise Adagrad: ``v_k`` shares one accumulator, ``w_k`` has its own, as in Wide & Deep);
``a`` and ``b`` are dense parameters. The dense features enter the first-order term linearly and the DNN
concatenated with the embeddings; they have no factor vectors, so the pairwise term is over the
categorical fields. (BARS / FuxiCTR give each numeric field a factor vector scaled by its value.)

Defaults: a 400-400-400 DNN, BARS DeepFM_criteo_x1 (reczoo/BARS, FuxiCTR v1.1.0 ``DeepFM``,
``hidden_units: [400, 400, 400]``; AUC 0.8138 on Criteo_x1). BARS trains with dropout 0.1, batch norm
and an embedding regulariser; this module has none of them, and uses the shared ``--embedding-dim``
(BARS: 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dlrmflow.engine.models.wide_deep import (
    DEFAULT_DNN,
    FIRST_ORDER_COLUMNS,
    ROW_INIT_STD,
    WideDeep,
    WideDeepConfig,
    row_width,
)

__all__ = ["DEFAULT_DNN", "FIRST_ORDER_COLUMNS", "ROW_INIT_STD", "DeepFM", "DeepFMConfig", "config_from",
           "pairwise_interactions", "row_width"]


@dataclass(frozen=True)
class DeepFMConfig(WideDeepConfig):
    name: ClassVar[str] = "deepfm"


config_from = DeepFMConfig.from_settings


def pairwise_interactions(factors: torch.Tensor) -> torch.Tensor:
    """``sum_{i<j} <v_i, v_j>`` [B] of factor vectors [B, T, D], by Rendle's identity."""
    square_of_sum = factors.sum(1).square()
    sum_of_squares = factors.square().sum(1)
    return 0.5 * (square_of_sum - sum_of_squares).sum(1)


class DeepFM(WideDeep):
    """Wide & Deep's parameters and initialisation (the DNN, ``a``, ``b``; the same default DNN, as in BARS),
    with the wide part a factorization machine over the DNN's factor vectors."""

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
