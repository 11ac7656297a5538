"""`sdcstudy golden record | check | quorum`: the command line of the golden checks."""

from __future__ import annotations

from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core.config import UserError
from sdcstudy.golden import devices
from sdcstudy.golden.check import DEFAULT, check
from sdcstudy.golden.record import record
from sdcstudy.golden.report import junit_xml, report_json

ALL = "all"


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
            else C.from_dict(DEFAULT, args.overrides))


def _write(args, report: dict, junit) -> None:
    for path, text in ((args.json, report_json), (args.junit, junit)):
        if path is not None:
            RF.atomic_write_text(Path(path), text(report))


def main(args) -> int:
    if args.golden_command == "record":
        meta = record(_config(args), args.out, device_index=args.device,
                      progress=not args.no_progress)
        print(f"golden record: {meta['golden_dir']} ({meta['steps']} steps x "
              f"{meta['microsteps']} microsteps, {len(meta['site_order'])} sites, "
              f"{meta['bytes'] / 1e6:.2f} MB, manifest sha256 {meta['manifest_sha256'][:16]}...)")
        return 0
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
        report = devices.quorum(_config(args), inject=args.inject,
                                inject_device=args.inject_device, workers=args.workers)
        return _finish(args, report)
    if args.repeat is not None and args.repeat < 1:
        raise UserError("--repeat must be at least 1.")
    if args.duration is not None and args.duration <= 0:
        raise UserError("--duration must be a positive number of minutes.")
    options = dict(allow_env_drift=args.allow_env_drift, repeat=args.repeat or 1,
                   duration_min=args.duration)
    if device == ALL:
        report = devices.check_all(args.golden_dir, inject=args.inject,
                                   inject_device=args.inject_device, workers=args.workers,
                                   progress=False, **options)
        for row in report["devices"]:
            row.pop("report")
        return _finish(args, report)
    report = check(args.golden_dir, inject=args.inject, device_index=device,
                   progress=not args.no_progress, **options)
    _write(args, report, junit_xml)
    reps = len(report["repetitions"])
    t = report["timing"]
    print(f"golden check {report['verdict']}: {report['reason']}")
    if reps:
        print(f"  device {report['device'].get('index')} ({report['device'].get('kind')}), "
              f"{reps} repetition(s), compile {t.get('compile_s', 0):.1f} s, run "
              f"{t.get('run_s', 0):.1f} s, total {t.get('total_s', 0):.1f} s")
    if report["injected"] is not None:
        print(f"  injected {report['injected']['label']}: {report['injected']['landed']} "
              f"corruption(s) landed")
    return report["exit_code"]


def _finish(args, report: dict) -> int:
    """Print the per-device table and the node's verdict; write the files asked for."""
    _write(args, report, devices.junit_xml)
    print(devices.table(report), end="")
    failing = [r for r in report["devices"] if r["verdict"] != "PASS"]
    print(f"golden {report['command']} {report['verdict']}: {len(report['devices'])} device(s), "
          f"{len(failing)} not PASS, {report['seconds']:.1f} s")
    for row in failing:
        print(f"  device {row['device']} {row['verdict']}: {row['reason']}")
    return report["exit_code"]
