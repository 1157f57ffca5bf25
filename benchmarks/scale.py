"""The whole pipeline at real cardinalities (generator scale 1.0), for several row counts, each stage run
through the CLI as a user runs it; its time, rows/s and peak memory, and a linear extrapolation to
Criteo Kaggle's 45,840,617 rows. Or, with ``--scales``, one row count at several cardinality scales:
what each stage's largest process holds per embedding row of the table.

    .venv/bin/python benchmarks/scale.py [--rows 1000000 4000000 16000000] [--iterations 100]
        [--batch-size 4096] [--shards 2] [--parity 1] [--trainers 1] [--repeats 1] [--work-dir DIR] [--keep]
    .venv/bin/python benchmarks/scale.py --rows 1000000 --scales 0.001 1.0 [--trainers 1] [--repeats 1] ...

Stages, for each row count N: ``dlrmflow generate --rows N --scale 1.0``, ``preprocess``, ``profile``,
``plan``, ``train --mode oracle`` for a fixed number of iterations (``--iterations`` x
``--batch-size`` rows trained, then the final evaluation of the held-out tenth and the final state
written by the servers), and ``verify`` (the parity re-encoded from that state, with ``--parity``).
Each is a fresh process (``dlrmflow ... --json``) with its own LocalCluster and temporary Prefect
API, so every stage pays the start-up a user pays.

Measured per stage: wall time (launch to exit), rows/s (N / wall time; for train the rows trained
are fixed, so its rows/s is N over its wall time too, to compare stages), and the peak memory of all
processes the command started (the CLI, its Dask nanny and worker processes, its Prefect API
server): RssAnon summed over them, sampled every 50 ms, and the largest single process's RssAnon
(what one Dask worker needs). RssAnon leaves out the page cache and mapped files, which the kernel
can drop. Each stage's stderr (its progress lines) goes to WORK_DIR/logs/.

The extrapolation is a least-squares line through the measured (rows, value) points of each stage
(with two row counts, the line through them): it assumes cost linear in rows, which holds for
the streaming stages and overstates nothing that grows slower; a stage whose memory does not grow
with rows shows a flat line.

``--scales S1 S2 ...`` runs the pipeline at one row count (``--rows N``, default 1,000,000) once per
generator scale: the same rows, batches and held-out rows (the rows' count, the plan's iterations and
the tenth held out do not depend on the scale), only the embedding tables differ (at 1M rows, scale 0.001
shows 133,121 embedding rows, scale 1.0 996,385). Per stage it prints the largest process's peak at
each scale and which process it was, the embedding rows at each scale (preprocess's count), and the
bytes per added embedding row: the least-squares slope of the peak over the embedding rows (with two
scales, the difference of the peaks over the difference of the embedding rows), for the largest process
and for all processes summed; then the same for the largest process of each kind (the command, a Dask
worker, the Prefect server), since the largest process can be of another kind at another scale. What a
stage holds per embedding row of the table is that slope; what it holds per row or batch cancels out.

``--repeats K`` runs each point (row count, or scale) K times and keeps, per stage, the least of the K
peaks (each peak separately: the largest process's, the sum's and each kind's; the time and the process
named are those of the run with the least largest-process peak). One run's peak can move by tens of MiB
(up to ~150 MiB), which over the 863,264 embedding rows added between scales 0.001 and 1.0 at 1M rows is
tens of bytes a row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

KAGGLE_ROWS = 45_840_617
STAGES = ("generate", "preprocess", "profile", "plan", "train", "verify")


@dataclass
class Measured:
    """One stage of one row count."""

    stage: str
    rows: int
    seconds: float
    peak_anon_bytes: int  # RssAnon summed over every process of the command, at its peak
    peak_process_bytes: int  # the largest RssAnon of one process (a Dask worker's need)
    processes: int  # the most processes seen at once
    result: dict = field(default_factory=dict)  # the command's --json object
    output_bytes: int | None = None  # what the stage wrote to disk (its output file or directory; None: not measured)
    load: float | None = None  # the 1-minute load average when the stage ended (other work on the machine)
    largest: str | None = None  # which process was the largest: the command itself, a Dask worker, ...
    scale: float | None = None  # the generator's cardinality scale (None: not recorded)
    peaks: list[int] | None = None  # with --repeats K > 1: each run's largest-process peak (the least is kept)
    role_peaks: dict[str, int] | None = None  # the largest RssAnon of one process of each kind (see _role)
    cpu_seconds: float | None = None  # user + system CPU of every process of the command (None: not measured)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # the process ended between the listing and the read
        pass
    return 0


class TreeMemory:
    """Samples the summed and the largest RssAnon of a process and all its descendants until stopped, and
    their CPU seconds: each process's last sample, summed (a process's last interval before it ended is
    missed: at most ``interval`` of CPU per process)."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval = pid, interval
        self.peak_sum = self.peak_one = self.processes = 0
        self.largest = ""  # the role of the process of peak_one
        self.role_peaks: dict[str, int] = {}  # the largest RssAnon of one process of each role
        self._roles: dict[int, str] = {}
        self._cpu: dict[int, float] = {}  # pid -> its user + system CPU seconds at the last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            try:
                pids = [self.pid] + [c.pid for c in root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            sizes = [_rss_anon(pid) for pid in pids]
            for pid in pids:
                try:
                    times = psutil.Process(pid).cpu_times()
                    self._cpu[pid] = times.user + times.system
                except psutil.Error:
                    pass
            self.peak_sum = max(self.peak_sum, sum(sizes))
            for pid, size in zip(pids, sizes, strict=True):
                role = self._roles.get(pid)
                if role in (None, "other", "?"):  # new, or maybe not yet exec'd: a fork shows its parent's line
                    role = self._roles[pid] = _role(pid, self.pid)
                self.role_peaks[role] = max(self.role_peaks.get(role, 0), size)
            if max(sizes) > self.peak_one:
                self.peak_one = max(sizes)
                self.largest = _role(pids[sizes.index(self.peak_one)], self.pid)
            self.processes = max(self.processes, len(pids))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu.values())


