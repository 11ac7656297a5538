"""Fault injection as a step feature: the one place a trainer gets its injector, its fault
key and its fault rows from.

Device half (`core.step.DeviceHalf`): `context` (the fault key from the run's "faults" stream,
`core.step.STREAMS`, at a `core.step.Where`), `install` (forward and backward sites),
`transform_grads` and `transform_updates` (the "grad" and "update" tree sites), `init_sinks`
and `records` (what leaves the step under "faults").
Host half: `host` turns one step's records into faults.parquet rows and the
`faults/landed` and `faults/unlogged` counters, for any layout of replicas (`core.step.Place`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax

from sdcstudy.core import mesh as M
from sdcstudy.core import runfolder as RF
from sdcstudy.core import sites as S
from sdcstudy.core.step import Place, SiteHooks, Where, stream_key
from sdcstudy.faults import inject as F
from sdcstudy.faults import profiles
from sdcstudy.faults.specs import Profile


@dataclass
class Faults:
    """A profile's faults on one model (`injector`), as a step feature."""

    name: ClassVar[str] = "faults"
    tables: ClassVar[tuple[str, ...]] = (RF.FAULTS,)

    injector: F.Injector

    @classmethod
    def from_profile(cls, profile: Profile, n_layers: int, limit: int = 64,
                     seed: int | None = None) -> "Faults | None":
        """The feature for `profile`, or None for a healthy one (nothing to inject)."""
        return None if profile.healthy else cls(F.Injector(profile, n_layers, limit, seed))

    @classmethod
    def from_config(cls, cfg, dims, fault_kind: str | None = None) -> "Faults | None":
        """`suspect.profile` with `suspect.log_limit` and `suspect.fault_seed` (None for a
        healthy profile); `dims`: the model's `core.config.ModelDims`."""
        profile = profiles.load_for(cfg, fault_kind)
        return cls.from_profile(profile, dims.n_layers, cfg.suspect.log_limit,
                                cfg.suspect.fault_seed)

    @property
    def profile(self) -> Profile:
        return self.injector.profile

    # --- device half ------------------------------------------------------------------------

    def init_sinks(self, axes: tuple[str, ...] = ()) -> dict:
        return M.vary(self.injector.init_sinks(), axes)

    def context(self, where: Where, sinks=None) -> F.FaultContext:
        """The context of one (step, microstep) at `where`: the run's fault stream, with
        `where.fold` (e.g. a device number) folded in after it, and the topology's axes,
        node and attempt."""
        key = stream_key(where.key, "faults")
        for value in where.fold:
            key = jax.random.fold_in(key, value)
        return F.FaultContext(key, where.step, where.microstep, sinks, node_axis=where.node_axis,
                              tp_axis=where.tp_axis, dp_axis=where.dp_axis, node=where.node,
                              attempt=where.attempt)

    def install(self, hooks: SiteHooks, ctx: F.FaultContext, sinks=None
                ) -> tuple[SiteHooks, dict]:
        """Corrupt first: every later hook (tap, check) sees the corrupted value."""
        del sinks  # in `ctx`
        inject = self.injector.hook(ctx)
        return hooks._replace(full=S.compose(inject, hooks.full), fault=inject), ctx.records

    def direction_hooks(self, ctx: F.FaultContext) -> tuple[S.Hook, S.Hook]:
        """(forward-only, backward-only) hooks with the same draws as `install`'s."""
        return tuple(_only(self.injector, d).hook(ctx) for d in ("fwd", "bwd"))

    def transform_grads(self, grads, ctx: F.FaultContext, site: str = "grad"):
        """The faults of the tree site `site` (the gradient by default; a topology may name
        one of its own, such as a collective's)."""
        return self.injector.corrupt_tree(grads, ctx, site)

    def transform_updates(self, updates, ctx: F.FaultContext):
        return self.injector.corrupt_tree(updates, ctx, "update")

    def records(self, ctx: F.FaultContext, fwd_M: dict, bwd_M: dict) -> dict:
        """What leaves the step: the microsteps' records (forward and backward, stacked per
        microstep) and the step's own (tree sites), which fill until the step is traced."""
        return {"micro": {**fwd_M, **bwd_M}, "step": ctx.records}

    # --- host half ----------------------------------------------------------------------------

    def rows(self, records: dict, step: int, places: list[Place], microsteps: int
             ) -> tuple[list[dict], int]:
        """faults.parquet rows of one step's records fetched to the host, and how many
        corruptions landed beyond the log limit. Each place's step records come first, then
        its microsteps' in order."""
        rows, overflow = [], 0
        profile = self.injector.profile
        for place in places:
            at = lambda tree: jax.tree.map(lambda a: a[place.index], tree)  # noqa: E731
            ranks = {"tp_rank": place.tp_rank, "dp_rank": place.dp_rank, "node": place.node}
            r, o = F.record_rows(at(records["step"]), step, -1, profile, **ranks)
            rows += r
            overflow += o
            micro = at(records.get("micro", {}))
            for m in range(microsteps if micro else 0):
                r, o = F.record_rows({k: v[m] for k, v in micro.items()}, step, m, profile,
                                     **ranks)
                rows += r
                overflow += o
        return rows, overflow

    def host(self, step: int, records: dict, places: list[Place], microsteps: int
             ) -> tuple[dict, dict]:
        rows, overflow = self.rows(records, step, places, microsteps)
        return {RF.FAULTS: rows}, counters(len(rows), overflow)

    @staticmethod
    def idle() -> tuple[dict, dict]:
        """A step with no faults to inject: no rows, zero counters."""
        return {RF.FAULTS: []}, counters()


def counters(rows: int = 0, overflow: int = 0) -> dict:
    """The fault counters of one step (zeros for a node that injects nothing)."""
    return {"faults/landed": rows + overflow, "faults/unlogged": overflow}


def _only(injector: F.Injector, direction: str) -> F.Injector:
    """The same injector (same spec indices, so the same draws) restricted to one direction."""
    part = F.Injector(injector.profile, injector.n_layers, injector.limit, injector.seed)
    part.model_specs = [(i, s) for i, s in injector.model_specs if s.direction == direction]
    part.tree_specs = []
    return part


__all__ = ["Faults", "counters"]
