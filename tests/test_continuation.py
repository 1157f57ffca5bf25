"""Training that continues a finished run (``--init-from``) and next-day evaluation (issue 30).

The specification: day 0 trained, then day 1 continued from it, ends bit-identical to one run over day 0's
batches then day 1's, in every mode, for a table layout that grew in between (rows new on day 1 start as
usual; a learning-rate warm-up that spans both days continues). Every refusal names the problem.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from distributed import Client, LocalCluster

from dlrmflow.cli import main
from dlrmflow.datasets.meta import PartFile, read_meta, write_meta
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.datasets.synthetic import generate_rows
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.run_state import load_state, read_summary, save_sharded_state, state_differences
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import prepare_run, train
from dlrmflow.engine.training.scoring import evaluate_run

ROWS_PER_DAY = 1024  # whole batches of 128: day 1's first batch is the reference's batch after day 0's last


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.CRITICAL) as c, Client(c) as client:
        yield client


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> dict[str, Path]:
    """Generated day files (one generator vocabulary, a seed per day) preprocessed as the daily loop does:
    day 1 with day 0's dataset as its vocabulary; and the reference's data, day 0's rows then day 1's."""
    root = tmp_path_factory.mktemp("days")
    settings = dict(block_bytes=64 << 10, seed=3)
    for day in range(2):
        (root / f"day_{day}.tsv").write_bytes(generate_rows(0, ROWS_PER_DAY, seed=11 + day, scale=0.002))
    preprocess([root / "day_0.tsv"], root / "ds0", **settings)
    preprocess([root / "day_1.tsv"], root / "ds1", vocabulary=root / "ds0", **settings)
    return {"ds0": root / "ds0", "ds1": root / "ds1", "both": one_after_the_other(root / "ds0", root / "ds1",
                                                                                  root / "both")}


def one_after_the_other(first: Path, second: Path, out: Path) -> Path:
    """A dataset of ``first``'s rows then ``second``'s, in ``second``'s vocabulary (which keeps every id of
    ``first``'s): what one run over both days reads."""
    out.mkdir()
    meta0, meta1 = read_meta(first), read_meta(second)
    files = []
    for tag, src, meta in (("a", first, meta0), ("b", second, meta1)):
        for f in meta.files:
            shutil.copyfile(src / f.name, out / f"{tag}-{f.name}")
            files.append(PartFile(f"{tag}-{f.name}", f.rows))
    both = meta1.__class__(**{**meta1.__dict__, "files": files, "rows": meta0.rows + meta1.rows,
                              "fingerprint": "both-" + meta1.fingerprint[:20]})
    write_meta(out, both)
    return out


def config(dataset: Path, out: Path, mode: str, **kw) -> TrainConfig:
    base = dict(dataset_dir=str(dataset), mode=mode, output_dir=str(out), batch_size=128, embedding_dim=4,
                eval_fraction=0.0, metrics_every=4, num_shards=2)
    layers = dict(bottom_mlp=(8, 4), top_mlp=(8, 1)) if kw.get("model", "dlrm") == "dlrm" else dict(dnn=(8,))
    base.update({k: v for k, v in layers.items() if k not in kw})
    return TrainConfig(**{**base, **kw})


CASES = {  # mode, then the settings that a continuation must carry over
    "local-dlrm-warmup": ("local", dict(lr_num_warmup_steps=12)),  # the warm-up ends on day 1
    "remote-parity-deepfm-adam": ("remote", dict(model="deepfm", dense_optimizer="adam", parity=1)),
    "remote-wide-deep-sgd-rows": ("remote", dict(model="wide-deep", embedding_optimizer="sgd")),
}


@pytest.mark.parametrize("case", CASES)
def test_day_1_continued_from_day_0_is_bit_identical_to_one_run_over_both_days(case, days, tmp_path, cluster):
    mode, settings = CASES[case]
    client = cluster if mode != "local" else None
    meta0, meta1 = read_meta(days["ds0"]), read_meta(days["ds1"])
    assert sum(meta1.cardinalities) > sum(meta0.cardinalities)  # day 1 brought new rows

    day0 = train(config(days["ds0"], tmp_path / "day0", mode, **settings), client=client)
    day1 = train(config(days["ds1"], tmp_path / "day1", mode, init_from=str(tmp_path / "day0"), **settings),
                 client=client)
    both = train(config(days["both"], tmp_path / "both", mode, **settings), client=client)
    assert day0["iterations"] + day1["iterations"] == both["iterations"] == 16

    assert day1["state_sha256"] == both["state_sha256"]
    assert state_differences(load_state(tmp_path / "day1"), load_state(tmp_path / "both")) == []
    assert day1["init_from"] == {"run_dir": str((tmp_path / "day0").resolve()),
                                 "state_sha256": day0["state_sha256"], "steps_before": 8}
    # The start mattered: day 1 trained from a fresh start ends elsewhere.
    fresh = train(config(days["ds1"], tmp_path / "fresh", mode, **settings), client=client)
    assert fresh["state_sha256"] != day1["state_sha256"]