def _role(pid: int, command_pid: int) -> str:
    """What a process of the command is: the command itself (the CLI: driver, trainer 0 with one trainer), a
    Dask worker, nanny or the forkserver the workers fork from (all started through multiprocessing), or
    another (the Prefect API server)."""
    import psutil

    if pid == command_pid:
        return "command"
    try:
        line = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return "?"
    if "multiprocessing" in line:
        return "dask worker"
    return "prefect server" if "prefect" in line or "exit_with_parent" in line else "other"


def dlrmflow_command() -> list[str]:
    """The ``dlrmflow`` script of this interpreter's environment (what a user runs), else ``-m``."""
    script = Path(sys.executable).with_name("dlrmflow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dlrmflow.cli"]


def disk_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (0 if absent)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def run_stage(stage: str, argv: list[str], rows: int, log: Path) -> Measured:
    """``dlrmflow STAGE ARGV --json`` in a fresh process: its wall time, peak memory and JSON object."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*dlrmflow_command(), stage, *argv, "--json"], stdout=subprocess.PIPE,
                                stderr=err, text=True)
        memory = TreeMemory(proc.pid)
        out, _ = proc.communicate()
        seconds = time.perf_counter() - t0
        memory.stop()
    if proc.returncode != 0:
        raise SystemExit(f"dlrmflow {stage} failed (exit {proc.returncode}); its stderr: {log}")
    lines = out.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {}
    return Measured(stage, rows, seconds, memory.peak_sum, memory.peak_one, memory.processes, result,
                    load=os.getloadavg()[0], largest=memory.largest, role_peaks=dict(memory.role_peaks),
                    cpu_seconds=memory.cpu_seconds)


def pipeline(rows: int, work: Path, args: argparse.Namespace, scale: float | None = None,
             repeat: int | None = None) -> list[Measured]:
    """Every stage for ``rows`` rows at generator scale ``scale`` (default ``args.scale``), in order, each on
    the previous one's output; ``repeat``: which of the ``--repeats`` runs (it names the logs)."""
    scale = args.scale if scale is None else scale
    point = f"{rows}" if not args.scales else f"{rows}-scale{scale:g}"
    label = f"{rows:,} rows" if not args.scales else f"{rows:,} rows, scale {scale:g}"
    if repeat is not None and args.repeats > 1:
        label += f", run {repeat + 1}/{args.repeats}"
    log_name = point if repeat is None or args.repeats == 1 else f"{point}-run{repeat + 1}"
    raw, ds, plan, run = (work / f"criteo-{point}.tsv", work / f"ds-{point}", work / f"plan-{point}",
                          work / f"run-{point}")
    for path in (ds, plan, run):
        shutil.rmtree(path, ignore_errors=True)
    raw.unlink(missing_ok=True)
    argvs = {
        "generate": ["--rows", str(rows), "--scale", str(scale), "--output", str(raw)],
        "preprocess": [str(raw), "--output", str(ds)],
        "profile": [str(ds)],
        "plan": [str(ds), "--batch-size", str(args.batch_size), "--lookahead", str(args.lookahead),
                 *(["--capacity", str(args.capacity)] if args.capacity else []), "--output", str(plan)],
        "train": [str(ds), "--mode", "oracle", "--plan", str(plan), "--output", str(run),
                  "--batch-size", str(args.batch_size), "--iterations", str(args.iterations),
                  "--shards", str(args.shards), "--parity", str(args.parity), "--trainers", str(args.trainers)],
        "verify": [str(run)],
    }
    outputs = {"generate": raw, "preprocess": ds, "plan": plan, "train": run}
    stages = [s for s in STAGES if s != "verify" or args.parity > 0]
    measured = []
    for stage in stages:
        print(f"{label}: dlrmflow {stage} ...", file=sys.stderr, flush=True)
        m = run_stage(stage, argvs[stage], rows, work / "logs" / f"{log_name}-{stage}.log")
        m.output_bytes = disk_bytes(outputs[stage]) if stage in outputs else None
        m.scale = scale
        print(f"{label}: dlrmflow {stage}: {m.seconds:.1f} s, peak {m.peak_anon_bytes / 2**20:,.0f} MiB "
              f"(largest process {m.peak_process_bytes / 2**20:,.0f} MiB: {m.largest})", file=sys.stderr, flush=True)
        measured.append(m)
    if not args.keep:
        for path in (ds, plan, run):
            shutil.rmtree(path, ignore_errors=True)
        raw.unlink(missing_ok=True)
    return measured


