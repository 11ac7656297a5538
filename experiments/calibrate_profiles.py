"""Calibration of the node zoo: do the paper profiles reproduce Ma et al.'s Tables 1 and 2?

For every `paper-node-N` profile whose expected number of mismatches over the run is at least
`--min-expected` (100 by default), run lock-step on the tiny Llama with that profile on the
suspect and print, per site, the measured average mismatch frequency and maximum severity
(summary.json, the contract's formulas) against the published ones.

The published frequency is a 4500-step average. A profile's time pattern (the initial spike of
nodes 10 and 11, the bursts of node 7) makes a shorter run's expected average differ from it, by
the ratio of the pattern's mean multiplier over this run to that over 4500 steps; the table
shows that expectation next to the published value, and the verdict uses it. A (profile, site)
is judged only where its own expected count reaches `--min-expected` and, for bursty profiles
(node 7), where at least 30 active steps are expected (`--steps 800` for node 7): rarer sites
are listed, but their few events say little. Verdict: frequency within 25%, maximum severity within a
factor of 3.

    python experiments/calibrate_profiles.py --out runs/calibration [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

from sdcstudy.core import config as C  # noqa: E402
from sdcstudy.faults import profiles  # noqa: E402
from sdcstudy import runner  # noqa: E402
from sdcstudy.core import runfolder as RF  # noqa: E402
from sdcstudy.core.config import UserError  # noqa: E402
from sdcstudy.demo import DEMO  # noqa: E402

FREQ_TOLERANCE = 0.25
SEVERITY_FACTOR = 3.0
MIN_EXPECTED = 100.0
# A bursty profile's average is judged only when this many active steps are expected: their
# count is binomial, so 30 of them put one standard deviation near 18%.
MIN_ACTIVE_STEPS = 30


def site_elements(cfg) -> int:
    """Elements compared per site and optimizer step: every tp rank holds a whole (B, L, D)
    partial sum before the reduce-scatter, in every layer and microstep."""
    dims = C.model_dims(cfg.model)
    e = cfg.experiment
    return e.batch_size * cfg.data.seq_len * dims.d_model * cfg.mesh.tp * dims.n_layers * e.microsteps


def expectations(profile, cfg) -> dict:
    """{site: (expected mismatches over the run, expected average frequency)} of a profile."""
    steps, per_step = cfg.experiment.steps, site_elements(cfg)
    out = {}
    for spec in profile.specs:
        if spec.site not in profiles.SITES:
            continue
        freq = spec.rate * spec.pattern.mean_multiplier(steps)
        count, total = out.get(spec.site, (0.0, 0.0))
        out[spec.site] = (count + freq * per_step * steps, total + freq)
    return out


def active_steps(profile, steps: int) -> float:
    """Expected number of steps in which a bursty profile fires at all (`steps` otherwise): with
    bursts the run average rests on that many draws, however many mismatches each brings."""
    bursts = [s.pattern.p_active for s in profile.specs if s.pattern.kind == "burst"]
    return min(bursts) * steps if bursts else float(steps)


def calibrate(name: str, cfg, out: Path, progress: bool, min_expected: float) -> list[dict]:
    profile = profiles.load(name)
    expected = expectations(profile, cfg)
    summary = runner.run(C.from_dict(C.to_dict(cfg), [f"suspect.profile={name}",
                                                      f"experiment.name={name}"]),
                         out / name, progress=progress)
    paper = profiles.published(name)
    rows = []
    for site in profiles.SITES:
        count, freq_expected = expected.get(site, (0.0, 0.0))
        freq = summary.get("freq", {}).get(site, 0.0)
        severity = summary.get("max_severity", {}).get(site, 0.0)
        sev_paper = paper["max_severity"][site]
        judged = count >= min_expected and active_steps(profile, cfg.experiment.steps) >= \
            MIN_ACTIVE_STEPS
        freq_ok = abs(freq - freq_expected) <= FREQ_TOLERANCE * freq_expected if judged else None
        sev_ok = (sev_paper / SEVERITY_FACTOR <= severity <= sev_paper * SEVERITY_FACTOR
                  if judged else None)
        rows.append({"profile": name, "site": site, "expected_mismatches": count,
                     "mismatches": summary.get("mismatches", {}).get(site, 0),
                     "freq": freq, "freq_expected": freq_expected,
                     "freq_published": paper["freq"][site], "max_severity": severity,
                     "max_severity_published": sev_paper, "judged": judged,
                     "freq_ok": freq_ok, "severity_ok": sev_ok})
    return rows


def markdown(rows: list[dict]) -> str:
    def mark(ok):
        return "" if ok is None else (" ok" if ok else " **off**")

    lines = ["| profile | site | expected n | measured n | frequency | expected (run) "
             "| Table 1 | max severity | Table 2 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['profile']} | {r['site']} | {r['expected_mismatches']:.0f} "
                     f"| {r['mismatches']} | {r['freq']:.3g}{mark(r['freq_ok'])} "
                     f"| {r['freq_expected']:.3g} | {r['freq_published']:.3g} "
                     f"| {r['max_severity']:.3g}{mark(r['severity_ok'])} "
                     f"| {r['max_severity_published']:.3g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the runs and the table")
    p.add_argument("--steps", type=int, default=200, help="lock-step optimizer steps per profile")
    p.add_argument("--min-expected", type=float, default=MIN_EXPECTED,
                   help="expected mismatches a profile (and a site) needs to be measured")
    p.add_argument("--profiles", default=None, help="comma-separated paper profiles "
                   "(default: every one expected to reach --min-expected)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        cfg = C.from_dict(DEMO, [f"experiment.steps={args.steps}"])
        names = args.profiles.split(",") if args.profiles else [
            n for n in profiles.zoo() if profiles.published(n) is not None
            and sum(c for c, _ in expectations(profiles.load(n), cfg).values()) >= args.min_expected]
        for n in names:
            if profiles.published(n) is None:
                raise UserError(f"{n!r} is not a paper-node profile with published numbers.")
        out = RF.open_run_dir(args.out, resume=False)
        print(f"calibrating {', '.join(names)}: {args.steps} lock-step steps each, "
              f"{site_elements(cfg):,} elements per site and step", file=sys.stderr)
        rows = []
        for name in names:
            rows += calibrate(name, cfg, out, not args.no_progress, args.min_expected)
    except UserError as e:
        print(f"calibrate_profiles: error: {e}", file=sys.stderr)
        return 2
    table = markdown(rows)
    RF.atomic_write_text(out / "calibration.md", table + "\n")
    RF.atomic_write_json(out / "calibration.json", rows)
    print(table)
    judged = [r for r in rows if r["judged"]]
    good = sum(bool(r["freq_ok"] and r["severity_ok"]) for r in judged)
    print(f"\n{good} of {len(judged)} measurable (profile, site) pairs within {FREQ_TOLERANCE:.0%} "
          f"in frequency and a factor {SEVERITY_FACTOR:g} in maximum severity; "
          f"tables in {out}")
    return 0 if good == len(judged) else 1


if __name__ == "__main__":
    sys.exit(main())