def test_a_continued_run_keeps_every_row_of_the_run_and_starts_new_ones_as_usual(days, tmp_path):
    """Zero iterations' worth of change is not possible to train, so read the start directly: the rows a
    continued run starts from, on the grown layout, are the finished run's rows where it had them."""
    from dlrmflow.engine.serving.embedding_rows import init_rows

    train(config(days["ds0"], tmp_path / "day0", "local"))
    setup = prepare_run(config(days["ds1"], tmp_path / "day1", "local", init_from=str(tmp_path / "day0")))
    fresh = prepare_run(config(days["ds1"], tmp_path / "fresh", "local"))
    finished = load_state(tmp_path / "day0")["embedding"]["rows"].numpy()
    meta0, meta1 = read_meta(days["ds0"]), read_meta(days["ds1"])
    for k, (n0, n1) in enumerate(zip(meta0.cardinalities, meta1.cardinalities, strict=True)):
        ids = meta1.table_offsets[k] + np.arange(n1)
        start = init_rows(setup.spec, ids)
        assert np.array_equal(start[:n0].view(np.int32), finished[meta0.table_offsets[k]:][:n0].view(np.int32)), k
        assert np.array_equal(start[n0:].view(np.int32), init_rows(fresh.spec, ids[n0:]).view(np.int32)), k


def _refusal(days, tmp_path, **kw) -> str:
    with pytest.raises(UserInputError) as info:
        prepare_run(config(days["ds1"], tmp_path / "new", "local", **kw))
    assert not (tmp_path / "new").exists()
    return str(info.value)


def test_init_from_refuses_what_it_cannot_continue(days, tmp_path):
    finished = tmp_path / "day0"
    train(config(days["ds0"], finished, "local"))
    assert "no such run directory" in _refusal(days, tmp_path, init_from=str(tmp_path / "nowhere"))
    assert _refusal(days, tmp_path, init_from=str(finished), model="deepfm").startswith(
        f"model: --init-from {finished} trained --model dlrm, this run is --model deepfm")
    assert _refusal(days, tmp_path, init_from=str(finished), top_mlp=(16, 1)).startswith("top_mlp: ")
    assert _refusal(days, tmp_path, init_from=str(finished), embedding_dim=8, bottom_mlp=(8, 8)).startswith(
        "embedding_dim: ")
    assert _refusal(days, tmp_path, init_from=str(finished), embedding_optimizer="sgd").startswith(
        "embedding_optimizer: ")
    assert _refusal(days, tmp_path, init_from=str(finished), dense_optimizer="adam").startswith("dense_optimizer: ")

    # A run on data this dataset's ids do not descend from (day 1's own vocabulary, not day 0's).
    preprocess([days["ds0"].parent / "day_1.tsv"], tmp_path / "alone", block_bytes=64 << 10, seed=3)
    train(config(tmp_path / "alone", tmp_path / "alone-run", "local"))
    assert "does not descend from it" in _refusal(days, tmp_path, init_from=str(tmp_path / "alone-run"))

    unfinished = tmp_path / "unfinished"
    shutil.copytree(finished, unfinished)
    (unfinished / "UNFINISHED").write_text("")
    assert "holds an unfinished run" in _refusal(days, tmp_path, init_from=str(unfinished))
    (unfinished / "UNFINISHED").unlink()
    (unfinished / "summary.json").unlink()
    assert "holds no finished run" in _refusal(days, tmp_path, init_from=str(unfinished))
    stateless = tmp_path / "stateless"
    train(config(days["ds0"], stateless, "local", save_state=False))
    assert "kept no final state" in _refusal(days, tmp_path, init_from=str(stateless))


