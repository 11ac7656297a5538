"""python experiments/paft_noise.py --out runs/paft-noise [--steps 150] [--set K=V] [--resume]

Gradient-aggregation noise on tiny Llama: Oracle / Noised / PAFT-Sync / PAFT-Dyn.

M = 4 workers, one-layer tiny Llama, synthetic corpus, SGD with momentum (the runs' set-up is
`sdcstudy.paft.study`). Three parts, each a set of run folders under OUT/runs and tables
(Markdown, CSV) and PNG figures:
1. sigma2 in {1e-4, 1e-3, 1e-2, 1e-1}: Noised, PAFT-Sync(H = 1, 4, 16, 64), PAFT-Dyn (with
   overlap), and Oracle. Should show Noised ending above Oracle from a noise level on, the
   divergence growing linearly without sync and reset by every sync, and PAFT-Sync with small
   H and PAFT-Dyn ending close to Oracle where the noise is moderate.
2. accidental large noise (background 1e-4, a 1e-1 or 1.0 burst every 50 steps).
3. model-only against all-state synchronization (momentum buffers averaged too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# M = 4 workers on simulated CPU devices, set before JAX is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

from sdcstudy.paft import study as PC  # noqa: E402

SIGMAS = (1e-4, 1e-3, 1e-2, 1e-1)
HS = (1, 4, 16, 64)
DYN = ["paft.dynamic=true", "paft.overlap=true", "paft.sync_every=4"]


def methods(sigma2: float) -> dict[str, list[str]]:
    noise = [f"paft.noise.sigma2={sigma2}"]
    out = {"Noised": noise}
    out.update({f"PAFT-Sync(H={h})": noise + [f"paft.sync_every={h}"] for h in HS})
    out["PAFT-Dyn"] = noise + DYN
    return out


def main(argv=None) -> int:
    args = PC.parse(__doc__, steps=150, argv=argv)
    args.overrides = PC.OPTIM + args.overrides
    from sdcstudy.paft import report as R

    def slug(text):
        return text.replace("(", "").replace(")", "").replace("=", "").replace("+", "-")

    # 1. the noise grid
    oracle = {"Oracle": PC.run(args, "oracle", [])}
    grid, all_runs = {}, dict(oracle)
    for sigma2 in SIGMAS:
        runs = dict(oracle)
        for name, overrides in methods(sigma2).items():
            runs[name] = PC.run(args, f"{slug(name)}-s{sigma2:g}", overrides)
            all_runs[f"{name} s2={sigma2:g}"] = runs[name]
        grid[sigma2] = runs
        R.curves(runs, args.out / f"loss_sigma2_{sigma2:g}.png", R.LOSS,
                 f"training loss, sigma2 = {sigma2:g} (M = 4)", smooth=5)
        R.curves(runs, args.out / f"divergence_sigma2_{sigma2:g}.png", R.DIV,
                 f"divergence of the copies, sigma2 = {sigma2:g} (M = 4)")
    table = R.final_table(all_runs)
    PC.write(args, "noise_grid.md", R.markdown(table))
    PC.write(args, "noise_grid.csv", table.to_csv(index=False, float_format="%.6g"))
    plot_grid(grid, args.out / "final_loss_vs_sigma2.png")

    # 2. accidental large noise
    accidental = dict(oracle)
    for large in (1e-1, 1.0):
        noise = ["paft.noise.sigma2=1e-4", f"paft.noise.large_sigma2={large}",
                 "paft.noise.large_every=50"]
        for name, extra in (("Noised", []), ("Sync(16)", ["paft.sync_every=16"]),
                            ("Dyn", DYN)):
            accidental[f"{name} L={large:g}"] = PC.run(
                args, f"accidental-{slug(name)}-L{large:g}", noise + extra)
    R.curves(accidental, args.out / "accidental_loss.png", R.LOSS,
             "accidental large noise L every 50 steps (background 1e-4)", smooth=3, log=True)
    R.curves(accidental, args.out / "accidental_divergence.png", R.DIV,
             "accidental large noise: divergence")
    table = R.final_table(accidental)
    PC.write(args, "accidental.md", R.markdown(table))
    PC.write(args, "accidental.csv", table.to_csv(index=False, float_format="%.6g"))

    # 3. model-only against all-state synchronization
    state = dict(oracle)
    for sigma2 in (1e-2, 1e-1):
        for h in (16, 64):
            base = [f"paft.noise.sigma2={sigma2}", f"paft.sync_every={h}"]
            state[f"model-only H={h} s2={sigma2:g}"] = grid[sigma2][f"PAFT-Sync(H={h})"]
            state[f"all-state H={h} s2={sigma2:g}"] = PC.run(
                args, f"allstate-H{h}-s{sigma2:g}", base + ["paft.sync_opt_state=true"])
    R.curves(state, args.out / "sync_state_loss.png", R.LOSS,
             "model-only vs all-state synchronization", smooth=5)
    table = R.final_table(state)
    PC.write(args, "sync_state.md", R.markdown(table))
    PC.write(args, "sync_state.csv", table.to_csv(index=False, float_format="%.6g"))
    print(f"tables and figures in {args.out}")
    return 0


def plot_grid(grid: dict, path: Path) -> None:
    """Final loss against sigma2, one line per method, Oracle as a horizontal line."""
    from sdcstudy.paft import report as R
    from sdcstudy.report import plots as PL

    plt = PL.pyplot()
    tables = {s: R.final_table(runs).set_index("method") for s, runs in grid.items()}
    names = [m for m in next(iter(tables.values())).index if m != "Oracle"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    style = PL.styles(names)
    for name in names:
        ax.plot(list(tables), [t.loc[name, "final_loss"] for t in tables.values()], marker="o",
                label=name, **style[name])
    oracle = next(iter(tables.values())).loc["Oracle", "final_loss"]
    ax.axhline(oracle, color="black", linestyle=":", label="Oracle")
    ax.set_xscale("log")
    ax.set_xlabel("aggregation-error variance sigma2 (per coordinate)")
    ax.set_ylabel("final training loss (mean of last 10 steps, nats)")
    ax.set_title("final loss against noise level (M = 4)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    PL.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
