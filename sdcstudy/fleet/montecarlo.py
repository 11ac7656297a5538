"""The SDC cost model drawn event by event: a seeded Monte Carlo check of model.py.

Every trial is one job. Its J steps are executed first; the events in them are drawn from
the Poisson rates of model.event_rates, and each event draws its own start, checkpoint offset
and, detector by detector, whether and when it is flagged (and for a persistent defect, the
golden checks that could catch it). The steps its detection loses are executed again, and
the events among those are drawn the same way, until a round loses nothing. The simulation
shares the model's assumptions (independent episodes, docs/fleet.md), not its algebra: no
survival function or renewal sum appears here.
"""

from __future__ import annotations

import numpy as np

from sdcstudy.fleet.model import Job, event_rates, golden_steps, wall_hours
from sdcstudy.fleet.strategies import Strategy

MAX_ROUNDS = 10_000
MAX_EVENTS = 5_000_000  # per round: past this the job is not finishing (model.expect: diverges)
# Trials are drawn in batches whose first round expects at most this many events (half of
# MAX_EVENTS: a later round may redo more steps than the first without hitting it). The
# default job (6 events) and the tests' busy job (38 events) fit 20,000 and 40,000 trials in
# one batch; 100,000 nodes (293 events) take three. A job of more events than this is not
# drawn at all (`simulated: false`), never reported as a job that does not finish.
BATCH_EVENTS = MAX_EVENTS // 2


def _transient_delays(strategy: Strategy, count: int, rng: np.random.Generator) -> np.ndarray:
    delay = np.full(count, np.inf)
    for d in strategy.detectors:
        flagged = rng.random(count) < d.recall_transient * d.coverage
        delay = np.where(flagged, np.minimum(delay, d.latency_steps), delay)
    return delay


def _persistent_delays(job: Job, strategy: Strategy, count: int,
                       rng: np.random.Generator) -> np.ndarray:
    delay = np.full(count, np.inf)
    for d in strategy.detectors:
        sees = rng.random(count) < d.recall_persistent
        unchecked = rng.geometric(d.coverage, count) - 1  # steps before its first check
        delay = np.where(sees, np.minimum(delay, unchecked + d.latency_steps), delay)
    if job.golden and job.golden_recall > 0:
        every = golden_steps(job, strategy)
        first = rng.integers(1, every + 1, count)  # steps from the onset to the next check
        misses = rng.geometric(job.golden_recall, count) - 1
        delay = np.minimum(delay, first + misses * every)
    return delay


def _round(job: Job, strategy: Strategy, executed: np.ndarray, rng: np.random.Generator):
    """Events in `executed` steps per trial -> (lost steps, corrupted steps, restarts,
    transient events, persistent events), each per trial."""
    trials = len(executed)
    m_t, m_p = event_rates(job, strategy)
    totals = [np.zeros(trials) for _ in range(3)]
    counts = []
    if (m_t + m_p) * executed.sum() > MAX_EVENTS:
        return None
    for persistent, rate in ((False, m_t), (True, m_p)):
        n = rng.poisson(rate * executed)
        counts.append(n)
        total = int(n.sum())
        if total == 0:
            continue
        owner = np.repeat(np.arange(trials), n)
        delay = (_persistent_delays(job, strategy, total, rng) if persistent
                 else _transient_delays(strategy, total, rng))
        remaining = rng.integers(1, job.steps + 1, total)  # U = J - s
        offset = rng.integers(0, job.checkpoint_every, total)  # o
        detected = delay < remaining
        rollback = offset + delay if job.clean_rollback else offset
        lost = np.where(detected, np.where(delay == 0, 1, rollback), 0)
        corrupted = np.minimum(delay, remaining)
        restart = detected & ((delay > 0) | persistent)
        for acc, values in zip(totals, (lost, corrupted, restart)):
            acc += np.bincount(owner, weights=values.astype(np.float64), minlength=trials)
    return (*totals, *counts)


def _jobs(job: Job, strategy: Strategy, trials: int, rng: np.random.Generator):
    """`trials` jobs, round after round until no step is lost: per trial the executed steps,
    corrupted steps, restarts and events (2 x trials); None when rework outgrows progress."""
    executed = np.zeros(trials)
    corrupted = np.zeros(trials)
    restarts = np.zeros(trials)
    events = np.zeros((2, trials))
    pending = np.full(trials, float(job.steps))
    for _ in range(MAX_ROUNDS):
        executed += pending
        drawn = _round(job, strategy, pending, rng)
        if drawn is None:
            break
        lost, corr, restart, n_t, n_p = drawn
        corrupted += corr
        restarts += restart
        events += (n_t, n_p)
        pending = lost
        if not pending.any():
            return executed, corrupted, restarts, events
    return None


def _unfinished(trials: int, simulated: bool = True) -> dict:
    return {"goodput_mc": 0.0 if simulated else None, "corrupted_steps_mc": None,
            "rollback_steps_mc": None, "restarts_mc": None, "trials": trials,
            "finished": False, "simulated": simulated}


def simulate(job: Job, strategy: Strategy, trials: int, seed: int) -> dict:
    """Means over `trials` jobs: goodput (J tau over the mean wall time, as the model
    defines it), corrupted steps, rollback steps, restarts; with standard errors. The jobs
    are drawn in batches of at most BATCH_EVENTS expected events, one after the other from
    one generator (one batch, the same draws as before batches, when they fit)."""
    rng = np.random.default_rng(seed)
    m_t, m_p = event_rates(job, strategy)
    per_trial = (m_t + m_p) * job.steps  # events expected in one job's first round
    if per_trial > BATCH_EVENTS:
        return _unfinished(trials, simulated=False)
    batch = trials if per_trial * trials <= BATCH_EVENTS else max(1, int(BATCH_EVENTS
                                                                        // per_trial))
    parts = []
    for first in range(0, trials, batch):
        part = _jobs(job, strategy, min(batch, trials - first), rng)
        if part is None:  # the job does not finish (rework outgrows progress)
            return _unfinished(trials)
        parts.append(part)
    executed, corrupted, restarts, events = (np.concatenate(x, axis=-1) for x in zip(*parts))
    wall = wall_hours(job, strategy, executed, restarts)
    sem = lambda x: float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else None  # noqa: E731
    return {"goodput_mc": job.steps * job.step_hours / float(wall.mean()),
            "corrupted_steps_mc": float(corrupted.mean()),
            "corrupted_steps_mc_sem": sem(corrupted),
            "rollback_steps_mc": float((executed - job.steps).mean()),
            "rollback_steps_mc_sem": sem(executed - job.steps),
            "restarts_mc": float(restarts.mean()),
            "events_mc": {"transient": float(events[0].mean()),
                          "persistent": float(events[1].mean())},
            "trials": trials, "finished": True, "simulated": True}
