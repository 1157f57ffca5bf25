"""Helpers shared by the end-to-end CLI tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dlrmflow.cli import main


def run_json(capsys, argv: list[str]) -> dict:
    """Run ``dlrmflow ARGV --json`` in-process; stdout must be exactly one JSON object."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, f"stdout must be one JSON line, got {out!r}"
    return json.loads(out[0])


# A command's first line with a configured API (the tests' harness is one): it names the API its runs go to.
API_LINE = re.compile(r"dlrmflow [a-z-]+: using the Prefect API at \S+ \(PREFECT_API_URL\)")


def refusal(err: str) -> str:
    """The one line of a refused command's stderr (its error), after at most the line that names the Prefect API
    (the command's first, so it comes first when the refusal comes from the flow's own checks)."""
    lines = err.strip().splitlines()
    assert lines and all(API_LINE.fullmatch(line) for line in lines[:-1]) and len(lines) <= 2, lines
    return lines[-1]


def terabyte_run_block() -> list[str]:
    """The lines of docs/terabyte.md's "How to run it" code block, as written (continuation lines joined)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "terabyte.md").read_text()
    block = text.split("## How to run it", 1)[1].split("```", 2)[1]
    return re.sub(r"\\\n\s*", " ", block).splitlines()
