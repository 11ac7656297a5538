"""The bits every mode computes, recorded and compared: a refactor's evidence that it changed
no computation.

    python -m sdcstudy.dev.mode_bits --out FILE.json      # record this tree's bits
    python -m sdcstudy.dev.mode_bits --compare BASE.json  # record again, exit 1 on a difference

Each mode (train, lockstep, paramsync, free, abft, detect, paft, finetune, golden) runs a few
steps of a tiny model with faults that fire in every fault-bearing mode (forward and backward
sites, the gradient and the update; lock-step with ABFT on), and `stacks` runs the train mode
with gradient and update faults drawn by rate (a dense additive error past the listed hits of
the stacked leaves, `faults.corrupt.corrupt_and_record_stacked`). Each leaves its
final parameter digest, every metrics row (wall-clock fields left out), the summary
(likewise) and a SHA-256 of every row of every Parquet table; `golden` leaves a SHA-256 of
every step's digests and of its fault rows, clean and injected. The comparison names the
first mode and field that differ; without `--modes` it takes the modes the base file holds
(a base recorded before a mode existed compares the others). A record also holds the
packages and CPU it was made with (`environment`): XLA's code, and so the bits, follow them,
and a comparison with a base made elsewhere says so before it compares. `--lowered` records
only a digest of each mode's lowered step program: a check in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

# Eight simulated CPU devices, as the tests have, before JAX is imported.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

MODES = ("train", "lockstep", "paramsync", "free", "abft", "detect", "paft", "finetune",
         "golden", "stacks")
# Fields that measure the host's clock, not the computation.
WALL_CLOCK = ("time/step_s", "compile_s", "wall_time_s", "tokens_per_s")

# Faults at the compared sites (forward and backward), the gradient and the update: small
# mantissa flips, so that training stays finite.
PROFILE = """\
name: mode-bits
description: mantissa flips at compared sites, the gradient and the update
specs:
  - {site: fwd/attn, kind: bitflip, count: 2, bit_class: mantissa}
  - {site: bwd/ffn, kind: bitflip, count: 2, bit_class: mantissa}
  - {site: grad, kind: bitflip, count: 1, bit_class: mantissa}
  - {site: update, kind: bitflip, count: 1, bit_class: mantissa}
"""
PAFT_PROFILE = """\
name: mode-bits-paft
specs:
  - {site: grad, kind: bitflip, count: 1, bit_class: mantissa}
  - {site: collective/grad_allreduce, kind: bitflip, count: 1, bit_class: mantissa}
  - {site: update, kind: bitflip, count: 1, bit_class: mantissa}
"""
# Drawn by rate, where the other runs' gradient and update faults are counts: dense additive
# gradient errors (past the listed hits of the 2,048-element leaves) and lane-bound mantissa
# flips of updates.
STACKS_PROFILE = """\
name: mode-bits-stacks
specs:
  - {site: grad, kind: additive, rate: 0.6, scale: [0.00390625, 1.0]}
  - {site: update, kind: bitflip, rate: 0.01, bit_class: mantissa, lanes: [1, 5]}
"""
DETECT_PROFILE = """\
name: mode-bits-detect
specs:
  - {site: fwd/ffn, kind: bitflip, count: 1, bits: [22]}
