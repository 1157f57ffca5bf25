"""The learning-rate schedule: MLPerf DLRM's warm-up and polynomial decay, a pure function of the iteration.

facebookresearch/dlrm's ``LRPolicyScheduler`` (``dlrm_s_pytorch.py``; MLPerf DLRM trains with it:
``--lr-num-warmup-steps``, ``--lr-decay-start-step``, ``--lr-num-decay-steps``) scales the base rate at
its step count ``s`` (``s = t + 1`` for iteration ``t``, counted from 0):

    s <  W                    s / W                      linear warm-up
    D <= s < D + N            ((N - (s - D)) / N) ** 2   polynomial (power 2) decay, at least 1e-7 / base
    s >= D + N  (N > 0)       the last decayed value     frozen
    otherwise                 1

One deviation: between the warm-up's end and the decay's start the reference keeps the last warm-up
rate, ``(W - 1) / W`` of the base; here the rate is the base rate there, as the warm-up intends.

Every trainer of every mode computes the rate of iteration ``t`` from ``t`` alone and applies it to the
dense optimizer and to the row updates of ``t`` (a row update applied later, as the LRPP cache does for
rows synced in the background, uses the rate of the iteration whose gradient it applies), so a schedule
keeps every mode bit-identical to ``local``. Without a schedule (the defaults) the scale is exactly 1
and nothing is touched: every rate stays the configured one, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_LR = 1e-7  # the reference's floor during the decay


@dataclass(frozen=True)
class LrSchedule:
    warmup_steps: int = 0  # W
    decay_start_step: int = 0  # D
    decay_steps: int = 0  # N; 0: no decay
    steps_before: int = 0  # a run continued from another (--init-from): the steps its state has taken

    @classmethod
    def of(cls, config: Any, steps_before: int = 0) -> LrSchedule:
        """The schedule a TrainConfig asks for (``steps_before``: RunSetup.steps_before)."""
        return cls(config.lr_num_warmup_steps, config.lr_decay_start_step, config.lr_num_decay_steps, steps_before)

    @property
    def constant(self) -> bool:
        return self.warmup_steps <= 1 and self.decay_steps == 0

    def lr(self, base: float, t: int) -> float:
        """The learning rate of iteration ``t`` (from 0) for the base rate ``base``."""
        if self.constant:
            return base
        s = self.steps_before + t + 1  # the reference's step count during iteration t
        if s < self.warmup_steps:
            return base * (s / self.warmup_steps)
        if self.decay_steps:
            end = self.decay_start_step + self.decay_steps
            if s >= self.decay_start_step:
                left = self.decay_steps - (min(s, end - 1) - self.decay_start_step)
                return max(MIN_LR, base * (left / self.decay_steps) ** 2)
        return base
