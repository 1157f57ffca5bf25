"""The skew profile equals a brute-force count, on random datasets and on the real sample."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine.planning.profile import CountHistogram, plot_coverage, profile_dataset
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


@pytest.mark.parametrize("seed", range(6))
def test_profile_equals_brute_force(seed, tmp_path):
    sparse, cards = _random_dataset(tmp_path / "ds", seed)
    profile, counts = profile_dataset(tmp_path / "ds")
    all_counts = []
    for k, card in enumerate(cards):
        want = [0] * card
        for v in sparse[:, k]:
            want[v] += 1
        assert counts[k].tolist() == want
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


def test_histogram_top_accesses_at_every_k():
    counts = np.array([5, 0, 3, 3, 9, 1, 0, 3])
    hist = CountHistogram(counts)
    ranked = np.sort(counts)[::-1]
    for k in range(len(counts) + 1):
        assert hist.top_accesses(k) == ranked[:k].sum()


def test_profile_on_dask_equals_in_process_and_plots(tmp_path):
    _random_dataset(tmp_path / "ds", 11)
    local, _ = profile_dataset(tmp_path / "ds")
    with dask_client(n_workers=2) as client:
        distributed, _ = profile_dataset(tmp_path / "ds", client=client)
    assert local == distributed
    png = plot_coverage(local, tmp_path / "coverage.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_criteo_sample_profile(data_dir, tmp_path):
    preprocess([data_dir / "criteo_kaggle_sample.csv"], tmp_path / "ds", fmt="criteo-csv")
    profile, counts = profile_dataset(tmp_path / "ds")
    assert profile["samples"] == 200 and profile["accesses"] == 200 * 26
    # Row 0 of C19 counts the rows where C19 is empty in the file.
    text = (data_dir / "criteo_kaggle_sample.csv").read_text().splitlines()
    empty_c19 = sum(1 for line in text[1:] if line.split(",")[14 + 18] == "")
    assert counts[18][0] == empty_c19
