"""Evaluation metrics of click prediction: ROC AUC and log loss, of all the rows at once (:func:`roc_auc`,
:func:`log_loss`) or merged exactly from summaries of parts of the rows (:class:`ScoreSummary`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
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


# ---- mergeable, exact summaries -------------------------------------------------------------------------
#
# The held-out rows are scored in parts (on a cluster, or a chunk at a time in one process); each part
# leaves a small summary, and the summaries merge into the metrics of the whole. Both merges are exact, so
# the result does not depend on how the rows were cut into parts nor on the order the parts come back:
# scoring on a cluster and scoring in one process agree bit for bit.

# Every finite float64 is an integer multiple of 2**-1074 (the smallest subnormal): a sum of float64 values
# kept as a Python integer in these units is exact, and adding two such sums is exact.
_UNIT_EXPONENT = 1074
_MANTISSA_BITS = 53
_SPLIT_BITS = 26  # a mantissa (< 2**53) as high and low halves of < 2**27 and 2**26
_EXACT_CHUNK = 1 << 24  # values per float64 bincount: its integer partial sums stay below 2**53


def _exact_units(values: np.ndarray) -> int:
    """The exact sum of finite float64 ``values`` in units of 2**-1074 (a Python integer).

    Vectorised: each value is ``mantissa * 2**shift`` units with an integer mantissa below 2**53; the
    mantissas are split into halves below 2**27 and summed per shift with float64 bincounts, exact
    because every partial sum is an integer below 2**53 (at most 2**24 values a call). A few dozen
    distinct shifts remain, combined as Python integers."""
    values = np.asarray(values, dtype=np.float64).ravel()
    total = 0
    for lo in range(0, len(values), _EXACT_CHUNK):
        v = values[lo : lo + _EXACT_CHUNK]
        v = v[v != 0]
        if not len(v):
            continue
        fraction, exponent = np.frexp(v)  # v = fraction * 2**exponent, 0.5 <= |fraction| < 1
        mantissa = (fraction * float(1 << _MANTISSA_BITS)).astype(np.int64)  # exact: 53 significant bits
        shift = exponent.astype(np.int64) + (_UNIT_EXPONENT - _MANTISSA_BITS)
        small = shift < 0  # subnormals: the mantissa's low bits are zero, the right shift is exact
        if small.any():
            mantissa[small] >>= -shift[small]
            shift[small] = 0
        base = int(shift.min())
        index = shift - base
        high = np.bincount(index, weights=mantissa >> _SPLIT_BITS)
        low = np.bincount(index, weights=mantissa & ((1 << _SPLIT_BITS) - 1))
        for k in np.flatnonzero((high != 0) | (low != 0)):
            total += ((int(high[k]) << _SPLIT_BITS) + int(low[k])) << (base + int(k))
    return total


def _units_to_float(units: int) -> float:
    """An exact sum in units of 2**-1074 rounded once to the nearest float64 (what math.fsum returns), or
    an infinity beyond float64's range (where math.fsum raises OverflowError)."""
    try:
        return units / (1 << _UNIT_EXPONENT)  # int / int: correctly rounded
    except OverflowError:
        return math.inf if units > 0 else -math.inf


def log_loss_terms(labels, probabilities) -> np.ndarray:
    """Each row's binary cross-entropy in float64, exactly as :func:`log_loss` computes it before its mean."""
    labels = np.asarray(labels).astype(np.float64).ravel()
    p = np.clip(np.asarray(probabilities).astype(np.float64).ravel(), LOG_LOSS_EPS, 1.0 - LOG_LOSS_EPS)
    if labels.shape != p.shape:
        raise ValueError(f"labels and probabilities differ in length: {labels.shape[0]} vs {p.shape[0]}")
    return -(labels * np.log(p) + (1.0 - labels) * np.log1p(-p))


@dataclass(frozen=True)
class LogLossSum:
    """The log loss of a part of the rows, mergeable exactly: the exact sum of its per-row losses
    (:func:`log_loss_terms`, in units of 2**-1074) and its row count; ``special`` is the sum of the terms
    that are not finite (a NaN probability), 0.0 when there is none.

    :meth:`value` is ``math.fsum(every row's term) / rows`` whatever the parts were: the exact sum rounded
    once. (:func:`log_loss` takes NumPy's pairwise mean instead, which can differ from it in the last bit
    or so.)"""

    units: int = 0
    rows: int = 0
    special: float = 0.0

    @classmethod
    def of(cls, labels, probabilities) -> LogLossSum:
        terms = log_loss_terms(labels, probabilities)
        finite = np.isfinite(terms)
        special = 0.0 if finite.all() else float(terms[~finite].sum())
        return cls(_exact_units(terms[finite]), int(terms.shape[0]), special)

    @classmethod
    def constant(cls, positives: int, rows: int) -> LogLossSum:
        """The sum of predicting every one of ``rows`` rows at their positive rate ``positives / rows``."""
        if rows == 0:
            return cls()
        rate = positives / rows
        one, zero = log_loss_terms([1.0, 0.0], [rate, rate])
        return cls(positives * _exact_units(one) + (rows - positives) * _exact_units(zero), rows)

    def merge(self, other: LogLossSum) -> LogLossSum:
        return LogLossSum(self.units + other.units, self.rows + other.rows, self.special + other.special)

    def value(self) -> float:
        """The mean per-row loss (NaN without rows)."""
        if self.rows == 0:
            return float("nan")
        if self.special:  # inf or NaN (a NaN is truthy)
            return float(self.special)
        return _units_to_float(self.units) / self.rows


