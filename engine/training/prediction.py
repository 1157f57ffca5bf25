"""A finished run's model scoring new rows: ``dlrmflow predict RUN_DIR INPUT... --output OUT``.

INPUT is a preprocessed dataset directory whose vocabulary keeps the run's ids (as for ``dlrmflow
evaluate``), or raw files of the run's format. Raw files go through the run's dataset vocabulary exactly
as ``dlrmflow preprocess --vocabulary`` maps them, because preprocess itself maps them: it writes a
temporary dataset (its ids: values the run's dataset has keep their ids, new ones take the next ids, rare
ones 0), and the raw rows, read again in input order, are mapped through that dataset's vocabulary files
(preprocess shuffles its rows; the predictions are numbered by the input's own order). A value the run
never had reads as a continued run would start its row (:func:`~.scoring.scoring_setup`), and the result
counts them.

The rows are scored as :mod:`.cluster_scoring` scores held-out rows: parts of whole batches, a Dask task
per part on the cluster or one part after another in this process, each reading its rows by id from the
run's ``final_state/`` files, memory-mapped; each part's task writes its rows' predictions,
``part-NNNNN.parquet`` with ``row`` (the input's row number: the dataset's row, or for raw files the
position among the accepted rows of the inputs in the given order), ``probability`` (float32, the bits
the evaluation computes) and ``label``. The parts' score summaries merge exactly into the AUC and log loss.

Everything is written under ``PARENT/.OUT.partial`` and renamed to OUT at the end: a failure (bad
input, a part that fails, an interrupt) leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlrmflow.datasets.formats import RawFormat, get_format, parse_block
from dlrmflow.datasets.meta import DatasetMeta, PartFile, read_meta, write_meta
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.phases import PhaseProgress, phase_reported
from dlrmflow.engine.row_files import open_rows
from dlrmflow.engine.run_lock import output_lock
from dlrmflow.engine.training.continuation import FinishedRun, parent_cardinalities, read_finished_run

if TYPE_CHECKING:
    from distributed import Client

SUMMARY_FILE = "_predict.json"  # the result, beside the parts (readers of a Parquet directory skip "_" names)
WORK_DIR = "_work"  # the temporary datasets of raw input, in the staging directory, removed before the rename
FIRST_LINES_CHECKED = 100  # raw input lines parsed before the work starts: a wrong format is refused at once


class PredictionError(UserInputError):
    """An input of ``dlrmflow predict`` cannot be scored: names the input and why."""


@dataclass(frozen=True)
class PredictionInput:
    """The checked inputs of a prediction: ``kind`` ``dataset`` (``paths``: its directory) or ``raw``
    (``paths``: the files; ``vocabulary``: the run's dataset, ``format`` its raw format)."""

    run: FinishedRun
    kind: str
    paths: tuple[str, ...]
    output: str
    format: str
    vocabulary: str | None = None


def staging_dir(output: str | os.PathLike) -> Path:
    """Where a prediction is written before it is renamed to ``output``."""
    path = Path(output).resolve()
    return path.parent / f".{path.name}.partial"


def check_final_state(run: FinishedRun, where: str) -> None:
    """The final state's files are there and whole in shape: ``dense.pt``, and shard files of float32
    rows of the manifest's width adding up to its rows (a truncated file fails to map). Its SHA-256 over
    every row is ``dlrmflow verify``'s (reading a terabyte table is not a check before scoring)."""
    state = Path(run.state_dir)
    manifest = run.manifest
    try:
        dense = state / manifest["dense"]["file"]
        shards, total, width = manifest["shards"], int(manifest["total_rows"]), int(manifest["width"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PredictionError(f"{where}: final_state/manifest.json is not a final state's manifest ({exc!r})") from None
    if not dense.is_file() or dense.stat().st_size == 0:
        raise PredictionError(f"{where}: the final state's dense parameters {dense} are missing or empty")
    rows = 0
    for entry in shards:
        path = state / entry["file"]
        try:
            shard = open_rows(path)
        except (OSError, ValueError) as exc:
            raise PredictionError(f"{where}: the final state's shard file {path} cannot be read: {exc}") from None
        if shard.shape[1] != width:
            raise PredictionError(f"{where}: {path} holds rows of width {shard.shape[1]}, the manifest says {width}")
        rows += shard.shape[0]
    if rows != total:
        raise PredictionError(f"{where}: the final state's shard files hold {rows} rows, its manifest {total}")


def run_dataset_dir(run: FinishedRun, where: str) -> str:
    """The dataset ``run`` trained on (its vocabulary maps raw input): PredictionError when it is gone or
    was made again since (other ids)."""
    recorded = run.summary.get("dataset")
    path = Path(recorded) if recorded else None
    if path is not None and not path.is_absolute() and not path.exists():
        path = Path(run.run_dir) / path  # a run trained from another working directory
    if path is None or not (path / "meta.json").is_file():
        raise PredictionError(f"{where} trained on the dataset {recorded}, which is gone: raw input is mapped "
                              "through its vocabulary (score a dataset preprocessed with --vocabulary instead)")
    meta = read_meta(path)
    if meta.fingerprint != run.summary["dataset_fingerprint"]:
        raise PredictionError(f"{where} trained on the dataset {recorded}, which was made again since (fingerprint "
                              f"{meta.fingerprint[:12]}, the run's {run.summary['dataset_fingerprint'][:12]}): "
                              "its ids are not the run's")
    return str(path.resolve())


def check_raw_rows(path: Path, fmt: RawFormat, where: str) -> None:
    """The first lines of a raw input parse as ``fmt``'s rows (at least one of them): else the file is of
    another format than the run trained on."""
    from dlrmflow.datasets.preprocess import _open_text  # plain or gzip, as preprocess opens it

    with _open_text(path) as f:
        if fmt.has_header:
            f.readline()
        lines = [line for _, line in zip(range(FIRST_LINES_CHECKED), f, strict=False)]
    parsed = parse_block(b"".join(lines), fmt)
    if len(parsed.labels) == 0 and parsed.rejects:
        _, reason, _ = parsed.rejects[0]
        raise PredictionError(f"INPUT {path}: no row of its first {len(lines)} lines is a {fmt.name!r} row "
                              f"(first line: {reason}); {where} trained on --format {fmt.name!r}")


def check_prediction(run_dir: str | os.PathLike, inputs: Sequence[str | os.PathLike], output: str | os.PathLike,
                     *, held_out: bool = False) -> PredictionInput:
    """Every check that needs no model: a finished run with a whole final state, an OUT that is absent or an
    empty directory, and inputs that are one dataset keeping the run's ids (``held_out``: the run's own
    dataset) or raw files of the run's format. PredictionError (or the dataset's, the run's error) naming
    the problem."""
    where = f"RUN_DIR {run_dir}"
    run = read_finished_run(run_dir, option="RUN_DIR")
    check_final_state(run, where)
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PredictionError(f"--output {output} exists and is not an empty directory: predictions are written "
                              "to a new directory")
    if not inputs:
        raise PredictionError("no INPUT given: raw files of the run's format, or a preprocessed dataset directory")
    paths = [Path(p) for p in inputs]
    if any(p.is_dir() for p in paths):
        if len(paths) > 1:
            raise PredictionError(f"INPUT {inputs[0]} ...: a dataset directory is scored alone, not with other "
                                  "inputs")
        meta = read_meta(paths[0])
        parent_cardinalities(run, meta, where)
        if held_out and meta.fingerprint != run.summary["dataset_fingerprint"]:
            raise PredictionError(f"--held-out scores the run's own held-out rows: INPUT {inputs[0]} is not the "
                                  f"dataset {where} trained on")
        return PredictionInput(run, "dataset", (str(paths[0].resolve()),), str(out.resolve()), meta.source_format)
    if held_out:
        raise PredictionError("--held-out scores the run's own held-out rows: INPUT must be the run's dataset "
                              "directory, not raw files")
    from dlrmflow.datasets.preprocess import check_inputs

    vocabulary = run_dataset_dir(run, where)
    fmt = get_format(read_meta(vocabulary).source_format)
    checked = check_inputs(list(paths), fmt)  # exists, not empty, the format's header
    for path in checked:
        check_raw_rows(path, fmt, where)
    return PredictionInput(run, "raw", tuple(str(p.resolve()) for p in checked), str(out.resolve()), fmt.name,
                           vocabulary)


def rows_in_input_order(raw_paths: Sequence[str], fmt: RawFormat, mapped_dir: Path, out_dir: Path) -> DatasetMeta:
    """The raw rows of ``raw_paths``, in their order, as a dataset in ``out_dir`` (a part file per block)
    with the ids of the dataset preprocess made of them (``mapped_dir``): each block encoded by that dataset's
    vocabulary (:func:`~dlrmflow.datasets.vocabulary_lookup.load_vocabulary`: preprocess's parse, hash cap and
    rejections; a value not in it, rare or missing, is 0, as preprocess writes it), so the rows are that
    dataset's rows, unshuffled."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # preprocess's own reading (not a copy of it): the blocks and lines it read
    from dlrmflow.datasets.meta import ROW_GROUP_ROWS
    from dlrmflow.datasets.preprocess import header_bytes, iter_blocks, split_pieces
    from dlrmflow.datasets.vocabulary_lookup import load_vocabulary

    mapped = read_meta(mapped_dir)
    vocabulary = load_vocabulary(mapped_dir)
    out_dir.mkdir(parents=True)
    block_bytes = int(mapped.transform.get("block_bytes") or 64 << 20)
    files: list[PartFile] = []
    for piece in split_pieces([Path(p) for p in raw_paths], fmt, block_bytes):
        for data in iter_blocks(piece, block_bytes, header_bytes(Path(piece.path), fmt)):
            rows = vocabulary.encode(data)
            if len(rows.labels) == 0:
                continue
            columns: dict[str, Any] = {"label": pa.array(rows.labels)}
            for j, name in enumerate(fmt.dense):
                columns[name] = pa.array(np.ascontiguousarray(rows.dense[:, j]))
            for k, name in enumerate(fmt.sparse):
                columns[name] = pa.array(np.ascontiguousarray(rows.sparse[:, k]))
            name = f"part-{len(files):05d}.parquet"
            pq.write_table(pa.table(columns), out_dir / name, compression="snappy", use_dictionary=False,
                           row_group_size=ROW_GROUP_ROWS)
            files.append(PartFile(name, len(rows.labels)))
    rows_read = sum(f.rows for f in files)
    if rows_read != mapped.rows:
        raise RuntimeError(f"read {rows_read} rows of {', '.join(raw_paths)} in input order, preprocess kept "
                           f"{mapped.rows}")
    meta = replace(mapped, files=files, rows=rows_read)
    write_meta(out_dir, meta)
    return meta


def predict_run(run_dir: str | os.PathLike, inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *,
                batch_size: int = 4096, device: str = "cpu", held_out: bool = False, client: Client | None = None,
                client_for: Callable[[int], AbstractContextManager[Client | None]] | None = None) -> dict[str, Any]:
    """Score ``inputs`` with ``run_dir``'s final model into ``output`` (module docstring); the result.

    The rows are scored in parts on a Dask cluster: ``client``, or the one ``client_for(rows)`` opens for
    that many rows (None: this process, the same bits). ``held_out``: only the run's own held-out rows of
    its dataset (with the run's evaluation batch size, its final evaluation's numbers)."""
    started = time.perf_counter()
    checked = check_prediction(run_dir, inputs, output, held_out=held_out)
    if batch_size < 1:
        raise PredictionError(f"--batch-size must be >= 1, got {batch_size}")
    output = Path(checked.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(output, "predict"):
        staging = staging_dir(output)
        shutil.rmtree(staging, ignore_errors=True)  # left by a prediction that was killed
        staging.mkdir()
        try:
            result = _predict_into(checked, staging, batch_size, device, held_out, client, client_for, started)
            shutil.rmtree(staging / WORK_DIR, ignore_errors=True)
            result["seconds"] = round(time.perf_counter() - started, 3)
            (staging / SUMMARY_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
            if output.exists():
                output.rmdir()  # checked empty
            os.replace(staging, output)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return result


def _predict_into(checked: PredictionInput, staging: Path, batch_size: int, device: str, held_out: bool,
                  client: Client | None, client_for: Callable[[int], AbstractContextManager[Client | None]] | None,
                  started: float) -> dict[str, Any]:
    """The work of :func:`predict_run` in its staging directory."""
    import torch

    from dlrmflow.engine.run_state import load_dense
    from dlrmflow.engine.training.cluster_scoring import (
        DenseModel,
        InitRows,
        PredictionParts,
        score_on_cluster,
        score_parts_in_process,
    )
    from dlrmflow.engine.training.scoring import constant_log_loss, scoring_setup

    run, where = checked.run, f"RUN_DIR {checked.run.run_dir}"
    try:
        load_dense(run.state_dir)
    except UserInputError:
        raise
    except Exception as exc:  # a damaged dense.pt: whatever torch.load says of it
        raise PredictionError(f"{where}: the final state's dense parameters cannot be read: {exc}") from None
    rejected = 0
    if checked.kind == "raw":
        dataset = _map_raw_rows(checked, staging / WORK_DIR)
        rejected = read_meta(dataset).rejected_rows
    else:
        dataset = checked.paths[0]
    meta = read_meta(dataset)
    dense, model_config, cards, spec = scoring_setup(run, meta, dataset, where)
    start = meta.rows - int(run.summary.get("eval_rows") or 0) if held_out else 0
    rows = meta.rows - start
    model = DenseModel(model_config, dense["dense"], spec.dim)
    predictions = PredictionParts(str(staging), with_labels=meta.label_column is not None)
    progress = PhaseProgress("prediction rows", rows)
    opened = nullcontext(client) if client is not None or client_for is None else client_for(rows)
    with opened as scoring_client:
        scoring_started = time.perf_counter()
        if scoring_client is not None:
            summary, lookups = score_on_cluster(scoring_client, dataset, start, meta.rows, batch_size, model,
                                                InitRows(spec), device_type=torch.device(device).type,
                                                progress=progress, known_rows=cards, predictions=predictions)
        else:
            summary, lookups = score_parts_in_process(dataset, start, meta.rows, batch_size, model, InitRows(spec),
                                                      device_type=torch.device(device).type, progress=progress,
                                                      known_rows=cards, predictions=predictions)
        scoring_seconds = time.perf_counter() - scoring_started
    labelled = predictions.with_labels and summary.rows > 0
    return {
        "run_dir": run.run_dir,
        "inputs": list(checked.paths),
        "input_kind": checked.kind,
        "output": checked.output,
        "scored_on": "cluster" if scoring_client is not None else "process",
        "model": dense["model"],
        "run_iterations": run.steps,
        "first_row": start,
        "rows": summary.rows,
        "parts": len(list(staging.glob("part-*.parquet"))),
        "rejected_rows": rejected,
        "scoring_seconds": round(scoring_seconds, 3),
        "rows_per_second": round(summary.rows / scoring_seconds) if scoring_seconds > 0 else None,
        "seconds": round(time.perf_counter() - started, 3),
        "labelled": labelled,
        "positive_rate": summary.positives / summary.rows if labelled else None,
        "auc": summary.auc() if labelled else None,
        "log_loss": summary.log_loss() if labelled else None,
        "constant_log_loss": constant_log_loss(summary.positives, summary.rows) if labelled else None,
        "new_ids": int(sum(meta.cardinalities) - sum(cards)),  # values of the input the run never had
        "new_id_lookups": lookups,  # lookups (rows x tables) that met one
        "new_id_lookup_share": lookups / (summary.rows * len(cards)) if summary.rows else 0.0,
    }


def _map_raw_rows(checked: PredictionInput, work: Path) -> str:
    """Raw input as a dataset of the run's ids in input order (:func:`rows_in_input_order`), under ``work``."""
    from dlrmflow.datasets.preprocess import run_preprocess
    from dlrmflow.datasets.preprocess_config import PreprocessConfig

    parent = read_meta(checked.vocabulary)
    cap = parent.transform.get("max_rows_per_table")
    config = PreprocessConfig(inputs=list(checked.paths), output=str(work / "mapped"), format=checked.format,
                              vocabulary=checked.vocabulary, max_rows_per_table=cap,
                              min_frequency=int(parent.transform.get("min_frequency") or 1))
    with phase_reported(f"mapping {len(checked.paths)} raw file(s) through the run's vocabulary"):
        run_preprocess(config)
        rows_in_input_order(checked.paths, get_format(checked.format), work / "mapped", work / "rows")
    return str(work / "rows")
