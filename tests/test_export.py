"""A trained model handed on (issue 44, items 2 and 3): ``dlrmflow.load_model``, ``dlrmflow.load_vocabulary`` and
``dlrmflow export RUN_DIR --to torchrec --output DIR``.

- ``load_model(RUN_DIR).predict`` gives the click probabilities ``dlrmflow evaluate`` computes, bit for bit,
  from rows memory-mapped by id; it takes the dataset's columns in any of their usual containers and refuses
  what does not fit, as it refuses a run that is unfinished or damaged;
- ``load_vocabulary(DATASET)`` maps raw lines to the rows ``dlrmflow preprocess`` wrote for them;
- the export holds TorchRec's DLRM state dict (its keys, shapes, the dataset's feature names, the run's final
  values; a plain-torch copy of TorchRec's DLRM computes dlrmflow's predictions from it: TorchRec itself cannot be
  installed in CI, benchmarks/torchrec_export.py loads it there), or for the other models a ``torch.export``
  program with dlrmflow's bits, and the vocabulary; bad input is one line, exit status 2, nothing written.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from test_models import run_config
from test_trainers import make_dataset, small_config

import dlrmflow
from dlrmflow.datasets.meta import DatasetError, read_meta
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.run_state import load_state
from dlrmflow.engine.training import evaluation
from dlrmflow.engine.training.export_checks import ExportError
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.metrics import ScoreSummary
from dlrmflow.engine.training.model_export import export_run, interaction_permutation
from dlrmflow.engine.training.scoring import evaluate_run
from dlrmflow.engine.training.trained_model import ModelInputError

DATA = Path(__file__).parent / "data"
CRITEO_SAMPLE = DATA / "criteo_kaggle_sample.csv"  # 200 rows, header, criteo-csv
AVAZU_SAMPLE = DATA / "avazu_sample.csv"


@pytest.fixture(scope="module")
def criteo(tmp_path_factory) -> Path:
    """The Criteo sample preprocessed: 26 tables named C1..C26, with a vocabulary."""
    out = tmp_path_factory.mktemp("criteo") / "dataset"
    preprocess([CRITEO_SAMPLE], out, fmt="criteo-csv")
    return out


@pytest.fixture(scope="module")
def dlrm_run(criteo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dlrm") / "run"
    train(small_config(criteo, out, "local", iterations=8, eval_fraction=0.2))
    return out


@pytest.fixture(scope="module")
def deepfm_run(criteo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deepfm") / "run"
    train(run_config(criteo, out, "local", "deepfm", iterations=8))
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.int32)


# ---- load_model ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run", ["dlrm_run", "deepfm_run"])
def test_predict_gives_the_probabilities_evaluate_computes_bit_for_bit(run, request, criteo, monkeypatch):
    run_dir = request.getfixturevalue(run)
    scored: list[np.ndarray] = []

    class Recorded(ScoreSummary):  # evaluate's probabilities, as its score_stream summarises them
        @classmethod
        def of(cls, labels, probabilities):
            scored.append(np.array(probabilities))
            return ScoreSummary.of(labels, probabilities)

    monkeypatch.setattr(evaluation, "ScoreSummary", Recorded)
    evaluated = evaluate_run(run_dir, criteo, batch_size=50)
    model = dlrmflow.load_model(run_dir)
    predicted = np.concatenate([model.predict(batch) for batch in BatchStream(criteo, 50)])

    assert isinstance(model, torch.nn.Module) and not model.training and model.model_name == run.removesuffix("_run")
    assert predicted.dtype == np.float32 and len(predicted) == evaluated["rows"] == read_meta(criteo).rows
    assert np.array_equal(_bits(predicted), _bits(np.concatenate(scored)))


def test_predict_takes_the_dataset_columns_in_a_batch_a_mapping_or_a_table(dlrm_run, criteo):
    model = dlrmflow.load_model(dlrm_run)
    table = pq.read_table(criteo / read_meta(criteo).files[0].name).slice(0, 50)
    batch = next(iter(BatchStream(criteo, 50)))  # the same first 50 rows
    from_batch = model.predict(batch)
    assert np.array_equal(_bits(model.predict({"dense": batch.dense, "sparse": batch.sparse})), _bits(from_batch))
    assert np.array_equal(_bits(model.predict(table)), _bits(from_batch))
    assert np.array_equal(_bits(model.predict(table.to_pandas())), _bits(from_batch))
    assert model.features.sparse == tuple(f"C{k}" for k in range(1, 27))
    assert model.predict({"dense": np.zeros((0, 13)), "sparse": np.zeros((0, 26), np.int64)}).shape == (0,)


@pytest.mark.parametrize("change,message", [
    (lambda d, s: (d, s[:, :25]), r"sparse ids: expected \[n, 26\], got \[4, 25\]"),
    (lambda d, s: (d[:, :12], s), r"dense features: expected \[n, 13\], got \[4, 12\]"),
    (lambda d, s: (d, s.astype(np.float32)), "sparse ids must be integers"),
    (lambda d, s: (d[:3], s), "3 rows of dense features, 4 of sparse ids"),
    (lambda d, s: (d, np.where(np.arange(26) == 2, -1, s)), "row 0: id -1 of C3 lies outside"),
])
def test_predict_refuses_a_batch_that_does_not_fit_the_model(dlrm_run, change, message):
    model = dlrmflow.load_model(dlrm_run)
    dense, sparse = change(np.zeros((4, 13), np.float32), np.zeros((4, 26), np.int64))
    with pytest.raises(ModelInputError, match=message):
        model.predict({"dense": dense, "sparse": sparse})


def test_an_id_beyond_its_table_is_refused_naming_the_table(dlrm_run):
    model = dlrmflow.load_model(dlrm_run)
    sparse = np.zeros((2, 26), np.int64)
    sparse[1, 5] = model.cardinalities[5]
    with pytest.raises(ModelInputError, match=f"row 1: id {model.cardinalities[5]} of C6 lies outside the model's "
                                              f"{model.cardinalities[5]} rows"):
        model.predict({"dense": np.zeros((2, 13)), "sparse": sparse})


def test_the_tables_stay_on_disk_memory_mapped(dlrm_run):
    """Loading reads dense.pt only: the rows are the shard files, memory-mapped, and no table is a parameter."""
    model = dlrmflow.load_model(dlrm_run)
    assert all(isinstance(shard, np.memmap) for shard in model.rows.shards)
    assert all(name.startswith("model.") for name in model.state_dict())
    state = load_state(dlrm_run)["embedding"]["rows"].numpy()
    assert np.array_equal(model.table_rows(3), state[model.table_offsets[3]:][:model.cardinalities[3], :model.dim])


def _damaged(run_dir: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(run_dir, copy)
    damage(copy)
    return copy


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


DAMAGES = {
    "unfinished": (lambda r: (r / "UNFINISHED").write_text("{}"), "holds an unfinished run"),
    "no final state": (lambda r: shutil.rmtree(r / "final_state"), "has no final_state/manifest.json"),
    "a shard file gone": (lambda r: (r / "final_state" / "shard-0.npy").unlink(), "final_state/ is damaged"),
    "a shard file cut short": (lambda r: (r / "final_state" / "shard-0.npy").write_bytes(
        (r / "final_state" / "shard-0.npy").read_bytes()[:-64]), "final_state/ is damaged"),
    "dense.pt overwritten": (lambda r: (r / "final_state" / "dense.pt").write_bytes(b"not a pickle"),
                             "final_state/dense.pt cannot be read"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_load_model_refuses_an_unfinished_or_damaged_run_in_one_line(damage, dlrm_run, tmp_path):
    do, message = DAMAGES[damage]
    with pytest.raises(UserInputError, match=message) as refused:
        dlrmflow.load_model(_damaged(dlrm_run, tmp_path, do))
    assert "\n" not in str(refused.value)


def test_verify_finds_a_changed_value_that_the_shapes_cannot(dlrm_run, tmp_path):
    damaged = _damaged(dlrm_run, tmp_path, lambda r: _flip_last_byte(r / "final_state" / "shard-0.npy"))
    dlrmflow.load_model(damaged)  # same shapes: it loads
    with pytest.raises(UserInputError, match="do not hash to the manifest's state SHA-256"):
        dlrmflow.load_model(damaged, verify=True)


def test_importing_dlrmflow_stays_cheap_and_names_the_api():
    code = "import sys, dlrmflow; print(sorted({'torch', 'pyarrow', 'prefect', 'numpy'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    from dlrmflow.datasets.vocabulary_lookup import load_vocabulary
    from dlrmflow.engine.training.trained_model import load_model

    assert dlrmflow.load_model is load_model and dlrmflow.load_vocabulary is load_vocabulary
    with pytest.raises(AttributeError, match="has no attribute 'load_modle'"):
        dlrmflow.load_modle  # noqa: B018


def test_the_readme_example_runs_as_written(dlrm_run, criteo, tmp_path, monkeypatch, capsys):
    """The README's five lines of load_model (docs/export.md shows them too), in a directory where its paths are a
    small run, its dataset and that dataset's raw file."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert example in (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    assert len(example.splitlines()) == 5
    for name, target in {"runs/remote": dlrm_run, "data/criteo": criteo, "data/day_0.tsv": CRITEO_SAMPLE}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).symlink_to(target)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    expected = dlrmflow.load_model(dlrm_run).predict(dlrmflow.load_vocabulary(criteo).encode(CRITEO_SAMPLE.read_text()))
    assert capsys.readouterr().out == f"{expected[:3]}\n"  # NumPy prints each float32's shortest exact repr


