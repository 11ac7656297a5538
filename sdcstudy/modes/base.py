"""The protocol every experiment mode follows, with the defaults most modes keep.

The runner (`sdcstudy.runner`) knows nothing of any mode: it asks the registered class for
`experiment.mode` (`modes.REGISTRY`) to check the config, build the trainer, give the batches,
wrap the compiled step, and add to `summary.json`. A mode overrides only what differs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from sdcstudy.abft import tables as abft_tables
from sdcstudy.core import data as D
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.core.config import Config
from sdcstudy.core.errors import ConfigError

# Run-folder tables a trainer may name in `TABLES`, with their columns.
TABLE_COLUMNS = {RF.FAULTS: TL.FAULT_COLUMNS, RF.MISMATCH: TL.MISMATCH_COLUMNS,
                 RF.ABFT: abft_tables.COLUMNS}

# Config sections every mode reads; a mode names the others it reads in `Mode.reads`, and
# refuses a key of any other section set to other than its default (`Mode.check`).
COMMON_SECTIONS = ("experiment", "model", "mesh", "optim", "data", "logging")
# Keys of a section a mode reads that the mode itself never reads, whatever their value:
# mode -> {key: why it is unread, or None where it is harmless and left alone}. `Mode.check`
# refuses the others set to other than their default; docs/config.md leaves the mode out of
# each key's "read by".
UNREAD = {
    "paft": {"suspect.fault_kind": "paft's workers draw each spec's faults as the profile "
                                   "gives them"},
    "finetune": {"data.text_field": "finetune's questions are finetune.task's, not a corpus's",
                 "data.synthetic_tokens": None, "data.cache_dir": None},
}
# The ABFT checker's settings, which mean nothing where the step checks no matmul.
ABFT_SETTINGS = ("abft.recompute", "abft.threshold", "abft.operand_rounding",
                 "abft.output_partials")


def changed(cfg: Config, keys) -> list[tuple[str, Any, Any]]:
    """(key, value, default) of each of `keys` (dotted; a section stands for every key in it)
    that `cfg` sets to other than its default."""
    out = []
    for key in keys:
        value, default = cfg, Config()
        for part in key.split("."):
            value, default = getattr(value, part), getattr(default, part)
        if dataclasses.is_dataclass(value):
            out += changed(cfg, [f"{key}.{f.name}" for f in dataclasses.fields(value)])
        elif value != default:
            out.append((key, value, default))
    return out


def refuse_sorted_embedding_grad(cfg: Config) -> None:
    """For a mode whose step runs inside `shard_map`: model.embedding_grad=sorted, refused there
    while the step was traced (core/embedding.py), refused before anything is built."""
    if cfg.model.embedding_grad == "sorted":
        raise ConfigError(f"model.embedding_grad=sorted runs only in steps outside shard_map "
                          f"(modes train, abft, detect), and experiment.mode "
                          f"{cfg.experiment.mode}'s step is inside one; use "
                          f"model.embedding_grad=scatter there.")


def refuse_ignored(cfg: Config, keys, why: str, fix: str = "") -> None:
    """One sentence (a ConfigError) for the first of `keys` that `cfg` sets to other than its
    default, which the run would ignore because `why`: its config.yaml would say the setting
    was on and its results nothing of it."""
    for key, value, default in changed(cfg, keys):
        raise ConfigError(f"{key}: {json.dumps(value)} would be ignored, since {why}; "
                          f"{fix or f'remove it (its default is {json.dumps(default)})'}.")


# summary.json fields every run writes, whatever its mode (runner.run).
COMMON_SUMMARY = {
    "mode": "experiment.mode",
    "steps_done": "optimizer steps completed",
    "steps": "experiment.steps",
    "n_params": "parameters of the model",
    "suspect_profile": "suspect.profile",
    "loss/first": "the run's first logged loss (the mode's loss key)",
    "loss/last": "the run's last logged loss",
    "loss/uniform": "ln(vocab size): the loss of a uniform guess",
    "param_digest": "SHA-256 over the bits of every final parameter",
    "compile_s": "seconds to compile the step",
    "wall_time_s": "seconds of the training loop",
    "tokens_per_s": "training tokens per second of the loop",
}

# metrics.jsonl fields every run writes, one line per optimizer step.
COMMON_METRICS = {
    "step": "optimizer step, counted from 1",
    "time/step_s": "host seconds between two logged steps",
}


class Mode:
    """One experiment mode. Subclasses set `name` and `build`; the rest has defaults.

    - `check(cfg)`: reject settings of this mode's sections, and any key the mode would
      ignore (`refuse_ignored`) (a `ConfigError`, one sentence, before anything is built);
    - `build()`: the trainer, with `init_state`, `make_batch`, `shardings`, `train_step`,
      `TABLES` and `host_tables` (see `core.train.Trainer`);
    - `batches()`: the data, with `batch(i)` and `seq_len`;
    - `step(compiled)`: the host loop's step around the compiled one;
    - `summarize(rows, tables, histograms)`: summary.json fields from the metrics rows and the
      run's tables;
    - `evaluate(state, run_dir)`: summary.json fields from the final state;
    - `carry()` / `resume(carried)`: host-side state the mode keeps between steps, saved with
      every checkpoint and given back on `--resume`, so a resumed run equals an unbroken one.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    # Config sections the mode reads beyond the ones every mode reads (docs/config.md).
    reads: ClassVar[tuple[str, ...]] = ()
    # The mode's nodes may be processes of their own (`jax.distributed`, docs/pairing.md): the
    # paired modes. The others run in one process.
    pairs_processes: ClassVar[bool] = False
    # What the mode adds to metrics.jsonl and summary.json: field -> one-line meaning.
    metrics: ClassVar[dict[str, str]] = {}
    summary: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: Config):
        self.check(cfg)
        self.cfg = cfg
        self.trainer = self.build()

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Refuse what this mode would ignore: a key of a section it does not read, or one of
        its `UNREAD` keys, set to other than its default."""
        for section in dataclasses.fields(cfg):
            if section.name not in COMMON_SECTIONS + cls.reads:
                refuse_ignored(cfg, [section.name], f"experiment.mode {cls.name} does not read "
                                                    f"the {section.name} section")
        for key, why in UNREAD.get(cls.name, {}).items():
            if why is not None:
                refuse_ignored(cfg, [key], f"experiment.mode {cls.name} does not read it ({why})")

    def build(self) -> Any:
        raise NotImplementedError

    @property
    def loss_key(self) -> str:
        """The metric that must stay finite and that `loss/first` and `loss/last` report."""
        return getattr(self.trainer, "loss_key", "loss/healthy")

    @property
    def shown(self) -> dict[str, str]:
        """What the step bar shows after each step: label -> metric."""
        return {"loss": self.loss_key}

    @property
    def tables(self) -> dict[str, tuple[str, ...]]:
        """The run folder's Parquet tables this mode writes: file name -> columns (a step
        feature's own table: the columns the feature declares, `columns`)."""
        own = {table: columns for f in getattr(self.trainer, "features", ())
               for table, columns in getattr(f, "columns", {}).items()}
        return {name: TABLE_COLUMNS.get(name) or own[name] for name in self.trainer.TABLES}

    def batches(self):
        e = self.cfg.experiment
        return D.TokenBatches(D.prepare(self.cfg.data, e.seed), e.batch_size, e.microsteps)

    def step(self, compiled):
        return compiled

    def summarize(self, rows: list[dict], tables: dict, histograms: dict) -> dict:
        del rows, tables, histograms
        return {}

    def evaluate(self, state, run_dir) -> dict:
        del state, run_dir
        return {}

    def carry(self) -> dict:
        return {}

    def resume(self, carried: dict) -> None:
        del carried
