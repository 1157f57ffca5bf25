"""The main job: generate (optional) -> preprocess -> profile, each a subflow.

Each step skips itself when its inputs and parameters are unchanged, so rerunning the
pipeline only redoes what changed. One Dask cluster serves every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from dlrmflow.engine.cluster import dask_scheduler
from dlrmflow.flows.dataset import generate_flow, preprocess_flow, profile_flow

DEMO_ROWS = 500_000
DEMO_SCALE = 0.05


@flow(name="pipeline")
def pipeline_flow(
    work_dir: str = "runs/demo",
    raw_inputs: list[str] | None = None,
    format: str = "criteo",
    rows: int = DEMO_ROWS,
    scale: float = DEMO_SCALE,
    seed: int = 0,
    dask_address: str | None = None,
) -> dict[str, Any]:
    """Without ``raw_inputs`` a synthetic Criteo-like file of ``rows`` rows is generated first."""
    logger = get_run_logger()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    with dask_scheduler(dask_address) as address:
        logger.info("Dask scheduler: %s", address)
        generated = None
        if raw_inputs is None:
            raw = str(work / "raw" / "train.tsv")
            Path(raw).parent.mkdir(parents=True, exist_ok=True)
            generated = generate_flow(raw, rows, seed, scale, address)
            raw_inputs, format = [raw], "criteo"
        dataset = str(work / "dataset")
        prep = preprocess_flow(raw_inputs, dataset, format=format, seed=seed, dask_address=address)
        profile = profile_flow(dataset, address)
    return {"work_dir": str(work), "generated": generated, "preprocess": prep, "profile": profile}
