"""What a flow run costs Prefect beyond its function: the same empty flows with Prefect's engine as shipped,
then with dlrmflow's flow decorator (``flows/prefect_internals.py``: a run's end does not wait for its
heartbeat thread), in one process against one temporary Prefect API.

Cases: an empty flow; a flow with one task; a flow with one subflow (two flow runs). Each is timed from
the call to its return, ``--runs`` times per side after one warm-up run; the table gives the medians.

    .venv/bin/python benchmarks/flow_overhead.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # read when prefect loads: no telemetry writes

import prefect  # noqa: E402
from prefect import task  # noqa: E402


def median_seconds(fn: Callable[[int], object], runs: int) -> float:
    fn(-1)  # warm-up: the first run of a flow registers it with the API
    times = []
    for i in range(runs):
        began = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def cases(make_flow: Callable) -> dict[str, Callable[[int], object]]:
    @task
    def one(x: int) -> int:
        return x + 1

    @make_flow
    def empty(x: int) -> int:
        return x

    @make_flow
    def with_task(x: int) -> int:
        return one(x)

    @make_flow
    def inner(x: int) -> int:
        return x + 1

    @make_flow
    def with_subflow(x: int) -> int:
        return inner(x)

    return {"empty flow": empty, "flow with one task": with_task, "flow with one subflow": with_subflow}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    from prefect import flow_engine
    from prefect.testing.utilities import prefect_test_harness

    from dlrmflow.flows import prefect_internals

    assert not hasattr(flow_engine._send_heartbeats, "unjoined"), "the baseline must be Prefect's engine as shipped"

    with prefect_test_harness(server_startup_timeout=120):
        shipped = {name: median_seconds(fn, args.runs) for name, fn in cases(prefect.flow).items()}
        ours = {name: median_seconds(fn, args.runs) for name, fn in cases(prefect_internals.flow).items()}
    print(f"Prefect {prefect.__version__}, Python {platform.python_version()}, {args.runs} runs per case "
          "(medians, call to return)")
    print("| case | Prefect's engine as shipped | dlrmflow's flow decorator | saved |")
    print("|---|---|---|---|")
    for name in shipped:
        print(f"| {name} | {shipped[name]:.3f} s | {ours[name]:.3f} s | {shipped[name] - ours[name]:.3f} s |")


if __name__ == "__main__":
    main()
