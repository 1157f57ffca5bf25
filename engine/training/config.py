"""The training configuration, declared once: every field's type, default, bounds and help text.

:class:`TrainConfig` is what :func:`dlrmflow.engine.training.job.train` runs, the train flow's
parameter, the source of the ``dlrmflow train`` options (:func:`cli_option` names them) and
what ``RUN_DIR/run_config.json`` records for ``dlrmflow resume``. Constructing one validates it:
a bad value raises :class:`TrainConfigError` (a ``UserInputError``: the CLI prints one line and
exits 2) whose message starts with the field's name, e.g. ``batch_size: --batch-size must be >= 1,
got 0``. Checks that need the dataset, the plan or the machine are made by ``prepare_run``. The
one-line errors and the option naming are every step config's (:mod:`dlrmflow.engine.config_model`).

This module imports neither torch nor Prefect: the CLI builds its parser from it.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dlrmflow.engine.coding import PARITY_BATCHES, REBUILD_CHUNK
from dlrmflow.engine.config_model import ConfigModel
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.models import AUTO_HIDDEN_INIT, HIDDEN_INIT_SETTINGS, MODEL_SETTINGS, MODELS
from dlrmflow.engine.training.faults import KILL_SYNTAX, check_kills
from dlrmflow.engine.training.modes import MODE_NAMES, MODES, SERVER_MODES

# The row updates of dlrmflow.engine.serving.embedding_rows: row-wise Adagrad (one accumulator per row, a model's
# first-order weight its own), SGD, and Adagrad with an accumulator per value (as torch's Adagrad and DeepCTR-Torch:
# a row of D values carries D accumulators instead of one; run_setup.row_optimizer).
EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "adagrad-per-value")
# --embedding-optimizer auto: each model's rows as its reference library trains them when no run is continued.
# DLRM row-wise (TorchRec's ROWWISE_ADAGRAD: the smaller rows); Wide & Deep, DeepFM and DCN-v2 per value
# (DeepCTR-Torch's torch.optim.Adagrad), the only setting that matched DeepCTR-Torch on every data source
# (benchmarks/RESULTS.md, issue 47), at about twice the bytes per row on the servers and the link.
AUTO_EMBEDDING_OPTIMIZER = {"dlrm": "adagrad", "wide-deep": "adagrad-per-value", "deepfm": "adagrad-per-value",
                            "dcn-v2": "adagrad-per-value"}
EMBEDDING_OPTIMIZER_SETTINGS = ("auto", *EMBEDDING_OPTIMIZERS)
DENSE_OPTIMIZERS = ("sgd", "adam")
DEFAULT_BOTTOM_HIDDEN = (512, 256, 64)  # the bottom MLP without bottom_mlp: these, then embedding_dim
DEFAULT_TOP_MLP = (512, 256, 1)

# Fields whose `dlrmflow train` option is not --field-name; fields in NO_OPTION have none.
OPTION_NAMES = {"dataset_dir": "DATASET_DIR", "output_dir": "--output", "plan_dir": "--plan",
                "num_shards": "--shards", "kills": "--kill"}
NO_OPTION = ("eval_batch_size", "save_state", "resume")


def _modes(has: str, lacks: str | None = None) -> str:
    """The modes whose record has ``has`` (and not ``lacks``), for help texts: ``lru``, ``lru or fifo``."""
    names = [m.name for m in MODES.values() if getattr(m, has) and not (lacks and getattr(m, lacks))]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class TrainConfigError(UserInputError):
    """The training configuration is invalid, or does not fit the data, the plan or the machine."""


def embedding_optimizer_for(setting: str, model: str, continued: str | None = None) -> str:
    """The row update ``--embedding-optimizer setting`` names for ``model``: ``auto`` is the optimizer of the run
    being continued (``continued``: its optimizer state must fit), else :data:`AUTO_EMBEDDING_OPTIMIZER`'s."""
    if setting != "auto":
        return setting
    return continued if continued is not None else AUTO_EMBEDDING_OPTIMIZER[model]


def cli_option(field: str) -> str | None:
    """The ``dlrmflow train`` option (or positional) that sets ``field``; None for a field it does not set."""
    return TrainConfig.cli_option(field)


