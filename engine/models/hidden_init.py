"""How the DNN's hidden layers of Wide & Deep, DeepFM and DCN-v2 start (``--hidden-init``), importable without
torch (the CLI builds its options from it); :mod:`.layers` turns a rule into weights and biases."""

from __future__ import annotations

# How the DNN's hidden layers of Wide & Deep, DeepFM and DCN-v2 start (--hidden-init; layers.HIDDEN_LAYER_INITS):
# glorot, FuxiCTR's (Glorot normal weights, zero biases), or deepctr, DeepCTR-Torch's DNN (weights N(0, 1e-4),
# biases nn.Linear's default uniform in +-1/sqrt(in)).
HIDDEN_INITS = ("glorot", "deepctr")
HIDDEN_INIT_SETTINGS = ("auto", *HIDDEN_INITS)
# Architecture fields added after runs had recorded their architecture (a summary's, a final state's model_config),
# each with the value such a run was built with: before --hidden-init every hidden layer started Glorot's way.
ADDED_ARCHITECTURE = {"hidden_init": "glorot"}
# --hidden-init auto, per --dense-optimizer. DeepCTR-Torch's 1e-4 weights give the inner layers gradients of
# order 1e-8: SGD's step (lr * g) leaves them where they are, Adam's (about lr whatever g's scale) moves them,
# and from there Adam reaches DeepCTR-Torch's figures where it did not from Glorot's (benchmarks/RESULTS.md,
# issue 47; docs/models.md says where not).
AUTO_HIDDEN_INIT = {"sgd": "glorot", "adam": "deepctr"}


def hidden_init_for(setting: str, dense_optimizer: str) -> str:
    """The hidden layers' initialisation (one of HIDDEN_INITS) that ``--hidden-init setting`` means under
    ``--dense-optimizer dense_optimizer``."""
    return AUTO_HIDDEN_INIT[dense_optimizer] if setting == "auto" else setting
