"""python experiments/golden_flips.py [--flips 50] [--clean 10] [--seed 0] [--out DIR]

Does the golden-run check catch every single-bit flip, and does it say where it happened?

1. `sdcstudy golden record` of the default tiny workload (a separate process): wall time, size.
2. `sdcstudy golden check` of it (a separate process): wall time including JAX start-up and
   compilation, verdict and exit code (should be PASS, 0, well under 60 s on 2 CPU cores).
3. `--clean` clean checks in this process (the program compiled once): none may FAIL.
4. `--flips` checks, each with one flip of one random bit of one random element at a random
   step, microstep, named site (its forward value or the gradient arriving at it) and layer:
   every one should FAIL (exit code 1) with the first difference at the flipped step,
   microstep, layer and site, and the flipped element inside the reported block.

Results go to DIR/flips.json (DIR new or empty; a temporary folder without --out) and a
summary is printed. Each flip compiles its own program (the fault is part of it), about 10-20 s
each on a 2-core CPU. Exit 0 when every check came out as it should, 1 when one did not, 3 (one
sentence) when the study could not run, never 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from sdcstudy.core import errors
from sdcstudy.core.errors import ArgumentParser

SDCSTUDY = [sys.executable, "-m", "sdcstudy"]


def sample_flips(meta: dict, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    flips = []
    for _ in range(n):
        site, layer = meta["site_order"][rng.integers(len(meta["site_order"]))].rsplit("/", 1)
        flips.append({"step": int(rng.integers(1, meta["steps"] + 1)),
                      "microstep": int(rng.integers(meta["microsteps"])),
                      "site": f"{rng.choice(['fwd', 'bwd'])}/{site}", "layer": int(layer),
                      "bit": int(rng.integers(32)), "seed": int(rng.integers(1, 10**6))})
    return flips


def flip_text(flip: dict) -> str:
    return "flip:" + ",".join(f"{k}={v}" for k, v in flip.items())


def localized(flip: dict, report: dict) -> tuple[bool, str]:
    """(whether the first difference is exactly where the flip landed, a note)."""
    from sdcstudy.faults import specs as FS

    first, injected = report.get("first_difference"), (report.get("injected") or {})
    landed = injected.get("first") or []
    if report["verdict"] != "FAIL" or first is None:
        return False, f"verdict {report['verdict']}: {report['reason']}"
    if injected.get("landed") != 1:
        return False, f"{injected.get('landed')} corruptions landed, not 1"
    direction, site = FS.FaultSpec(flip["site"]).resolve()
    want = (flip["step"], flip["microstep"], flip["layer"], f"{direction}/{site}")
    got = (first.get("step"), first.get("microstep"), first.get("layer"), first.get("site"))
    if got != want:
        return False, f"reported {got}, injected {want}"
    block = first["block"]
    if not block["flat_start"] <= landed[0]["flat_index"] < block["flat_stop"]:
        return False, f"element {landed[0]['flat_index']} outside block {block}"
    return True, f"block {block['index']} of {block['of']}"


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--flips", type=int, default=50, help="flipped checks (default 50)")
    parser.add_argument("--clean", type=int, default=10, help="clean checks (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="a new or empty folder")
    args = parser.parse_args(argv)
    if args.flips < 1 or args.clean < 0:
        parser.error(f"--flips must be at least 1 and --clean at least 0, not {args.flips} and "
                     f"{args.clean}.")
    if args.out is not None and args.out.exists() and \
            (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out} is not an empty folder; give a new --out.")
    try:
        return study(args)
    except Exception as e:  # a crash is no verdict: exit 3, as `sdcstudy` ends one
        if os.environ.get("SDCSTUDY_TRACEBACK"):
            traceback.print_exc()
        print(f"golden_flips: error: {errors.unexpected(e)}", file=sys.stderr)
        return errors.EXIT_COULD_NOT_RUN


def study(args) -> int:
    """Records, checks and flips; writes OUT/flips.json; 0 when every check came out right."""
    out = args.out or Path(tempfile.mkdtemp(prefix="golden-flips-"))
    out.mkdir(parents=True, exist_ok=True)
    golden_dir = out / "golden"
    env = dict(os.environ)
    results = {"seed": args.seed}

    started = time.perf_counter()
    subprocess.run(SDCSTUDY + ["golden", "record", "--out", str(golden_dir), "--no-progress"],
                   check=True, env=env)
    results["record_wall_s"] = time.perf_counter() - started
    results["golden_bytes"] = sum(p.stat().st_size for p in golden_dir.iterdir())

    started = time.perf_counter()
    proc = subprocess.run(SDCSTUDY + ["golden", "check", str(golden_dir), "--json",
                                      str(out / "clean.json"), "--no-progress"], env=env)
    clean = json.loads((out / "clean.json").read_text())
    results["check_cli"] = {"wall_s": time.perf_counter() - started, "exit_code": proc.returncode,
                            "verdict": clean["verdict"], "timing": clean["timing"]}
    print(f"record {results['record_wall_s']:.1f} s, {results['golden_bytes'] / 1e6:.2f} MB; "
          f"check (new process) {clean['verdict']} exit {proc.returncode} in "
          f"{results['check_cli']['wall_s']:.1f} s", flush=True)

    from sdcstudy.core import determinism

    determinism.configure(device_count=8)  # as the command line does
    from sdcstudy.golden import check as golden

    _, _, meta, _ = golden.load(golden_dir)
    verdicts = []
    for i in range(args.clean):
        report = golden.check(golden_dir)
        verdicts.append(report["verdict"])
        print(f"clean check {i + 1}: {report['verdict']} ({report['timing']['total_s']:.1f} s)",
              flush=True)
    results["clean_checks"] = verdicts

    rows = []
    for i, flip in enumerate(sample_flips(meta, args.flips, args.seed)):
        report = golden.check(golden_dir, inject=flip_text(flip))
        ok, note = localized(flip, report)
        landed = (report.get("injected") or {}).get("first") or [{}]
        rows.append({"flip": flip, "verdict": report["verdict"], "exit_code": report["exit_code"],
                     "localized": ok, "note": note, "first_difference": report["first_difference"],
                     "landed": landed[0], "total_s": report["timing"].get("total_s")})
        print(f"flip {i + 1:2d}/{args.flips} {flip_text(flip):70s} {report['verdict']:12s} "
              f"{'localized' if ok else 'NOT LOCALIZED'}: {note}", flush=True)
    results["flips"] = rows
    failed = sum(r["verdict"] == "FAIL" for r in rows)
    right = sum(r["localized"] for r in rows)
    results["summary"] = {"flips": len(rows), "fail": failed, "localized": right,
                          "clean_pass": verdicts.count("PASS"), "clean": len(verdicts)}
    (out / "flips.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nclean checks: {verdicts.count('PASS')}/{len(verdicts)} PASS, "
          f"{verdicts.count('FAIL')} FAIL")
    print(f"single-bit flips: {failed}/{len(rows)} FAIL, {right}/{len(rows)} localized to the "
          f"right step, microstep, layer, site and block")
    print(f"results: {out / 'flips.json'}")
    return 0 if failed == right == len(rows) and verdicts.count("PASS") == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