@dataclass(frozen=True)
class AucCounts:
    """The AUC of a part of the rows, mergeable exactly: its distinct scores, ascending, with how many
    positive and negative rows have each. Merging two parts merges the score lists and adds the counts;
    :meth:`auc` is then the AUC of the union of their rows."""

    scores: np.ndarray  # distinct, ascending (the scores' own float dtype)
    positives: np.ndarray  # int64, per score
    negatives: np.ndarray  # int64, per score

    @classmethod
    def empty(cls) -> AucCounts:
        return cls(np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def of(cls, labels, scores) -> AucCounts:
        """The counts of 0/1 ``labels`` and their ``scores``."""
        labels = np.asarray(labels).ravel()
        scores = np.asarray(scores).ravel()
        if labels.shape != scores.shape:
            raise ValueError(f"labels and scores differ in length: {labels.shape[0]} vs {scores.shape[0]}")
        if not np.issubdtype(scores.dtype, np.floating):
            scores = scores.astype(np.float64)
        positive = labels == 1
        if not (positive | (labels == 0)).all():
            raise ValueError("labels must be 0 or 1")
        distinct, inverse = np.unique(scores, return_inverse=True)
        pos = np.bincount(inverse[positive], minlength=len(distinct)).astype(np.int64)
        return cls(distinct, pos, np.bincount(inverse, minlength=len(distinct)).astype(np.int64) - pos)

    def __len__(self) -> int:
        return len(self.scores)

    @property
    def n_pos(self) -> int:
        return int(self.positives.sum())

    @property
    def n_neg(self) -> int:
        return int(self.negatives.sum())

    @classmethod
    def merged(cls, parts: list[AucCounts]) -> AucCounts:
        """The counts of every part's rows together."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        scores = np.concatenate([p.scores for p in parts])
        order = np.argsort(scores, kind="stable")  # sorted runs: near linear
        scores = scores[order]
        starts = np.flatnonzero(np.concatenate([[True], scores[1:] != scores[:-1]]))
        return cls(scores[starts], np.add.reduceat(np.concatenate([p.positives for p in parts])[order], starts),
                   np.add.reduceat(np.concatenate([p.negatives for p in parts])[order], starts))

    def merge(self, other: AucCounts) -> AucCounts:
        return AucCounts.merged([self, other])

    def auc(self) -> float:
        """P(score of a random positive > score of a random negative), ties one half: the Mann-Whitney U
        over the product of the class sizes, from integer counts and divided once (NaN if a class is
        absent). Bit-equal to :func:`roc_auc` of the same rows wherever that one's float64 rank sums are
        exact (below 2**53: up to about 10**8 rows); beyond, this one is the exact value rounded once."""
        n_pos, n_neg = self.n_pos, self.n_neg
        if n_pos == 0 or n_neg == 0:
            return float("nan")
        below = np.cumsum(self.negatives) - self.negatives  # negatives scored strictly lower
        # Twice U: each positive wins over the negatives below it and ties with those at its score.
        dtype = np.int64 if 2 * n_pos * n_neg < 1 << 62 else object  # int64 cannot overflow; else Python ints
        twice_u = int(np.sum(self.positives.astype(dtype) * (2 * below.astype(dtype) + self.negatives)))
        return twice_u / (2 * n_pos * n_neg)  # int / int: correctly rounded


@dataclass(frozen=True)
class ScoreSummary:
    """What a part of the scored rows leaves for the metrics of the whole: :class:`AucCounts` and
    :class:`LogLossSum`. Merges exactly; O(distinct scores) in size."""

    counts: AucCounts
    loss: LogLossSum

    @classmethod
    def empty(cls) -> ScoreSummary:
        return cls(AucCounts.empty(), LogLossSum())

    @classmethod
    def of(cls, labels, probabilities) -> ScoreSummary:
        return cls(AucCounts.of(labels, probabilities), LogLossSum.of(labels, probabilities))

    @classmethod
    def merged(cls, parts: list[ScoreSummary]) -> ScoreSummary:
        loss = LogLossSum()
        for part in parts:
            loss = loss.merge(part.loss)
        return cls(AucCounts.merged([p.counts for p in parts]), loss)

    @property
    def rows(self) -> int:
        return self.loss.rows

    @property
    def positives(self) -> int:
        return self.counts.n_pos

    def auc(self) -> float | None:
        """The AUC (None when one class is absent)."""
        auc = self.counts.auc()
        return None if math.isnan(auc) else auc

    def log_loss(self) -> float | None:
        """The log loss (None without rows)."""
        return self.loss.value() if self.rows else None


class SummaryMerger:
    """Merges :class:`ScoreSummary` parts as they come, in O(n log(parts)) for n distinct scores: a stack
    whose sizes at least halve upwards (a new part merges with the one below it while that one is at
    most twice its size), so that a long run of parts never re-merges one large summary each time. The
    result does not depend on the order of the parts (every merge is exact)."""

    def __init__(self) -> None:
        self._stack: list[ScoreSummary] = []

    def add(self, part: ScoreSummary) -> None:
        self._stack.append(part)
        while len(self._stack) > 1 and len(self._stack[-2].counts) <= 2 * len(self._stack[-1].counts):
            top = self._stack.pop()
            self._stack[-1] = ScoreSummary.merged([self._stack[-1], top])

    def result(self) -> ScoreSummary:
        """Every part added so far, merged."""
        if not self._stack:
            return ScoreSummary.empty()
        merged = ScoreSummary.merged(self._stack)
        self._stack = [merged]
        return merged
