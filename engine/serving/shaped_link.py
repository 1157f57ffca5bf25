"""A kernel-shaped network link on this machine: a network namespace joined to the root one by a veth pair.

:func:`shaped_link` builds, for the length of a ``with`` block::

    root namespace                                   namespace dlrmflow-<pid>-<n>
    dlf<pid>-<n>  10.213.x.y/30  <=== veth, MTU 1500 ===>  veth0  10.213.x.y+1/30
    egress: tbf at the rate                                  egress: tbf at the rate

A process started inside the namespace (:meth:`ShapedLink.command`) reaches the root namespace only
through the veth, and the other way round: traffic between the two addresses crosses the link, each
direction shaped by a token bucket (``tbf``) on the sending end's egress (a qdisc shapes only what
leaves an interface, so each direction needs its own). Traffic within one side (loopback, or the
namespace's own address from inside) does not cross it. No ``netem``: the link adds no delay beyond
what its rate and queue make.

Rate ``None`` or 0 is the same link unshaped: the same namespace, addresses and veth, no qdisc; so a
comparison between rates changes nothing but the shaping. :meth:`ShapedLink.set_rate` changes the
rate of a built link (both ends) between runs.

Cleanup. The namespace and the veth are removed when the block ends, however it ends: an exception,
KeyboardInterrupt, or SIGTERM (while the block runs in the main thread and SIGTERM has its default
action, SIGTERM raises SystemExit there). After SIGKILL nothing runs, so every :func:`shaped_link`
first removes the namespaces and veths named for a process id that no longer exists, ending the
processes still inside such a namespace. A failed build removes what it made before raising.

Permissions. Building needs root or CAP_NET_ADMIN and the ``ip`` and ``tc`` commands (iproute2).
Without them, or when any step is refused, :class:`LinkUnavailableError` says why in one line, and
nothing is left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The commands used, looked up on PATH at build time (tests point these at a missing binary).
IP_COMMAND = "ip"
TC_COMMAND = "tc"

MTU = 1500
NAMESPACE_PREFIX = "dlrmflow-"
ROOT_VETH_PREFIX = "dlf"  # + "<pid>-<n>": within the kernel's 15 characters for an interface name
INSIDE_VETH = "veth0"
# /30 subnets are taken from here, skipping any that overlaps an address or route of the root namespace.
ADDRESS_POOL = ipaddress.ip_network("10.213.0.0/16")
CAP_NET_ADMIN = 12
LOCK_FILE = Path(tempfile.gettempdir()) / "dlrmflow-shaped-link.lock"

_NAMESPACE_RE = re.compile(rf"^{re.escape(NAMESPACE_PREFIX)}(\d+)-(\d+)$")
_ROOT_VETH_RE = re.compile(rf"^{re.escape(ROOT_VETH_PREFIX)}(\d+)-(\d+)$")
_serial = itertools.count()


class LinkUnavailableError(RuntimeError):
    """A shaped link cannot be built here (no permission, no iproute2, a step refused); the message is one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(" ".join(reason.split()))


def token_bucket(rate_bits_per_s: int) -> tuple[int, int]:
    """``(burst, limit)`` in bytes of the tbf shaping one direction at ``rate_bits_per_s``.

    The burst is 1 ms of the rate, at least 8 KiB (several full frames): the rate holds over any span
    longer than a few milliseconds. The limit (the queue in front of the bucket) is 100 ms of the rate,
    at least 256 KiB, like a switch port's buffer: TCP's bulk transfers fill the link without drops,
    so the rate, not loss recovery, sets the transfer time."""
    rate_bytes = rate_bits_per_s / 8
    return max(8 * 1024, int(rate_bytes / 1000)), max(256 * 1024, int(rate_bytes / 10))