class TrainConfig(ConfigModel):
    """One training run. Frozen; unknown fields are refused. ``TrainConfig(**values)`` raises
    :class:`TrainConfigError` naming every invalid field; :func:`replace` makes a validated copy."""

    error = TrainConfigError
    setting = "training setting"
    option_names = OPTION_NAMES
    no_option = NO_OPTION

    dataset_dir: str = Field(description="a preprocessed dataset directory")
    mode: Literal[MODE_NAMES] = Field(
        description="where embedding rows live: " + ", ".join(mode.help for mode in MODES.values()))
    output_dir: str = Field(description="where final_state/, summary.json and iterations.csv go")
    batch_size: int = Field(128, ge=1, description="training batch size")
    iterations: int | None = Field(
        None, ge=1, description="batches to train (default: every batch before the held-out rows)")
    num_shards: int = Field(2, ge=1, description="embedding servers")
    trainers: int = Field(
        1, ge=1, description="data-parallel trainer processes, each training 1/W of every batch on a Dask worker "
                             "(workers advertising the `trainer` resource when any does); --mode oracle then "
                             "runs Bagpipe's LRPP cache (docs/trainers.md)")
    capacity: int | None = Field(
        None, ge=1, description=f"cache rows: required by --mode {_modes('capacity_required')}; with --mode "
                                f"{_modes('capacity', 'capacity_required')} an optional bound on the cache")
    plan_dir: str | None = Field(None, description=f"the plan for --mode {_modes('plan')} (`dlrmflow plan`)")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$",
                        description="cpu, cuda, or cuda:N (one trainer); with --trainers W each trainer takes its "
                                    "worker's GPU (one advertising the Dask resource GPU=1), else cuda:(w mod GPUs)")
    seed: int = Field(0, description="model and embedding initialisation")
    model: Literal[MODELS] = Field(
        "dlrm", description="the model: DLRM, Wide & Deep, DeepFM or DCN-v2 (docs/models.md); its per-id "
                            "parameters all sit in the id's embedding row")
    embedding_dim: int = Field(16, ge=1, description="embedding width")
    bottom_mlp: tuple[int, ...] | None = Field(
        None, description="DLRM's bottom MLP layer sizes after the input, e.g. 512-256-64-16 (default: "
                          "512-256-64 then --embedding-dim)")
    top_mlp: tuple[int, ...] = Field(DEFAULT_TOP_MLP, description="DLRM's top MLP layer sizes, ending in 1")
    dnn: tuple[int, ...] | None = Field(
        None, description="hidden layer sizes of the DNN of --model wide-deep, deepfm or dcn-v2, e.g. "
                          "400-400-400 (default: the model's published sizes, 400-400-400 for wide-deep and "
                          "deepfm, 500-500-500 for dcn-v2)")
    cross_layers: int | None = Field(None, ge=1, description="cross layers of --model dcn-v2 (default 3)")
    hidden_init: Literal[HIDDEN_INIT_SETTINGS] = Field(
        "auto", description="how the DNN's hidden layers of --model wide-deep, deepfm or dcn-v2 start: glorot "
                            "(Glorot normal weights, zero biases: FuxiCTR's), deepctr (DeepCTR-Torch's: weights "
                            "N(0, 1e-4), biases uniform in +-1/sqrt(inputs)); auto: "
                            + ", ".join(f"{init} under --dense-optimizer {opt}"
                                        for opt, init in AUTO_HIDDEN_INIT.items()))
    embedding_optimizer: Literal[EMBEDDING_OPTIMIZER_SETTINGS] = Field(
        "auto", description="the embedding rows' update: adagrad (row-wise: one accumulator per row), sgd, or "
                            "adagrad-per-value (an accumulator per value: about twice the bytes per row); auto: "
                            "the optimizer of the run --init-from continues, else "
                            + ", ".join(f"{o} for --model {m}" for m, o in AUTO_EMBEDDING_OPTIMIZER.items()))
    dense_optimizer: Literal[DENSE_OPTIMIZERS] = Field("sgd", description="optimizer of the dense parameters")
    lr: float = Field(0.01, gt=0, description="dense learning rate")
    embedding_lr: float | None = Field(None, gt=0, description="embedding learning rate (default: --lr)")
    lr_num_warmup_steps: int = Field(
        0, ge=0, description="warm the dense and embedding learning rates up linearly over the first N iterations "
                             "(MLPerf DLRM's schedule; 0: no warm-up)")
    lr_decay_start_step: int = Field(
        0, ge=0, description="the step (iteration + 1, as MLPerf DLRM counts) at which the polynomial (power 2) "
                             "decay of --lr-num-decay-steps starts")
    lr_num_decay_steps: int = Field(
        0, ge=0, description="decay the learning rates to ~0 over N iterations from --lr-decay-start-step, then "
                             "hold them (MLPerf DLRM's schedule; 0: no decay)")
    eval_fraction: float = Field(
        0.1, ge=0, lt=1, description="the last F of the dataset's rows are held out for AUC / log loss")
    eval_batch_size: int = Field(4096, ge=1, description="batch size of the evaluation")
    metrics_every: int = Field(50, ge=1, description="log loss and timings every N iterations")
    eval_every: int = Field(
        0, ge=0, description="evaluate AUC and log loss on the held-out rows every N iterations, recorded in "
                             "summary.json (0: only at the end)")
    save_state: bool = Field(True, description="write final_state/ (its SHA-256 is always computed)")
    parity: int = Field(
        0, ge=0, le=4, description="R erasure-coded parity shards (1: XOR, 2-4: Reed-Solomon; 0: none); a "
                                   "LocalCluster then gets one worker per shard plus a spare")
    kills: tuple[str, ...] = Field(
        (), description=f"failure injection ({KILL_SYNTAX}, repeatable): SIGKILL the worker of data shard I or "
                        "parity shard J when iteration ITER starts; needs --parity or --checkpoint-every")
    rebuild_chunk: int = Field(
        REBUILD_CHUNK, ge=1, description="stripes per recovery task (bounds a rebuild's memory per chunk)")
    parity_batches: int = Field(
        PARITY_BATCHES, ge=1,
        description="write-back batches whose parity deltas go to the parity shards in one message "
                    "(1: a message per batch). Fewer messages cost the trainer less; pending deltas "
                    "are sent before anything reads parity")
    rebuild_rate: float = Field(
        0.0, ge=0, json_schema_extra={"unit": "MB/s"},
        description="cap a rebuild at MB/S of rebuilt rows (0: as fast as it goes). On machines the trainer "
                    "shares with the servers, a cap leaves training more of the cores while a lost shard is "
                    "rebuilt, and the rebuild takes longer")
    checkpoint_every: int | None = Field(
        None, ge=1, description=f"checkpoint all shards + dense state every N iterations (modes "
                                f"{_modes('checkpoints')}): without --parity a lost shard is reloaded and "
                                "replayed; a crashed run continues with `dlrmflow resume RUN_DIR`")
    resume: bool = Field(
        False, description="continue the unfinished run in output_dir from its checkpoint (same configuration)")
    init_from: str | None = Field(
        None, description="start from the final state of a finished run (RUN_DIR) on this dataset or one whose "
                          "vocabulary it grew from: its dense parameters, optimizer state and embedding rows "
                          "(rows new in this vocabulary start as usual)")

    @field_validator("dataset_dir", "output_dir", "plan_dir", "init_from", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @model_validator(mode="after")
    def _fields_agree(self) -> TrainConfig:
        """The rules between fields; each error names the field it is about."""
        mode = MODES[self.mode]
        if self.parity and not mode.servers:
            raise TrainConfigError(f"parity: --parity needs embedding servers; use --mode {_one_of(SERVER_MODES)}")
        if self.checkpoint_every is not None and not mode.checkpoints:
            able = [m.name for m in MODES.values() if m.checkpoints]
            raise TrainConfigError(f"checkpoint_every: --checkpoint-every works with --mode {_one_of(able)}")
        if self.capacity is not None and not mode.capacity:
            users = _all_of(m.name for m in MODES.values() if m.capacity)
            raise TrainConfigError(f"capacity: --capacity is used by --mode {users}, not --mode {self.mode}")
        if self.plan_dir and not mode.plan:
            users = _all_of(m.name for m in MODES.values() if m.plan)
            raise TrainConfigError(f"plan_dir: --plan is only used by --mode {users}, not --mode {self.mode}")
        if self.kills and not (self.parity or self.checkpoint_every):
            raise TrainConfigError("kills: --kill needs --parity R >= 1 or --checkpoint-every N (nothing could "
                                   "recover the lost shard)")
        if self.lr_num_decay_steps and self.lr_decay_start_step < self.lr_num_warmup_steps:
            raise TrainConfigError(f"lr_decay_start_step: --lr-decay-start-step {self.lr_decay_start_step} is inside "
                                   f"the warm-up (--lr-num-warmup-steps {self.lr_num_warmup_steps}); the decay starts "
                                   "after it")
        if self.eval_every and self.eval_fraction == 0:
            raise TrainConfigError("eval_every: --eval-every needs held-out rows (--eval-fraction > 0)")
        if self.trainers > 1:
            self._check_trainers()
        # prepare_run checks the iterations again once the dataset says how many there are.
        check_kills(self.kills, num_shards=self.num_shards, parity=self.parity, iterations=self.iterations)
        self._check_model_settings()
        return self

    def _check_trainers(self) -> None:
        """What several trainers support (one trainer supports everything)."""
        w = self.trainers
        if not MODES[self.mode].several_trainers:
            others = [name for name, m in MODES.items() if m.several_trainers]
            mode = MODES[self.mode]
            why = "needs embedding servers" if not mode.servers else f"is not supported by --mode {mode.name}"
            raise TrainConfigError(f"trainers: --trainers {w} {why}; use --mode {others[0]} (the "
                                   f"reference), {_one_of(others[1:])}")
        if self.batch_size % w:
            raise TrainConfigError(f"trainers: --batch-size {self.batch_size} does not split into {w} equal "
                                   f"slices (--trainers {w}); use a multiple of {w}")
        if self.device.startswith("cuda:"):
            raise TrainConfigError(f"trainers: --device {self.device} names one GPU, for one trainer; with "
                                   f"--trainers {w} use --device cuda (each trainer takes its worker's GPU)")
        if self.parity and not MODES[self.mode].parity_with_trainers:
            able = [name for name, m in MODES.items() if m.servers and m.parity_with_trainers]
            raise TrainConfigError(f"trainers: --mode {self.mode} with --parity is not supported with --trainers {w} "
                                   f"(with parity one trainer talks to the servers: use --mode {_one_of(able[::-1])})")
        if self.kills and not self.parity:
            raise TrainConfigError(f"kills: --kill with --trainers {w} needs --parity R >= 1 (several trainers "
                                   "do not replay a lost shard from a checkpoint)")
        if self.eval_every:  # the rows are spread over W trainers' caches mid-run; the final evaluation runs
            raise TrainConfigError(f"eval_every: --eval-every is for one trainer, not --trainers {w} (the held-out "
                                   "rows are evaluated once, at the end)")

    def _check_model_settings(self) -> None:
        """Each architecture setting is for the models that read it; layer sizes are positive."""
        # A setting counts as set when it differs from its default: the CLI passes every option's default.
        for name in ("bottom_mlp", "top_mlp", "dnn", "cross_layers", "hidden_init"):
            if getattr(self, name) != type(self).model_fields[name].default and name not in MODEL_SETTINGS[self.model]:
                users = [m for m, names in MODEL_SETTINGS.items() if name in names]
                raise TrainConfigError(f"{name}: {cli_option(name)} is used by --model {', '.join(users)}, not "
                                       f"--model {self.model}")
        for name in ("bottom_mlp", "top_mlp", "dnn"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or min(sizes) < 1):
                raise TrainConfigError(f"{name}: {cli_option(name)} layer sizes must be positive, at least one; "
                                       f"got {list(sizes)}")

    @property
    def bottom_layers(self) -> tuple[int, ...]:
        """The bottom MLP's layer sizes: ``bottom_mlp``, or the default ending in ``embedding_dim``."""
        return tuple(self.bottom_mlp or (*DEFAULT_BOTTOM_HIDDEN, self.embedding_dim))


def _one_of(names) -> str:
    """``a, b or c``."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _all_of(names) -> str:
    """``a, b and c``."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def replace(config: TrainConfig, **changes: Any) -> TrainConfig:
    """``config`` with ``changes``, validated like a new one (what ``dataclasses.replace`` does for a dataclass)."""
    return TrainConfig(**{**config.model_dump(), **changes})

