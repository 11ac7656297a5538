"""Lock-step taps: numpy mismatch statistics, exact counts, and the taps in shard_map.

The model runs on a (node=2, dp=1, tp) mesh with identical parameters and tokens on both nodes.
A test-only fault hook flips one chosen bit on node 1: of the value at `attn_out` of layer 2
(forward, composed before the tap) and of the cotangent at `ffn_in` of layer 1 (backward,
composed after the tap in forward order). Which flips are on, and where, are runtime inputs, so
each (dtype, tp) configuration compiles two programs: with taps and without.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from sdcstudy.core import config as C
from sdcstudy.paired import lockstep as L
from sdcstudy.paired import mismatch as MS
from sdcstudy.core import mesh as M
from sdcstudy.core import model
from sdcstudy.core import sites as S
from sdcstudy.core import stats

BF16 = ml_dtypes.bfloat16
# The device computes relative errors in float32 from exact significands and exponents (one
# rounding for the difference, one for the division); numpy in float64. Two float32 roundings
# are at most 2**-23 apart; a wrong formula or a wrong element is off by far more.
SEVERITY_RTOL = 2.0 ** -22

# --- numpy statistics --------------------------------------------------------------------------


def _flip(a, index, bit):
    a = np.array(a)
    uint = np.uint32 if a.dtype == np.float32 else np.uint16
    bits = a.reshape(-1).view(uint)
    bits[index] ^= uint(1) << uint(bit)
    return a


def test_mismatch_stats_float32_one_mantissa_bit():
    healthy = np.array([1.5, -3.0, 0.25, 7.0], np.float32)
    suspect = _flip(healthy, 0, 10)
    got = stats.mismatch_stats(healthy, suspect)
    # 1.5 = 1.1b x 2^0: mantissa bit 10 weighs 2^(10-23); the relative error is 2^-13 / 1.5.
    assert got == {"mismatches": 1, "elements": 4, "severity": 2.0 ** -13 / 1.5,
                   "max_rel_err": 2.0 ** -13 / 1.5, "nonfinite": 0}
    hist = stats.bit_histogram(healthy, suspect)
    assert hist.shape == (32,) and hist[10] == 1 and hist.sum() == 1


def test_mismatch_stats_bfloat16_and_exponent_bit():
    healthy = np.array([1.5, 2.0, -0.75, 4.0], BF16)
    # bf16 bit 3 of 2.0 (mantissa, weight 2^(3-7) x 2^1) and bit 7 of -0.75 (lowest exponent
    # bit: -0.75 = -1.1b x 2^-1 has exponent field 126, flipping bit 7 gives 127, i.e. -1.5).
    suspect = _flip(_flip(healthy, 1, 3), 2, 7)
    got = stats.mismatch_stats(healthy, suspect)
    assert got["mismatches"] == 2 and got["elements"] == 4 and got["nonfinite"] == 0
    assert float(suspect[1]) == 2.0 + 2.0 ** -3 and float(suspect[2]) == -1.5
    errors = [2.0 ** -3 / 2.0, 0.75 / 0.75]
    assert got["severity"] == np.mean(errors) and got["max_rel_err"] == max(errors)
    hist = stats.bit_histogram(healthy, suspect)
    assert hist.shape == (16,) and list(np.flatnonzero(hist)) == [3, 7]
    assert stats.class_counts(hist, BF16) == {"mantissa": 1, "exponent": 1, "sign": 0}


def test_zero_healthy_uses_smallest_normal_and_nonfinite_is_left_out():
    healthy = np.array([0.0, 0.0, 1.0, 2.0, 5.0], np.float32)
    suspect = np.array([1e-30, 0.0, np.inf, np.nan, 5.0], np.float32)
    got = stats.mismatch_stats(healthy, suspect)
    tiny = float(np.finfo(np.float32).tiny)
    assert got["mismatches"] == 3 and got["nonfinite"] == 2
    assert got["severity"] == float(np.float32(1e-30)) / tiny == got["max_rel_err"]
    assert stats.smallest_normal(BF16) == tiny  # bfloat16 keeps float32's exponent range
    negative_zero = stats.mismatch_stats(np.zeros(3, BF16), -np.zeros(3, BF16))
    assert negative_zero["mismatches"] == 3 and negative_zero["severity"] == 0.0
    assert stats.bit_histogram(np.zeros(3, BF16), -np.zeros(3, BF16))[15] == 3


def test_no_mismatch_and_bit_classes():
    a = np.linspace(-3, 3, 11, dtype=np.float32)
    assert stats.mismatch_stats(a, a.copy()) == {"mismatches": 0, "elements": 11,
                                                 "severity": 0.0, "max_rel_err": 0.0,
                                                 "nonfinite": 0}
    assert [stats.bit_class(b, np.float32) for b in (0, 22, 23, 30, 31)] == [
        "mantissa", "mantissa", "exponent", "exponent", "sign"]
    assert stats.bit_classes(BF16)["exponent"] == range(7, 15)
    with pytest.raises(ValueError):
        stats.mismatch_stats(a, a[:3])


# --- the device comparison against numpy -------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_device_compare_matches_numpy(dtype):
    rng = np.random.default_rng(0)
    n = 4000
    width = 32 if dtype == np.float32 else 16
    uint = np.uint32 if width == 32 else np.uint16
    healthy = (rng.standard_normal(n) * np.exp(rng.uniform(-60, 60, n))).astype(dtype)
    healthy[:40] = 0
    healthy[40:50] = np.float32(1e-40)  # subnormal: XLA on CPU would flush it in arithmetic
    bits = healthy.view(uint).copy()
    hit = rng.random(n) < 0.3
    bits[hit] ^= uint(1) << rng.integers(0, width, n).astype(uint)[hit]
    suspect = bits.view(dtype)
    want = stats.mismatch_stats(healthy, suspect)
    got = MS.decode(jax.jit(MS.compare)(jnp.asarray(healthy), jnp.asarray(suspect)))
    for key in ("mismatches", "elements", "nonfinite"):
        assert got[key] == want[key], key
    # Exponent flips give relative errors far beyond float32's range (2^128); they must
    # still agree with the float64 reference.
    assert want["max_rel_err"] > 1e38
    for key in ("severity", "max_rel_err"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
    np.testing.assert_array_equal(got["bits"][:width], stats.bit_histogram(healthy, suspect))
    assert not got["bits"][width:].any()


def test_counts_beyond_float32_integers_stay_exact():
    for n in (2 ** 24 + 1, 2 ** 31 + 3, 2 ** 32 - 1):
        hi, lo = np.asarray(MS.encode_count(jnp.uint32(n)))
        assert MS.decode_count(hi, lo) == n
    assert float(np.float32(2 ** 24 + 1)) != 2 ** 24 + 1  # why the split is needed
    # A whole tensor of 2^24 + 3 mismatching elements, through the real comparison.
    n = 2 ** 24 + 3
    got = MS.decode(jax.jit(MS.compare)(jnp.zeros(n, jnp.float32), jnp.ones(n, jnp.float32)))
    assert got["mismatches"] == got["elements"] == got["finite"] == n
    ones = np.flatnonzero(np.array([1], np.float32).view(np.uint32)[0] >> np.arange(32) & 1)
    np.testing.assert_array_equal(np.flatnonzero(got["bits"]), ones)
    assert set(got["bits"][ones]) == {n}
    # relative error of 1 against a zero healthy value: 1 / smallest normal, for every element
    np.testing.assert_allclose(got["severity"], 1 / stats.smallest_normal(np.float32),
                               rtol=1e-6)


# --- the taps in shard_map ---------------------------------------------------------------------

B, LENGTH = 2, 16
FWD_SITE, BWD_SITE = (S.ATTN_OUT, 2), (S.FFN_IN, 1)
# fault vector: [flags (1 = forward flip, 2 = backward flip), tp rank, forward element,
#                forward bit, backward element, backward bit]
FWD, BWD = 1, 2


def _flip_one(x, hit, index, bit):
    uint = jnp.uint32 if x.dtype == jnp.float32 else jnp.uint16
    bits = lax.bitcast_convert_type(x, uint)
    mask = hit & (lax.broadcasted_iota(jnp.int32, (x.size,), 0) == index).reshape(x.shape)
    flipped = bits ^ (jnp.ones((), uint) << bit.astype(uint))
    return lax.bitcast_convert_type(jnp.where(mask, flipped, bits), x.dtype)


# A corrupted value whose gradient flows on as if it were clean (hardware corrupts the result,
# not the derivative).
@jax.custom_vjp
def _corrupt_value(x, hit, index, bit):
    return _flip_one(x, hit, index, bit)


def _corrupt_value_fwd(x, hit, index, bit):
    return _flip_one(x, hit, index, bit), None


def _corrupt_value_bwd(residuals, ct):
    return ct, None, None, None


_corrupt_value.defvjp(_corrupt_value_fwd, _corrupt_value_bwd)


# Identity forward; the backward flips a bit of the cotangent and hands the clean cotangent to
# `capture` (a zero sink of x's shape) so the test can compute the expected statistics.
@jax.custom_vjp
def _corrupt_ct(x, capture, hit, index, bit):
    return x


def _corrupt_ct_fwd(x, capture, hit, index, bit):
    return x, (hit, index, bit)


def _corrupt_ct_bwd(residuals, ct):
    hit, index, bit = residuals
    return _flip_one(ct, hit, index, bit), ct, None, None, None


_corrupt_ct.defvjp(_corrupt_ct_fwd, _corrupt_ct_bwd)


def _fault_hook(fault, tp_axis, captured, capture_sink):
    """Test injector: flips on node 1 (and the chosen tp rank) only."""
    on_suspect = lax.axis_index(M.NODE) == 1
    if tp_axis is not None:
        on_suspect &= lax.axis_index(tp_axis) == fault[1]

    def hook(site, x, layer):
        if (site, layer) == FWD_SITE:
            captured["value"] = x
            return _corrupt_value(x, on_suspect & (fault[0] & FWD > 0), fault[2], fault[3])
        if (site, layer) == BWD_SITE:
            return _corrupt_ct(x, capture_sink, on_suspect & (fault[0] & BWD > 0), fault[4],
                               fault[5])
        return x

    return hook


def _tp_specs(params, tp):
    def spec(path, _):
        name = path[-1].key
        if tp > 1 and name in ("wq", "wk", "wv", "w_gate", "w_up"):
            return P(None, M.TP)
        if tp > 1 and name in ("wo", "w_down"):
            return P(M.TP, None)
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


def _node_first(spec):
    return P(M.NODE, *spec)


def _build(graphdef, params, dims, tp, *, taps: bool, order="lockstep"):
    """jit(shard_map(...)): (params, inputs, targets, fault) -> per-node loss, grads, stats."""
    mesh = M.make_mesh(2, 1, tp)
    tp_axis = M.TP if tp > 1 else None
    lockstep = L.LockstepTaps(dims.n_layers, tp_axis=tp_axis)
    specs = _tp_specs(params, tp)
    axes = (M.NODE,) if tp_axis is None else (M.NODE, M.TP)

    def local(params, inputs, targets, fault):
        # Each node holds its own copy: gradients must not be summed over nodes.
        params = M.vary(params, (M.NODE,))
        capture_sink = M.vary(jnp.zeros((B, LENGTH, dims.d_model), jnp.float32), axes)

        def loss_fn(params, sinks, capture_sink):
            captured = {}
            inject = _fault_hook(fault, tp_axis, captured, capture_sink.astype(
                model.DTYPES[dims.dtype]))
            if not taps:
                hook, fwd_stats = inject, {}
            else:
                tap_hook = lockstep.hook(sinks)
                hook, fwd_stats = tap_hook, tap_hook.fwd_stats
                if order == "lockstep":
                    hook = L.compose_with_injector(tap_hook, inject)
                else:  # the wrong order for backward sites, kept to show why it matters
                    hook = S.compose(inject, tap_hook)
            loss, _ = model.sequence_losses(graphdef, params, inputs, targets, hook=hook,
                                            tp_axis=tp_axis)
            return loss, (fwd_stats, captured["value"].astype(jnp.float32))

        sinks = lockstep.init_sinks()
        (loss, (fwd, value)), (grads, bwd, ct) = jax.value_and_grad(
            loss_fn, (0, 1, 2), has_aux=True)(params, sinks, capture_sink)
        expand = lambda a: M.vary(a, axes)[None, None]  # noqa: E731
        return (expand(loss), jax.tree.map(lambda g: g[None], grads),
                lockstep.expand(fwd), lockstep.expand(bwd), expand(value), expand(ct))

    pair = P(M.NODE, tp_axis)
    out_specs = (pair, jax.tree.map(_node_first, specs), lockstep.out_spec, lockstep.out_spec,
                 pair, pair)
    seq = P(None, tp_axis)
    step = jax.shard_map(local, mesh=mesh, in_specs=(specs, seq, seq, P()), out_specs=out_specs,
                         check_vma=True)
    return jax.jit(step), lockstep


# (compute dtype, tp ranks, also compile the program without taps as a baseline)
CONFIGS = {"f32-tp1": ("float32", 1, True), "f32-tp2": ("float32", 2, True),
           "bf16-tp1": ("bfloat16", 1, False)}
# The flipped bits: (forward bit at attn_out of layer 2, backward bit at ffn_in of layer 1).
FLIPS = {"float32": (22, 20), "bfloat16": (6, 5)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    dtype, tp, baseline = CONFIGS[request.param]
    dims = C.model_dims(C.ModelConfig(preset="tiny", dtype=dtype))
    graphdef, params = model.init(dims, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (B, LENGTH + 1), 0, dims.vocab_size)
    tapped, lockstep = _build(graphdef, params, dims, tp, taps=True)
    plain = _build(graphdef, params, dims, tp, taps=False)[0] if baseline else None
    fwd_bit, bwd_bit = FLIPS[dtype]
    rank = tp - 1

    def fault(flags):
        return jnp.array([flags, rank, 777, fwd_bit, 333, bwd_bit], jnp.int32)

    def run(fn, flags):
        out = fn(params, tokens[:, :-1], tokens[:, 1:], fault(flags))
        return jax.tree.map(np.asarray, out)

    return dict(dtype=dtype, tp=tp, rank=rank, dims=dims, lockstep=lockstep,
                tapped=lambda flags: run(tapped, flags), plain=lambda flags: run(plain, flags),
                clean=run(plain, 0) if baseline else None, clean_tapped=run(tapped, 0),
                fwd_bit=fwd_bit, bwd_bit=bwd_bit)


# XLA:CPU emits reductions with LLVM's `reassoc` flag, so two different programs may sum one
# reduction in different orders: the tap's all-gather materializes the cotangent at `attn_in`,
# and with it the layer-1 `attn_norm` scale gradient (a sum over batch and sequence) came out
# 1 ulp apart from the untapped program's in some elements (f32, tp=1). That is rounding, not
# arithmetic the taps changed; a wrong or mixed-up gradient is off by far more than this.
REASSOCIATION_RTOL = 2.0 ** -20


def _assert_bitwise(a, b, what):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8),
                                      err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def _node(tree, node):
    return jax.tree.map(lambda a: a[node], tree)


def _both_nodes_equal_clean(out, clean):
    """Loss and gradients of BOTH nodes bitwise equal to the clean run's healthy node."""
    for node in (0, 1):
        _assert_bitwise(out[0][node], clean[0][0], f"loss node {node}")
        _assert_bitwise(_node(out[1], node), _node(clean[1], 0), f"grads node {node}")


