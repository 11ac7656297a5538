"""`sdcstudy bench`: each suite runs end to end at a tiny size and reports what it claims.

No timing is asserted (a shared CPU makes any threshold flaky); what is asserted is what would
make the figures meaningless: a contender missing, a ratio that is not a positive number, a
"healthy" program that is not the plain one, an idle fault profile that changes the training,
a healthy pair that disagrees.
"""

import argparse
import json
import math
import mmap
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.bench import (
    common as bench, abft as bench_abft, faults as bench_faults, paft as bench_paft, paired as bench_paired, plot as bench_plot, timing as bench_timing, train as bench_train)
from sdcstudy import cli
from sdcstudy.core import determinism
from sdcstudy.detect.plan import DETECTORS

# One layer, short sequences, one repetition of one step: structure, not speed.
FAST = ["--presets", "tiny", "--batch", "4", "--seq-len", "16", "--steps", "1", "--repeats", "1",
        "--set", "model.n_layers=1"]


def _run(tmp_path, capsys, suite, *extra):
    json_path, md_path = tmp_path / f"{suite}.json", tmp_path / f"{suite}.md"
    code = cli.main(["bench", suite, *FAST, *extra, "--json", str(json_path),
                     "--markdown", str(md_path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(json_path.read_text())
    # The Markdown file is the printed table, and progress went to stderr, not into it.
    assert md_path.read_text() == out.out
    assert "repetition 1/1" in out.err and "repetition 1/1" not in out.out
    return report, out.out, out.err


def _positive(spread):
    return all(math.isfinite(x) and x > 0 for x in (spread["median"], spread["min"],
                                                    spread["max"]))


def _read_by_the_acceptance(report, contenders, plain):
    """`accept-gpu`'s overhead checks read this report (`floors.overhead_figures`, the first
    result): every contender's median ratio and step time, the plain one's ratio 1, the
    largest ratio the headline."""
    from sdcstudy.gpu import floors as GF

    figures = GF.overhead_figures(report)
    assert figures["pass"] is True and set(figures["contenders"]) == set(contenders)
    assert figures["contenders"][plain]["ratio"] == 1.0
    assert all(c["step_ms"] > 0 for c in figures["contenders"].values())
    assert figures["worst_ratio"] == max(c["ratio"] for c in figures["contenders"].values())
    for name, c in contenders.items():  # carried where the suite counts them
        assert figures["contenders"][name].get("conditionals") == c.get("conditionals"), name


def test_faults_suite(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "live_line", lambda: True)  # as on a terminal
    report, table, err = _run(tmp_path, capsys, "faults")
    # The seconds its contenders take to compile are counted on one line before the timing.
    assert "tiny: preparing and compiling: 00:" in err
    assert err.index("preparing and compiling") < err.index("repetition 1/1")
    (result,) = report["results"]
    variants = result["variants"]
    assert list(variants) == list(bench_faults.FAULT_VARIANTS)
    for name, v in variants.items():
        assert _positive(v["ratio"]) and _positive(v["tokens_per_s"]), name
        assert f"| {name} |" in table
        # The kernel's share of each contender's timed steps is recorded beside its time.
        assert v["kernel"]["minor_faults_per_step"] >= 0 <= v["kernel"]["system_s_per_step"]
        assert v["ratio"]["geomean"] > 0 and v["ratio"]["ci95"] is None  # one repetition
    assert variants["plain"]["ratio"]["median"] == 1.0
    _read_by_the_acceptance(report, variants, "plain")
    # healthy and rate-0 profiles build no injector: the compiled program must be plain's,
    # byte for byte. If not, the fault engine costs something even when it is switched off.
    for name in ("healthy", "zero-rate"):
        assert not variants[name]["injector"] and variants[name]["hlo_identical"], name
        # ... and so it is compiled once and shared, which is what makes it identical here.
        assert variants[name]["shares_program_of"] == "plain", name
    assert "shares_program_of" not in variants["idle"]
    assert result["phases"]["programs"] == 4
    # Every variant starts from one initial state, computed once and copied.
    assert result["phases"]["initializers"] == 1
    assert {"init_s", "lower_s", "compile_s", "warmup_s", "timed_s"} <= set(result["phases"])
    # The idle profile compiles the engine in (a different program) but never fires: nothing
    # lands and the losses are plain's bit for bit (corruptions select in the integer domain).
    idle = variants["idle"]
    assert idle["injector"] and not idle["program_identical"]
    assert idle["faults_landed"] == 0
    # The engine's conditionals are counted (on a GPU each reads its predicate on the host):
    # none without it, some with it.
    assert variants["plain"]["conditionals"] == 0 < idle["conditionals"]
    quiet = [n for n in variants if not n.startswith("active")]
    assert all(variants[n]["losses_equal_plain"] for n in quiet)
    # The active profiles fire: faults land and the losses leave plain's.
    for name in ("active-scale", "active"):
        v = variants[name]
        assert v["injector"] and v["faults_landed"] > 0 and not v["losses_equal_plain"], name
    # active / active-scale per repetition is the ratio of their ratios to plain.
    (a,), (s,) = variants["active"]["ratio"]["runs"], variants["active-scale"]["ratio"]["runs"]
    assert result["active_over_scale"]["runs"] == [pytest.approx(a / s)]
    # The goal rows: idle / plain and additive / scale, judged against their limits, printed.
    ratios = {"faults.idle_over_plain": idle["ratio"]["median"],
              "faults.additive_over_scale": result["active_over_scale"]["median"]}
    assert report["goals"] == [{"name": name, "preset": "tiny", "value": ratio, "limit": 1.1,
                                "bound": "upper", "met": ratio <= 1.1}
                               for name, ratio in ratios.items()]
    for name, ratio in ratios.items():
        assert f"| {name} | preset tiny | {ratio:.3f} | <= 1.1 |" in table


def test_paired_suite(tmp_path, capsys):
    # Two tp degrees timed in one rotation: one result each, ratios to free at its own degree.
    report, table, err = _run(tmp_path, capsys, "paired", "--tp", "1,2")
    assert [r["mesh"] for r in report["results"]] == [{"node": 2, "dp": 1, "tp": tp}
                                                      for tp in (1, 2)]
    for result in report["results"]:
        modes = result["modes"]
        assert list(modes) == list(bench_paired.PAIRED_MODES)
        for mode, v in modes.items():
            assert _positive(v["ratio"]) and _positive(v["tokens_per_s"]), mode
            assert v["memory"]["peak"] > 0 and v["memory_ratio"] > 0
            # A healthy pair computes the same thing on both nodes in every mode.
            assert v["pair_agrees"], mode
        assert modes["free"]["ratio"]["median"] == 1.0 and modes["free"]["memory_ratio"] == 1.0
        assert all(w["mismatches"] == 0 for w in modes["lockstep"]["warmup"])
        # Every goal of the project is judged, and the table says so.
        assert {(m, w) for m, g in result["goals"].items() for w in g} == {
            ("lockstep", "time"), ("lockstep", "memory"), ("paramsync", "time")}
        # The six programs differ (mode or mesh): none may borrow another's executable.
        assert {v["compile_s"] > 0 for v in modes.values()} == {True}
    _read_by_the_acceptance(report, report["results"][0]["modes"], "free")
    one, two = report["results"]
    # The three modes of a degree start from one initial state; the degrees shard it apart.
    assert one["phases"]["initializers"] == 2
    assert one["free_ratio_to_tp"]["median"] == 1.0 and _positive(two["free_ratio_to_tp"])
    # tp 2 halves each device's share of the weights, so its compiled memory is not tp 1's.
    assert two["modes"]["free"]["memory"]["peak"] != one["modes"]["free"]["memory"]["peak"]
    assert "lockstep/free memory" in table and "| 2 x 1 x 2 | lockstep |" in table
    # One goal row per tp degree: lock-step over free at that degree.
    assert [(g["name"], g["tp"], g["value"]) for g in report["goals"]] == [
        ("paired.lockstep_over_free", r["mesh"]["tp"], r["modes"]["lockstep"]["ratio"]["median"])
        for r in report["results"]]
    assert all(g["met"] == (g["value"] <= 1.1) for g in report["goals"])
    assert "free at tp 2 / free at tp 1" in table


def test_collectives_suite(tmp_path, capsys):
    # Free running at tp 2 (the cheapest paired program with collectives), at test_paired_suite's
    # shapes: "off" is its free@tp2 program, which the session's cache may already hold.
    from sdcstudy.bench import collectives as bench_collectives
    from sdcstudy.collectives import checksum as CS

    report, table, err = _run(tmp_path, capsys, "collectives", "--mode", "free")
    (result,) = report["results"]
    assert result["mesh"] == {"node": 2, "dp": 1, "tp": bench_collectives.DEFAULT_TP}
    assert result["mode"] == "free"
    off, on = (result["variants"][name] for name in ("off", "on"))
    assert list(result["variants"]) == ["off", "on"]
    for name, v in result["variants"].items():
        assert _positive(v["ratio"]) and _positive(v["tokens_per_s"]), name
        assert v["memory"]["peak"] > 0 and v["compile_s"] > 0, name
        assert v["pair_agrees"] and v["verdicts"] == 0, name  # a healthy pair: no verdict
        assert f"| tiny | free | 2 x 1 x 2 | {name} |" in table
    # The ratio is on's time over off's, repetition by repetition (one step each: exact).
    assert on["ratio"]["runs"] == [a / b for a, b in zip(on["seconds_per_step"]["runs"],
                                                          off["seconds_per_step"]["runs"])]
    assert off["ratio"]["runs"] == [1.0]
    assert on["memory_ratio"] == on["memory"]["peak"] / off["memory"]["peak"]
    # The feature was on: the "on" step returned a checksum at every point of its one layer,
    # forward and backward, "off" none; two programs, neither borrowing the other's.
    assert on["checksum_points"] == {"fwd": len(CS.FWD_POINTS), "bwd": len(CS.sink_keys(1))}
    assert off["checksum_points"] == {"fwd": 0, "bwd": 0}
    assert result["phases"]["programs"] == 2
    assert not any("shares_program_of" in v for v in result["variants"].values())
    # Checksums read the values and change none: the pair trains as without them.
    assert on["losses_equal_off"] and on["warmup_losses"] == off["warmup_losses"]
    assert f"the checksums cost {on['ratio']['median']:.2f}x (" in table
    assert f"| {len(CS.FWD_POINTS)} + {len(CS.sink_keys(1))} |" in table
    assert report["goals"] == []  # the project set no goal for the feature's cost
    _read_by_the_acceptance(report, result["variants"], "off")
    # `bench plot` and `--plot` draw on / off as one more overhead curve.
    assert [(p["overhead"], p["median"]) for p in bench_plot.overhead_points(report)] == [
        ("collectives: on/off (tp 2)", on["ratio"]["median"])]


@pytest.mark.parametrize("tp", ["1", "1,2"])
def test_collectives_suite_refuses_tp_1_before_compiling(tp, capsys, monkeypatch):
    from sdcstudy.paired.trainer import PairedTrainer

    def built(*args, **kwargs):
        raise AssertionError("a trainer was built for tp 1")

    monkeypatch.setattr(PairedTrainer, "from_config", built)
    monkeypatch.setattr(bench_timing, "build_runners", built)
    assert cli.main(["bench", "collectives", "--tp", tp]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tp {tp}:" in err and "tensor-parallel" in err


@pytest.mark.parametrize("text, degrees", [("1", [1]), ("1,2,4", [1, 2, 4]), (2, [2])])
def test_tp_degrees(text, degrees):
    assert bench_paired.tp_degrees(argparse.Namespace(tp=text)) == degrees


def test_detect_suite(tmp_path, capsys):
    report, table, err = _run(tmp_path, capsys, "detect")
    (result,) = report["results"]
    variants = result["variants"]
    assert list(variants) == ["none", *DETECTORS]
    for name, v in variants.items():
        assert _positive(v["ratio"]) and f"| {name} |" in table, name
        # A healthy run: no detector may raise a flag (a flag here is a false alarm).
        assert v["flags"] == 0, name
    assert variants["none"]["ratio"]["median"] == 1.0
    # The executions each detector adds on 2 ranks (detect_plan.executions): the shadow one
    # copy, re-execution and the mirror one per rank, localization two per rank.
    assert {k: v["executions"] for k, v in variants.items()} == {
        "none": 2, "monitor": 2, "abft": 2, "shadow": 3, "reexec": 4, "lockstep": 4,
        "localize": 6}
    # The monitor adds no device work: it runs none's executable (compiled once); every
    # device detector is a program of its own.
    assert variants["monitor"]["shares_program_of"] == "none"
    assert not any("shares_program_of" in v for k, v in variants.items() if k != "monitor")
    assert result["phases"]["programs"] == 6
    assert variants["localize"]["memory_ratio"] > 1.0


def test_abft_suite(tmp_path, capsys):
    report, table, err = _run(tmp_path, capsys, "abft")
    (result,) = report["results"]
    variants = result["variants"]
    assert list(variants) == list(bench_abft.ABFT_VARIANTS)
    for name, v in variants.items():
        assert _positive(v["ratio"]) and f"| {name} |" in table, name
    # Checks ran (one layer: q k v o gate up down and the head, three products each, per
    # warm-up step) and a healthy float32 step raises no flag under the paper's threshold;
    # checking reads the products and changes none of them, so the losses are the plain ones.
    assert variants["off"]["checks"] == 0
    _read_by_the_acceptance(report, variants, "off")
    for name in ("on", "recompute"):
        assert variants[name]["checks"] == 8 * 3 * bench.WARMUP_STEPS, name
        assert variants[name]["flags"] == 0 and variants[name]["losses_equal_off"], name
    # The goal the table judges is in the JSON's goals list too (it held none).
    (goal,) = report["goals"]
    assert goal["name"] == "abft.on_over_off" and goal["preset"] == "tiny"
    assert goal["value"] == variants["on"]["ratio"]["median"] and goal["limit"] == 1.10


def test_train_suite_matches_torch(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(bench, "live_line", lambda: True)
    report, table, err = _run(tmp_path, capsys, "train", "--torch-attention", "sdpa")
    assert "tiny: compiling our step: 00:" in err
    (result,) = report["results"]
    assert result["torch_baseline"] == "sdpa" and _positive(result["ratio"])
    # The comparison is only fair if torch trains the same model the same way: the warm-up
    # losses (the second follows the first update) agree to float32 rounding of a mean over
    # 64 tokens. A larger difference means different weights, loss or update.
    torch_losses = result["torch"]["sdpa"]["warmup_losses"]
    assert len(torch_losses) == bench.WARMUP_STEPS
    assert result["torch"]["sdpa"]["max_loss_diff"] < 1e-4
    assert torch_losses[-1] != torch_losses[0]
    assert "(sdpa)" in table
    # The roofline: both contenders' FLOP/s below the matmul peak measured beside them, and the
    # ceiling is that peak over torch's rate.
    roof = result["roofline"]
    peak = max(roof["peak_gflops"].values())
    assert 0 < roof["gflops"]["ours"] <= peak and 0 < roof["gflops"]["torch-sdpa"] <= peak
    assert roof["ceiling"] == pytest.approx(peak / roof["gflops"]["torch-sdpa"])
    assert "ceiling on ours / torch" in table
    # ours / torch is a goal for every preset; the peak share only for small, not tiny.
    assert report["goals"] == [{"name": "train.ours_over_torch", "preset": "tiny",
                                "value": result["ratio"]["median"], "limit": 1.0,
                                "bound": "lower", "met": result["ratio"]["median"] >= 1.0}]


def test_goals_judge_each_bound_and_print_a_table():
    from sdcstudy.bench import goals

    low = goals.goal("train.peak_share", 0.74, preset="small")
    high = goals.goal("faults.idle_over_plain", 1.1, preset="tiny")
    assert (low["met"], high["met"]) == (False, True)  # >= 0.75 missed; <= 1.10 met at 1.10
    assert goals.goal("train.ours_over_torch", None, preset="tiny")["met"] is False
    assert goals.applies("train.peak_share", "small") and not goals.applies(
        "train.peak_share", "tiny")
    table = goals.goals_table([low, high])
    assert "| train.peak_share | preset small | 0.740 | >= 0.75 | NO |" in table
    assert "| faults.idle_over_plain | preset tiny | 1.100 | <= 1.1 | yes |" in table
    assert goals.goals_table([]) == ""


def _dot_flops(jaxpr) -> int:
    """FLOPs of every dot_general in a jaxpr and the jaxprs inside it."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracted)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                total += _dot_flops(inner)
    return total


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=true", "model.n_kv_heads=4"]])
def test_step_flops_count_every_matmul_of_the_traced_step(overrides):
    from sdcstudy.core import config as C
    from sdcstudy.core import model
    from sdcstudy.bench import roofline

    dims = C.model_dims(C.from_dict({"model": {"preset": "tiny"}}, overrides).model)
    graphdef, params = model.abstract_init(dims)
    tokens = jax.ShapeDtypeStruct((3, 17), jnp.int32)
    grad = jax.grad(lambda p, t: model.token_losses(graphdef, p, t)[0])
    traced = jax.make_jaxpr(grad)(params, tokens).jaxpr
    assert roofline.step_flops(dims, 3, 16) == _dot_flops(traced)


def _scale_by(k):
    def scaled(x):
        return x * k
    return scaled


class _Toucher:
    """A stand-in runner: each step maps `size` fresh bytes and writes every page of them
    (0: does nothing)."""

    def __init__(self, size):
        self.size = size

    def run(self, steps):
        for _ in range(steps):
            if self.size:
                with mmap.mmap(-1, self.size) as m:
                    m.write(b"\x01" * self.size)


def test_interleaved_charges_page_faults_to_the_contender_that_takes_them():
    # If this fails, the kernel columns of a benchmark table blame the wrong contender (or
    # none): each runner's faults must be counted around its own timed blocks only.
    pages = 2048  # 8 MiB of fresh pages per step
    size = pages * mmap.PAGESIZE
    seconds, kernel = bench_timing.interleaved({"idle": _Toucher(0), "toucher": _Toucher(size)},
                                               steps=2, repeats=3, tokens=1, label="t",
                                               echo=lambda line: None)
    assert [len(v) for v in seconds.values()] == [3, 3]
    assert kernel["toucher"]["minor_faults_per_step"] >= 0.9 * pages
    assert kernel["idle"]["minor_faults_per_step"] < 0.1 * pages
    assert all(k["system_s_per_step"] >= 0 for k in kernel.values())


def test_geomean_ci_is_students_t_on_the_logarithms():
    # Ratios 1, 1.1, 1.21: logs 0, a, 2a with a = log 1.1; mean a, sample sd a, 2 degrees of
    # freedom (t = 4.303). If this fails, the interval printed beside a goal is not a 95% one.
    a = math.log(1.1)
    out = bench_timing.geomean_ci([1.0, 1.1, 1.21])
    assert out["geomean"] == pytest.approx(1.1, rel=1e-12)
    half = 4.302652729911275 * a / math.sqrt(3)
    assert out["ci95"] == pytest.approx([math.exp(a - half), math.exp(a + half)], rel=1e-9)
    assert bench_timing.geomean_ci([1.3]) == {"geomean": pytest.approx(1.3), "ci95": None}
    ratio = bench_timing.ratio_spread([2.0, 2.2, 2.42], [2.0, 2.0, 2.0])
    assert ratio["median"] == pytest.approx(1.1) and ratio["ci95"] == pytest.approx(out["ci95"])


def test_program_text_ignores_only_source_locations():
    # The faults suite compares programs traced from different lines; the comparison must
    # see through the lines and still see a different constant.
    x = jnp.ones(4)
    a = jax.jit(_scale_by(2.0)).lower(x).compile().as_text()
    b = jax.jit(_scale_by(2.0)).lower(x).compile().as_text()
    c = jax.jit(_scale_by(3.0)).lower(x).compile().as_text()
    assert a != b, "the premise: compiled text names the lines that traced it"
    assert determinism.program_text(a) == determinism.program_text(b)
    assert determinism.program_text(a) != determinism.program_text(c)


def test_bad_preset_is_one_sentence_and_exit_2():
    # Through the real entry point: the error comes before JAX starts, with no traceback.
    proc = subprocess.run([sys.executable, "-m", "sdcstudy", "bench", "paired", "--presets",
                           "tiny,nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("sdcstudy: error:") and "'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("suite", ["train", "faults", "paired", "abft", "detect", "paft", "all"])
def test_every_suite_help_names_the_presets_it_runs(suite, capsys):
    # A suite may run other presets by default (paft: tiny only); its --help must say which.
    used = cli.build_parser().parse_args(["bench", suite]).presets
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", suite, "--help"])
    assert f"(default {used})" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, needle", [
    (["faults", "--repeats", "0"], "--repeats"),
    (["train", "--seq-len", "-4"], "--seq-len"),
    (["paired", "--tp", "3"], "mesh.tp"),
    (["paired", "--tp", "1,x"], "--tp"),
    (["paired", "--tp", "2,2"], "--tp"),
    (["detect", "--compile-threads", "0"], "--compile-threads"),
    (["plot", "/nonexistent/bench.json", "--out", "x.png"], "does not exist"),
    (["train", "--torch-attention", "flash"], "flash"),
])
def test_bad_numbers_exit_2(argv, needle, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_all_runs_every_suite_with_its_own_defaults(tmp_path, capsys, monkeypatch):
    # The suites themselves are tested above; here: each is called once, with the shared
    # options and its own defaults, and the combined files hold every suite's output.
    seen = {}

    def fake(name):
        def run(args):
            seen[name] = args
            goals = [{"name": f"{name}.x", "preset": "tiny", "value": 2.0, "limit": 1.0,
                      "bound": "upper", "met": False}]
            bench.finish(args, name, [{"suite": name}], f"| {name} table |\n", goals=goals)
            return 0
        return run

    # Patched in the suites' own modules, where `bench all` looks them up when it runs.
    for module, name in ((bench_train, "train"), (bench_faults, "faults"),
                         (bench_paired, "paired"), (bench_abft, "abft"), (bench_paft, "paft")):
        monkeypatch.setattr(module, f"run_{name}_suite", fake(name))
    json_path, md_path = tmp_path / "all.json", tmp_path / "all.md"
    assert cli.main(["bench", "all", "--presets", "tiny", "--json", str(json_path),
                     "--markdown", str(md_path)]) == 0
    assert list(seen) == ["train", "faults", "paired", "abft", "paft"]
    assert all(a.repeats == 3 and a.presets == "tiny" for a in seen.values())
    assert seen["train"].no_torch is False and bench_paired.tp_degrees(seen["paired"]) == [1]
    assert seen["paft"].workers == "4"
    # Each suite's elapsed time, printed at the end and kept in the JSON file.
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("elapsed: train ") and "; all " in err
    report = json.loads(json_path.read_text())
    assert list(report["elapsed_s"]) == list(seen)
    assert all(s >= 0 for s in report["elapsed_s"].values())
    assert {k: v["results"] for k, v in report["suites"].items()} == {
        name: [{"suite": name}] for name in seen}
    table = md_path.read_text()
    assert all(f"## {name}" in table and f"| {name} table |" in table for name in seen)
    # Every suite's goals, gathered into one list and one table at the end.
    assert [g["name"] for g in report["goals"]] == [f"{name}.x" for name in seen]
    goals_part = table.split("## goals")[-1]
    assert all(f"| {name}.x | preset tiny | 2.000 | <= 1 | NO |" in goals_part for name in seen)


def _ratio(median, low, high):
    return {"median": median, "min": low, "max": high}


# A small hand-written `bench all` file: what the plot reads from each suite.
SMALL_REPORT = {"suite": "all", "suites": {
    "train": {"suite": "train", "results": [{"preset": "tiny", "n_params": 100,
                                             "ratio": _ratio(0.9, 0.8, 1.0)}]},
    "abft": {"suite": "abft", "results": [
        {"preset": p, "n_params": n, "variants": {"off": {"ratio": _ratio(1.0, 1.0, 1.0)},
                                                  "on": {"ratio": _ratio(r, r - 0.1, r + 0.1)}}}
        for p, n, r in (("tiny", 100, 1.2), ("small", 1000, 1.05))]},
    "paired": {"suite": "paired", "results": [
        {"preset": "tiny", "n_params": 100, "mesh": {"node": 2, "dp": 1, "tp": tp},
         "modes": {"free": {"ratio": _ratio(1.0, 1.0, 1.0)},
                   "lockstep": {"ratio": _ratio(1.1 * tp, 1.0, 1.3 * tp)}},
         "free_ratio_to_tp": {"tp": 1, **_ratio(0.5 * tp, 0.4, tp)}} for tp in (1, 2)]},
    "paft": {"suite": "paft", "results": [
        {"preset": "tiny", "by_workers": [
            {"preset": "tiny", "n_params": 100, "workers": 4,
             "variants": {"dp": {"ratio": _ratio(1.0, 1.0, 1.0)},
                          "dyn-overlap": {"ratio": _ratio(1.5, 1.4, 1.6),
                                          "ratio_to_noised": _ratio(1.03, 0.98, 1.07)}}}]}]}}}


def test_overhead_points_read_every_suite():
    rows = {(r["overhead"], r["preset"]): (r["n_params"], r["median"], r["min"], r["max"])
            for r in bench_plot.overhead_points(SMALL_REPORT)}
    # The plain steps (ratio 1 by construction) and the train speed-up are not overheads.
    assert rows == {
        ("abft: on/off", "tiny"): (100, 1.2, 1.2 - 0.1, 1.2 + 0.1),
        ("abft: on/off", "small"): (1000, 1.05, 1.05 - 0.1, 1.05 + 0.1),
        ("paired: lockstep/free", "tiny"): (100, 1.1, 1.0, 1.3),
        ("paired: lockstep/free (tp 2)", "tiny"): (100, 2.2, 1.0, 2.6),
        ("paired: free tp 2/tp 1", "tiny"): (100, 1.0, 0.4, 2),
        ("paft: dyn-overlap/dp (M=4)", "tiny"): (100, 1.5, 1.4, 1.6),
        ("paft: dyn-overlap/noised (M=4)", "tiny"): (100, 1.03, 0.98, 1.07)}


def test_plot_command_writes_the_figure(tmp_path, capsys):
    one = tmp_path / "all.json"
    one.write_text(json.dumps(SMALL_REPORT))
    out = tmp_path / "overhead.png"
    assert cli.main(["bench", "plot", str(one), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A file with only the train suite has no overhead to draw: one sentence, exit 2.
    train_only = tmp_path / "train.json"
    train_only.write_text(json.dumps(SMALL_REPORT["suites"]["train"]))
    capsys.readouterr()
    assert cli.main(["bench", "plot", str(train_only), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "no overhead ratio" in err and err.count("\n") == 1
    assert not (tmp_path / "t.png").exists()


def _scaling_module():
    return _experiment("bench_scaling")


def test_scaling_summary_tables_and_explains_every_curve(tmp_path):
    # The sweep's write-up from measured rows (here hand-made): a table per axis with the
    # ratios, a figure, and under it one sentence per curve on what it communicates.
    import pandas as pd

    scaling = _scaling_module()
    point = {"n_params": 1000, "seq_len": 32, "batch": 8}
    rows = []
    for tp in (1, 2):
        rows += scaling.rows_of("tp", tp, point, {"lockstep/free": _ratio(1.1 * tp, 1.0, 1.3 * tp),
                                                  "free tp/tp 1": _ratio(tp, 0.9, 2.5)})
    rows += scaling.rows_of("workers", 4, point, {"dyn-overlap/noised": _ratio(1.05, 1, 1.1)})
    table = pd.DataFrame(rows)
    text = scaling.summary(table, 90.0, argparse.Namespace(repeats=3, steps=5))
    assert "| tp | lockstep/free | free tp/tp 1 |" in text
    assert "| 2 | 2.20x (1.00-2.60) | 2.00x (0.90-2.50) |" in text
    assert "## workers" in text and "| 4 | 1.05x (1.00-1.10) |" in text
    for name in ("lockstep/free", "free tp/tp 1", "dyn-overlap/noised"):
        assert text.count(f"- {name}: {scaling.EXPLAIN[name]}") == 1
    scaling.figure(table, "tp", tmp_path / "tp.png")
    assert (tmp_path / "tp.png").read_bytes()[:4] == b"\x89PNG"


def _experiment(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_counts_what_the_optimized_hlo_holds():
    # experiments/profile_overheads.py reads a compiled program's work from its optimized HLO:
    # a program with one conditional, one loop and one matmul, and random bits in a branch,
    # must be counted as such (a wrong pattern counts nothing, or counts fused bodies twice).
    profile = _experiment("profile_overheads")

    def f(x, key):
        y = jax.lax.cond(x[0, 0] > 0, lambda: x + jax.random.uniform(key, x.shape),
                         lambda: x)
        y = jax.lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v) * 1.5, y)
        return y @ y

    x = jnp.ones((64, 64))
    text = jax.jit(f).lower(x, jax.random.key(0)).compile().as_text()
    counts = profile.hlo_counts(text)
    assert counts["conditional"] == 1 and counts["dot"] == 1 and counts["while"] >= 1
    assert counts["random-bit ops"] > 0
    assert profile.hlo_counts(jax.jit(lambda x: x @ x).lower(x).compile().as_text())[
        "random-bit ops"] == 0
    # The matmuls of a traced step, with their multiplicity.
    dots = profile._dots(jax.make_jaxpr(lambda x: (x @ x) @ x + jax.lax.cond(
        x[0, 0] > 0, lambda: x @ x, lambda: x))(x).jaxpr, profile.Counter())
    assert sum(dots.values()) == 3


def test_barrier_cost_times_taps_with_and_without_work():
    # Two tiny programs per case on the (node=2) mesh: both cases measured, times positive.
    profile = _experiment("profile_overheads")
    result = profile.barrier_cost(rows=8, width=8, hidden=8, segments=2, repeats=2)
    assert list(result) == ["alone", "with matmuls"]
    assert all(r["step_s"] > 0 and math.isfinite(r["per_tap_s"]) for r in result.values())
    assert "| with matmuls |" in profile.barrier_table(result)


def test_step_profile_joins_the_trace_with_the_hlo():
    # experiments/profile_step.py: each operation the runtime ran, found in the optimized HLO
    # with its matmul FLOPs (a batched matmul's 2*b*m*n*k, wherever XLA fused it), its kind,
    # and the time the profiler gave it; a matmul with a transposed operand shows its layout
    # change as an operation of its own kind.
    profile = _experiment("profile_step")
    b, m, k, n = 3, 32, 48, 16

    def f(x, w, y):
        return jnp.tanh(jnp.einsum("bmk,bkn->bmn", x, w)) + 1.0, y.T.copy() * 2.0

    args = (jnp.ones((b, m, k)), jnp.ones((b, k, n)), jnp.ones((64, 128)))
    compiled = jax.jit(f).lower(*args).compile()
    ops = profile.operations(compiled.as_text())
    matmuls = [o for o in ops.values() if o["kind"] == "matmul"]
    assert sum(o["flops"] for o in matmuls) == 2 * b * m * n * k
    assert any(o["kind"] == "layout change" for o in ops.values())

    times = profile.traced_times(lambda steps: [jax.block_until_ready(compiled(*args))
                                                for _ in range(steps)], 2)
    rows = profile.join(ops, times)
    assert {r["kind"] for r in rows} >= {"matmul", "layout change"}
    # Thread nanoseconds per step from the trace become milliseconds, slowest first.
    assert [r["ms"] for r in rows] == sorted((times[r["name"]] / 1e6 for r in rows), reverse=True)
    table = profile.report({"preset": "t", "batch": 1, "seq_len": 1, "step_s": 0.1,
                            "minor_faults": 0, "system_s": 0.0, "rows": rows})
    assert "| matmul |" in table and "| layout change |" in table
    torch_table = profile.torch_report({"step_s": 0.1, "kinds": {"matmul": 2.0, "other": 1.0}})
    assert "| matmul | 2.0 | 66.7% |" in torch_table and "100 ms a step" in torch_table


def test_compiler_options_parse_and_bits_compare():
    # experiments/compiler_options.py: `K=V,K2=V2` becomes typed options; the bit comparison
    # tells -0.0 from 0.0 (a float comparison would not).
    options = _experiment("compiler_options")
    assert options.parse_options("a=true,b=False, c=8,d=-2,e=x") == {
        "a": True, "b": False, "c": 8, "d": -2, "e": "x"}
    for bad in ("a", "=1", "a="):
        with pytest.raises(ValueError, match="is not KEY=VALUE"):
            options.parse_options(bad)
    tree = {"w": jnp.zeros(3), "b": jnp.ones(2)}
    assert options.same_bits(tree, {"w": jnp.zeros(3), "b": jnp.ones(2)})
    assert not options.same_bits(tree, {"w": -jnp.zeros(3), "b": jnp.ones(2)})


def test_matmul_form_swaps_the_model_matmul_while_tracing_only():
    # experiments/compiler_options.py --matmul-form: inside the block the model's matmuls take
    # sites.matmul's custom VJP, whose weight gradient contracts the tokens flattened to one
    # axis (a reshape autodiff's form does not have); the same gradient up to rounding, and
    # autodiff's form is back after.
    from sdcstudy.core import sites as S

    options = _experiment("compiler_options")
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 4))

    def grad():  # a new function each time: JAX caches traces by function
        return jax.grad(lambda w: (S.linear(S.identity_hook, S.ATTN_Q, x, w, 0) ** 2).sum())

    autodiff = S.linear
    with options.matmul_form():
        assert "reshape" in str(jax.make_jaxpr(grad())(w))
        swapped = grad()(w)
    assert S.linear is autodiff and "reshape" not in str(jax.make_jaxpr(grad())(w))
    np.testing.assert_allclose(swapped, grad()(w), rtol=1e-5, atol=1e-5)


def test_fault_draw_cost_times_three_parts_of_one_site(capsys):
    # experiments/fault_draw_cost.py: the matmul, the draws and the whole firing site, each a
    # positive time, the draws and the site as ratios to the matmul.
    _experiment("fault_draw_cost").main(["--tokens", "16", "--calls", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["matmul", "draws", "draw,"]
    times = [float(line.split(" us")[0].split()[-1]) for line in lines]
    assert all(t > 0 for t in times) and lines[0].endswith("1.0x the matmul")


def test_fault_compile_cost_hears_only_the_step_and_writes_loadable_profiles(tmp_path):
    # experiments/fault_compile_cost.py adds up JAX's compile-time events of `jit(train_step)`
    # alone (not the initializer's or a slice's), and its profiles load as a run would load them.
    from sdcstudy.faults import profiles

    cost = _experiment("fault_compile_cost")
    listener = cost.StepCompiles()

    def train_step(x):
        return x * 3.0 + 1.0

    def init(x):
        return x - 2.0

    jax.jit(init)(jnp.ones(7))
    assert listener.seconds == 0.0
    jax.jit(train_step)(jnp.ones(5))
    assert listener.seconds > 0.0
    for name, profile in cost.PROFILES.items():
        arg = cost.profile_arg(profile, tmp_path)
        if profile is None:
            assert arg == {}, name
            continue
        loaded = profiles.load(arg["suspect"]["profile"])
        assert loaded.specs and not loaded.healthy, name
    assert len(list(tmp_path.glob("profile-*.yaml"))) == 3
