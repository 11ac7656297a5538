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


# --- bounded input: YAML (core/yamlsafe.py) ---------------------------------------------------

# Each alias below stands for nine copies of the one before: 9^6 = 531,441 strings from 300
# bytes (the 617-byte version grew past 4 GB). Built, it is a few MB of pointers; the
# screen refuses the first anchor before building anything.
BOMB = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        + "".join(f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n"
                  for p, n in zip("abcde", "bcdef")))


def _peak_bytes(call):
    """(what `call` raised, the peak of Python allocations while it ran)."""
    import tracemalloc

    tracemalloc.start()
    try:
        call()
        raised = None
    except Exception as e:  # noqa: BLE001 - the test asserts on what it is
        raised = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


def test_an_anchor_bomb_is_refused_before_anything_is_built(tmp_path):
    # If this fails, a few hundred bytes of YAML can take the machine's memory (the loader
    # builds, or the config copies, every alias's expansion) before a key is validated.
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert len(BOMB) < 400
    raised, peak = _peak_bytes(lambda: C.load(path))
    assert isinstance(raised, C.ConfigError) and "anchor &a (line 1)" in str(raised)
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse a {len(BOMB)}-byte file"


def test_no_module_reads_yaml_except_through_yamlsafe():
    # If this fails, a module reads YAML without the bounds (aliases, tags, size) of
    # core/yamlsafe.py: route it through yamlsafe.load_file or load_text.
    import re
    from pathlib import Path

    package = Path(C.__file__).resolve().parents[1]
    raw = re.compile(r"\byaml\.(safe_load|load|full_load|unsafe_load|load_all|safe_load_all)\(")
    readers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                     if raw.search(p.read_text()))
    assert readers == ["core/yamlsafe.py"]


@pytest.mark.parametrize("what", ["config", "profile", "preset", "golden", "fleet", "run"])
def test_every_yaml_input_refuses_aliases_in_one_sentence(tmp_path, what):
    # The same bomb through each reader the package has: each ends in a UserError that names
    # the file and the anchor, never a traceback or an expansion.
    from sdcstudy.core.errors import UserError
    from sdcstudy.faults import profiles
    from sdcstudy.fleet import config as fleet_config
    from sdcstudy.golden import manifest
    from sdcstudy.report import runs

    path = tmp_path / ("config.yaml" if what in ("golden", "run") else f"{what}.yaml")
    path.write_text(BOMB)
    read = {"config": lambda: C.load(path),
            "profile": lambda: profiles.load(str(path)),
            "preset": lambda: C.model_dims(C.ModelConfig(preset=what), presets_dir=tmp_path),
            "golden": lambda: manifest.load_config(tmp_path),
            "fleet": lambda: fleet_config.load(path),
            "run": lambda: runs.load_run(tmp_path)}[what]
    raised, peak = _peak_bytes(read)
    assert isinstance(raised, (UserError, manifest.GoldenError)), raised
    assert "anchor &a" in str(raised) and str(path) in str(raised)
    assert "\n" not in str(raised) and peak < 4 << 20


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system ['true']", "!!binary aGk=",
                                 "!!python/name:os.system"])
def test_a_python_or_binary_tag_is_refused_by_name(tmp_path, tag):
    # A golden record's config.yaml is read as root on every node: a tag that names Python
    # code must end in one sentence (INCONCLUSIVE, exit 2), not a ConstructorError traceback.
    from sdcstudy.golden import manifest

    (tmp_path / "config.yaml").write_text(f"experiment:\n  name: {tag}\n")
    with pytest.raises(manifest.GoldenError) as info:
        manifest.load_config(tmp_path)
    assert f"holds the tag {tag.split()[0]}" in str(info.value)
    with pytest.raises(C.ConfigError, match="holds the tag !!"):
        C.load(tmp_path / "config.yaml")


