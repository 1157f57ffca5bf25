"""The four models (``--model dlrm|wide-deep|deepfm|dcn-v2``): each forward pass against its paper's
formula, written out here; the per-id weights living in the embedding row; the hidden layers'
initialisation (``--hidden-init``); every mode ending bit-identical to local for every model;
learning the generator's labels and real Criteo rows; bad input as one line.

How forward passes are compared. The models evaluate their formulas in other orders than a loop
does (Rendle's identity for the FM term, batched matrix products, vectorised sums), so float32
results may differ from a loop in the last bits. The comparisons therefore run on a float64 copy
of the model whose parameters, and whose inputs, are small multiples of 1/4: every product and sum
is then exact in float64, any order of operations gives the same bits, and ``torch.equal`` applies.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_recovery import Cluster
from test_resume import Crash, crash_at, crash_then_resume
from test_trainers import assert_bit_identical, keep_all_plan, make_dataset

from dlrmflow.cli import main
from dlrmflow.datasets import synthetic
from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine import models
from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models.dcn_v2 import DCNv2Config
from dlrmflow.engine.models.deepfm import DeepFMConfig
from dlrmflow.engine.models.wide_deep import WideDeepConfig
from dlrmflow.engine.run_state import bit_equal, load_state
from dlrmflow.engine.serving.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.training.config import DENSE_OPTIMIZERS, MODELS, TrainConfig, replace
from dlrmflow.engine.training.job import prepare_run, train
from dlrmflow.engine.training.row_updates import apply_update, apply_update_rowwise, correctly_rounded_sqrt
from dlrmflow.engine.training.run_directory import RUN_CONFIG_FILE, config_sha256

DATA = Path(__file__).parent / "data"

# Small architectures of every model for the runs below (the published defaults are exercised on the
# real Criteo rows).
SMALL = {"dlrm": {"bottom_mlp": (8, 4), "top_mlp": (8, 1)}, "wide-deep": {"dnn": (8, 8)}, "deepfm": {"dnn": (8,)},
         "dcn-v2": {"dnn": (8,), "cross_layers": 2}}


def run_config(dataset: Path, out: Path, mode: str, model: str, **kw) -> TrainConfig:
    base = dict(dataset_dir=str(dataset), mode=mode, output_dir=str(out), batch_size=16, iterations=12,
                embedding_dim=4, eval_fraction=0.1, metrics_every=5, embedding_lr=0.05, model=model, **SMALL[model])
    return TrainConfig(**{**base, **kw})


# ---- the registry -----------------------------------------------------------------------------------


def test_the_cli_choices_are_the_registrys_models():
    assert tuple(models.MODULES) == MODELS == TrainConfig.model_fields["model"].annotation.__args__


def test_a_row_holds_every_per_id_parameter():
    """Wide & Deep's wide weight and DeepFM's first-order weight sit next to the factor vector."""
    assert {name: models.row_width(name, 16) for name in MODELS} == {
        "dlrm": 16, "wide-deep": 17, "deepfm": 17, "dcn-v2": 16}


def test_a_first_order_weight_keeps_an_accumulator_of_its_own(tmp_path):
    """Under row-wise Adagrad the row of Wide & Deep and DeepFM is [v (D), w, a_v, a_w]: the embedding shares
    one accumulator, the first-order weight has its own; DLRM's and DCN-v2's is [v (D), a_v]; SGD keeps no
    state."""
    assert {name: models.first_order_columns(name) for name in MODELS} == {
        "dlrm": 0, "wide-deep": 1, "deepfm": 1, "dcn-v2": 0}
    dataset = make_dataset(tmp_path / "data", 3)
    for name in MODELS:
        for optimizer, state in (("adagrad", 1 + models.first_order_columns(name)), ("sgd", 0)):
            spec = prepare_run(run_config(dataset, tmp_path / name, "local", name,
                                          embedding_optimizer=optimizer)).spec
            assert (spec.dim, spec.state_width, spec.width) == (
                models.row_width(name, 4), state, models.row_width(name, 4) + state), (name, optimizer)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("update", [apply_update, apply_update_rowwise])
def test_adagrad_per_value_keeps_an_accumulator_for_every_value_of_a_row(update, name, tmp_path):
    """--embedding-optimizer adagrad-per-value: a row of D values carries D accumulators, and three steps of
    random sparse gradients move each value by its own (Adagrad per value, as torch.optim.Adagrad and
    DeepCTR-Torch: ``a += g^2``, ``v -= g / (sqrt(a) + eps) * lr``, each step rounded to float32), bit for bit."""
    dataset = make_dataset(tmp_path / "data", 3)
    spec = prepare_run(run_config(dataset, tmp_path / "run", "local", name,
                                  embedding_optimizer="adagrad-per-value")).spec
    width = models.row_width(name, 4)
    assert (spec.dim, spec.state_width, spec.width) == (width, width, 2 * width)
    rng = np.random.default_rng(5)
    rows = init_rows(spec, np.arange(30))
    values, sums = rows[:, :width].copy(), np.zeros((30, width), np.float32)
    for _ in range(3):
        grad = rng.standard_normal((30, width)).astype(np.float32)
        grad[rng.random(30) < 0.3] = 0.0  # ids not in this batch
        rows = update(spec, torch.from_numpy(rows), torch.from_numpy(grad)).numpy()
        sums = sums + grad * grad
        values = values - grad / (np.sqrt(sums) + np.float32(spec.eps)) * np.float32(spec.lr)
    # The shared accumulator (first state value) serves value 0; the own accumulators, values 1..D-1, follow.
    own = np.concatenate([rows[:, width + 1:], rows[:, width:width + 1]], axis=1)
    assert np.array_equal(own.view(np.int32), np.roll(sums, -1, axis=1).view(np.int32))
    # Value 0 sits in the row's shared group, which apply_update steps with one fused addcdiv (its rounding);
    # the others, and all of them row by row, are the formula's bits.
    exact = slice(0, width) if update is apply_update_rowwise else slice(1, width)
    assert np.array_equal(rows[:, exact].view(np.int32), values[:, exact].view(np.int32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_the_rows_square_root_is_the_correctly_rounded_one_on_any_machine(device):
    """Adagrad's update runs on the servers or on the trainers, by mode, so its square root must give the same
    bits on every machine: the correctly rounded float32 (IEEE 754's, NumPy's), at every magnitude."""
    rng = np.random.default_rng(11)
    exponents = rng.uniform(-149, 128, 200_000)
    values = (rng.uniform(1, 2, exponents.size) * 2.0 ** exponents).astype(np.float32)
    edges = np.float32([0.0, 1e-45, np.finfo(np.float32).tiny, 1.0, np.finfo(np.float32).max, np.inf])
    values = np.concatenate([values, edges])
    got = correctly_rounded_sqrt(torch.from_numpy(values).to(device)).cpu().numpy()
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.int32), np.sqrt(values).view(np.int32))


@pytest.mark.parametrize("update", [apply_update, apply_update_rowwise])
def test_only_the_first_order_weights_gradient_moves_its_accumulator(update):
    """A gradient on the first-order weight alone changes that weight and its own accumulator, nothing else
    (Adagrad per value: ``a_w += g^2``, ``w -= lr * g / (sqrt(a_w) + eps)``, each step rounded to float32); a
    gradient on the embedding alone leaves both as they were."""
    spec = RowSpec(5, "adagrad", 0, (0,), (40,), lr=0.1, init_std=1e-4, own_accumulator_columns=1)
    rng = np.random.default_rng(4)
    rows = init_rows(spec, np.arange(40))
    rows[:, 5:] = rng.random((40, 2)).astype(np.float32)  # accumulators that have seen some steps
    first_order = np.zeros((40, 5), np.float32)
    first_order[:, 4] = rng.standard_normal(40).astype(np.float32)
    first_order[::7, 4] = 0.0
    after = update(spec, torch.from_numpy(rows.copy()), torch.from_numpy(first_order)).numpy()
    assert np.array_equal(after[:, [0, 1, 2, 3, 5]].view(np.int32), rows[:, [0, 1, 2, 3, 5]].view(np.int32))
    g = first_order[:, 4]
    own = rows[:, 6] + g * g
    assert np.array_equal(after[:, 6].view(np.int32), own.view(np.int32))
    w = rows[:, 4] - g / (np.sqrt(own) + np.float32(spec.eps)) * np.float32(spec.lr)
    assert np.array_equal(after[:, 4].view(np.int32), w.view(np.int32))
    assert (after[1:7, 4] != rows[1:7, 4]).all()

    embedding = rng.standard_normal((40, 5)).astype(np.float32)
    embedding[:, 4] = 0.0
    after = update(spec, torch.from_numpy(rows.copy()), torch.from_numpy(embedding)).numpy()
    assert np.array_equal(after[:, [4, 6]].view(np.int32), rows[:, [4, 6]].view(np.int32))
    assert (after[:, 5] > rows[:, 5]).all() and (after[:, :4] != rows[:, :4]).all()


def test_the_published_defaults():
    """BARS Criteo_x1 (reczoo/BARS): DNN 400-400-400 for Wide & Deep and DeepFM; DCN-v2 parallel,
    3 cross layers beside a 500-500-500 DNN."""
    settings = TrainConfig(dataset_dir="d", mode="local", output_dir="o", model="dcn-v2")
    arch = {name: models.architecture(models.model_config(name, TrainConfig(
        dataset_dir="d", mode="local", output_dir="o", model=name), num_dense=13, num_tables=26)) for name in MODELS}
    assert arch["wide-deep"]["dnn"] == arch["deepfm"]["dnn"] == [400, 400, 400]
    assert (arch["dcn-v2"]["dnn"], arch["dcn-v2"]["cross_layers"]) == ([500, 500, 500], 3)
    assert (arch["dlrm"]["bottom_mlp"], arch["dlrm"]["top_mlp"]) == ([512, 256, 64, 16], [512, 256, 1])
    assert models.model_config("dcn-v2", settings, num_dense=13, num_tables=26).input_width == 26 * 16 + 13


# Every model with each hidden layers' initialisation it can have (DLRM: its own, no --hidden-init).
INITS = [(name, None) for name in MODELS if "hidden_init" not in models.MODEL_SETTINGS[name]] + [
    (name, init) for name in MODELS if "hidden_init" in models.MODEL_SETTINGS[name] for init in models.HIDDEN_INITS]


def hidden_init_setting(init: str | None) -> dict:
    return {} if init is None else {"hidden_init": init}


@pytest.mark.parametrize(("name", "init"), INITS)
def test_init_is_a_function_of_the_config_and_seed(name, init):
    config = models.model_config(name, run_config(Path("d"), Path("o"), "local", name, **hidden_init_setting(init)),
                                 num_dense=3, num_tables=4)
    a, b, c = (models.build_model(config, seed) for seed in (1, 1, 2))
    for (key, p), q, r in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(),
                              strict=True):
        assert bit_equal(p, q), key
        if p.abs().sum() > 0:  # biases that start at 0 do so whatever the seed
            assert not bit_equal(p, r), key


@pytest.fixture(scope="module")
def fresh_rows() -> tuple[torch.Tensor, np.ndarray, list[int]]:
    """4,000 rows of the synthetic Criteo generator as `dlrmflow preprocess` writes them: dense
    log(1 + x) (up to about 15 here), ids by popularity rank; the tables' sizes."""
    scale = 0.001
    arrays = synthetic.generate_arrays(0, 4000, seed=5, scale=scale)
    dense = np.log1p(np.maximum(arrays["dense"], 0)).astype(np.float32)
    dense[arrays["dense_missing"]] = 0.0
    sparse = np.where(arrays["cat_missing"], 0, arrays["ranks"]).astype(np.int64)
    return torch.from_numpy(dense), sparse, [c + 1 for c in synthetic.max_cardinalities(scale)]


