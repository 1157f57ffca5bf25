"""What a run of W > 1 trainers prepares before they start (:func:`prepare_trainers`), in the run directory:
each iteration's slices (:class:`BatchSlices`: the batch's distinct ids and which trainers' slices use each),
so that a trainer reads only its own slice of every batch, and with a plan every cached lifetime's holders
(:mod:`dlrmflow.engine.planning.holders`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlrmflow.engine.batch_stream import BatchStream, global_ids
from dlrmflow.engine.phases import phase_reported
from dlrmflow.engine.planning.holders import mask_dtype, slice_masks, write_lifetime_holders
from dlrmflow.engine.planning.planner import PlanMismatchError
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.run_setup import RunSetup

TRAINERS_DIR = "trainers"  # in the run directory: what prepare_trainers wrote


class SliceWriter:
    """Appends each iteration's :func:`~dlrmflow.engine.planning.holders.slice_masks` to ``directory``
    (``slice-union.bin``, ``slice-masks.bin``, then ``slice-offsets.npy``), in iteration order."""

    def __init__(self, directory: Path, size: int) -> None:
        self.directory, self.dtype = directory, mask_dtype(size)
        self._union = open(directory / "slice-union.bin", "wb")  # noqa: SIM115 - closed by close()
        self._masks = open(directory / "slice-masks.bin", "wb")  # noqa: SIM115
        self.offsets = [0]

    def add(self, t: int, union: np.ndarray, masks: np.ndarray) -> None:
        if t != len(self.offsets) - 1:
            raise ValueError(f"slices of iteration {t} after {len(self.offsets) - 1} iterations")
        self._union.write(np.ascontiguousarray(union, dtype=np.int64).tobytes())
        self._masks.write(np.ascontiguousarray(masks).astype(self.dtype).tobytes())
        self.offsets.append(self.offsets[-1] + len(union))

    def close(self) -> None:
        self._union.close()
        self._masks.close()
        np.save(self.directory / "slice-offsets.npy", np.asarray(self.offsets, dtype=np.int64))


@dataclass
class BatchSlices:
    """Every iteration's distinct ids and their trainers, memory-mapped (what :class:`SliceWriter` wrote)."""

    size: int
    offsets: np.ndarray
    union: np.ndarray
    masks: np.ndarray

    @classmethod
    def load(cls, directory: str | Path, size: int) -> BatchSlices:
        directory = Path(directory)
        offsets = np.load(directory / "slice-offsets.npy")

        def mapped(name: str, dtype) -> np.ndarray:  # an empty file cannot be mapped
            return np.memmap(directory / name, dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype)

        return cls(size, offsets, mapped("slice-union.bin", np.int64), mapped("slice-masks.bin", mask_dtype(size)))

    def split(self, t: int, rank: int, ids: np.ndarray) -> BatchSplit:
        """Iteration ``t``'s split for trainer ``rank``, from its slice's global ids ``[B/W, T]``."""
        lo, hi = self.offsets[t], self.offsets[t + 1]
        return BatchSplit.of_slice(t, np.asarray(self.union[lo:hi]), self.masks[lo:hi].astype(np.int64), ids,
                                   self.size, rank)


def prepare_trainers(setup: RunSetup, output: str | Path) -> RunSetup:
    """Before W > 1 trainers start (in the driver): one pass over the run's batches (ids only) writes, in
    ``output/trainers``, each iteration's slices and, with a plan, every cached lifetime's holders (trainer 0
    holds every row when it alone talks to coded servers, or writes checkpoints). Returns the setup that
    names the directory."""
    config, stream, n = setup.config, setup.stream, setup.iterations
    size = config.trainers
    directory = Path(output) / TRAINERS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    ids_only = BatchStream(stream.dataset_dir, stream.batch_size, drop_last=stream.drop_last, sparse_only=True)
    batches = (global_ids(batch.sparse, ids_only.offsets) for batch in ids_only.iter_range(0, n))
    writer = SliceWriter(directory, size)
    what = "the slices of every batch" + (" and which trainer holds each cached row" if setup.plan else "")
    with phase_reported(f"{size} trainers: {what} ({n} iterations)"):
        try:
            if setup.plan is None:
                for t, ids in enumerate(batches):
                    writer.add(t, *slice_masks(ids, size))
            else:
                always = 1 if config.parity or config.checkpoint_every else 0
                if setup.every_trainer_holds_every_row:
                    always = (1 << size) - 1
                try:
                    write_lifetime_holders(directory, lambda: setup.plan.iterations(0, n), batches, size=size,
                                           distance=setup.plan.config.prefetch_distance,
                                           iterations=n, always=always,
                                           on_slices=writer.add)
                except ValueError as exc:  # the plan does not fit these batches
                    raise PlanMismatchError(f"plan_dir: {setup.config.plan_dir}: {exc}") from None
        finally:
            writer.close()
    return dataclasses.replace(setup, trainers_dir=str(directory))