def least_peaks(runs: list[list[Measured]]) -> list[Measured]:
    """Per stage, the least peaks of several runs of one point: the run with the least largest-process peak,
    with the least summed peak of all runs and every run's largest-process peak (``peaks``)."""
    if len(runs) == 1:
        return runs[0]
    kept = []
    for same in zip(*runs, strict=True):
        best = min(same, key=lambda m: m.peak_process_bytes)
        best.peaks = [m.peak_process_bytes for m in same]
        best.peak_anon_bytes = min(m.peak_anon_bytes for m in same)
        if all(m.role_peaks for m in same):
            roles = set().union(*(m.role_peaks for m in same))
            best.role_peaks = {role: min(m.role_peaks[role] for m in same if role in m.role_peaks) for role in roles}
        kept.append(best)
    return kept


def measure(rows: int, work: Path, args: argparse.Namespace, scale: float | None = None) -> list[Measured]:
    """The pipeline ``args.repeats`` times at one point, each stage's least peaks."""
    return least_peaks([pipeline(rows, work, args, scale, k) for k in range(args.repeats)])


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of at least two points."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def embedding_rows(measured: list[Measured]) -> int | None:
    return next((m.result.get("embedding_rows") for m in measured if m.stage == "preprocess"), None)


def table(results: dict[int, list[Measured]], target: int = KAGGLE_ROWS) -> str:
    """The measured stages side by side, then the linear extrapolation to ``target`` rows."""
    mib = 2**20
    out = ["| rows | embedding rows | stage | wall s | CPU s | rows/s | peak anon MiB (all processes) "
           "| largest process MiB | output MB | load |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for rows, measured in sorted(results.items()):
        emb = embedding_rows(measured)
        for m in measured:
            cpu = "-" if m.cpu_seconds is None else format(m.cpu_seconds, ".1f")
            out.append(f"| {rows:,} | {emb if emb is None else format(emb, ',')} | {m.stage} | {m.seconds:.1f} "
                       f"| {cpu} | {m.rows_per_second:,.0f} | {m.peak_anon_bytes / mib:,.0f} | "
                       f"{m.peak_process_bytes / mib:,.0f} | "
                       f"{'-' if m.output_bytes is None else format(m.output_bytes / 1e6, ',.0f')} | "
                       f"{'-' if m.load is None else format(m.load, '.1f')} |")
        total = sum(m.seconds for m in measured)
        out.append(f"| {rows:,} | | **all stages** | {total:.1f} | | {rows / total:,.0f} | | | | |")
    sizes = sorted(results)
    if len(sizes) < 2:  # a line through one point would be a guess at the fixed costs
        return "\n".join([*out, "", "(no extrapolation: it needs at least two row counts)"])
    out += ["", f"Extrapolated to {target:,} rows (least-squares line through the {len(sizes)} measured row "
            f"counts {', '.join(f'{n:,}' for n in sizes)}; linear in rows by assumption):", "",
            "| stage | s per 1M rows (slope) | fixed s (intercept) | wall s | peak anon MiB | largest process MiB |",
            "|---|---:|---:|---:|---:|---:|"]
    stages = [m.stage for m in results[sizes[0]]]
    total = 0.0
    for i, stage in enumerate(stages):
        xs = [float(n) for n in sizes]
        a, b = linear_fit(xs, [results[n][i].seconds for n in sizes])
        ma, mb = linear_fit(xs, [results[n][i].peak_anon_bytes for n in sizes])
        pa, pb = linear_fit(xs, [results[n][i].peak_process_bytes for n in sizes])
        wall = a + b * target
        total += wall
        out.append(f"| {stage} | {b * 1e6:.2f} | {a:.1f} | {wall:,.0f} | {(ma + mb * target) / mib:,.0f} | "
                   f"{(pa + pb * target) / mib:,.0f} |")
    out.append(f"| **all stages** | | | {total:,.0f} | | |")
    return "\n".join(out)


def scales_table(results: dict[float, list[Measured]]) -> str:
    """One row count at several scales, per stage side by side: the largest process's peak at each scale and
    which process it was, the embedding rows at each scale, and the bytes per added embedding row."""
    mib = 2**20
    scales = sorted(results)
    emb = {s: embedding_rows(results[s]) for s in scales}
    head = ["stage"]
    for s in scales:
        head += [f"largest process MiB at {s:g}", f"process at {s:g}"]
    head += [f"embedding rows at {s:g}" for s in scales]
    head += ["bytes per added embedding row (largest process)", "bytes per added embedding row (all processes)"]
    head += [f"wall s at {s:g}" for s in scales]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|---|" * len(scales) + "---:|" * (len(scales) + 2)
           + "---:|" * len(scales)]
    by_stage = {s: {m.stage: m for m in results[s]} for s in scales}
    fit = len(scales) >= 2 and all(emb[s] is not None for s in scales) and len(set(emb.values())) > 1
    for stage in [m.stage for m in results[scales[0]]]:
        points = [by_stage[s].get(stage) for s in scales]
        if any(m is None for m in points):
            continue
        cells = [stage]
        for m in points:
            spread = ""
            if m.peaks and len(m.peaks) > 1:
                spread = f" (of {', '.join(format(p / mib, ',.0f') for p in m.peaks)})"
            cells += [f"{m.peak_process_bytes / mib:,.0f}{spread}", m.largest or "?"]
        cells += ["?" if emb[s] is None else f"{emb[s]:,}" for s in scales]
        if fit:
            xs = [float(emb[s]) for s in scales]
            cells += [f"{linear_fit(xs, [float(m.peak_process_bytes) for m in points])[1]:,.1f}",
                      f"{linear_fit(xs, [float(m.peak_anon_bytes) for m in points])[1]:,.1f}"]
        else:
            cells += ["-", "-"]
        cells += [f"{m.seconds:.1f}" for m in points]
        out.append("| " + " | ".join(cells) + " |")
    rows = {m.rows for s in scales for m in results[s]}
    out += ["", f"{', '.join(f'{n:,}' for n in sorted(rows))} rows; bytes per added embedding row: "
            + ("the least-squares slope of the peak over the embedding rows (two scales: the difference of the "
               "peaks over the difference of the embedding rows)" if fit else
               "none (it needs two scales with different embedding rows)")]
    caches = [(sc, by_stage[sc].get("train")) for sc in scales]
    if all(m is not None and m.result.get("capacity") for _, m in caches):
        out += ["", "train's cache rows (the plan's slots, what one trainer holds at most, O(cache)): "
                + ", ".join(f"{m.result['capacity']:,} at {sc:g}" for sc, m in caches)
                + (" (the cache grows with the scale: its rows count in the bytes per added embedding row)"
                   if len({m.result['capacity'] for _, m in caches}) > 1 else "")]
    trainers = [(sc, (m.result.get("trainers") or {}).get("per_trainer")) for sc, m in caches if m is not None]
    if len(trainers) == len(scales) and all(t and all("peak_rss_bytes" in r for r in t) for _, t in trainers):
        peaks = [max(r["peak_rss_bytes"] for r in t) for _, t in trainers]
        slope = f"{linear_fit([float(emb[sc]) for sc in scales], [float(v) for v in peaks])[1]:,.1f}" if fit else "-"
        out += ["", "train's largest trainer, by its own peak resident memory (ru_maxrss of its Dask worker, which "
                "runs nothing else; the Dask workers above include the servers, which hold the table): "
                + ", ".join(f"{v / mib:,.0f} MiB at {sc:g}" for v, sc in zip(peaks, scales, strict=True))
                + f"; {slope} bytes per added embedding row"]
    # The largest process of each kind, so that a stage whose largest process changes kind between scales
    # still shows what each kind grows by.
    kinds = ["| stage | process | " + " | ".join(f"MiB at {s:g}" for s in scales)
             + " | bytes per added embedding row |", "|---|---|" + "---:|" * (len(scales) + 1)]
    for stage in [m.stage for m in results[scales[0]]]:
        points = [by_stage[s].get(stage) for s in scales]
        if any(m is None or not m.role_peaks for m in points):
            continue
        for role in sorted(set().union(*(m.role_peaks for m in points))):
            peaks = [m.role_peaks.get(role) for m in points]
            if max(p or 0 for p in peaks) < mib:  # a short-lived helper process (under 1 MiB)
                continue
            cells = [stage, role, *("-" if p is None else format(p / mib, ",.0f") for p in peaks)]
            if fit and all(p is not None for p in peaks):
                cells.append(format(linear_fit([float(emb[s]) for s in scales], [float(p) for p in peaks])[1],
                                    ",.1f"))
            else:
                cells.append("-")
            kinds.append("| " + " | ".join(cells) + " |")
    if len(kinds) > 2:
        out += ["", "The largest process of each kind:", "", *kinds]
    return "\n".join(out)


