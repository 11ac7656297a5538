"""Every config key does what it says in every mode, or is refused: a key the mode would ignore,
set to other than its default, ends in one sentence (exit 2) before anything is built, where
the run's config.yaml said the setting was on and its results said nothing of it. Through each
mode's `check`: nothing here compiles."""

import json

import pytest

from sdcstudy import modes, reference
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF

# The keys a tiny run showed to change nothing in its folder (metrics, summary, tables, final
# parameters) in these modes, with what the sentence says.
IGNORED = [
    # A section the mode does not read.
    ("train", ["paft.sync_every=4"], "experiment.mode train does not read the paft section"),
    ("abft", ["detect.replicas=5"], "experiment.mode abft does not read the detect section"),
    ("lockstep", ["finetune.task=boolq"], "does not read the finetune section"),
    ("detect", ["paft.loss.p=0.1"], "does not read the paft section"),
    ("finetune", ["detect.shadow_rank=0"], "does not read the detect section"),
    ("train", ["collectives.enabled=true"], "does not read the collectives section"),
    ("paft", ["collectives.enabled=true"], "does not read the collectives section"),
    ("paft", ["abft.recompute=true"], "experiment.mode paft does not read the abft section"),
    ("paft", ["suspect.fault_kind=repeatable"], "experiment.mode paft does not read it"),
    ("finetune", ["data.text_field=body"], "experiment.mode finetune does not read it"),
    # ABFT's settings where no matmul is checked.
    ("train", ["abft.recompute=true"], "abft.enabled is false"),
    ("free", ["abft.threshold=rounding"], "abft.enabled is false"),
    ("finetune", ["abft.output_partials=2"], "abft.enabled is false"),
    ("detect", ["detect.detectors=monitor", "abft.operand_rounding=none"],
     "detect.detectors does not name abft"),
    # A detector's settings without the detector.
    ("detect", ["detect.detectors=lockstep", "detect.shadow_rank=1"], "does not name shadow"),
    ("detect", ["detect.detectors=lockstep", "detect.replicas=5"], "does not name localize"),
    ("detect", ["detect.detectors=lockstep", "detect.spike_window=4"], "does not name monitor"),
    ("detect", ["detect.max_retries=2"], "detect.rollback is false"),
    # PAFT settings whose mechanism the config leaves off.
    ("paft", ["paft.sync_every=4", "paft.h_max=8"], "paft.dynamic is false"),
    ("paft", ["paft.overlap=true"], "the workers never average"),
    ("paft", ["paft.sync_opt_state=true"], "the workers never average"),
    ("paft", ["paft.noise.large_sigma2=1.0"], "paft.noise.large_every is 0"),
    ("paft", ["paft.noise.sigma2=0", "paft.noise.large_every=5"], "no aggregation error is drawn"),
    ("paft", ["paft.loss.burst=4"], "paft.loss.p is 0"),
    ("paft", ["paft.loss.aggregate=zero"], "paft.loss.p is 0"),
    ("paft", ["paft.loss.packet_size=64"], "nothing travels in lossy packets"),
    # Fine-tuning data the task does not read.
    ("finetune", ["data.source=corpus.txt"], "finetune.task synthetic makes its own questions"),
    ("finetune", ["finetune.task=boolq", "finetune.synthetic_train=8"],
     "finetune.task boolq reads its questions from data.source"),
]


def _cfg(mode, overrides=()):
    return C.from_dict({"experiment": {"mode": mode}, "mesh": {"dp": 2}}, list(overrides))


@pytest.mark.parametrize("mode, overrides, words", IGNORED)
def test_a_key_the_mode_would_ignore_is_refused_in_one_sentence(mode, overrides, words):
    with pytest.raises(C.ConfigError) as refusal:
        modes.check(_cfg(mode, overrides))
    sentence = str(refusal.value)
    key = overrides[-1].split("=")[0]
    assert sentence.startswith(f"{key}: ") and words in sentence, sentence
    assert sentence.count(". ") == 0 and sentence.endswith(".") and "remove it" in sentence