@pytest.mark.parametrize(("name", "init"), INITS)
def test_the_initial_logit_is_small(name, init, fresh_rows):
    """With the published architectures and the rows as the run initialises them, the initial logit's
    standard deviation over the rows is below 0.25 for every seed and either hidden layers' initialisation:
    training starts near a constant prediction (a spread of 0.25 moves a probability near the click rate by
    about +-5 points) and the one output bias is free to find the click rate. The initialisation before the
    references' (rows uniform in +-sqrt(1/n), Glorot dense weights on features up to 15, normal output
    biases) gave 1.7 to 2.6 for wide-deep, 3.3 to 3.9 for deepfm and 0.33 to 0.83 for dcn-v2 on these rows;
    dlrm keeps facebookresearch/dlrm's rule (0.10 to 0.12)."""
    dense, sparse, cards = fresh_rows
    settings = TrainConfig(dataset_dir="d", mode="local", output_dir="o", model=name, **hidden_init_setting(init))
    config = models.model_config(name, settings, num_dense=dense.shape[1], num_tables=sparse.shape[1])
    offsets = tuple(int(o) for o in np.cumsum([0, *cards[:-1]]))
    width = models.row_width(name, config.embedding_dim)
    ids = (sparse + np.asarray(offsets)).reshape(-1)
    for seed in range(3):
        spec = RowSpec(width, "adagrad", seed, offsets, tuple(cards), init_std=models.row_init_std(name))
        rows = torch.from_numpy(init_rows(spec, ids)[:, :width]).view(len(sparse), -1, width)
        with torch.no_grad():
            logits = models.build_model(config, seed)(dense, rows)
        assert logits.std() < 0.25, (name, seed, float(logits.std()))


