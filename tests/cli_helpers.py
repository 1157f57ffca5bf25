"""Helpers shared by the end-to-end CLI tests."""

from __future__ import annotations

import json

from dlrmflow.cli import main


def run_json(capsys, argv: list[str]) -> dict:
    """Run ``dlrmflow ARGV --json`` in-process; stdout must be exactly one JSON object."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, f"stdout must be one JSON line, got {out!r}"
    return json.loads(out[0])
