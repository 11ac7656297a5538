"""`sdcstudy reproduce --reuse DIR ...`: take a planned run from another reproduce folder
instead of running it again, where that folder already ran the very same run.

A run is the same when its folder finished every step, its config.yaml is the config this
command would give it, its planned entry (what the profile leads us to expect) is this plan's,
and its env.json names the same software and machine (`SAME_ENVIRONMENT`). sdcstudy's runs
are bitwise deterministic for a given config, program and machine (docs/guide.md, "Determinism"), so
such a run is the run this command would make; the copy leaves its checkpoints behind. The
flip and additive scorecards of `--fault-model chosen` share every run of the nodes whose
model they agree on, for example. Imports no JAX.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core.config import UserError
from sdcstudy.core.determinism import flags_deciding_bits

# The env.json fields that must agree: what decides the bits of a run. Left out: the OS
# string, the process layout and the compiled step's hash (which needs a compile to check).
SAME_ENVIRONMENT = ("packages", "xla_flags", "platform", "device_kinds", "device_count", "cpu",
                    "gpu_stack", "backend_version")


def sources(dirs: list[Path], out: Path, read_manifest) -> list[tuple[Path, dict]]:
    """[(folder, {run name: planned entry})] of the --reuse folders, checked: reproduce
    folders, each once, none of them the --out folder."""
    dirs = [Path(d) for d in dirs]
    if len({d.resolve() for d in dirs}) < len(dirs):
        raise UserError("--reuse names a folder more than once.")
    if out is not None and Path(out).resolve() in {d.resolve() for d in dirs}:
        raise UserError(f"--reuse names the --out folder {str(out)!r}; name other reproduce "
                        f"folders.")
    return [(d, {e["name"]: e for e in read_manifest(d)["plan"]}) for d in dirs]


def find(entry: dict, cfg: C.Config, found: list[tuple[Path, dict]], env: dict) -> Path | None:
    """The first finished run folder among `found` that is the run of `entry` and `cfg` on a
    machine and software stack of fingerprint `env` (`determinism.fingerprint`)."""
    name, want = entry["name"], C.to_dict(cfg)
    for root, plan in found:
        run = root / "runs" / name
        if plan.get(name) != entry or not RF.finished(run) or not (run / RF.ENV).is_file():
            continue
        theirs = RF.json_load(run / RF.ENV)
        if any(_compared(theirs, k) != _compared(env, k) for k in SAME_ENVIRONMENT):
            continue
        if C.to_dict(C.load(run / RF.CONFIG)) == want:
            return run
    return None


def _compared(env: dict, field: str):
    """env.json's `field` as the comparison reads it: XLA flags without the ones that only say
    how long a thread waits (a run is the same run with or without them)."""
    value = env.get(field)
    return flags_deciding_bits(value) if field == "xla_flags" else value


def copy(run: Path, to: Path) -> None:
    """The run folder `run` as `to`, without its checkpoints, whole or not at all."""
    partial = to.with_name(to.name + ".reusing")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(run, partial, ignore=shutil.ignore_patterns(RF.CHECKPOINTS, ".lock"))
    if to.exists():  # an unfinished run of this folder, which the copy replaces
        shutil.rmtree(to)
    partial.rename(to)
