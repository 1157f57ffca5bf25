"""The undocumented Prefect behaviour of :mod:`dlrmflow.flows.prefect_internals`, exercised for real.

Each test fails when a Prefect upgrade changes what a function relies on (run contexts kept in
contextvars, ``TaskRunContext.__var__``, how ``SubprocessASGIServer`` launches its server, how results are
linked to runs by ``id()``), naming the
function to fix, instead of as a recover-shard
flow run that is silently orphaned or logs under the wrong run.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dlrmflow.flows import prefect_internals
from dlrmflow.flows.prefect_internals import (
    SERVER_ENV,
    SERVER_MODULE_ARGS,
    TemporaryApi,
    TemporaryApiError,
    capture_run_context,
    outside_task_run,
    untraced,
    use_api_everywhere,
)

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _in_bare_thread(fn, *args) -> Any:
    """``fn(*args)`` in a plain thread, which starts with an empty context (as the prefetch worker does)."""
    results, errors = [], []

    def target() -> None:
        try:
            results.append(fn(*args))
        except BaseException as exc:  # handed back to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def test_capture_run_context_makes_a_flow_called_from_a_bare_thread_a_child_of_the_run():
    from prefect import flow, get_client, task
    from prefect.context import FlowRunContext

    @flow(name="internals-child")
    def child() -> Any:
        return FlowRunContext.get().flow_run.id

    @task
    def caller(captured: bool) -> list[Any]:
        if not captured:
            return [_in_bare_thread(child)]
        run = capture_run_context()
        runs: list[Any] = []
        # Two threads at once: each call enters its own copy of the captured context.
        threads = [threading.Thread(target=lambda: runs.append(run(child))) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return runs

    @flow(name="internals-parent")
    def parent(captured: bool) -> tuple[Any, list[Any]]:
        return FlowRunContext.get().flow_run.id, caller(captured)

    with get_client(sync_client=True) as client:
        parent_run, children = parent(True)
        assert len(children) == 2
        for child_run in children:
            run = client.read_flow_run(child_run)
            assert run.parent_task_run_id is not None, "capture_run_context: the flow run has no parent"
            assert client.read_task_run(run.parent_task_run_id).flow_run_id == parent_run
        # The control: without the captured context the thread's flow run is a top-level run.
        _, (orphan,) = parent(False)
        assert client.read_flow_run(orphan).parent_task_run_id is None


def test_untraced_arguments_of_a_subflows_result_are_not_taken_for_its_run():
    """A value inside a subflow's result, passed on to a task as is, becomes a ``flow_run`` input of that
    task (what the UI's task run pages reject); passed through ``untraced``, the task has no such input."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client

    @task
    def report(name: str, rows: list) -> int:
        return len(name) + len(rows)

    @flow
    def child() -> dict:
        return {"name": "day_0", "rows": [1, 2]}

    @flow
    def parent() -> tuple[Any, Any]:
        result = child()
        traced = report(result["name"], result["rows"], return_state=True)
        quoted = report(*untraced(result["name"], result["rows"]), return_state=True)
        return traced.state_details.task_run_id, quoted.state_details.task_run_id

    traced_id, quoted_id = parent()
    with get_client(sync_client=True) as client:
        traced, quoted = client.read_task_run(traced_id), client.read_task_run(quoted_id)
    assert {i.input_type for group in traced.task_inputs.values() for i in group} == {"flow_run"}
    assert all(not group for group in quoted.task_inputs.values()), quoted.task_inputs


def test_outside_task_run_hides_the_task_run_and_restores_it():
    from prefect import flow, get_client, get_run_logger, task
    from prefect.artifacts import create_table_artifact
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.context import FlowRunContext, TaskRunContext

    @flow(name="internals-report")
    def report() -> tuple[Any, dict[str, Any]]:
        create_table_artifact([{"a": 1}], key="internals-report")
        return FlowRunContext.get().flow_run.id, dict(get_run_logger().extra)

    @task
    def caller() -> tuple[Any, Any, dict[str, Any]]:
        task_run = TaskRunContext.get()
        assert task_run is not None
        with outside_task_run():
            assert TaskRunContext.get() is None, "outside_task_run: a task run is still current"
            assert FlowRunContext.get() is not None  # the flow run stays current
            report_run, extra = report()
        assert TaskRunContext.get() is task_run, "outside_task_run: the task run was not restored"
        return task_run.task_run.id, report_run, extra

    @flow(name="internals-reporter")
    def reporter() -> tuple[Any, Any, dict[str, Any]]:
        return caller()

    task_run_id, report_run, extra = reporter()
    assert extra["flow_run_id"] == str(report_run) and "task_run_id" not in extra  # logs: the subflow's own
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["internals-report"])), limit=1
        )
    assert artifact.flow_run_id == report_run and artifact.task_run_id != task_run_id


