"""python experiments/loss_spike.py --out DIR [--steps 60] [--at 40]

Ma et al.'s Figure 7 (section 6.2): fine-tuning on CosmosQA, node 6's training loss spikes,
and a spike near the end leaves a model with 0% test accuracy (Table 3). What it takes to
make such a spike, measured on the `tiny` preset (configs/tiny.yaml), free-running (no
synchronization: the healthy and the suspect node train side by side on the same batches),
one run per case, each with one corrupting event at step `--at`:

- `paper-node-6`: node 6 as published (Table 1's rates, Figure 5's weight-gradient noise);
- `ceiling`: the largest corruption node 6's Table 2 allows at its four sites (a severity of
  about 1: each element doubled or zeroed, `scale` 1 +/- 1), at every element of all four
  (rate 1, about 10^8-10^10 times Table 1's), for one step;
- `update-F`: a fraction F of the parameter update's elements multiplied by 1 +/- r, r
  log-uniform in [1e3, 1e4] (an error of 10 to 13 binary orders in the update, as an
  exponent-bit flip makes), for F in 1e-5, 1e-4, 1e-3, 1e-2: what size it takes;
- `grad-0.01`: the errors of `update-0.01` in the weight gradient instead (before clipping
  and Adam, which bound what one step can move);
- `paper-node-6-loss-spike`: the zoo's regime (node 6 as published plus such update errors,
  sdcstudy/faults/profiles.py), its rare events placed at step `--at`.

The spike criterion is the study's one (sdcstudy/core/metrics.py, `loss_spike_spans`;
docs/metrics.md, "Loss spikes"): a step is flagged when the suspect's loss is not finite or
exceeds the healthy node's at the same step by more than 0.5 nats (summary.json's
`loss_spikes`), and a loss spike is at least 2 consecutive flagged steps. Two, because Figure
7's spikes last (the loss comes down only as "training is again stabilized"), while a
corrupted forward pass raises the loss read at its own step only. Also reported: the largest
gap loss/suspect - loss/healthy after the event, and the first step after the first flagged
one that is not flagged (the recovery; "never" within the run).

What it should show: no spike from node 6 as published (no fault at its four sites in a run of
this size) nor from the ceiling (the loss read at the event's own step up, the model not), none
from the errors in the gradient, and a spike from update errors once F is large enough,
recovering or not by its size. Results in DIR (a new or empty folder): loss_spike.md and
loss_spike.csv, the run folders. Two to four minutes a run on the loaded 2-core machine, most of
it compiling.

Measured (defaults, 2026-11-29, docs/results/faults.md "Loss spikes"): node 6 as published, a
largest loss gap of 8e-5 nats; the ceiling 0.58 nats at its own step (flagged), 0.011 the next
(no spike); gradient errors 0.009; update errors at 1e-5 and 1e-4 at most 0.019 nats, at 1e-3
a spike at steps 41-43 of 1.8 nats back under 0.5 at step 44, at 1e-2 one of 27.6 nats at
steps 41-60, still 7.7 up at step 60; the regime (1e-2) a spike of 14.7 nats at steps 41-60,
still 3.8 up at step 60.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy import runner  # noqa: E402
from sdcstudy.core import config as C  # noqa: E402
from sdcstudy.core.errors import ArgumentParser  # noqa: E402
from sdcstudy.core import metrics as MX  # noqa: E402
from sdcstudy.core import runfolder as RF  # noqa: E402
from sdcstudy.core import yamlsafe  # noqa: E402
from sdcstudy.faults import profiles as P  # noqa: E402
from sdcstudy.faults.specs import TimePattern  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NATS = MX.SPIKE_NATS  # the criterion's per-step threshold, for the table's words
UPDATE_FRACTIONS = (1e-5, 1e-4, 1e-3, 1e-2)
REGIME = "paper-node-6-loss-spike"


def at_step(profile, step: int):
    """`profile` with its update-site specs' events placed at `step` (the rest as it is)."""
    specs = tuple(dataclasses.replace(s, pattern=TimePattern("steps", steps=(step,)))
                  if s.site == "update" else s for s in profile.specs)
    return dataclasses.replace(profile, specs=specs)


def profile_yaml(profile) -> str:
    """A profile as the YAML `profiles.load` reads."""
    return yamlsafe.dump(P.to_dict(profile), sort_keys=False)


def one_step(name: str, step: int, specs: list[dict], what: str) -> str:
    pattern = {"kind": "steps", "steps": [step]}
    return yamlsafe.dump({"name": name, "description": what,
                          "specs": [{**s, "pattern": pattern} for s in specs]}, sort_keys=False)


