"""What the training loop records per iteration: losses, times, metrics rows and evaluations."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class TrainLog:
    """What the loop records per iteration. A checkpoint carries it (:meth:`snapshot`), so a resumed
    run reports every iteration's loss, not only those after the resume."""

    losses: list  # 0-d loss tensors (None: not trained yet)
    iteration_seconds: np.ndarray
    stall_seconds: np.ndarray
    metrics: list[dict[str, Any]]
    evaluations: list[dict[str, Any]] = field(default_factory=list)  # --eval-every: {iteration, auc, logloss}
    start: int = 0  # the first iteration this process trains (a resume: the checkpoint's)
    done: int = 0  # iterations reported (progress, metrics): a replay does not report them again
    seconds_before: float = 0.0  # training time before the resume
    begin: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, n: int) -> TrainLog:
        return cls([None] * n, np.zeros(n), np.zeros(n), [])

    def record(self, t: int, loss: torch.Tensor, seconds: float, stall: float) -> None:
        self.losses[t], self.iteration_seconds[t], self.stall_seconds[t] = loss, seconds, stall

    def snapshot(self, t: int) -> dict[str, Any]:
        """The log of iterations ``0..t-1`` (what a checkpoint before iteration ``t`` holds)."""
        return {"losses": torch.stack(self.losses[:t]).cpu() if t else torch.zeros(0),
                "iteration_seconds": torch.from_numpy(self.iteration_seconds[:t].copy()),
                "stall_seconds": torch.from_numpy(self.stall_seconds[:t].copy()),
                "metrics": [dict(m) for m in self.metrics if m["iteration"] <= t],
                "evaluations": [dict(e) for e in self.evaluations if e["iteration"] <= t],
                "seconds": self.seconds_before + time.perf_counter() - self.begin}

    @classmethod
    def restore(cls, n: int, snap: dict[str, Any], device: torch.device) -> TrainLog:
        log = cls.empty(n)
        t = len(snap["losses"])
        log.losses[:t] = list(snap["losses"].to(device).unbind())
        log.iteration_seconds[:t] = snap["iteration_seconds"].numpy()
        log.stall_seconds[:t] = snap["stall_seconds"].numpy()
        log.metrics = [dict(m) for m in snap["metrics"]]
        log.evaluations = [dict(e) for e in snap["evaluations"]]
        log.start = log.done = t
        log.seconds_before = float(snap["seconds"])
        return log

    def metrics_row(self, t: int, every: int, n: int) -> dict[str, Any] | None:
        """After ``t`` of ``n`` iterations, the metrics row due then (every ``every`` and at the end), appended
        to :attr:`metrics`: the mean loss, ms per iteration and stall since the previous row; else None."""
        if t % every and t != n:
            return None
        lo = self.metrics[-1]["iteration"] if self.metrics else 0
        row = {"iteration": t, "loss": float(torch.stack(self.losses[lo:t]).mean()),
               "iteration_ms": 1e3 * float(self.iteration_seconds[lo:t].mean()),
               "stall_ms": 1e3 * float(self.stall_seconds[lo:t].mean())}
        self.metrics.append(row)
        return row

    def result(self) -> dict[str, Any]:
        return {
            "losses": torch.stack(self.losses).cpu().numpy().astype(np.float64),
            "iteration_seconds": self.iteration_seconds,
            "stall_seconds": self.stall_seconds,
            "train_seconds": self.seconds_before + time.perf_counter() - self.begin,
            "metrics": self.metrics,
            "evaluations": self.evaluations,
        }

