"""The fault-injection engine: kinds, bits, rates, replay, profiles, and placement on a mesh."""

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from sdcstudy.core import config as C
from sdcstudy.faults import specs as FS
from sdcstudy.faults import inject as F
from sdcstudy.faults.feature import Faults
from sdcstudy.faults import corrupt as FC
from sdcstudy.faults import draws as FD
from sdcstudy.faults import bits as FB
from sdcstudy.faults import records as FR
from sdcstudy.core import mesh as M
from sdcstudy.core import model
from sdcstudy.faults import profiles
from sdcstudy.core import sites as S
from sdcstudy.faults.trainer import NodeTrainer
from sdcstudy.core.config import UserError
from sdcstudy.core.digest import path_name

DTYPES = [jnp.float32, jnp.bfloat16]
UINT = {jnp.float32: np.uint32, jnp.bfloat16: np.uint16}


def _x(dtype, shape=(200, 500), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _bits(a, dtype):
    return np.asarray(jax.device_get(FB.to_bits(a))).astype(np.uint64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_counts_follow_the_rate_within_binomial_bounds(dtype):
    # 10 independent draws at rate 1e-3 over 1e5 elements: each count within 5 standard
    # deviations of n p, and their total within 4 (a biased sampler fails the total).
    x, rate = _x(dtype), 1e-3
    spec = FS.FaultSpec("fwd/attn", "bitflip", rate=rate, bit_class="mantissa")
    n = x.size
    counts = [int(FC.corrupt(x, jax.random.key(s), spec, rate)[1].sum()) for s in range(10)]
    sd = math.sqrt(n * rate * (1 - rate))
    assert all(abs(c - n * rate) < 5 * sd for c in counts), counts
    assert abs(sum(counts) - 10 * n * rate) < 4 * math.sqrt(10) * sd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bit", [0, 6, 7, 14, 15, 22, 30, 31])
def test_the_flipped_bit_is_exactly_the_configured_one(dtype, bit):
    width = FB.bit_width(dtype)
    if bit >= width:
        pytest.skip("no such bit in this dtype")
    x = _x(dtype)
    spec = FS.FaultSpec("fwd/attn", "bitflip", rate=0.01, bits=(bit,))
    y, landed, got_bit = FC.corrupt(x, jax.random.key(1), spec, 0.01)
    diff = _bits(x, dtype) ^ _bits(y, dtype)
    landed = np.asarray(landed)
    assert landed.sum() > 0
    assert np.all(diff[landed] == (1 << bit)) and np.all(diff[~landed] == 0)
    assert np.all(np.asarray(got_bit)[landed] == bit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bit_class", ["sign", "exponent", "mantissa"])
def test_bit_classes_stay_in_their_field(dtype, bit_class):
    width = FB.bit_width(dtype)
    allowed = set(FB.bits_of_class(bit_class, width))
    expected = {32: {"sign": {31}, "exponent": set(range(23, 31)), "mantissa": set(range(23))},
                16: {"sign": {15}, "exponent": set(range(7, 15)), "mantissa": set(range(7))}}
    assert allowed == expected[width][bit_class]
    x = _x(dtype)
    spec = FS.FaultSpec("fwd/attn", "bitflip", rate=0.05, bit_class=bit_class)
    y, landed, _ = FC.corrupt(x, jax.random.key(2), spec, 0.05)
    diff = (_bits(x, dtype) ^ _bits(y, dtype))[np.asarray(landed)]
    positions = {int(math.log2(int(d))) for d in diff}
    assert positions <= allowed and len(positions) == len(allowed)  # every allowed bit is used


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_kinds(dtype):
    x = _x(dtype)
    key = jax.random.key(3)
    lo, hi = 0.5, 8.0
    y, landed, _ = FC.corrupt(x, key,
                             FS.FaultSpec("fwd/ffn", "scale", rate=0.02, scale=(lo, hi)), 0.02)
    landed = np.asarray(landed)
    xf, yf = np.asarray(x, np.float64)[landed], np.asarray(y, np.float64)[landed]
    rel = np.abs(yf - xf) / np.abs(xf)
    ulp = 2.0 ** (-8 if dtype == jnp.bfloat16 else -24)  # rounding of the scaled value
    assert np.all(rel >= lo * (1 - 4 * ulp) - 2 * ulp) and np.all(rel <= hi * (1 + 4 * ulp))
    for kind, check in (("zero", lambda v: v == 0), ("nan", np.isnan), ("inf", np.isinf)):
        y, landed, _ = FC.corrupt(x, key, FS.FaultSpec("fwd/ffn", kind, rate=0.02), 0.02)
        assert np.asarray(landed).sum() > 0
        assert np.all(check(np.asarray(y, np.float32)[np.asarray(landed)]))


def test_count_and_lanes():
    x = _x(jnp.float32, (4, 8, 16))
    y, landed, _ = FC.corrupt(x, jax.random.key(4), FS.FaultSpec("fwd/ffn", count=3), 1.0)
    assert int(landed.sum()) == 3
    y, landed, _ = FC.corrupt(x, jax.random.key(4), FS.FaultSpec("fwd/ffn", count=3), 0.0)
    assert int(landed.sum()) == 0  # a count spec is off when its pattern is off
    y, landed, _ = FC.corrupt(x, jax.random.key(5),
                             FS.FaultSpec("fwd/ffn", "zero", rate=1.0, lanes=(3,)), 1.0)
    lanes = np.nonzero(np.asarray(landed))[-1]
    assert set(lanes.tolist()) == {3} and landed.sum() == 4 * 8
    assert np.all(np.asarray(y)[..., 3] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_records_match_the_corruption_exactly(dtype):
    x = _x(dtype)
    spec = FS.FaultSpec("fwd/attn", "bitflip", rate=2e-4, bit_class="any")
    y, landed, bit = FC.corrupt(x, jax.random.key(6), spec, 2e-4)
    count, rows = FR.decode_record(np.asarray(FR.make_record(x, y, landed, bit, 100)))
    flat_x, flat_y = np.asarray(x, np.float32).ravel(), np.asarray(y, np.float32).ravel()
    changed = np.nonzero(_bits(x, dtype).ravel() != _bits(y, dtype).ravel())[0]
    assert count == len(changed) == len(rows) > 0
    assert [r["flat_index"] for r in rows] == changed.tolist()
    for r in rows:
        assert r["original"] == flat_x[r["flat_index"]] or np.isnan(r["original"])
        same = r["corrupted"] == flat_y[r["flat_index"]]
        assert same or (np.isnan(r["corrupted"]) and np.isnan(flat_y[r["flat_index"]]))
    # More corruptions than the record holds: all counted, the first `limit` logged.
    count, rows = FR.decode_record(np.asarray(FR.make_record(x, y, landed, bit, 5)))
    assert count == len(changed) and len(rows) == 5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [
    FS.FaultSpec("fwd/attn", "additive", rate=1e-3, scale=(2.0 ** -8, 1.0)),
    FS.FaultSpec("fwd/attn", "bitflip", rate=0.3),  # past the cap: the rest drawn densely
    FS.FaultSpec("fwd/attn", "zero", rate=0.01, lanes=(3, 7)),
    FS.FaultSpec("fwd/attn", "bitflip", count=5, bits=(2,)),
], ids=["sparse", "dense", "lanes", "count"])
def test_records_of_the_listed_hits_equal_a_search_of_the_whole_tensor(dtype, spec):
    """A model site searches only the positions its draw lists for landed elements (and the
    whole tensor when the draw went past its cap); the record must be bit for bit the one a
    search of the whole tensor gives, as the pytree sites make it. If this fails, a record
    lists other elements, or counts differently, than the corruption applied."""
    x = _x(dtype)
    key_data = jax.random.key_data(jax.random.key(8))
    listed = FC.corrupt_and_record(x, key_data, spec.base_rate, spec, 16, skip_idle=True)
    searched = FC.corrupt_and_record(x, key_data, spec.base_rate, spec, 16)
    (y, record), (y_all, record_all) = jax.device_get((listed, searched))
    assert _bits(y, dtype).tobytes() == _bits(y_all, dtype).tobytes()
    assert np.asarray(record).tobytes() == np.asarray(record_all).tobytes()
    assert FR.decode_record(np.asarray(record))[0] > 0


@functools.lru_cache(maxsize=None)
def _site(profile, fault_seed=None):
    """The profile's forward hook at layer 1's attn_out, jitted as a step runs it: one
    program per profile (and suspect.fault_seed), the key, step, microstep and tensor its
    inputs."""
    injector = F.Injector(profile, n_layers=2, seed=fault_seed)

    def site(key, step, microstep, x):
        return injector.hook(F.FaultContext(key, step, microstep))(S.ATTN_OUT, x, 1)

    return jax.jit(site)


def _inject(profile, seed, step=1, microstep=0, x=None, fault_seed=None):
    x = _x(jnp.float32, (64, 64)) if x is None else x
    return np.asarray(_site(profile, fault_seed)(jax.random.key(seed), jnp.int32(step),
                                                 jnp.int32(microstep), x))


def test_same_seed_replays_other_seed_differs():
    profile = FS.Profile("p", (FS.FaultSpec("fwd/attn", "bitflip", rate=1e-2),))
    a, b, c = _inject(profile, 0), _inject(profile, 0), _inject(profile, 1)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert not np.array_equal(a.view(np.uint32), c.view(np.uint32))
    # Another step or microstep draws other faults.
    assert not np.array_equal(a.view(np.uint32), _inject(profile, 0, step=2).view(np.uint32))
    assert not np.array_equal(a.view(np.uint32),
                              _inject(profile, 0, microstep=1).view(np.uint32))


def test_fault_seed_draws_other_faults_and_replays_its_own():
    """suspect.fault_seed: the same run seed with another fault seed draws other faults, the
    same fault seed the same ones; two profiles with the same spec draw the same faults
    unless their fault seeds differ."""
    spec = FS.FaultSpec("fwd/attn", "bitflip", rate=1e-2)
    one, other = FS.Profile("one", (spec,)), FS.Profile("other", (spec,))
    plain = _inject(one, 0)
    assert np.array_equal(plain.view(np.uint32), _inject(other, 0).view(np.uint32))
    seeded = _inject(one, 0, fault_seed=3)
    assert not np.array_equal(plain.view(np.uint32), seeded.view(np.uint32))
    assert np.array_equal(seeded.view(np.uint32),
                          _inject(other, 0, fault_seed=3).view(np.uint32))
    assert not np.array_equal(seeded.view(np.uint32),
                              _inject(other, 0, fault_seed=4).view(np.uint32))


def test_repeatable_faults_depend_on_the_input_not_the_step():
    profile = FS.Profile("p", (FS.FaultSpec("fwd/attn", "bitflip", rate=1e-2, repeatable=True),))
    # Compared as bits: a flipped exponent bit may make a NaN, which no float equals.
    a, b = _inject(profile, 0, step=1), _inject(profile, 0, step=7, microstep=1)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    other = _inject(profile, 0, x=_x(jnp.float32, (64, 64), seed=9))
    clean = np.asarray(_x(jnp.float32, (64, 64), seed=9))
    hit_here = np.nonzero(a.view(np.uint32) != np.asarray(_x(jnp.float32, (64, 64))).view(
        np.uint32))
    hit_there = np.nonzero(other.view(np.uint32) != clean.view(np.uint32))
    assert not np.array_equal(hit_there, hit_here)


@pytest.mark.parametrize("pattern, active_steps", [
    (FS.TimePattern("onset", onset_step=3), [3, 4, 5]),
    (FS.TimePattern("steps", steps=(2, 5)), [2, 5]),
    (FS.TimePattern("periodic", period=2, amplitude=0.0), [1, 3, 5]),
])
def test_time_patterns(pattern, active_steps):
    profile = FS.Profile("p", (FS.FaultSpec("fwd/attn", "bitflip", rate=1e-2, pattern=pattern),))
    clean = np.asarray(_x(jnp.float32, (64, 64)))
    hit = [s for s in range(1, 6) if not np.array_equal(_inject(profile, 0, step=s), clean)]
    assert hit == active_steps


def test_burst_and_decay_multipliers():
    burst = FS.TimePattern("burst", p_active=0.25)
    active = [float(FS.pattern_multiplier(burst, s, jax.random.key(s))) for s in range(400)]
    assert set(active) == {0.0, 1.0} and abs(np.mean(active) - 0.25) < 5 * math.sqrt(.25 * .75 / 400)
    decay = FS.TimePattern("decay", amplitude=10.0, decay_steps=20.0)
    assert float(FS.pattern_multiplier(decay, 1, None)) == pytest.approx(11.0)
    assert float(FS.pattern_multiplier(decay, 201, None)) == pytest.approx(1 + 10 * math.exp(-10),
                                                                       rel=1e-5)
    assert decay.mean_multiplier(4500) == pytest.approx(1 + 10 * 20 / 4500, rel=0.01)


def test_zoo_numbers_come_from_the_paper():
    zoo = profiles.zoo()
    assert {f"paper-node-{i}" for i in range(1, 16)} <= set(zoo)
    assert {"healthy", "exponent-flip", "mantissa-noise", "stuck-lane", "nan-burst",
            "repeatable"} <= set(zoo)
    # Node 1, fwd/attn: Table 1 frequency 1.55e-5 (constant), accumulator errors of 2^-8 to 1
    # times the row's RMS (docs/faults.md).
    spec = next(s for s in zoo["paper-node-1"].specs if s.site == "fwd/attn")
    assert spec.rate == 1.55e-5 and spec.kind == "additive" and spec.scale == (2 ** -8, 1.0)
    # Node 11 decays from a spike: its base rate times the run-mean multiplier is Table 1's.
    spec = next(s for s in zoo["paper-node-11"].specs if s.site == "fwd/attn")
    assert spec.rate * spec.pattern.mean_multiplier(4500) == pytest.approx(2.89e-2)
    assert zoo["paper-node-13"].specs[0].pattern.onset_step == 450
    assert zoo["healthy"].healthy and not zoo["paper-node-2"].healthy


def test_yaml_profile_loads_and_errors_name_the_field(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("name: mine\ndescription: test\nspecs:\n"
                    "  - {site: bwd/ffn, kind: bitflip, rate: 1.0e-4, bits: [30], layers: [2],\n"
                    "     pattern: {kind: steps, steps: [3]}}\n")
    profile = profiles.load(str(good))
    assert profile.specs[0].bits == (30,) and profile.specs[0].pattern.steps == (3,)
    plain = tmp_path / "plain.yaml"  # YAML 1.1 reads 5e-7 and 1e-2 (no dot) as strings
    plain.write_text("name: p\nspecs:\n  - {site: fwd/ffn, kind: additive, rate: 5e-7, "
                     "scale: [1e-2, 1]}\n")
    spec = profiles.load(str(plain)).specs[0]
    assert spec.rate == 5e-7 and spec.scale == (0.01, 1.0)
    cases = {"site: fwd/attn\n    kidn: bitflip": "unknown field 'kidn' (did you mean 'kind'?)",
             "site: fwd/attn\n    kind: melt": "kind must be one of",
             "site: fwd/atn": "unknown site 'fwd/atn'",
             "kind: bitflip": "the field 'site' is required",
             "site: fwd/attn\n    rate: 2.0": "rate must be a probability",
             "site: fwd/attn\n    rate: often": "rate must be a number, not 'often'",
             "site: fwd/attn\n    pattern: {kind: burst, p: 1}": "pattern has unknown fields"}
    for i, (body, message) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.yaml"
        bad.write_text(f"name: bad\nspecs:\n  - {body}\n")
        with pytest.raises(UserError) as info:
            profiles.load(str(bad))
        assert message in str(info.value) and "specs[0]" in str(info.value)
    with pytest.raises(UserError, match="did you mean 'paper-node-1'"):
        profiles.load("paper-node1")


def test_a_listing_into_a_closed_pipe_ends_quietly():
    """`sdcstudy profiles | head -1`: the reader leaves early; no traceback, SIGPIPE's code."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "sdcstudy", "profiles"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    try:
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141 and err == "", err
    finally:
        proc.kill()


# --- on a mesh: faults land only on the chosen node and tp ranks --------------------------------

DIMS = C.model_dims(C.ModelConfig(preset="tiny"))
LIMIT = 32


def _param_specs(params, node=True):
    lead = (M.NODE,) if node else ()

    def spec(path, _):
        name = path[-1].key
        if name in ("wq", "wk", "wv", "w_gate", "w_up"):
            return P(*lead, None, M.TP)
        if name in ("wo", "w_down"):
            return P(*lead, M.TP, None)
        return P(*lead)
    return jax.tree_util.tree_map_with_path(spec, params)


PROFILE = FS.Profile("t", (
    FS.FaultSpec("fwd/attn", "bitflip", rate=2e-3, bit_class="mantissa", layers=(1,),
                 tp_ranks=(1,)),
    FS.FaultSpec("bwd/ffn", "bitflip", rate=2e-3, bit_class="exponent", layers=(2,)),
))


@pytest.fixture(scope="module")
def mesh_run():
    """Run the tiny model forward and backward on (node=2, tp=2) with a profile that corrupts
    fwd/attn of layer 1 on tp rank 1 and bwd/ffn of layer 2 on every rank, both on node 1."""
    return _mesh_run(PROFILE)


@pytest.fixture(scope="module")
def clean_mesh_run():
    return _mesh_run(FS.Profile("clean", ()))


def _mesh_run(profile):
    injector = F.Injector(profile, DIMS.n_layers, limit=LIMIT)
    mesh = M.make_mesh(2, 1, 2)
    graphdef, params = model.init(DIMS, jax.random.key(0))
    pair = jax.tree.map(lambda p: jnp.stack([p, p]), params)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, DIMS.vocab_size)
    sinks = {k: jnp.zeros((2, 2) + s) for k, s in injector.sink_shapes().items()}

    def local(pair, sinks, inputs, targets):
        params = jax.tree.map(lambda p: p[0], pair)
        sinks = jax.tree.map(lambda s: s[0, 0], sinks)
        captured = {}

        def capture(when):
            def hook(site, x, layer):
                if (site, layer) == (S.ATTN_OUT, 1):
                    captured[when] = x
                return x
            return hook

        def loss(params, sinks):
            ctx = F.FaultContext(jax.random.key(7), jnp.int32(1), jnp.int32(0), sinks,
                                 node_axis=M.NODE, tp_axis=M.TP)
            hook = S.compose(capture("pre"), injector.hook(ctx), capture("post"))
            total, count = model.sequence_losses(graphdef, params, inputs, targets, hook=hook,
                                                 tp_axis=M.TP)
            return lax.psum(total, M.TP) / lax.psum(count, M.TP), (ctx.records, captured)

        (_, (records, captured)), (grads, sink_grads) = jax.value_and_grad(
            loss, argnums=(0, 1), has_aux=True)(params, sinks)
        lead = lambda t: jax.tree.map(lambda a: a[None, None], t)  # noqa: E731
        grads = jax.tree.map(lambda g: g[None], grads)
        return lead(records), lead(captured), lead(sink_grads), grads

    out_specs = (P(M.NODE, M.TP), P(M.NODE, M.TP), P(M.NODE, M.TP), _param_specs(params))
    run = jax.jit(jax.shard_map(local, mesh=mesh,
                                in_specs=(_param_specs(params), P(M.NODE, M.TP), P(None, M.TP),
                                          P(None, M.TP)),
                                out_specs=out_specs, check_vma=False))
    return jax.device_get(run(pair, sinks, tokens[:, :-1], tokens[:, 1:]))


def test_forward_faults_land_only_on_the_chosen_node_and_rank(mesh_run):
    records, captured, _, _ = mesh_run
    pre, post = captured["pre"], captured["post"]
    changed = pre.view(np.uint32) != post.view(np.uint32)
    per_device = changed.reshape(2, 2, -1).sum(-1)
    assert per_device[0].tolist() == [0, 0]  # healthy node untouched
    assert per_device[1, 0] == 0 and per_device[1, 1] > 0  # suspect, rank 1 only
    (key,) = [k for k in records if F.parse_record_key(k)[1] == S.ATTN_OUT]
    for node in range(2):
        for rank in range(2):
            count, rows = FR.decode_record(records[key][node, rank])
            assert count == per_device[node, rank]
            flat = np.nonzero(changed[node, rank].ravel())[0]
            assert [r["flat_index"] for r in rows] == flat[:LIMIT].tolist()
            assert all(r["corrupted"] == post[node, rank].ravel()[r["flat_index"]] for r in rows)


def test_backward_faults_reach_only_the_suspects_gradients(mesh_run, clean_mesh_run):
    _, _, sink_grads, grads = mesh_run
    clean = clean_mesh_run[3]
    (key,) = list(sink_grads)
    counts = [[FR.decode_record(sink_grads[key][n, r])[0] for r in range(2)] for n in range(2)]
    assert counts[0] == [0, 0] and min(counts[1]) > 0
    # The forward fault of node 1 (layer 1) and the backward one (layer 2) both change node 1's
    # weight gradients; node 0's must be exactly those of a clean run of the same program.
    for g, c in zip(jax.tree.leaves(grads), jax.tree.leaves(clean)):
        assert np.array_equal(g[0].view(np.uint32), c[0].view(np.uint32))
    changed = [not np.array_equal(g[1], c[1]) for g, c in zip(jax.tree.leaves(grads),
                                                              jax.tree.leaves(clean))]
    assert all(changed)  # both faults reach the embedding; every weight sees one of them


def test_healthy_profile_compiles_to_the_plain_step():
    # The engine must cost nothing when off: the healthy profile builds no injector, and the
    # compiled training step is the same program as one built without any fault code.
    from sdcstudy.core import train

    cfg = C.from_dict({"experiment": {"batch_size": 2}, "data": {"seq_len": 16}})
    healthy = NodeTrainer.from_config(cfg)
    assert healthy.faults is None
    assert not F.Injector(profiles.load("healthy"), DIMS.n_layers).active
    plain = train.Trainer.from_config(cfg)  # the core step, which has no fault code at all
    state = healthy.init_state()
    batch = {"tokens": np.zeros((1, 2, 17), np.int32)}
    text = lambda t: jax.jit(t.train_step).lower(state, batch).as_text()  # noqa: E731
    assert text(healthy) == text(plain)
    noisy = NodeTrainer.from_config(C.from_dict(
        {"experiment": {"batch_size": 2}, "data": {"seq_len": 16},
         "suspect": {"profile": "mantissa-noise"}}))
    assert text(noisy) != text(healthy)


def test_step_level_sites_run_in_the_single_node_trainer():
    # Gradient and update specs carry no microstep; the trainer must still trace them, and they
    # must land: `count` specs hit one element of every leaf in every step. If this fails, a
    # step-level site is skipped (no rows, an unchanged gradient) or its record does not say
    # what was applied.
    profile = FS.Profile("step-level", (FS.FaultSpec("grad", "bitflip", count=1, bits=(23,)),
                                        FS.FaultSpec("update", "bitflip", count=1, bits=(23,))))
    cfg = C.from_dict({"experiment": {"batch_size": 2}, "data": {"seq_len": 16},
                       "model": {"n_layers": 1}})
    clean = NodeTrainer.from_config(cfg)
    trainer = dataclasses.replace(clean, faults=Faults(F.Injector(profile, 1)))
    assert {s.site for _, s in trainer.faults.injector.tree_specs} == {"grad", "update"}
    state = jax.device_get(trainer.init_state())
    batch = {"tokens": jax.random.randint(jax.random.key(3), (1, 2, 17), 0, 256)}
    _, clean_metrics, _ = jax.jit(clean.train_step)(state, batch)
    new_state, metrics, records = jax.device_get(jax.jit(trainer.train_step)(state, batch))
    assert int(new_state["step"]) == 1 and np.isfinite(float(metrics["loss/healthy"]))
    rows, overflow = trainer.fault_rows(records["faults"], 1)
    leaves = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        state["params"])[0]}
    assert overflow == 0 and sorted(r["site"] for r in rows) == sorted(
        f"{site}/{name}" for site in ("grad", "update") for name in leaves)
    # the exponent flips reached the gradient the optimizer and the metrics see
    assert float(metrics["grad/norm"]) != float(clean_metrics["grad/norm"])
    assert all(r["bit"] == 23 and r["corrupted"] != r["original"] for r in rows)
    # each corrupted update element is the one added to its parameter
    new_leaves = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        new_state["params"])[0]}
    for r in rows:
        if r["site"].startswith("update/"):
            name = r["site"].removeprefix("update/")
            old = leaves[name].reshape(-1)[r["flat_index"]]
            assert new_leaves[name].reshape(-1)[r["flat_index"]] == \
                np.float32(old) + np.float32(r["corrupted"])


def _one_layer_trainer(profile):
    """A one-layer tiny NodeTrainer injecting `profile`."""
    cfg = C.from_dict({"experiment": {"batch_size": 2}, "data": {"seq_len": 16},
                       "model": {"n_layers": 1}})
    return dataclasses.replace(NodeTrainer.from_config(cfg), faults=Faults(F.Injector(profile, 1)))


def _one_layer_batch():
    return {"tokens": jax.random.randint(jax.random.key(3), (1, 2, 17), 0, 256)}


def test_skipping_idle_draws_keeps_every_bit(monkeypatch):
    # At the model's sites the draws and the record run under a lax.cond that skips them at a
    # rate of 0 (faults/corrupt.py). That must change no bit of anything: three steps whose
    # middle one fires (forward, backward and a count spec) and whose others are idle give the
    # same parameters, losses and fault records as drawing unconditionally. If this fails,
    # the conditional moved XLA's fusions around a site and with them the model's last bits.
    steps2 = FS.TimePattern("steps", steps=(2,))
    profile = FS.Profile("middle", (
        FS.FaultSpec("fwd/attn", "scale", rate=0.01, scale=(0.25, 1.0), pattern=steps2),
        FS.FaultSpec("bwd/ffn", "bitflip", rate=0.01, bit_class="mantissa", pattern=steps2),
        FS.FaultSpec("fwd/attn_k", "bitflip", count=1, bits=(20,), pattern=steps2)))
    batch = _one_layer_batch()

    def run():
        trainer = _one_layer_trainer(profile)
        step = jax.jit(trainer.train_step)
        state, out = trainer.init_state(), []
        for _ in range(3):
            state, metrics, records = step(state, batch)
            out.append((metrics["loss/healthy"], records["faults"]))
        text = step.lower(state, batch).as_text()
        return jax.device_get((state["params"], out)), text

    skipped, skipped_text = run()
    unconditional = F.corrupt_and_record
    monkeypatch.setattr(F, "corrupt_and_record",
                        lambda *a, skip_idle=False: unconditional(*a, skip_idle=False))
    drawn, drawn_text = run()
    assert skipped_text.count("stablehlo.case") > drawn_text.count("stablehlo.case")
    bits = lambda t: [np.asarray(a).tobytes() for a in jax.tree.leaves(t)]  # noqa: E731
    assert bits(skipped) == bits(drawn)
    landed = [sum(FR.decode_record(r[0])[0] for r in faults["micro"].values())
              for _, faults in drawn[1]]
    assert landed[0] == landed[2] == 0 < landed[1]


def test_stacked_leaves_are_corrupted_as_one_at_a_time(monkeypatch):
    # `grad` and `update` specs corrupt every parameter leaf; leaves of one shape are corrupted
    # as one stack (inject.STACK_LEAVES), which XLA compiles once instead of once a leaf. Every
    # leaf's faults, its record and all the step computes from them must be those of
    # corrupting it alone, bit for bit, in the compiled step: an additive gradient spec (the
    # kind that reads each row's RMS, a reduction XLA may fuse apart) dense enough to draw past
    # the listed hits, over two steps (XLA fuses the corruption into the optimizer's update,
    # and on the CPU contracts its multiply-adds by how that fusion reads: the Adam moments'
    # contractions show from the second step on, when they no longer start from 0).
    profile = FS.Profile("stacked", (
        FS.FaultSpec("grad", "additive", rate=0.3, scale=(2.0 ** -8, 1.0)),))
    batch = _one_layer_batch()

    def run():
        trainer = _one_layer_trainer(profile)
        lowered = jax.jit(trainer.train_step).lower(trainer.init_state(), batch)
        step = lowered.compile()
        first = step(trainer.init_state(), batch)
        return jax.device_get((first, step(first.state, batch))), lowered.as_text()

    stacked, stacked_text = run()
    monkeypatch.setattr(F, "STACK_LEAVES", False)
    alone, alone_text = run()
    # One dense-rest conditional per stack of leaves instead of one per leaf.
    assert stacked_text.count("stablehlo.case") < alone_text.count("stablehlo.case")
    bits = lambda t: [np.asarray(a).tobytes() for a in jax.tree.leaves(t)]  # noqa: E731
    assert bits(stacked) == bits(alone)
    landed = [FR.decode_record(r)[0] for r in stacked[1].records["faults"]["step"].values()]
    assert max(landed) > FD.HIT_CAP  # the additive spec drew past the listed hits


@pytest.mark.parametrize("dtype, spec", [
    (jnp.bfloat16, FS.FaultSpec("grad", "random", rate=1.0, lanes=(1, 3))),
    (jnp.float32, FS.FaultSpec("grad", "zero", rate=1.0)),
    (jnp.float32, FS.FaultSpec("update", "bitflip", count=2, bits=(20,)))])
def test_a_stack_of_tensors_is_corrupted_as_each_alone(dtype, spec):
    # The kinds the step test above leaves out, a bfloat16 stack and lanes; per tensor a rate
    # of its own: off, sparse, and dense enough to draw past the listed hits (2,560 elements
    # at 0.5: about 1,280 hits; in two lanes of 64, about 40; a count spec: its count).
    spec = spec.validate()
    xs = _x(dtype, (3, 40, 64))
    key_data = jax.random.key_data(jax.random.split(jax.random.key(1), 3))
    rates = jnp.asarray([0.0, 1e-3, 0.5], jnp.float32)
    alone = jax.jit(lambda xs, kd, r: [FC.corrupt_and_record(xs[i], kd[i], r[i], spec, 16)
                                        for i in range(3)])(xs, key_data, rates)
    ys, records = jax.jit(lambda *a: FC.corrupt_and_record_stacked(*a, spec, 16))(
        xs, key_data, rates)
    for i, (y, record) in enumerate(alone):
        assert np.array_equal(_bits(ys[i], dtype), _bits(y, dtype)), i
        assert np.array_equal(np.asarray(records[i]).view(np.uint32),
                              np.asarray(record).view(np.uint32)), i
    landed = [FR.decode_record(record)[0] for record in records]
    least = spec.count if spec.count else 20 if spec.lanes else FD.HIT_CAP
    assert landed[0] == 0 and landed[2] >= least


def test_an_additive_error_is_rounded_before_it_is_added():
    # XLA:GPU contracts a multiply that feeds an add into one FMA in some programs and not in
    # others: on an H100 the step test above failed (stacked and alone an ulp apart at the
    # hit elements of two stacks) until the error term was rounded on its own behind an
    # optimization barrier (faults/corrupt.py). On the CPU the two programs agreed either way
    # (the step test passed here before the barrier; XLA's CPU backend removes barriers before
    # it fuses), so no comparison of bits here can see it; this sees the barrier, one a
    # tensor, stacked or alone.
    spec = FS.FaultSpec("grad", "additive", rate=0.5, scale=(2.0 ** -8, 1.0)).validate()
    xs = _x(jnp.float32, (2, 8, 16))
    key_data = jax.random.key_data(jax.random.split(jax.random.key(1), 2))
    rates = jnp.asarray([0.5, 0.5], jnp.float32)
    alone = jax.jit(lambda x, kd: FC.corrupt_and_record(x, kd, 0.5, spec, 16)).lower(
        xs[0], key_data[0]).as_text()
    stacked = jax.jit(lambda *a: FC.corrupt_and_record_stacked(*a, spec, 16)).lower(
        xs, key_data, rates).as_text()
    assert alone.count("stablehlo.optimization_barrier") == 1
    assert stacked.count("stablehlo.optimization_barrier") == 1


def test_bits_a_bfloat16_site_lacks_are_one_sentence_and_exit_2(tmp_path, capsys):
    # bits: [20] exists in float32 but not in a bfloat16 model's sites; the step finds out
    # while tracing, and the user gets one sentence, not a traceback.
    from sdcstudy import cli

    profile = tmp_path / "high-bit.yaml"
    profile.write_text("name: high-bit\nspecs:\n  - {site: fwd/attn, kind: bitflip, "
                       "rate: 0.01, bits: [20]}\n")
    config = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
    code = cli.main(["run", str(config), "--out", str(tmp_path / "run"),
                     "--no-progress", "--set", "experiment.steps=1",
                     "--set", "model.dtype=bfloat16", "--set", f"suspect.profile={profile}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("sdcstudy: error:")]
    assert "none of bits [20] exist in the 16-bit values" in line


def test_a_profile_written_from_to_dict_loads_as_itself(tmp_path):
    # What a study writes to hand a changed profile to a run (experiments/loss_spike.py,
    # flip_model_compare.py) must load back as the same profile: every spec and its pattern.
    from sdcstudy.core import yamlsafe
    from sdcstudy.faults import profiles
    for name in ("paper-node-6-loss-spike", "paper-node-7", "stuck-lane"):
        profile = profiles.load(name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yamlsafe.dump(profiles.to_dict(profile), sort_keys=False))
        loaded = profiles.load(str(path))
        assert (loaded.name, loaded.specs) == (profile.name, profile.specs)


@pytest.mark.parametrize("dtype, spec", [
    (jnp.float32, FS.FaultSpec("grad", "additive", rate=1.0, scale=(2.0 ** -8, 1.0))),
    (jnp.float32, FS.FaultSpec("grad", "scale", rate=1.0, scale=(0.5, 2.0))),
    (jnp.float32, FS.FaultSpec("grad", "bitflip", rate=1.0, bit_class="exponent")),
    (jnp.bfloat16, FS.FaultSpec("grad", "bitflip", rate=1.0, bits=(3,))),
    (jnp.float32, FS.FaultSpec("grad", "nan", rate=1.0))])
def test_the_dense_rest_drawn_in_two_passes_is_the_one_pass_draw_bit_for_bit(dtype, spec):
    # The dense rest (more than HIT_CAP hits in a tensor) draws the second word of a uniform
    # and the hit's value only where the first word leaves the element undecided, gathered
    # (`draws._undecided_drawn`); it must give every element the hit and value that drawing
    # every element's words gives (`dense_after_one_pass`, the one-pass draw), at rates from
    # just past the cap to the most the gathered pass takes, and an exact tie with the rate.
    spec, size = spec.validate(), FD.GATHERED_MIN_SIZE
    width = FB.bit_width(dtype)
    gathered_share = 1 / FD.GATHERED_SHARE

    @jax.jit
    def both(key_data, rate):
        key = jax.random.wrap_key_data(key_data)
        hit, aux, positions, dense_keys = FD.listed_draws(key, spec, rate, size, width)
        first, undecided = FD._undecided(dense_keys[0], rate, positions, size)
        two = FD._undecided_drawn(dense_keys, spec, rate, width, hit, aux, first, undecided)
        one = FD.dense_after_one_pass(dense_keys, spec, rate, width, hit, aux, positions)
        return two, one, jnp.sum(undecided), positions[-1]

    @jax.jit
    def first_words(key_data):
        dense_key = FD.listed_draws(jax.random.wrap_key_data(key_data), spec, 0.03, size,
                                     width)[3][0]
        return FD._undecided(dense_key, 0.03, jnp.zeros(1, jnp.uint32), size)[0]

    def tie(key_data):  # (a rate that is exactly an element's first-word part, the element)
        parts = np.asarray(first_words(key_data)) >> 8
        at = size * 9 // 10 + np.flatnonzero((parts[size * 9 // 10:] > 0.025 * 2 ** 24) &
                                             (parts[size * 9 // 10:] < 0.05 * 2 ** 24))[0]
        return parts[at] * 2.0 ** -24, at

    key_data = [jax.random.key_data(jax.random.key(seed)) for seed in range(4)]
    tie_rate, tie_at = tie(key_data[3])
    rates = [0.02, 0.3 * gathered_share, 0.9 * gathered_share, tie_rate]
    for key_data, rate in zip(key_data, rates):
        (hit2, aux2), (hit1, aux1), undecided, last = both(key_data, jnp.float32(rate))
        assert last < size and 0 < undecided <= FD._gathered_size(size), (rate, undecided)
        assert rate != tie_rate or last < tie_at  # the tied element is in the dense rest
        assert np.array_equal(np.asarray(hit2), np.asarray(hit1)), rate
        assert np.asarray(hit1).sum() > FD.HIT_CAP
        if aux1 is not None:
            assert np.array_equal(np.asarray(aux2).view(np.uint32),
                                  np.asarray(aux1).view(np.uint32)), rate


def test_the_dense_rest_falls_back_to_one_pass_past_the_gathered_share():
    # Above 1 / GATHERED_SHARE the undecided elements outnumber the gathered pass: the draw
    # must take the one-pass path (a truncated gather would drop hits), alone and stacked.
    spec = FS.FaultSpec("grad", "additive", rate=1.0, scale=(2.0 ** -8, 1.0)).validate()
    size = FD.GATHERED_MIN_SIZE
    rate = jnp.float32(2.0 / FD.GATHERED_SHARE)

    @jax.jit
    def draws(key_data):
        key = jax.random.wrap_key_data(key_data)
        hit, aux, positions, dense_keys = FD.listed_draws(key, spec, rate, size, 32)
        one = FD.dense_after_one_pass(dense_keys, spec, rate, 32, hit, aux, positions)
        alone = FD.dense_after(dense_keys, spec, rate, 32, hit, aux, positions)
        stack = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        stacked = FD._dense_after_stacked(*stack((dense_keys,)), spec, rate[None], 32,
                                          *stack((hit, aux, positions)))
        return one, alone, stacked

    one, alone, stacked = draws(jax.random.key_data(jax.random.key(3)))
    assert np.asarray(one[0]).sum() > FD._gathered_size(size)
    for got in (alone, jax.tree.map(lambda a: a[0], stacked)):
        assert np.array_equal(np.asarray(got[0]), np.asarray(one[0]))
        assert np.array_equal(np.asarray(got[1]).view(np.uint32),
                              np.asarray(one[1]).view(np.uint32))


def test_only_a_large_tensor_whose_spec_can_pass_the_cap_draws_its_dense_rest_in_two_passes():
    # The second pass costs a conditional to compile; a tensor takes it where its dense rest
    # is likely: node 14's weight gradients on the small model's 512 x 1,536 leaves, not its
    # bursty Table 1 sites (a few hits a step at most) nor tiny's 8,192-element leaves.
    grad, *_ = [s for s in profiles.paper_node(14).specs if s.site == "grad"]
    sites = [s for s in profiles.paper_node(14).specs if s.site != "grad"]
    assert FD._gathers(grad, 512 * 1536) and not FD._gathers(grad, 64 * 128)
    assert not any(FD._gathers(s, 8 * 128 * 512) for s in sites)
    # the time pattern's peak counts: a decay spike 11x the base rate crosses HIT_CAP / 2
    base = FS.FaultSpec("fwd/attn", "additive", rate=1e-4, scale=(2.0 ** -8, 1.0))
    spiking = dataclasses.replace(base, pattern=FS.TimePattern("decay", amplitude=10.0))
    assert not FD._gathers(base, 2 ** 20) and FD._gathers(spiking, 2 ** 20)
    assert not FD._gathers(dataclasses.replace(base, kind="random", rate=0.5), 2 ** 20)
    # on the CPU only: a GPU draws one pass faster (an H200: 52 us against 253 us)
    assert FD._gathers(grad, 512 * 1536, "cpu") and not FD._gathers(grad, 512 * 1536, "gpu")
