"""``make gpu-check``: on a machine with a CUDA GPU, every CUDA test and the GPU rows of the benchmarks in one
go (at most ``--max-seconds``, 8 minutes by default), written as ONE markdown report; without a GPU, one line
and exit 0, writing nothing.

The steps (``--dry-run`` prints them with their budgets and commands, on any machine):

    device        the card: torch.cuda.get_device_name, driver, CUDA and CuPy versions (this script, --device-info)
    cuda-tests    every CUDA test: pytest -m cuda over the test files that carry the cuda mark
    trainers-cuda benchmarks/trainers.py --device cuda --trainers 1,2 --modes remote,oracle --json: samples/s of
                  W = 1 and 2 on the GPU, and every W's runs bit-exact (state SHA-256) against that W's remote
    trainers-cpu  the same on the CPU, --modes remote: the baseline of the GPU rows, measured in the same run
    recovery      benchmarks/fault_tolerance.py --device cuda: time to recover and throughput during recovery
                  (parity R = 1, 2) against checkpoint + replay, the trainer's model and cache on the GPU
    parity-cupy   benchmarks/erasure.py --xp auto: the parity code (encode, delta, decode) on CuPy beside NumPy
    torchrec      benchmarks/torchrec_export.py (a `local` run exported to TorchRec and scored by both) when
                  TorchRec imports; otherwise a line saying it was skipped and why

Each step runs as a subprocess with its own budget: one that overruns is interrupted (SIGINT, then SIGKILL
of its process tree) and recorded as timed out, one that fails as failed, and the next step runs. The
measurements are the benchmarks' own (their --json where they have one, else their printed tables): this
script adds no measurement code. Exit status: 0 when every step passed or was skipped, 1 otherwise.

    python benchmarks/gpu_check.py [--output benchmarks/gpu_check.md] [--steps cuda-tests,recovery]
        [--budget recovery=150] [--max-seconds 480] [--torchrec-python /tmp/trvenv/bin/python] [--dry-run]

Where a step's figures come from, and what none of them can show: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "gpu_check.md"
MAX_SECONDS = 480.0  # the whole check, report included: 8 minutes
GRACE_S = 10.0  # after its budget, a step gets this long to stop on SIGINT before its processes are killed
RESERVE_S = 15.0  # kept back from the last step for the interruption's grace and the report
MIN_STEP_S = 5.0  # a step with less time than this left is not started ("not run")
TAIL_LINES = 15  # a failed or timed-out step's last lines of output, in the report
OK, FAILED, TIMED_OUT, SKIPPED, NOT_RUN = "ok", "FAILED", "TIMED OUT", "skipped", "not run"

# Budgets in seconds. Estimates for a machine like the lent H200 (16 cores; nothing here has been timed on a
# GPU yet): together 450 s, inside the 480 s limit with RESERVE_S to spare. --budget NAME=S changes one.
BUDGETS: dict[str, float] = {
    "device": 20.0,
    "cuda-tests": 110.0,
    "trainers-cuda": 100.0,
    "trainers-cpu": 50.0,
    "recovery": 110.0,
    "parity-cupy": 30.0,
    "torchrec": 30.0,
}
TRAINER_ARGS = ["--no-link", "--rates", "unshaped", "--trainers", "1,2", "--configs", "a", "--iterations", "20",
                "--repeats", "1", "--json"]
RECOVERY_ARGS = ["--iterations", "200", "--kill-at", "150", "--repeats", "1", "--checkpoint-every", "100",
                 "--paced-rate", "0"]
PARITY_ARGS = ["--xp", "auto", "--k", "4", "--r", "1", "2", "--rows", "1048576", "--repeats", "3"]
TORCHREC_ARGS = ["--rows", "10000"]
# The fault-tolerance table's rows the report keeps: benchmarks/fault_tolerance.py's labels, or their beginnings.
RECOVERY_ROWS = ("ms/iteration (failure-free)", "overhead vs none", "kill -> detected (s)", "time to recover (s)",
                 "recovery speed-up vs", "new iterations during recovery", "throughput during recovery",
                 "counting partial iterations", "training blocked by rebuild (s)", "parity delta bytes (MB)",
                 "verify (parity == encode(data))", "final state == failure-free")


@dataclass
class Step:
    """One step of the check: what it runs and how long it may take."""

    name: str
    title: str
    budget_s: float
    what: str
    argv: list[str]


@dataclass
class StepResult:
    """What one step gave: its status, wall time, the command, what was read from its output (``data``), a
    note (why it failed or was skipped) and, for a step that did not pass, its last lines of output."""

    name: str
    title: str
    budget_s: float
    status: str = NOT_RUN
    wall_s: float = 0.0
    command: str = ""
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    tail: str = ""


@dataclass
class Outcome:
    """A finished (or interrupted) command: exit status (None when killed), whether it ran past its time, its
    wall time and its output."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str


