"""The `model` section of a config and the sizes it resolves to: built-in presets, preset files
in `configs/models/`, and `ModelDims`, what the model code reads. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcstudy.core import bounds, yamlsafe
from sdcstudy.core.errors import ConfigError, did_you_mean


@dataclass
class ModelConfig:
    """Llama-style decoder. Sizes set to null take the preset's value."""

    # A built-in preset (tiny, small, medium, llama3.2-1b, llama3-8b, ...) or
    # configs/models/NAME.yaml.
    preset: str = "tiny"
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # storage dtype of parameters and optimizer state
    vocab_size: int | None = None  # tokens in the vocabulary (at least 1 or null)
    d_model: int | None = None  # hidden size (at least 1 or null)
    n_layers: int | None = None  # decoder blocks (at least 1 or null)
    n_heads: int | None = None  # query heads (at least 1 or null)
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention) (at least 1 or null)
    head_dim: int | None = None  # size of one head, even (at least 2 or null)
    ffn_dim: int | None = None  # SwiGLU hidden size (at least 1 or null)
    rope_theta: float | None = None  # RoPE base frequency (finite, positive or null)
    norm_eps: float | None = None  # RMSNorm epsilon (finite, positive or null)
    tie_embeddings: bool | None = None  # output projection shares the embedding
    # auto (cuDNN's fused attention on a GPU, einsum + softmax elsewhere; where cuDNN's
    # cannot launch under the determinism flags, jaxlib 0.11.2 and earlier, the Pallas kernels
    # where they take the step, else einsum + softmax), fused (also off a GPU; refused where
    # cuDNN's cannot launch), unfused, or pallas (JAX's Pallas flash
    # attention: Triton kernels on a GPU, no cuDNN, a backward without atomic adds; its
    # interpreter elsewhere, slow); fused and pallas run only where no hook reads
    # attn_scores, attn_probs or attn_context (docs/gpu.md).
    attention: str = "auto"
    # scatter (autodiff of the lookup: a scatter-add, atomic on a GPU without the determinism
    # flags) or sorted (each row's cotangents summed in an order the tokens fix: a sort, a
    # segmented scan, a gather; other bits than scatter's; outside shard_map only)
    # (core/embedding.py, docs/gpu.md).
    embedding_grad: str = "scatter"



