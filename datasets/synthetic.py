"""Synthetic Criteo data: the raw Kaggle/Terabyte TSV format, any size, deterministic by seed.

Each line is ``label \\t I1..I13 \\t C1..C26``: label 0/1, dense integers (heavy-tailed, may be
empty, I2 may be negative), categorical values as 8 lowercase hex digits or empty. The file
is a pure function of ``(rows, seed, scale)``; chunking and worker count never change it.

How rows are drawn
------------------
- Randomness comes in fixed blocks of ``BLOCK_ROWS`` rows; block ``b`` uses
  ``Generator(PCG64(SeedSequence([seed, b])))``. Any row range can therefore be produced
  anywhere (a Dask worker) by generating the blocks that cover it and slicing them.
- Categorical column ``k`` draws a popularity rank ``r``: with probability ``t_k``
  (``TAIL_SHARES[k]``) uniformly in ``1..N_k`` (the long tail of rare values), otherwise from
  the truncated power law ``P(r) ~ r**-HEAD_EXPONENT`` on ``1..n_k`` (inverse CDF of the
  continuous law, floored), ``n_k = table_cardinalities(scale)[k]``. ``N_k = n_k`` and
  ``t_k = TAIL_SHARE`` except in the five wide-tail tables (see "Cardinality calibration"). It
  writes ``mix32(r, key_k)`` in hex: an invertible xor-shift-multiply permutation of uint32, so
  distinct ranks never collide and at most ``N_k`` (``max_cardinalities``) distinct values
  appear. The keys depend on the table only, not on the seed: files made with different seeds
  (e.g. ``day_0``, ``day_1``) share one vocabulary, as real Criteo days do.
- Missing values follow the real data (``tests/data/criteo_kaggle_sample.csv`` and the published
  Kaggle rates): C3/C4/C12/C16/C21/C24 are missing together in ~3.5% of rows,
  C19/C20/C25/C26 together in ~44%, C6 in ~12%, C22 in ~76%; dense columns have their own rates
  (I12 ~77%, I1/I10 ~45%, ...).
- Dense ``I_j = round(exp(mu_j + sigma_j * z_j) - 1)`` with ``z_j ~ N(0, 1)``, (mu, sigma)
  fitted to the sample's median and 90th percentile; I2 is -1 (rarely -2/-3) in ~7% of rows.
- Label: ``P(1) = sigmoid(b + sum_j w_j z_j + sum_k (effect_k(r_k) - E[effect_k]))`` where
  ``effect_k`` is a fixed pseudo-random value per (table, rank), independent of the seed, and
  centring it keeps ~25% positives at every scale. A model can learn the labels (head values
  and dense values predict the click): per-value click rates fitted on half of 60k rows reach
  AUC ~0.7 on the other half (see the tests).

Cardinality calibration
-----------------------
At scale ``s``, ``round(s * KAGGLE_ROWS)`` rows (Criteo Kaggle's 45,840,617 rows, scaled like its
tables) show each table's published cardinality times ``s`` in distinct values:
``expected_distinct`` gives the exact expectation (a row shows rank ``r`` of table ``k`` with
probability ``q_k P_k(r)``, ``q_k`` its present share, independently of the other rows, so
``E[distinct] = sum_r 1 - (1 - q_k P_k(r))**rows``), within 0.2% of ``n_k`` at ``s`` = 1.0 and 0.1.

Twenty-one tables get there with the ``TAIL_SHARE`` tail over their own ``n_k`` ranks (>= 7.7
tail draws per rank: >= 99.95% of them seen). The five largest (C3 C4 C12 C16 C21) would not: a
0.05 tail reaches 20% (C3) to 63% (C4) of their ranks, which is why 4M rows at scale 1.0 used
to show 1.3M embedding rows where 33.8M were announced. A uniform tail over ``n_k`` alone cannot
fix it: reaching 95% of ``n`` ranks takes ~3 draws per rank, so the tail would take most of these
tables' accesses, each value seen ~3 times, and the top-1% share would drop (simulated: 0.915 at
Kaggle's rows, 0.89 at 60k rows and scale 1.0). Real long
tails are mostly values seen once or twice, so these tables draw their tail uniformly from
``N_k = TAIL_SPACE * n_k = 4 n_k`` ranks, with the share ``t_k`` that makes the expectation ``n_k``
at ``KAGGLE_ROWS`` rows and scale 1.0 (``solve_tail_shares``; 0.263 C3, 0.217 C12, 0.183 C21,
0.142 C16, 0.057 C4; the solution at scale 0.1 differs by < 1%, as rows and tables scale together).
A quarter of the 4n tail ranks are then seen, 86% of them once and 99% at most twice. With more
rows the wide-tail tables keep growing, as more days of real data do (scale 1.0: 58.6M embedding
rows expected at twice Kaggle's rows, up to 4n per table); with fewer rows they show fewer
(4M rows at scale 1.0: 3.65M in all, C3 1.0M).

Measured by brute force from the ranks (seed 0; ``python benchmarks/generate.py --cardinalities
0.1 1.0`` prints each table): at scale 1.0, 45,840,617 rows show 33,763,016 distinct values
(Kaggle: 33,762,577), every table within 0.08% of its Kaggle cardinality (C16 -0.08%, C3
+0.03%); at scale 0.1, 4,584,062 rows show 3,384,173 (0.1 x Kaggle: 3,376,258), the large
tables within 1.1% (C4 +1.1%, C3 +0.2%), the small ones at their rounded size (C25 11 for 10.5,
C6 2 for 2.4: no integer lies within 10% of a target under 5).

Skew calibration
----------------
The profile ranks all embedding rows of all tables together (per table: the distinct values
seen, plus one row, id 0, for "missing") by access count and reports the share of all
accesses taken by the top 1% of those rows (``top1pct_share``). Real Criteo shows >= ~0.9
(Bagpipe: ~1% of rows take >92% of accesses).

A pure power law cannot show that at the sizes people generate: at 100k rows and scale 1.0 the
share peaks at ~0.86 (exponent ~1.5) and falls for steeper or flatter laws, because the head
must be steep while the rare values must be numerous (each rare value seen once adds a row and
so widens the top 1%). Real data has both, so the law is a steep head plus a flat tail:
``HEAD_EXPONENT = 2.0``, ``TAIL_SHARE = 0.05`` and the wide tails above give, measured by brute
force with this module (seed 0; ``python benchmarks/generate.py`` prints this table):

    rows        scale   embedding rows   top1pct_share
    50,000      0.01            46,547           0.949
    100,000     0.01            87,793           0.959
    1,000,000   0.01           628,291           0.967
    100,000     0.1            101,726           0.945
    1,000,000   0.1            864,384           0.963
    4,584,062   0.1          3,384,199           0.966   (0.1 x Kaggle's rows; --cardinalities)
    100,000     1.0            122,781           0.936
    1,000,000   1.0            996,385           0.954
    10,000,000  1.0          8,587,316           0.964
    45,840,617  1.0         33,763,042           0.967   (Kaggle's rows; --cardinalities 1.0)

The profile of a preprocessed file reports the same numbers (checked with the wide tails: 100k
rows at scale 0.01 and 200k rows at scale 1.0 gave 87,793 and 228,887 embedding rows and shares
0.958617 and 0.943160 both ways). The tests check the >= 0.9 bound by brute force on generated
text. With few rows the share drops under 0.9: too few draws to fill
the tail (scale 1.0: 0.891 at 20k rows, 0.910 at 30k; scale 0.01: 0.878 at 10k, 0.922 at 20k).
"""

