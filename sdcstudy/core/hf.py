"""Local Hugging Face Llama and Mistral checkpoints as our `ModelDims` and parameter dicts.

Reads `config.json` and `*.safetensors` (one file or shards listed in
`model.safetensors.index.json`) without torch, transposes Linear weights from HF's
(out, in) to our (in, out), and checks the result against `model.abstract_init`. Both the
transformers 4 layout (`rope_theta`, `rope_scaling`) and the 5 layout (`rope_parameters`)
of the rotary settings are understood.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from sdcstudy.core import model
from sdcstudy.core.errors import UserError
from sdcstudy.core.presets import DTYPES, ModelDims

MODEL_TYPES = ("llama", "mistral")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
_HF_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_HF_FFN = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved


def load_hf_checkpoint(path, *, dtype: str | None = None, max_length: int | None = None):
    """`(dims, params)` for a local HF Llama/Mistral folder; `dtype` overrides the stored one.

    `max_length` is the longest sequence you will run (default: the config's
    `max_position_embeddings`); a Mistral sliding window shorter than it is refused, since
    our model attends over the whole causal prefix.
    """
    folder = Path(path)
    hf = _read_config(folder)
    with contextlib.ExitStack() as stack:
        tensors = _open_tensors(folder, stack)
        stored = _stored_dtype(tensors)
        dims = _dims_from_config(hf, folder, dtype or stored, max_length)
        params = _convert(dims, tensors, folder)
    return dims, params


def hf_dims(path, *, dtype: str, max_length: int | None = None) -> ModelDims:
    """The model a local HF folder's config.json describes, in `dtype`; its tensors unread."""
    folder = Path(path)
    return _dims_from_config(_read_config(folder), folder, dtype, max_length)


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise UserError(f"Hugging Face checkpoint folder {str(folder)!r} does not exist.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"{str(folder)!r} has no config.json; is it a Hugging Face model folder?")
    return json.loads(config_path.read_text())


def _dims_from_config(hf: dict, folder: Path, dtype: str, max_length: int | None) -> ModelDims:
    where = str(folder / "config.json")
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise UserError(f"{where}: model_type {kind!r} is not supported; "
                        f"only {', '.join(MODEL_TYPES)} checkpoints can be loaded.")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UserError(f"{where}: attention or MLP biases are not supported by our model.")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported; "
                        f"our feed-forward is SwiGLU (silu).")
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    length = max_length or hf.get("max_position_embeddings")
    window = hf.get("sliding_window") if kind == "mistral" else None
    if window is not None and (length is None or window < length):
        raise UserError(f"{where}: sliding_window {window} is shorter than the sequences to run "
                        f"({length}); our model has no sliding window, so pass "
                        f"max_length <= {window}.")
    n_heads = hf["num_attention_heads"]
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise UserError(f"{where}: num_attention_heads ({n_heads}) is not a multiple of "
                        f"num_key_value_heads ({n_kv_heads}).")
    rope_theta, rope_scaling = _rope(hf, where)
    return ModelDims(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        ffn_dim=hf["intermediate_size"], rope_theta=rope_theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype, param_dtype=dtype, rope_scaling=rope_scaling)


def _rope(hf: dict, where: str) -> tuple[float, tuple | None]:
    """`(rope_theta, rope_scaling)` from the transformers 5 or 4 layout of config.json."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise UserError(f"{where}: per-layer-type rope_parameters are not supported.")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UserError(f"{where}: rope scaling type {kind!r} is not supported; "
                        f"only the default rotary embedding and 'llama3' scaling are.")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
    if missing:
        raise UserError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}.")
    return theta, tuple(sorted((k, rope[k]) for k in LLAMA3_ROPE_KEYS))


def _open_tensors(folder: Path, stack: contextlib.ExitStack) -> dict:
    """Tensor name without the `model.` prefix -> (open safetensors handle, stored name)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [f for f in files if not (folder / f).is_file()]
        if absent:
            raise UserError(f"{str(folder)!r} lacks weight shard {absent[0]!r} listed in "
                            f"{index.name}.")
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{str(folder)!r} has no *.safetensors weights.")
    tensors = {}
    for name in files:
        handle = stack.enter_context(safe_open(str(folder / name), framework="numpy"))
        for key in handle.keys():
            if not key.endswith(_IGNORED_SUFFIXES):
                tensors[key.removeprefix("model.")] = handle, key
    return tensors


