"""The acceptance's `free_step` check: does a GPU step repeat its bits without XLA's
determinism flags, once its kernel choices are pinned, and how much faster is it?

On an H200 (docs/results/gpu.md, 2026-11-30) the flags cost medium's bfloat16 step 34%: under
either flag XLA's autotuner takes its first candidate and drops the Triton GEMMs and fusions,
and a loaded autotune file is honoured only for the cuBLASLt GEMMs that remain. What the flags
buy is deterministic kernels: a scatter-add sorted before it adds, cuDNN's attention backward
without atomics, and the same kernel choices in every compile. The step here gets each
another way: the Pallas attention (no atomics), `model.embedding_grad=sorted` (no scatter),
and the choices of a first compile loaded, with XLA told to fail rather than tune again
(`REQUIRE_PINNED`). Four runs of medium in bfloat16 (`FREE_STEP`), each in its own process:
the first without the flags dumps its choices (`FREE_STEP_AUTOTUNE`: every program the
process compiled, so that the next runs find each one's); two more without the flags load them
and must end on the same parameters bit for bit; the last, with the flags and the same model,
gives the speed the flags allow (`floors.judge_free_step`).
"""

from __future__ import annotations

import json

from sdcstudy.core.determinism import AUTOTUNE_DUMP_FLAG, AUTOTUNE_FLAG
from sdcstudy.gpu import floors as GF
from sdcstudy.gpu.session import Session, broke, child_env, failure, with_flags
from sdcstudy.gpu.session import without_determinism

FREE_STEP = ("medium", 32, 512, 8)  # preset, batch, sequence length, steps
FREE_STEP_MODEL = ("model.dtype=bfloat16", "model.attention=pallas",
                   "model.embedding_grad=sorted")
REQUIRE_PINNED = "--xla_gpu_require_complete_aot_autotune_results=true"
FREE_RUNS = ("tuned", "repeat_1", "repeat_2", "flags")  # in this order
FREE_STEP_CONFIG = "configs/tiny.yaml"  # mode train on the synthetic corpus, sized by the sets
FREE_STEP_AUTOTUNE = "free_step_autotune.txt"  # in the work folder; text for a .txt name


def free_step_sets() -> tuple[str, ...]:
    """The `--set`s of every run: `FREE_STEP`'s sizes and `FREE_STEP_MODEL`."""
    preset, batch, seq_len, steps = FREE_STEP
    return (*FREE_STEP_MODEL, f"model.preset={preset}", f"experiment.batch_size={batch}",
            f"data.seq_len={seq_len}", f"experiment.steps={steps}")


class FreeStepChecks(Session):
    """The free-step check; `acceptance.run_checks` calls it in its order."""

    def free_step(self) -> dict:
        """The four runs (module docstring), judged by `floors.judge_free_step`."""
        free = without_determinism(child_env())
        pinned = self.work / FREE_STEP_AUTOTUNE
        envs = {"tuned": with_flags(free, f"{AUTOTUNE_DUMP_FLAG}={pinned}"),
                "repeat_1": with_flags(free, f"{AUTOTUNE_FLAG}={pinned}", REQUIRE_PINNED),
                "repeat_2": with_flags(free, f"{AUTOTUNE_FLAG}={pinned}", REQUIRE_PINNED),
                "flags": with_flags(child_env(), f"{AUTOTUNE_FLAG}={pinned}")}
        runs, summaries = {}, {}
        for name in FREE_RUNS:
            run, summary = self._free_run(name, envs[name])
            if "skipped" in run:  # no time left: nothing judged, the runs so far kept
                return {**run, **self._so_far(runs)} if runs else run
            runs[name] = run
            if summary is None:
                return broke(self._so_far(runs), f"{name}: {failure(run)}")
            summaries[name] = summary
            if name == "tuned" and not pinned.is_file():
                return broke(self._so_far(runs), "the first run pinned no kernel choices "
                                                 f"({pinned} is missing)")
        return {**self._so_far(runs), **GF.judge_free_step(summaries)}

    def _free_run(self, name: str, env: dict) -> tuple[dict, dict | None]:
        """One run of `FREE_STEP` under `env`: (its result, its summary.json or None)."""
        folder = self.work / f"free-step-{name.replace('_', '-')}"
        run = self.sdcstudy(f"free step {name}", [
            "run", FREE_STEP_CONFIG, "--out", folder, "--no-progress",
            *[arg for s in free_step_sets() for arg in ("--set", s)]], cap=150, env=env)
        summary = folder / "summary.json"
        if "skipped" in run or not self.ran(run, summary):
            return run, None
        return run, json.loads(summary.read_text())

    @staticmethod
    def _so_far(runs: dict) -> dict:
        return {"runs": runs, "seconds": round(sum(r["seconds"] for r in runs.values()), 1)}
