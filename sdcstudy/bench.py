"""`sdcstudy bench`: performance benchmarks, measured side by side in one run.

`sdcstudy bench train` times our real training step (`Trainer.train_step`, compiled once with
the state donated) against the same Llama trained by transformers + torch on the CPU: the same
initial weights (`torch_state_dict`), batch, next-token loss, global-norm clipping, AdamW and
learning-rate schedule, all in float32. After a warm-up, each repetition times N steps of every
contender in a rotating order, so load from other processes falls on all of them alike.
JAX and torch are imported inside the functions that use them (the CLI builds its parser
without them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .config import UserError

# Per preset: (sequences per step, sequence length, timed steps per repetition). The step
# counts keep one repetition of `small` near half a minute on a 2-core CPU.
DEFAULT_SHAPES = {"tiny": (16, 64, 20), "small": (8, 256, 3)}
FALLBACK_SHAPE = (8, 64, 5)
TORCH_ATTENTION = ("eager", "sdpa")
WARMUP_STEPS = 2  # untimed steps of each contender after compilation (ours) or model build
TARGET_RATIO = 2.0  # the project's goal: ours at least twice torch's tokens/s


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", metavar="SUITE")
    sub.required = True
    t = sub.add_parser("train", help="tokens/s of our training step against transformers+torch")
    t.add_argument("--presets", default="tiny,small",
                   help="comma-separated model presets (default tiny,small)")
    t.add_argument("--batch", type=int, default=None, metavar="B",
                   help="sequences per step (default: tiny 16, small 8)")
    t.add_argument("--seq-len", type=int, default=None, metavar="L",
                   help="predicted tokens per sequence (default: tiny 64, small 256)")
    t.add_argument("--steps", type=int, default=None, metavar="N",
                   help="timed steps per contender and repetition (default: tiny 20, small 3)")
    t.add_argument("--repeats", type=int, default=5, metavar="R",
                   help="interleaved repetitions (default 5)")
    t.add_argument("--torch-attention", default=",".join(TORCH_ATTENTION), metavar="LIST",
                   help="transformers attention implementations to time (default eager,sdpa); "
                        "the faster one is the baseline")
    t.add_argument("--json", type=Path, default=None, metavar="FILE", help="write results here")
    t.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                   help="write the table here")
    t.add_argument("--no-torch", action="store_true", help="time only our step")
    t.set_defaults(bench=run_train_suite)


def main(args) -> int:
    return args.bench(args)


# --- our step ---------------------------------------------------------------------------------


def bench_config(preset: str, batch: int, seq_len: int, total_steps: int):
    """The default experiment at this size; `experiment.steps` sets the cosine's length."""
    from . import config as C

    return C.from_dict({"model": {"preset": preset},
                        "experiment": {"batch_size": batch, "steps": total_steps},
                        "data": {"seq_len": seq_len}})


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0):
    """int32 tokens (1 microstep, B, L+1), the same numpy draw for every contender."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab_size, (1, batch, seq_len + 1),
                                                dtype=np.int32)


class OursRunner:
    """The compiled `Trainer.train_step` with its donated state."""

    def __init__(self, cfg, tokens_MBL1):
        import jax
        import numpy as np

        from .train import Trainer, compile_step

        self.trainer = Trainer.from_config(cfg)
        self.state = self.trainer.init_state()
        # A copy made before the first step donates (and so may overwrite) these buffers.
        self.initial_params = jax.tree.map(lambda x: np.array(x, copy=True), self.state["params"])
        self.batch = {"tokens": jax.device_put(tokens_MBL1)}
        self.step_fn, _, self.compile_s = compile_step(self.trainer.train_step, self.state,
                                                       self.batch)
        self.metrics = None

    def run(self, n: int) -> None:
        import jax

        for _ in range(n):
            self.state, self.metrics, _ = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, self.metrics))

    def losses(self, n: int) -> list[float]:
        """Run n steps one at a time and return each step's loss (before its update)."""
        out = []
        for _ in range(n):
            self.run(1)
            out.append(float(self.metrics["loss/healthy"]))
        return out

    def learning_rates(self, total_steps: int):
        """The schedule's value at optimizer steps 0..total_steps-1, for torch to follow."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        return np.asarray(jax.vmap(self.trainer.schedule)(jnp.arange(total_steps)), np.float64)


# --- the same model in transformers + torch ---------------------------------------------------


def torch_import_problem() -> str | None:
    """None when torch and transformers import, else one sentence saying what is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return (f"torch or transformers is not importable ({e.name or e}), so only our step "
                f"is measured; `pip install torch transformers` adds the comparison.")
    return None


