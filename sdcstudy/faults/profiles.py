"""The node zoo: fault profiles modelled on the unhealthy nodes of Ma et al. and synthetic ones.

Paper nodes (`paper-node-1` ... `paper-node-15`) take their numbers from Ma et al.,
"Understanding Silent Data Corruption in LLM Training"; docs/faults.md derives the model:
- each fault is an error in a dot product's float32 accumulator: the element plus +/- m times
  the RMS of its row (`kind: additive`), m log-uniform on [2^-8, 1], the accumulator bits a
  bfloat16 result can show (MAGNITUDE). The relative L2 noise of a tensor is then
  sqrt(rate * E[m^2]) whatever its size, and the relative error of an element is large only
  where its healthy value is near zero (Table 2's heavy tail);
- per-site rates from Table 1 (average mismatch frequency over microsteps, per element),
  divided by the time pattern's mean multiplier over the paper's 4500-step run (section 4.1,
  appendix B.3) so that the run average reproduces Table 1;
- one weight-gradient spec (`grad`: the products dW = x^T dy, which the lock-step taps do not
  compare) whose rate gives Figure 5's WCNTS: nodes 2, 3 and 12 have no mismatch at the four
  sites but a non-zero WCNTS, and the rare nodes' Table 1 rates are far too low for theirs
  (section 7 of the paper: node 14 is rare under computation synchronization and shows
  "mismatched gradient norms at every step" under parameter synchronization);
- time patterns from the text: Figure 3 (nodes 7 and 14: rare spikes, "during the majority of
  training time, no mismatch occurs"; node 14 "very infrequently over 4000 optimizer steps"),
  Figure 4 (nodes 10 and 11: "a high peak of mismatch frequency at the first few steps"),
  section 6.2 (node 13: "no parameter difference before step 450");
- where the attention's faults arise (`attn_placement`): by default every fwd/attn fault lands
  in the output projection's product, between it and its ABFT check; `inside` puts them in the
  attention's context (the input of that projection), `split` shares them by multiply-adds
  (docs/faults.md, section 5.4);
- which error model (`fault_model`): `additive` (the above, the default) or `flip`, flips of
  the stored bfloat16 result's mantissa bits with a fitted fraction of accumulator errors
  (`faults/flip_model.py`; zoo names `paper-node-N-flip`, docs/faults.md section 6), and the
  initial spike's height (`spike_amplitude`, nodes 10 and 11).
The tables were measured in bfloat16 on a 16-layer (Tables 1-2) and a 32-layer (Figure 5)
Llama3-8B-style model (the tensor-parallel degree is not stated); rates are per element, so
they transfer to other sizes, but rare nodes (rates below ~1e-8) produce no submodule event at
all in a short run of a small model, as they would not on real hardware either.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from sdcstudy.core import yamlsafe
from sdcstudy.core.errors import UserError
from sdcstudy.faults import flip_model
from sdcstudy.faults.specs import FaultSpec, FaultSpecError, Profile, TimePattern, check_fits
from sdcstudy.faults.profile_yaml import profile_from_dict
from sdcstudy.faults.published import SITES, TABLE1_FREQUENCY, TABLE2_MAX_SEVERITY, WCNTS
from sdcstudy.faults.published import FLIP_SUFFIX, published
from sdcstudy.faults.time_patterns import NODE_PATTERNS

# An accumulator fault's error in units of its row's RMS: log-uniform over the top 8 bits of a
# float32 accumulator's mantissa, the ones a bfloat16 result keeps (docs/faults.md, section 2).
MAGNITUDE = (2.0 ** -8, 1.0)
PAPER_STEPS = 4500  # Ma et al. section 4: M = 4500 optimizer steps in the lock-step runs
PATTERNS = NODE_PATTERNS  # the nodes' time patterns (faults/time_patterns.py)
# The weight-gradient faults' time patterns: node 14 "shows mismatched gradient norms at every
# step" under parameter synchronization (section 7), so its bursts are not theirs.
GRAD_PATTERNS = {13: PATTERNS[13]}
# The fraction of Figure 5's WCNTS left to the weight-gradient faults; the rest comes from the
# node's Table 1 faults (measured: docs/faults.md, "Calibration"). 1.0 where those are too
# rare to matter, 0 where they alone reach it.
WEIGHT_GRAD_SHARE = {10: 0.0, 11: 0.0}

# Weight-gradient faults: errors in the products dW = x^T dy, which the lock-step taps do not see
# (they compare submodule outputs and input gradients), so they leave Tables 1 and 2 as they
# are and show only in the weight gradients (Figure 5). With `additive` errors of magnitude
# MAGNITUDE relative to the row RMS, a rate r adds a relative L2 noise of sqrt(r * E[m^2]) to
# each gradient leaf (docs/faults.md); the rate is the one that gives Figure 5's WCNTS less
# the noise the node's Table 1 faults already make (WEIGHT_GRAD_SHARE of it).
MAGNITUDE_MEAN_SQUARE = (MAGNITUDE[1] ** 2 - MAGNITUDE[0] ** 2) / (
    2 * math.log(MAGNITUDE[1] / MAGNITUDE[0]))
# Node 3's WCNTS, 1.34e-15, is a last-bit difference: a flip of the lowest mantissa bit.
LAST_BIT = {3: FaultSpec("grad", "bitflip", rate=1e-9, bits=(0,),
                         note="Figure 5 WCNTS 1.34e-15: a last-bit difference")}

# Where a node's fwd/attn faults land (`paper_node(attn_placement=...)`): `o_proj`, in the
# attention output projection's product before its check (the zoo's default: ABFT sees every
# one); `inside`, in the attention's context, the projection's input (the check sees a product
# consistent with its input); `split`, O_SHARE of the rate in the projection, the rest inside.
ATTN_PLACEMENTS = ("o_proj", "inside", "split")
CONTEXT_SITE = "fwd/attn_context"
# The output projection's share of the attention's unchecked multiply-adds per token: o takes
# d^2, QK^T and PV s*d each (standard attention without FlashAttention, appendix B.2), so
# d / (d + 2s) = 1/3 at the paper's s = d = 4096. The q, k and v projections have checks of
# their own and are left out.
O_SHARE = 1 / 3
FAULT_MODELS = ("additive", "flip")


def site_specs(node: int, site: str, rate: float, pattern: TimePattern, note: str,
               fault_model: str) -> list[FaultSpec]:
    """The specs of one Table 1 site under `fault_model`: one accumulator-error spec, or the
    bulk of bfloat16 mantissa flips and the fitted accumulator-error tail (`flip_model`)."""
    if fault_model == "additive":
        return [FaultSpec(site, "additive", rate=rate, scale=MAGNITUDE, pattern=pattern,
                          note=note)]
    p_tail = flip_model.tail_fraction(node, site)
    bulk = FaultSpec(site, "bitflip", rate=rate * (1 - p_tail),
                     bit_class=flip_model.BULK_BIT_CLASS, pattern=pattern,
                     note=f"{note}; bfloat16 mantissa flips, {1 - p_tail:.4g} of it")
    if p_tail == 0:
        return [bulk]
    return [bulk, FaultSpec(site, "additive", rate=rate * p_tail, scale=MAGNITUDE,
                            pattern=pattern, note=f"{note}; accumulator errors, {p_tail:.3g} "
                                                  f"of it (Tables 8-9 per-layer maxima)")]


def node_pattern(node: int, spike_amplitude: float | None) -> TimePattern:
    """The node's time pattern, its initial spike `spike_amplitude` high where given."""
    pattern = PATTERNS.get(node, TimePattern())
    if spike_amplitude is None:
        return pattern
    if pattern.kind != "decay":
        raise UserError(f"spike_amplitude applies to the nodes with an initial spike "
                        f"({', '.join(str(n) for n, p in PATTERNS.items() if p.kind == 'decay')}"
                        f"), not node {node}.")
    if spike_amplitude < 0:
        raise UserError(f"spike_amplitude must be at least 0, not {spike_amplitude}.")
    return dataclasses.replace(pattern, amplitude=float(spike_amplitude))


