"""`sdcstudy profiles` describes each profile as its specs are: the researcher choosing a node
reads these lines, not the code.

If a test here fails, a description claims what the profile does not do: an accumulator-error
tail a flip-model node lacks, "rare bursts" where the spec's own burst odds are one step in
20, or "low-order" mantissa flips where every mantissa bit is drawn alike.
"""

import pytest

from sdcstudy.faults import profiles
from sdcstudy.faults.published import SITES, TABLE1_FREQUENCY, WCNTS

ALL = {**profiles.zoo(), **profiles.flip_variants()}


def _site_specs(profile):
    return [s for s in profile.specs if s.site in SITES or s.site == "fwd/attn_context"]


@pytest.mark.parametrize("node", range(1, 16))
def test_a_paper_node_states_its_table_1_rate_pattern_and_wcnts(node):
    profile = ALL[f"paper-node-{node}"]
    text = profile.description
    assert f"WCNTS {WCNTS[node]:g}" in text
    busiest = max(TABLE1_FREQUENCY.get(node, (0,)))
    if not busiest:
        assert not _site_specs(profile) and "no submodule mismatch" in text
        return
    assert f"up to {busiest:.2g} per element" in text
    patterns = {s.pattern for s in _site_specs(profile)}
    assert len(patterns) == 1
    (pattern,) = patterns
    if pattern.kind == "burst":  # the odds the spec draws, not a word for them
        assert f"1 step in {1 / pattern.p_active:,.0f}" in text
    elif pattern.kind == "decay":
        assert f"{1 + pattern.amplitude:g}x at step 1" in text
    elif pattern.kind == "onset":
        assert f"before step {pattern.onset_step}" in text
    else:
        assert pattern.kind == "constant" and "constant rate" in text


@pytest.mark.parametrize("node", range(1, 16))
def test_a_flip_node_claims_a_tail_only_where_it_has_one(node):
    profile = ALL[f"paper-node-{node}-flip"]
    specs = _site_specs(profile)
    tail = [s for s in specs if s.kind == "additive"]
    assert ("accumulator-error tail" in profile.description) == bool(tail)
    for spec in specs:
        if spec.kind == "bitflip" and spec.rate == 0:  # every fault of the site is in the tail
            assert f"{spec.site}" in profile.description.split("accumulator errors only")[0]


def test_the_mantissa_profile_does_not_call_its_flips_low_order():
    profile = ALL["mantissa-noise"]
    assert {s.bit_class for s in profile.specs} == {"mantissa"}  # every mantissa bit alike
    assert "low-order" not in profile.description
