"""The bytes a paired step sends between its two nodes, derived from the step's shapes.

Each device of the healthy node has one counterpart on the suspect node (same dp and tp rank),
and every exchange of `paired/trainer.py` is between such a pair, over the `node` axis. Per
device and step, what it sends to its counterpart (it receives as much):

- lock-step comparisons (`lockstep` only): every tap all-gathers its tensor over `node`, so
  each device sends its own copy: the forward values at `attn_out` and `ffn_out` and the
  backward cotangents at `attn_in` and `ffn_in` (`paired/lockstep.py`), in every layer and
  microstep. Under tensor parallelism each tp rank holds the whole sequence there (the
  all-gathered input, the partial sum before the reduce-scatter), so one tap is
  (batch_size / dp) x seq_len x d_model elements of the compute dtype;
- the gradient copy behind `grad/diff_l2` (every paired mode): the device's gradient shards;
- the parameter copy behind `param/diff_l2`, which in `lockstep` and `paramsync` is also the
  synchronization (XLA computes the two identical copies once): the parameter shards;
- the optimizer-state copy (`lockstep`, `paramsync`): the optimizer-state shards.

Copies travel as 32-bit words whatever the dtype (`mesh.broadcast_from`: a masked integer psum
over the two nodes, exact for every bit pattern), so each element costs 4 bytes. A few scalar
metrics (the nodes' losses and norms) also cross; they are left out. A free run needs none of
this to train: its copies serve the difference metrics only. A single-node mode sends nothing.
"""

from __future__ import annotations

from sdcstudy.core.config import Config, ModelDims
from sdcstudy.paired.lockstep import SITE_NAMES
from sdcstudy.paired.trainer import PAIRED_MODES, SYNCED_MODES

COPY_WORD = 4  # bytes a copied element costs (a 32-bit word)

ITEMSIZE = {"float32": 4, "bfloat16": 2}


def tap_elements(cfg: Config, dims: ModelDims) -> int:
    """Elements one device compares at one tapped site, layer and microstep."""
    return cfg.experiment.batch_size // cfg.mesh.dp * cfg.data.seq_len * dims.d_model


def node_bytes(cfg: Config, dims: ModelDims, param_elements: int,
               opt_elements: int) -> dict[str, int]:
    """{what: bytes one device sends to its counterpart on the other node in one step}, from
    the per-device element counts of its parameter and optimizer-state shards; empty for a
    mode with one node."""
    mode = cfg.experiment.mode
    if mode not in PAIRED_MODES:
        return {}
    out = {}
    if mode == "lockstep":
        taps = cfg.experiment.microsteps * dims.n_layers * len(SITE_NAMES)
        out["lock-step comparisons"] = taps * tap_elements(cfg, dims) * ITEMSIZE[dims.dtype]
    out["gradient copy (grad/diff_l2)"] = COPY_WORD * param_elements
    if mode in SYNCED_MODES:
        out["parameter copy (param/diff_l2 and the sync)"] = COPY_WORD * param_elements
        out["optimizer-state copy (the sync)"] = COPY_WORD * opt_elements
    else:
        out["parameter copy (param/diff_l2)"] = COPY_WORD * param_elements
    return out