def test_the_temporary_api_runs_the_server_command_prefect_itself_launches(monkeypatch):
    """TemporaryApi launches what ``SubprocessASGIServer`` launches (the same uvicorn arguments and server
    environment; the port its own), under ``dlrmflow.exit_with_parent`` with this process's id."""
    import os
    import sys
    from types import SimpleNamespace

    from prefect.server.api import server as server_module
    from prefect.settings import get_current_settings

    launched = []

    def recording_popen(args, **kwargs):
        launched.append((list(args), kwargs.get("env", {})))
        return SimpleNamespace(poll=lambda: None, pid=0)

    monkeypatch.setattr(server_module.subprocess, "Popen", recording_popen)
    server_module.SubprocessASGIServer(port=1)._run_uvicorn_command()
    monkeypatch.setattr(prefect_internals.subprocess, "Popen", recording_popen)
    ours = TemporaryApi(1.0)
    ours.start()
    (theirs, their_env), (mine, my_env) = launched
    assert mine[:4] == [sys.executable, "-m", "dlrmflow.exit_with_parent", str(os.getpid())]
    assert theirs[:3] == [sys.executable, "-m", "uvicorn"], "Prefect's server command changed"
    their_port, my_port = theirs.index("--port") + 1, mine.index("--port") + 1
    assert sorted(theirs[2:their_port] + theirs[their_port + 1:]) == sorted(mine[4:my_port] + mine[my_port + 1:])
    assert SERVER_MODULE_ARGS[0] == "uvicorn" and set(SERVER_MODULE_ARGS) <= set(theirs)
    settings = get_current_settings().to_environment_variables(exclude_unset=True)
    assert {k: v for k, v in their_env.items() if os.environ.get(k) != v and k not in settings} == SERVER_ENV
    assert {k: my_env[k] for k in SERVER_ENV} == SERVER_ENV
    assert my_env["PREFECT_API_BLOCKS_REGISTER_ON_START"] == "false"
    assert mine[my_port] == str(ours.port)


def test_a_temporary_api_that_does_not_answer_in_time_is_one_line_and_leaves_no_server():
    """A real server start waited for 0.1 s (it needs seconds): TemporaryApiError naming the way out, and the
    server process is gone, not orphaned."""
    from process_helpers import running_children

    api = TemporaryApi(0.1)
    api.start()
    with pytest.raises(TemporaryApiError, match=r"^the temporary local Prefect API did not start \(it did not "
                                                r"answer within 0.1 s\); start one with `prefect server start`"):
        api.wait_until_answering()
    assert api.process.poll() is not None
    assert not [p for p, command in running_children() if "dlrmflow.exit_with_parent" in command]


def test_use_api_everywhere_reaches_bare_threads_and_puts_the_settings_back():
    """Within the block this thread and a plain thread (no context of its own: Prefect's log worker, the
    prefetch worker) read the given API URL; afterwards both read what they read before."""
    from prefect.settings import get_current_settings

    def url() -> str:
        return str(get_current_settings().api.url)

    before = (url(), _in_bare_thread(url))
    with use_api_everywhere("http://127.0.0.1:1/api"):
        assert url() == _in_bare_thread(url) == "http://127.0.0.1:1/api"
    assert (url(), _in_bare_thread(url)) == before


