"""Iteration ``t``'s global batch as the W trainers see it (one trainer: W = 1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BatchSplit:
    """Iteration ``t``'s global batch as the W trainers see it (every trainer computes the same one)."""

    t: int
    rank: int
    union: np.ndarray  # sorted distinct ids of the whole global batch
    uniq: list[np.ndarray]  # trainer w's sorted distinct ids
    where: list[np.ndarray]  # positions of uniq[w] in union
    users: np.ndarray  # [W, len(union)] bool: trainer w's slice uses union[i]
    inverse: np.ndarray  # this trainer's slice, flattened: index into uniq[rank] per id

    @classmethod
    def of(cls, t: int, ids: np.ndarray, size: int, rank: int) -> BatchSplit:
        """``ids``: the global batch's ids ``[B, T]``; trainer w takes rows ``w*B/W .. (w+1)*B/W - 1``.

        One sort of the whole batch: each slice's distinct ids are the union's ids its rows point at."""
        rows = ids.shape[0] // size
        union, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(ids.shape)
        users = np.zeros((size, len(union)), dtype=bool)
        uniq, where = [], []
        for w in range(size):
            users[w, inverse[w * rows:(w + 1) * rows]] = True
            where.append(np.flatnonzero(users[w]))
            uniq.append(union[where[-1]])
        # This trainer's slice: positions in the union -> positions among its own distinct ids.
        rank_of = np.cumsum(users[rank]) - 1
        mine = rank_of[inverse[rank * rows:(rank + 1) * rows].reshape(-1)]
        return cls(t, rank, union, uniq, where, users, mine)

    @classmethod
    def of_slice(cls, t: int, union: np.ndarray, masks: np.ndarray, ids: np.ndarray, size: int, rank: int
                 ) -> BatchSplit:
        """The same split from the batch's distinct ids ``union`` (sorted), their trainers ``masks`` (bit w:
        trainer w's slice uses it; :class:`~dlrmflow.engine.training.trainer_slices.BatchSlices`) and this trainer's
        slice ``ids`` ``[B/W, T]`` alone."""
        users = (masks[None, :] >> np.arange(size, dtype=np.int64)[:, None]) & 1 == 1
        where = [np.flatnonzero(used) for used in users]
        uniq = [union[w] for w in where]
        return cls(t, rank, union, uniq, where, users, np.searchsorted(uniq[rank], ids.reshape(-1)))

    @property
    def size(self) -> int:
        return len(self.uniq)

    @property
    def mine(self) -> np.ndarray:
        return self.uniq[self.rank]

    def first_user(self) -> np.ndarray:
        """Per id of the union: the lowest rank whose slice uses it."""
        return np.argmax(self.users, axis=0)

    def held(self, mask: np.ndarray) -> list[np.ndarray]:
        """Per trainer, its ids that ``mask`` (over the union) selects."""
        return [ids_w[mask[where_w]] for ids_w, where_w in zip(self.uniq, self.where, strict=True)]
