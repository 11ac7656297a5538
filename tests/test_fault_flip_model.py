"""The flip model of the paper nodes (faults/flip_model.py, docs/faults.md section 6): its bulk
of bfloat16 mantissa flips against the derivation, its bits in float32 and bfloat16, the tail
fit, and the default profiles left as they were."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.core.errors import UserError
from sdcstudy.faults import corrupt as FC
from sdcstudy.faults import bits as FB
from sdcstudy.faults import flip_model as F
from sdcstudy.faults import profiles as P
from sdcstudy.faults import published_layers as PL
from sdcstudy.faults.published import SITES, TABLE1_FREQUENCY, TABLE2_MAX_SEVERITY
from sdcstudy.faults.specs import FaultSpec, TimePattern

RATE = 0.05
N = 2 ** 19


def _bulk_hits(dtype):
    """(healthy, corrupted, bit) of the hit elements of a normal tensor under the bulk spec."""
    x = jax.random.normal(jax.random.key(3), (N // 256, 256), jnp.float32).astype(dtype)
    spec = FaultSpec("fwd/attn", "bitflip", rate=RATE, bit_class=F.BULK_BIT_CLASS)
    y, landed, bit = FC.corrupt(x, jax.random.key(4), spec, RATE)
    landed = np.asarray(landed)
    as64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)[landed]  # noqa: E731
    return as64(x), as64(y), np.asarray(bit)[landed], np.asarray(x.astype(jnp.float32))


@pytest.mark.parametrize("dtype, low", [(jnp.float32, 16), (jnp.bfloat16, 0)])
def test_bulk_errors_are_the_flipped_places(dtype, low):
    """Each bulk hit flips one of the 7 bfloat16 mantissa bits (bits 16-22 of a float32, 0-6
    of a bfloat16), all equally likely, and its relative error lies in [2^(j-8), 2^(j-7)] for
    mantissa bit j; the mean square over hits is the derivation's E[4^(j-7)] E[s^-2]. A
    failure means the bulk flips other bits, weighs them unequally, or E[r^2] (and with it
    the WCNTS the docs derive) is not what is documented."""
    f, g, bit, _ = _bulk_hits(dtype)
    assert len(bit) > 0.9 * RATE * N
    j = bit - low
    assert set(np.unique(j)) == set(range(7))
    counts = np.bincount(j, minlength=7)
    chi2 = float(np.sum((counts - len(j) / 7) ** 2 / (len(j) / 7)))
    assert chi2 < 22.5  # chi-square, 6 degrees of freedom: p = 0.001
    r = np.abs(g - f) / np.abs(f)
    assert np.all(r >= 2.0 ** (j - 8)) and np.all(r <= 2.0 ** (j - 7))
    sq = r ** 2
    se = sq.std() / math.sqrt(len(sq))
    assert abs(sq.mean() - F.bulk_mean_square()) < 4 * se  # 4 standard errors


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bulk_noise_of_a_tensor_is_the_derivation(dtype):
    """The bulk's relative L2 noise ||f'-f||^2 / ||f||^2 over a normal tensor is rate x
    E[4^(j-7)] x kappa (kappa = E[4^e] / E[f^2] for normal values), within 4 standard errors
    of the hits' sum: the number WCNTS is derived from. A failure means the docs' WCNTS
    derivation for the flip model is wrong."""
    f, g, _, whole = _bulk_hits(dtype)
    hits, total = len(f), float(np.sum(whole.astype(np.float64) ** 2))
    per_hit = (g - f) ** 2
    measured = per_hit.sum() / total
    expected = hits / whole.size * F.bulk_noise()
    se = per_hit.std() * math.sqrt(hits) / total
    assert abs(measured - expected) < 4 * se
    assert F.bulk_noise() == pytest.approx(0.0258, abs=5e-5)  # against additive's 0.0902
    assert F.bulk_mean_square() == pytest.approx(0.0258, abs=5e-5)


def test_bf16_classes_are_the_bits_a_bfloat16_result_keeps():
    """"bf16-result" is bits 16-22, 23 and 31 of a float32 and 0-6, 7 and 15 of a bfloat16,
    and flipping one of them in a float32 that holds a bfloat16 value gives exactly the
    bfloat16 value with that bit flipped, converted: a failure means a float32 run's flips are
    not the bfloat16 result's."""
    assert FB.bits_of_class("bf16-result", 32) == (*range(16, 23), 23, 31)
    assert FB.bits_of_class("bf16-result", 16) == (*range(0, 7), 7, 15)
    assert FB.bits_of_class("bf16-mantissa", 32) == tuple(range(16, 23))
    assert FB.bits_of_class("bf16-mantissa", 16) == tuple(range(0, 7))
    x16 = jax.random.normal(jax.random.key(0), (4096,), jnp.float32).astype(jnp.bfloat16)
    for b16, b32 in zip(FB.bits_of_class("bf16-result", 16), FB.bits_of_class("bf16-result", 32)):
        flipped16 = FB.flip_bits(x16, b16).astype(jnp.float32)
        flipped32 = FB.flip_bits(x16.astype(jnp.float32), b32)
        assert np.array_equal(np.asarray(FB.to_bits(flipped16)), np.asarray(FB.to_bits(flipped32)))


