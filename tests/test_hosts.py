"""Training across emulated hosts (issue 43): each Dask process on a network namespace of its own.

Why: on one machine every Dask process reaches every other through loopback, so nothing shows whether
the trainers of ``--trainers W`` can meet across machines, nor what a machine's failure does to a run.
Here (tests/hosts.py) a scheduler host, four embedding-server hosts (K = 2 data shards + 1 parity + a
spare for a rebuild) and two trainer hosts sit on one bridge, each started with docs/terabyte.md's
command lines, with no ``GLOO_SOCKET_IFNAME`` anywhere, and the machine's host name, which inside a host
never resolves to the host's bridge address: left to itself, gloo would bind each trainer to loopback,
which the other trainer's host cannot reach. The trainers must instead bind gloo to their Dask worker's
interface and train to the same bits as a LocalCluster run; and when the host of a data shard fails
mid-run (its link down, every process on it SIGKILLed), the run must rebuild that shard on the spare
host from the survivors and still end in those bits.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from cli_helpers import terabyte_run_block
from hosts import (
    PROGRESS,
    HostsUnavailableError,
    WatchedRun,
    dask_on_hosts,
    emulated_hosts,
    host_of,
    hostname_addresses,
    member_hosts,
    missing,
    namespaces,
    placed_on_stderr,
    remove_stale,
    root_links,
    server_actors,
    start_scheduler,
    start_worker,
)

from dlrmflow.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"),
              pytest.mark.skipif(missing() is not None, reason=f"no emulated hosts here: {missing()}")]

SERVERS = ["server0", "server1", "server2", "server3"]  # K = 2 data shards + 1 parity + 1 spare for a rebuild
TRAINERS = ["trainer0", "trainer1", "trainer2"]  # W = 2, and a spare: a resume after a trainer host's loss
WORKERS = {**{name: "embedding_server=1" for name in SERVERS}, **{name: "trainer=1" for name in TRAINERS}}
SEED = "3"
# 20,000 rows hold 70 batches of 256 before the held-out tenth. Every run of the module trains the same
# iterations (one LocalCluster run is the oracle of all). The failed-host test fails its host once the run
# reports KILL_AFTER of them: the rest (about 0.1 s each here) outlast the failing (well under a second),
# and training then waits for the loss to be noticed (3 probes unanswered: SERVER_LOSS_S).
ITERATIONS = 60
KILL_AFTER = 5
RUN_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The module's one harness: the seven hosts, the scheduler and the six workers (starting them is most
    of the module's time, so every test shares them; the failed-host test, last, takes one down)."""
    home = tmp_path_factory.mktemp("hosts")
    try:
        with emulated_hosts(["scheduler", *SERVERS, *TRAINERS], home / "logs") as network, \
                dask_on_hosts(network, home, "scheduler", WORKERS) as dask:
            yield dask
    except HostsUnavailableError as exc:
        pytest.skip(f"no emulated hosts here: {exc}")


def cli_json(argv: list[str], cluster=None) -> dict:
    """``dlrmflow ARGV --json`` in this process (the root namespace); stdout must be one JSON object. On a
    failure the message carries, with ``cluster``, its hosts' log tails (pytest shows the stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--json"])
    logs = f"\nhost logs:\n{cluster.log_tails()}" if cluster is not None else ""
    assert code == 0, f"dlrmflow {' '.join(argv)} exited {code}{logs}"
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got {lines!r}"
    return json.loads(lines[0])


@dataclass
class Workload:
    dataset: Path
    plan: Path
    train: list[str]  # `dlrmflow train ...` without --output and --dask-address


@pytest.fixture(scope="module")
def workload(cluster, tmp_path_factory) -> Workload:
    """The dataset and plan, made on the hosts' cluster, and the W = 2 oracle parity-1 run every test trains."""
    home = tmp_path_factory.mktemp("workload")
    on_hosts = ["--dask-address", cluster.address]
    raw, dataset, plan = home / "x.tsv", home / "ds", home / "plan"
    with without_cluster_settings():
        cli_json(["generate", "--rows", "20000", "--scale", "0.01", "--seed", "1", "--output", str(raw), *on_hosts],
                 cluster)
        cli_json(["preprocess", str(raw), "--output", str(dataset), *on_hosts], cluster)
        cli_json(["plan", str(dataset), "--batch-size", "256", "--output", str(plan), *on_hosts], cluster)
    train = ["train", str(dataset), "--mode", "oracle", "--plan", str(plan), "--trainers", "2", "--shards", "2",
             "--parity", "1", "--iterations", str(ITERATIONS), "--batch-size", "256", "--seed", SEED,
             "--metrics-every", "5"]
    return Workload(dataset, plan, train)


