"""The ``dlrmflow`` command line.

Every command runs its Prefect flow (so each run shows up in the Prefect UI when a server is
configured, and in an ephemeral local API otherwise), prints a human summary, or with
``--json`` exactly one JSON object on stdout. Bad input exits with status 2 and one line
on stderr naming the problem.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from types import ModuleType

from dlrmflow import __version__
from dlrmflow.errors import UserInputError

COMMANDS = ["demo", "generate", "preprocess", "profile", "train", "resume", "plan", "compare-caches", "verify"]


def _modules() -> list[ModuleType]:
    return [importlib.import_module(f"dlrmflow.commands.{name.replace('-', '_')}") for name in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlrmflow",
        description="Train DLRMs with huge embedding tables: preprocess, profile, plan, train.",
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


def main(argv: list[str] | None = None) -> int:
    # The local Prefect API would otherwise try to phone home and log an error on every run
    # on machines without internet access; a user's own setting wins.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    args = build_parser().parse_args(argv)
    module: ModuleType = args._module
    _hide_user_error_tracebacks()
    if args.json:
        # stdout carries the JSON object only; Prefect's own console output stays on stderr.
        logging.getLogger("prefect").setLevel(logging.WARNING)
    try:
        result = module.run(args)
    except UserInputError as exc:
        print(f"dlrmflow {module.NAME}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dlrmflow {module.NAME}: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(module.summarize(result))
    return 0


def add_dask_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dask-address",
        default=None,
        metavar="ADDR",
        help="scheduler of an existing Dask cluster (default: $DLRMFLOW_DASK_ADDRESS, else a LocalCluster)",
    )


if __name__ == "__main__":
    raise SystemExit(main())
