"""`sdcstudy plan`: the numbers of a plan against what a real step of the same setup holds,
computes and sends, and the setups it refuses.

One tiny lock-step pair (node 2 x tp 2, bfloat16 with bfloat16 parameters, 2 microsteps) is
planned once; its compiled program then runs one real step from a real initial state, so
the plan's abstract numbers meet the bytes, tap statistics and collectives of the run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from sdcstudy import cli
from sdcstudy.bench import roofline
from sdcstudy.core import config as C
from sdcstudy.core.config import UserError
from sdcstudy.plan import aot, crossing, devices as DV, summary, text

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
PAIR = ["experiment.mode=lockstep", "mesh.tp=2", "experiment.microsteps=2",
        "experiment.batch_size=4", "model.dtype=bfloat16", "model.param_dtype=bfloat16"]


@pytest.fixture(scope="module")
def planned():
    cfg = C.load(TINY, PAIR)
    program = aot.compile_program(cfg)
    return cfg, program, summary.make_plan(cfg, str(TINY), program, list(DV.DEVICES))


@pytest.fixture(scope="module")
def ran(planned):
    """A real initial state's bytes per device, then one real step of the planned program:
    its mismatch rows and the state it held."""
    cfg, program, _ = planned
    trainer = program.trainer
    state = trainer.init_state()
    held = {part: per_device(state[part], "nbytes") for part in ("params", "opt_state")}
    sizes = {part: per_device(state[part], "size") for part in held}
    e = cfg.experiment
    tokens = np.random.default_rng(0).integers(
        0, trainer.dims.vocab_size, (e.microsteps, e.batch_size, cfg.data.seq_len + 1),
        dtype=np.int32)
    batch = jax.device_put(trainer.make_batch(tokens), trainer.batch_shardings())
    out = program.compiled(state, batch)
    tables, _ = trainer.host_tables(1, jax.device_get(out.records))
    return held, sizes, tables["mismatch.parquet"]


def per_device(tree, what: str) -> dict:
    """{device: `what` (nbytes, size) of its shards of every leaf of `tree`, summed}."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + getattr(shard.data, what)
    return out


def test_state_bytes_equal_a_real_states(planned, ran):
    """The plan's parameter and optimizer bytes are those every device of a real initial state
    holds, to the byte; if not, the plan reads the shardings or the itemsizes wrong."""
    _, _, plan = planned
    held, _, _ = ran
    assert len(held["params"]) == 4
    assert set(held["params"].values()) == {plan["state"]["params"]}
    assert set(held["opt_state"].values()) == {plan["state"]["opt_state"]}


def test_flops_are_the_roofline_count(planned):
    """The plan's FLOPs are bench/roofline.py's count of the step's sequences, divided over the
    node's devices; XLA's own count, which adds what the roofline leaves out (softmax, norms,
    the optimizer) but counts the microstep loop's body once, is not below one microstep's
    share. Otherwise the plan counts another step."""
    cfg, _, plan = planned
    e = cfg.experiment
    node = roofline.step_flops(C.model_dims(cfg.model), e.microsteps * e.batch_size,
                               cfg.data.seq_len)
    assert plan["flops"]["node"] == node
    assert plan["flops"]["device"] == node / 2
    xla = plan["flops"]["xla_device"]
    assert xla is None or xla >= plan["flops"]["device"] / e.microsteps


def test_lockstep_bytes_are_what_the_taps_compared(planned, ran):
    """The lock-step line is the elements the real step's taps compared (mismatch.parquet's
    `elements`, over every site, layer, microstep and tp rank) per device, at 2 bytes a
    bfloat16 element; the copies are each device's real state elements at 4 bytes. If not,
    the derivation in plan/crossing.py misses a site, a layer, a microstep or a shard."""
    _, _, plan = planned
    _, sizes, rows = ran
    devices_per_node = 2
    compared = sum(r["elements"] for r in rows) // devices_per_node
    parts = plan["node_bytes"]
    assert {r["site"] for r in rows} == {"fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn"}
    assert parts["lock-step comparisons"] == compared * 2
    (params,), (opt,) = (set(sizes[p].values()) for p in ("params", "opt_state"))
    assert parts["gradient copy (grad/diff_l2)"] == 4 * params
    assert parts["parameter copy (param/diff_l2 and the sync)"] == 4 * params
    assert parts["optimizer-state copy (the sync)"] == 4 * opt


