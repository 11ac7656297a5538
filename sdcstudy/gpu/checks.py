"""The checks of `sdcstudy accept-gpu`, one method each: every check runs sdcstudy (or the
torch contender) in a child process (`session.Session`) and reads what the child wrote into
figures and a verdict (`floors` judges them; `nvidia_smi` reads the device's state).
"""

from __future__ import annotations

import json
from pathlib import Path

from sdcstudy.gpu import floors as GF
from sdcstudy.gpu import nvidia_smi as SMI
from sdcstudy.gpu.free_step import FreeStepChecks
from sdcstudy.gpu.golden_checks import GoldenChecks
from sdcstudy.gpu.session import ROOT, broke, child_env, failure, skipped, with_flags
from sdcstudy.gpu.session import without_determinism

DTYPES = ("float32", "bfloat16")
# bench train's workloads: (preset, sequences per step, tokens per sequence, timed steps,
# repetitions); the 1B model at 8 x 512 fits an 80 GB card in float32.
MEDIUM = ("medium", 32, 512, 10, 3)
ONE_B = (GF.ONE_B, 8, 512, 5, 3)
# llama3-8b-16l (about 4.9 billion parameters): in bfloat16 with float32 parameters and Adam,
# about 80 GB before activations, so 4 x 512 on one H200; MFU stated, no floor.
EIGHT_B_16L = ("llama3-8b-16l", 4, 512, 3, 2)
# ABFT on a healthy node: `small` (8 layers, 7 checked matmuls, forward and two backward
# checks each, and the head: 170 checks a step) for 600 steps is 102,000 checks per dtype.
ABFT_HEALTHY = ("small", 600)
# The overhead benches (`bench faults`, `bench paired`, `bench abft`): each contender's step
# against its suite's plain one, on `small` at 16 x 512 (stated, no floor: issue 53 asks them).
OVERHEAD_WORKLOAD = ("small", 16, 512, 5, 3)
OVERHEADS = {"fault_engine_cost": "faults", "paired_cost": "paired", "abft_overhead": "abft"}
# XLA's default command-buffer types and CONDITIONAL: each `lax.cond` then runs inside the CUDA
# graph instead of as a thunk reading its predicate on the host (a lead for the fault engine's
# idle cost on the GPU, docs/results/gpu.md; `fault_engine_cost_graphs` measures it).
CONDITIONALS_IN_GRAPHS = ("--xla_gpu_enable_command_buffer="
                          "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL")
PAIR_NEEDS_TWO = ("a pair's two nodes are two devices of one mesh (its node axis), and this "
                  "machine has one GPU, so the paired modes' step cost cannot be measured here")
RECALL_PROFILE = "exponent-flip"
RECALL_STEPS = 20
ABFT_RULES = ("rounding", "paper", "paper-dtype")  # abft/tables.py HOST_THRESHOLDS
ATTENTION_REPEAT_STEPS = 6
# The fault engine's dense rest: a weight gradient of `small` (512 x 1,536) at nodes 1 and 14's
# weight-gradient rate, about 11,900 hits (experiments/fault_draw_cost.py: preset, rows of the
# tensor, rate, timed calls).
FAULT_DRAWS = ("small", 1536, 0.0152, 20)
AUTOTUNE_FILE = "autotune_medium_bfloat16.txt"  # text: XLA writes text for a .txt name
CUDNN_FAILS = ("this jaxlib's XLA cannot launch cuDNN's fused attention under the determinism "
               "flags (core/determinism.py CUDNN_ATTENTION_FAILS_THROUGH), so `auto` runs the "
               "Pallas kernels")


def preset_problem(name: str) -> str | None:
    """None when the model preset exists (built in or configs/models/NAME.yaml), else why
    its check is skipped."""
    from sdcstudy.core.presets import PRESETS

    if name in PRESETS or (ROOT / "configs" / "models" / f"{name}.yaml").is_file():
        return None
    return (f"the model preset {name} is not defined (sdcstudy/core/presets.py, "
            f"configs/models/), so its floor was not measured")


