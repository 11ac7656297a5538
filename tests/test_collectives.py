"""Checksums at the tensor-parallel collectives (sdcstudy/collectives/): a lock-step mismatch
attributed to communication or to computation.

The verdicts are first checked on hand-made checksums (no JAX program), then once end to end:
one lock-step run whose suspect gets a fault on the wire of an all-gather at step 1, one
inside the FFN at step 2, none at step 3, one in the FFN's input gradient at step 4 and two
sign flips on the wire of an all-gather at step 5.
"""

import numpy as np
import pytest

from sdcstudy import runner
from sdcstudy.collectives import checksum as CS
from sdcstudy.collectives import verdicts as V
from sdcstudy.collectives.feature import Collectives
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core import sites as S
from sdcstudy.core import tablelog as TL
from sdcstudy.core.errors import UserError
from sdcstudy.faults.specs import FaultSpec, FaultSpecError, Profile, check_fits

TP, LAYERS = 2, 2


def _agreeing(value: int = 1000, direction: str = CS.FWD) -> dict:
    """Checksums of a healthy pair: both nodes alike; every all-gather (in the backward, the
    transpose of a reduce-scatter) received the sum of what its ranks sent. {record key:
    (node, dp=1, tp, microstep=1, (A, B)) uint32 array}."""
    out = {}
    ab = np.array([1, 3], np.uint64)  # B unlike A, so that a test can not mix them up
    for layer in range(1, LAYERS + 1):
        for (submodule, collective), _ in S.COLLECTIVES.items():
            sent = np.broadcast_to(((value + layer) * ab) % 2 ** 32, (2, 1, TP, 1, 2))
            sent = sent.astype(np.uint32)
            received = np.broadcast_to(((value + 7 * layer) * ab) % 2 ** 32, sent.shape)
            received = received.astype(np.uint32)
            if (collective == S.ALL_GATHER) == (direction == CS.FWD):
                received = ((TP * sent.astype(np.uint64)) % 2 ** 32).astype(np.uint32)
            else:
                out[CS.record_key(layer, submodule, collective, CS.COMPUTED)] = sent.copy()
            out[CS.record_key(layer, submodule, collective, CS.SENT)] = sent
            out[CS.record_key(layer, submodule, collective, CS.RECEIVED)] = received
    return out


def _verdicts(rows, direction=CS.FWD):
    assert all(r["direction"] == direction for r in rows)
    return [(r["layer"], r["submodule"], r["collective"], r["tp_rank"], r["verdict"],
             r["found_by"], r["first"]) for r in rows]


def test_a_healthy_pair_has_no_verdict():
    rows = V.verdict_rows(1, _agreeing())
    assert rows == []
    assert set(V.counters(rows).values()) == {0}


def test_an_all_gather_that_received_other_bits_is_communication_on_one_node_alone():
    # Only the suspect's received checksum moves (a flipped bit 5 on tp rank 1): its sum no
    # longer equals what the ranks sent. The healthy node's copy is the same bits, so a check
    # that looked only at the pair would say the same; "sum" says it needs no pair.
    sums = _agreeing()
    sums[CS.record_key(2, "ffn", S.ALL_GATHER, CS.RECEIVED)][1, 0, 1, 0] += 32
    assert _verdicts(V.verdict_rows(1, sums)) == [
        (2, "ffn", S.ALL_GATHER, 1, "communication", "sum", True)]


def test_a_wrapping_sum_is_what_an_all_gather_receives():
    # Near 2**32 sent by each rank: the received sum wraps, and it is still no verdict.
    sums = _agreeing(2 ** 32 - 3)
    assert V.verdict_rows(1, sums) == []


