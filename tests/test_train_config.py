"""TrainConfig: declared once (CLI, flow, pipeline derive from it), validated naming the field, one
``--kill`` rule, run_config.json round trip, and one ``prepare_run`` per run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from annotated_types import Ge, Gt, Le, Lt
from test_trainers import make_dataset

from dlrmflow.cli import build_parser, main
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models import MODELS
from dlrmflow.engine.serving.embedding_rows import EMBEDDING_OPTIMIZERS
from dlrmflow.engine.training import job as trainer_module
from dlrmflow.engine.training.config import TrainConfig, TrainConfigError, cli_option, replace
from dlrmflow.engine.training.faults import FaultSpecError, check_kills
from dlrmflow.engine.training.run_directory import config_sha256, start_run_dir

REQUIRED = {"dataset_dir": "data", "mode": "remote", "output_dir": "run"}


def parse_train(*argv: str):
    return build_parser().parse_args(["train", "data", "--mode", "remote", "--output", "run", *argv])


# ---- declared once ----------------------------------------------------------------------------------


def test_cli_defaults_are_the_model_defaults():
    from dlrmflow.commands.train import config_from_args

    args = parse_train()
    assert config_from_args(args) == TrainConfig(**REQUIRED)
    for name, info in TrainConfig.model_fields.items():
        if cli_option(name) is not None and not info.is_required():
            assert TrainConfig(**{**REQUIRED, name: getattr(args, name)}) == TrainConfig(**REQUIRED), name


def test_every_option_but_the_internal_ones_is_a_field():
    args = vars(parse_train())
    settings = {k for k in args if k not in ("command", "json", "dask_address", "_module")}
    assert settings == {name for name in TrainConfig.model_fields if cli_option(name) is not None}
    assert {name for name in TrainConfig.model_fields if cli_option(name) is None} == {
        "eval_batch_size", "save_state", "resume"}


def test_cli_options_keep_their_names_and_syntax():
    args = parse_train("--shards", "3", "--plan", "p", "--bottom-mlp", "512-256-64-16", "--kill", "shard:0@1",
                       "--kill", "parity:0@2", "--capacity", "9", "--checkpoint-every", "4")
    assert (args.num_shards, args.plan_dir, args.bottom_mlp, args.kills) == (
        3, "p", [512, 256, 64, 16], ["shard:0@1", "parity:0@2"])
    assert (args.dataset_dir, args.output_dir) == ("data", "run")


def test_flow_parameter_schema_has_the_model_defaults():
    from dlrmflow.flows.train import train_flow

    schema = train_flow.parameters.model_dump()
    assert schema["required"] == ["config"]
    fields = schema["definitions"]["TrainConfig"]["properties"]
    for name, info in TrainConfig.model_fields.items():
        if info.is_required():
            assert name in schema["definitions"]["TrainConfig"]["required"]
        else:
            assert json.loads(json.dumps(fields[name]["default"])) == json.loads(json.dumps(info.default)), name
            assert fields[name]["description"] == info.description


def test_the_pipeline_derives_its_training_fields():
    from dlrmflow.flows.pipeline import PipelineConfig

    for pipeline_name, name in [("batch_size", "batch_size"), ("train_iterations", "iterations"),
                                ("shards", "num_shards"), ("parity", "parity"), ("seed", "seed"), ("model", "model")]:
        assert PipelineConfig.model_fields[pipeline_name].metadata == TrainConfig.model_fields[name].metadata
    assert PipelineConfig().shards == TrainConfig(**REQUIRED).num_shards
    assert PipelineConfig().model == TrainConfig(**REQUIRED).model
    assert PipelineConfig.model_fields["model"].annotation == TrainConfig.model_fields["model"].annotation


def test_the_optimizer_choices_are_the_engines():
    """Each --embedding-optimizer but auto is one of the engine's row updates, with its accumulator columns; every
    engine update is offered."""
    from dlrmflow.engine.training.run_setup import row_optimizer

    choices = TrainConfig.model_fields["embedding_optimizer"].annotation.__args__
    assert choices[0] == "auto" == TrainConfig.model_fields["embedding_optimizer"].default
    assert {row_optimizer(choice, 5, 1)[0] for choice in choices[1:]} == set(EMBEDDING_OPTIMIZERS)
    assert row_optimizer("adagrad", 5, 1) == ("adagrad", 1) and row_optimizer("sgd", 5, 1) == ("sgd", 1)
    assert row_optimizer("adagrad-per-value", 5, 1) == ("adagrad", 4)  # every value but the first its own


@pytest.mark.parametrize("model", MODELS)
def test_auto_trains_each_models_rows_as_its_reference_does(model, tmp_path):
    """The default --embedding-optimizer auto: DLRM's rows row-wise (one accumulator per row, as TorchRec's
    ROWWISE_ADAGRAD), Wide & Deep's, DeepFM's and DCN-v2's with an accumulator per value (as DeepCTR-Torch)."""
    from test_models import run_config

    from dlrmflow.engine.training.run_setup import prepare_run

    config = run_config(make_dataset(tmp_path / "data", 0), tmp_path / "run", "local", model)
    setup = prepare_run(config)
    expected = "adagrad" if model == "dlrm" else "adagrad-per-value"
    assert config.embedding_optimizer == "auto" and setup.embedding_optimizer == expected
    assert setup.spec.state_width == (1 if model == "dlrm" else setup.spec.dim)


