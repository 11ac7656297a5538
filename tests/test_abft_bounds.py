"""ABFT's rounding bound against emulations of the arithmetic GPUs use (abft/bound.py).

Each emulation (TF32 operands rounded to nearest or toward zero, a checksum handed the
unrounded float32 weight of a bfloat16 product, split-K partial sums stored in bfloat16) is
checked twice: by the rule before the bound modelled the platform ("today's": the operands as
handed, exact float32 products, one output rounding), which must flag the healthy product,
and by the checker as it is, configured for that arithmetic, whose row AND column ratios must
stay below 1. On the CPU itself the two are the same rule.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.abft import bound as B
from sdcstudy.abft import checker as A
from sdcstudy.abft import checksum as CS
from sdcstudy.abft import emulate as E
from sdcstudy.core import config as C
from sdcstudy.core.errors import ConfigError

F32, BF16 = jnp.float32, jnp.bfloat16
SEEDS = range(4)
CHECK = jax.jit(CS.check_values, static_argnums=(3, 4, 5))
GPU = B.Arithmetic("tf32", 2 * B.U32)  # what `auto` resolves to on a GPU at DEFAULT precision


def _ratios(record):
    return float(record[CS.ROW_RATIO]), float(record[CS.COL_RATIO])


def _today(a32, b32, c32, c_dtype=F32):
    """Today's rule: the operands as handed, exact float32 products, one output rounding."""
    return _ratios(CHECK(a32, b32, c32, (F32, F32, jnp.dtype(c_dtype)), "rounding", B.CPU))


def _new(a32, b32, c32, dtypes, arithmetic):
    return _ratios(CHECK(a32, b32, c32, tuple(jnp.dtype(d) for d in dtypes), "rounding",
                         arithmetic))


def _old_formula(a, b, c, u_out):
    """1.01 [(u_out + n u) (|C| w)_i + (2k + n) u (|A| (|B| w))_i + underflow_i] in float64,
    per row, underflow_i = eta [(2k + 3) n + 2k + 3 n (|A| w)_i + 2 w^T |B| w]."""
    a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
    (_, k), n = a.shape, b.shape[1]
    u, eta = 2.0 ** -24, 2.0 ** -126
    spread = np.abs(a) @ np.abs(b).sum(1)
    underflow = eta * ((2 * k + 3) * n + 2 * k + 3 * n * np.abs(a).sum(1) + 2 * np.abs(b).sum())
    return 1.01 * ((u_out + n * u) * np.abs(c).sum(1) + (2 * k + n) * u * spread + underflow)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_cpu_the_bound_is_todays_formula(dtype):
    # If this fails, the CPU's checks changed: `auto` no longer resolves to IEEE float32
    # there, or the bound's terms moved, and CPU's false alarms or recall may change.
    assert B.resolve("auto", backend="cpu") == B.CPU
    assert B.resolve("auto") == B.CPU  # these tests run on the CPU
    a, b = E.operands(jax.random.key(0), 64, 32, 48)
    a, b = a.astype(dtype), b.astype(dtype)
    c = a @ b
    record = np.asarray(CS.check(a, b, c, "rounding", B.CPU))
    row = int(record[CS.ROW])
    bound = _old_formula(a, b, c, 2.0 ** -8 if dtype == "bfloat16" else 0.0)[row]
    # float32 evaluation of the bound against float64: 1e-5 relative.
    assert record[CS.ROW_THRESHOLD] == pytest.approx(bound, rel=1e-5)
    assert record[CS.OPERAND_ROUNDING] == 0 and record[CS.ACC_BITS] == 24


@pytest.mark.parametrize("scale", [1e-35, 1e-36, 1e-37, 1e-38, 1e-39])
def test_a_row_near_underflow_is_not_a_false_alarm_and_a_fault_there_is_caught(scale):
    """A bfloat16 input-gradient row of about 1e-37 (the last position's key and value late in
    training) underflows in the product, and flushing to zero loses up to 2^-126 whatever
    the row's size: without the bound's underflow term such rows flagged a healthy run
    (ratio up to inf: a bound that underflowed to 0). A corruption of 1e-30 there still
    flags: the term is about 3e-33 here."""
    rng = np.random.default_rng(0)
    m, k, n = 64, 256, 512
    a = rng.standard_normal((m, k)).astype(np.float32) * 1e-3
    a[3] = rng.standard_normal(k) * scale
    a[7] = rng.standard_normal(k) * scale * 1e-3
    a[7, 10] = scale
    b = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    a16, b16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    c = jnp.einsum("mk,kn->mn", a16, b16, preferred_element_type=jnp.float32
                   ).astype(jnp.bfloat16)
    check = jax.jit(lambda c: CS.check(a16, b16, c, "rounding", B.CPU))
    healthy = np.asarray(check(c))
    assert healthy[CS.FLAGGED] == 0 and healthy[CS.ROW_RATIO] <= 1
    faulty = np.asarray(check(c.at[3, 100].add(jnp.bfloat16(1e-30))))
    assert faulty[CS.FLAGGED] == 1 and int(faulty[CS.ROW]) == 3


