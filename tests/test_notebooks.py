"""The notebooks run from top to bottom on run folders and show what the report computes."""

import base64
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from report_runs import random_node

from sdcstudy.report import runs as report
from sdcstudy.report import tables as T

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NODES = (1, 7, 13)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for node in NODES:
        dirs += [str(d) for d in random_node(root, node, steps=12, layers=2).values()]
    return dirs


def _execute(name, run_dirs, monkeypatch, tmp_path):
    """Execute notebooks/`name` with SDCSTUDY_RUNS set; returns its outputs' text and the
    number of images it showed, each of them also kept in SDCSTUDY_FIGURES. A cell that
    raises fails the test."""
    monkeypatch.setenv("SDCSTUDY_RUNS", os.pathsep.join(run_dirs))
    figures = tmp_path / "figures"
    monkeypatch.setenv("SDCSTUDY_FIGURES", str(figures))
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), \
        f"{name} is stored with outputs; clear them before committing."
    NotebookClient(book, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text, shown = [], []
    for cell in book.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            shown += [data["image/png"].replace("\n", "")] if "image/png" in data else []
            text += [output.get("text", ""), data.get("text/markdown", ""),
                     data.get("text/html", ""), data.get("text/plain", "")]
    # Every figure kept in SDCSTUDY_FIGURES is one the notebook showed, byte for byte (the
    # heatmap is drawn inline, so not every image shown is a file).
    saved = list(figures.glob("*.png"))
    assert saved and all(base64.b64encode(path.read_bytes()).decode() in shown
                         for path in saved)
    return "\n".join(text), len(shown)


def test_mismatch_tables_notebook(run_dirs, monkeypatch, tmp_path):
    text, images = _execute("mismatch_tables.ipynb", run_dirs, monkeypatch, tmp_path)
    runs = T.lockstep_runs(report.label_runs([report.load_run(d) for d in run_dirs]))
    # The notebook's Table 1 is the report's, row for row.
    table1 = T.markdown(T.frequency_table(runs), ["node"], with_published=True)
    assert table1 in text
    assert "Table 9: backward severity" in text
    bits = T.bit_position_table(runs)
    assert T.markdown(bits.loc[:, (bits != 0).any()], ["node", "site"]) in text
    assert T.markdown(T.abft_rate_table(runs), ["matmul", "direction"]) in text
    assert images == 5  # the heatmap, Figures 3 and 4, bit positions, Figure 10
    assert {p.name for p in (tmp_path / "figures").glob("*.png")} == {  # all but the heatmap
        "fig3_mismatch_frequency.png", "fig4_mismatch_frequency_smoothed.png",
        "bit_positions.png", "fig10_abft_flag_frequency.png"}


def test_training_dynamics_notebook(run_dirs, monkeypatch, tmp_path):
    text, images = _execute("training_dynamics.ipynb", run_dirs, monkeypatch, tmp_path)
    runs = report.label_runs([report.load_run(d) for d in run_dirs])
    assert T.markdown(T.wcnts_table(runs), ["node"], with_published=True) in text
    assert "first step apart" in text and "Node 13 (free)" in text
    assert images == 2  # Figures 5 and 6


def _paft_run(folder: Path, sigma2: float, sync_every: int, steps: int = 30) -> str:
    """A small PAFT run folder written directly (no training): divergence that grows between
    averages and is 0 at them, a loss that falls less with more divergence."""
    import json

    import yaml

    from sdcstudy.core import config as C

    cfg = C.to_dict(C.from_dict({}, ["experiment.mode=paft", "mesh.dp=4",
                                     f"paft.noise.sigma2={sigma2}",
                                     f"paft.sync_every={sync_every}"]))
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for step in range(1, steps + 1):
        since = step % sync_every if sync_every else step
        div = since * sigma2 * 100.0
        rows.append({"step": step, "loss/mean": 5.0 / step ** 0.3 + div, "div/mean_sq": div,
                     "paft/sync": float(sync_every > 0 and since == 0),
                     "paft/H": float(sync_every), "bytes/sync": 1000 * (since == 0)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"mode": "paft", "n_params": 100}))
    return str(folder)


def test_paft_notebook(monkeypatch, tmp_path):
    from sdcstudy.paft import report as paft_report

    dirs = [_paft_run(tmp_path / "runs" / name, s, h)
            for name, s, h in (("oracle", 0.0, 0), ("noised", 1e-3, 0), ("sync4", 1e-3, 4))]
    text, images = _execute("paft.ipynb", dirs, monkeypatch, tmp_path)
    runs = paft_report.paft_runs(report.label_runs([report.load_run(d) for d in dirs]))
    table = paft_report.markdown(paft_report.final_table(runs))
    assert table.strip() in text
    assert "PAFT-Sync(H=4)" in table and "Oracle" in table
    assert images == 2  # loss and divergence curves


def test_what_the_notebooks_import_is_declared_in_the_notebooks_extra():
    # A user who installs `sdcstudy[notebooks]` can run every notebook: each module a notebook
    # imports comes with the package's dependencies or that extra, pandas' Styler (`.style`)
    # brings its jinja2, and the test extra pulls the extra in, so CI runs them as users do.
    # (jinja2 once came only with torch, through the test extra: a user without torch got an
    # ImportError from mismatch_tables.ipynb.)
    import ast
    import importlib.metadata as md
    import re
    import sys
    import tomllib

    project = tomllib.loads((NOTEBOOKS.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    name = lambda requirement: re.split(r"[\[<>=!~ ;]", requirement, 1)[0].lower()  # noqa: E731
    declared = {name(r) for r in project["dependencies"] + extras["notebooks"]}
    assert "sdcstudy[notebooks]" in extras["test"]
    assert {"jinja2", "ipykernel", "nbclient", "nbformat"} <= declared
    distributions = md.packages_distributions()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        book = nbformat.read(path, as_version=4)
        source = "\n".join(cell.source for cell in book.cells if cell.cell_type == "code")
        if ".style" in source:
            assert "jinja2" in declared, f"{path.name} uses pandas' Styler, which needs jinja2"
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            for module in (n.split(".")[0] for n in names):
                if module in sys.stdlib_module_names or module == "sdcstudy":
                    continue
                owners = {d.lower() for d in distributions.get(module, [module])}
                assert owners & declared, f"{path.name} imports {module}, which no declared " \
                                          f"dependency provides ({sorted(owners)})"