def test_backward_checksums_check_each_transpose_as_what_it_is_and_come_after_the_forward():
    # Backward, the reduce-scatter's transpose is an all-gather: its sum is exact, one node
    # suffices. It runs after every forward collective, and the backward's layers run down:
    # layer 2's backward difference comes before layer 1's, after a forward one.
    fwd, bwd = _agreeing(), _agreeing(direction=CS.BWD)
    halves = {k: np.stack([v >> 16, v & 0xFFFF], axis=-1).astype(np.float32)
              for k, v in bwd.items()}
    assert (V.decode(halves[next(iter(halves))]) == bwd[next(iter(bwd))]).all()
    bwd[CS.record_key(1, "attn", S.REDUCE_SCATTER, CS.RECEIVED)][1, 0, 0, 0] += 2
    bwd[CS.record_key(2, "ffn", S.ALL_GATHER, CS.COMPUTED)][1, 0, 1, 0] += 2
    assert V.verdict_rows(1, fwd, bwd) == V.verdict_rows(1, {}, bwd)
    rows = V.verdict_rows(1, fwd, bwd)
    assert _verdicts(rows, CS.BWD) == [
        (2, "ffn", S.ALL_GATHER, 1, "computation", "pair", True),
        (1, "attn", S.REDUCE_SCATTER, 0, "communication", "sum", False)]
    fwd[CS.record_key(2, "ffn", S.REDUCE_SCATTER, CS.COMPUTED)][1, 0, 1, 0] += 1
    assert [(r["direction"], r["first"]) for r in V.verdict_rows(1, fwd, bwd)] == [
        (CS.FWD, True), (CS.BWD, False), (CS.BWD, False)]


def test_a_reduce_scatter_whose_inputs_agree_but_outputs_differ_is_communication():
    sums = _agreeing()
    sums[CS.record_key(1, "attn", S.REDUCE_SCATTER, CS.RECEIVED)][1, 0, 0, 0] ^= 1
    assert _verdicts(V.verdict_rows(3, sums)) == [
        (1, "attn", S.REDUCE_SCATTER, 0, "communication", "pair", True)]


def test_an_input_computed_differently_is_computation_even_after_a_tap_repaired_it():
    # The attention output of rank 1 differed on the suspect (computed), the lock-step tap
    # sent the healthy copy on (sent and received agree): computation, and nothing else.
    sums = _agreeing()
    sums[CS.record_key(1, "attn", S.REDUCE_SCATTER, CS.COMPUTED)][1, 0, 1, 0] += 1
    assert _verdicts(V.verdict_rows(3, sums)) == [
        (1, "attn", S.REDUCE_SCATTER, 1, "computation", "pair", True)]


def test_inputs_that_differ_make_every_output_differ_without_blaming_the_wire():
    # Free-running nodes: the FFN's partial sums differ on rank 0, so every rank's reduced
    # output differs; only rank 0's input is blamed, and as computation.
    sums = _agreeing()
    for point in (CS.COMPUTED, CS.SENT):
        sums[CS.record_key(2, "ffn", S.REDUCE_SCATTER, point)][1, 0, 0, 0] += 1
    sums[CS.record_key(2, "ffn", S.REDUCE_SCATTER, CS.RECEIVED)][1] += 1
    assert _verdicts(V.verdict_rows(3, sums)) == [
        (2, "ffn", S.REDUCE_SCATTER, 0, "computation", "pair", True)]


def test_the_first_verdict_in_forward_order_is_the_root_cause():
    # A corrupted all-gather feeds the attention, whose output then differs: both are rows,
    # the all-gather's first; a later layer's own computation is not first.
    sums = _agreeing()
    sums[CS.record_key(1, "attn", S.ALL_GATHER, CS.RECEIVED)][1, 0, 0, 0] += 4
    sums[CS.record_key(1, "attn", S.REDUCE_SCATTER, CS.COMPUTED)][1, 0, 0, 0] += 1
    sums[CS.record_key(2, "attn", S.REDUCE_SCATTER, CS.COMPUTED)][1, 0, 1, 0] += 1
    rows = V.verdict_rows(1, sums)
    assert _verdicts(rows) == [
        (1, "attn", S.ALL_GATHER, 0, "communication", "sum", True),
        (1, "attn", S.REDUCE_SCATTER, 0, "computation", "pair", False),
        (2, "attn", S.REDUCE_SCATTER, 1, "computation", "pair", False)]
    assert V.counters(rows) == {"collectives/computation": 2, "collectives/communication": 1,
                                "collectives/first_computation": 0,
                                "collectives/first_communication": 1}
    assert all(set(r) == set(V.COLUMNS) for r in rows)


