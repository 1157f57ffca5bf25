"""Cache policies compared on one batch stream: how many embedding rows each one fetches.

The model, the same for every policy: iteration ``t`` needs its unique rows ``U_t`` in a cache of
``C`` rows while it computes; a row that is not there is fetched; every fetched row is written
back exactly once, when it leaves the cache or after the last iteration (training updates every
row it uses). The policies:

- ``none``: no cache; every iteration fetches and writes back all of ``U_t``.
- ``lru``: before ``t`` the least recently used rows outside ``U_t`` make room (ties: larger id first).
- ``static``: FAE-style hot set: the ``k`` most accessed rows (access counts over the stream) stay
  pinned, the other rows of ``U_t`` pass through the cache for their iteration only; ``k`` is the
  largest with ``k + max_t |U_t minus hot| <= C``.
- ``oracle``: the lookahead plan (window ``L``, prefetch distance ``P``) bounded to ``C`` rows.
- ``belady``: Belady's MIN, unlimited lookahead and fetch on demand: the fewest fetches any
  policy can achieve in this model (a lower bound for the others).

A policy that cannot run at ``C`` (``C < max_t |U_t|``; for the oracle, fewer rows than ``P + 1``
consecutive iterations use) is reported infeasible (``rows_fetched`` is None) with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.planning.lookahead import coverage, decide_range, farthest_first_drops, iter_id_batches, occupancy

POLICIES = ("none", "lru", "static", "oracle", "belady")
BYTES_PER_VALUE = 4  # float32 embedding rows
MARKERS = {"lru": "o", "static": "s", "oracle": "^", "belady": "v"}


@dataclass
class Trace:
    """The unique rows of every iteration of a batch stream, and per-row access counts."""

    batches: list[np.ndarray]  # int64 global ids, sorted, unique per iteration
    num_rows: int  # total embedding rows (ids lie in 0 .. num_rows-1)
    access_counts: np.ndarray  # int64 [num_rows]: occurrences over the stream (the static hot set's profile)

    @property
    def uses(self) -> int:
        return int(sum(len(b) for b in self.batches))

    @property
    def max_batch_rows(self) -> int:
        return max((len(b) for b in self.batches), default=0)


def build_trace(dataset_dir: str | os.PathLike, batch_size: int, *, drop_last: bool = False) -> Trace:
    stream = BatchStream(dataset_dir, batch_size, drop_last=drop_last, sparse_only=True)
    num_rows = stream.meta.total_embedding_rows
    counts = np.zeros(num_rows, dtype=np.int64)
    batches = []
    for _, ids in iter_id_batches(stream, 0, len(stream)):
        unique, n = np.unique(ids, return_counts=True)
        counts[unique] += n
        batches.append(unique.astype(np.int64, copy=False))
    return Trace(batches, num_rows, counts)


def trace_from_batches(batches: Iterable[Iterable[int]], num_rows: int) -> Trace:
    """A trace from raw id lists (ids may repeat within a batch: they count as accesses)."""
    counts = np.zeros(num_rows, dtype=np.int64)
    unique_batches = []
    for b in batches:
        ids = np.asarray(list(b), dtype=np.int64)
        unique, n = np.unique(ids, return_counts=True)
        counts[unique] += n
        unique_batches.append(unique)
    return Trace(unique_batches, num_rows, counts)


@dataclass
class PolicyResult:
    policy: str
    capacity: int | None
    uses: int  # sum over iterations of |U_t|
    rows_fetched: int | None  # None: the policy cannot run at this capacity
    rows_written_back: int | None
    note: str = ""

    @property
    def hit_rate(self) -> float | None:
        if self.rows_fetched is None:
            return None
        return 1.0 - self.rows_fetched / self.uses if self.uses else 0.0

    def row(self, embedding_dim: int) -> dict[str, Any]:
        fetched = self.rows_fetched
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "rows_fetched": fetched,
            "bytes_fetched": None if fetched is None else fetched * embedding_dim * BYTES_PER_VALUE,
            "rows_written_back": self.rows_written_back,
            "hit_rate": self.hit_rate,
            "note": self.note,
        }


def _infeasible(policy: str, trace: Trace, capacity: int, why: str) -> PolicyResult:
    return PolicyResult(policy, capacity, trace.uses, None, None, why)


def _batch_too_big(policy: str, trace: Trace, capacity: int) -> PolicyResult | None:
    for t, batch in enumerate(trace.batches):
        if len(batch) > capacity:
            return _infeasible(policy, trace, capacity, f"iteration {t} uses {len(batch)} rows > capacity {capacity}")
    return None


def simulate_none(trace: Trace) -> PolicyResult:
    return PolicyResult("none", None, trace.uses, trace.uses, trace.uses)


def simulate_lru(trace: Trace, capacity: int) -> PolicyResult:
    if (too_big := _batch_too_big("lru", trace, capacity)) is not None:
        return too_big
    cached = np.zeros(trace.num_rows, dtype=bool)
    last_use = np.zeros(trace.num_rows, dtype=np.int64)  # t + 1 of the latest use, 0 = never
    size = fetched = written = 0
    oldest = 0  # iterations before it hold no cached row as their latest use
    for t, ids in enumerate(trace.batches):
        misses = ids[~cached[ids]]
        last_use[ids] = t + 1  # rows of U_t are now the most recent: never victims below
        need = size + len(misses) - capacity
        while need > 0:
            old = trace.batches[oldest]
            victims = old[(last_use[old] == oldest + 1) & cached[old]]
            if len(victims) <= need:
                oldest += 1
            else:
                victims = victims[len(victims) - need :]  # larger ids leave first
            cached[victims] = False
            size -= len(victims)
            written += len(victims)
            need -= len(victims)
        cached[misses] = True
        size += len(misses)
        fetched += len(misses)
    return PolicyResult("lru", capacity, trace.uses, fetched, written + size)


def simulate_static(trace: Trace, capacity: int) -> PolicyResult:
    if (too_big := _batch_too_big("static", trace, capacity)) is not None:
        return too_big
    used = np.flatnonzero(trace.access_counts)
    hot_order = used[np.lexsort((used, -trace.access_counts[used]))]  # most accessed first, then by id
    rank = np.full(trace.num_rows, len(used), dtype=np.int64)
    rank[hot_order] = np.arange(len(used))
    ranks = rank[np.concatenate(trace.batches)] if trace.batches else np.zeros(0, np.int64)
    batch_of = np.repeat(np.arange(len(trace.batches)), [len(b) for b in trace.batches])

    def cold_per_batch(k: int) -> np.ndarray:
        return np.bincount(batch_of[ranks >= k], minlength=len(trace.batches))

    # k + max cold rows of a batch never decreases with k (pinning one more row frees at most one
    # row per batch), so the largest feasible k is found by bisection.
    lo, hi = 0, min(len(used), capacity)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid + int(cold_per_batch(mid).max(initial=0)) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    cold = int(cold_per_batch(lo).sum())
    return PolicyResult("static", capacity, trace.uses, lo + cold, lo + cold, f"{lo} rows pinned")


def _windowed(trace: Trace, window: int, distance: int):
    """The lookahead policy's decisions on ``trace``, its occupancy and the rows it must hold at each iteration."""
    n = len(trace.batches)
    d = decide_range(
        enumerate(trace.batches), first=0, stop=n, num_iterations=n, window=window,
        distance=distance, candidates=True, num_rows=trace.num_rows,
    )
    if not n:
        return d, None, None
    occ = occupancy(d.prefetch_counts, d.evict_counts, distance)
    return d, occ, occ - coverage(d.cand_start, d.cand_end, n)


