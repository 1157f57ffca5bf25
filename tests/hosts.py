"""Emulated hosts on this machine: network namespaces on one Linux bridge, each running its own processes.

Why: a Dask cluster whose processes all run on loopback cannot show what breaks across machines. Here
every "host" is a network namespace of its own, so a process on one host reaches another only through
that host's address on the bridge, never through loopback; that reproduces the multi-machine layout of
docs/terabyte.md ("How to run it") on one Linux box::

    root namespace (the test process)
    bridge dlfhb<pid>-<n>  10.215.N.1/24
      |-- dlfhv<pid>-<m> <== veth ==> eth0 10.215.N.2/24   namespace dlfhost-<pid>-<m>   ("scheduler")
      |-- dlfhv<pid>-<m> <== veth ==> eth0 10.215.N.3/24   namespace dlfhost-<pid>-<m>   ("server0")
      ...

Each host has ``lo`` up (its own loopback, which no other host shares) and optionally a tbf-shaped
link (both directions at one rate, with :func:`dlrmflow.engine.serving.shaped_link.token_bucket`'s
bucket and queue). The bridge has an address too, so the test process in the root namespace reaches
every host (a Dask client, the CLI's ``--dask-address``).

A host fails as a machine does (:meth:`Host.fail`): its link goes down on both ends, then every process
inside it is SIGKILLed; the others learn of it only from their own timeouts, as from a machine that lost
power.

Host names. Processes run with the machine's own host name (``ip netns exec`` keeps the UTS
namespace). Inside a host that name can never resolve to the host's bridge address (nothing maps
10.215.N.x to it): it resolves to a loopback address (this machine's /etc/hosts maps it to 127.0.0.1)
or to an address the host does not hold, or not at all. Software that finds "its own address" from
the host name (gloo without ``GLOO_SOCKET_IFNAME``) therefore falls back to loopback there, exactly
the multi-machine bug that trainers binding gloo to their Dask worker's interface fixes
(:func:`hostname_addresses` shows what the name resolves to inside a host).

The subnet is the first /24 of :data:`ADDRESS_POOL` that overlaps no address or route of the root
namespace (engine/serving/shaped_link.py takes its /30s from 10.213.0.0/16, so the two never meet);
builds are serialised by a lock file, so concurrent test processes get different subnets and names.

Cleanup. :func:`emulated_hosts` removes, however its block ends (an exception, KeyboardInterrupt,
SIGTERM while it runs in the main thread), every process it started (by process group, then whatever
is still inside a namespace), the namespaces, veths and the bridge. A run that was SIGKILLed leaves
them behind; names carry the builder's process id, so every build first removes those of process ids
that no longer exist (:func:`remove_stale`), as shaped_link.py does for its links.

Needs root and iproute2 (``ip``; ``tc`` for shaped links); :func:`missing` says
cheaply what is missing, and a refused step raises :class:`HostsUnavailableError` with one line.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# namespaces(): the names `ip netns` knows; root_links(): the root namespace's interfaces (re-exported).
from dlrmflow.engine.serving.shaped_link import (
    build_lock,
    end_processes_inside,
    free_subnet,
    namespaces,
    pid_alive,
    root_links,
    sigterm_raises,
    token_bucket,
)

__all__ = ["DaskOnHosts", "Host", "HostNetwork", "HostsUnavailableError", "WatchedRun", "dask_on_hosts",
           "PROGRESS", "emulated_hosts", "host_of", "hostname_addresses", "member_hosts", "missing", "namespaces",
           "placed_on_stderr", "remove_stale", "root_links", "server_actors", "start_scheduler", "start_worker"]

NAMESPACE_PREFIX = "dlfhost-"  # + "<pid>-<n>"; shaped_link's "dlrmflow-<pid>-<n>" never matches it, nor it this
BRIDGE_PREFIX = "dlfhb"  # + "<pid>-<n>": at most 15 characters (pid <= 7 digits, n < 100)
VETH_PREFIX = "dlfhv"  # + "<pid>-<n>" (shaped_link's root veths are "dlf<digits>-<n>")
INSIDE_VETH = "eth0"
MTU = 1500
ADDRESS_POOL = ipaddress.ip_network("10.215.0.0/16")
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` names a namespace (a bind mount of its nsfs file)
STOP_GRACE_S = 5.0  # a Dask worker closes in about a second on SIGTERM; then SIGKILL

# The docs' command lines (docs/terabyte.md, "How to run it"), with this venv's `dask`.
DASK = Path(sys.executable).parent / "dask"
SCHEDULER_PORT = 8786
# Settings that must not leak from the test environment into the hosts' processes: the point is to run
# without them (GLOO_SOCKET_IFNAME would hide the bug; DLRMFLOW_DASK_ADDRESS is the client's business).
UNSET_IN_HOSTS = ("GLOO_SOCKET_IFNAME", "DLRMFLOW_DASK_ADDRESS")

_NAMESPACE_RE = re.compile(rf"^{re.escape(NAMESPACE_PREFIX)}(\d+)-(\d+)$")
_LINK_RE = re.compile(rf"^(?:{BRIDGE_PREFIX}|{VETH_PREFIX})(\d+)-(\d+)$")
_serial = itertools.count()


class HostsUnavailableError(RuntimeError):
    """Emulated hosts cannot be built here; the message is one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(" ".join(reason.split()))


