"""`sdcstudy golden record | check | quorum`: the command line of the golden checks.

Input that cannot work (a bad option, a folder that is no usable golden record, a config that
does not load) is refused here in one sentence, before JAX is imported or a device touched.
The record is read and checked once here (`contents.open_record`, against `--expect-sha`) and
that one copy is what every device is checked against. The verdict is printed before any
report file is written; a report that cannot be written is one warning sentence and leaves
the verdict's exit code as it is.
"""

from __future__ import annotations

import os
import sys

from sdcstudy.core import config as C
from sdcstudy.core import errors, interrupts, reports, runlock
from sdcstudy.core.config import UserError
from sdcstudy.golden import contents
from sdcstudy.golden.manifest import (
    MANIFEST, RECORD_FOLDER, RECORD_HINT, GoldenError, expect_sha_arg)
from sdcstudy.golden.report import junit_xml, node_junit_xml, refused_report, report_json
from sdcstudy.golden.sizing import MAX_MEMORY_SHARE, TINY

ALL = "all"
# The full workload's buffer needs most of the GPU's memory; JAX's allocator takes 75% of it
# unless told otherwise (XLA_PYTHON_CLIENT_MEM_FRACTION, read when the backend starts).
FULL_MEMORY_FRACTION = "0.95"


def device_arg(text: str) -> int | str:
    """`--device`: a local device index, or `all`."""
    if text == ALL:
        return ALL
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--device must be a device index or 'all', not {text!r}.") from None


def _config(args):
    return (C.load(args.config, args.overrides) if args.config is not None
            else C.from_dict(TINY, args.overrides))


def _write(args, report: dict, junit) -> None:
    """The report files asked for, after the verdict was printed: one that cannot be written
    (a read-only or full folder, a path through a file) is one warning sentence naming it
    (core/reports.py), and the verdict keeps its exit code."""
    for path, text, what in ((args.json, report_json, "JSON report"),
                             (args.junit, junit, "JUnit report")):
        if path is not None:
            reports.write_report_file(path, text(report), what)


def _full_workload_memory() -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", FULL_MEMORY_FRACTION)


def main_record(args) -> int:
    full = args.workload == "full"
    if full and (args.config is not None or args.overrides):
        raise UserError("golden record --workload full sizes its own config for the device; "
                        "give no CONFIG and no --set.")
    if args.memory_share is not None and not full:
        raise UserError("--memory-share sizes the full workload's buffer: add --workload full.")
    if args.memory_share is not None and not 0 < args.memory_share <= MAX_MEMORY_SHARE:
        raise UserError(f"--memory-share must be above 0 and at most {MAX_MEMORY_SHARE}, not "
                        f"{args.memory_share}.")
    cfg = None if full else _config(args)
    # Said at once, before JAX is imported (seconds): a folder another recorder holds, or one
    # that holds anything (a golden record is never overwritten). `record` still decides, under
    # the folder's lock.
    runlock.refuse_early(args.out, create=True, what=RECORD_FOLDER, hint=RECORD_HINT)
    if full:
        _full_workload_memory()
    from sdcstudy.golden.record import record
    from sdcstudy.golden.telemetry import coverage_line

    try:
        meta = record(cfg, args.out, device_index=args.device, progress=not args.no_progress,
                      memory_share=args.memory_share)
    except KeyboardInterrupt as stop:  # a record stopped before its manifest left no folder
        kept = (args.out / MANIFEST).is_file()
        raise interrupts.Stopped(interrupts.signum_of(stop), (
            f"the golden record {str(args.out)!r} was written whole before the stop" if kept
            else "nothing of the golden record was kept: run the same command again"
        )) from None
    print(f"golden record: {meta['golden_dir']} ({meta['workload']} workload, {meta['steps']} "
          f"steps x {meta['microsteps']} microsteps, {len(meta['site_order'])} sites, "
          f"{meta['bytes'] / 1e6:.2f} MB)")
    print(f"  manifest sha256 {meta['manifest_sha256']} (keep it: golden check "
          f"--expect-sha {meta['manifest_sha256']} refuses any other record)")
    print(f"  {coverage_line(meta['coverage'])}")
    return 0


def open_or_refuse(args, device) -> contents.Golden | None:
    """The record, read and checked once; or None after printing why it is no usable golden
    record (one sentence) and writing its reports when asked for, before any device is
    touched."""
    try:
        golden = contents.open_record(args.golden_dir, args.expect_sha)
    except GoldenError as e:
        _refuse(args, str(e), device)
        return None
    if golden.meta.get("workload") == "full":
        _full_workload_memory()
    return golden