# Where the mechanism is on, the same keys are read, and accepted.
HONOURED = [
    ("train", ["abft.enabled=true", "abft.recompute=true"]),
    ("abft", ["abft.recompute=true", "abft.threshold=rounding"]),
    ("lockstep", ["abft.enabled=true", "abft.output_partials=2"]),
    ("detect", ["detect.detectors=abft,shadow,localize,monitor", "abft.recompute=true",
                "detect.shadow_rank=1", "detect.replicas=5", "detect.spike_window=4"]),
    ("detect", ["detect.advance=primary", "detect.rollback=true", "detect.max_retries=2"]),
    ("paft", ["paft.dynamic=true", "paft.h_max=8", "paft.overlap=true",
              "paft.sync_opt_state=true"]),
    ("paft", ["paft.noise.large_every=5", "paft.noise.large_sigma2=1.0", "paft.loss.p=0.1",
              "paft.loss.burst=4", "paft.loss.aggregate=zero", "paft.loss.packet_size=64"]),
    ("paft", ["paft.loss.param_p=0.1", "paft.loss.packet_size=64"]),
    ("finetune", ["finetune.synthetic_train=8", "collectives.enabled=true", "mesh.tp=2"]),
    ("finetune", ["finetune.task=boolq", "data.source=folder", "data.split=validation"]),
]


@pytest.mark.parametrize("mode, overrides", HONOURED)
def test_the_same_keys_pass_where_the_mode_reads_them(mode, overrides):
    modes.check(_cfg(mode, overrides))


@pytest.mark.parametrize("mode", list(modes.REGISTRY))
def test_no_key_at_its_default_is_refused(mode):
    # Every key written out at its default, as a run's config.yaml holds them.
    explicit = C.to_dict(C.Config())
    explicit["experiment"]["mode"], explicit["mesh"]["dp"] = mode, 2
    modes.check(C.from_dict(explicit))


def test_tensor_parallelism_outside_a_pair_is_refused_before_anything_is_built():
    for mode in ("train", "abft"):
        with pytest.raises(C.ConfigError, match=f"experiment.mode '{mode}' runs data-parallel"):
            modes.check(_cfg(mode, ["mesh.tp=2"]))


@pytest.mark.parametrize("mode", ["lockstep", "finetune", "paft"])
def test_the_sorted_embedding_gradient_is_refused_where_the_step_is_inside_shard_map(mode):
    # It was refused only while the step was traced, after the initial state had compiled.
    with pytest.raises(C.ConfigError, match=f"experiment.mode {mode}'s step is inside one"):
        modes.check(_cfg(mode, ["model.embedding_grad=sorted"]))
    for other in ("train", "abft", "detect"):
        modes.check(_cfg(other, ["model.embedding_grad=sorted"]))


def test_a_model_key_finetune_init_overrides_is_refused(tmp_path):
    # The run folder's model is the one fine-tuned; model.* named another (but model.dtype).
    init = tmp_path / "pretrained"
    init.mkdir()
    (init / RF.CONFIG).write_text(C.dump(C.from_dict({}, ["model.n_layers=1"])))
    base = ["experiment.mode=finetune", f"finetune.init={init}"]
    with pytest.raises(C.ConfigError, match=r"model.n_layers: 3 would be ignored, since "
                                            r"finetune.init .* \(n_layers 1 there\)"):
        modes.check(C.from_dict({}, base + ["model.n_layers=3"]))
    with pytest.raises(C.ConfigError, match=r"model.attention: \"unfused\" would be ignored"):
        modes.check(C.from_dict({}, base + ["model.attention=unfused"]))
    modes.check(C.from_dict({}, base + ["model.n_layers=1", "model.dtype=bfloat16"]))
    # A Hugging Face folder's config.json (its tensors are not read for this).
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}))
    base = ["experiment.mode=finetune", f"finetune.init={hf}"]
    with pytest.raises(C.ConfigError, match=r"model.d_model: 128 would be ignored"):
        modes.check(C.from_dict({}, base + ["model.d_model=128", "model.n_heads=4"]))
    modes.check(C.from_dict({}, base + ["model.dtype=bfloat16", "model.param_dtype=bfloat16"]))


def test_docs_name_the_modes_that_read_each_key():
    classes = {name: modes.get(name) for name in modes.REGISTRY}
    assert "`paft`" not in reference._readers("suspect.fault_kind", classes)
    assert reference._readers("data.text_field", classes) == "every mode but `finetune`"
    assert "`finetune`" in reference._readers("collectives.enabled", classes)


def test_finetune_runs_the_collectives_checksums_its_docs_promise():
    # Its pair is free mode's (finetune/trainer.py), with collectives.enabled's feature.
    from sdcstudy.finetune.trainer import FinetuneTrainer

    cfg = C.from_dict({}, ["experiment.mode=finetune", "mesh.tp=2", "model.n_layers=1",
                           "collectives.enabled=true", "data.seq_len=176",
                           "finetune.synthetic_train=4", "finetune.synthetic_test=4",
                           "finetune.eval_batch_size=4", "experiment.batch_size=4"])
    modes.check(cfg)
    trainer = FinetuneTrainer.from_config(cfg)
    assert "collectives" in [f.name for f in trainer.features]
    assert "collectives.parquet" in trainer.TABLES
