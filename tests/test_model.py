"""DLRM (dense part): architecture, dot interaction, loss, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models import bce_loss
from dlrmflow.engine.models.dlrm import DLRM, DLRMConfig, criteo_config
from dlrmflow.engine.run_state import bit_equal


def _linear_shapes(seq: torch.nn.Sequential) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in seq if isinstance(m, torch.nn.Linear)]


def test_criteo_architecture_matches_the_reference_sizes():
    model = DLRM(criteo_config())
    assert _linear_shapes(model.bottom) == [(13, 512), (512, 256), (256, 64), (64, 16)]
    # 27 features (bottom output + 26 embeddings): 27*26/2 = 351 dot products + 16 = 367 inputs.
    assert _linear_shapes(model.top) == [(367, 512), (512, 256), (256, 1)]
    assert isinstance(model.bottom[-1], torch.nn.ReLU)  # the reference applies ReLU after every bottom layer
    assert isinstance(model.top[-1], torch.nn.Linear)  # the logit: sigmoid lives in the loss / prediction


def _interaction_by_loops(x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """The reference's definition, spelled out: [x, (z_i . z_j for i in 1..F-1, j < i)]."""
    feats = [x] + [emb[:, k] for k in range(emb.shape[1])]
    dots = [(feats[i] * feats[j]).sum(1) for i in range(len(feats)) for j in range(i)]
    return torch.cat([x, torch.stack(dots, dim=1)], dim=1)


@pytest.mark.parametrize("seed", range(5))
def test_dot_interaction_is_the_strict_lower_triangle(seed):
    rng = np.random.default_rng(seed)
    tables, dim, batch = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 9))
    model = DLRM(DLRMConfig(3, tables, dim, (4, dim), (5, 1)), seed=seed)
    x = torch.from_numpy(rng.standard_normal((batch, dim)).astype(np.float32))
    emb = torch.from_numpy(rng.standard_normal((batch, tables, dim)).astype(np.float32))
    got = model.interact(x, emb)
    assert got.shape == (batch, model.config.interaction_width)
    torch.testing.assert_close(got, _interaction_by_loops(x, emb))


def test_forward_equals_the_layers_composed_by_hand():
    torch.manual_seed(0)
    model = DLRM(DLRMConfig(4, 2, 3, (6, 3), (5, 1)), seed=3)
    dense, emb = torch.randn(7, 4), torch.randn(7, 2, 3)
    b1, b2 = [m for m in model.bottom if isinstance(m, torch.nn.Linear)]
    t1, t2 = [m for m in model.top if isinstance(m, torch.nn.Linear)]
    x = F.relu(b2(F.relu(b1(dense))))
    expected = t2(F.relu(t1(_interaction_by_loops(x, emb)))).squeeze(1)
    torch.testing.assert_close(model(dense, emb), expected)


def test_loss_is_binary_cross_entropy_of_the_sigmoid():
    logits = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    p = torch.sigmoid(logits).double()
    expected = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean()
    assert bce_loss(logits, labels).item() == pytest.approx(expected.item(), rel=1e-6)


def test_init_is_a_function_of_the_seed():
    config = DLRMConfig(5, 3, 4, (8, 4), (8, 1))
    a, b, c = DLRM(config, seed=1), DLRM(config, seed=1), DLRM(config, seed=2)
    for (name, p), q, r in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(),
                               strict=True):
        assert bit_equal(p, q), name
        assert not bit_equal(p, r), name


def test_bad_architectures_are_user_errors():
    with pytest.raises(UserInputError, match="embedding dim"):
        DLRMConfig(13, 26, 16, (512, 32), (512, 1))
    with pytest.raises(UserInputError, match="1 output"):
        DLRMConfig(13, 26, 16, (512, 16), (512, 2))
