"""Wide & Deep (Cheng et al. 2016, arXiv:1606.07792), the dense part.

    rows [B, T, D+1] (looked up by the trainer): row k = [v_k (D values), w_k (1 value)]
    wide  = sum_k w_k + <a, dense> + b          a linear model: one weight per id, one per dense feature
    deep  = DNN([v_1, ..., v_T, dense])         ReLU hidden layers, then one linear output unit
    logit = wide + deep;  sigmoid gives the click probability

Every per-id parameter lives in the id's embedding row: its deep embedding ``v_k`` and, in the
next column, its wide weight ``w_k`` (``row_width(D) = D + 1``). Both are trained by the embedding
optimizer; under row-wise Adagrad ``v_k`` shares one accumulator and ``w_k`` has one of its own
(``FIRST_ORDER_COLUMNS``), so the wide weight takes per-value Adagrad's step, as in DeepCTR-Torch,
not one scaled by the embedding's gradients. ``a`` and ``b`` are dense parameters. The dense
features enter both parts: the wide part as a linear term, the deep part concatenated with the
embeddings (as BARS / FuxiCTR feed Criteo's numeric fields to both). The wide part holds the raw
features only: the paper's hand-made cross-product features are left out, as in BARS.

Defaults: a 400-400-400 DNN, BARS WideDeep_criteo_x1 (reczoo/BARS, FuxiCTR v1.1.0 ``WideDeep``,
``hidden_units: [400, 400, 400]``; AUC 0.8138 on Criteo_x1). BARS trains with dropout 0.1, batch
norm and an embedding regulariser; this module has none of them (training stays a deterministic
function of the rows, like DLRM's), and uses the shared ``--embedding-dim`` (BARS: 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dlrmflow.engine.models.hidden_init import ADDED_ARCHITECTURE, hidden_init_for
from dlrmflow.engine.models.layers import REFERENCE_INIT_STD, check_hidden_init, check_layers, hidden_layers, linear

DEFAULT_DNN = (400, 400, 400)  # BARS WideDeep_criteo_x1: hidden_units [400, 400, 400]
# Every value of a row (the deep embedding and the wide weight) starts with this standard deviation:
# DeepCTR-Torch's embeddings and linear-part embeddings (deepctr_torch/inputs.py, models/basemodel.py).
ROW_INIT_STD = REFERENCE_INIT_STD
# The row's last value, the wide weight, is a first-order weight: it keeps an optimizer accumulator of its own
# (RowSpec.own_accumulator_columns). Sharing the embedding's accumulator would give it steps up to sqrt(D + 1)
# times per-value Adagrad's while the embedding's gradients are small, which fits the noise of rare ids
# (measured: benchmarks/RESULTS.md, issue 47).
FIRST_ORDER_COLUMNS = 1


@dataclass(frozen=True)
class WideDeepConfig:
    num_dense: int
    num_tables: int
    embedding_dim: int = 16
    dnn: tuple[int, ...] = DEFAULT_DNN  # hidden layer sizes; the output unit follows
    hidden_init: str = ADDED_ARCHITECTURE["hidden_init"]  # how the hidden layers start (models.HIDDEN_INITS)
    name: ClassVar[str] = "wide-deep"

    def __post_init__(self) -> None:
        check_layers("dnn", self.dnn)
        check_hidden_init(self.hidden_init)

    @property
    def deep_input_width(self) -> int:
        return self.num_tables * self.embedding_dim + self.num_dense

    @classmethod
    def from_settings(cls, settings: Any, num_dense: int, num_tables: int) -> WideDeepConfig:
        return cls(num_dense, num_tables, settings.embedding_dim, tuple(settings.dnn or DEFAULT_DNN),
                   hidden_init_for(settings.hidden_init, settings.dense_optimizer))


def row_width(embedding_dim: int) -> int:
    return embedding_dim + 1  # the deep embedding, then the wide weight


config_from = WideDeepConfig.from_settings


class WideDeep(nn.Module):
    def __init__(self, config: WideDeepConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        # Hidden layers by the config's rule (FuxiCTR's or DeepCTR-Torch's); the output unit as DeepCTR-Torch's
        # dnn_linear (nn.Linear's default weights, no bias): b below is the model's one output bias (two
        # would move the logit's offset at twice the rate).
        hidden = hidden_layers([config.deep_input_width, *config.dnn], generator, config.hidden_init)
        self.deep = nn.Sequential(*hidden, linear(config.dnn[-1], 1, generator, bias="none", weight="torch"))
        self.dense_weight = nn.Parameter(torch.empty(config.num_dense))  # a: the wide part's dense weights
        self.bias = nn.Parameter(torch.zeros(()))  # b, DeepCTR-Torch's PredictionLayer bias: zero
        with torch.no_grad():
            # DeepCTR-Torch's Linear.weight: N(0, init_std). Dense features reach ~7 (log1p of counts):
            # a Glorot-scale a made <a, dense> the initial logit's largest part.
            self.dense_weight.normal_(0.0, REFERENCE_INIT_STD, generator=generator)

    def wide(self, dense: torch.Tensor, wide_weights: torch.Tensor) -> torch.Tensor:
        """The linear model [B]: the ids' weights [B, T] summed, plus ``<a, dense> + b``."""
        return wide_weights.sum(1) + dense @ self.dense_weight + self.bias

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Click logits [B] from dense features [B, num_dense] and embedding rows [B, T, D + 1]."""
        dim = self.config.embedding_dim
        embeddings, wide_weights = rows[:, :, :dim], rows[:, :, dim]
        deep_input = torch.cat([embeddings.flatten(1), dense], dim=1)
        return self.wide(dense, wide_weights) + self.deep(deep_input).squeeze(1)


MODEL = WideDeep
