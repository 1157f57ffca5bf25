"""The README's examples are specifications: every `dlrmflow` command in it parses, and the
Commands section runs as written, in order, in a fresh directory."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_pipeline import SMALL

from dlrmflow.cli import build_parser, main
from dlrmflow.engine.training.checkpoint_format import checkpoint_iteration

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(section: str | None = None) -> list[list[str]]:
    """The `dlrmflow ...` command lines of README code blocks (optionally of one `## ` section), as argv."""
    text = README.read_text()
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = []
    for block in re.findall(r"^```\n(.*?)^```", text, re.S | re.M):
        lines = block.splitlines()
        # A block with `$ ` prompts shows output too: only its prompted lines are commands.
        prompted = any(line.startswith("$ ") for line in lines)
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            is_command = line.startswith("$ ") or not prompted
            line = line.removeprefix("$ ")
            while is_command and line.endswith("\\"):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            if is_command and line.startswith("dlrmflow "):
                found.append(shlex.split(line.split(" #")[0])[1:])
    return found


def test_the_readme_has_examples_of_every_command():
    used = {argv[0] for argv in commands()}
    assert used >= {"demo", "generate", "preprocess", "profile", "plan", "compare-caches", "train", "verify",
                    "resume"}


@pytest.mark.parametrize("argv", commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_readme_command_parses(argv):
    build_parser().parse_args(argv)


def _train_until_checkpointed(argv: list[str], cwd: Path) -> None:
    """Start ``dlrmflow train ... --checkpoint-every N`` and SIGKILL it once it has checkpointed
    iteration N: the crashed run that the README's `dlrmflow resume` example continues."""
    every = int(argv[argv.index("--checkpoint-every") + 1])
    output = Path(cwd, argv[argv.index("--output") + 1])
    from prefect.settings import get_current_settings

    # The test session's Prefect API (a server process of its own) spares the run a temporary one.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": str(get_current_settings().api.url)}
    proc = subprocess.Popen([sys.executable, "-m", "dlrmflow.cli", *argv], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while (checkpoint_iteration(output / "checkpoint.pt") or 0) < every:
            assert proc.poll() is None, "the training run ended before its checkpoint"
            assert time.monotonic() < deadline, f"no checkpoint of iteration {every} within 300 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.slow
def test_the_commands_section_runs_as_written(prefect_harness, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    steps = commands("Commands")
    resumed = {argv[1] for argv in steps if argv[0] == "resume"}
    for argv in steps:
        if argv[0] == "predict" and argv[1].startswith("runs/daily/"):  # the deployment's nights' model: run by
            continue  # tests/test_prefect_server.py after those nights
        if argv[0] == "demo":  # test_pipeline runs these very arguments (and checks their results)
            assert argv[3:] == SMALL
            continue
        if argv[0] == "train" and "--checkpoint-every" in argv and argv[argv.index("--output") + 1] in resumed:
            _train_until_checkpointed(argv, tmp_path)
            continue
        code = main(argv)
        out = capsys.readouterr().out
        assert code == 0, f"`dlrmflow {shlex.join(argv)}` exited {code}:\n{out}"
