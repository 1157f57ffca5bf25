"""Erasure-coded embedding servers: K data shards + R parity shards that survive losing R of them.

Modules, each with what it owns:

- :mod:`.members`: the member actors (their rows, applied batches, fresh rows, rebuild target).
- :mod:`.checked_out`: the trainer's copies of fetched rows (the old rows of parity deltas).
- :mod:`.group`: :class:`CodedShardGroup`, the trainer's write path (exchange, pending parity deltas,
  settle/send, degraded reads) and its whole-group reads.
- :mod:`.rebuild_state`: :class:`RebuildState`, the only code that changes the recovery state
  (lost members, replacements, rebuilt stripes, dirty log, generation).
- :mod:`.rebuild`: the rebuild thread and its copy tasks (network and waiting only).
- :mod:`.record`: what a recovery did. :mod:`.verify`: parity checks. :mod:`.start`: starting a group.

Design and consistency arguments: docs/rebuild.md.
"""

from dlrmflow.engine.coded_shards.checked_out import CheckedOutRows
from dlrmflow.engine.coded_shards.group import PARITY_BATCHES, REBUILD_CHUNK, CodedShardGroup
from dlrmflow.engine.coded_shards.members import CodedShard, ParityShard, member_name, num_stripes, shard_row_counts
from dlrmflow.engine.coded_shards.rebuild_state import RebuildState
from dlrmflow.engine.coded_shards.record import RecoveryRecord
from dlrmflow.engine.coded_shards.start import place_members, start_coded_shards
from dlrmflow.engine.coded_shards.verify import PARITY_FILE, parity_report, verify_run_dir
from dlrmflow.engine.embedding_server import LostMembersError, remote, wait_all

__all__ = [
    "PARITY_BATCHES",
    "PARITY_FILE",
    "REBUILD_CHUNK",
    "CheckedOutRows",
    "CodedShard",
    "CodedShardGroup",
    "LostMembersError",
    "ParityShard",
    "RebuildState",
    "RecoveryRecord",
    "member_name",
    "num_stripes",
    "parity_report",
    "place_members",
    "remote",
    "shard_row_counts",
    "start_coded_shards",
    "verify_run_dir",
    "wait_all",
]
