"""Closed forms for PAFT divergence and packet-loss aggregation (derived in docs/paft.md).

Plain SGD (no momentum, weight decay or clipping) with M workers, each updating with the common
average gradient plus its own error eps_m ~ N(0, sigma2 I_d):
    theta_m <- theta_m - lr (g_bar + eps_m).
The common term cancels in theta_bar - theta_m, so the divergence is a function of the errors
alone. Lossy owner broadcasts and renormalized aggregation follow. Imports no JAX.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def expected_divergence(steps: float, lr: float, n_params: int, sigma2: float,
                        workers: int) -> float:
    """E[mean_m ||theta_bar - theta_m||^2] after `steps` noisy updates since the copies agreed:
    steps * lr^2 * d * sigma2 * (M - 1) / M (the paper's Lemma 3.1 has (M + 1) / M and no d)."""
    return steps * lr ** 2 * n_params * sigma2 * (workers - 1) / workers


def divergence_quantile(steps: float, lr: float, n_params: int, sigma2: float, workers: int,
                        q: float) -> float:
    """The q-quantile of mean_m ||theta_bar - theta_m||^2: it is exactly
    lr^2 * steps * sigma2 / M times a chi-square variable with d (M - 1) degrees of freedom."""
    from scipy.stats import chi2

    dof = n_params * (workers - 1)
    return lr ** 2 * steps * sigma2 / workers * float(chi2.ppf(q, dof))


def sync_bound(sync_every: int, lr: float, n_params: int, sigma2: float, workers: int,
               overlap: bool = False) -> float:
    """Bound on E[div] at every step with a sync every H steps: at most H - 1 noisy updates
    separate a step from the last average (H with overlap, whose average is applied one
    step late and so already carries one update)."""
    steps = sync_every if overlap else sync_every - 1
    return expected_divergence(steps, lr, n_params, sigma2, workers)


# --- lossy owner broadcasts ---------------------------------------------------------------


def copy_lag_moments(p: float, step_var: float) -> tuple[float, float]:
    """Stationary (E e_i^2, E e_i e_k) per coordinate of the lag e_i = owner's value - worker i's
    copy, for two non-owners i != k, when each broadcast reaches each of them independently with
    probability 1 - p and the owner's updates are independent, zero-mean, variance `step_var`."""
    return p * step_var / (1 - p), p * p * step_var / (1 - p * p)


def pair_drift(p: float, step_var: float) -> float:
    """Stationary E[(copy_i - copy_k)^2] per coordinate for two non-owners: 2 p s / (1 - p^2)
    (the packet-loss paper's Theorem 3.1 states 2 p s / (1 + p), which drops a factor 1/(1-p))."""
    a, c = copy_lag_moments(p, step_var)
    return 2 * (a - c)


def broadcast_divergence(p: float, step_var: float, n_params: int, workers: int) -> float:
    """Stationary E[mean_m ||theta_bar - theta_m||^2] when every coordinate has one owner whose
    copy is current and M - 1 lagging copies: d (M-1)/M^2 ((M-1) a - (M-2) c)."""
    a, c = copy_lag_moments(p, step_var)
    m = workers
    return n_params * (m - 1) / m ** 2 * ((m - 1) * a - (m - 2) * c)


# --- aggregation of what arrived ------------------------------------------------------------


def mask_average(aggregate, workers: int, me: int, p: float, condition=None):
    """E of `aggregate(arrived)` over every loss mask of the M-1 links into receiver `me`
    (enumerated, each with its probability p^lost (1-p)^arrived); `condition(arrived)` keeps
    only the masks it accepts, renormalized by their total probability (a conditional mean).
    `arrived[me]` is always True: a worker's own gradient never crosses the network."""
    total, mass = 0.0, 0.0
    others = [i for i in range(workers) if i != me]
    for bits in itertools.product((False, True), repeat=workers - 1):
        arrived = np.ones(workers, bool)
        arrived[others] = bits
        if condition is not None and not condition(arrived):
            continue
        prob = math.prod((1 - p) if b else p for b in bits)
        total = total + prob * np.asarray(aggregate(arrived), np.float64)
        mass += prob
    return total / mass
