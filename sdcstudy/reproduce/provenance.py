"""What a scorecard was measured with, for its header: the sdcstudy commit that scored it (and
the versions its runs recorded, and the machine they ran on), the fault sampler, the fault model, the preset, dtype, steps
and seeds, so that a scorecard can be re-checked. Imports no JAX.
"""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.reproduce import plan as P

# The hits' sampler of faults/draws.py (docs/faults.md section 2); scorecards written before
# it fired every rate below 2^-23 at about 1.19e-7.
SAMPLER = "exact (faults/draws.py, docs/faults.md section 2)"
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def commit(root: Path = SOURCE_ROOT) -> str | None:
    """`git describe --always --dirty` of the source tree the package runs from, or None where
    it is not a git checkout (an installed wheel) or git is missing."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty",
                              "--abbrev=12"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def version() -> str | None:
    """The installed sdcstudy package's version, or None."""
    try:
        return metadata.version("sdcstudy")
    except metadata.PackageNotFoundError:
        return None


def _seeds(request: dict) -> dict:
    """experiment.seed and suspect.fault_seed of every run of `request` (the runs' own keys
    leave them alone); {} where the request is too incomplete to build the config."""
    try:
        cfg = C.from_dict(P.base_config(request), list(request.get("overrides", [])))
    except (KeyError, TypeError):
        return {}
    return {"seed": cfg.experiment.seed, "fault_seed": cfg.suspect.fault_seed}


def machine(env: dict) -> str | None:
    """What a run's env.json says it ran on, in a few words: the CPU (with or without AVX-512:
    XLA:CPU compiles for the host, and the same code gives other last bits on another CPU,
    docs/results/fidelity.md) or the accelerator kind, and jaxlib; None where it names none."""
    platform = env.get("platform")
    if not platform:
        return None
    if platform == "cpu":
        cpu = env.get("cpu") or {}
        wide = "AVX-512" if "avx512f" in cpu.get("isa", []) else "no AVX-512"
        where = f"CPU {cpu.get('model', 'unknown')} ({wide})"
    else:
        where = ", ".join(sorted(env.get("device_kinds") or {})) or platform
    jaxlib = (env.get("packages") or {}).get("jaxlib")
    return where + (f", jaxlib {jaxlib}" if jaxlib else "")


def collect(request: dict, plan: list[dict], runs: dict) -> dict:
    """The header's facts, JSON-ready: from the request, the plan's entries (each run's steps,
    dtype, fault model) and the finished runs' env.json (the sdcstudy version they ran, and
    on what: `machine`)."""
    models: dict[str, list[int]] = {}
    for entry in plan:
        nodes = models.setdefault(entry.get("fault_model", P.DEFAULT_FAULT_MODEL), [])
        if entry["node"] not in nodes:
            nodes.append(entry["node"])
    recorded = sorted({str(run.env.get("packages", {}).get("sdcstudy"))
                       for run in runs.values() if run is not None
                       and getattr(run, "env", {}).get("packages", {}).get("sdcstudy")})
    machines = sorted({m for run in runs.values() if run is not None
                       and (m := machine(getattr(run, "env", {}) or {}))})
    return {"commit": commit(), "version": version(), "runs_version": recorded,
            "runs_machine": machines,
            "sampler": SAMPLER, "fault_model": request.get("fault_model",
                                                           P.DEFAULT_FAULT_MODEL),
            "node_models": {m: sorted(n) for m, n in sorted(models.items())},
            "preset": request.get("preset"),
            "dtype": sorted({str(e["dtype"]) for e in plan if e.get("dtype")}),
            "steps": {mode: sorted({e["steps"] for e in plan if e["mode"] == mode})
                      for mode in P.MODES if any(e["mode"] == mode for e in plan)},
            **_seeds(request)}


def line(facts: dict) -> str:
    """The header's sentence."""
    made = f"sdcstudy {facts['commit'] or 'commit unknown (not a git checkout)'}"
    if facts.get("version"):
        made += f" (package {facts['version']})"
    if facts.get("runs_version"):
        made += f", runs recorded sdcstudy {', '.join(facts['runs_version'])}"
    if facts.get("runs_machine"):
        made += f" on {'; '.join(facts['runs_machine'])}"
    models = "; ".join(f"{m}: nodes {', '.join(map(str, n))}"
                       for m, n in facts.get("node_models", {}).items())
    steps = ", ".join(f"{mode} {'/'.join(map(str, s))}"
                      for mode, s in facts.get("steps", {}).items())
    fault_seed = facts.get("fault_seed")
    seeds = (f"seed {facts['seed']}, fault seed " + (f"{fault_seed}" if fault_seed is not None
                                                     else "null (the seed's draws alone)")
             if "seed" in facts else "seeds unknown")
    return (f"Measured with: {made}; sampler {facts['sampler']}; fault model "
            f"{facts['fault_model']}" + (f" ({models})" if models else "")
            + f"; preset {facts['preset']}; dtype {', '.join(facts['dtype']) or 'unknown'}; "
            f"steps {steps or 'unknown'}; {seeds}.")
