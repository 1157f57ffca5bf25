"""Erasure-coded embedding servers: K data shards + R parity shards that survive losing R of them.

Modules, each with what it owns:

- :mod:`.gf256`, :mod:`.erasure`: the codec (GF(2^8) tables, XOR and Reed-Solomon on bit patterns).
- :mod:`.members`: the member actors (their rows, applied batches, fresh rows, rebuild target).
- :mod:`.checked_out`: the trainer's copies of fetched rows (the old rows of parity deltas).
- :mod:`.group`: :class:`~.group.CodedShardGroup`, the trainer's write path (exchange, settle/send,
  degraded reads) and its whole-group reads: the driver (lock, actor calls) of the two state objects below.
- :mod:`.parity_batches`: :class:`~.parity_batches.ParityBatching`, the only code that changes the write
  path's state (batch numbers, rows written, pending parity deltas, unacknowledged parity messages, when
  a message is due, its counters): events in, actions (:class:`~.parity_batches.SendParity`,
  :class:`~.parity_batches.AwaitAcks`) out.
- :mod:`.rebuild_state`: :class:`~.rebuild_state.RebuildState`, the only code that changes the recovery
  state (lost members, replacements, rebuilt stripes, dirty log, generation).
- :mod:`.rebuild`: the rebuild thread and its copy tasks (network and waiting only).
- :mod:`.record`: what a recovery did. :mod:`.verify`: parity checks. :mod:`.start`: starting a group.
- :mod:`.prefault`: a replacement's pages faulted in before its rows are installed.

Design and consistency arguments: docs/rebuild.md.

This package's own namespace holds only the group's defaults, so that the training configuration can
declare them without importing the coded group (NumPy, Dask).
"""

PARITY_BATCHES = 8  # write-back batches whose parity deltas travel in one message per parity shard
REBUILD_CHUNK = 262_144  # stripes per recovery task
