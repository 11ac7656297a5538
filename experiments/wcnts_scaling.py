"""python experiments/wcnts_scaling.py --out DIR [--nodes 1,11] [--presets tiny,small,medium]

Does the gradient noise of a paper node grow with the model? One parameter-synchronized run
(`experiment.mode=paramsync`, configs/demo.yaml's pairing: tp 2, batch 4 x 64 tokens) per node
and model preset, then WCNTS (eq. 5) against the parameter count: `wcnts_scaling.md`, `.json`
and `wcnts_scaling.png` in DIR, beside one run folder per (preset, node).

What it should show: the paper nodes' additive accumulator faults add a relative L2 noise of
sqrt(rate * E[m^2]) to each tensor whatever its size (docs/faults.md), so WCNTS stays within a
small factor across sizes (the target: tiny, small and medium within 3x of each other), where
the earlier multiplicative model grew it from 142 (tiny) to 4.4e7 (small) for node 1.
Finished runs in DIR are kept, so an interrupted study continues where it stopped. About 25
minutes on 2 idle CPU cores (medium's steps take most of it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy.core.errors import ArgumentParser  # noqa: E402

STEPS = {"tiny": 10, "small": 10, "medium": 6}  # medium's steps are ~30x tiny's
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def run_one(out: Path, preset: str, node: int) -> dict:
    from sdcstudy import runner
    from sdcstudy.core import config as C
    from sdcstudy.core import runfolder as RF

    folder = out / f"{preset}-node{node}"
    if (folder / RF.SUMMARY).is_file():
        return RF.json_load(folder / RF.SUMMARY)
    resume = (folder / RF.CONFIG).is_file()  # a run the study was interrupted in continues
    cfg = C.load(CONFIG, [f"model.preset={preset}", "experiment.mode=paramsync",
                          f"suspect.profile=paper-node-{node}", "experiment.batch_size=4",
                          f"experiment.steps={STEPS[preset]}", "optim.warmup_steps=2"])
    return runner.run(cfg, folder, resume=resume, progress=False, echo=lambda *a: None)


def plot(rows: list[dict], path: Path) -> None:
    from sdcstudy.core import reports
    from sdcstudy.faults.published import WCNTS

    plt = reports.pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=120)
    for node in sorted({r["node"] for r in rows}):
        mine = sorted((r for r in rows if r["node"] == node), key=lambda r: r["n_params"])
        line, = ax.plot([r["n_params"] for r in mine], [r["wcnts"] for r in mine], "o-",
                        label=f"paper-node-{node}")
        ax.axhline(WCNTS[node], color=line.get_color(), ls=":", lw=1)
        ax.axhspan(WCNTS[node] / 3, WCNTS[node] * 3, color=line.get_color(), alpha=0.08)
    ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="WCNTS (eq. 5)",
           title="WCNTS against model size (dotted: Figure 5, band: 3x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", type=Path, required=True,
                        help="a folder; the runs it holds already are kept and reused")
    parser.add_argument("--nodes", default="1,11")
    parser.add_argument("--presets", default="tiny,small,medium")
    args = parser.parse_args(argv)
    from sdcstudy.core import runfolder as RF
    from sdcstudy.core.config import UserError
    from sdcstudy.faults.published import WCNTS

    try:
        nodes = [int(n) for n in args.nodes.split(",")]
        presets = args.presets.split(",")
        if bad := [n for n in nodes if n not in WCNTS] + [p for p in presets if p not in STEPS]:
            raise UserError(f"unknown node or preset {bad[0]!r}; nodes are 1-15, presets "
                            f"{', '.join(STEPS)}.")
    except (ValueError, UserError) as e:
        print(f"wcnts_scaling: error: {e}", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"wcnts_scaling: error: --out {str(args.out)!r} is a file, not a folder; give a "
              f"folder.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in presets:
        for node in nodes:
            summary = run_one(args.out, preset, node)
            rows.append({"preset": preset, "node": node, "n_params": summary["n_params"],
                         "steps": summary["steps"], "wcnts": summary["wcnts"],
                         "figure5": WCNTS[node]})
            print(f"{preset:>6} node {node:>2}: {summary['n_params']:>11,} parameters, "
                  f"WCNTS {summary['wcnts']:.4g} (Figure 5: {WCNTS[node]:g})", flush=True)
    lines = ["| preset | parameters | node | steps | WCNTS | Figure 5 | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['preset']} | {r['n_params']:,} | {r['node']} | {r['steps']} | "
              f"{r['wcnts']:.3g} | {r['figure5']:g} | {r['wcnts'] / r['figure5']:.2f} |"
              for r in rows]
    for node in nodes:
        values = [r["wcnts"] for r in rows if r["node"] == node]
        lines.append(f"\nnode {node}: largest / smallest WCNTS over the sizes "
                     f"{max(values) / min(values):.2f}")
    RF.atomic_write_text(args.out / "wcnts_scaling.md", "\n".join(lines) + "\n")
    RF.atomic_write_json(args.out / "wcnts_scaling.json", rows)
    plot(rows, args.out / "wcnts_scaling.png")
    print("\n".join(lines))
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
