"""Prefaulting a replacement's rows: it changes no byte, even while other threads write, and it
does fault the pages in where the kernel can (Linux 5.14+)."""

from __future__ import annotations

import mmap
import os
import platform
import sys
import threading

import numpy as np
import pytest
from test_erasure import assert_bits_equal, random_rows

from dlrmflow.engine.coding import prefault as prefault_module
from dlrmflow.engine.coding.members import CodedShard, ParityShard
from dlrmflow.engine.coding.prefault import prefault
from dlrmflow.engine.serving.embedding_rows import RowSpec

LINUX_5_14 = sys.platform.startswith("linux") and tuple(
    int(part) for part in platform.release().split("-")[0].split(".")[:2]) >= (5, 14)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("seed", range(4))
def test_prefault_leaves_every_byte_as_it_was(seed):
    rng = np.random.default_rng(seed)
    rows = np.zeros((int(rng.integers(1, 300_000)), int(rng.integers(1, 40))), dtype=np.float32)
    touched = rng.choice(len(rows), size=min(len(rows), 1000), replace=False)
    rows[touched] = random_rows(rng, len(touched), rows.shape[1])
    view = rows[int(rng.integers(0, len(rows))):]  # an array that starts inside a page
    before = rows.copy()
    assert prefault(view) is LINUX_5_14
    assert_bits_equal(rows, before)


@pytest.mark.skipif(not LINUX_5_14, reason="MADV_POPULATE_WRITE needs Linux 5.14+")
def test_prefault_faults_the_pages_in():
    memory = mmap.mmap(-1, 64 << 20)  # fresh zero pages, none in memory yet (np.zeros may reuse freed ones)
    rows = np.frombuffer(memory, dtype=np.float32)
    before = _rss_bytes()
    assert prefault(rows)
    assert _rss_bytes() - before >= 0.9 * rows.nbytes
    assert not rows.any()
    del rows
    memory.close()


def test_writes_during_a_prefault_all_land(monkeypatch):
    """The install runs while the prefault does: every row it writes is there afterwards, and the rows
    it does not write are still zero (many small slices so the two interleave)."""
    monkeypatch.setattr(prefault_module, "PREFAULT_SLICE_BYTES", 1 << 16)
    rng = np.random.default_rng(3)
    rows = np.zeros((1 << 21, 8), dtype=np.float32)  # 64 MiB
    expected = np.zeros_like(rows)
    thread = prefault_module.prefault_in_background(rows)
    for _ in range(200):
        ids = rng.choice(len(rows), size=500, replace=False)
        values = random_rows(rng, 500, 8)
        rows[ids] = values
        expected[ids] = values
    thread.join()
    assert_bits_equal(rows, expected)


def test_a_replacement_prefaults_its_rows_once_when_a_rebuild_resets_it():
    spec = RowSpec(dim=4, optimizer="adagrad", seed=0, table_offsets=(0,), cardinalities=(50_000,))
    for member, initial in ((CodedShard(spec, 1, 2, initialise=False), CodedShard(spec, 1, 2).rows),
                            (ParityShard(spec, 2, 1, 0, initialise=False), ParityShard(spec, 2, 1, 0).rows)):
        assert member.prefaulting is None  # a standby costs nothing until a rebuild takes it
        member.reset("first")
        first = member.prefaulting
        assert isinstance(first, threading.Thread)
        member.reset("second")  # a rebuild that starts over does not start another
        assert member.prefaulting is first
        first.join()
        assert_bits_equal(member.all_local_rows(), initial)
