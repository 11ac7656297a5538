"""ABFT: checksummed matmuls flag exactly the corrupted products, locate the corrupted element,
recompute it bitwise, stay quiet on healthy runs, and miss what happens outside the matmuls.

The model is the tiny preset cut to one layer (every protected matmul still runs once, plus the
output head). Faults inside forward matmuls are injected at the projection outputs
(`fwd/attn_q`, ...), which ABFT checks after the fault, in a lock-step run whose comparison
also shows the recomputed forward values bitwise equal to the healthy node's; faults inside
backward matmuls through `Checker(corrupt_backward=...)`, which stands in for a fault between
a backward product and its check, in a single step compared bitwise with the plain step.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from sdcstudy.abft import checker as A
from sdcstudy.abft import checksum as CS
from sdcstudy import cli
from sdcstudy.core import config as C
from sdcstudy.faults import bits as FB
from sdcstudy.report import runs as report
from sdcstudy import runner
from sdcstudy.faults.trainer import NodeTrainer

BASE = {"experiment": {"batch_size": 2, "steps": 2, "checkpoint_every": 0},
        "model": {"n_layers": 1}, "data": {"seq_len": 16}, "optim": {"warmup_steps": 1}}
# The top exponent bit: a value below 2 in magnitude becomes about 2**128 times larger.
TOP_EXPONENT_BIT = {"float32": 30, "bfloat16": 14}
# One corruption in the output of every protected matmul (layer 1, head at layer 0).
FORWARD_SITES = {"q": "fwd/attn_q", "k": "fwd/attn_k", "v": "fwd/attn_v", "o": "fwd/attn_out",
                 "gate": "fwd/ffn_gate", "up": "fwd/ffn_up", "down": "fwd/ffn_out",
                 "head": "fwd/logits"}
# Backward products corrupted by the test hook: (matmul, layer, direction) -> flat index.
BACKWARD_HITS = {("up", 1, "bwd_input"): 37, ("q", 1, "bwd_weight"): 5,
                 ("head", 0, "bwd_weight"): 300}


def _cfg(dtype="float32", *overrides):
    return C.from_dict(BASE, [f"model.dtype={dtype}", *overrides])


def _corrupt_backward(matmul, layer, direction, grad):
    index = BACKWARD_HITS.get((matmul, layer, direction))
    if index is None:
        return grad
    hit = jnp.arange(grad.size).reshape(grad.shape) == index
    return jnp.where(hit, FB.flip_bits(grad, TOP_EXPONENT_BIT["float32"]), grad)


def _one_step(trainer):
    tokens = jax.random.randint(jax.random.key(1), (1, 2, 17), 0, 256)
    state, metrics, *extras = jax.jit(trainer.train_step)(trainer.init_state(),
                                                          {"tokens": tokens})
    return jax.device_get((state, metrics, extras))


def _abft_rows(trainer, extras):
    checks = extras[-1]["abft"]
    return trainer.abft.rows({k: v[0] for k, v in checks["fwd"].items()},
                             {k: v[0] for k, v in checks["bwd"].items()}, 1, 0)


def _bits(tree):
    return [np.asarray(x).view(np.uint16 if np.asarray(x).dtype.itemsize == 2 else np.uint32)
            for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b):
    for x, y in zip(_bits(a), _bits(b), strict=True):
        assert np.array_equal(x, y)


@pytest.fixture(scope="module")
def plain_step():
    """The step without ABFT: the reference every recomputed step must equal bit for bit."""
    return _one_step(NodeTrainer.from_config(_cfg()))


@pytest.fixture(scope="module")
def faulty_step():
    """ABFT with recomputation and a top-exponent flip in three backward products. (Forward
    faults are injected through the runner below, under tensor parallelism.)"""
    trainer = NodeTrainer.from_config(_cfg("float32", "abft.enabled=true",
                                             "abft.recompute=true"))
    trainer.abft = A.Checker(1, "paper", recompute=True, corrupt_backward=_corrupt_backward)
    state, metrics, extras = _one_step(trainer)
    return state, metrics, _abft_rows(trainer, extras)


def test_every_injected_backward_product_is_flagged_and_located(faulty_step):
    # If this fails, a backward matmul (dA = dC B^T or dB = A^T dC) is not checked, or checked
    # against the wrong operands, or its location is wrong.
    _, _, rows = faulty_step
    flagged = {(r["matmul"], r["layer"], r["direction"]): r for r in rows
               if r["direction"] != "fwd" and r["flagged"]}
    assert set(flagged) == set(BACKWARD_HITS)
    for key, r in flagged.items():
        assert r["row"] * r["n"] + r["col"] == BACKWARD_HITS[key] and r["recomputed"]


def test_recomputation_gives_the_clean_step_bit_for_bit(faulty_step, plain_step):
    # Three backward products were corrupted by 2**128-fold errors; recomputed on the flag,
    # the loss, parameters and optimizer state equal those of the step without ABFT and
    # without faults.
    state, metrics, _ = faulty_step
    plain_state, plain_metrics, _ = plain_step
    _assert_bitwise_equal(state, plain_state)
    _assert_bitwise_equal(metrics["loss/healthy"], plain_metrics["loss/healthy"])


def _profile_file(folder, dtype, probs_step=None, fault_step=3):
    """A profile (node 1) with one top-exponent flip in every protected matmul's output at
    `fault_step` and, if asked, a scaled softmax probability (outside the matmuls) earlier."""
    lines = ["name: abft-test", "specs:"]
    for matmul, site in FORWARD_SITES.items():
        bit = TOP_EXPONENT_BIT["float32" if matmul == "head" else dtype]  # logits: float32
        lines.append(f"  - {{site: {site}, kind: bitflip, count: 1, bits: [{bit}], "
                     f"pattern: {{kind: steps, steps: [{fault_step}]}}}}")
    if probs_step is not None:
        lines.append(f"  - {{site: fwd/attn_probs, kind: scale, count: 1, scale: [10.0, 100.0],"
                     f" pattern: {{kind: steps, steps: [{probs_step}]}}}}")
    path = folder / f"{dtype}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A lock-step run through the runner in float32 with tp=2, the paper's threshold and
    recomputation: the softmax corrupted at step 2, every matmul output at step 3."""
    root = tmp_path_factory.mktemp("abft")
    cfg = _cfg("float32", "abft.enabled=true", "abft.recompute=true", "abft.threshold=paper",
               "experiment.steps=3", "experiment.mode=lockstep", "mesh.tp=2",
               f"suspect.profile={_profile_file(root, 'float32', probs_step=2)}")
    summary = runner.run(cfg, root / "lockstep", progress=False)
    return {"lockstep": (summary, report.load_run(root / "lockstep"))}