def _refuse(args, reason: str, device, command: str = "check") -> int:
    """Refuse the command before any device ran: the sentence on stderr, and the report files
    asked for say the same (INCONCLUSIVE, no device rows), so that no earlier report is left
    standing for this command. Exit 2."""
    print(f"sdcstudy: error: {reason}", file=sys.stderr)
    report = refused_report(getattr(args, "golden_dir", None), reason, device, args.inject,
                            getattr(args, "allow_env_drift", False), command=command)
    _write(args, report, node_junit_xml if device == ALL else junit_xml)
    return errors.EXIT_BAD_INPUT


def main(args) -> int:
    if args.golden_command == "record":
        return main_record(args)
    device = device_arg(args.device)
    if args.inject_device is not None and device != ALL:
        raise UserError("--inject-device chooses among the devices of --device all; with one "
                        "device, --inject alone injects there.")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}.")
    if args.golden_command == "quorum":
        if device != ALL:
            raise UserError("golden quorum compares the devices with each other: give "
                            "--device all.")
        try:
            cfg = _config(args)
            from sdcstudy.golden import devices

            report = devices.quorum(cfg, inject=args.inject, inject_device=args.inject_device,
                                    workers=args.workers, progress=not args.no_progress)
        except UserError as e:  # a config, device count or injection refused
            return _refuse(args, str(e), ALL, command="quorum")
        return _finish(args, report)
    if args.repeat is not None and args.repeat < 1:
        raise UserError("--repeat must be at least 1.")
    if args.duration is not None and args.duration <= 0:
        raise UserError("--duration must be a positive number of minutes.")
    if args.expect_sha is not None:
        args.expect_sha = expect_sha_arg(args.expect_sha)
    golden = open_or_refuse(args, device)
    if golden is None:
        return errors.EXIT_BAD_INPUT
    from sdcstudy.golden import devices
    from sdcstudy.golden.check import check
    from sdcstudy.golden.telemetry import coverage_line

    options = dict(allow_env_drift=args.allow_env_drift, repeat=args.repeat,
                   duration_min=args.duration)
    if device == ALL:
        try:
            report = devices.check_all(golden, inject=args.inject,
                                       inject_device=args.inject_device, workers=args.workers,
                                       progress=not args.no_progress, **options)
        except UserError as e:  # an injection that cannot land, refused before any device ran
            return _refuse(args, str(e), ALL)
        for row in report["devices"]:
            row.pop("report")
        return _finish(args, report)
    report = check(golden, inject=args.inject, device_index=device,
                   progress=not args.no_progress, **options)
    reps = len(report["repetitions"])
    t = report["timing"]
    print(f"golden check {report['verdict']}: {report['reason']}")
    if reps:
        print(f"  device {report['device'].get('index')} ({report['device'].get('kind')}), "
              f"{reps} repetition(s), compile {t.get('compile_s', 0):.1f} s, run "
              f"{t.get('run_s', 0):.1f} s, total {t.get('total_s', 0):.1f} s")
    if report["coverage"] is not None:
        print(f"  {coverage_line(report['coverage'])}")
    if report["injected"] is not None:
        print(f"  injected {report['injected']['label']}: {report['injected']['landed']} "
              f"corruption(s) landed")
    sys.stdout.flush()
    _write(args, report, junit_xml)
    return report["exit_code"]


def at_once(workers: int | None) -> str:
    """How many devices ran at a time, and so why the devices' seconds add up to more than
    the wall time."""
    if not workers or workers < 2:
        return ""
    return f" ({workers} devices at a time: their seconds overlap)"


def same_reasons(rows: list[dict]) -> list[tuple[str, str, str]]:
    """The not-PASS devices grouped by verdict and reason, in device order, so that a reason
    every device shares (another software stack, say) is printed once."""
    groups: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        groups.setdefault((row["verdict"], row["reason"]), []).append(row["device"])
    return [(device_names(indices), verdict, reason)
            for (verdict, reason), indices in groups.items()]


def device_names(indices: list[int]) -> str:
    """`device 2`, `devices 0 to 3` or `devices 0, 2, 5`."""
    if len(indices) == 1:
        return f"device {indices[0]}"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"devices {indices[0]} to {indices[-1]}"
    return "devices " + ", ".join(str(i) for i in indices)


def _finish(args, report: dict) -> int:
    """Print the per-device table and the node's verdict; write the files asked for."""
    from sdcstudy.golden.report import node_table
    from sdcstudy.golden.telemetry import coverage_line

    print(node_table(report), end="")
    failing = [r for r in report["devices"] if r["verdict"] != "PASS"]
    print(f"golden {report['command']} {report['verdict']}: {len(report['devices'])} device(s), "
          f"{len(failing)} not PASS, {report['seconds']:.1f} s wall time"
          f"{at_once(report.get('workers'))}")
    for devices, verdict, reason in same_reasons(failing):
        print(f"  {devices} {verdict}: {reason}")
    for row in report["devices"]:
        if row.get("coverage") is not None:
            print(f"  device {row['device']} {coverage_line(row['coverage'])}")
    sys.stdout.flush()
    _write(args, report, node_junit_xml)
    return report["exit_code"]