def test_only_dlrm_keeps_the_per_table_row_bound():
    """facebookresearch/dlrm's rows (+-sqrt(1/n) per table) for dlrm; the others start every row value
    with DeepCTR-Torch's init_std, 1e-4."""
    assert {name: models.row_init_std(name) for name in MODELS} == {
        "dlrm": None, "wide-deep": 1e-4, "deepfm": 1e-4, "dcn-v2": 1e-4}
    spec = RowSpec(5, "adagrad", 0, (0, 4), (4, 1000), init_std=1e-4)
    rows = init_rows(spec, np.arange(1004))
    assert np.abs(rows[:, :5]).max() <= np.float32(np.sqrt(3) * 1e-4) and 0.8e-4 < rows[:, :5].std() < 1.2e-4
    assert not rows[:, 5:].any()  # the Adagrad accumulator starts at 0


# ---- the hidden layers' initialisation (--hidden-init) ------------------------------------------------


def hidden_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The DNN's hidden layers (Wide & Deep's and DeepFM's deep part without its output unit; DCN-v2's DNN)."""
    layers = [m for m in model.deep if isinstance(m, torch.nn.Linear)]
    return layers if model.config.name == "dcn-v2" else layers[:-1]


def test_auto_picks_the_hidden_init_by_the_dense_optimizer():
    """auto: Glorot under SGD (a DNN of 1e-4 weights does not learn by SGD's steps), DeepCTR-Torch's rule under
    Adam; every dense optimizer has its rule; an explicit setting is taken as it is."""
    assert set(models.AUTO_HIDDEN_INIT) == set(DENSE_OPTIMIZERS)
    assert models.AUTO_HIDDEN_INIT == {"sgd": "glorot", "adam": "deepctr"}
    for name in ("wide-deep", "deepfm", "dcn-v2"):
        for optimizer in DENSE_OPTIMIZERS:
            for setting in models.HIDDEN_INIT_SETTINGS:
                settings = TrainConfig(dataset_dir="d", mode="local", output_dir="o", model=name,
                                       dense_optimizer=optimizer, hidden_init=setting)
                config = models.model_config(name, settings, num_dense=3, num_tables=4)
                expected = models.AUTO_HIDDEN_INIT[optimizer] if setting == "auto" else setting
                assert config.hidden_init == expected, (name, optimizer, setting)


@pytest.mark.parametrize("name", ["wide-deep", "deepfm", "dcn-v2"])
def test_the_hidden_init_reaches_the_model(name, tmp_path):
    """`dlrmflow train --hidden-init` reaches the run's architecture, its summary and final state, and the
    model's hidden layers: glorot, N(0, sqrt(2 / (in + out))) weights and zero biases; deepctr, N(0, 1e-4)
    weights and biases uniform in +-1/sqrt(in). DCN-v2's cross layers are the same bits under either."""
    from dlrmflow.cli import build_parser
    from dlrmflow.commands.train import config_from_args

    dataset = make_dataset(tmp_path / "data", 3)
    built = {}
    for init in models.HIDDEN_INITS:
        args = build_parser().parse_args(["train", str(dataset), "--mode", "local", "--output", str(tmp_path / init),
                                          "--model", name, "--dnn", "64-32", "--hidden-init", init])
        config = config_from_args(args)
        setup = prepare_run(config)
        assert setup.model_config.hidden_init == init
        model = built[init] = models.build_model(setup.model_config, 0)
        for layer in hidden_linears(model):
            weight, bias, bound = layer.weight, layer.bias, 1 / np.sqrt(layer.in_features)
            if init == "glorot":
                assert 0.8 < float(weight.detach().std()) / np.sqrt(2 / (layer.in_features + layer.out_features)) < 1.2
                assert not bias.any()
            else:
                assert 0.8e-4 < float(weight.detach().std()) < 1.2e-4 and float(bias.detach().abs().max()) <= bound
                assert float(bias.detach().std()) > 0.8 * bound / np.sqrt(3)
        summary = train(replace(config, iterations=2))
        assert summary["architecture"]["hidden_init"] == init
        assert load_state(tmp_path / init)["model_config"]["hidden_init"] == init
    glorot, deepctr = (dict(built[init].named_parameters()) for init in models.HIDDEN_INITS)
    assert {k: v.shape for k, v in glorot.items()} == {k: v.shape for k, v in deepctr.items()}
    if name == "dcn-v2":  # drawn before the DNN: the cross layers are the same bits under either rule
        assert all(bit_equal(glorot[k], deepctr[k]) for k in glorot if k.startswith("cross."))


def test_dlrm_refuses_the_hidden_init():
    """DLRM keeps facebookresearch/dlrm's initialisation: an explicit --hidden-init is refused in one line."""
    with pytest.raises(UserInputError) as error:
        TrainConfig(dataset_dir="d", mode="local", output_dir="o", hidden_init="deepctr")
    assert str(error.value) == ("hidden_init: --hidden-init is used by --model wide-deep, deepfm, dcn-v2, not "
                                "--model dlrm")
    assert not hasattr(models.model_config("dlrm", TrainConfig(dataset_dir="d", mode="local", output_dir="o",
                                                               dense_optimizer="adam"), num_dense=3, num_tables=4),
                       "hidden_init")


def test_a_run_recorded_before_the_hidden_init_resumes_as_it_started(clusters, tmp_path, monkeypatch):
    """A checkpointed run whose run_config.json has no hidden_init (a dlrmflow before the setting: its hidden layers
    Glorot's, whatever the dense optimizer) resumes with glorot, under the configuration SHA-256 its checkpoint
    recorded, and ends bit-identical to the uninterrupted run. A DLRM configuration hashes as it did."""
    from dlrmflow.commands.resume import resumed_config

    dataset = make_dataset(tmp_path / "data", 5)
    config = run_config(dataset, tmp_path / "full", "lru", "deepfm", capacity=120, checkpoint_every=4,
                        dense_optimizer="adam", hidden_init="glorot")
    full = train(config, client=clusters.get())
    crashed = replace(config, output_dir=str(tmp_path / "crashed"))
    with monkeypatch.context() as patch:
        crash_at(patch, 7)
        with pytest.raises(Crash):
            train(crashed, client=clusters.get())
    path = tmp_path / "crashed" / RUN_CONFIG_FILE
    recorded = json.loads(path.read_text())
    del recorded["config"]["hidden_init"]
    path.write_text(json.dumps(recorded))
    resumed = resumed_config(str(tmp_path / "crashed"))
    assert resumed.hidden_init == "glorot"
    summary = train(resumed, client=clusters.get())
    assert summary["state_sha256"] == full["state_sha256"] and summary["architecture"]["hidden_init"] == "glorot"
    dlrm = run_config(dataset, tmp_path / "dlrm", "lru", "dlrm", capacity=120, checkpoint_every=4).model_dump()
    assert config_sha256(dlrm) == config_sha256({k: v for k, v in dlrm.items() if k != "hidden_init"})


def test_init_from_a_run_recorded_before_the_hidden_init(tmp_path):
    """A finished run whose summary records no hidden_init was built with glorot hidden layers: a run continues
    it with glorot, and another rule is refused in one line naming both."""
    dataset = make_dataset(tmp_path / "data", 6)
    parent = tmp_path / "parent"
    train(run_config(dataset, parent, "local", "wide-deep", iterations=3))
    summary = json.loads((parent / "summary.json").read_text())
    del summary["architecture"]["hidden_init"]
    (parent / "summary.json").write_text(json.dumps(summary))
    assert prepare_run(run_config(dataset, tmp_path / "child", "local", "wide-deep", init_from=str(parent))).init_from
    with pytest.raises(UserInputError) as error:
        prepare_run(run_config(dataset, tmp_path / "other", "local", "wide-deep", init_from=str(parent),
                               hidden_init="deepctr"))
    assert str(error.value) == f"hidden_init: --init-from {parent} has hidden_init glorot, this run deepctr"


# ---- forward passes against the papers' formulas -------------------------------------------------------


def quarters(shape, generator: torch.Generator) -> torch.Tensor:
    """float64 multiples of 1/4 in [-3/4, 3/4]: products and sums of a few of them are exact."""
    return torch.randint(-3, 4, shape, generator=generator).double() / 4


def exact_copy(config, seed: int):
    """The model of ``config`` in float64 with parameters that are multiples of 1/4."""
    model = models.build_model(config, seed).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(quarters(p.shape, generator))
    return model


def inputs(config, width: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + seed)
    return (quarters((batch, config.num_dense), generator),
            quarters((batch, config.num_tables, width), generator))


def linears(seq: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in seq if isinstance(m, torch.nn.Linear)]


def dnn_by_hand(layers: list[torch.nn.Linear], a: torch.Tensor, linear_output: bool) -> torch.Tensor:
    """a_{l+1} = ReLU(W_l a_l + b_l), the last layer without ReLU when ``linear_output``."""
    for i, layer in enumerate(layers):
        a = layer.weight @ a + (0 if layer.bias is None else layer.bias)
        if not (linear_output and i == len(layers) - 1):
            a = torch.relu(a)
    return a


@pytest.mark.parametrize("seed", range(3))
def test_wide_and_deep_is_the_papers_formula(seed):
    """logit = sum of the ids' wide weights + <a, dense> + b  +  DNN([v_1..v_T, dense])."""
    rng = np.random.default_rng(seed)
    config = WideDeepConfig(int(rng.integers(0, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 4)),
                            tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 3)))))
    model = exact_copy(config, seed)
    dense, rows = inputs(config, config.embedding_dim + 1, 5, seed)
    dim = config.embedding_dim
    expected = []
    for b in range(len(dense)):
        wide = model.bias.clone()
        for k in range(config.num_tables):
            wide = wide + rows[b, k, dim]  # the wide weight of the id in field k
        for j in range(config.num_dense):
            wide = wide + model.dense_weight[j] * dense[b, j]
        deep = dnn_by_hand(linears(model.deep), torch.cat([rows[b, :, :dim].reshape(-1), dense[b]]), True)
        expected.append(wide + deep[0])
    assert torch.equal(model(dense, rows), torch.stack(expected))


