"""A cache of rows on the training device: a tensor of slots and the directory of which id sits where.

Shared by the LRU and oracle stores (one trainer's cache, or one of W trainers'). The directory is
this trainer's compute-side view; the oracle's prefetch worker keeps its own (rows fetched ahead),
and compute's follows it as each iteration's rows are handed over.
"""

from __future__ import annotations

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.training.stores.homes import ShardHome


class SlotDirectory:
    """Which global id sits in which cache slot (both directions). Readers ask :meth:`lookup` (id -> slot) and
    ``owner`` (slot -> id, -1: free); only :meth:`place` and :meth:`remove` change them."""

    def __init__(self, total_rows: int, num_slots: int) -> None:
        self._slot_of = np.full(total_rows, -1, dtype=np.int64)
        self.owner = np.full(num_slots, -1, dtype=np.int64)
        self.held = self.peak = 0  # rows cached now, and the most at once (counted as they come and go)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each of ``ids`` (-1: not cached), a fresh array."""
        return self._slot_of[ids]

    def place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self.held += int(np.count_nonzero(self._slot_of[ids] < 0))
        self.peak = max(self.peak, self.held)
        self._slot_of[ids] = slots
        self.owner[slots] = ids

    def remove(self, ids: np.ndarray) -> np.ndarray:
        slots = self._slot_of[ids]
        self.held -= int(np.count_nonzero(slots >= 0))
        self._slot_of[ids] = -1
        self.owner[slots] = -1
        return slots

    def cached_ids(self) -> np.ndarray:
        """Every cached id, sorted."""
        return np.sort(self.owner[self.owner >= 0])


class SlotCache:
    """``num_slots`` rows on ``device`` and their :class:`SlotDirectory`; moves rows between the slots and
    the home (:class:`~.homes.ShardHome`, which counts them)."""

    def __init__(self, spec: RowSpec, device: torch.device, home: ShardHome, num_slots: int) -> None:
        self.spec, self.device, self.home = spec, device, home
        self.rows = torch.zeros((num_slots, spec.width), dtype=torch.float32, device=device)
        self.directory = SlotDirectory(spec.total_rows, num_slots)
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
        ids = self.directory.cached_ids()
        return ids, self.in_slots(self.directory.lookup(ids))

    def empty(self) -> None:
        """No row cached: a fresh directory and zeroed rows."""
        self._earlier_peak = self.peak
        self.directory = SlotDirectory(self.spec.total_rows, self.num_slots)
        self.rows.zero_()
