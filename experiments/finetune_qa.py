"""python experiments/finetune_qa.py --out DIR [--pretrain-steps 300] [--steps 200]

Fine-tuning under SDC offline (Ma et al., section 6.1 experiment II, Table 3 and Figure 7):
pretrain the tiny Llama on the synthetic corpus, then fine-tune it on the synthetic
multiple-choice task (configs/finetune-tiny.yaml) on a healthy node paired with a suspect
node, free-running, once per suspect profile:

- healthy, and healthy with another shuffle seed (the data-order baseline of DP);
- three zoo profiles: paper-node-1 (steady mismatches at all four sites), paper-node-10
  (a burst of mismatches in the first steps), mantissa-noise (many small corruptions);
- late-update-corruption, a profile defined here: at step 90% of the run, 10% of the
  parameter update's elements are multiplied by 1 +/- r, r log-uniform in [1000, 10000] (a
  large late corruption, as on Ma et al.'s node 6; a tenth of that, 5% at [100, 1000], moved
  the loss by only 0.4 nats on this task).

What it should show: the healthy node's test accuracy (TA) well above chance (1/3) and above
always answering "?" (50%) or "." (45%); the zoo profiles' models near the healthy one, with a
disagreement (DP) of the order of the other seed's; the late corruption flagged as a loss
spike, with its damage in TA and DP. Results in DIR: report/ (report.md with Table 3, the
loss-spike table and Figure 7), finetune_qa.md and finetune_qa.csv (Table 3), the run
folders. About 10 minutes on 2 idle CPU cores (20 on a loaded machine).

Measured (defaults, 2 shared CPU cores, 2026-11-25, RESULTS.md): Table 3 TA (DP) healthy
93.00 (-); other seed 92.60 (3.40); paper-node-1 93.40 (1.20) and paper-node-10 93.80 (3.20),
no loss spike (the paper nodes' faults are small additive errors, docs/faults.md: their DP is
not larger than the other seed's, as in Ma et al.'s Table 3); mantissa-noise 93.40 (2.80), no
spike; late-update-corruption 42.60 (52.40), a loss spike at steps 181-200 of up to 15 nats.
The healthy row is the healthy node of the first run read (paper-node-1's), whose bits leave
the healthy run's (TA 91.40) at step 3 when the suspect's profile has a `grad` or `update` spec.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy.core import config as C  # noqa: E402
from sdcstudy.core.errors import ArgumentParser  # noqa: E402
from sdcstudy.finetune import report as FR  # noqa: E402
from sdcstudy.report import writer as R  # noqa: E402
from sdcstudy import runner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ZOO = ("paper-node-1", "paper-node-10", "mantissa-noise")
LATE = "late-update-corruption"
OTHER_SEED = 1


def late_profile(steps: int) -> str:
    step = max(1, int(0.9 * steps))
    return f"""name: {LATE}
description: "at step {step}, 10% of the parameter update multiplied by 1 +/- r, r in [1e3, 1e4]"
specs:
  - site: update
    kind: scale
    rate: 0.1
    scale: [1000, 10000]
    pattern: {{kind: steps, steps: [{step}]}}
"""


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if args.pretrain_steps < 1 or args.steps < 1:
        parser.error(f"--pretrain-steps and --steps must be at least 1, not "
                     f"{args.pretrain_steps} and {args.steps}.")
    out = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"finetune_qa: --out {str(out)!r} exists and is not empty; choose a new folder.",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    pretrain = C.load(ROOT / "configs" / "tiny.yaml", [
        f"experiment.steps={args.pretrain_steps}", "experiment.checkpoint_every=0",
        "data.seq_len=128"])
    summary = runner.run(pretrain, out / "pretrain")
    print(f"pretrained: loss {summary['loss/first']:.3f} -> {summary['loss/last']:.3f}")

    profile_file = out / f"{LATE}.yaml"
    profile_file.write_text(late_profile(args.steps))
    runs = [("healthy", None), ("healthy", OTHER_SEED), *((p, None) for p in ZOO),
            (str(profile_file), None)]
    run_dirs = []
    for profile, seed in runs:
        name = Path(profile).stem + ("" if seed is None else f"-seed{seed}")
        overrides = [f"finetune.init={out / 'pretrain'}", f"suspect.profile={profile}",
                     f"experiment.steps={args.steps}", f"experiment.name={name}"]
        if seed is not None:
            overrides.append(f"finetune.shuffle_seed={seed}")
        cfg = C.load(ROOT / "configs" / "finetune-tiny.yaml", overrides)
        s = runner.run(cfg, out / name)
        run_dirs.append(out / name)
        print(f"{name}: TA healthy {s['qa/ta/healthy']:.2f}, suspect {s['qa/ta/suspect']:.2f}, "
              f"DP {s['qa/dp/suspect']:.2f}, loss spikes at {s['loss_spikes'] or 'no step'}")

    result = R.write_report(run_dirs, out / "report")
    runs_by_label, _ = R.load_runs(run_dirs)
    table = FR.table3(runs_by_label)
    (out / "finetune_qa.md").write_text(FR.table3_markdown(table) + "\n")
    (out / "finetune_qa.csv").write_text(table.to_csv(float_format="%.4g"))
    print(FR.table3_markdown(table))
    print(f"report: {result['out'] / R.REPORT}; {time.perf_counter() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