"""
MODEL = {"preset": "tiny", "n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1,
         "ffn_dim": 64}
BASE = {"experiment": {"steps": 6, "batch_size": 4, "microsteps": 2, "checkpoint_every": 0,
                       "seed": 1},
        "model": MODEL, "optim": {"warmup_steps": 2}, "data": {"seq_len": 16,
                                                                "synthetic_tokens": 20_000}}


def _configs(folder: Path) -> dict:
    """Mode -> its config as a dict (finetune's init filled in by `record`)."""
    profile = folder / "profile.yaml"
    profile.write_text(PROFILE)
    (folder / "paft.yaml").write_text(PAFT_PROFILE)
    (folder / "detect.yaml").write_text(DETECT_PROFILE)
    (folder / "stacks.yaml").write_text(STACKS_PROFILE)
    faulty = {"suspect": {"profile": str(profile)}}
    # Tensor parallelism splits the KV heads: two of them on the paired nodes.
    paired = {**faulty, "mesh": {"tp": 2, "dp": 2}, "model": {"n_kv_heads": 2}}

    def mode(name, **sections):
        d = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
        for key, value in sections.items():
            d[key] = {**d.get(key, {}), **value}
        d["experiment"]["mode"] = name
        return d

    return {
        "train": mode("train", mesh={"dp": 2}, **faulty),
        "stacks": mode("train", mesh={"dp": 2}, suspect={"profile": str(folder / "stacks.yaml")}),
        "lockstep": mode("lockstep", abft={"enabled": True}, **paired),
        "paramsync": mode("paramsync", **paired),
        "free": mode("free", **paired),
        "abft": mode("abft", abft={"enabled": True}, **faulty),
        "detect": mode("detect", mesh={"dp": 2}, optim={"schedule": "constant"},
                       suspect={"profile": str(folder / "detect.yaml"),
                                "fault_kind": "transient"}),
        "paft": mode("paft", mesh={"dp": 4}, suspect={"profile": str(folder / "paft.yaml")},
                     optim={"name": "sgdm", "lr": 0.3, "clip_norm": None},
                     experiment={"microsteps": 1, "batch_size": 8},
                     paft={"sync_every": 2, "noise": {"sigma2": 1.0e-3}}),
        "finetune": mode("finetune", mesh={"dp": 2}, **faulty,
                         experiment={"batch_size": 4, "microsteps": 1},
                         optim={"name": "adam", "lr": 1e-3, "warmup_steps": 1,
                                "min_lr_ratio": 1.0},
                         data={"seq_len": 176},
                         finetune={"synthetic_train": 16, "synthetic_test": 12,
                                   "eval_batch_size": 8}),
    }


def _sha(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _table_rows(path: Path) -> list[str]:
    from sdcstudy.core import tablelog as TL

    frame = TL.read_table(path)
    frame = frame[sorted(frame.columns)]
    return [_sha(row) for row in frame.astype(object).where(frame.notna(), None)
            .to_dict("records")]


def condensed(row_digests: list[str]) -> dict:
    """A table's row digests as their number and one SHA-256 over them, in order."""
    return {"rows": len(row_digests), "sha256": _sha(row_digests)}


def run_folder_bits(run_dir: Path, summary: dict, folder: Path) -> dict:
    """The bits of one run folder; paths inside `folder` (this recording's scratch) are
    written relative to it."""
    from sdcstudy.core import runfolder as RF

    rows = [{k: v for k, v in r.items() if k not in WALL_CLOCK}
            for r in RF.read_jsonl(run_dir / RF.METRICS)]
    tables = {p.name: condensed(_table_rows(p)) for p in sorted(run_dir.iterdir())
              if p.name.endswith(".parquet")}
    return {"param_digest": summary["param_digest"], "metrics": rows,
            "summary": json.loads(json.dumps(
                {k: v for k, v in summary.items() if k not in WALL_CLOCK and k != "run_dir"},
                default=str).replace(str(folder), "<scratch>")),
            "tables": tables}


def golden_bits(folder: Path) -> dict:
    """A tiny golden workload's per-step digests, clean and with the mode-bits faults."""
    import jax
    import numpy as np

    from sdcstudy.core import config as C
    from sdcstudy.golden import record as GR
    from sdcstudy.golden import workload as GW

    cfg = C.from_dict({**{k: v for k, v in BASE.items() if k != "experiment"},
                       "experiment": {**BASE["experiment"], "steps": 4}})
    tokens = GR.load_tokens(cfg)
    device = jax.local_devices()[0]
    out = {}
    for label, injection in (("clean", None),
                             ("injected", GW.parse_injection(str(folder / "profile.yaml")))):
        work = GW.Workload(cfg, tokens, device, injection)
        steps, faults = [], []
        for step, digests, _ in work.run():
            leaves = jax.tree_util.tree_flatten_with_path(
                {k: v for k, v in digests.items() if k != "faults"})[0]
            steps.append(_sha([[jax.tree_util.keystr(p), np.asarray(v).tolist()]
                               for p, v in leaves]))
            if step:
                faults.append(_sha(work.fault_rows(digests.get("faults", {}), step)))
        out[label] = {"steps": steps, "fault_rows": faults}
    return out


def lowered_programs(modes=MODES, progress=print) -> dict:
    """Mode -> SHA-256 of its step's lowered program (StableHLO, no source locations), traced
    from abstract values: no compile, no step run. Equal programs compile to equal executables
    on one machine, so equal digests show the same computation in seconds, when both trees have
    the same model (compare with the parent commit); a difference (the order of outputs
    included) says only that the full `record` must decide."""
    import jax

    from sdcstudy import modes as registry
    from sdcstudy.core import config as C

    result = {}
    with tempfile.TemporaryDirectory(prefix="mode-bits-") as tmp:
        configs = _configs(Path(tmp))
        for name in modes:
            if name in ("golden", "finetune"):  # they compile when built: `record` only
                continue
            progress(f"mode-bits: lowering {name}")
            mode = registry.build(C.from_dict(configs[name]))
            trainer = mode.trainer
            state = jax.eval_shape(trainer.init_state)
            batch = trainer.make_batch(mode.batches().batch(0))
            shardings = trainer.shardings(state, batch)
            jitted = jax.jit(trainer.train_step, donate_argnums=0,
                             **({} if shardings is None else dict(in_shardings=shardings)))
            text = jitted.lower(state, batch).as_text()
            # Output names (result[2]... against result.records...) say nothing of the program.
            text = re.sub(r'jax\.result_info = "[^"]*"', "", text)
            result[name] = hashlib.sha256(text.encode()).hexdigest()
    return result


def record(modes=MODES, progress=print) -> dict:
    from sdcstudy import runner
    from sdcstudy.core import config as C

    result = {}
    with tempfile.TemporaryDirectory(prefix="mode-bits-") as tmp:
        folder = Path(tmp)
        configs = _configs(folder)
        for name in modes:
            progress(f"mode-bits: {name}")
            if name == "golden":
                result[name] = golden_bits(folder)
                continue
            d = configs[name]
            if name == "finetune":  # from the train mode's run, in a folder of its own
                init = folder / "runs" / "pretrained"
                runner.run(C.from_dict(configs["train"]), init, progress=False,
                           echo=lambda *a: None)
                d["finetune"]["init"] = str(init)
            out = folder / "runs" / name
            summary = runner.run(C.from_dict(d), out, progress=False, echo=lambda *a: None)
            result[name] = run_folder_bits(out, summary, folder)
    return result


ENVIRONMENT = "environment"


def environment() -> dict:
    """The packages and the CPU this process runs with."""
    from sdcstudy.core import determinism

    return {"packages": determinism.package_versions(), "cpu": determinism.cpu_info()}


def other_environment(base: dict) -> str | None:
    """How `base`'s environment differs from this one's, in words, or None where they agree."""
    if ENVIRONMENT not in base:
        return "holds no record of its packages and CPU"
    here, there = environment(), base[ENVIRONMENT]
    changed = [f"{name} {there['packages'].get(name)} (here {version})"
               for name, version in here["packages"].items()
               if name != "sdcstudy" and there["packages"].get(name) != version]
    there_cpu = there.get("cpu") or {}  # a field the record lacks was added since: not compared
    cpu_fields = [f"{key} {value} (here {here['cpu'].get(key)})"
                  for key, value in there_cpu.items() if here["cpu"].get(key) != value]
    if cpu_fields or not there_cpu:
        changed.append(f"another CPU ({', '.join(cpu_fields) or 'none recorded'})")
    return f"recorded with {', '.join(changed)}" if changed else None


def first_difference(base, new, where: str = "") -> str | None:
    """The path of the first field where `new` differs from `base`, or None."""
    if isinstance(base, dict) and isinstance(new, dict):
        for key in list(base) + [k for k in new if k not in base]:
            if key not in base or key not in new:
                return f"{where}/{key} (only in {'the base' if key in base else 'this tree'})"
            if (found := first_difference(base[key], new[key], f"{where}/{key}")) is not None:
                return found
        return None
    if isinstance(base, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(base, new)):
            if (found := first_difference(a, b, f"{where}[{i}]")) is not None:
                return found
        return None if len(base) == len(new) else f"{where} (length {len(base)} != {len(new)})"
    # A float by its bits (repr: -0.0 is not 0.0, 1.0 is not 1, NaN is NaN), the rest by value.
    if repr(base) == repr(new) if isinstance(base, float) or isinstance(new, float) else \
            base == new:
        return None
    return f"{where}: {base!r} != {new!r}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdcstudy.dev.mode_bits",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write this tree's bits to this JSON file")
    parser.add_argument("--compare", type=Path, help="compare this tree's bits with this file")
    parser.add_argument("--lowered", action="store_true",
                        help="record (or compare) the lowered step programs only: seconds, no "
                             "run; golden and finetune are left to the full record")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes (default: all)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not (args.out or args.compare):
        parser.error(f"unknown mode {unknown[0]!r}" if unknown else "give --out or --compare")
    base = json.loads(args.compare.read_text()) if args.compare else None
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if base is not None and args.modes == parser.get_default("modes") and (
            newer := [m for m in modes if m not in base]):
        say(f"mode-bits: not in {args.compare}, left out: {', '.join(newer)}")
        modes = [m for m in modes if m in base]
    if base is not None and (elsewhere := other_environment(base)):
        say(f"mode-bits: {args.compare}: {elsewhere}; bits may differ for that alone")
    bits = lowered_programs(modes, say) if args.lowered else record(modes, say)
    bits[ENVIRONMENT] = environment()
    if args.lowered:
        skipped = [m for m in modes if m not in bits]
        if skipped:
            say(f"mode-bits: not lowered (compiled when built; use the full record): "
                f"{', '.join(skipped)}")
        modes = [m for m in modes if m in bits]
    if args.out:  # whole or not at all: a stop while it is written leaves no half of it
        from sdcstudy.core.runfolder import atomic_write_text

        atomic_write_text(args.out, json.dumps(bits, indent=1, sort_keys=True) + "\n")
    if base is None:
        return 0
    for mode in modes:
        if mode not in base:
            print(f"{mode}: not in {args.compare}")
            return 1
        found = first_difference(base[mode], bits[mode], mode)
        if found is not None:
            print(f"differs: {found}")
            return 1
    print(f"identical: {', '.join(modes)}")
    return 0


def command(argv=None) -> int:
    """`main` as a command: Ctrl-C or SIGTERM (143, as the CLI's `Terminated` carries it)
    ends it with one line and 130 or 143, and a stop Python swallowed is sent again."""
    from sdcstudy.core import interrupts

    def terminated(signum, frame):
        raise interrupts.Stopped(signum, "run it again")

    before = signal.signal(signal.SIGTERM, terminated)
    try:
        with interrupts.resent_when_swallowed():
            return main(argv)
    except KeyboardInterrupt as stop:
        signum = interrupts.signum_of(stop)
        print(f"mode-bits: interrupted by {signal.Signals(signum).name}; run it again (--out is "
              f"written whole or not at all)", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(command())
