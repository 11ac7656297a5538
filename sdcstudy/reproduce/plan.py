"""What `sdcstudy reproduce` runs: four runs per paper node, in a fixed order, split in shards.

For each chosen node of Ma et al. ("Understanding Silent Data Corruption in LLM Training") the
suspect runs the zoo profile `paper-node-N` (`paper-node-N-flip` with `--fault-model flip`)
beside a healthy node in
- `lockstep` (RQ1, section 4: Tables 1, 2 and 6-9),
- `paramsync` (RQ2, section 5: the WCNTS table of Figure 5),
- `free` (RQ3, section 6.2: Figure 6),
and alone with checksummed matmuls in `abft` (appendix D, Figure 10: float32, tp 1, the
paper's threshold), on a built-in config (`PRESETS`); `--modes` keeps some of the four. Runs
are enumerated node by node in `MODES` order; shard I/N takes every N-th of them from the
I-th, so the shards of a Slurm job array partition the runs. Each planned run carries what its
profile leads us to expect (the mismatches over the run, the time pattern's weight over this
run against the paper's 4500 steps, the onset), so the scorecard needs no profile, and no JAX,
to judge it.
"""

from __future__ import annotations

import math

from sdcstudy.core import config as C
from sdcstudy.core.config import UserError
from sdcstudy.faults import flip_model
from sdcstudy.faults import published as PB

MODES = ("lockstep", "paramsync", "free", "abft")
NODES = tuple(sorted(PB.WCNTS))  # Ma et al.'s nodes 1-15
ALL = "all"
DTYPES = ("float32", "bfloat16")
FAULT_MODELS = ("additive", "flip")  # faults.profiles.FAULT_MODELS: the zoo's two error models
CHOSEN = "chosen"  # each node the model it keeps (faults.flip_model.MODEL_OF_NODE)
DEFAULT_FAULT_MODEL = "additive"
PAPER_STEPS = 4500  # section 4: the lock-step runs' 4500 optimizer steps (faults.profiles)

# The built-in configs: tiny is configs/demo.yaml's model; small and medium take batches that
# fit one accelerator with room for the pair.
PRESETS = {
    "tiny": {"model": {"preset": "tiny"}, "steps": 200, "batch_size": 16, "seq_len": 64,
             "lr": 3e-3},
    "small": {"model": {"preset": "small"}, "steps": 100, "batch_size": 8, "seq_len": 128,
              "lr": 1e-3},
    "medium": {"model": {"preset": "medium"}, "steps": 100, "batch_size": 8, "seq_len": 128,
               "lr": 1e-3},
}
# Config keys the command has an option for: --set of them would leave the scorecard's header
# and the request naming the option's value, not the runs'.
OWN_OPTIONS = {"experiment.steps": "--steps", "model.dtype": "--dtype"}
CHECKPOINT_EVERY = 50  # an interrupted run continues from here with --resume
# Appendix D.1: float32 (tp 1 is our choice: D.1 records flags across tp ranks, their number unsaid)
ABFT_FORCED = ("mesh.tp=1", "model.dtype=float32", "abft.enabled=true")


def run_name(node: int, mode: str) -> str:
    return f"{PB.PAPER_PREFIX}{node}-{mode}"


def parse_nodes(text: str) -> list[int]:
    """"1,4, 11" -> [1, 4, 11]; "all" -> nodes 1-15. Unknown or repeated nodes are bad input."""
    if text.strip() == ALL:
        return list(NODES)
    parts = [p.strip().removeprefix(PB.PAPER_PREFIX) for p in text.split(",")]
    bad = [p for p in parts if not p.isdecimal() or int(p) not in NODES]
    if bad or not parts:
        raise UserError(f"--nodes {text!r} names {', '.join(map(repr, bad)) or 'no node'}; "
                        f"give Ma et al.'s node numbers 1-15 separated by commas, or all.")
    nodes = [int(p) for p in parts]
    if len(set(nodes)) != len(nodes):
        raise UserError(f"--nodes {text!r} names a node more than once.")
    return sorted(nodes)


def parse_modes(text: str) -> list[str]:
    """"free, paramsync" -> ["paramsync", "free"] (in `MODES` order); "all" -> `MODES`."""
    if text.strip() == ALL:
        return list(MODES)
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if p not in MODES]
    if bad:
        raise UserError(f"--modes {text!r} names {', '.join(map(repr, bad))}; give "
                        f"{', '.join(MODES)} separated by commas, or all.")
    if len(set(parts)) != len(parts):
        raise UserError(f"--modes {text!r} names a mode more than once.")
    return [m for m in MODES if m in parts]


def parse_shard(text: str | None) -> tuple[int, int]:
    """"2/8" -> (2, 8): the third of eight shards (I counts from 0, as SLURM_ARRAY_TASK_ID)."""
    if text is None:
        return (0, 1)
    index, _, count = text.partition("/")
    if not (index.strip().isdecimal() and count.strip().isdecimal()) \
            or not 0 <= int(index) < int(count):
        raise UserError(f"--shard {text!r} must be I/N with 0 <= I < N, e.g. --shard 0/4 for "
                        f"the first of four shards.")
    return (int(index), int(count))


def in_shard(position: int, shard: tuple[int, int]) -> bool:
    """Whether the run at `position` of the plan belongs to `shard` (I, N)."""
    return position % shard[1] == shard[0]