@pytest.fixture(scope="module")
def local_run(workload, tmp_path_factory) -> dict:
    """The oracle: the same run on dlrmflow's own LocalCluster (every process on loopback)."""
    with without_cluster_settings():
        return cli_json([*workload.train, "--output", str(tmp_path_factory.mktemp("local") / "run")])


@contextlib.contextmanager
def without_cluster_settings():
    """No GLOO_SOCKET_IFNAME (it would hide the bug) nor DLRMFLOW_DASK_ADDRESS in this process meanwhile."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("GLOO_SOCKET_IFNAME", raising=False)
        patch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
        yield


def test_trainers_on_two_hosts_end_in_the_bits_of_a_local_cluster(cluster, workload, local_run, tmp_path):
    network = cluster.network
    # The premise: inside a trainer host the host name does not name the host's own address, so gloo's
    # default (the host name's address, else loopback) is not one the other trainer can reach.
    for name in TRAINERS:
        assert network[name].address not in hostname_addresses(network[name])

    with without_cluster_settings():
        across = cli_json([*workload.train, "--output", str(tmp_path / "run-hosts"), "--dask-address",
                           cluster.address], cluster)
    trainer_hosts = {network[name].address for name in TRAINERS}
    per_trainer = across["trainers"]["per_trainer"]
    on = [host_of(t["worker"]) for t in per_trainer]
    assert len(on) == 2 and len(set(on)) == 2 and set(on) <= trainer_hosts, per_trainer  # each on a host of its own
    assert [t["host"] for t in per_trainer] == on, per_trainer  # the summary names each trainer's host
    members = across["parity"]["member_workers"]  # the 2 data shards and the parity shard: on server hosts
    server_hosts = {network[name].address for name in SERVERS}
    assert len(members) == 3 and len({host_of(w) for w in members.values()}) == 3, members  # one per host
    assert {host_of(w) for w in members.values()} <= server_hosts, members
    # The summary's servers: each member, its worker (the parity section's) and that worker's host.
    assert [s["member"] for s in across["servers"]] == ["data shard 0", "data shard 1", "parity shard 0"]
    assert {s["member"]: s["worker"] for s in across["servers"]} == members, across["servers"]
    assert all(s["host"] == host_of(s["worker"]) for s in across["servers"]), across["servers"]
    assert {s["host"] for s in across["servers"]} <= server_hosts, across["servers"]
    assert across["parity"]["recoveries"] == []

    assert across["state_sha256"] == local_run["state_sha256"]


def docs_commands() -> list[str]:
    """The ``dlrmflow`` command lines of docs/terabyte.md's "How to run it" block, as written (continuation
    lines joined)."""
    return [line.split("#", 1)[0].strip() for line in terabyte_run_block() if line.startswith("dlrmflow ")]


# docs/terabyte.md's sizes, made small: (as written, here). Each must be in the block (else the test fails:
# the docs changed and this test must follow them).
SMALL_SIZES = [("--batch-size 65536", "--batch-size 256"), ("--shards 32", "--shards 2"),
               ("--checkpoint-every 1000", "--checkpoint-every 20")]


def test_the_docs_commands_run_across_hosts_as_written_and_end_in_the_local_cluster_bits(cluster, tmp_path,
                                                                                          monkeypatch):
    """docs/terabyte.md's commands, as written (small sizes, /shared a directory every host sees, optional
    options left out), with DLRMFLOW_DASK_ADDRESS naming the hosts' scheduler: preprocess of gzipped day
    files, profile, plan, an oracle run with parity and checkpoints, verify; then evaluate on the hosts'
    workers. The run ends in the bits of the same command on dlrmflow's own LocalCluster, and the
    evaluation on the hosts equals the one in process."""
    import gzip

    shared = tmp_path / "shared"
    (shared / "raw").mkdir(parents=True)
    raw = tmp_path / "x.tsv"
    with without_cluster_settings():
        cli_json(["generate", "--rows", "12000", "--scale", "0.01", "--seed", "2", "--output", str(raw),
                  "--dask-address", cluster.address], cluster)
    lines = raw.read_bytes().splitlines(keepends=True)
    for day, part in enumerate((lines[:6000], lines[6000:])):
        with gzip.open(shared / "raw" / f"day_{day}.gz", "wb") as out:
            out.writelines(part)

    commands = []
    for line in docs_commands():
        for written, small in SMALL_SIZES:
            line = line.replace(written, small)
        line = re.sub(r"\s*\[[^\]]*\]", "", line)  # optional options: left out
        argv = line.replace("/shared/", f"{shared}/").split()[1:]
        if "day_*.gz" in " ".join(argv):  # the shell's glob
            argv = [a for a in argv if "day_*" not in a]
            argv[1:1] = [str(p) for p in sorted((shared / "raw").glob("day_*.gz"))]
        commands.append(argv)
    assert [argv[0] for argv in commands] == ["preprocess", "profile", "plan", "train", "verify"], commands
    joined = " ".join(" ".join(argv) for argv in commands)
    assert all(small in joined for _, small in SMALL_SIZES), joined

    results = {}
    with without_cluster_settings():
        monkeypatch.setenv("DLRMFLOW_DASK_ADDRESS", cluster.address)  # the docs' `export`
        for argv in commands:
            results[argv[0]] = cli_json(argv, cluster)
        run_dir, dataset = commands[3][commands[3].index("--output") + 1], commands[3][1]
        on_hosts = cli_json(["evaluate", run_dir, dataset, "--score-on", "cluster"], cluster)
        monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS")
        train = commands[3]
        local = cli_json([*train[: train.index("--output")], "--output", str(tmp_path / "local")])
        in_process = cli_json(["evaluate", run_dir, dataset, "--score-on", "process"])

    assert results["train"]["state_sha256"] == local["state_sha256"]
    assert results["train"]["parity"]["member_workers"], results["train"]["parity"]
    assert results["verify"]["ok"], results["verify"]
    assert on_hosts["scored_on"] == "cluster" and in_process["scored_on"] == "process"
    assert (on_hosts["auc"], on_hosts["log_loss"]) == (in_process["auc"], in_process["log_loss"])


def with_options(argv: list[str], **options: str | None) -> list[str]:
    """``argv`` with each ``--option value`` replaced (None: removed), or added when missing."""
    out = list(argv)
    for name, value in options.items():
        flag = f"--{name.replace('_', '-')}"
        if flag in out:
            at = out.index(flag)
            del out[at: at + 2]
        if value is not None:
            out += [flag, value]
    return out


@pytest.mark.parametrize("mode,parity", [("remote", "1"), ("lru", "0")])  # lru with parity: one trainer only
def test_each_mode_across_hosts_ends_in_the_local_cluster_bits(mode, parity, cluster, workload, local_run, tmp_path):
    """remote and lru with two trainers, parity or none, on the hosts: the bits of the LocalCluster oracle run
    (every mode trains to the same bits; one trainer: the docs commands' test)."""
    argv = with_options(workload.train, mode=mode, parity=parity, plan=None, capacity="8000" if mode == "lru" else None)
    with without_cluster_settings():
        across = cli_json([*argv, "--output", str(tmp_path / "run"), "--dask-address", cluster.address], cluster)
    assert across["state_sha256"] == local_run["state_sha256"]
    members = {s["host"] for s in across["servers"]}
    assert members <= {cluster.network[name].address for name in SERVERS}, across["servers"]


def test_a_night_of_daily_across_hosts_ends_in_the_local_cluster_bits(cluster, tmp_path):
    """One night of `dlrmflow daily` (preprocess building the vocabulary, plan, oracle training with parity,
    export) on the hosts' cluster: the night's model ends in the bits of the same night on a LocalCluster."""
    from dlrmflow.datasets.synthetic import generate_rows

    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "day_0.tsv").write_bytes(generate_rows(0, 3000, seed=100, scale=0.002))
    argv = ["daily", str(landing), "--batch-size", "512", "--lookahead", "20", "--embedding-dim", "4"]
    with without_cluster_settings():
        across = cli_json([*argv, "--state-dir", str(tmp_path / "hosts"), "--dask-address", cluster.address], cluster)
        local = cli_json([*argv, "--state-dir", str(tmp_path / "local")])
    assert across["new_days"] == local["new_days"] == ["day_0"]
    [on_hosts], [on_local] = across["days"], local["days"]
    assert on_hosts["state_sha256"] == on_local["state_sha256"]
    assert Path(on_hosts["export_dir"], "export.json").is_file()


