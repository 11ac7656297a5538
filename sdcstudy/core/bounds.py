"""The range of every numeric config key, checked when a config is loaded.

A value no model can have run (`model.n_layers: 0`, `optim.lr: .nan`, `experiment.steps`
past any budget) ends in one `ConfigError` sentence that names the key and its range, before
anything is built. Every `int` or `float` key of `Config` has a `Range` here
(tests/test_config.py checks that none is missing and that docs/config.md states each range,
which it takes from the comment on the key's line); every float must also be finite and
every int at most 2^31-1. Relations between keys (a batch that splits over mesh.dp, heads that
split over mesh.tp) are checked where they are defined: `config.validate`,
`presets.model_dims` and the modes' own checks. The sentences read like the modes' own
(`paft/checks.py`): "paft.loss.p must be in [0, 1)." Imports no JAX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sdcstudy.core.errors import ConfigError

INT_MAX = 2 ** 31 - 1  # every integer key: the largest a 32-bit signed integer holds
MAX_STEPS = 10 ** 9  # far past any study's budget (the paper's runs take 4,500 steps)
# Each localization copy is one more forward and backward of every rank in the one compiled
# step; three name the one faulty device. A mistyped count (1000000) built a plan that never
# compiled.
MAX_REPLICAS = 16
MAX_LOG_LIMIT = 10 ** 6  # each (site, layer, spec, microstep) holds this many rows on the device


@dataclass(frozen=True)
class Range:
    """lo <= value <= hi (or lo < value where `lo_open`, value < hi where `hi_open`); a float
    must also be finite, an int at most INT_MAX. `words` states a range that names another key."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    words: str | None = None

    def text(self, is_float: bool) -> str:
        """The range as the error sentence states it ("at least 1", "in [0, 1)")."""
        if self.words:
            return self.words
        if self.hi is not None and is_float:
            return (f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        if self.hi is not None:
            return f"from {_num(self.lo)} to {_num(self.hi)}"
        if self.lo == 0:
            return "positive" if self.lo_open else "non-negative"
        return f"{'above' if self.lo_open else 'at least'} {_num(self.lo)}"

    def doc(self, is_float: bool, nullable: bool = False) -> str:
        """The range as docs/config.md states it, from the comment on the key's line."""
        finite = "finite, " if is_float and self.hi is None else ""
        return f"({finite}{self.text(is_float)}{' or null' if nullable else ''})"

    def holds(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below


def _num(x: float) -> str:
    if x >= 10 ** 6 and math.log10(x).is_integer():
        return f"10^{int(math.log10(x))}"
    return f"{x:g}"


AT_LEAST_0, AT_LEAST_1 = Range(0), Range(1)
POSITIVE, NON_NEGATIVE = Range(0, lo_open=True), Range(0)
PROBABILITY, BELOW_1 = Range(0, 1), Range(0, 1, hi_open=True)

RANGES: dict[str, Range] = {
    "experiment.steps": Range(1, MAX_STEPS),
    "experiment.microsteps": AT_LEAST_1,
    "experiment.seed": AT_LEAST_0,
    "experiment.batch_size": AT_LEAST_1,
    "experiment.checkpoint_every": AT_LEAST_0,
    "experiment.checkpoint_keep": AT_LEAST_1,
    "model.vocab_size": AT_LEAST_1,
    "model.d_model": AT_LEAST_1,
    "model.n_layers": AT_LEAST_1,
    "model.n_heads": AT_LEAST_1,
    "model.n_kv_heads": AT_LEAST_1,
    "model.head_dim": Range(2),
    "model.ffn_dim": AT_LEAST_1,
    "model.rope_theta": POSITIVE,
    "model.norm_eps": POSITIVE,
    "mesh.tp": AT_LEAST_1,
    "mesh.dp": AT_LEAST_1,
    "suspect.log_limit": Range(0, MAX_LOG_LIMIT),
    "suspect.fault_seed": AT_LEAST_0,
    "optim.lr": POSITIVE,
    "optim.warmup_steps": AT_LEAST_0,
    "optim.decay_steps": AT_LEAST_1,
    "optim.min_lr_ratio": PROBABILITY,
    "optim.beta1": BELOW_1,
    "optim.beta2": BELOW_1,
    "optim.eps": POSITIVE,
    "optim.momentum": BELOW_1,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.clip_norm": POSITIVE,
    "abft.output_partials": AT_LEAST_1,
    "paft.noise.sigma2": NON_NEGATIVE,
    "paft.noise.large_sigma2": NON_NEGATIVE,
    "paft.noise.large_every": AT_LEAST_0,
    "paft.sync_every": AT_LEAST_0,
    "paft.h_min": AT_LEAST_1,
    "paft.h_max": Range(1, words="at least paft.h_min"),
    "paft.div_every": AT_LEAST_0,
    "paft.loss.p": BELOW_1,
    "paft.loss.burst": NON_NEGATIVE,
    "paft.loss.packet_size": AT_LEAST_1,
    "paft.loss.param_p": BELOW_1,
    "data.seq_len": AT_LEAST_1,
    "data.synthetic_tokens": AT_LEAST_1,
    "finetune.shuffle_seed": AT_LEAST_0,
    "finetune.eval_batch_size": AT_LEAST_1,
    "finetune.max_train": AT_LEAST_1,
    "finetune.max_test": AT_LEAST_1,
    "finetune.synthetic_train": AT_LEAST_1,
    "finetune.synthetic_test": AT_LEAST_1,
    "detect.suspect_rank": AT_LEAST_0,
    "detect.shadow_rank": Range(-1),
    "detect.replicas": Range(3, MAX_REPLICAS),
    "detect.spike_window": AT_LEAST_1,
    "detect.spike_loss": NON_NEGATIVE,
    "detect.spike_grad": POSITIVE,
    "detect.max_retries": AT_LEAST_0,
}


def check_value(key: str, value, nullable: bool = False, origin: str = "") -> None:
    """A `ConfigError` naming `key` (and `origin`, where the value came from) when `value` is
    not a finite number in the key's range; null passes where the key may be null."""
    if key not in RANGES or (value is None and nullable):
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{key}{origin} must be a number, not {value!r}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}{origin} must be a finite number, not {value}.")
    r = RANGES[key]
    if not r.holds(value):
        null = " or null" if nullable else ""
        raise ConfigError(f"{key}{origin} must be {r.text(isinstance(value, float))}{null}.")
    if isinstance(value, int) and abs(value) > INT_MAX:
        raise ConfigError(f"{key}{origin} must be at most 2^31-1 ({INT_MAX}).")