def llama_config(dims, seq_len: int, attention: str):
    """A transformers `LlamaConfig` that computes what our `ModelDims` does."""
    import transformers

    if dims.dtype != "float32" or dims.param_dtype != "float32":
        raise UserError("the torch comparison runs in float32; use a float32 model preset.")
    rope = {}
    if dims.rope_scaling is not None:
        rope = {"rope_scaling": {"rope_type": "llama3", **dict(dims.rope_scaling)}}
    return transformers.LlamaConfig(
        vocab_size=dims.vocab_size, hidden_size=dims.d_model, intermediate_size=dims.ffn_dim,
        num_hidden_layers=dims.n_layers, num_attention_heads=dims.n_heads,
        num_key_value_heads=dims.n_kv_heads, head_dim=dims.head_dim,
        rope_theta=dims.rope_theta, rms_norm_eps=dims.norm_eps,
        tie_word_embeddings=dims.tie_embeddings, max_position_embeddings=max(seq_len, 1),
        hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        use_cache=False, attn_implementation=attention, **rope)


def torch_state_dict(params) -> dict:
    """Our parameter tree as a `LlamaForCausalLM` state dict: Linear weights transposed from
    our (in, out) to torch's (out, in), copied into fresh float32 tensors."""
    import jax
    import numpy as np
    import torch

    from .hf import _hf_name

    out = {}
    for key_path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(getattr(k, "key", k) for k in key_path)
        name, transpose = _hf_name(path)
        array = np.asarray(value, np.float32)
        array = array.T if transpose else array
        full = name if name.startswith("lm_head.") else f"model.{name}"
        out[full] = torch.from_numpy(np.ascontiguousarray(array).copy())
    return out


