"""Promises of docs/metrics.md, docs/paft.md and docs/plan.md that no other test held, each
against a pure call or a tiny program (no run, no model compiled).

- metrics.md, "Mismatches of one tensor": a mismatch whose healthy value is itself non-finite
  is in `mismatches` only; data-parallel workers of one tp rank share a row whose severity is
  the mean over all their finite mismatches together (`paired/mismatch.py`, `merge`);
- metrics.md, "Parameter drift": summary.json's `param/diff_l2` is the last step's value;
  `bit_histogram` of a bfloat16 run counts its 16 bit positions and sums them per field;
- paft.md, section 2: copies that agree bit for bit give a divergence of exactly 0 for any M
  (`divergence`); the divergence an average removed is exactly 0 for them when M is a power
  of two, and otherwise no more than the mean's rounding;
- plan.md: "fits" is at most 95% of the device's memory, a plan between 75% and 95% names the
  XLA_PYTHON_CLIENT_MEM_FRACTION it needs, the step time is FLOPs / (MFU x peak) with the
  documented defaults and peaks, and an MFU outside (0, 1] is refused in one sentence.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sdcstudy.core import mesh as M
from sdcstudy.core import stats
from sdcstudy.core.config import UserError
from sdcstudy.paft import divergence as DV
from sdcstudy.paired import mismatch as MS
from sdcstudy.paired.summary import bit_histogram_summary, paired_summary
from sdcstudy.plan import devices as PD

BF16 = stats.BFLOAT16


# --- metrics.md: one tensor, and the rows of several dp workers --------------------------------


def test_a_mismatch_whose_healthy_value_is_not_finite_is_counted_but_not_averaged():
    """"the rare mismatches whose healthy value is itself non-finite (those are in
    `mismatches` only)": not in `nonfinite` (the suspect is finite), not in the mean."""
    healthy = np.array([np.inf, np.nan, 2.0, 4.0], np.float32)
    suspect = np.array([1.0, 3.0, 3.0, 4.0], np.float32)
    got = stats.mismatch_stats(healthy, suspect)
    assert got == {"mismatches": 3, "elements": 4, "severity": 0.5, "max_rel_err": 0.5,
                   "nonfinite": 0}


def _decoded(finite: int, rel_sum: float, rel_max: float, mismatches: int, nonfinite: int):
    return {"mismatches": mismatches, "elements": 100, "finite": finite, "rel_sum": rel_sum,
            "severity": rel_sum / finite if finite else 0.0, "max_rel_err": rel_max,
            "nonfinite": nonfinite, "bits": np.arange(32, dtype=np.int64)}


def test_dp_workers_share_a_row_whose_severity_is_the_mean_over_all_their_mismatches():
    """One worker with one finite mismatch of relative error 1.0 and one with three of 0.1
    each: the row's severity is (1.0 + 0.3) / 4, not the mean of the workers' means."""
    one, three = _decoded(1, 1.0, 1.0, 2, 1), _decoded(3, 0.3, 0.1, 3, 0)
    row = MS.merge([one, three])
    assert row["severity"] == pytest.approx(1.3 / 4, rel=1e-15)
    assert (row["mismatches"], row["elements"], row["nonfinite"]) == (5, 200, 1)
    assert row["max_rel_err"] == 1.0
    np.testing.assert_array_equal(row["bits"], 2 * np.arange(32))
    # a worker without finite mismatches adds nothing to the mean
    assert MS.merge([one, _decoded(0, 0.0, 0.0, 4, 4)])["severity"] == 1.0


# --- metrics.md: summary.json of a paired run -------------------------------------------------


def test_summary_param_diff_is_the_last_steps_value():
    rows = [{"step": s, "grad/nts": 0.0, "grad/norm": 1.0, "loss/healthy": 5.0,
             "loss/suspect": 5.0, "param/diff_l2": d} for s, d in ((1, 0.5), (2, 3.0), (3, 0.25))]
    assert paired_summary(rows, {}, {}, "float32")["param/diff_l2"] == 0.25


