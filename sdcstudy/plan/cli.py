"""`sdcstudy plan CONFIG [--set KEY=VALUE ...] [--device NAME] [--mfu F] [--json FILE]`.

The mesh's device count is known from the config alone, so the command starts JAX with that
many simulated CPU devices (a GPU backend ignores the flag and uses its own devices), then
compiles the mode's step ahead of time and prints its plan (docs/plan.md). A `--json` file
that cannot be written ends the command with one sentence naming it, exit 3.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import reports
from sdcstudy.core.config import UserError
from sdcstudy.core.runfolder import atomic_write_json

# The largest mesh a plan simulates on CPU (each simulated device costs the client memory:
# 1024 of them start in under a second and about 330 MB).
MAX_SIMULATED_DEVICES = 1024
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def add_arguments(p) -> None:
    p.add_argument("config", type=Path, help="YAML config (keys it omits take defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="the device to fit and time the step on: h100 or h200 (default both)")
    p.add_argument("--mfu", type=float, default=None, metavar="F",
                   help="model FLOPs utilisation for the step time, e.g. 0.4 (default: the one "
                        "measured on one H100 for the step's dtype, RESULTS.md)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write the plan as JSON here")


def simulate_devices(count: int) -> None:
    """Start JAX, when it has not started yet, with `count` simulated CPU devices."""
    if count > MAX_SIMULATED_DEVICES:
        raise UserError(f"the mesh needs {count} devices, more than the "
                        f"{MAX_SIMULATED_DEVICES} sdcstudy plan simulates; plan a smaller "
                        f"mesh.dp or mesh.tp.")
    if "jax" in sys.modules:  # started by the caller: aot.check_devices compares counts
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith(DEVICE_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={count}"])


def main(args) -> int:
    from sdcstudy.plan import devices as DV

    cfg = C.load(args.config, args.overrides)
    names = list(DV.DEVICES) if args.device is None else [DV.device(args.device).name]
    DV.check_mfu(args.mfu)
    simulate_devices(DV.devices_needed(cfg))
    from sdcstudy.plan import aot, summary, text  # import JAX: after the device count is set

    program = aot.compile_program(cfg)
    plan = summary.make_plan(cfg, str(args.config), program, names, args.mfu)
    print(text.render(plan))
    if args.json is not None:  # the plan's file: one that cannot be written is exit 3
        with reports.writing(args.json, "plan file"):
            # `--json ""` is the folder `.`: the atomic write would stop at its empty name
            # with a ValueError, not the OSError whose sentence says it is a folder.
            if not args.json.name:
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            atomic_write_json(args.json, plan)
        print(f"\nwrote {args.json}")
    return 0