def test_auto_follows_platform_and_precision_and_bad_settings_are_one_sentence():
    # If this fails, a GPU at DEFAULT precision would be checked as if it multiplied exact
    # float32 operands (the false alarms the bound exists to remove), or an unknown platform
    # would be checked silently.
    assert B.resolve("auto", backend="gpu", precision=None) == GPU
    assert B.resolve("auto", backend="gpu", precision="tensorfloat32") == GPU
    assert B.resolve("auto", backend="gpu", precision="highest").operand_rounding == "none"
    assert B.resolve("tf32_truncate", 4, backend="cpu") == B.Arithmetic("tf32_truncate", B.U32, 4)
    with pytest.raises(ConfigError, match="knows the cpu and gpu"):
        B.resolve("auto", backend="tpu", precision=None)
    with pytest.raises(ConfigError, match="does not know what matmul precision"):
        B.resolve("auto", backend="gpu", precision="BF16_BF16_F32")
    with pytest.raises(ConfigError, match="did you mean 'tf32_truncate'"):
        C.from_dict({}, ["abft.operand_rounding=tf32_truncat"])
    with pytest.raises(ConfigError, match="output_partials must be at least 1"):
        C.from_dict({}, ["abft.output_partials=0"])


def test_tf32_rounding_helpers_on_a_tie():
    # If this fails, the emulations (and the checksum's operands) do not round as named.
    tie, above = 1.0 + 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -20
    x = jnp.array([tie, -tie, above, 1.5], F32)
    assert np.asarray(B.tf32_nearest(x)).tolist() == [1.0, -1.0, 1.0 + 2.0 ** -10, 1.5]
    assert np.asarray(B.tf32_nearest_away(x)).tolist() == [1.0 + 2.0 ** -10, -1.0 - 2.0 ** -10,
                                                           1.0 + 2.0 ** -10, 1.5]
    assert np.asarray(B.tf32_truncate(x)).tolist() == [1.0, -1.0, 1.0, 1.5]
    _, radius = B.checksum_operand(x, F32, F32, GPU)
    assert np.asarray(radius).tolist() == [2.0 ** -10, 2.0 ** -10, 0.0, 0.0]


@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("hardware", ["tf32", "tf32_away", "tf32_truncate"])
def test_tf32_operands_flag_under_todays_rule_and_not_under_the_new(hardware, n):
    # A float32 product at DEFAULT precision on tensor cores: operands rounded to TF32 (to
    # nearest, ties to even or away, or toward zero). If today's rule stops flagging, the
    # emulation no longer rounds the operands; if the new one flags, the checksums do not see
    # the operands the GEMM multiplied.
    configured = B.Arithmetic("tf32_truncate" if hardware == "tf32_truncate" else "tf32",
                              2 * B.U32)
    for seed in SEEDS:
        a, w = E.operands(jax.random.key(seed), 512, 64, n)
        c = E.gemm(a, w, operand_rounding=hardware)
        assert max(_today(a, w, c)) > 1
        assert max(_new(a, w, c, (F32, F32, F32), configured)) < 1


@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_a_widened_weight_flags_under_todays_rule_and_is_re_rounded_by_the_new(out_dtype):
    # XLA's excess-precision pass can hand the checksum the float32 weight whose bfloat16
    # copy the GEMM multiplied. Re-rounding the checksum's operands to bfloat16 restores it;
    # if the new rule flags, that re-rounding is gone.
    today, new = [], []
    for seed in SEEDS:
        a, w = E.operands(jax.random.key(seed), 512, 64, 128)
        a16 = a.astype(BF16)
        c = E.gemm(a16, w.astype(BF16), out_dtype=out_dtype).astype(F32)
        today.append(_today(a16.astype(F32), w, c, out_dtype))
        new.append(_new(a16.astype(F32), w, c, (BF16, BF16, out_dtype), GPU))
    assert np.max(today) > 1
    assert np.max(new) < 1


