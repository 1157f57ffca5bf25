"""What one recovery did: the record a rebuild fills in and the run's report shows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dlrmflow.engine.coding.members import member_name


@dataclass
class RecoveryRecord:
    """One recovery: what was lost, when it was detected and rebuilt, what it cost."""

    members: list[int]
    detected_at: float
    rebuilt_at: float | None = None
    stripes: int = 0
    rows_rebuilt: int = 0
    chunks: int = 0
    stripes_fixed_up: int = 0  # stripes written during a chunk's bulk copy, re-read under the lock
    stripes_generated: int = 0  # stripes with no row the trainer wrote: the replacements generate them
    placement_seconds: float = 0.0  # detection -> replacement actors started
    copy_seconds: float = 0.0  # bulk copies on workers + fix-ups, wall clock (training runs meanwhile)
    locked_seconds: float = 0.0  # fix-ups under the lock (training waits)
    # Of copy_seconds, the copy tasks' own time on the replacement's worker (the rest: dispatch and fix-ups),
    # and within it the wait for the survivors' answers and the decode + install.
    copy_task_seconds: float = 0.0
    copy_read_wait_seconds: float = 0.0
    copy_install_seconds: float = 0.0
    fix_ups: int = 0
    restarts: int = 0
    workers: dict[int, str] = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)  # the failures that showed each loss (a restart adds one)

    def as_dict(self, k: int, start: float) -> dict[str, Any]:
        return {
            "lost": [member_name(s, k) for s in self.members],
            "detected_s": self.detected_at - start,
            "rebuilt_s": None if self.rebuilt_at is None else self.rebuilt_at - start,
            "seconds": None if self.rebuilt_at is None else self.rebuilt_at - self.detected_at,
            "stripes": self.stripes, "rows_rebuilt": self.rows_rebuilt, "chunks": self.chunks,
            "stripes_fixed_up": self.stripes_fixed_up, "fix_ups": self.fix_ups,
            "stripes_generated": self.stripes_generated,
            "placement_seconds": self.placement_seconds, "copy_seconds": self.copy_seconds,
            "locked_seconds": self.locked_seconds, "copy_task_seconds": self.copy_task_seconds,
            "copy_read_wait_seconds": self.copy_read_wait_seconds, "copy_install_seconds": self.copy_install_seconds,
            "restarts": self.restarts, "new_workers": {member_name(s, k): w for s, w in self.workers.items()},
            "causes": list(self.causes),
        }

