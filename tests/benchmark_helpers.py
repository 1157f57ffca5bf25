"""A benchmark script (``benchmarks/NAME.py``, not a package module) imported by a test."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextmanager
def benchmark_module(file_name: str) -> Iterator[ModuleType]:
    """``benchmarks/FILE_NAME`` imported as ``benchmark_<stem>``, registered in ``sys.modules`` meanwhile
    (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{Path(file_name).stem}", BENCHMARKS / file_name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
