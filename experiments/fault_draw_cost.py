"""python experiments/fault_draw_cost.py [--preset tiny] [--tokens 1024] [--rate 1e-3] [--calls 300]
    [--json FILE]

What one firing fault site costs: the draws, against the matmul that made the tensor.

`sdcstudy bench faults` times whole steps, idle and firing (RESULTS.md, "The fault engine's
speed"). This times the parts at one site of the model, jitted alone: the site's matmul
(tokens x d_model by d_model x d_model), the random draws of an additive spec
(`faults.draws.draw`: the hit positions, then a magnitude and a sign for each hit), and
drawing, applying and recording together (`corrupt_and_record`, as a firing site runs it).
Where the rate makes more than `draws.HIT_CAP` hits, it also times the dense rest of the draw
both ways, side by side: every element's words at once (`dense_after_one_pass`), and the two
passes (`dense_after` with `two_passes=True`: first words, then the undecided elements
gathered; the engine takes them on the CPU only), and says whether the two give the same
bits. A weight gradient of the small model at nodes 1 and 14's rate: `--preset small
--tokens 1536 --rate 0.0152 --calls 20` (its 512 x 1,536 product dW; `sdcstudy accept-gpu`'s
`fault_draws` check runs it on a GPU).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax

from sdcstudy.core import config as C
from sdcstudy.core.digest import tree_digest
from sdcstudy.core.errors import ArgumentParser
from sdcstudy.faults import corrupt as FC
from sdcstudy.faults import draws as FD
from sdcstudy.faults import specs as FS


def per_call_us(fn, *args, calls: int) -> float:
    """The mean wall time of `calls` back-to-back calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--preset", default="tiny", help="model preset: its d_model (default tiny)")
    p.add_argument("--tokens", type=int, default=1024, help="rows of the activation (default "
                                                            "1,024: 16 sequences of 64)")
    p.add_argument("--rate", type=float, default=1e-3, help="the spec's rate (default 1e-3)")
    p.add_argument("--calls", type=int, default=300, help="timed calls each (default 300)")
    p.add_argument("--json", type=Path, help="also write the times, and whether the dense "
                                             "rest's two ways agree, to this new JSON file")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.calls < 1 or not 0 < args.rate <= 1:
        p.error(f"--tokens and --calls must be at least 1 and --rate in (0, 1], not "
                f"{args.tokens}, {args.calls} and {args.rate}")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: its folder {args.json.parent} does not exist")
    if args.json is not None and args.json.exists():
        p.error(f"--json {args.json} already exists; remove it or give a new file name")
    try:
        width = C.model_dims(C.from_dict({"model": {"preset": args.preset}}).model).d_model
    except C.ConfigError as e:
        p.error(str(e))
    shape = (args.tokens, width)
    x = jax.random.normal(jax.random.key(0), shape)
    w = jax.random.normal(jax.random.key(1), (width, width))
    spec = FS.FaultSpec("fwd/attn", "additive", rate=args.rate, scale=(2.0**-8, 1.0))
    key_data = jax.random.key_data(jax.random.key(2))
    parts = {
        f"matmul {args.tokens} x {width} @ {width} x {width}": (jax.jit(lambda x, w: x @ w),
                                                                (x, w)),
        "draws (hits, magnitude, sign)": (jax.jit(lambda kd: FD.draw(
            jax.random.wrap_key_data(kd), spec, args.rate, shape, 32)), (key_data,)),
        "draw, apply and record": (jax.jit(lambda x, kd: FC.corrupt_and_record(
            x, kd, args.rate, spec, 64, skip_idle=True)), (x, key_data)),
    }
    dense = dense_rest_parts(spec, args.rate, math.prod(shape), key_data)
    parts.update(dense)
    base, times = None, {}
    for name, (fn, fn_args) in parts.items():
        us = per_call_us(fn, *fn_args, calls=args.calls)
        base, times[name] = base or us, us
        print(f"{name:<38} {us:9.0f} us  {us / base:5.1f}x the matmul")
    same = None
    if dense:
        (one, one_args), (two, two_args) = dense.values()
        same = tree_digest(one(*one_args)) == tree_digest(two(*two_args))
        print(f"the two passes give the one-pass draw's bits: {'yes' if same else 'NO'}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "device": jax.devices()[0].device_kind, "shape": list(shape), "rate": args.rate,
            "parts_us": times, "dense_rest_us": dict(zip(DENSE_KEYS, [times[n] for n in dense])),
            "dense_rest_same_bits": same}, indent=1))
        print(f"wrote {args.json}")


DENSE_KEYS = ("one_pass", "two_passes")  # the JSON's names of the dense rest's two ways


def dense_rest_parts(spec, rate: float, size: int, key_data) -> dict:
    """{name: (jitted fn, args)}: the dense rest of one draw both ways, every element's words
    (`dense_after_one_pass`) and the two passes (`dense_after`, forced); empty where the rate
    leaves no dense rest to draw."""
    if rate * size <= FD.HIT_CAP:
        return {}
    listed = jax.jit(lambda kd: FD.listed_draws(jax.random.wrap_key_data(kd), spec, rate, size,
                                                32))(key_data)
    hit, aux, positions, dense_keys = listed
    args = (dense_keys, hit, aux, positions)
    return {"dense rest, every element's words": (jax.jit(
                lambda *a: FD.dense_after_one_pass(a[0], spec, rate, 32, *a[1:])), args),
            "dense rest, two passes": (jax.jit(
                lambda *a: FD.dense_after(a[0], spec, rate, 32, *a[1:], two_passes=True)), args)}


if __name__ == "__main__":
    main()
