"""A cache of rows on the training device: a tensor of slots and the directory of which id sits where.

Shared by the LRU and oracle stores (one trainer's cache, or one of W trainers'). The directory is
this trainer's compute-side view; the oracle's prefetch worker keeps its own (rows fetched ahead),
and compute's follows it as each iteration's rows are handed over.
"""

from __future__ import annotations

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.training.slot_directory import SlotDirectory
from dlrmflow.engine.training.stores.homes import ShardHome


class SlotCache:
    """``num_slots`` rows on ``device`` and their :class:`SlotDirectory`; moves rows between the slots and
    the home (:class:`~.homes.ShardHome`, which counts them)."""

    def __init__(self, spec: RowSpec, device: torch.device, home: ShardHome, num_slots: int) -> None:
        self.spec, self.device, self.home = spec, device, home
        self.rows = torch.zeros((num_slots, spec.width), dtype=torch.float32, device=device)
        self.directory = SlotDirectory(num_slots)
        self._earlier_peak = 0  # the peak of the directories before the current one (a reload starts afresh)

    @property
    def num_slots(self) -> int:
        return len(self.rows)

    @property
    def peak(self) -> int:
        return max(self._earlier_peak, self.directory.peak)

    def slots_of(self, t: int, ids: np.ndarray) -> np.ndarray:
        """The slots of ``ids``, every one of which must be cached."""
        slots = self.directory.lookup(ids)
        if (slots < 0).any():
            missing = ids[slots < 0]
            raise RuntimeError(
                f"iteration {t}: {len(missing)} rows are not in the cache (first id {int(missing[0])}); "
                "the cache schedule does not match the batch stream"
            )
        return slots

    def index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots).to(self.device)

    def in_slots(self, slots: np.ndarray) -> np.ndarray:
        """The rows in ``slots``, a fresh host array."""
        return self.rows.index_select(0, self.index(slots)).cpu().numpy()

    def load(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """``rows`` (host) into ``slots``."""
        self.rows.index_copy_(0, self.index(slots), torch.from_numpy(rows).to(self.device))

    def exchange(self, write_ids: np.ndarray, write_slots: np.ndarray, fetch_ids: np.ndarray,
                 fetch_slots: np.ndarray) -> None:
        """Send the cached rows of ``write_ids`` home and fetch ``fetch_ids`` into ``fetch_slots``, in
        one synchronous round trip per shard (the shards apply the writes first)."""
        if not len(write_ids) and not len(fetch_ids):
            return
        fetched = self.home.exchange_to(write_ids, self.in_slots(write_slots), fetch_ids, self.device)
        if len(fetch_ids):
            self.rows.index_copy_(0, self.index(fetch_slots), fetched)

    def write_back(self, ids: np.ndarray) -> None:
        """Send the cached rows of ``ids`` home and remove them from the cache."""
        self.exchange(ids, self.directory.lookup(ids), ids[:0], ids[:0])
        self.directory.remove(ids)

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        """Every cached id (sorted) and its row (a cached row is at least as new as its shard's)."""
        ids, slots = self.directory.cached()
        return ids, self.in_slots(slots)

    def empty(self) -> None:
        """No row cached: a fresh directory and zeroed rows."""
        self._earlier_peak = self.peak
        self.directory = SlotDirectory(self.num_slots)
        self.rows.zero_()
