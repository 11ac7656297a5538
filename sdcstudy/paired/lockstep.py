"""Lock-step computation synchronization: compare a suspect node with a healthy one, per site.

Ma et al., "Understanding Silent Data Corruption in LLM Training", section 4 and appendix C.1:
the healthy node (index 0 on the `node` mesh axis) and the suspect node (index 1) run the same
training step; at each of the four sites the suspect's tensor is compared bit for bit with the
healthy one, and then overwritten by it, so an error never propagates past the site where it
appeared and every site sees the same inputs on both nodes.

- Forward taps (`fwd/attn`, `fwd/ffn`: the values at `attn_out`, `ffn_out`) all-gather the
  tensor over `node`, return the healthy copy to both nodes, and hand back their statistics
  (the hook records them; the loss function returns them as `aux`). Their backward passes each
  node's own cotangent through unchanged.
- Backward taps (`bwd/attn`, `bwd/ffn`: the cotangents arriving at `attn_in`, `ffn_in`) are the
  identity in the forward; their backward all-gathers the cotangent, returns the healthy one to
  both nodes, and returns the statistics as the cotangent of a zero "sink" input, so that
  differentiating the loss with respect to the sinks yields them with no host sync.

Both run inside `jax.shard_map` over a mesh whose `node` axis has size 2; each device sees its
own node's (and tp rank's) tensor. Both nodes compute the same statistics from the gathered pair.

Composition with fault injection (see `compose_with_injector`): an injector that corrupts a
forward value must run BEFORE the forward tap, so the tap compares what it corrupted; an
injector that corrupts a cotangent at a backward site must come AFTER the identity-forward
backward tap in forward order, so that its backward runs first and the tap sees the corrupted
cotangent. `sites.compose(inject, taps)` gets the first right and the second wrong: the
cotangent corruption slips past its own tap and is reported, spread over many elements, by the
next backward tap upstream. A forward corruption should pass the gradient straight through
(hardware corrupts a result, not its derivative): one with a zero or different derivative (a
`jnp.where` on a bitcast, a scale) changes the suspect's cotangent, which the backward taps then
report as mismatches that no hardware produced.

Forward statistics leave through a Python dict filled while the hook is traced, so the model
must call the hook in the traced function itself (a Python loop over layers, as `model.py`
has), not inside `lax.scan` or `jax.checkpoint`; backward statistics have no such limit.

Statistics vector (float32, `STATS_LEN` entries per tap and device): every count is an exact
integer held as a (hi, lo) pair, n = hi * 2**12 + lo: float32 holds integers exactly only below
2**24, and one llama3-8b tensor per rank has more elements than that. With 12 low bits, sums of
up to 4096 vectors (microsteps, dp workers) still decode exactly. Relative errors are held as a
sum and a max scaled by 2**-REL_EXP, with the per-tap integer exponent REL_EXP: flipping the top
exponent bit of a value below 1 gives a relative error above 2**128, beyond float32's range.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from sdcstudy.core import sites as S
from sdcstudy.core.mesh import HEALTHY, NODE

# --- statistics layout ------------------------------------------------------------------------
COUNT_BITS = 12  # a count n is stored as (n >> 12, n & 4095), both exact in float32
# Offsets of the (hi, lo) pairs.
MISMATCHES = 0  # elements whose bits differ
ELEMENTS = 2  # elements compared (this device's tensor)
FINITE_MISMATCHES = 4  # mismatches with both values finite: those in the severity mean
NONFINITE = 6  # mismatches whose suspect value is Inf or NaN
REL_SUM = 8  # sum of relative errors of the finite mismatches, times 2**-REL_EXP
REL_MAX = 9  # their max, times 2**-REL_EXP
REL_EXP = 10  # an integer exponent shared by REL_SUM and REL_MAX
BIT_HIST = 16  # 32 (hi, lo) pairs: elements differing in bit b at BIT_HIST + 2b (bit 0 = lsb)
HIST_BITS = 32  # bfloat16 uses the low 16
STATS_LEN = BIT_HIST + 2 * HIST_BITS

FWD_SITES = {S.ATTN_OUT: "fwd/attn", S.FFN_OUT: "fwd/ffn"}
BWD_SITES = {S.ATTN_IN: "bwd/attn", S.FFN_IN: "bwd/ffn"}
SITE_NAMES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")

# float32 and bfloat16 share the exponent field (8 bits, bias 127); they differ in mantissa bits.
_MANTISSA = {jnp.dtype(jnp.float32): 23, jnp.dtype(jnp.bfloat16): 7}
_UINT = {jnp.dtype(jnp.float32): jnp.uint32, jnp.dtype(jnp.bfloat16): jnp.uint16}
_NO_EXPONENT = -(2 ** 20)
CHUNK = 8192  # elements per chunk of the mismatch statistics


def stat_key(site: str, layer: int) -> str:
    """Key of one tap in the stats and sink dicts: "fwd/attn/2"."""
    return f"{site}/{layer}"


def parse_stat_key(key: str) -> tuple[str, int]:
    site, layer = key.rsplit("/", 1)
    return site, int(layer)


# --- exact counts -----------------------------------------------------------------------------


def encode_count(n) -> jax.Array:
    """float32 (hi, lo) pair that holds the non-negative integer count `n` (< 2**32) exactly."""
    n = jnp.asarray(np.uint32(n) if isinstance(n, int) else n).astype(jnp.uint32)
    return jnp.stack([(n >> COUNT_BITS).astype(jnp.float32),
                      (n & ((1 << COUNT_BITS) - 1)).astype(jnp.float32)])


def decode_count(hi, lo) -> int:
    """Host side: the integer a (hi, lo) pair holds (also after summing pairs)."""
    hi, lo = float(hi), float(lo)
    if not (hi.is_integer() and lo.is_integer()):
        raise ValueError(f"({hi}, {lo}) is not an encoded count.")
    return (int(hi) << COUNT_BITS) + int(lo)


# --- the comparison, on device ----------------------------------------------------------------


def _decompose(bits, mantissa: int):
    """Exact (significand, exponent, negative, nonfinite) with value = ±sig * 2**exp.

    Read from the bits rather than with float arithmetic: XLA on CPU flushes subnormals to zero.
    """
    bits = bits.astype(jnp.uint32)
    field = (bits >> mantissa) & 0xFF
    fraction = bits & ((1 << mantissa) - 1)
    normal = field > 0
    sig = jnp.where(normal, fraction | (1 << mantissa), fraction)
    exp = jnp.where(normal, field, 1).astype(jnp.int32) - (127 + mantissa)
    return sig, exp, (bits >> (mantissa + 8)) & 1 == 1, field == 0xFF


def compare(healthy, suspect) -> jax.Array:
    """The `STATS_LEN` statistics vector of a suspect tensor against the healthy one."""
    dtype = jnp.dtype(healthy.dtype)
    if dtype not in _MANTISSA or suspect.dtype != dtype or suspect.shape != healthy.shape:
        raise TypeError(f"lock-step taps compare two float32 or bfloat16 tensors of one shape, "
                        f"got {healthy.dtype}{healthy.shape} and {suspect.dtype}{suspect.shape}.")
    bits_h = lax.bitcast_convert_type(healthy, _UINT[dtype]).reshape(-1)
    bits_s = lax.bitcast_convert_type(suspect, _UINT[dtype]).reshape(-1)
    # Mismatches are rare: the statistics are computed only when there is one (a device-side
    # branch, no host sync); a clean comparison costs one pass and a reduction.
    clean = jnp.concatenate([jnp.zeros(ELEMENTS, jnp.float32), encode_count(healthy.size),
                             jnp.zeros(STATS_LEN - ELEMENTS - 2, jnp.float32)])
    return lax.cond(jnp.any(bits_h != bits_s),
                    lambda: _mismatch_stats(bits_h, bits_s, _MANTISSA[dtype]),
                    lambda: vary(clean, tuple(_vma(bits_h))))


def _chunk_size(n: int) -> int:
    """The largest divisor of n up to CHUNK (n itself when no divisor is at least CHUNK / 64)."""
    for size in range(min(n, CHUNK), CHUNK // 64 - 1, -1):
        if n % size == 0:
            return size
    return n


def _mismatch_stats(bits_h, bits_s, mantissa: int) -> jax.Array:
    """Statistics of a tensor pair with at least one mismatch, `CHUNK` elements at a time.

    Chunks keep the branch's temporaries small: XLA plans memory for an untaken branch too, and
    a whole-tensor pass would need several tensor-sized buffers at every tap. Each chunk holds
    its relative errors scaled by its own exponent; the chunks are rescaled to the largest.
    Per chunk, the bit histogram's (chunk, 32) intermediate stays small and compiles fast.
    """
    size = _chunk_size(bits_h.size)
    per_chunk = lax.map(lambda hs: _chunk_stats(hs[0], hs[1], mantissa),
                        (bits_h.reshape(-1, size), bits_s.reshape(-1, size)))
    counts, rel_sum, rel_max, exponent = per_chunk
    counted = exponent != _NO_EXPONENT
    shared = jnp.max(exponent, initial=_NO_EXPONENT)
    shared = jnp.where(shared == _NO_EXPONENT, 0, shared)
    rescale = lambda x: jnp.where(counted, jnp.ldexp(x, exponent - shared), 0.0)  # noqa: E731
    totals = jnp.sum(counts, axis=0, dtype=jnp.uint32)
    return jnp.concatenate([
        encode_count(totals[0]), encode_count(bits_h.size), encode_count(totals[1]),
        encode_count(totals[2]),
        jnp.stack([jnp.sum(rescale(rel_sum)), jnp.max(rescale(rel_max), initial=0.0),
                   shared.astype(jnp.float32)]),
        jnp.zeros(BIT_HIST - REL_EXP - 1, jnp.float32),
        encode_count(totals[3:]).T.reshape(-1),
    ])


def _chunk_stats(bits_h, bits_s, mantissa: int):
    """(counts: mismatches, finite mismatches, nonfinite, 32 per-bit; sum and max of the relative
    errors times 2**-exponent; exponent, or _NO_EXPONENT when no finite value differs)."""
    differ = bits_h != bits_s
    sig_h, exp_h, neg_h, nonfinite_h = _decompose(bits_h, mantissa)
    sig_s, exp_s, neg_s, nonfinite_s = _decompose(bits_s, mantissa)
    finite = differ & ~nonfinite_h & ~nonfinite_s

    # |f' - f| / |f| = ratio * 2**(top - exp_q), with |f| = sig_q * 2**exp_q (the smallest
    # normal when f is zero) and both values scaled by 2**-top before they are subtracted.
    top = jnp.maximum(exp_h, exp_s)
    value_h = jnp.ldexp(jnp.where(neg_h, -1.0, 1.0) * sig_h.astype(jnp.float32), exp_h - top)
    value_s = jnp.ldexp(jnp.where(neg_s, -1.0, 1.0) * sig_s.astype(jnp.float32), exp_s - top)
    zero_h = sig_h == 0
    sig_q = jnp.where(zero_h, 1 << mantissa, sig_h).astype(jnp.float32)
    exp_q = jnp.where(zero_h, 1 - 127 - mantissa, exp_h)
    ratio = jnp.abs(value_s - value_h) / sig_q
    fraction, exp_r = jnp.frexp(ratio)
    counted = finite & (ratio > 0)
    exponent = jnp.where(counted, exp_r + top - exp_q, _NO_EXPONENT)
    shared = jnp.max(exponent, initial=_NO_EXPONENT)
    # eq. (3), Ma et al.: relative differences of the mismatching elements, scaled by 2**-shared.
    scaled = jnp.where(counted, jnp.ldexp(fraction, exponent - shared), 0.0)

    xor = (bits_h ^ bits_s).astype(jnp.uint32)
    count = lambda mask: jnp.sum(mask, dtype=jnp.uint32)  # noqa: E731
    per_bit = jnp.sum((xor[:, None] >> jnp.arange(HIST_BITS, dtype=jnp.uint32)) & 1, axis=0,
                      dtype=jnp.uint32)
    counts = jnp.concatenate([jnp.stack([count(differ), count(finite), count(differ & nonfinite_s)]),
                              per_bit])
    return counts, jnp.sum(scaled), jnp.max(scaled, initial=0.0), shared


# --- varying-manual-axes bookkeeping (check_vma=True) -----------------------------------------


def _vma(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10 keeps it here; earlier versions on `.vma`
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary(tree, axes):
    """`tree`'s arrays marked as varying over `axes` inside shard_map (a no-op at run time; with
    check_vma=True it decides what out_specs may name and what autodiff sums)."""
    def one(x):
        missing = tuple(a for a in axes if a not in _vma(x))
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


# --- forward tap: compare the value, return the healthy one -----------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fwd_tap(x, node_axis, stats_axes):
    gathered = lax.all_gather(x, node_axis)
    healthy = vary(gathered[HEALTHY], tuple(_vma(x)))
    return healthy, vary(compare(gathered[HEALTHY], gathered[1 - HEALTHY]), stats_axes)


def _fwd_tap_fwd(x, node_axis, stats_axes):
    return _fwd_tap(x, node_axis, stats_axes), None


def _fwd_tap_bwd(node_axis, stats_axes, residuals, cts):
    del node_axis, stats_axes, residuals
    ct_x, _ = cts  # each node's own cotangent goes on unchanged
    return (ct_x,)


_fwd_tap.defvjp(_fwd_tap_fwd, _fwd_tap_bwd)


def forward_tap(x, *, node_axis: str = NODE, stats_axes: tuple[str, ...] = (NODE,)):
    """(healthy x on both nodes, stats varying over `stats_axes`) inside shard_map."""
    with jax.named_scope("lockstep_fwd"):
        return _fwd_tap(x, node_axis, tuple(stats_axes))


# --- backward tap: identity forward, compare the cotangent ------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _bwd_tap(x, sink, node_axis, x_axes, sink_axes):
    del sink, node_axis, x_axes, sink_axes
    return x


def _bwd_tap_fwd(x, sink, node_axis, x_axes, sink_axes):
    del sink, node_axis, x_axes, sink_axes
    return x, None


def _bwd_tap_bwd(node_axis, x_axes, sink_axes, residuals, ct):
    del residuals
    gathered = lax.all_gather(ct, node_axis)
    healthy = vary(gathered[HEALTHY], x_axes)
    return healthy, vary(compare(gathered[HEALTHY], gathered[1 - HEALTHY]), sink_axes)


_bwd_tap.defvjp(_bwd_tap_fwd, _bwd_tap_bwd)


def backward_tap(x, sink, *, node_axis: str = NODE):
    """Identity; in the backward, the healthy cotangent to both nodes, the stats to `sink`."""
    with jax.named_scope("lockstep_bwd"):
        return _bwd_tap(x, sink, node_axis, tuple(sorted(_vma(x))), tuple(sorted(_vma(sink))))


# --- the hook ---------------------------------------------------------------------------------


class TapHook:
    """A `sites.Hook` that taps the paper's four sites. `fwd_stats` fills while it is traced."""

    def __init__(self, taps: "LockstepTaps", sinks: dict):
        self.taps, self.sinks = taps, sinks
        self.fwd_stats: dict[str, jax.Array] = {}

    def __call__(self, site: str, x, layer: int):
        if layer < 1:
            return x
        if site in FWD_SITES:
            x, stats = forward_tap(x, node_axis=self.taps.node_axis,
                                   stats_axes=self.taps.stats_axes)
            self.fwd_stats[stat_key(FWD_SITES[site], layer)] = stats
        elif site in BWD_SITES:
            x = backward_tap(x, self.sinks[stat_key(BWD_SITES[site], layer)],
                             node_axis=self.taps.node_axis)
        return x