def test_default_paper_profiles_are_unchanged():
    """Without `fault_model` every paper node's spec list is the one built before the flip
    model existed: accumulator errors at Table 1's rates over the pattern's mean, then the
    weight-gradient spec. Rebuilt here from the published numbers; a failure means recorded
    figures would move."""
    for node in range(1, 16):
        pattern = P.PATTERNS.get(node, TimePattern())
        mean = pattern.mean_multiplier(P.PAPER_STEPS)
        specs = [FaultSpec(site, "additive", rate=min(freq / mean, 1.0), scale=P.MAGNITUDE,
                           pattern=pattern, note=f"Table 1 frequency {freq:g} (Table 2 max "
                                                 f"severity {sev:g})")
                 for site, freq, sev in zip(SITES, TABLE1_FREQUENCY.get(node, (0,) * 4),
                                            TABLE2_MAX_SEVERITY.get(node, (0,) * 4)) if freq]
        grad = P.weight_grad_spec(node, P.GRAD_PATTERNS.get(node, TimePattern()))
        specs += [grad] if grad is not None else []
        for profile in (P.paper_node(node), P.zoo()[f"paper-node-{node}"],
                        P.load(f"paper-node-{node}")):
            assert profile.specs == tuple(specs) and profile.name == f"paper-node-{node}"
    assert not any(f"paper-node-{n}{P.FLIP_SUFFIX}" in P.zoo() for n in range(1, 16))


def test_flip_profiles_split_each_rate_into_bulk_and_fitted_tail():
    """`paper-node-N-flip` keeps each site's Table 1 rate, split into mantissa flips and the
    fitted tail fraction of accumulator errors, and the default's weight-gradient spec; it is
    listed and loads by name. A failure means the flip profiles are not the documented model."""
    listing = P.listing()
    for node in (1, 10, 11, 14):
        default, flip = P.paper_node(node), P.load(f"paper-node-{node}-flip")
        assert f"paper-node-{node}-flip" in listing and flip.name == f"paper-node-{node}-flip"
        for spec in default.specs:
            if spec.site == "grad":
                assert spec in flip.specs
                continue
            mine = [s for s in flip.specs if s.site == spec.site]
            assert sum(s.rate for s in mine) == pytest.approx(spec.rate, rel=1e-12)
            bulk = [s for s in mine if s.kind == "bitflip"]
            assert len(bulk) == 1 and bulk[0].bit_class == F.BULK_BIT_CLASS
            tail = [s for s in mine if s.kind == "additive"]
            p_tail = F.tail_fraction(node, spec.site)
            assert sum(s.rate for s in tail) == pytest.approx(p_tail * spec.rate, rel=1e-12)
            assert all(s.scale == P.MAGNITUDE for s in tail)
            assert all(s.pattern == spec.pattern for s in mine)