@pytest.mark.parametrize("seed", range(3))
def test_deepfm_is_the_papers_formula(seed):
    """logit = b + <a, dense> + sum_k w_k + sum_{i<j} <v_i, v_j>  +  DNN([v_1..v_T, dense]); the pairwise
    term by a double loop over the fields."""
    rng = np.random.default_rng(10 + seed)
    config = DeepFMConfig(int(rng.integers(0, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 4)),
                          tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 3)))))
    model = exact_copy(config, seed)
    dense, rows = inputs(config, config.embedding_dim + 1, 5, seed)
    dim, fields = config.embedding_dim, config.num_tables
    expected = []
    for b in range(len(dense)):
        v = rows[b, :, :dim]
        fm = model.bias.clone()
        for j in range(config.num_dense):
            fm = fm + model.dense_weight[j] * dense[b, j]
        for k in range(fields):
            fm = fm + rows[b, k, dim]  # the first-order weight of the id in field k
        for i in range(fields):
            for j in range(i + 1, fields):
                fm = fm + (v[i] * v[j]).sum()
        deep = dnn_by_hand(linears(model.deep), torch.cat([v.reshape(-1), dense[b]]), True)
        expected.append(fm + deep[0])
    assert torch.equal(model(dense, rows), torch.stack(expected))