@dataclass
class ShapedLink:
    """A built link: ``root_address`` is this namespace's end, ``inside_address`` the namespace's."""

    namespace: str
    root_veth: str
    root_address: str
    inside_address: str
    rate_bits_per_s: int | None = None

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as a command run inside the namespace: ``ip netns exec NAMESPACE ARGV...``, which
        execs ``argv`` in the process it was started as (same process id, same parent)."""
        return [_tool(IP_COMMAND), "netns", "exec", self.namespace, *argv]

    def set_rate(self, rate_bits_per_s: int | None) -> None:
        """Shape both directions at ``rate_bits_per_s`` from now on (None or 0: unshaped)."""
        _shape(self.root_veth, None, rate_bits_per_s)
        _shape(INSIDE_VETH, self.namespace, rate_bits_per_s)
        self.rate_bits_per_s = rate_bits_per_s or None

    def sent_bytes(self) -> dict[str, int]:
        """Bytes each end's shaping qdisc has sent (frames, headers included): ``{"root": ..., "inside": ...}``.
        0 for an unshaped end (no qdisc counts)."""
        return {"root": _qdisc_bytes(self.root_veth, None), "inside": _qdisc_bytes(INSIDE_VETH, self.namespace)}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LinkUnavailableError(f"a shaped link needs the `{name}` command (iproute2), which is not on PATH")
    return path


def _run(argv: list[str], check: bool = True) -> str:
    """Run an ``ip``/``tc`` command; with ``check``, its failure is a LinkUnavailableError quoting the
    command and its first error line."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        first = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[0]
        shown = " ".join([Path(argv[0]).name, *argv[1:]])
        raise LinkUnavailableError(f"cannot build the shaped link: `{shown}` failed: {first}")
    return done.stdout


def _tc(namespace: str | None, *args: str) -> list[str]:
    return [_tool(TC_COMMAND), *(["-n", namespace] if namespace else []), *args]


def _shape(device: str, namespace: str | None, rate_bits_per_s: int | None) -> None:
    """Make ``device``'s root qdisc a tbf at the rate, or remove it (the veth's default, no queue) when unshaped."""
    if not rate_bits_per_s:
        _run(_tc(namespace, "qdisc", "del", "dev", device, "root"), check=False)  # none there: nothing to do
        return
    burst, limit = token_bucket(rate_bits_per_s)
    _run(_tc(namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{int(rate_bits_per_s)}bit",
             "burst", str(burst), "limit", str(limit)))


def _qdisc_bytes(device: str, namespace: str | None) -> int:
    out = _run(_tc(namespace, "-s", "qdisc", "show", "dev", device, "root"), check=False)
    if "tbf" not in out:
        return 0
    found = re.search(r"Sent (\d+) bytes", out)
    return int(found.group(1)) if found else 0


def has_net_admin() -> bool:
    """Whether this process may change network namespaces and interfaces (root, or CAP_NET_ADMIN)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    found = re.search(r"^CapEff:\s*([0-9a-fA-F]+)$", status, re.MULTILINE)
    return bool(found) and bool(int(found.group(1), 16) >> CAP_NET_ADMIN & 1)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """The names of the network namespaces ``ip netns`` knows."""
    return [line.split()[0] for line in _run([_tool(IP_COMMAND), "netns", "list"], check=False).splitlines()
            if line.strip()]


def root_links() -> list[str]:
    """The interface names of the root namespace."""
    out = _run([_tool(IP_COMMAND), "-o", "link", "show"], check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def remove_stale() -> list[str]:
    """Remove the namespaces and root-side veths this module made for processes that no longer exist
    (a run that was SIGKILLed), ending the processes still inside such a namespace. Returns their names."""
    removed = []
    for name in namespaces():
        found = _NAMESPACE_RE.match(name)
        if found and not pid_alive(int(found.group(1))):
            end_processes_inside(name)
            _run([_tool(IP_COMMAND), "netns", "del", name], check=False)
            removed.append(name)
    for name in root_links():
        found = _ROOT_VETH_RE.match(name)
        if found and not pid_alive(int(found.group(1))):
            _run([_tool(IP_COMMAND), "link", "del", name], check=False)
            removed.append(name)
    return removed


def networks_in_use() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of the root namespace's addresses and routes (the default route excluded)."""
    used = []
    for line in _run([_tool(IP_COMMAND), "-4", "-o", "addr", "show"], check=False).splitlines():
        found = re.search(r"\binet (\S+)", line)
        if found:
            used.append(ipaddress.ip_interface(found.group(1)).network)
    for line in _run([_tool(IP_COMMAND), "-4", "route", "show", "table", "all"], check=False).splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "multicast", "blackhole", "unreachable"):
            words = words[1:]
        if words and words[0] != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(words[0], strict=False))
    return used