# ---- validation names the field ----------------------------------------------------------------------


def _outside(metadata) -> list:
    """Values just outside each bound."""
    values = []
    for m in metadata:
        if isinstance(m, Ge):
            values.append(m.ge - 1)
        elif isinstance(m, Gt):
            values.append(m.gt)
        elif isinstance(m, Le):
            values.append(m.le + 1)
        elif isinstance(m, Lt):
            values.append(m.lt)
    return values


BOUNDED = [(name, value) for name, info in TrainConfig.model_fields.items() for value in _outside(info.metadata)]


def test_every_bounded_field_is_tested():
    assert {name for name, _ in BOUNDED} == {
        "batch_size", "iterations", "num_shards", "trainers", "capacity", "embedding_dim", "lr", "embedding_lr",
        "eval_fraction", "eval_batch_size", "metrics_every", "parity", "rebuild_chunk", "parity_batches",
        "rebuild_rate", "checkpoint_every", "cross_layers", "lr_num_warmup_steps", "lr_decay_start_step",
        "lr_num_decay_steps", "eval_every"}


@pytest.mark.parametrize(("name", "value"), BOUNDED)
def test_a_violated_bound_names_its_field(name, value):
    with pytest.raises(TrainConfigError) as caught:
        TrainConfig(**{**REQUIRED, "mode": "lru", name: value})
    message = str(caught.value)
    assert message.startswith(f"{name}: ") and f"got {value!r}" in message and "\n" not in message
    if cli_option(name) is not None:
        assert cli_option(name) in message


def test_messages_in_words():
    def error(**values) -> str:
        with pytest.raises(TrainConfigError) as caught:
            TrainConfig(**{**REQUIRED, **values})
        return str(caught.value)

    assert error(batch_size=0) == "batch_size: --batch-size must be >= 1, got 0"
    assert error(parity=5) == "parity: --parity must be between 0 and 4, got 5"
    assert error(eval_fraction=1.0) == "eval_fraction: --eval-fraction must be in [0, 1), got 1.0"
    assert error(rebuild_rate=float("nan")) == "rebuild_rate: --rebuild-rate must be >= 0 MB/s, got nan"
    assert error(mode="cached").startswith("mode: unknown mode 'cached'; choose one of local, remote, lru, oracle")
    assert error(batch_size=0, seed="x").count(";") == 1  # every invalid field, on one line
    assert error(batch_sise=8) == "batch_sise: not a training setting"
    assert error(mode="local", parity=1).startswith("parity: --parity needs embedding servers")
    assert error(mode="local", checkpoint_every=2).startswith("checkpoint_every: ")
    assert error(mode="remote", capacity=5).startswith("capacity: ")
    assert error(mode="lru", plan_dir="p").startswith("plan_dir: --plan is only used by --mode oracle")


