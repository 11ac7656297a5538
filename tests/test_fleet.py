"""`sdcstudy fleet simulate`: the SDC cost model at fleet scale (docs/fleet.md).

The analytic expectation and the Monte Carlo simulation are two implementations of one model,
so they must agree; the limits the model must reach (no SDC, more SDC, more nodes) are checked
against formulas written out here; bad input ends in one sentence and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from sdcstudy.core.errors import UserError
from sdcstudy.fleet import cli
from sdcstudy.fleet import config as FC
from sdcstudy.fleet.model import HOUR, Job, expect
from sdcstudy.fleet.montecarlo import simulate
from sdcstudy.fleet.strategies import parse, strategies

ROOT = Path(__file__).resolve().parents[1]

# Many events per job (about 35 transient, 3 persistent) on a short job, so that rollbacks,
# restarts, golden catches and the renewal of rework all carry weight in the comparison.
BUSY = ["fleet.nodes=200", "job.hours=50", "job.checkpoint_every=50",
        "sdc.transient_per_node_hour=3e-3", "sdc.persistent_per_node_hour=3e-4",
        "golden.interval_hours=1"]
AGREEMENT = 0.02  # relative; 40,000 trials put the MC's standard error at 0.4% or less
TRIALS = 40_000


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, error sentence) as `sdcstudy` would give them: the top-level CLI
    prints a UserError as one sentence and exits 2."""
    parser = argparse.ArgumentParser(prog="sdcstudy")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = cli.main(args)
    except UserError as e:
        return 2, out.getvalue(), str(e)
    return code, out.getvalue(), ""


def one_sentence(text: str) -> bool:
    return ("\n" not in text and text.endswith(".")
            and len(re.findall(r"[.!?](?=\s|$)", text)) == 1)


def test_configs_fleet_yaml_holds_the_code_defaults():
    # docs/fleet.md cites configs/fleet.yaml; if the code's defaults drifted from it, the
    # command would run numbers the docs do not justify.
    assert yaml.safe_load((ROOT / "configs" / "fleet.yaml").read_text()) == FC.DEFAULTS


def test_default_rates_and_step_time_are_the_llama3_arithmetic():
    # Golden numbers from Dubey et al. 2024 (docs/fleet.md shows the arithmetic): 6 SDC
    # interruptions over 54 days on 16,384 GPUs in 8-GPU servers; 400 TFLOP/s per GPU at 16M
    # tokens a step. Update only together with the derivation in the docs.
    cfg = FC.load()
    total = cfg["sdc.transient_per_node_hour"] + cfg["sdc.persistent_per_node_hour"]
    assert total == pytest.approx(6 / (16_384 / 8 * 54 * 24), rel=1e-4)
    assert cfg["job.step_seconds"] == pytest.approx(
        6 * 405e9 * 8192 * 16 * 128 / (16_384 * 400e12), abs=0.005)
    assert cfg["job.hours"] == 54 * 24 and cfg["fleet.nodes"] == 16_384 // 8


@pytest.mark.parametrize("rollback", ["clean", "latest"])
def test_analytic_and_monte_carlo_agree(rollback):
    # Two independent computations of one model: sums over survival functions and a renewal
    # factor, against events drawn one by one. A wrong sum, a missed term or a bad draw shows
    # up as a gap far beyond the sampling error.
    cfg = FC.load(None, BUSY + [f"job.rollback={rollback}"])
    job = Job.from_config(cfg)
    for strategy in strategies(cfg):
        analytic = expect(job, strategy)
        mc = simulate(job, strategy, TRIALS, seed=1)
        events = sum(analytic["events"].values())
        assert events > 30, "the comparison needs events to compare"
        for key in ("goodput", "corrupted_steps", "rollback_steps", "restarts"):
            want, got = analytic[key], mc[f"{key}_mc"]
            if want == 0:
                assert got == 0, (strategy.name, key)
            else:
                assert abs(got - want) <= AGREEMENT * want, (strategy.name, key, want, got)


@pytest.mark.parametrize("golden", [True, False])
def test_without_sdc_goodput_is_one_minus_overhead_checkpoint_and_check_shares(golden):
    # With no SDC, a step's wall time is tau (1 + o) + c / C (+ golden checks: d every P
    # hours of computation), and goodput is 1 minus the shares of overhead, checkpoints and
    # checks in it; nothing is corrupted or redone.
    cfg = FC.load(None, ["sdc.transient_per_node_hour=0", "sdc.persistent_per_node_hour=0",
                         "job.hours=100", f"golden.enabled={str(golden).lower()}"])
    tau = cfg["job.step_seconds"] / HOUR
    c = cfg["job.checkpoint_seconds"] / HOUR / cfg["job.checkpoint_every"]
    for strategy in strategies(cfg):
        o = strategy.overhead
        checks = tau * (1 + o) * cfg["golden.duration_hours"] / cfg["golden.interval_hours"] \
            if golden else 0.0
        step = tau * (1 + o) + c + checks
        want = 1 - (tau * o) / step - c / step - checks / step
        job = Job.from_config(cfg)
        got = expect(job, strategy)
        assert got["goodput"] == pytest.approx(want, rel=1e-12), strategy.name
        assert got["corrupted_steps"] == 0 and got["rollback_steps"] == 0
        assert simulate(job, strategy, 50, seed=0)["goodput_mc"] == pytest.approx(want, rel=1e-12)


