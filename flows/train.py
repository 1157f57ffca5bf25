"""The train flow: check the configuration, train (with embedding servers unless local), report.

Its parameter is one validated :class:`~dlrmflow.engine.training.config.TrainConfig`, whatever starts it
(``dlrmflow train``, a deployment, the pipeline). Its first task checks every input against the dataset,
the plan, the machine and the run directory (:func:`~dlrmflow.engine.training.run_setup.prepare_run`); the
checked run it returns goes to the train task as that task's input. Once the check passed, the flow says
so on :data:`INPUT_CHECKED` (the CLI holds the run's console lines until then, so that a run refused for
its input prints one line).

A run with ``checkpoint_every`` that fails or crashes leaves a checkpoint; the flow's hooks then
log the command that resumes it (``dlrmflow resume RUN_DIR``, or this flow with ``resume: true``
in its config) in the flow run's logs.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_run_logger
from prefect.logging.loggers import flow_run_logger

from dlrmflow.engine.serving.cluster import coded_cluster_workers, dask_scheduler
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.modes import MODES
from dlrmflow.engine.training.run_directory_checks import unfinished_run_message
from dlrmflow.engine.training.summary import train_summary
from dlrmflow.flows.prefect_internals import flow, untraced
from dlrmflow.flows.recovery import recovery_runner
from dlrmflow.flows.run_names import tag_this_run, train_run_name, train_tags
from dlrmflow.tasks.reporting import PHASES_LOGGER, PROGRESS, engine_events_to_run_log, train_run_label
from dlrmflow.tasks.train import check_task, publish_train_report_task, train_task

# One record, once the run's input check passed: a plain logger (not the run's), so that a listener in the
# calling process hears it whatever Prefect's log level is (dlrmflow.commands.console.HeldConsole).
INPUT_CHECKED = logging.getLogger("dlrmflow.flows.train.input_checked")


def log_resume_command(flow, flow_run, state) -> None:
    """on_failure / on_crashed: when the run dir holds an unfinished run with a checkpoint, say how to resume it."""
    try:
        config = flow_run.parameters.get("config")
        output_dir = config.get("output_dir") if isinstance(config, dict) else getattr(config, "output_dir", None)
        message = unfinished_run_message(output_dir)
    except Exception as exc:  # a hook must not hide the failure it reports on
        message = f"the checkpoint cannot be read ({exc})"
    if message:
        flow_run_logger(flow_run, flow).error("%s", message)


@flow(name="train", flow_run_name=train_run_name, on_failure=[log_resume_command], on_crashed=[log_resume_command])
def train_flow(config: TrainConfig, dask_address: str | None = None) -> dict[str, Any]:
    """Train the model ``config`` names (mode local | remote | lru | oracle); writes final_state/ (unless
    ``config.save_state`` is off), summary.json and iterations.csv into ``config.output_dir``.

    ``config.resume``: continue the unfinished run in ``output_dir`` from its checkpoint; every other setting
    must be the run's own (``dlrmflow resume RUN_DIR`` reads them from its run_config.json).

    The run is named for what it runs (``train-oracle-k2-r1``) and tagged with its mode and dataset;
    a kill, the loss it causes and the rebuild appear in its log as they happen."""
    logger = get_run_logger()
    tag_this_run(train_tags(config))
    setup = check_task(config)  # the first task: every input check (a UserInputError names the field)
    INPUT_CHECKED.info("%s: input checked", config.output_dir)
    n = setup.iterations
    logger.info("%s training: %d iterations of batch %d on %s", config.mode, n, config.batch_size, config.device)
    if config.resume:
        logger.info("resuming %s from its checkpoint at iteration %d", config.output_dir, setup.resume_at)
    if not MODES[config.mode].servers:
        trained = train_task(setup, None, return_state=True)
    else:
        # Each rebuild is a recover-shard child of this flow run, whatever thread notices the loss.
        runner = recovery_runner(train_run_label(config.mode, config.num_shards, config.parity,
                                                 config.output_dir)) if config.parity else None
        workers = coded_cluster_workers(config.num_shards, config.parity)
        with engine_events_to_run_log(logger, name=PHASES_LOGGER), \
                dask_scheduler(dask_address, n_workers=workers, trainers=config.trainers) as address:
            logger.info("embedding servers: %d shards on the Dask cluster at %s", config.num_shards, address)
            if config.trainers > 1:
                logger.info("%d trainers, each training %d rows of every batch", config.trainers,
                            config.batch_size // config.trainers)
            trained = train_task(setup, address, runner, return_state=True)
    summary = trained.result()
    logger.info("publishing the run's tables and plots ...", extra=PROGRESS)
    # The summary holds each recover-shard subflow's result (untraced); the report's one input is the train
    # task, by wait_for on its state with a stand-in for its data (Prefect looks into a state's data too).
    publish_train_report_task(*untraced(summary), wait_for=[trained.model_copy(update={"data": True})])
    done = train_summary(summary)
    auc = f"{done.eval_auc:.4f}" if done.eval_auc is not None else \
        "none (no rows held out)" if not summary.get("eval_rows") else "undefined (one class held out)"
    logger.info("done: %.2f ms/iteration, stall %.1f%%, eval AUC %s; state SHA-256 %s",
                done.mean_iteration_ms, 100 * done.stall_fraction, auc, done.state_sha256[:16], extra=PROGRESS)
    return summary