@pytest.mark.parametrize("seed", range(3))
def test_dcn_v2_is_the_papers_formula(seed):
    """x_0 = [v_1..v_T, dense]; x_{l+1} = x_0 * (W_l x_l + b_l) + x_l; logit = <u, [x_L, DNN(x_0)]> + c."""
    rng = np.random.default_rng(20 + seed)
    config = DCNv2Config(int(rng.integers(0, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 4)),
                         tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 3)))),
                         int(rng.integers(1, 4)))
    model = exact_copy(config, seed)
    dense, rows = inputs(config, config.embedding_dim, 4, seed)
    expected = []
    for b in range(len(dense)):
        x0 = torch.cat([rows[b].reshape(-1), dense[b]])
        x = x0
        for layer in model.cross:
            w, bias = layer.weight, layer.bias
            x = torch.stack([x0[i] * (sum(w[i, j] * x[j] for j in range(len(x))) + bias[i]) + x[i]
                             for i in range(len(x))])
        h = dnn_by_hand(linears(model.deep), x0, False)
        both = torch.cat([x, h])
        u, c = model.output.weight[0], model.output.bias[0]
        expected.append(sum(u[i] * both[i] for i in range(len(both))) + c)
    assert torch.equal(model(dense, rows), torch.stack(expected))


