"""`sdcstudy bench train`: our `Trainer.train_step` against the same Llama trained by
transformers + torch on the CPU: the same initial weights (`torch_state_dict`), batch, next-token
loss, global-norm clipping, AdamW and learning-rate schedule, all in float32, timed side by side
in one run (bench_timing.py's rotation); the model FLOP/s of both against the machine's matmul
peak (roofline.py), and on a GPU whose kind roofline.py knows, the MFU against its published
peak. The torch contender runs on the CPU, so on a GPU time ours alone (`--no-torch`, which
also allows a bfloat16 model). Each result carries the kernel census of our compiled step
(census.py: which library runs each GEMM, Triton's tiles, fused attention, serialized
scatters); `--hlo DIR` also keeps that step's optimized HLO as DIR/PRESET-DTYPE.hlo. Its
`phases`: our step's initial state, lowering and compilation together (`compile_s`), the torch
models' set-up, warm-up, timed steps and the matmul peak's timing, in seconds.

torch and transformers are imported inside the functions that use them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sdcstudy.bench import census
from sdcstudy.bench import common as B
from sdcstudy.bench import goals as G
from sdcstudy.bench import timing as BT
from sdcstudy.bench import roofline
from sdcstudy.core import reports
from sdcstudy.core.config import UserError, tokens_per_step
from sdcstudy.core.ticker import ticking

TORCH_ATTENTION = ("eager", "sdpa")
TARGET_RATIO = G.GOALS["train.ours_over_torch"].limit  # ours / torch tokens/s, at least


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="tokens/s of our training step against transformers+torch")
    B.add_common_args(t, "train")
    t.add_argument("--torch-attention", default=",".join(TORCH_ATTENTION), metavar="LIST",
                   help="transformers attention implementations to time (default eager,sdpa); "
                        "the faster one is the baseline")
    t.add_argument("--no-torch", action="store_true", help="time only our step")
    t.add_argument("--hlo", type=Path, default=None, metavar="DIR",
                   help="write our compiled step's optimized HLO to DIR/PRESET-DTYPE.hlo")
    t.set_defaults(bench=run_train_suite)


def torch_import_problem() -> str | None:
    """None when torch and transformers import, else one sentence saying what is missing."""
    import importlib

    try:
        for name in ("torch", "transformers"):
            importlib.import_module(name)
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

    from sdcstudy.core.hf import _hf_name

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

    def warm_up(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            self.step()
            out.append({"loss/healthy": float(self.loss.detach())})
        return out


def torch_runners(cfg, trainer, params, tokens_MBL1, attentions) -> dict[str, TorchRunner]:
    """A torch runner per attention, on torch's threads over every core, starting from
    `params` (numpy arrays) and following `trainer`'s learning-rate schedule."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from sdcstudy.core.config import model_dims

    torch.set_num_threads(os.cpu_count() or 1)
    rates = np.asarray(jax.vmap(trainer.schedule)(jnp.arange(cfg.experiment.steps)), np.float64)
    return {attention: TorchRunner(cfg, model_dims(cfg.model), params, tokens_MBL1, attention,
                                   rates) for attention in attentions}


