"""How a fault's rate varies with the optimizer step: `TimePattern`, and the paper nodes' own
(`NODE_PATTERNS`). Imports no JAX: the scorer reads a pattern's per-step rate to state what a
correct model gives (`reproduce.pass_chance`); the traced multiplier the injector draws is
`faults.specs.pattern_multiplier`.

The nodes' patterns come from the paper's text: Figure 3 (nodes 7 and 14: rare spikes, "during
the majority of training time, no mismatch occurs"; node 14 "very infrequently over 4000
optimizer steps"), Figure 4 (nodes 10 and 11: "a high peak of mismatch frequency at the first
few steps"), section 6.2 (node 13: "no parameter difference before step 450").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TimePattern:
    """How a spec's rate varies with the optimizer step (counted from 1).

    constant: always `rate`. steps: only at the listed steps. burst: each step is active with
    probability `p_active` (then the spec's rate applies; otherwise nothing). onset: nothing
    before `onset_step`. decay: rate times (1 + `amplitude` * exp(-(step - 1) / `decay_steps`)),
    a spike at the start of the run.
    periodic: every `period`-th step the rate is multiplied by `amplitude`.
    """

    kind: str = "constant"
    p_active: float = 1.0
    onset_step: int = 0
    amplitude: float = 0.0
    decay_steps: float = 1.0
    period: int = 0
    steps: tuple[int, ...] = ()

    def mean_multiplier(self, steps: int) -> float:
        """Average rate multiplier over steps 1..steps (for calibration and descriptions)."""
        return float(np.mean(self.expected_multipliers(steps)))

    def peak_multiplier(self) -> float:
        """The largest rate multiplier a step can take (a burst's active step: 1)."""
        if self.kind == "decay":
            return 1 + self.amplitude
        if self.kind == "periodic":
            return max(1.0, self.amplitude)
        return 1.0

    def expected_multipliers(self, steps: int) -> np.ndarray:
        """The expected rate multiplier at each of steps 1..steps (a burst's: `p_active`)."""
        return self._multiplier_np(np.arange(1, steps + 1, dtype=np.float64))

    def _multiplier_np(self, step):
        if self.kind == "constant":
            return np.ones_like(step)
        if self.kind == "burst":
            return np.full_like(step, self.p_active)
        if self.kind == "onset":
            return (step >= self.onset_step).astype(np.float64)
        if self.kind == "steps":
            return np.isin(step, self.steps).astype(np.float64)
        if self.kind == "decay":
            return 1 + self.amplitude * np.exp(-(step - 1) / self.decay_steps)
        return np.where(step % self.period == 0, self.amplitude, 1.0)


NODE_PATTERNS = {
    7: TimePattern("burst", p_active=0.05),  # Figure 3: occasional spikes
    14: TimePattern("burst", p_active=1 / 4000),  # Figure 3: about one spike in 4000 steps
    10: TimePattern("decay", amplitude=10.0, decay_steps=20.0),  # Figure 4: initial peak
    11: TimePattern("decay", amplitude=10.0, decay_steps=20.0),
    13: TimePattern("onset", onset_step=450),  # section 6.2: clean before step 450
}


def node_pattern(node: int) -> TimePattern:
    """Paper node `node`'s time pattern (constant where the paper shows none)."""
    return NODE_PATTERNS.get(node, TimePattern())
