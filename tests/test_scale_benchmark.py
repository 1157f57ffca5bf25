"""benchmarks/scale.py's own parts: the memory it reports is that of every process a command starts, and its
extrapolation is the least-squares line it says it is. (The pipeline end to end, even at 20,000 rows,
takes minutes on 2 cores: six commands, each with its own LocalCluster and Prefect API; it is the
benchmark's run, not a test.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCALE = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("benchmark_scale", SCALE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


# A parent that starts a child; the child holds 200 MiB of written (anonymous) memory for a while.
CHILD = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"


def test_tree_memory_counts_the_children_of_the_command(scale):
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    memory = scale.TreeMemory(proc.pid, interval=0.02)
    proc.wait(timeout=60)
    time.sleep(0.05)
    memory.stop()
    assert memory.processes == 2
    assert memory.peak_one >= 200 * 2**20 and memory.largest == "other"  # the child's, not the parent's
    assert memory.peak_sum >= memory.peak_one


def test_the_extrapolation_is_the_least_squares_line(scale):
    assert scale.linear_fit([1.0, 2.0, 3.0], [3.0, 5.0, 7.0]) == pytest.approx((1.0, 2.0))

    def stage(name: str, rows: int, seconds: float) -> object:
        return scale.Measured(name, rows, seconds, rows * 100, rows * 10, 4, {"embedding_rows": rows // 2}, 0)

    results = {n: [stage("generate", n, 10 + n / 1e5), stage("preprocess", n, 5 + n / 2e5)]
               for n in (1_000_000, 4_000_000)}
    text = scale.table(results, target=10_000_000)
    assert "| 4,000,000 | 2,000,000 | preprocess | 25.0 | 160,000 | 381 | 38 | 0 | - |" in text
    assert "| generate | 10.00 | 10.0 | 110 |" in text  # s per 1M rows, fixed s, wall s at 10M rows
    assert "| **all stages** | | | 165 | | |" in text
    assert "no extrapolation" in scale.table({1_000_000: results[1_000_000]})
