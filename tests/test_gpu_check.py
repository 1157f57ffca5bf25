"""benchmarks/gpu_check.py (`make gpu-check`) where no GPU is: the one line and nothing written, the plan
(every step the issue asks for, within 8 minutes, each option one its benchmark has), a step past its budget
stopped with every process it started, a failed step recorded while the next one runs, the parsers on the
benchmarks' real output formats, and the report's renderer.

None of this is GPU evidence: the renderer and parser tests feed fabricated or CPU-made results, and the
orchestration tests run stand-in commands. The GPU figures come only from a run on a machine with a GPU."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from benchmark_helpers import benchmark_module

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device for torch, on any machine
ONE_LINE = "gpu-check: no CUDA device (torch.cuda.is_available() is False); nothing to check\n"
REQUIRED = ("device", "cuda-tests", "trainers-cuda", "trainers-cpu", "recovery", "parity-cupy", "torchrec")


@pytest.fixture(scope="module")
def gpu_check():
    with benchmark_module("gpu_check.py") as module:
        yield module


def _default_report() -> tuple[bool, float | None]:
    path = ROOT / "benchmarks" / "gpu_check.md"
    return path.exists(), path.stat().st_mtime if path.exists() else None


def test_make_gpu_check_without_a_gpu_says_so_in_one_line_and_installs_and_writes_nothing(tmp_path):
    """`make gpu-check GPU_PYTHON=<this interpreter>` (GPU_PYTHON skips the venv's stamp, so .venv is not
    touched): the CUDA extra's probe finds no device (nothing installed, nothing printed), the script says its
    one line and exits 0; no report (the default one neither made nor touched), no work folder. Without make,
    the script alone."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    before = _default_report()
    command = [sys.executable, str(GPU_CHECK)]
    if shutil.which("make"):
        command = ["make", "--no-print-directory", "-C", str(ROOT), "gpu-check", f"GPU_PYTHON={sys.executable}"]
    done = subprocess.run(command, cwd=tmp_path, env={**NO_GPU, "TMPDIR": str(temp)}, capture_output=True,
                          text=True, timeout=180)
    assert (done.returncode, done.stdout, done.stderr) == (0, ONE_LINE, "")
    assert _default_report() == before
    assert list(temp.iterdir()) == [] and list(tmp_path.iterdir()) == [temp]