def missing() -> str | None:
    """Why no emulated hosts can be built here, without building anything (root, ``ip``), or None.
    A step refused later (namespaces or bridges off in this kernel) raises :class:`HostsUnavailableError`."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, a bridge, veths)"
    if shutil.which("ip") is None:
        return "emulated hosts need the `ip` command (iproute2), which is not on PATH"
    return None


def _ip() -> str:
    path = shutil.which("ip")
    if path is None:
        raise HostsUnavailableError("emulated hosts need the `ip` command (iproute2), which is not on PATH")
    return path


def _run(argv: list[str], check: bool = True) -> str:
    """Run an ``ip``/``tc`` command; with ``check`` its failure raises, quoting the command and its first error line."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        first = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[0]
        shown = " ".join([Path(argv[0]).name, *argv[1:]])
        raise HostsUnavailableError(f"cannot build the emulated hosts: `{shown}` failed: {first}")
    return done.stdout


def remove_stale() -> list[str]:
    """Remove the namespaces, veths and bridges of this module named for process ids that no longer exist
    (a SIGKILLed run), killing the processes left inside; returns the names removed."""
    removed = []
    for name in namespaces():
        found = _NAMESPACE_RE.match(name)
        if found and not pid_alive(int(found.group(1))):
            end_processes_inside(name)
            _run([_ip(), "netns", "del", name], check=False)
            removed.append(name)
    for name in root_links():
        found = _LINK_RE.match(name)
        if found and not pid_alive(int(found.group(1))):
            _run([_ip(), "link", "del", name], check=False)
            removed.append(name)
    return removed


