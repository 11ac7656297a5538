"""Experiment configuration: a dataclass schema, YAML files, `--set key=value` overrides.

Configs give only the keys they change; everything else takes the defaults below. Unknown
keys, wrong types and values outside a key's range (`core/bounds.py`, stated on each key's
line below) end in a `ConfigError` whose message names the key and, for a typo, the closest
valid one. Files are read through `core/yamlsafe.py` (bounded, no aliases). This module
imports no JAX.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from sdcstudy.core import bounds, yamlsafe
from sdcstudy.core.errors import ConfigError, UserError, did_you_mean, quoted
from sdcstudy.core.presets import PRESETS, ModelConfig, ModelDims, model_dims

__all__ = ["Config", "ConfigError", "UserError", "ModelConfig", "ModelDims", "PRESETS",
           "model_dims", "load", "from_dict", "dump", "to_dict", "all_keys", "parse_override",
           "validate"]


@dataclass
class ExperimentConfig:
    mode: str = "train"  # train, lockstep, paramsync, free, finetune, abft, paft or detect
    steps: int = 200  # optimizer steps of the run (from 1 to 10^9)
    microsteps: int = 1  # gradient-accumulation microsteps per optimizer step (at least 1)
    seed: int = 0  # seeds parameters, data order and fault draws (non-negative)
    batch_size: int = 8  # sequences per microstep, summed over data-parallel workers (at least 1)
    checkpoint_every: int = 100  # 0 saves only at the end (non-negative)
    checkpoint_keep: int = 2  # checkpoints kept; older ones are deleted (at least 1)
    name: str = ""  # run folders are runs/NAME-TIMESTAMP; empty: the mode; no "/" or leading "."


@dataclass
class MeshConfig:
    tp: int = 1  # tensor-parallel degree (devices per model copy) (at least 1)
    dp: int = 1  # data-parallel degree (at least 1)


@dataclass
class SuspectConfig:
    profile: str = "healthy"  # a zoo name (`sdcstudy profiles`) or a YAML profile file
    # corruptions logged per (site, layer, spec, microstep); all are counted (from 0 to 10^6)
    log_limit: int = 64
    # "profile" keeps each spec's own kind; "transient" (a re-execution draws afresh) or
    # "repeatable" (the same inputs give the same corruption) applies to every spec.
    fault_kind: str = "profile"
    # Folded into every fault draw: the same model, data and profile with other faults.
    # null: the draws of experiment.seed alone (profiles whose specs match draw the same).
    fault_seed: int | None = None  # (non-negative or null)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw, adam, sgd or sgdm
    lr: float = 3e-3  # peak learning rate (finite, positive)
    schedule: str = "warmup_cosine"  # or "constant"
    warmup_steps: int = 20  # linear warm-up from 0 to lr (non-negative)
    # length of the cosine; null means experiment.steps (at least 1 or null)
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of the peak (in [0, 1])
    # Adam's first-moment decay; Ma et al., appendix B.3: beta1 0.9, beta2 0.99, weight decay 0.01
    # (in [0, 1))
    beta1: float = 0.9
    beta2: float = 0.99  # Adam's second-moment decay (in [0, 1))
    eps: float = 1e-8  # Adam's denominator floor (finite, positive)
    momentum: float = 0.9  # for sgdm (in [0, 1))
    weight_decay: float = 0.01  # decoupled, for adamw (finite, non-negative)
    # global gradient-norm clip; null: none (finite, positive or null)
    clip_norm: float | None = 1.0


@dataclass
class AbftConfig:
    enabled: bool = False  # checksummed matmuls on every linear layer (abft/checker.py)
    recompute: bool = False  # recompute a flagged product, so training goes on correct values
    threshold: str = "paper"  # "paper" (tau = k u, float32 u) or "rounding" (safe for bfloat16)
    # What the GEMM does to float32 operands, which the checksums reproduce: auto (tf32 on a GPU
    # at DEFAULT or HIGH matmul precision, none on the CPU), none, tf32 (to nearest) or
    # tf32_truncate (toward zero); abft/bound.py derives the bound for each
    operand_rounding: str = "auto"
    # split-K partial sums stored in the output dtype (1: rounded once) (at least 1)
    output_partials: int = 1


@dataclass
class CollectivesConfig:
    # checksums of each tensor-parallel collective's input and output on both nodes of a pair:
    # a mismatch told apart as communication or computation (collectives/; mesh.tp >= 2)
    enabled: bool = False


@dataclass
class PaftNoiseConfig:
    # per-coordinate variance of each worker's aggregation error (finite, non-negative)
    sigma2: float = 0.0
    # accidental large noise: this variance instead, every ... (finite, non-negative)
    large_sigma2: float = 0.0
    large_every: int = 0  # ... large_every-th step (0: never) (non-negative)


@dataclass
class PaftLossConfig:
    """Packet loss in gradient aggregation and parameter broadcasts (paft/packets.py)."""

    p: float = 0.0  # drop probability of each gradient packet on each link (in [0, 1))
    # mean length of a run of dropped packets; 0: independent drops (finite, non-negative)
    burst: float = 0.0
    aggregate: str = "renormalized"  # renormalized, zero or stale
    packet_size: int = 256  # float32 elements per packet (at least 1)
    # drop probability of owner broadcasts; null: no broadcasts (in [0, 1) or null)
    param_p: float | None = None


@dataclass
class PaftConfig:
    noise: PaftNoiseConfig = field(default_factory=PaftNoiseConfig)
    # H of PAFT-Sync (and PAFT-Dyn's first H); 0: never synchronize (non-negative)
    sync_every: int = 0
    dynamic: bool = False  # PAFT-Dyn: the next H from the error estimated at each sync
    overlap: bool = False  # the average launched at step t is applied at step t+1
    sync_opt_state: bool = False  # average optimizer state with the parameters
    h_min: int = 1  # PAFT-Dyn's lower bound on H (at least 1)
    h_max: int = 64  # PAFT-Dyn's upper bound on H (at least paft.h_min)
    # measure the divergence every k steps (0: only when synchronizing) (non-negative)
    div_every: int = 1
    loss: PaftLossConfig = field(default_factory=PaftLossConfig)


@dataclass
class DetectConfig:
    """Detector benchmark and verified rollback (`experiment.mode: detect`, detect/trainer.py)."""

    detectors: str = "all"  # comma-separated: monitor, abft, shadow, reexec, lockstep, localize
    suspect_rank: int = 1  # the data-parallel rank whose device is faulty (non-negative)
    shadow_rank: int = -1  # the rank the shadow replica recomputes; -1: round robin (at least -1)
    replicas: int = 3  # replicas of each rank's step for localization (from 3 to 16)
    advance: str = "reference"  # train on the "reference" (clean) or the "primary" gradient
    spike_window: int = 8  # steps of history for the loss / gradient-norm monitor (at least 1)
    spike_loss: float = 0.5  # nats above the window's median loss (finite, non-negative)
    spike_grad: float = 4.0  # times the window's median gradient norm (finite, positive)
    rollback: bool = False  # re-run a flagged step from the last verified snapshot
    max_retries: int = 8  # re-runs of a flagged step before the run gives up (non-negative)


@dataclass
class DataConfig:
    # "synthetic", a local .txt/.jsonl/.json/.parquet file (text and JSON also .gz) or folder,
    # a datasets save_to_disk folder, or a hub name
    source: str = "synthetic"
    hub_config: str | None = None  # e.g. "20220301.en" for wikipedia
    split: str = "train"  # dataset split to read
    text_field: str = "text"  # the column holding the text
    tokenizer: str = "byte"  # "byte" or a local Hugging Face tokenizer folder
    seq_len: int = 64  # predicted tokens per sequence (at least 1)
    synthetic_tokens: int = 400_000  # size of the built-in corpus, in bytes (at least 1)
    cache_dir: str | None = None  # where prepared datasets are kept; default ~/.cache/sdcstudy


@dataclass
class FinetuneConfig:
    """Fine-tuning on multiple-choice QA (Ma et al., section 6.1 experiment II, appendix E)."""

    # a Hugging Face model folder or an sdcstudy run folder, whose model replaces model.* but
    # model.dtype; "" = random init
    init: str = ""
    task: str = "synthetic"  # synthetic, cosmosqa, mathqa, scienceqa, openbookqa, boolq, race
    test_split: str | None = None  # null: the task's labelled evaluation split
    # order of the training questions; null = experiment.seed (non-negative or null)
    shuffle_seed: int | None = None
    loss_on: str = "all"  # "all" tokens but the padding (appendix E.3) or only the "answer"
    predict: str = "generate"  # TA/DP from the greedy next token (E.2) or the best "score"
    eval_batch_size: int = 16  # test questions scored per batch (at least 1)
    # use at most this many training questions (null: all) (at least 1 or null)
    max_train: int | None = None
    max_test: int | None = None  # test questions used; null: all (at least 1 or null)
    synthetic_train: int = 4000  # questions of the synthetic task (at least 1)
    synthetic_test: int = 500  # questions of the synthetic task's test split (at least 1)


@dataclass
class LoggingConfig:
    """How a run can be watched while it trains; changes nothing it computes."""

    # the per-step scalars of metrics.jsonl also as TensorBoard event files in
    # RUN_DIR/tensorboard/ (needs tensorboardX: pip install 'sdcstudy[tensorboard]')
    tensorboard: bool = False


@dataclass
class Config:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    suspect: SuspectConfig = field(default_factory=SuspectConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    abft: AbftConfig = field(default_factory=AbftConfig)
    collectives: CollectivesConfig = field(default_factory=CollectivesConfig)
    paft: PaftConfig = field(default_factory=PaftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --- loading, overriding, validating ---------------------------------------------------------


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check `value` against a field annotation, converting ints to floats where allowed."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float):  # 1e14 or 3.0 is no count of steps, layers or sequences
            raise ConfigError(f"{key} must be int, not the float {value!r}; write a whole "
                              f"number without a dot or exponent.")
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    name = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{key} must be {name}, not {quoted(value)}.")


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        what = prefix.rstrip('.') or 'the config'
        raise ConfigError(f"{what} must be a mapping, not {quoted(data)}.")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in types_:
            valid = [f"{prefix}{k}" for k in types_]
            raise ConfigError(f"unknown config key {full!r}{did_you_mean(full, valid)}.")
        annotation = types_[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value if value is not None else {}, full + ".")
        else:
            kwargs[key] = _coerce(value, annotation, full)
    return cls(**kwargs)


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    keys = []
    for name, annotation in _field_types(cls).items():
        if dataclasses.is_dataclass(annotation):
            keys += all_keys(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _set_nested(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is not a section.")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value read as YAML (so `1e-3`, `null`, `true` mean what they say)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}.")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key not in all_keys():
        raise ConfigError(f"unknown config key {key!r}{did_you_mean(key, all_keys())}.")
    try:
        value = yamlsafe.load_text(raw, f"--set {key}") if raw.strip() else ""
    except yamlsafe.InvalidYaml:
        value = raw
    return key, value


def tokens_per_step(cfg: Config) -> int:
    """Tokens of one optimizer step: microsteps x sequences a microstep x sequence length."""
    e = cfg.experiment
    return e.microsteps * e.batch_size * cfg.data.seq_len


def from_dict(data: dict | None, overrides: list[str] = ()) -> Config:
    data = _deepcopy(data or {})
    for text in overrides:
        key, value = parse_override(text)
        _set_nested(data, key, value)
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def load(path: str | Path, overrides: list[str] = ()) -> Config:
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}.")
    return from_dict(yamlsafe.load_file(path, "config file"), overrides)


def _deepcopy(data):
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    return yamlsafe.dump(to_dict(cfg), sort_keys=False)


def _check_ranges(section, prefix: str = "") -> None:
    """Every numeric key in its range (`core/bounds.py`)."""
    for name, annotation in _field_types(type(section)).items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(annotation):
            _check_ranges(value, f"{prefix}{name}.")
        else:
            nullable = type(None) in typing.get_args(annotation)
            bounds.check_value(f"{prefix}{name}", value, nullable)


def validate(cfg: Config) -> None:
    """The checks every mode shares; a mode checks its own sections (`modes.Mode.check`)."""
    _check_ranges(cfg)
    e, o, d = cfg.experiment, cfg.optim, cfg.data
    if cfg.paft.h_max < cfg.paft.h_min:
        raise ConfigError("paft.h_max must be at least paft.h_min.")
    if "/" in e.name or "\\" in e.name or e.name.startswith("."):
        raise ConfigError(f"experiment.name {e.name!r} names a folder inside runs/: it may not "
                          f"hold '/' or '\\' or start with '.'.")
    if o.name not in ("adamw", "adam", "sgd", "sgdm"):
        raise ConfigError(f"optim.name {o.name!r} is not one of adamw, adam, sgd, sgdm"
                          f"{did_you_mean(o.name, ('adamw', 'adam', 'sgd', 'sgdm'))}.")
    if o.schedule not in ("constant", "warmup_cosine"):
        raise ConfigError(f"optim.schedule {o.schedule!r} is not one of constant, warmup_cosine.")
    if e.batch_size % cfg.mesh.dp:
        raise ConfigError(f"experiment.batch_size ({e.batch_size}) must be a multiple of "
                          f"mesh.dp ({cfg.mesh.dp}).")
    if cfg.abft.threshold not in ("paper", "rounding"):
        raise ConfigError(f"abft.threshold {cfg.abft.threshold!r} is not one of paper, rounding"
                          f"{did_you_mean(cfg.abft.threshold, ('paper', 'rounding'))}.")
    roundings = ("auto", "none", "tf32", "tf32_truncate")
    if cfg.abft.operand_rounding not in roundings:
        raise ConfigError(f"abft.operand_rounding {cfg.abft.operand_rounding!r} is not one of "
                          f"{', '.join(roundings)}"
                          f"{did_you_mean(cfg.abft.operand_rounding, roundings)}.")
    kinds = ("profile", "transient", "repeatable")
    if cfg.suspect.fault_kind not in kinds:
        raise ConfigError(f"suspect.fault_kind {cfg.suspect.fault_kind!r} is not one of "
                          f"{', '.join(kinds)}{did_you_mean(cfg.suspect.fault_kind, kinds)}.")
    dims = model_dims(cfg.model)
    if d.tokenizer == "byte" and dims.vocab_size < 256:
        raise ConfigError(f"the byte tokenizer needs model.vocab_size >= 256, "
                          f"not {dims.vocab_size}.")
