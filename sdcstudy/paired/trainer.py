"""The paired-node step: a healthy and a suspect replica trained side by side in `shard_map`.

Ma et al., "Understanding Silent Data Corruption in LLM Training", section 3.2. The mesh is
(node, dp, tp): node 0 is the trusted healthy replica, node 1 the suspect, each a complete
training replica with Megatron tensor and sequence parallelism over `tp` and data parallelism
over `dp`; both run the same sharded program. Modes:

- `lockstep` (RQ1): taps at the four sites compare the suspect's tensors with the healthy ones
  bit for bit and overwrite them (`paired/lockstep.py`); parameters and optimizer state are also
  synchronized after every step, so each comparison isolates one submodule computation.
- `paramsync` (RQ2): after each optimizer step the healthy state overwrites the suspect's.
- `free` (RQ3): no synchronization.

Every state leaf carries a leading node axis of size 2. Gradient all-reduces over dp and tp are
the transposes that `check_vma` inserts for parameters that are invariant over those axes.
Metrics leave the step as replicated scalars; mismatch statistics and fault records as
(node, dp, tp, ...) blocks; nothing syncs with the host inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdcstudy import features as FT
from sdcstudy.core import config as C
from sdcstudy.core import mesh as M
from sdcstudy.core import model
from sdcstudy.core.compose import apply_update, feature_grads, feature_loss, init_sinks
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.step import Place, Records, StepOut, Where, stream_key
from sdcstudy.core.train import learning_rate_schedule, make_optimizer

PAIRED_MODES = ("lockstep", "paramsync", "free")
SYNCED_MODES = ("lockstep", "paramsync")
# The mesh axes a feature's draws and records vary over on a node of the pair.
PAIR_AXES = {"node_axis": M.NODE, "tp_axis": M.TP, "dp_axis": M.DATA}

# Megatron layout: Q, K, V, gate and up split by columns (heads, FFN units); O and down by rows.
COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up")
ROW_PARALLEL = ("wo", "w_down")


def leaf_spec(path, leaf, node: bool = True) -> P:
    """PartitionSpec of a parameter (or optimizer-state) leaf: node first, then tp layout."""
    name = getattr(path[-1], "key", None) if path else None
    lead = (M.NODE,) if node else ()
    ndim = leaf.ndim - (1 if node else 0)
    if name in COLUMN_PARALLEL and ndim == 2:
        return P(*lead, None, M.TP)
    if name in ROW_PARALLEL and ndim == 2:
        return P(*lead, M.TP, None)
    return P(*lead)


def tree_specs(tree, node: bool = True):
    return jax.tree_util.tree_map_with_path(lambda p, x: leaf_spec(p, x, node), tree)


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _block(tree):
    """Per-device values as (1, 1, 1, ...) blocks that leave shard_map by P(node, dp, tp)."""
    return jax.tree.map(lambda x: M.vary(x, M.AXES)[None, None, None], tree)


def _healthy_copy(tree):
    """Every node gets node 0's values (the healthy state overwrites the suspect's).

    Leaves that vary over the same mesh axes travel together, as the 32-bit patterns of one
    flat vector: one exchange per group instead of one per leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict = {}
    for i, x in enumerate(leaves):
        groups.setdefault((M.varying_axes(x), x.dtype.itemsize == 4), []).append(i)
    out = list(leaves)
    for (axes, word), members in groups.items():
        if not word or len(members) == 1:
            for i in members:
                out[i] = M.vary(M.broadcast_from(leaves[i], M.HEALTHY, M.NODE), axes)
            continue
        flat = jnp.concatenate([lax.bitcast_convert_type(leaves[i], jnp.uint32).reshape(-1)
                                for i in members])
        flat = M.vary(M.broadcast_from(flat, M.HEALTHY, M.NODE), axes)
        offset = 0
        for i in members:
            x = leaves[i]
            out[i] = lax.bitcast_convert_type(flat[offset:offset + x.size].reshape(x.shape),
                                              x.dtype)
            offset += x.size
    return jax.tree.unflatten(treedef, out)


def _sum_squares(tree):
    """Sum of squares over a whole sharded tree: tp-sharded leaves are summed over tp."""
    total = jnp.float32(0)
    for x in jax.tree.leaves(tree):
        sq = jnp.sum(jnp.square(x.astype(jnp.float32)))
        total += lax.psum(sq, M.TP) if M.TP in M.varying_axes(x) else M.vary(sq, ())
    return total


