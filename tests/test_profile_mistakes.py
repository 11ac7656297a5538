"""A mistake in a profile YAML a researcher writes ends in one sentence naming the field and the
fix (exit 2 from the CLI), before anything is compiled; never a traceback, never a run that
quietly injects less than the file says.

If a test here fails, a profile that could not do what it says was accepted: a spec without a
rate (which injects nothing), a count that its lanes cut to a fraction, a pattern field its
kind ignores, layers of a site outside the blocks, an empty list of layers, lanes or tp
ranks, steps the run never reaches, or an empty profile ran as a faulty node that made no
fault; or a typo crashed the run (exit 3) where it should have been named. Nothing here
compiles a JAX program.
"""

import pytest

from sdcstudy import cli
from sdcstudy.core import config as C
from sdcstudy.core.errors import UserError
from sdcstudy.faults import profiles

CONFIG = "configs/tiny.yaml"
SPEC = "{site: fwd/attn, kind: bitflip, rate: 1.0e-3}"


def _file(tmp_path, text: str, name: str = "mine.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _one_spec(tmp_path, spec: str):
    return _file(tmp_path, f"name: mine\nspecs:\n  - {spec}\n")


def _refused(path, *named):
    with pytest.raises(UserError) as refused:
        profiles.load(str(path))
    message = str(refused.value)
    assert all(n in message for n in named) and "\n" not in message, message
    return message


@pytest.mark.parametrize("spec, named", [
    ("{site: fwd/attn, kind: bitflip}", ("rate", "count")),  # injects nothing
    ("{site: fwd/attn, kind: bitflip, rate: 0.5, count: 2}", ("rate", "count")),
    ("{site: fwd/ffn, kind: zero, count: 5, lanes: [3]}", ("count", "lanes")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, bits: [3]}", ("bits", "bitflip")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, bit_class: sign}", ("bit_class", "bitflip")),
    ("{site: fwd/attn, kind: bitflip, rate: 0.1, bits: [3], bit_class: sign}",
     ("bits", "bit_class")),
    ("{site: fwd/attn, kind: bitflip, rate: 0.1, scale: [1, 2]}", ("scale", "additive")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, value_std: 3}", ("value_std", "random")),
    ("{site: grad, kind: zero, rate: 0.1, layers: [1]}", ("layers", "grad")),
    ("{site: fwd/logits, kind: zero, rate: 0.1, layers: [2]}", ("layers", "fwd/logits")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, pattern: {steps: [3]}}",
     ("pattern.steps", "pattern.kind")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, pattern: {kind: onset, steps: [3]}}",
     ("pattern.steps", "onset")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, pattern: {kind: burst, period: 3}}",
     ("pattern.period",)),
    ("{site: fwd/attn, kind: zero, rate: 0.1, pattern: {kind: steps}}", ("pattern.steps",)),
    ("{site: 3, kind: zero, rate: 0.1}", ("site",)),  # was an AttributeError, exit 3
    ("{site: fwd/attn, kind: zero, rate: 0.1, note: [a]}", ("note",)),
    # an empty list selects nothing: the spec never fired, and the run read as a faulty node
    ("{site: fwd/attn, kind: zero, rate: 0.1, layers: []}", ("layers", "never fire")),
    ("{site: fwd/ffn, kind: zero, rate: 0.1, lanes: []}", ("lanes", "never fire")),
    ("{site: fwd/ffn, kind: zero, rate: 0.1, tp_ranks: []}", ("tp_ranks", "never fire")),
    # misspellings and numbers out of range that docs/faults.md section 8 lists
    ("{site: fwd/attn, kind: bitflip, rate: 0.1, bit_class: mantisa}", ("bit_class",)),
    ("{site: fwd/attn, kind: zero, rate: 0.1, pattern: {kind: bursty}}", ("pattern.kind",)),
    ("{site: fwd/attn, kind: zero, rate: -0.1}", ("rate", "[0, 1]")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, layers: [-1]}", ("layers", "-1")),
    ("{site: fwd/attn, kind: zero, rate: 0.1, pattern: {kind: steps, steps: [0]}}",
     ("pattern.steps", "at least 1")),
    ("{site: fwd/attn, kind: zero, count: 0}", ("count", "at least 1")),
])
def test_a_spec_that_could_not_do_what_it_says_is_one_sentence_naming_the_field(
        tmp_path, spec, named):
    message = _refused(_one_spec(tmp_path, spec), "specs[0]", *named)
    assert message.startswith(str(tmp_path))