KILLED_BUILDER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from hosts import emulated_hosts
with emulated_hosts(["a"], Path(sys.argv[2])) as network:
    host = network["a"]
    inside = host.start("sleep", ["sleep", "600"])
    print(network.bridge, host.namespace, host.veth, inside.pid, flush=True)
    time.sleep(600)
"""


def ended(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether process ``pid`` ended within ``timeout_s`` (a zombie too: an orphan's new parent may not have
    reaped it yet). A SIGKILL takes effect when the process next runs: on busy cores not at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


@pytest.fixture
def buildable(tmp_path):
    """Skips where the kernel refuses a step (namespaces, a bridge, a veth, tbf) though this is root."""
    try:
        with emulated_hosts(["probe"], tmp_path / "probe", rates={"probe": 20_000_000}):
            pass
    except HostsUnavailableError as exc:
        pytest.skip(f"no emulated hosts here: {exc}")


@pytest.mark.usefixtures("buildable")
def test_a_build_removes_what_a_killed_run_left_and_shapes_both_ends(tmp_path):
    """A SIGKILLed run cannot clean up: the next build removes its namespace, veth, bridge and the process
    still inside. A shaped host has a tbf at its rate on both ends of its link; nothing outlives the block."""
    child = subprocess.Popen([sys.executable, "-c", KILLED_BUILDER, str(Path(__file__).parent), str(tmp_path / "a")],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        with child.stdout:
            bridge, namespace, veth, sleeper = child.stdout.readline().split()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert namespace in namespaces() and {bridge, veth} <= set(root_links())
        with emulated_hosts(["b"], tmp_path / "b", rates={"b": 20_000_000}) as network:
            assert namespace not in namespaces() and not {bridge, veth} & set(root_links())
            assert ended(int(sleeper))
            host = network["b"]
            for tc in (["tc", "qdisc", "show", "dev", host.veth],
                       ["tc", "-n", host.namespace, "qdisc", "show", "dev", "eth0"]):
                shown = subprocess.run(tc, capture_output=True, text=True, check=True).stdout
                assert "tbf" in shown and "rate 20Mbit" in shown, shown
        assert host.namespace not in namespaces() and not {network.bridge, host.veth} & set(root_links())
    finally:  # whatever failed above: the child's hosts go (named for its process id, dead by now)
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        remove_stale()


def run_environment() -> dict[str, str]:
    """A WatchedRun's environment: no gloo or cluster setting, the test session's Prefect API."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "DLRMFLOW_DASK_ADDRESS")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    return env