def weight_grad_spec(node: int, pattern: TimePattern) -> FaultSpec | None:
    if node in LAST_BIT:
        return LAST_BIT[node]
    share = WEIGHT_GRAD_SHARE.get(node, 1.0)
    if share <= 0:
        return None
    rate = (share * WCNTS[node]) ** 2 / MAGNITUDE_MEAN_SQUARE
    return FaultSpec("grad", "additive", rate=rate, scale=MAGNITUDE, pattern=pattern,
                     note=f"Figure 5 WCNTS {WCNTS[node]:g} (weight-gradient products)")


def attention_specs(spec: FaultSpec, placement: str, context_width: int | None,
                    o_share: float) -> list[FaultSpec]:
    """The fwd/attn spec `spec` (faults in the output projection's product) placed as
    `placement` says (ATTN_PLACEMENTS).

    A fault in the context (the attention's output, the projection's input: a row of
    `context_width` elements per token on one tp rank) moves the whole row of the projection's
    product, its fan-out of n elements. Table 1 counts mismatching elements of that product
    (m x n per rank); the same count, rate * m * n, comes from rate * m * n / n faulty rows, so
    the rate per context element is rate / context_width."""
    if placement not in ATTN_PLACEMENTS:
        raise UserError(f"attn_placement must be one of {', '.join(ATTN_PLACEMENTS)}, "
                        f"not {placement!r}.")
    if placement == "o_proj":
        return [spec]
    if not context_width or context_width < 1:
        raise UserError(f"attn_placement {placement!r} needs the context's width on one tp "
                        f"rank (context_width, the model's heads times head_dim over tp).")
    share = 0.0 if placement == "inside" else o_share
    inside = dataclasses.replace(spec, site=CONTEXT_SITE,
                                 rate=spec.rate * (1 - share) / context_width,
                                 note=f"{spec.note}; {1 - share:.3g} of it in the attention's "
                                      f"context, divided by its width {context_width}")
    if share == 0:
        return [inside]
    return [dataclasses.replace(spec, rate=spec.rate * share,
                                note=f"{spec.note}; {share:.3g} of it in the output projection"),
            inside]