_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|all-reduce|collective-permute)\(.*"
                         r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}")
_ARRAY = re.compile(r"(bf16|f32|u32|s32|u16)\[([\d,]*)\]")
_ITEMSIZE = {"bf16": 2, "u16": 2, "f32": 4, "u32": 4, "s32": 4}


def node_crossing(hlo: str, node_of: dict, microsteps: int) -> dict:
    """What one device sends over the compiled program's collectives whose groups pair the two
    nodes: elements of the lock-step taps' all-gathers, and bytes of the rest (scalars left
    out); ops of the microstep loop counted once per microstep."""
    out = {"tap_elements": 0, "other_bytes": 0}
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        groups = [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}",
                                                                        match.group(3))]
        if len({node_of[i] for i in groups[0]}) < 2:
            continue
        arrays = [(t, int(np.prod([int(d) for d in dims.split(",")]))) for t, dims in
                  _ARRAY.findall(match.group(1)) if dims]
        share = len(groups[0]) if match.group(2) == "all-gather" else 1
        times = microsteps if "/while/body/" in line else 1
        if "lockstep_" in line:
            out["tap_elements"] += sum(n for _, n in arrays) // share * times
        else:
            out["other_bytes"] += sum(_ITEMSIZE[t] * n for t, n in arrays) // share * times
    return out


def test_node_bytes_are_the_compiled_programs_collectives(planned):
    """The compiled program's node-crossing collectives (read from its HLO) carry the plan's
    copies to the byte and the plan's tap elements; if not, the step exchanges something the
    derivation does not know of, or XLA no longer shares the parameter copy between the metric
    and the sync. (XLA:CPU gathers a bfloat16 tap in float32, so its tap bytes are not the
    plan's: docs/plan.md.)"""
    cfg, program, plan = planned
    node_of = {d.id: n for n, row in enumerate(program.trainer.mesh.devices)
               for d in np.ravel(row)}
    sent = node_crossing(program.compiled.as_text(), node_of, cfg.experiment.microsteps)
    parts = dict(plan["node_bytes"])
    taps = parts.pop("lock-step comparisons")
    assert sent["tap_elements"] * 2 == taps
    assert sent["other_bytes"] == sum(parts.values())


def test_free_and_single_node_modes_send_no_sync():
    """A free pair sends only the difference metrics' copies, a single node nothing; if not,
    the plan charges a mode for a synchronization it does not do."""
    dims = C.model_dims(C.ModelConfig())
    free = crossing.node_bytes(C.load(TINY, ["experiment.mode=free"]), dims, 10, 21)
    assert free == {"gradient copy (grad/diff_l2)": 40, "parameter copy (param/diff_l2)": 40}
    assert crossing.node_bytes(C.load(TINY, []), dims, 10, 21) == {}


def test_a_typo_of_a_mode_gets_the_nearest_one_a_plan_compiles():
    """A misspelt mode is offered the plannable mode it is closest to; a real mode a plan does
    not compile is offered none (the nearest to `finetune` is `free`, which it is not)."""
    with pytest.raises(UserError, match="did you mean 'lockstep'"):
        DV.devices_needed(C.load(TINY, ["experiment.mode=lockstpe"]))
    with pytest.raises(UserError) as refused:
        DV.devices_needed(C.load(TINY, ["experiment.mode=finetune"]))
    assert "did you mean" not in str(refused.value)


