"""The skew profile equals a brute-force count, on random datasets and on the real sample."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlrmflow.datasets.meta import read_meta
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine.planning import profile as skew
from dlrmflow.engine.planning.profile import CountHistogram, count_rows, count_tasks, plot_coverage, profile_dataset
from dlrmflow.engine.serving.cluster import dask_client


def _random_dataset(path, seed: int, n: int = 3000):
    rng = np.random.default_rng(seed)
    cards = [int(c) for c in rng.integers(1, 400, rng.integers(1, 6))]
    sparse = np.stack([np.minimum(rng.zipf(1.3, n) - 1, c - 1) for c in cards], axis=1)
    write_array_dataset(path, rng.integers(0, 2, n), rng.random((n, 2)), sparse, cards, rows_per_file=700)
    return sparse, cards


def _brute_top_share(counts: list[int], fraction: float) -> float:
    ranked = sorted(counts, reverse=True)
    k = max(1, math.ceil(fraction * len(ranked)))
    return sum(ranked[:k]) / sum(ranked)


def _histogram(counts: list[int]) -> tuple[list[int], list[int]]:
    """(distinct counts descending, rows with each), by brute force."""
    distinct = sorted(set(counts), reverse=True)
    return distinct, [counts.count(c) for c in distinct]


@pytest.mark.parametrize("seed", range(6))
def test_profile_equals_brute_force(seed, tmp_path, monkeypatch):
    if seed % 2:  # tables counted in id ranges (several tasks each), and counts both tallied and sorted
        monkeypatch.setattr(skew, "ROWS_PER_TASK", 37)
        monkeypatch.setattr(skew, "_DENSE_COUNTS", 3)
    sparse, cards = _random_dataset(tmp_path / "ds", seed)
    profile, tables = profile_dataset(tmp_path / "ds")
    all_counts = []
    for k, card in enumerate(cards):
        want = [0] * card
        for v in sparse[:, k]:
            want[v] += 1
        assert (tables[k].counts.tolist(), tables[k].levels.tolist()) == _histogram(want)
        t = profile["tables"][k]
        assert t["rows"] == card and t["touched_rows"] == sum(1 for c in want if c)
        assert t["accesses"] == len(sparse)
        assert t["top1pct_share"] == round(_brute_top_share(want, 0.01), 6)
        all_counts += want
    assert profile["total_rows"] == sum(cards) and profile["accesses"] == sparse.size
    assert profile["top1pct_share"] == round(_brute_top_share(all_counts, 0.01), 6)
    assert profile["top10pct_share"] == round(_brute_top_share(all_counts, 0.1), 6)
    curve = profile["coverage"]
    ranked = sorted(all_counts, reverse=True)
    for f, share in zip(curve["row_fraction"], curve["access_share"], strict=True):
        k = max(1, math.ceil(f * len(ranked) - 1e-9))
        assert share == pytest.approx(sum(ranked[:k]) / sum(ranked), abs=1e-12)
    assert curve["access_share"] == sorted(curve["access_share"]) and curve["access_share"][-1] == 1.0


def test_tasks_cover_every_row_once_and_send_only_histograms(tmp_path, monkeypatch):
    """Id ranges of at most ROWS_PER_TASK rows tile each table; a task's result is its histogram, whose size
    follows the distinct counts, not the rows; the report is the one of whole-table tasks."""
    sparse, cards = _random_dataset(tmp_path / "ds", 3, n=2000)
    meta = read_meta(tmp_path / "ds")
    whole, _ = profile_dataset(tmp_path / "ds")
    monkeypatch.setattr(skew, "ROWS_PER_TASK", 10)
    tasks = count_tasks(meta)
    for k, card in enumerate(cards):
        ranges = [(lo, hi) for j, lo, hi in tasks if j == k]
        assert ranges == [(lo, min(lo + 10, card)) for lo in range(0, card, 10)]
    files = [f.name for f in meta.files]
    k = int(np.argmax(cards))
    pieces = [count_rows(str(tmp_path / "ds"), files, meta.sparse_columns[k], lo, hi, cards[k])
              for j, lo, hi in tasks if j == k]
    assert np.concatenate(pieces).tolist() == np.bincount(sparse[:, k], minlength=cards[k]).tolist()
    split, tables = profile_dataset(tmp_path / "ds")
    assert split == whole
    assert all(len(t.counts) <= math.isqrt(2 * len(sparse)) + 1 for t in tables)


def test_histograms_of_parts_add_up_to_the_whole():
    rng = np.random.default_rng(4)
    counts = np.concatenate([rng.zipf(1.5, 3000), np.zeros(40, np.int64), [10**12, 10**12, 7 * 10**11]])
    whole = CountHistogram(counts)
    cuts = np.sort(rng.integers(0, len(counts), 5))
    merged = CountHistogram.merged([CountHistogram(part) for part in np.split(rng.permutation(counts), cuts)])
    for h in (whole, merged):
        assert (h.counts.tolist(), h.levels.tolist()) == _histogram(counts.tolist())
        assert h.rows == len(counts) and h.accesses == int(counts.sum()) and h.untouched_rows == 40
    assert merged.top_accesses(np.arange(len(counts) + 1)).tolist() == whole.top_accesses(
        np.arange(len(counts) + 1)).tolist()
    empty = CountHistogram.merged([])
    assert empty.rows == empty.accesses == empty.untouched_rows == 0 and empty.top_share(0.01) == 0.0


def test_histogram_top_accesses_at_every_k():
    counts = np.array([5, 0, 3, 3, 9, 1, 0, 3])
    hist = CountHistogram(counts)
    ranked = np.sort(counts)[::-1]
    for k in range(len(counts) + 1):
        assert hist.top_accesses(k) == ranked[:k].sum()


def test_profile_on_dask_equals_in_process_and_plots(tmp_path, monkeypatch):
    _random_dataset(tmp_path / "ds", 11)
    local, _ = profile_dataset(tmp_path / "ds")
    with dask_client(n_workers=2) as client:
        distributed, _ = profile_dataset(tmp_path / "ds", client=client)
        calls = []
        monkeypatch.setattr(skew, "ROWS_PER_TASK", 50)  # tables in several ranges, one task each
        split, _ = profile_dataset(tmp_path / "ds", client=client, progress=lambda d, n: calls.append((d, n)))
    assert local == distributed == split
    tables = len(local["tables"])
    assert [d for d, _ in calls] == list(range(1, tables + 1)) and {n for _, n in calls} == {tables}
    png = plot_coverage(local, tmp_path / "coverage.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_criteo_sample_profile(data_dir, tmp_path):
    preprocess([data_dir / "criteo_kaggle_sample.csv"], tmp_path / "ds", fmt="criteo-csv")
    profile, _ = profile_dataset(tmp_path / "ds")
    assert profile["samples"] == 200 and profile["accesses"] == 200 * 26
    # Row 0 of C19 counts the rows where C19 is empty in the file.
    text = (data_dir / "criteo_kaggle_sample.csv").read_text().splitlines()
    empty_c19 = sum(1 for line in text[1:] if line.split(",")[14 + 18] == "")
    meta = read_meta(tmp_path / "ds")
    c19 = count_rows(str(tmp_path / "ds"), [f.name for f in meta.files], meta.sparse_columns[18], 0, 1,
                     meta.cardinalities[18])
    assert c19.tolist() == [empty_c19]