def test_goodput_falls_as_the_sdc_rate_rises():
    # Every strategy pays for detected SDC (a recomputed step, a rollback, a restart); even
    # `none` does, through the golden checks. More SDC must never cost less.
    base = ["job.hours=200"]
    for name in FC.DEFAULTS["strategies"]:
        goodputs = []
        for rate in (0.0, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4):
            cfg = FC.load(None, base + [f"sdc.transient_per_node_hour={rate!r}",
                                        f"sdc.persistent_per_node_hour={rate!r}"])
            goodputs.append(expect(Job.from_config(cfg), parse(name, cfg))["goodput"])
        assert goodputs[3] > 0, "the Llama 3 rate (about 1e-6) must leave a job that ends"
        assert all(a > b or a == b == 0 for a, b in zip(goodputs, goodputs[1:])), \
            (name, goodputs)  # 0: rework outgrows progress, the job never ends


def test_goodput_falls_as_the_fleet_grows():
    # More nodes, more events per step, same useful work per step. The exception is the
    # shadow, whose spare costs 1 / nodes of the fleet: it gets cheaper first (docs/fleet.md).
    sizes = (1, 10, 100, 1_000, 10_000, 100_000)
    cfg = FC.load(None, ["job.hours=200"])
    for name in FC.DEFAULTS["strategies"]:
        goodputs = [expect(Job.from_config(cfg, n), parse(name, cfg, n))["goodput"]
                    for n in sizes]
        if "shadow" in name:
            assert goodputs[0] < goodputs[2], (name, goodputs)  # the spare is 1/N
            goodputs = goodputs[3:]
        assert all(a > b or a == b == 0 for a, b in zip(goodputs, goodputs[1:])), \
            (name, goodputs)


def test_reexecution_never_flags_a_persistent_defect():
    # Recomputing on the same device repeats a repeatable error; with only persistent
    # defects and no golden checks, each defect corrupts as many steps under reexec as under
    # none (reexec doubles the node-hours, so it meets twice as many defects a job).
    cfg = FC.load(None, ["sdc.transient_per_node_hour=0", "golden.enabled=false",
                         "job.hours=200"])
    job = Job.from_config(cfg)
    none, reexec, lockstep = (expect(job, parse(n, cfg)) for n in ("none", "reexec", "lockstep"))
    per_defect = [r["corrupted_steps"] / r["events"]["persistent"] for r in (none, reexec)]
    assert per_defect[0] > 0
    assert per_defect[1] == pytest.approx(per_defect[0], rel=1e-12)
    assert reexec["recall"]["persistent"] == 0 and reexec["rollback_steps"] == 0
    assert lockstep["corrupted_steps"] == 0 and lockstep["recall"]["persistent"] == 1


def test_monte_carlo_is_seeded():
    cfg = FC.load(None, BUSY)
    job, strategy = Job.from_config(cfg), parse("monitor+abft", cfg)
    first, again = simulate(job, strategy, 500, seed=3), simulate(job, strategy, 500, seed=3)
    assert first == again
    assert simulate(job, strategy, 500, seed=4) != first