def test_a_file_over_one_mib_is_not_read(tmp_path):
    # A 100 MB list ran for 4 minutes before anything looked at it. A config is a few KiB.
    path = tmp_path / "big.yaml"
    path.write_text("experiment:\n  steps: 7\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(C.ConfigError, match=r"larger than 1 MiB, the most sdcstudy reads"):
        C.load(path)


@pytest.mark.parametrize("body, fragment", [
    ("experiment:\n  name: [" + ", ".join(["1"] * 10_001) + "]\n", "more than 10000 values"),
    ("experiment:\n  name: " + "[" * 40 + "]" * 40 + "\n", "more than 16 deep"),
])
def test_value_count_and_nesting_are_bounded(tmp_path, body, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(body)
    with pytest.raises(C.ConfigError, match=fragment):
        C.load(path)


# --- bounded input: ranges (core/bounds.py) ---------------------------------------------------


@pytest.mark.parametrize("override, sentence", [
    ("model.n_layers=0", "model.n_layers must be at least 1 or null."),
    ("model.n_layers=-1", "model.n_layers must be at least 1 or null."),
    ("model.d_model=0", "model.d_model must be at least 1 or null."),
    ("optim.lr=.nan", "optim.lr must be a finite number, not nan."),
    ("optim.lr=.inf", "optim.lr must be a finite number, not inf."),
    ("optim.lr=-1", "optim.lr must be positive."),
    ("experiment.steps=100000000000000", "experiment.steps must be from 1 to 10^9."),
    ("experiment.steps=1.0e+14", "experiment.steps must be int, not the float 100000000000000.0; "
                                 "write a whole number without a dot or exponent."),
    ("experiment.steps=3.0", "experiment.steps must be int, not the float 3.0; write a whole "
                             "number without a dot or exponent."),
    ("experiment.seed=4294967296", "experiment.seed must be at most 2^31-1 (2147483647)."),
    ("model.d_model=30", "model.d_model (30) must be a multiple of model.n_heads (4), or set "
                         "model.head_dim."),
    ("model.head_dim=15", "model.head_dim (15) must be even: the rotary embedding turns pairs "
                          "of its elements."),
    ("experiment.name=../../etc", "experiment.name '../../etc' names a folder inside runs/: it "
                                  "may not hold '/' or '\\' or start with '.'."),
])
def test_values_no_model_can_run_are_one_sentence_at_load(override, sentence):
    # If this fails, a value that cannot train (no layers, a NaN learning rate, a step count
    # past any budget) loads, and the run fails later with a traceback or trains nonsense.
    with pytest.raises(C.ConfigError) as info:
        C.from_dict({}, [override])
    assert str(info.value) == sentence


def _numeric_keys():
    import typing

    def walk(cls, prefix=""):
        for name, hint in typing.get_type_hints(cls).items():
            if C.dataclasses.is_dataclass(hint):
                yield from walk(hint, f"{prefix}{name}.")
            elif {int, float} & set(typing.get_args(hint) or (hint,)):
                yield f"{prefix}{name}", float in (typing.get_args(hint) or (hint,)), \
                    type(None) in typing.get_args(hint)
    return list(walk(C.Config))


def test_every_numeric_key_has_a_range_and_docs_config_md_states_it():
    # A numeric key added without a range is unchecked at load; a range not on the key's line
    # is missing from docs/config.md (the page is generated from those comments).
    from pathlib import Path

    from sdcstudy.core import bounds

    page = (Path(C.__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    keys = _numeric_keys()
    assert sorted(k for k, _, _ in keys) == sorted(bounds.RANGES)
    for key, is_float, nullable in keys:
        assert bounds.RANGES[key].doc(is_float, nullable) in rows[key], key


@pytest.mark.parametrize("key, is_float, nullable", _numeric_keys(), ids=lambda v: str(v))
def test_every_numeric_key_refuses_a_value_below_its_range(key, is_float, nullable):
    from sdcstudy.core import bounds

    r = bounds.RANGES[key]
    below = r.lo if r.lo_open else r.lo - 1
    for value in ([below, float("nan"), float("-inf")] if is_float else [below]):
        with pytest.raises(C.ConfigError) as info:
            C.from_dict({}, [f"{key}={value}" if value == value and abs(value) != float("inf")
                             else f"{key}={'.nan' if value != value else '-.inf'}"])
        assert str(info.value).startswith(f"{key} must be")


def test_a_preset_file_with_impossible_sizes_names_the_preset(tmp_path):
    (tmp_path / "flat.yaml").write_text("vocab_size: 256\nd_model: 32\nn_layers: 0\n"
                                        "n_heads: 2\nn_kv_heads: 1\nffn_dim: 64\n")
    with pytest.raises(C.ConfigError) as info:
        C.model_dims(C.ModelConfig(preset="flat"), presets_dir=tmp_path)
    assert str(info.value) == "model.n_layers (from model.preset 'flat') must be at least 1."


def test_cli_refuses_a_float_step_count_before_any_folder(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("experiment:\n  steps: 2\n")
    code, err = _cli(capsys, "run", str(path), "--set", "experiment.steps=1.0e+14",
                     "--out", str(tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1 and "experiment.steps must be int" in err
    assert not (tmp_path / "run").exists()


def test_what_sdcstudy_writes_as_yaml_it_reads_back():
    """A value used twice (a bench profile's shared `scale` list) is written out twice, not as
    an anchor and alias that the loader refuses: if this fails, `sdcstudy bench faults` and
    fault_compile_cost wrote profiles their own run then refused."""
    from sdcstudy.core import yamlsafe

    scale = [2.0 ** -8, 1.0]
    data = {"name": "x", "specs": [{"site": "fwd/attn", "scale": scale},
                                   {"site": "fwd/ffn", "scale": scale}]}
    text = yamlsafe.dump(data, sort_keys=False)
    assert "&" not in text and yamlsafe.load_text(text) == data


def test_a_file_that_is_not_a_mapping_is_quoted_short(tmp_path, capsys):
    """A text file given as the config is refused in one sentence that quotes its start and
    says its length, not the whole file."""
    path = tmp_path / "notes.txt"
    path.write_text(" ".join(f"line{i}" for i in range(500)) + "\n")
    code, err = _cli(capsys, "run", str(path), "--out", str(tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1
    assert "the config must be a mapping, not 'line0 line1" in err
    assert f"... ({len(repr(path.read_text().strip())):,} characters)." in err
    assert "line499" not in err and len(err) < 200
    assert not (tmp_path / "run").exists()


def test_cli_config_that_is_a_folder_says_so(tmp_path, capsys):
    code, err = _cli(capsys, "run", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "is a folder, not a YAML file" in err


def test_tensor_parallelism_refused_in_the_mode_the_user_chose():
    # The sentence names the mode of the run (abft here), not always 'train'.
    import types

    from sdcstudy.core.errors import UserError
    from sdcstudy.core.train import Trainer

    cfg = C.from_dict({"experiment": {"mode": "abft"}, "mesh": {"tp": 2}})
    with pytest.raises(UserError, match="experiment.mode 'abft' runs data-parallel only"):
        Trainer.shardings(types.SimpleNamespace(cfg=cfg), None, None)


def test_a_key_given_twice_in_one_mapping_is_refused():
    """YAML's loader keeps the last of two equal keys silently (a profile's `{rate: 0.1,
    rate: 0.2}` read as 0.2, a config's second `optim:` section replacing the first)."""
    from sdcstudy.core import yamlsafe

    for text, key in (("p: {rate: 0.1, rate: 0.2}\n", "rate"),
                      ("optim: {lr: 0.1}\nmodel: {preset: tiny}\noptim: {lr: 0.2}\n", "optim")):
        with pytest.raises(C.ConfigError, match=f"gives the key '{key}' twice in one mapping"):
            yamlsafe.load_text(text)
    # The same key in different mappings, nested or in list items, is no repeat.
    assert yamlsafe.load_text("m: {k: 1, n: {k: 2}, j: 3}\nl: [{x: 1}, {x: 2}]\n") == {
        "m": {"k": 1, "n": {"k": 2}, "j": 3}, "l": [{"x": 1}, {"x": 2}]}