def paper_node(node: int, attn_placement: str = "o_proj", context_width: int | None = None,
               o_share: float = O_SHARE, fault_model: str = "additive",
               spike_amplitude: float | None = None) -> Profile:
    """Ma et al.'s node `node`; `attn_placement` (with `context_width` and `o_share`) moves its
    fwd/attn faults (`attention_specs`); the default keeps them in the output projection.
    `fault_model` "flip" makes the Table 1 faults bfloat16 mantissa flips with a fitted tail
    of accumulator errors (`site_specs`); `spike_amplitude` sets nodes 10 and 11's spike."""
    if fault_model not in FAULT_MODELS:
        raise UserError(f"fault_model must be one of {', '.join(FAULT_MODELS)}, "
                        f"not {fault_model!r}.")
    pattern = node_pattern(node, spike_amplitude)
    mean = pattern.mean_multiplier(PAPER_STEPS)
    specs = []
    if node in TABLE1_FREQUENCY:
        for site, freq, severity in zip(SITES, TABLE1_FREQUENCY[node], TABLE2_MAX_SEVERITY[node]):
            if freq == 0:
                continue
            note = f"Table 1 frequency {freq:g} (Table 2 max severity {severity:g})"
            for spec in site_specs(node, site, min(freq / mean, 1.0), pattern, note,
                                   fault_model):
                specs += (attention_specs(spec, attn_placement, context_width, o_share)
                          if site == "fwd/attn" else [spec])
    if (grad := weight_grad_spec(node, GRAD_PATTERNS.get(node, TimePattern()))) is not None:
        specs.append(grad)
    busiest = max(TABLE1_FREQUENCY.get(node, (0,)))
    what = (f"Table 1 mismatch frequency up to {busiest:.2g} per element (run average), "
            f"{pattern_words(pattern)}" if busiest
            else "no submodule mismatch; weight-gradient noise only")
    name = f"paper-node-{node}" + (FLIP_SUFFIX if fault_model == "flip" else "")
    if spike_amplitude is not None:
        name += f"-spike{spike_amplitude:g}"
    model = ""
    if fault_model == "flip" and busiest:
        tail = [s.site for s in specs if s.kind == "additive" and s.site != "grad"]
        alone = [s.site for s in specs if s.kind == "bitflip" and s.rate == 0]
        model = (", bfloat16 mantissa flips" + (" with an accumulator-error tail" if tail else "")
                 + (f" ({', '.join(alone)}: accumulator errors only)" if alone else ""))
    elif fault_model == "flip":
        model = f", as paper-node-{node} (no submodule faults to model)"
    return Profile(name, tuple(specs),
                   f"Ma et al. node {node}: {what}{model}; WCNTS {WCNTS[node]:g}")


def pattern_words(pattern: TimePattern) -> str:
    """A node's time pattern as its description states it."""
    if pattern.kind == "burst":
        return f"in bursts on about 1 step in {1 / pattern.p_active:,.0f}"
    if pattern.kind == "decay":
        return (f"an initial spike ({1 + pattern.amplitude:g}x at step 1, decaying over "
                f"{pattern.decay_steps:g} steps)")
    if pattern.kind == "onset":
        return f"none before step {pattern.onset_step}"
    return "constant rate"