# (unit, its size in the base unit) of each printer, largest first; the first is the top unit.
PRINTED_UNITS = {
    text.size: [("TiB", 2.0 ** 40), ("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10),
                ("B", 1.0)],
    text.seconds: [("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)],
    text.flop: [("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                ("FLOP", 1.0)],
    text.count: [("B", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0)],
}


@pytest.mark.parametrize("printer", list(PRINTED_UNITS), ids=lambda f: f.__name__)
def test_numbers_print_plainly_in_the_largest_unit_they_fill(printer):
    """Every size, time, FLOP count and parameter count prints as a plain number, never in
    Python's exponent form (`1.01e+03 MiB` came out of a real plan: small at 7 x 248 tokens),
    in the largest unit where it reads at least 1, and reads back within its rounding; a size
    fits the table's 10-character column."""
    units = PRINTED_UNITS[printer]
    mantissas = (1.0, 1.5, 7.12, 99.96, 999.4, 999.6, 1000.0, 1023.4, 1023.7)
    values = sorted({m * scale for m in mantissas for _, scale in units} |
                    {m * units[0][1] * 1000 for m in mantissas})
    for value in values:
        if printer is text.count:
            value = round(value)
        printed = printer(value)
        plain = re.fullmatch(r"([\d,]+(?:\.\d+)?) ?([A-Za-z]*)", printed)  # not 1e+03
        assert plain, printed
        read, unit = float(plain.group(1).replace(",", "")), plain.group(2)
        rank = [u for u, _ in units].index(unit)
        scale = units[rank][1]
        assert read >= 1 or rank == len(units) - 1, printed  # a larger unit than it fills
        assert rank == 0 or read * scale < units[rank - 1][1], printed  # one it fills
        assert read * scale == pytest.approx(value, rel=5e-3, abs=0.5 * units[-1][1]), printed
        if printer is text.size and value < 1000 * 2.0 ** 40:
            assert len(printed) <= 10, printed


@pytest.mark.parametrize("path", ["", "."])
def test_json_to_the_current_folder_is_one_sentence_and_exit_3(path, monkeypatch, capsys):
    """`--json ""` (which argparse makes the folder `.`) and `--json .` end, after the printed
    plan, with the sentence of any folder given as the plan file, exit 3; not "could not run:
    ValueError", which calls the user's typo a bug (compilation stubbed, as in
    tests/test_exit_codes.py)."""
    monkeypatch.setattr(aot, "compile_program", lambda cfg: None)
    monkeypatch.setattr(summary, "make_plan", lambda *args: {"plan": 1})
    monkeypatch.setattr(text, "render", lambda plan: "the plan")
    code = cli.main(["plan", str(TINY), "--json", path])
    out, err = capsys.readouterr()
    assert code == 3 and out.startswith("the plan"), err
    [line] = err.strip().splitlines()
    assert line.startswith("sdcstudy: error: could not write the plan file '.' (it is a "
                           "folder)"), line


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sdcstudy", "plan", str(TINY), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args, words", [
    (["--device", "h300"], "unknown device 'h300'"),
    (["--set", "experiment.mode=lockstep", "--set", "mesh.dp=1024", "--set",
      "experiment.batch_size=1024"], "more than the 1024"),
    (["--set", "experiment.mode=lockstep", "--set", "mesh.tp=3"], "multiple of mesh.tp (3)"),
    (["--set", "experiment.mode=paft"], "not experiment.mode 'paft'"),
])
def test_a_setup_that_cannot_be_planned_gets_one_sentence(args, words):
    """An unknown device, a mesh past the simulated limit, a mesh the model cannot be split
    over and a mode a plan does not compile each end with one line on stderr and exit code 2;
    a traceback or another code means the user is left to read the code."""
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdcstudy: error:"), done.stderr
    assert words in lines[0]


def test_a_mesh_larger_than_the_started_devices_gets_one_sentence(capsys):
    """In a process whose JAX already started with 8 simulated devices, a 16-device mesh is
    refused in one sentence (exit 2) instead of a traceback from the mesh."""
    code = cli.main(["plan", str(TINY), "--set", "experiment.mode=lockstep",
                     "--set", "mesh.tp=8", "--set", "experiment.batch_size=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "needs 16 devices but JAX started with 8" in err[0]


def test_the_default_mfu_is_the_one_results_states():
    """Each dtype's default MFU is the figure docs/results/gpu.md's "On one GPU" states for
    `bench train` in that dtype; when the GPU is measured again, plan/devices.py's MEASURED_MFU
    must follow, or a plan's step time quotes a figure nobody measured."""
    text = (ROOT / "docs" / "results" / "gpu.md").read_text()
    section = text[text.index("## On one GPU"):]
    section = section.split("\n## ")[0]
    for dtype, mfu in DV.MEASURED_MFU.items():
        lines = [line for line in section.splitlines() if f"`bench train`, {dtype}" in line]
        assert any(f"MFU {mfu:.1%}" in line for line in lines), (dtype, lines)
