"""Building blocks shared by the models: linear layers and MLPs with one initialisation rule.

Every ``nn.Linear`` of every model is initialised as facebookresearch/dlrm initialises its MLPs:
``W ~ N(0, sqrt(2 / (in + out)))``, ``b ~ N(0, sqrt(1 / out))``, drawn from the model's own
``torch.Generator`` in construction order, so a model's initial parameters are a function of its
configuration and seed alone.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dlrmflow.engine.errors import UserInputError


class ModelConfigError(UserInputError):
    """The architecture asked for does not fit the model or the data."""



def linear(n_in: int, n_out: int, generator: torch.Generator) -> nn.Linear:
    """An ``n_in -> n_out`` linear layer with the reference initialisation."""
    layer = nn.Linear(n_in, n_out)
    with torch.no_grad():
        layer.weight.normal_(0.0, float(np.sqrt(2.0 / (n_in + n_out))), generator=generator)
        layer.bias.normal_(0.0, float(np.sqrt(1.0 / n_out)), generator=generator)
    return layer


def mlp(sizes: list[int], generator: torch.Generator) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...``, each followed by a ReLU (a caller that wants a
    linear output drops the last one: ``mlp(...)[:-1]``)."""
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [linear(n_in, n_out, generator), nn.ReLU()]
    return nn.Sequential(*layers)


def check_layers(what: str, sizes: tuple[int, ...]) -> None:
    """Layer sizes must be positive integers, at least one (a UserInputError naming ``what`` otherwise)."""
    if not sizes or min(sizes) < 1:
        raise UserInputError(f"{what}: layer sizes must be positive, at least one layer; got {list(sizes)}")