def test_the_dry_run_lists_every_required_step_within_eight_minutes(gpu_check, capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = gpu_check.plan_steps("python", Path("WORK"), 16, "python")
    assert [s.name for s in steps] == list(REQUIRED)
    for s in steps:
        assert f"  {s.name:<14}{s.budget_s:5.0f} s  " in out
    assert sum(s.budget_s for s in steps) + gpu_check.RESERVE_S <= gpu_check.MAX_SECONDS == 480
    command = {s.name: shlex.join(s.argv) for s in steps}
    assert command["cuda-tests"].startswith("python -m pytest -m cuda")
    for name in ("tests/test_erasure_cuda.py", "tests/test_trainers_cuda.py"):
        assert name in command["cuda-tests"]
    for part in ("benchmarks/trainers.py", "--device cuda", "--trainers 1,2", "--modes remote,oracle", "--json"):
        assert part in command["trainers-cuda"]
    for part in ("benchmarks/trainers.py", "--device cpu", "--trainers 1,2", "--modes remote", "--json"):
        assert part in command["trainers-cpu"]
    for part in ("benchmarks/fault_tolerance.py", "--device cuda", "--trainer-cores 4", "--checkpoint-every 100"):
        assert part in command["recovery"]
    assert "benchmarks/erasure.py --xp auto" in command["parity-cupy"]
    assert "benchmarks/torchrec_export.py" in command["torchrec"]
    assert "--trainer-cores" not in shlex.join(gpu_check.plan_steps("python", Path("W"), 4, "python")[4].argv)


def test_every_option_the_plan_passes_is_one_its_benchmark_has(gpu_check):
    for step in gpu_check.plan_steps("python", Path("WORK"), 16, "python"):
        scripts = [a for a in step.argv if a.startswith("benchmarks/")]
        if not scripts:
            continue
        source = (ROOT / scripts[0]).read_text()
        for option in (a for a in step.argv if a.startswith("--")):
            assert f'"{option}"' in source, f"{step.name}: {scripts[0]} has no {option}"


# The parent starts a child in a session of its own (as fault_tolerance.py starts its Dask processes), says its
# pid, and waits: a kill of the parent's process group alone would leave the child running.
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(120)\n")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_step_past_its_budget_is_stopped_with_every_process_it_started(gpu_check, tmp_path):
    outcome = gpu_check.run_command([sys.executable, "-c", PARENT], 3.0, tmp_path / "step", cwd=tmp_path,
                                    grace_s=2.0)
    assert outcome.timed_out and outcome.returncode is None and 3.0 <= outcome.wall_s < 30
    child = int(outcome.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


PYTEST_FAILED = ("import sys\nprint('FAILED tests/test_trainers_cuda.py::test_x - AssertionError')\n"
                 "print('1 failed, 34 passed in 61.20s (0:01:01)')\nsys.exit(1)\n")
ERASURE_OUTPUT = """shards: 1048576 rows x 17 float32 = 71.3 MB each; medians of 3
   xp  k  r            op    MB    ms  GB/s  copy GB/s  x copy
numpy  4  1        encode  285.21  37.10  7.69      11.50    1.50
numpy  4  1      decode 1   71.30  33.20  2.15      11.00    5.10
 cupy  4  1        encode  285.21   1.40  203.72   1500.10    7.36
 cupy  4  1      decode 1   71.30   1.39  51.30   1400.00   27.29
"""


def test_a_failed_step_and_one_past_its_budget_are_recorded_and_the_next_step_runs(gpu_check, tmp_path):
    """Stand-in commands (not the benchmarks) through the real runner: each step's status, the failed test's name,
    and the output of the steps that did not pass."""
    py = sys.executable
    card = json.dumps({"devices": [{"name": "stand-in card"}]})
    steps = [gpu_check.Step("device", "the card", 30, "", [py, "-c", f"print({card!r})"]),
             gpu_check.Step("cuda-tests", "CUDA tests", 30, "", [py, "-c", PYTEST_FAILED]),
             gpu_check.Step("recovery", "recovery", 2, "", [py, "-c", "import time; time.sleep(60)"]),
             gpu_check.Step("parity-cupy", "parity", 30, "", [py, "-c", f"print({ERASURE_OUTPUT!r})"])]
    lines: list[str] = []
    results, info, total = gpu_check.run_check(steps, tmp_path, 120, progress=lines.append)
    assert [r.status for r in results] == ["ok", "FAILED", "TIMED OUT", "ok"]
    assert info == {"devices": [{"name": "stand-in card"}]}
    tests, recovery, parity = results[1:]
    assert tests.data["failed"] == ["tests/test_trainers_cuda.py::test_x"]
    assert tests.data["counts"] == {"failed": 1, "passed": 34}
    assert "1 failed, 34 passed" in tests.tail and recovery.note == "stopped at its budget of 2 s"
    assert parity.tail == "" and {r["xp"] for r in parity.data["rows"]} == {"numpy", "cupy"}
    assert len(lines) == 8 and "[3/4] recovery: TIMED OUT" in lines[5]


def test_the_limit_of_the_whole_check_leaves_later_steps_not_run(gpu_check, tmp_path, monkeypatch):
    """With no device step, the card's name comes from this process's torch: a stand-in here."""
    cuda = types.SimpleNamespace(get_device_name=lambda index: "stand-in card")
    version = types.SimpleNamespace(cuda="13.0")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda, __version__="0", version=version))
    steps = [gpu_check.Step("parity-cupy", "parity", 30, "", [sys.executable, "-c", "print()"])]
    results, info, _ = gpu_check.run_check(steps, tmp_path, gpu_check.RESERVE_S, progress=lambda line: None)
    assert results[0].status == "not run" and "limit" in results[0].note
    assert info["devices"] == [{"name": "stand-in card"}]


