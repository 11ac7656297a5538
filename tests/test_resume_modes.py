"""A run stopped and resumed equals the unbroken run bit for bit, in the modes whose resume no
other module tests (train: test_train and test_resume_data; lockstep: test_interrupts; detect:
test_detect_scores): parameter sync, free running, ABFT, PAFT and fine-tuning.

Each mode's suspect or workers draw from a random stream every step (faults by rate, packet
loss, aggregation noise), so a resume that restarted a stream, lost a counter or restored one
leaf of the optimizer state wrong shows here: the metrics, the summary, every table and every
array of the final training state are compared by their bits (tests/bitwise.py). Each run is
one layer of the tiny Llama for five steps, stopped after step 3 (the stop saves a checkpoint
there; the regular checkpoints at 2 and 4 fall before and after it).
"""

import pandas as pd
import pytest

from bitwise import bits, state_bits
from sdcstudy import runner
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.dev.mode_bits import WALL_CLOCK

STEPS, STOP = 5, 3
COMMON = {"experiment": {"steps": STEPS, "batch_size": 4, "checkpoint_every": 2},
          "model": {"n_layers": 1}, "optim": {"warmup_steps": 1}, "data": {"seq_len": 32}}

# Faults drawn by rate at a forward site and by count at a backward one: each step draws
# afresh from the suspect's stream.
PROFILE = """\
name: drawn-each-step
specs:
  - {site: fwd/ffn, kind: bitflip, rate: 2.0e-3, bit_class: exponent}
  - {site: bwd/attn, kind: random, count: 2, value_std: 3.0}
"""


def _faulty(mode, tmp_path, *more):
    profile = tmp_path / "profile.yaml"
    profile.write_text(PROFILE)
    return [f"experiment.mode={mode}", f"suspect.profile={profile}", *more]


def _paramsync(tmp_path):
    return _faulty("paramsync", tmp_path, "mesh.tp=2")


def _free(tmp_path):
    return _faulty("free", tmp_path, "mesh.tp=2")


def _abft(tmp_path):
    return _faulty("abft", tmp_path, "abft.recompute=true")


def _paft(tmp_path):
    # Synchronizing every 2 steps: the stop at 3 falls between the syncs at 2 and 4.
    return ["experiment.mode=paft", "mesh.dp=4", "paft.sync_every=2", "paft.loss.p=0.1",
            "paft.noise.sigma2=1e-6"]


def _finetune(tmp_path):
    init = tmp_path / "pretrained"
    runner.run(C.from_dict(COMMON, ["experiment.mode=train", "experiment.steps=1"]), init,
               progress=False)
    return ["experiment.mode=finetune", "mesh.tp=2", "suspect.profile=exponent-flip",
            "data.seq_len=176", f"finetune.init={init}", "finetune.synthetic_train=16",
            "finetune.synthetic_test=12", "finetune.eval_batch_size=8"]


MODES = {"paramsync": _paramsync, "free": _free, "abft": _abft, "paft": _paft,
         "finetune": _finetune}


def _view(run_dir):
    """Everything of a run that must be bitwise reproducible (the host's clock excluded): its
    metrics, summary, tables and whole final training state, by their bits."""
    def timeless(row):
        return {k: v for k, v in row.items() if k not in WALL_CLOCK}

    tables = {path.name: bits(pd.read_parquet(path)) for path in sorted(run_dir.glob("*.parquet"))}
    return {"metrics": bits([timeless(r) for r in RF.read_jsonl(run_dir / RF.METRICS)]),
            "summary": bits(timeless(RF.json_load(run_dir / RF.SUMMARY))),
            "tables": tables, "state": state_bits(run_dir)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_stopped_and_resumed_run_equals_the_unbroken_one(mode, tmp_path):
    cfg = C.from_dict(COMMON, MODES[mode](tmp_path))
    unbroken, split = tmp_path / "unbroken", tmp_path / "split"
    runner.run(cfg, unbroken, progress=False)
    assert runner.run(cfg, split, stop_after=STOP, progress=False)["steps_done"] == STOP
    runner.run(cfg, split, resume=True, progress=False)
    assert [r["step"] for r in RF.read_jsonl(split / RF.METRICS)] == list(range(1, STEPS + 1))
    assert _view(split) == _view(unbroken)
