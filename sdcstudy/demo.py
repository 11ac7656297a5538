"""`sdcstudy demo`: a healthy node paired with a suspect one, the paper's method in a minute.

Two short runs of the tiny Llama on simulated CPU devices (node x tp = 2 x 2), the suspect
running a paper node profile:
1. lock-step computation synchronization (RQ1): the mismatch frequency and maximum severity per
   site, against the numbers Ma et al. published for that node (Tables 1 and 2), and which bit
   fields the mismatches touched;
2. parameter synchronization (RQ2): the worst-case noise-to-signal ratio of the gradients.
Both leave run folders (config, metrics, mismatch and fault tables, summary, a plot).
"""

from __future__ import annotations

from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import interrupts, reports
from sdcstudy.faults import profiles
from sdcstudy.core import runfolder as RF
from sdcstudy.core import runlock
from sdcstudy.core import tablelog as TL
from sdcstudy import runner
from sdcstudy.core.metrics import SITES

PROFILE = "paper-node-1"  # the node with the most mismatches at all four sites (Table 1)
DEMO_STEPS = 40
# The embedded default (configs/demo.yaml reads the same).
DEMO = {
    "experiment": {"mode": "lockstep", "steps": DEMO_STEPS, "batch_size": 16,
                   "checkpoint_every": 0},
    "model": {"preset": "tiny"},
    "mesh": {"tp": 2},
    "suspect": {"profile": PROFILE},
    "optim": {"lr": 3e-3, "warmup_steps": 10},
    "data": {"source": "synthetic", "seq_len": 64},
}


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def mismatch_table(summary: dict, profile: str) -> str:
    """Markdown: per site, mismatches, frequency and maximum severity, measured and published,
    and the bit fields that differed."""
    paper = profiles.published(profile)
    lines = ["| site | mismatches | frequency | Table 1 | max severity | Table 2 "
             "| differing bits: sign / exponent / mantissa |", "|---|---:|---:|---:|---:|---:|---:|"]
    for site in SITES:
        hist = summary.get("bit_histogram", {}).get(site)
        bits = f"{hist['sign']} / {hist['exponent']} / {hist['mantissa']}" if hist else "-"
        lines.append(
            f"| {site} | {summary.get('mismatches', {}).get(site, 0)} "
            f"| {_g(summary.get('freq', {}).get(site))} "
            f"| {_g(paper['freq'][site]) if paper else '-'} "
            f"| {_g(summary.get('max_severity', {}).get(site))} "
            f"| {_g(paper['max_severity'][site]) if paper else '-'} | {bits} |")
    return "\n".join(lines)


def plot_frequency(mismatch, path: Path, title: str) -> None:
    """Mismatch frequency per optimizer step and site, log scale (zero steps left out)."""
    plt = reports.pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=120)
    for site in SITES:
        rows = mismatch[mismatch["site"] == site]
        if rows.empty:
            continue
        per_step = rows.groupby("step")[["mismatches", "elements"]].sum()
        freq = per_step["mismatches"] / per_step["elements"]
        freq = freq[freq > 0]
        ax.plot(freq.index, freq.values, marker=".", lw=0.8, label=site)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mismatch frequency (per element)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def main(out: Path | None, steps: int = DEMO_STEPS, progress: bool = True,
         profile: str = PROFILE) -> dict:
    """Both runs into a new demo folder, held for as long as they write it (core.runlock). A
    demo stopped (Ctrl-C, SIGTERM) or failed before its second run ended leaves no folder, so
    the same command may run again (a demo has no --resume: its runs take minutes)."""
    root = Path(out or RF.default_run_dir("demo"))
    whole = lambda folder: (folder / "paramsync" / RF.SUMMARY).is_file()  # noqa: E731
    try:
        with runlock.hold(root, create=True, what="demo folder", hint="choose another --out",
                          keep=whole):
            return _demo(root, steps, progress, profile)
    except KeyboardInterrupt as stop:
        raise interrupts.Stopped(interrupts.signum_of(stop), (
            f"both runs of the demo were done and {str(root)!r} is kept" if whole(root) else
            f"the demo folder {str(root)!r} was not kept: run the same command again")) from None


def _demo(root: Path, steps: int, progress: bool, profile: str) -> dict:
    base = [f"experiment.steps={steps}", f"suspect.profile={profile}"]
    print(f"sdcstudy demo: a healthy node and a suspect node ({profile}) train the tiny Llama "
          f"side by side (node x tp = 2 x 2 simulated CPU devices)\n")

    lock = runner.run(C.from_dict(DEMO, base + ["experiment.name=lockstep"]), root / "lockstep",
                      progress=progress)
    lock_dir = Path(lock["run_dir"])
    mismatch = TL.read_table(lock_dir / RF.MISMATCH)
    plot_frequency(mismatch, lock_dir / "mismatch.png", f"lock-step, suspect {profile}")
    print(f"\n1. Lock-step computation synchronization, {steps} steps: every attention and FFN "
          f"output and input gradient compared bit for bit, then repaired")
    print(mismatch_table(lock, profile))
    faults = TL.read_table(lock_dir / RF.FAULTS)
    at_sites = int(faults["site"].isin(SITES).sum())
    print(f"   {at_sites} corruptions injected at the four compared sites (faults.parquet), "
          f"{sum(lock.get('mismatches', {}).values())} mismatches found (mismatch.parquet); "
          f"{lock.get('faults/landed', 0) - at_sites} more in the weight gradients (a row on "
          f"each device that holds one, docs/metrics.md), which lock-step does not compare. "
          f"Tables 1-2 are Ma et al.'s measurements of this node.")

    sync = runner.run(C.from_dict(DEMO, base + ["experiment.mode=paramsync",
                                                "experiment.name=paramsync"]),
                      root / "paramsync", progress=progress)
    paper = profiles.published(profile)
    wcnts = sync["wcnts"]
    published = (f" (Ma et al., Figure 5: {paper['wcnts']:g} on the 32-layer Llama3-8B; ours is "
                 f"{wcnts / paper['wcnts']:.2g}x that)") if paper and wcnts is not None else ""
    print(f"\n2. Parameter synchronization, {steps} steps: the suspect's gradients against the "
          f"healthy ones, healthy parameters copied over after each step")
    print(f"   WCNTS = max_t ||g' - g|| / ||g|| = {_g(wcnts)}{published}.")
    print(f"\nrun folders: {lock_dir} (mismatch.png), {sync['run_dir']}")
    return {"lockstep": lock, "paramsync": sync, "faults_at_sites": at_sites,
            "run_dir": str(root)}
