"""The kernel census of a compiled step (sdcstudy/bench/census.py).

On a GPU the census is how we tell which library runs each matrix product (an untuned Triton
tile under the determinism flags, cuBLAS once tuned), whether attention is fused and whether a
scatter was serialized into a `while` loop. No GPU runs here, so two kinds of input stand in:
an optimized HLO module in XLA:GPU's printed form (tests/data/census_gpu_step.hlo: cuBLAS and
cuBLASLt calls, Triton GEMM fusions in both the older `triton_gemm_config` and the nested
`block_level_fusion_config` form, a cuDNN GEMM fusion and cuDNN attention, a scatter kept, one
expanded into a loop and one sorted), and the real tiny training step compiled for this CPU,
whose census must agree with the traced program it came from.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import pytest

from sdcstudy.bench import census as C

DATA = Path(__file__).resolve().parent / "data"
GPU_STEP = DATA / "census_gpu_step.hlo"
# An older XLA's printing: each backend_config one quoted, escaped JSON string.
QUOTED = DATA / "census_quoted_config.hlo"
T, D, F = 512, 768, 3072  # the fixture's tokens, model width and FFN width


def gflop(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k / 1e9


@pytest.fixture(scope="module")
def gpu_census() -> dict:
    return C.census(GPU_STEP.read_text())


def test_each_gemm_is_counted_under_its_library_with_its_flops(gpu_census):
    """One cuBLAS GEMM in the entry, one cuBLASLt GEMM inside the microstep loop's body,
    three Triton GEMM fusions and one cuDNN GEMM fusion: a wrong count here would blame
    the wrong library for a slow step, and wrong FLOPs the wrong share of it."""
    assert gpu_census["gemms"] == {"cublas": 1, "cublaslt": 1, "triton": 3, "cudnn": 1,
                                   "xla": 0}
    expected = {"cublas": gflop(T, F, D), "cublaslt": gflop(F, D, T),
                "triton": gflop(T, F, D) + gflop(T, D, F) + gflop(T, D, D),
                "cudnn": gflop(T, D, D), "xla": 0.0}
    assert gpu_census["gemm_gflop"] == pytest.approx(expected, rel=1e-12)


def test_triton_tiles_are_read_in_both_config_forms(gpu_census):
    """The untuned default tile (32x32x32, one stage, four warps) must be told apart from
    tuned ones, whether XLA printed a `triton_gemm_config` or a nested GEMM fusion whose
    block_k comes from its lhs operand's tile: this is the evidence the determinism flags
    left the GEMMs untuned."""
    tiles = {(t["block_m"], t["block_n"], t["block_k"]): t for t in gpu_census["triton_tiles"]}
    assert set(tiles) == {(32, 32, 32), (128, 128, 64), (64, 128, 32)}
    assert tiles[32, 32, 32] == {"block_m": 32, "block_n": 32, "block_k": 32, "split_k": 1,
                                 "num_stages": 1, "num_warps": 4, "count": 1}
    assert tiles[128, 128, 64]["num_stages"] == 4 and tiles[128, 128, 64]["num_warps"] == 8
    nested = tiles[64, 128, 32]
    assert (nested["num_stages"], nested["num_warps"], nested["count"]) == (3, 8, 1)
    assert "split_k" not in nested  # the nested form states none


def test_attention_scatters_and_loops(gpu_census):
    """cuDNN's fused attention forward and backward; of the three scatters one kept, one
    expanded into a 16,384-trip serial loop and one sorted; the microstep loop (not from a
    scatter) listed with its trip count but not counted as a serialized scatter."""
    assert gpu_census["attention"] == {"cudnn_fmha_forward": 1, "cudnn_fmha_backward": 1,
                                       "pallas_forward": 0, "pallas_backward": 0}
    assert gpu_census["scatters"] == {"native": 1, "while_loops": 1, "sort_based": 1}
    trips = {loop["trip_count"]: loop["op_name"] for loop in gpu_census["while_loops"]}
    assert set(trips) == {16384, 4}
    assert trips[16384].endswith("scatter-add") and trips[4] == "jit(train_step)/while"


def test_fusions_count_where_they_launch(gpu_census):
    """Seven fusions launch (three Triton GEMMs, a cuDNN GEMM, a loop, a reduction and a
    scatter); the two operand fusions nested inside a Triton GEMM launch nothing of their own
    and must not be counted."""
    assert gpu_census["fusions"] == 7
    assert gpu_census["fusion_kinds"] == {"__triton_gemm": 2, "__triton_nested_gemm_fusion": 1,
                                          "__cudnn$fusion": 1, "kLoop": 1, "kInput": 2}
    assert gpu_census["cudnn_fusions"] == 1
    assert gpu_census["custom_calls"] == {"__cublas$gemm": 1, "__cublas$lt$matmul": 1,
                                          "__cudnn$fmhaSoftmax": 1,
                                          "__cudnn$fmhaSoftmaxBackward": 1}


# The Pallas flash attention's kernels as XLA:GPU prints Triton custom calls: the kernel's
# name in the backend config (in either spelling), beside another Triton kernel, and the
# kernel names again in op_name metadata, which must not count (a backslash joins lines).
PALLAS_STEP = """HloModule jit_train_step