FAULT_TABLE = """data: 10,240 rows; kill shard:0@12
                                             none checkpoint/100     parity R=1     parity R=2   R=1 copy all
-------------------------------------------------------------------------------------------------------------
ms/iteration (failure-free)                 145.5          100.1           76.3           74.3           76.3
time to recover (s)                           n/a          0.939          0.117          0.207          0.530
recovery speed-up vs checkpoint/100           n/a           1.0x           8.0x           4.5x           1.8x
throughput during recovery                    n/a             0%             0%            69%             0%
  counting partial iterations                 n/a             0%           194%            88%            27%
verify (parity == encode(data))               n/a            n/a           True           True           True
final state == failure-free                   n/a           True           True          False           True
"""


def test_parsers_read_the_benchmarks_printed_formats(gpu_check):
    """Parser test: the layouts of fault_tolerance.py's table, pytest's summary, trainers.py --json and
    erasure.py's table, as they print them (values from CPU runs or made up: not GPU figures)."""
    modes, rows = gpu_check.parse_fault_table(FAULT_TABLE)
    assert modes == ["none", "checkpoint/100", "parity R=1", "parity R=2", "R=1 copy all"]
    assert rows["time to recover (s)"]["parity R=2"] == "0.207"
    assert rows["  counting partial iterations"]["parity R=1"] == "194%"
    status, note, _ = gpu_check.parse_recovery(gpu_check.Outcome(0, False, 1.0, FAULT_TABLE, ""))
    assert status == "FAILED" and note.endswith(": parity R=2")
    ok = gpu_check.parse_recovery(gpu_check.Outcome(0, False, 1.0, FAULT_TABLE.replace("False", " True"), ""))
    assert ok[0] == "ok"
    skipped = gpu_check.parse_pytest(gpu_check.Outcome(5, False, 1.0, "\n2 skipped in 14.43s\n", ""))
    assert skipped[0] == "FAILED" and skipped[2]["counts"] == {"skipped": 2}
    run = {"trainers": 2, "device": "cuda", "mode": "remote", "config": "a", "iterations": 20, "batch_size": 4096,
           "samples_per_s": 1e5, "pooled_median_ms": 40.9, "pooled_stall_fraction": 0.1, "state_sha256": "ab" * 32,
           "per_trainer": [{"device": "cuda:0"}, {"device": "cuda:0"}]}
    printed = json.dumps({"runs": [run, {**run, "mode": "oracle"}], "mismatches": []}, indent=2)
    status, _, data = gpu_check.parse_trainers(gpu_check.Outcome(0, False, 1.0, printed, ""))
    assert status == "ok" and data["runs"][1]["trainer_devices"] == ["cuda:0", "cuda:0"]
    mismatch = json.dumps({"runs": [run], "mismatches": ["MISMATCH [a] W=2 oracle ..."]}, indent=2)
    assert gpu_check.parse_trainers(gpu_check.Outcome(1, False, 1.0, mismatch, ""))[0] == "FAILED"
    rows = gpu_check.parse_parity(gpu_check.Outcome(0, False, 1.0, ERASURE_OUTPUT, ""))[2]["rows"]
    assert [(r["xp"], r["op"], r["GB/s"]) for r in rows][2:] == [("cupy", "encode", 203.72), ("cupy", "decode 1", 51.3)]


def _result(gpu_check, name: str, status: str, **kw):
    budget = gpu_check.BUDGETS[name]
    return gpu_check.StepResult(name, name, budget, status=status, wall_s=kw.pop("wall_s", budget / 2),
                                command=f"python {name}", **kw)


