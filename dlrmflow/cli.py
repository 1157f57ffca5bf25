"""The ``dlrmflow`` command line.

Every command runs its Prefect flow (so each run shows up in the Prefect UI when a server is
configured, and in a temporary local API otherwise: see :func:`temporary_prefect_api`), prints a human
summary, or with ``--json`` exactly one JSON object on stdout. Bad input exits with status 2 and one
line on stderr naming the problem.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from dlrmflow import __version__
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.training.timing import LAUNCHED_AT_ENV

if TYPE_CHECKING:  # Prefect loads only once the options passed
    from dlrmflow.flows.prefect_internals import TemporaryApi

# How long a command waits for its temporary local Prefect API to answer. A cold start imports the
# server and migrates its database: seconds on an idle machine, a minute or more on busy cores.
# PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS raises it (Prefect's own default is 20 s).
API_STARTUP_TIMEOUT_S = 120

COMMANDS = ["demo", "daily", "generate", "preprocess", "profile", "train", "resume", "evaluate", "predict", "plan",
            "compare-caches", "verify", "export"]


def _modules() -> list[ModuleType]:
    return [importlib.import_module(f"dlrmflow.commands.{name.replace('-', '_')}") for name in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlrmflow",
        description="Train CTR models (DLRM, Wide & Deep, DeepFM, DCN-v2) with huge embedding tables.",
    )
    parser.add_argument("--version", action="version", version=f"dlrmflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a summary")
        p.set_defaults(_module=module)
    return parser


def _hide_user_error_tracebacks() -> None:
    """Bad input is reported as one line; keep Prefect from logging its traceback first.

    Prefect logs every exception that ends a task or flow run with its traceback. For a
    UserInputError that traceback is noise (the message says everything), so records carrying
    one lose their exc_info; any other exception keeps its traceback.
    """
    make_record = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        if record.exc_info and isinstance(record.exc_info[1], UserInputError):
            record.exc_info = None
        return record

    logging.setLogRecordFactory(factory)


# What a command says when it starts its temporary API (the seconds until its flow's first line are that server's).
STARTING_API = "starting a temporary local Prefect API (PREFECT_API_URL is not set) ..."
# Settings in the environment that decide whether a temporary API may start at all (Prefect's name and its alias).
EPHEMERAL_SETTINGS = ("PREFECT_SERVER_EPHEMERAL_ENABLED", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE")


def temporary_prefect_api(say: Callable[[str], None] = lambda line: None) -> TemporaryApi | None:
    """Without ``PREFECT_API_URL``: the command's temporary local Prefect API, its server launched now (its
    seconds of start-up overlap the command's imports; ``say`` gets :data:`STARTING_API` once it is launched);
    the command waits for it before its flow runs
    (:meth:`~dlrmflow.flows.prefect_internals.TemporaryApi.wait_until_answering`: on busy cores up to
    :data:`API_STARTUP_TIMEOUT_S`, and a server that does not answer is one line naming ``PREFECT_API_URL``).
    With ``PREFECT_API_URL`` set (the environment, a profile): None, no server, and ``say`` names that API (a
    command's first line, within a second of its launch, as with a temporary API).

    In a process that has not loaded Prefect yet (the ``dlrmflow`` command), the server is launched, and said,
    before Prefect's settings load here: they take 1.2 s, and the server reads the same ones itself. When a
    profile names an API after all, that server is stopped (it ran for that second)."""
    if os.environ.get("PREFECT_API_URL"):
        say(f"using the Prefect API at {os.environ['PREFECT_API_URL']} (PREFECT_API_URL)")
        return None  # without loading Prefect's settings
    from dlrmflow.flows.prefect_internals import SERVER_WAY_OUT, TemporaryApi

    api = TemporaryApi(API_STARTUP_TIMEOUT_S)
    launched_first = "prefect" not in sys.modules and not any(name in os.environ for name in EPHEMERAL_SETTINGS)
    if launched_first:
        api.start(pass_settings=False)
        say(STARTING_API)
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        if launched_first:
            api.stop()
        say(f"using the Prefect API at {settings.api.url} (PREFECT_API_URL)")
        return None
    if not settings.server.ephemeral.enabled:
        raise UserInputError(f"no Prefect API: PREFECT_API_URL is not set and PREFECT_SERVER_ALLOW_EPHEMERAL_MODE "
                             f"is off; {SERVER_WAY_OUT}")
    api.timeout_s = max(API_STARTUP_TIMEOUT_S, settings.server.ephemeral.startup_timeout_seconds)
    if not launched_first:
        api.start()
        say(STARTING_API)
    return api


def start_local_cluster_workers_early(module: ModuleType, args: argparse.Namespace) -> None:
    """For a command that will start a LocalCluster (its module's ``starts_local_cluster(args)``, and no Dask
    address given): the server its workers fork from, started now. It imports the engine (and torch: 2.3 s on a
    quiet core) while the command imports its flows and its temporary Prefect API starts, instead of when the flow
    starts the cluster (which then takes 0.2 s instead of 2.5). Without torch where the module's
    ``workers_use_torch(args)`` says no worker trains or scores; with what a trainer imports where its workers
    will train (``trains_on_cluster(args)``: ``--trainers`` 2 or more)."""
    from dlrmflow.engine.serving.cluster import resolve_address, start_worker_server

    if getattr(module, "starts_local_cluster", lambda _: False)(args) and \
            resolve_address(getattr(args, "dask_address", None)) is None:
        start_worker_server(torch=getattr(module, "workers_use_torch", lambda _: True)(args),
                            trainers=getattr(module, "trains_on_cluster", lambda _: False)(args))


def import_flows(module: ModuleType) -> None:
    """Import what a command will import, while its temporary Prefect API starts (the seconds it would otherwise
    wait for it): ``module.FLOWS``, its flows module, then what its flow loads later (torch's deterministic
    settings where it trains or scores, matplotlib where it plots)."""
    for name in module.FLOWS:
        importlib.import_module(name)


def _progress_only_on_the_console() -> list[tuple[logging.Handler, logging.Filter]]:
    """Prefect's console handlers show warnings and progress lines only; returns what to undo."""
    import prefect.main  # noqa: F401
    from prefect.logging.handlers import PrefectConsoleHandler

    from dlrmflow.tasks.reporting import is_progress

    def only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or is_progress(record)

    installed = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            handler.addFilter(only)
            installed.append((handler, only))
    return installed


def _launched_at() -> float:
    """This process's start (wall clock, seconds since the epoch): the interpreter's start-up counts too."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil, or no /proc: from here
        return time.time()


def main(argv: list[str] | None = None) -> int:
    # The local Prefect API would otherwise try to phone home and log an error on every run
    # on machines without internet access; a user's own setting wins.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # When this command started (summary.json's startup_seconds counts from it): the process's start when
    # it is the command, else (main() called in-process: tests, notebooks) now.
    launched = os.environ.get(LAUNCHED_AT_ENV)
    os.environ[LAUNCHED_AT_ENV] = repr(_launched_at() if argv is None else time.time())
    args = build_parser().parse_args(argv)
    module: ModuleType = args._module
    _hide_user_error_tracebacks()
    quiet: list[tuple[logging.Handler, logging.Filter]] = []
    api = None
    try:
        # The options' own checks (a command's ``check``) come before Prefect, torch, Dask or pandas load:
        # a bad option is refused in a fraction of a second.
        getattr(module, "check", lambda _: None)(args)
        api = temporary_prefect_api(lambda line: print(f"dlrmflow {module.NAME}: {line}", file=sys.stderr, flush=True))
        start_local_cluster_workers_early(module, args)
        if args.json:
            # stdout carries the JSON object only; on stderr, Prefect's console shows warnings and progress
            # (tasks.reporting.PROGRESS: steps done, phases, engine events), not its other lines. Prefect
            # configures its handlers when its flow API is first imported: do that first.
            quiet = _progress_only_on_the_console()
        if api is not None:
            import_flows(module)  # the command's own imports, while the server starts
            api.wait_until_answering()
        result = module.run(args)
    except UserInputError as exc:
        print(f"dlrmflow {module.NAME}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dlrmflow {module.NAME}: interrupted", file=sys.stderr)
        return 130
    finally:
        if api is not None:
            api.stop()  # SIGTERM, no wait: the server ends on its own, with this process at the latest
        for handler, only in quiet:  # main() called in-process (tests, notebooks) leaves logging as it was
            handler.removeFilter(only)
        if launched is None:
            os.environ.pop(LAUNCHED_AT_ENV, None)
        else:
            os.environ[LAUNCHED_AT_ENV] = launched
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(module.summarize(result))
    # A command whose result can be a failure (verify's mismatch) says so: one line on stderr, its status.
    failure = getattr(module, "failure", lambda _: None)(result)
    if failure is not None:
        status, message = failure
        print(f"dlrmflow {module.NAME}: {message}", file=sys.stderr)
        return status
    return 0


def add_dask_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dask-address",
        default=None,
        metavar="ADDR",
        help="scheduler of an existing Dask cluster (default: $DLRMFLOW_DASK_ADDRESS, else a LocalCluster)",
    )


def run_command() -> None:
    """The ``dlrmflow`` console script: :func:`main`, then an exit without the interpreter's teardown.

    Once the command is done, a normal exit still frees every module and object of torch, Prefect, Dask and
    pandas one by one: 1.5 s on 2 cores after the summary, the shell prompt waiting for nothing. Here the
    process does what that exit does that matters (waits for its non-daemon threads, runs the ``atexit``
    hooks: Prefect's log and event flush, Dask's client close, the logging handlers' flush; flushes stdout
    and stderr) and then ends at once (``os._exit``) with the command's status."""
    import atexit
    import threading

    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`dlrmflow ... | head`): nothing more can be said there
            pass
    os._exit(code)


if __name__ == "__main__":
    run_command()
