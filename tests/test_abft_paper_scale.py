"""Figure 10 at the paper's sizes (`reproduce/abft_paper_scale.py`): its numpy check against
the JAX checker, the scaling of a fault's residual with the inner dimension, the attention
placement option of the paper node profiles, and the scorecard rows."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.abft import checksum as CK
from sdcstudy.core.errors import UserError
from sdcstudy.faults import profiles as P
from sdcstudy.faults.published import SITES, TABLE1_FREQUENCY
from sdcstudy.reproduce import abft_paper_scale as A

TINY = A.ANCHOR_SHAPES[0]  # m = 1024 tokens, k = n = 64: the tiny scorecard's o check
# Float32 sums of the same at most 1024 terms in another order: the norms and thresholds agree
# to 1024 * 2^-24 = 6.1e-5 relative at worst (positive terms).
REORDER = 1024 * 2.0 ** -24
_jax_check = jax.jit(CK.check, static_argnums=3)


def _profile(node, placement, width):
    return P.paper_node(node, placement, context_width=width)


def _record(a, b, c, rule):
    return np.asarray(_jax_check(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c), rule),
                      np.float64)


def _rounding_room(sums: A.Checksums, c, row: int) -> float:
    """Twice the rounding bound of `row`: two float32 evaluations of the same residual, each
    within that bound of the exact one, differ by at most this much."""
    bound = A._rounding_bound(np.abs(c).sum(axis=1), sums.row_spread, sums.k, c.shape[1])
    return 2 * float(bound[row])


@pytest.mark.parametrize("rule", A.RULES)
def test_numpy_check_matches_the_jax_checker(rule):
    """The numpy check flags as the JAX checker does on a healthy and a corrupted product, and
    on the corrupted one reports its row and column, thresholds (to float32 reordering) and
    residuals (within the rounding both make); a healthy product's largest residual is
    rounding noise, whose row differs between the two. If not, the paper-size figures would
    not be ABFT's."""
    rng = np.random.default_rng(3)
    a, b = A.operands(A.Shape("t", 96, 48, 40), rng)
    c = a @ b
    sums = A.checksums(a, b)
    faults = A.AttentionFaults(1, 3e-3, 0.0, (0.5, 1.0), 1.0)
    bad, _, landed, _ = A.faulty_product(a, b, c, sums, faults, rng)
    assert landed >= 1
    for product, should_flag in ((c, False), (bad, True)):
        ours, theirs = A.check(sums, product, rule), _record(a, b, product, rule)
        assert ours["flagged"] is should_flag and bool(theirs[CK.FLAGGED]) is should_flag
        if not should_flag:
            continue
        assert (ours["row"], ours["col"]) == (int(theirs[CK.ROW]), int(theirs[CK.COL]))
        for key, index in (("row_threshold", CK.ROW_THRESHOLD),
                           ("col_threshold", CK.COL_THRESHOLD)):
            assert ours[key] == pytest.approx(theirs[index], rel=REORDER)
        room = _rounding_room(sums, product, int(theirs[CK.ROW]))
        assert abs(ours["row_residual"] - theirs[CK.ROW_RESIDUAL]) <= room


def test_flagged_share_at_tiny_matches_the_jax_checker():
    """Node 1's faults at the tiny scorecard's o shape (about one a check): the numpy check
    flags exactly the checks the JAX checker flags on the same products and faults, and about
    as many as the tiny scorecard recorded (0.652 of its checks; binomial spread over 40
    checks, 0.08). A disagreement would make every paper-size figure suspect."""
    faults = A.attention_faults(_profile(1, "o_proj", TINY.k), 1)
    a, b = A.operands(TINY, np.random.default_rng(0))
    c, sums = a @ b, A.checksums(a, b)
    ours, theirs, landed = [], [], []
    for draw in range(40):
        bad, _, o, _ = A.faulty_product(a, b, c, sums, faults, np.random.default_rng(draw))
        ours.append(A.check(sums, bad, "paper")["flagged"])
        theirs.append(bool(_record(a, b, bad, "paper")[CK.FLAGGED]))
        landed.append(o)
    assert ours == theirs
    assert np.mean(landed) == pytest.approx(faults.o_rate * TINY.m * TINY.n, rel=0.35)
    assert abs(np.mean(ours) - 0.652) <= 3 * math.sqrt(0.652 * 0.348 / 40)