@pytest.mark.parametrize("name", ["wide-deep", "deepfm"])
def test_the_per_id_weight_gets_its_gradient_through_the_row(name):
    """d logit / d w_k = 1 for each field's first-order (wide) weight: the embedding optimizer trains it
    as one more value of the id's row."""
    config = models.model_config(name, run_config(Path("d"), Path("o"), "local", name), num_dense=3, num_tables=4)
    rows = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    models.build_model(config, 0)(torch.randn(6, 3), rows).sum().backward()
    assert torch.equal(rows.grad[:, :, 4], torch.ones(6, 4))
    assert rows.grad[:, :, :4].abs().sum() > 0


# ---- every mode ends bit-identical to local, for every model --------------------------------------------


@pytest.fixture(scope="module")
def clusters():
    """One LocalCluster of 4 worker processes for every mode of every model (K = 2 shards, R = 1 parity
    shard, a spare), started afresh only if a killed worker does not come back (test_recovery)."""
    holder = Cluster()
    yield holder
    holder.close()


@pytest.mark.parametrize(("name", "dense"), [(name, {}) for name in MODELS]
                         + [("deepfm", {"dense_optimizer": "adam", "embedding_optimizer": "adagrad"}),
                            ("dcn-v2", {"dense_optimizer": "adam"})])
def test_every_mode_ends_bit_identical_to_local(name, dense, clusters, tmp_path, monkeypatch):
    """remote, lru, oracle; oracle with a parity shard and a killed data shard; lru with checkpoints, a
    trainer crash and a resume: each run's final state equals local's, bit for bit (under Adam too, whose
    hidden layers start DeepCTR-Torch's way; each model's default rows, and DeepFM's row-wise ones: one accumulator
    for the embedding, one for the first-order weight)."""
    dataset = make_dataset(tmp_path / "data", 3)
    plan = keep_all_plan(dataset, 16, 12, 2)

    def run(out: str, mode: str, **kw) -> dict:
        config = run_config(dataset, tmp_path / out, mode, name, **dense, **kw)
        return train(config, client=clusters.get(), setup=prepare_run(config, plan=plan if mode == "oracle" else None))

    local = run("local", "local")
    reference = load_state(tmp_path / "local")
    assert reference["model"] == name and reference["embedding"]["dim"] == models.row_width(name, 4)
    for out, mode, kw in [("remote", "remote", {}), ("lru", "lru", {"capacity": 120}), ("oracle", "oracle", {}),
                          ("oracle-parity-kill", "oracle", {"parity": 1, "kills": ["shard:0@5"]})]:
        summary = run(out, mode, **kw)
        assert summary["state_sha256"] == local["state_sha256"], out
        assert_bit_identical(reference, load_state(tmp_path / out), out)
    assert summary["parity"]["recoveries"] and summary["parity"]["verify"]["ok"]
    crashed = run_config(dataset, tmp_path / "full", "lru", name, capacity=120, checkpoint_every=4, **dense)
    *_, resumed = crash_then_resume(crashed, tmp_path, monkeypatch, clusters.get(), crash=7, every=4)
    assert resumed["state_sha256"] == local["state_sha256"]
    assert_bit_identical(reference, load_state(tmp_path / "crashed"), "resumed")


SCHEDULE = {"lr_num_warmup_steps": 4, "lr_decay_start_step": 6, "lr_num_decay_steps": 5}


