"""Evaluation metrics of click prediction: ROC AUC and log loss."""

from __future__ import annotations

from types import ModuleType

import numpy as np

LOG_LOSS_EPS = 1e-7  # probabilities are clipped to [eps, 1 - eps] (log(0) would be infinite)


def roc_auc(labels, scores, xp: ModuleType = np) -> float:
    """Area under the ROC curve: P(score of a random positive > score of a random negative),
    ties counted one half (the Mann-Whitney U statistic from average ranks). NaN if one class is absent."""
    labels = xp.asarray(labels).astype(xp.float64).ravel()
    scores = xp.asarray(scores).astype(xp.float64).ravel()
    if labels.shape != scores.shape:
        raise ValueError(f"labels and scores differ in length: {labels.shape[0]} vs {scores.shape[0]}")
    n_pos = float(labels.sum())
    n_neg = labels.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = xp.argsort(scores)  # order within ties does not matter: tied scores share a rank
    sorted_scores = scores[order]
    # Average rank (1-based) of every run of equal scores.
    starts = xp.concatenate([xp.asarray([True]), sorted_scores[1:] != sorted_scores[:-1]])
    run_id = xp.cumsum(starts) - 1
    run_start = xp.flatnonzero(starts)
    run_end = xp.concatenate([run_start[1:], xp.asarray([scores.shape[0]])])
    avg_rank = (run_start + run_end + 1) / 2.0
    ranks = avg_rank[run_id]
    rank_sum_pos = float((ranks * labels[order]).sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def log_loss(labels, probabilities, xp: ModuleType = np) -> float:
    """Mean binary cross-entropy of predicted click probabilities (clipped to [eps, 1 - eps])."""
    labels = xp.asarray(labels).astype(xp.float64).ravel()
    p = xp.clip(xp.asarray(probabilities).astype(xp.float64).ravel(), LOG_LOSS_EPS, 1.0 - LOG_LOSS_EPS)
    if labels.shape != p.shape:
        raise ValueError(f"labels and probabilities differ in length: {labels.shape[0]} vs {p.shape[0]}")
    if labels.shape[0] == 0:
        return float("nan")
    return float(-(labels * xp.log(p) + (1.0 - labels) * xp.log1p(-p)).mean())
