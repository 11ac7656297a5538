"""Golden-run pre-admission tests: a clean node passes, every corruption fails where it began,
and a check that could not verify anything is never a PASS."""

import json
import shutil
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy import cli
from sdcstudy.core import determinism
from sdcstudy.faults import specs as FS
from sdcstudy.golden import check as G
from sdcstudy.golden import compare as GC
from sdcstudy.golden import digest as GD
from sdcstudy.golden import record as GR
from sdcstudy.core import sites as S

# Single-bit flips, each its own check. Sampled once with a fixed seed so that a failure can be
# replayed; `experiments/golden_flips.py` runs 50 of them.
N_FLIPS = 2


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "tiny"
    assert cli.main(["golden", "record", "--out", str(out), "--no-progress"]) == 0
    return out


def _copy(golden_dir, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(golden_dir, target)
    return target


def _sample_flips(meta, n, seed=0):
    """Random (step, microstep, direction, site, layer, bit) over every site of the model."""
    rng = np.random.default_rng(seed)
    flips = []
    for _ in range(n):
        key = meta["site_order"][rng.integers(len(meta["site_order"]))]
        site, layer = key.rsplit("/", 1)
        flips.append({"step": int(rng.integers(1, meta["steps"] + 1)),
                      "microstep": int(rng.integers(meta["microsteps"])),
                      "site": f"{rng.choice(['fwd', 'bwd'])}/{site}", "layer": int(layer),
                      "bit": int(rng.integers(32)), "seed": int(rng.integers(1, 1000))})
    return flips


# Sites of the default tiny workload (2 layers), steps and microsteps of `golden.DEFAULT`.
DEFAULT_LAYOUT = {"site_order": [f"{s}/{layer}" for layer in (1, 2) for s in S.BLOCK_SITES]
                  + [f"{s}/0" for s in S.MODEL_SITES],
                  "steps": G.DEFAULT["experiment"]["steps"],
                  "microsteps": G.DEFAULT["experiment"]["microsteps"]}


def _flip_text(flip):
    return "flip:" + ",".join(f"{k}={v}" for k, v in flip.items())


# --- the digest -----------------------------------------------------------------------------


def _mix_np(u):
    u = u ^ (u >> np.uint32(16))
    u = u * np.uint32(0x7FEB352D)
    u = u ^ (u >> np.uint32(15))
    u = u * np.uint32(0x846CA68B)
    return u ^ (u >> np.uint32(16))


def _digest_np(x):
    bits = x.reshape(-1).view(np.uint32)
    blocks = GD.n_blocks(bits.size)
    per = -(-bits.size // blocks)
    bits = np.pad(bits, (0, blocks * per - bits.size))
    i = np.arange(blocks * per, dtype=np.uint32)
    a = _mix_np(bits) * (np.uint32(2) * i + np.uint32(1))
    b = _mix_np(bits ^ np.uint32(0x5BD1E995)) * (_mix_np(i) | np.uint32(1))
    return np.stack([a, b], -1).reshape(blocks, per, 2).sum(1, dtype=np.uint32)


def test_device_digest_matches_numpy_and_sees_every_single_flip():
    # The on-device digest must be the documented formula (a numpy reimplementation gives the
    # same words), and a flip of any one bit must change both lanes of exactly the block that
    # holds the element: otherwise a corrupted site could pass, or be reported in the wrong
    # place.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 7, 9)).astype(np.float32)  # 315 elements, uneven blocks
    digest = jax.jit(GD.block_digest)
    clean = np.asarray(digest(x))
    np.testing.assert_array_equal(clean, _digest_np(x))
    for _ in range(40):
        index, bit = int(rng.integers(x.size)), int(rng.integers(32))
        flipped = x.copy().reshape(-1)
        flipped.view(np.uint32)[index] ^= np.uint32(1 << bit)
        differ = np.asarray(digest(flipped.reshape(x.shape))) != clean
        (blocks,) = np.nonzero(differ.any(-1))
        assert blocks.tolist() == [next(b for b in range(GD.n_blocks(x.size))
                                        if index < GD.block_range(b, x.size)[1])]
        assert differ[blocks[0]].all(), "both lanes must see a single-element change"
    # Moving values around (same multiset of bits, other positions) must change it too.
    assert not np.array_equal(np.asarray(digest(x[::-1].copy())), clean)


def test_backward_digest_is_the_digest_of_the_gradient():
    # The sink's cotangent must carry exactly the digest of the gradient arriving at the site,
    # and the gradient itself must pass through unchanged.
    x = jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32).reshape(3, 100)
    weights = jnp.cos(jnp.arange(300, dtype=jnp.float32)).reshape(3, 100)
    sink = jnp.zeros(GD.sink_shape(x.size), jnp.float32)
    grad_x, grad_sink = jax.grad(
        lambda x, s: jnp.sum(GD.backward_digest(x, s) * weights), argnums=(0, 1))(x, sink)
    np.testing.assert_array_equal(grad_x, weights)
    np.testing.assert_array_equal(np.asarray(GD._to_uint(grad_sink)),
                                  _digest_np(np.asarray(weights)))


# --- record and check -------------------------------------------------------------------------


def test_record_is_small_complete_and_never_overwritten(golden_dir, capsys):
    # The budget (under 5 MB for tiny, with full parameters of every step, which the
    # exact parameter reports need), the fingerprint fields a check compares, and a second
    # record into the same folder refused without touching the first.
    manifest = G.verify(golden_dir)
    size = sum(f["bytes"] for f in manifest["body"]["files"].values())
    assert size < 5e6, f"a tiny golden record must stay under 5 MB, it is {size / 1e6:.2f} MB"
    _, env, meta, arrays = G.load(golden_dir)
    assert meta["full_param_steps"] == list(range(1, meta["steps"] + 1))
    assert set(GC.ENV_FIELDS) <= set(env) and len(env["compiled_step_sha256"]) == 64
    before = (golden_dir / GR.MANIFEST).read_bytes()
    code = cli.main(["golden", "record", "--out", str(golden_dir), "--no-progress"])
    assert code == 2 and "never overwritten" in capsys.readouterr().err
    assert (golden_dir / GR.MANIFEST).read_bytes() == before


def test_clean_node_passes_every_repetition(golden_dir, tmp_path):
    # The same machine, another simulated device, three repetitions: every step of every
    # repetition must be bitwise equal (if not, the golden step is not deterministic, or the
    # device index leaks into the program).
    code = cli.main(["golden", "check", str(golden_dir), "--repeat", "3", "--device", "1",
                     "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"),
                     "--no-progress"])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and report["verdict"] == "PASS", report["reason"]
    assert [r["verdict"] for r in report["repetitions"]] == ["PASS"] * 3
    assert all(r["steps_compared"] == report["golden"]["steps"] for r in report["repetitions"])
    assert report["device"]["index"] == 1 and report["env"]["differences"] == []
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("errors"), suite.get("tests")) == ("0", "0", "6")