def test_the_cli_prints_one_line_naming_the_field(capsys):
    assert main(["train", "data", "--mode", "local", "--output", "run", "--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dlrmflow train: error: batch_size: --batch-size must be >= 1, got 0"


def test_frozen_and_replace_validates():
    config = TrainConfig(**REQUIRED)
    with pytest.raises(Exception, match="frozen"):
        config.batch_size = 4
    assert replace(config, batch_size=4).batch_size == 4 and config.batch_size == 128
    with pytest.raises(TrainConfigError, match="^batch_size: "):
        replace(config, batch_size=0)


def test_paths_are_kept_as_text():
    config = TrainConfig(dataset_dir=Path("data"), mode="oracle", output_dir=Path("run"), plan_dir=Path("plan"))
    assert (config.dataset_dir, config.output_dir, config.plan_dir) == ("data", "run", "plan")


def test_the_bottom_mlp_default_ends_in_the_embedding_dim():
    assert TrainConfig(**REQUIRED, embedding_dim=8).bottom_layers == (512, 256, 64, 8)
    assert TrainConfig(**REQUIRED, bottom_mlp=[8, 4]).bottom_layers == (8, 4)


# ---- one --kill rule ------------------------------------------------------------------------------


def test_one_kill_rule():
    assert [str(k) for k in check_kills(["shard:1@3", " parity:0@0 "], num_shards=2, parity=1, iterations=4)] == [
        "shard:1@3", "parity:0@0"]
    cases = [("shard0@1", "expected shard:I@ITER or parity:J@ITER"), ("shard:2@1", "no shard 2 with --shards 2"),
             ("parity:1@1", "no parity 1 with --parity 1"), ("shard:0@4", r"past the last one \(3\)")]
    for spec, match in cases:
        with pytest.raises(FaultSpecError, match=match):
            check_kills([spec], num_shards=2, parity=1, iterations=4)
        # The same rule, through every way kills are given.
        with pytest.raises(FaultSpecError, match=match):
            TrainConfig(**REQUIRED, parity=1, iterations=4, kills=[spec])
    with pytest.raises(FaultSpecError, match="same kill twice"):
        check_kills(["shard:0@1", "shard:0@1"], num_shards=2, parity=1, iterations=None)
    assert len(check_kills(["shard:0@1", "shard:0@2"], num_shards=2, parity=1, iterations=None)) == 2  # again
    assert check_kills(["shard:0@99"], num_shards=2, parity=1, iterations=None)  # the count is not known yet


def test_the_pipeline_uses_the_kill_rule():
    from dlrmflow.flows.pipeline import PipelineConfig

    with pytest.raises(ValueError, match="no shard 2 with shards 2"):  # the config's field, not the CLI flag
        PipelineConfig(parity=1, kills=["shard:2@1"])
    with pytest.raises(ValueError, match="past the last one"):
        PipelineConfig(parity=1, train_iterations=5, kills=["shard:0@5"])
    assert PipelineConfig(parity=1, kills=["parity:0@3"]).kills == ["parity:0@3"]


def test_a_kill_needs_something_to_recover_from_it():
    with pytest.raises(TrainConfigError, match="^kills: --kill needs --parity R >= 1 or --checkpoint-every N"):
        TrainConfig(**REQUIRED, kills=["shard:0@1"])
    assert TrainConfig(**REQUIRED, kills=["shard:0@1"], checkpoint_every=2).kills == ("shard:0@1",)
    assert TrainConfig(**REQUIRED, kills=["parity:0@1"], parity=1).kills == ("parity:0@1",)


# ---- run_config.json ---------------------------------------------------------------------------------


def test_run_config_round_trip(tmp_path):
    from dlrmflow.commands.resume import resumed_config

    config = TrainConfig(dataset_dir="data", mode="oracle", output_dir=str(tmp_path / "run"), plan_dir="plan",
                         batch_size=512, iterations=40, checkpoint_every=10, kills=["shard:0@25"],
                         bottom_mlp=[8, 4], embedding_lr=0.05)
    (tmp_path / "run").mkdir()
    start_run_dir(tmp_path / "run", config.model_dump(), dataset_fingerprint="f", plan_fingerprint="p", iterations=40)
    (tmp_path / "run" / "checkpoint.pt").touch()  # resume refuses a run without one
    resumed = resumed_config(str(tmp_path / "run"))
    assert resumed == replace(config, resume=True, dataset_dir=str(Path("data").resolve()),
                              plan_dir=str(Path("plan").resolve()))
    assert config_sha256(resumed.model_dump()) == config_sha256(config.model_dump())


def test_another_models_run_config_round_trip(tmp_path):
    from dlrmflow.commands.resume import resumed_config

    config = TrainConfig(dataset_dir="data", mode="lru", capacity=99, output_dir=str(tmp_path / "run"),
                         checkpoint_every=5, model="dcn-v2", dnn=[64, 32], cross_layers=2)
    assert (config.model_dump()["model"], config.model_dump()["dnn"]) == ("dcn-v2", (64, 32))
    (tmp_path / "run").mkdir()
    start_run_dir(tmp_path / "run", config.model_dump(), dataset_fingerprint="f", plan_fingerprint=None,
                  iterations=40)
    (tmp_path / "run" / "checkpoint.pt").touch()  # resume refuses a run without one

    resumed = resumed_config(str(tmp_path / "run"))
    assert (resumed.model, resumed.dnn, resumed.cross_layers) == ("dcn-v2", (64, 32), 2)
    assert config_sha256(resumed.model_dump()) == config_sha256(config.model_dump())
    other = replace(config, model="deepfm", cross_layers=None)
    assert config_sha256(other.model_dump()) != config_sha256(config.model_dump())


def test_a_setting_for_another_model_names_its_field():
    def error(**values) -> str:
        with pytest.raises(TrainConfigError) as caught:
            TrainConfig(**{**REQUIRED, **values})
        return str(caught.value)

    assert error(model="bert").startswith("model: unknown model 'bert'; choose one of dlrm, wide-deep, deepfm, dcn-v2")
    assert error(model="dcn-v2", cross_layers=0) == "cross_layers: --cross-layers must be >= 1, got 0"
    assert error(cross_layers=3) == "cross_layers: --cross-layers is used by --model dcn-v2, not --model dlrm"
    assert error(dnn=(8,)) == "dnn: --dnn is used by --model wide-deep, deepfm, dcn-v2, not --model dlrm"
    assert error(model="deepfm", top_mlp=(8, 1)) == "top_mlp: --top-mlp is used by --model dlrm, not --model deepfm"
    assert error(model="deepfm", dnn=(8, 0)) == "dnn: --dnn layer sizes must be positive, at least one; got [8, 0]"
    assert TrainConfig(**REQUIRED, model="dcn-v2", dnn=(8,), cross_layers=1).cross_layers == 1


def test_schedule_and_evaluation_settings_in_words():
    def error(**values) -> str:
        with pytest.raises(TrainConfigError) as caught:
            TrainConfig(**{**REQUIRED, **values})
        return str(caught.value)

    assert error(lr_num_warmup_steps=10, lr_decay_start_step=5, lr_num_decay_steps=20) == (
        "lr_decay_start_step: --lr-decay-start-step 5 is inside the warm-up (--lr-num-warmup-steps 10); the decay "
        "starts after it")
    assert error(eval_every=5, eval_fraction=0.0) == (
        "eval_every: --eval-every needs held-out rows (--eval-fraction > 0)")
    assert error(mode="remote", trainers=2, eval_every=5) == (
        "eval_every: --eval-every is for one trainer, not --trainers 2 (the held-out rows are evaluated once, at "
        "the end)")


# ---- prepare_run once per run ------------------------------------------------------------------------


@pytest.fixture
def count_prepare_run(monkeypatch):
    import dlrmflow.tasks.train as train_tasks

    calls = []
    real = trainer_module.prepare_run

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "prepare_run", counting)
    monkeypatch.setattr(train_tasks, "prepare_run", counting)
    return calls


@pytest.mark.usefixtures("prefect_harness")
def test_prepare_run_runs_once_per_cli_run(tmp_path, capsys, count_prepare_run):
    dataset = make_dataset(tmp_path / "data", 0)
    argv = ["train", str(dataset), "--mode", "lru", "--capacity", "200", "--shards", "1", "--output",
            str(tmp_path / "run"), "--batch-size", "16", "--iterations", "4", "--embedding-dim", "4",
            "--bottom-mlp", "8-4", "--top-mlp", "8-1", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    assert len(count_prepare_run) == 1


@pytest.mark.usefixtures("prefect_harness")
def test_prepare_run_runs_once_per_flow_run(tmp_path, count_prepare_run):
    from dlrmflow.flows.train import train_flow

    dataset = make_dataset(tmp_path / "data", 0)
    summary = train_flow(TrainConfig(dataset_dir=str(dataset), mode="local", output_dir=str(tmp_path / "run"),
                                     batch_size=16, iterations=4, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1]))
    assert summary["iterations"] == 4 and len(count_prepare_run) == 1


def test_user_errors_are_user_input_errors():
    assert issubclass(TrainConfigError, UserInputError) and issubclass(FaultSpecError, UserInputError)
