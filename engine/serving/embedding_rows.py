"""Embedding rows: their layout, their initial values, and their optimizer updates.

Row layout. Every embedding row travels as one contiguous float32 buffer of ``width`` values:
``dim`` weights followed by the row's optimizer state (``state_width`` values). With ``m =
own_accumulator_columns`` (a model's per-id first-order weights: the last ``m`` weights)::

    [w_0 .. w_{dim-m-1} | w_{dim-m} .. w_{dim-1} | state]
    SGD                 state: nothing
    row-wise Adagrad    state: a_shared, then a_{dim-m} .. a_{dim-1}: one accumulator shared by the
                        first dim - m weights (the embedding), one of its own for each of the last m

so an id's first-order weight takes Adagrad steps of its own size, as a per-value Adagrad would give
it, while the embedding keeps one accumulator per row. A block of ``n`` rows is a ``[n, width]``
array. The local table, the embedding servers and the trainer caches all store exactly this layout,
so a row moves between them by copying bytes, never by converting values.

Initial values. Row ``id`` (a global id) is a pure function of ``(seed, id)`` and the table
layout (which table ``id`` belongs to, fixed by the dataset): weight ``c`` is a counter-based
hash of ``(seed, id, c)`` mapped to a uniform float in ``[-b, b)`` with ``b = sqrt(1 / n_k)`` for
a row of table ``k`` with ``n_k`` rows (the facebookresearch/dlrm initialisation), or, when the
spec's ``init_std`` is set, ``b = sqrt(3) * init_std`` in every table (standard deviation
``init_std``: the models whose references start every row near zero, docs/models.md). Any process
can therefore create or check any shard, in any order, and get the same bits.

A vocabulary that grew (``dlrmflow preprocess --vocabulary``) keeps every earlier id, so a row is
initialised as the vocabulary that first held it did: ``id`` and ``n_k`` are the row's global id and
its table's size in that earlier layout (``RowSpec.earlier_cardinalities``, oldest first). An id's
initial value therefore never changes as its tables grow, and training day 0 then, continued, day 1
starts from the same rows as one run over both days. A run continued from a finished run
(``--init-from``, ``RowSpec.start``) starts every row that run had from its final value instead.

The optimizer updates of these rows are the trainers' (:mod:`dlrmflow.engine.training.row_updates`): this
module imports no torch, so an embedding server's process never loads it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from dlrmflow.engine.errors import UserInputError

EMBEDDING_OPTIMIZERS = ("sgd", "adagrad")
# State values per accumulator group of a row (the shared weights, each own-accumulator column), per optimizer.
STATE_WIDTH = {"sgd": 0, "adagrad": 1}

# splitmix64 constants (Steele, Lea, Flood 2014): a counter-based generator whose output for
# counter x depends on x alone, so rows can be initialised independently anywhere.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Rows initialised per step when a whole table or shard is filled with init_rows: bounds the hash's
# temporaries (a few uint64 arrays of CHUNK x dim values) whatever the table's size.
INIT_CHUNK_ROWS = 1 << 18


@dataclass(frozen=True)
class RowSpec:
    """Everything that defines the embedding rows of one run (picklable; shards get a copy)."""

    dim: int
    optimizer: str  # "sgd" | "adagrad"
    seed: int
    table_offsets: tuple[int, ...]
    cardinalities: tuple[int, ...]
    lr: float = 0.01
    eps: float = 1e-10  # row-wise Adagrad: w -= lr * g / (sqrt(acc) + eps)
    # None: facebookresearch/dlrm's per-table bound sqrt(1/n); a number: every weight uniform with this
    # standard deviation (the model's choice, models.row_init_std).
    init_std: float | None = None
    # The cardinalities of the vocabularies this one grew from, oldest first (module docstring).
    earlier_cardinalities: tuple[tuple[int, ...], ...] = ()
    # A finished run's final rows to start from (``--init-from``); None: every row from its hash.
    start: StartingRows | None = None
    # How many of the last weights keep an Adagrad accumulator each (module docstring): the model's per-id
    # first-order weights (models.first_order_columns); the other weights share the row's one.
    own_accumulator_columns: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in STATE_WIDTH:
            raise UserInputError(
                f"unknown embedding optimizer {self.optimizer!r}; "
                f"choose one of {', '.join(EMBEDDING_OPTIMIZERS)}"
            )
        if self.dim < 1:
            raise UserInputError(f"embedding dim must be >= 1, got {self.dim}")
        if not 0 <= self.own_accumulator_columns < self.dim:
            raise ValueError(f"own_accumulator_columns must lie in [0, {self.dim}) (at least one shared weight), "
                             f"got {self.own_accumulator_columns}")
        if len(self.table_offsets) != len(self.cardinalities):
            raise ValueError("table_offsets and cardinalities disagree on the number of tables")
        for earlier in (*self.earlier_cardinalities, *([self.start.cardinalities] if self.start else [])):
            if len(earlier) != len(self.cardinalities) or any(
                    e > n for e, n in zip(earlier, self.cardinalities, strict=True)):
                raise ValueError(f"an earlier vocabulary's cardinalities {earlier} do not fit in {self.cardinalities}")

    @property
    def shared_columns(self) -> int:
        """The weights that share the row's accumulator (all but the own-accumulator columns)."""
        return self.dim - self.own_accumulator_columns

    @property
    def state_width(self) -> int:
        """float32 optimizer values per row, after the weights."""
        return STATE_WIDTH[self.optimizer] * (1 + self.own_accumulator_columns)

    def describe_layout(self) -> str:
        """The row layout in words (what an error about a row width names)."""
        if self.optimizer == "sgd":
            return f"{self.dim} weights, no optimizer state"
        own = self.own_accumulator_columns
        if not own:
            return f"{self.dim} weights, then one Adagrad accumulator shared by them"
        return (f"{self.dim} weights, then one Adagrad accumulator shared by the first {self.shared_columns} and "
                f"one for each of the last {own}")

    @property
    def width(self) -> int:
        """float32 values per row: weights then optimizer state."""
        return self.dim + self.state_width

    @property
    def total_rows(self) -> int:
        return int(sum(self.cardinalities))

    @property
    def row_bytes(self) -> int:
        return 4 * self.width


