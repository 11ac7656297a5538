"""What every training step shares, whatever its topology: its named output, the table of
random streams, where a step runs, and the protocol of a step feature.

A step returns `StepOut(state, metrics, records)`: the new state, the replicated scalar
metrics, and each feature's records under the feature's name ("faults", "taps", "abft", ...),
so the host loop and a trainer's `host_tables` read them by name, never by position.

A step feature (faults, lock-step taps, ABFT, ...) has two halves, after levanter's
JitCallback:
- the device half, inside the jitted step (`DeviceHalf`): the zero sinks it carries
  (backward records leave as their cotangents), its context at a `Where`, the site hooks it
  installs, optional gradient and update transforms, and the records it returns under its
  `name`;
- the host half, after the step (`HostHalf`): the run-folder tables it writes and how one
  step's records become rows and counters (`host`).
`core/` knows no feature: features implement these protocols from their own folders, are
listed in `sdcstudy/features.py`, and `core/compose.py` runs the one step over any list of
them; a trainer (a topology: one node, the pair, PAFT workers, detector executions, the
golden device) maps that over its mesh axes.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Protocol

import jax

from sdcstudy.core.sites import Hook, identity_hook


@jax.tree_util.register_pytree_with_keys_class
class Records(dict):
    """A step's records by feature name, flattened in the order the features added them (a
    plain dict flattens sorted by name): the step's outputs keep their order, and so its
    program, whatever the features are called."""

    def tree_flatten_with_keys(self):
        return [(jax.tree_util.DictKey(k), v) for k, v in self.items()], tuple(self)

    def tree_flatten(self):
        return list(self.values()), tuple(self)

    @classmethod
    def tree_unflatten(cls, names, values):
        return cls(zip(names, values))


class StepOut(NamedTuple):
    """One step's result: the new state, the metrics, and the records by feature name."""

    state: Any
    metrics: dict
    records: dict


# Every kind of randomness of a run, folded into the run's key (the seed's) under one number.
# A new kind takes the next number; a number once used keeps its meaning (checkpoints, golden
# records and replayed faults depend on it).
STREAMS = {"params": 0, "faults": 1, "paft/noise": 2, "paft/loss": 3, "paft/broadcast": 4}


def stream_key(key: jax.Array, stream: str) -> jax.Array:
    """The key of one random stream of the run whose key is `key`."""
    return jax.random.fold_in(key, STREAMS[stream])


class Place(NamedTuple):
    """Where one block of a step's records was computed: its index into the leading axes of
    the record arrays (() for a single replica), and the tp rank and node it stands for
    (node None: the one the record's own spec names)."""

    index: tuple = ()
    tp_rank: int = 0
    node: int | None = None
    dp_rank: int = 0


class SiteHooks(NamedTuple):
    """The hooks a step installs at the model's sites, as each feature adds its own
    (`install`): `full` runs at every site; `fault` is the corruption alone (ABFT checks a
    matmul's product after it); `after` runs after a checked matmul (a lock-step tap, else the
    trainer's own hook)."""

    full: Hook = identity_hook
    fault: Hook = identity_hook
    after: Hook = identity_hook

    @classmethod
    def around(cls, hook: Hook) -> "SiteHooks":
        """Where features start: the trainer's own hook (the identity by default)."""
        return cls(hook, identity_hook, hook)


class Where(NamedTuple):
    """Where and when a feature acts, as the topology running the step says: the run's key,
    the step (counted from 1), the microstep (-1: the step's own tree sites, after the
    gradients are accumulated), values folded into a feature's random stream after it (a
    device number), the mesh axes a feature's draws and records vary over, and, outside a
    node axis, the node and the execution attempt of this computation."""

    key: Any
    step: Any
    microstep: Any = -1
    fold: tuple = ()
    node_axis: str | None = None
    tp_axis: str | None = None
    dp_axis: str | None = None
    node: Any = None
    attempt: Any = None

    def at(self, microstep) -> "Where":
        return self._replace(microstep=microstep)


class DeviceHalf(Protocol):
    """The inside-the-step half of a feature, called in this order by `core.compose`:

    - `init_sinks(axes)`: its zero sinks (backward records leave as their cotangents),
      varying over the mesh axes `axes` inside shard_map;
    - per microstep, `context(where, sinks)` (what its draws need, or None) and
      `install(hooks, ctx, sinks) -> (hooks, forward records)`: its hooks on top of those
      installed before it, and the dict its forward records fill while the model is traced;
    - per step, at `where.at(-1)`: `context(where, None)`, `transform_grads(grads, ctx)`
      after accumulation, `transform_updates(updates, ctx)` inside the optimizer update, and
      `records(ctx, fwd_M, bwd_M)`: what leaves the step under its `name` (its forward and
      backward records stacked per microstep)."""

    name: ClassVar[str]

    def init_sinks(self, axes: tuple[str, ...] = ()) -> dict: ...

    def context(self, where: Where, sinks) -> Any: ...

    def install(self, hooks: SiteHooks, ctx, sinks) -> tuple[SiteHooks, dict]: ...

    def transform_grads(self, grads, ctx) -> Any: ...

    def transform_updates(self, updates, ctx) -> Any: ...

    def records(self, ctx, fwd_M: dict, bwd_M: dict) -> dict: ...


class StepFeature:
    """Defaults of a `DeviceHalf` for a feature that only observes (lock-step taps, ABFT):
    no context, no transforms, and its records as they came: {"fwd": forward records,
    "bwd": backward records}, each stacked per microstep."""

    def context(self, where: Where, sinks) -> Any:
        del where, sinks
        return None

    def transform_grads(self, grads, ctx):
        del ctx
        return grads

    def transform_updates(self, updates, ctx):
        del ctx
        return updates

    def records(self, ctx, fwd_M: dict, bwd_M: dict) -> dict:
        del ctx
        return {"fwd": fwd_M, "bwd": bwd_M}


class HostHalf(Protocol):
    """The on-the-host half of a feature: `host(step, records, places, microsteps)` gives
    ({table: rows}, counters) of one step from its records fetched to the host; `idle()` the
    same for a step of a topology that reports the feature while it is off (zero counters)."""

    tables: ClassVar[tuple[str, ...]]

    def host(self, step: int, records, places: list[Place], microsteps: int
             ) -> tuple[dict, dict]: ...


__all__ = ["DeviceHalf", "HostHalf", "Place", "Records", "STREAMS", "SiteHooks", "StepFeature",
           "StepOut", "Where", "stream_key"]
