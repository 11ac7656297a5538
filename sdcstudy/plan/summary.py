"""The plan of one configuration: the numbers `sdcstudy plan` prints and writes as JSON.

Everything is per device of the mode's mesh unless a key says otherwise:

- `state`: parameter and optimizer-state bytes from the abstract state's shardings;
- `memory`: XLA's memory analysis of the compiled step (arguments, outputs, donated, temporary,
  and what a device needs in all), `aot.Program.memory`;
- `flops`: the model FLOPs of one node's step (`bench/roofline.py`'s count over the step's
  microsteps x batch_size sequences), that divided over the node's dp x tp devices, and XLA's
  own per-device count when its backend has a cost model;
- `node_bytes`: what a device sends to its counterpart on the other node (`crossing.py`);
- `devices`: per named device, whether the need fits and the step time at an MFU.
"""

from __future__ import annotations

import jax

from sdcstudy.bench import roofline
from sdcstudy.core.config import Config
from sdcstudy.plan import devices as DV
from sdcstudy.plan.aot import Program, shards
from sdcstudy.plan.crossing import node_bytes


def flops(cfg: Config, dims, program: Program) -> dict:
    e = cfg.experiment
    node = roofline.step_flops(dims, e.microsteps * e.batch_size, cfg.data.seq_len)
    return {"node": node, "device": node / (cfg.mesh.dp * cfg.mesh.tp),
            "xla_device": program.xla_flops()}


def device_rows(cfg: Config, need: int | None, flops_per_device: float, names, mfu) -> list:
    rows = []
    for name in names:
        dev = DV.device(name)
        row = {"device": name, "memory": dev.memory,
               **DV.step_estimate(dev, cfg.model.dtype, flops_per_device, mfu)}
        if need is not None:
            row.update(DV.fit(dev, need))
        rows.append(row)
    return rows


def make_plan(cfg: Config, config: str, program: Program, device_names, mfu=None) -> dict:
    """The plan of `cfg` (read from `config`) from its compiled `program`."""
    dims = program.trainer.dims
    params = shards(program.state["params"])
    opt = shards(program.state["opt_state"])
    memory = program.memory()
    count = flops(cfg, dims, program)
    e, m = cfg.experiment, cfg.mesh
    crossing = node_bytes(cfg, dims, params.elements, opt.elements)
    return {
        "config": config,
        "mode": e.mode,
        "preset": cfg.model.preset,
        "dtype": dims.dtype,
        "param_dtype": dims.param_dtype,
        "n_params": dims.n_params,
        "mesh": {"node": DV.NODES[e.mode], "dp": m.dp, "tp": m.tp},
        "tokens_per_node": e.microsteps * e.batch_size * cfg.data.seq_len,
        "step": {"microsteps": e.microsteps, "batch_size": e.batch_size,
                 "seq_len": cfg.data.seq_len},
        "compiled_for": {"backend": jax.default_backend(), "devices": jax.device_count(),
                         "device_kind": jax.devices()[0].device_kind,
                         "compile_s": program.compile_s},
        "state": {"params": params.bytes, "opt_state": opt.bytes,
                  "batch": shards(program.batch).bytes},
        "memory": memory,
        "flops": count,
        "node_bytes": crossing,
        "node_bytes_total": sum(crossing.values()),
        "devices": device_rows(cfg, memory.get("total"), count["device"], device_names, mfu),
    }