def test_auto_continues_with_the_finished_runs_row_update(days, tmp_path):
    """--embedding-optimizer auto (the default) continues a run with the optimizer that run trained with, whatever
    the model's own default: a DeepFM run trained row-wise continues row-wise, and its rows' state fits. Naming
    another optimizer is refused, naming both."""
    finished = tmp_path / "day0"
    train(config(days["ds0"], finished, "local", model="deepfm", embedding_optimizer="adagrad"))
    assert read_summary(finished)["embedding_optimizer"] == "adagrad"
    setup = prepare_run(config(days["ds1"], tmp_path / "day1", "local", model="deepfm", init_from=str(finished)))
    assert setup.embedding_optimizer == "adagrad" and setup.spec.own_accumulator_columns == 1
    fresh = prepare_run(config(days["ds1"], tmp_path / "fresh", "local", model="deepfm"))
    assert fresh.embedding_optimizer == "adagrad-per-value" and fresh.spec.width == 2 * setup.spec.dim
    assert _refusal(days, tmp_path, init_from=str(finished), model="deepfm",
                    embedding_optimizer="adagrad-per-value") == (
        f"embedding_optimizer: --init-from {finished} trained with --embedding-optimizer adagrad, this run "
        "adagrad-per-value (the optimizer state would not fit)")


def test_a_final_state_with_the_shared_accumulator_layout_is_refused_and_still_scores(days, tmp_path):
    """A Wide & Deep final state whose first-order weight shares the row's accumulator (rows of D + 2 values,
    no own_accumulator_columns recorded): --init-from names both layouts instead of misreading the optimizer
    state; dlrmflow evaluate reads its weights, which sit where they sit in the layout of today."""
    run = tmp_path / "day0"
    train(config(days["ds0"], run, "local", model="wide-deep", embedding_optimizer="adagrad"))
    scored = evaluate_run(run, days["ds1"])
    state = load_state(run)
    assert state["embedding"]["rows"].shape[1] == 4 + 1 + 2 and state["embedding"]["own_accumulator_columns"] == 1
    state["embedding"]["rows"] = state["embedding"]["rows"][:, :-1].contiguous()  # v, w, one accumulator
    state["embedding"]["state_width"] = 1
    del state["embedding"]["own_accumulator_columns"]
    save_sharded_state(run, state)
    message = _refusal(days, tmp_path, init_from=str(run), model="wide-deep", embedding_optimizer="adagrad")
    assert message == (
        f"embedding_optimizer: --init-from {run} stores rows of 6 values (5 weights, then 1 optimizer value), this "
        "version 7 (5 weights, then one Adagrad accumulator shared by the first 4 and one for each of the last 1): "
        "the run was trained by a dlrmflow with another row layout; continue it with that version, or train it "
        "again with this one")
    old = evaluate_run(run, days["ds1"])
    assert (old["auc"], old["log_loss"]) == (scored["auc"], scored["log_loss"])