@pytest.fixture(scope="module")
def bfloat16_steps(tmp_path_factory):
    """Two bfloat16 steps of one program with our threshold on the device (the paper's is
    evaluated on the same checks from the recorded residuals): step 1 healthy, step 2 with a
    top-exponent flip in every matmul's output. (abft.parquet rows, faults.parquet rows)."""
    profile = _profile_file(tmp_path_factory.mktemp("bf16"), "bfloat16", fault_step=2)
    trainer = NodeTrainer.from_config(_cfg("bfloat16", "abft.enabled=true",
                                             "abft.recompute=true", "abft.threshold=rounding",
                                             f"suspect.profile={profile}"))
    step_fn, state = jax.jit(trainer.train_step), trainer.init_state()
    checks, faults = [], []
    for step in (1, 2):
        tokens = jax.random.randint(jax.random.key(step), (1, 2, 17), 0, 256)
        state, metrics, *extras = jax.device_get(step_fn(state, {"tokens": tokens}))
        assert np.isfinite(metrics["loss/healthy"])
        records = extras[0]
        faults += trainer.fault_rows(records["faults"], step)[0]
        checks += trainer.abft.rows({k: v[0] for k, v in records["abft"]["fwd"].items()},
                                    {k: v[0] for k, v in records["abft"]["bwd"].items()}, step, 0)
    return pd.DataFrame(checks), pd.DataFrame(faults)


MATMUL_OF_SITE = {site: matmul for matmul, site in FORWARD_SITES.items()}


