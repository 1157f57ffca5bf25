"""Start-up of a command as a user runs it, phase by phase (issue 45, item 3): a one-iteration
``dlrmflow train DS --mode remote --iterations 1`` on 20,000 generated rows, launched without
``PREFECT_API_URL`` (so with the temporary local Prefect API), launch to exit.

Each stderr line is stamped on arrival; a phase ends at the first line that marks it:

    first line        the command's first line on stderr
    flow begins       Prefect's "Beginning flow run" (the temporary API answered and the flow run exists)
    cluster started   "Dask: starting a LocalCluster: done"
    servers started   "embedding servers: initialising N shards: done"
    first iteration   "iterations: 1/1"
    published         the run's tables and plots published (the flow's "done:" line)
    flow finished     Prefect's "Finished in state" of the flow run
    summary           the summary's first line on stdout
    exit              the process ended

``--api-url URL`` runs them against a running Prefect server instead (``prefect server start``, as a user
with the UI does). ``--python A B`` runs each interpreter (for example two venvs whose editable installs
point at two trees) in turn, ``--repeats`` rounds, and prints the medians side by side.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--python /tmp/before-venv/bin/python .venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PHASES = [
    ("first line", None),
    ("flow begins", "Beginning flow run"),
    ("cluster started", "Dask: starting a LocalCluster: done"),
    ("servers started", "embedding servers: initialising"),
    ("first iteration", "iterations: 1/1"),
    ("published", "- done: "),
    ("flow finished", "Finished in state"),  # the flow run's, not a task run's
]


def run_once(python: str, dataset: Path, out: Path, env: dict[str, str]) -> dict[str, float]:
    """One launch: seconds from launch to each phase's first line, and to the exit."""
    argv = [python, "-m", "dlrmflow.cli", "train", str(dataset), "--mode", "remote", "--iterations", "1",
            "--output", str(out)]
    started = time.monotonic()
    # In the run's directory: python -m puts the current directory first on sys.path, and a checkout's
    # dlrmflow/ there would shadow the interpreter's own install.
    proc = subprocess.Popen(argv, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            lines.append(line)
            at = time.monotonic() - started
            seen.setdefault("first line", at)
            for name, marker in PHASES[1:]:
                if name not in seen and marker in line and (name != "servers started" or ": done" in line) \
                        and (name != "flow finished" or "Flow run" in line):
                    seen[name] = at

    out_lines: list[str] = []

    def read_stdout() -> None:
        for line in proc.stdout:
            seen.setdefault("summary", time.monotonic() - started)
            out_lines.append(line)

    # Both pipes read in threads: the exit is the process's own, not the end of its pipes (the temporary
    # API's server and the Dask worker server inherit stderr and may outlive the command by a second).
    readers = [threading.Thread(target=read_stderr), threading.Thread(target=read_stdout)]
    for reader in readers:
        reader.start()
    code = proc.wait()
    seen["exit"] = time.monotonic() - started
    for reader in readers:
        reader.join()
    stdout = "".join(out_lines)
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} exited {code}:\n{stdout}{''.join(lines[-20:])}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", nargs="+", default=[sys.executable], help="interpreters to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--json", type=Path, default=None, help="also write every sample here")
    parser.add_argument("--api-url", default=None,
                        help="PREFECT_API_URL of a running server to use (default: none, the temporary API)")
    args = parser.parse_args()
    args.python = [os.path.abspath(p) for p in args.python]  # not resolved: a venv's python is a symlink

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL" and k != "DLRMFLOW_DASK_ADDRESS"}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if args.api_url:
        env["PREFECT_API_URL"] = args.api_url
    with tempfile.TemporaryDirectory(prefix="dlrmflow-startup-") as tmp:
        work = Path(tmp)
        dataset = work / "ds"
        from dlrmflow.datasets.synthetic import generate_rows

        (work / "raw.tsv").write_bytes(generate_rows(0, args.rows, seed=0, scale=1.0))
        subprocess.run([args.python[-1], "-m", "dlrmflow.cli", "preprocess", str(work / "raw.tsv"), "--output",
                        str(dataset), "--json"], env=env, cwd=work, check=True, capture_output=True)
        samples: dict[str, list[dict[str, float]]] = {p: [] for p in args.python}
        for round_ in range(args.repeats):
            for python in args.python:
                out = work / f"run-{round_}-{args.python.index(python)}"
                samples[python].append(run_once(python, dataset, out, env))
                print(f"round {round_ + 1}, {python}: exit at {samples[python][-1]['exit']:.1f} s", file=sys.stderr)

    names = [name for name, _ in PHASES] + ["summary", "exit"]
    load = os.getloadavg()[0]
    print(f"median seconds from launch ({args.repeats} rounds, {os.cpu_count()} cores, load {load:.1f} at the end)")
    print(f"{'phase':<18}" + "".join(f"{Path(p).parent.parent.name or p:>16}" for p in args.python))
    for name in names:
        row = [statistics.median(s[name] for s in samples[p]) if all(name in s for s in samples[p]) else None
               for p in args.python]
        print(f"{name:<18}" + "".join(f"{v:>16.2f}" if v is not None else f"{'-':>16}" for v in row))
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))


if __name__ == "__main__":
    main()