def test_train_init_from_on_the_command_line_refuses_in_one_line(days, tmp_path, capsys):
    code = main(["train", str(days["ds1"]), "--mode", "local", "--output", str(tmp_path / "new"),
                 "--init-from", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--init-from" in err[0] and "no such run directory" in err[0]
    assert not (tmp_path / "new").exists()


def test_a_continued_run_can_itself_be_continued(days, tmp_path):
    """The steps a state has taken add up along a chain of runs (the schedule reads them)."""
    train(config(days["ds0"], tmp_path / "a", "local"))
    train(config(days["ds1"], tmp_path / "b", "local", init_from=str(tmp_path / "a")))
    c = train(config(days["ds1"], tmp_path / "c", "local", init_from=str(tmp_path / "b"), iterations=3))
    assert c["init_from"]["steps_before"] == 16
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["init_from"]["run_dir"] == str(
        (tmp_path / "b").resolve())
    assert read_summary(tmp_path / "c")["iterations"] == 3


# ---- next-day evaluation ----------------------------------------------------------------------------


def test_evaluate_scores_a_run_on_the_next_days_data_as_training_would_see_it(days, tmp_path):
    """Yesterday's model on today's data: the rows training's own evaluation reads (a continued run's
    start), so on the run's own held-out rows it agrees with the run's final evaluation; the constant
    prediction's log loss is the labels' entropy; new ids are counted."""
    from dlrmflow.engine.training.metrics import log_loss_terms
    from dlrmflow.engine.training.scoring import evaluate_run

    run = train(config(days["ds0"], tmp_path / "day0", "local", eval_fraction=0.25, iterations=4))
    own = evaluate_run(tmp_path / "day0", days["ds0"])
    assert own["rows"] == ROWS_PER_DAY and own["new_ids"] == 0 and own["new_id_lookups"] == 0
    assert own["run_iterations"] == 4

    next_day = evaluate_run(tmp_path / "day0", days["ds1"], batch_size=100)
    meta0, meta1 = read_meta(days["ds0"]), read_meta(days["ds1"])
    assert next_day["rows"] == meta1.rows and next_day["new_ids"] == sum(meta1.cardinalities) - sum(meta0.cardinalities)
    assert next_day["new_id_lookups"] > 0 and 0 < next_day["new_id_lookup_share"] < 1
    assert 0 < next_day["auc"] < 1
    labels = np.concatenate([b.labels for b in __import__("dlrmflow.engine.batch_stream", fromlist=["BatchStream"])
                             .BatchStream(days["ds1"], 512)])
    rate = labels.mean()
    assert next_day["constant_log_loss"] == pytest.approx(-(rate * np.log(rate) + (1 - rate) * np.log(1 - rate)))
    # Every scoring sums the per-row losses exactly (math.fsum's value), not with np.mean's pairwise sum.
    terms = log_loss_terms(labels, np.full(len(labels), rate))
    assert next_day["constant_log_loss"] == math.fsum(terms) / len(labels)
    # The batch size does not change the scores (same model, same rows): the same AUC bits.
    assert evaluate_run(tmp_path / "day0", days["ds1"], batch_size=333)["auc"] == next_day["auc"]

    # On its own held-out rows: the same numbers as the run's final evaluation.
    held_out = one_after_the_other_tail(days["ds0"], tmp_path / "held-out", first_row=int(0.75 * ROWS_PER_DAY))
    mine = evaluate_run(tmp_path / "day0", held_out, batch_size=4096)
    assert (mine["auc"], mine["log_loss"]) == (run["eval_auc"], run["eval_log_loss"])


def one_after_the_other_tail(dataset: Path, out: Path, first_row: int) -> Path:
    """The rows ``[first_row, end)`` of ``dataset`` as a dataset of the same vocabulary."""
    import pyarrow.parquet as pq

    meta = read_meta(dataset)
    out.mkdir()
    tables, start = [], 0
    for f in meta.files:
        table = pq.read_table(dataset / f.name)
        lo = max(0, first_row - start)
        if lo < f.rows:
            tables.append(table.slice(lo))
        start += f.rows
    import pyarrow as pa

    pq.write_table(pa.concat_tables(tables), out / "part-00000.parquet")
    rows = meta.rows - first_row
    write_meta(out, meta.__class__(**{**meta.__dict__, "files": [PartFile("part-00000.parquet", rows)], "rows": rows}))
    return out


def test_evaluate_on_the_command_line_and_its_refusals(days, tmp_path, capsys, prefect_harness):
    train(config(days["ds0"], tmp_path / "day0", "local", iterations=2))
    assert main(["evaluate", str(tmp_path / "day0"), str(days["ds1"]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == read_meta(days["ds1"]).rows and result["auc"] is not None

    preprocess([days["ds0"].parent / "day_1.tsv"], tmp_path / "alone", block_bytes=64 << 10, seed=3)
    for argv, error in (
        ([str(tmp_path / "nowhere"), str(days["ds1"])], "RUN_DIR " + str(tmp_path / "nowhere") + ": no such run"),
        ([str(tmp_path / "day0"), str(tmp_path / "nowhere")], "does not exist"),
        ([str(tmp_path / "day0"), str(tmp_path / "alone")], "does not descend from it"),
    ):
        assert main(["evaluate", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and error in err[0], err


def test_a_finished_run_replaced_after_the_check_is_refused_not_read(days, tmp_path):
    """A process that opens the run's files after it was written over (a Dask worker of a later run, say)
    refuses; one that opened them before keeps reading the rows that were checked."""
    from dlrmflow.engine.serving import embedding_rows
    from dlrmflow.engine.serving.embedding_rows import init_rows

    train(config(days["ds0"], tmp_path / "day0", "local"))
    checked = prepare_run(config(days["ds1"], tmp_path / "day1", "local", init_from=str(tmp_path / "day0")))
    ids = np.arange(50)
    before = init_rows(checked.spec, ids)
    shutil.rmtree(tmp_path / "day0")
    train(config(days["ds0"], tmp_path / "day0", "local", seed=5))
    assert np.array_equal(init_rows(checked.spec, ids).view(np.int32), before.view(np.int32))  # opened before
    embedding_rows._final_rows.cache_clear()  # a process that opens the files now
    with pytest.raises(UserInputError, match="changed since the run that continues it was checked"):
        init_rows(checked.spec, ids)