def _located(frame, faults, paired=True):
    """{(step, layer, matmul, node, tp_rank): flat index} of the flagged rows (as located) and
    of the injected matmul faults (as recorded). A single-node run has one node, whichever
    node its fault specs name."""
    node = (lambda r: r.node) if paired else (lambda r: 0)  # noqa: E731
    flagged = {(r.step, r.layer, r.matmul, node(r), r.tp_rank): r.row * r.n + r.col
               for r in frame[frame["flagged"]].itertuples()}
    truth = {(r.step, r.layer, MATMUL_OF_SITE[r.site], node(r), r.tp_rank): r.flat_index
             for r in faults.itertuples() if r.site in MATMUL_OF_SITE}
    return flagged, truth


def test_healthy_float32_steps_have_no_flags_and_follow_the_documented_columns(runs):
    summary, run = runs["lockstep"]
    frame = run.abft
    assert list(frame.columns[:9]) == list(report.ABFT_COLUMNS)
    # 3 steps x 2 nodes x 2 tp ranks x (7 block matmuls + head) x 3 directions.
    assert len(frame) == 3 * 2 * 2 * 8 * 3 == summary["abft/checks"]
    assert set(frame["direction"]) == set(A.DIRECTIONS)
    assert set(frame["matmul"]) == set(A.MATMULS.values())
    healthy = frame[(frame["node"] == 0) | (frame["step"] == 1)]
    assert not healthy["flagged"].any()
    # The checks are live: rounding leaves non-zero residuals, all below the paper's bound.
    assert (healthy["residual"] > 0).mean() > 0.5
    assert (healthy["residual"] < healthy["threshold"]).all()


def test_flags_under_tp_are_the_injected_faults_located_and_counted(runs):
    # Step 3: one flip per matmul output on each tp rank of the suspect; each is flagged at its
    # matmul, step, layer and rank, located to its element, and nothing else is flagged.
    summary, run = runs["lockstep"]
    flagged, truth = _located(run.abft, run.faults)
    assert len(truth) == len(FORWARD_SITES) * 2
    assert flagged == truth
    assert all(summary[f"abft/flags/{m}"] == 2 for m in FORWARD_SITES)
    assert summary["abft/flags"] == summary["abft/flags/fwd"] == len(truth)
    assert run.abft.loc[run.abft["flagged"], "recomputed"].all()


def test_softmax_corruption_is_missed_by_abft_and_caught_by_lockstep(runs):
    # The blind spot: a fault outside every matmul feeds the output projection a corrupted
    # input, so its checksums agree; the lock-step comparison at fwd/attn sees it.
    _, run = runs["lockstep"]
    probs = run.faults[run.faults["site"] == "fwd/attn_probs"]
    assert len(probs) == 2 and set(probs["step"]) == {2}
    assert not run.abft.loc[run.abft["step"] == 2, "flagged"].any()
    caught = run.mismatch[(run.mismatch["site"] == "fwd/attn") & (run.mismatch["step"] == 2)]
    assert caught["mismatches"].sum() > 0
    # At step 3 the recomputed products leave nothing for lock-step to repair.
    assert run.mismatch.loc[run.mismatch["step"] == 3, "mismatches"].sum() == 0


def test_bfloat16_paper_threshold_false_alarms_ours_none_and_catches_large(bfloat16_steps):
    # Side by side on the same healthy step: the paper's tau = k u (float32 u) flags healthy
    # bfloat16 products, the rounding bound flags none. If the paper's stops flagging, the
    # bfloat16 rounding of the products no longer reaches the checks.
    frame, faults = bfloat16_steps
    healthy = frame[frame["step"] == 1]
    assert not healthy["flagged"].any() and not A.host_flags(healthy, "rounding").any()
    paper = A.host_flags(healthy, "paper")
    assert paper.mean() > 0.1
    assert not paper[(healthy["out_bits"] == 32).to_numpy()].any()  # float32 logits never
    # Step 2: every flag is an injected fault at its element, and every fault that made a value
    # huge (> 2**64) is flagged; a flip that shrinks a value moves it by less than rounding may.
    flagged, truth = _located(frame, faults, paired=False)
    assert flagged and all(truth.get(k) == v for k, v in flagged.items())
    huge = {k for k, r in zip(truth, faults.itertuples()) if abs(r.corrupted) > 2.0 ** 64}
    assert len(huge) >= 4 and huge <= set(flagged)


CHECK = {rule: jax.jit(partial(CS.check, rule=rule)) for rule in CS.THRESHOLDS}


