"""`sdcstudy report`: paper-style tables (Markdown in report.md, and CSV) and PNG figures for
a set of run folders.

    from sdcstudy.report import writer
    writer.write_report(["runs/a", "runs/b"], "reports/ab")   # report.md, CSV, PNG

`load_runs` reads and labels the run folders (`report/runs.py`) and turns each file it could
not read into one sentence that says what the report leaves out (`NEEDED_BY`). `write_report`
computes the tables (`tables.py`) while the figures (`plots.py`) are drawn, in forked workers
where that is safe, adds the report sections of the runs' modes (`sections.py`: PAFT, the
detector benchmark and fine-tuning contribute theirs through the mode registry,
`sdcstudy.modes.REPORT_SECTIONS`), and removes the files an earlier report in the same folder
wrote and this one did not. Imports no JAX, and no feature package. A run folder with a
missing or damaged file still reports what the other files allow; `sdcstudy report` then
names each such file on stderr and exits 2 (core/errors.py: input that is partly unreadable;
1 is a FAIL verdict, which a report never gives). A report file that cannot be written ends
the command with `ReportWriteError` naming it (exit 3). Files are written in a hidden folder
in --out, moved out at the end (`_commit`): a stop leaves no half report, an earlier one whole.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from sdcstudy import modes
from sdcstudy.core import errors, interrupts, reports, runlock
from sdcstudy.core import runfolder as RF
from sdcstudy.core.config import UserError
from sdcstudy.report.runs import DamagedFile, expand_run_dirs, label_runs, load_run

REPORT = "report.md"
CSV_FILES = ("runs.csv", "table1_frequency.csv", "table2_max_severity.csv",
             "table6_layer_frequency_fwd.csv", "table7_layer_frequency_bwd.csv",
             "table8_layer_severity_fwd.csv", "table9_layer_severity_bwd.csv", "bit_fields.csv",
             "bit_positions.csv", "wcnts.csv", "abft_runs.csv", "abft_flag_rate.csv")
# Wide tables whose Markdown shows only the columns with a non-zero value (the CSV has all).
SPARSE_TABLES = ("bit_positions.csv",)
FIGURE_TITLES = {
    "fig3_mismatch_frequency.png": "Figure 3: mismatch frequency per step, per lock-step run",
    "fig4_mismatch_frequency_smoothed.png": "Figure 4: smoothed mismatch frequency of fwd/attn",
    "fig5_gradient_difference.png": "Figure 5: gradient difference and ground-truth gradient "
                                    "norm",
    "fig6_training_dynamics.png": "Figure 6: parameter difference, gradient norms and losses "
                                  "of free-running pairs",
    "bit_positions.png": "Differing bits per bit position of the mismatching elements",
    "fig10_abft_flag_frequency.png": "Figure 10: ABFT flag frequency over steps",
}
# What the report leaves out of a run whose file of this name can not be read.
NEEDED_BY = {RF.MISMATCH: "Tables 1-2 and 6-9 and Figures 3-4",
             RF.METRICS: "the runs table's step values, WCNTS, Figures 5-6 and the PAFT "
                         "table and figure",
             RF.SUMMARY: "the bit-field and bit-position tables and figure and the ABFT "
                         "runs table's recall and precision",
             RF.ABFT: "the ABFT tables and Figure 10",
             RF.FAULTS: "the runs table's fault count where metrics.jsonl has no "
                        "faults/landed",
             RF.ENV: "nothing (the report does not use it)"}
# Beside a table with the paper's values: they are of its whole runs, ours of the run's steps.
PUBLISHED_NOTE = (" Ma et al.'s published value in parentheses, of their whole run (Figure 3 "
                  "spans 4,000 optimizer steps); a run of a few steps can differ from it by the "
                  "node's time pattern alone (nodes 10 and 11 start with a spike that decays "
                  "over 20 steps: `sdcstudy profiles`).")
# The runs table's columns shown with the digits that tell a row's values apart.
LOSSES = ("loss/healthy", "loss/suspect")
SUMMARY_TABLES = ("runs.csv", "table1_frequency.csv", "table2_max_severity.csv", "wcnts.csv",
                  "abft_runs.csv")
STAGING = ".report-partial-"  # the hidden folder inside --out a report is written into


def _out_dir(out) -> tuple[Path, Path]:
    """The report folder (new, empty, or an earlier report, whose files are replaced) and the
    hidden folder made inside it that the report is written into (`_commit`)."""
    if out is None:
        out = RF.default_run_dir("report")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file, not a folder.")
    if out.exists() and not (out / REPORT).is_file() and any(
            not p.name.startswith(STAGING) for p in out.iterdir()):  # one a kill left: no file
        raise UserError(f"--out {str(out)!r} already exists and holds no {REPORT}; choose a new "
                        f"folder (an earlier report folder is replaced).")
    with reports.writing(out, "report folder"):
        out.mkdir(parents=True, exist_ok=True)
        return out, Path(tempfile.mkdtemp(prefix=STAGING, dir=out))


def _write(path: Path, text: str) -> None:
    """One file of the report, atomically; one that cannot be written is ReportWriteError."""
    with reports.writing(path):
        RF.atomic_write_text(path, text)


def partial_note(runs: dict) -> str:
    """The runs table's note on the runs short of their last step: those a live process still
    writes (a report of a sweep under way), then those that stopped."""
    from sdcstudy.report import tables as T

    still, stopped = [], []
    for label, (done, asked) in T.partial_runs(runs).items():
        pid = runlock.holder(runs[label].path)
        (stopped if pid is None else still).append(
            f"{label} at step {done} of {asked}" + (f" (process {pid})" if pid and pid > 0
                                                     else ""))
    return ((" Still being written, so every figure here is of the steps written so far: "
             + ", ".join(still) + "." if still else "")
            + (" Stopped before their last step, so every figure here is of the steps done: "
               + ", ".join(stopped) + "." if stopped else ""))


def distinguished(table, columns):
    """`table` with the cells of `columns` that `tables.fmt` would round to the same text in
    one row (a free pair's losses 5.02119 and 5.02154: "5.02" twice) written with the digits
    that tell them apart, up to 9."""
    import pandas as pd

    from sdcstudy.report import tables as T

    columns = [c for c in columns if c in table]
    values = table[columns].apply(pd.to_numeric, errors="coerce")
    shown = table.astype({c: object for c in columns})
    for key, row in values.iterrows():
        finite = row[row.map(math.isfinite)]
        if finite.nunique() < 2 or len({T.fmt(v) for v in finite}) == finite.nunique():
            continue
        digits = next((d for d in range(4, 10)
                       if len({f"{v:.{d}g}" for v in finite}) == finite.nunique()), 9)
        for c, v in finite.items():
            shown.at[key, c] = f"{v:.{digits}g}"
    return shown


def run_sections(runs: dict) -> list:
    """The report sections (`sections.Section`) of the modes among `runs`, in the registry's
    order."""
    from sdcstudy.report import tables as T

    present = {T.run_mode(run) for run in runs.values()}
    return [s for mode, s in modes.report_sections().items() if mode in present]


def report_tables(runs: dict, sections: list | None = None) -> dict:
    """{csv file name: (title, DataFrame, index names, fold published)} for the runs: the
    report's own tables, then those of the runs' report `sections` (default: looked up)."""
    from sdcstudy.report import tables as T

    sections = run_sections(runs) if sections is None else sections

    layer = lambda d, s: T.layer_table(runs, d, s)  # noqa: E731
    return {
        "runs.csv": ("Runs", T.runs_table(runs), ["node"], False),
        "table1_frequency.csv": (
            "Table 1: average mismatch frequency over microsteps, eqs. (1)-(2)",
            T.frequency_table(runs), ["node"], True),
        "table2_max_severity.csv": (
            "Table 2: maximum mismatch severity over microsteps, eqs. (3)-(4)",
            T.severity_table(runs), ["node"], True),
        "table6_layer_frequency_fwd.csv": (
            "Table 6: forward mismatch frequency per decoder layer, averaged over microsteps",
            layer("fwd", "freq"), ["layer", "site"], False),
        "table7_layer_frequency_bwd.csv": (
            "Table 7: backward mismatch frequency per decoder layer, averaged over microsteps",
            layer("bwd", "freq"), ["layer", "site"], False),
        "table8_layer_severity_fwd.csv": (
            "Table 8: forward mismatch severity per decoder layer, maximised over microsteps",
            layer("fwd", "severity"), ["layer", "site"], False),
        "table9_layer_severity_bwd.csv": (
            "Table 9: backward mismatch severity per decoder layer, maximised over microsteps",
            layer("bwd", "severity"), ["layer", "site"], False),
        "bit_fields.csv": ("Differing bits of the mismatching elements per field: sign / "
                           "exponent / mantissa (an element counts once per differing bit, "
                           "so a field may count more than the mismatches)",
                           T.bit_field_table(runs), ["node"], False),
        "bit_positions.csv": ("Differing bits per bit position (highest first) of the "
                              "mismatching elements", T.bit_position_table(runs),
                              ["node", "site"], False),
        "wcnts.csv": ("WCNTS (Figure 5): worst-case noise-to-signal ratio of the weight "
                      "gradients, eq. (5)", T.wcnts_table(runs), ["node"], True),
        "abft_runs.csv": ("ABFT: checksummed matmuls per run, the threshold rule of their "
                          "flags (paper: eq. (6); rounding: our bound), and recall and "
                          "precision against the injected faults (experiment.mode abft)",
                          T.abft_runs_table(runs), ["node"], False),
        "abft_flag_rate.csv": ("ABFT flag rate: the fraction of checksum tests that flagged "
                               "under each run's threshold rule, per matmul and direction",
                               T.abft_rate_table(runs), ["matmul", "direction"], False),
        **{name: table for s in sections for name, table in s.tables(runs).items()},
    }


def write_report(run_dirs, out=None) -> dict:
    """Tables (Markdown in report.md, and CSV) and PNG figures for the run folders `run_dirs`
    (a folder of run folders, as a sweep or the demo leaves, counts as its run folders),
    written into `out` (default runs/report-TIME). A file that is missing or damaged leaves
    out what needs it (`NEEDED_BY`) and is named in "problems" and in report.md. Returns
    {"out", "files", "markdown", "summary", "problems"}: "summary" the Markdown of the runs,
    Table 1, Table 2, WCNTS and the ABFT runs table, "problems" a sentence per unreadable file."""
    paths = [run for p in run_dirs for run in expand_run_dirs(p)]
    if not paths:
        raise UserError("sdcstudy report needs at least one run folder.")
    seen = set()
    for p in paths:
        if p.resolve() in seen:
            raise UserError(f"run folder {str(p)!r} is given twice.")
        seen.add(p.resolve())
    runs, problems = load_runs(paths)
    made = out is None or not Path(out).exists()
    out, staging = _out_dir(out)
    try:
        drawing = draw_figures(runs, staging)  # in worker processes while tables are written
        try:
            result = _write_files(runs, problems, staging, drawing)
        except BaseException as e:
            drawing(cancel=True)  # a file that could not be written: no figure workers left
            if isinstance(e, errors.ReportWriteError):  # name the file in --out
                raise errors.ReportWriteError(str(e).replace(str(staging), str(out))) from e
            raise
        _commit(staging, out, result["files"][1:], result["markdown"])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty: a folder made here that got nothing
    return {**result, "out": out}


def _commit(staging: Path, out: Path, files: list[str], markdown: str) -> None:
    """Move `files` from `staging` into `out`, write report.md, and remove what an earlier
    report wrote and this one did not; SIGINT and SIGTERM wait for it (milliseconds)."""
    from sdcstudy.report import plots

    section_files = [name for s in modes.report_sections().values() for name in s.files]
    stale = [n for n in (*CSV_FILES, *plots.FIGURES, *section_files) if n not in files]
    with interrupts.held_back():
        for name in files:
            with reports.writing(out / name):
                os.replace(staging / name, out / name)
        _write(out / REPORT, markdown)
        for name in stale:  # from an earlier report into the same folder
            with reports.writing(out / name):
                (out / name).unlink(missing_ok=True)


def _write_files(runs: dict, problems: list[str], out: Path, drawing) -> dict:
    """write_report's tables and the figures `drawing` waits for, into `out`; report.md's text."""
    from sdcstudy.report import tables as T

    mode_sections = run_sections(runs)

    produced, sections, summary = [], [], []
    for name, (title, table, index, fold) in report_tables(runs, mode_sections).items():
        if table.empty:
            continue
        shown = table.loc[:, (table.fillna(0) != 0).any()] if name in SPARSE_TABLES else table
        if name == "runs.csv":
            shown = distinguished(shown, LOSSES)
        text = T.markdown(shown, index, with_published=fold)
        if shown.shape[1] == 0:  # a sparse table with nothing non-zero
            text = "No mismatching element differs in any bit position."
        published = [c for c in table.columns if str(c).endswith(T.PUBLISHED_SUFFIX)]
        note = PUBLISHED_NOTE if fold and table[published].notna().any().any() else ""
        if 0 < shown.shape[1] < table.shape[1]:
            note += " Bit positions without a differing bit are left out here; the CSV has all."
        if name == "runs.csv":
            note += partial_note(runs)
        section = f"## {title}\n\n{text}\n\n[{name}]({name}){note}\n"
        sections.append(section)
        if name in SUMMARY_TABLES:
            summary.append(section)
        _write(out / name, T.csv(table, index))
        produced.append(name)
    for section in mode_sections:  # tables that format themselves (fine-tuning's Table 3)
        texts, files = section.text(runs)
        for name, text in files.items():
            _write(out / name, text)
            produced.append(name)
        sections += texts
    if not T.lockstep_runs(runs):
        sections.append("Tables 1, 2 and 6-9 and Figures 3-4 need lock-step runs "
                        "(mismatch.parquet); none was given or readable.\n")
    figures = []
    titles = dict(FIGURE_TITLES)
    drawn = drawing()
    for section in mode_sections:
        titles.update(section.titles)
        drawn += section.figures(runs, out)
    for name in drawn:
        figures.append(f"## {titles.get(name, name)}\n\n![{name}]({name})\n")
        produced.append(name)
    left_out = ["## Files that could not be read\n\n" + "".join(f"- {p}\n" for p in problems)
                ] if problems else []
    markdown = "\n".join(["# sdcstudy report\n\nRun folders: " + ", ".join(
        f"`{r.path}`" for r in runs.values()) + "\n", *left_out, *sections, *figures]) + "\n"
    return {"out": out, "files": [REPORT, *produced], "markdown": markdown,
            "summary": "\n".join(summary), "problems": problems}


_DRAWING: dict = {}  # what forked figure workers draw from: {"runs": ..., "out": ...}


def _draw(name: str) -> bool:
    from sdcstudy.report import plots

    return plots.FIGURES[name](_DRAWING["runs"], _DRAWING["out"] / name) is not None


def draw_figures(runs: dict, out: Path):
    """Starts drawing every figure of `plots.FIGURES` that the runs have data for into `out`;
    returns a function that waits for them and returns their names (or, given cancel=True,
    stops them). Each figure is seconds of single-threaded matplotlib, so with more than one
    CPU they are drawn in forked worker
    processes (which inherit `runs` without a copy) while the caller writes the tables -
    unless JAX is loaded (a sweep's own report): forking XLA's threads is not safe."""
    import multiprocessing

    from sdcstudy.report import plots

    names = list(plots.FIGURES)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    fork = "fork" in multiprocessing.get_all_start_methods() and "jax" not in sys.modules
    _DRAWING.update(runs=runs, out=out)
    if not (cpus > 1 and len(names) > 1 and fork):
        def draw_here(cancel: bool = False) -> list[str]:
            try:
                return [] if cancel else [name for name in names if _draw(name)]
            finally:
                _DRAWING.clear()
        return draw_here

    plots.pyplot()  # imported once, before the fork
    pool = multiprocessing.get_context("fork").Pool(min(cpus, len(names)),
                                                    initializer=_worker_signals)
    pending = pool.map_async(_draw, names, chunksize=1)
    _DRAWING.clear()  # the workers have their copies

    def wait(cancel: bool = False) -> list[str]:
        try:
            drawn = [] if cancel else pending.get()
        finally:
            pool.terminate()
            pool.join()
        return [name for name, made in zip(names, drawn) if made]
    return wait


def _worker_signals() -> None:
    """A drawing worker ends quietly: SIGTERM (the pool's `terminate`) with the default action,
    not the CLI's handler it was forked with (which raised and printed a traceback), and
    Ctrl-C left to the parent, which stops the pool."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def load_runs(paths) -> tuple[dict, list[str]]:
    """({label: Run}, problems) for the run folders `paths`: a run whose config.yaml is damaged
    or which has nothing readable beyond it is left out; each unreadable file is named in one
    sentence that says what the report leaves out. Nothing readable at all is a UserError."""
    loaded, problems = [], []
    for path in paths:
        try:
            loaded.append(load_run(path, strict=False))
        except DamagedFile as e:
            problems.append(f"{str(e)[:-1]}; the report leaves run {str(path)!r} out.")
    usable = [run for run in loaded if run.usable]
    if not usable:
        named = problems or [p for run in loaded for p in run.problems.values()]
        raise UserError("nothing to report: no run folder has a readable metrics.jsonl, "
                        "summary.json or table" + (f" ({named[0][:-1]})." if named else "."))
    for run in loaded:
        if not run.usable:
            problems += run.problems.values()
            problems.append(f"{str(run.path)!r} has no readable metrics.jsonl, summary.json "
                            f"or table; the report leaves that run out.")
    runs = label_runs(usable)
    for label, run in runs.items():
        for name, sentence in run.problems.items():
            problems.append(f"{sentence[:-1]}; the report leaves {label} out of "
                            f"{NEEDED_BY.get(name, 'what needs it')}.")
    return runs, problems


def main(run_dirs, out=None, echo=print, warn=None) -> int:
    """`sdcstudy report RUN_DIR [RUN_DIR ...] [--out DIR]`: exit 0, or 2 when a file could not
    be read and the report left out what needs it (each named on stderr)."""
    warn = warn or (lambda line: print(line, file=sys.stderr))
    result = write_report(run_dirs, out)
    echo(result["summary"])
    echo(f"report: {result['out'] / REPORT} ({len(result['files'])} files)")
    for problem in result["problems"]:
        warn(f"sdcstudy: {problem}")
    return errors.EXIT_BAD_INPUT if result["problems"] else errors.EXIT_PASS