def smallest_feasible_capacity(trace: Trace, window: int, distance: int) -> int:
    """The fewest cache rows at which every policy runs: the most rows one iteration uses (LRU, static hot
    set, Belady MIN) or the oracle plan must hold at once (``P + 1`` consecutive iterations' rows)."""
    if not trace.batches:
        return 1
    _, _, base = _windowed(trace, window, distance)
    return max(1, trace.max_batch_rows, int(base.max()))


def windowed_fetches(trace: Trace, capacity: int, window: int, distance: int) -> tuple[int, int] | str:
    """(rows fetched, rows written back) of the lookahead policy, or why ``capacity`` is too small."""
    n = len(trace.batches)
    d, occ, base = _windowed(trace, window, distance)
    if not n:
        return 0, 0
    if base.max() > capacity:
        u = int(np.argmax(base > capacity))
        span = f"iterations {u}..{min(u + distance, n - 1)} use" if distance else f"iteration {u} uses"
        return f"{span} {int(base[u])} rows > capacity {capacity}"
    dropped = int(farthest_first_drops(occ - capacity, d.cand_start, d.cand_end, d.cand_ids).sum())
    return len(d.prefetch_ids) + dropped, len(d.evict_ids) + dropped


def simulate_oracle(trace: Trace, capacity: int, window: int, distance: int) -> PolicyResult:
    result = windowed_fetches(trace, capacity, window, distance)
    if isinstance(result, str):
        return _infeasible("oracle", trace, capacity, result)
    return PolicyResult("oracle", capacity, trace.uses, *result, f"L={window}, P={distance}")