@dataclass(frozen=True)
class ModelDims:
    """Resolved model sizes: what the model code reads."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    rope_scaling: tuple | None = None  # llama3 scaling as a sorted tuple of (key, value)
    attention: str = "auto"  # model.attention
    embedding_grad: str = "scatter"  # model.embedding_grad

    @property
    def n_params(self) -> int:
        d, f, v = self.d_model, self.ffn_dim, self.vocab_size
        attn = d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.n_layers * per_layer + d + head


PRESETS: dict[str, dict[str, Any]] = {
    # Tests and CPU demos: D=64, 2 layers, byte vocabulary.
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    # About 25M parameters: the largest that trains comfortably on a 2-core CPU.
    "small": dict(vocab_size=256, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536),
    # About 104M parameters: the scaling benchmarks' third size, between small and the 8B
    # blocks; 12 heads and 4 KV heads (head dim 64) and FFN 4x split over tp = 1, 2 or 4.
    "medium": dict(vocab_size=256, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                   ffn_dim=3072),
    # Ma et al., appendix B.2: Llama3-8B blocks (d=4096, 32 heads, 8 KV heads, head dim 128,
    # FFN 4x = 16384), 16 layers for section 4 and appendix D, 32 for sections 5-6.
    "llama3-8b-16l": dict(vocab_size=128256, d_model=4096, n_layers=16, n_heads=32, n_kv_heads=8,
                          ffn_dim=16384, rope_theta=500_000.0),
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=16384, rope_theta=500_000.0),
    # Llama 3.2 1B's shape (d=2048, 16 layers, 32 heads, 8 KV heads, head dim 64, FFN 8192,
    # its llama3 RoPE scaling): the ~1B size for one GPU. Unlike Llama 3.2 1B the output head
    # is its own matrix (1.50B parameters in all, not 1.24B): set tie_embeddings to share it.
    "llama3.2-1b": dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                        ffn_dim=8192, rope_theta=500_000.0,
                        rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0),
                                      ("low_freq_factor", 1.0),
                                      ("original_max_position_embeddings", 8192))),
}

DTYPES = ("float32", "bfloat16")
ATTENTION_MODES = ("auto", "fused", "unfused", "pallas")  # model.attention; core/model.py reads it
EMBEDDING_GRADS = ("scatter", "sorted")  # model.embedding_grad; core/embedding.py reads it


def model_dims(model: ModelConfig, presets_dir: Path | None = None) -> ModelDims:
    """Resolve `model.preset` plus any explicit sizes into `ModelDims`, each in its range
    (`core/bounds.py`) and the sizes consistent with one another."""
    base = dict(PRESETS.get(model.preset) or _preset_from_file(model.preset, presets_dir))
    explicit = set()
    for f in dataclasses.fields(ModelConfig):
        value = getattr(model, f.name)
        if f.name not in ("preset", "dtype", "param_dtype") and value is not None:
            base[f.name] = value
            explicit.add(f.name)
    for key in ("dtype", "param_dtype"):
        if getattr(model, key) not in DTYPES:
            raise ConfigError(f"model.{key} must be one of {', '.join(DTYPES)}, "
                              f"not {getattr(model, key)!r}.")
    if model.attention not in ATTENTION_MODES:
        raise ConfigError(f"model.attention must be one of {', '.join(ATTENTION_MODES)}, "
                          f"not {model.attention!r}.")
    if model.embedding_grad not in EMBEDDING_GRADS:
        raise ConfigError(f"model.embedding_grad must be one of {', '.join(EMBEDDING_GRADS)}, "
                          f"not {model.embedding_grad!r}.")
    _check_sizes(base, explicit, model.preset)
    if "head_dim" not in base:
        if base["d_model"] % base["n_heads"]:
            raise ConfigError(f"model.d_model ({base['d_model']}) must be a multiple of "
                              f"model.n_heads ({base['n_heads']}), or set model.head_dim.")
        base["head_dim"] = base["d_model"] // base["n_heads"]
        _check_sizes({"head_dim": base["head_dim"]}, set(), model.preset)
    if base["head_dim"] % 2:
        raise ConfigError(f"model.head_dim ({base['head_dim']}) must be even: the rotary "
                          f"embedding turns pairs of its elements.")
    if base["n_heads"] % base["n_kv_heads"]:
        raise ConfigError(f"model.n_heads ({base['n_heads']}) must be a multiple of "
                          f"model.n_kv_heads ({base['n_kv_heads']}).")
    return ModelDims(**base, dtype=model.dtype, param_dtype=model.param_dtype)


_INT_SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim")
_FLOAT_SIZES = ("rope_theta", "norm_eps")


def _check_sizes(base: dict, explicit: set, preset: str) -> None:
    """Each resolved size of the right type and in its range; a value that came from the
    preset is named with it."""
    for key in _INT_SIZES + _FLOAT_SIZES:
        if key not in base:
            continue
        value = base[key]
        origin = "" if key in explicit else f" (from model.preset {preset!r})"
        if key in _FLOAT_SIZES and isinstance(value, int) and not isinstance(value, bool):
            value = base[key] = float(value)
        wanted = float if key in _FLOAT_SIZES else int
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise ConfigError(f"model.{key}{origin} must be {wanted.__name__}, not {value!r}.")
        bounds.check_value(f"model.{key}", value, origin=origin)


def _preset_from_file(name: str, presets_dir: Path | None) -> dict:
    """A preset that is not built in may be a YAML file `configs/models/NAME.yaml`."""
    folder = presets_dir or Path(__file__).resolve().parents[2] / "configs" / "models"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = sorted(PRESETS) + sorted(p.stem for p in folder.glob("*.yaml"))
        raise ConfigError(f"unknown model.preset {name!r}{did_you_mean(name, known)}; "
                          f"choose one of {', '.join(known)}.")
    data = yamlsafe.load_file(path, "model preset file") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"model preset file {str(path)!r} must be a YAML mapping of sizes.")
    allowed = {f.name for f in dataclasses.fields(ModelDims)}
    for key in data:
        if key not in allowed:
            raise ConfigError(f"unknown key {key!r} in model preset file {path}"
                              f"{did_you_mean(key, allowed)}.")
    return data