def test_rare_faults_are_drawn_given_one_and_weighed_by_its_probability():
    """A node with under one fault a check is drawn given one fault at least: every draw holds
    one or more, distinct and spread over the tensor, as many on average as the binomial given
    one (N p / (1 - (1 - p)^N)), and its checks are weighed by that probability. Were either
    wrong, the rare nodes' shares of flagged checks would be wrong by as much."""
    rng = np.random.default_rng(5)
    size, rate, draws = 10_000, 5e-5, 4000
    where = [A.draw_faults(rng, size, rate, (0.5, 1.0), at_least_one=True)[0]
             for _ in range(draws)]
    counts = np.array([len(w) for w in where])
    positions = np.concatenate(where)
    share = -math.expm1(size * math.log1p(-rate))
    assert counts.min() >= 1 and all(len(set(w)) == len(w) for w in where)
    assert positions.min() >= 0 and positions.max() < size
    assert abs(counts.mean() - size * rate / share) <= 4 * counts.std() / math.sqrt(draws)
    spread = size / math.sqrt(12 * len(positions))
    assert abs(positions.mean() - (size - 1) / 2) <= 4 * spread
    faults = A.AttentionFaults(4, rate, 0.0, (0.5, 1.0), 1.0)
    assert A.fault_share(faults, A.Shape("t", 100, 8, 100)) == pytest.approx(share, rel=1e-12)


def test_a_single_faults_ratio_falls_as_k_to_the_minus_1_5():
    """R = residual / threshold of one fault ~ k^-1.5 at fixed m and n (module docstring);
    the norms' maxima over rows, larger at small k, flatten the measured slope to about -1.44
    over k = 64-1024, so the slope must lie within 0.1 of -1.5, and R below the leading-order
    law by no more than the maxima allow (a factor 0.55 to 1)."""
    ks = (64, 256, 1024)
    shapes = [A.Shape(f"k {k}", 256, k, 256) for k in ks]
    ratios = [A.single_fault_ratio(s, np.random.default_rng(k), faults=32)
              for s, k in zip(shapes, ks)]
    slope = np.polyfit(np.log(ks), np.log(ratios), 1)[0]
    assert abs(slope + 1.5) <= 0.1, slope
    for shape, ratio in zip(shapes, ratios):
        assert 0.55 <= ratio / A.law_ratio(shape) <= 1.0


def test_faults_inside_the_attention_are_not_seen_by_the_o_check():
    """Node 11's faults put in the context (o's input) make a product consistent with its
    corrupted input: the o check flags none of them, while the same node's faults in o's
    product flag every check; if the inside placement flagged, the check or the
    recomputation of the rows would be wrong."""
    a, b = A.operands(TINY, np.random.default_rng(1))
    c, sums = a @ b, A.checksums(a, b)
    healthy = {rule: A.check(sums, c, rule)["flagged"] for rule in A.RULES}
    flags = {}
    for placement in ("inside", "o_proj"):
        faults = A.attention_faults(_profile(11, placement, TINY.k), 11)
        checks = [A.faulty_check(a, b, c, sums, faults, healthy, np.random.default_rng(d))
                  for d in range(8)]
        flags[placement] = [x["paper"] for x in checks]
        landed = sum(x["context"] + x["o"] for x in checks)
        assert landed >= 8 * 10
    assert not any(flags["inside"]) and all(flags["o_proj"])


def test_default_placement_keeps_todays_specs():
    """Without `attn_placement` every paper node's specs are the ones the recorded figures were
    made with: the fwd/attn faults at Table 1's rate over the pattern's mean, in the output
    projection, nothing in the context; bitwise the specs of an explicit `o_proj`."""
    for node in range(1, 16):
        default = P.paper_node(node)
        assert default == P.paper_node(node, "o_proj", context_width=64)
        assert all(s.site != P.CONTEXT_SITE for s in default.specs)
        freq = dict(zip(SITES, TABLE1_FREQUENCY.get(node, (0.0,) * 4)))["fwd/attn"]
        attn = [s for s in default.specs if s.site == "fwd/attn"]
        if freq:
            mean = P.PATTERNS.get(node, P.TimePattern()).mean_multiplier(P.PAPER_STEPS)
            assert [s.rate for s in attn] == [min(freq / mean, 1.0)]
        else:
            assert attn == []


def test_placement_moves_the_rate_and_keeps_the_mismatches():
    """`inside` moves node 10's fwd/attn rate into the context at rate / width, `split` keeps
    O_SHARE of it in o; the expected mismatching elements of o's product (each context fault
    moves a row of n) stay the same, and the other sites do not move."""
    width, n, m = 512, 4096, 4096
    base = {s.site: s for s in P.paper_node(10).specs}
    rate = base["fwd/attn"].rate
    for placement, share in (("inside", 0.0), ("split", P.O_SHARE)):
        specs = {s.site: s for s in P.paper_node(10, placement, context_width=width).specs}
        o_rate = specs["fwd/attn"].rate if "fwd/attn" in specs else 0.0
        assert o_rate == pytest.approx(rate * share, rel=1e-12)
        context = specs[P.CONTEXT_SITE].rate
        assert context == pytest.approx(rate * (1 - share) / width, rel=1e-12)
        assert (o_rate * m * n + context * m * width * n ==
                pytest.approx(rate * m * n, rel=1e-12))
        for site in ("fwd/ffn", "bwd/attn", "bwd/ffn"):
            assert specs[site] == base[site]


def test_placement_errors_are_one_sentence():
    """A bad placement, or one that needs the context's width without it, is a UserError the
    CLI prints as one line."""
    with pytest.raises(UserError, match="attn_placement must be one of"):
        P.paper_node(1, "qk")
    with pytest.raises(UserError, match="context_width"):
        P.paper_node(1, "inside")


