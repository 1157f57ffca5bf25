"""The emulated network: a namespace behind a tbf-shaped veth, and embedding servers behind it.

The link must really limit throughput to its rate, leave nothing behind however the run ends (SIGKILL
included: the next build removes what a dead run left), fail in one line where it cannot be built, and
training with the servers behind it must end in the same bits as without.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from process_helpers import running_children
from test_trainers import make_dataset, small_config

from dlrmflow.engine.serving import shaped_link as link_module
from dlrmflow.engine.serving.shaped_link import LinkUnavailableError, namespaces, root_links, shaped_link

UNAVAILABLE = link_module.unavailable_reason()  # None where this machine can build a shaped link
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no shaped link here: {UNAVAILABLE}")


def left_behind(namespace: str, root_veth: str) -> list[str]:
    return [name for name in (namespace, root_veth) if name in namespaces() + root_links()]


def own_links() -> set[str]:
    """The namespaces and root-side veths named for this process: all a build here may make (names carry the
    builder's process id). Other processes (pytest-xdist workers, other test runs on this machine) build and
    remove their own links meanwhile, so a before/after comparison looks at this process's names only."""
    pid = os.getpid()
    return {name for name in namespaces() if name.startswith(f"{link_module.NAMESPACE_PREFIX}{pid}-")} | \
        {name for name in root_links() if name.startswith(f"{link_module.ROOT_VETH_PREFIX}{pid}-")}


# ---- the link limits throughput ----------------------------------------------------------------


SENDER = """
import socket, sys
data = b"x" * 65536
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    for _ in range(int(sys.argv[3])):
        s.sendall(data)
"""


def measure_goodput(link, chunks: int) -> tuple[float, int]:
    """Bytes/s of payload a sender inside the namespace pushes to a receiver here (first byte to last), and
    the frame bytes the inside end's qdisc sent meanwhile."""
    server = socket.create_server((link.root_address, 0))
    received: list[tuple[float, int]] = []

    def receive() -> None:
        conn, _ = server.accept()
        buf = bytearray(1 << 20)
        with conn:
            while n := conn.recv_into(buf):
                received.append((time.perf_counter(), n))

    thread = threading.Thread(target=receive)
    thread.start()
    before = link.sent_bytes()["inside"]
    subprocess.run(link.command([sys.executable, "-c", SENDER, link.root_address, str(server.getsockname()[1]),
                                 str(chunks)]), check=True, timeout=60)
    thread.join(timeout=60)
    server.close()
    total = sum(n for _, n in received)
    assert total == chunks * 65536
    # The first chunk's arrival starts the clock: the bytes it brought are not counted.
    return (total - received[0][1]) / (received[-1][0] - received[0][0]), link.sent_bytes()["inside"] - before


@pytest.mark.slow
@pytest.mark.parametrize("mbit", [20, 50])
def test_the_link_carries_its_rate_and_no_more(mbit):
    """About 1.5 s of traffic; a TCP payload is 1448 of a frame's 1514 bytes at MTU 1500, so the payload rate
    is 96% of the link's, and the frames the shaping qdisc sent are the whole rate. No try exceeds the rate;
    the best of up to 3 reaches it (on busy cores a sender or receiver that gets no CPU for a while slows
    a try below the rate, never above it)."""
    rate = mbit * 1_000_000
    with shaped_link(rate) as link:
        best = 0.0
        for _ in range(3):
            goodput, frame_bytes = measure_goodput(link, chunks=int(1.5 * rate / 8 / 65536))
            assert 8 * goodput <= 1.10 * rate, f"{8 * goodput / 1e6:.1f} Mbit/s through a {mbit} Mbit/s link"
            assert frame_bytes >= 1.5 * rate / 8
            best = max(best, goodput)
            if 8 * best >= 0.90 * rate:
                break
        assert 8 * best >= 0.90 * rate, f"at best {8 * best / 1e6:.1f} Mbit/s through a {mbit} Mbit/s link"
        link.set_rate(None)  # the same path unshaped: many times faster, so the qdisc was the limit
        unshaped, _ = measure_goodput(link, chunks=int(1.5 * rate / 8 / 65536))
        assert 8 * unshaped > 5 * rate


# ---- nothing is left behind ---------------------------------------------------------------------


def test_a_link_is_built_as_specified_and_removed_after_its_block():
    with shaped_link(20_000_000) as link:
        assert link.namespace == f"dlrmflow-{os.getpid()}-{link.namespace.rsplit('-', 1)[1]}"
        assert link.namespace in namespaces() and link.root_veth in root_links()
        inside = subprocess.run(link.command(["ip", "-o", "-4", "addr", "show", "dev", "veth0"]),
                                capture_output=True, text=True, check=True).stdout
        assert f"inet {link.inside_address}/30" in inside
        assert "mtu 1500" in subprocess.run(["ip", "link", "show", link.root_veth], capture_output=True,
                                            text=True).stdout
        for shaping in (subprocess.run(["tc", "qdisc", "show", "dev", link.root_veth], capture_output=True,
                                       text=True).stdout,
                        subprocess.run(link.command(["tc", "qdisc", "show", "dev", "veth0"]), capture_output=True,
                                       text=True).stdout):
            assert "tbf" in shaping and "rate 20Mbit" in shaping
        names = link.namespace, link.root_veth
    assert left_behind(*names) == []


def test_a_link_is_removed_when_its_block_raises():
    with pytest.raises(KeyboardInterrupt), shaped_link(None) as link:
        names = link.namespace, link.root_veth
        raise KeyboardInterrupt
    assert left_behind(*names) == []


BUILDER = """
import subprocess, sys, time
from dlrmflow.engine.serving.shaped_link import shaped_link
with shaped_link(10_000_000) as link:
    inside = subprocess.Popen(link.command([sys.executable, "-c", "import time; time.sleep(300)"]))
    print(link.namespace, link.root_veth, inside.pid, flush=True)
    time.sleep(300)
"""


def start_builder() -> tuple[subprocess.Popen, str, str, int]:
    """The builder, once the process it started is inside the namespace: ``ip netns exec`` joins it a moment
    after its pid exists, and a process not yet inside is not one the link's cleanup can find."""
    proc = subprocess.Popen([sys.executable, "-c", BUILDER], stdout=subprocess.PIPE, text=True)
    namespace, root_veth, inside_pid = proc.stdout.readline().split()
    deadline = time.monotonic() + 30
    while inside_pid not in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                                           text=True).stdout.split():
        assert time.monotonic() < deadline, f"process {inside_pid} never entered {namespace}"
        time.sleep(0.05)
    return proc, namespace, root_veth, int(inside_pid)