@pytest.mark.parametrize("text, named", [
    ("name: mine\nspecs: []\n", ("no specs", "healthy")),
    ("name: mine\nspecs:\n", ("no specs", "healthy")),
    ("", ("mapping", "specs")),
    (f"- {SPEC}\n", ("a list", "specs:")),
    ("name: mine\n", ("specs",)),
    (f"name: [a, b]\nspecs:\n  - {SPEC}\n", ("name", "text")),
    (f"name: mine\ndescription: {{a: 1}}\nspecs:\n  - {SPEC}\n", ("description", "text")),
    (f"name: mine\nspec:\n  - {SPEC}\n", ("unknown profile field", "'spec'", "specs")),
])
def test_a_profile_file_of_the_wrong_shape_says_what_it_needs(tmp_path, text, named):
    _refused(_file(tmp_path, text), *named)


def test_the_fields_of_a_good_spec_still_load(tmp_path):
    """The controls: each refusal above is about the combination, not the field alone."""
    text = ("name: mine\nspecs:\n"
            "  - {site: fwd/ffn, kind: zero, rate: 1.0, lanes: [3]}\n"
            "  - {site: fwd/attn, kind: bitflip, count: 2, bits: [30], layers: [1],\n"
            "     pattern: {kind: steps, steps: [2]}}\n"
            "  - {site: fwd/logits, kind: bitflip, rate: 0.1, bit_class: sign, layers: [0]}\n"
            "  - {site: grad, kind: additive, rate: 0, scale: [0.5, 1]}\n"
            "  - {site: bwd/ffn, kind: random, rate: 0.1, value_std: 3,\n"
            "     pattern: {kind: decay, amplitude: 4, decay_steps: 2}}\n")
    profile = profiles.load(str(_file(tmp_path, text)))
    assert [s.kind for s in profile.specs] == ["zero", "bitflip", "bitflip", "additive", "random"]
    assert profile.specs[1].count == 2 and profile.specs[1].pattern.steps == (2,)


@pytest.mark.parametrize("name", ["paper-node-7", "paper-node-6-loss-spike", "stuck-lane",
                                  "paper-node-10-flip", "paper-node-13"])
def test_every_zoo_profile_written_out_passes_the_same_checks(tmp_path, name):
    """A zoo profile written as YAML (`profiles.to_dict`, as the studies hand changed
    profiles to runs) loads: its defaults are not taken for fields its kinds ignore."""
    from sdcstudy.core import yamlsafe

    profile = profiles.load(name)
    path = _file(tmp_path, yamlsafe.dump(profiles.to_dict(profile), sort_keys=False))
    assert profiles.load(str(path)).specs == profile.specs


def _for_config(path, *overrides):
    cfg = C.load(CONFIG, [f"suspect.profile={path}", "experiment.steps=3", *overrides])
    with pytest.raises(UserError) as refused:
        profiles.load_for(cfg)
    message = str(refused.value)
    assert message.startswith("suspect.profile") and "\n" not in message, message
    return message


