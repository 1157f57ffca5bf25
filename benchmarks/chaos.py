"""A chaos run on emulated hosts (issue 43, item 5): one long training run, many faults, the same bits.

    .venv/bin/python benchmarks/chaos.py [--iterations 1000] [--server-faults 11] [--seed 0] [--work DIR]

Root only (network namespaces: tests/hosts.py). Ten hosts on one bridge, each started with docs/terabyte.md's
command lines: a scheduler, six embedding-server hosts (K = 2 data shards + R = 2 parity shards + 2 spares)
and three trainer hosts (W = 2 trainers + a spare). A generated dataset, preprocessed and planned on the
hosts, trains ``--mode oracle --trainers 2 --shards 2 --parity 2 --checkpoint-every 100`` for ITERATIONS
iterations of 256 rows:

1. fault-free on dlrmflow's own LocalCluster (the oracle of bits), and fault-free on the hosts (the time
   baseline);
2. the chaos run on the hosts: at a random iteration after the first checkpoint a trainer host fails
   (link down, every process SIGKILLed): the run stops with one line naming ``dlrmflow resume``; the resume
   runs on the other trainer hosts, and during it, at random iterations and on random members (data or
   parity shards), SERVER_FAULTS faults, alternately a server process SIGKILLed (its nanny starts a fresh
   worker, which rejoins as a spare) and a whole server host failing (repaired once its member is rebuilt:
   its link up and its worker started again, a spare again). One fault of the run takes two members at
   once (R = 2); otherwise a fault waits for the previous one's rebuild (never more than R lost at once).
   A rebuilt member can be hit again.

It prints every fault (iteration, kind, member, host), when its loss was detected and how long the rebuild
took (from the resumed run's summary), the training time with faults against the fault-free run on the
same hosts, and whether the final state's SHA-256 equals the LocalCluster run's (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hosts import (  # noqa: E402 - tests/hosts.py, the emulated hosts of the test suite
    HostsUnavailableError,
    WatchedRun,
    dask_on_hosts,
    emulated_hosts,
    host_of,
    missing,
    placed_on_stderr,
    start_worker,
)

from dlrmflow.cli import main as dlrmflow  # noqa: E402

SERVERS = [f"server{i}" for i in range(6)]  # K = 2 + R = 2 members, 2 spares
TRAINERS = ["trainer0", "trainer1", "trainer2"]  # W = 2, a spare for the resume
WORKERS = {**{name: "embedding_server=1" for name in SERVERS}, **{name: "trainer=1" for name in TRAINERS}}
BATCH = 256
CHECKPOINT_EVERY = 100
PARITY = 2
RUN_TIMEOUT_S = 3600
REBUILT_TIMEOUT_S = 240  # a fault's rebuild: detection (Dask's 30 s TCP timeout for a host) + the rebuild


@dataclass
class Fault:
    iteration: int
    kind: str  # "process" | "host" | "trainer host"
    members: list[str]
    hosts: list[str]
    at: float = 0.0  # time.monotonic() of the fault
    notes: dict = field(default_factory=dict)

    def where(self) -> str:
        return ", ".join(f"{m} ({h})" for m, h in zip(self.members, self.hosts, strict=True))


def cli_json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = dlrmflow([*argv, "--json"])
    if code != 0:
        raise SystemExit(f"dlrmflow {' '.join(argv)} exited {code}")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "DLRMFLOW_DASK_ADDRESS")}


def member_workers(cluster) -> dict[str, str]:
    """Member name -> the worker address holding it now (a CodedShard / ParityShard actor), from the workers."""
    def held(dask_worker) -> list[str]:
        names = {"CodedShard": lambda a: f"data shard {a.shard}", "ParityShard": lambda a: f"parity shard {a.p}"}
        return [names[type(a).__name__](a) for a in dask_worker.state.actors.values() if type(a).__name__ in names]

    on: dict[str, list[str]] = {}
    for worker, names in cluster.client.run(held).items():
        for name in names:
            on.setdefault(name, []).append(worker)
    # A member's worker holds that member alone; a spare holds standbys of every member.
    counts = {w: sum(w in ws for ws in on.values()) for ws in on.values() for w in ws}
    return {name: next(w for w in ws if counts[w] == 1) for name, ws in on.items()
            if any(counts[w] == 1 for w in ws)}


def kill_worker_process(cluster, address: str) -> int:
    """SIGKILL the worker process at ``address`` (its nanny starts a fresh one)."""
    pid = cluster.client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_rebuilt(run: WatchedRun, fault_at: float, timeout_s: float) -> bool:
    """Until the run's log has said ``rebuilt ...`` after the fault, later than its last ``lost ...: rebuilding``
    line (one recovery may answer several losses: two members lost at once are two lines, one rebuild)."""
    def settled(r: WatchedRun) -> bool:
        last_lost = max((at for at, line in r.lines if ": rebuilding from parity" in line), default=0.0)
        rebuilt = [at for at, line in r.lines if line.split(" - ", 1)[-1].startswith("rebuilt ") and at > fault_at]
        return bool(rebuilt) and max(rebuilt) > last_lost

    return run.wait_for(settled, timeout_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--server-faults", type=int, default=11, help="server faults during the resumed run")
    ap.add_argument("--seed", type=int, default=0, help="the faults' random times and places")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dlrmflow-chaos")
    args = ap.parse_args()
    if missing() is not None:
        print(f"no emulated hosts here: {missing()}")
        return 2
    rng = random.Random(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="run-", dir=args.work))
    rows = int(args.iterations * BATCH / 0.9) + 4 * BATCH
    try:
        with emulated_hosts(["scheduler", *SERVERS, *TRAINERS], home / "logs") as network, \
                dask_on_hosts(network, home, "scheduler", WORKERS) as cluster:
            return chaos(args, rng, network, cluster, home, rows)
    except HostsUnavailableError as exc:
        print(f"no emulated hosts here: {exc}")
        return 2


def chaos(args, rng: random.Random, network, cluster, home: Path, rows: int) -> int:
    on_hosts = ["--dask-address", cluster.address]
    by_address = {network[name].address: network[name] for name in [*SERVERS, *TRAINERS]}
    raw, dataset, plan = home / "x.tsv", home / "ds", home / "plan"
    print(f"{rows:,} rows; {args.iterations} iterations of {BATCH}; 10 hosts; seed {args.seed}", flush=True)
    cli_json(["generate", "--rows", str(rows), "--scale", "0.01", "--seed", "1", "--output", str(raw), *on_hosts])
    cli_json(["preprocess", str(raw), "--output", str(dataset), *on_hosts])
    cli_json(["plan", str(dataset), "--batch-size", str(BATCH), "--output", str(plan), *on_hosts])
    train = ["train", str(dataset), "--mode", "oracle", "--plan", str(plan), "--trainers", "2", "--shards", "2",
             "--parity", str(PARITY), "--iterations", str(args.iterations), "--batch-size", str(BATCH),
             "--seed", "3", "--metrics-every", "10", "--checkpoint-every", str(CHECKPOINT_EVERY)]

    started = time.monotonic()
    local = cli_json([*train, "--output", str(home / "local")])
    print(f"fault-free, LocalCluster: {time.monotonic() - started:.0f} s, state {local['state_sha256'][:16]}",
          flush=True)
    started = time.monotonic()
    baseline = cli_json([*train, "--output", str(home / "baseline"), *on_hosts])
    print(f"fault-free, on the hosts: {time.monotonic() - started:.0f} s, training {baseline['train_seconds']:.1f} s, "
          f"state {baseline['state_sha256'][:16]}", flush=True)

    faults: list[Fault] = []
    run_dir = home / "chaos"
    # 1. A trainer host fails after the first checkpoint; the run stops, and is resumed on the other hosts.
    first = WatchedRun([*train, "--output", str(run_dir), *on_hosts], environment(), home / "chaos-1.log")
    try:
        when = rng.randint(CHECKPOINT_EVERY + 10, min(args.iterations - 1, 2 * CHECKPOINT_EVERY))
        if not first.wait_for(lambda r: r.done >= when, RUN_TIMEOUT_S):
            raise SystemExit(f"the run did not reach iteration {when}:\n{first.stderr_tail()}")
        trainers = placed_on_stderr(first, "trainers") or {}
        victim = by_address[trainers[f"trainer {rng.randint(0, 1)}"]]
        fault = Fault(first.done, "trainer host", [name for name, a in trainers.items() if a == victim.address],
                      [victim.name])
        fault.at = victim.fail()
        code = first.finish(RUN_TIMEOUT_S)
        stopped = next((at for at, line in first.lines if "error:" in line), time.monotonic())
        fault.notes = {"exit": code, "stopped_s": stopped - fault.at,
                       "line": next((line for _, line in first.lines if "error:" in line), "")}
        faults.append(fault)
    finally:
        first.stop()
    print(f"fault 1: {fault.members[0]}'s host {victim.name} failed at iteration {fault.iteration}: exit "
          f"{fault.notes['exit']} {fault.notes['stopped_s']:.1f} s later: {fault.notes['line']}", flush=True)
    if fault.notes["exit"] != 2 or "dlrmflow resume" not in fault.notes["line"]:
        return 1

    # 2. The resume, with server faults at random iterations after its start.
    resumed_from = (fault.iteration // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    span = range(resumed_from + 5, args.iterations - 5)
    at_iterations = sorted(rng.sample(span, args.server_faults))
    double = rng.randrange(args.server_faults)  # this one takes two members at once
    resume = WatchedRun(["resume", str(run_dir), *on_hosts], environment(), home / "chaos-2.log")
    repaired = 0
    try:
        for n, iteration in enumerate(at_iterations):
            if not resume.wait_for(lambda r, i=iteration: r.done >= i, RUN_TIMEOUT_S):
                print(f"the resumed run ended before iteration {iteration}")
                break
            members = member_workers(cluster)
            names = rng.sample(sorted(members), 2 if n == double else 1)
            kind = "process" if n % 2 == 0 else "host"
            fault = Fault(resume.done, kind, names, [by_address[host_of(members[m])].name for m in names])
            if kind == "process":
                fault.at = time.monotonic()
                for m in names:
                    kill_worker_process(cluster, members[m])
            else:
                downs = [by_address[host_of(members[m])].fail() for m in names]
                fault.at = min(downs)
            faults.append(fault)
            print(f"fault {len(faults)}: {kind} {fault.where()} at iteration {fault.iteration}", flush=True)
            if not wait_rebuilt(resume, fault.at, REBUILT_TIMEOUT_S):
                print(f"no rebuild within {REBUILT_TIMEOUT_S} s of fault {len(faults)}:\n{resume.stderr_tail()}")
                break
            if kind == "host":  # repaired: link up, its worker again; it joins as a spare
                for name in fault.hosts:
                    host = network[name]
                    host.stop()
                    host.set_link(True)
                    repaired += 1
                    start_worker(host, cluster.address, WORKERS[name], home, label=f"worker-repaired-{repaired}")
        code = resume.finish(RUN_TIMEOUT_S)
    finally:
        resume.stop()
    if code != 0:
        print(f"the resumed run exited {code}:\n{resume.stderr_tail()}")
        return 1
    summary = json.loads(resume.stdout.strip().splitlines()[-1])
    recoveries = summary["parity"]["recoveries"]
    origin = summary["parity"]["clock_origin"]

    print(f"\n{len(faults)} faults in {args.iterations} iterations (K = 2, R = {PARITY}, W = 2, seed {args.seed})\n")
    print("| # | iteration | fault | members (host) | detected after | rebuilt in | training waited |")
    print("|---|---|---|---|---|---|---|")
    f0 = faults[0]
    print(f"| 1 | {f0.iteration} | trainer host | {f0.members[0]} ({f0.hosts[0]}) | run stopped "
          f"{f0.notes['stopped_s']:.1f} s later (exit 2) | resumed from {resumed_from} | - |")
    server_faults = faults[1:]
    answered = 0
    for i, fault in enumerate(server_faults):
        until = server_faults[i + 1].at if i + 1 < len(server_faults) else float("inf")
        mine = [r for r in recoveries if fault.at <= origin + r["detected_s"] < until]
        answered += bool(mine) and all(r["seconds"] is not None for r in mine)
        detected = "; ".join(f"{origin + r['detected_s'] - fault.at:.1f} s ({', '.join(r['lost'])})" for r in mine)
        rebuilt = "; ".join("not finished" if r["seconds"] is None else f"{r['seconds']:.2f} s" for r in mine)
        waited = "; ".join(f"{r['locked_seconds']:.3f} s" for r in mine)
        print(f"| {i + 2} | {fault.iteration} | {fault.kind} | {fault.where()} | {detected or 'none'} | "
              f"{rebuilt or '-'} | {waited or '-'} |")
    print(f"\nrecoveries in the summary: {len(recoveries)} for {len(faults) - 1} server faults")
    print(f"training: {summary['train_seconds']:.1f} s resumed (+ the stopped run's) against "
          f"{baseline['train_seconds']:.1f} s fault-free on the same hosts")
    same = summary["state_sha256"] == local["state_sha256"] == baseline["state_sha256"]
    print(f"final state equal to the fault-free LocalCluster run's, bit for bit: {'yes' if same else 'NO'} "
          f"({summary['state_sha256'][:16]})")
    print(f"server faults with a finished rebuild: {answered} of {len(server_faults)}")
    return 0 if same and answered == len(server_faults) else 1


if __name__ == "__main__":
    sys.exit(main())