def test_rows_judge_per_check_shares_against_appendix_d():
    """Node 14 must flag at least 10% of its checks, every other node at most 1%; a node with
    no attention fault proves nothing ("no events"); anchors and other placements are left
    out. A wrong band would misjudge Figure 10 at the paper's sizes."""
    base = {"shape": "paper tp 8", "m": 4096, "k": 512, "n": 4096, "placement": "o_proj",
            "checks": 16, "active": 1.0, "o_faults": 3.0, "context_faults": 0.0,
            "single_fault_ratio": 0.24, "flagged_active_paper": 0.0, "flagged_paper": 0.0}
    entries = [dict(base, node=14), dict(base, node=1, flagged_paper=0.5),
               dict(base, node=4, flagged_paper=0.005), dict(base, node=2, o_faults=0.0),
               dict(base, node=1, shape="tiny"), dict(base, node=1, placement="inside"),
               dict(base, node=0)]
    rows = A.figure10_paper_rows(entries)
    assert [(r.node, r.verdict) for r in rows] == [(14, "fail"), (1, "fail"), (4, "pass"),
                                                   (2, "no events")]
    assert all(r.source == "Figure 10" and "tp 8" in r.quantity for r in rows)
    assert dataclasses.asdict(rows[0])["published"] == "frequently"


def test_a_shape_measured_again_alone_keeps_its_draws():
    """`measure(..., first_index=s)` on shape s alone gives bitwise the entries that shape has in
    its series (and not those of index 0), and more draws give as many more checks: the draws'
    seeds are (seed, shape index, product, node, placement, draw), so the first ones are the
    same. If this failed, a row measured again with more draws (`figure10_entries.decide`)
    would not extend the committed draws."""
    shapes = [A.Shape("one", 256, 32, 64), A.Shape("two", 256, 64, 64)]
    series = A.measure(_profile, shapes, [9], draws=2)
    alone = A.measure(_profile, shapes[1:], [9], draws=2, first_index=1)
    assert alone == [e for e in series if e["shape"] == "two"]
    assert A.measure(_profile, shapes[1:], [9], draws=2) != alone  # the index seeds the draws
    more = A.measure(_profile, shapes[1:], [9], draws=4, first_index=1)
    assert more[1]["checks"] == 2 * alone[1]["checks"]


def test_decide_measures_an_undecided_row_again_until_its_draws_decide(monkeypatch):
    """`figure10_entries.decide`: an undecided paper-size row is measured again alone (its own
    shape index, o's placement), first with the draws `draws_to_decide` asks at its analytic
    rate, then twice as many, until decided or over the cap; decided rows, healthy entries and
    other placements stay as they were. Here the analytic rate a draw is 0.2 against a 0.1 edge
    (node 4, fault share 0.1): 2 of 16 is undecided; the fake flags 13% of any count of draws,
    which the first re-measurement does not decide."""
    from sdcstudy.dev import figure10_entries as FE
    from sdcstudy.reproduce import figure10_paper as F10

    def entry(node, flagged, checks, placement="o_proj", shape="paper tp 8"):
        return {"shape": shape, "m": 4096, "k": 512, "n": 4096, "node": node,
                "placement": placement, "checks": checks, "active": 1.0,
                "fault_share": 0.1, "o_faults": 0.1, "context_faults": 0.0,
                "single_fault_ratio": 0.24, "sparse_prediction": 0.02,
                "flagged_active_paper": 0.1 * flagged / checks,
                "flagged_paper": 0.1 * flagged / checks}

    calls = []

    def fake_measure(profile_of, shapes, nodes, placements, products, draws, seed,
                     first_index=0):
        calls.append((shapes[0].name, nodes, placements, products, draws, first_index))
        checks = products * draws
        return [entry(0, 0, products), entry(nodes[0], round(0.13 * checks), checks)]

    monkeypatch.setattr(A, "measure", fake_measure)
    undecided = entry(4, 2, 16)
    assert not F10.decided(undecided)
    found = [entry(0, 0, 2), undecided, entry(4, 2, 16, placement="split"),
             entry(6, 16, 16)]
    said = []
    out = FE.decide(found, products=2, seed=0, cap=4096, say=said.append)
    assert out[0] is found[0] and out[2] is found[2] and out[3] is found[3]
    assert F10.decided(out[1]) and out[1]["checks"] > 16
    needed = F10.draws_to_decide(0.2, F10.edge_probability(undecided))
    assert calls[0] == ("paper tp 8", [4], ("o_proj",), 2, math.ceil(1.2 * needed / 2), 1)
    assert len(calls) > 1 and all(c[4] == 2 * p[4] for p, c in zip(calls, calls[1:]))
    assert len(said) == len(calls) and "decided" in said[-1]
    capped = FE.decide(found, products=2, seed=0, cap=20, say=said.append)
    assert capped[1] is undecided  # a cap below the first re-measurement leaves the row