def cases(at: int) -> dict[str, str]:
    """Run name -> a zoo profile's name or a profile's YAML text."""
    four = [{"site": s, "kind": "scale", "rate": 1.0, "scale": [1.0, 1.0]}
            for s in ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")]
    found = {"paper-node-6": "paper-node-6",
             "ceiling": one_step("ceiling", at, four, "every element of the four sites "
                                 "doubled or zeroed (Table 2's node-6 severity ~1), one step")}
    for fraction in UPDATE_FRACTIONS:
        name = f"update-{fraction:g}"
        found[name] = one_step(name, at, [{"site": "update", "kind": "scale", "rate": fraction,
                                           "scale": [1e3, 1e4]}],
                               f"{fraction:g} of the update's elements times 1 +/- [1e3, 1e4]")
    found["grad-0.01"] = one_step("grad-0.01", at, [{"site": "grad", "kind": "scale",
                                                     "rate": 1e-2, "scale": [1e3, 1e4]}],
                                  "update-0.01's errors in the gradient instead")
    found[REGIME] = profile_yaml(at_step(P.load(REGIME), at))
    return found


def measure(run_dir: Path, at: int) -> dict:
    """The spike figures of one run folder (metrics.jsonl, summary.json) from step `at` on."""
    rows = RF.read_jsonl(run_dir / RF.METRICS)  # a non-finite value is written as a string
    steps = [r["step"] for r in rows]
    healthy = [float(r["loss/healthy"]) for r in rows]
    suspect = [float(r["loss/suspect"]) for r in rows]
    gap = {s: b - a for s, a, b in zip(steps, healthy, suspect)}
    after = [s for s in steps if s >= at]
    largest = max((gap[s] for s in after), key=lambda g: g if math.isfinite(g) else math.inf)
    flagged = MX.loss_spikes(rows)
    over = [s for s in flagged if s >= at]
    recovered = next((s for s in after if over and s > over[0] and s not in flagged), None)
    summary = RF.json_load(run_dir / RF.SUMMARY)
    return {"spikes": MX.loss_spike_spans(flagged), "flagged": flagged,
            "gap/at": gap.get(at, math.nan), "gap/largest": largest,
            "gap/first_over": over[0] if over else None,
            "recovered_at": recovered if over else None,
            "param/diff_l2": float(rows[-1]["param/diff_l2"]),
            "faults/landed": summary.get("faults/landed"),
            "loss/suspect_last": suspect[-1], "loss/healthy_last": healthy[-1]}


def table(results: dict[str, dict]) -> str:
    head = ("| run | faults landed | flagged steps | spikes | gap at the event | largest gap | "
            f"back under {NATS:g} nats | gap at the end | param/diff_l2 at the end |")
    lines = [head, "|" + "---|" * 9]
    for name, r in results.items():
        back = ("-" if r["gap/first_over"] is None else
                f"step {r['recovered_at']}" if r["recovered_at"] else "never")
        spans = ", ".join(f"{a}-{b}" for a, b in r["spikes"]) or "none"
        end = r["loss/suspect_last"] - r["loss/healthy_last"]
        lines.append(f"| {name} | {r['faults/landed']} | {steps_text(r['flagged'])} | {spans} | "
                     f"{r['gap/at']:.3g} | {r['gap/largest']:.3g} | {back} | {end:.3g} | "
                     f"{r['param/diff_l2']:.3g} |")
    return "\n".join(lines)


def steps_text(steps: list[int]) -> str:
    """Steps as ranges: [11, 12, 13, 20] -> "11-13, 20"."""
    spans = MX.loss_spike_spans(steps, min_steps=1)
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) or "none"


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", required=True, type=Path, help="a new or empty folder")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--at", type=int, default=40, help="the step of the corrupting event")
    parser.add_argument("--only", nargs="*", help="run only these cases (names as listed)")
    args = parser.parse_args(argv)
    if not 1 <= args.at <= args.steps:
        print(f"loss_spike: --at {args.at} must lie in 1..--steps ({args.steps}).",
              file=sys.stderr)
        return 2
    runs = cases(args.at)
    unknown = sorted(set(args.only or ()) - set(runs))
    if unknown:
        print(f"loss_spike: --only names {', '.join(unknown)}, not one of {', '.join(runs)}.",
              file=sys.stderr)
        return 2
    out = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"loss_spike: --out {str(out)!r} is not an empty folder; give a new --out.",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results, start = {}, time.perf_counter()
    for name, profile in runs.items():
        if args.only and name not in args.only:
            continue
        if profile.startswith("name:"):
            path = out / f"{name}.yaml"
            path.write_text(profile)
            profile = str(path)
        cfg = C.load(ROOT / "configs" / "tiny.yaml", [
            "experiment.mode=free", f"experiment.steps={args.steps}",
            "experiment.checkpoint_every=0", f"experiment.name={name}",
            f"suspect.profile={profile}"])
        runner.run(cfg, out / name, progress=False)
        results[name] = measure(out / name, args.at)
        print(f"{name}: {results[name]}", flush=True)
    text = table(results)
    (out / "loss_spike.md").write_text(text + "\n")
    (out / "loss_spike.csv").write_text(
        "run," + ",".join(next(iter(results.values()))) + "\n" + "\n".join(
            name + "," + ",".join(str(v).replace(",", ";") for v in r.values())
            for name, r in results.items()) + "\n")
    print(text)
    print(f"{time.perf_counter() - start:.0f} s in all; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