def free_subnet(pool: ipaddress.IPv4Network = ADDRESS_POOL, prefix: int = 30) -> ipaddress.IPv4Network:
    """The first subnet of ``prefix`` bits in ``pool`` that overlaps no address or route of the root namespace
    (the emulated hosts of the tests take a /24 of a pool of their own)."""
    used = networks_in_use()
    for subnet in pool.subnets(new_prefix=prefix):
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise LinkUnavailableError(f"cannot build the network: every /{prefix} of {pool} is in use")


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """Serialise builds across processes (shaped links and the tests' emulated hosts): two builds must not
    pick the same names or subnet."""
    with open(LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def end_processes_inside(namespace: str) -> None:
    """SIGKILL the processes still inside ``namespace``: while any lives, the namespace outlasts its name."""
    for pid in _run([_tool(IP_COMMAND), "netns", "pids", namespace], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove(namespace: str, root_veth: str) -> None:
    """Remove a link: the processes left inside, the veth (deleting one end deletes both), the namespace.
    Parts already gone are fine."""
    end_processes_inside(namespace)
    _run([_tool(IP_COMMAND), "link", "del", root_veth], check=False)
    _run([_tool(IP_COMMAND), "netns", "del", namespace], check=False)


def _build(rate_bits_per_s: int | None) -> ShapedLink:
    if not has_net_admin():
        raise LinkUnavailableError("a shaped link needs root or CAP_NET_ADMIN (network namespaces, veth, tc)")
    ip = _tool(IP_COMMAND)
    _tool(TC_COMMAND)
    with build_lock():
        remove_stale()
        taken = set(namespaces()) | set(root_links())
        while True:
            n = next(_serial)
            namespace, root_veth = f"{NAMESPACE_PREFIX}{os.getpid()}-{n}", f"{ROOT_VETH_PREFIX}{os.getpid()}-{n}"
            if namespace not in taken and root_veth not in taken:
                break
        subnet = free_subnet()
        root_address, inside_address = (str(a) for a in subnet.hosts())
        link = ShapedLink(namespace, root_veth, root_address, inside_address)
        try:
            _run([ip, "netns", "add", namespace])
            _run([ip, "link", "add", root_veth, "mtu", str(MTU), "type", "veth", "peer", "name", INSIDE_VETH,
                  "mtu", str(MTU), "netns", namespace])
            _run([ip, "addr", "add", f"{root_address}/30", "dev", root_veth])
            _run([ip, "link", "set", root_veth, "up"])
            _run([ip, "-n", namespace, "addr", "add", f"{inside_address}/30", "dev", INSIDE_VETH])
            _run([ip, "-n", namespace, "link", "set", INSIDE_VETH, "up"])
            _run([ip, "-n", namespace, "link", "set", "lo", "up"])
            link.set_rate(rate_bits_per_s)
        except BaseException:
            _remove(namespace, root_veth)
            raise
    return link


class _TerminatedError(SystemExit):
    """SIGTERM, raised in the main thread so that ``with`` blocks clean up."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs: SIGTERM raises SystemExit in the main thread, when SIGTERM has its default
    action there (which would end the process without cleanup); any other handler is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise _TerminatedError(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def shaped_link(rate_bits_per_s: int | None = None) -> Iterator[ShapedLink]:
    """A namespace joined to this one by a veth shaped at ``rate_bits_per_s`` both ways (None or 0: unshaped),
    removed when the block ends. Raises :class:`LinkUnavailableError` (one line) where it cannot be built."""
    with sigterm_raises():
        link = _build(rate_bits_per_s)
        try:
            yield link
        finally:
            _remove(link.namespace, link.root_veth)


def unavailable_reason() -> str | None:
    """Why no shaped link can be built here (one line), or None when one can: builds a shaped link and
    removes it, so a refused step anywhere (a namespace, a veth, a qdisc) is found, not only a missing
    permission or command."""
    try:
        with shaped_link(10_000_000):
            return None
    except LinkUnavailableError as exc:
        return str(exc)
