"""The models a run can train, one module each: DLRM, Wide & Deep, DeepFM, DCN-v2 (docs/models.md).

Every model is only the dense part of a CTR model. The trainer gathers the batch's embedding rows
(from the local table, the embedding servers or a cache) and calls ``model(dense, rows)`` with
dense features ``[B, num_dense]`` and rows ``[B, T, row_width]``; the model returns click logits
``[B]``. Every per-id parameter of a model sits in that id's row (Wide & Deep's wide weight and
DeepFM's first-order weight next to the factor vector), so ``RowSpec.dim`` is
:func:`row_width` and the servers, caches, plans, parity and recovery store, move and protect rows
without knowing which model reads them. Nothing outside this package looks at the model's name.

A model module provides: a frozen config dataclass (``name`` class attribute, checked on
construction), ``row_width(embedding_dim)``, ``ROW_INIT_STD`` (how its rows start: RowSpec.init_std),
``FIRST_ORDER_COLUMNS`` (how many of the row's last values are per-id first-order weights, each with an
optimizer accumulator of its own: RowSpec.own_accumulator_columns),
``config_from(settings, num_dense, num_tables)``
(the architecture a TrainConfig asks for, with the module's published defaults for what it leaves
unset, and for Wide & Deep, DeepFM and DCN-v2 the hidden layers' initialisation: :func:`hidden_init_for`)
and ``MODEL``, the ``nn.Module`` class built from ``(config, seed)``; its initial parameters are a
function of the config and the seed.
"""

from __future__ import annotations

from typing import Any

from dlrmflow.engine.models.hidden_init import (
    ADDED_ARCHITECTURE,
    AUTO_HIDDEN_INIT,
    HIDDEN_INIT_SETTINGS,
    HIDDEN_INITS,
    hidden_init_for,
)

# The --model choices. Declared here, without torch, so that the training configuration (which the CLI
# imports to build its options) can name them; the modules are in .registry.
MODELS = ("dlrm", "wide-deep", "deepfm", "dcn-v2")
# The architecture settings each model reads; setting one that the chosen model does not read is an error.
MODEL_SETTINGS = {"dlrm": ("bottom_mlp", "top_mlp"), "wide-deep": ("dnn", "hidden_init"),
                  "deepfm": ("dnn", "hidden_init"), "dcn-v2": ("dnn", "cross_layers", "hidden_init")}
_REGISTRY = ("MODULES", "architecture", "bce_loss", "build_model", "first_order_columns", "model_config",
             "row_init_std", "row_width")


def __getattr__(name: str) -> Any:
    """The registry's names (torch and the model modules), imported on first use."""
    if name in _REGISTRY:
        from dlrmflow.engine.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADDED_ARCHITECTURE", "AUTO_HIDDEN_INIT", "HIDDEN_INITS", "HIDDEN_INIT_SETTINGS", "MODELS",
           "MODEL_SETTINGS", "hidden_init_for", *_REGISTRY]
