"""The acceptance's golden checks (`sdcstudy accept-gpu --stage quick`): the full workload
recorded and checked on this GPU, the stack fingerprint, and a record made on another GPU
machine checked here.

A record crosses machines in the repository: `golden_other_machine` records the tiny workload
and packs it, with `GPU_FILE` (which GPU made it, by its UUID), into one archive in the
acceptance's `--out` (`KEPT`: one file, as a device machine's outputs come back), which
whoever keeps that run's outputs commits under `RECORDS` (docs/gpu.md). Every later acceptance
on a GPU unpacks each committed archive another GPU made and checks it: the same bits (PASS),
and with one flipped bit (`CROSS_FLIP`) a FAIL at the flip's step, layer and site.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from sdcstudy.gpu import floors as GF
from sdcstudy.gpu import nvidia_smi as SMI
from sdcstudy.gpu.session import ROOT, Session, broke, failure, skipped

RECORDS_DIR = "experiments/golden-records"
RECORDS = ROOT / RECORDS_DIR
KEPT = "golden-record-tiny.tar.gz"  # record/ (the golden folder) and GPU_FILE
GPU_FILE = "gpu.json"
# One exponent bit of one attention output element, and where the check must say it differs.
CROSS_FLIP = "flip:step=3,site=fwd/attn,layer=1,bit=30"
CROSS_FLIP_AT = {"step": 3, "layer": 1, "paper_site": "fwd/attn"}


def pack(record: Path, gpu: dict, archive: Path) -> None:
    """`record` as record/ and `gpu` as GPU_FILE in one gzipped tar."""
    staged = archive.with_suffix(".tmp")
    with tarfile.open(staged, "w:gz") as tar:
        tar.add(record, arcname="record")
        info = tarfile.TarInfo(GPU_FILE)
        data = (json.dumps(gpu, indent=2) + "\n").encode()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    staged.replace(archive)


def committed_records(into: Path, root: Path | None = None) -> list[tuple[str, Path, dict]]:
    """(name, record folder, the GPU that made it) of each archive committed under `RECORDS`,
    unpacked into `into`/NAME."""
    out = []
    for archive in sorted((root or RECORDS).glob("*.tar.gz")):
        name = archive.name[:-len(".tar.gz")]
        with tarfile.open(archive) as tar:
            tar.extractall(into / name, filter="data")
        out.append((name, into / name / "record",
                    json.loads((into / name / GPU_FILE).read_text())))
    return out


class GoldenChecks(Session):
    """The golden checks; `acceptance.run_checks` calls them in their order."""

    def golden_full(self) -> dict:
        """golden record --workload full, then golden check of it once: coverage, seconds,
        bitwise reproducibility."""
        folder, path = self.work / "golden-full", self.work / "golden_full_check.json"
        rec = self.sdcstudy("golden record full", ["golden", "record", "--workload", "full",
                                                   "--out", folder, "--no-progress"], cap=240)
        if "skipped" in rec:
            return rec
        if not self.ran(rec, folder / "golden.json"):
            return broke({"record": rec, "seconds": rec["seconds"]}, failure(rec))
        chk = self.sdcstudy("golden check full", ["golden", "check", folder, "--repeat", 1,
                                                  "--json", path, "--no-progress"], cap=240)
        check_verdict = json.loads(path.read_text())["verdict"] if path.exists() else None
        meta = json.loads((folder / "golden.json").read_text())
        judged = {"record": rec, "check": chk,
                  "seconds": round(rec["seconds"] + chk.get("seconds", 0), 1),
                  **GF.judge_golden_full(meta, rec["seconds"], check_verdict)}
        if check_verdict is None and all(judged[k] for k in ("every_sm", "memory_ok", "time_ok")):
            return broke(judged, f"golden check gave no verdict ({failure(chk)})")
        return judged

    def fingerprint(self) -> dict:
        """The stack fingerprint in env.json of the golden record (or the doctor's run)."""
        for env_file in (self.work / "golden-full" / "env.json",):
            if env_file.exists():
                return {"env_file": str(env_file), **GF.judge_fingerprint(
                    json.loads(env_file.read_text()))}
        doctor = self.work / "doctor.json"
        # a doctor that could not run leaves no "env" (its verdict null)
        env = json.loads(doctor.read_text()).get("env") if doctor.exists() else None
        if env:
            return {"env_file": str(doctor), **GF.judge_fingerprint(env)}
        return skipped("neither the golden record nor the doctor wrote an env.json")

    def golden_other_machine(self) -> dict:
        """The tiny workload recorded and packed into --out (`KEPT`, to commit for the next
        GPU machine), and each committed record another GPU made checked here (module
        docstring)."""
        folder, here = self.work / "golden-tiny", SMI.identity()
        rec = self.sdcstudy("golden record tiny", ["golden", "record", "--out", folder,
                                                   "--no-progress"], cap=120)
        if "skipped" in rec:
            return rec
        if not self.ran(rec, folder / "golden.json"):
            return broke(rec)
        pack(folder, here, self.args.out / KEPT)
        if not here.get("uuid"):
            return broke({"record": rec, "gpu": here, "seconds": rec["seconds"]},
                         f"this GPU's UUID is unknown ({here.get('error', 'nvidia-smi gave none')}"
                         f"): a record another GPU made cannot be told from one made here")
        others = [(name, record, gpu) for name, record, gpu
                  in committed_records(self.work / "golden-cross")
                  if gpu.get("uuid") != here.get("uuid")]
        if not others:
            return skipped(f"no record made by another GPU is committed under {RECORDS_DIR}/ "
                           f"yet; commit this run's {KEPT} there (docs/gpu.md)",
                           record=rec, gpu=here)
        results, seconds = {}, rec["seconds"]
        for name, record, gpu in others:
            reports = []
            for label, extra in (("", []), (" with a flip", ["--inject", CROSS_FLIP])):
                path = self.work / f"golden-cross-{name}{'-flip' if extra else ''}.json"
                run = self.sdcstudy(f"golden check {name}{label}", [
                    "golden", "check", record, *extra, "--json", path, "--no-progress"],
                    cap=120)
                if "skipped" in run:
                    return run
                seconds += run["seconds"]
                if not path.exists():
                    return broke({**run, "seconds": round(seconds, 1)},
                                 f"golden check of {name}{label}: {failure(run)}")
                report = json.loads(path.read_text())
                if report.get("verdict") not in ("PASS", "FAIL"):  # e.g. another stack
                    return broke({**run, "seconds": round(seconds, 1)},
                                 f"golden check of {name}{label}: {report.get('verdict')}, "
                                 f"{report.get('reason')}")
                reports.append(report)
            results[name] = {"made_by": gpu, **GF.judge_golden_cross(*reports, CROSS_FLIP_AT)}
        return {"record": rec, "gpu": here, "records": results, "seconds": round(seconds, 1),
                "pass": all(r["pass"] for r in results.values())}
