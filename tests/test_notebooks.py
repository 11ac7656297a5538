"""The notebooks run from top to bottom on run folders and show what the report computes."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from report_runs import paft_runs, random_node

from sdcstudy import paft_report, report
from sdcstudy import tables as T

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
    number of images it showed. A cell that raises fails the test."""
    monkeypatch.setenv("SDCSTUDY_RUNS", os.pathsep.join(run_dirs))
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), \
        f"{name} is stored with outputs; clear them before committing."
    NotebookClient(book, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text, images = [], 0
    for cell in book.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            images += "image/png" in data
            text += [output.get("text", ""), data.get("text/markdown", ""),
                     data.get("text/html", ""), data.get("text/plain", "")]
    return "\n".join(text), images


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


def test_training_dynamics_notebook(run_dirs, monkeypatch, tmp_path):
    text, images = _execute("training_dynamics.ipynb", run_dirs, monkeypatch, tmp_path)
    runs = report.label_runs([report.load_run(d) for d in run_dirs])
    assert T.markdown(T.wcnts_table(runs), ["node"], with_published=True) in text
    assert "first step apart" in text and "Node 13 (free)" in text
    assert images == 2  # Figures 5 and 6


def test_paft_notebook(tmp_path, monkeypatch):
    dirs = [str(d) for d in paft_runs(tmp_path / "runs", steps=30)]
    text, images = _execute("paft.ipynb", dirs, monkeypatch, tmp_path)
    runs = paft_report.paft_runs(report.label_runs([report.load_run(d) for d in dirs]))
    assert T.markdown(paft_report.final_table(runs), ["run"]) in text
    assert "noised: 4 workers" in text  # the run that never synchronizes diverges most
    assert images == 1
