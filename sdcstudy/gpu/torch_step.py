"""python -m sdcstudy.gpu.torch_step --preset medium --batch 32 --seq-len 512 --json PATH

The contender `sdcstudy accept-gpu` holds our step against: transformers' Llama with the same
sizes (`bench.train.llama_config`), on the GPU, float32 parameters under bfloat16 autocast (our
bfloat16 compute with float32 parameters), SDPA attention, `torch.compile` where it compiles
(eager otherwise, said in the JSON), AdamW, next-token cross-entropy on B x L tokens. It writes
{"tokens_per_s", "seconds_per_step", "attention", "compiled", "dtype", "torch_version"} to
PATH: the median over `--repeats` timed runs of `--steps` steps after `--warmup` steps, each
run ended by a device synchronization. Needs torch with CUDA and transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sdcstudy.gpu.torch_step")
    p.add_argument("--preset", default="medium")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--json", type=Path, required=True)
    return p.parse_args(argv)


def build(args):
    """(model, optimizer, compiled?) on the GPU."""
    import torch
    import transformers

    from sdcstudy.bench.train import llama_config
    from sdcstudy.core.presets import ModelConfig, model_dims

    dims = dataclasses.replace(model_dims(ModelConfig(preset=args.preset)), dtype="float32")
    config = llama_config(dims, args.seq_len, "sdpa")
    model = transformers.LlamaForCausalLM(config).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    try:
        return model, torch.compile(model), optimizer, True
    except Exception:  # noqa: BLE001 - torch.compile refused: time eager, and say so
        return model, model, optimizer, False


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    model, step_model, optimizer, compiled = build(args)
    dtype = getattr(torch, args.dtype)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = step_model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(args.warmup):
            step()
    except Exception:  # noqa: BLE001 - a graph torch.compile cannot run: eager instead
        step_model, compiled = model, False
        for _ in range(args.warmup):
            step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.repeats):
        begin = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) / args.steps)
    seconds = statistics.median(times)
    args.json.write_text(json.dumps({
        "preset": args.preset, "batch": args.batch, "seq_len": args.seq_len,
        "tokens_per_s": args.batch * args.seq_len / seconds, "seconds_per_step": seconds,
        "attention": "sdpa", "compiled": compiled, "dtype": args.dtype,
        "torch_version": torch.__version__}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
