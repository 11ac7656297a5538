"""Mesh axes, defined once, and the one function that builds a mesh.

`node` pairs a trusted healthy replica (index 0) with a suspect one (index 1); `dp` holds
data-parallel workers; `tp` tensor-parallel ranks. Every axis is Auto so that `shard_map`
accepts inputs that jit placed (see JAX-NOTES: `jax.make_mesh` now makes Explicit axes).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

NODE, DATA, TP = "node", "dp", "tp"
AXES = (NODE, DATA, TP)
HEALTHY, SUSPECT = 0, 1


def make_mesh(nodes: int = 1, dp: int = 1, tp: int = 1, devices=None) -> Mesh:
    """A (node, dp, tp) mesh over the first nodes*dp*tp devices (all processes' devices)."""
    devices = list(jax.devices() if devices is None else devices)
    need = nodes * dp * tp
    if len(devices) < need:
        from .config import UserError

        raise UserError(f"the mesh needs {need} devices (node={nodes} x dp={dp} x tp={tp}) but "
                        f"only {len(devices)} are visible; on CPU set "
                        f"XLA_FLAGS=--xla_force_host_platform_device_count={need}.")
    grid = np.array(devices[:need], dtype=object).reshape(nodes, dp, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)