from __future__ import annotations

import functools
import gzip
import math
import numbers
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from dlrmflow.engine.errors import UserInputError

# The 26 categorical table sizes of the Criteo Kaggle (Display Advertising Challenge) data, C1..C26.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
N_DENSE = 13
N_SPARSE = len(CRITEO_KAGGLE_CARDINALITIES)
N_FIELDS = 1 + N_DENSE + N_SPARSE

# Rows per random block; fixed forever, part of the output's definition. Small on purpose: a
# block's temporaries stay near glibc's 128 KiB mmap threshold. Dask workers set
# MALLOC_TRIM_THRESHOLD_, which pins that threshold, so every bigger temporary would be a fresh
# mmap and page faults.
BLOCK_ROWS = 512
# Rows of the Criteo Kaggle training set (train.txt), the rows behind CRITEO_KAGGLE_CARDINALITIES:
# round(scale * KAGGLE_ROWS) rows at ``scale`` show ~scale x those distinct values per table.
KAGGLE_ROWS = 45_840_617

# The calibrated access law (see the module docstring): a power-law head and a uniform tail.
HEAD_EXPONENT = 2.0
TAIL_SHARE = 0.05  # the tail share of every table but the five wide-tail ones
# The wide-tail tables (C3 C4 C12 C16 C21: where a TAIL_SHARE tail over the table's own n ranks
# would reach under 99% of them in KAGGLE_ROWS rows) draw their tail from TAIL_SPACE * n ranks,
# with the share that solve_tail_shares(1.0) finds: their expected distinct values at
# round(scale * KAGGLE_ROWS) rows equal n = table_cardinalities(scale), most seen once.
TAIL_SPACE = 4
WIDE_TAIL_TABLES = (2, 3, 11, 15, 20)
TAIL_SPACE_FACTORS: tuple[int, ...] = tuple(TAIL_SPACE if k in WIDE_TAIL_TABLES else 1 for k in range(26))
TAIL_SHARES: tuple[float, ...] = (
    0.05, 0.05, 0.26332, 0.057039, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.21702, 0.05,
    0.05, 0.05, 0.14182, 0.05, 0.05, 0.05, 0.05, 0.18306, 0.05, 0.05, 0.05, 0.05, 0.05,
)
MAX_CARDINALITY = 2**32  # values are uint32 hashes

