"""Our Llama against HF transformers on the same random checkpoints; the loader's errors."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from sdcstudy.core import hf
from sdcstudy.core.config import UserError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Same algorithm in float32 on both sides: matmul and softmax sums are reassociated differently
# by XLA and torch, which moved logits by about 1e-6 of their largest magnitude when written.
LOGIT_RTOL = 1e-5
LOGIT_ATOL_OF_MAX = 1e-5  # absolute tolerance, as a fraction of max |logits|
# Dropping the llama3 rope scaling must move the logits far beyond the tolerance, or the
# scaling test proves nothing.
ROPE_EFFECT_MIN = 1e-2
BATCH, LENGTH = 2, 24
# Random weights larger than HF's default std 0.02, so attention is far from uniform and
# positions (rope) matter; norm scales are perturbed so swapped norms would show.
WEIGHT_STD = 0.15
NORM_NOISE = 0.2

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, rope_theta=10_000.0,
             rms_norm_eps=1e-5, attn_implementation="eager")
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CONFIGS = {
    "llama": ("llama", {}),
    "mistral_head_dim": ("mistral", dict(head_dim=24, sliding_window=None, rms_norm_eps=1e-6)),
    "mistral_window_ok": ("mistral", dict(sliding_window=LENGTH)),
    "llama3_rope": ("llama", dict(rope_scaling=dict(LLAMA3_SCALING))),  # HF edits the dict
    "tied": ("llama", dict(tie_word_embeddings=True)),
}


def _hf_model(kind: str, overrides: dict, seed: int):
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**SMALL, **overrides})
        net = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MistralConfig(**{**SMALL, **overrides})
        net = transformers.MistralForCausalLM(config)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + NORM_NOISE * torch.randn_like(p))
            else:
                p.normal_(0.0, WEIGHT_STD)
    return net.float().eval()


@pytest.fixture(scope="module")
def tokens_BL():
    return np.random.default_rng(0).integers(0, SMALL["vocab_size"], (BATCH, LENGTH))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokens_BL):
    """name -> (folder, HF float32 logits) for each config in CONFIGS."""
    out = {}
    for seed, (name, (kind, overrides)) in enumerate(CONFIGS.items()):
        net = _hf_model(kind, overrides, seed)
        folder = tmp_path_factory.mktemp(name)
        net.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            expected = net(torch.as_tensor(tokens_BL)).logits.float().numpy()
        out[name] = folder, expected
    return out


def _assert_logits_close(ours, expected):
    atol = LOGIT_ATOL_OF_MAX * np.abs(expected).max()
    np.testing.assert_allclose(ours, expected, rtol=LOGIT_RTOL, atol=atol)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(saved, tokens_BL, name):
    """A failure means our model or the loader computes something other than HF Llama/Mistral."""
    folder, expected = saved[name]
    dims, params = hf.load_hf_checkpoint(folder, max_length=LENGTH)
    ours = hf.logits(dims, params, tokens_BL)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    _assert_logits_close(ours, expected)


def test_loaded_dims(saved):
    """The config fields we read land in ModelDims, in both rope layouts' llama3 form."""
    dims, params = hf.load_hf_checkpoint(saved["mistral_head_dim"][0])
    assert (dims.head_dim, dims.n_heads, dims.n_kv_heads, dims.norm_eps) == (24, 4, 2, 1e-6)
    assert params["layers"][0]["attn"]["wq"].shape == (64, 4 * 24)
    dims, params = hf.load_hf_checkpoint(saved["tied"][0])
    assert dims.tie_embeddings and "head" not in params
    dims, _ = hf.load_hf_checkpoint(saved["llama3_rope"][0])
    assert dims.rope_scaling == (("factor", 8.0), ("high_freq_factor", 4.0),
                                 ("low_freq_factor", 1.0), ("original_max_position_embeddings", 16))


def test_rope_scaling_matters_at_this_length(saved, tokens_BL):
    """Without llama3 scaling the logits must miss HF's, so the rope test above has teeth."""
    folder, expected = saved["llama3_rope"]
    dims, params = hf.load_hf_checkpoint(folder)
    unscaled = hf.logits(dataclasses.replace(dims, rope_scaling=None), params, tokens_BL)
    assert np.abs(unscaled - expected).max() > ROPE_EFFECT_MIN * np.abs(expected).max()


def test_old_rope_layout(saved, tokens_BL, tmp_path):
    """A transformers 4 config.json (top-level rope_theta, rope_scaling 'type') reads the same."""
    folder, expected = saved["llama3_rope"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    new, old = hf.load_hf_checkpoint(folder)[0], hf.load_hf_checkpoint(tmp_path)[0]
    assert old == new


def test_sharded_checkpoint_loads_identically(saved, tmp_path):
    """Shards listed in model.safetensors.index.json give bit-identical parameters."""
    net = _hf_model("llama", {}, seed=0)
    net.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, sharded = hf.load_hf_checkpoint(tmp_path)
    _, single = hf.load_hf_checkpoint(saved["llama"][0])
    same = jax.tree_util.tree_map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                  sharded, single)
    assert all(jax.tree_util.tree_leaves(same))


def test_bfloat16_checkpoint(tmp_path):
    """bf16 weights load as bf16 params bit for bit; dtype='float32' overrides."""
    net = _hf_model("llama", {}, seed=0).to(torch.bfloat16)
    net.save_pretrained(tmp_path, safe_serialization=True)
    dims, params = hf.load_hf_checkpoint(tmp_path)
    assert (dims.dtype, dims.param_dtype) == ("bfloat16", "bfloat16")
    wq = net.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["attn"]["wq"], np.float32), wq)
    dims32, params32 = hf.load_hf_checkpoint(tmp_path, dtype="float32")
    assert dims32.param_dtype == "float32" and params32["embed"].dtype == np.float32


def _edited_copy(folder, tmp_path, **changes):
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


@pytest.mark.parametrize("changes, words", [
    (dict(model_type="gemma"), "model_type 'gemma'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "'yarn'"),
    (dict(attention_bias=True), "biases"),
    (dict(hidden_size=32), "shape"),
])
def test_unsupported_configs_are_user_errors(saved, tmp_path, changes, words):
    """Checkpoints our model can not reproduce are refused in one sentence, not run wrongly."""
    folder = _edited_copy(saved["llama"][0], tmp_path, **changes)
    with pytest.raises(UserError, match=words):
        hf.load_hf_checkpoint(folder)


def test_sliding_window_shorter_than_run_is_refused(saved):
    """A Mistral window shorter than the sequences we would run changes the attention."""
    with pytest.raises(UserError, match="sliding_window 24"):
        hf.load_hf_checkpoint(saved["mistral_window_ok"][0], max_length=LENGTH + 1)


def test_missing_files_name_the_path(saved, tmp_path):
    """Missing folder, config.json or weights each raise a UserError naming the path."""
    missing = tmp_path / "nowhere"
    with pytest.raises(UserError, match="nowhere"):
        hf.load_hf_checkpoint(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json"):
        hf.load_hf_checkpoint(tmp_path / "empty")
    shutil.copy(saved["llama"][0] / "config.json", tmp_path / "empty")
    with pytest.raises(UserError, match="empty.*safetensors"):
        hf.load_hf_checkpoint(tmp_path / "empty")
