"""What docs/faults.md (section 8, and section 3's "Shared draws") promises a researcher who
writes or runs a profile, held where no other module holds it: a file's default name, what
keys a draw (the spec's position, not the profile), when a time pattern is on and at what rate,
which node and which tp ranks a spec strikes, and how many elements a `count` hits.

If a test here fails, a profile does something other than the page says: a burst that is on
at one layer and off at another, a spec whose rate past 1 injects nothing, a `tp_ranks` that
splits a replicated gradient leaf between the ranks, or two profiles said to share their draws
that do not. Each test compiles at most one small program (a hook on a 16 x 16 tensor, a
gradient site on two CPU devices) or none.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sdcstudy.core import mesh as M
from sdcstudy.core import sites as S
from sdcstudy.core.step import Where
from sdcstudy.faults import corrupt as FC
from sdcstudy.faults import inject as F
from sdcstudy.faults import profiles
from sdcstudy.faults.feature import Faults
from sdcstudy.faults.published import SITES, TABLE1_FREQUENCY
from sdcstudy.faults.specs import FaultSpec, Profile, pattern_multiplier
from sdcstudy.faults.time_patterns import TimePattern

X = jnp.arange(1, 257, dtype=jnp.float32).reshape(16, 16)  # no zeros: a `zero` hit always lands


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def test_a_profile_file_without_a_name_is_named_by_its_path(tmp_path):
    """Section 8: `name` defaults to the file's path (what faults.parquet's runs and the
    report call it), `description` to nothing."""
    path = tmp_path / "stuck.yaml"
    path.write_text("specs:\n  - {site: fwd/ffn, kind: zero, rate: 1.0, lanes: [3]}\n")
    profile = profiles.load(str(path))
    assert profile.name == str(path) and profile.description == ""


def _grad_faults(*profiles_: Profile) -> list[np.ndarray]:
    """The bits of a 32 x 32 gradient leaf after each profile's `grad` specs, at one run key
    (one program for them all)."""
    grads = {"w": jax.random.normal(jax.random.key(0), (32, 32), jnp.float32)}

    def corrupted(key):
        ctx = F.FaultContext(key, jnp.int32(1), jnp.int32(-1))
        return [F.Injector(p, n_layers=1).corrupt_tree(grads, ctx, "grad")["w"]
                for p in profiles_]

    return [_bits(w) for w in jax.jit(corrupted)(jax.random.key(5))] + [_bits(grads["w"])]


def test_a_draw_is_keyed_by_the_specs_position_not_its_profile():
    """Section 3: a draw is keyed by the spec's position in its profile, not the profile's
    name. Nodes 1 and 14 have the same weight-gradient spec, but at positions 4 and 3 (node
    14 has no fwd/ffn spec), so they draw other faults; moved to node 1's position, node 14's
    draws node 1's, bit for bit."""
    one, fourteen = profiles.load("paper-node-1"), profiles.load("paper-node-14")
    (i,) = [k for k, s in enumerate(one.specs) if s.site == "grad"]
    (j,) = [k for k, s in enumerate(fourteen.specs) if s.site == "grad"]
    assert one.specs[i] == fourteen.specs[j] and (i, j) == (4, 3)
    moved = fourteen.specs[:j] + (fourteen.specs[0],) + fourteen.specs[j:]  # grad now at 4
    node_1, node_14, node_14_moved, clean = _grad_faults(
        one, fourteen, Profile("paper-node-14", moved))
    assert (node_1 != clean).any()
    assert not np.array_equal(node_14, node_1)
    assert np.array_equal(node_14_moved, node_1)


def test_time_patterns_multiply_the_rate_as_the_table_says():
    """Section 8's table of multipliers, at steps 1 to 12, traced (as the step draws) and as
    the scorer reads them (`TimePattern.expected_multipliers`)."""
    steps = np.arange(1, 13)
    table = [
        (TimePattern(), np.ones(12)),
        (TimePattern("steps", steps=(2, 5)), np.isin(steps, (2, 5)).astype(float)),
        (TimePattern("steps", steps=()), np.zeros(12)),  # `[]`: never
        (TimePattern("onset", onset_step=4), (steps >= 4).astype(float)),
        (TimePattern("decay", amplitude=4.0, decay_steps=2.0), 1 + 4 * np.exp(-(steps - 1) / 2)),
        (TimePattern("periodic", period=3, amplitude=5.0), np.where(steps % 3 == 0, 5.0, 1.0)),
    ]
    for pattern, want in table:
        traced = [float(pattern_multiplier(pattern, jnp.int32(s), None)) for s in steps]
        np.testing.assert_allclose(traced, want, rtol=1e-6, err_msg=pattern.kind)
        np.testing.assert_allclose(pattern.expected_multipliers(12), want, rtol=1e-12)



