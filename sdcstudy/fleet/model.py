"""The analytic expectation of the SDC cost model (docs/fleet.md, "SDC cost model").

A job must complete J steps on N nodes. An executed step takes h = tau (1 + overhead) hours of
every node's time (a detector that uses extra nodes costs the same node-hours). SDC events
arrive in executed steps (rework included) as Poisson processes: m_t = N h lambda_t transient
and m_p = N h lambda_p persistent events per executed step. Each event is an independent
episode: it starts at a step s uniform over the job (U = J - s steps remain, U uniform on
1..J), a checkpoint offset o uniform on 0..C-1 after the last checkpoint, and is flagged D
steps later (D = infinity: never; its survival function S(k) = P(D > k) is below). Then
- corrupted steps (trained on before detection, or to the job's end): min(D, U);
- detected when D < U; lost steps: 1 when D = 0 (the step is recomputed before its update is
  applied); otherwise o + D with `job.rollback: clean` (back to the last checkpoint before the
  event, which removes the corruption) or o with `latest` (back to the latest checkpoint, o
  steps before the flag, keeping the corruption: a restart as after any interruption);
- a restart of R hours for every detected persistent defect (the node is swapped out) and for
  every transient event detected after its update was applied (reload from a checkpoint).
Lost steps are executed steps too, so the job executes A = J / (1 - l) steps, l the expected
lost steps per executed step (renewal); with l >= 1 the job never finishes. Wall time:
T = A (h + c / C) + (A h / P) d + restarts R, with checkpoints of c hours every C steps and
golden checks of d hours every P hours of computation. Goodput = J tau / T.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdcstudy.fleet.config import FleetConfig
from sdcstudy.fleet.strategies import Strategy, parse

HOUR = 3600.0


@dataclass(frozen=True)
class Job:
    nodes: int
    step_hours: float  # tau: one step without any detector
    steps: int  # J
    checkpoint_every: int  # C
    checkpoint_hours: float  # c
    restart_hours: float  # R
    clean_rollback: bool  # back to the checkpoint before the event, not the latest one
    transient_rate: float  # lambda_t, events per node-hour
    persistent_rate: float  # lambda_p, defect onsets per node-hour
    golden: bool
    golden_interval_hours: float  # P
    golden_duration_hours: float  # d
    golden_recall: float

    @classmethod
    def from_config(cls, cfg: FleetConfig, nodes: int | None = None) -> "Job":
        job = cfg["job"]
        return cls(nodes=cfg["fleet.nodes"] if nodes is None else nodes,
                   step_hours=job["step_seconds"] / HOUR,
                   steps=int(job["hours"] * HOUR // job["step_seconds"]),
                   checkpoint_every=job["checkpoint_every"],
                   checkpoint_hours=job["checkpoint_seconds"] / HOUR,
                   restart_hours=job["restart_seconds"] / HOUR,
                   clean_rollback=job["rollback"] == "clean",
                   transient_rate=cfg["sdc.transient_per_node_hour"],
                   persistent_rate=cfg["sdc.persistent_per_node_hour"],
                   golden=cfg["golden.enabled"],
                   golden_interval_hours=cfg["golden.interval_hours"],
                   golden_duration_hours=cfg["golden.duration_hours"],
                   golden_recall=cfg["golden.recall"])


def executed_step_hours(job: Job, strategy: Strategy) -> float:
    """h = tau (1 + overhead)."""
    return job.step_hours * (1 + strategy.overhead)


def golden_steps(job: Job, strategy: Strategy) -> int:
    """The golden-check interval in executed steps (at least 1)."""
    return max(1, round(job.golden_interval_hours / executed_step_hours(job, strategy)))


def event_rates(job: Job, strategy: Strategy) -> tuple[float, float]:
    """(m_t, m_p): transient events and persistent onsets per executed step, fleet-wide."""
    node_hours = job.nodes * executed_step_hours(job, strategy)
    return node_hours * job.transient_rate, node_hours * job.persistent_rate


def survival_transient(strategy: Strategy, steps: int) -> np.ndarray:
    """S(k) = P(D > k), k = 0..steps-1, for a transient event: detector i flags it with
    probability recall * coverage, L_i steps after it; the earliest flag counts."""
    k = np.arange(steps)
    survival = np.ones(steps)
    for d in strategy.detectors:
        survival *= 1 - d.recall_transient * d.coverage * (k >= d.latency_steps)
    return survival


def survival_persistent(strategy: Strategy, steps: int, golden_every: int | None,
                        golden_recall: float) -> np.ndarray:
    """S(k) = P(D > k), k = 0..steps-1, for a persistent defect.

    Detector i sees the defect with probability r_i; a defect it sees is first checked after
    G_i ~ Geometric(coverage) steps (0 when coverage is 1) and flagged L_i steps later:
    P(G_i + L_i > k) = (1 - coverage)^(k - L_i + 1) for k >= L_i. A golden check every P_s
    steps (first one U_g ~ uniform on 1..P_s steps after the onset) catches it with
    probability g each time: D_g = U_g + M P_s, M ~ Geometric(g) misses, so with
    k = q P_s + rho, P(D_g > k) = (1 - g)^(q + 1) + g (1 - g)^q (P_s - rho) / P_s.
    """
    k = np.arange(steps)
    survival = np.ones(steps)
    for d in strategy.detectors:
        if d.recall_persistent == 0:
            continue
        chances = k - d.latency_steps + 1
        unseen = np.where(chances > 0, (1 - d.coverage) ** np.maximum(chances, 0), 1.0)
        survival *= (1 - d.recall_persistent) + d.recall_persistent * unseen
    if golden_every is not None and golden_recall > 0:
        q, rho = np.divmod(k, golden_every)
        miss = 1 - golden_recall
        survival *= (miss ** (q + 1)
                     + golden_recall * miss ** q * (golden_every - rho) / golden_every)
    return survival


@dataclass(frozen=True)
class Episode:
    """Expectations for one event, over its start, checkpoint offset and detection."""

    corrupted: float  # E[min(D, U)]
    detected: float  # P(D < U)
    in_step: float  # P(D = 0): flagged before its update was applied
    lost: float  # E[lost steps]
    latency: float | None  # E[D | detected]


def episode(survival: np.ndarray, checkpoint_every: int, clean: bool = True) -> Episode:
    """Sums over k = 0..J-1 with P(U > k) = (J - k) / J and P(D = k) = S(k-1) - S(k)."""
    steps = len(survival)
    k = np.arange(steps, dtype=np.float64)
    remaining = (steps - k) / steps
    pmf = np.concatenate(([1.0], survival[:-1])) - survival
    detected_at = pmf * remaining
    detected = float(detected_at.sum())
    offset = (checkpoint_every - 1) / 2
    lost = float(pmf[0] + (detected_at[1:] * (offset + (k[1:] if clean else 0))).sum())
    latency = float((detected_at * k).sum() / detected) if detected > 0 else None
    return Episode(corrupted=float((survival * remaining).sum()), detected=detected,
                   in_step=float(pmf[0]), lost=lost, latency=latency)


def episodes(job: Job, strategy: Strategy) -> tuple[Episode, Episode]:
    golden_every = golden_steps(job, strategy) if job.golden else None
    return (episode(survival_transient(strategy, job.steps), job.checkpoint_every,
                    job.clean_rollback),
            episode(survival_persistent(strategy, job.steps, golden_every, job.golden_recall),
                    job.checkpoint_every, job.clean_rollback))


def wall_hours(job: Job, strategy: Strategy, executed: float, restarts: float) -> float:
    """T = A (h + c / C) + (A h / P) d + restarts R, for A executed steps."""
    h = executed_step_hours(job, strategy)
    golden = executed * h / job.golden_interval_hours * job.golden_duration_hours \
        if job.golden else 0.0
    return (executed * (h + job.checkpoint_hours / job.checkpoint_every) + golden
            + restarts * job.restart_hours)


def expect(job: Job, strategy: Strategy, cached: tuple[Episode, Episode] | None = None) -> dict:
    """The analytic expectation for one strategy (see the module docstring)."""
    transient, persistent = cached or episodes(job, strategy)
    m_t, m_p = event_rates(job, strategy)
    lost_per_step = m_t * transient.lost + m_p * persistent.lost
    out = {"name": strategy.name, "overhead": strategy.overhead,
           "recall": {"transient": transient.detected, "persistent": persistent.detected},
           "latency_steps": {"transient": transient.latency, "persistent": persistent.latency}}
    if lost_per_step >= 1:  # every executed step loses a step or more: the job never ends
        return {**out, "goodput": 0.0, "corrupted_steps": None, "rollback_steps": None,
                "restarts": None, "events": None, "undetected_events": None,
                "wall_hours": None, "diverges": True}
    executed = job.steps / (1 - lost_per_step)
    events_t, events_p = m_t * executed, m_p * executed
    restarts = events_t * (transient.detected - transient.in_step) + events_p * persistent.detected
    wall = wall_hours(job, strategy, executed, restarts)
    return {**out,
            "goodput": job.steps * job.step_hours / wall,
            "corrupted_steps": events_t * transient.corrupted + events_p * persistent.corrupted,
            "rollback_steps": executed - job.steps,
            "restarts": restarts,
            "events": {"transient": events_t, "persistent": events_p},
            "undetected_events": (events_t * (1 - transient.detected)
                                  + events_p * (1 - persistent.detected)),
            "wall_hours": wall, "diverges": False}


def goodput_curve(cfg: FleetConfig, strategy_names, sizes) -> dict[str, list[float]]:
    """{strategy: goodput at each fleet size}. The episodes depend on the size only through
    the shadow's coverage and the executed step time, so they are computed once per value."""
    out: dict[str, list[float]] = {}
    for name in strategy_names:
        cache: dict = {}
        curve = []
        for nodes in sizes:
            strategy = parse(name, cfg, int(nodes))
            job = Job.from_config(cfg, int(nodes))
            key = (strategy.detectors, golden_steps(job, strategy))
            if key not in cache:
                cache[key] = episodes(job, strategy)
            curve.append(expect(job, strategy, cache[key])["goodput"])
        out[name] = curve
    return out
