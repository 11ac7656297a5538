"""`sdcstudy sweep`: one run per suspect profile, then one combined report.

    sdcstudy sweep configs/demo.yaml --profiles paper-node-1,paper-node-7,paper-node-11 \
        --set experiment.steps=200 --out runs/zoo

leaves runs/zoo/<profile>/ (a run folder each, in the order given) and runs/zoo/report/
(`sdcstudy report` of them all); `--profiles all` runs every profile of `sdcstudy profiles`
but `healthy`, the node each suspect is paired with. Every profile is checked before the
first run starts; an interrupted sweep continues with --resume: finished runs are kept, an
unfinished one continues from its last checkpoint.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.report import writer as R
from sdcstudy.core import interrupts, reports
from sdcstudy.core import runfolder as RF
from sdcstudy.core import runlock
from sdcstudy.core.config import UserError
from sdcstudy.core.errors import first_line

SWEEP = "sweep.json"  # what the sweep was asked to do, to check a --resume against
ALL = "all"  # --profiles all: the whole zoo
REPORT = "report"  # the sweep's report folder, beside the run folders


def parse_profiles(text: str) -> list[str]:
    """"a,b, c" -> ["a", "b", "c"]; "all" stands for every zoo profile but `healthy` (the
    node each suspect is paired with); empty or repeated names are bad input."""
    names = [name.strip() for name in text.split(",")]
    if not names or any(not name for name in names):
        raise UserError(f"--profiles {text!r} needs profile names separated by commas, e.g. "
                        f"--profiles paper-node-1,paper-node-7, or all.")
    if ALL in names:
        from sdcstudy.faults import profiles as zoo  # imports JAX: only here

        whole = [name for name in zoo.zoo() if name != "healthy"]
        at = names.index(ALL)
        names[at:at + 1] = whole
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UserError(f"--profiles names {', '.join(repeated)} more than once.")
    return names


def folder_name(profile: str) -> str:
    """The run folder of a profile: its zoo name, or the stem of its YAML file."""
    return Path(profile).stem if profile.endswith((".yaml", ".yml")) else profile


def _check_resumable(root: Path, request: dict) -> None:
    try:
        earlier = RF.json_load(root / SWEEP)
        if not isinstance(earlier, dict):
            raise ValueError("it is not a JSON object")
    except (OSError, ValueError) as e:
        raise UserError(f"cannot resume {str(root)!r}: its {SWEEP} can not be read "
                        f"({first_line(e)}); start the sweep again with another --out (the "
                        f"runs in it can still be reported: sdcstudy report "
                        f"{str(root)}).") from None
    if earlier != request:
        changed = sorted(k for k in request if earlier.get(k) != request[k])
        raise UserError(f"cannot resume {str(root)!r}: its sweep had different "
                        f"{', '.join(changed)}; run the same command with --resume.")


def sweep(config_path, profiles: list[str], out: Path | None = None, overrides=(), *,
          resume: bool = False, progress: bool = True, echo=print) -> dict:
    """Run `config_path` once per suspect profile, then report; returns {"root", "runs",
    "report"} (the report as `report.write_report` returns it)."""
    if out is not None:  # said before the imports below (JAX), which take seconds
        runlock.refuse_early(out, create=not resume, what="sweep folder")
    from sdcstudy.faults import profiles as zoo
    from sdcstudy import runner

    overrides = list(overrides)
    configs = {}
    for profile in profiles:
        zoo.load(profile)  # an unknown name or a bad file stops the sweep before any run
        name = folder_name(profile)
        if name in (REPORT, SWEEP):
            kept = "report folder" if name == REPORT else "request file"
            raise UserError(f"profile {profile!r} would have the run folder {name!r}, the name "
                            f"of the sweep's {kept}; rename the file.")
        if name in configs:
            raise UserError(f"profiles {profile!r} and {configs[name][0]!r} would share the "
                            f"run folder {name!r}; rename one of the files.")
        configs[name] = (profile, C.load(config_path, [*overrides, f"suspect.profile={profile}",
                                                       f"experiment.name={name}"]))
        zoo.load_for(configs[name][1])  # so does a spec this run's model or mode cannot fire
    mode = next(iter(configs.values()))[1].experiment.mode
    if mode == "train":
        raise UserError("a sweep compares each suspect profile with a healthy node or scores "
                        "a detector on it, and experiment.mode train does neither; use "
                        "lockstep, paramsync or free (paired), or abft.")
    request = {"config": str(config_path), "overrides": overrides, "profiles": list(profiles)}
    if resume and (out is None or not (Path(out) / SWEEP).is_file()):
        raise UserError(f"--resume needs --out SWEEP_DIR, a folder an earlier sweep wrote "
                        f"(with {SWEEP}).")
    root = Path(out) if out is not None else RF.default_run_dir(f"sweep-{mode}")
    # The sweep holds its folder, and each run its own, for as long as they write. A new sweep
    # that fails (or is stopped) before any run holds a step leaves no folder, as `run` does:
    # the same command, corrected, may run again.
    with runlock.hold(root, create=not resume, what="sweep folder", keep=_holds_a_run):
        if resume:
            _check_resumable(root, request)
        else:
            with reports.writing(root / SWEEP, "sweep file"):
                RF.atomic_write_json(root / SWEEP, request)
        run_dirs = []
        for i, (name, (profile, cfg)) in enumerate(configs.items(), 1):
            run_dir = root / name
            run_dirs.append(run_dir)
            if resume and RF.finished(run_dir):
                echo(f"[{i}/{len(configs)}] {profile}: finished earlier, kept ({run_dir})")
                continue
            echo(f"[{i}/{len(configs)}] {profile}: {mode}, {cfg.experiment.steps} steps -> "
                 f"{run_dir}")
            runner.run(cfg, run_dir, resume=resume and (run_dir / RF.CONFIG).is_file(),
                       progress=progress, echo=echo)
        result = R.write_report(run_dirs, root / REPORT)
    return {"root": root, "runs": run_dirs, "report": result}


def _holds_a_run(root: Path) -> bool:
    """Something a sweep's runs left (a run folder keeps only what holds a step)."""
    return any(p.name not in (SWEEP, runlock.LOCK) for p in root.iterdir())