ENTRY %main.9 (p: bf16[4,128,12,64]) -> bf16[4,128,12,64] {
  %p = bf16[4,128,12,64]{3,2,1,0} parameter(0)
  %fwd = (bf16[4,128,12,64]{3,2,1,0}, f32[4,12,128]{2,1,0}) custom-call(%p, %p, %p), \
custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/mha_forward"}, \
backend_config={name = "mha_forward", ir = "payload"}
  %other = bf16[4,128,12,64]{3,2,1,0} custom-call(%p), \
custom_call_target="__gpu$xla.gpu.triton", \
metadata={op_name="jit(train_step)/mha_backward/pallas_call"}, \
backend_config={ir="x", name="rms_norm"}
  %bwd = (bf16[4,128,12,64]{3,2,1,0}, bf16[4,128,12,64]{3,2,1,0}) custom-call(%p, %other), \
custom_call_target="__gpu$xla.gpu.triton", backend_config={ir="payload", name="mha_backward"}
  ROOT %out = bf16[4,128,12,64]{3,2,1,0} get-tuple-element(%bwd), index=0
}
"""


def test_pallas_attention_kernels_are_counted_by_name():
    """The Pallas path's forward and backward kernels, by the name in their backend config;
    another Triton kernel and kernel names in metadata count as neither."""
    c = C.census(PALLAS_STEP)
    assert c["custom_calls"] == {"__gpu$xla.gpu.triton": 3}
    assert c["attention"] == {"cudnn_fmha_forward": 0, "cudnn_fmha_backward": 0,
                              "pallas_forward": 1, "pallas_backward": 1}
    assert "Pallas attention 1 forward, 1 backward" in C.describe(c)


def test_older_quoted_backend_configs_read_the_same():
    """Older XLA versions print backend_config as one quoted, escaped JSON string; the census
    must read the library, the FLOPs and the tile (split_k 2 included) from it alike, or a
    jaxlib upgrade would silently empty the census."""
    c = C.census(QUOTED.read_text())
    assert c["gemms"] == {"cublas": 1, "cublaslt": 0, "triton": 1, "cudnn": 0, "xla": 0}
    assert c["gemm_gflop"]["cublas"] == pytest.approx(gflop(64, 32, 128), rel=1e-12)
    assert c["gemm_gflop"]["triton"] == pytest.approx(gflop(64, 32, 128), rel=1e-12)
    assert c["triton_tiles"] == [{"block_m": 16, "block_n": 32, "block_k": 64, "split_k": 2,
                                  "num_stages": 2, "num_warps": 2, "count": 1}]


def test_describe_names_every_count(gpu_census):
    """The table's one line must carry the libraries, the default tile and the scatters."""
    line = C.describe(gpu_census)
    assert line.startswith("GEMMs 6: cuBLAS 1 (2.416 GFLOP), cuBLASLt 1 (2.416 GFLOP), "
                           "Triton 3 (5.436 GFLOP), cuDNN 1 (0.604 GFLOP)")
    assert "32x32x32 split_k 1 stages 1 warps 4: 1" in line
    assert "cuDNN attention 1 forward, 1 backward" in line and "Pallas" not in line
    assert line.endswith("scatters 1 kept, 1 as while loops, 1 sorted; 7 fusions")


def _traced(jaxpr, counts: dict) -> dict:
    """dot_general count and FLOPs, and scatter-add count, of a jaxpr and those inside it."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            counts["dots"] += 1
            counts["gflop"] += 2.0 * math.prod(out) * math.prod(lhs[i] for i in contracted) / 1e9
        elif name in ("scatter-add", "scatter_add"):
            counts["scatters"] += 1
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    _traced(inner, counts)
    return counts


def test_cpu_step_census_matches_the_traced_program():
    """The real tiny step compiled for this CPU: every dot_general the traced step holds is one
    XLA dot in the census with the same FLOPs (which also equal the roofline's model FLOPs),
    no library GEMM is reported (there is no cuBLAS here), and every scatter-add is still a
    scatter. A census that missed dots inside fusions, or invented cuBLAS calls, fails here."""
    from sdcstudy.bench import roofline
    from sdcstudy.bench import timing as BT
    from sdcstudy.core import config as config_module
    from sdcstudy.core.train import Trainer

    cfg = config_module.from_dict({"model": {"preset": "tiny"}, "data": {"seq_len": 16},
                                   "experiment": {"batch_size": 4, "steps": 3,
                                                  "checkpoint_every": 0}}, [])
    runner = BT.StepRunner(Trainer.from_config(cfg), BT.random_tokens(cfg))
    c = C.census(runner.hlo)
    traced = _traced(jax.make_jaxpr(runner.trainer.train_step)(runner.state, runner.batch).jaxpr,
                     {"dots": 0, "gflop": 0.0, "scatters": 0})
    assert traced["dots"] > 0 and traced["scatters"] > 0
    assert c["gemms"] == {"cublas": 0, "cublaslt": 0, "triton": 0, "cudnn": 0,
                          "xla": traced["dots"]}
    assert c["gemm_gflop"]["xla"] == pytest.approx(traced["gflop"], rel=1e-9)
    dims = config_module.model_dims(cfg.model)
    assert c["gemm_gflop"]["xla"] == pytest.approx(roofline.step_flops(dims, 4, 16) / 1e9,
                                                   rel=1e-9)
    assert c["triton_tiles"] == [] and c["attention"] == {
        "cudnn_fmha_forward": 0, "cudnn_fmha_backward": 0, "pallas_forward": 0,
        "pallas_backward": 0}
    assert c["scatters"] == {"native": traced["scatters"], "while_loops": 0, "sort_based": 0}
    assert c["fusions"] > 0 and not any(t.startswith("__cublas") for t in c["custom_calls"])