def one_summary(run: WatchedRun) -> dict:
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got {lines!r}"
    return json.loads(lines[0])




CHECKPOINT_EVERY = 20
LINK_DOWN_S = 4.0  # shorter than 3 unanswered probes (each 3 s) and Dask's TCP timeout (30 s): ridden out
SERVER_LOSS_S = 20  # a lost server host: 3 probes unanswered (about 11 s), where the scheduler alone took 29 s
SCHEDULER_LOSS_S = 60  # a lost scheduler stops the command within this
TRAINER_LOSS_S = 30  # a lost trainer host: 3 missed probes (about 12 s) and the survivors' restart, where
# the scheduler alone took 33-41 s (Dask's TCP timeout, then the restart)


def test_a_server_link_drop_is_ridden_out_and_a_trainer_host_failing_stops_the_run_for_a_resume_to_the_same_bits(
        cluster, workload, local_run, tmp_path):
    """One run, two faults. After KILL_AFTER iterations the link of data shard 0's host goes down for a few
    seconds and comes back (its processes live on): the run goes on, riding it out or rebuilding the shard on
    the spare, never hanging. After its first checkpoint, trainer 1's host fails (link down, every process
    SIGKILLed): the command stops with exit status 2 and one line naming `dlrmflow resume`; the resume, on the
    cluster's other trainer hosts, ends in the LocalCluster run's bits."""
    network = cluster.network
    run_dir = tmp_path / "run"
    on_hosts = ["--dask-address", cluster.address]
    earlier = server_actors(cluster, SERVERS)
    run = WatchedRun([*workload.train, "--checkpoint-every", str(CHECKPOINT_EVERY), "--output", str(run_dir),
                      *on_hosts], run_environment(), tmp_path / "stderr.log")
    try:
        began = time.monotonic()
        if not run.wait_for(lambda r: r.done >= KILL_AFTER, RUN_TIMEOUT_S):
            pytest.fail(f"the run did not reach iteration {KILL_AFTER} (exit {run.proc.poll()}):\n"
                        f"{run.stderr_tail()}\nhost logs:\n{cluster.log_tails()}")
        actors = server_actors(cluster, SERVERS)
        placed, _ = member_hosts({key: actors[key] for key in set(actors) - set(earlier)})
        server = next(network[name] for name in SERVERS if network[name].address == placed["data shard 0"])
        dropped_after = run.done
        down_at = server.set_link(False)
        try:
            time.sleep(LINK_DOWN_S)
        finally:
            server.set_link(True)
        after = max(CHECKPOINT_EVERY, dropped_after) + 2
        if not run.wait_for(lambda r: r.done >= after, RUN_TIMEOUT_S - (time.monotonic() - began)):
            pytest.fail(f"the run did not go on to iteration {after} after the link came back (exit "
                        f"{run.proc.poll()}):\n{run.stderr_tail()}\nhost logs:\n{cluster.log_tails()}")
        went_on_s = next(at for at, line in run.lines if PROGRESS.search(line) and at > down_at) - down_at
        rebuilt = any(": rebuilding from parity" in line for _, line in run.lines)
        trainers = placed_on_stderr(run, "trainers")
        assert trainers is not None, run.stderr_tail()
        victim = next(network[name] for name in TRAINERS if network[name].address == trainers["trainer 1"])
        reached = run.done
        failed_at = victim.fail()
        code = run.finish(max(1.0, RUN_TIMEOUT_S - (time.monotonic() - began)))
    finally:
        run.stop()
    assert code == 2, f"the run exited {code}:\n{run.stderr_tail()}\nhost logs:\n{cluster.log_tails()}"
    assert run.stdout.strip() == ""
    errors = [(at, line) for at, line in run.lines if line.startswith("dlrmflow train: error:")]
    assert len(errors) == 1, run.stderr_tail()
    stopped_at, message = errors[0]
    assert "trainer 1 of 2" in message and f"dlrmflow resume {run_dir}" in message, message
    assert not any("Traceback" in line for _, line in run.lines), run.stderr_tail()
    # Noticed by the driver's probes, not when the scheduler drops the worker after Dask's TCP timeout (30 s+).
    assert "stopped answering" in message and stopped_at - failed_at < TRAINER_LOSS_S, (stopped_at - failed_at,
                                                                                       message)

    resumed_began = time.monotonic()
    resumed = cli_json(["resume", str(run_dir), *on_hosts], cluster)
    resume_s = time.monotonic() - resumed_began
    assert resumed["state_sha256"] == local_run["state_sha256"]
    hosts = {t["host"] for t in resumed["trainers"]["per_trainer"]}
    assert len(hosts) == 2 and victim.address not in hosts, resumed["trainers"]
    print(f"\n{server.name}'s link (data shard 0) down for {LINK_DOWN_S} s after iteration {dropped_after}: "
          f"{'rebuilt the shard' if rebuilt else 'rode it out'}, the next progress line {went_on_s:.1f} s after it "
          f"went down\n{victim.name} (trainer 1) failed after iteration {reached}: the command stopped "
          f"{stopped_at - failed_at:.1f} s later with: {message}\nthe resume took {resume_s:.1f} s and ended in the "
          "LocalCluster run's bits")


