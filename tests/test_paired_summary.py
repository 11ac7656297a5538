"""summary.json of a paired run, from metrics rows alone (no JAX, no run): what it says when
the suspect's gradient is not finite, and that each field it writes is documented."""

import math

from sdcstudy import modes
from sdcstudy.core import metrics as MX
from sdcstudy.paired.summary import nonfinite_nts_steps, paired_summary


def _row(step, nts, loss_suspect=5.0):
    """A metrics.jsonl row as the run folder holds it: JSON writes NaN and Inf as strings."""
    return {"step": step, "grad/nts": nts, "grad/diff_l2": nts, "grad/norm": 1.0,
            "loss/healthy": 5.0, "loss/suspect": loss_suspect, "param/diff_l2": 0.0}


def test_a_nan_suspect_gradient_is_not_hidden_behind_a_zero_wcnts():
    # A free run whose suspect went NaN at step 2 (a NaN in its attention output) wrote
    # "wcnts": 0.0 and nothing else about its gradients: WCNTS leaves non-finite steps out, so
    # the worst step of the run vanished from the summary.
    rows = [_row(1, 0.0), _row(2, "nan", "nan"), _row(3, "nan", "nan"), _row(4, "inf")]
    summary = paired_summary(rows, {}, {}, "float32")
    assert summary["wcnts"] == MX.wcnts(rows) == 0.0  # eq. (5) over the finite steps
    assert summary["grad/nonfinite_steps"] == 3
    assert summary["grad/first_nonfinite_step"] == 2
    assert nonfinite_nts_steps(rows) == [2, 3, 4]


def test_a_paramsync_nan_step_among_finite_ones_is_counted_once():
    # Under parameter synchronization the suspect recovers after the step: one NaN step among
    # finite ones, which the WCNTS of the finite steps must not hide.
    rows = [_row(1, 0.01), _row(2, float("nan")), _row(3, 0.03), _row(4, 0.02)]
    summary = paired_summary(rows, {}, {}, "float32")
    assert summary["wcnts"] == 0.03
    assert (summary["grad/nonfinite_steps"], summary["grad/first_nonfinite_step"]) == (1, 2)


def test_finite_gradients_report_no_nonfinite_step():
    rows = [_row(1, 0.0), _row(2, 0.5)]
    summary = paired_summary(rows, {}, {}, "float32")
    assert summary["grad/nonfinite_steps"] == 0 and summary["grad/first_nonfinite_step"] is None
    assert not math.isnan(summary["wcnts"]) and summary["wcnts"] == 0.5
    # rows without the metric (another mode's rows) are not counted as non-finite
    assert nonfinite_nts_steps([{"step": 1, "loss/healthy": 1.0}]) == []


def test_every_summary_field_is_documented_for_each_paired_mode():
    # docs/config.md is generated from the modes' `summary` dicts; a field written but not
    # listed there is a number nobody can read.
    rows = [_row(1, 0.0)]
    written = set(paired_summary(rows, {}, {}, "float32"))
    for mode in ("lockstep", "paramsync", "free"):
        documented = set(modes.get(mode).summary)
        assert written <= documented, (mode, written - documented)