# Dense columns: (mu, sigma) of log(x + 1) fitted to the sample's median and 90th percentile,
# and the share of missing values.
DENSE_MU = np.array([0.69, 1.25, 1.95, 1.79, 7.63, 3.64, 1.50, 2.08, 3.83, 0.0, 0.69, 0.0, 1.79])
DENSE_SIGMA = np.array([1.17, 2.5, 1.69, 1.05, 2.05, 1.72, 1.40, 1.17, 1.42, 0.54, 1.08, 0.80, 1.33])
DENSE_MISSING = np.array([0.45, 0.0, 0.21, 0.22, 0.026, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22])
I2_NEGATIVE = 0.07  # share of rows where I2 < 0 (mostly -1, as in the real data)
DENSE_MAX = 999_999_999  # 9 digits: the formatter's width

# Categorical columns missing together (0-based table indices) and their missing rates.
MISSING_GROUPS: tuple[tuple[tuple[int, ...], float], ...] = (
    ((2, 3, 11, 15, 20, 23), 0.035),  # C3 C4 C12 C16 C21 C24
    ((18, 19, 24, 25), 0.44),  # C19 C20 C25 C26
    ((5,), 0.12),  # C6
    ((21,), 0.76),  # C22
)

# Label model: logit = LABEL_BIAS + dense part + sum of per-(table, rank) effects.
LABEL_BIAS = -1.35
LABEL_DENSE_WEIGHTS = np.array([0.35, 0.0, 0.0, -0.2, 0.0, 0.0, 0.3, 0.0, 0.0, 0.25, 0.3, 0.0, -0.15])
LABEL_EFFECT_SCALE = 0.5  # effect_k(r) is uniform in [-scale, scale]

_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_TAB, _NEWLINE, _MINUS, _ZERO = ord("\t"), ord("\n"), ord("-"), ord("0")
_INT_WIDTH = 10  # sign + 9 digits; each field slot is followed by a tab


def table_cardinalities(scale: float = 1.0) -> list[int]:
    """The 26 Criteo Kaggle table sizes times ``scale``, rounded half up, each at least 1.

    Table k's head ranks are 1..n_k; round(scale * KAGGLE_ROWS) rows show ~n_k distinct values
    (the wide-tail tables can show up to :func:`max_cardinalities` with more rows).
    """
    _check_scale(scale)
    cards = [max(1, math.floor(c * scale + 0.5)) for c in CRITEO_KAGGLE_CARDINALITIES]
    most = max(c * f for c, f in zip(cards, TAIL_SPACE_FACTORS, strict=True))
    if most > MAX_CARDINALITY:
        raise UserInputError(
            f"scale {scale} makes a table of up to {most} distinct values; the most is {MAX_CARDINALITY}"
        )
    return cards


def max_cardinalities(scale: float = 1.0) -> list[int]:
    """Each table's rank range 1..N_k (N_k = TAIL_SPACE_FACTORS[k] * n_k): it never shows more
    distinct values, whatever the rows. Size embedding tables indexed by rank with these."""
    return [c * f for c, f in zip(table_cardinalities(scale), TAIL_SPACE_FACTORS, strict=True)]


def _check_scale(scale: float) -> None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise UserInputError(f"scale must be a positive number, got {scale!r}")


# ---------------------------------------------------------------------------------------------
# Hashing: a keyed bijection of uint32 (the "lowbias32" xor-shift-multiply mixer).