def test_the_other_features_pass_the_collective_sites_through():
    # The model calls every hook at the collectives' sites; a feature that enumerates its own
    # sites (faults by spec, taps at four, ABFT at matmuls) must leave them alone, or the
    # programs of runs without this feature would change. Golden layouts list BLOCK_SITES.
    from sdcstudy.abft.checker import Checker
    from sdcstudy.faults.inject import FaultContext, Injector
    from sdcstudy.paired.lockstep import LockstepTaps

    every = Profile("every", tuple(FaultSpec(f"{direction}/{site}", count=1)
                                   for site in S.ALL_SITES for direction in ("fwd", "bwd")))
    hooks = [Injector(every, LAYERS).hook(FaultContext(None, None, None)),
             LockstepTaps(LAYERS).hook({}), Checker(LAYERS).hook({})]
    x = object()
    for site in S.COLLECTIVE_SITES:
        assert site not in S.ALL_SITES
        assert all(hook(site, x, layer) is x for hook in hooks for layer in (1, LAYERS))


def _cfg(*overrides):
    return C.from_dict({"experiment": {"steps": 5, "batch_size": 4, "microsteps": 2,
                                       "checkpoint_every": 0, "mode": "lockstep"},
                        "mesh": {"tp": 2, "dp": 1}, "optim": {"warmup_steps": 1},
                        "data": {"seq_len": 32}, "model": {"n_layers": 1},
                        "collectives": {"enabled": True}}, list(overrides))


@pytest.mark.parametrize("override, words", [
    ("experiment.mode=train", "experiment.mode 'train' has none"),
    ("mesh.tp=1", "mesh.tp = 1 does not have"),
])
def test_the_feature_is_refused_where_there_is_no_pair_or_no_tensor_parallelism(override,
                                                                               words):
    with pytest.raises(UserError, match=words):
        Collectives.from_config(_cfg(override), None)
    assert Collectives.from_config(_cfg("collectives.enabled=false", override), None) is None


def test_a_collective_fault_is_refused_where_mesh_tp_is_1():
    profile = Profile("p", (FaultSpec("collective/all_gather", count=1),))
    dims = C.model_dims(_cfg().model)
    with pytest.raises(FaultSpecError, match="mesh.tp = 1 does not have"):
        check_fits(profile, dims, tp=1)
    assert check_fits(profile, dims, tp=2) is profile


# Step 1: one exponent flip in what tp rank 1 received from each all-gather of layer 1;
# step 2: one in the FFN's activation on tp rank 0, inside the computation; step 3: nothing;
# step 4: one in the gradient arriving at the FFN's input on tp rank 1, before its tap;
# step 5: two sign flips in what tp rank 0 received, which cancel in a whole-word sum.
PROFILE = """\
name: wire-then-ffn
specs:
  - {site: collective/all_gather, kind: bitflip, count: 1, bit_class: exponent, tp_ranks: [1],
     pattern: {kind: steps, steps: [1]}}
  - {site: fwd/ffn_act, kind: bitflip, count: 1, bit_class: exponent, tp_ranks: [0],
     pattern: {kind: steps, steps: [2]}}
  - {site: bwd/ffn, kind: bitflip, count: 1, bit_class: exponent, tp_ranks: [1],
     pattern: {kind: steps, steps: [4]}}
  - {site: collective/all_gather, kind: bitflip, count: 2, bit_class: sign, tp_ranks: [0],
     pattern: {kind: steps, steps: [5]}}
"""


