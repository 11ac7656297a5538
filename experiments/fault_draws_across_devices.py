"""python experiments/fault_draws_across_devices.py [--kinds bitflip-drawn,count] [--quick]

The fault engine's corruption on the default device (a GPU) against the CPU's, bit for bit.

A profile replays its faults on the machine that drew them. This says how far that holds
across platforms: each case corrupts one tensor with one spec on both devices, from the same
key, and compares the hit positions the draw lists and the corrupted tensor. Hit positions and
flipped bits come from integer hashes and the exact sampler (`faults/draws.py`); the values of
`scale` and `additive` hits go through exp and log (and `additive` through a row RMS), which
each platform rounds its own way.

On a machine without a GPU both sides are the CPU, and every case agrees. Exit 1 if any case
differs; 3 (one sentence) if the comparison could not run, never 1.
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from sdcstudy.core import errors
from sdcstudy.core.errors import ArgumentParser
from sdcstudy.faults import specs as FS
from sdcstudy.faults.corrupt import corrupt_with_positions

SPECS = {
    "bitflip-drawn": dict(kind="bitflip", bit_class="exponent"),
    "bitflip-fixed": dict(kind="bitflip", bits=(14,)),  # a bit both float32 and bfloat16 have
    "additive": dict(kind="additive", scale=(1e-3, 1.0)),
    "scale": dict(kind="scale", scale=(0.5, 2.0)),
    "count": dict(kind="bitflip", bits=(14,), count=3),
}
RATES = (1.0, 0.3, 1e-3, 1e-6, 1e-9, 0.0)
SHAPES = ((64,), (128, 96), (700, 3000))
DTYPES = (jnp.float32, jnp.bfloat16)


def _bytes(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def compare(name: str, rate: float, shape, dtype, devices) -> dict:
    """One case: the same corruption on each of `devices`; what agrees and how much differs."""
    spec = FS.FaultSpec(site="fwd/attn", rate=rate, **SPECS[name])
    corrupt = jax.jit(lambda x, key, r: corrupt_with_positions(x, key, spec, r))
    outs = []
    for device in devices:
        x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
        args = jax.device_put((x, jax.random.key(7), jnp.float32(rate)), device)
        outs.append(jax.device_get(corrupt(*args)))
    (y0, *_, pos0, _), (y1, *_, pos1, _) = outs
    apart = np.asarray(y0).view(np.uint8) != np.asarray(y1).view(np.uint8)
    return {"spec": name, "rate": rate, "shape": "x".join(map(str, shape)),
            "dtype": jnp.dtype(dtype).name, "positions_equal": _bytes(pos0) == _bytes(pos1),
            "elements_apart": int(apart.reshape(*np.shape(y0), -1).any(-1).sum()),
            "hits": int(np.sum(np.asarray(pos0) < np.prod(shape)))}


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--kinds", default=",".join(SPECS),
                        help=f"comma-separated, of {', '.join(SPECS)}")
    parser.add_argument("--quick", action="store_true", help="the two smaller shapes only")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := sorted(set(kinds) - set(SPECS)):
        parser.error(f"unknown kind {unknown[0]!r}; choose from {', '.join(SPECS)}.")
    try:
        return 1 if differing(kinds, SHAPES[:2] if args.quick else SHAPES) else 0
    except Exception as e:  # a crash is no verdict: exit 3, as `sdcstudy` ends one
        if os.environ.get("SDCSTUDY_TRACEBACK"):
            traceback.print_exc()
        print(f"fault_draws_across_devices: error: {errors.unexpected(e)}", file=sys.stderr)
        return errors.EXIT_COULD_NOT_RUN


def differing(kinds: list[str], shapes) -> int:
    """Prints the table of every case; returns how many differ."""
    devices = (jax.devices("cpu")[0], jax.devices()[0])
    print(f"{devices[1].device_kind} against {devices[0].device_kind}, jax {jax.__version__}")
    print("| spec | rate | shape | dtype | positions equal | elements apart | listed hits |")
    print("|---|---:|---|---|---|---:|---:|")
    apart = 0
    for name, rate, shape, dtype in itertools.product(kinds, RATES, shapes, DTYPES):
        row = compare(name, rate, shape, dtype, devices)
        apart += row["elements_apart"] > 0 or not row["positions_equal"]
        print("| {spec} | {rate:g} | {shape} | {dtype} | {positions_equal} | {elements_apart} "
              "| {hits} |".format(**row), flush=True)
    print(f"cases that differ: {apart}")
    return apart


if __name__ == "__main__":
    raise SystemExit(main())