def sweep_command(args, root: Path, resume: bool) -> str:
    """`args`' sweep command for a shell, `--set` flags and all, into `root`."""
    words = ["sdcstudy", "sweep", str(args.config), "--profiles", args.profiles]
    for override in args.overrides:
        words += ["--set", override]
    words += ["--out", str(root), *(["--resume"] if resume else [])]
    return shlex.join(words + (["--no-progress"] if args.no_progress else []))


def main(args) -> int:
    """`sdcstudy sweep CONFIG.yaml --profiles P1,P2,... [--set k=v ...] [--out DIR]`."""
    try:
        result = sweep(args.config, parse_profiles(args.profiles), args.out, args.overrides,
                       resume=args.resume, progress=not args.no_progress)
    except KeyboardInterrupt as stop:  # a run's `Interrupted`: the sweep continues, not the run
        if getattr(stop, "run_dir", None) is None:
            raise
        run, root = str(stop.run_dir), stop.run_dir.parent
        where = (f"run {run!r} was stopped before its first step and not kept" if not stop.kept
                 else f"run {run!r} has no checkpoint yet" if stop.checkpoint is None
                 else f"run {run!r} keeps its checkpoint of step {stop.checkpoint}")
        then = (f"{where}, and the runs finished before it are kept: continue the sweep with: "
                f"{sweep_command(args, root, resume=True)}" if (root / SWEEP).is_file() else
                f"no run had done a step, so {str(root)!r} was not kept: run again with: "
                f"{sweep_command(args, root, resume=False)}")
        raise interrupts.Stopped(stop.signum, then) from None  # the CLI says it: 130, 143
    print(result["report"]["summary"])
    print(f"sweep folder: {result['root']}; report: {result['report']['out'] / R.REPORT}")
    return 0
