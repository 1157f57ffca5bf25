"""Building blocks shared by the models: linear layers and MLPs, initialised as the references do.

Every ``nn.Linear`` weight is ``W ~ N(0, sqrt(2 / (in + out)))``: facebookresearch/dlrm's rule for its
MLPs, which is also Glorot's normal rule (``xavier_normal_``) that FuxiCTR applies to every linear layer
(``fuxictr/pytorch/models/rank_model.py``, ``reset_parameters``). The bias is where they differ:
``b ~ N(0, sqrt(1 / out))`` in DLRM (``bias="normal"``), zero in FuxiCTR and DeepCTR-Torch's cross
layers (``bias="zero"``), or no bias at all for an output unit whose model adds its one output bias
itself (``bias="none"``, DeepCTR-Torch's ``dnn_linear``). That output unit's weight is ``nn.Linear``'s
own default, uniform in ``+-1/sqrt(in)`` (``weight="torch"``), as DeepCTR-Torch leaves its ``dnn_linear``:
2.4 times smaller than Glorot's for DCN-v2's 929 inputs, so the initial logit stays near the bias.
DeepCTR-Torch's DNN draws its weights ``N(0, 1e-4)`` (``weight="normal-1e-4"``) and leaves its biases at
``nn.Linear``'s default, uniform in ``+-1/sqrt(in)`` (``bias="torch"``): the hidden layers' ``deepctr``
rule (:data:`HIDDEN_LAYER_INITS`).
Values are drawn from the model's own ``torch.Generator`` in construction order, so a model's initial
parameters are a function of its configuration and seed alone.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dlrmflow.engine.errors import UserInputError

# DeepCTR-Torch's ``init_std`` (deepctr_torch/inputs.py create_embedding_matrix, models/basemodel.py
# Linear) and FuxiCTR's embedding initializer (normal, std 1e-4): the scale at which the references start
# embeddings, first-order weights and the linear part's dense weights, so that the initial logit is
# close to the output bias whatever the features.
REFERENCE_INIT_STD = 1e-4
BIAS_INITS = ("normal", "zero", "torch", "none")
WEIGHT_INITS = ("glorot", "torch", "normal-1e-4")
# The hidden layers' rules (models.HIDDEN_INITS, --hidden-init) as linear()'s weight and bias rules: FuxiCTR's
# (rank_model.py reset_parameters) and DeepCTR-Torch's DNN (deepctr_torch/layers/core.py: nn.init.normal_ on the
# weights with init_std, the biases left as nn.Linear made them).
HIDDEN_LAYER_INITS = {"glorot": {"weight": "glorot", "bias": "zero"},
                      "deepctr": {"weight": "normal-1e-4", "bias": "torch"}}


class ModelConfigError(UserInputError):
    """The architecture asked for does not fit the model or the data."""



def linear(n_in: int, n_out: int, generator: torch.Generator, *, bias: str = "normal",
           weight: str = "glorot") -> nn.Linear:
    """An ``n_in -> n_out`` linear layer: weights ``glorot`` (normal), ``torch`` (uniform in ``+-1/sqrt(n_in)``)
    or ``normal-1e-4``; the bias ``normal`` (DLRM's), ``zero``, ``torch`` (uniform in ``+-1/sqrt(n_in)``) or
    ``none`` (module docstring)."""
    if bias not in BIAS_INITS or weight not in WEIGHT_INITS:
        raise ValueError(f"bias must be one of {BIAS_INITS} and weight one of {WEIGHT_INITS}, got {bias!r}, "
                         f"{weight!r}")
    layer = nn.Linear(n_in, n_out, bias=bias != "none")
    with torch.no_grad():
        bound = float(1.0 / np.sqrt(n_in))  # nn.Linear's own, for weights and biases
        if weight == "glorot":
            layer.weight.normal_(0.0, float(np.sqrt(2.0 / (n_in + n_out))), generator=generator)
        elif weight == "normal-1e-4":
            layer.weight.normal_(0.0, REFERENCE_INIT_STD, generator=generator)
        else:
            layer.weight.uniform_(-bound, bound, generator=generator)
        if bias == "normal":
            layer.bias.normal_(0.0, float(np.sqrt(1.0 / n_out)), generator=generator)
        elif bias == "torch":
            layer.bias.uniform_(-bound, bound, generator=generator)
        elif bias == "zero":
            layer.bias.zero_()
    return layer


def mlp(sizes: list[int], generator: torch.Generator, *, bias: str = "normal", weight: str = "glorot"
        ) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...``, each followed by a ReLU (a caller that wants a
    linear output drops the last one: ``mlp(...)[:-1]``); ``bias`` and ``weight`` as :func:`linear`'s."""
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [linear(n_in, n_out, generator, bias=bias, weight=weight), nn.ReLU()]
    return nn.Sequential(*layers)


def hidden_layers(sizes: list[int], generator: torch.Generator, init: str) -> nn.Sequential:
    """The DNN's hidden layers ``sizes[0] -> sizes[1] -> ...`` (each followed by a ReLU), started by the rule
    ``init`` of :data:`HIDDEN_LAYER_INITS`."""
    return mlp(sizes, generator, **HIDDEN_LAYER_INITS[init])


def check_hidden_init(init: str) -> None:
    """``init`` must be a hidden layers' rule (:data:`HIDDEN_LAYER_INITS`); a UserInputError otherwise."""
    if init not in HIDDEN_LAYER_INITS:
        raise UserInputError(f"hidden_init: unknown hidden layers' initialisation {init!r}; choose one of "
                             f"{', '.join(HIDDEN_LAYER_INITS)}")


def check_layers(what: str, sizes: tuple[int, ...]) -> None:
    """Layer sizes must be positive integers, at least one (a UserInputError naming ``what`` otherwise)."""
    if not sizes or min(sizes) < 1:
        raise UserInputError(f"{what}: layer sizes must be positive, at least one layer; got {list(sizes)}")
