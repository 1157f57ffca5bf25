"""Numbers with units in the commands' summaries: a prefix that keeps small values readable."""

from __future__ import annotations

_PREFIXES = ((1e9, "G"), (1e6, "M"), (1e3, "k"))


def per_second(count: float, unit: str) -> str:
    """``12.3 M ids/s``, ``45.6 k ids/s``, ``789 ids/s``: the largest prefix with a value >= 1."""
    for scale, prefix in _PREFIXES:
        if count >= scale:
            return f"{count / scale:,.1f} {prefix} {unit}/s"
    return f"{count:,.0f} {unit}/s"


def size(n_bytes: float) -> str:
    """``512 B``, ``1.5 KB``, ``2.3 MB``, ``1.0 GB`` (powers of 1000)."""
    n = float(n_bytes)
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} GB"
