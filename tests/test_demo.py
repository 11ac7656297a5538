"""The demo end to end, apart from tests/test_paired.py so that pytest-xdist's loadscope can
give its long run (a lock-step and a parameter-sync pair of the demo model) to another worker."""

from pathlib import Path

import pytest

from sdcstudy import demo
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.paired.lockstep import SITE_NAMES


def test_demo_config_file_is_what_the_demo_runs():
    path = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    assert C.to_dict(C.load(path)) == C.to_dict(C.from_dict(demo.DEMO))


# A light profile for the end-to-end test: one forward and one backward site, no weight-gradient
# faults. The demo's own paper-node-1 corrupts every gradient leaf too, which takes XLA some 40
# seconds a program to compile on two cores; the demo's code does not depend on the profile.
# At 2e-4 each site's fault record (64 rows a layer and microstep) holds every hit.
LIGHT = """name: light
specs:
  - {site: fwd/attn, kind: additive, rate: 2.0e-4}
  - {site: bwd/ffn, kind: additive, rate: 2.0e-4}
"""


@pytest.mark.slow
def test_demo_leaves_both_run_folders_and_prints_the_table(tmp_path, capsys):
    profile = tmp_path / "light.yaml"
    profile.write_text(LIGHT)
    result = demo.main(tmp_path / "demo", steps=3, progress=False, profile=str(profile))
    printed = capsys.readouterr().out
    for site in SITE_NAMES:
        assert f"| {site} |" in printed
    assert "WCNTS" in printed
    lock, sync = (tmp_path / "demo" / name for name in ("lockstep", "paramsync"))
    assert (lock / "mismatch.png").stat().st_size > 0 and (lock / RF.MISMATCH).exists()
    assert RF.json_load(sync / RF.SUMMARY)["wcnts"] == result["paramsync"]["wcnts"]
    # the suspect did corrupt something at the compared sites, and lock-step found exactly that
    # much, at those two sites only
    mismatches = result["lockstep"]["mismatches"]
    assert 0 < result["faults_at_sites"] == sum(mismatches.values())
    assert result["lockstep"]["faults/landed"] == result["faults_at_sites"]
    assert {site for site, n in mismatches.items() if n} == {"fwd/attn", "bwd/ffn"}
    # README's tour shows what `sdcstudy demo` prints, written there by `make tour`
    # (sdcstudy/dev/tour.py). This shorter run with a light profile prints the same words and
    # columns: with the numbers, the profile and the run folder masked, the two must agree. A
    # change to what the demo prints fails here until `make tour` rewrites README's block; a
    # change that moves only the numbers shows in `python -m sdcstudy.dev.tour --check`.
    from sdcstudy.dev import tour

    assert tour.PROFILE == demo.PROFILE
    shown = tour.shown_output(tour.README.read_text())
    assert (tour.skeleton(printed, str(profile), str(tmp_path / "demo"))
            == tour.skeleton(shown, tour.PROFILE, tour.SHOWN_OUT))