def test_a_server_host_failing_mid_run_is_rebuilt_on_the_spare_host_to_the_same_bits(cluster, workload, local_run,
                                                                                     tmp_path):
    """It takes a server host down for good (the spare takes its member). The run goes on the hosts' cluster as a user
    runs it (a command in the root namespace); after KILL_AFTER iterations the host of data shard 0 fails
    (its link down, every process on it SIGKILLed). The run must notice, rebuild the shard on the spare
    host from the survivors while it trains, end with exit status 0 in the LocalCluster run's bits, and
    say so in its summary: the recovery, the replacement's worker and host."""
    from prefect.settings import PREFECT_API_URL

    network = cluster.network
    by_address = {network[name].address: network[name] for name in SERVERS}
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "DLRMFLOW_DASK_ADDRESS")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    run_dir = tmp_path / "run"
    earlier = server_actors(cluster, SERVERS)  # an earlier run's, if its servers outlived it
    run = WatchedRun([*workload.train, "--output", str(run_dir), "--dask-address", cluster.address], env,
                     tmp_path / "stderr.log")
    try:
        began = time.monotonic()
        if not run.wait_for(lambda r: r.done >= KILL_AFTER, RUN_TIMEOUT_S):
            pytest.fail(f"the run did not reach iteration {KILL_AFTER} (exit {run.proc.poll()}):\n"
                        f"{run.stderr_tail()}\nhost logs:\n{cluster.log_tails()}")
        reached = run.done
        actors = server_actors(cluster, SERVERS)
        placed, spare = member_hosts({key: actors[key] for key in set(actors) - set(earlier)})
        assert set(placed) == {"data shard 0", "data shard 1", "parity shard 0"}, placed
        assert len({*placed.values(), spare}) == 4, (placed, spare)  # each on a server host of its own
        victim = by_address[placed["data shard 0"]]
        failed_at = victim.fail()
        assert reached < ITERATIONS and run.proc.poll() is None, "the run ended before the host failed"
        code = run.finish(max(1.0, RUN_TIMEOUT_S - (time.monotonic() - began)))
        ended_at = time.monotonic()
        assert code == 0, f"the run exited {code}:\n{run.stderr_tail()}\nhost logs:\n{cluster.log_tails()}"
    finally:
        run.stop()
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got {lines!r}"
    summary = json.loads(lines[0])

    parity = summary["parity"]
    (recovery,) = parity["recoveries"]  # one loss, one recovery
    assert recovery["lost"] == ["data shard 0"] and recovery["rebuilt_s"] is not None, recovery
    replacement = recovery["new_workers"]["data shard 0"]
    assert host_of(replacement) == spare, (recovery, spare)
    assert parity["member_workers"]["data shard 0"] == replacement, parity["member_workers"]
    assert parity["verify"]["ok"], parity["verify"]
    servers = {s["member"]: s for s in summary["servers"]}
    assert servers["data shard 0"]["worker"] == replacement and servers["data shard 0"]["host"] == spare, servers
    assert {servers[m]["host"] for m in ("data shard 1", "parity shard 0")} == \
        {placed["data shard 1"], placed["parity shard 0"]}, servers
    assert summary["state_sha256"] == local_run["state_sha256"]
    # The run's log says where the trainers ran (and, where it shows it, where the servers did).
    trainers = {f"trainer {t['rank']}": t["host"] for t in summary["trainers"]["per_trainer"]}
    assert placed_on_stderr(run, "trainers") == trainers, run.stderr_tail()
    assert len(set(trainers.values())) == 2, trainers
    assert set(trainers.values()) <= {network[name].address for name in TRAINERS}, trainers
    servers_line = placed_on_stderr(run, "embedding servers")
    assert servers_line in (None, placed), (servers_line, placed)

    # The group's clock is trainer 0's perf_counter, this test's time.monotonic: on Linux both CLOCK_MONOTONIC.
    detected = parity["clock_origin"] + recovery["detected_s"] - failed_at
    assert detected < SERVER_LOSS_S and "stopped answering" in "; ".join(recovery["causes"]), (detected, recovery)
    print(f"\n{victim.name} ({victim.address}, data shard 0) failed after iteration {reached}; the loss was "
          f"detected {detected:.1f} s later ({'; '.join(recovery['causes'])}), rebuilt on {spare} in "
          f"{recovery['seconds']:.2f} s ({recovery['rows_rebuilt']} rows, {recovery['chunks']} chunks, training "
          f"waited {recovery['locked_seconds']:.3f} s); the run ended {ended_at - failed_at:.1f} s after the "
          f"failure; `embedding servers on` on the run's stderr: {servers_line is not None}; actors of earlier "
          f"runs still on the server hosts at its start: {sorted(earlier.values())}")