def test_spike_amplitude_sets_the_decay_and_refuses_other_nodes():
    """`spike_amplitude` changes nodes 10 and 11's initial spike (and with it the base rate,
    so the 4500-step mean stays Table 1's) and is refused, in one sentence, for a node
    without one: a failure means the amplitude sweep does not sweep what it says."""
    for amplitude in (0, 3, 10):
        profile = P.paper_node(10, fault_model="flip", spike_amplitude=amplitude)
        bulk = next(s for s in profile.specs if s.site == "fwd/attn" and s.kind == "bitflip")
        assert bulk.pattern.amplitude == amplitude
        total = sum(s.rate for s in profile.specs if s.site == "fwd/attn")
        assert total * bulk.pattern.mean_multiplier(P.PAPER_STEPS) == pytest.approx(4.78e-3)
    with pytest.raises(UserError, match="initial spike"):
        P.paper_node(1, spike_amplitude=3)
    with pytest.raises(UserError, match="fault_model must be one of"):
        P.paper_node(1, fault_model="outflip")


def test_tail_fit_recovers_the_constant_it_was_drawn_with():
    """Per-layer maxima drawn from the model (the maximum over U units of a unit severity
    with P(S > t) = c / t, so P(max <= t) = exp(-c U / t)), with node 10's fwd/attn
    exposures, give back c within 5% over 4000 layers; the fitted c of the paper's own
    tables makes the likelihood's derivative zero. A failure means p_tail is not the fit to
    the tables it claims."""
    freqs = [v for v in PL.layer_values("Table 6", 10, "fwd/attn") if v > 0]
    units = np.array([F.paper_units(f) for f in freqs] * 250)
    c = 3e-5
    u = np.random.default_rng(0).uniform(size=units.size)
    maxima = c * units / -np.log(u)  # inverse of exp(-c U / t)
    assert F.tail_constant(list(maxima), list(units)) == pytest.approx(c, rel=0.05)
    for node, site in ((10, "fwd/attn"), (11, "bwd/ffn"), (1, "bwd/attn")):
        fit = F.layer_fit(node, site)
        maxima = PL.layer_values(PL.tables_for(site)[1], node, site)
        freqs = PL.layer_values(PL.tables_for(site)[0], node, site)
        lay = [(m, F.paper_units(f)) for m, f in zip(maxima, freqs) if F.paper_units(f) > 0]
        above = [(m, u) for m, u in lay if m > F.BULK_MAX]
        score = len(above) / fit["c"] - sum(u / m for m, u in above) \
            - sum(u for m, u in lay if m <= F.BULK_MAX) / F.BULK_MAX
        assert abs(score) < 1e-9 * len(above) / fit["c"]
        assert fit["p_tail"] == pytest.approx(fit["c"] / F.ADDITIVE_TAIL)
        assert fit["p_tail"] < 1  # uncapped: the predicted maximum is the fit's median
        assert math.exp(-fit["c"] * fit["units"] / fit["table2"]) == pytest.approx(0.5)


def test_tail_constant_of_additive_hits_is_the_derivation():
    """ADDITIVE_TAIL: the relative error of additive hits (m log-uniform on [2^-8, 1] times
    the row RMS) on normal values exceeds t with probability ADDITIVE_TAIL / t for t >> 1;
    measured at t = 30 over 2^20 hits within 4 standard errors of the binomial. A failure
    means the tail fractions are off by the same factor."""
    x = jax.random.normal(jax.random.key(5), (N // 256, 256), jnp.float32)
    spec = FaultSpec("fwd/attn", "additive", rate=1.0, scale=P.MAGNITUDE)
    y, landed, _ = FC.corrupt(x, jax.random.key(6), spec, 1.0)
    r = np.abs(np.asarray(y, np.float64) - np.asarray(x, np.float64)) / np.abs(np.asarray(x))
    t = 30.0
    p = F.ADDITIVE_TAIL / t
    assert abs(np.mean(r > t) - p) < 4 * math.sqrt(p * (1 - p) / r.size)