def mix32(x: np.ndarray, key: int | np.ndarray) -> np.ndarray:
    """Invertible mixing of uint32 values: xor with a key, then xor-shifts and odd multiplies.

    Each step is a bijection of uint32 (xor with a constant, x ^= x >> s, multiply by an odd
    number mod 2**32), so distinct inputs give distinct outputs. ``key`` broadcasts (per column).
    """
    x = np.asarray(x, dtype=np.uint32) ^ np.asarray(key, dtype=np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _table_key(table: int, purpose: int) -> int:
    return int(mix32(np.array([table * 2 + purpose + 1], dtype=np.uint32), 0x9E3779B9)[0])


VALUE_KEYS = np.array([_table_key(k, 0) for k in range(N_SPARSE)], dtype=np.uint32)
EFFECT_KEYS = np.array([_table_key(k, 1) for k in range(N_SPARSE)], dtype=np.uint32)


# ---------------------------------------------------------------------------------------------
# Drawing rows as arrays.


def popularity_ranks(
    u: np.ndarray,
    n: np.ndarray | int,
    exponent: float = HEAD_EXPONENT,
    tail: np.ndarray | float = TAIL_SHARE,
    space: np.ndarray | int | None = None,
) -> np.ndarray:
    """Map uniforms in [0, 1) to popularity ranks: a power-law head on 1..n, a uniform tail on 1..space.

    ``u < tail`` (a ``tail`` share of draws) picks a rank uniformly in 1..space (``space`` >= n;
    default n); the rest follows the truncated power law P(r) ~ r**-exponent on 1..n (inverse CDF
    of the density x**-exponent on [1, n + 1), floored). ``n``, ``tail`` and ``space`` broadcast
    against ``u`` (one value per column).
    """
    return _draw_ranks(u, _rank_coefficients(n, exponent, tail, space))


def _rank_coefficients(n, exponent, tail, space) -> tuple:
    """The per-column constants of :func:`_draw_ranks` (computed once per table set, not per block)."""
    n_float = np.asarray(n, dtype=np.float64)
    tail = np.asarray(tail, dtype=np.float64)
    space = np.asarray(n if space is None else space, dtype=np.int64)
    head = 1.0 / (1.0 - tail)  # (u - tail) * head: a head draw's uniform in [0, 1)
    if exponent == 1.0:  # x = exp(v * log(n + 1))
        power, mult = None, np.log(n_float + 1.0) * head
        offset = -tail * mult
    else:  # x = (1 + v * ((n + 1)**a - 1))**(1 / a), a = 1 - exponent
        a = 1.0 - exponent
        power, mult = 1.0 / a, ((n_float + 1.0) ** a - 1.0) * head
        offset = 1.0 - tail * mult
    tail_mult = space / np.where(tail > 0, tail, 1.0)  # a tail draw: x = u * space / tail + 1
    return mult, offset, power, tail, tail_mult, space, bool((tail > 0).any())


def _draw_ranks(u: np.ndarray, coefficients: tuple) -> np.ndarray:
    """:func:`popularity_ranks` with its constants precomputed by :func:`_rank_coefficients`."""
    mult, offset, power, tail, tail_mult, space, any_tail = coefficients
    # In-place steps: fresh 1.7 MB temporaries per block cost more in page faults than in math.
    x = u * mult  # the head's affine step folded into one multiply-add; tail rows are overwritten
    x += offset
    if power is None:
        np.exp(x, out=x)
    else:
        x **= power
    if any_tail:
        tail_x = u * tail_mult
        tail_x += 1.0
        np.copyto(x, tail_x, where=u < tail)
    ranks = x.astype(np.int64)  # floor; x >= 1 up to rounding (hence the maximum below)
    # x may round up to n + 1 (head) or space + 1 (tail); where space > n, a head draw rounding
    # up (probability ~2**-53) lands on the tail rank n + 1 rather than n.
    np.minimum(ranks, space, out=ranks)
    return np.maximum(ranks, 1, out=ranks)


def click_effects(ranks: np.ndarray) -> np.ndarray:
    """[n, 26] ranks -> each (table, rank)'s fixed effect on the click logit, in [-1, 1).

    A second keyed hash of the rank: fixed for the table's value whatever the seed or scale.
    """
    return mix32(ranks.astype(np.uint32), EFFECT_KEYS).astype(np.float64) * (2.0 / 2**32) - 1.0


def _head_probabilities(lo: int, hi: int, n: int, exponent: float = HEAD_EXPONENT) -> np.ndarray:
    """P(head rank = r) for r = lo..hi (1 <= lo, hi <= n), in a form exact for large r too."""
    r = np.arange(lo, hi + 1, dtype=np.float64)
    if exponent == 1.0:
        return np.log1p(1.0 / r) / math.log(n + 1.0)
    a = 1.0 - exponent
    # P(r) = (r**a - (r + 1)**a) / (1 - (n + 1)**a), without the cancellation of two near values
    return -(r**a) * np.expm1(a * np.log1p(1.0 / r)) / (1.0 - (n + 1.0) ** a)


def rank_probabilities(
    n: int, top: int, tail: float = TAIL_SHARE, space: int | None = None, exponent: float = HEAD_EXPONENT
) -> np.ndarray:
    """P(rank = r) for r = 1..min(space, top) under :func:`popularity_ranks` (``space`` default n)."""
    space = n if space is None else space
    p = np.full(min(space, top), tail / space)
    head = min(n, top)
    p[:head] += (1.0 - tail) * _head_probabilities(1, head, n, exponent)
    return p


def present_rates() -> np.ndarray:
    """Each table's share of rows with a value (not missing), from MISSING_GROUPS."""
    present = np.ones(N_SPARSE)
    for tables, rate in MISSING_GROUPS:
        present[list(tables)] = 1.0 - rate
    return present


def _table_expected_distinct(rows: int, present: float, n: int, space: int, tail: float) -> float:
    """Expected distinct values of one table in ``rows`` rows: sum over ranks r of
    1 - (1 - present * P(r))**rows (each row shows rank r with probability present * P(r),
    independently of the other rows)."""
    total = 0.0
    step = 1 << 20
    for lo in range(1, n + 1, step):  # ranks 1..n: head and tail
        hi = min(n, lo + step - 1)
        p = (1.0 - tail) * _head_probabilities(lo, hi, n) + tail / space
        with np.errstate(divide="ignore"):  # log1p(-1) = -inf where a rank is certain: fine
            total -= float(np.expm1(rows * np.log1p(-present * p)).sum())
    if space > n:  # ranks n+1..space: tail only, all alike
        total -= (space - n) * math.expm1(rows * math.log1p(-present * tail / space))
    return total


def expected_distinct(rows: int, scale: float = 1.0, tails: Iterable[float] = TAIL_SHARES) -> np.ndarray:
    """Each table's expected number of distinct values in ``rows`` generated rows (exact, not
    simulated; about 1 s per 30M ranks). ``tails``: the tail shares (default the module's)."""
    cards, spaces, present = table_cardinalities(scale), max_cardinalities(scale), present_rates()
    return np.array([
        _table_expected_distinct(rows, present[k], cards[k], spaces[k], tail)
        for k, tail in enumerate(tails)
    ])


def solve_tail_shares(scale: float = 1.0) -> tuple[float, ...]:
    """The tail shares that make each wide-tail table's expected distinct count at
    round(scale * KAGGLE_ROWS) rows equal its n at ``scale`` (TAIL_SHARES is this at 1.0, rounded
    to 5 significant digits); TAIL_SHARE for the others. A few seconds at scale 1.0."""
    rows = round(scale * KAGGLE_ROWS)
    cards, spaces, present = table_cardinalities(scale), max_cardinalities(scale), present_rates()
    shares = []
    for k in range(N_SPARSE):
        if TAIL_SPACE_FACTORS[k] == 1:
            shares.append(TAIL_SHARE)
            continue
        n, space, q = cards[k], spaces[k], present[k]

        def excess(t: float, n=n, space=space, q=q) -> float:
            return _table_expected_distinct(rows, q, n, space, t) - n

        # the tail alone reaches n at `guess`; the head adds a little, so the root is just below it
        guess = min(0.999, -space / (q * rows) * math.log1p(-n / space))
        shares.append(_root(excess, 0.5 * guess, guess))
    return tuple(shares)


def _root(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-9) -> float:
    """Root of an increasing ``f`` bracketed by [lo, hi] (regula falsi, Illinois variant)."""
    f_lo, f_hi = f(lo), f(hi)
    if not f_lo <= 0.0 <= f_hi:
        raise ValueError(f"no root in [{lo}, {hi}]: f = {f_lo}, {f_hi}")
    side = 0
    for _ in range(100):
        x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        f_x = f(x)
        if abs(f_x) < 1e-3 or hi - lo < tol:
            return x
        if f_x > 0:
            hi, f_hi = x, f_x
            if side == 1:
                f_lo /= 2
            side = 1
        else:
            lo, f_lo = x, f_x
            if side == -1:
                f_hi /= 2
            side = -1
    return x


@functools.lru_cache(maxsize=16)
def _mean_click_effects(cards: tuple[int, ...]) -> np.ndarray:
    """Each table's expected click effect, over its first 10,000 ranks (the rest average ~0).

    Subtracted so the label rate stays ~25% at every scale: the head ranks' fixed effects would
    otherwise shift the logit by their (arbitrary) sum.
    """
    means = np.empty(len(cards))
    for k, card in enumerate(cards):
        p = rank_probabilities(card, 10_000, TAIL_SHARES[k], card * TAIL_SPACE_FACTORS[k])
        ranks = np.zeros((len(p), len(cards)), dtype=np.int64)
        ranks[:, k] = np.arange(1, len(p) + 1)
        means[k] = p @ click_effects(ranks)[:, k]
    return means


@functools.lru_cache(maxsize=16)
def _rank_law(cards: tuple[int, ...]) -> tuple:
    """The rank law's constants for a block's 26 columns (n, tail share, space per table)."""
    n = np.array(cards, dtype=np.int64)
    return _rank_coefficients(n, HEAD_EXPONENT, np.array(TAIL_SHARES), n * np.array(TAIL_SPACE_FACTORS))


def _block_draws(block: int, seed: int) -> tuple[np.ndarray, ...]:
    """The random numbers of one block's BLOCK_ROWS rows, drawn in their fixed order."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, block])))
    n = BLOCK_ROWS
    z = rng.standard_normal((n, N_DENSE))
    u_dense = rng.random((n, N_DENSE))
    u_i2 = rng.random(n)
    u_rank = rng.random((n, N_SPARSE))
    u_group = rng.random((n, len(MISSING_GROUPS)))
    u_label = rng.random(n)
    return z, u_dense, u_i2, u_rank, u_group, u_label


def _categorical(u_rank: np.ndarray, u_group: np.ndarray, cards: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, missing mask) of a block's 26 categorical columns."""
    ranks = _draw_ranks(u_rank, _rank_law(tuple(cards)))
    cat_missing = np.zeros(u_rank.shape, dtype=bool)
    for g, (tables, rate) in enumerate(MISSING_GROUPS):
        cat_missing[:, list(tables)] = (u_group[:, g] < rate)[:, None]
    return ranks, cat_missing


def _block_ranks(block: int, seed: int, cards: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Only (ranks, missing mask) of one block: what _block_arrays gives, at about half the cost."""
    _, _, _, u_rank, u_group, _ = _block_draws(block, seed)
    return _categorical(u_rank, u_group, cards)


def _block_arrays(block: int, seed: int, cards: list[int]) -> dict[str, np.ndarray]:
    """All values of the BLOCK_ROWS rows of one block (the pure function everything rests on)."""
    z, u_dense, u_i2, u_rank, u_group, u_label = _block_draws(block, seed)
    dense_missing = u_dense < DENSE_MISSING

    dense = np.rint(np.expm1(np.minimum(DENSE_MU + DENSE_SIGMA * z, 21.0))).astype(np.int64)
    dense = np.clip(dense, 0, DENSE_MAX)
    i2_negative = u_i2 < I2_NEGATIVE
    dense[:, 1] = np.where(i2_negative, -1 - (u_i2 < 0.002) - (u_i2 < 0.0005), dense[:, 1])

    ranks, cat_missing = _categorical(u_rank, u_group, cards)

    effect = click_effects(ranks) - _mean_click_effects(tuple(cards))
    effect[cat_missing] = 0.0
    logit = LABEL_BIAS + np.where(dense_missing, 0.0, z) @ LABEL_DENSE_WEIGHTS
    logit += LABEL_EFFECT_SCALE * effect.sum(axis=1)
    labels = (u_label < 1.0 / (1.0 + np.exp(-logit))).astype(np.uint8)

    return {
        "labels": labels,
        "dense": dense,
        "dense_missing": dense_missing,
        "ranks": ranks,
        "values": mix32(ranks.astype(np.uint32), VALUE_KEYS),
        "cat_missing": cat_missing,
    }


def generate_arrays(start_row: int, n_rows: int, *, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Rows [start_row, start_row + n_rows) as arrays (labels, dense, ranks, values, missing masks).

    ``ranks`` are the popularity ranks behind the hashed ``values`` (1 = most frequent); tests and
    calibration use them. Memory grows with ``n_rows``: keep ranges modest.
    """
    _check_range(start_row, n_rows, seed)
    cards = table_cardinalities(scale)
    pieces = [_sliced(b, lo, hi, seed, cards) for b, lo, hi in _blocks(start_row, n_rows)]
    if not pieces:
        pieces = [{k: v[:0] for k, v in _block_arrays(0, seed, cards).items()}]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


def _blocks(start_row: int, n_rows: int) -> list[tuple[int, int, int]]:
    """(block, lo, hi) slices covering the row range, in order."""
    out, row, stop = [], start_row, start_row + n_rows
    while row < stop:
        block = row // BLOCK_ROWS
        lo = row - block * BLOCK_ROWS
        hi = min(BLOCK_ROWS, stop - block * BLOCK_ROWS)
        out.append((block, lo, hi))
        row = block * BLOCK_ROWS + hi
    return out


def _sliced(block: int, lo: int, hi: int, seed: int, cards: list[int]) -> dict[str, np.ndarray]:
    return {k: v[lo:hi] for k, v in _block_arrays(block, seed, cards).items()}


def _check_range(start_row: int, n_rows: int, seed: int) -> None:
    if start_row < 0 or n_rows < 0:
        raise UserInputError(f"row range must be non-negative, got start {start_row}, count {n_rows}")
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise UserInputError(f"seed must be a non-negative integer, got {seed!r}")


# ---------------------------------------------------------------------------------------------
# Text: every field gets a fixed-width slot in a byte matrix; unused bytes are 0 and are
# squeezed out at the end (no valid output byte is 0), so the whole block is formatted with
# a few vectorized passes and no Python loop over rows.


def format_rows(arrays: dict[str, np.ndarray]) -> bytes:
    """The TSV text of rows given as arrays (see :func:`generate_arrays`)."""
    labels = arrays["labels"]
    n = len(labels)
    if n == 0:
        return b""
    head = np.empty((n, 2), dtype=np.uint8)
    head[:, 0] = labels + _ZERO
    head[:, 1] = _TAB
    dense = _format_ints(arrays["dense"], arrays["dense_missing"])
    cats = _format_hex(arrays["values"], arrays["cat_missing"])
    matrix = np.concatenate([head, dense.reshape(n, -1), cats.reshape(n, -1)], axis=1)
    matrix[:, -1] = _NEWLINE  # the tab after C26
    return matrix[matrix != 0].tobytes()


def _format_ints(values: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """[n, cols] ints -> [n, cols, 11] bytes: right-aligned digits (sign, up to 9 digits), then a tab.

    Built position-major ([11, n, cols]) so each pass writes contiguous memory, then transposed.
    """
    n, cols = values.shape
    out = np.empty((_INT_WIDTH + 1, n, cols), dtype=np.uint8)
    out[_INT_WIDTH] = _TAB
    out[0] = 0
    present = ~missing
    rest = np.abs(values).astype(np.uint32)
    n_digits = np.ones((n, cols), dtype=np.int64)
    for k in range(1, _INT_WIDTH - 1):
        n_digits += rest >= 10**k
    for j in range(_INT_WIDTH - 1):  # j-th digit from the right
        quotient = rest // np.uint32(10)
        digit = (rest - quotient * np.uint32(10)).astype(np.uint8) + np.uint8(_ZERO)
        rest = quotient
        out[_INT_WIDTH - 1 - j] = np.where(present & (j < n_digits), digit, np.uint8(0))
    rows, fields = np.nonzero(present & (values < 0))
    out[_INT_WIDTH - 1 - n_digits[rows, fields], rows, fields] = _MINUS
    return out.transpose(1, 2, 0)


# Byte b -> its two hex digits, as one uint16 (so one gather writes two characters).
_HEX_PAIRS = np.array([[_HEX_DIGITS[b >> 4], _HEX_DIGITS[b & 15]] for b in range(256)], dtype=np.uint8)
_HEX_PAIRS_U16 = _HEX_PAIRS.view(np.uint16).ravel()


def _format_hex(values: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """[n, cols] uint32 -> [n, cols, 9] bytes: 8 lowercase hex digits (or nothing), then a tab."""
    n, cols = values.shape
    out = np.empty((n, cols, 9), dtype=np.uint8)
    big_endian_bytes = values.astype(">u4").view(np.uint8).reshape(n, cols, 4)
    out[:, :, :8] = np.take(_HEX_PAIRS_U16, big_endian_bytes).view(np.uint8).reshape(n, cols, 8)
    out[missing, :8] = 0
    out[:, :, 8] = _TAB
    return out


def generate_rows(start_row: int, n_rows: int, *, seed: int, scale: float = 1.0) -> bytes:
    """The TSV text of rows [start_row, start_row + n_rows): a pure function of its arguments."""
    _check_range(start_row, n_rows, seed)
    cards = table_cardinalities(scale)
    return b"".join(
        format_rows(_sliced(b, lo, hi, seed, cards)) for b, lo, hi in _blocks(start_row, n_rows)
    )


def _chunk_payload(start_row: int, n_rows: int, seed: int, scale: float, gzip_level: int | None) -> bytes:
    """One chunk as it goes into the file. Gzip files are concatenated gzip members (valid gzip,
    compressed where the rows are made, so the writer never becomes the bottleneck)."""
    text = generate_rows(start_row, n_rows, seed=seed, scale=scale)
    return text if gzip_level is None else gzip.compress(text, compresslevel=gzip_level, mtime=0)


# ---------------------------------------------------------------------------------------------
# Writing a file: chunks produced in order (in process or on Dask workers), a bounded window.

GZIP_LEVEL = 1  # random hex barely compresses better at higher levels; level 1 is several times faster


def ordered_results(
    tasks: Iterable[tuple], produce: Callable[..., object], *, max_in_flight: int
) -> Iterator[tuple[int, object]]:
    """Yield (task[1], produce(*task)) for each task, in order; ``task[1]`` is the chunk's row count.

    ``produce`` returns either a value or a future with ``.result()``. At most ``max_in_flight``
    chunks exist at any time, counting the one the caller holds: the next task is produced only
    after the caller asks for the next chunk. So memory does not grow with the number of tasks.
    """
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be >= 1")
    pending: deque = deque()
    remaining = iter(tasks)
    for task in remaining:
        pending.append((task[1], produce(*task)))
        if len(pending) >= max_in_flight:
            break
    while pending:
        n_rows, item = pending.popleft()
        value = item.result() if hasattr(item, "result") else item
        del item  # drop the future so the worker can release the chunk
        yield n_rows, value
        del value
        # refill only once the caller is done with this chunk: never more than the window exists
        nxt = next(remaining, None)
        if nxt is not None:
            pending.append((nxt[1], produce(*nxt)))


def _check_output(output: str | os.PathLike) -> Path:
    path = Path(output)
    if path.is_dir():
        raise UserInputError(f"output {str(path)!r} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"cannot create the directory of output {str(path)!r}: {exc}") from exc
    if not os.access(path.parent, os.W_OK):
        raise UserInputError(f"output directory {str(path.parent)!r} is not writable")
    return path


def generate(
    output: str | os.PathLike,
    rows: int,
    *,
    seed: int = 0,
    scale: float = 1.0,
    client=None,
    chunk_rows: int = 100_000,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Write ``rows`` synthetic Criteo rows to ``output`` (".gz" suffix: gzip).

    With a Dask ``client`` the chunks are made on its workers, at most two per worker thread in
    flight, and appended here in order; otherwise in process, one at a time. Writes to a
    temporary file next to ``output`` and renames it when complete.
    """
    if not isinstance(rows, int | np.integer) or rows < 1:
        raise UserInputError(f"rows must be a positive integer, got {rows!r}")
    if not isinstance(chunk_rows, int | np.integer) or chunk_rows < 1:
        raise UserInputError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    _check_range(0, rows, seed)
    cards = table_cardinalities(scale)
    path = _check_output(output)
    gzip_level = GZIP_LEVEL if path.suffix.lower() == ".gz" else None
    tasks = (
        (start, min(chunk_rows, rows - start), int(seed), float(scale), gzip_level)
        for start in range(0, rows, chunk_rows)
    )
    if client is None:
        produce, window = _chunk_payload, 1
    else:
        threads = sum(client.nthreads().values()) or 1
        produce, window = (lambda *task: client.submit(_chunk_payload, *task, pure=False)), 2 * threads

    began = time.perf_counter()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        f = open(tmp, "wb")
    except OSError as exc:
        raise UserInputError(f"cannot write {str(path)!r}: {exc}") from exc
    done = written = 0
    try:
        with f:
            for n_rows, payload in ordered_results(tasks, produce, max_in_flight=window):
                f.write(payload)
                written += len(payload)
                done += n_rows
                if progress is not None:
                    progress(done, rows)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a partial file behind
        raise
    return {
        "output": str(path),
        "rows": int(rows),
        "bytes": written,
        "seed": int(seed),
        "scale": float(scale),
        "cardinalities": cards,
        "seconds": time.perf_counter() - began,
    }


# ---------------------------------------------------------------------------------------------
# Calibration: the skew the profile will report, measured by brute force.


def top1pct_share(per_table_counts: list[np.ndarray], missing_counts: list[int]) -> tuple[float, int]:
    """Share of all accesses taken by the top 1% of embedding rows, as the profile computes it.

    Each table contributes its observed values (count > 0) plus one row, id 0, holding its missing
    values (even when none are missing). Returns (share, total rows).
    """
    counts = np.concatenate(
        [np.append(c[c > 0], m) for c, m in zip(per_table_counts, missing_counts, strict=True)]
    )
    top = max(1, math.ceil(0.01 * len(counts)))
    return float(np.sort(counts)[::-1][:top].sum() / counts.sum()), len(counts)


def measure_skew(rows: int, *, seed: int = 0, scale: float = 1.0) -> dict:
    """top1pct_share and each table's distinct values in the first ``rows`` generated rows,
    counted from the ranks block by block (no text, no labels; memory ~4 bytes per rank of
    max_cardinalities): the same ranks as :func:`generate_arrays`, which the tests check."""
    cards = table_cardinalities(scale)
    counts = [np.zeros(c + 1, dtype=np.int32 if rows < 2**31 else np.int64) for c in max_cardinalities(scale)]
    missing = [0] * N_SPARSE
    piece = 64 * BLOCK_ROWS
    for start in range(0, rows, piece):
        blocks = [(_block_ranks(b, seed, cards), lo, hi) for b, lo, hi in _blocks(start, min(piece, rows - start))]
        all_ranks = np.concatenate([r[lo:hi] for (r, _), lo, hi in blocks])
        all_missing = np.concatenate([m[lo:hi] for (_, m), lo, hi in blocks])
        for k in range(N_SPARSE):
            present = ~all_missing[:, k]
            ranks = all_ranks[present, k]
            if len(counts[k]) <= 4 * piece:  # small table: one pass, no sort
                counts[k] += np.bincount(ranks, minlength=len(counts[k])).astype(counts[k].dtype)
            else:
                ranks, n = np.unique(ranks, return_counts=True)
                counts[k][ranks] += n.astype(counts[k].dtype)
            missing[k] += int((~present).sum())
    share, total_rows = top1pct_share(counts, missing)
    return {"rows": rows, "scale": scale, "embedding_rows": total_rows, "top1pct_share": share,
            "distinct": [int(np.count_nonzero(c)) for c in counts]}