BAD = {
    "no nodes": (["--set", "fleet.nodes=0"], "fleet.nodes"),
    "too many nodes": (["--set", "fleet.nodes=100001"], "fleet.nodes"),
    "negative rate": (["--set", "sdc.persistent_per_node_hour=-1e-6"], "sdc.persistent"),
    "unknown strategy": (["--set", "strategies=none,monitr"], "monitr"),
    "unknown key": (["--set", "fleet.node=4"], "fleet.node"),
    "missing config": (["/nonexistent/fleet.yaml"], "does not exist"),
    # inf and nan passed every range check: inf gave nan goodputs (and `none` as the cheapest),
    # a job of 1e300 hours a crash (exit 3, "a bug").
    "infinite rate": (["--set", "sdc.transient_per_node_hour=inf"], "finite number"),
    "nan hours": (["--set", "job.hours=nan"], "finite number"),
    "infinite overhead": (["--set", "detectors.abft.overhead=inf"], "finite number"),
    "endless job": (["--set", "job.hours=1e300"], "at most 10,000,000"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_sentence(case):
    argv, named = BAD[case]
    code, out, error = run_cli(["fleet", "simulate", *argv, "--trials", "10"])
    assert code == 2 and out == ""
    assert one_sentence(error) and named in error, error


def test_a_bench_file_without_detect_results_is_one_sentence(tmp_path):
    train = tmp_path / "train.json"
    train.write_text(json.dumps({"suite": "train", "results": [{"preset": "tiny"}]}))
    code, _, error = run_cli(["fleet", "simulate", "--bench-detect", str(train)])
    assert code == 2 and one_sentence(error) and "no detect results" in error, error


def test_bench_detect_overheads_replace_the_defaults(tmp_path):
    # A `bench detect --json` file: each detector's median step-time ratio against none.
    ratios = {"none": 1.0, "monitor": 1.02, "abft": 1.2, "shadow": 1.4, "reexec": 1.9,
              "lockstep": 1.8}
    bench = {"suite": "detect", "results": [
        {"preset": "tiny", "n_params": 10, "ranks": 2,
         "variants": {k: {"ratio": {"median": 9.0}} for k in ratios}},
        {"preset": "small", "n_params": 1000, "ranks": 2,
         "variants": {k: {"ratio": {"median": v}} for k, v in ratios.items()}}]}
    path = tmp_path / "detect.json"
    path.write_text(json.dumps(bench))
    out = tmp_path / "fleet.json"
    code, _, error = run_cli(["fleet", "simulate", "--bench-detect", str(path), "--set",
                              "job.hours=20", "--trials", "20", "--json", str(out)])
    assert code == 0, error
    rows = {r["name"]: r for r in json.loads(out.read_text())["strategies"]}
    nodes = FC.DEFAULTS["fleet"]["nodes"]
    for name in ("monitor", "abft", "reexec", "lockstep"):  # the largest preset's ratios
        assert rows[name]["overhead"] == pytest.approx(ratios[name] - 1)
    assert rows["shadow"]["overhead"] == pytest.approx((1.4 - 1) * 2 / nodes)
    assert rows["monitor+abft"]["overhead"] == pytest.approx(0.02 + 0.2)


def test_cli_writes_json_png_and_the_cheapest_within_the_limit(tmp_path):
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    code, stdout, error = run_cli(["fleet", "simulate", str(ROOT / "configs" / "fleet.yaml"),
                                   "--set", "job.hours=100", "--trials", "200", "--seed", "7",
                                   "--max-corrupted-steps", "10", "--json", str(out),
                                   "--plot", str(png)])
    assert code == 0, error
    report = json.loads(out.read_text())
    assert report["config"]["montecarlo"] == {"trials": 200, "seed": 7}
    rows = report["strategies"]
    assert [r["name"] for r in rows] == FC.DEFAULTS["strategies"]
    for row in rows:
        assert {"name", "goodput", "corrupted_steps", "rollback_steps", "overhead", "recall",
                "latency_steps", "goodput_mc", "corrupted_steps_mc"} <= set(row)
    within = [r for r in rows if r["corrupted_steps"] <= 10]
    assert within, "lock-step checks every step before its update, so it corrupts none"
    assert report["cheapest"] == max(within, key=lambda r: r["goodput"])["name"]
    assert "| strategy |" in stdout and f"{report['cheapest']}" in stdout.splitlines()[-1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert math.isclose(rows[0]["goodput"], rows[0]["goodput_mc"], rel_tol=0.05)


def test_monte_carlo_draws_a_large_fleet_instead_of_calling_it_endless():
    # At 100,000 nodes (the largest fleet the command takes) the default job meets about 290
    # events: 20,000 trials of it were more events than one round may draw, and every
    # strategy's Monte Carlo came out as a job that never ends (goodput 0, inf) beside an
    # analytic lock-step goodput of 0.49. Drawn in batches, the two agree again.
    cfg = FC.load(None, ["fleet.nodes=100000"])
    job, strategy = Job.from_config(cfg), parse("lockstep", cfg)
    analytic, mc = expect(job, strategy), simulate(job, strategy, 20_000, seed=0)
    assert not analytic["diverges"] and mc["finished"] and mc["simulated"]
    assert abs(mc["goodput_mc"] - analytic["goodput"]) <= AGREEMENT * analytic["goodput"]
    assert abs(mc["restarts_mc"] - analytic["restarts"]) <= AGREEMENT * analytic["restarts"]


def test_a_job_of_too_many_events_to_draw_is_not_called_endless():
    # 2.7 million events a job: too many to draw, which says nothing about whether the job
    # ends (under `none` nothing is detected, so nothing is redone); the table shows "-".
    code, out, error = run_cli(["fleet", "simulate", "--set", "sdc.transient_per_node_hour=1",
                                "--set", "strategies=none", "--trials", "10"])
    assert code == 0, error
    row = next(line for line in out.splitlines() if line.startswith("| none"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[3]) > 0.5 and cells[4] == cells[6] == cells[8] == "-", row
    cfg = FC.load(None, ["sdc.transient_per_node_hour=1"])
    mc = simulate(Job.from_config(cfg), parse("none", cfg), 10, seed=0)
    assert mc["simulated"] is False and mc["goodput_mc"] is None


def test_no_cheapest_strategy_is_not_read_as_the_strategy_none():
    # Every job diverges (a rollback of 10 million steps): the last line said "none meets the
    # limit" with no limit given, which reads as the strategy `none`.
    code, out, error = run_cli(["fleet", "simulate", "--set", "job.checkpoint_every=10000000",
                                "--set", "strategies=none,monitor", "--trials", "10"])
    assert code == 0, error
    last = out.splitlines()[-1]
    assert last.startswith("cheapest strategy (highest goodput): no strategy"), last
