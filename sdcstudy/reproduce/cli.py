"""`sdcstudy reproduce`: every paper node's runs, then the reproduction scorecard.

    sdcstudy reproduce [--preset tiny|small|medium] [--steps N] [--nodes 1,4,...|all]
        [--modes lockstep,paramsync,free,abft|all] [--dtype float32|bfloat16]
        [--fault-model additive|flip|chosen] [--set key=value ...] --out DIR [--resume]
        [--shard I/N] [--reuse DIR ...]
    sdcstudy reproduce --merge DIR ... --out DIR

leaves DIR/reproduce.json (what was asked, the shard, the plan: `plan`), one run folder per
planned run of the shard under DIR/runs/<node>-<mode>/, DIR/scorecard.md, .csv and .json
(`scorecard`) and DIR/figures/ (`figures`). `--resume` keeps finished runs and continues the
others; `--merge` copies the finished runs of the shards of one command (without their
checkpoints) into a new folder and scores them together; `--reuse` copies the runs other
folders already ran the same way (`reuse`). docs/reproduction.md has the bands.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sdcstudy.core import runfolder as RF
from sdcstudy.core.config import UserError
from sdcstudy.reproduce import plan as P

MANIFEST = "reproduce.json"  # what the command asked for, to check a --resume or --merge
STOPPED = "stopped.json"  # {run: why it stopped} for runs whose loss became non-finite
RUNS, FIGURES = "runs", "figures"
SCHEMA = "sdcstudy-reproduce/1"
DEFAULT_PRESET, DEFAULT_NODES, DEFAULT_MODES = "tiny", P.ALL, P.ALL
RUN_ARGUMENTS = ("preset", "steps", "nodes", "modes", "dtype", "shard", "fault_model")


def add_parser(sub) -> None:
    p = sub.add_parser("reproduce", help="every paper node in lock-step, parameter sync, free "
                                         "running and ABFT, then the reproduction scorecard of "
                                         "Tables 1, 2, 6-9, Figures 3-6 and 10 and appendices "
                                         "C.2 and D.3")
    p.add_argument("--preset", default=None, metavar="P",
                   help=f"built-in config: {', '.join(P.PRESETS)} (default {DEFAULT_PRESET})")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="optimizer steps per run (default: 200 for tiny, 100 for small and "
                        "medium)")
    p.add_argument("--nodes", default=None, metavar="1,4,...|all",
                   help="Ma et al.'s nodes, comma separated, or all (default)")
    p.add_argument("--modes", default=None, metavar="lockstep,paramsync,...|all",
                   help=f"which of each node's runs: {', '.join(P.MODES)}, comma separated, or "
                        f"all (default)")
    p.add_argument("--dtype", default=None, metavar="D",
                   help="model.dtype of the paired runs: float32 or bfloat16 (ABFT runs "
                        "float32 always)")
    p.add_argument("--fault-model", default=None, metavar="M",
                   help="the paper nodes' error model: additive (default, `paper-node-N`), "
                        "flip (`paper-node-N-flip`) or chosen (each node's own, docs/faults.md "
                        "6.5)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of every run (repeatable)")
    p.add_argument("--out", type=Path, default=None,
                   help="reproduce folder (default runs/reproduce-TIME)")
    p.add_argument("--resume", action="store_true",
                   help="continue the folder given by --out: keep finished runs")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only every N-th run, from the I-th (0 <= I < N), e.g. "
                        "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT")
    p.add_argument("--reuse", type=Path, nargs="+", default=None, metavar="DIR",
                   help="other reproduce folders: copy a planned run from them where they ran "
                        "the same run (config, expectations, software and machine) instead of "
                        "running it")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="DIR",
                   help="join the finished runs of these shard folders into --out and score "
                        "them together")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.merge:
        given = [f"--{a}" for a in RUN_ARGUMENTS if getattr(args, a) is not None]
        given += ["--set"] * bool(args.overrides) + ["--resume"] * args.resume
        given += ["--reuse"] * bool(args.reuse)
        if given:
            raise UserError(f"--merge takes only --out; {', '.join(given)} belong to the "
                            f"shards' own commands.")
        if args.out is None:
            raise UserError("--merge needs --out DIR, a new folder for the merged scorecard.")
        result = merge(args.merge, args.out)
    else:  # an option given empty ("--nodes ''") is refused, not read as its default
        req = P.request(_given(args.preset, DEFAULT_PRESET), args.steps,
                        P.parse_nodes(_given(args.nodes, DEFAULT_NODES)), args.dtype,
                        args.overrides, P.parse_modes(_given(args.modes, DEFAULT_MODES)),
                        _given(args.fault_model, P.DEFAULT_FAULT_MODEL))
        result = reproduce(req, P.parse_shard(args.shard), args.out, resume=args.resume,
                           progress=not args.no_progress, reuse=args.reuse or ())
    print(result["markdown"].split("\n## ")[0].rstrip())
    if result.get("missing"):
        print(f"\n{len(result['missing'])} planned runs are in none of the merged folders "
              f"({', '.join(result['missing'])}): their rows are \"not run\"; the shards' "
              f"command without --shard, with --resume --out {result['root']}, runs them.")
    print(f"\nscorecard: {result['root'] / 'scorecard.md'} (figures in "
          f"{result['root'] / FIGURES})")
    return 0


def _given(value: str | None, default: str) -> str:
    return default if value is None else value


# --- the folder --------------------------------------------------------------------------------


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise UserError(f"{str(root)!r} is not a reproduce folder (it has no {MANIFEST}); "
                        f"give the --out folders of sdcstudy reproduce.")
    manifest = RF.json_load(path)
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise UserError(f"{str(path)!r} is not a manifest sdcstudy reproduce wrote.")
    return {**manifest, "request": P.with_defaults(manifest["request"])}


def _stopped(root: Path) -> dict:
    path = Path(root) / STOPPED
    return RF.json_load(path) if path.is_file() else {}


def _hold(root: Path, create: bool, early: bool = False, keep=None,
          hint: str = "pass --resume to continue it or choose another --out"):
    """The run-folder lock on the reproduce root (core.runlock), as `run` and `sweep` hold;
    `early`: only the sentence it would refuse with now (`runlock.refuse_early`); `keep`, as
    `runlock.hold`'s: whether a new folder whose command failed keeps what it holds."""
    from sdcstudy.core import runlock

    if early:
        return runlock.refuse_early(root, create=create, what="reproduce folder", hint=hint)
    return runlock.hold(root, create=create, what="reproduce folder", hint=hint, keep=keep)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the command: where, how to continue, and the signal's exit
    code (130 or 143, as `interrupts.Interrupted` and `cli.Terminated` carry it)."""

    def __init__(self, stop: KeyboardInterrupt, where: str, root: Path):
        import signal

        from sdcstudy.core import errors

        self.exit_code = getattr(stop, "exit_code", errors.EXIT_SIGINT)
        super().__init__(f"interrupted by {signal.Signals(self.exit_code - 128).name}{where}; "
                         f"continue with the same command and --resume --out {root}")


def _check_resume(root: Path, manifest: dict) -> None:
    earlier = read_manifest(root)
    for key, what in (("request", "settings"), ("shard", "shard"),
                      ("plan", "planned runs (have the fault profiles changed?)")):
        if earlier.get(key) != manifest[key]:
            if key == "request":
                what = ", ".join(k for k in manifest[key]
                                 if earlier[key].get(k) != manifest[key][k])
            raise UserError(f"cannot resume {str(root)!r}: it was started with other {what}; "
                            f"run the same command with --resume, or choose another --out.")


def reproduce(req: dict, shard: tuple[int, int], out: Path | None, *, resume: bool = False,
              progress: bool = True, reuse=()) -> dict:
    """Run this shard's part of the plan of `req` into `out`, then score the folder; a run
    that a `reuse` folder already ran is copied from there (`reuse.find`)."""
    from sdcstudy.reproduce import reuse as U

    if resume and out is None:
        raise UserError("--resume needs --out DIR, the reproduce folder to continue.")
    if out is not None:  # said before the imports below (JAX), which take seconds
        _hold(out, create=not resume, early=True)
    found = U.sources(list(reuse), out, read_manifest)

    plan, configs = P.build(req)
    manifest = {"schema": SCHEMA, "request": req, "shard": list(shard), "plan": plan}
    root = Path(out) if out is not None else RF.default_run_dir("reproduce")
    if resume:
        read_manifest(root)  # a folder sdcstudy reproduce wrote, before it is held
    refused = []  # a run refused its config: a new folder with no run in it is emptied again

    def keep(path: Path) -> bool:
        return not refused or any((path / RUNS).glob("*"))

    with _hold(root, create=not resume, keep=keep):
        if resume:
            _check_resume(root, manifest)
        else:
            RF.atomic_write_json(root / MANIFEST, manifest)
        try:
            return _run_shard(root, plan, configs, shard, resume, progress, found)
        except UserError:
            refused.append(True)
            raise


def _run_shard(root: Path, plan: list[dict], configs: dict, shard: tuple[int, int],
               resume: bool, progress: bool, found: list) -> dict:
    """The loop of `reproduce` over this shard's runs, then the scorecard."""
    from tqdm import tqdm

    from sdcstudy import runner
    from sdcstudy.core.train import NonFiniteError
    from sdcstudy.reproduce import reuse as U

    where = ""
    try:
        mine = [entry for i, entry in enumerate(plan) if P.in_shard(i, shard)]
        env = _environment() if found else {}
        stopped = _stopped(root)
        bar = tqdm(mine, desc="reproduce", unit="run", disable=not progress, position=0,
                   dynamic_ncols=True)
        for k, entry in enumerate(bar, 1):
            name = entry["name"]
            run_dir, where = root / RUNS / name, f" in {name}"
            bar.set_postfix_str(name)
            if not progress:  # a line a run, for logs (no bars)
                tqdm.write(f"{name}: run {k} of {len(mine)}")
            if resume and RF.finished(run_dir):
                tqdm.write(f"{name}: finished earlier, kept")
                continue
            if found and (same := U.find(entry, configs[name], found, env)):
                U.copy(same, run_dir)
                tqdm.write(f"{name}: the same run as {same}, reused")
                stopped.pop(name, None)
                RF.atomic_write_json(root / STOPPED, stopped)
                continue
            try:
                runner.run(configs[name], run_dir, progress=progress, echo=tqdm.write,
                           resume=resume and (run_dir / RF.CONFIG).is_file())
                stopped.pop(name, None)
            except NonFiniteError as e:
                tqdm.write(f"{name}: stopped: {e}")
                stopped[name] = str(e)
            RF.atomic_write_json(root / STOPPED, stopped)
        where = ""
        bar.close()
        return write_scorecard(root)
    except KeyboardInterrupt as stop:
        raise Stopped(stop, where, root) from None