def stopped_by_the_scheduler_host_failing(cluster, train: list[str], run_dir: Path,
                                          tmp_path: Path) -> tuple[int, float, str]:
    """``dlrmflow train`` (``train`` with checkpoints, into ``run_dir``) on the hosts, its scheduler's host failed
    a little after the first checkpoint: the command must stop within SCHEDULER_LOSS_S, exit status 2, with one
    line naming the loss and `dlrmflow resume`, no traceback. The iteration it had reached when the host
    failed, the seconds until that line, and the line."""
    run = WatchedRun([*train, "--checkpoint-every", str(CHECKPOINT_EVERY), "--output", str(run_dir),
                      "--dask-address", cluster.address], run_environment(), tmp_path / "stderr.log")
    try:
        after = CHECKPOINT_EVERY + 2
        if not run.wait_for(lambda r: r.done >= after, RUN_TIMEOUT_S):
            pytest.fail(f"the run did not reach iteration {after} (exit {run.proc.poll()}):\n"
                        f"{run.stderr_tail()}\nhost logs:\n{cluster.log_tails()}")
        reached = run.done
        failed_at = cluster.network["scheduler"].fail()
        code = run.finish(SCHEDULER_LOSS_S * 3)
    finally:
        run.stop()
    errors = [(at, line) for at, line in run.lines if line.startswith("dlrmflow train: error:")]
    assert code == 2 and len(errors) == 1, f"exit {code}:\n{run.stderr_tail()}"
    stopped_at, message = errors[0]
    assert stopped_at - failed_at < SCHEDULER_LOSS_S, (stopped_at - failed_at, message)
    assert "lost the Dask scheduler" in message and f"dlrmflow resume {run_dir}" in message, message
    assert not any("Traceback" in line for _, line in run.lines), run.stderr_tail()
    return reached, stopped_at - failed_at, message