class Acceptance(GoldenChecks, FreeStepChecks):
    """The checks; `acceptance.run_stage` calls them in their order."""

    def doctor(self) -> dict:
        path = self.work / "doctor.json"
        run = self.sdcstudy("doctor", ["doctor", "--json", path, "--no-progress"], cap=240)
        if "skipped" in run:
            return run
        if run["exit_code"] not in (0, 1) or not path.exists():  # 1: the doctor's FAIL
            return broke(run)
        d = json.loads(path.read_text())
        return {"pass": run["exit_code"] == 0, **run, "verdict": d["verdict"],
                "problems": d["problems"], "steps": d["steps"],
                "compiled_step_sha256": d["env"]["compiled_step_sha256"],
                "param_digest": d["param_digest"], "xla_flags": d["env"]["xla_flags"]}

    def bench(self, name: str, workload: tuple, dtype: str, cap: float,
              env: dict | None = None, floor: GF.Floor | None = None,
              sets: tuple[str, ...] = ()) -> dict:
        """bench train of one workload (our step alone), its figures and census, judged by
        `floor` (None: MFU measured is enough); `sets`: more `--set` overrides."""
        preset, batch, seq_len, steps, repeats = workload
        path, hlo = self.work / f"{name}.json", self.work / "hlo" / name
        overrides = [a for s in (f"model.dtype={dtype}", *sets) for a in ("--set", s)]
        run = self.sdcstudy(name, [
            "bench", "train", "--no-torch", "--presets", preset, "--batch", batch,
            "--seq-len", seq_len, "--steps", steps, "--repeats", repeats, *overrides,
            "--json", path, "--hlo", hlo], cap=cap, env=env,
            sample=self.work / f"{name}.samples.csv")
        if "skipped" in run:
            return run
        out = {"pass": False, **run, "dtype": dtype,
               "device_during": SMI.samples_summary(_read(self.work / f"{name}.samples.csv"))}
        if not self.ran(run, path):
            return broke(out)
        self.pack_hlo()
        report = json.loads(path.read_text())
        out.update(GF.bench_figures(report),
                   xla_flags=report.get("environment", {}).get("xla_flags"))
        out.update(GF.judge_bench(out, floor, self.report["device_kind"]))
        return out

    def autotune_path(self) -> Path:
        return self.work / AUTOTUNE_FILE

    def bench_tuned(self) -> dict:
        """medium bfloat16 without the determinism flags, XLA's autotuner free, its choices
        dumped to a file (`--xla_gpu_dump_autotune_results_to`)."""
        from sdcstudy.core.determinism import AUTOTUNE_DUMP_FLAG

        env = with_flags(without_determinism(child_env()),
                         f"{AUTOTUNE_DUMP_FLAG}={self.autotune_path()}")
        # The attention `auto` runs under the flags (the Pallas kernels where cuDNN's cannot
        # launch), so that the tuned and pinned steps are one program.
        attention = "pallas" if cudnn_fails_here() else "auto"
        out = self.bench("bench_medium_bfloat16_tuned", MEDIUM, "bfloat16", cap=200, env=env,
                         sets=(f"model.attention={attention}",))
        if out.get("pass") is not None and "tokens_per_s" in out:
            out["pass"] = self.autotune_path().is_file()
            out["autotune_file_bytes"] = (self.autotune_path().stat().st_size
                                          if out["pass"] else None)
        return out

    def bench_pinned(self) -> dict:
        """medium bfloat16 with the determinism flags and the tuned choices loaded
        (`--xla_gpu_load_autotune_results_from`): the step this project would ship; judged by
        the medium bfloat16 MFU floor."""
        from sdcstudy.core.determinism import AUTOTUNE_FLAG

        if not self.autotune_path().is_file():
            return skipped("the tuned run dumped no autotuning results")
        env = with_flags(child_env(), f"{AUTOTUNE_FLAG}={self.autotune_path()}")
        return self.bench("bench_medium_bfloat16_pinned", MEDIUM, "bfloat16", cap=200, env=env,
                          floor=GF.BENCH_FLOORS["medium", "bfloat16"])

    def bench_untuned(self) -> dict:
        """medium bfloat16 with the determinism flags and nothing loaded: today's step."""
        return self.bench("bench_medium_bfloat16_untuned", MEDIUM, "bfloat16", cap=200)

    def bench_pallas(self, pinned: dict) -> dict:
        """medium bfloat16 with the determinism flags, the tuned choices loaded where the tuned
        run dumped them, and `model.attention=pallas` (JAX's Pallas flash attention: Triton
        kernels, no cuDNN). Judged by the medium bfloat16 MFU floor and by the census showing
        the Pallas kernels both ways; its tokens/s against the pinned step beside it. Where
        cuDNN's kernel cannot launch under the flags, `auto` runs the Pallas kernels, so the
        pinned step is this one: judged from its figures, not run again."""
        from sdcstudy.core.determinism import AUTOTUNE_FLAG

        if cudnn_fails_here():
            if "tokens_per_s" not in pinned:
                return skipped("auto runs the Pallas kernels here, and the pinned step (this "
                               "one) measured nothing")
            return {**pinned, "autotune_loaded": True, "seconds": 0.0,
                    "note": "the pinned step's figures: auto runs the Pallas kernels here",
                    **GF.judge_pallas_attention(pinned, pinned)}
        env, loaded = child_env(), self.autotune_path().is_file()
        if loaded:
            env = with_flags(env, f"{AUTOTUNE_FLAG}={self.autotune_path()}")
        out = self.bench("bench_medium_bfloat16_pallas", MEDIUM, "bfloat16", cap=240, env=env,
                         floor=GF.BENCH_FLOORS["medium", "bfloat16"],
                         sets=("model.attention=pallas",))
        if "tokens_per_s" not in out:
            return out
        return {**out, "autotune_loaded": loaded, **GF.judge_pallas_attention(out, pinned)}

    def pinned_autotune(self, tuned: dict, pinned: dict, untuned: dict) -> dict:
        if "tokens_per_s" not in tuned or "tokens_per_s" not in pinned:
            return skipped("the tuned or the pinned bench train measured nothing")
        return GF.judge_pinned_autotune(tuned, pinned, untuned)

    def determinism_cost(self, tuned: dict, pinned: dict, untuned: dict) -> dict:
        """The flags' cost against the free-running tuned step: judged with the pinned
        choices loaded; the untuned step's cost recorded beside it."""
        if "tokens_per_s" not in tuned or "tokens_per_s" not in pinned:
            return skipped("the tuned or the pinned bench train measured nothing")
        out = GF.judge_determinism(pinned, tuned)
        if "tokens_per_s" in untuned:
            out["cost_untuned"] = GF.judge_determinism(untuned, tuned)["cost"]
        return out

    def torch_ratio(self, ours: dict) -> dict:
        """transformers + torch on the same GPU and shapes, against our pinned step."""
        if "tokens_per_s" not in ours:
            return skipped("our medium bfloat16 step measured nothing")
        preset, batch, seq_len, steps, repeats = MEDIUM
        path = self.work / "torch_medium_bfloat16.json"
        env = {**child_env(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        run = self.child("torch medium bfloat16", [
            "-m", "sdcstudy.gpu.torch_step", "--preset", preset, "--batch", batch,
            "--seq-len", seq_len, "--steps", steps, "--repeats", repeats,
            "--dtype", "bfloat16", "--json", path], cap=240, env=env)
        if "skipped" in run:
            return run
        if not self.ran(run, path):
            return broke(run)
        return {**run, **GF.judge_torch_ratio(ours, json.loads(path.read_text()))}

    def abft(self, dtype: str, profile: str, steps: int, preset: str = "tiny") -> tuple:
        """One `sdcstudy run configs/abft.yaml` under the rounding bound: (run, its folder)."""
        folder = self.work / f"abft-{profile}-{preset}-{dtype}"
        run = self.sdcstudy(f"abft {profile} {preset} {dtype}", [
            "run", "configs/abft.yaml", "--out", folder, "--no-progress",
            "--set", f"suspect.profile={profile}", "--set", f"model.dtype={dtype}",
            "--set", f"model.preset={preset}", "--set", "abft.threshold=rounding",
            "--set", f"experiment.steps={steps}"], cap=150)
        return run, folder if self.ran(run, folder / "summary.json") else None

    def abft_healthy(self, dtype: str) -> dict:
        preset, steps = ABFT_HEALTHY
        run, folder = self.abft(dtype, "healthy", steps, preset)
        if "skipped" in run or folder is None:
            return run if "skipped" in run else broke(run)
        summary = json.loads((folder / "summary.json").read_text())
        return {**run, "dtype": dtype, "preset": preset, "device_rule": "rounding",
                **GF.judge_healthy_abft(summary), "rules": host_rule_rates(folder),
                "where_flagged": where_flagged(folder, steps)}

    def abft_recall(self, dtype: str) -> dict:
        run, folder = self.abft(dtype, RECALL_PROFILE, RECALL_STEPS)
        if "skipped" in run or folder is None:
            return run if "skipped" in run else broke(run)
        summary = json.loads((folder / "summary.json").read_text())
        return {**run, "dtype": dtype, "profile": RECALL_PROFILE,
                **GF.judge_recall(summary, _records(folder / "faults.parquet"),
                                  _records(folder / "abft.parquet"))}

    def overhead(self, name: str, suite: str, flags: tuple[str, ...] = ()) -> dict:
        """`bench SUITE` on `OVERHEAD_WORKLOAD` (with `flags` added to XLA_FLAGS): each
        contender's step time over the plain step's, measured side by side in one run
        (`floors.overhead_figures`)."""
        preset, batch, seq_len, steps, repeats = OVERHEAD_WORKLOAD
        if suite == "paired" and self.report.get("device_count", 1) < 2:
            return skipped(PAIR_NEEDS_TWO)
        path = self.work / f"{name}.json"
        run = self.sdcstudy(name, ["bench", suite, "--presets", preset, "--batch", batch,
                                   "--seq-len", seq_len, "--steps", steps, "--repeats",
                                   repeats, "--json", path], cap=180,
                           env=with_flags(child_env(), *flags) if flags else None)
        if "skipped" in run:
            return run
        if not self.ran(run, path):
            return broke(run)
        return {**run, "suite": suite, **({"xla_flags_added": list(flags)} if flags else {}),
                **GF.overhead_figures(json.loads(path.read_text()))}

    def attention_repeat(self) -> dict:
        """The tiny training in bfloat16 with fused attention (cuDNN on a GPU: head dim 16;
        where cuDNN's cannot launch under the flags, the Pallas kernels) twice, in two
        processes: the same final parameters, bit for bit (the doctor trains in float32, where
        `auto` runs XLA's composition of attention on a GPU)."""
        attention = "pallas" if cudnn_fails_here() else "fused"
        runs, digests = [], []
        for i in (1, 2):
            folder = self.work / f"attention-repeat-{i}"
            run = self.sdcstudy(f"attention repeat {i}", [
                "run", "configs/tiny.yaml", "--out", folder, "--no-progress",
                "--set", "model.dtype=bfloat16", "--set", f"model.attention={attention}",
                "--set", f"experiment.steps={ATTENTION_REPEAT_STEPS}"], cap=120)
            if "skipped" in run:
                return run
            runs.append(run)
            summary = folder / "summary.json"
            if not self.ran(run, summary):
                return broke({"runs": runs, "seconds": round(sum(r["seconds"] for r in runs), 1)},
                             f"run {i}: {failure(run)}")
            digests.append(json.loads(summary.read_text())["param_digest"])
        return {"runs": runs, "seconds": round(sum(r["seconds"] for r in runs), 1),
                "attention": attention, **GF.judge_repeat(digests)}

    def fault_draws(self) -> dict:
        """The fault engine's dense rest on this device, both ways timed side by side in one
        process (experiments/fault_draw_cost.py), and the two passes (the engine's on the CPU)
        bit for bit the one-pass draw (`floors.judge_fault_draws`)."""
        preset, tokens, rate, calls = FAULT_DRAWS
        path = self.work / "fault_draws.json"
        run = self.child("fault draws", [
            ROOT / "experiments" / "fault_draw_cost.py", "--preset", preset, "--tokens", tokens,
            "--rate", rate, "--calls", calls, "--json", path], cap=120)
        if "skipped" in run:
            return run
        if not self.ran(run, path):
            return broke(run)
        return {**run, **GF.judge_fault_draws(json.loads(path.read_text()))}

    def device_health(self, before: dict, after: dict) -> dict:
        if "error" in before or "error" in after:
            return broke({}, before.get("error") or after.get("error"))
        return {"pass": not SMI.ecc_problems(before, after),
                "problems": SMI.ecc_problems(before, after),
                "clock_event_reasons_during_us": SMI.counters_during(before, after)}


def cudnn_fails_here() -> bool:
    """Whether this Python's jaxlib fails to launch cuDNN's fused attention under the
    determinism flags (`determinism.cudnn_attention_fails`); read without importing JAX."""
    from sdcstudy.core import determinism

    return determinism.cudnn_attention_fails(" ".join(determinism.DETERMINISM_XLA_FLAGS))


def host_rule_rates(folder: Path) -> dict:
    """Flagged checks over all checks under each rule, from the recorded residuals."""
    from sdcstudy.abft.tables import host_flags
    from sdcstudy.core.tablelog import read_table

    frame = read_table(folder / "abft.parquet")
    out = {}
    for rule in ABFT_RULES:
        flags = int(host_flags(frame, rule).sum())
        out[rule] = {"flags": flags, "checks": len(frame),
                     "false_alarm_rate": flags / len(frame) if len(frame) else None}
    return out


FLAGGED_ROWS_KEPT = 20  # the flagged checks a healthy run's result lists, worst first


def where_flagged(folder: Path, steps: int, rule: str = "rounding") -> dict:
    """Where a healthy run's checks flagged under `rule`: counts by matmul and direction, by
    layer and by tenth of the run's steps, each matmul and direction's largest ratio of
    residual to bound (1 is the bound), and the worst flagged checks with their figures."""
    import numpy as np

    from sdcstudy.abft.tables import host_ratios
    from sdcstudy.core.tablelog import read_table

    frame = read_table(folder / "abft.parquet")
    row, col = host_ratios(frame, rule)
    frame = frame.assign(ratio=np.fmax(row, col))
    flagged = frame[frame["ratio"] > 1]
    tenth = (flagged["step"] - 1) * 10 // max(steps, 1)
    columns = [c for c in ("step", "microstep", "layer", "matmul", "direction", "tp_rank",
                           "ratio", "max_residual", "k") if c in frame]
    worst = flagged.sort_values("ratio", ascending=False).head(FLAGGED_ROWS_KEPT)
    return {"rule": rule, "flags": len(flagged),
            "by_matmul": _counts(flagged, ["matmul", "direction"]),
            "by_layer": _counts(flagged, ["layer"]),
            "by_tenth_of_steps": {str(k): int(v)
                                  for k, v in tenth.value_counts().sort_index().items()},
            "largest_ratio": {f"{m}/{d}": float(r) for (m, d), r in
                              frame.groupby(["matmul", "direction"])["ratio"].max().items()},
            "worst": [{c: _plain(r[c]) for c in columns} for r in worst.to_dict("records")]}


def _counts(frame, keys: list[str]) -> dict:
    return {"/".join(map(str, k if isinstance(k, tuple) else (k,))): int(v)
            for k, v in frame.groupby(keys).size().items()}


def _plain(value):
    """A table cell as JSON takes it."""
    return value.item() if hasattr(value, "item") else value


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _records(path: Path) -> list[dict]:
    """A run folder's table as rows ([] when the run wrote none)."""
    from sdcstudy.core.tablelog import read_table

    return read_table(path).to_dict("records") if path.exists() else []
