"""`sdcstudy bench`: each suite runs end to end at a tiny size and reports what it claims.

No timing is asserted (a shared CPU makes any threshold flaky); what is asserted is what would
make the figures meaningless: a contender missing, a ratio that is not a positive number, a
"healthy" program that is not the plain one, an idle fault profile that changes the training,
a healthy pair that disagrees.
"""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from sdcstudy import bench, bench_paft, cli

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
    return report, out.out


def _positive(spread):
    return all(math.isfinite(x) and x > 0 for x in (spread["median"], spread["min"],
                                                    spread["max"]))


def test_faults_suite(tmp_path, capsys):
    report, table = _run(tmp_path, capsys, "faults")
    (result,) = report["results"]
    variants = result["variants"]
    assert list(variants) == list(bench.FAULT_VARIANTS)
    for name, v in variants.items():
        assert _positive(v["ratio"]) and _positive(v["tokens_per_s"]), name
        assert f"| {name} |" in table
    assert variants["plain"]["ratio"]["median"] == 1.0
    # healthy and rate-0 profiles build no injector: the compiled program must be plain's,
    # byte for byte. If not, the fault engine costs something even when it is switched off.
    for name in ("healthy", "zero-rate"):
        assert not variants[name]["injector"] and variants[name]["hlo_identical"], name
    # The idle profile compiles the engine in (a different program) but never fires: nothing
    # lands and the losses are plain's bit for bit (corruptions select in the integer domain).
    idle = variants["idle"]
    assert idle["injector"] and not idle["program_identical"]
    assert idle["faults_landed"] == 0
    assert all(v["losses_equal_plain"] for v in variants.values())


def test_paired_suite(tmp_path, capsys):
    report, table = _run(tmp_path, capsys, "paired")
    (result,) = report["results"]
    assert result["mesh"] == {"node": 2, "dp": 1, "tp": 1}
    modes = result["modes"]
    assert list(modes) == list(bench.PAIRED_MODES)
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
    assert "lockstep/free memory" in table


def test_abft_suite(tmp_path, capsys):
    report, table = _run(tmp_path, capsys, "abft")
    (result,) = report["results"]
    variants = result["variants"]
    assert list(variants) == list(bench.ABFT_VARIANTS)
    for name, v in variants.items():
        assert _positive(v["ratio"]) and f"| {name} |" in table, name
    # Checks ran (one layer: q k v o gate up down and the head, three products each, per
    # warm-up step) and a healthy float32 step raises no flag under the paper's threshold;
    # checking reads the products and changes none of them, so the losses are the plain ones.
    assert variants["off"]["checks"] == 0
    for name in ("on", "recompute"):
        assert variants[name]["checks"] == 8 * 3 * bench.WARMUP_STEPS, name
        assert variants[name]["flags"] == 0 and variants[name]["losses_equal_off"], name


def test_train_suite_matches_torch(tmp_path, capsys):
    pytest.importorskip("transformers")
    report, table = _run(tmp_path, capsys, "train", "--torch-attention", "sdpa")
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
    from sdcstudy import config as C
    from sdcstudy import model, roofline

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


def test_program_text_ignores_only_source_locations():
    # The faults suite compares programs traced from different lines; the comparison must
    # see through the lines and still see a different constant.
    x = jnp.ones(4)
    a = jax.jit(_scale_by(2.0)).lower(x).compile().as_text()
    b = jax.jit(_scale_by(2.0)).lower(x).compile().as_text()
    c = jax.jit(_scale_by(3.0)).lower(x).compile().as_text()
    assert a != b, "the premise: compiled text names the lines that traced it"
    assert bench.program_text(a) == bench.program_text(b)
    assert bench.program_text(a) != bench.program_text(c)


def test_bad_preset_is_one_sentence_and_exit_2():
    # Through the real entry point: the error comes before JAX starts, with no traceback.
    proc = subprocess.run([sys.executable, "-m", "sdcstudy", "bench", "paired", "--presets",
                           "tiny,nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("sdcstudy: error:") and "'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("argv, needle", [
    (["faults", "--repeats", "0"], "--repeats"),
    (["train", "--seq-len", "-4"], "--seq-len"),
    (["paired", "--tp", "3"], "mesh.tp"),
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
            bench.finish(args, name, [{"suite": name}], f"| {name} table |\n")
            return 0
        return run

    for name in ("train", "faults", "paired", "abft"):
        monkeypatch.setattr(bench, f"run_{name}_suite", fake(name))
    monkeypatch.setattr(bench_paft, "run_paft_suite", fake("paft"))
    json_path, md_path = tmp_path / "all.json", tmp_path / "all.md"
    assert cli.main(["bench", "all", "--presets", "tiny", "--json", str(json_path),
                     "--markdown", str(md_path)]) == 0
    assert list(seen) == ["train", "faults", "paired", "abft", "paft"]
    assert all(a.repeats == 3 and a.presets == "tiny" for a in seen.values())
    assert seen["train"].no_torch is False and seen["paired"].tp == 1
    assert seen["paft"].workers == "4"
    report = json.loads(json_path.read_text())
    assert {k: v["results"] for k, v in report["suites"].items()} == {
        name: [{"suite": name}] for name in seen}
    table = md_path.read_text()
    assert all(f"## {name}" in table and f"| {name} table |" in table for name in seen)