# ---- load_vocabulary -------------------------------------------------------------------------------------


def _dataset_rows(dataset: Path) -> Counter:
    meta = read_meta(dataset)
    table = pq.read_table(dataset / meta.files[0].name) if len(meta.files) == 1 else None
    assert table is not None
    return Counter(zip(table["label"].to_pylist(), *(_bits(table[c].to_numpy()).tolist() for c in meta.dense_columns),
                       *(table[c].to_pylist() for c in meta.sparse_columns), strict=True))


def _encoded_rows(encoded) -> Counter:
    return Counter(zip(encoded.labels.tolist(), *_bits(encoded.dense).T.tolist(), *encoded.sparse.T.tolist(),
                       strict=True))


@pytest.mark.parametrize("sample,settings", [(CRITEO_SAMPLE, {"fmt": "criteo-csv"}),
                                             (CRITEO_SAMPLE, {"fmt": "criteo-csv", "min_frequency": 2,
                                                              "max_rows_per_table": 16}),
                                             (AVAZU_SAMPLE, {"fmt": "avazu"})])
def test_the_vocabulary_maps_raw_lines_to_the_rows_preprocess_wrote(sample, settings, tmp_path):
    """Every raw line encodes to a row of the dataset preprocess made of those lines (the dataset's rows are
    shuffled: compared as multisets), with the hash cap and the rare values' id 0."""
    preprocess([sample], tmp_path / "dataset", **settings)
    vocabulary = dlrmflow.load_vocabulary(tmp_path / "dataset")
    encoded = vocabulary.encode(sample.read_text())
    assert _encoded_rows(encoded) == _dataset_rows(tmp_path / "dataset")
    # Id 0: a missing value, or one under --min-frequency (not in the vocabulary: counted as unseen).
    missing = sum(c.count("") for line in csv.reader(sample.read_text().splitlines()[1:])
                  for c in [line[-len(vocabulary.tables):] if sample == CRITEO_SAMPLE else line])
    assert encoded.unseen == np.count_nonzero(encoded.sparse == 0) - missing
    assert (encoded.unseen > 0) == ("min_frequency" in settings) and encoded.rejects == []
    assert encoded.sparse.dtype == np.int32 and encoded.dense.dtype == np.float32


