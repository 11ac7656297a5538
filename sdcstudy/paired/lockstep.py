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
- The statistics are `paired/mismatch.py`'s vector (`mismatch.compare`); on the host,
  `LockstepTaps` decodes them into mismatch.parquet rows.

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
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from sdcstudy.core import mesh as M
from sdcstudy.core import runfolder as RF
from sdcstudy.core import sites as S
from sdcstudy.core.mesh import HEALTHY, NODE
from sdcstudy.core.step import SiteHooks, StepFeature
from sdcstudy.core.train import STEP_ONLY
from sdcstudy.paired.mismatch import ROW_STATS, STATS_LEN, compare, decode, merge

FWD_SITES = {S.ATTN_OUT: "fwd/attn", S.FFN_OUT: "fwd/ffn"}
BWD_SITES = {S.ATTN_IN: "bwd/attn", S.FFN_IN: "bwd/ffn"}
SITE_NAMES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")


def stat_key(site: str, layer: int) -> str:
    """Key of one tap in the stats and sink dicts: "fwd/attn/2"."""
    return f"{site}/{layer}"


def parse_stat_key(key: str) -> tuple[str, int]:
    site, layer = key.rsplit("/", 1)
    return site, int(layer)


# --- forward tap: compare the value, return the healthy one -----------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fwd_tap(x, node_axis, stats_axes):
    gathered = lax.all_gather(x, node_axis)
    healthy = M.vary(gathered[HEALTHY], tuple(M.varying_axes(x)))
    return healthy, M.vary(compare(gathered[HEALTHY], gathered[1 - HEALTHY]), stats_axes)


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
    healthy = M.vary(gathered[HEALTHY], x_axes)
    return healthy, M.vary(compare(gathered[HEALTHY], gathered[1 - HEALTHY]), sink_axes)


_bwd_tap.defvjp(_bwd_tap_fwd, _bwd_tap_bwd)


def backward_tap(x, sink, *, node_axis: str = NODE):
    """Identity; in the backward, the healthy cotangent to both nodes, the stats to `sink`."""
    with jax.named_scope("lockstep_bwd"):
        return _bwd_tap(x, sink, node_axis, tuple(sorted(M.varying_axes(x))),
                        tuple(sorted(M.varying_axes(sink))))


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


def site_frequencies(rows: list[dict]) -> dict:
    """{"freq/<site>": mismatching elements / elements compared} of one step's mismatch rows:
    eqs. (1)-(2) over the step's microsteps, layers and tp ranks (docs/metrics.md)."""
    totals = {}
    for r in rows:
        n, e = totals.get(r["site"], (0, 0))
        totals[r["site"]] = (n + int(r["mismatches"]), e + int(r["elements"]))
    return {f"freq/{site}": n / e for site, (n, e) in totals.items() if e}


class LockstepTaps(StepFeature):
    """The taps of one model, and the host-side decoding of their statistics: the lock-step
    step feature ("taps"; device half `init_sinks`, `install`, with `core.step.StepFeature`'s
    defaults; host half `host`).

    Inside the shard_mapped step (mesh axes node, and dp / tp where given)::

        taps = LockstepTaps(dims.n_layers, tp_axis=TP)
        params = M.vary(params, (NODE,))  # each node its own copy, before the grad
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

    name = "taps"
    tables = (RF.MISMATCH,)

    def __init__(self, n_layers: int, tp_axis: str | None = None, *, dp_axis: str | None = None,
                 node_axis: str = NODE):
        self.n_layers = n_layers
        self.node_axis, self.dp_axis, self.tp_axis = node_axis, dp_axis, tp_axis
        self.stats_axes = tuple(a for a in (node_axis, dp_axis, tp_axis) if a is not None)

    @classmethod
    def from_config(cls, cfg, dims) -> "LockstepTaps | None":
        """The taps of the pair's mesh (node, dp, tp) in lockstep mode; else None."""
        if cfg.experiment.mode != "lockstep":
            return None
        return cls(dims.n_layers, tp_axis=M.TP, dp_axis=M.DATA)

    def keys(self, direction: str) -> list[str]:
        """Stat keys of one direction ("fwd" or "bwd"), layers 1..n_layers."""
        return [stat_key(site, layer) for layer in range(1, self.n_layers + 1)
                for site in SITE_NAMES if site.startswith(direction)]

    def init_sinks(self, axes: tuple[str, ...] = ()) -> dict[str, jax.Array]:
        """Zero sinks, one per (bwd site, layer), varying over the taps' own axes (`axes`
        aside); call inside shard_map, differentiate by them."""
        del axes
        return {k: M.vary(jnp.zeros((STATS_LEN,), jnp.float32), self.stats_axes)
                for k in self.keys("bwd")}

    def hook(self, sinks: dict) -> TapHook:
        """A fresh hook for one traced forward pass; read `.fwd_stats` after it."""
        return TapHook(self, sinks)

    def install(self, hooks: SiteHooks, ctx, sinks: dict) -> tuple[SiteHooks, dict]:
        """A fresh tap placed where it sees the faults installed before it
        (`compose_with_injector`), and after a checked matmul; its forward statistics."""
        del ctx
        tap = self.hook(sinks)
        return hooks._replace(full=compose_with_injector(tap, hooks.fault), after=tap), \
            tap.fwd_stats

    def host(self, step: int, records: dict, places, microsteps: int) -> tuple[dict, dict]:
        """mismatch.parquet rows of one step's (node, dp, tp, microstep) records, the
        mismatches counter, this step's frequency per site and the bit histograms."""
        del places  # the taps decode every device's block themselves (`decoded`)
        rows, hist = [], {}
        for m in range(microsteps):
            fwd = {k: v[:, :, :, m] for k, v in records["fwd"].items()}
            bwd = {k: v[:, :, :, m] for k, v in records["bwd"].items()}
            rows += self.rows(fwd, bwd, step, m)
            for (_, site, _), counts in self.bit_histograms(fwd, bwd).items():
                hist[site] = hist.get(site, 0) + np.asarray(counts, np.int64)
        return {RF.MISMATCH: rows}, {"mismatches": int(sum(r["mismatches"] for r in rows)),
                                     STEP_ONLY: site_frequencies(rows), "bit_histograms": hist}

    @property
    def out_spec(self) -> P:
        """out_specs for `expand`ed stats: (node, dp, tp, STATS_LEN) globally."""
        return P(self.node_axis, self.dp_axis, self.tp_axis, None)

    def expand(self, stats: dict) -> dict:
        """Per-device stats as (1, 1, 1, STATS_LEN) blocks, to leave shard_map by `out_spec`."""
        return {k: M.vary(v, self.stats_axes).reshape(1, 1, 1, STATS_LEN)
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
        """mismatch.parquet rows (docs/metrics.md) for one microstep.

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