def _mix64(x, xp: ModuleType):
    """The splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> xp.uint64(30))) * xp.uint64(_MIX1)
    x = (x ^ (x >> xp.uint64(27))) * xp.uint64(_MIX2)
    return x ^ (x >> xp.uint64(31))


def _offsets(cardinalities) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(cardinalities, np.int64))[:-1]]).astype(np.int64)


def _table_and_local(spec: RowSpec, ids, xp: ModuleType):
    """Per global id: its table and its row within the table."""
    offsets = xp.asarray(np.asarray(spec.table_offsets, dtype=np.int64))
    table = xp.searchsorted(offsets, ids, side="right") - 1
    return table, ids - offsets[table]


def _birth_layout(spec: RowSpec, ids, table, local, xp: ModuleType):
    """Per global id (in ``table`` at row ``local``): the global id and the table size it had in the first
    vocabulary that held it (the spec's own layout without earlier ones; module docstring)."""
    base = ids
    size = xp.asarray(np.asarray(spec.cardinalities, np.int64))[table]
    for cards in reversed(spec.earlier_cardinalities):  # newest to oldest: the oldest that held a row wins
        sizes = xp.asarray(np.asarray(cards, np.int64))[table]
        inside = local < sizes
        base = xp.where(inside, xp.asarray(_offsets(cards))[table] + local, base)
        size = xp.where(inside, sizes, size)
    return base, size


def table_bounds(spec: RowSpec, sizes, xp: ModuleType = np):
    """Per-row init bound (float32) for rows of tables of ``sizes`` rows: ``sqrt(1 / n_k)``, or
    ``sqrt(3) * init_std`` for every row when the spec sets ``init_std``."""
    if spec.init_std is not None:
        return xp.full(sizes.shape[0], np.float32(np.sqrt(3.0) * spec.init_std), dtype=xp.float32)
    return xp.sqrt(1.0 / xp.maximum(sizes.astype(xp.float64), 1.0)).astype(xp.float32)


def init_rows(spec: RowSpec, ids, xp: ModuleType = np):
    """Initial rows ``[len(ids), spec.width]`` float32 for global ``ids``: hashed weights, zero state; with
    ``spec.start``, the final rows of the run it continues for the ids that run had."""
    ids = xp.asarray(ids, dtype=xp.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= spec.total_rows):
        raise ValueError(f"row ids must lie in [0, {spec.total_rows})")
    table, local = _table_and_local(spec, ids, xp)
    base, sizes = _birth_layout(spec, ids, table, local, xp)
    columns = xp.arange(spec.dim, dtype=xp.uint64)[None, :]
    counter = base.astype(xp.uint64)[:, None] * xp.uint64(spec.dim) + columns
    seed_key = _mix64(xp.asarray([spec.seed & 0xFFFFFFFFFFFFFFFF], dtype=xp.uint64), xp)
    bits = _mix64(counter * xp.uint64(_GOLDEN) + seed_key, xp)
    # Top 24 bits -> an exact float32 in [0, 1); 2u - 1 is exact too, so only the final scale rounds.
    unit = (bits >> xp.uint64(40)).astype(xp.float32) * xp.float32(2.0**-24)
    weights = (unit * xp.float32(2.0) - xp.float32(1.0)) * table_bounds(spec, sizes, xp)[:, None]
    rows = xp.zeros((ids.shape[0], spec.width), dtype=xp.float32)
    rows[:, : spec.dim] = weights
    if spec.start is not None:
        had = xp.asarray(np.asarray(spec.start.cardinalities, np.int64))[table]
        kept = xp.flatnonzero(local < had)
        if kept.size:
            parent_ids = xp.asarray(_offsets(spec.start.cardinalities))[table[kept]] + local[kept]
            rows[kept] = xp.asarray(spec.start.read(_to_numpy(parent_ids)))
    return rows


def _to_numpy(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


@dataclass(frozen=True)
class StartingRows:
    """The final rows of a finished run (``RUN_DIR/final_state``) a run continues from: ``cardinalities``
    are its tables' sizes; its rows are read by id from the shard files, memory-mapped (each process
    opens them once), so a shard reads only its own rows. Every process must see ``state_dir`` at the
    same path (as a run directory: row_files' docstring)."""

    state_dir: str
    cardinalities: tuple[int, ...]
    width: int
    state_sha256: str  # the manifest's: a final state written over since the run was checked is refused

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The run's final rows of its global ``ids`` ``[len(ids), width]``."""
        rows = _final_rows(self.state_dir, self.state_sha256)
        if rows.width != self.width:
            raise ValueError(f"{self.state_dir}: rows of width {rows.width}, expected {self.width}")
        return rows[ids]


@functools.lru_cache(maxsize=4)
def _final_rows(state_dir: str, state_sha256: str):
    """The shard files of ``state_dir``, memory-mapped once per process; keyed by the state's SHA-256 too, so
    that a process that outlives one run (a Dask worker) never serves the files of a replaced run."""
    from dlrmflow.engine.run_state import read_manifest, state_rows  # torch: only when continuing a run

    manifest = read_manifest(state_dir)
    if manifest is None or manifest["state_sha256"] != state_sha256:
        raise UserInputError(f"{state_dir} changed since the run that continues it was checked (its state "
                             f"SHA-256 is no longer {state_sha256[:12]}...)")
    return state_rows(state_dir)