def request(preset: str, steps: int | None, nodes: list[int], dtype: str | None,
            overrides: list[str], modes: list[str] = MODES,
            fault_model: str = DEFAULT_FAULT_MODEL) -> dict:
    """What a reproduce command asks for, checked; shards of one command share it."""
    if fault_model not in (*FAULT_MODELS, CHOSEN):
        raise UserError(f"--fault-model {fault_model!r} is not one of "
                        f"{', '.join((*FAULT_MODELS, CHOSEN))}.")
    if preset not in PRESETS:
        raise UserError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}.")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps} must be at least 1.")
    for text in overrides:
        key = text.partition("=")[0].strip()
        if key in OWN_OPTIONS:
            raise UserError(f"--set {key} is {OWN_OPTIONS[key]} of sdcstudy reproduce, which "
                            f"the plan and the scorecard read; give {OWN_OPTIONS[key]} instead.")
    return {"preset": preset, "steps": steps or PRESETS[preset]["steps"], "nodes": list(nodes),
            "modes": list(modes), "dtype": dtype, "overrides": list(overrides),
            "fault_model": fault_model}


def with_defaults(req: dict) -> dict:
    """A request as read from a manifest; one without `modes` ran every mode, one without
    `fault_model` the additive model."""
    return {**req, "modes": list(req.get("modes", MODES)),
            "fault_model": req.get("fault_model", DEFAULT_FAULT_MODEL)}


def node_model(req: dict, node: int) -> str:
    """The error model of `node`'s profile under the request's --fault-model."""
    model = req.get("fault_model", DEFAULT_FAULT_MODEL)
    return flip_model.MODEL_OF_NODE.get(node, DEFAULT_FAULT_MODEL) if model == CHOSEN else model


def profile_name(req: dict, node: int) -> str:
    """The zoo profile a node's suspect runs: `paper-node-N`, or `paper-node-N-flip` under the
    flip model (docs/faults.md section 6)."""
    flip = node_model(req, node) == "flip"
    return f"{PB.PAPER_PREFIX}{node}" + (PB.FLIP_SUFFIX if flip else "")


def base_config(req: dict) -> dict:
    """The config every run of `req` starts from, before --set and the run's own keys."""
    preset = PRESETS[req["preset"]]
    base = {
        "experiment": {"steps": req["steps"], "batch_size": preset["batch_size"],
                       "checkpoint_every": CHECKPOINT_EVERY, "checkpoint_keep": 1},
        "model": dict(preset["model"]),
        "mesh": {"tp": 2},
        "optim": {"lr": preset["lr"], "warmup_steps": 10},
        "data": {"source": "synthetic", "seq_len": preset["seq_len"]},
    }
    if req["dtype"]:
        base["model"]["dtype"] = req["dtype"]
    return base


def run_config(req: dict, node: int, mode: str) -> C.Config:
    """The config of one run: the base, the user's --set, then what the run itself needs."""
    own = [f"suspect.profile={profile_name(req, node)}", f"experiment.mode={mode}",
           f"experiment.name={run_name(node, mode)}"]
    if mode == "abft":
        own += ABFT_FORCED
    return C.from_dict(base_config(req), [*req["overrides"], *own])


def site_elements(cfg: C.Config) -> int:
    """Elements compared per site and optimizer step: each tp rank's whole (B, L, D) partial
    sum before the reduce-scatter, in every layer and microstep."""
    dims = C.model_dims(cfg.model)
    e = cfg.experiment
    return e.batch_size * cfg.data.seq_len * dims.d_model * cfg.mesh.tp * dims.n_layers \
        * e.microsteps


def expectations(profile, cfg: C.Config) -> dict:
    """What a lock-step run of `profile` should show: per site the expected mismatches over
    the run and `scale`, the time pattern's mean over this run over its mean over the paper's
    4500 steps (Table 1 times `scale` is this run's expected frequency); the expected number of
    steps a bursty profile fires in (None: not bursty); the onset step of an onset pattern
    (None: none)."""
    steps, per_step = cfg.experiment.steps, site_elements(cfg)
    sites = {}
    for spec in profile.specs:
        if spec.site not in PB.SITES:
            continue
        pattern = spec.pattern
        weight = pattern.mean_multiplier(steps)
        count = (spec.count * steps * weight if spec.count else
                 spec.rate * weight * per_step * steps)
        paper_weight = pattern.mean_multiplier(PAPER_STEPS)
        entry = sites.setdefault(spec.site, {"mismatches": 0.0, "scale": 1.0})
        entry["mismatches"] += count
        if paper_weight > 0:
            entry["scale"] = weight / paper_weight
    bursts = [s.pattern.p_active for s in profile.specs if s.pattern.kind == "burst"]
    onsets = [s.pattern.onset_step for s in profile.specs if s.pattern.kind == "onset"]
    return {"sites": sites, "active_steps": min(bursts) * steps if bursts else None,
            "onset_step": min(onsets) if onsets else None}


def build(req: dict) -> tuple[list[dict], dict]:
    """(the plan: one entry per run in the fixed order, JSON-ready; {name: Config}). Every
    config is checked here, so bad input stops the command before its first run."""
    from sdcstudy import modes
    from sdcstudy.faults import profiles

    entries, configs = [], {}
    for node in req["nodes"]:
        profile = profiles.load(profile_name(req, node))
        for mode in req["modes"]:
            cfg = run_config(req, node, mode)
            modes.check(cfg)
            name = run_name(node, mode)
            entry = {"name": name, "node": node, "mode": mode, "steps": cfg.experiment.steps,
                     "layers": C.model_dims(cfg.model).n_layers, "dtype": cfg.model.dtype,
                     **expectations(profile, cfg)}
            if node_model(req, node) != DEFAULT_FAULT_MODEL:
                entry["fault_model"] = node_model(req, node)  # absent: additive, as before
            entries.append(_finite(entry))
            configs[name] = cfg
    return entries, configs


def _finite(value):
    """JSON has no inf or nan: such numbers (a pattern that never fires) become None."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