@dataclass
class Host:
    """One emulated host: ``name`` is the test's name for it, ``namespace`` the kernel's, ``address`` its
    address on the bridge; its processes' logs go to ``log_dir/NAME-LABEL.log``."""

    name: str
    namespace: str
    veth: str  # the root namespace's end, on the bridge
    address: str
    log_dir: Path
    rate_bits_per_s: int | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)
    logs: dict[str, Path] = field(default_factory=dict)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host: ``ip netns exec NAMESPACE ARGV...`` execs ARGV in the same process."""
        return [_ip(), "netns", "exec", self.namespace, *map(str, argv)]

    def start(self, label: str, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` inside this host, in a process group of its own (so that stopping it reaches what it
        started), stdout and stderr to ``log_dir/NAME-LABEL.log`` (a label is unique per host)."""
        log = self.log_dir / f"{self.name}-{label}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.command(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)
        self.processes.append(proc)
        self.logs[label] = log
        self._wait_inside(proc)
        return proc

    def _wait_inside(self, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
        """Until ``proc`` (``ip netns exec``, which enters the namespace, then execs) is inside this host or
        ended: before that, ``ip netns pids`` does not list it, so a removal or :meth:`fail` at that moment
        would leave it running in a namespace nobody names any more (seen on 2 busy cores)."""
        inside = os.stat(NETNS_DIR / self.namespace).st_ino
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == inside:
                    return
            except FileNotFoundError:
                return
            time.sleep(0.005)

    def pids_inside(self) -> list[int]:
        """The processes inside this host now (``ip netns pids``)."""
        return [int(p) for p in _run([_ip(), "netns", "pids", self.namespace], check=False).split()]

    def fail(self, timeout_s: float = 10.0) -> float:
        """The host fails as a machine does when it loses power: its link goes down first on both ends, so that
        nothing its processes send while they die gets out (no FIN, no RST: the other hosts learn of it only
        from their own timeouts, and packets to it are dropped), then every process inside is SIGKILLed, until
        none is left. The namespace stays (the network's removal takes it). Returns the ``time.monotonic()``
        at which the link went down."""
        _run([_ip(), "link", "set", self.veth, "down"])
        went_down = time.monotonic()
        _run([_ip(), "-n", self.namespace, "link", "set", INSIDE_VETH, "down"])
        deadline = time.monotonic() + timeout_s
        while pids := self.pids_inside():  # a nanny may start a process while its group dies: until none is left
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name}: processes {pids} still inside {timeout_s} s after SIGKILL")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for proc in self.processes:  # reap them (each was an `ip netns exec`, exec'd into the command)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout_s)
        return went_down

    def set_link(self, up: bool) -> float:
        """Take this host's link down (both ends: packets either way are dropped, its processes live on and
        notice nothing but silence) or bring it back up; returns the ``time.monotonic()`` of the change."""
        state = "up" if up else "down"
        _run([_ip(), "link", "set", self.veth, state])
        changed = time.monotonic()
        _run([_ip(), "-n", self.namespace, "link", "set", INSIDE_VETH, state])
        return changed

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End every process started on this host (a machine whose services are stopped): as
        :meth:`HostNetwork.stop_processes` does for every host."""
        stop_started([self], grace_s)

    def run(self, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to its end; its output captured."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout)

    def set_rate(self, rate_bits_per_s: int | None) -> None:
        """Shape this host's link both ways at ``rate_bits_per_s`` (None or 0: unshaped): a tbf on the host's
        end (what it sends) and on the bridge's end (what it receives); a qdisc shapes only its egress."""
        for tc, device in ((_tc(None), self.veth), (_tc(self.namespace), INSIDE_VETH)):
            if not rate_bits_per_s:
                _run([*tc, "qdisc", "del", "dev", device, "root"], check=False)
                continue
            burst, limit = token_bucket(rate_bits_per_s)
            _run([*tc, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{int(rate_bits_per_s)}bit",
                  "burst", str(burst), "limit", str(limit)])
        self.rate_bits_per_s = rate_bits_per_s or None

    def log_tails(self, lines: int = 40) -> str:
        """The last ``lines`` of each of this host's process logs, for a failure message."""
        return "\n".join(f"--- {path.name} ---\n{tail(path, lines)}" for path in self.logs.values())