def measure_train(preset: str, args, attentions: tuple[str, ...], echo=B.echo_stderr) -> dict:
    """Our step and each torch attention, warmed up, then timed in rotation."""
    import jax
    import numpy as np

    from sdcstudy.core.config import model_dims
    from sdcstudy.core.train import Trainer

    cfg, steps = B.preset_config("train", preset, args, ["experiment.mode=train"])
    dims, tokens_MBL1, tokens = (model_dims(cfg.model), BT.random_tokens(cfg),
                                 tokens_per_step(cfg))
    e = cfg.experiment
    echo(f"{preset}: compiling our step ({dims.n_params:,} parameters, batch {e.batch_size} x "
         f"{cfg.data.seq_len})")
    began = time.perf_counter()
    with ticking(f"{preset}: compiling our step", enabled=B.live_line()):
        ours = BT.StepRunner(Trainer.from_config(cfg), tokens_MBL1)
    phases = {"compile_s": time.perf_counter() - began}
    echo(f"{preset}: our step compiled in {ours.compile_s:.1f} s")
    runners = {"ours": ours}
    if attentions:
        # Copied before our first step donates (and so may overwrite) the parameter buffers.
        params = jax.tree.map(lambda x: np.array(x, copy=True), ours.state["params"])
        for attention, runner in torch_runners(cfg, ours.trainer, params, tokens_MBL1,
                                               attentions).items():
            runners[f"torch-{attention}"] = runner
    phases["torch_setup_s"] = time.perf_counter() - began - phases["compile_s"]
    echo(f"{preset}: warming up {B.contenders(len(runners))}, {B.WARMUP_STEPS} steps each")
    t0 = time.perf_counter()
    losses = {name: [r["loss/healthy"] for r in runner.warm_up(B.WARMUP_STEPS)]
              for name, runner in runners.items()}
    t1 = time.perf_counter()
    seconds, kernel = BT.interleaved(runners, steps, args.repeats, tokens, preset, echo)
    phases.update({"warmup_s": t1 - t0, "timed_s": time.perf_counter() - t1})

    def contender(name):
        return {**BT.timing(seconds[name], steps, tokens), "warmup_losses": losses[name],
                "kernel": kernel[name]}

    result = {"preset": preset, "dtype": dims.dtype, "n_params": dims.n_params,
              "batch": e.batch_size,
              "seq_len": cfg.data.seq_len, "tokens_per_step": tokens, "steps": steps,
              "repeats": args.repeats, "warmup_steps": B.WARMUP_STEPS, "phases": phases,
              "ours": {**contender("ours"), "compile_s": ours.compile_s},
              "census": census.census(ours.hlo),
              "torch": {}, "torch_baseline": None, "ratio": None}
    keep_hlo(args, f"{preset}-{dims.dtype}", ours.hlo)
    for a in attentions:
        name = f"torch-{a}"
        result["torch"][a] = {**contender(name),
                              "ratio": BT.ratio_spread(seconds[name], seconds["ours"]),
                              "max_loss_diff": max(abs(x - y) for x, y in
                                                   zip(losses[name], losses["ours"]))}
    if attentions:
        best = max(attentions, key=lambda a: result["torch"][a]["tokens_per_s"]["median"])
        result["torch_baseline"] = best
        result["ratio"] = result["torch"][best]["ratio"]
    echo(f"{preset}: timing a {roofline.PEAK_SIZE}x{roofline.PEAK_SIZE} float32 matmul "
         "for the machine's peak")
    rates = {name: steps / float(np.median(s)) for name, s in seconds.items()}
    t0 = time.perf_counter()
    peaks = roofline.matmul_peak(with_torch=bool(attentions))
    phases["peak_s"] = time.perf_counter() - t0
    mfu_peak = roofline.device_peak(jax.devices()[0].device_kind, dims.dtype, peaks["jax"])
    result["roofline"] = roofline.summary(
        dims, e.microsteps * e.batch_size, cfg.data.seq_len, rates, peaks,
        f"torch-{result['torch_baseline']}" if attentions else None, mfu_peak)
    if mfu_peak is not None:
        echo(f"{preset}: MFU of ours {result['roofline']['mfu']['ours']:.1%} against the "
             f"{mfu_peak['label']}")
    return result


def keep_hlo(args, name: str, hlo: str) -> None:
    """Our step's optimized HLO as `--hlo`/NAME.hlo, when asked."""
    folder = getattr(args, "hlo", None)
    if folder is not None:
        from sdcstudy.core import runfolder as RF

        with reports.writing(folder / f"{name}.hlo", "HLO file"):
            RF.atomic_write_text(folder / f"{name}.hlo", hlo)