def test_a_schedule_and_evaluations_keep_every_mode_bit_identical_to_local(clusters, tmp_path):
    """With MLPerf DLRM's warm-up and decay, remote, lru and oracle end bit-identical to local; evaluating
    the held-out rows every 3 iterations (which reads rows mid-run, from caches and servers) changes no bit
    of any of them, and the evaluations land in the summary."""
    dataset = make_dataset(tmp_path / "data", 3)
    plan = keep_all_plan(dataset, 16, 12, 2)

    def run(out: str, mode: str, **kw) -> dict:
        config = run_config(dataset, tmp_path / out, mode, "deepfm", **kw)
        return train(config, client=clusters.get(), setup=prepare_run(config, plan=plan if mode == "oracle" else None))

    plain = run("plain", "local")
    local = run("local", "local", **SCHEDULE)
    assert local["state_sha256"] != plain["state_sha256"]  # the schedule does change the run
    assert local["lr_schedule"] == {"warmup_steps": 4, "decay_start_step": 6, "decay_steps": 5}
    for out, mode, kw in [("local-eval", "local", {}), ("remote", "remote", {}), ("lru", "lru", {"capacity": 120}),
                          ("oracle", "oracle", {})]:
        summary = run(out, mode, eval_every=3, **SCHEDULE, **kw)
        assert summary["state_sha256"] == local["state_sha256"], out
        assert [e["iteration"] for e in summary["evaluations"]] == [3, 6, 9, 12], out
        assert summary["evaluations"][-1] == {"iteration": 12, "auc": local["eval_auc"],
                                              "logloss": local["eval_log_loss"]}, out
        best = min(summary["evaluations"], key=lambda e: e["logloss"])
        assert summary["best_evaluation_iteration"] == best["iteration"], out
    assert run("plain-eval", "local", eval_every=5)["state_sha256"] == plain["state_sha256"]
    assert [e["iteration"] for e in plain["evaluations"]] == [12]  # without --eval-every: the final one


def test_a_run_with_another_schedule_or_evaluations_is_not_up_to_date(tmp_path):
    """The pipeline reuses a finished run only if it trained with the same schedule and --eval-every."""
    from dlrmflow.engine.training.config import replace
    from dlrmflow.engine.training.summary import saved_run

    config = run_config(make_dataset(tmp_path / "data", 1), tmp_path / "run", "local", "wide-deep", iterations=3)
    fingerprint = train(config)["dataset_fingerprint"]
    assert saved_run(config, fingerprint) is not None
    assert saved_run(replace(config, lr_num_warmup_steps=2), fingerprint) is None
    assert saved_run(replace(config, eval_every=2), fingerprint) is None


def test_the_schedule_is_mlperf_dlrms():
    """facebookresearch/dlrm's LRPolicyScheduler at step count s = t + 1: linear warm-up s / W, then the base
    rate, the decay ((N - (s - D)) / N)^2 from step D, then its last value."""
    from dlrmflow.engine.training.schedule import LrSchedule

    schedule = LrSchedule(warmup_steps=4, decay_start_step=6, decay_steps=5)
    rates = [schedule.lr(2.0, t) for t in range(12)]
    assert rates == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0 * 1.0, 2.0 * (4 / 5) ** 2, 2.0 * (3 / 5) ** 2, 2.0 * (2 / 5) ** 2,
                     2.0 * (1 / 5) ** 2, 2.0 * (1 / 5) ** 2, 2.0 * (1 / 5) ** 2]
    assert LrSchedule().constant and all(LrSchedule().lr(0.01, t) == 0.01 for t in range(5))
    assert LrSchedule(warmup_steps=3).lr(0.3, 0) == pytest.approx(0.1) and LrSchedule(warmup_steps=3).lr(0.3, 2) == 0.3


# ---- learning ---------------------------------------------------------------------------------------

# Architectures for embedding dim 8, small enough to train in a second or two on 2 cores.
LEARNING = {"dlrm": {"bottom_mlp": (16, 8), "top_mlp": (16, 1)}, "wide-deep": {"dnn": (32, 32)},
            "deepfm": {"dnn": (32, 32)}, "dcn-v2": {"dnn": (32, 32), "cross_layers": 2}}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """10,000 rows of the synthetic Criteo generator, preprocessed as `dlrmflow preprocess` writes them
    (id 0 = missing, ids by popularity rank, dense log(max(x, 0) + 1)); its labels are learnable."""
    path = tmp_path_factory.mktemp("generated")
    scale = 0.001
    arrays = synthetic.generate_arrays(0, 10_000, seed=5, scale=scale)
    dense = np.log1p(np.maximum(arrays["dense"], 0)).astype(np.float32)
    dense[arrays["dense_missing"]] = 0.0
    sparse = np.where(arrays["cat_missing"], 0, arrays["ranks"]).astype(np.int32)
    cards = [c + 1 for c in synthetic.max_cardinalities(scale)]  # ranks reach past n in wide-tail tables
    write_array_dataset(path, arrays["labels"].astype(np.int8), dense, sparse, cards)
    return path


