"""DCN-v2 (Wang et al. 2021, "DCN V2: Improved Deep & Cross Network", arXiv:2008.13535), the dense
part, in its parallel structure with full-rank cross layers.

    rows [B, T, D] (looked up by the trainer): row k = v_k
    x_0     = [v_1, ..., v_T, dense]                       [B, d], d = T*D + num_dense
    cross   x_{l+1} = x_0 * (W_l x_l + b_l) + x_l          l = 0 .. L-1, W_l [d, d] (elementwise *)
    deep    h = DNN(x_0)                                   ReLU hidden layers
    logit   = <u, [x_L, h]> + c;  sigmoid gives the click probability

An id's embedding row is its D-vector ``v_k`` and nothing else (``row_width(D) = D``). The dense
features join the embeddings in ``x_0`` (the paper's ``x_0 = [x_embed,1; ...; x_embed,k; x_dense]``),
so both the cross network and the DNN see them.

Defaults: 3 cross layers and a 500-500-500 DNN side by side, BARS DCNv2_criteo_x1 (reczoo/BARS,
FuxiCTR v1.1.0 ``DCNv2``: ``model_structure: parallel``, ``num_cross_layers: 3``,
``parallel_dnn_hidden_units: [500, 500, 500]``, ``use_low_rank_mixture: False``; AUC 0.8139 on
Criteo_x1). BARS trains with dropout 0.1 and an embedding regulariser; this module has neither, and
uses the shared ``--embedding-dim`` (BARS: 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models.hidden_init import ADDED_ARCHITECTURE, hidden_init_for
from dlrmflow.engine.models.layers import REFERENCE_INIT_STD, check_hidden_init, check_layers, hidden_layers, linear

DEFAULT_DNN = (500, 500, 500)  # BARS DCNv2_criteo_x1: parallel_dnn_hidden_units [500, 500, 500]
DEFAULT_CROSS_LAYERS = 3  # BARS DCNv2_criteo_x1: num_cross_layers 3
# Every embedding value starts with this standard deviation (DeepCTR-Torch's and FuxiCTR's embeddings).
ROW_INIT_STD = REFERENCE_INIT_STD
# A row is the embedding alone: no per-id first-order weight.
FIRST_ORDER_COLUMNS = 0


@dataclass(frozen=True)
class DCNv2Config:
    num_dense: int
    num_tables: int
    embedding_dim: int = 16
    dnn: tuple[int, ...] = DEFAULT_DNN  # hidden layer sizes of the deep network
    cross_layers: int = DEFAULT_CROSS_LAYERS
    hidden_init: str = ADDED_ARCHITECTURE["hidden_init"]  # how the DNN's hidden layers start (models.HIDDEN_INITS)
    name: ClassVar[str] = "dcn-v2"

    def __post_init__(self) -> None:
        check_layers("dnn", self.dnn)
        check_hidden_init(self.hidden_init)
        if self.cross_layers < 1:
            raise UserInputError(f"cross_layers: DCN-v2 needs at least one cross layer, got {self.cross_layers}")

    @property
    def input_width(self) -> int:
        return self.num_tables * self.embedding_dim + self.num_dense


def row_width(embedding_dim: int) -> int:
    return embedding_dim


def config_from(settings: Any, num_dense: int, num_tables: int) -> DCNv2Config:
    cross_layers = settings.cross_layers if settings.cross_layers is not None else DEFAULT_CROSS_LAYERS
    return DCNv2Config(num_dense, num_tables, settings.embedding_dim, tuple(settings.dnn or DEFAULT_DNN),
                       cross_layers, hidden_init_for(settings.hidden_init, settings.dense_optimizer))


class DCNv2(nn.Module):
    def __init__(self, config: DCNv2Config, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        width = config.input_width
        # Cross layers: Glorot weights and zero biases, DeepCTR-Torch's CrossNet (matrix kernels xavier_normal_,
        # biases zeros_) and FuxiCTR's linear layers, whatever the DNN's rule. The DNN's hidden layers by the
        # config's rule. The output unit's weights as DeepCTR-Torch's dnn_linear (nn.Linear's default); its bias,
        # zero, is the model's one output bias c (PredictionLayer's).
        self.cross = nn.ModuleList(linear(width, width, generator, bias="zero") for _ in range(config.cross_layers))
        self.deep = hidden_layers([width, *config.dnn], generator, config.hidden_init)
        self.output = linear(width + config.dnn[-1], 1, generator, bias="zero", weight="torch")

    def cross_network(self, x0: torch.Tensor) -> torch.Tensor:
        """``x_L`` [B, d]: the cross layers applied to ``x_0``."""
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return x

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Click logits [B] from dense features [B, num_dense] and embedding rows [B, T, D]."""
        x0 = torch.cat([rows.flatten(1), dense], dim=1)
        both = torch.cat([self.cross_network(x0), self.deep(x0)], dim=1)
        return self.output(both).squeeze(1)


MODEL = DCNv2