def synthetic() -> list[Profile]:
    both_fwd = ("fwd/attn", "fwd/ffn")
    return [
        Profile("exponent-flip", tuple(
            FaultSpec(s, "bitflip", rate=1e-5, bit_class="exponent") for s in both_fwd),
            "single exponent-bit flips in attention and FFN outputs (huge relative errors)"),
        Profile("mantissa-noise", tuple(
            FaultSpec(s, "bitflip", rate=1e-4, bit_class="mantissa") for s in SITES),
            "flips of one mantissa bit, any of them, at all four sites (relative errors "
            "below 1, many events)"),
        Profile("stuck-lane", (
            FaultSpec("fwd/ffn", "zero", rate=1.0, lanes=(3,), tp_ranks=(0,)),),
            "tp rank 0 keeps FFN output column 3 stuck at zero (a dead lane)"),
        Profile("nan-burst", (
            FaultSpec("fwd/attn", "nan", rate=1e-4, pattern=TimePattern("burst", p_active=0.05)),),
            "rare steps whose attention outputs contain NaNs"),
        Profile("repeatable", (
            FaultSpec("fwd/ffn", "bitflip", rate=1e-4, bit_class="exponent", repeatable=True),),
            "the same inputs always give the same wrong FFN output (not caught by re-execution)"),
    ]


# Figure 7 (section 6.2): node 6's loss spike while fine-tuning, which its Tables 1 and 2 cannot
# make (docs/faults.md, "Loss spikes", measured by experiments/loss_spike.py). Node 6 as
# published plus rare errors of 10 to 13 binary orders (as an exponent-bit flip makes) in a
# fraction of the optimizer's parameter update: a site that lock-step and parameter
# synchronization never compare (both overwrite the suspect's parameters after the step), so
# Tables 1 and 2 and Figure 5 stay node 6's. One event per LOSS_SPIKE_STEPS steps: the one spike
# in the steps whose loss the paper shows for node 6 (2,500 of pre-training in Figure 6, none
# there; 790 of CosmosQA fine-tuning in Figure 7, appendix E.4).
LOSS_SPIKE_NODE = 6
LOSS_SPIKE_STEPS = 2500 + 790
LOSS_SPIKE_UPDATE = FaultSpec(
    "update", "scale", rate=1e-2, scale=(1e3, 1e4),
    pattern=TimePattern("burst", p_active=1 / LOSS_SPIKE_STEPS),
    note="Figure 7: update errors that spike the loss (docs/faults.md, Loss spikes)")


def loss_spike_regime() -> Profile:
    """`paper-node-6-loss-spike`: node 6 as published plus LOSS_SPIKE_UPDATE."""
    node = paper_node(LOSS_SPIKE_NODE)
    return Profile(f"{node.name}-loss-spike", node.specs + (LOSS_SPIKE_UPDATE,),
                   f"{node.description}; plus, about once in {LOSS_SPIKE_STEPS} steps, "
                   f"{LOSS_SPIKE_UPDATE.rate:g} of the parameter update times 1 +/- 1e3-1e4: "
                   f"Figure 7's loss spike")


def zoo() -> dict[str, Profile]:
    profiles = {"healthy": Profile("healthy", (), "a healthy node: injects nothing")}
    for node in range(1, 16):
        profiles[f"paper-node-{node}"] = paper_node(node)
    spike = loss_spike_regime()
    profiles[spike.name] = spike
    for p in synthetic():
        profiles[p.name] = p
    return profiles


def flip_variants() -> dict[str, Profile]:
    """The paper nodes under the flip model (`paper-node-N-flip`): named like the zoo's, listed
    by `sdcstudy profiles`, outside `zoo()` so that a sweep of the whole zoo stays as it was."""
    return {f"paper-node-{node}{FLIP_SUFFIX}": paper_node(node, fault_model="flip")
            for node in range(1, 16)}


def with_fault_kind(profile: Profile, fault_kind: str = "profile") -> Profile:
    """`profile` with every spec made transient or repeatable ("profile" leaves it as is)."""
    if fault_kind == "profile":
        return profile
    flags = dict(transient=fault_kind == "transient", repeatable=fault_kind == "repeatable")
    return Profile(profile.name, tuple(dataclasses.replace(s, **flags) for s in profile.specs),
                   profile.description)


def load(name_or_path: str, fault_kind: str = "profile") -> Profile:
    """A zoo profile by name, or a YAML profile file, with `with_fault_kind` applied."""
    return with_fault_kind(_load(name_or_path), fault_kind)


# Tree sites only some modes apply; a spec at one elsewhere would never fire. (Detect mode
# refuses its own, `detect.trainer.UNAPPLIED_SITES`.)
SITE_MODES = {"collective/grad_allreduce": ("paft", "detect")}


