"""Verified rollback: re-run a step the detectors flag, from the last state they passed.

Two in-memory slots hold training states (double buffering, after the in-memory snapshots of
Wang et al., "Fault-Tolerant Hybrid-Parallel Training at Scale with Reliable and Efficient
In-memory Checkpointing"). A new state goes into the spare slot and is promoted to "verified"
by flipping one index, and only after every detector has passed the step that produced it:
a snapshot taken before the check would keep a corrupted state as faithfully as a clean one.
On a flag the candidate is dropped and the step is recomputed from the verified slot with the
next attempt number (transient faults then draw afresh; repeatable ones recur, and the run
stops after `max_retries`, as it does when a detector that judges the result alone, the loss
monitor, flags a clean step: its re-runs give the same bits, and the error says so). The host
loop only ever receives verified states, so the run folder's orbax checkpoints, every
`experiment.checkpoint_every` steps, persist verified states only; orbax writes into a
temporary folder and renames it when complete, so a process killed mid-write leaves the
previous checkpoint as the latest, never a mix of two steps.

What the run folder records of a step is its first execution's verdict and records (the
detectors' flags, the ground truth, the faults that landed: what the detectors caught and are
scored on) with `rollbacks`, the re-runs it took; its state and metrics are the accepted
re-run's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class DetectionError(RuntimeError):
    """A step stayed flagged after every retry the rollback allows."""


class VerifiedRollback:
    """Wraps a compiled detect step `(state, batch) -> core.step.StepOut`.

    The step donates its input, so each attempt gets a fresh copy of the verified state.
    """

    def __init__(self, compiled, trainer, max_retries: int = 8):
        self.compiled, self.trainer, self.max_retries = compiled, trainer, max_retries
        self.slots: list = [None, None]
        self.active = 0  # the slot holding the verified state
        self.verified_step = None
        self.rollbacks = 0

    @property
    def verified(self):
        return self.slots[self.active]

    def promote(self, state, step: int) -> None:
        """The spare slot takes `state`, then one index flip makes it the verified one."""
        spare = 1 - self.active
        self.slots[spare] = state
        self.active = spare
        self.slots[1 - spare] = None  # the previous verified state is no longer needed
        self.verified_step = step

    def __call__(self, state, batch):
        if self.verified is None or self.verified is not state:
            self.promote(state, int(jax.device_get(state["step"])))
        first = None  # the first execution's (verdict, records): what the detectors caught
        results = set()  # (loss, gradient norm) of each flagged attempt
        for attempt in range(self.max_retries + 1):
            work = jax.tree.map(jnp.copy, self.verified)
            # Even attempt numbers: a re-execution detector uses attempt + 1 for its copy.
            out = self.compiled(work, {**batch, "attempt": jnp.int32(2 * attempt)})
            verdict = self.trainer.judge(out.records["detect"])
            first = first or (verdict, out.records)
            if not self.trainer.flagged(verdict):
                self.trainer.accept(verdict)
                self.promote(out.state, self.verified_step + 1)
                self.rollbacks += attempt
                # The accepted re-run's verdict is clean by construction: recording it would
                # erase every detection (and the faults behind it) from the run folder.
                caught, records = first
                return out._replace(records={**records,
                                             "detect": {**caught, "rollbacks": attempt}})
            results.add((repr(verdict["loss"]), repr(verdict["grad_norm"])))  # NaN alike
        raise DetectionError(self._still_flagged(verdict, len(results) == 1))

    def _still_flagged(self, verdict: dict, alike: bool) -> str:
        """Why the run stops: the step, the detectors that flagged its last attempt and, when
        every attempt gave the same loss and gradient norm, the two things that do that."""
        names = ", ".join(n for n in self.trainer.detectors if verdict.get(n)) or "a detector"
        said = (f"step {self.verified_step + 1} was still flagged after {self.max_retries} "
                f"rollbacks (by {names})")
        if not alike:
            return (f"{said}, its attempts giving different results: a transient fault that "
                    f"strikes nearly every execution cannot be rolled back.")
        return (f"{said}, every attempt giving the same loss and gradient norm: a repeatable "
                f"fault, which rollback cannot get past, or a false alarm on a clean step (a "
                f"loss monitor's threshold, detect.spike_loss or detect.spike_grad, too tight).")
