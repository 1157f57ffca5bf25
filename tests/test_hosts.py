"""Training across emulated hosts (issue 43): each Dask process on a network namespace of its own.

Why: on one machine every Dask process reaches every other through loopback, so nothing shows whether
the trainers of ``--trainers W`` can meet across machines. Here (tests/hosts.py) a scheduler host, three
embedding-server hosts (K = 2 data shards + 1 parity) and two trainer hosts sit on one bridge, each
started with docs/terabyte.md's command lines, with no ``GLOO_SOCKET_IFNAME`` anywhere, and the machine's
host name, which inside a host never resolves to the host's bridge address: left to itself, gloo would
bind each trainer to loopback, which the other trainer's host cannot reach. The trainers must instead
bind gloo to their Dask worker's interface and train to the same bits as a LocalCluster run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from hosts import (
    HostsUnavailableError,
    dask_on_hosts,
    emulated_hosts,
    hostname_addresses,
    missing,
    namespaces,
    remove_stale,
    root_links,
)

from dlrmflow.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"),
              pytest.mark.skipif(missing() is not None, reason=f"no emulated hosts here: {missing()}")]

SERVERS = ["server0", "server1", "server2"]  # K = 2 data shards + 1 parity
TRAINERS = ["trainer0", "trainer1"]
WORKERS = {**{name: "embedding_server=1" for name in SERVERS}, **{name: "trainer=1" for name in TRAINERS}}
SEED = "3"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The module's one harness: the six hosts, the scheduler and the five workers (starting them is most
    of the module's time, so every test shares them)."""
    home = tmp_path_factory.mktemp("hosts")
    try:
        with emulated_hosts(["scheduler", *SERVERS, *TRAINERS], home / "logs") as network, \
                dask_on_hosts(network, home, "scheduler", WORKERS) as dask:
            yield dask
    except HostsUnavailableError as exc:
        pytest.skip(f"no emulated hosts here: {exc}")


def run_json(capsys, argv: list[str], cluster=None) -> dict:
    """``dlrmflow ARGV --json`` in this process (the root namespace); stdout must be one JSON object. On a
    failure the message carries the command's stderr and, with ``cluster``, its hosts' log tails."""
    capsys.readouterr()
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    logs = f"\nhost logs:\n{cluster.log_tails()}" if cluster is not None else ""
    assert code == 0, f"dlrmflow {' '.join(argv)} exited {code}:\n{err[-4000:]}{logs}"
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got {lines!r}"
    return json.loads(lines[0])


def test_trainers_on_two_hosts_end_in_the_bits_of_a_local_cluster(cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    network = cluster.network
    # The premise: inside a trainer host the host name does not name the host's own address, so gloo's
    # default (the host name's address, else loopback) is not one the other trainer can reach.
    for name in TRAINERS:
        assert network[name].address not in hostname_addresses(network[name])

    on_hosts = ["--dask-address", cluster.address]
    raw, dataset, plan = tmp_path / "x.tsv", tmp_path / "ds", tmp_path / "plan"
    run_json(capsys, ["generate", "--rows", "20000", "--scale", "0.01", "--seed", "1", "--output", str(raw),
                      *on_hosts], cluster)
    run_json(capsys, ["preprocess", str(raw), "--output", str(dataset), *on_hosts], cluster)
    run_json(capsys, ["plan", str(dataset), "--batch-size", "256", "--output", str(plan), *on_hosts], cluster)
    train = ["train", str(dataset), "--mode", "oracle", "--plan", str(plan), "--trainers", "2", "--shards", "2",
             "--parity", "1", "--iterations", "20", "--batch-size", "256", "--seed", SEED]

    across = run_json(capsys, [*train, "--output", str(tmp_path / "run-hosts"), *on_hosts], cluster)
    trainer_hosts = {network[name].address for name in TRAINERS}
    per_trainer = across["trainers"]["per_trainer"]
    on = [t["worker"].split("://", 1)[-1].rsplit(":", 1)[0] for t in per_trainer]
    assert len(on) == 2 and set(on) == trainer_hosts, per_trainer  # one trainer on each trainer host
    members = across["parity"]["member_workers"]  # the 2 data shards and the parity shard: on server hosts
    server_hosts = {network[name].address for name in SERVERS}
    assert len(members) == 3 and {w.split("://", 1)[-1].rsplit(":", 1)[0] for w in members.values()} <= \
        server_hosts, members

    local = run_json(capsys, [*train, "--output", str(tmp_path / "run-local")])
    assert across["state_sha256"] == local["state_sha256"]


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


def ended(pid: int) -> bool:
    """Whether process ``pid`` ended (a zombie too: an orphan's new parent may not have reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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
