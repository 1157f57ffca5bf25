"""AUC and log loss against brute-force definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlrmflow.engine.training.metrics import LOG_LOSS_EPS, log_loss, roc_auc


def auc_by_pairs(labels, scores) -> float:
    """P(positive scores above negative), ties 1/2, by enumerating every (positive, negative) pair."""
    pos = [s for y, s in zip(labels, scores, strict=True) if y == 1]
    neg = [s for y, s in zip(labels, scores, strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def log_loss_by_loop(labels, probs) -> float:
    total = 0.0
    for y, p in zip(labels, probs, strict=True):
        p = min(max(p, LOG_LOSS_EPS), 1 - LOG_LOSS_EPS)
        total += -math.log(p) if y == 1 else -math.log(1 - p)
    return total / len(labels)


def test_fixed_inputs():
    labels, scores = [0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]
    assert roc_auc(labels, scores) == auc_by_pairs(labels, scores) == 0.75
    assert log_loss(labels, scores) == pytest.approx(log_loss_by_loop(labels, scores), rel=1e-12)
    assert roc_auc([1, 0], [0.3, 0.3]) == 0.5  # a tie is half a win
    assert roc_auc([0, 1, 1], [0.9, 0.1, 0.2]) == 0.0


@pytest.mark.parametrize("seed", range(30))
def test_random_inputs_with_ties_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    labels = rng.integers(0, 2, n)
    labels[0], labels[1] = 0, 1  # both classes present
    # Few distinct values -> many ties; sometimes exact 0/1 probabilities (clipped by log loss).
    scores = rng.integers(0, int(rng.integers(1, 6)) + 1, n) / 5.0
    assert roc_auc(labels, scores) == pytest.approx(auc_by_pairs(labels, scores), abs=1e-12)
    assert log_loss(labels, scores) == pytest.approx(log_loss_by_loop(labels, scores), rel=1e-12)


def test_auc_is_undefined_without_both_classes():
    assert math.isnan(roc_auc([1, 1, 1], [0.1, 0.2, 0.3]))
    assert math.isnan(roc_auc([0, 0], [0.1, 0.2]))


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in length"):
        roc_auc([0, 1], [0.5])
    with pytest.raises(ValueError, match="differ in length"):
        log_loss([0, 1], [0.5])