def test_renderer_writes_every_step_with_the_cards_name(gpu_check):
    """Renderer test: fabricated step results (nothing here ran on a GPU; the numbers are made up) rendered into
    the report: the card's name, each step's status and wall time against its budget, the figures beside their
    baselines, and the output of the failed and the timed-out step."""
    runs = [{"trainers": w, "device": dev, "mode": mode, "config": "a", "iterations": 20, "batch_size": 4096,
             "samples_per_s": sps, "median_ms": 4096e3 / sps, "stall": 0.01, "state_sha256": sha * 32,
             "trainer_devices": [f"{dev}:0"] * w if w > 1 else []}
            for w, dev, mode, sps, sha in ((1, "cuda", "remote", 40000.0, "aa"), (1, "cuda", "oracle", 80000.0, "aa"),
                                           (2, "cuda", "remote", 50000.0, "bb"), (2, "cuda", "oracle", 120000.0, "bb"))]
    info = {"devices": [{"name": "NVIDIA H200", "memory_gib": 139.8}], "driver": "580.159.04", "torch": "2.11.0+cu130",
            "torch_cuda": "13.0", "cupy": "14.2.0", "cupy_runtime": "13.0", "cuda_driver_api": "13.0", "cpus": 16}
    modes, rows = gpu_check.parse_fault_table(FAULT_TABLE)
    results = [
        _result(gpu_check, "device", "ok", data=info),
        _result(gpu_check, "cuda-tests", "ok", data={"counts": {"passed": 35}, "failed": []}),
        _result(gpu_check, "trainers-cuda", "ok", data={"runs": runs, "mismatches": []}),
        _result(gpu_check, "trainers-cpu", "TIMED OUT", wall_s=60.2, note="stopped at its budget of 50 s",
                tail="[a] unshaped W=1 remote  median 300.0 ms"),
        _result(gpu_check, "recovery", "FAILED", note="exit status 1", tail="Traceback ...\nRuntimeError: boom",
                data={"modes": modes, "rows": rows}),
        _result(gpu_check, "parity-cupy", "ok", data={"rows": gpu_check.parse_parity(
            gpu_check.Outcome(0, False, 1.0, ERASURE_OUTPUT, ""))[2]["rows"], "shards": "shards: 1048576 rows"}),
        _result(gpu_check, "torchrec", "skipped", note="TorchRec does not import with python: No module named "
                "'torchrec'"),
    ]
    report = gpu_check.render_report(info, "make gpu-check", results, "2026-12-01 10:00 UTC", 401.0)
    assert report.startswith("# GPU check\n")
    assert "NVIDIA H200 (139.8 GiB)" in report and "driver 580.159.04" in report and "CuPy 14.2.0" in report
    assert "```\nmake gpu-check\n```" in report and "401 s in all (limit 480 s): 5 of 7 steps" in report
    assert "| trainers-cpu | trainers-cpu | **TIMED OUT** | 60.2 | 50 | stopped at its budget of 50 s |" in report
    assert "| recovery | recovery | **FAILED** | 55.0 | 110 | exit status 1 |" in report
    assert "| 2 | cuda (cuda:0, cuda:0) | oracle | 120,000 | 34.1 | 1.0% | `bbbbbbbbbbbbbbbb` | yes |" in report
    assert "- W=2 on cuda: oracle against remote: bit-exact" in report
    assert "- oracle, samples/s: W=2 cuda 120,000 / W=1 cuda 80,000 = 1.50x; W=1 cuda / W=1 CPU n/a = n/a" in report
    assert "| time to recover (s) | n/a | 0.939 | 0.117 | 0.207 | 0.530 |" in report
    assert "| 4, 1 | encode | 7.69 | 203.72 | 26.49x | 7.36 |" in report
    assert "Skipped: TorchRec does not import with python: No module named 'torchrec'" in report
    assert "### trainers-cpu: TIMED OUT\n\n```\n[a] unshaped W=1 remote  median 300.0 ms\n```" in report
    assert "### recovery: FAILED\n\n```\nTraceback ...\nRuntimeError: boom\n```" in report
