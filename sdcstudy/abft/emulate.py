"""GEMMs as other platforms compute them, emulated on the CPU, for testing ABFT's bound.

`gemm` rounds float32 operands as a GPU's tensor cores do at XLA's DEFAULT precision (TF32,
to nearest or toward zero), splits the k sum into partial sums (split-K) held in float32 or
in a narrower dtype and adds them in any order, and rounds the result to the output dtype.
`operands` draws the inputs of one linear layer with the structure that makes rounding
errors add up rather than cancel: per-feature means and a few outlier features in the
activations, and a small mean in the weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.abft import bound as B
from sdcstudy.abft import checksum as C

OPERAND_ROUNDING = {"none": lambda x: x, "tf32": B.tf32_nearest,
                    "tf32_away": B.tf32_nearest_away, "tf32_truncate": B.tf32_truncate}
OUTLIER_FEATURES = 4  # activation features 30x larger than the others
OUTLIER_SCALE = 30.0


def operands(key, m: int, k: int, n: int):
    """(activations A, m x k; weights W, k x n), float32."""
    k_a, k_mean, k_w, k_w_mean = jax.random.split(key, 4)
    feature_mean_K = 0.5 + jax.random.uniform(k_mean, (k,))
    a = jax.random.normal(k_a, (m, k)) + feature_mean_K
    a = a.at[:, :OUTLIER_FEATURES].multiply(OUTLIER_SCALE)
    w_mean_N = 0.2 * jax.random.uniform(k_w_mean, (n,))
    w = (jax.random.normal(k_w, (k, n)) + w_mean_N) / jnp.sqrt(k)
    return a, w


def gemm(a, b, *, operand_rounding: str = "none", partials: int = 1,
         partial_dtype=jnp.float32, out_dtype=jnp.float32, order_key=None):
    """a @ b as a GPU may compute it: operands rounded by `operand_rounding` (none, tf32,
    tf32_away, tf32_truncate), exact float32 products of each of `partials` slices of k
    summed at HIGHEST, each partial stored in `partial_dtype` and added in `partial_dtype`
    (in the order `order_key` permutes them to, if given), the result rounded to
    `out_dtype`."""
    rnd = OPERAND_ROUNDING[operand_rounding]
    a32, b32 = rnd(a.astype(jnp.float32)), rnd(b.astype(jnp.float32))
    k = a.shape[1]
    if k % partials:
        raise ValueError(f"k = {k} does not split into {partials} partial sums.")
    step = k // partials
    parts = [jnp.dot(a32[:, p * step:(p + 1) * step], b32[p * step:(p + 1) * step],
                     precision=lax.Precision.HIGHEST).astype(partial_dtype)
             for p in range(partials)]
    if order_key is not None:
        parts = [parts[i] for i in jax.random.permutation(order_key, partials).tolist()]
    total = parts[0]
    for part in parts[1:]:
        total = (total + part).astype(partial_dtype)
    return total.astype(out_dtype)


# --- healthy and corrupted products of tiny's linear layers, as the checks see them ------------

# tiny's linear layers at 4 x 64 tokens: (m, k, n, the output's dtype in a bfloat16 model) of
# q, up, down and the float32 head.
TINY_SHAPES = ((256, 64, 64, jnp.bfloat16), (256, 64, 128, jnp.bfloat16),
               (256, 128, 64, jnp.bfloat16), (256, 64, 256, jnp.float32))
ERROR_SIZES = tuple(2.0 ** e for e in range(-16, 5, 2))  # additive errors, in row RMS
GPU_TF32 = B.Arithmetic("tf32", 2 * B.U32)
# scenario -> (dtype of the model, the GEMM's operand rounding, the arithmetic the checks
# assume); bfloat16_widened: the checksum is handed the unrounded float32 weight, as after
# XLA's excess-precision simplification.
SCENARIOS = {
    "float32_cpu": ("float32", "none", B.CPU),
    "float32_tf32": ("float32", "tf32", GPU_TF32),
    "float32_tf32_truncate": ("float32", "tf32_truncate",
                              B.Arithmetic("tf32_truncate", 2 * B.U32)),
    "bfloat16_cpu": ("bfloat16", "none", B.CPU),
    "bfloat16_widened": ("bfloat16", "none", GPU_TF32),
}


def product(scenario: str, key, m: int, k: int, n: int, out_dtype):
    """(float32 copies of A, B, C as the checks are handed them, the GEMM's dtypes)."""
    dtype, rounding, _ = SCENARIOS[scenario]
    a, w = operands(key, m, k, n)
    if dtype == "float32":
        c = gemm(a, w, operand_rounding=rounding)
        return a, w, c, (jnp.float32, jnp.float32, jnp.float32)
    a16, w16 = a.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    c = gemm(a16, w16, out_dtype=out_dtype)
    handed_w = w if scenario.endswith("widened") else w16.astype(jnp.float32)
    return (a16.astype(jnp.float32), handed_w, c.astype(jnp.float32),
            (jnp.bfloat16, jnp.bfloat16, out_dtype))


def with_errors(c32, c_dtype, key, sizes, trials: int):
    """(trials x sizes) copies of C, each with one element moved by size x its row's RMS
    (random sign and element), stored in C's dtype."""
    m, n = c32.shape
    k_row, k_col, k_sign = jax.random.split(key, 3)
    rows = jax.random.randint(k_row, (trials,), 0, m)
    cols = jax.random.randint(k_col, (trials,), 0, n)
    signs = jnp.where(jax.random.bernoulli(k_sign, 0.5, (trials,)), 1.0, -1.0)
    rms_T = jnp.sqrt(jnp.mean(jnp.square(c32[rows]), axis=1))
    errors_ST = jnp.asarray(sizes)[:, None] * signs * rms_T
    hit_TMN = (jnp.arange(m)[None, :, None] == rows[:, None, None]) & \
        (jnp.arange(n)[None, None, :] == cols[:, None, None])
    bad = c32 + jnp.where(hit_TMN[None], errors_ST[:, :, None, None], 0.0)
    return B.as_stored(bad.astype(c_dtype).astype(jnp.float32), c_dtype)


RULES = ("today", "new")


@functools.cache
def _check_fn(rule: str, scenario: str, dtypes):
    """A jitted (A, B, C stack) -> records under `rule`: `new` is the checker as it is;
    `today` the rounding rule before it modelled the platform (the operands as handed,
    exact float32 products accumulated at 2^-24, one output rounding)."""
    arithmetic = SCENARIOS[scenario][2]
    if rule == "today":
        dtypes, arithmetic = (jnp.float32, jnp.float32, dtypes[2]), B.CPU
    one = lambda a, b, c: C.check_values(a, b, c, dtypes, "rounding", arithmetic)  # noqa: E731
    return jax.jit(jax.vmap(one, in_axes=(None, None, 0)))


def recall_rows(scenario: str, seeds, trials: int, sizes=ERROR_SIZES) -> list[dict]:
    """Per rule: healthy checks and their flags, and per error size the corrupted products
    and those flagged, over `seeds` draws of each of tiny's shapes."""
    totals = {rule: {"healthy": 0, "false_alarms": 0, "corrupted": 0,
                     **{size: 0 for size in sizes}} for rule in RULES}
    for seed in seeds:
        for index, (m, k, n, out_dtype) in enumerate(TINY_SHAPES):
            key = jax.random.fold_in(jax.random.key(seed), index)
            a, b, c, dtypes = product(scenario, key, m, k, n, out_dtype)
            bad_STMN = with_errors(c, dtypes[2], jax.random.fold_in(key, 1), sizes, trials)
            for rule in RULES:
                fn = _check_fn(rule, scenario, dtypes)
                healthy = fn(a, b, c[None])[:, C.FLAGGED] > 0
                flagged_ST = fn(a, b, bad_STMN.reshape(-1, m, n))[:, C.FLAGGED] > 0
                t = totals[rule]
                t["healthy"] += 1
                t["false_alarms"] += int(healthy.sum())
                t["corrupted"] += trials
                for size, flags in zip(sizes, flagged_ST.reshape(len(sizes), trials)):
                    t[size] += int(flags.sum())
    return [{"scenario": scenario, "rule": rule, **t} for rule, t in totals.items()]
