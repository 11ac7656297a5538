"""The golden workloads' sizes: the quick tiny default, and the full coverage workload sized
from a description of the device it records on. Pure functions; imports no JAX.

The full workload is sized so that (docs/golden.md, "Coverage"):
- its main products launch several waves of thread blocks over every SM: with 128 x 128 output
  tiles, the smallest of the model's main GEMMs (tokens x d_model by d_model x d_model) has
  ceil(tokens / 128) * ceil(d_model / 128) tiles, at least `WAVES` per SM, and so do the
  float32 products (gemm_size / 128 squared tiles);
- a buffer of `memory_share` of the device's memory is written by every step and read back,
  digested, by the next;
- a check repeats it for at least `min_seconds`, long enough to reach full clocks and power.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sdcstudy.core.errors import UserError

# The default workload: tiny Llama, 6 steps of 2 microsteps of 4 sequences of 64 tokens.
TINY = {
    "experiment": {"mode": "train", "steps": 6, "microsteps": 2, "batch_size": 4, "seed": 0,
                   "checkpoint_every": 0, "name": "golden"},
    "model": {"preset": "tiny", "dtype": "float32"},
    "optim": {"warmup_steps": 2},
    "data": {"source": "synthetic", "seq_len": 64},
}
WORKLOADS = ("tiny", "full")

TILE = 128  # output tile of a tensor-core GEMM, per side
WAVES = 4  # thread blocks per SM of each main product, at least
MEMORY_SHARE = 0.75  # of the device's memory, written and read back every step
MAX_MEMORY_SHARE = 0.9  # what is left holds the model, its activations and the runtime
CHUNK_WORDS = 1 << 20  # the memory buffer's digest unit: 4 MiB of uint32 words
BLOCK_CHUNKS = 64  # chunks the memory buffer is read back in per loop iteration: 256 MiB
GPU_MIN_SECONDS = 60.0  # repeated at least this long: clocks, power and temperature settle
MiB = 1 << 20
BLOCKS = 64  # digest blocks per tensor (golden/digest.py)
PRODUCTS = ("tf32", "highest", "bfloat16")  # the full workload's products, digested each step
COVERAGE_DIGESTS = ("memory",) + PRODUCTS  # the full workload's digests beside the model's


def n_blocks(size: int) -> int:
    """Digest blocks of a tensor of `size` elements."""
    return max(1, min(BLOCKS, size))


def block_range(block: int, size: int) -> tuple[int, int]:
    """[start, stop) of the elements of digest block `block` of a tensor of `size` elements."""
    per = -(-size // n_blocks(size))
    return block * per, min(size, (block + 1) * per)


@dataclass(frozen=True)
class DeviceDescription:
    """What the full workload is sized from: streaming multiprocessors (SMs), memory in bytes,
    the floating-point types its products run in. `simulated`: a CPU stand-in, not a GPU."""

    platform: str
    kind: str
    sms: int
    memory_bytes: int
    dtypes: tuple[str, ...]
    simulated: bool = False


# A simulated CPU device: one "SM" and 32 MiB, so that the full workload runs in seconds there.
CPU_DESCRIPTION = DeviceDescription("cpu", "cpu", sms=1, memory_bytes=32 * MiB,
                                    dtypes=("bfloat16", "float32"), simulated=True)


@dataclass(frozen=True)
class FullSizing:
    """The full workload's sizes (kept in golden.json: a check runs exactly these)."""

    d_model: int
    n_layers: int
    ffn_dim: int
    n_heads: int
    seq_len: int
    batch_size: int
    microsteps: int
    steps: int
    dtype: str  # the model's compute dtype: bfloat16 where the device has it
    gemm_size: int  # side of the float32 products (TF32 and HIGHEST)
    buffer_chunks: int  # the memory buffer, in CHUNK_WORDS words each
    min_seconds: float  # a check repeats the workload at least this long

    @property
    def tokens(self) -> int:
        """Tokens per microstep: the M dimension of the model's GEMMs."""
        return self.seq_len * self.batch_size

    @property
    def buffer_bytes(self) -> int:
        return 4 * CHUNK_WORDS * self.buffer_chunks

    def tiles(self) -> dict:
        """128 x 128 output tiles (thread blocks) of each main product, by name."""
        t = math.ceil(self.tokens / TILE)
        return {"model d x d (attention projections)": t * math.ceil(self.d_model / TILE),
                "model d x ffn (feed-forward)": t * math.ceil(self.ffn_dim / TILE),
                "float32 products": math.ceil(self.gemm_size / TILE) ** 2}

    def config(self) -> dict:
        """The training config of the model part (for `config.from_dict`)."""
        head_dim = self.d_model // self.n_heads
        return {
            "experiment": {"mode": "train", "steps": self.steps, "microsteps": self.microsteps,
                           "batch_size": self.batch_size, "seed": 0, "checkpoint_every": 0,
                           "name": "golden-full"},
            "model": {"preset": "tiny", "dtype": self.dtype, "param_dtype": "float32",
                      "d_model": self.d_model, "n_layers": self.n_layers,
                      "n_heads": self.n_heads, "n_kv_heads": self.n_heads,
                      "head_dim": head_dim, "ffn_dim": self.ffn_dim},
            "optim": {"warmup_steps": 2, "lr": 1e-3},
            "data": {"source": "synthetic", "seq_len": self.seq_len},
        }

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def size_full(device: DeviceDescription, memory_share: float = MEMORY_SHARE) -> FullSizing:
    """The full workload for `device` (module docstring says what it guarantees)."""
    if not 0 < memory_share <= MAX_MEMORY_SHARE:
        raise UserError(f"--memory-share must be above 0 and at most {MAX_MEMORY_SHARE}, not "
                        f"{memory_share}.")
    if device.sms < 1 or device.memory_bytes < 4 * CHUNK_WORDS:
        raise UserError(f"device {device.kind!r} reports {device.sms} SMs and "
                        f"{device.memory_bytes} bytes: too small to size the full workload.")
    blocks = WAVES * device.sms  # thread blocks each main product must launch
    d_tiles = min(16, max(1, math.isqrt(blocks // 8)))
    token_tiles = math.ceil(blocks / d_tiles)
    seq_len = 4 * TILE if token_tiles >= 16 else TILE
    batch_size = math.ceil(token_tiles * TILE / seq_len)
    d_model = TILE * d_tiles
    buffer_chunks = int(memory_share * device.memory_bytes) // (4 * CHUNK_WORDS)
    return FullSizing(
        d_model=d_model, n_layers=1 if device.simulated else 4, ffn_dim=3 * d_model,
        n_heads=d_tiles, seq_len=seq_len, batch_size=batch_size, microsteps=2,
        steps=3 if device.simulated else 8,
        dtype="bfloat16" if "bfloat16" in device.dtypes else "float32",
        gemm_size=TILE * math.ceil(math.sqrt(blocks)), buffer_chunks=max(1, buffer_chunks),
        min_seconds=0.0 if device.simulated else GPU_MIN_SECONDS)


def sizing_from_dict(values: dict) -> FullSizing:
    """A FullSizing as golden.json keeps it."""
    return FullSizing(**values)
