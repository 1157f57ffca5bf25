"""benchmarks/scale.py's own parts: the memory it reports is that of every process a command starts, and its
extrapolation is the least-squares line it says it is. (The pipeline end to end, even at 20,000 rows,
takes minutes on 2 cores: six commands, each with its own LocalCluster and Prefect API; it is the
benchmark's run, not a test.)"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from benchmark_helpers import benchmark_module


@pytest.fixture(scope="module")
def scale():
    with benchmark_module("scale.py") as module:
        yield module


# A parent that starts a child; the child holds 200 MiB of written (anonymous) memory for a while.
CHILD = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"


def watched(scale, parent_code: str):
    """A TreeMemory of ``python -c PARENT_CODE`` from its start to its end."""
    proc = subprocess.Popen([sys.executable, "-c", parent_code])
    memory = scale.TreeMemory(proc.pid, interval=0.02)
    proc.wait(timeout=60)
    time.sleep(0.05)
    memory.stop()
    return memory


def test_tree_memory_counts_the_children_of_the_command(scale):
    memory = watched(scale, PARENT)
    assert memory.processes == 2
    assert memory.peak_one >= 200 * 2**20 and memory.largest == "other"  # the child's, not the parent's
    assert memory.peak_sum >= memory.peak_one
    assert memory.role_peaks["other"] == memory.peak_one and memory.role_peaks["command"] < 200 * 2**20


# A parent whose child spins one core for a second.
SPINNER = "import time; t = time.process_time(); exec('while time.process_time() - t < 1.0: pass')"
SPINNING_PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPINNER!r}])"


def test_tree_memory_counts_the_cpu_of_the_command_s_children(scale):
    memory = watched(scale, SPINNING_PARENT)
    assert 0.9 <= memory.cpu_seconds < 5.0, memory.cpu_seconds  # the child's second, the interpreters' start


def test_the_extrapolation_is_the_least_squares_line(scale):
    assert scale.linear_fit([1.0, 2.0, 3.0], [3.0, 5.0, 7.0]) == pytest.approx((1.0, 2.0))

    def stage(name: str, rows: int, seconds: float) -> object:
        return scale.Measured(name, rows, seconds, rows * 100, rows * 10, 4, {"embedding_rows": rows // 2}, 0)

    results = {n: [stage("generate", n, 10 + n / 1e5), stage("preprocess", n, 5 + n / 2e5)]
               for n in (1_000_000, 4_000_000)}
    text = scale.table(results, target=10_000_000)
    assert "| 4,000,000 | 2,000,000 | preprocess | 25.0 | - | 160,000 | 381 | 38 | 0 | - |" in text  # CPU: not measured
    assert "| generate | 10.00 | 10.0 | 110 |" in text  # s per 1M rows, fixed s, wall s at 10M rows
    assert "| **all stages** | | | 165 | | |" in text
    assert "no extrapolation" in scale.table({1_000_000: results[1_000_000]})


def test_the_scales_table_gives_the_bytes_per_added_embedding_row(scale):
    def run(s: float, emb: int, peak: int) -> list:
        return [scale.Measured("preprocess", 1000, 1.0, 3 * peak, peak, 4, {"embedding_rows": emb},
                               largest="dask worker", scale=s),
                scale.Measured("train", 1000, 2.0, 3 * peak + 12 * emb, peak + 4 * emb, 4, largest="command", scale=s,
                               role_peaks={"command": peak + 4 * emb, "dask worker": peak // 2 + 8 * emb})]

    # two runs of scale 0.001: the least peak of each kind is kept, with every run's largest-process peak
    least = scale.least_peaks([run(0.001, 50_000, 2**30), run(0.001, 50_000, 2**29)])
    assert [m.peak_process_bytes for m in least] == [2**29, 2**29 + 200_000]
    assert least[0].peaks == [2**30, 2**29]
    text = scale.scales_table({0.001: least, 1.0: run(1.0, 1_050_000, 2**29)})
    assert ("| preprocess | 512 (of 1,024, 512) | dask worker | 512 | dask worker | 50,000 | 1,050,000 | 0.0 | 0.0 |"
            in text)
    assert "| train | 512 (of 1,024, 512) | command | 516 | command | 50,000 | 1,050,000 | 4.0 | 12.0 |" in text
    assert "| train | dask worker | 256 | 264 | 8.0 |" in text  # each kind's largest process