@pytest.fixture(scope="module")
def lockstep_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("collectives")
    (folder / "profile.yaml").write_text(PROFILE)
    out = folder / "run"
    runner.run(_cfg(f"suspect.profile={folder / 'profile.yaml'}"), out, progress=False)
    return (TL.read_table(out / V.TABLE), TL.read_table(out / RF.MISMATCH),
            TL.read_table(out / RF.FAULTS), RF.read_jsonl(out / RF.METRICS))


def _first(rows, step):
    first = rows[(rows.step == step) & rows["first"]]
    return sorted(set(zip(first.submodule, first.collective, first.direction, first.tp_rank,
                          first.verdict)))


def test_a_fault_on_the_wire_of_an_all_gather_is_communication(lockstep_run):
    rows, mismatch, faults, _ = lockstep_run
    # the lock-step taps saw it, in the attention it fed
    assert mismatch[(mismatch.step == 1) & (mismatch.site == "fwd/attn")].mismatches.sum() > 0
    assert set(faults[faults.step == 1].site) == {S.ATTN_GATHER_OUT, S.FFN_GATHER_OUT}
    assert _first(rows, 1) == [("attn", S.ALL_GATHER, "fwd", 1, "communication")]
    wire = rows[(rows.step == 1) & (rows.collective == S.ALL_GATHER) & (rows.direction == "fwd")]
    assert set(wire.verdict) == {"communication"} and set(wire.found_by) == {"sum"}
    assert len(wire) == 2 * 2  # microsteps, the attention's and the FFN's all-gather


def test_a_fault_inside_the_ffn_is_computation(lockstep_run):
    rows, mismatch, _, _ = lockstep_run
    assert mismatch[(mismatch.step == 2) & (mismatch.site == "fwd/ffn")].mismatches.sum() > 0
    assert _first(rows, 2) == [("ffn", S.REDUCE_SCATTER, "fwd", 0, "computation")]
    assert set(rows[rows.step == 2].verdict) == {"computation"}


def test_a_fault_in_a_gradient_is_computation_in_the_backward(lockstep_run):
    rows, mismatch, _, _ = lockstep_run
    assert mismatch[(mismatch.step == 4) & (mismatch.site == "bwd/ffn")].mismatches.sum() > 0
    assert _first(rows, 4) == [("ffn", S.ALL_GATHER, "bwd", 1, "computation")]
    assert len(rows[rows.step == 4]) == 2  # one per microstep: the tap repaired it after


def test_a_healthy_step_has_no_verdict(lockstep_run):
    rows, _, _, metrics = lockstep_run
    assert (rows.step != 3).all()
    assert metrics[2]["collectives/communication"] == metrics[2]["collectives/computation"] == 0
    assert metrics[0]["collectives/first_communication"] == 2  # one per microstep
    assert metrics[1]["collectives/first_computation"] == 2


def test_two_sign_flips_on_the_wire_are_communication(lockstep_run):
    # Two float32 sign flips move a whole-word sum by 2**31 + 2**31 = 0 (mod 2**32): such a
    # sum saw no communication, and the attention the corrupted input fed took the blame.
    rows, mismatch, faults, _ = lockstep_run
    assert set(faults[faults.step == 5].bit) == {31}
    assert mismatch[(mismatch.step == 5) & (mismatch.site == "fwd/attn")].mismatches.sum() > 0
    assert _first(rows, 5) == [("attn", S.ALL_GATHER, "fwd", 0, "communication")]
    wire = rows[(rows.step == 5) & (rows.collective == S.ALL_GATHER) & (rows.direction == "fwd")]
    assert set(wire.verdict) == {"communication"} and set(wire.found_by) == {"sum"}
    assert len(wire) == 2 * 2  # microsteps, the attention's and the FFN's all-gather