def test_the_scheduler_host_failing_stops_the_run_in_one_line_and_a_new_scheduler_resumes_it_to_the_same_bits(
        cluster, workload, local_run, tmp_path):
    """Next to last in the module: the scheduler's host fails mid-run (link down, the scheduler SIGKILLed). The command
    stops within a minute with exit status 2 and one line naming `dlrmflow resume`; the last checkpoint is
    intact: with a new scheduler at the same address and the workers of the live hosts started again (as an
    operator restarts them), the resume ends in the LocalCluster run's bits."""
    from distributed import Client

    network = cluster.network
    scheduler = network["scheduler"]
    live = [name for name in WORKERS if any(p.poll() is None for p in network[name].processes)]
    run_dir = tmp_path / "run"
    reached, took, message = stopped_by_the_scheduler_host_failing(cluster, workload.train, run_dir, tmp_path)

    # A new scheduler where the old one was, and the live hosts' workers started again.
    scheduler.set_link(True)
    for name in live:
        network[name].stop()
    home = tmp_path / "again"
    address = start_scheduler(scheduler, home, label="scheduler-again")
    assert address == cluster.address
    for name in live:
        start_worker(network[name], address, WORKERS[name], home, label="worker-again")
    with Client(address, timeout="30s") as client:
        client.wait_for_workers(len(live), timeout=120)
    resumed = cli_json(["resume", str(run_dir), "--dask-address", address], cluster)
    assert resumed["state_sha256"] == local_run["state_sha256"]
    print(f"\nthe scheduler's host failed after iteration {reached}: the command stopped {took:.1f} s later "
          f"with: {message}\nthe resume on a new scheduler ended in the LocalCluster run's bits")


def test_the_scheduler_host_failing_under_a_lone_trainer_stops_the_run_in_one_line(cluster, workload, tmp_path):
    """After the test above (the scheduler it started again): one trainer, in the command's own process, whose
    calls go straight to its servers, so it would train on without a scheduler. Its watch on the scheduler
    stops the command within a minute, exit status 2, one line naming `dlrmflow resume`, with its last
    checkpoint written. (That a resume from a checkpoint taken after the loss ends in the failure-free bits
    was measured: docs/terabyte.md.)"""
    import torch

    run_dir = tmp_path / "run"
    _, took, message = stopped_by_the_scheduler_host_failing(cluster, with_options(workload.train, trainers="1"),
                                                             run_dir, tmp_path)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["iteration"] >= CHECKPOINT_EVERY
    print(f"\nthe scheduler's host failed under one trainer: the command stopped {took:.1f} s later with: {message}")
