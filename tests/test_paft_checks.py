"""PAFT settings that cannot work end in one sentence naming the key (sdcstudy/paft/checks.py).

If a case here fails, `check_config` lets a setting through that the step can not run (or
refuses one it can), or its sentence no longer names the key the user has to change.
"""

import pytest

from sdcstudy.core import config as C
from sdcstudy.core.config import UserError
from sdcstudy.paft.checks import check_config

GOOD = ["experiment.mode=paft", "mesh.dp=4", "paft.noise.sigma2=1e-3", "paft.sync_every=4"]


def test_a_working_setup_passes():
    check_config(C.from_dict({}, GOOD))
    check_config(C.from_dict({}, GOOD + ["paft.loss.p=0.2", "paft.loss.burst=4",
                                         "paft.loss.param_p=0.1", "paft.dynamic=true"]))


@pytest.mark.parametrize("override, sentence", [
    ("mesh.dp=1", "paft mode needs at least 2 workers (mesh.dp), not 1."),
    ("mesh.tp=2", "paft mode runs data-parallel workers only; set mesh.tp=1."),
    ("paft.noise.sigma2=-1", "paft.noise.sigma2 must be non-negative."),
    ("paft.noise.large_sigma2=-1", "paft.noise.large_sigma2 must be non-negative."),
    ("paft.noise.large_every=-1", "paft.noise.large_every must be non-negative."),
    ("paft.sync_every=-1", "paft.sync_every must be non-negative."),
    ("paft.div_every=-1", "paft.div_every must be non-negative."),
    ("paft.h_min=0", "paft.h_min must be at least 1."),
    ("paft.h_max=0", "paft.h_max must be at least paft.h_min."),
    ("paft.loss.p=1", "paft.loss.p must be in [0, 1)."),
    ("paft.loss.param_p=-0.1", "paft.loss.param_p must be in [0, 1) or null."),
    ("paft.loss.packet_size=0", "paft.loss.packet_size must be at least 1."),
    ("paft.loss.burst=0.5", "paft.loss.burst must be 0 (independent drops) or a mean run "
                            "length of at least 1 packet."),
    ("paft.loss.aggregate=mean", "paft.loss.aggregate 'mean' is not one of renormalized, "
                                 "zero, stale."),
])
def test_each_impossible_setting_is_one_sentence(override, sentence):
    with pytest.raises(UserError) as error:
        check_config(C.from_dict({}, GOOD + [override]))
    assert str(error.value) == sentence


# --- collectives in conditionals ---------------------------------------------------------------

COLLECTIVES = {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "ppermute", "all_to_all",
               "psum_scatter"}


def _sub_jaxprs(eqn):
    from jax.extend import core as jcore

    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jcore.Jaxpr):
                yield v


def _holds_collective(eqn) -> bool:
    return eqn.primitive.name in COLLECTIVES or any(
        _holds_collective(e) for j in _sub_jaxprs(eqn) for e in j.eqns)


def _unordered(overrides) -> dict[int, list[int]]:
    """{conditional: the collectives it has no data path to or from}, over the equations of
    the PAFT step's `shard_map` body, traced from abstract values (nothing compiled)."""
    import jax
    import numpy as np
    from jax.extend import core as jcore

    from sdcstudy.paft.trainer import PaftTrainer

    trainer = PaftTrainer.from_config(C.from_dict({}, GOOD + ["model.n_layers=1"] + overrides))
    state = jax.eval_shape(trainer.init_state)
    batch = trainer.make_batch(np.zeros((1, 8, 33), np.int32))
    outer = jax.make_jaxpr(trainer.train_step)(state, batch).jaxpr
    body = next(_sub_jaxprs(next(e for e in outer.eqns if e.primitive.name == "shard_map")))
    made_by = {v: i for i, e in enumerate(body.eqns) for v in e.outvars}

    def ancestors(i):
        seen, todo = set(), [i]
        while todo:
            for v in body.eqns[todo.pop()].invars:
                j = made_by.get(v) if isinstance(v, jcore.Var) else None
                if j is not None and j not in seen:
                    seen.add(j)
                    todo.append(j)
        return seen

    collective = [i for i, e in enumerate(body.eqns) if _holds_collective(e)]
    return {c: [i for i in collective if i != c and i not in ancestors(c)
                and c not in ancestors(i)]
            for c in collective if body.eqns[c].primitive.name == "cond"}


LOSSY = ["paft.loss.p=0.3", "paft.sync_every=2"]


@pytest.mark.parametrize("overrides", [
    ["paft.loss.p=0.3", "paft.loss.aggregate=stale", "paft.sync_every=0"],
    LOSSY + ["paft.overlap=false"],
    LOSSY + ["paft.overlap=true", "paft.loss.param_p=0.1", "paft.loss.aggregate=stale"],
    ["paft.sync_every=2", "paft.overlap=false"],
], ids=["stale", "lossy-averages", "lossy-overlap-broadcast", "exact-averages"])
def test_every_conditional_with_collectives_is_ordered_by_data(overrides):
    """A program loaded from JAX's compilation cache loses XLA:CPU's order between the
    collectives inside a conditional and those outside it, and crashed when they could run in
    either order (docs/developing.md, "A crash in programs loaded from the compilation
    cache"). Every conditional of the PAFT step that holds collectives (an average, the
    divergence) must therefore come before or after each other collective by a data path. If
    this fails, one of them is free to meet another collective's rendezvous."""
    unordered = _unordered(overrides)
    assert unordered and all(found == [] for found in unordered.values()), unordered


def test_the_exact_overlapped_average_leaves_the_order_to_xla():
    # The overlapped average's divergence rides in the gradients' all-reduce (one all-reduce
    # more than data parallel, not two), whose other operands do not wait for it: XLA combines
    # them into one all-reduce, which does (docs/developing.md). This pins that exception.
    unordered = _unordered(["paft.sync_every=2", "paft.overlap=true"])
    (average, others), (divergence, none) = sorted(unordered.items())
    assert others and none == []


def test_after_gives_the_predicate_back_for_every_value_it_reads():
    # The data edge must not change what the conditional decides: for NaN, infinities and
    # zeros alike, and it refuses arrays it cannot read so (an integer's x == x folds away).
    import jax.numpy as jnp

    from sdcstudy.core import mesh as M

    values = jnp.asarray([jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0, 1.5], jnp.float32)
    for pred in (True, False):
        for x in values:
            assert bool(M.after(jnp.bool_(pred), {"a": x, "b": values})) is pred
    with pytest.raises(TypeError, match="float arrays"):
        M.after(jnp.bool_(True), jnp.int32(3))