@pytest.mark.slow
def test_after_sigkill_the_next_build_removes_the_dead_runs_namespace_and_its_processes():
    proc, namespace, root_veth, inside_pid = start_builder()
    # Under the build lock, so that no other process's build (which first removes dead runs' links, as
    # this test's does below) removes the dead run's link before it is seen left behind.
    with link_module.build_lock():
        proc.kill()
        proc.wait()
        assert left_behind(namespace, root_veth) == [namespace, root_veth]  # nothing ran after SIGKILL
        assert psutil.pid_exists(inside_pid)
        inside = psutil.Process(inside_pid)
    with shaped_link(None) as link:
        assert left_behind(namespace, root_veth) == [] and link.namespace != namespace
    inside.wait(timeout=10)  # ended, and reaped by init once its parent was gone


@pytest.mark.slow
def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it ended between the two questions
        return False


def test_sigterm_removes_the_link():
    proc, namespace, root_veth, inside_pid = start_builder()
    inside = psutil.Process(inside_pid)  # with its start time: a new process may reuse the pid afterwards
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert left_behind(namespace, root_veth) == []
    # The builder SIGKILLs the process inside and exits; the kernel ends it a moment later.
    deadline = time.monotonic() + 10
    while _alive(inside):
        assert time.monotonic() < deadline, f"process {inside_pid} inside the namespace outlived the builder"
        time.sleep(0.05)


# ---- where it cannot be built ---------------------------------------------------------------------


def test_without_iproute2_one_line_and_nothing_built(monkeypatch):
    before = own_links()
    monkeypatch.setattr(link_module, "IP_COMMAND", "dlrmflow-no-such-ip")
    with pytest.raises(LinkUnavailableError) as failed, shaped_link(20_000_000):
        pass
    assert str(failed.value) == ("a shaped link needs the `dlrmflow-no-such-ip` command (iproute2), "
                                 "which is not on PATH")
    monkeypatch.undo()
    assert own_links() == before