def test_a_parameter_difference_is_reported_to_the_bit(golden_dir, tmp_path):
    # A golden record whose step-2 value of one weight differs in one element (signed again, as
    # a record from another run would be) must FAIL at step 2 naming that element, with the
    # golden's bits as expected and the node's bits as observed.
    target = _copy(golden_dir, tmp_path)
    with np.load(target / GR.ARRAYS) as npz:
        arrays = {k: npz[k] for k in npz.files}
    name, index = "layers/1/ffn/w_up", 1234
    truth = int(arrays[f"full/2/{name}"].reshape(-1)[index])
    arrays[f"full/2/{name}"].reshape(-1)[index] ^= np.uint32(1 << 4)
    arrays[f"params/{name}"][2, 0, 0] ^= np.uint32(1)
    with open(target / GR.ARRAYS, "wb") as f:
        np.savez_compressed(f, **arrays)
    GR.write_manifest(target)
    report = G.check(target, device_index=1)  # the program of the clean check, compiled once
    assert report["verdict"] == "FAIL", report["reason"]
    first = report["first_difference"]
    assert (first["step"], first["kind"], first["tensor"], first["exact"]) == (2, "parameter",
                                                                                name, True)
    assert first["index"] == index and first["differing_elements"] == 1
    assert int(first["observed_bits"], 16) == truth
    assert int(first["expected_bits"], 16) == truth ^ (1 << 4)
    assert first["differing_bits"] == [4]


def test_final_sha256_is_checked_even_when_every_digest_agrees(golden_dir, tmp_path):
    # The digests are not cryptographic; the end-to-end SHA-256 of the final parameters is the
    # backstop. A record whose final SHA-256 of one tensor differs must FAIL, naming it.
    target = _copy(golden_dir, tmp_path)
    meta = json.loads((target / GR.META).read_text())
    meta["final_param_sha256"]["head"] = "0" * 64
    (target / GR.META).write_text(json.dumps(meta))
    GR.write_manifest(target)
    report = G.check(target, device_index=1)
    assert report["verdict"] == "FAIL", report["reason"]
    assert report["first_difference"]["differing_tensors"] == ["head"]
    assert report["repetitions"][0]["steps_compared"] == report["golden"]["steps"]


@pytest.mark.parametrize("flip", _sample_flips(DEFAULT_LAYOUT, N_FLIPS), ids=_flip_text)
def test_single_bit_flip_fails_where_it_landed(golden_dir, flip):
    # One flipped bit anywhere in the model, forward or backward, must FAIL, and the first
    # difference must be the step, microstep, layer and site where it was injected, in the
    # block that holds the flipped element. A report that names a later site would send the
    # fleet manager looking at the wrong unit.
    report = G.check(golden_dir, inject=_flip_text(flip))
    assert report["verdict"] == "FAIL" and report["exit_code"] == 1, report["reason"]
    (landed,) = report["injected"]["first"]
    assert report["injected"]["landed"] == 1
    first = report["first_difference"]
    direction, site = FS.FaultSpec(flip["site"]).resolve()
    assert (first["step"], first["microstep"], first["layer"], first["site"]) == (
        flip["step"], flip["microstep"], flip["layer"], f"{direction}/{site}")
    assert (landed["step"], landed["microstep"], landed["bit"]) == (
        flip["step"], flip["microstep"], flip["bit"])
    assert first["block"]["flat_start"] <= landed["flat_index"] < first["block"]["flat_stop"]