def test_clean_pair_has_no_mismatch_and_taps_change_nothing(pair):
    out = pair["clean_tapped"]
    rows = pair["lockstep"].rows(out[2], out[3], step=1, microstep=0)
    dims, tp = pair["dims"], pair["tp"]
    assert len(rows) == 4 * dims.n_layers * tp
    assert {(r["layer"], r["site"], r["tp_rank"]) for r in rows} == {
        (layer, site, rank) for layer in (1, 2) for site in L.SITE_NAMES for rank in range(tp)}
    # attn_out / ffn_out are per-rank partial sums over the whole sequence; the cotangents at
    # attn_in / ffn_in are after the all-gather: the whole sequence too.
    for r in rows:
        assert (r["mismatches"], r["severity"], r["max_rel_err"], r["nonfinite"]) == (0, 0, 0, 0)
        assert r["elements"] == B * LENGTH * dims.d_model
    assert set(MS.ROW_STATS) | {"step", "microstep", "layer", "site", "tp_rank"} == set(rows[0])
    # Both nodes agree bitwise, with taps and without.
    for run in (out, pair["clean"]) if pair["clean"] else (out,):
        _assert_bitwise(run[0][1], run[0][0], "loss node 1")
        _assert_bitwise(_node(run[1], 1), _node(run[1], 0), "grads node 1")
    if pair["clean"] is None:
        return
    # Against the program without taps: the same loss bit for bit, the same gradients up to
    # the order XLA may pick for a reduction.
    _assert_bitwise(out[0], pair["clean"][0], "loss with and without taps")
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(out[1]),
                                 jax.tree.leaves(pair["clean"][1])):
        np.testing.assert_allclose(got, want, rtol=0,
                                   atol=REASSOCIATION_RTOL * np.abs(want).max(),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("pair", ["f32-tp1", "f32-tp2"], indirect=True)
def test_each_flip_alone_changes_the_suspect_without_taps(pair):
    """The corruptions are real: without taps node 1's loss or gradients change."""
    clean = pair["clean"]
    fwd = pair["plain"](FWD)
    assert not np.array_equal(fwd[0][1], clean[0][0])
    np.testing.assert_array_equal(fwd[0][0], clean[0][0])  # node 0 untouched
    bwd = pair["plain"](BWD)
    np.testing.assert_array_equal(bwd[0][1], clean[0][0])  # a cotangent flip leaves the loss
    changed = [not np.array_equal(g[1], c[0]) for g, c in
               zip(jax.tree.leaves(bwd[1]), jax.tree.leaves(clean[1]))]
    assert any(changed)


def test_flips_are_caught_where_they_land_and_do_not_propagate(pair):
    out = pair["tapped"](FWD | BWD)
    lockstep, rank, dtype = pair["lockstep"], pair["rank"], pair["dtype"]
    rows = lockstep.rows(out[2], out[3], step=1, microstep=0)
    hits = {(r["layer"], r["site"], r["tp_rank"]): r for r in rows if r["mismatches"]}
    assert set(hits) == {(2, "fwd/attn", rank), (1, "bwd/ffn", rank)}
    np_dtype = np.float32 if dtype == "float32" else BF16
    expected = {
        (2, "fwd/attn", rank): (out[4][0, rank].astype(np_dtype), 777, pair["fwd_bit"]),
        (1, "bwd/ffn", rank): (out[5][0, rank].astype(np_dtype), 333, pair["bwd_bit"]),
    }
    histograms = lockstep.bit_histograms(out[2], out[3])
    for key, (clean_value, index, bit) in expected.items():
        want = stats.mismatch_stats(clean_value, _flip(clean_value, index, bit))
        got = hits[key]
        assert got["mismatches"] == want["mismatches"] == 1, key
        assert got["nonfinite"] == 0 and got["elements"] == want["elements"]
        assert want["severity"] > 0
        np.testing.assert_allclose(got["severity"], want["severity"], rtol=SEVERITY_RTOL)
        np.testing.assert_allclose(got["max_rel_err"], want["max_rel_err"], rtol=SEVERITY_RTOL)
        assert list(np.flatnonzero(histograms[key])) == [bit]
    # Both nodes computed the same statistics from the gathered pair.
    for key in out[2]:
        np.testing.assert_array_equal(out[2][key][0], out[2][key][1])
    _both_nodes_equal_clean(out, pair["clean_tapped"])


def test_injector_after_a_forward_tap_escapes_the_backward_comparison():
    """The composition rule: `sites.compose(inject, taps)` puts the cotangent corruption behind
    the backward tap at `ffn_in`, which sees nothing; the corruption spreads through the layer's
    backward and is caught, smeared over many elements, at the next tap (`bwd/attn`)."""
    dims = C.model_dims(C.ModelConfig(preset="tiny"))
    graphdef, params = model.init(dims, jax.random.key(0))
    wrong, lockstep = _build(graphdef, params, dims, 1, taps=True, order="naive")
    tokens = jax.random.randint(jax.random.key(1), (B, LENGTH + 1), 0, dims.vocab_size)
    fault = jnp.array([BWD, 0, 777, FLIPS["float32"][0], 333, FLIPS["float32"][1]], jnp.int32)
    out = jax.tree.map(np.asarray, wrong(params, tokens[:, :-1], tokens[:, 1:], fault))
    hits = {(r["layer"], r["site"]): r["mismatches"]
            for r in lockstep.rows(out[2], out[3], step=1, microstep=0) if r["mismatches"]}
    assert set(hits) == {(1, "bwd/attn")} and hits[(1, "bwd/attn")] > 1
    changed = [not np.array_equal(g[1], g[0]) for g in jax.tree.leaves(out[1])]
    assert any(changed)