@pytest.mark.slow
def test_a_recovery_runner_called_from_a_bare_thread_starts_a_child_of_the_training_run():
    """The cause of the recover-shard nesting gap, in process and in seconds: the oracle trainer notices
    a loss in its prefetch worker, a plain thread whose context is empty. The runner made inside the
    task brings the task's context along; calling the bare runner from such a thread makes an orphan."""
    import threading

    from prefect import flow, get_client, task
    from prefect.context import FlowRunContext

    from dlrmflow.engine.coding.record import RecoveryRecord
    from dlrmflow.flows.recovery import recovery_runner, run_recovery_subflow

    def rebuild(progress=None):  # what rebuild_lost returns (a record of a rebuild that took 0.01 s), and the run
        record = RecoveryRecord(members=[0], detected_at=0.0, rebuilt_at=0.01, rows_rebuilt=8, chunks=1)
        return record.as_dict(k=2, start=0.0) | {"recovery_run": FlowRunContext.get().flow_run.id}

    @task
    def train_like(bound: bool):
        runner = recovery_runner() if bound else run_recovery_subflow
        results = []
        # Like engine/training/prefetch.py's worker: a thread that does not copy its creator's context.
        thread = threading.Thread(target=lambda: results.append(runner(rebuild, {"lost": ["data shard 0"],
                                                                                  "stripes": 8, "chunk": 8})))
        thread.start()
        thread.join()
        return results[0]["recovery_run"]

    @flow(name="train")
    def train_like_flow(bound: bool):
        return FlowRunContext.get().flow_run.id, train_like(bound)

    with get_client(sync_client=True) as client:
        for bound in (True, False):
            train_run, recovery_run = train_like_flow(bound)
            recovery = client.read_flow_run(recovery_run)
            assert client.read_flow(recovery.flow_id).name == "recover-shard"
            assert recovery.state.is_completed()
            if bound:
                assert recovery.parent_task_run_id is not None, "recover-shard run is not a subflow run"
                assert client.read_task_run(recovery.parent_task_run_id).flow_run_id == train_run
            else:  # Prefect finds no parent in the thread's context: a top-level run
                assert recovery.parent_task_run_id is None


@pytest.mark.usefixtures("prefect_harness")
def test_a_rebuild_that_the_run_s_stop_cut_short_ends_its_recover_shard_run_cancelled_without_a_traceback(caplog):
    """A run that stops (the scheduler lost, a trainer lost) closes its shard group while a rebuild may be in
    flight: that recover-shard run ends Cancelled, saying so, not Failed with the group's error and a traceback."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from dlrmflow.engine.coding.rebuild_state import GroupClosedError
    from dlrmflow.flows.recovery import run_recovery_subflow

    def rebuild(progress=None):
        raise GroupClosedError("the shard group is closed")

    with pytest.raises(BaseException) as stopped:  # the caller (the rebuild's thread) only notes the outcome
        run_recovery_subflow(rebuild, {"lost": ["data shard 0"], "stripes": 8, "chunk": 8})
    assert not isinstance(stopped.value, GroupClosedError)
    with get_client(sync_client=True) as client:  # the session's latest recover-shard run: this one
        [run] = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["recover-shard"])),
                                      sort=FlowRunSort.START_TIME_DESC, limit=1)
    assert run.state.is_cancelled(), run.state
    assert run.state.message == "the training run stopped before the rebuild of data shard 0 ended"
    assert not any(record.exc_info for record in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_flow_run_ends_without_joining_its_heartbeat_thread(monkeypatch):
    """flow_runs_end_without_waiting_for_heartbeats: the sync engine starts each run's heartbeats through
    ``prefect.flow_engine._send_heartbeats`` (a flow and its subflow: two runs), never joining the thread."""
    import contextlib

    from prefect import flow, flow_engine

    calls: list[bool] = []
    original = getattr(flow_engine._send_heartbeats, "unjoined", flow_engine._send_heartbeats)  # Prefect's own

    @contextlib.contextmanager
    def spy(engine, join_on_exit=True):
        calls.append(join_on_exit)
        with original(engine, join_on_exit=join_on_exit):
            yield

    monkeypatch.setattr(flow_engine, "_send_heartbeats", spy)
    prefect_internals.flow_runs_end_without_waiting_for_heartbeats()
    assert flow_engine._send_heartbeats is not spy
    prefect_internals.flow_runs_end_without_waiting_for_heartbeats()  # idempotent: one wrapper, not two

    @flow
    def inner() -> int:
        return 1

    @flow
    def outer() -> int:
        return inner() + 1

    assert outer() == 2
    assert calls == [False, False]