def train_table(results: list[dict]) -> str:
    """The results as a Markdown table, then one line per preset on the torch variants."""
    lines = ["| preset | params | batch x seq | ours tokens/s | torch tokens/s (attention) | "
             "ours / torch | ours compile s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        torch_cell, ratio = "not measured", "-"
        if r["torch_baseline"]:
            best = r["torch_baseline"]
            torch_cell = f"{B._rate(r['torch'][best]['tokens_per_s'])} ({best})"
            ratio = B._ratio(r["ratio"])
        lines.append(f"| {r['preset']} | {r['n_params'] / 1e6:.2f}M | {r['batch']} x "
                     f"{r['seq_len']} | {B._rate(r['ours']['tokens_per_s'])} | {torch_cell} | "
                     f"{ratio} | {r['ours']['compile_s']:.1f} |")
    lines += ["", "Median (min-max) over interleaved repetitions; ours / torch is taken per "
              f"repetition against the faster torch attention (goal: at least "
              f"{TARGET_RATIO:g}x)."]
    for r in results:
        if r["torch"]:
            variants = ", ".join(f"{a} {v['tokens_per_s']['median']:,.0f} tokens/s, warm-up "
                                 f"losses within {v['max_loss_diff']:.1e} of ours"
                                 for a, v in r["torch"].items())
            lines.append(f"- {r['preset']}: torch {variants}.")
    for r in results:
        lines.append(f"- {r['preset']} ({r['dtype']}), kernel census of our step: "
                     f"{census.describe(r['census'])}.")
    return "\n".join(lines) + "\n" + roofline_table(results)


def roofline_table(results: list[dict]) -> str:
    """Model FLOP/s of each contender against the matmul peak measured in the same run, and
    the ceiling that peak puts on ours / torch (sdcstudy/bench/roofline.py)."""
    rows = [r for r in results if r.get("roofline")]
    if not rows:
        return ""
    lines = ["", "| preset | GFLOP / step | ours GFLOP/s (of peak) | torch GFLOP/s (of peak) | "
             "matmul peak GFLOP/s | ceiling on ours / torch |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = r["roofline"]
        cell = lambda name: (f"{f['gflops'][name]:.1f} ({f['fraction_of_peak'][name]:.0%})"  # noqa: E731
                             if name in f["gflops"] else "-")
        peaks = " / ".join(f"{v:.1f} ({k})" for k, v in f["peak_gflops"].items())
        torch_name = f"torch-{r['torch_baseline']}" if r["torch_baseline"] else ""
        ceiling = "-" if f["ceiling"] is None else f"{f['ceiling']:.2f}x"
        lines.append(f"| {r['preset']} | {f['step_gflop']:.2f} | {cell('ours')} | "
                     f"{cell(torch_name)} | {peaks} | {ceiling} |")
    lines += ["", f"Model FLOPs of the step's matmuls (forward and backward, full L x L attention "
              f"scores) at the median step time; the peak is a "
              f"{roofline.PEAK_SIZE}x{roofline.PEAK_SIZE} float32 matmul timed in the same "
              f"run. The ceiling, peak / torch's FLOP/s, is the highest ours / torch any "
              f"implementation of this step could reach on this machine."]
    for r in rows:
        f = r["roofline"]
        if f.get("mfu"):
            shares = ", ".join(f"{k} {v:.1%}" for k, v in f["mfu"].items())
            lines.append(f"MFU on {f['mfu_peak']['device_kind']}, {r['preset']} "
                         f"({r.get('dtype', 'float32')}): {shares} of the "
                         f"{f['mfu_peak']['label']}.")
    beyond = [r["preset"] for r in rows
              if r["roofline"]["ceiling"] is not None and r["roofline"]["ceiling"] < TARGET_RATIO]
    if beyond:
        lines.append(f"The {TARGET_RATIO:g}x goal is beyond this machine's matmul peak for "
                     f"{', '.join(beyond)}.")
    return "\n".join(lines) + "\n"


def train_goals(results: list[dict]) -> list[dict]:
    """ours / torch per preset measured against torch; the peak share where its goal applies."""
    goals = []
    for r in results:
        if r["ratio"] is not None:
            goals.append(G.goal("train.ours_over_torch", r["ratio"]["median"],
                                preset=r["preset"]))
        if r.get("roofline") and G.applies("train.peak_share", r["preset"]):
            goals.append(G.goal("train.peak_share", r["roofline"]["fraction_of_peak"]["ours"],
                                preset=r["preset"]))
    return goals


def run_train_suite(args) -> int:
    attentions = tuple(a.strip() for a in args.torch_attention.split(",") if a.strip())
    unknown = sorted(set(attentions) - set(TORCH_ATTENTION))
    if unknown:
        raise UserError(f"--torch-attention {unknown[0]!r} is not one of "
                        f"{', '.join(TORCH_ATTENTION)}.")
    if args.hlo is not None:  # checked before minutes of measuring, not after
        reports.check_writable(args.hlo, args.hlo, "HLO folder")
    note = None
    if args.no_torch:
        attentions = ()
    elif (note := torch_import_problem()) is not None:
        B.echo_stderr(note)
        attentions = ()
    return B.run_suite(args, "train", lambda preset, a: measure_train(preset, a, attentions),
                       train_table, goals=train_goals, torch_note=note,
                       target_ratio=TARGET_RATIO)
