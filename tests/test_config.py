"""Config schema, overrides and the CLI's answers to bad input (no JAX computation)."""

import pytest

from sdcstudy import cli
from sdcstudy import modes
from sdcstudy.core import config as C


def test_partial_file_takes_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("experiment:\n  steps: 7\noptim:\n  lr: 1\n")
    cfg = C.load(path)
    assert cfg.experiment.steps == 7
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # int accepted for a float
    assert cfg.optim.beta2 == 0.99 and cfg.model.preset == "tiny"


def test_overrides_read_values_as_yaml():
    cfg = C.from_dict({}, ["optim.clip_norm=null", "optim.lr=1e-4", "abft.enabled=true",
                           "paft.noise.sigma2=0.5", "model.preset=small"])
    assert cfg.optim.clip_norm is None
    assert cfg.optim.lr == 1e-4
    assert cfg.abft.enabled is True
    assert cfg.paft.noise.sigma2 == 0.5
    assert C.model_dims(cfg.model).d_model == 512


@pytest.mark.parametrize("data, overrides, fragment", [
    ({"optim": {"lrr": 1}}, [], "did you mean 'optim.lr'"),
    ({}, ["experiment.step=3"], "did you mean 'experiment.steps'"),
    ({"experiment": {"steps": "many"}}, [], "experiment.steps must be int"),
    ({"experiment": {"mode": "lockstpe"}}, [], "did you mean 'lockstep'"),
    ({"optim": {"name": "lion"}}, [], "optim.name 'lion'"),
    ({"model": {"preset": "tinny"}}, [], "did you mean 'tiny'"),
    ({"model": {"dtype": "float16"}}, [], "model.dtype must be one of"),
    ({"experiment": {"batch_size": 6}, "mesh": {"dp": 4}}, [], "multiple of mesh.dp"),
])
def test_bad_config_names_the_key(data, overrides, fragment):
    # Loading checks what every mode shares; the mode's own check (modes.check) the rest.
    with pytest.raises(C.ConfigError, match=None) as info:
        modes.check(C.from_dict(data, overrides))
    assert fragment in str(info.value)


def test_every_documented_key_exists():
    # The config keys the docs name keep their names; renaming one breaks users' configs.
    documented = ["experiment.mode", "experiment.steps", "experiment.microsteps",
                "experiment.seed", "model.preset", "model.dtype", "mesh.tp", "mesh.dp",
                "suspect.profile", "optim.name", "optim.lr", "optim.schedule",
                "optim.weight_decay", "optim.clip_norm", "abft.enabled", "paft.noise.sigma2",
                "paft.sync_every", "paft.dynamic", "data.source"]
    assert set(documented) <= set(C.all_keys())


def test_paper_presets_match_appendix_b():
    # Ma et al., appendix B.2: d=4096, 32 heads, 8 KV heads, head dim 128, FFN 16384.
    for name, layers in (("llama3-8b-16l", 16), ("llama3-8b", 32)):
        dims = C.model_dims(C.ModelConfig(preset=name))
        assert (dims.d_model, dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.ffn_dim,
                dims.n_layers) == (4096, 32, 8, 128, 16384, layers)
    assert 20e6 < C.model_dims(C.ModelConfig(preset="small")).n_params < 60e6


def test_preset_from_yaml_file(tmp_path):
    (tmp_path / "mine.yaml").write_text("vocab_size: 256\nd_model: 32\nn_layers: 1\n"
                                        "n_heads: 2\nn_kv_heads: 1\nffn_dim: 64\n")
    dims = C.model_dims(C.ModelConfig(preset="mine"), presets_dir=tmp_path)
    assert (dims.d_model, dims.head_dim) == (32, 16)
    (tmp_path / "bad.yaml").write_text("d_modle: 32\n")
    with pytest.raises(C.ConfigError, match="did you mean 'd_model'"):
        C.model_dims(C.ModelConfig(preset="bad"), presets_dir=tmp_path)


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def test_cli_unknown_key_is_one_sentence_exit_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: 1\n")
    code, err = _cli(capsys, "run", str(path), "--out", str(tmp_path / "run"))
    assert code == 2
    assert err.count("\n") == 1 and "optim.learning_rate" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_cli_missing_file_exit_2(tmp_path, capsys):
    code, err = _cli(capsys, "run", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml" in err and "does not exist" in err


def test_cli_invalid_yaml_exit_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("experiment: [unclosed\n")
    code, err = _cli(capsys, "run", str(path))
    assert code == 2 and "not valid YAML" in err


def test_cli_refuses_to_clobber_a_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    path = tmp_path / "c.yaml"
    path.write_text("experiment:\n  steps: 1\n")
    code, err = _cli(capsys, "run", str(path), "--out", str(out))
    assert code == 2 and "already exists" in err
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_medium_preset_sits_between_small_and_8b_and_splits_over_tp_4():
    # The benchmarks' third size: about 100M parameters, and tp = 1, 2, 4 must divide its
    # heads, KV heads and FFN (the paired bench times it at each degree).
    dims = C.model_dims(C.ModelConfig(preset="medium"))
    assert 90e6 < dims.n_params < 120e6
    assert (dims.vocab_size, dims.d_model, dims.n_layers, dims.head_dim) == (256, 768, 12, 64)
    assert dims.n_heads % 4 == 0 and dims.n_kv_heads % 4 == 0 and dims.ffn_dim % 4 == 0
    assert dims.n_kv_heads < dims.n_heads  # grouped-query attention, as in Llama 3


def test_first_line_quotes_one_line_of_an_error():
    """If this fails, an error sentence could quote a multi-line traceback or an empty `()`."""
    from sdcstudy.core.errors import first_line

    assert first_line(ValueError("  bad value\nsecond line")) == "bad value"
    assert first_line(ValueError("x" * 500 + "\ny"), 300) == "x" * 300
    assert first_line(KeyError()) == "KeyError"
