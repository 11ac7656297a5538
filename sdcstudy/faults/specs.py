"""What a fault is: a `FaultSpec`, its `TimePattern` (`faults/time_patterns.py`, with the traced
multiplier `pattern_multiplier` here) and a `Profile`; their YAML form is `faults/profile_yaml.py`.

Faults are data. A `FaultSpec` names a site, a corruption kind, a per-element rate, the bits or
value model, the layers, tp ranks and node it strikes, and a time pattern; a profile is a named
list of specs (`faults/profiles.py` holds the node zoo). `faults/inject.py` injects them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from sdcstudy.core import sites as S
from sdcstudy.core.bounds import AT_LEAST_0, AT_LEAST_1, INT_MAX, NON_NEGATIVE, POSITIVE, PROBABILITY
from sdcstudy.core.bounds import Range
from sdcstudy.core.errors import UserError
from sdcstudy.faults.time_patterns import TimePattern

KINDS = ("bitflip", "scale", "additive", "random", "zero", "nan", "inf")
PATTERNS = ("constant", "burst", "onset", "steps", "decay", "periodic")
BIT_CLASSES = ("any", "sign", "exponent", "mantissa", "bf16-mantissa", "bf16-result")

# The paper's four site names (docs/metrics.md) -> (direction, model site). Any model site can
# also be named directly as "fwd/<site>" (its value) or "bwd/<site>" (the gradient arriving at
# it).
SITE_ALIASES = {"fwd/attn": ("fwd", S.ATTN_OUT), "fwd/ffn": ("fwd", S.FFN_OUT),
                "bwd/attn": ("bwd", S.ATTN_IN), "bwd/ffn": ("bwd", S.FFN_IN)}
# Sites outside the model, applied by the trainer to whole pytrees.
TREE_SITES = ("grad", "update")
# Collective payloads (their order numbers the draws of the tree sites: keep it).
COLLECTIVE_SITES = ("collective/all_gather", "collective/reduce_scatter",
                    "collective/grad_allreduce")
# Collectives inside the model (tensor parallelism, mesh.tp >= 2): a fault on the wire, the
# value each tp rank received corrupted at the output site of every such collective of the
# spec's layers (the attention's and the FFN's), the value sent left alone.
MODEL_COLLECTIVES = {
    "collective/all_gather": tuple(out for (_, kind), (_, out) in S.COLLECTIVES.items()
                                   if kind == S.ALL_GATHER),
    "collective/reduce_scatter": tuple(out for (_, kind), (_, out) in S.COLLECTIVES.items()
                                       if kind == S.REDUCE_SCATTER),
}
# The rest are whole pytrees, corrupted where the payload is formed (PAFT's gradient all-reduce).


class FaultSpecError(UserError, ValueError):
    """A fault spec that cannot work; the CLI prints it as one sentence (exit 2), even when the
    step finds it while tracing (bits a tensor's type does not have)."""


# --- specs ------------------------------------------------------------------------------------


def pattern_multiplier(pattern: TimePattern, step, key):
    """`pattern`'s rate multiplier at a traced step; `key` drives the burst draw."""
    step_f = jnp.asarray(step, jnp.float32)
    if pattern.kind == "constant":
        return jnp.float32(1)
    if pattern.kind == "burst":
        return jax.random.bernoulli(key, pattern.p_active).astype(jnp.float32)
    if pattern.kind == "onset":
        return (step >= pattern.onset_step).astype(jnp.float32)
    if pattern.kind == "steps":
        return jnp.isin(step, jnp.asarray(pattern.steps or (-1,))).astype(jnp.float32)
    if pattern.kind == "decay":
        return 1 + pattern.amplitude * jnp.exp(-(step_f - 1) / pattern.decay_steps)
    return jnp.where(step % pattern.period == 0, jnp.float32(pattern.amplitude), jnp.float32(1))


@dataclass(frozen=True)
class FaultSpec:
    """One kind of corruption at one site. Rates are per element of the tensor at the site."""

    site: str
    kind: str = "bitflip"
    rate: float = 0.0
    bits: tuple[int, ...] | None = None  # bitflip: the bits to choose from; None -> bit_class
    bit_class: str = "any"
    # scale: the element times 1 +/- r, r log-uniform in [lo, hi]. additive: the element plus
    # +/- m times the RMS of its row (the last axis), m log-uniform in [lo, hi] (docs/faults.md).
    scale: tuple[float, float] = (1.0, 1.0)
    value_std: float = 1.0  # random: replacement values ~ N(0, value_std^2)
    count: int | None = None  # hit exactly this many elements (when active) instead of a rate
    lanes: tuple[int, ...] | None = None  # only these indices of the last axis (a stuck lane)
    layers: tuple[int, ...] | None = None  # None: every layer
    tp_ranks: tuple[int, ...] | None = None  # None: every rank
    node: int = 1  # which node of a pair is faulty (1 = the suspect)
    pattern: TimePattern = field(default_factory=TimePattern)
    repeatable: bool = False  # the same input gives the same corruption, in any step
    transient: bool = False  # a re-execution of the same step draws afresh (keyed by attempt)
    note: str = ""

    @property
    def base_rate(self) -> float:
        """The rate before the time pattern: a `count` spec is simply on (1) or off."""
        return 1.0 if self.count is not None else self.rate

    @property
    def direction(self) -> str:
        return self.resolve()[0]

    def resolve(self) -> tuple[str, str]:
        """(direction, site): "fwd"/"bwd" and a model site, ("fwd", a collective of
        `MODEL_COLLECTIVES`), or ("tree", name)."""
        if self.site in SITE_ALIASES:
            return SITE_ALIASES[self.site]
        if self.site in MODEL_COLLECTIVES:
            return "fwd", self.site
        if self.site in TREE_SITES or self.site in COLLECTIVE_SITES:
            return "tree", self.site
        direction, _, name = self.site.partition("/")
        return direction, name

    def validate(self, where: str = "fault spec") -> "FaultSpec":
        """Every field of the right type and in its range, and none that the spec's kind,
        site or pattern would ignore (docs/faults.md, section 8); a spec whose layers, lanes
        or tp ranks the model lacks is refused by `check_fits`."""
        for name in ("site", "kind", "bit_class", "note"):
            if not isinstance(getattr(self, name), str):
                raise FaultSpecError(f"{where}: {name} must be text, not "
                                     f"{getattr(self, name)!r}.")
        _check_numbers(self, where)
        direction, name = self.resolve()
        ok = (direction == "tree" or name in MODEL_COLLECTIVES
              or (direction in ("fwd", "bwd") and name in S.ALL_SITES))
        if not ok:
            known = list(SITE_ALIASES) + [f"fwd/{s}" for s in S.ALL_SITES] + list(TREE_SITES)
            raise FaultSpecError(f"{where}: unknown site {self.site!r}; use one of "
                                 f"{', '.join(known[:8])}, ... or fwd/<site>, bwd/<site> with a "
                                 f"model site ({', '.join(S.ALL_SITES)}).")
        if self.kind not in KINDS:
            raise FaultSpecError(f"{where}: kind must be one of {', '.join(KINDS)}, "
                                 f"not {self.kind!r}.")
        if self.bit_class not in BIT_CLASSES:
            raise FaultSpecError(f"{where}: bit_class must be one of {', '.join(BIT_CLASSES)}.")
        if self.bits is not None and not self.bits:
            raise FaultSpecError(f"{where}: bits must be a non-empty list of positions 0-31.")
        for name, each in (("lanes", "lane"), ("layers", "block"), ("tp_ranks", "tp rank")):
            if getattr(self, name) == ():  # it would select nothing: a spec that never fires
                raise FaultSpecError(f"{where}: {name} is an empty list, so the spec would "
                                     f"never fire; list at least one, or leave {name} out "
                                     f"for every {each}.")
        lo, hi = self.scale
        if self.kind in ("scale", "additive") and not 0 < lo <= hi:
            raise FaultSpecError(f"{where}: scale must be [lo, hi] with 0 < lo <= hi.")
        if self.repeatable and self.transient:
            raise FaultSpecError(f"{where}: a fault is either repeatable or transient, not both.")
        if self.node not in (0, 1):
            raise FaultSpecError(f"{where}: node must be 0 or 1.")
        p = self.pattern
        if p.kind not in PATTERNS:
            raise FaultSpecError(f"{where}: pattern.kind must be one of {', '.join(PATTERNS)}.")
        if p.kind == "periodic" and p.period < 1:
            raise FaultSpecError(f"{where}: a periodic pattern needs pattern.period >= 1.")
        _check_fields_apply(self, where)
        return self


# The fields each corruption kind and each time pattern reads; a field another kind or pattern
# reads must keep its default (docs/faults.md, section 8): given, it would be ignored.
KIND_FIELDS = {"bitflip": ("bits", "bit_class"), "scale": ("scale",),
               "additive": ("scale",), "random": ("value_std",)}
PATTERN_FIELDS = {"constant": (), "burst": ("p_active",), "onset": ("onset_step",),
                  "steps": ("steps",), "decay": ("amplitude", "decay_steps"),
                  "periodic": ("period", "amplitude")}


def _check_fields_apply(spec: "FaultSpec", where: str) -> None:
    """One sentence for a field that the spec's kind, site or pattern would ignore, or for
    two fields that contradict each other."""
    if spec.count is not None and spec.rate > 0:
        raise FaultSpecError(f"{where}: give either rate (per element) or count (elements "
                             f"per tensor), not both; count would override rate {spec.rate:g}.")
    if spec.count is not None and spec.lanes is not None:
        raise FaultSpecError(f"{where}: count picks its elements from the whole tensor, so "
                             f"lanes would keep only the few that fall in lanes "
                             f"{list(spec.lanes)}; use a rate (per element of those lanes) "
                             f"instead of count.")
    default = FaultSpec(spec.site)
    for name in ("bits", "bit_class", "scale", "value_std"):
        kinds = [k for k, fields in KIND_FIELDS.items() if name in fields]
        if spec.kind not in kinds and getattr(spec, name) != getattr(default, name):
            raise FaultSpecError(f"{where}: {name} applies to kind {' or '.join(kinds)} "
                                 f"only, and a {spec.kind} spec would ignore it: remove it.")
    if spec.bits is not None and spec.bit_class != default.bit_class:
        raise FaultSpecError(f"{where}: give either bits or bit_class, not both (bits "
                             f"{list(spec.bits)} would override bit_class {spec.bit_class!r}).")
    _, site = spec.resolve()
    outside = site not in S.BLOCK_SITES and site not in MODEL_COLLECTIVES
    if outside and spec.layers is not None and set(spec.layers) != {0}:
        raise FaultSpecError(f"{where}: layers {list(spec.layers)} name blocks, but "
                             f"{spec.site} lies outside them (faults.parquet records it at "
                             f"layer 0); remove layers.")
    p, plain = spec.pattern, TimePattern()
    for name in ("p_active", "onset_step", "amplitude", "decay_steps", "period", "steps"):
        if name not in PATTERN_FIELDS[p.kind] and getattr(p, name) != getattr(plain, name):
            kinds = " or ".join(k for k, n in PATTERN_FIELDS.items() if name in n)
            raise FaultSpecError(f"{where}: pattern.{name} applies to pattern.kind {kinds}, "
                                 f"and this pattern's kind is {p.kind}, which ignores it: set "
                                 f"pattern.kind or remove pattern.{name}.")


# The range of each numeric field of a spec and of its pattern (docs/faults.md, section 8).
# Layers count the model's blocks from 1 (0: the sites outside them); bits are positions in a
# float32 (a bfloat16 site has 0-15, checked where the step is traced).
SPEC_INTS = {"count": AT_LEAST_1, "bits": Range(0, 31), "lanes": AT_LEAST_0,
             "layers": AT_LEAST_0, "tp_ranks": AT_LEAST_0, "node": Range(0, 1)}
SPEC_REALS = {"rate": Range(0, 1, words="a probability in [0, 1]"), "scale": NON_NEGATIVE,
              "value_std": NON_NEGATIVE}
PATTERN_INTS = {"onset_step": AT_LEAST_0, "period": AT_LEAST_0, "steps": AT_LEAST_1}
PATTERN_REALS = {"p_active": PROBABILITY, "amplitude": NON_NEGATIVE, "decay_steps": POSITIVE}
SPEC_FLAGS = ("repeatable", "transient")


def _check_numbers(spec: FaultSpec, where: str) -> None:
    """One sentence naming the field when a number is of the wrong type or out of range."""
    fields = [(name, getattr(spec, name), r, False) for name, r in SPEC_INTS.items()]
    fields += [(name, getattr(spec, name), r, True) for name, r in SPEC_REALS.items()]
    fields += [(f"pattern.{name}", getattr(spec.pattern, name), r, False)
               for name, r in PATTERN_INTS.items()]
    fields += [(f"pattern.{name}", getattr(spec.pattern, name), r, True)
               for name, r in PATTERN_REALS.items()]
    for name, value, r, real in fields:
        for v in value if isinstance(value, tuple) else (value,):
            if v is None and name in ("count", "bits", "lanes", "layers", "tp_ranks"):
                continue
            number = isinstance(v, (int, float)) if real else isinstance(v, int)
            ok = (number and not isinstance(v, bool) and r.holds(v)
                  and (math.isfinite(v) if real else abs(v) <= INT_MAX))
            if not ok:
                what = f"every entry of {name}" if isinstance(value, tuple) else name
                text = r.text(real)
                text = (f"finite and {text}" if r.hi is None else text) if real \
                    else f"{text} (a whole number)"
                raise FaultSpecError(f"{where}: {what} must be {text}, not {v!r}.")
    if len(spec.scale) != 2:
        raise FaultSpecError(f"{where}: scale must be [lo, hi], two numbers.")
    for name in SPEC_FLAGS:
        if not isinstance(getattr(spec, name), bool):
            raise FaultSpecError(f"{where}: {name} must be true or false, "
                                 f"not {getattr(spec, name)!r}.")


def lane_counts(dims, tp: int, seq_len: int) -> dict[str, int]:
    """Model site -> the length of its tensor's last axis on one tp rank: the lanes a spec's
    `lanes` index (`draws._shaped`). The model's collectives move (B, L, D) activations; pytree
    sites get the longest last axis of any parameter, a bound on every leaf's."""
    d, e, f = dims.d_model, dims.head_dim, dims.ffn_dim
    q, kv = dims.n_heads * e // tp, dims.n_kv_heads * e // tp
    lanes = {site: d for site in (S.EMBED, S.ATTN_NORM, S.ATTN_IN, S.ATTN_OUT, S.FFN_NORM,
                                  S.FFN_IN, S.FFN_OUT, S.FINAL_NORM)}
    lanes.update({S.ATTN_Q: q, S.ATTN_CONTEXT: q, S.ATTN_K: kv, S.ATTN_V: kv,
                  S.ATTN_SCORES: seq_len, S.ATTN_PROBS: seq_len, S.FFN_GATE: f // tp,
                  S.FFN_UP: f // tp, S.FFN_ACT: f // tp, S.LOGITS: dims.vocab_size})
    widest = max(d, dims.n_heads * e, dims.n_kv_heads * e, f, dims.vocab_size)
    lanes.update({site: widest for site in TREE_SITES + COLLECTIVE_SITES})
    lanes.update({site: d for site in MODEL_COLLECTIVES})
    return lanes


def check_fits(profile: "Profile", dims, tp: int = 1, seq_len: int = 1) -> "Profile":
    """`profile`, or a `FaultSpecError` for a spec that could never fire on this model: a
    layer it lacks (blocks count 1 to dims.n_layers), a lane past its site's last axis
    (`lane_counts`), a tp rank past mesh.tp, or a collective of the model's tensor
    parallelism where mesh.tp = 1 (there is none)."""
    lanes = lane_counts(dims, tp, seq_len)
    for i, spec in enumerate(profile.specs):
        where = f"profile {profile.name!r}: specs[{i}] ({spec.site})"
        _, site = spec.resolve()
        if site in MODEL_COLLECTIVES and tp < 2 and spec.base_rate > 0:
            raise FaultSpecError(f"{where}: {site} strikes the tensor-parallel collectives, "
                                 f"which a run with mesh.tp = {tp} does not have; set mesh.tp "
                                 f"to 2 or more (a paired mode).")
        if spec.layers is not None and (site in S.BLOCK_SITES or site in MODEL_COLLECTIVES):
            bad = [layer for layer in spec.layers if not 1 <= layer <= dims.n_layers]
            if bad:
                raise FaultSpecError(f"{where}: layers {bad} are not blocks of this model; "
                                     f"its layers are 1 to {dims.n_layers} (model.n_layers).")
        if spec.lanes is not None:
            bad = [lane for lane in spec.lanes if lane >= lanes[site]]
            if bad:
                raise FaultSpecError(f"{where}: lanes {bad} lie past the site's last axis, "
                                     f"which has {lanes[site]} lanes on a tp rank (0 to "
                                     f"{lanes[site] - 1}).")
        if spec.tp_ranks is not None and any(rank >= tp for rank in spec.tp_ranks):
            raise FaultSpecError(f"{where}: tp_ranks {list(spec.tp_ranks)} name ranks this "
                                 f"run lacks; mesh.tp = {tp} has ranks 0 to {tp - 1}.")
    return profile


@dataclass(frozen=True)
class Profile:
    name: str
    specs: tuple[FaultSpec, ...] = ()
    description: str = ""

    @property
    def healthy(self) -> bool:
        return all(s.base_rate == 0 for s in self.specs)