def test_check_locates_one_element_and_flags_non_finite_values():
    a = jax.random.normal(jax.random.key(0), (40, 24))
    b = jax.random.normal(jax.random.key(1), (24, 30))
    c = a @ b
    record = np.asarray(CHECK["paper"](a, b, c))
    norm = np.abs(np.asarray(a)).sum(1).max() * np.abs(np.asarray(b)).sum(1).max()
    assert record[CS.ROW_THRESHOLD] == pytest.approx(24 * 2.0 ** -23 * norm, rel=1e-6)
    assert record[CS.FLAGGED] == 0
    bad = c.at[17, 9].add(1.0)
    record = np.asarray(CHECK["paper"](a, b, bad))
    assert record[CS.FLAGGED] == 1 and (record[CS.ROW], record[CS.COL]) == (17, 9)
    record = np.asarray(CHECK["paper"](a, b, c.at[3, 4].set(jnp.nan)))
    assert record[CS.FLAGGED] == 1 and (record[CS.ROW], record[CS.COL]) == (3, 4)


def test_rounding_bound_holds_for_bfloat16_products_where_the_papers_fails():
    # 64 healthy bfloat16 products (float32 accumulation, bfloat16 output): the rounding bound
    # is never exceeded, the paper's tau = k u is; one element off by more than its row's
    # bfloat16 rounding is flagged and located by ours.
    ratios, paper_flags = [], 0
    for seed in range(64):
        a = jax.random.normal(jax.random.key(seed), (64, 64)).astype(jnp.bfloat16)
        b = jax.random.normal(jax.random.key(seed + 100), (64, 96)).astype(jnp.bfloat16)
        c = a @ b
        ratios.append(float(CHECK["rounding"](a, b, c)[CS.ROW_RATIO]))
        paper_flags += int(CHECK["paper"](a, b, c)[CS.FLAGGED])
    # Never exceeded, and not vacuous: the worst healthy residual reaches over 1/20 of it.
    assert 0.05 < max(ratios) < 1 and paper_flags > 32
    bad = c.at[10, 20].add(jnp.bfloat16(16.0))
    record = np.asarray(CHECK["rounding"](a, b, bad))
    assert record[CS.FLAGGED] == 1 and (record[CS.ROW], record[CS.COL]) == (10, 20)


def test_bad_threshold_is_one_sentence_and_exit_code_2(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("abft: {enabled: true, threshold: papr}\n")
    assert cli.main(["run", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "abft.threshold 'papr'" in err and "did you mean 'paper'" in err
    assert not (tmp_path / "run").exists()


def test_detection_summary_counts_products_not_rows():
    # Two faults in one product are one corrupted product; a flag without a fault lowers
    # precision; a fault outside the matmuls is reported apart and is not in the recall.
    where = {"step": 1, "microstep": 0, "tp_rank": 0}
    faults = [{**where, "layer": 1, "site": "fwd/attn_q"},
              {**where, "layer": 1, "site": "fwd/attn_q"},
              {**where, "layer": 2, "site": "fwd/ffn"},
              {**where, "layer": 1, "site": "fwd/attn_probs"}]
    checks = [{**where, "layer": 1, "matmul": "q", "direction": "fwd", "flagged": True},
              {**where, "layer": 2, "matmul": "down", "direction": "fwd", "flagged": False},
              {**where, "layer": 2, "matmul": "up", "direction": "bwd_input", "flagged": True}]
    assert A.detection_summary(checks, faults) == {
        "corrupted_products": 2, "faults_outside": 1, "detected_products": 1, "recall": 0.5,
        "flags": 2, "precision": 0.5}
    # A data-parallel rank's product is its own (faults.parquet names the rank struck): a
    # fault on rank 0 and flags on ranks 0 and 1 are one detected product and one false flag;
    # a fault on rank 1 flagged on rank 0 alone is missed.
    both = [{**checks[0], "dp_rank": rank} for rank in (0, 1)]
    on_rank = lambda rank: [{**faults[0], "dp_rank": rank}]  # noqa: E731
    assert A.detection_summary(both, on_rank(0)) == {
        "corrupted_products": 1, "faults_outside": 0, "detected_products": 1, "recall": 1.0,
        "flags": 2, "precision": 0.5}
    assert A.detection_summary(both, on_rank(0) + on_rank(1))["precision"] == 1.0
    assert A.detection_summary(both[:1], on_rank(1))["recall"] == 0.0
