"""python experiments/paft_packets.py --out runs/paft-packets [--steps 150] [--set K=V] [--resume]

Gradient aggregation without retransmission under packet loss, on tiny Llama (the runs' set-up,
SGD with momentum included, is `sdcstudy.paft.study`).

M = 4 workers exchange gradient packets (256 floats) that are each dropped with probability
p in {0, 10, 20, 30, 40}%; each worker aggregates what reached it: renormalized (unbiased given
an arrival), zero-filled, or stale reuse. The same renormalized losses in the packet-loss
paper's topology: each shard's owner aggregates it and broadcasts the result (reliably,
`paft.loss.param_p=0`), so every worker holds the owners' copy. Then bursty drops (mean run of
8 packets) and lossy owner broadcasts of the parameters. Writes tables (Markdown, CSV) and PNG
figures. Should show the renormalized average staying closest to the loss-free run as p grows,
zero-fill slowing training (its average is shrunk by about 1 - p (M-1)/M), no divergence in the
owners' topology, and the copies' divergence staying bounded under lossy broadcasts.
"""

from __future__ import annotations

import os
import sys

# M = 4 workers on simulated CPU devices, set before JAX is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

from sdcstudy.paft import study as PC  # noqa: E402

RATES = (0.1, 0.2, 0.3, 0.4)
MODES = ("renormalized", "zero", "stale")
OWNER = "renormalized, by the owner"


def main(argv=None) -> int:
    args = PC.parse(__doc__, steps=150, argv=argv)
    args.overrides = PC.OPTIM + args.overrides
    from sdcstudy.paft import report as R

    reliable = PC.run(args, "loss-0", [])
    runs = {"p=0": reliable}
    by_mode = {}
    for mode in MODES:
        mode_runs = {"p=0": reliable}
        for p in RATES:
            run = PC.run(args, f"{mode}-p{p:g}", [f"paft.loss.p={p}",
                                                  f"paft.loss.aggregate={mode}"])
            mode_runs[f"{mode} p={p:g}"] = runs[f"{mode} p={p:g}"] = run
        by_mode[mode] = mode_runs
        R.curves(mode_runs, args.out / f"loss_{mode}.png", R.LOSS,
                 f"training loss, {mode} aggregation (M = 4)", smooth=5)
        R.curves(mode_runs, args.out / f"divergence_{mode}.png", R.DIV,
                 f"divergence of the copies, {mode} aggregation")
    # The packet-loss paper's topology: only shard j's owner aggregates it; its reliable
    # broadcast replaces every other worker's value, so the copies never differ.
    owner_runs = {"p=0": reliable}
    for p in RATES:
        run = PC.run(args, f"owner-p{p:g}", [f"paft.loss.p={p}", "paft.loss.param_p=0"])
        owner_runs[f"owner p={p:g}"] = runs[f"owner p={p:g}"] = run
    R.curves(owner_runs, args.out / "loss_owner.png", R.LOSS,
             "training loss, renormalized aggregation by the shards' owners (M = 4)", smooth=5)
    for label, extra in (("burst8 p=0.2", ["paft.loss.p=0.2", "paft.loss.burst=8"]),
                         ("broadcast q=0.2", ["paft.loss.param_p=0.2"]),
                         ("broadcast q=0.4", ["paft.loss.param_p=0.4"])):
        runs[label] = PC.run(args, label.replace(" ", "-").replace("=", ""), extra)
    R.curves({k: runs[k] for k in ("p=0", "broadcast q=0.2", "broadcast q=0.4")},
             args.out / "divergence_broadcast.png", R.DIV,
             "lossy owner broadcasts: divergence stays bounded")

    table = R.final_table(runs)
    table["rate"] = [0.0] + [p for _ in MODES for p in RATES] + list(RATES) + [0.2, 0.2, 0.4]
    table["mode"] = ["reliable"] + [m for m in MODES for _ in RATES] + [OWNER] * len(RATES) + [
        "renormalized, bursts of 8", "broadcast loss", "broadcast loss"]
    PC.write(args, "packet_loss.md", R.markdown(table))
    PC.write(args, "packet_loss.csv", table.to_csv(index=False, float_format="%.6g"))
    grid = table[table["mode"].isin(MODES + (OWNER,)) | (table["mode"] == "reliable")]
    rows = []
    for mode in MODES + (OWNER,):  # the reliable run belongs to every mode's p = 0
        part = grid[grid["mode"].isin([mode, "reliable"])].copy()
        part["mode"] = mode
        rows.append(part)
    import pandas as pd

    R.bar_final(pd.concat(rows), args.out / "final_loss_vs_rate.png", "rate", "mode",
                "final loss against gradient packet-loss rate (M = 4)")
    print(f"tables and figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