def test_the_zoos_time_patterns_are_section_4s():
    """Section 4 in numbers: nodes 7 and 14 in bursts on 1 step in 20 and in 4,000, at Table
    1's rate divided by the odds; nodes 10 and 11 from 11x their base rate, decaying over 20
    steps; node 13 clean before step 450; node 14's weight-gradient spec constant, node 13's
    with the onset; node 3's weight-gradient spec a flip of the lowest mantissa bit."""
    zoo = profiles.zoo()
    for node, p_active in ((7, 0.05), (14, 1 / 4000)):
        for spec in zoo[f"paper-node-{node}"].specs:
            if spec.site == "grad":
                continue
            assert spec.pattern == TimePattern("burst", p_active=p_active)
            table_1 = TABLE1_FREQUENCY[node][SITES.index(spec.site)]
            assert spec.rate == pytest.approx(table_1 / p_active, rel=1e-12)
    for node in (10, 11):
        patterns = {s.pattern for s in zoo[f"paper-node-{node}"].specs}
        assert patterns == {TimePattern("decay", amplitude=10.0, decay_steps=20.0)}
    assert {s.pattern for s in zoo["paper-node-13"].specs} == {TimePattern("onset", onset_step=450)}
    grad = {n: next(s for s in zoo[f"paper-node-{n}"].specs if s.site == "grad") for n in (3, 14)}
    assert grad[14].pattern == TimePattern()
    assert (grad[3].kind, grad[3].bits, grad[3].rate) == ("bitflip", (0,), 1e-9)

BURST = TimePattern("burst", p_active=0.5)


@jax.jit
def _burst_hits(step):
    """Whether each of two burst specs (fwd/attn, fwd/ffn) hit X, at layers 1 and 2 of
    microsteps 0 and 1 of `step`: (spec, microstep x layer)."""
    profile = Profile("bursts", (FaultSpec("fwd/attn", "zero", rate=1.0, pattern=BURST),
                                 FaultSpec("fwd/ffn", "zero", rate=1.0, pattern=BURST)))
    injector = F.Injector(profile, n_layers=2)
    hits = []
    for site in (S.ATTN_OUT, S.FFN_OUT):
        for microstep in (0, 1):
            hook = injector.hook(F.FaultContext(jax.random.key(0), step, jnp.int32(microstep)))
            hits += [jnp.any(hook(site, X, layer) != X) for layer in (1, 2)]
    return jnp.stack(hits).reshape(2, 4)


def test_a_burst_is_drawn_once_per_step_and_spec():
    """Section 8: a burst is on or off for the whole step, alike at every layer and
    microstep, and each spec draws its own (node 7's four sites are on at independent
    steps)."""
    on = np.asarray([_burst_hits(jnp.int32(s)) for s in range(1, 41)])  # (step, spec, unit)
    assert (on.min(axis=-1) == on.max(axis=-1)).all()  # alike at every layer and microstep
    attn, ffn = on[:, 0, 0], on[:, 1, 0]
    assert 0 < attn.sum() < 40 and 0 < ffn.sum() < 40
    assert not np.array_equal(attn, ffn)


@jax.jit
def _sites_at(step):
    """X after a decaying spec (rate 0.5, 11x at step 1) and two specs of nodes 0 and 1
    (other sites), in a single-node mode's context (no node) and on nodes 0 and 1 of a pair:
    (context, site) -> the hit elements."""
    profile = Profile("p", (
        FaultSpec("fwd/attn", "bitflip", rate=0.5, bits=(23,),
                  pattern=TimePattern("decay", amplitude=10.0, decay_steps=20.0)),
        FaultSpec("fwd/ffn", "zero", rate=1.0, node=0),
        FaultSpec("fwd/logits", "zero", rate=1.0, node=1)))
    faults = Faults(F.Injector(profile, n_layers=1))
    hits = []
    for node in (None, jnp.int32(0), jnp.int32(1)):
        hook = faults.injector.hook(faults.context(Where(jax.random.key(1), step, jnp.int32(0),
                                                         node=node)))
        hits.append(jnp.stack([hook(S.ATTN_OUT, X, 1) != X, hook(S.FFN_OUT, X, 1) != X,
                               hook(S.LOGITS, X, 0) != X]))
    return jnp.stack(hits)