def test_a_value_the_vocabulary_never_saw_reads_id_0_and_is_counted(criteo):
    vocabulary = dlrmflow.load_vocabulary(criteo)
    table = read_meta(criteo).sparse_columns[0]
    first = pq.read_table(criteo / read_meta(criteo).files[0].name)[table].to_pylist()
    known = next(int(line.split(",")[14], 16) for line in CRITEO_SAMPLE.read_text().splitlines()[1:]
                 if line.split(",")[14])
    ids, unseen = vocabulary.lookup(table, [known, None, 0xFFFFFFFF])
    assert ids[0] in first and ids[0] > 0
    assert ids[1:].tolist() == [0, 0] and unseen == 1  # missing: 0, not counted; never seen: 0, counted
    with pytest.raises(DatasetError, match="its vocabulary holds int values, given string"):
        vocabulary.ids(table, ["68fd1e64"])
    with pytest.raises(DatasetError, match="no categorical table 'C99'"):
        vocabulary.ids("C99", [1])


def test_a_dataset_written_from_arrays_has_no_vocabulary(tmp_path):
    with pytest.raises(DatasetError, match="keeps no vocabulary"):
        dlrmflow.load_vocabulary(make_dataset(tmp_path / "arrays", 1))


# ---- export ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tables", range(1, 8))
def test_the_interaction_permutation_takes_torchrecs_order_from_dlrmflows(tables):
    """TorchRec keeps the pairwise products above the diagonal, row by row; dlrmflow those below: the permutation
    picks, for each of TorchRec's, the same product (bit for bit: z[i, j] = z[j, i])."""
    features = torch.randn(5, tables + 1, 3, generator=torch.Generator().manual_seed(tables))
    z = torch.bmm(features, features.transpose(1, 2))
    lower = z.flatten(1)[:, torch.from_numpy(np.ravel_multi_index(np.tril_indices(tables + 1, -1), z.shape[1:]))]
    upper = z[:, *torch.triu_indices(tables + 1, tables + 1, 1)]
    perm = interaction_permutation(tables)
    assert sorted(perm.tolist()) == list(range(tables * (tables + 1) // 2))
    assert torch.equal(lower[:, torch.from_numpy(perm)], upper)


def _torchrec_dlrm_logits(state: dict, arguments: dict, dense: torch.Tensor, sparse: np.ndarray) -> torch.Tensor:
    """TorchRec 1.8.0's DLRM forward (torchrec/models/dlrm.py) in plain torch, from its state dict: the sparse
    arch's tables by feature, the dense arch (ReLU after every layer), the interaction's upper triangle, the
    over arch (ReLU after all but the last layer)."""
    tables = "sparse_arch.embedding_bag_collection.embedding_bags"
    embeddings = torch.stack([state[f"{tables}.{t['name']}.weight"][torch.from_numpy(sparse[:, k])]
                              for k, t in enumerate(arguments["tables"])], dim=1)
    x = dense
    for i in range(len(arguments["dense_arch_layer_sizes"])):
        x = torch.relu(torch.nn.functional.linear(x, state[f"dense_arch.model._mlp.{i}._linear.weight"],
                                                  state[f"dense_arch.model._mlp.{i}._linear.bias"]))
    combined = torch.cat([x.unsqueeze(1), embeddings], dim=1)
    z = torch.bmm(combined, combined.transpose(1, 2))
    y = torch.cat([x, z[:, *torch.triu_indices(combined.shape[1], combined.shape[1], 1)]], dim=1)
    for i in range(len(arguments["over_arch_layer_sizes"]) - 1):
        y = torch.relu(torch.nn.functional.linear(y, state[f"over_arch.model.0._mlp.{i}._linear.weight"],
                                                  state[f"over_arch.model.0._mlp.{i}._linear.bias"]))
    return torch.nn.functional.linear(y, state["over_arch.model.1.weight"], state["over_arch.model.1.bias"]).squeeze(1)


def test_a_dlrm_exports_as_torchrecs_dlrm_state_dict(dlrm_run, criteo, tmp_path):
    result = export_run(dlrm_run, tmp_path / "export")
    out = tmp_path / "export"
    description = json.loads((out / "export.json").read_text())
    state = torch.load(out / "model.pt", weights_only=True)
    final = load_state(dlrm_run)
    meta = read_meta(criteo)
    features = [f"C{k}" for k in range(1, 27)]

    assert result["format"] == description["format"] == "torchrec.models.dlrm.DLRM state dict"
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.pt", "vocabulary", "vocabulary.json"]
    assert sorted(description["files"]) == sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    arguments = description["torchrec"]
    assert arguments["tables"] == [{"name": f"t_{f}", "feature_names": [f], "num_embeddings": n, "embedding_dim": 4,
                                    "pooling": "SUM"} for f, n in zip(features, meta.cardinalities, strict=True)]
    assert (arguments["dense_in_features"], arguments["dense_arch_layer_sizes"], arguments["over_arch_layer_sizes"]) \
        == (13, [8, 4], [8, 1])
    assert description["dense_features"] == [f"I{k}" for k in range(1, 14)]
    assert description["sparse_features"] == features
    assert description["state_sha256"] == final_sha256(dlrm_run)
    assert (description["dataset"], description["dataset_fingerprint"]) == (str(criteo), meta.fingerprint)

    tables = "sparse_arch.embedding_bag_collection.embedding_bags"
    assert list(state) == [*(f"{tables}.t_{f}.weight" for f in features),
                           "dense_arch.model._mlp.0._linear.weight", "dense_arch.model._mlp.0._linear.bias",
                           "dense_arch.model._mlp.1._linear.weight", "dense_arch.model._mlp.1._linear.bias",
                           "over_arch.model.0._mlp.0._linear.weight", "over_arch.model.0._mlp.0._linear.bias",
                           "over_arch.model.1.weight", "over_arch.model.1.bias"]
    rows = final["embedding"]["rows"]
    for f, offset, n in zip(features, meta.table_offsets, meta.cardinalities, strict=True):
        assert torch.equal(state[f"{tables}.t_{f}.weight"], rows[offset:offset + n, :4])  # weights, not Adagrad's
    dense = final["dense"]
    assert torch.equal(state["dense_arch.model._mlp.1._linear.weight"], dense["bottom.2.weight"])
    assert torch.equal(state["over_arch.model.1.bias"], dense["top.2.bias"])
    first = state["over_arch.model.0._mlp.0._linear.weight"]
    assert first.shape == dense["top.0.weight"].shape == (8, 4 + 27 * 26 // 2)
    assert torch.equal(first[:, :4], dense["top.0.weight"][:, :4])
    assert torch.equal(first[:, 4:], dense["top.0.weight"][:, 4 + torch.from_numpy(interaction_permutation(26))])

    # TorchRec's computation on the exported values predicts what dlrmflow predicts (the over arch's first layer
    # sums its inputs in TorchRec's order: last-bit differences, docs/export.md).
    model = dlrmflow.load_model(dlrm_run)
    batch = next(iter(BatchStream(criteo, 200)))
    theirs = torch.sigmoid(_torchrec_dlrm_logits(state, arguments, torch.tensor(batch.dense),
                                                 batch.sparse.astype(np.int64))).numpy()
    assert np.abs(theirs - model.predict(batch)).max() <= 1e-6


def final_sha256(run_dir: Path) -> str:
    return json.loads((run_dir / "final_state" / "manifest.json").read_text())["state_sha256"]


def test_the_export_carries_the_vocabulary(dlrm_run, criteo, tmp_path):
    export_run(dlrm_run, tmp_path / "export")
    exported = dlrmflow.load_vocabulary(tmp_path / "export")
    own = dlrmflow.load_vocabulary(criteo)
    text = CRITEO_SAMPLE.read_text()
    assert _encoded_rows(exported.encode(text)) == _encoded_rows(own.encode(text))
    assert exported.fingerprint == read_meta(criteo).fingerprint


def test_another_model_exports_as_a_program_with_dlrmflows_bits(deepfm_run, criteo, tmp_path):
    result = export_run(deepfm_run, tmp_path / "export")
    description = json.loads((tmp_path / "export" / "export.json").read_text())
    program = torch.export.load(str(tmp_path / "export" / "model.pt2"))
    model = dlrmflow.load_model(deepfm_run)
    batch = next(iter(BatchStream(criteo, 64)))

    assert result["format"] == description["format"] == "torch.export program" and result["embedding_dim"] == 5
    with torch.no_grad():
        logits = program.module()(torch.tensor(batch.dense), torch.from_numpy(batch.sparse.astype(np.int64)))
    assert np.array_equal(_bits(torch.sigmoid(logits).numpy()), _bits(model.predict(batch)))
    weights = program.state_dict["embeddings.C7.weight"]
    assert torch.equal(weights, torch.from_numpy(model.table_rows(6)))  # factors and first-order weight: D + 1


def test_a_second_export_replaces_the_first(dlrm_run, tmp_path):
    export_run(dlrm_run, tmp_path / "export")
    (tmp_path / "export" / "left-over").write_text("x")
    export_run(dlrm_run, tmp_path / "export")
    assert not (tmp_path / "export" / "left-over").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging directory left


def test_a_run_whose_dataset_is_gone_loads_but_does_not_export(dlrm_run, tmp_path):
    """Its feature names and vocabulary went with the dataset: the model loads and predicts from arrays; a table
    by column names and the export are refused, and the refused export leaves no directory behind."""
    run = _damaged(dlrm_run, tmp_path, lambda r: (r / "summary.json").write_text(
        (r / "summary.json").read_text().replace(str(run_dataset(dlrm_run)), str(tmp_path / "gone"))))
    model = dlrmflow.load_model(run)
    assert model.features.sparse is None
    assert model.predict({"dense": np.zeros((1, 13)), "sparse": np.zeros((1, 26), np.int64)}).shape == (1,)
    with pytest.raises(ModelInputError, match="column names are unknown"):
        model.predict(pq.read_table(run_dataset(dlrm_run) / "part-00000.parquet"))
    with pytest.raises(ExportError, match="the dataset it trained on is gone or was rewritten"):
        export_run(run, tmp_path / "new" / "export")
    assert not (tmp_path / "new").exists()


def run_dataset(run_dir: Path) -> Path:
    return Path(json.loads((run_dir / "summary.json").read_text())["dataset"])


def test_a_dlrm_with_a_one_layer_top_mlp_does_not_fit_torchrecs_over_arch(tmp_path):
    dataset = make_dataset(tmp_path / "data", 2)
    train(small_config(dataset, tmp_path / "run", "local", iterations=2, top_mlp=(1,)))
    with pytest.raises(ExportError, match=r"TorchRec's DLRM needs an over arch of two layers or more; this run's "
                                          r"top MLP is \[1\]"):
        export_run(tmp_path / "run", tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_export_on_the_command_line(dlrm_run, tmp_path, capsys, prefect_harness):
    from dlrmflow.cli import main

    assert main(["export", str(dlrm_run), "--to", "torchrec", "--output", str(tmp_path / "out"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["output"] == str((tmp_path / "out").resolve()) and result["model"] == "dlrm"
    assert result["tables"] == 26 and result["vocabulary"] and "model.pt" in result["files"]
    assert main(["export", str(dlrm_run), "--output", str(tmp_path / "out")]) == 0
    summary = capsys.readouterr().out
    assert "the dlrm model as a torchrec.models.dlrm.DLRM state dict" in summary and "(checked)" in summary


# What makes the input bad, the error's words, and whether the command's check refuses it before the flow starts
# (then stderr holds that line alone; a refusal inside the flow comes last, after the flow's own log lines).
BAD_EXPORTS = {
    "an unknown target": (lambda run, out: ["--to", "onnx"], "--to 'onnx': this version exports to torchrec", True),
    "an unfinished run": (lambda run, out: (run / "UNFINISHED").write_text("{}") and [], "holds an unfinished run",
                          True),
    "an output directory with other files": (lambda run, out: out.mkdir() or (out / "notes.txt").write_text("x") and [],
                                             "holds files and no earlier export", True),
    "a damaged final state": (lambda run, out: _flip_last_byte(run / "final_state" / "shard-0.npy") or [],
                              "do not hash to the manifest's state SHA-256", False),
}


@pytest.mark.parametrize("bad", BAD_EXPORTS)
def test_bad_input_is_one_line_exit_2_and_nothing_written(bad, dlrm_run, tmp_path, capsys, prefect_harness):
    from dlrmflow.cli import main

    run = tmp_path / "run"
    shutil.copytree(dlrm_run, run)
    out = tmp_path / "out"
    make_bad, message, before_the_flow = BAD_EXPORTS[bad]
    extra = make_bad(run, out) or []
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export", str(run), "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dlrmflow export: error: ") and message in err[-1], err
    assert len(err) == 1 or not before_the_flow, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no staging directory
    assert not out.exists() or sorted(p.name for p in out.iterdir()) in ([], ["notes.txt"])
