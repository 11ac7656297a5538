"""What a mode adds to `sdcstudy report`: its report section, a plug-in. Imports no JAX.

The report's own tables and figures (the runs table, Tables 1-2 and 6-9, the bit tables,
WCNTS, ABFT, Figures 3-6 and 10) cover the paired, train and ABFT modes' run folders
(`tables.py`, `plots.py`). A mode whose runs hold more (PAFT's divergence, the detector
benchmark, fine-tuning's Table 3) contributes a `Section`, which its feature package defines
and the mode registry names, "module:attribute", in `sdcstudy.modes.REPORT_SECTIONS`.
`report/writer.py` loads the registered sections when it writes a report, so the imports
point from the feature to the report: `report/` imports no feature package
(tests/test_architecture.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def no_tables(runs: dict) -> dict:
    del runs
    return {}


def no_text(runs: dict) -> tuple[list[str], dict]:
    del runs
    return [], {}


def no_figures(runs: dict, out: Path) -> list[str]:
    del runs, out
    return []


@dataclass(frozen=True)
class Section:
    """One mode's part of the report. Each function gets every run of the report ({label:
    report.Run}), keeps its mode's own and returns nothing when there are none:

    - `tables(runs)`: {csv name: (title, DataFrame, index names, fold published)}, written as
      the report's own tables are (a Markdown section in report.md, and the CSV);
    - `text(runs)`: (Markdown sections, {csv name: CSV text}), for tables that format
      themselves; they follow every table of the report;
    - `figures(runs, out)`: draws the section's figures into the folder `out` and returns the
      names of those it drew; they follow the report's own figures;
    - `titles`: figure name -> its heading in report.md (the name itself when missing);
    - `files`: every file the section may write, so that a later report into the same folder
      removes those it did not write again.
    """

    tables: Callable[[dict], dict] = no_tables
    text: Callable[[dict], tuple[list[str], dict]] = no_text
    figures: Callable[[dict, Path], list[str]] = no_figures
    titles: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