def read_results(paths: list[str]) -> tuple[dict[int, list[Measured]], dict[float, list[Measured]]]:
    """Earlier runs' --json files: row-count runs ({rows: [...]}) and scale runs ({"scales": {scale: [...]}})."""
    by_rows: dict[int, list[Measured]] = {}
    by_scale: dict[float, list[Measured]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "scales" in data:
            for scale, measured in data["scales"].items():
                by_scale[float(scale)] = [Measured(**m) for m in measured]
        else:
            for rows, measured in data.items():
                by_rows[int(rows)] = [Measured(**m) for m in measured]
    return by_rows, by_scale


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+",
                    help="row counts (default 1000000 4000000 16000000; with --scales one, default 1000000)")
    scale = ap.add_mutually_exclusive_group()
    scale.add_argument("--scale", type=float, default=1.0, help="generator cardinality scale (default 1.0)")
    scale.add_argument("--scales", type=float, nargs="+", metavar="S",
                       help="run one row count at each of these generator scales and print the bytes per added "
                            "embedding row of each stage")
    ap.add_argument("--iterations", type=int, default=100, help="training iterations (default 100)")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lookahead", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=None, metavar="ROWS",
                    help="the plan's cache rows (default: unbounded). With --scales, a bound the plans reach at "
                         "every scale keeps the trainer's cache the same size, so that the bytes per added "
                         "embedding row are the table's alone: unbounded, the cache grows with the distinct ids "
                         "of the lookahead window, which grow with the scale")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--trainers", type=int, default=1, help="data-parallel trainers of the train stage (default 1)")
    ap.add_argument("--parity", type=int, default=1, help="parity shards (0: no verify stage; default 1)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per point; each stage's least peak of them is kept (default 1)")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dlrmflow-scale"))
    ap.add_argument("--keep", action="store_true", help="keep each row count's files (default: delete them)")
    ap.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    ap.add_argument("--table", metavar="FILE", nargs="+",
                    help="measure nothing: print the table of earlier runs' --json files together")
    args = ap.parse_args(argv)
    if args.table:
        by_rows, by_scale = read_results(args.table)
        print("\n\n".join(([table(by_rows)] if by_rows else []) + ([scales_table(by_scale)] if by_scale else [])))
        return
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.scales:
        args.rows = args.rows or [1_000_000]
        if len(args.rows) != 1:
            ap.error("--scales runs one row count: give --rows N")
        if len(set(args.scales)) != len(args.scales):
            ap.error("--scales: each scale once")
    args.rows = args.rows or [1_000_000, 4_000_000, 16_000_000]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    spec = importlib.util.find_spec("dlrmflow")
    scales = ", ".join(f"{s:g}" for s in args.scales) if args.scales else f"{args.scale:g}"
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the start; "
          f"scale {scales}; train: oracle, {args.iterations} iterations of batch {args.batch_size}, "
          f"{args.shards} shards, parity {args.parity}, {args.trainers} trainer(s); {args.repeats} run(s) per "
          f"point; {' '.join(dlrmflow_command())} (dlrmflow from {spec.origin if spec else '?'})", flush=True)
    if args.scales:
        by_scale = {scale: measure(args.rows[0], work, args, scale) for scale in args.scales}
        load = os.getloadavg()
        print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end\n")
        if args.json:  # first: the measurements outlive a failure of the table
            Path(args.json).write_text(json.dumps(
                {"scales": {str(s): [vars(m) for m in measured] for s, measured in by_scale.items()}}, indent=1))
        print(scales_table(by_scale))
        return
    results = {rows: measure(rows, work, args) for rows in sorted(args.rows)}
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {str(rows): [vars(m) for m in measured] for rows, measured in results.items()}, indent=1))


if __name__ == "__main__":
    main()
