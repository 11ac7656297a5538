"""Golden-run pre-admission tests: a clean node passes, every corruption fails where it began,
and a check that could not verify anything is never a PASS."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy import cli
from sdcstudy.core import determinism
from sdcstudy.faults import specs as FS
from sdcstudy.core.errors import UserError
from sdcstudy.golden import check as G
from sdcstudy.golden import compare as GC
from sdcstudy.golden import coverage as GCov
from sdcstudy.golden import digest as GD
from sdcstudy.golden import manifest as GM
from sdcstudy.golden import record as GR
from sdcstudy.golden import report as GRep
from sdcstudy.golden import sizing as GS
from sdcstudy.golden import telemetry as GT
from sdcstudy.core import sites as S

# Single-bit flips, each its own check. Sampled once with a fixed seed so that a failure can be
# replayed; `experiments/golden_flips.py` runs 50 of them.
N_FLIPS = 2


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "tiny"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["golden", "record", "--out", str(out), "--no-progress"]) == 0
    (out.parent / "record.txt").write_text(printed.getvalue())  # what the recorder saw
    return out


def _sha(golden_dir):
    """The manifest SHA-256 of a record, computed here from its body (not the one it claims)."""
    return GM.body_sha256(json.loads((golden_dir / GR.MANIFEST).read_text())["body"])


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


def test_a_record_that_cannot_be_written_could_not_run_and_leaves_nothing(
        golden_dir, tmp_path, monkeypatch, capsys):
    # A disk that fills while the record is written is not bad input: exit 3 (could not run),
    # as for a run folder that cannot be written (docs/golden.md, exit codes), and no file of
    # the unfinished record is left. If this fails, a full disk read as a fixable argument (2)
    # or left a half record. (The workload compiled for golden_dir is reused: only a run.)
    import errno

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(GR.RF, "atomic_write_bytes", full)
    out = tmp_path / "record"
    code = cli.main(["golden", "record", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "could not write the golden record" in err and "nothing of it was kept" in err
    names = (GR.CONFIG, GR.ENV, GR.META, GR.ARRAYS, GR.MANIFEST)
    assert not [name for name in names if (out / name).exists()]


def test_clean_node_passes_every_repetition(golden_dir, tmp_path):
    # The same machine, another simulated device, three repetitions: every step of every
    # repetition must be bitwise equal (if not, the golden step is not deterministic, or the
    # device index leaks into the program).
    code = cli.main(["golden", "check", str(golden_dir), "--repeat", "3", "--device", "1",
                     "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"),
                     "--no-progress", "--expect-sha", _sha(golden_dir)])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and report["verdict"] == "PASS", report["reason"]
    assert [r["verdict"] for r in report["repetitions"]] == ["PASS"] * 3
    assert all(r["steps_compared"] == report["golden"]["steps"] for r in report["repetitions"])
    assert report["device"]["index"] == 1 and report["env"]["differences"] == []
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("errors"), suite.get("tests")) == ("0", "0", "6")
    assert report["golden"]["manifest_sha256"] == _sha(golden_dir)


def test_a_check_shows_its_compile_before_its_steps(golden_dir, capsys):
    # A full record's workload compiles for a while on a GPU: the check counts its seconds on
    # one line (stderr) before its step bar, and the verdict (stdout) is unchanged.
    code = cli.main(["golden", "check", str(golden_dir), "--device", "1"])
    out, err = capsys.readouterr()
    assert code == 0 and "PASS" in out
    line = "golden check: preparing and compiling the workload: 00:"
    assert line in err and err.index(line) < err.index("step/s")
    assert "compiling" not in out


def test_the_acceptances_cross_machine_flip_is_found_where_it_was_put(golden_dir):
    """`accept-gpu`'s golden_other_machine checks another GPU's record plainly and with
    `CROSS_FLIP`, and its judge reads both reports: PASS, then FAIL at the flip's step, layer
    and site (`floors.judge_golden_cross`)."""
    from sdcstudy.gpu import floors as GF
    from sdcstudy.gpu import golden_checks as GGC

    reports = [G.check(golden_dir, device_index=1, inject=inject)
               for inject in (None, GGC.CROSS_FLIP)]
    judged = GF.judge_golden_cross(*reports, GGC.CROSS_FLIP_AT)
    assert judged["pass"] is True, judged


def test_record_prints_the_sha_that_check_expects(golden_dir):
    # The fleet keeps what `golden record` printed and passes it to --expect-sha: it must be
    # all 64 digits of the SHA-256 that the check computes, as a ready option.
    printed = (golden_dir.parent / "record.txt").read_text()
    assert f"--expect-sha {_sha(golden_dir)} " in printed


def test_an_unwritable_report_after_a_pass_leaves_the_pass(golden_dir, tmp_path, capsys):
    # The check PASSed, then a traceback and exit 1 drained a healthy node: the verdict must
    # be printed first, the report that cannot be written one warning, the exit code PASS's.
    # (The program of the clean check above, compiled once.)
    (tmp_path / "file").write_text("")
    code = cli.main(["golden", "check", str(golden_dir), "--device", "1", "--no-progress",
                     "--json", str(tmp_path / "file" / "r.json"),
                     "--junit", str(tmp_path / "file" / "r.xml")])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("golden check PASS"), err
    warnings = err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("sdcstudy: warning: could not write the ")
                                      for w in warnings)
    assert str(tmp_path / "file" / "r.json") in warnings[0]


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


def test_a_difference_in_the_optimizer_state_alone_fails(golden_dir, monkeypatch):
    # A flipped bit of Adam's second moment in the final state changes no step's digest and no
    # parameter; a PASS would call the node bitwise equal to the record while it is not. The
    # check must FAIL at the last step, naming the tensor.
    from sdcstudy.golden import workload as GW

    meta = json.loads((golden_dir / GR.META).read_text())
    (nu,) = [k for k in meta["final_state_sha256"] if k.endswith("/nu/head")]
    clean = GW.Workload.run

    def flip_nu(path, leaf):
        if GW.path_name(path) != nu.removeprefix("opt_state/"):
            return leaf
        bits = jax.lax.bitcast_convert_type(leaf, jnp.uint32)
        return jax.lax.bitcast_convert_type(bits.at[0, 0].set(bits[0, 0] ^ 1), jnp.float32)

    def run(self):
        for step, out, state in clean(self):
            if step == self.steps:
                state = {**state, "opt_state": jax.tree_util.tree_map_with_path(
                    flip_nu, state["opt_state"])}
            yield step, out, state

    monkeypatch.setattr(GW.Workload, "run", run)
    report = G.check(golden_dir, device_index=1)
    assert report["verdict"] == "FAIL", report["reason"]
    first = report["first_difference"]
    assert (first["step"], first["kind"], first["differing_tensors"]) == (
        meta["steps"], "optimizer state", [nu])
    assert "optimizer state" in report["reason"]


def test_a_record_without_the_optimizer_states_sha_says_what_its_pass_compared(golden_dir,
                                                                               tmp_path):
    # A record made before it held the optimizer state's SHA-256 is still checked, and its
    # PASS must not claim the whole state equal.
    target = _copy(golden_dir, tmp_path)
    meta = json.loads((target / GR.META).read_text())
    del meta["final_state_sha256"]
    (target / GR.META).write_text(json.dumps(meta))
    GR.write_manifest(target)
    report = G.check(target, device_index=1)
    assert report["verdict"] == "PASS", report["reason"]
    assert "no SHA-256 of the optimizer state" in report["reason"]
    assert report["repetitions"][0]["state_compared"] is False


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


def _arrays(folder):
    with np.load(folder / GR.ARRAYS) as npz:
        return {k: npz[k] for k in npz.files}


def _cut_to_one_step(folder):
    """What the issue did: config, golden.json and arrays cut to the first step, consistent."""
    config = (folder / GR.CONFIG).read_text().replace("steps: 6", "steps: 1", 1)
    assert "steps: 1" in config
    (folder / GR.CONFIG).write_text(config)
    meta = json.loads((folder / GR.META).read_text())
    meta.update(steps=1, full_param_steps=[1], loss=meta["loss"][:1])
    (folder / GR.META).write_text(json.dumps(meta))
    arrays = _arrays(folder)
    cut = {k: v[:2] if k.startswith("params/") else v[:1] for k, v in arrays.items()
           if not k.startswith("full/")}
    cut.update({k: v for k, v in arrays.items() if k.startswith("full/1/")})
    with open(folder / GR.ARRAYS, "wb") as f:
        np.savez_compressed(f, **cut)


def test_a_resealed_record_is_refused_by_the_sha_the_fleet_keeps(golden_dir, tmp_path, capsys):
    # A record cut to 1 step and sealed again is consistent with itself, and PASSed ("1
    # repetition(s) of 1 steps") where the fleet's covers 6. With the SHA-256 the fleet kept
    # it is refused, naming both, before anything runs.
    target = _copy(golden_dir, tmp_path)
    _cut_to_one_step(target)
    GR.write_manifest(target)
    code = cli.main(["golden", "check", str(target), "--expect-sha", _sha(golden_dir),
                     "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 2 and report["failed_stage"] == "golden", err
    assert _sha(golden_dir) in err and _sha(target) in err and err.count("\n") == 1


def _lying_member(name, shape):
    """A .npy member whose header declares `shape` (uint32) and holds 16 bytes of data."""
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<u4", "fortran_order": False,
                                                 "shape": shape})
    return name + ".npy", member.getvalue() + bytes(16)


def _npy(array):
    member = io.BytesIO()
    np.save(member, array)
    return member.getvalue()


def _with_member(folder, name, data):
    """golden.npz with member `name` added or replaced by raw `data`."""
    kept = {k: v for k, v in _arrays(folder).items() if f"{k}.npy" != name}
    with open(folder / GR.ARRAYS, "wb") as f:
        np.savez_compressed(f, **kept)
    with zipfile.ZipFile(folder / GR.ARRAYS, "a", zipfile.ZIP_DEFLATED) as npz:
        npz.writestr(name, data)


def _config_steps(folder, steps):
    text = (folder / GR.CONFIG).read_text()
    (folder / GR.CONFIG).write_text(text.replace("steps: 6", f"steps: {steps}", 1))


def _drop_param(folder):
    meta = json.loads((folder / GR.META).read_text())
    meta["params"].pop("head")
    (folder / GR.META).write_text(json.dumps(meta))


def _empty_state_sha(folder):
    meta = json.loads((folder / GR.META).read_text())
    meta["final_state_sha256"] = {}  # present but empty would compare nothing
    (folder / GR.META).write_text(json.dumps(meta))


@pytest.mark.parametrize("change, words", [
    (lambda d: _with_member(d, "junk.npy", _npy(np.zeros(16 << 20, np.uint32))),
     "1 not expected, first ['junk']"),
    (lambda d: _with_member(d, *_lying_member("loss", (1 << 28,))),
     "array loss is uint32 (268435456,), its config implies uint32 (6,)"),
    (lambda d: _with_member(d, *_lying_member("grad_norm", (6,))), "grad_norm is cut short"),
    (lambda d: _config_steps(d, 5), "6 steps of 2 microsteps, the config says 5 of 2"),
    (_drop_param, "106816"),
    (_empty_state_sha, "the final optimizer state's SHA-256 are not SHA-256 digests"),
], ids=["extra-member", "lying-header", "cut-member", "steps", "parameters", "state-sha"])
def test_a_record_inconsistent_with_its_config_is_refused_before_running(
        golden_dir, tmp_path, capsys, change, words):
    # Sealed again (so the manifest agrees), each record describes other arrays than its
    # config and golden.json imply: refused in one sentence before anything is decompressed
    # beyond what the config implies, and before anything compiles (a 64 MiB member of zeros
    # was decompressed once per device, a header may claim any size).
    target = _copy(golden_dir, tmp_path)
    change(target)
    GR.write_manifest(target)
    code = cli.main(["golden", "check", str(target), "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 2 and report["failed_stage"] == "golden", err
    assert words in err and err.count("\n") == 1


def test_the_record_is_read_once_for_every_device(golden_dir, monkeypatch, capsys):
    # `--device all` decompressed golden.npz once per device; one copy serves them all. (The
    # workload is stopped before it compiles: what is counted is the reading.)
    opened = []
    real = zipfile.ZipFile.__init__

    def counting(self, file, *args, **kwargs):
        if not str(file).endswith(".zip"):  # Python's own zipped library is no record
            opened.append(file)
        real(self, file, *args, **kwargs)

    def no_workload(*args, **kwargs):
        raise RuntimeError("not built in this test")

    monkeypatch.setattr(zipfile.ZipFile, "__init__", counting)
    monkeypatch.setattr(G, "workload", no_workload)
    code = cli.main(["golden", "check", str(golden_dir), "--device", "all", "--workers", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and "8 device(s), 8 not PASS" in out
    # Each device's verdict on stdout as it comes, the count of devices done on stderr.
    assert out.count(": INCONCLUSIVE (") == 8 and "golden check: 8/8 devices done [" in err
    assert "could not build the golden workload: RuntimeError" in out
    assert len(opened) == 1


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


# --- the fingerprint: what a check compares on each platform ----------------------------------


def _env(platform, **changes):
    """A synthetic env.json of `platform` with some fields changed."""
    env = {"packages": {"jax": "0.10.2"}, "xla_flags": "--xla_gpu_deterministic_ops=true",
           "platform": platform, "device_kinds": {"NVIDIA H100 80GB HBM3": 1},
           "device_count": 1, "local_device_count": 1, "process_count": 1,
           "cpu": {"model": "AMD EPYC 9654", "isa": ["avx2"], "cores": 192},
           "gpu_stack": {"driver": "570.124.06", "cuda_runtime": 12080, "cublas": 120804,
                         "cudnn": 90800, "nccl": 22603},
           "backend_version": "PJRT C API\ncuda 12080", "compiled_step_sha256": "a" * 64}
    for name, value in changes.items():
        env[name] = dict(env[name], **value) if isinstance(value, dict) else value
    return env


def test_a_changed_cuda_library_is_inconclusive_and_named():
    # Another cuBLAS may compute other bits with the same program text: a check must say it
    # cannot tell (the field and both versions, and to re-record), never FAIL the node.
    golden, observed = _env("gpu"), _env("gpu", gpu_stack={"cublas": 120900})
    differences = GC.env_differences(golden, observed)
    assert differences == [{"field": "gpu_stack.cublas", "golden": 120804,
                            "observed": 120900}]
    sentence = GC.env_sentence(differences)
    assert "gpu_stack.cublas 120804 -> 120900" in sentence and "record a golden run" in sentence


def test_the_host_cpu_matters_on_cpu_only():
    # On a GPU node the host CPU computes none of the GPU's bits: another CPU model must not
    # make a check INCONCLUSIVE. On CPU it is what computes the bits, so it must.
    other_cpu = {"cpu": {"model": "Intel Xeon 8480", "isa": ["avx512f"]}}
    assert GC.env_differences(_env("gpu"), _env("gpu", **other_cpu)) == []
    assert {d["field"] for d in GC.env_differences(_env("cpu"), _env("cpu", **other_cpu))} == {
        "cpu.model", "cpu.isa"}
    # ... and the GPU stack of a CPU record is not compared (a CPU's bits do not use it).
    assert GC.env_differences(_env("cpu"), _env("cpu", gpu_stack={"driver": "1"})) == []


def test_the_cores_a_check_may_run_on_are_compared_where_the_record_has_them():
    # XLA:CPU sizes its thread pool by the process's CPU affinity and compiles another program
    # for another size: a CPU check confined to fewer cores must say so, not a program hash.
    golden = _env("cpu", cpu={"schedulable_cores": 8})
    differences = GC.env_differences(golden, _env("cpu", cpu={"schedulable_cores": 1}))
    assert differences == [{"field": "cpu.schedulable_cores", "golden": 8, "observed": 1}]
    # A record made before env.json held the field is not compared on it (its compiled step's
    # hash still is); one holding it is compared even against an observer without it.
    assert GC.env_differences(_env("cpu"), _env("cpu", cpu={"schedulable_cores": 1})) == []
    assert len(GC.env_differences(golden, _env("cpu"))) == 1


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2,
                    reason="needs a process that may run on two cores or more")
def test_a_check_on_fewer_cores_than_its_record_stops_before_compiling(golden_dir, tmp_path):
    # The real thing: the same record checked by a process confined to one core.
    here = determinism.schedulable_cores()
    env = json.loads((golden_dir / "env.json").read_text())
    assert env["cpu"]["schedulable_cores"] == here
    one_core = min(os.sched_getaffinity(0))
    check = [sys.executable, "-m", "sdcstudy", "golden", "check", str(golden_dir),
             "--no-progress", "--json", str(tmp_path / "check.json")]
    confined = (f"import os, sys; os.sched_setaffinity(0, {{{one_core}}}); "
                f"os.execv(sys.executable, {check!r})")
    done = subprocess.run([sys.executable, "-c", confined], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cpu.schedulable_cores {here} -> 1" in done.stdout + done.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["failed_stage"] == "environment"  # stopped before the workload was built


def test_flags_that_only_say_how_long_to_wait_are_not_compared():
    # A record made before the CLI set its rendezvous patience (or a check with another
    # collective timeout) is the same environment; a flag that changes code generation is not.
    waits = " ".join(f"{flag}=600" for flag in determinism.WAIT_XLA_FLAGS)
    golden = _env("cpu")
    waited = _env("cpu", xla_flags=f"{waits} {golden['xla_flags']}")
    assert GC.env_differences(golden, waited) == []
    fast_math = _env("cpu", xla_flags=f"{golden['xla_flags']} --xla_cpu_enable_fast_math=true")
    assert [d["field"] for d in GC.env_differences(golden, fast_math)] == ["xla_flags"]


def test_pinned_kernel_choices_are_compared_by_content(tmp_path):
    # The autotuning results a node loads decide its kernels: the same file in another place
    # is the same stack; another file's content is not.
    results, copy, other = (tmp_path / n for n in ("a.txt", "b.txt", "c.txt"))
    results.write_text("gemm tiles 128x128\n")
    copy.write_text("gemm tiles 128x128\n")
    other.write_text("gemm tiles 64x128\n")

    def env(path):
        flags = f"--xla_gpu_deterministic_ops=true {determinism.AUTOTUNE_FLAG}={path}"
        return _env("gpu", xla_flags=flags, gpu_stack=determinism.autotune_results(flags))

    assert len(env(results)["gpu_stack"]["autotune_results_sha256"]) == 64
    assert GC.env_differences(env(results), env(copy)) == []
    assert [d["field"] for d in GC.env_differences(env(results), env(other))] == [
        "gpu_stack.autotune_results_sha256"]


def test_driver_version_is_read_from_the_kernel_module(tmp_path, monkeypatch):
    # The driver file's two spellings (proprietary and open kernel module); no file, no driver.
    path = tmp_path / "version"
    monkeypatch.setattr(determinism, "NVIDIA_DRIVER_FILE", path)
    assert determinism.nvidia_driver() is None
    path.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Thu Feb 20\n")
    assert determinism.nvidia_driver() == "570.124.06"
    path.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.51.03  "
                    "Release Build\n")
    assert determinism.nvidia_driver() == "575.51.03"


# --- the full workload: sizing, coverage report, record and check -------------------------------


GPUS = [GS.DeviceDescription("gpu", "NVIDIA H100 80GB HBM3", 132, 80 * 2**30,
                             ("bfloat16", "tf32", "float32")),
        GS.DeviceDescription("gpu", "NVIDIA H200", 132, 141 * 10**9,
                             ("bfloat16", "tf32", "float32"))]


@pytest.mark.parametrize("device", GPUS, ids=lambda d: d.kind)
def test_full_workload_fills_every_sm_and_most_memory(device):
    # Each main product must launch at least 4 waves of 128x128 thread blocks over all SMs
    # (else some SMs do little or nothing), the buffer must be 70-75% of the device's memory
    # (the default share), and the model must run in bfloat16 where the device has it.
    sizing = GS.size_full(device)
    for name, tiles in sizing.tiles().items():
        assert tiles >= GS.WAVES * device.sms, name
    assert 0.70 <= sizing.buffer_bytes / device.memory_bytes <= GS.MEMORY_SHARE
    assert sizing.dtype == "bfloat16" and sizing.min_seconds >= 60
    assert sizing.d_model % GS.TILE == 0 and sizing.tokens % GS.TILE == 0
    assert GS.size_full(device, 0.5).buffer_bytes < sizing.buffer_bytes
    with pytest.raises(UserError, match="--memory-share"):
        GS.size_full(device, 0.95)


def test_a_full_check_repeats_for_its_minimum_only_where_no_count_or_duration_is_given():
    # On a GPU a full record's check repeats for at least min_seconds (clocks settle), unless
    # --repeat or --duration says otherwise: an explicit --repeat 1 is one repetition (an
    # H200 ran 35 for `--repeat 1`, 61 s, before), --duration its minutes from the start.
    from types import SimpleNamespace

    gpu_sizing = SimpleNamespace(min_seconds=60.0)
    before = G.time.perf_counter()
    deadline = G._deadline(0.0, None, None, gpu_sizing)
    assert deadline is not None and deadline - before >= 60.0
    assert G._deadline(0.0, None, 1, gpu_sizing) is None
    assert G._deadline(0.0, None, 3, gpu_sizing) is None
    assert G._deadline(10.0, 2.0, None, gpu_sizing) == 130.0
    assert G._deadline(0.0, None, None, SimpleNamespace(min_seconds=0.0)) is None
    assert G._deadline(0.0, None, None, None) is None


@pytest.mark.parametrize("argv, repeat", [([], None), (["--repeat", "1"], 1),
                                          (["--repeat", "4"], 4)])
def test_golden_check_hands_the_repeat_count_as_given(golden_dir, monkeypatch, argv, repeat):
    # "Not given" must reach the check as None (the full workload's minimum then applies), an
    # explicit count as itself.
    seen = []

    def captured(golden, **options):
        seen.append(options)
        raise RuntimeError("stop here")  # the command line reports it, exit 3

    monkeypatch.setattr(G, "check", captured)
    assert cli.main(["golden", "check", str(golden_dir), "--no-progress", *argv]) == 3
    assert [options["repeat"] for options in seen] == [repeat]


def test_full_workload_on_a_simulated_cpu_device_is_small():
    # CPU tests must stay in seconds: a one-layer model of width 128 and a 24 MiB buffer.
    sizing = GS.size_full(GS.CPU_DESCRIPTION)
    assert (sizing.d_model, sizing.n_layers, sizing.min_seconds) == (128, 1, 0.0)
    assert sizing.buffer_bytes == 24 * 2**20 and sizing.tokens == 512


def test_kernel_grids_measure_sm_reach_and_nothing_else():
    # SM reach comes from the launch grids of tensor-core kernels in a trace; a trace without
    # them leaves it unmeasured (never an estimate shown as a measurement).
    assert GT.grid_blocks("regs:128 grid:66,8,1 block:256,1,1") == 528
    assert GT.grid_blocks("grid_x:12 grid_y:11 grid_z:1 block_x:128") == 132
    assert GT.grid_blocks("regs:32 block:128,1,1") is None
    launches = [("sm90_xmma_gemm_bf16bf16_bf16f32", 544, 2.0),
                ("cutlass_80_tensorop_s1688gemm", 64, 1.0), ("loop_add_fusion", 9000, 5.0)]
    reach = GT.sm_reach(launches, 132)
    assert (reach["measured"], reach["reached"], reach["widest_grid_ctas"]) == (True, 132, 544)
    assert reach["time_share_of_grids_filling_every_sm"] == pytest.approx(2 / 3)
    assert GT.sm_reach(launches[:2], 1000)["reached"] == 544
    assert GT.sm_reach(launches[2:], 132) == {"measured": False, "sms": 132, "reached": None,
                                              "why": "the trace has no tensor-core kernel "
                                                     "with a launch grid"}


def test_clock_samples_and_smi_lines():
    # nvidia-smi's '[N/A]' is None, not 0; full clocks means >= 90% of the maximum SM clock.
    values = GT.parse_smi_csv("1980, 1980, 2619, 690.5, 61, 0, [N/A], 0, No")
    assert values["power_w"] == 690.5 and values["ecc_uncorrected_volatile"] is None
    samples = [{"sm_clock_mhz": c, "max_sm_clock_mhz": 1980} for c in (345, 1785, 1980)]
    assert GT.seconds_at_full_clocks(samples, 1.0) == 2.0


def test_memory_digest_localizes_a_flipped_bit():
    # One flipped bit in the buffer must change both lanes of exactly its chunk's digest, so a
    # check names the chunk (and its bytes) where memory went wrong.
    buffer = np.asarray(jax.jit(GCov._mix)(np.arange(4 * 1024, dtype=np.uint32))).reshape(4, 1024)
    clean = np.asarray(jax.jit(GCov.chunk_digest)(buffer))
    flipped = buffer.copy()
    flipped[2, 777] ^= np.uint32(1 << 19)
    differ = np.asarray(jax.jit(GCov.chunk_digest)(flipped)) != clean
    assert differ.any(-1).tolist() == [False, False, True, False] and differ[2].all()


@pytest.mark.parametrize("chunks", [2, 3, 7])
def test_the_buffer_read_back_in_blocks_keeps_every_bit(monkeypatch, chunks):
    """`sweep` reads the buffer in blocks of BLOCK_CHUNKS (here 3: no full block, one, two and
    a rest) and rewrites it after: bit for bit the whole-buffer digest and next pattern."""
    monkeypatch.setattr(GCov, "BLOCK_CHUNKS", 3)
    buffer = np.asarray(jax.jit(GCov._mix)(np.arange(chunks * 512, dtype=np.uint32)))
    buffer = buffer.reshape(chunks, 512)
    salt = np.uint32(0x9E3779B9)
    pattern, digest = jax.jit(GCov.sweep)(buffer, salt)
    np.testing.assert_array_equal(np.asarray(digest), np.asarray(GCov.chunk_digest(buffer)))
    np.testing.assert_array_equal(np.asarray(pattern), np.asarray(GCov._mix(buffer ^ salt)))


def test_the_full_workload_step_keeps_no_buffer_sized_temporary(monkeypatch):
    """The buffer is most of the device's memory, so the compiled coverage step may hold no
    second copy of it (an H200 ran out of memory asking for one): XLA:CPU's own measure of
    the step's temporaries stays under the buffer's size (written over the whole buffer at
    once it kept two buffers' worth; read in blocks, two blocks' worth of digest lanes)."""
    from sdcstudy.golden.sizing import CHUNK_WORDS, DeviceDescription, size_full

    monkeypatch.setattr(GCov, "BLOCK_CHUNKS", 5)  # three blocks and one chunk
    description = DeviceDescription("cpu", "cpu", sms=1, memory_bytes=22 * CHUNK_WORDS * 4,
                                    dtypes=("bfloat16", "float32"))
    sizing = size_full(description)
    assert sizing.buffer_chunks == 16
    device = jax.devices("cpu")[0]
    compiled = jax.jit(GCov.step, donate_argnums=0).lower(
        GCov.abstract_state(sizing, device), jnp.uint32(1)).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= sizing.buffer_bytes  # rewritten in place
    assert memory.temp_size_in_bytes < sizing.buffer_bytes


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "full"
    assert cli.main(["golden", "record", "--workload", "full", "--out", str(out),
                     "--no-progress"]) == 0
    return out


def test_full_workload_checks_bitwise_and_reports_its_coverage(full_dir, tmp_path, capsys):
    # The full workload (model in bfloat16, float32 products, memory buffer) must be as
    # deterministic as the tiny one, and its report must say what it covered: the buffer's
    # share of the (simulated) device, the units, and on CPU that SM reach and clocks are not
    # available rather than numbers.
    code = cli.main(["golden", "check", str(full_dir), "--json", str(tmp_path / "r.json"),
                     "--no-progress"])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and report["verdict"] == "PASS", report["reason"]
    _, _, meta, arrays = G.load(full_dir)
    assert meta["workload"] == "full" and arrays["coverage/memory"].shape == (3, 6, 2)
    coverage = report["coverage"]
    assert coverage["memory"]["bytes"] == 24 * 2**20 and coverage["memory"]["share"] == 0.75
    assert coverage["sms"]["measured"] is False and "not available on cpu" in \
        coverage["sms"]["why"]
    assert coverage["device"]["before"] == "not available on cpu"
    assert "float32 products at HIGHEST precision" in coverage["units"]
    line = [ln for ln in capsys.readouterr().out.splitlines() if "coverage (full)" in ln]
    assert len(line) == 1 and "75% of 32 MiB memory written and verified" in line[0]


def test_full_workload_fails_where_a_flip_landed(full_dir):
    # A bit flipped in the bfloat16 model must FAIL at its step, microstep, layer and site.
    report = G.check(full_dir, inject="flip:step=2,site=fwd/attn,layer=1,bit=14")
    assert report["verdict"] == "FAIL", report["reason"]
    first = report["first_difference"]
    assert (first["step"], first["microstep"], first["layer"], first["site"]) == (
        2, 0, 1, "fwd/attn_out")


def test_a_memory_difference_is_named_by_chunk(full_dir):
    # A wrong word read back from the buffer is reported by chunk and byte range, after the
    # model's sites and before the loss.
    _, _, meta, arrays = G.load(full_dir)
    step = 2
    out = {d: {k: arrays[f"{d}/{k}"][step - 1] for k in meta["site_order"]}
           for d in ("fwd", "bwd")}
    out["coverage"] = {n: arrays[f"coverage/{n}"][step - 1].copy()
                       for n in meta["coverage_digests"]}
    out["params"] = {p: arrays[f"params/{p}"][step] for p in meta["params"]}
    out["loss"], out["grad_norm"] = arrays["loss"][step - 1], arrays["grad_norm"][step - 1]
    out["coverage"]["memory"][4] += np.uint32(1)
    (found,) = GC.step_differences(step, out, arrays, meta)
    entry = GC.describe(found, step, meta, arrays, None)
    assert (entry["kind"], entry["chunk"], entry["of"]) == ("memory", 4, 6)
    assert entry["byte_start"] == 4 * 4 * GS.CHUNK_WORDS
    assert "chunk 4 of 6" in GRep._sentence(entry)
