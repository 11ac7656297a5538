"""Records you can trust, refused before anything runs: a record other than the one the fleet
keeps (`--expect-sha`), a damaged record file of any kind, a backend that does not start, a
report that cannot be written; and where a FAIL says the node went wrong. No test here compiles
a JAX program: each refusal comes before the workload is built (tests/test_golden.py checks a
real record)."""

import json

import jax
import numpy as np
import pytest

from sdcstudy import cli
from sdcstudy.core import config as C
from sdcstudy.golden import compare as GC
from sdcstudy.golden import contents as GCon
from sdcstudy.golden import manifest as GM
from sdcstudy.golden import report as GRep
from sdcstudy.golden import sizing as GS


def _record(folder, **files):
    """A folder that passes the manifest (files given as text or bytes, sealed): the default
    files are a valid config and environment, and a golden.json and golden.npz that are not
    a record, so that a check of it stops at the first file it reads wrong."""
    folder.mkdir()
    defaults = {GM.CONFIG: C.dump(C.from_dict(GS.TINY)), GM.ENV: json.dumps({"platform": "cpu"}),
                GM.META: "{}", GM.ARRAYS: b"not a zip"}
    for name, data in {**defaults, **files}.items():
        (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return folder, GM.write_manifest(folder)["sha256"]


def _check(capsys, *argv):
    code = cli.main(["golden", "check", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_record_other_than_the_expected_one_is_refused_naming_both(tmp_path, capsys):
    # Whoever can write the folder can write a new manifest that seals changed files; only a
    # SHA-256 kept elsewhere shows it. A sealed record that is not the expected one must be
    # refused (exit 2) in one sentence naming the expected and the found SHA-256, before any
    # file of it is read beyond the manifest.
    folder, found = _record(tmp_path / "swapped")
    expected = "ab" * 32
    code, out, err = _check(capsys, folder, "--expect-sha", expected)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err and found in err
    # The same SHA in capitals is the same SHA; this one gets past the manifest and is
    # refused for its golden.json (not a record), still before anything runs.
    code, _, err = _check(capsys, folder, "--expect-sha", found.upper())
    assert code == 2 and "golden.json" in err and "SHA-256" not in err


@pytest.mark.parametrize("value", ["", "abc", "g" * 64, "ab" * 33])
def test_an_expected_sha_that_is_not_one_is_refused(tmp_path, capsys, value):
    # An empty or cut value must not silently turn the comparison off.
    code, _, err = _check(capsys, tmp_path, "--expect-sha", value)
    assert code == 2 and "--expect-sha must be the 64 hexadecimal digits" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("files, words", [
    ({GM.CONFIG: "experiment: [1, 2\n"}, "is not valid YAML"),
    ({GM.CONFIG: "experiment:\n  name: !!python/object/apply:os.system ['true']\n"},
     "holds the tag !!python/object/apply:os.system"),
    ({GM.CONFIG: "- 1\n- 2\n"}, "must be a mapping"),
    ({GM.CONFIG: C.dump(C.from_dict(GS.TINY, ["experiment.mode=paired"]))},
     "experiment.mode must be 'train'"),
    ({GM.ENV: "[1, 2]"}, "env.json in"),
    ({GM.ENV: "{}"}, "env.json in"),
    ({GM.META: '"a string"'}, "golden.json in"),
    ({GM.META: "[]"}, "golden.json in"),
    ({GM.META: "{not json"}, "golden.json in"),
], ids=["yaml-syntax", "python-tag", "yaml-list", "not-train", "env-list", "env-no-platform",
        "meta-string", "meta-list", "meta-not-json"])
def test_a_damaged_record_file_is_one_sentence_and_exit_2(tmp_path, capsys, files, words):
    # Each file of a record read as root on every node: a file of the wrong kind is a damaged
    # record (bad input, exit 2) in one sentence, never a traceback and never exit 1 or 3.
    folder, _ = _record(tmp_path / "record", **files)
    code, out, err = _check(capsys, folder, "--device", "all", "--json", tmp_path / "r.json")
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith("sdcstudy: error: ") and words in err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "INCONCLUSIVE" and report["failed_stage"] == "golden"


def test_an_unwritable_report_leaves_the_verdict_and_its_code(tmp_path, capsys):
    # A report asked for in a folder that cannot be written (here a path through a file; a
    # read-only or full folder raises the same OSError) must not turn the verdict into a
    # crash: the verdict first, then one warning naming the file, and the verdict's code.
    (tmp_path / "file").write_text("")
    unwritable = tmp_path / "file" / "r.json"
    code, _, err = _check(capsys, tmp_path / "nowhere", "--json", unwritable,
                          "--junit", tmp_path / "r.xml")
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith("sdcstudy: error: golden folder") and "does not exist" in lines[0]
    assert lines[1].startswith("sdcstudy: warning:") and str(unwritable) in lines[1]
    assert (tmp_path / "r.xml").is_file()


def _a_record():
    """A record as `open_record` returns it (for the commands that take one), not a real one."""
    return GCon.Golden(GM.Path("g"), "0" * 64, C.from_dict(GS.TINY), {"platform": "cpu"},
                       {"workload": "tiny"}, {})


@pytest.mark.parametrize("device", ["all", "0"])
def test_a_backend_that_does_not_start_could_not_run(monkeypatch, capsys, device):
    # A driver that fails to load is no verdict on the node (never 1, never INCONCLUSIVE's 2):
    # exit 3, one sentence.
    def broken():
        raise AssertionError("no visible device")

    monkeypatch.setattr(GCon, "open_record", lambda *a, **k: _a_record())
    monkeypatch.setattr(jax, "local_devices", broken)
    code, out, err = _check(capsys, "g", "--device", device)
    assert code == 3, err
    assert err.count("\n") == 1 and "the accelerator backend did not start" in err
    assert "AssertionError: no visible device" in err


# --- the first difference: the first block, and every scalar compared --------------------------


def test_a_digest_reports_its_first_differing_block_and_how_many():
    # Two blocks of one site's digest differ: the report must name the first (where the
    # corruption began in memory order), not the last, and count both.
    expected = np.arange(64 * 2, dtype=np.uint32).reshape(64, 2)
    observed = expected.copy()
    observed[40, 1] ^= 1
    observed[5, 0] ^= 1
    observed[57, 0] ^= 1
    shape = (4, 64, 64)
    entry = GC._blocks({"expected": expected, "observed": observed}, shape)
    assert entry["block"]["index"] == 5 and entry["differing_blocks"] == 3
    assert (entry["block"]["flat_start"], entry["block"]["flat_stop"]) == (5 * 256, 6 * 256)
    assert entry["block"]["start"] == [0, 20, 0]
    chunk = GC._coverage_entry({"name": "memory", "expected": expected,
                                "observed": observed}, {})
    assert (chunk["chunk"], chunk["differing_chunks"]) == (5, 3)


def test_the_gradient_norm_is_compared_to_the_bit():
    # A step whose gradient norm alone differs (the loss, every site and parameter equal) is a
    # difference, reported exactly: a check that dropped it would pass a node whose
    # gradients are corrupted after the last digested site.
    meta = {"site_order": [], "microsteps": 2, "params": {}}
    arrays = {"loss": np.array([7, 8], np.uint32),
              "grad_norm": np.array([0x3F800000, 0x40000000], np.uint32)}
    out = {"fwd": {}, "bwd": {}, "params": {}, "loss": np.uint32(8),
           "grad_norm": np.uint32(0x40000000 ^ (1 << 3))}
    (found,) = GC.step_differences(2, out, arrays, meta)
    entry = GC.describe(found, 2, meta, arrays, None)
    assert (entry["kind"], entry["exact"], entry["differing_bits"]) == ("grad_norm", True, [3])
    assert entry["expected"] == 2.0
    assert "grad_norm is 0x40000008" in GRep._sentence(entry)
    out["grad_norm"] = np.uint32(0x40000000)
    assert GC.step_differences(2, out, arrays, meta) == []


@pytest.mark.parametrize("site", ["grad", "collective/all_gather", "collective/reduce_scatter"])
def test_a_flip_outside_the_models_sites_is_one_sentence(site):
    # A flip strikes a forward or backward model site; the golden device has no gradient tree
    # to strike and no tensor parallelism, so its collectives have no wire: one sentence that
    # says so, not a later error about layers.
    from sdcstudy.core.errors import UserError
    from sdcstudy.golden import workload
    with pytest.raises(UserError, match="a flip strikes a model site"):
        workload.parse_injection(f"flip:step=1,site={site},layer=1,bit=3")


def test_a_flip_at_a_site_outside_the_blocks_takes_no_layer():
    # The logits lie outside the blocks: layer=1 was refused as "remove layers", a field the
    # user never typed; layer=0 (where faults.parquet records such a site) is accepted.
    from sdcstudy.core.errors import UserError
    from sdcstudy.golden import workload
    with pytest.raises(UserError, match="fwd/logits lies outside the blocks, so it takes no "
                                        "layer=; remove layer=1"):
        workload.parse_injection("flip:step=1,site=fwd/logits,layer=1,bit=3")
    assert workload.parse_injection("flip:step=1,site=fwd/logits,bit=3").profile.specs