def _stored_dtype(tensors: dict) -> str:
    """bfloat16 when every stored tensor is, else float32 (exact for float16 too)."""
    kinds = {handle.get_slice(key).get_dtype() for handle, key in tensors.values()}
    return "bfloat16" if kinds == {"BF16"} else "float32"


def _hf_name(path: tuple) -> tuple[str, bool]:
    """HF tensor name of one of our parameters, and whether it is a transposed Linear."""
    match path:
        case ("embed",):
            return "embed_tokens.weight", False
        case ("head",):
            return "lm_head.weight", True
        case ("final_norm", "scale"):
            return "norm.weight", False
        case ("layers", i, "attn", w):
            return f"layers.{i}.self_attn.{_HF_ATTN[w]}.weight", True
        case ("layers", i, "ffn", w):
            return f"layers.{i}.mlp.{_HF_FFN[w]}.weight", True
        case ("layers", i, "attn_norm", "scale"):
            return f"layers.{i}.input_layernorm.weight", False
        case ("layers", i, "ffn_norm", "scale"):
            return f"layers.{i}.post_attention_layernorm.weight", False
    raise ValueError(f"no Hugging Face name for parameter {'.'.join(map(str, path))}")


def _convert(dims: ModelDims, tensors: dict, folder: Path) -> dict:
    """Fill the tree of `model.abstract_init(dims)` from the checkpoint, checking every leaf."""
    used = set()

    def leaf(key_path, expected):
        path = tuple(getattr(k, "key", k) for k in key_path)
        ours, (name, transpose) = ".".join(map(str, path)), _hf_name(path)
        if name not in tensors:
            raise UserError(f"{str(folder)!r} lacks tensor {name!r} (our {ours}).")
        used.add(name)
        handle, stored = tensors[name]
        array = handle.get_tensor(stored)
        array = np.ascontiguousarray(array.T) if transpose else array
        if array.shape != expected.shape:
            raise UserError(f"{str(folder)!r}: tensor {name!r} has shape {array.shape} but our "
                            f"{ours} needs {expected.shape}; config.json and weights disagree.")
        return jnp.asarray(array, dtype=expected.dtype)

    params = jax.tree_util.tree_map_with_path(leaf, model.abstract_init(dims)[1])
    extra = sorted(set(tensors) - used - ({"lm_head.weight"} if dims.tie_embeddings else set()))
    if extra:
        raise UserError(f"{str(folder)!r} holds tensor {extra[0]!r} that our model has no place "
                        f"for (biases or an unsupported architecture?).")
    return params


@functools.cache
def _jitted_apply(dims: ModelDims):
    graphdef = model.abstract_init(dims)[0]
    return jax.jit(lambda params, tokens_BL: model.apply(graphdef, params, tokens_BL))


def logits(dims: ModelDims, params: dict, tokens) -> np.ndarray:
    """float32 logits (B, L, V) of int tokens (B, L), compiled once per `dims` and shape."""
    tokens_BL = np.asarray(tokens)
    if tokens_BL.ndim != 2 or not np.issubdtype(tokens_BL.dtype, np.integer):
        raise UserError(f"tokens must be a 2-D integer array (batch, length), "
                        f"not {tokens_BL.dtype} of shape {tokens_BL.shape}.")
    if tokens_BL.size and not 0 <= tokens_BL.min() <= tokens_BL.max() < dims.vocab_size:
        raise UserError(f"token ids must lie in [0, {dims.vocab_size}).")
    out = _jitted_apply(dims)(params, jnp.asarray(tokens_BL, jnp.int32))
    return np.asarray(out, dtype=np.float32)