def test_the_rate_applied_is_capped_at_1():
    """min(1, rate x multiplier): rate 0.5 at 11x hits every element at step 1 (uncapped, a
    rate of 5.5 has no Bernoulli draw and hit none), and about half of them at step 200."""
    first, late = (np.asarray(_sites_at(jnp.int32(s)))[0, 0] for s in (1, 200))
    assert first.all()
    assert abs(late.mean() - 0.5) < 5 * math.sqrt(0.25 / late.size)


def test_node_picks_the_node_of_a_pair_and_a_single_node_takes_every_spec():
    """`node`: a paired run's node 0 gets the node-0 specs, node 1 the node-1 specs; a
    single-node mode (no node in its context) applies every spec to its one node."""
    hit = np.asarray(_sites_at(jnp.int32(1)))
    for context, struck in enumerate([(True, True), (True, False), (False, True)]):
        assert (hit[context, 1].all(), hit[context, 2].all()) == struck
        assert (hit[context, 1].any(), hit[context, 2].any()) == struck


def test_a_count_past_the_tensors_size_hits_every_element():
    """`count`: exactly this many distinct elements, all of them where the tensor has fewer."""
    spec = FaultSpec("fwd/ffn", "zero", count=10)
    small = jnp.arange(1, 7, dtype=jnp.float32).reshape(2, 3)
    landed = jax.jit(lambda key: [FC.corrupt(x, key, spec, 1.0)[1].sum() for x in (small, X)])
    assert [int(n) for n in landed(jax.random.key(2))] == [6, 10]



def test_a_random_hit_is_a_normal_draw_of_value_std():
    """`value_std`: a `random` hit is replaced by a draw of N(0, value_std^2), whatever the
    element held (the mean and spread of 4,096 draws within 5 standard errors)."""
    spec = FaultSpec("fwd/ffn", "random", rate=1.0, value_std=3.0)
    x = jnp.full((64, 64), 1000.0, jnp.float32)
    values = np.asarray(jax.jit(lambda key: FC.corrupt(x, key, spec, 1.0)[0])(
        jax.random.key(4)), np.float64).ravel()
    n = values.size
    assert abs(values.mean()) < 5 * 3.0 / math.sqrt(n)
    assert abs(values.std() - 3.0) < 5 * 3.0 / math.sqrt(2 * n)

def test_tp_ranks_strike_a_sharded_leaf_on_those_ranks_and_a_replicated_one_on_every_rank():
    """Section 8: `tp_ranks` picks the ranks of a gradient leaf split over tp; a leaf every
    rank holds alike is corrupted on every rank, alike, whatever `tp_ranks` says (corrupted
    on one rank only, the replicas of a parameter would part)."""
    spec = FaultSpec("grad", "bitflip", rate=0.25, bits=(23,), tp_ranks=(1,))
    injector = F.Injector(Profile("p", (spec,)), n_layers=1)

    def local(replicated, split):
        ctx = F.FaultContext(jax.random.key(3), jnp.int32(1), jnp.int32(-1), tp_axis=M.TP)
        out = injector.corrupt_tree({"replicated": replicated, "split": split}, ctx, "grad")
        return M.vary(out["replicated"], (M.TP,))[None], out["split"]

    mesh = M.make_mesh(1, 1, 2)
    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(M.TP)),
                                out_specs=(P(M.TP), P(M.TP)), check_vma=True))
    replicated, split = (jax.random.normal(jax.random.key(k), (8, 8)) for k in (6, 7))
    copies, corrupted = jax.device_get(run(replicated, split))
    assert np.array_equal(_bits(copies[0]), _bits(copies[1]))  # alike on both ranks
    assert (_bits(copies[0]) != _bits(replicated)).any()
    changed = _bits(corrupted) != _bits(split)
    assert not changed[:4].any() and changed[4:].any()  # rank 0's half untouched