def _tc(namespace: str | None) -> list[str]:
    path = shutil.which("tc")
    if path is None:
        raise HostsUnavailableError("a shaped host link needs the `tc` command (iproute2), which is not on PATH")
    return [path, *(["-n", namespace] if namespace else [])]


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` of a log (a failure message shows what a host's process said last)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def stop_started(hosts: Sequence[Host], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process group started on ``hosts``, SIGKILL what remains ``grace_s`` later, then anything
    else still inside them (a process that left its group)."""
    # Only processes not yet reaped: a reaped one's process id (and group id) may belong to another by now.
    procs = [p for host in hosts for p in host.processes if p.poll() is None]
    victims = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            victims += [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    for host in hosts:
        end_processes_inside(host.namespace)
    psutil.wait_procs(alive, timeout=10)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@dataclass
class HostNetwork:
    """The bridge (``bridge_address`` on ``bridge``) and its hosts, by name."""

    bridge: str
    bridge_address: str
    subnet: ipaddress.IPv4Network
    hosts: dict[str, Host]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def stop_processes(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every started process group, SIGKILL what remains ``grace_s`` later, then anything else
        still inside a host (a process that left its group)."""
        stop_started(list(self.hosts.values()), grace_s)

    def remove(self) -> None:
        """Remove the processes, veths, namespaces and the bridge; parts already gone are fine."""
        self.stop_processes()
        _remove(self.bridge, list(self.hosts.values()))


def _remove(bridge: str, hosts: list[Host]) -> None:
    for host in hosts:
        end_processes_inside(host.namespace)
        _run([_ip(), "link", "del", host.veth], check=False)  # deletes both ends
        _run([_ip(), "netns", "del", host.namespace], check=False)
    _run([_ip(), "link", "del", bridge], check=False)


def _build(names: Sequence[str], log_dir: Path, rates: dict[str, int | None]) -> HostNetwork:
    reason = missing()
    if reason:
        raise HostsUnavailableError(reason)
    if len(set(names)) != len(names) or not 0 < len(names) < 250:
        raise ValueError(f"host names must be distinct, 1 to 249 of them: {list(names)}")
    ip, pid = _ip(), os.getpid()
    log_dir.mkdir(parents=True, exist_ok=True)
    with build_lock():
        remove_stale()
        taken = set(namespaces()) | set(root_links())

        def fresh(prefix: str) -> tuple[str, int]:
            while True:
                n = next(_serial)
                if n >= 100:
                    raise HostsUnavailableError("cannot build the emulated hosts: 100 names used in this process")
                if f"{prefix}{pid}-{n}" not in taken:
                    return f"{prefix}{pid}-{n}", n

        subnet = free_subnet(ADDRESS_POOL, 24)
        addresses = [str(a) for a in subnet.hosts()]
        bridge, _ = fresh(BRIDGE_PREFIX)
        network = HostNetwork(bridge, addresses[0], subnet, {})
        try:
            _run([ip, "link", "add", bridge, "type", "bridge"])
            _run([ip, "addr", "add", f"{addresses[0]}/{subnet.prefixlen}", "dev", bridge])
            _run([ip, "link", "set", bridge, "up"])
            for i, name in enumerate(names, start=1):
                _, n = fresh(VETH_PREFIX)
                host = Host(name, f"{NAMESPACE_PREFIX}{pid}-{n}", f"{VETH_PREFIX}{pid}-{n}", addresses[i], log_dir)
                network.hosts[name] = host  # from here on, removal covers it
                _run([ip, "netns", "add", host.namespace])
                _run([ip, "link", "add", host.veth, "mtu", str(MTU), "type", "veth", "peer", "name", INSIDE_VETH,
                      "mtu", str(MTU), "netns", host.namespace])
                _run([ip, "link", "set", host.veth, "master", bridge])
                _run([ip, "link", "set", host.veth, "up"])
                _run([ip, "-n", host.namespace, "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev",
                      INSIDE_VETH])
                _run([ip, "-n", host.namespace, "link", "set", INSIDE_VETH, "up"])
                _run([ip, "-n", host.namespace, "link", "set", "lo", "up"])
                if rates.get(name):
                    host.set_rate(rates[name])
        except BaseException:
            _remove(bridge, list(network.hosts.values()))
            raise
    return network


@contextlib.contextmanager
def emulated_hosts(names: Sequence[str], log_dir: Path,
                   rates: dict[str, int | None] | None = None) -> Iterator[HostNetwork]:
    """Hosts ``names`` on one bridge for the length of the block (module docstring); ``rates``: a host's link
    rate in bits/s (missing, None or 0: unshaped). Raises :class:`HostsUnavailableError` (one line) where
    they cannot be built, leaving nothing behind."""
    with sigterm_raises():
        network = _build(names, Path(log_dir), rates or {})
        try:
            yield network
        finally:
            network.remove()


def hostname_addresses(host: Host) -> list[str]:
    """The addresses the machine's host name resolves to inside ``host`` (what gloo, left to itself, starts
    from): an empty list when it does not resolve."""
    probe = ("import socket\ntry:\n"
             "    print(*sorted({i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}))\n"
             "except OSError:\n    pass\n")
    return host.run([sys.executable, "-c", probe]).stdout.split()


# ---- a Dask cluster on the hosts, started as docs/terabyte.md says --------------------------------------------


def host_environment(host: Host, home: Path) -> dict[str, str]:
    """The environment of a host's Dask processes: the test's, without :data:`UNSET_IN_HOSTS`, with Dask's
    scratch space in the host's own directory (as on a machine of its own)."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET_IN_HOSTS}
    scratch = home / host.name
    scratch.mkdir(parents=True, exist_ok=True)
    env["DASK_TEMPORARY_DIRECTORY"] = str(scratch)
    return env


def start_scheduler(host: Host, home: Path, label: str = "scheduler") -> str:
    """``dask scheduler --port 8786`` on ``host``, plus ``--host ADDRESS`` (listen on the host's address);
    returns the scheduler's address. ``label``: its log's (a second scheduler on the host needs another)."""
    host.start(label, [DASK, "scheduler", "--port", str(SCHEDULER_PORT), "--host", host.address],
               env=host_environment(host, home), cwd=home)
    return f"tcp://{host.address}:{SCHEDULER_PORT}"


def start_worker(host: Host, scheduler: str, resources: str, home: Path, label: str = "worker") -> subprocess.Popen:
    """``dask worker SCHEDULER --nthreads 1 --resources RESOURCES`` on ``host``, plus ``--host ADDRESS`` so that
    it listens on (and advertises) the host's address. ``label``: its log's."""
    return host.start(label, [DASK, "worker", scheduler, "--nthreads", "1", "--resources", resources,
                                 "--host", host.address], env=host_environment(host, home), cwd=home)


@dataclass
class DaskOnHosts:
    """A Dask scheduler and workers on emulated hosts; ``client`` is the test process's, on ``address``."""

    network: HostNetwork
    address: str
    client: object  # distributed.Client

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(host.log_tails(lines) for host in self.network.hosts.values() if host.logs)


@contextlib.contextmanager
def dask_on_hosts(network: HostNetwork, home: Path, scheduler: str, workers: dict[str, str],
                  start_timeout_s: float = 180) -> Iterator[DaskOnHosts]:
    """A scheduler on host ``scheduler`` and a worker on each host of ``workers`` (host name -> its
    ``--resources``); yields once every worker has joined. Stops them all when the block ends."""
    from distributed import Client

    try:
        address = start_scheduler(network[scheduler], home)
        for name, resources in workers.items():
            start_worker(network[name], address, resources, home)
        deadline = time.monotonic() + start_timeout_s
        client = None
        while client is None:
            try:
                client = Client(address, timeout="10s")
            except OSError as exc:
                dead = [p.args for h in network.hosts.values() for p in h.processes if p.poll() is not None]
                if time.monotonic() > deadline or dead:
                    raise RuntimeError(f"the scheduler at {address} did not start ({exc}); exited: {dead}\n"
                                       + "\n".join(h.log_tails() for h in network.hosts.values())) from None
        try:
            try:
                client.wait_for_workers(len(workers), timeout=max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RuntimeError("the Dask workers did not all join:\n"
                                   + "\n".join(h.log_tails() for h in network.hosts.values())) from None
            yield DaskOnHosts(network, address, client)
        finally:
            client.close()
    finally:
        network.stop_processes()


# ---- a command watched as it runs, and where its servers and trainers went ------------------------------------


def host_of(address: str) -> str:
    """``tcp://10.215.3.4:40123`` -> ``10.215.3.4``."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


PROGRESS = re.compile(r"training iterations: (\d+)/\d+|iterations? (?:[\d,]+–)?([\d,]+): loss")


class WatchedRun:
    """``dlrmflow ARGV --json`` as a subprocess of the root namespace, its stderr read as it comes: each line
    with its ``time.monotonic()``, the iterations done as the progress lines say."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.done = 0
        self.changed = threading.Condition()
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "dlrmflow.cli", *argv, "--json"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.stdout = ""
        self.readers = [threading.Thread(target=self._read_stderr, daemon=True),
                        threading.Thread(target=self._read_stdout, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read_stdout(self) -> None:
        self.stdout = self.proc.stdout.read()

    def _read_stderr(self) -> None:
        with open(self.log, "w") as log:
            for line in self.proc.stderr:
                now = time.monotonic()
                log.write(f"{now:.3f} {line}")
                log.flush()
                found = PROGRESS.search(line)
                with self.changed:
                    self.lines.append((now, line.rstrip("\n")))
                    if found:
                        self.done = max(self.done, int((found.group(1) or found.group(2)).replace(",", "")))
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, predicate, timeout_s: float) -> bool:
        """Until ``predicate(self)`` holds (True), the command ended or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.readers[0].is_alive()):
                    return False
                self.changed.wait(min(left, 0.5))
        return True

    def finish(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        for reader in self.readers:
            reader.join(30)
        return code

    def stop(self) -> None:
        """Whatever happened: the command and what it started gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((at, line) for at, line in self.lines if re.search(pattern, line)), None)

    def stderr_tail(self, n: int = 60) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def server_actors(cluster, servers: list[str]) -> dict[str, tuple[str, str]]:
    """The coded-shard actors the server hosts' workers hold now: task key -> (host address, member name); a
    data shard is a CodedShard (``shard``), a parity shard a ParityShard (``p``)."""
    def held(dask_worker) -> dict[str, str]:
        names = {"CodedShard": lambda a: f"data shard {a.shard}", "ParityShard": lambda a: f"parity shard {a.p}"}
        return {str(key): names[type(a).__name__](a) for key, a in dask_worker.state.actors.items()
                if type(a).__name__ in names}

    addresses = {cluster.network[name].address for name in servers}
    workers = [w for w in cluster.client.scheduler_info()["workers"] if host_of(w) in addresses]
    return {key: (host_of(worker), name) for worker, actors in cluster.client.run(held, workers=workers).items()
            for key, name in actors.items()}


def member_hosts(actors: dict[str, tuple[str, str]]) -> tuple[dict[str, str], str]:
    """Each member's host address and the spare's, from one run's :func:`server_actors`: a member's worker
    holds that member alone, the spare's worker a standby for every member."""
    on: dict[str, list[str]] = {}
    for host, name in actors.values():
        on.setdefault(host, []).append(name)
    members = {names[0]: host for host, names in on.items() if len(names) == 1}
    spares = [host for host, names in on.items() if len(names) > 1]
    assert len(spares) == 1 and sorted(on[spares[0]]) == sorted(members), on  # standbys for every member
    return members, spares[0]


def placed_on_stderr(run: WatchedRun, what: str) -> dict[str, str] | None:
    """``{name: host}`` from the run's log line ``WHAT on N hosts: 10.x.y.z (NAME, ...), ...``; None without one."""
    found = run.first(rf"{what} on \d+ hosts?: ")
    if found is None:
        return None
    listed = found[1].split(f"{what} on ", 1)[1].split(": ", 1)[1]
    return {name.strip(): host for host, names in re.findall(r"([\d.]+) \(([^)]*)\)", listed)
            for name in names.split(",")}
