"""A real Prefect server, the README's deployment commands and a process worker, for the deployment tests.

The README's deployment block, run as written: its ``prefect server start --port 4200`` on a free loopback port
instead, with its own PREFECT_HOME (so it never touches ~/.prefect, nor the session's ``prefect_harness`` server),
the server and the children given PREFECT_API_URL in their environment (what the README's ``prefect config set``,
first, puts in the profile: the server's UI then talks to that API, :func:`ui_api_url`); then the README's next lines
verbatim in a shell with the venv's ``bin`` first on PATH (what ``source .venv/bin/activate`` does): ``prefect
work-pool create``, ``prefect deploy --all``, ``prefect worker start``. tests/conftest.py makes a server and a
worker per test module (``prefect_server``, ``prefect_worker``), so that two modules' long runs go on in parallel.

They run in a copy of the project root (``prefect.yaml`` and the ``flows/`` its entrypoints name), as a user's
clone: the README's relative ``work_dir`` then lands in the test's temporary directory, not in this checkout's
``runs/``. This process's settings change only inside ``temporary_settings`` while it reads the API.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from process_helpers import stop_process_groups

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
README_SECTION = "### Prefect server, UI and deployments"
POOL = "dlrmflow"
START_TIMEOUT_S = 180  # a cold server start migrates a fresh SQLite database; 2 busy cores are slow
RUN_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_deployment_block(heading: str = README_SECTION) -> list[str]:
    """The shell commands of the first block under the README's ``heading`` (the Prefect deployment block):
    continuation lines joined (their backslash-newline kept, as a shell reads them), a ``# ...`` comment
    after a command left out."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    commands, pending = [], ""
    for line in block.splitlines():
        if line.endswith("\\"):
            pending += line + "\n"
            continue
        commands.append(pending + re.sub(r"\s+# .*$", "", line))
        pending = ""
    return commands


def readme_command(prefix: str) -> str:
    """The README block's one command that starts with ``prefix``."""
    [command] = [c for c in readme_deployment_block() if c.startswith(prefix)]
    return command


def readme_server_command(port: int) -> list[str]:
    """The README's ``prefect server start --port 4200`` as words, on ``port`` instead."""
    words = shell_words(readme_command("prefect server start"))
    return [str(port) if n and words[n - 1] == "--port" else word for n, word in enumerate(words)]


def ui_api_url(base_url: str) -> str:
    """The API URL that the server at ``base_url`` gives its UI (its ``/ui-settings``, which the UI's page
    reads first): where the UI looks for flow runs."""
    import json

    with urllib.request.urlopen(f"{base_url}/ui-settings", timeout=10) as response:
        return json.loads(response.read())["api_url"]


def shell_words(command: str) -> list[str]:
    """The words a POSIX shell makes of ``command`` (a backslash-newline joins two lines)."""
    return shlex.split(command.replace("\\\n", ""))


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


@dataclass
class PrefectServer:
    api_url: str
    env: dict[str, str]  # for child processes: this server, an isolated PREFECT_HOME, the venv first on PATH
    log_dir: Path
    project: Path  # the copy of the project root the commands run in

    @property
    def database(self) -> Path:
        """Prefect's default database in the server's PREFECT_HOME."""
        return Path(self.env["PREFECT_HOME"]) / "prefect.db"

    def shell(self, command: str, timeout: float = 300) -> str:
        """Run ``command`` as a user types it, in the project root; fail with its output if it fails."""
        done = subprocess.run(["bash", "-c", command], cwd=self.project, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            pytest.fail(f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done.stdout + done.stderr

    def start(self, name: str, command: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        """Start ``command`` in the background, in the project root; its output goes to ``NAME.log``."""
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.project,
                                    env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return proc, log


def _child_env(home: Path) -> dict[str, str]:
    # No PREFECT_* setting of this process (the test harness, the user's profile) leaks into the children;
    # no DLRMFLOW_DASK_ADDRESS either: the flow runs start their own LocalCluster.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DLRMFLOW_DASK_ADDRESS"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_COLORS="false",
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV_BIN.parent))
    return env


def _project_copy(base: Path) -> Path:
    """A project root as a clone has it, for what the deployments need: prefect.yaml and flows/."""
    project = base / "project"
    project.mkdir()
    (project / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
    (project / "flows").symlink_to(REPO / "flows", target_is_directory=True)
    return project


@contextmanager
def running_server(base: Path, database: Path | None = None) -> Iterator[PrefectServer]:
    """``prefect server start`` in ``base``, healthy; stopped afterwards. ``database``: a copy of it is the
    server's database (a migrated one saves the migration)."""
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    # The README sets PREFECT_API_URL before it starts the server, which tells the server's UI where its API is.
    env = {**_child_env(base / "home"), "PREFECT_API_URL": api_url}
    server = PrefectServer(api_url, env, base, _project_copy(base))
    if database is not None:
        server.database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(database, server.database)
    log = base / "server.log"
    with open(log, "wb") as out:
        # --no-scheduler: the nightly schedule must not create runs on the test server (one at 02:00 UTC
        # would start the full-size pipeline in the project directory).
        # The README's command on this port (``--port 4200`` replaced; the README gives it, so that a user who
        # changes the port sees both places), loopback only, without building the UI's files.
        command = [str(VENV_BIN / "prefect"), *readme_server_command(port)[1:], "--host", "127.0.0.1", "--no-ui",
                   "--analytics-off", "--no-scheduler"]
        proc = subprocess.Popen(command, cwd=base, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prefect server did not become healthy at {api_url}:\n{tail(log)}")
            time.sleep(1)
        yield server
    finally:
        stop_process_groups([proc])


@contextmanager
def polling_worker(prefect_server: PrefectServer) -> Iterator[Path]:
    """The pool, every deployment of prefect.yaml, and a process worker polling the pool, each made by the
    README's own command; yields the worker's log."""
    prefect_server.shell(readme_command("prefect work-pool create"))
    prefect_server.shell(readme_command("prefect deploy --all"))
    # Poll every 2 s instead of 10 s: the test waits for the run.
    proc, log = prefect_server.start("worker", readme_command("prefect worker start"),
                                     env={"PREFECT_WORKER_QUERY_SECONDS": "2"})
    try:
        yield log
    finally:
        # The worker turns SIGTERM into SIGINT and stops its flow runs; a hung one gets SIGKILL.
        stop_process_groups([proc], signal.SIGINT)


@contextmanager
def api(url: str):
    """A client of the test server; this process's own Prefect settings are back as they were afterwards."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def wait_for_final_state(url: str, run_id: str, worker_log: Path):
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with api(url) as client:
        while True:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            if time.monotonic() > deadline:
                pytest.fail(f"flow run {run_id} still {run.state_name} after {RUN_TIMEOUT_S} s; worker log:\n"
                            f"{tail(worker_log)}")
            time.sleep(2)