def torch_model(dims, params, seq_len: int, attention: str):
    """`LlamaForCausalLM` holding exactly our `params`, in training mode."""
    import transformers

    net = transformers.LlamaForCausalLM(llama_config(dims, seq_len, attention)).float()
    missing, unexpected = net.load_state_dict(torch_state_dict(params), strict=False)
    missing = [m for m in missing if not (dims.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"torch model and our parameters differ: missing {missing}, "
                           f"unexpected {unexpected}")
    return net.train()


class TorchRunner:
    """One transformers + torch training loop doing our step's work: next-token cross-entropy
    over tokens[:, 1:], global-norm clipping, AdamW(0.9, 0.99, wd) with our schedule."""

    def __init__(self, cfg, dims, params, tokens_MBL1, attention: str, learning_rates):
        import torch

        o = cfg.optim
        if cfg.experiment.microsteps != 1 or o.name != "adamw":
            raise UserError("the torch comparison covers one microstep and AdamW only.")
        self.torch = torch
        self.model = torch_model(dims, params, tokens_MBL1.shape[-1] - 1, attention)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(learning_rates[0]),
                                           betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.clip_norm = o.clip_norm
        self.learning_rates = learning_rates
        tokens_BL1 = torch.from_numpy(tokens_MBL1[0].astype("int64"))
        self.inputs_BL = tokens_BL1[:, :-1].contiguous()
        self.targets_BL = tokens_BL1[:, 1:].contiguous()
        self.steps_done = 0
        self.loss = None

    def step(self) -> None:
        torch = self.torch
        for group in self.optimizer.param_groups:
            group["lr"] = float(self.learning_rates[self.steps_done])
        self.optimizer.zero_grad(set_to_none=True)
        logits_BLV = self.model(input_ids=self.inputs_BL).logits
        self.loss = torch.nn.functional.cross_entropy(
            logits_BLV.reshape(-1, logits_BLV.shape[-1]).float(), self.targets_BL.reshape(-1))
        self.loss.backward()
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        self.steps_done += 1

    def run(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def losses(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            self.step()
            out.append(float(self.loss.detach()))
        return out


# --- measuring --------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    import numpy as np

    v = np.asarray(values, np.float64)
    q1, median, q3 = np.percentile(v, [25, 50, 75])
    return {"median": float(median), "min": float(v.min()), "max": float(v.max()),
            "q1": float(q1), "q3": float(q3), "runs": [float(x) for x in v]}


def measure_preset(preset: str, batch: int | None, seq_len: int | None, steps: int | None,
                   repeats: int, attentions: tuple[str, ...], echo=None) -> dict:
    """Warm up every contender, then time `repeats` rotations of `steps` steps each."""
    echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    default = DEFAULT_SHAPES.get(preset, FALLBACK_SHAPE)
    batch, seq_len, steps = (batch or default[0], seq_len or default[1], steps or default[2])
    total_steps = WARMUP_STEPS + repeats * steps
    cfg = bench_config(preset, batch, seq_len, total_steps)
    from .config import model_dims

    dims = model_dims(cfg.model)
    tokens_MBL1 = random_tokens(dims.vocab_size, batch, seq_len)
    tokens_per_step = batch * seq_len

    echo(f"{preset}: compiling our step ({dims.n_params:,} parameters, batch {batch} x "
         f"{seq_len})")
    ours = OursRunner(cfg, tokens_MBL1)
    runners = {"ours": ours}
    if attentions:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        lrs = ours.learning_rates(total_steps)
        for attention in attentions:
            runners[f"torch-{attention}"] = TorchRunner(cfg, dims, ours.initial_params,
                                                        tokens_MBL1, attention, lrs)
    warmup_losses = {name: r.losses(WARMUP_STEPS) for name, r in runners.items()}

    names = list(runners)
    seconds = {name: [] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            start = time.perf_counter()
            runners[name].run(steps)
            seconds[name].append(time.perf_counter() - start)
        echo(f"{preset} repetition {rep + 1}/{repeats}: " + ", ".join(
            f"{name} {tokens_per_step * steps / seconds[name][-1]:,.0f} tokens/s"
            for name in names))

    def contender(name):
        return {"tokens_per_s": spread([tokens_per_step * steps / s for s in seconds[name]]),
                "seconds_per_step": spread([s / steps for s in seconds[name]]),
                "warmup_losses": warmup_losses[name]}

    result = {"preset": preset, "n_params": dims.n_params, "batch": batch, "seq_len": seq_len,
              "tokens_per_step": tokens_per_step, "steps": steps, "repeats": repeats,
              "warmup_steps": WARMUP_STEPS,
              "ours": {**contender("ours"), "compile_s": ours.compile_s},
              "torch": {a: contender(f"torch-{a}") for a in attentions},
              "torch_baseline": None, "ratio": None}
    if attentions:
        best = max(attentions, key=lambda a: result["torch"][a]["tokens_per_s"]["median"])
        result["torch_baseline"] = best
        result["ratio"] = (result["ours"]["tokens_per_s"]["median"]
                           / result["torch"][best]["tokens_per_s"]["median"])
    return result


def _rate(s: dict) -> str:
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def markdown_table(results: list[dict]) -> str:
    """The results as a Markdown table, then one line per preset on the torch variants."""
    lines = ["| preset | params | batch x seq | ours tokens/s | torch tokens/s (attention) | "
             "ratio | ours compile s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        torch_cell, ratio = "not measured", "-"
        if r["torch_baseline"]:
            best = r["torch_baseline"]
            torch_cell = f"{_rate(r['torch'][best]['tokens_per_s'])} ({best})"
            ratio = f"{r['ratio']:.2f}x"
        lines.append(f"| {r['preset']} | {r['n_params'] / 1e6:.2f}M | {r['batch']} x "
                     f"{r['seq_len']} | {_rate(r['ours']['tokens_per_s'])} | {torch_cell} | "
                     f"{ratio} | {r['ours']['compile_s']:.1f} |")
    lines.append("")
    lines.append("Median (min-max) over interleaved repetitions; ratio = ours / the faster "
                 "torch attention.")
    for r in results:
        if len(r["torch"]) > 1:
            variants = ", ".join(f"{a} {v['tokens_per_s']['median']:,.0f}"
                                 for a, v in r["torch"].items())
            lines.append(f"- {r['preset']}: torch tokens/s by attention: {variants}.")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    from importlib import metadata

    from .determinism import cpu_info

    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"cpu": cpu_info(), "versions": versions, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "torch_threads": os.cpu_count(), "load_average": list(os.getloadavg())}


def run_train_suite(args) -> int:
    from . import runfolder as RF

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    attentions = tuple(a.strip() for a in args.torch_attention.split(",") if a.strip())
    unknown = sorted(set(attentions) - set(TORCH_ATTENTION))
    if unknown:
        raise UserError(f"--torch-attention {unknown[0]!r} is not one of "
                        f"{', '.join(TORCH_ATTENTION)}.")
    for name, value in (("--batch", args.batch), ("--seq-len", args.seq_len),
                        ("--steps", args.steps), ("--repeats", args.repeats)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1, not {value}.")
    if not presets:
        raise UserError("--presets names no preset; give e.g. --presets tiny,small.")
    note = None
    if args.no_torch:
        attentions = ()
    elif (note := torch_import_problem()) is not None:
        print(note, file=sys.stderr)
        attentions = ()

    env = environment()
    results = [measure_preset(p, args.batch, args.seq_len, args.steps, args.repeats, attentions)
               for p in presets]
    env["load_average_end"] = list(os.getloadavg())
    table = markdown_table(results)
    print(table, end="")
    if args.json is not None:
        RF.atomic_write_json(args.json, {"suite": "train", "results": results,
                                         "environment": env, "torch_note": note,
                                         "target_ratio": TARGET_RATIO})
    if args.markdown is not None:
        RF.atomic_write_text(args.markdown, table)
    return 0
