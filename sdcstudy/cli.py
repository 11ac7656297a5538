"""`sdcstudy ...` and `python -m sdcstudy ...`.

Exit codes follow the contract in `core/errors.py` (docs/golden.md "Exit codes"): 0 PASS,
1 FAIL (bits differ) or a training stopped by what it measured, 2 bad input or INCONCLUSIVE,
3 could not run or could not report, 130/143 interrupted. Every error ends with one sentence
on stderr. JAX is imported only by the commands that need it, after the determinism flags
are set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import errors
from sdcstudy.core.config import UserError
from sdcstudy.version import PrintVersion

DEMO_STEPS = 40  # sdcstudy.demo.DEMO_STEPS (kept here so the parser needs no JAX)
SIMULATED_CPU_DEVICES = 8


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=1e-3 (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="run folder (default runs/NAME-TIME)")


def _progress(args) -> bool:
    return not getattr(args, "no_progress", False)


def _run_command(args, out: Path | None, resume: bool) -> str:
    """`args`' `sdcstudy run` command for a shell, `--set` flags and all, into `out`; with
    --resume when asked, and never --stop-after."""
    words = ["sdcstudy", "run", str(args.config)]
    for override in args.overrides:
        words += ["--set", override]
    words += ["--out", str(out)] if out is not None else []
    words += ["--resume"] if resume else []
    for flag, value in (("--coordinator", args.coordinator),
                        ("--num-processes", args.num_processes),
                        ("--process-id", args.process_id), ("--timeout", args.timeout)):
        words += [flag, str(value)] if value is not None else []
    return shlex.join(words + (["--no-progress"] if args.no_progress else []))


def cmd_run(args) -> int:
    cfg = C.load(args.config, args.overrides)
    if args.resume and args.out is None:
        raise UserError("--resume needs --out RUN_DIR, the run folder to continue.")
    if args.out is not None and not args.process_id:  # process 0 is the folder's writer
        from sdcstudy.core import runfolder, runlock

        if args.resume:
            runfolder.open_run_dir(args.out, resume=True)
        runlock.refuse_early(args.out, create=not args.resume)
    from sdcstudy.core import distributed

    try:
        with distributed.ends_together():
            distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   args.timeout, run=distributed.run_settings(cfg, args))
            from sdcstudy import runner

            summary = runner.run(cfg, args.out, resume=args.resume, stop_after=args.stop_after,
                                 progress=_progress(args) and distributed.is_writer())
    except KeyboardInterrupt as stop:  # interrupts.Interrupted: SIGINT 130, SIGTERM 143
        if not hasattr(stop, "exit_code"):
            raise
        again = (_run_command(args, stop.run_dir, resume=True) if stop.kept else
                 _run_command(args, args.out, resume=args.resume))
        print(f"sdcstudy: {stop.sentence(again)}", file=sys.stderr)
        return stop.exit_code
    print(f"run folder: {summary['run_dir']}")
    if summary["steps_done"] < summary["steps"]:
        print(f"stopped after step {summary['steps_done']} of {summary['steps']}; continue "
              f"with: {_run_command(args, summary['run_dir'], resume=True)}")
    return 0


def cmd_demo(args) -> int:
    from sdcstudy import demo

    demo.main(args.out, steps=args.steps, progress=_progress(args))
    return 0


def cmd_doctor(args) -> int:
    from sdcstudy import doctor

    return doctor.main(json_path=args.json, keep=args.keep, progress=not args.no_progress)


def cmd_golden(args) -> int:
    from sdcstudy.golden import cli as golden

    return golden.main(args)


def cmd_profiles(args) -> int:
    from sdcstudy.faults import profiles

    print(profiles.listing())
    return 0


def cmd_sweep(args) -> int:
    from sdcstudy import sweep

    return sweep.main(args)


def cmd_report(args) -> int:
    from sdcstudy.report import writer as report
    from sdcstudy.reproduce import cli as reproduce

    return report.main(reproduce.report_dirs(args.run_dirs), args.out)


def cmd_plan(args) -> int:
    from sdcstudy.plan import cli as plan

    return plan.main(args)


def cmd_bench(args) -> int:
    from sdcstudy.bench import cli as bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = errors.ArgumentParser(prog="sdcstudy", description="Silent data corruption in "
                                     "LLM training: paired-node experiments in JAX.")
    parser.add_argument("--version", action=PrintVersion, help="the version (and git commit)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("demo", help="a healthy and a suspect node in lock-step and "
                                     "parameter sync: mismatch table and WCNTS")
    p.add_argument("--out", type=Path, default=None, help="run folder (default runs/demo-TIME)")
    p.add_argument("--steps", type=int, default=DEMO_STEPS, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", help="run one experiment from a YAML config")
    p.add_argument("config", type=Path, help="YAML config (keys it omits take defaults)")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue the run folder given by --out")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="checkpoint and stop after this step (continue later with --resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("one node per process (see docs/pairing.md)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address and a free port (or SDCSTUDY_COORDINATOR)")
    g.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="processes in the run, one per node (or SDCSTUDY_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process, 0 = the healthy node (or SDCSTUDY_PROCESS_ID)")
    g.add_argument("--timeout", type=int, default=None, metavar="SECONDS",
                   help="how long to wait for the peers to start or to join a collective "
                        "before failing; a peer silent twice as long is dead (or "
                        "SDCSTUDY_TIMEOUT_S; default 300)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sweep", help="one run per suspect profile, then a combined report")
    p.add_argument("config", type=Path, help="YAML config (keys it omits take defaults)")
    p.add_argument("--profiles", required=True, metavar="P1,P2,...",
                   help="suspect profiles, comma separated: zoo names or YAML files; all: "
                        "every zoo profile but healthy")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key for every run (repeatable)")
    p.add_argument("--out", type=Path, default=None,
                   help="sweep folder: one run folder per profile and report/ "
                        "(default runs/sweep-MODE-TIME)")
    p.add_argument("--resume", action="store_true",
                   help="continue the sweep in --out: keep finished runs, resume the others")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("report", help="paper-style tables (Markdown, CSV) and PNG plots from "
                                      "run folders")
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                   help="run folders, or folders of them (a sweep, a demo)")
    p.add_argument("--out", type=Path, default=None,
                   help="report folder, new or an earlier report (default runs/report-TIME)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("doctor", help="determinism self-test and environment fingerprint")
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    p.add_argument("--keep", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true",
                   help="no line counting the runs done")
    p.set_defaults(func=cmd_doctor)

    from sdcstudy.golden.arguments import add_parser as add_golden_parser

    add_golden_parser(sub).set_defaults(func=cmd_golden)

    from sdcstudy.fleet.cli import add_parser as add_fleet_parser

    add_fleet_parser(sub)

    from sdcstudy.reproduce.cli import add_parser as add_reproduce_parser

    add_reproduce_parser(sub)

    p = sub.add_parser("plan", help="per-device memory, FLOPs, bytes between the nodes and "
                                     "step time of a setup, from its step compiled ahead of "
                                     "time (docs/plan.md)")
    from sdcstudy.plan.cli import add_arguments as add_plan_arguments

    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("profiles", help="list the fault profiles (node zoo)")
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("bench", help="performance benchmarks")
    from sdcstudy.bench.cli import add_bench_args

    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("accept-gpu", help="acceptance of one NVIDIA GPU against the project's "
                                          "targets: exit 0 PASS, 1 FAIL, 2 INCOMPLETE, no GPU "
                                          "or bad arguments, 3 a check could not run "
                                          "(docs/gpu.md)")
    from sdcstudy.gpu.acceptance import add_arguments as add_gpu_arguments
    from sdcstudy.gpu.acceptance import run as run_gpu_acceptance

    add_gpu_arguments(p)
    p.set_defaults(func=run_gpu_acceptance)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from sdcstudy.core import determinism, xlaflags

    # Simulated CPU devices for the paired mesh (node x dp x tp) unless XLA_FLAGS names a
    # count; a GPU or TPU backend ignores it.
    determinism.configure(device_count=SIMULATED_CPU_DEVICES)
    xlaflags.tolerate_slow_threads()  # a starved thread must not abort a healthy run
    from sdcstudy.core import interrupts

    # A stop that Python swallowed (raised in a garbage-collection callback after a long call
    # into XLA) is sent again, so no command goes on to exit 0 past a Ctrl-C.
    with _sigterm_as_interrupt(), interrupts.resent_when_swallowed():
        return _dispatch(args)


def entry() -> int:
    """The `sdcstudy` command (and `python -m sdcstudy`): `main`, then after an interrupt (130,
    143; every file and sentence written) an exit without the interpreter's clean-up. A compile
    cut short by Ctrl-C goes on in XLA's own thread, and the clean-up freed what it used: a
    segmentation fault (exit 139) after the sentence saying how to run again."""
    code = main()
    if code in (errors.EXIT_SIGINT, errors.EXIT_SIGTERM):
        jax = sys.modules.get("jax")
        if jax is not None and jax.distributed.is_initialized():
            jax.distributed.shutdown()  # the handshake the clean-up would have made with peers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _dispatch(args) -> int:
    """Run the command; every way it can end becomes an exit code of the contract."""
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe raises here, not at exit
        return code
    except UserError as e:
        print(f"sdcstudy: error: {e}", file=sys.stderr)
        return errors.EXIT_BAD_INPUT
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM through _terminate_as_interrupt
        print(f"sdcstudy: {str(e) or 'interrupted'}", file=sys.stderr)
        return getattr(e, "exit_code", errors.EXIT_SIGINT)
    except BrokenPipeError:  # `sdcstudy profiles | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 128 + signal.SIGPIPE
    except errors.CouldNotRun as e:
        print(f"sdcstudy: error: {e}", file=sys.stderr)
        return errors.EXIT_COULD_NOT_RUN
    except Exception as e:
        return _stopped(e)


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a run's own loop (which checkpoints first): stop like Ctrl-C, exit 143."""

    exit_code = errors.EXIT_SIGTERM

    def __str__(self) -> str:
        return "terminated (SIGTERM)"


def _terminate_as_interrupt(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises `Terminated` while a command runs (a run's loop installs its own); the
    previous handler comes back after, so a caller's own process (a test) keeps its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _stopped(error: Exception) -> int:
    """The exit code and sentence of an exception that reached the top: a training stopped by
    what it measured is 1; anything else could not run (3), never a FAIL verdict."""
    from sdcstudy.core.train import NonFiniteError
    from sdcstudy.detect.trainer import DetectionError
    from sdcstudy.runner import WriteError

    if isinstance(error, (NonFiniteError, DetectionError)):  # the run stopped on a finding
        print(f"sdcstudy: error: {error}", file=sys.stderr)
        return errors.EXIT_FAIL
    if isinstance(error, WriteError):  # the run folder could not be written
        print(f"sdcstudy: error: {error}", file=sys.stderr)
        return errors.EXIT_COULD_NOT_RUN
    if os.environ.get("SDCSTUDY_TRACEBACK"):
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    print(f"sdcstudy: error: {errors.unexpected(error)}", file=sys.stderr)
    return errors.EXIT_COULD_NOT_RUN