def load_for(cfg, fault_kind: str | None = None) -> Profile:
    """`cfg.suspect.profile` as `load` gives it (with `fault_kind`, by default the config's),
    refused when a spec could never fire in the config's run: layers, lanes or tp ranks its
    model lacks (`specs.check_fits`), a site its mode does not have (`SITE_MODES`), or, in a
    profile file, a time pattern whose steps all lie past experiment.steps (`check_reached`;
    the zoo's nodes are as published: node 13 is clean before step 450 in any run)."""
    from sdcstudy.core.config import model_dims

    profile = load(cfg.suspect.profile,
                   cfg.suspect.fault_kind if fault_kind is None else fault_kind)
    try:
        check_fits(profile, model_dims(cfg.model), cfg.mesh.tp, cfg.data.seq_len)
        check_mode(profile, cfg.experiment.mode)
        if cfg.suspect.profile not in {**zoo(), **flip_variants()}:
            check_reached(profile, cfg.experiment.steps)
    except FaultSpecError as e:
        raise UserError(f"suspect.profile: {e}") from None
    return profile


def _where(profile: Profile, i: int) -> str:
    return f"profile {profile.name!r}: specs[{i}] ({profile.specs[i].site})"


def check_mode(profile: Profile, mode: str) -> None:
    """A `FaultSpecError` for a spec at a site that experiment.mode `mode` never applies."""
    for i, spec in enumerate(profile.specs):
        modes = SITE_MODES.get(spec.site)
        if modes is not None and mode not in modes and spec.base_rate > 0:
            raise FaultSpecError(f"{_where(profile, i)}: {spec.site} is the gradient "
                                 f"all-reduce of experiment.mode paft, which mode {mode} does "
                                 f"not have; use site grad (the accumulated gradient) or mode "
                                 f"paft.")


def check_reached(profile: Profile, steps: int) -> None:
    """A `FaultSpecError` for a spec whose time pattern is off at every step of a run of
    `steps` optimizer steps (counted from 1): a steps pattern past them, or a later onset."""
    for i, spec in enumerate(profile.specs):
        p = spec.pattern
        if spec.base_rate > 0 and p.kind == "steps" and p.steps and min(p.steps) > steps:
            raise FaultSpecError(f"{_where(profile, i)}: pattern.steps {list(p.steps)} all lie "
                                 f"past the run's last step (experiment.steps = {steps}), so "
                                 f"the spec would never fire; list a step from 1 to {steps} "
                                 f"or raise experiment.steps.")
        if spec.base_rate > 0 and p.kind == "onset" and p.onset_step > steps:
            raise FaultSpecError(f"{_where(profile, i)}: pattern.onset_step {p.onset_step} "
                                 f"lies past the run's last step (experiment.steps = {steps}), "
                                 f"so the spec would never fire; lower it or raise "
                                 f"experiment.steps.")


def _load(name_or_path: str) -> Profile:
    profiles = {**zoo(), **flip_variants()}
    if name_or_path in profiles:
        return profiles[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise UserError(f"fault profile file {name_or_path!r} does not exist.")
        try:
            return profile_from_dict(yamlsafe.load_file(path, "fault profile"), str(path))
        except FaultSpecError as e:
            raise UserError(str(e)) from None
    import difflib

    close = difflib.get_close_matches(name_or_path, list(profiles), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UserError(f"unknown fault profile {name_or_path!r}{hint}; `sdcstudy profiles` lists "
                    f"them, or give a .yaml file.")


def to_dict(profile: Profile) -> dict:
    """A profile as the mapping `load` reads from a YAML file (tuples as lists): write it with
    `core.yamlsafe.dump` to hand a changed profile to a run."""
    def plain(value):
        return list(value) if isinstance(value, tuple) else value
    specs = []
    for spec in profile.specs:
        fields = {k: plain(v) for k, v in dataclasses.asdict(spec).items()}
        fields["pattern"] = {k: plain(v) for k, v in fields["pattern"].items()}
        specs.append(fields)
    return {"name": profile.name, "description": profile.description, "specs": specs}


def listing() -> str:
    rows = [(name, p.description) for name, p in {**zoo(), **flip_variants()}.items()]
    width = max(len(n) for n, _ in rows)
    return "\n".join(f"{name:<{width}}  {desc}" for name, desc in rows)


# What callers read from here: the zoo, loading, and (for `demo`) the published numbers.
__all__ = ["zoo", "flip_variants", "paper_node", "load", "load_for", "to_dict", "listing",
           "published", "check_mode", "check_reached"]
