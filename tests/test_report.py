"""`sdcstudy.load_run`: run folders as DataFrames, without importing JAX."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from sdcstudy import runfolder as RF
from sdcstudy.config import UserError


def _fake_run(path):
    path.mkdir()
    (path / RF.CONFIG).write_text("experiment:\n  mode: free\n  steps: 2\n")
    RF.write_rows(path / RF.METRICS, [{"step": 1, "loss/healthy": 2.5, "loss/suspect": 2.5},
                                      {"step": 2, "loss/healthy": 2.4, "loss/suspect": "nan"}])
    RF.atomic_write_json(path / RF.SUMMARY, {"wcnts": 0.5})
    pd.DataFrame([{c: 0 for c in RF.MISMATCH_COLUMNS} | {"site": "fwd/attn", "severity": 1.5}]
                 ).to_parquet(path / RF.MISMATCH)
    return path


def test_load_run_reads_every_file_without_jax(tmp_path):
    run_dir = _fake_run(tmp_path / "run")
    code = (f"import sys, sdcstudy; r = sdcstudy.load_run({str(run_dir)!r}); "
            "import json; print(json.dumps({'jax': 'jax' in sys.modules, "
            "'mode': r.config['experiment']['mode'], 'wcnts': r.summary['wcnts'], "
            "'suspect': [str(x) for x in r.metrics['loss/suspect']], "
            "'severity': float(r.mismatch['severity'][0]), 'faults': list(r.faults.columns), "
            "'abft': len(r.abft)}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    assert out == {"jax": False, "mode": "free", "wcnts": 0.5, "suspect": ["2.5", "nan"],
                   "severity": 1.5, "faults": list(RF.FAULT_COLUMNS), "abft": 0}


def test_load_run_metrics_are_numbers(tmp_path):
    import sdcstudy

    run = sdcstudy.load_run(_fake_run(tmp_path / "run"))
    assert run.metrics["loss/suspect"].dtype == np.float64
    assert np.isnan(run.metrics["loss/suspect"][1]) and run.name == "run"


def test_load_run_refuses_a_folder_that_is_not_a_run(tmp_path):
    import sdcstudy

    with pytest.raises(UserError, match="is not a run folder"):
        sdcstudy.load_run(tmp_path)
