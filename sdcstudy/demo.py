"""`sdcstudy demo`: the tiny model trained on the built-in corpus, with a loss-curve summary."""

from __future__ import annotations

import math
from pathlib import Path

from . import config as C
from . import runfolder as RF
from . import runner

# The embedded default: tiny Llama, byte tokens, synthetic corpus (configs/tiny.yaml reads
# the same).
DEMO = {
    "experiment": {"mode": "train", "steps": 300, "batch_size": 16, "name": "demo",
                   "checkpoint_every": 100},
    "model": {"preset": "tiny"},
    "optim": {"lr": 3e-3, "warmup_steps": 20},
    "data": {"source": "synthetic", "seq_len": 64},
}


def loss_table(rows: list[dict], uniform: float, points: int = 8) -> str:
    """Markdown table of the loss at evenly spaced steps, against the uniform baseline."""
    picks = sorted({round(i * (len(rows) - 1) / (points - 1)) for i in range(points)})
    lines = ["| step | loss (nats/token) | vs. uniform |", "|---:|---:|---:|"]
    for i in picks:
        loss = rows[i]["loss/healthy"]
        lines.append(f"| {rows[i]['step']} | {loss:.3f} | {loss / uniform:.0%} |")
    return "\n".join(lines)


def plot_loss(rows: list[dict], uniform: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in rows], [r["loss/healthy"] for r in rows], lw=1.2, label="loss")
    ax.axhline(uniform, color="grey", ls="--", lw=1, label=f"uniform (ln V = {uniform:.2f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tiny Llama on the synthetic corpus")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def main(out: Path | None, steps: int = DEMO["experiment"]["steps"], progress: bool = True):
    cfg = C.from_dict(DEMO, [f"experiment.steps={steps}"])
    summary = runner.run(cfg, out, progress=progress)
    run_dir = Path(summary["run_dir"])
    rows = RF.read_jsonl(run_dir / RF.METRICS)
    uniform = math.log(C.model_dims(cfg.model).vocab_size)
    plot_loss(rows, uniform, run_dir / "loss.png")
    print()
    print(f"tiny Llama ({summary['n_params']:,} parameters), {len(rows)} steps on the synthetic "
          f"corpus, {summary['tokens_per_s']:,.0f} tokens/s after {summary['compile_s']:.1f} s "
          f"compile")
    print(loss_table(rows, uniform))
    print(f"\nrun folder: {run_dir} (loss.png, metrics.jsonl, checkpoints/)")
    return summary
