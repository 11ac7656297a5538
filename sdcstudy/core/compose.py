"""One step, composed: accumulate -> features -> corrupt -> update, written once for every
topology and any list of step features (`core.step.DeviceHalf`, in install order:
`sdcstudy/features.py`).

A topology (a trainer) supplies only what is its own: the model's loss on its layout
(`model_loss(params, batch, hook) -> (sum of losses, token count)`), where each microstep
runs (`where_of(microstep) -> core.step.Where`), its state layout and shardings, how it maps
this over its mesh axes, and its metrics. Nothing here names a feature: each is called through
the protocol in turn, so the first installed (faults) corrupts what every later one sees.

    loss_fn = feature_loss(features, model_loss, where_of)
    loss, grads, step = feature_grads(features, loss_fn, params, batch, sinks, where_of)
    new_state = apply_update(tx, state, grads, step.transform_updates)
    records = step.records()  # by feature name, after the update (it may record too)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sdcstudy.core import mesh as M
from sdcstudy.core.sites import Hook, identity_hook
from sdcstudy.core.step import Records, SiteHooks, Where


def accumulate_gradients(loss_fn: Callable, params, batch_M: dict, sinks=None):
    """Mean loss and its gradient over all microsteps' tokens.

    `loss_fn(params, sinks, batch, microstep)` returns (sum of losses, (token count, aux)) for
    one microstep's slice of `batch_M` (a dict of arrays with a leading microstep axis).
    Gradients of the sums accumulate in float32 and are divided by the total count once.
    `sinks` are zero inputs whose gradients carry backward records out of the step (see
    `faults/inject.py`, `paired/lockstep.py`); they and `aux` come back stacked per microstep.
    """
    sinks = {} if sinks is None else sinks
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def micro(grads_acc, xs):
        batch, microstep = xs
        (loss, (count, aux)), (grads, sink_grads) = grad_fn(params, sinks, batch, microstep)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return grads_acc, (loss, count, aux, sink_grads)

    # Inside shard_map the accumulator must vary over the mesh axes each gradient varies over,
    # which are its parameter's (gradients of replicated parameters are reduced).
    zeros = jax.tree.map(lambda p: M.vary(jnp.zeros(p.shape, jnp.float32), M.varying_axes(p)),
                         params)
    microsteps = jnp.arange(jax.tree.leaves(batch_M)[0].shape[0], dtype=jnp.int32)
    grads, (loss_M, count_M, aux_M, sinks_M) = jax.lax.scan(micro, zeros, (batch_M, microsteps))
    count = jnp.sum(count_M)
    return jnp.sum(loss_M) / count, jax.tree.map(lambda g: g / count, grads), (aux_M, sinks_M)


def apply_update(tx: optax.GradientTransformation, state: dict, grads,
                 transform_updates: Callable = lambda u: u) -> dict:
    params = state["params"]
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    return {"params": optax.apply_updates(params, transform_updates(updates)),
            "opt_state": opt_state, "step": state["step"] + 1}


def init_sinks(features, axes: tuple[str, ...] = ()) -> Records:
    """Every feature's zero sinks under its name, varying over `axes` (inside shard_map)."""
    return Records((f.name, f.init_sinks(axes)) for f in features)


def install(features, hooks: SiteHooks, sinks, where: Where) -> tuple[SiteHooks, Records]:
    """Each feature's hooks on top of those installed before it, and the forward records
    each fills (by name) while the model is traced with `hooks.full`."""
    forward = Records()
    for f in features:
        own = sinks[f.name]
        hooks, forward[f.name] = f.install(hooks, f.context(where, own), own)
    return hooks, forward


def feature_loss(features, model_loss: Callable, where_of: Callable[[Any], Where],
                 hook: Hook = identity_hook) -> Callable:
    """The microstep loss `accumulate_gradients` differentiates: `(params, sinks, batch,
    microstep) -> (sum of losses, (token count, forward records by feature))`, the model run
    with every feature's hooks around the topology's own `hook`."""

    def loss(params, sinks, batch, microstep):
        hooks, forward = install(features, SiteHooks.around(hook), sinks,
                                 where_of(microstep))
        total, count = model_loss(params, batch, hooks.full)
        return total, (count, forward)

    return loss


class FeatureStep(NamedTuple):
    """The features of one step after accumulation: their step contexts and the records of
    the microsteps, for the update's transforms and the step's records."""

    features: list
    contexts: list
    forward_M: Records
    backward_M: Records

    def context(self, name: str):
        """The step context of the feature called `name` (a topology's own corruption site)."""
        return dict(zip((f.name for f in self.features), self.contexts))[name]

    def transform_grads(self, grads):
        """Each feature's gradient transform in turn (the "grad" tree site)."""
        for f, ctx in zip(self.features, self.contexts):
            grads = f.transform_grads(grads, ctx)
        return grads

    def transform_updates(self, updates):
        """Each feature's update transform in turn (inside `apply_update`)."""
        for f, ctx in zip(self.features, self.contexts):
            updates = f.transform_updates(updates, ctx)
        return updates

    def records(self) -> Records:
        """What each feature returns from the step, by name; read after the update, which
        may add records of its own (an update fault)."""
        return Records((f.name, f.records(ctx, self.forward_M[f.name], self.backward_M[f.name]))
                       for f, ctx in zip(self.features, self.contexts))


def open_step(features, where: Where, records_M) -> FeatureStep:
    """The features' step contexts at `where` (the step's tree sites), with the microsteps'
    (forward, backward) records that `accumulate_gradients` returned."""
    forward_M, backward_M = records_M
    return FeatureStep(list(features), [f.context(where, None) for f in features], forward_M,
                       backward_M)


def feature_grads(features, loss_fn: Callable, params, batch_M: dict, sinks,
                  where_of: Callable[[Any], Where]):
    """(mean loss, gradients, FeatureStep): the gradients accumulated over the microsteps,
    then each feature's gradient transform at the step's tree sites (`where_of(-1)`, traced
    after the accumulation). A topology that measures the gradient before its faults calls
    `accumulate_gradients`, `open_step` and `FeatureStep.transform_grads` itself."""
    loss, grads, records_M = accumulate_gradients(loss_fn, params, batch_M, sinks)
    step = open_step(features, where_of(jnp.int32(-1)), records_M)
    return loss, step.transform_grads(grads), step


def feature_step(features, tx, state: dict, loss_fn: Callable, batch_M: dict, sinks,
                 where_of: Callable[[Any], Where]):
    """(mean loss, gradients, new state, records by feature): a whole step of a topology
    that updates right after accumulating (one node, the golden device)."""
    loss, grads, step = feature_grads(features, loss_fn, state["params"], batch_M, sinks,
                                      where_of)
    new_state = apply_update(tx, state, grads, step.transform_updates)
    return loss, grads, new_state, step.records()


__all__ = ["FeatureStep", "accumulate_gradients", "apply_update", "feature_grads", "open_step", "feature_loss", "feature_step", "init_sinks",
           "install"]