def compose_with_injector(tap_hook: S.Hook, inject_hook: S.Hook | None) -> S.Hook:
    """One hook with fault injection placed where the taps see it.

    At forward tap sites the injector runs first (the tap compares the corrupted value). At
    backward tap sites it runs after the tap in forward order, so its backward (which corrupts
    the cotangent) runs before the tap's backward compares. Elsewhere only the injector runs.
    """
    if inject_hook is None or inject_hook is S.identity_hook:
        return tap_hook

    def composed(site: str, x, layer: int):
        if site in BWD_SITES:
            return inject_hook(site, tap_hook(site, x, layer), layer)
        return tap_hook(site, inject_hook(site, x, layer), layer)

    return composed


class LockstepTaps:
    """The taps of one model, and the host-side decoding of their statistics.

    Inside the shard_mapped step (mesh axes node, and dp / tp where given)::

        taps = LockstepTaps(dims.n_layers, tp_axis=TP)
        params = lockstep.vary(params, (NODE,))  # each node its own copy, before the grad
        def loss_fn(params, sinks):
            tap = taps.hook(sinks)
            hook = compose_with_injector(tap, inject)  # inject may be None
            loss, count = model.sequence_losses(graphdef, params, inputs, targets, hook=hook,
                                                tp_axis=TP)
            return loss, tap.fwd_stats
        (loss, fwd), (grads, bwd) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
            params, taps.init_sinks())
        return ..., taps.expand(fwd), taps.expand(bwd)     # out_specs: taps.out_spec

    `params` must vary over `node` before `value_and_grad`, or their gradients are summed over
    both nodes. On the host, `taps.rows(fwd, bwd, step, microstep)` gives mismatch.parquet rows
    and `taps.bit_histograms(fwd, bwd)` the per-bit counts.
    """

    def __init__(self, n_layers: int, tp_axis: str | None = None, *, dp_axis: str | None = None,
                 node_axis: str = NODE):
        self.n_layers = n_layers
        self.node_axis, self.dp_axis, self.tp_axis = node_axis, dp_axis, tp_axis
        self.stats_axes = tuple(a for a in (node_axis, dp_axis, tp_axis) if a is not None)

    def keys(self, direction: str) -> list[str]:
        """Stat keys of one direction ("fwd" or "bwd"), layers 1..n_layers."""
        return [stat_key(site, layer) for layer in range(1, self.n_layers + 1)
                for site in SITE_NAMES if site.startswith(direction)]

    def init_sinks(self) -> dict[str, jax.Array]:
        """Zero sinks, one per (bwd site, layer); call inside shard_map, differentiate by them."""
        return {k: vary(jnp.zeros((STATS_LEN,), jnp.float32), self.stats_axes)
                for k in self.keys("bwd")}

    def hook(self, sinks: dict) -> TapHook:
        """A fresh hook for one traced forward pass; read `.fwd_stats` after it."""
        return TapHook(self, sinks)

    @property
    def out_spec(self) -> P:
        """out_specs for `expand`ed stats: (node, dp, tp, STATS_LEN) globally."""
        return P(self.node_axis, self.dp_axis, self.tp_axis, None)

    def expand(self, stats: dict) -> dict:
        """Per-device stats as (1, 1, 1, STATS_LEN) blocks, to leave shard_map by `out_spec`."""
        return {k: vary(v, self.stats_axes).reshape(1, 1, 1, STATS_LEN)
                for k, v in stats.items()}

    def decoded(self, fwd_stats: dict, bwd_stats: dict) -> dict:
        """{(layer, site, tp_rank): decoded stats} from (node, dp, tp, STATS_LEN) host arrays.

        The healthy node's copy is read; dp workers' statistics are merged (counts summed,
        severity the mean over all their finite mismatches)."""
        out = {}
        for key, array in {**fwd_stats, **bwd_stats}.items():
            array = np.asarray(array, np.float64)
            if array.ndim != 4 or array.shape[-1] != STATS_LEN:
                raise ValueError(f"stats {key!r} have shape {array.shape}; expected (node, dp, "
                                 f"tp, {STATS_LEN}) as `expand` and `out_spec` give.")
            site, layer = parse_stat_key(key)
            for rank in range(array.shape[2]):
                out[(layer, site, rank)] = merge([decode(v) for v in array[HEALTHY, :, rank]])
        return out

    def rows(self, fwd_stats: dict, bwd_stats: dict, step: int, microstep: int,
             elements_by_site: dict | None = None) -> list[dict]:
        """mismatch.parquet rows (CONTRACT.md) for one microstep.

        `elements_by_site` ({site: n} or {(site, layer): n}), when given, is checked against
        the element counts the taps measured."""
        rows = []
        decoded = self.decoded(fwd_stats, bwd_stats)
        for layer, site, rank in sorted(decoded, key=lambda k: (k[0], SITE_NAMES.index(k[1]),
                                                                 k[2])):
            d = decoded[(layer, site, rank)]
            if elements_by_site is not None:
                want = elements_by_site.get((site, layer), elements_by_site.get(site))
                if want is not None and want != d["elements"]:
                    raise ValueError(f"{site} layer {layer} rank {rank}: the tap compared "
                                     f"{d['elements']} elements, not {want}.")
            rows.append({"step": step, "microstep": microstep, "layer": layer, "site": site,
                         "tp_rank": rank, **{k: d[k] for k in ROW_STATS}})
        return rows

    def bit_histograms(self, fwd_stats: dict, bwd_stats: dict) -> dict:
        """{(layer, site, tp_rank): int64 array of 32 per-bit mismatch counts}."""
        return {k: d["bits"] for k, d in self.decoded(fwd_stats, bwd_stats).items()}