def test_bfloat16_bit_histogram_has_16_positions_summed_per_field():
    """Index 0 is the lowest mantissa bit; bfloat16 has 7 mantissa bits, 8 exponent bits and
    the sign at 15. The device's histogram has 32 slots; the summary keeps the dtype's."""
    counts = np.zeros(32, np.int64)
    counts[[0, 6, 7, 14, 15]] = [1, 2, 4, 8, 16]
    got = bit_histogram_summary({"fwd/ffn": counts, "fwd/attn": counts}, "bfloat16")
    assert list(got) == ["fwd/attn", "fwd/ffn"]  # the sites' order
    site = got["fwd/ffn"]
    assert len(site["bits"]) == 16 and site["bits"][15] == 16
    assert (site["mantissa"], site["exponent"], site["sign"]) == (3, 12, 16)


# --- paft.md, section 2: the divergence of copies that agree ---------------------------------


def _average_of_equal_copies(workers: int, x: np.ndarray):
    """(the averaged copy, the divergence the average removed as (mean, max), and
    `divergence` of the copies) for `workers` copies of `x`."""
    mesh = M.make_mesh(1, workers, 1)

    def local(x_M):
        params = {"w": x_M[0]}
        averaged, _, removed = DV.average(jnp.bool_(True), params, (), workers)
        return averaged["w"][None], removed, DV.divergence(params)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(M.DATA),
                                 out_specs=(P(M.DATA), P(), P()), check_vma=True))
    return jax.device_get(step(jnp.stack([jnp.asarray(x)] * workers)))


@pytest.mark.parametrize("workers", [3, 4])
def test_copies_that_agree_have_no_divergence_and_an_average_keeps_them(workers):
    x = np.random.default_rng(0).standard_normal(512).astype(np.float32)
    averaged, (removed, removed_max), measured = _average_of_equal_copies(workers, x)
    assert tuple(map(float, measured)) == (0.0, 0.0)  # `divergence`: exactly 0 for any M
    assert (averaged == averaged[0]).all()  # the copies still agree after the average
    if workers & (workers - 1) == 0:  # a power of two: the mean of equal copies is exact
        assert (averaged[0] == x).all() and float(removed) == float(removed_max) == 0.0
    else:  # the mean's rounding, at most about M^2 2^-48 ||theta||^2 (docs/paft.md)
        bound = workers ** 2 * 2.0 ** -48 * float(np.sum(x.astype(np.float64) ** 2))
        assert 0 <= float(removed) <= bound and float(removed_max) <= bound


# --- plan.md: what the device table says -----------------------------------------------------


def test_fits_is_95_percent_and_a_plan_above_75_names_the_fraction_it_needs():
    dev = PD.DEVICES["h100"]
    assert dev.memory == 81559 * 2 ** 20 and PD.DEVICES["h200"].memory == 143771 * 2 ** 20
    at = lambda share: PD.fit(dev, math.floor(share * dev.memory))  # noqa: E731
    assert at(0.75)["fits"] and at(0.75)["mem_fraction"] is None  # XLA's default share
    assert at(0.80)["fits"] and at(0.80)["mem_fraction"] == 0.80
    assert at(0.9401)["mem_fraction"] == 0.95 and at(0.95)["fits"]
    over = PD.fit(dev, math.floor(0.95 * dev.memory) + 1)
    assert not over["fits"] and over["mem_fraction"] is None


@pytest.mark.parametrize("dtype, mfu, peak", [("float32", 0.186, 494e12),
                                              ("bfloat16", 0.126, 989e12)])
def test_step_time_is_flops_over_mfu_times_the_documented_peak(dtype, mfu, peak):
    """The defaults plan.md states: 18.6% of the TF32 peak (494 TFLOP/s) in float32, 12.6% of
    989 TFLOP/s in bfloat16; `--mfu` replaces the MFU."""
    flops = 3.0e15
    for name in ("h100", "h200"):
        got = PD.step_estimate(PD.DEVICES[name], dtype, flops)
        assert got["mfu"] == mfu and got["seconds"] == pytest.approx(flops / (mfu * peak),
                                                                      rel=1e-3)
        given = PD.step_estimate(PD.DEVICES[name], dtype, flops, 0.5)
        assert given["seconds"] == pytest.approx(flops / (0.5 * peak), rel=1e-3)
        assert "given with --mfu" in given["mfu_source"]


@pytest.mark.parametrize("mfu", [0.0, -0.1, 40.0, float("nan")])
def test_an_mfu_outside_0_to_1_is_one_sentence(mfu):
    with pytest.raises(UserError) as refused:
        PD.check_mfu(mfu)
    assert str(refused.value).startswith("--mfu must be a fraction above 0 and at most 1")
    PD.check_mfu(1.0)
    PD.check_mfu(None)