def simulate_belady(trace: Trace, capacity: int) -> PolicyResult:
    # MIN is the window policy with an unlimited window and fetches issued on demand (P = 0).
    result = windowed_fetches(trace, capacity, max(len(trace.batches), 1), 0)
    if isinstance(result, str):
        return _infeasible("belady", trace, capacity, result)
    return PolicyResult("belady", capacity, trace.uses, *result)


def parse_capacity(text: str | int, total_rows: int) -> int:
    """``"123456"`` rows, or ``"1%"`` of all embedding rows."""
    value = str(text).strip()
    try:
        rows = round(float(value[:-1]) / 100 * total_rows) if value.endswith("%") else int(value)
    except ValueError:
        raise UserInputError(f"--capacity {value!r} is neither a row count nor a percentage like 1%") from None
    if rows < 1:
        raise UserInputError(f"--capacity {value!r} is {rows} rows; it must be at least 1 row")
    return rows


def compare_policies(
    trace: Trace,
    capacities: list[int],
    *,
    window: int,
    distance: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[PolicyResult]:
    """Every policy at every capacity (``none`` once), in table order."""
    steps = [(c, p) for c in sorted(set(capacities)) for p in POLICIES if p != "none"]
    results = [simulate_none(trace)]
    for i, (capacity, policy) in enumerate(steps, start=1):
        if policy == "lru":
            results.append(simulate_lru(trace, capacity))
        elif policy == "static":
            results.append(simulate_static(trace, capacity))
        elif policy == "oracle":
            results.append(simulate_oracle(trace, capacity, window, distance))
        else:
            results.append(simulate_belady(trace, capacity))
        if progress:
            progress(i, len(steps))
    return results


def capacity_sweep(fraction: float, total_rows: int, points: int = 8) -> list[int]:
    """Cache capacities (rows) for a comparison plot around ``fraction`` of ``total_rows``: ``points``
    capacities, each twice the one before, with ``fraction``'s among them (up to three doublings above
    it, as far as they stay within ``total_rows``); at least 1 row each, no capacity twice."""
    above = 0
    while above < 3 and fraction * 2 ** (above + 1) <= 1.0:
        above += 1
    shares = [fraction * 2.0**k for k in range(above - points + 1, above + 1)]
    return sorted({max(1, round(share * total_rows)) for share in shares})


def comparison_lines(results: list[PolicyResult]) -> dict[str, tuple[list[int], list[int]]]:
    """What :func:`plot_comparison` draws: per policy (legend label) the capacities and rows fetched of its line.

    ``none`` (label ``no cache``) is flat across the capacities; every other policy has its feasible
    capacities only, and a policy feasible at none has an empty line and says so in its label."""
    capacities = sorted({r.capacity for r in results if r.capacity is not None})
    lines: dict[str, tuple[list[int], list[int]]] = {}
    for policy in POLICIES:
        rows = sorted((r for r in results if r.policy == policy), key=lambda r: r.capacity or 0)
        if policy == "none":
            if rows and capacities:
                lines["no cache"] = ([capacities[0], capacities[-1]], [rows[0].rows_fetched] * 2)
            continue
        points = [(r.capacity, r.rows_fetched) for r in rows if r.rows_fetched is not None]
        label = policy if points else f"{policy} (infeasible at every capacity)"
        lines[label] = ([c for c, _ in points], [f for _, f in points])
    return lines


def plot_comparison(results: list[PolicyResult], path: str | os.PathLike, *, title: str = "") -> Path:
    """PNG: rows fetched vs cache capacity (log x and y), one line per policy.

    Every policy is drawn: ``none`` as a flat dashed line across the capacities; the others through
    their feasible capacities (an infeasible capacity, too small for the policy, has no point; the
    line goes on from the next feasible one). A policy feasible at no capacity is named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, (xs, ys) in comparison_lines(results).items():
        if label == "no cache":
            ax.plot(xs, ys, "k--", label=label)
        else:  # distinct markers: policies often land on the same point
            ax.plot(xs, ys, marker=MARKERS[label.split()[0]], fillstyle="none", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cache capacity (rows)")
    ax.set_ylabel("rows fetched")
    ax.set_title(title or "Embedding rows fetched by cache policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="no point: capacity too small for the policy", title_fontsize="small", fontsize="small")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def compare_dataset(
    dataset_dir: str | os.PathLike,
    batch_size: int,
    capacities: list[str | int],
    *,
    window: int,
    distance: int,
    embedding_dim: int,
    drop_last: bool = False,
    progress: Callable[[int, int], None] | None = None,
    feasible_only: bool = False,
) -> dict[str, Any]:
    """Every policy on the batch stream of ``dataset_dir``: a JSON-able report (``rows`` is the table).

    ``feasible_only`` (a sweep, as the pipeline's): the capacities at which some policy cannot run are left
    out (``left_out``) and the smallest at which every policy runs (``smallest_feasible``) takes their place,
    so that every row of the table has figures; else every capacity asked for is reported, infeasible or not."""
    from dlrmflow.engine.planning.planner import PlanConfig  # validates B, L, P like a plan would

    PlanConfig(batch_size, window, distance, drop_last=drop_last)
    if embedding_dim < 1:
        raise UserInputError(f"--embedding-dim must be >= 1 (float32 values per row), got {embedding_dim}")
    stream = BatchStream(dataset_dir, batch_size, drop_last=drop_last, sparse_only=True)
    total_rows = stream.meta.total_embedding_rows
    rows = [parse_capacity(c, total_rows) for c in capacities]
    if not rows:
        raise UserInputError("give at least one cache capacity")
    trace = build_trace(dataset_dir, batch_size, drop_last=drop_last)
    left_out: list[int] = []
    smallest = None
    if feasible_only:
        smallest = smallest_feasible_capacity(trace, window, distance)
        left_out = sorted({c for c in rows if c < smallest})
        rows = [c for c in rows if c >= smallest] + ([smallest] if left_out else [])
    results = compare_policies(trace, rows, window=window, distance=distance, progress=progress)
    return {
        "dataset": str(dataset_dir),
        "batch_size": batch_size,
        "lookahead": window,
        "prefetch_distance": distance,
        "embedding_dim": embedding_dim,
        "iterations": len(trace.batches),
        "total_rows": total_rows,
        "uses": trace.uses,
        "max_batch_rows": trace.max_batch_rows,
        "capacities": sorted(set(rows)),
        "left_out": left_out,
        "smallest_feasible": smallest,
        "rows": [r.row(embedding_dim) for r in results],
    }


def results_from_rows(rows: list[dict[str, Any]], uses: int) -> list[PolicyResult]:
    """Back from a report's table to results (for plotting a saved report)."""
    return [PolicyResult(r["policy"], r["capacity"], uses, r["rows_fetched"], r["rows_written_back"], r["note"])
            for r in rows]
