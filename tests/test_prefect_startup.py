"""The temporary local Prefect API of a ``dlrmflow`` command: it waits long enough on busy cores, a
server that does not start is one line naming ``PREFECT_API_URL``, and it never outlives its command."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from process_helpers import running_children

from dlrmflow import cli

REPO = Path(__file__).resolve().parents[1]


def _without_api_url(monkeypatch: pytest.MonkeyPatch):
    """This process as a user's command without a server: no PREFECT_API_URL, temporary servers on, and no
    temporary server registered yet (the session's ``prefect_harness`` registers its own as the default one
    in Prefect's registry, ``SubprocessASGIServer._instances``; it is back after the test)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE, temporary_settings

    monkeypatch.delitem(SubprocessASGIServer._instances, None, raising=False)
    return temporary_settings({PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: True}, restore_defaults={PREFECT_API_URL})


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE  # ended; its new parent may never reap it
    except psutil.NoSuchProcess:
        return True


class _NotStarted:
    """Stands in for TemporaryApi: records its timeout, starts nothing."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def start(self) -> None:
        pass


def test_the_api_start_up_waits_120_s_or_the_longer_prefect_setting(monkeypatch):
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    monkeypatch.setattr("dlrmflow.flows.prefect_internals.TemporaryApi", _NotStarted)
    with _without_api_url(monkeypatch):
        waits = [cli.temporary_prefect_api().timeout_s]  # Prefect's default of 20 s is too short for a busy machine
        with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 300}):
            waits.append(cli.temporary_prefect_api().timeout_s)
    assert waits == [120, 300]


def test_a_set_api_url_starts_no_server(monkeypatch):
    """PREFECT_API_URL in the settings (a profile) or in the environment: no temporary API."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr("dlrmflow.flows.prefect_internals.TemporaryApi", _NotStarted)
    with _without_api_url(monkeypatch):
        assert isinstance(cli.temporary_prefect_api(), _NotStarted)
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:1/api"}):
            assert cli.temporary_prefect_api() is None
        monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
        assert cli.temporary_prefect_api() is None


def test_the_server_starts_before_the_command_s_imports_and_answers_before_its_flow(monkeypatch, tmp_path,
                                                                                     capsys):
    """The order that makes the server's start-up overlap the command's imports: launch (and say so on stderr:
    the seconds until the flow's first line are the server's), import the flows, wait for the server, run the
    flow; then the server is stopped."""
    from dlrmflow.commands import generate

    events = []

    class Recording(_NotStarted):
        def start(self) -> None:
            events.append("server launched")

        def wait_until_answering(self) -> None:
            events.append("server answered")

        def stop(self) -> None:
            events.append("server stopped")

    def importing(module):
        events.append(f"import {module.FLOWS[0]}")

    monkeypatch.setattr("dlrmflow.flows.prefect_internals.TemporaryApi", Recording)
    monkeypatch.setattr(cli, "import_flows", importing)
    monkeypatch.setattr(generate, "run", lambda args: events.append("flow") or {"rows": 0})
    monkeypatch.setattr(generate, "summarize", lambda result: "")
    with _without_api_url(monkeypatch):
        assert cli.main(["generate", "--rows", "10", "--output", str(tmp_path / "g.tsv")]) == 0
    assert events == ["server launched", "import dlrmflow.flows.dataset", "server answered", "flow",
                      "server stopped"]
    assert capsys.readouterr().err.splitlines()[0] == ("dlrmflow generate: starting a temporary local Prefect API "
                                                       "(PREFECT_API_URL is not set) ...")


def test_bad_input_is_answered_without_starting_a_server(monkeypatch, capsys, tmp_path):
    with _without_api_url(monkeypatch):
        assert cli.main(["generate", "--rows", "0", "--output", str(tmp_path / "g.tsv")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dlrmflow generate: error: --rows must be >= 1, got 0"
    assert not [p for p, command in running_children() if "dlrmflow.exit_with_parent" in command]


def test_an_api_that_does_not_start_is_one_line_naming_prefect_api_url(monkeypatch, capsys, tmp_path):
    """A real server start that cannot answer in time (the wait cut to 0.1 s, and nothing imported first):
    exit 2, one line, no server left."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    from dlrmflow.commands import generate

    monkeypatch.setattr(cli, "API_STARTUP_TIMEOUT_S", 0.1)
    monkeypatch.setattr(generate, "FLOWS", ("dlrmflow.engine.errors",))  # the wait begins as the server launches
    with _without_api_url(monkeypatch), temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 0}):
        status = cli.main(["generate", "--rows", "10", "--output", str(tmp_path / "g.tsv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert [line for line in err if "error" in line] == [
        "dlrmflow generate: error: the temporary local Prefect API did not start (it did not answer within 0.1 s); "
        "start one with `prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api (`prefect config "
        "set PREFECT_API_URL=...`), or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]
    assert not (tmp_path / "g.tsv").exists()
    servers = [p for p, command in running_children() if "dlrmflow.exit_with_parent" in command]
    assert all(_gone(p) for p in servers), servers


def test_a_process_run_by_exit_with_parent_ends_when_its_parent_is_killed():
    """The mechanism on its own, in a second: a parent that starts a server under
    ``dlrmflow.exit_with_parent`` is SIGKILLed; the server ends though nothing stopped it."""
    parent_code = ("import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-m', "
                   "'dlrmflow.exit_with_parent', str(os.getpid()), 'http.server', '0', '--bind', '127.0.0.1'], "
                   "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(parent.stdout.readline()))
    try:
        time.sleep(0.5)  # the server runs, its parent still there
        assert not _gone(server)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(server)
    finally:
        if not _gone(server):
            server.kill()
        parent.stdout.close()


@pytest.mark.slow
def test_a_killed_command_takes_its_temporary_api_along(tmp_path):
    """SIGKILL of a ``dlrmflow generate`` process once its temporary Prefect API listens: the server ends
    within seconds and its port is closed (Prefect stops it only from an atexit hook, which SIGKILL skips).
    Slow: a real server start on a fresh database, 5-30 s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DLRMFLOW_DASK_ADDRESS"}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    command = [sys.executable, "-m", "dlrmflow.cli", "generate", "--rows", "5000000", "--output",
               str(tmp_path / "g.tsv")]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        port = None
        while port is None:
            assert proc.poll() is None, f"dlrmflow generate ended with status {proc.returncode} before the test"
            assert time.monotonic() < deadline, "no temporary Prefect API listened within 180 s"
            servers = [p for p, command in running_children(psutil.Process(proc.pid)) if "uvicorn" in " ".join(command)]
            listening = [c.laddr.port for s in servers for c in s.net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN]
            port = listening[0] if listening else None
            time.sleep(0.05)
        [server] = servers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not _gone(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(server), f"the temporary Prefect API (pid {server.pid}) outlived its killed command"
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", port))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever else the command had started
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


# A ``dlrmflow generate`` in a fresh process whose temporary API records what it is asked to do (on stderr, in
# order with the command's own lines) and whose flow does nothing.
RECORDED_COMMAND = """
import sys
from dlrmflow import cli
from dlrmflow.commands import generate
from dlrmflow.flows import prefect_internals

class Recording(prefect_internals.TemporaryApi):
    def start(self, *, pass_settings=True):
        print(f"launched: Prefect loaded {'prefect' in sys.modules}, settings passed {pass_settings}",
              file=sys.stderr, flush=True)

    def wait_until_answering(self):
        print("waited", file=sys.stderr, flush=True)

    def stop(self):
        print("stopped", file=sys.stderr, flush=True)

prefect_internals.TemporaryApi = Recording
generate.run = lambda args: {}
generate.summarize = lambda result: "ran"
sys.exit(cli.main(["generate", "--rows", "10", "--output", "g.tsv"]))
"""


def _fresh_command(home: Path, profile_api_url: str | None = None) -> list[str]:
    """RECORDED_COMMAND's stderr lines, run with a Prefect home of its own (whose profile may name an API) and no
    Prefect setting in its environment."""
    home.mkdir()
    if profile_api_url is not None:
        (home / "profiles.toml").write_text(
            f'active = "team"\n\n[profiles.team]\nPREFECT_API_URL = "{profile_api_url}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DLRMFLOW_DASK_ADDRESS"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    done = subprocess.run([sys.executable, "-c", RECORDED_COMMAND], cwd=home, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ran\n"
    return done.stderr.splitlines()


def test_a_fresh_command_launches_its_api_and_says_so_before_prefect_loads(tmp_path):
    """The command's first line comes before Prefect's 1.2 s of imports: the server is launched first, without
    this process's settings (it reads the same ones), then waited for before the flow, then stopped."""
    assert _fresh_command(tmp_path / "home") == [
        "launched: Prefect loaded False, settings passed False",
        "dlrmflow generate: starting a temporary local Prefect API (PREFECT_API_URL is not set) ...",
        "waited", "stopped"]


def test_a_profile_that_names_an_api_stops_the_server_launched_first_and_says_which_api(tmp_path):
    assert _fresh_command(tmp_path / "home", "http://127.0.0.1:1/api") == [
        "launched: Prefect loaded False, settings passed False",
        "dlrmflow generate: starting a temporary local Prefect API (PREFECT_API_URL is not set) ...",
        "stopped",
        "dlrmflow generate: using the Prefect API at http://127.0.0.1:1/api (PREFECT_API_URL)"]


@pytest.mark.parametrize(("argv", "started"), [  # (torch, trainers) of each start
    (["generate", "--rows", "10", "--output", "g.tsv"], [(False, False)]),  # data only: no torch on the workers
    (["preprocess", "raw.tsv", "--output", "ds"], [(False, False)]),
    (["profile", "ds"], [(False, False)]),
    (["plan", "ds", "--batch-size", "8", "--output", "p"], [(False, False)]),
    (["train", "ds", "--mode", "remote", "--output", "r"], [(False, False)]),  # embedding servers only
    (["train", "ds", "--mode", "oracle", "--plan", "p", "--output", "r"], [(False, False)]),
    (["train", "ds", "--mode", "remote", "--trainers", "2", "--output", "r"], [(True, True)]),  # trainers there
    (["daily", "landing", "--state-dir", "s"], [(True, False)]),  # scores and trains on the cluster
    (["demo"], [(True, False)]),
    (["train", "ds", "--mode", "local", "--output", "r"], []),  # no servers: no cluster
    (["train", "ds", "--mode", "remote", "--output", "r", "--dask-address", "tcp://10.0.0.1:8786"], []),
    (["verify", "r"], []),
])
def test_the_worker_server_starts_early_only_for_a_command_that_starts_a_local_cluster(monkeypatch, argv, started):
    """The server a LocalCluster's workers fork from starts with the command (its imports overlap the command's),
    only where the command will start a LocalCluster: not for a local run, one on the user's own cluster
    (--dask-address, or $DLRMFLOW_DASK_ADDRESS), or a command without a cluster. It imports torch only where a
    worker may train or score, and what a trainer imports besides only where trainers run on the workers."""
    calls = []
    monkeypatch.setattr("dlrmflow.engine.serving.cluster.start_worker_server",
                        lambda torch, trainers: calls.append((torch, trainers)))
    monkeypatch.delenv("DLRMFLOW_DASK_ADDRESS", raising=False)
    args = cli.build_parser().parse_args(argv)
    cli.start_local_cluster_workers_early(args._module, args)
    assert calls == started
    monkeypatch.setenv("DLRMFLOW_DASK_ADDRESS", "tcp://10.0.0.1:8786")
    cli.start_local_cluster_workers_early(args._module, args)
    assert calls == started