# --- host-side decoding -----------------------------------------------------------------------
ROW_STATS = ("mismatches", "elements", "severity", "max_rel_err", "nonfinite")


def decode(vector) -> dict:
    """Host side: one statistics vector as python numbers, as `stats.mismatch_stats` gives them,
    plus `finite` (mismatches in the severity mean), `rel_sum` and `bits` (per-bit counts)."""
    v = np.asarray(vector, np.float64)
    count = lambda at: decode_count(v[at], v[at + 1])  # noqa: E731
    scale = 2.0 ** int(v[REL_EXP])
    finite = count(FINITE_MISMATCHES)
    rel_sum = float(v[REL_SUM]) * scale
    return {"mismatches": count(MISMATCHES), "elements": count(ELEMENTS),
            "severity": rel_sum / finite if finite else 0.0,
            "max_rel_err": float(v[REL_MAX]) * scale, "nonfinite": count(NONFINITE),
            "finite": finite, "rel_sum": rel_sum,
            "bits": np.array([count(BIT_HIST + 2 * b) for b in range(HIST_BITS)], np.int64)}


def merge(parts: list[dict]) -> dict:
    """Decoded stats of several tensors (e.g. dp workers) as if they were one."""
    if len(parts) == 1:
        return parts[0]
    finite = sum(p["finite"] for p in parts)
    rel_sum = sum(p["rel_sum"] for p in parts)
    return {"mismatches": sum(p["mismatches"] for p in parts),
            "elements": sum(p["elements"] for p in parts),
            "severity": rel_sum / finite if finite else 0.0,
            "max_rel_err": max(p["max_rel_err"] for p in parts),
            "nonfinite": sum(p["nonfinite"] for p in parts),
            "finite": finite, "rel_sum": rel_sum, "bits": sum(p["bits"] for p in parts)}
