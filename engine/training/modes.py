"""The training modes, declared once: what each needs and which row store implements it.

A mode is a place for the embedding rows (:mod:`.stores`): its store module builds the store for
any number of trainers (``make_store``), and its :class:`Mode` record says what the mode reads and
supports. Everything else asks this record (the configuration's checks, ``prepare_run``, the flows, the
summary) instead of comparing mode names, so a new mode (a cache policy, say) is one store module
plus one line in :data:`MODES`.

This module imports neither torch nor NumPy: the configuration, which the CLI builds its options
from, reads it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mode:
    name: str
    help: str
    store: str  # the module whose make_store(setup, device, shards, group, start=, rows=) builds the store
    servers: bool = True  # rows on embedding servers (what parity and checkpoints protect)
    checkpoints: bool = True  # supports --checkpoint-every (its servers write the checkpoint's rows files)
    capacity: bool = False  # reads --capacity (a cache's rows)
    capacity_required: bool = False  # needs --capacity, at least the most distinct rows of any batch
    plan: bool = False  # reads --plan (a lookahead plan made for its dataset and batch size)
    several_trainers: bool = True  # supports --trainers W > 1
    parity_with_trainers: bool = True  # supports --parity with W > 1 (one trainer then talks to the servers)

    def make_store(self, *args: Any, **kwargs: Any) -> Any:
        """The mode's row store (see :mod:`.stores.base` for the protocol)."""
        return importlib.import_module(self.store).make_store(*args, **kwargs)


_STORES = "dlrmflow.engine.training.stores"
MODES: dict[str, Mode] = {mode.name: mode for mode in (
    Mode("local", "local tables", f"{_STORES}.local", servers=False, checkpoints=False, several_trainers=False),
    Mode("remote", "remote shards (no cache)", f"{_STORES}.remote"),
    Mode("lru", "remote + LRU cache", f"{_STORES}.lru", capacity=True, capacity_required=True,
         parity_with_trainers=False),
    Mode("oracle", "remote + plan-driven cache and prefetch", f"{_STORES}.oracle", capacity=True, plan=True),
)}
MODE_NAMES = tuple(MODES)
SERVER_MODES = tuple(name for name, mode in MODES.items() if mode.servers)