@pytest.mark.parametrize("pattern, named", [
    ("{kind: steps, steps: [4, 9]}", ("pattern.steps", "experiment.steps = 3")),
    ("{kind: onset, onset_step: 4}", ("pattern.onset_step", "experiment.steps = 3")),
])
def test_a_time_pattern_the_run_never_reaches_is_refused_for_that_run(tmp_path, pattern, named):
    path = _one_spec(tmp_path, f"{{site: fwd/attn, kind: zero, rate: 0.1, pattern: {pattern}}}")
    message = _for_config(path)
    assert all(n in message for n in named), message
    cfg = C.load(CONFIG, [f"suspect.profile={path}", "experiment.steps=4"])
    assert profiles.load_for(cfg).specs  # one step more and the spec fires: accepted


def test_an_explicitly_empty_steps_list_keeps_a_spec_compiled_in_and_off(tmp_path):
    """`steps: []` is how `sdcstudy bench faults` times an idle spec: accepted, not a crash of
    the check of the steps the run reaches."""
    path = _one_spec(tmp_path, "{site: fwd/attn, kind: zero, rate: 0.1, "
                               "pattern: {kind: steps, steps: []}}")
    cfg = C.load(CONFIG, [f"suspect.profile={path}", "experiment.steps=3"])
    assert profiles.load_for(cfg).specs[0].pattern.steps == ()


def test_a_zoo_node_whose_onset_lies_past_a_short_run_still_runs():
    """Node 13 is clean before step 450 (the paper's section 6.2): a 3-step run of it injects
    nothing, which is the node as published, not a mistake in a file."""
    cfg = C.load(CONFIG, ["suspect.profile=paper-node-13", "experiment.steps=3"])
    assert profiles.load_for(cfg).name == "paper-node-13"


@pytest.mark.parametrize("mode", ["train", "lockstep"])
def test_the_gradient_all_reduce_site_outside_paft_is_refused(tmp_path, mode):
    """Only paft mode has a gradient all-reduce to corrupt; elsewhere the spec never fired."""
    path = _one_spec(tmp_path, "{site: collective/grad_allreduce, kind: zero, count: 1}")
    message = _for_config(path, f"experiment.mode={mode}")
    assert "collective/grad_allreduce" in message and "paft" in message
    cfg = C.load("configs/paft.yaml", [f"suspect.profile={path}", "experiment.steps=3"])
    assert profiles.load_for(cfg).specs


def test_a_profile_file_that_does_not_exist_is_named(tmp_path):
    _refused(tmp_path / "nowhere.yaml", "nowhere.yaml", "does not exist")


def test_the_cli_names_a_non_text_site_in_one_sentence_and_exits_2(tmp_path, capsys):
    """`site: 3` crashed the run with an AttributeError (exit 3, 'a bug or a broken
    environment'); it is the user's typo: exit 2, one sentence."""
    path = _one_spec(tmp_path, "{site: 3, kind: zero, rate: 0.1}")
    code = cli.main(["run", CONFIG, "--out", str(tmp_path / "run"), "--no-progress",
                     "--set", "experiment.steps=1", "--set", f"suspect.profile={path}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("sdcstudy: error:")]
    assert "site" in line and "specs[0]" in line
    assert not (tmp_path / "run").exists()


def test_bits_a_site_lacks_are_refused_even_when_some_exist():
    # bits [3, 20] on a bfloat16 site flipped bit 3 alone, silently: half of what the spec
    # says. Only a spec none of whose bits exist was refused.
    from sdcstudy.faults import draws
    from sdcstudy.faults import specs as FS

    spec = FS.FaultSpec("fwd/attn", "bitflip", rate=0.01, bits=(3, 20))
    assert draws._allowed_bits(spec, 32) == (3, 20)
    with pytest.raises(FS.FaultSpecError, match=r"bits \[20\] of bits \[3, 20\] exist in the "
                                                r"16-bit values"):
        draws._allowed_bits(spec, 16)
    with pytest.raises(FS.FaultSpecError, match=r"none of bits \[20\] exist"):
        draws._allowed_bits(FS.FaultSpec("fwd/attn", "bitflip", rate=0.01, bits=(20,)), 16)
    assert len(draws._allowed_bits(FS.FaultSpec("fwd/attn", "bitflip", rate=0.01), 16)) == 16
