"""The parts of the full golden workload beside the model (`golden.sizing` sizes them): a memory
buffer threaded through the step, and float32 products at TF32 (the default precision) and at
HIGHEST precision, each digested every step so that a wrong bit anywhere in them is seen.

The buffer holds `buffer_chunks` x CHUNK_WORDS uint32 words. Each step reads it (its digest is
the read-back of what the previous step wrote, kept in device memory between the two launches)
and writes the next pattern, `mix(word ^ salt(step))`, an invertible map, so the words stay
pseudo-random and a flipped bit in any word changes every later digest. The state is donated
and `sweep` reads it in blocks before rewriting it in place, so it costs its size once: written
as one expression over the whole buffer, XLA kept buffer-sized temporaries (on an H200 the step
asked for 105.51 GiB beside the buffer and failed; on the CPU two; tests/test_golden.py
measures the CPU's).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.golden.digest import _mix, block_digest
from sdcstudy.golden.sizing import (
    BLOCK_CHUNKS, CHUNK_WORDS, COVERAGE_DIGESTS, CPU_DESCRIPTION, PRODUCTS, DeviceDescription,
    FullSizing)

_PRECISION = {"tf32": lax.Precision.DEFAULT, "highest": lax.Precision.HIGHEST}


def describe(device, memory_bytes: int | None = None) -> DeviceDescription:
    """The description of a local JAX device that the full workload is sized from.
    `memory_bytes`: the device's memory when known from elsewhere (nvidia-smi)."""
    if device.platform == "cpu":
        return CPU_DESCRIPTION
    stats = device.memory_stats() or {}
    sms = getattr(device, "core_count", None)
    if not sms or not (memory_bytes or stats.get("bytes_limit")):
        raise ValueError(f"device {device.device_kind!r} does not report its SMs and memory.")
    dtypes = ("bfloat16", "tf32", "float32") if device.platform in ("gpu", "cuda") else (
        "bfloat16", "float32")
    return DeviceDescription(device.platform, device.device_kind, int(sms),
                             int(memory_bytes or stats["bytes_limit"]), dtypes)


def chunk_digest(buffer_CW) -> jax.Array:
    """uint32 (chunks, 2): per chunk of the buffer, the two lanes of `golden_digest`'s digest
    (positions within the chunk, so every index fits 32 bits whatever the buffer's size)."""
    i = jnp.arange(buffer_CW.shape[1], dtype=jnp.uint32)[None, :]
    lane_a = _mix(buffer_CW) * (2 * i + 1)
    lane_b = _mix(buffer_CW ^ jnp.uint32(0x5BD1E995)) * (_mix(i) | 1)
    return jnp.stack([jnp.sum(lane_a, axis=1, dtype=jnp.uint32),
                      jnp.sum(lane_b, axis=1, dtype=jnp.uint32)], axis=-1)


def sweep(buffer_CW, salt) -> tuple[jax.Array, jax.Array]:
    """(the buffer's next pattern `_mix(buffer ^ salt)`, its digest `chunk_digest(buffer)`),
    with no buffer-sized temporary: the digest is read BLOCK_CHUNKS chunks per loop iteration,
    then the rest one chunk at a time (each chunk's lanes are uint32 sums modulo 2^32, the
    same bits whatever the blocks), and the rewrite waits for the digest through its salt (a
    zero XLA does not fold), so every word is read before any is rewritten in place."""
    digest = _read_back(buffer_CW)
    salt = salt + (digest[0, 0] - digest[0, 0])
    return _mix(buffer_CW ^ salt), digest


def _read_back(buffer_CW) -> jax.Array:
    chunks = buffer_CW.shape[0]
    full = chunks // BLOCK_CHUNKS
    digest = jnp.zeros((chunks, 2), jnp.uint32)
    for start, count, size in ((0, full, BLOCK_CHUNKS),
                               (full * BLOCK_CHUNKS, chunks - full * BLOCK_CHUNKS, 1)):
        if count:
            digest = lax.fori_loop(0, count, partial(_digest_block, buffer_CW, start=start,
                                                     size=size), digest)
    return digest


def _digest_block(buffer_CW, i, digest, start, size):
    at = start + i * size
    block = lax.dynamic_slice_in_dim(buffer_CW, at, size, axis=0)
    return lax.dynamic_update_slice_in_dim(digest, chunk_digest(block), at, axis=0)


def _salt(step):
    return _mix(jnp.uint32(step) * jnp.uint32(0x9E3779B9) + jnp.uint32(1))


def init_state(sizing: FullSizing) -> dict:
    """The buffer's first pattern and the float32 products' operands (jit it onto a device)."""
    words = lax.broadcasted_iota(jnp.uint32, (sizing.buffer_chunks, CHUNK_WORDS), 1)
    chunks = lax.broadcasted_iota(jnp.uint32, (sizing.buffer_chunks, CHUNK_WORDS), 0)
    n = sizing.gemm_size
    key_x, key_w = jax.random.split(jax.random.key(17))
    return {"buffer": _mix(words ^ _mix(chunks + jnp.uint32(0x632BE5AB))),
            "x": jax.random.normal(key_x, (n, n), jnp.float32),
            "w": jax.random.normal(key_w, (n, n), jnp.float32) / jnp.sqrt(jnp.float32(n))}


def abstract_state(sizing: FullSizing, device) -> dict:
    """Shapes of `init_state` placed on `device`, to compile without allocating."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        jax.eval_shape(lambda: init_state(sizing)))


def step(state: dict, step_number) -> tuple[dict, dict]:
    """(the next state, this step's digests): the buffer read back, each product's output."""
    buffer, memory = sweep(state["buffer"], _salt(step_number))
    digests = {"memory": memory}
    x, w = state["x"], state["w"]
    products = {name: jnp.matmul(x, w, precision=_PRECISION[name]) for name in _PRECISION}
    products["bfloat16"] = jnp.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                      preferred_element_type=jnp.float32)
    for name in PRODUCTS:
        digests[name] = block_digest(products[name])
    next_x = jnp.tanh(products["highest"]) + 0.5 * jnp.tanh(products["tf32"] -
                                                            products["bfloat16"])
    return {"buffer": buffer, "x": next_x, "w": w}, digests


def digest_names() -> tuple[str, ...]:
    """The digests `step` returns, in the order a check compares them."""
    return COVERAGE_DIGESTS