def _node_pair(x):
    """(healthy, suspect) values of a per-node scalar, the same on every device."""
    return M.broadcast_from(x, M.HEALTHY, M.NODE), M.broadcast_from(x, 1 - M.HEALTHY, M.NODE)


def _clip(grads, norm, max_norm):
    """Global-norm clipping with the norm of the whole sharded gradient (optax's formula)."""
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, (g / norm) * max_norm), grads)


def refuse_other_process_counts(processes: int) -> None:
    """A pair on several processes is two, node i on process i. Every process builds its
    trainer at the same point and knows the count alike, so all refuse together
    (`distributed.SharedRefusal`): a plain error here (the mesh's) ended process 0 at once and a
    slower process with jax's C++ abort, exit 134 (measured: 3 processes, lockstep)."""
    if processes not in (1, 2):
        from sdcstudy.core.distributed import SharedRefusal

        raise SharedRefusal(f"a paired mode runs on two processes (node i on process i), not "
                            f"{processes}: start 2 processes (docs/pairing.md).")


@dataclass
class PairedTrainer:
    cfg: Config
    dims: C.ModelDims
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: jax.sharding.Mesh
    faults: Any = None
    taps: Any = None
    mode: str = "lockstep"
    specs: dict = field(default_factory=dict)
    abft: Any = None
    more: dict = field(default_factory=dict)  # features registered after these, by name

    @classmethod
    def from_config(cls, cfg: Config, mesh=None, dims: C.ModelDims | None = None
                    ) -> "PairedTrainer":
        mode = cfg.experiment.mode
        if mode not in PAIRED_MODES:
            raise UserError(f"experiment.mode {mode!r} is not a paired mode "
                            f"({', '.join(PAIRED_MODES)}).")
        dims = dims or C.model_dims(cfg.model)
        tp, dp = cfg.mesh.tp, cfg.mesh.dp
        for what, n in (("model.n_heads", dims.n_heads), ("model.n_kv_heads", dims.n_kv_heads),
                        ("model.ffn_dim", dims.ffn_dim), ("data.seq_len", cfg.data.seq_len)):
            if n % tp:
                raise UserError(f"{what} ({n}) must be a multiple of mesh.tp ({tp}).")
        graphdef, _ = model.abstract_init(dims)
        steps = cfg.experiment.steps
        built = FT.by_name(FT.from_config(cfg, dims))
        if mesh is None:
            refuse_other_process_counts(jax.process_count())
        mesh = mesh or M.make_node_mesh(2, dp, tp)
        return cls(cfg, dims, graphdef, make_optimizer(cfg.optim, steps, clip=False),
                   learning_rate_schedule(cfg.optim, steps), mesh, built.pop("faults", None),
                   built.pop("taps", None), mode, abft=built.pop("abft", None), more=built)

    # --- state ---------------------------------------------------------------------------

    @property
    def base_key(self):
        return jax.random.key(self.cfg.experiment.seed)

    def state_shardings(self, state):
        specs = {"params": tree_specs(state["params"]), "opt_state": tree_specs(state["opt_state"]),
                 "step": P()}
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, P))

    def init_state(self) -> dict:
        """Both nodes start from the same parameters (the seed's), stacked on the node axis."""
        return self.pair_state(model.init_params(self.dims,
                                                 stream_key(self.base_key, "params")))

    def pair_state(self, params) -> dict:
        """The state of two nodes that both start from `params`, sharded over the mesh."""
        def init(params):
            pair = lambda t: jax.tree.map(lambda x: jnp.stack([x, x]), t)  # noqa: E731
            return {"params": pair(params), "opt_state": pair(self.tx.init(params)),
                    "step": jnp.int32(0)}
        shapes = jax.eval_shape(init, params)
        return jax.jit(init, out_shardings=self.state_shardings(shapes))(params)

    def batch_shardings(self):
        spec = NamedSharding(self.mesh, P(None, M.DATA, M.TP))
        return {"inputs": spec, "targets": spec}

    @staticmethod
    def split_batch(tokens_MBL1):
        return {"inputs": tokens_MBL1[:, :, :-1], "targets": tokens_MBL1[:, :, 1:]}

    # --- the step ------------------------------------------------------------------------

    @property
    def features(self) -> list:
        """The step features of the pair, in install order (`sdcstudy/features.py`)."""
        return FT.active(self)

    def where(self, step, microstep) -> Where:
        return Where(self.base_key, step, microstep, **PAIR_AXES)

    def _model_loss(self, params, batch, hook):
        total, count = model.sequence_losses(self.graphdef, params, batch["inputs"],
                                             batch["targets"], batch.get("mask"), hook=hook,
                                             tp_axis=M.TP)
        axes = (M.DATA, M.TP)
        return lax.psum(total, axes), lax.psum(count, axes)

    def _local_step(self, state, batch):
        params, opt_state = _squeeze(state["params"]), _squeeze(state["opt_state"])
        step = state["step"] + 1
        where_of = partial(self.where, step)
        loss, grads, features = feature_grads(
            self.features, feature_loss(self.features, self._model_loss, where_of), params,
            batch, init_sinks(self.features, M.AXES), where_of)

        grad_sq = _sum_squares(grads)
        diff_sq = _sum_squares(jax.tree.map(lambda g, h: g - h, grads, _healthy_copy(grads)))
        if self.cfg.optim.clip_norm:
            grads = _clip(grads, jnp.sqrt(grad_sq), self.cfg.optim.clip_norm)
        new = apply_update(self.tx, {"params": params, "opt_state": opt_state,
                                     "step": state["step"]}, grads, features.transform_updates)
        param_diff_sq = _sum_squares(jax.tree.map(lambda p, h: p - h, new["params"],
                                                  _healthy_copy(new["params"])))
        if self.mode in SYNCED_MODES:
            new["params"] = _healthy_copy(new["params"])
            new["opt_state"] = _healthy_copy(new["opt_state"])

        loss_h, loss_s = _node_pair(loss)
        norm_h, norm_s = (jnp.sqrt(v) for v in _node_pair(grad_sq))
        diff = jnp.sqrt(_node_pair(diff_sq)[1])
        metrics = {"loss/healthy": loss_h, "loss/suspect": loss_s, "grad/norm": norm_h,
                   "grad/norm_suspect": norm_s, "grad/diff_l2": diff, "grad/nts": diff / norm_h,
                   "param/diff_l2": jnp.sqrt(_node_pair(param_diff_sq)[1]),
                   "lr": self.schedule(state["step"])}
        out_state = {"params": _unsqueeze(new["params"]), "opt_state": _unsqueeze(new["opt_state"]),
                     "step": new["step"]}
        # Each device's records as (1, 1, 1, ...) blocks, by feature.
        records = Records((name, _block(r)) for name, r in features.records().items())
        return StepOut(out_state, metrics, records)

    def train_step(self, state, batch):
        state_specs = {"params": tree_specs(state["params"]),
                       "opt_state": tree_specs(state["opt_state"]), "step": P()}
        step = jax.shard_map(
            self._local_step, mesh=self.mesh,
            in_specs=(state_specs, {k: P(None, M.DATA, M.TP) for k in batch}),
            out_specs=StepOut(state_specs, P(), P(M.NODE, M.DATA, M.TP)), check_vma=True)
        return step(state, batch)

    # --- host-loop interface (shared with train.Trainer) ---------------------------------

    @property
    def TABLES(self):
        return FT.tables(self.features, ("faults",))  # faults.parquet even when healthy

    def shardings(self, state, batch):
        del batch
        return self.state_shardings(state), self.batch_shardings()

    def make_batch(self, tokens_MBL1) -> dict:
        return self.split_batch(tokens_MBL1)

    def places(self) -> list[Place]:
        """Every device's block of the step's records: (node, dp rank, tp rank)."""
        return [Place((n, d, t), tp_rank=t, node=n, dp_rank=d)
                for n, d, t in np.ndindex(*self.mesh.devices.shape)]

    def host_tables(self, step: int, records: dict) -> tuple[dict, dict]:
        """Host side, one step: each feature's rows and counters (mismatch rows, bit
        histograms and frequencies; fault rows; ABFT checks), from every device's block."""
        return FT.host(self.features, step, records, self.places(), self.cfg.experiment.microsteps)