def test_the_checked_bfloat16_product_re_rounds_its_checksum_operands_and_sums_in_float32():
    # The CPU compiler never widens the round trip, so this guards the defence itself: every
    # check's three operands pass through reduce-precision to bfloat16 (in the lowered program
    # and after the CPU's optimizations), and every product of bfloat16 operands (forward and
    # both backward) has a float32 result, rounded once to bfloat16 afterwards.
    def step(a, w, sink):
        def loss(a, w, sink):
            c, record = CS.checked_matmul(a, w, sink, rule="rounding")
            return jnp.sum(c.astype(F32)), (c, record)
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(a, w, sink)

    args = (jnp.ones((8, 16), BF16), jnp.ones((16, 32), BF16), jnp.zeros((2, CS.RECORD_LEN)))
    lowered = jax.jit(step).lower(*args)
    text = lowered.as_text()
    assert text.count("reduce_precision") == len(A.DIRECTIONS) * 3
    assert re.findall(r"reduce_precision .*format = (\w+)", text) == ["e8m7"] * 9
    products = [line for line in text.splitlines() if "dot_general" in line and "bf16>" in line]
    assert len(products) == 3 and all(line.endswith("xf32>") for line in products)
    compiled = lowered.compile().as_text()
    assert compiled.count("exponent_bits=8, mantissa_bits=7") >= 9


@pytest.mark.parametrize("s", [4, 16])
def test_split_k_partials_in_float32_hold_and_in_bfloat16_need_their_term(s):
    # Split-K: the k sum in s partial sums, added in a random order. Held in float32 they are
    # within the accumulation term of both rules (the checked products force float32
    # partials). Stored in bfloat16 they add (2s - 2) u_out |A||B|: on operands whose halves
    # cancel, today's rule and the new one with one output rounding flag, the new one told of
    # s partials does not. If that last one flags, the term is wrong.
    for seed in SEEDS:
        a, w = E.operands(jax.random.key(seed), 512, 256, 64)
        # The second half of k nearly undoes the first: partial sums far larger than C.
        noise = 0.1 * jax.random.normal(jax.random.key(50 + seed), (512, 128))
        a, w = a.at[:, 128:].set(a[:, :128] + noise), w.at[128:].set(-w[:128])
        a16, w16 = a.astype(BF16), w.astype(BF16)
        a32, w32 = a16.astype(F32), w16.astype(F32)
        order = jax.random.key(100 + seed)
        dtypes = (BF16, BF16, BF16)
        c = E.gemm(a16, w16, partials=s, out_dtype=BF16, order_key=order).astype(F32)
        assert max(_today(a32, w32, c, BF16)) < 1
        assert max(_new(a32, w32, c, dtypes, GPU)) < 1
        c = E.gemm(a16, w16, partials=s, partial_dtype=BF16, out_dtype=BF16,
                   order_key=order).astype(F32)
        assert max(_today(a32, w32, c, BF16)) > 1
        assert max(_new(a32, w32, c, dtypes, GPU)) > 1
        assert max(_new(a32, w32, c, dtypes, B.Arithmetic("tf32", 2 * B.U32, s))) < 1


@pytest.mark.parametrize("scenario, caught_from", [("float32_tf32", 2.0 ** -4),
                                                    ("bfloat16_widened", 1.0)])
def test_new_bound_has_no_false_alarms_and_catches_errors_above_rounding(scenario, caught_from):
    # Tiny's four linear shapes with one element moved by a multiple of its row's RMS: no
    # healthy product flags, and every error from `caught_from` x RMS up is flagged (what
    # RESULTS.md reports for the CPU). If recall falls, the bound grew looser than rounding.
    rows = {r["rule"]: r for r in E.recall_rows(scenario, range(1), trials=16)}
    new, today = rows["new"], rows["today"]
    assert new["false_alarms"] == 0 and today["false_alarms"] > 0
    caught = [size for size in E.ERROR_SIZES if new[size] == new["corrupted"]]
    assert caught and min(caught) <= caught_from
    assert all(new[size] == new["corrupted"] for size in E.ERROR_SIZES if size >= caught_from)
    assert new[E.ERROR_SIZES[0]] < new["corrupted"]  # not vacuous: the smallest hide