def test_differences_are_ordered_as_the_program_runs(golden_dir):
    # Within a step: microstep 0 forward sites in model order, its backward sites in reverse,
    # then microstep 1, then the loss, the gradient norm and the parameters. The loss and the
    # gradient norm are reported to the bit.
    _, _, meta, arrays = G.load(golden_dir)
    step = 3
    out = {d: {k: arrays[f"{d}/{k}"][step - 1].copy() for k in meta["site_order"]}
           for d in ("fwd", "bwd")}
    out["params"] = {p: arrays[f"params/{p}"][step].copy() for p in meta["params"]}
    out["loss"], out["grad_norm"] = arrays["loss"][step - 1], arrays["grad_norm"][step - 1]
    assert GC.step_differences(step, out, arrays, meta) == []
    out["loss"] = out["loss"] ^ np.uint32(1 << 22)
    out["bwd"]["attn_q/1"][1, 5, 0] += np.uint32(1)
    out["bwd"]["ffn_up/2"][0, 7, 1] += np.uint32(1)
    out["fwd"]["logits/0"][1, 0, 0] += np.uint32(1)
    found = GC.step_differences(step, out, arrays, meta)
    assert [GC._short(d) for d in found] == ["m0 bwd/ffn_up/2", "m1 fwd/logits/0",
                                            "m1 bwd/attn_q/1", "loss"]
    loss = GC.describe(found[-1], step, meta, arrays, None)
    assert loss["exact"] and loss["differing_bits"] == [22]
    assert int(loss["expected_bits"], 16) == int(arrays["loss"][step - 1])


# --- never PASS without verifying ---------------------------------------------------------------


def _damage_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: _damage_byte(d / GR.ARRAYS), "golden.npz"),
    (lambda d: _damage_byte(d / GR.MANIFEST), "MANIFEST.json"),
    (lambda d: (d / GR.ENV).unlink(), "env.json is missing"),
    (lambda d: (d / GR.MANIFEST).unlink(), "MANIFEST.json is missing"),
], ids=["byte-in-arrays", "byte-in-manifest", "missing-env", "missing-manifest"])
def test_damaged_or_incomplete_golden_is_inconclusive(golden_dir, tmp_path, damage, reason):
    target = _copy(golden_dir, tmp_path)
    damage(target)
    code = cli.main(["golden", "check", str(target), "--json", str(tmp_path / "r.json"),
                     "--junit", str(tmp_path / "r.xml"), "--no-progress"])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 2 and report["verdict"] == "INCONCLUSIVE"
    assert reason in report["reason"] and report["failed_stage"] == "golden"
    assert report["repetitions"] == []
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("errors") == "1" and suite.get("failures") == "0"


def test_another_environment_is_inconclusive_and_named(golden_dir, monkeypatch):
    # A node on another stack (another jax, another instruction set) may compute other bits
    # without being faulty: the check must say it cannot tell (exit 2), name what differs, and
    # stop before running anything.
    real = determinism.fingerprint

    def other_stack(compiled_text=None):
        env = real(compiled_text)
        env["packages"] = dict(env["packages"], jax="0.0.1")
        env["cpu"] = dict(env["cpu"], isa=["sse4_2"])
        return env

    monkeypatch.setattr(determinism, "fingerprint", other_stack)
    report = G.check(golden_dir)
    assert report["verdict"] == "INCONCLUSIVE" and report["exit_code"] == 2
    assert report["failed_stage"] == "environment" and report["repetitions"] == []
    assert {d["field"] for d in report["env"]["differences"]} == {"packages.jax", "cpu.isa"}
    assert "packages.jax" in report["reason"] and "cpu.isa" in report["reason"]


@pytest.mark.parametrize("inject, words", [
    ("flip:step=99,site=fwd/attn,layer=1,bit=3", "step must be 1 to 6"),
    ("flip:step=2,site=fwd/attn,layer=7,bit=3", "layers [1, 2]"),
    ("flip:step=2,site=fwd/atn,layer=1,bit=3", "unknown site"),
    ("no-such-node", "unknown fault profile"),
])
def test_an_injection_that_cannot_land_is_refused(golden_dir, inject, words):
    # A flip outside the run would let the detector "pass" without having been exercised.
    report = G.check(golden_dir, inject=inject)
    assert report["verdict"] == "INCONCLUSIVE" and words in report["reason"]