# --- without a GPU -----------------------------------------------------------------------------------------

def cuda_status() -> tuple[bool, str]:
    """(whether torch sees a CUDA device, the reason in words when it does not)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means no device to check
        return False, f"torch does not import: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, ""


def cuda_extra() -> str:
    """The pyproject extra to install for CuPy (``cuda12`` or ``cuda13``, torch's CUDA major version), or ''
    when there is no CUDA device, CuPy already imports, or torch's CUDA has no extra. Used by `make gpu-check`."""
    available, _ = cuda_status()
    if not available or importlib.util.find_spec("cupy") is not None:
        return ""
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    return f"cuda{major}" if major in ("12", "13") else ""


def device_info() -> dict[str, Any]:
    """The card and its software: names and memory per device (torch), the driver (nvidia-smi), torch's CUDA,
    CuPy's version and runtime (or why it does not import), the CPU count, Python and the OS."""
    import torch

    info: dict[str, Any] = {
        "devices": [{"name": torch.cuda.get_device_name(i),
                     "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                    for i in range(torch.cuda.device_count())],
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cpus": os.cpu_count(),
        "python": platform.python_version(), "platform": platform.platform(),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=5, check=True).stdout.split()
            info["driver"] = out[0] if out else None
    try:
        import cupy

        info["cupy"] = cupy.__version__
        info["cupy_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        info["cuda_driver_api"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
        info["cupy_devices"] = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - reported, and the CuPy step says so
        info["cupy_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return info


def _cuda_version(number: int) -> str:
    """12040 -> '12.4' (the CUDA runtime's and driver API's encoding)."""
    return f"{number // 1000}.{number % 1000 // 10}"


# --- the plan ----------------------------------------------------------------------------------------------

def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The test files that carry the cuda mark (``pytestmark = pytest.mark.cuda`` or ``@pytest.mark.cuda``),
    relative to ``root``: pytest -m cuda then collects only them instead of importing the whole suite."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py")
                  if "mark.cuda" in p.read_text(encoding="utf-8"))


def plan_steps(python: str, work: Path, cores: int, torchrec_python: str,
               budgets: dict[str, float] | None = None) -> list[Step]:
    """Every step, in the order it runs, with its budget and command."""
    budget = {**BUDGETS, **(budgets or {})}
    files = cuda_test_files()
    xdist = ["-n", str(min(2, len(files))), "--dist", "loadfile"] if importlib.util.find_spec("xdist") and \
        len(files) > 1 else []
    pinned = ["--trainer-cores", "4"] if cores >= 8 else []  # the trainer on cores of its own, as on the H200 before
    trainers = [python, "benchmarks/trainers.py", *TRAINER_ARGS, "--work-dir", str(work / "trainers")]
    steps = [
        Step("device", "the card", budget["device"], "torch.cuda.get_device_name, driver (nvidia-smi), torch's CUDA, "
             "CuPy", [python, __file__, "--device-info"]),
        Step("cuda-tests", "CUDA tests", budget["cuda-tests"], "every CUDA test: pytest -m cuda",
             [python, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *xdist, *files]),
        Step("trainers-cuda", "--trainers W --device cuda", budget["trainers-cuda"],
             "W = 1, 2 on the GPU: samples/s; each W's oracle bit-exact (state SHA-256) against its remote",
             [*trainers, "--modes", "remote,oracle", "--device", "cuda", "--plot", str(work / "trainers-cuda.png")]),
        Step("trainers-cpu", "the same on the CPU", budget["trainers-cpu"],
             "the baseline: W = 1, 2 remote on this machine's CPU, the same config and data",
             [*trainers, "--modes", "remote", "--device", "cpu", "--plot", str(work / "trainers-cpu.png")]),
        Step("recovery", "recovery with the trainer on the GPU", budget["recovery"],
             "fault_tolerance.py --device cuda: time to recover, throughput during recovery (parity R=1, 2) "
             "against checkpoint/100 + replay",
             [python, "benchmarks/fault_tolerance.py", "--device", "cuda", *pinned, *RECOVERY_ARGS,
              "--work", str(work / "fault")]),
        Step("parity-cupy", "the parity code on the GPU (CuPy)", budget["parity-cupy"],
             "erasure.py: encode, delta update and decode on CuPy beside NumPy",
             [python, "benchmarks/erasure.py", *PARITY_ARGS]),
        Step("torchrec", "`local` against TorchRec", budget["torchrec"],
             "when TorchRec imports: torchrec_export.py (a local run exported to TorchRec, both score the rows); "
             "else skipped, with why",
             [torchrec_python, "benchmarks/torchrec_export.py", *TORCHREC_ARGS, "--work", str(work / "torchrec")]),
    ]
    return steps


def print_plan(steps: list[Step], output: Path, max_seconds: float) -> None:
    total = sum(s.budget_s for s in steps)
    print(f"gpu-check plan: {len(steps)} steps, budgets {total:.0f} s together, the whole check at most "
          f"{max_seconds:.0f} s; a step stops at its budget and the next one runs")
    for s in steps:
        print(f"  {s.name:<14}{s.budget_s:5.0f} s  {s.what}")
        print(f"  {'':<14}{'':>7}  {display_command(s.argv)}")
    print(f"report: {output}")


def display_command(argv: list[str], work: Path | None = None) -> str:
    """``argv`` as a shell line, this interpreter as ``python`` and the work folder as ``WORK``."""
    shown = ["python" if a == sys.executable else a for a in argv]
    if work is not None:
        shown = [a.replace(str(work), "WORK") for a in shown]
    if shown and shown[1:2] == [__file__]:
        shown[1] = "benchmarks/gpu_check.py"
    return shlex.join(shown)


# --- running a step ----------------------------------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), read from /proc: also those that started a
    session of their own (the fault-tolerance benchmark's Dask processes), which a process-group kill misses."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_command(argv: list[str], timeout_s: float, log_prefix: Path, cwd: Path = ROOT,
                grace_s: float = GRACE_S) -> Outcome:
    """Run ``argv`` in its own session, output to ``log_prefix``.out/.err. Past ``timeout_s`` it gets SIGINT (so
    the benchmark's clean-up runs: clusters closed, pytest's summary printed), then after ``grace_s`` SIGKILL
    for it and every process it started."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out_path, err_path = log_prefix.with_suffix(".out"), log_prefix.with_suffix(".err")
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            tree = descendants(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            for pid in [proc.pid, *tree, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - start
    read = lambda p: p.read_text(encoding="utf-8", errors="replace")  # noqa: E731
    return Outcome(None if timed_out else proc.returncode, timed_out, wall, read(out_path), read(err_path))


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def finish(result: StepResult, outcome: Outcome, parse: Callable[[Outcome], tuple[str, str, dict[str, Any]]]
           ) -> StepResult:
    """Fill ``result`` from ``outcome``: timed out, or what ``parse`` reads (status, note, data); a parse that
    raises is a failed step whose output is kept."""
    result.wall_s = outcome.wall_s
    if outcome.timed_out:
        result.status, result.note = TIMED_OUT, f"stopped at its budget of {result.budget_s:.0f} s"
        with contextlib.suppress(Exception):  # whatever it printed before it was stopped
            _, _, result.data = parse(outcome)
    else:
        try:
            result.status, result.note, result.data = parse(outcome)
        except Exception as exc:  # noqa: BLE001 - the step's own output stays in the report
            result.status, result.note = FAILED, f"its output could not be read: {type(exc).__name__}: {exc}"
    if result.status != OK:
        result.tail = tail(outcome.stdout + ("\n" if outcome.stdout else "") + outcome.stderr)
    return result


# --- reading each step's output ----------------------------------------------------------------------------

def parse_device(outcome: Outcome) -> tuple[str, str, dict[str, Any]]:
    if outcome.returncode != 0:
        return FAILED, f"exit status {outcome.returncode}", {}
    return OK, "", json.loads(outcome.stdout)


def parse_pytest(outcome: Outcome) -> tuple[str, str, dict[str, Any]]:
    """Counts from pytest's last summary line and the names of failed tests."""
    text = outcome.stdout + "\n" + outcome.stderr
    summaries = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
                                               summaries[-1] if summaries else "")}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    data = {"counts": counts, "failed": failed}
    if outcome.returncode == 0 and counts.get("passed", 0) > 0:
        skipped = counts.get("skipped", 0)
        return OK, f"{skipped} skipped" if skipped else "", data
    if outcome.returncode == 5 or not set(counts) - {"skipped", "deselected"}:
        return FAILED, "no CUDA test ran (each skipped or none collected)", data
    return FAILED, f"exit status {outcome.returncode}", data


def parse_trainers(outcome: Outcome) -> tuple[str, str, dict[str, Any]]:
    """trainers.py --json: per run W, device, mode, samples/s, median ms, stall, state SHA-256; its mismatches."""
    start = re.search(r"^\{", outcome.stdout, flags=re.M)
    if start is None:
        return FAILED, f"exit status {outcome.returncode}, no JSON printed", {}
    report, _ = json.JSONDecoder().raw_decode(outcome.stdout, start.start())
    runs = [{"trainers": r["trainers"], "device": r["device"], "mode": r["mode"], "config": r["config"],
             "iterations": r["iterations"], "batch_size": r["batch_size"], "samples_per_s": r["samples_per_s"],
             "median_ms": r["pooled_median_ms"], "stall": r["pooled_stall_fraction"],
             "state_sha256": r["state_sha256"],
             "trainer_devices": [t.get("device") for t in r.get("per_trainer") or []]} for r in report["runs"]]
    data = {"runs": runs, "mismatches": report.get("mismatches", [])}
    if data["mismatches"]:
        return FAILED, "final states differ from remote's: " + "; ".join(data["mismatches"]), data
    if outcome.returncode != 0:
        return FAILED, f"exit status {outcome.returncode}", data
    if not runs:
        return FAILED, "no run", data
    return OK, "", data


def parse_fault_table(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """benchmarks/fault_tolerance.py's printed table -> (its modes, {row label: {mode: cell}}): a 34-character
    label, then one 15-character right-aligned column per mode."""
    lines = text.splitlines()
    at = next(i for i in range(1, len(lines)) if lines[i] and set(lines[i]) == {"-"} and lines[i - 1].startswith(
        " " * 34))
    header = lines[at - 1]
    width = 15
    modes = [header[c:c + width].strip() for c in range(34, len(header), width)]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[at + 1:]:
        if len(line) < 34 + width * len(modes):
            break
        cells = [line[34 + i * width:34 + (i + 1) * width].strip() for i in range(len(modes))]
        rows[line[:34].rstrip()] = dict(zip(modes, cells, strict=True))
    return modes, rows


def parse_recovery(outcome: Outcome) -> tuple[str, str, dict[str, Any]]:
    if outcome.returncode != 0:
        return FAILED, f"exit status {outcome.returncode}", {}
    modes, rows = parse_fault_table(outcome.stdout)
    data = {"modes": modes, "rows": rows}
    checks = ("final state == failure-free", "verify (parity == encode(data))")
    bad = sorted({m for label in checks for m, cell in rows.get(label, {}).items() if cell not in ("True", "n/a")})
    if bad:
        return FAILED, f"not bit-identical to the failure-free run, or parity not verified: {', '.join(bad)}", data
    return OK, "", data


ERASURE_ROW = re.compile(r"^\s*(numpy|cupy)\s+(\d+)\s+(\d+)\s+(.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                         r"\s+([\d.]+)\s*$")


def parse_parity(outcome: Outcome) -> tuple[str, str, dict[str, Any]]:
    rows = [{"xp": m[1], "k": int(m[2]), "r": int(m[3]), "op": m[4], "MB": float(m[5]), "ms": float(m[6]),
             "GB/s": float(m[7]), "copy GB/s": float(m[8]), "x copy": float(m[9])}
            for m in map(ERASURE_ROW.match, outcome.stdout.splitlines()) if m]
    shards = next((line for line in outcome.stdout.splitlines() if line.startswith("shards:")), "")
    data = {"rows": rows, "shards": shards}
    if outcome.returncode != 0:
        return FAILED, f"exit status {outcome.returncode}", data
    if not any(r["xp"] == "cupy" for r in rows):
        return FAILED, "no CuPy row: erasure.py found no usable CuPy", data
    return OK, "", data


def parse_torchrec(outcome: Outcome) -> tuple[str, str, dict[str, Any]]:
    text = outcome.stdout
    found = re.search(r"^([\d,]+) rows: ([\d,]+) probabilities bit-equal; largest difference (\S+) \(probability\), "
                      r"(\S+) \(logit\)", text, flags=re.M)
    data: dict[str, Any] = {}
    if found:
        data = {"rows": int(found[1].replace(",", "")), "bit_equal": int(found[2].replace(",", "")),
                "probability_diff": float(found[3]), "logit_diff": float(found[4])}
    for key, prefix in (("stages", "stage by stage"), ("tolerance", "tolerance"), ("versions", "torchrec ")):
        data[key] = next((line for line in text.splitlines() if line.startswith(prefix)), "")
    if outcome.returncode == 0 and found:
        return OK, "", data
    return FAILED, f"exit status {outcome.returncode}" + ("" if found else ", no comparison printed"), data


# --- the steps' runners ------------------------------------------------------------------------------------

def run_step(step: Step, timeout_s: float, work: Path, context: dict[str, Any]) -> StepResult:
    """Run one step within ``timeout_s``; ``context`` carries the device step's findings to the later steps."""
    result = StepResult(step.name, step.title, step.budget_s, command=display_command(step.argv, work))
    log = work / step.name
    if step.name == "parity-cupy" and "cupy_error" in context.get("info", {}):
        result.status = FAILED
        result.note = (f"CuPy does not import here ({context['info']['cupy_error']}): pip install -e '.[cuda12]' or "
                       "'.[cuda13]', matching torch's CUDA (make gpu-check does it)")
        return result
    if step.name == "torchrec":
        probe = [step.argv[0], "-c", "import warnings; warnings.filterwarnings('ignore'); import torchrec"]
        found = run_command(probe, min(timeout_s, 30.0), work / "torchrec-probe")
        if found.returncode != 0:
            result.status, result.wall_s = SKIPPED, found.wall_s
            last = tail(found.stderr, 1) or ("its import ran past 30 s" if found.timed_out else "no error printed")
            result.note = (f"TorchRec does not import with {display_command([step.argv[0]])}: {last}. "
                           "docs/export.md sets up an interpreter that has it (--torchrec-python)")
            return result
        timeout_s -= found.wall_s
    parse = {"device": parse_device, "cuda-tests": parse_pytest, "trainers-cuda": parse_trainers,
             "trainers-cpu": parse_trainers, "recovery": parse_recovery, "parity-cupy": parse_parity,
             "torchrec": parse_torchrec}[step.name]
    finish(result, run_command(step.argv, timeout_s, log), parse)
    if step.name == "torchrec":
        result.wall_s += found.wall_s
    if step.name == "device":
        context["info"] = result.data
    return result


def run_check(steps: list[Step], work: Path, max_seconds: float,
              progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
              ) -> tuple[list[StepResult], dict[str, Any], float]:
    """Every step in order, each within its budget and what is left of ``max_seconds``: (results, the device
    info, total wall seconds)."""
    start = time.monotonic()
    context: dict[str, Any] = {}
    results: list[StepResult] = []
    for i, step in enumerate(steps, 1):
        left = max_seconds - (time.monotonic() - start) - RESERVE_S
        if left < MIN_STEP_S:
            results.append(StepResult(step.name, step.title, step.budget_s, command=display_command(step.argv, work),
                                      note=f"the check's limit of {max_seconds:.0f} s was reached"))
            progress(f"gpu-check: [{i}/{len(steps)}] {step.name}: not run (the {max_seconds:.0f} s limit)")
            continue
        progress(f"gpu-check: [{i}/{len(steps)}] {step.name} (budget {min(step.budget_s, left):.0f} s) ...")
        result = run_step(step, min(step.budget_s, left), work, context)
        results.append(result)
        progress(f"gpu-check: [{i}/{len(steps)}] {step.name}: {result.status} in {result.wall_s:.1f} s"
                 + (f" ({result.note})" if result.note else ""))
    info = context.get("info") or {}
    if not info.get("devices"):  # the device step failed: the card's name at least, from this process
        try:
            import torch

            info = {**info, "devices": [{"name": torch.cuda.get_device_name(0)}], "torch": torch.__version__,
                    "torch_cuda": torch.version.cuda, "cpus": os.cpu_count()}
        except Exception as exc:  # noqa: BLE001 - the report says so rather than failing
            info = {**info, "devices": [{"name": f"unknown ({type(exc).__name__}: {exc})".splitlines()[0]}]}
    return results, info, time.monotonic() - start


# --- the report --------------------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def machine_lines(info: dict[str, Any]) -> list[str]:
    devices = info.get("devices") or [{"name": "unknown"}]
    names = ", ".join(f"{d['name']}" + (f" ({d['memory_gib']} GiB)" if d.get("memory_gib") else "") for d in devices)
    cupy = (f"CuPy {info['cupy']} (CUDA runtime {info.get('cupy_runtime')}, driver API {info.get('cuda_driver_api')})"
            if info.get("cupy") else f"CuPy: not usable ({info.get('cupy_error', 'not checked')})")
    return [f"- GPU: {len(devices)} x {names}",
            f"- driver {info.get('driver') or 'unknown (no nvidia-smi)'}; torch {info.get('torch')} built for CUDA "
            f"{info.get('torch_cuda')}; {cupy}",
            f"- {info.get('cpus')} CPU cores; Python {info.get('python', '?')}; {info.get('platform', '?')}"]


def steps_table(results: list[StepResult]) -> list[str]:
    lines = ["| step | what | status | wall s | budget s | note |", "|---|---|---|---|---|---|"]
    for r in results:
        status = f"**{r.status}**" if r.status in (FAILED, TIMED_OUT) else r.status
        lines.append(f"| {r.name} | {r.title} | {status} | {r.wall_s:.1f} | {r.budget_s:.0f} | "
                     f"{r.note.replace('|', '/')} |")
    return lines


def section_tests(r: StepResult) -> list[str]:
    counts = r.data.get("counts", {})
    lines = ["Counts: " + (", ".join(f"{n} {k}" for k, n in counts.items()) or "none read") + "."]
    lines += [f"- failed: `{name}`" for name in r.data.get("failed", [])]
    return lines


def section_trainers(gpu: StepResult | None, cpu: StepResult | None) -> list[str]:
    """W = 1, 2 on the GPU and on the CPU, one table, then the comparisons: bit-exactness per (device, W), W = 2
    against W = 1, GPU against CPU."""
    runs = [run for r in (gpu, cpu) if r for run in r.data.get("runs", [])]
    if not runs:
        return ["No run finished."]
    first = runs[0]
    lines = [f"Config `{first['config']}` (benchmarks/train.py's), batch {first['batch_size']}, {first['iterations']} "
             "iterations, one round after the warm-up, no link (unshaped). samples/s: the global batch over the "
             "median iteration (rank 0's for W = 2).", "",
             "| W | device | mode | samples/s | median ms | stall | final state SHA-256 | = this W's remote |",
             "|---|---|---|---|---|---|---|---|"]
    by = {(x["device"], x["trainers"], x["mode"]): x for x in runs}
    for x in sorted(runs, key=lambda x: (x["device"] != "cuda", x["trainers"], x["mode"] != "remote", x["mode"])):
        ref = by.get((x["device"], x["trainers"], "remote"))
        same = "n/a" if ref is None else ("yes" if ref["state_sha256"] == x["state_sha256"] else "**NO**")
        device = x["device"] + (f" ({', '.join(x['trainer_devices'])})" if x["trainer_devices"] else "")
        lines.append(f"| {x['trainers']} | {device} | {x['mode']} | {x['samples_per_s']:,.0f} | {x['median_ms']:.1f} | "
                     f"{100 * x['stall']:.1f}% | `{x['state_sha256'][:16]}` | {same} |")
    lines.append("")
    for device, w in sorted({(x["device"], x["trainers"]) for x in runs}):
        ref = by.get((device, w, "remote"))
        for x in (x for x in runs if (x["device"], x["trainers"]) == (device, w) and x["mode"] != "remote"):
            verdict = "n/a (no remote)" if ref is None else (
                "bit-exact" if ref["state_sha256"] == x["state_sha256"] else "**MISMATCH**")
            lines.append(f"- W={w} on {device}: {x['mode']} against remote: {verdict}")
    for mode in sorted({x["mode"] for x in runs}):
        one, two = by.get(("cuda", 1, mode)), by.get(("cuda", 2, mode))
        cpu1, cpu2 = by.get(("cpu", 1, mode)), by.get(("cpu", 2, mode))
        if one or two:
            lines.append(f"- {mode}, samples/s: W=2 cuda {_num(two)} / W=1 cuda {_num(one)} = "
                         f"{_ratio(_sps(two), _sps(one))}; W=1 cuda / W=1 CPU {_num(cpu1)} = "
                         f"{_ratio(_sps(one), _sps(cpu1))}; W=2 cuda / W=2 CPU {_num(cpu2)} = "
                         f"{_ratio(_sps(two), _sps(cpu2))}")
    return lines


def _sps(run: dict[str, Any] | None) -> float | None:
    return run["samples_per_s"] if run else None


def _num(run: dict[str, Any] | None) -> str:
    return f"{run['samples_per_s']:,.0f}" if run else "n/a"


def section_recovery(r: StepResult) -> list[str]:
    modes, rows = r.data.get("modes", []), r.data.get("rows", {})
    if not rows:
        return ["No table was printed."]
    lines = ["Same data and kill (SIGKILL of data shard 0's worker at iteration 150 of 200), each mode beside "
             "`none` and checkpoint + replay in the same run. The parity members run on the Dask workers' CPUs "
             "(NumPy): the engine computes no parity on the GPU; the CuPy code is measured in the next section.", "",
             "| | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for label, cells in rows.items():
        if label.strip().startswith(RECOVERY_ROWS):
            lines.append(f"| {label.strip()} | " + " | ".join(cells.get(m, "") for m in modes) + " |")
    return lines


def section_parity(r: StepResult) -> list[str]:
    rows = r.data.get("rows", [])
    if not rows:
        return ["No table was printed."]
    by = {(x["xp"], x["k"], x["r"], x["op"]): x for x in rows}
    lines = [r.data.get("shards", ""), "",
             "| k, r | operation | NumPy GB/s | CuPy GB/s | CuPy / NumPy | CuPy x copy |", "|---|---|---|---|---|---|"]
    for (xp, k, rr, op), x in by.items():
        if xp != "numpy":
            continue
        gpu = by.get(("cupy", k, rr, op))
        speed, versus_copy = (f"{gpu['GB/s']:.2f}", f"{gpu['x copy']:.2f}") if gpu else ("n/a", "n/a")
        lines.append(f"| {k}, {rr} | {op} | {x['GB/s']:.2f} | {speed} | {_ratio(gpu and gpu['GB/s'], x['GB/s'])} | "
                     f"{versus_copy} |")
    return lines


def section_torchrec(r: StepResult) -> list[str]:
    if r.status == SKIPPED:
        return [f"Skipped: {r.note}"]
    d = r.data
    if "rows" not in d:
        return ["No comparison was printed."]
    return [d.get("versions", ""), "",
            f"{d['rows']:,} rows: {d['bit_equal']:,} probabilities bit-equal; largest difference "
            f"{d['probability_diff']:.3e} (probability), {d['logit_diff']:.3e} (logit); {d.get('tolerance', '')}.",
            d.get("stages", ""), "",
            "benchmarks/torchrec_export.py trains, exports and scores on the CPU (it has no --device): a comparison "
            "of `local` against TorchRec on the GPU itself is not built."]


def render_report(info: dict[str, Any], command: str, results: list[StepResult], started: str, total_s: float,
                  max_seconds: float = MAX_SECONDS) -> str:
    """The markdown report: the machine, the command, every step's status and wall time against its budget, then
    each step's figures beside the baseline measured in the same run, and the output of any step that did not
    pass."""
    by = {r.name: r for r in results}
    passed = sum(r.status in (OK, SKIPPED) for r in results)
    lines = ["# GPU check", "", f"Run {started}, {total_s:.0f} s in all (limit {max_seconds:.0f} s): "
             f"{passed} of {len(results)} steps passed or were skipped.", "", "```", command, "```", "",
             *machine_lines(info), "", "## Steps", "", *steps_table(results)]

    def section(title: str, body: list[str], *names: str) -> None:
        ran = [by[n] for n in names if n in by]
        if not ran:
            return
        lines.extend(["", f"## {title}", ""])
        for r in ran:
            lines.append(f"`{r.command}`: {r.status}, {r.wall_s:.1f} s of {r.budget_s:.0f} s"
                         + (f" ({r.note})" if r.note and r.status != SKIPPED else "") + "  ")
        lines.append("")
        lines.extend(body)

    if "cuda-tests" in by:
        section("CUDA tests", section_tests(by["cuda-tests"]), "cuda-tests")
    if "trainers-cuda" in by or "trainers-cpu" in by:
        section("Trainers on the GPU against remote, and against the CPU",
                section_trainers(by.get("trainers-cuda"), by.get("trainers-cpu")), "trainers-cuda", "trainers-cpu")
    if "recovery" in by:
        section("Recovery, the trainer on the GPU", section_recovery(by["recovery"]), "recovery")
    if "parity-cupy" in by:
        section("The parity code on the GPU (CuPy) beside NumPy", section_parity(by["parity-cupy"]), "parity-cupy")
    if "torchrec" in by:
        section("`local` against TorchRec", section_torchrec(by["torchrec"]), "torchrec")
    unread = [r for r in results if r.tail]
    if unread:
        lines.extend(["", "## Output of the steps that did not pass"])
        for r in unread:
            lines.extend(["", f"### {r.name}: {r.status}", "", "```", r.tail, "```"])
    return "\n".join(lines) + "\n"


# --- the command -------------------------------------------------------------------------------------------

def parse_budgets(items: list[str]) -> dict[str, float]:
    """``["recovery=150"]`` -> ``{"recovery": 150.0}``; SystemExit for an unknown step or a bad number."""
    out: dict[str, float] = {}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in BUDGETS:
            raise SystemExit(f"gpu-check: --budget {item!r}: no step {name!r}; steps: {', '.join(BUDGETS)}")
        try:
            out[name] = float(seconds)
        except ValueError:
            raise SystemExit(f"gpu-check: --budget {item!r}: {seconds!r} is not a number of seconds") from None
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the report (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the steps, budgets and commands; run nothing")
    parser.add_argument("--steps", help=f"comma-separated subset, in this order: {', '.join(BUDGETS)} (default all; "
                                        "device always runs)")
    parser.add_argument("--budget", action="append", default=[], metavar="STEP=S", help="one step's budget in seconds")
    parser.add_argument("--max-seconds", type=float, default=MAX_SECONDS, help="the whole check (default 480)")
    parser.add_argument("--torchrec-python", default=sys.executable,
                        help="the interpreter for the TorchRec step (default this one; docs/export.md sets up one)")
    parser.add_argument("--keep-work", action="store_true", help="keep the work folder (data, runs, logs)")
    parser.add_argument("--cuda-extra", action="store_true", help=argparse.SUPPRESS)  # for make gpu-check
    parser.add_argument("--device-info", action="store_true", help=argparse.SUPPRESS)  # the device step
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cuda_extra:
        print(cuda_extra())
        return 0
    if args.device_info:
        print(json.dumps(device_info()))
        return 0
    budgets = parse_budgets(args.budget)
    wanted = set(BUDGETS)
    if args.steps:
        wanted = {s.strip() for s in args.steps.split(",")} | {"device"}
        if unknown := wanted - set(BUDGETS):
            print(f"gpu-check: --steps: no step {', '.join(sorted(unknown))}; steps: {', '.join(BUDGETS)}",
                  file=sys.stderr)
            return 2
    if args.dry_run:
        steps = plan_steps(sys.executable, Path("WORK"), os.cpu_count() or 1, args.torchrec_python, budgets)
        print_plan([s for s in steps if s.name in wanted], args.output, args.max_seconds)
        return 0
    available, why = cuda_status()
    if not available:
        print(f"gpu-check: no CUDA device ({why}); nothing to check")
        return 0
    work = Path(tempfile.mkdtemp(prefix="dlrmflow-gpu-check-"))
    steps = [s for s in plan_steps(sys.executable, work, os.cpu_count() or 1, args.torchrec_python, budgets)
             if s.name in wanted]
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python benchmarks/gpu_check.py" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])
                                                   if (argv or sys.argv[1:]) else "")
    if os.environ.get("MAKELEVEL"):
        command = f"make gpu-check  # {command}"
    try:
        results, info, total = run_check(steps, work, args.max_seconds)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render_report(info, command, results, started, total, args.max_seconds), encoding="utf-8")
    bad = [r.name for r in results if r.status not in (OK, SKIPPED)]
    print(f"gpu-check: report {args.output}: {len(results) - len(bad)} of {len(results)} steps passed or skipped"
          + (f"; not passed: {', '.join(bad)}" if bad else "") + (f"; work kept in {work}" if args.keep_work else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
