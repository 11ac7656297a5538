"""Order-aware digests of pytrees: "did any bit change", answered in one string."""

from __future__ import annotations

import hashlib

import jax
import numpy as np


def path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def tensor_digests(tree) -> dict[str, str]:
    """SHA-256 of every leaf's bytes (with dtype and shape), keyed by its path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        array = np.asarray(jax.device_get(leaf))
        h = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
        out[path_name(path)] = h.hexdigest()
    return out


def tree_digest(tree) -> str:
    h = hashlib.sha256()
    for name, digest in tensor_digests(tree).items():
        h.update(f"{name}={digest};".encode())
    return h.hexdigest()