def _environment() -> dict:
    """This process's `determinism.fingerprint`, which reused runs must share."""
    from sdcstudy.core import determinism

    return determinism.fingerprint()


def write_scorecard(root: Path) -> dict:
    """Score the finished runs of the folder: scorecard files and figures. No JAX."""
    from sdcstudy.report.runs import load_run
    from sdcstudy.reproduce import figures as F
    from sdcstudy.reproduce import scorecard as S
    from sdcstudy.reproduce import seed_scatter as SS

    manifest = read_manifest(root)
    plan = manifest["plan"]
    runs = {e["name"]: load_run(root / RUNS / e["name"], strict=False) for e in plan
            if RF.finished(root / RUNS / e["name"])}
    rows = S.build(plan, runs, _stopped(root), scatter=SS.by_node(manifest["request"]))
    result = S.write(root, rows, manifest["request"], plan, runs)
    by_mode = {mode: {f"Node {e['node']}": runs[e["name"]] for e in plan
                      if e["mode"] == mode and e["name"] in runs} for mode in P.MODES}
    figures = F.draw(rows, by_mode, root / FIGURES)
    return {**result, "root": Path(root), "rows": rows, "figures": figures}


# --- merging shards -----------------------------------------------------------------------------


def merge(dirs: list[Path], out: Path) -> dict:
    """A new folder `out` with the finished runs of the shard folders `dirs` (all of one
    command), scored together. Everything is checked before anything is written."""
    dirs = [Path(d) for d in dirs]
    if len({d.resolve() for d in dirs}) < len(dirs):
        raise UserError("--merge names a folder more than once.")
    manifests = [read_manifest(d) for d in dirs]
    first = manifests[0]
    for d, manifest in zip(dirs[1:], manifests[1:]):
        if manifest["request"] != first["request"]:
            keys = [k for k in first["request"]
                    if manifest["request"].get(k) != first["request"][k]]
            raise UserError(f"{str(d)!r} was run with other {', '.join(keys)} than "
                            f"{str(dirs[0])!r}; merge only the shards of one reproduce command.")
        if manifest["plan"] != first["plan"]:
            raise UserError(f"{str(d)!r} planned other runs than {str(dirs[0])!r} (the fault "
                            f"profiles changed between them); merge only the shards of one "
                            f"reproduce command.")
    from sdcstudy.core import runlock

    for d in dirs:
        if pid := runlock.holder(d):
            by = f"process {pid}" if pid > 0 else "another process"
            raise UserError(f"{str(d)!r} is still being written by {by}; merge it once that "
                            f"command has ended.")
    found, stopped = {}, {}
    for d in dirs:
        for entry in first["plan"]:
            name = entry["name"]
            if RF.finished(d / RUNS / name):
                if name in found:
                    raise UserError(f"run {name} finished in both {str(found[name])!r} and "
                                    f"{str(d)!r}: the shards overlap; merge each shard once.")
                found[name] = d
        stopped.update(_stopped(d))
    with _hold(Path(out), create=True, hint="--merge writes a new folder: choose another --out"):
        RF.atomic_write_json(Path(out) / MANIFEST, {
            **first, "shard": [0, 1], "merged_from": [str(d) for d in dirs]})
        for name, d in found.items():
            shutil.copytree(d / RUNS / name, Path(out) / RUNS / name,
                            ignore=shutil.ignore_patterns(RF.CHECKPOINTS, ".lock"))
        stopped = {k: v for k, v in stopped.items() if k not in found}
        RF.atomic_write_json(Path(out) / STOPPED, stopped)
        missing = [e["name"] for e in first["plan"] if e["name"] not in {**found, **stopped}]
        return {**write_scorecard(Path(out)), "missing": missing}


def report_dirs(paths, echo=print) -> list[Path]:
    """For `sdcstudy report`: a reproduce folder prints its scorecard and stands for its runs."""
    from sdcstudy.reproduce import scorecard as S

    out = []
    for path in map(Path, paths):
        if (path / MANIFEST).is_file():
            if (path / S.MARKDOWN).is_file():
                echo((path / S.MARKDOWN).read_text().rstrip())
            out.append(path / RUNS)
        else:
            out.append(path)
    return out

