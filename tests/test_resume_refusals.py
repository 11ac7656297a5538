"""What `--resume` refuses, and that each refusal says what to do instead (no JAX run here).

If a test here fails, a resume would overwrite a folder a user made (a config.yaml and notes,
no run), or a refusal's sentence gives advice that is itself refused, or names neither the
values that differ nor the checkpoint to fall back on.
"""

import re
from pathlib import Path

import pytest

from sdcstudy import cli
from sdcstudy.core import checkpoint
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core.config import UserError

ROOT = Path(__file__).resolve().parents[1]
SAVED = ["experiment.steps=6", "optim.lr=0.003"]


def _cfg(*overrides):
    return C.from_dict({}, [*SAVED, *overrides])


def test_another_setting_is_named_with_both_values():
    with pytest.raises(UserError) as info:
        checkpoint.check_resumable(_cfg(), _cfg("optim.lr=0.5", "experiment.seed=3"))
    message = str(info.value)
    assert "experiment.seed is 3 here, 0 in the run folder's config.yaml" in message
    assert "optim.lr is 0.5 here, 0.003 in the run folder's config.yaml" in message
    assert message.count(".") >= 2 and "\n" not in message


def test_the_advice_for_another_step_count_is_accepted():
    # A cosine run whose optim.decay_steps was unset decays over its own experiment.steps: more
    # steps would change every learning rate. The sentence once said to set optim.decay_steps,
    # which the same check then refused as another configuration; what it says now must pass.
    with pytest.raises(UserError) as info:
        checkpoint.check_resumable(_cfg(), _cfg("experiment.steps=8"))
    advised = re.findall(r"; resume with (\S+)=(\d+)", str(info.value))
    assert advised == [("experiment.steps", "6")], str(info.value)
    checkpoint.check_resumable(_cfg(), _cfg("experiment.steps=6"))
    # With optim.decay_steps set from the start, or a constant schedule, the count may change.
    checkpoint.check_resumable(_cfg("optim.decay_steps=6"),
                               _cfg("optim.decay_steps=6", "experiment.steps=8"))
    checkpoint.check_resumable(_cfg("optim.schedule=constant"),
                               _cfg("optim.schedule=constant", "experiment.steps=8"))


def test_a_users_folder_with_a_config_is_not_resumed_into(tmp_path, capsys):
    # A folder the user made, holding their config.yaml (with its comments) and notes: before,
    # --resume took it for a run folder, rewrote its config.yaml and trained into it.
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / RF.CONFIG).write_text((ROOT / "configs" / "tiny.yaml").read_text())
    (folder / "notes.txt").write_text("my notes\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(UserError, match="nothing a run writes .*without --resume"):
        RF.open_run_dir(folder, resume=True)
    code = cli.main(["run", str(folder / RF.CONFIG), "--out", str(folder), "--resume",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # What a run leaves, even killed before its first step (its lock file), is a run folder.
    (folder / ".lock").write_text("999999999\n")
    assert RF.open_run_dir(folder, resume=True) == folder


def test_a_damaged_only_checkpoint_says_to_start_again(tmp_path):
    (tmp_path / "4").mkdir()
    ckpt = checkpoint.Checkpointer.__new__(checkpoint.Checkpointer)
    ckpt.directory = tmp_path
    assert "only checkpoint" in ckpt._without(4) and "another --out" in ckpt._without(4)
    (tmp_path / "8").mkdir()
    assert ckpt._without(8).endswith("to resume from step 4, the checkpoint before it")
