"""The main job: generate (optional) -> preprocess -> profile -> plan -> train, each a subflow.

Every step skips itself when its inputs and parameters are unchanged (generate and preprocess
by their own fingerprints; profile, plan and training runs when their saved result names the
same dataset fingerprint and parameters), so rerunning the pipeline redoes only what changed.
The parameters are one validated model, :class:`PipelineConfig`: a bad value fails before any
work with a message naming the field. Each step gets its own validated config (``PreprocessConfig``,
``ProfileConfig``, ``PlanJobConfig``, ``TrainConfig``), asks it whether the step is up to date, and
returns a typed result (``PreprocessResult``, ``ProfileResult``, ``PlanResult``, ``TrainSummary``)
whose attributes the pipeline reads; its own result is their JSON form.

remote and oracle train twice: on a LocalCluster (servers on this machine, no network between
them and the trainer), and with ``link_rate`` set, with their embedding servers behind an emulated
link of that rate (docs/network.md). Where the link cannot be built (no root or CAP_NET_ADMIN), the
summary says so in its row and the pipeline goes on.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prefect import get_run_logger, tags

from dlrmflow.datasets.preprocess_config import PreprocessConfig
from dlrmflow.engine.planning.cache_policies import capacity_sweep
from dlrmflow.engine.planning.planner import PlanJobConfig
from dlrmflow.engine.planning.profile import ProfileConfig, ProfileResult
from dlrmflow.engine.serving.cluster import coded_cluster_workers, dask_scheduler, shaped_scheduler
from dlrmflow.engine.serving.shaped_link import LinkUnavailableError
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.modes import MODES
from dlrmflow.engine.training.summary import TrainSummary, saved_run, train_summary
from dlrmflow.flows.dataset import generate_flow, preprocess_flow, profile_flow
from dlrmflow.flows.pipeline_config import PipelineConfig
from dlrmflow.flows.plan import compare_caches_flow, plan_flow
from dlrmflow.flows.prefect_internals import flow, untraced
from dlrmflow.flows.run_names import pipeline_run_name, pipeline_tags, tag_this_run
from dlrmflow.flows.train import train_flow
from dlrmflow.tasks.pipeline_report import publish_pipeline_summary_task
from dlrmflow.tasks.reporting import Column, artifact_key, format_table, run_dir_label


def _trainers(cfg: PipelineConfig, mode: str) -> int:
    """The pipeline's ``trainers`` train every remote and oracle run, parity's included, so that the runs it
    compares bit for bit train the same way; a local run has one."""
    return cfg.trainers if MODES[mode].several_trainers else 1


def _train_config(cfg: PipelineConfig, dataset: str, plan_dir: str | None, mode: str, parity: int, name: str,
                  kills: list[str]) -> TrainConfig:
    """Training run ``name`` (runs/NAME in the work dir)."""
    return TrainConfig(dataset_dir=dataset, mode=mode, output_dir=str(Path(cfg.work_dir) / "runs" / name),
                       batch_size=cfg.batch_size, iterations=cfg.train_iterations, num_shards=cfg.shards,
                       plan_dir=plan_dir, seed=cfg.seed, parity=parity, kills=kills, model=cfg.model,
                       trainers=_trainers(cfg, mode))


def _train(cfg: PipelineConfig, config: TrainConfig, fingerprint: str, dask_address: str) -> TrainSummary:
    """The training run ``config`` on the Dask cluster at ``dask_address``, skipped when up to date."""
    earlier = saved_run(config, fingerprint)
    if earlier is not None:
        get_run_logger().info("training run %s is up to date: skipped", config.output_dir)
        return earlier
    return train_summary(train_flow(config, dask_address))


LINK_MODES = ("remote", "oracle")


def _train_behind_link(cfg: PipelineConfig, dataset: str, plan_dir: str, fingerprint: str
                       ) -> tuple[dict[str, TrainSummary], str | None]:
    """remote and oracle again, their embedding servers behind a ``link_rate`` Mbit/s emulated link
    (:func:`~dlrmflow.engine.serving.cluster.shaped_scheduler`): ``({"remote_link": ..., "oracle_link": ...}, None)``,
    or ``({}, why)`` when the link cannot be built here or the runs use the user's own cluster. The link is
    built only when a run is not up to date."""
    if cfg.dask_address:
        return {}, f"the runs use the Dask cluster at {cfg.dask_address}"
    plans = {"remote": None, "oracle": plan_dir}
    configs = {mode: _train_config(cfg, dataset, plans[mode], mode, 0, f"{mode}-link{cfg.link_rate}mbit", [])
               for mode in LINK_MODES}
    saved = {mode: saved_run(config, fingerprint) for mode, config in configs.items()}
    if all(saved.values()):
        get_run_logger().info("training runs behind the %d Mbit/s link are up to date: skipped", cfg.link_rate)
        return {f"{mode}_link": run for mode, run in saved.items()}, None
    with ExitStack() as stack:
        try:
            address = stack.enter_context(shaped_scheduler(cfg.link_rate * 1_000_000, n_servers=cfg.shards,
                                                           trainers=cfg.trainers))
        except LinkUnavailableError as exc:
            get_run_logger().warning("runs behind the emulated link skipped: %s", exc)
            return {}, str(exc)
        get_run_logger().info("embedding servers behind a %d Mbit/s link: scheduler %s", cfg.link_rate, address)
        with tags(f"link:{cfg.link_rate}mbit"):  # in the UI, tells these runs from the unshaped ones of the same name
            return {f"{mode}_link": _train(cfg, config, fingerprint, address) for mode, config in configs.items()}, None


@flow(name="pipeline", flow_run_name=pipeline_run_name)
def pipeline_flow(config: PipelineConfig = PipelineConfig()) -> dict[str, Any]:  # noqa: B008 - immutable use
    """Generate or read raw data, preprocess, profile, plan, compare caches, train remote vs oracle (unshaped,
    and behind a ``link_rate`` Mbit/s emulated link).

    The run is named ``pipeline-<work dir label>`` and tagged (:func:`pipeline_tags`); every step run is
    tagged ``dataset:<work dir name>``."""
    tag_this_run(pipeline_tags(config))
    with tags(f"dataset:{artifact_key(Path(config.work_dir).resolve().name)}"):
        return _pipeline(config)


def _pipeline(config: PipelineConfig) -> dict[str, Any]:
    """The pipeline's steps, in the pipeline's flow run (see :func:`pipeline_flow`)."""
    cfg = config
    logger = get_run_logger()
    work = Path(cfg.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"work_dir": str(work), "generated": None}
    # One cluster for every step, training included, sized as the train flow's own (as the daily flow's). Only
    # the runs behind the emulated link need a cluster of their own.
    workers = coded_cluster_workers(cfg.shards, cfg.parity)
    with dask_scheduler(cfg.dask_address, n_workers=workers, trainers=cfg.trainers) as address:
        logger.info("Dask scheduler: %s", address)
        raw_inputs, fmt = cfg.raw_inputs, cfg.format
        if not raw_inputs:
            raw = work / "raw" / "train.tsv"
            raw.parent.mkdir(parents=True, exist_ok=True)
            result["generated"] = generate_flow(str(raw), cfg.rows, cfg.seed, cfg.scale, address)
            raw_inputs, fmt = [str(raw)], "criteo"  # the generator writes raw Criteo TSV
        dataset = str(work / "dataset")
        preprocess = preprocess_flow(PreprocessConfig(inputs=raw_inputs, output=dataset, format=fmt, seed=cfg.seed),
                                     dask_address=address)
        result["preprocess"] = preprocess.as_dict()
        cfg.check_rows(preprocess.rows)  # raw_inputs' rows are known only now: before profile, plan and training
        fingerprint = preprocess.fingerprint

        profile_config = ProfileConfig(dataset_dir=dataset)
        profile = profile_config.saved_result()
        if profile is None:
            profile = profile_flow(profile_config, address)
        else:
            logger.info("profile of %s is up to date: skipped", dataset)
        result["profile"] = profile.as_dict(coverage=False)

        plan_dir = str(work / "plan")
        plan_config = PlanJobConfig(dataset_dir=dataset, output_dir=plan_dir, batch_size=cfg.batch_size,
                                    lookahead=cfg.lookahead, prefetch_distance=cfg.prefetch_distance)
        plan = plan_config.saved_result()
        if plan is None:
            plan = plan_flow(plan_config, dask_address=address)
        else:
            logger.info("plan %s is up to date: skipped", plan_dir)
        result["plan"] = plan.as_dict()
        # A sweep of capacities around cache_fraction: the plot shows each policy as a line.
        sweep = capacity_sweep(cfg.cache_fraction, preprocess.embedding_rows)
        result["caches"] = compare_caches_flow(dataset, cfg.batch_size, sweep, cfg.lookahead, cfg.prefetch_distance,
                                               output_dir=str(work / "caches"))

        runs = {mode: _train(cfg, _train_config(cfg, dataset, plans, mode, 0, mode, []), fingerprint, address)
                for mode, plans in (("remote", None), ("oracle", plan_dir))}
        link_skipped = None
        if cfg.link_rate:
            behind_link, link_skipped = _train_behind_link(cfg, dataset, plan_dir, fingerprint)
            runs.update(behind_link)
        if cfg.parity:  # last: its kills take workers of the cluster down
            runs["oracle_parity"] = _train(cfg, _train_config(cfg, dataset, plan_dir, "oracle", cfg.parity,
                                                              f"oracle-parity{cfg.parity}", cfg.kills), fingerprint,
                                           address)
    result["train"] = {name: {key: getattr(run, key) for key in SUMMARY_KEYS} for name, run in runs.items()}
    result["link"] = {"rate_mbit": cfg.link_rate, "skipped": link_skipped}
    result["summary"] = summary_rows(profile, result["caches"], runs, link_skipped, cfg)
    table = format_table(result["summary"], SUMMARY_COLUMNS)
    publish_pipeline_summary_task(*untraced(artifact_key("pipeline-summary", run_dir_label(work)), str(work), table))
    return result


SUMMARY_COLUMNS = [Column("What", "what"), Column("Value", "value"), Column("Baseline", "baseline"),
                   Column("Comparison", "ratio")]
SUMMARY_KEYS = ("mode", "iterations", "mean_iteration_ms", "median_iteration_ms", "stall_fraction",
                "bytes_fetched", "bytes_written_back", "final_train_loss", "eval_auc", "eval_log_loss",
                "state_sha256", "parity", "skipped", "output_dir")


def summary_rows(profile: ProfileResult, caches: dict[str, Any], train: dict[str, TrainSummary],
                 link_skipped: str | None, cfg: PipelineConfig) -> list[dict[str, Any]]:
    """The final table: skew, cache hit rate vs LRU, iteration time vs remote, parity overhead."""
    rows = [{"what": "top 1% of embedding rows take", "value": f"{100 * profile.top1pct_share:.1f}%",
             "baseline": "", "ratio": ""}]
    # The policies at the capacity of cache_fraction (the sweep's capacity nearest to it).
    at = min(caches["capacities"], key=lambda c: abs(c - cfg.cache_fraction * caches["total_rows"]))
    policies = {r["policy"]: r for r in caches["rows"] if r["capacity"] == at}
    lru, oracle = policies.get("lru"), policies.get("oracle")
    if lru and oracle:
        def rate(r: dict[str, Any]) -> str:
            return "infeasible" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"

        rows.append({"what": f"cache hit rate, oracle vs LRU ({lru['capacity']:,} rows)", "value": rate(oracle),
                     "baseline": rate(lru), "ratio": oracle["note"] or lru["note"]})
    remote, orc = train["remote"], train["oracle"]
    rows.append({"what": "iteration time, oracle vs remote (median)",
                 "value": f"{orc.median_iteration_ms:.1f} ms", "baseline": f"{remote.median_iteration_ms:.1f} ms",
                 "ratio": _faster(remote.median_iteration_ms, orc.median_iteration_ms)})
    rows.append({"what": "oracle stall (share of iteration time)", "value": f"{100 * orc.stall_fraction:.1f}%",
                 "baseline": "", "ratio": ""})
    rows.append({"what": "fetched, oracle vs remote", "value": f"{orc.bytes_fetched / 1e6:.3g} MB",
                 "baseline": f"{remote.bytes_fetched / 1e6:.3g} MB", "ratio": ""})
    same = orc.state_sha256 == remote.state_sha256
    rows.append({"what": "final state, oracle vs remote", "value": "bit-identical" if same else "DIFFERENT",
                 "baseline": "", "ratio": ""})
    rows += link_rows(train, link_skipped, cfg)
    if "oracle_parity" in train:
        par = train["oracle_parity"]
        overhead = par.median_iteration_ms / orc.median_iteration_ms - 1
        rows.append({"what": f"parity R={cfg.parity}: iteration time vs no parity (median)",
                     "value": f"{par.median_iteration_ms:.1f} ms",
                     "baseline": f"{orc.median_iteration_ms:.1f} ms",
                     "ratio": f"{100 * overhead:+.1f}%"})
        same = par.state_sha256 == orc.state_sha256
        rows.append({"what": "final state with parity" + (" and kills" if cfg.kills else ""),
                     "value": "bit-identical" if same else "DIFFERENT", "baseline": "", "ratio": ""})
    return rows


def _faster(baseline_ms: float, ms: float) -> str:
    speedup = baseline_ms / ms
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def link_rows(train: dict[str, TrainSummary], link_skipped: str | None, cfg: PipelineConfig) -> list[dict[str, Any]]:
    """Oracle vs remote behind the emulated link: iteration time, stall, final state; one row saying why
    when the runs were skipped; none when ``link_rate`` is 0."""
    if not cfg.link_rate:
        return []
    what = f"iteration time behind a {cfg.link_rate} Mbit/s link, oracle vs remote (median)"
    if "oracle_link" not in train:
        return [{"what": what, "value": "skipped", "baseline": "", "ratio": link_skipped}]
    remote, orc = train["remote_link"], train["oracle_link"]
    same = remote.state_sha256 == orc.state_sha256 == train["oracle"].state_sha256
    return [
        {"what": what, "value": f"{orc.median_iteration_ms:.1f} ms",
         "baseline": f"{remote.median_iteration_ms:.1f} ms",
         "ratio": _faster(remote.median_iteration_ms, orc.median_iteration_ms)},
        {"what": f"stall behind the {cfg.link_rate} Mbit/s link, oracle vs remote",
         "value": f"{100 * orc.stall_fraction:.1f}%", "baseline": f"{100 * remote.stall_fraction:.1f}%",
         "ratio": ""},
        {"what": "final state behind the link, vs unshaped", "value": "bit-identical" if same else "DIFFERENT",
         "baseline": "", "ratio": ""},
    ]
