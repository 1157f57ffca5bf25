"""What one recovery did: the record a rebuild fills in, and the one set of figures that the run's log, the
``recover-shard`` subflow's log and table, the train summary and ``dlrmflow train``'s report all show.

A rebuild restores every stripe of the lost members (``stripes_total``): those with a row the trainer wrote
are copied from the survivors (``stripes_copied``), the others are generated from the seed
(``stripes_generated``), so the two add up to the total. :func:`recovery_figures` (the tables' rows) and
:func:`recovery_sentence` (the log lines) read the record's dict (:meth:`RecoveryRecord.as_dict`, the form
it takes in summary.json), so that no report computes a figure of its own.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from dlrmflow.engine.coding.members import member_name


@dataclass
class RecoveryRecord:
    """One recovery: what was lost, when it was detected and rebuilt, what it cost."""

    members: list[int]
    detected_at: float
    rebuilt_at: float | None = None
    stripes: int = 0  # stripes copied by the copy tasks, over every attempt (a restart copies again)
    rows_rebuilt: int = 0
    chunks: int = 0
    stripes_fixed_up: int = 0  # stripes written during a chunk's bulk copy, re-read under the lock
    stripes_generated: int = 0  # stripes with no row the trainer wrote: the replacements generate them
    stripes_total: int = 0  # every stripe of the lost members: stripes_copied + stripes_generated
    stripes_copied: int = 0  # the last attempt's stripes with a row the trainer wrote: copied from the survivors
    placement_seconds: float = 0.0  # detection -> replacement actors started
    copy_seconds: float = 0.0  # bulk copies on workers + fix-ups, wall clock (training runs meanwhile)
    locked_seconds: float = 0.0  # fix-ups under the lock (training waits)
    # Of copy_seconds, the copy tasks' own time on the replacement's worker (the rest: dispatch and fix-ups),
    # and within it the wait for the survivors' answers and the decode + install.
    copy_task_seconds: float = 0.0
    copy_read_wait_seconds: float = 0.0
    copy_install_seconds: float = 0.0
    fix_ups: int = 0  # fix-up passes (each holds the trainer for two round trips)
    restarts: int = 0
    workers: dict[int, str] = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)  # the failures that showed each loss (a restart adds one)
    noticed_by: list[str] = field(default_factory=list)  # in words, what noticed each loss (one per cause)

    def as_dict(self, k: int, start: float) -> dict[str, Any]:
        return {
            "lost": [member_name(s, k) for s in self.members],
            "detected_s": self.detected_at - start,
            "rebuilt_s": None if self.rebuilt_at is None else self.rebuilt_at - start,
            "seconds": None if self.rebuilt_at is None else self.rebuilt_at - self.detected_at,
            "stripes_total": self.stripes_total, "stripes_copied": self.stripes_copied,
            "stripes_generated": self.stripes_generated,
            "stripes": self.stripes, "rows_rebuilt": self.rows_rebuilt, "chunks": self.chunks,
            "stripes_fixed_up": self.stripes_fixed_up, "fix_ups": self.fix_ups,
            "placement_seconds": self.placement_seconds, "copy_seconds": self.copy_seconds,
            "locked_seconds": self.locked_seconds, "copy_task_seconds": self.copy_task_seconds,
            "copy_read_wait_seconds": self.copy_read_wait_seconds, "copy_install_seconds": self.copy_install_seconds,
            "restarts": self.restarts, "new_workers": {member_name(s, k): w for s, w in self.workers.items()},
            "causes": list(self.causes), "noticed_by": list(self.noticed_by),
        }


# ---- what noticed a loss ----------------------------------------------------------------------------------

# The engine's threads that talk to the shards, by name (threading.Thread(name=...)); any other is the trainer's.
THREAD_ROLES = {"dlrmflow-prefetch": "the oracle's prefetch thread", "dlrmflow-rebuild": "the rebuild",
                "dlrmflow-recovery": "the rebuild"}


def noticed_by(during: str, members: list[str], cause: BaseException | None, limit: int = 160) -> str:
    """What noticed a loss, in words: the thread (``the trainer``, ``the oracle's prefetch thread``, ``the
    rebuild``), what it was doing (``during``), and which call failed how: ``the trainer, writing back and
    fetching a batch's rows: its call to data shard 1 failed (OSError: Unable to contact Actor's worker)``."""
    who = THREAD_ROLES.get(threading.current_thread().name, "the trainer")
    inner = getattr(cause, "cause", cause)  # a LostMembersError carries the call's own failure
    if inner is None:
        failure = "no answer"
    else:
        text = " ".join(str(inner).split())
        failure = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
        if len(failure) > limit:
            failure = failure[: limit - 3] + "..."
    calls = f"its call to {', '.join(members)}" if members else "a call"
    return f"{who}, {during}: {calls} failed ({failure})"


_EXCEPTION_REPR = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Closed))\((?:(['\"])(.*?)\2)?\)")


def readable_error(text: str) -> str:
    """An error as a person reads it, not its Python repr: ``members [0] lost: OSError("Unable to contact
    Actor's worker")`` -> ``members [0] lost: OSError: Unable to contact Actor's worker``."""
    return _EXCEPTION_REPR.sub(lambda m: f"{m[1]}: {m[3]}" if m[3] else m[1], str(text))


# ---- the figures ------------------------------------------------------------------------------------------


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def stripe_split(report: dict[str, Any]) -> tuple[int, int, int]:
    """(every stripe of the lost members, those copied, those generated from the seed): copied + generated
    = total. A record without ``stripes_total`` (an older summary.json) reads its copied stripes."""
    generated = int(report.get("stripes_generated") or 0)
    if report.get("stripes_total"):
        total = int(report["stripes_total"])
        return total, total - generated, generated
    copied = int(report.get("stripes") or 0)
    return copied + generated, copied, generated


def noticed_words(report: dict[str, Any]) -> list[str]:
    """What noticed each loss, in words (one per failure: a restart of the rebuild adds one); a record of an
    older run, which kept only the failures, gives each as a readable error."""
    noticed = list(report.get("noticed_by") or [])
    return [noticed[n] if n < len(noticed) and noticed[n] else f"a failed call ({readable_error(cause)})"
            for n, cause in enumerate(report.get("causes") or [])]


def recovery_figures(report: dict[str, Any], *, brief: bool = False) -> list[tuple[str, Any, str]]:
    """The recovery's figures, ``(what, value, unit)``, one per row of a table, in the order they happened: a
    figure the record lacks is left out, one not measured (a rebuild still running) says so. ``brief``: those
    a run's summary shows (what was lost, when, the stripes, what training waited, what noticed it)."""
    total, copied, generated = stripe_split(report)
    seconds = report.get("seconds")
    # (what, value, unit, in the brief form)
    items: list[tuple[str, Any, str, bool]] = [
        ("Lost", report.get("lost"), "", True),
        ("Detected after the shards started", report.get("detected_s"), "s", True),
        ("Rebuilt after detection", seconds, "s", True) if seconds is not None or "seconds" not in report else
        ("Rebuilt after detection", "not finished", "", True),
        ("Found replacement workers", report.get("placement_seconds"), "s", False),
        ("Stripes rebuilt (copied + generated)", total, "count", True),
        ("Stripes copied from the survivors (a row in them was trained)", copied, "count", True),
        ("Stripes generated from the seed (no row in them was trained)", generated, "count", True),
    ]
    if int(report.get("restarts") or 0) and int(report.get("stripes") or 0) != copied:
        items.append(("Stripes copied in all, restarted attempts included", report.get("stripes"), "count", False))
    items += [
        ("Rows copied", report.get("rows_rebuilt"), "count", True),
        ("Copy chunks", report.get("chunks"), "count", False),
        ("Bulk copy (training went on)", report.get("copy_seconds"), "s", False),
        ("Copy tasks on the new worker", report.get("copy_task_seconds"), "s", False),
        ("Copy tasks waiting for the survivors", report.get("copy_read_wait_seconds"), "s", False),
        ("Copy tasks decoding and installing", report.get("copy_install_seconds"), "s", False),
        ("Fix-up passes (training paused for each)", report.get("fix_ups"), "count", False),
        ("Stripes written during the copy, re-read in the fix-ups", report.get("stripes_fixed_up"), "count", False),
        ("Training waited for the fix-ups", report.get("locked_seconds"), "s", True),
        ("Restarts (a further loss during the rebuild)", report.get("restarts"), "count", True),
    ]
    items += [(f"New worker of {member}", worker, "", False)
              for member, worker in (report.get("new_workers") or {}).items()]
    noticed = noticed_words(report)
    items += [(f"Noticed by ({n})" if len(noticed) > 1 else "Noticed by", words, "", True)
              for n, words in enumerate(noticed, start=1)]
    return [(what, value, unit) for what, value, unit, short in items if value is not None and (short or not brief)]


def rebuild_start_sentence(lost: list[str], stripes: int, chunk: int) -> str:
    """The line that says a rebuild starts: what it rebuilds and how."""
    return (f"rebuilding {', '.join(lost)}: {_plural(stripes, 'stripe')} on replacement workers; those with a "
            f"row the trainer wrote are copied from the survivors (in chunks of {chunk:,} stripes), the others "
            f"are generated from the seed")


def recovery_sentence(report: dict[str, Any]) -> str:
    """The recovery in one line, from the same figures as :func:`recovery_figures`: ``rebuilt data shard 1:
    0.095 s after detection, 27,540 stripes = 3,039 copied from the survivors (2,382 rows in 1 chunk) + 24,501
    generated from the seed; 1 fix-up pass re-read 0 stripes written during the copy (training waited
    0.002 s); 0 restarts``."""
    total, copied, generated = stripe_split(report)
    seconds = report.get("seconds")
    when = "not finished" if seconds is None else f"{seconds:.3f} s after detection"
    return (f"rebuilt {', '.join(report['lost'])}: {when}, {_plural(total, 'stripe')} = {copied:,} copied from the "
            f"survivors ({_plural(int(report.get('rows_rebuilt') or 0), 'row')} in "
            f"{_plural(int(report.get('chunks') or 0), 'chunk')}) + {generated:,} generated from the seed; "
            f"{_plural(int(report.get('fix_ups') or 0), 'fix-up pass', 'fix-up passes')} re-read "
            f"{_plural(int(report.get('stripes_fixed_up') or 0), 'stripe')} written during the copy (training "
            f"waited {float(report.get('locked_seconds') or 0.0):.3f} s); "
            f"{_plural(int(report.get('restarts') or 0), 'restart')}")
