"""What a run asks of a model by its name: row width, checked architecture, the module, its loss."""


from __future__ import annotations

from dataclasses import asdict
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dlrmflow.engine.models import dcn_v2, deepfm, dlrm, wide_deep

# Each model name of MODELS and its module.
MODULES: dict[str, ModuleType] = {"dlrm": dlrm, "wide-deep": wide_deep, "deepfm": deepfm, "dcn-v2": dcn_v2}
# Each model name and its architecture's dataclass (what a final state's model_config holds).
CONFIGS: dict[str, type] = {"dlrm": dlrm.DLRMConfig, "wide-deep": wide_deep.WideDeepConfig,
                            "deepfm": deepfm.DeepFMConfig, "dcn-v2": dcn_v2.DCNv2Config}


def row_width(name: str, embedding_dim: int) -> int:
    """float32 values per id that the model ``name`` reads from an embedding row (RowSpec.dim)."""
    return MODULES[name].row_width(embedding_dim)


def first_order_columns(name: str) -> int:
    """How many of the last row values of model ``name`` are per-id first-order weights, each with an optimizer
    accumulator of its own (RowSpec.own_accumulator_columns)."""
    return MODULES[name].FIRST_ORDER_COLUMNS


def row_init_std(name: str) -> float | None:
    """The standard deviation every row value of model ``name`` starts with (RowSpec.init_std); None:
    facebookresearch/dlrm's per-table bound ``sqrt(1/n)``."""
    return MODULES[name].ROW_INIT_STD


def model_config(name: str, settings: Any, *, num_dense: int, num_tables: int) -> Any:
    """The checked architecture of model ``name`` that ``settings`` (a TrainConfig: embedding_dim,
    bottom_layers, top_mlp, dnn, cross_layers) asks for on data with these feature counts.
    A UserInputError says what does not fit."""
    return MODULES[name].config_from(settings, num_dense, num_tables)


def config_of(name: str, values: dict[str, Any]) -> Any:
    """The architecture of model ``name`` from its fields as a final state records them (``model_config``)."""
    return CONFIGS[name](**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def build_model(config: Any, seed: int = 0) -> nn.Module:
    """The model of ``config`` (from :func:`model_config`), initialised from ``seed``."""
    return MODULES[config.name].MODEL(config, seed)


def architecture(config: Any) -> dict[str, Any]:
    """``config`` as plain values (layer sizes as lists), with the model's name: what a summary records."""
    values = {name: list(v) if isinstance(v, tuple) else v for name, v in asdict(config).items()}
    return {"model": config.name, **values}


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of sigmoid(logits) against 0/1 labels.

    Computed from the logit (``binary_cross_entropy_with_logits``), which equals BCE of the sigmoid
    output without its overflow at large logits."""
    return F.binary_cross_entropy_with_logits(logits, labels)