def test_without_net_admin_one_line(monkeypatch):
    monkeypatch.setattr(link_module, "has_net_admin", lambda: False)
    with pytest.raises(LinkUnavailableError, match=r"^a shaped link needs root or CAP_NET_ADMIN [^\n]*$"), \
            shaped_link(20_000_000):
        pass


def test_a_refused_step_leaves_no_half_built_link(monkeypatch):
    """Shaping fails after the namespace and veth exist (``tc`` refuses): both are removed, one line says why."""
    before = own_links()
    monkeypatch.setattr(link_module, "TC_COMMAND", "false")
    with pytest.raises(LinkUnavailableError) as failed, shaped_link(20_000_000):
        pass
    message = str(failed.value)
    assert message.startswith("cannot build the shaped link: `false qdisc replace dev dlf") and "\n" not in message
    assert own_links() == before


# ---- training behind the link ---------------------------------------------------------------------


@pytest.mark.slow
def test_training_behind_the_link_ends_in_the_same_bits(tmp_path):
    """remote and oracle with their servers behind a 50 Mbit/s link end where local training does; their
    embedding traffic crossed the link (the servers' end sent at least the rows fetched); the server
    processes end with the block, and the namespace is gone."""
    from distributed import Client

    from dlrmflow.engine.planning import planner
    from dlrmflow.engine.serving.cluster import shaped_cluster
    from dlrmflow.engine.training.job import train

    dataset = make_dataset(tmp_path / "ds", seed=3)
    planner.make_plan(dataset, planner.PlanConfig(batch_size=16, lookahead=4), tmp_path / "plan")
    local = train(small_config(dataset, tmp_path / "local", "local"))
    with shaped_cluster(50_000_000, n_servers=2) as cluster:
        servers = [p for p, command in running_children() if "dlrmflow.exit_with_parent" in command]
        assert len(servers) == 2
        for server in servers:
            identify = subprocess.run(["ip", "netns", "identify", str(server.pid)], capture_output=True, text=True)
            assert identify.stdout.strip() == cluster.link.namespace
        assert all(s.startswith(f"tcp://{cluster.link.inside_address}:") for s in cluster.servers)
        with Client(cluster.address, direct_to_workers=True) as client:
            remote = train(small_config(dataset, tmp_path / "remote", "remote", num_shards=2), client=client)
            oracle = train(small_config(dataset, tmp_path / "oracle", "oracle", num_shards=2,
                                        plan_dir=str(tmp_path / "plan")), client=client)
        sent = cluster.link.sent_bytes()
        names = cluster.link.namespace, cluster.link.root_veth
    assert remote["state_sha256"] == oracle["state_sha256"] == local["state_sha256"]
    assert sent["inside"] >= remote["bytes_fetched"] + oracle["bytes_fetched"]
    assert sent["root"] >= remote["bytes_written_back"] + oracle["bytes_written_back"]
    psutil.wait_procs(servers, timeout=5)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in servers)
    assert left_behind(*names) == []


def test_server_workers_run_inside_the_namespace_under_exit_with_parent():
    from dlrmflow.engine.serving.cluster import server_worker_command
    from dlrmflow.engine.serving.shaped_link import ShapedLink

    link = ShapedLink("dlrmflow-1-0", "dlf1-0", "10.213.0.1", "10.213.0.2")
    argv = server_worker_command(link, "tcp://10.213.0.1:8786", "server-0", "/tmp/x")
    assert argv[1:4] == ["netns", "exec", "dlrmflow-1-0"]
    assert argv[5:9] == ["-m", "dlrmflow.exit_with_parent", str(os.getpid()), "distributed.cli.dask_worker"]
    assert " ".join(argv[9:]).startswith(
        "tcp://10.213.0.1:8786 --host 10.213.0.2 --nthreads 1 --no-nanny --no-dashboard --resources "
        "embedding_server=1")


def test_the_probe_builds_and_removes_a_link():
    before = own_links()
    assert link_module.unavailable_reason() is None
    assert own_links() == before


def test_the_probe_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(link_module, "TC_COMMAND", "dlrmflow-no-such-tc")
    reason = link_module.unavailable_reason()
    assert reason is not None and "dlrmflow-no-such-tc" in reason and "\n" not in reason