@pytest.mark.parametrize("name", MODELS)
def test_each_model_learns_the_generators_labels(name, generated, tmp_path):
    """Trained on the first 80% of the rows (62 batches of 128), the held-out 20% rank clicks well
    above chance: the labels depend on the head values and the dense features (datasets/synthetic)."""
    config = TrainConfig(dataset_dir=str(generated), mode="local", output_dir=str(tmp_path / "run"), model=name,
                         batch_size=128, embedding_dim=8, lr=0.003, embedding_lr=0.05, dense_optimizer="adam",
                         eval_fraction=0.2, save_state=False, **LEARNING[name])
    summary = train(config)
    assert summary["eval_rows"] == 2000 and summary["iterations"] == 62
    assert summary["eval_auc"] > 0.62, summary["eval_auc"]


def test_each_model_fits_the_real_criteo_sample(tmp_path):
    """The 200 real Criteo rows (13 dense, 26 categorical features), 5 shuffled passes: each model's loss
    falls and it ranks the rows it was trained on well (the eval tail is a copy of the 200 rows, as in
    test_trainers' DLRM test of the same data). Small layers keep it fast on 2 cores."""
    from dlrmflow.datasets.preprocess import preprocess

    preprocess([str(DATA / "criteo_kaggle_sample.csv")], tmp_path / "criteo", fmt="criteo-csv")
    stream = BatchStream(tmp_path / "criteo", 200)
    batch = next(iter(stream))
    rng = np.random.default_rng(0)
    order = np.concatenate([rng.permutation(200) for _ in range(5)] + [np.arange(200)])
    write_array_dataset(tmp_path / "passes", batch.labels[order], batch.dense[order], batch.sparse[order],
                        stream.meta.cardinalities)
    for name in MODELS:
        out = tmp_path / name
        config = TrainConfig(dataset_dir=str(tmp_path / "passes"), mode="local", output_dir=str(out), model=name,
                             batch_size=20, eval_fraction=200 / len(order), lr=0.003, embedding_lr=0.01,
                             dense_optimizer="adam", metrics_every=10, save_state=False, embedding_dim=8,
                             **LEARNING[name])
        summary = train(config)
        assert summary["iterations"] == 50 and summary["architecture"]["num_dense"] == 13
        with open(out / "iterations.csv") as f:
            losses = [float(r["loss"]) for r in csv.DictReader(f)]
        assert np.mean(losses[-10:]) < np.mean(losses[:10]), name
        assert summary["eval_auc"] > 0.7, (name, summary["eval_auc"])


# ---- bad input ---------------------------------------------------------------------------------------


def _train_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        status = main(["train", "data", "--mode", "local", "--output", "run", *argv])
    except SystemExit as exc:  # argparse refuses an unknown choice itself (after its usage lines)
        status = exc.code
    return status, capsys.readouterr().err.strip().splitlines()


def test_bad_model_settings_are_one_line(capsys):
    status, err = _train_cli(capsys, "--model", "bert")
    assert status == 2 and err[-1].endswith(
        "argument --model: invalid choice: 'bert' (choose from 'dlrm', 'wide-deep', 'deepfm', 'dcn-v2')")
    for argv, message in [
        (["--model", "dcn-v2", "--cross-layers", "0"], "cross_layers: --cross-layers must be >= 1, got 0"),
        (["--cross-layers", "2"], "cross_layers: --cross-layers is used by --model dcn-v2, not --model dlrm"),
        (["--dnn", "64-32"], "dnn: --dnn is used by --model wide-deep, deepfm, dcn-v2, not --model dlrm"),
        (["--model", "deepfm", "--cross-layers", "2"],
         "cross_layers: --cross-layers is used by --model dcn-v2, not --model deepfm"),
        (["--model", "wide-deep", "--bottom-mlp", "64-16"],
         "bottom_mlp: --bottom-mlp is used by --model dlrm, not --model wide-deep"),
        (["--model", "dcn-v2", "--top-mlp", "64-1"], "top_mlp: --top-mlp is used by --model dlrm, not --model dcn-v2"),
        (["--hidden-init", "glorot"],
         "hidden_init: --hidden-init is used by --model wide-deep, deepfm, dcn-v2, not --model dlrm"),
    ]:
        assert _train_cli(capsys, *argv) == (2, [f"dlrmflow train: error: {message}"]), argv


def test_model_configs_refuse_impossible_architectures():
    with pytest.raises(UserInputError, match="dnn: layer sizes must be positive"):
        DeepFMConfig(3, 2, 4, ())
    with pytest.raises(UserInputError, match="cross_layers: DCN-v2 needs at least one cross layer"):
        DCNv2Config(3, 2, 4, (8,), 0)


def test_dlrm_needs_dense_features_the_others_do_not(tmp_path):
    dataset = make_dataset(tmp_path / "data", 1, n_dense=0)
    with pytest.raises(UserInputError, match="^dataset_dir: the dataset has no dense features"):
        prepare_run(run_config(dataset, tmp_path / "run", "local", "dlrm"))
    for name in ("wide-deep", "deepfm", "dcn-v2"):
        assert train(run_config(dataset, tmp_path / name, "local", name, iterations=3))["iterations"] == 3
