"""The numbers Ma et al. published for their unhealthy nodes, without JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training": Table 1 (average mismatch
frequency over microsteps), Table 2 (maximum mismatch severity over microsteps) and the WCNTS
table of Figure 5 (eq. 5), measured in bfloat16 on a 16-layer (Tables 1-2) and a 32-layer
(Figure 5) Llama3-8B-style model (the tensor-parallel degree is not stated). `sdcstudy report`
prints them beside measured values; `profiles` builds the paper node profiles from the same
numbers.
"""

from __future__ import annotations

SITES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")

# Table 1: average mismatch frequency (fwd/attn, fwd/ffn, bwd/attn, bwd/ffn). Nodes 2, 3 and
# 12 showed no mismatch at these sites and are not in the table.
TABLE1_FREQUENCY = {
    1: (1.55e-5, 5.06e-7, 1.56e-4, 2.81e-6),
    4: (3.79e-9, 9.20e-11, 2.99e-9, 2.80e-11),
    5: (0.0, 0.0, 1.49e-15, 1.25e-12),
    6: (1.71e-9, 1.64e-11, 1.49e-9, 6.02e-11),
    7: (2.13e-6, 1.18e-7, 4.31e-6, 6.73e-8),
    8: (3.21e-9, 1.99e-11, 1.01e-7, 2.21e-9),
    9: (1.10e-5, 5.05e-7, 4.33e-6, 3.86e-8),
    10: (4.78e-3, 1.03e-3, 1.92e-3, 7.98e-5),
    11: (2.89e-2, 2.25e-3, 6.71e-3, 1.08e-4),
    13: (0.0, 0.0, 0.0, 1.21e-10),
    14: (6.48e-11, 0.0, 4.91e-10, 2.99e-9),
    15: (0.0, 0.0, 0.0, 7.39e-15),
}

# Table 2: maximum mismatch severity over microsteps, same site order.
TABLE2_MAX_SEVERITY = {
    1: (99, 312, 7392, 3.88),
    4: (2.95, 1.46, 2.39, 5.38),
    5: (0, 0, 0.0047, 0.0908),
    6: (1.01, 1, 0.162, 0.0776),
    7: (43.2, 88.5, 32.3, 0.297),
    8: (13.5, 5.69, 6.41, 1.59),
    9: (119, 200, 3.79e11, 9.63e12),
    10: (1120, 262, 12.75, 0.648),
    11: (318, 976, 2208, 7680),
    13: (0, 0, 0, 0.316),
    14: (1.12, 0, 3.80, 0.380),
    15: (0, 0, 0, 0.0176),
}

# Figure 5 (left table): worst-case noise-to-signal ratio of the weight gradients, eq. (5).
WCNTS = {1: 0.037, 2: 0.002, 3: 1.34e-15, 4: 0.019, 5: 0.011, 6: 0.004, 7: 0.008, 8: 0.006,
         9: 0.017, 10: 0.010, 11: 0.051, 12: 0.002, 13: 0.004, 14: 0.037, 15: 4.16e-4}

PAPER_PREFIX = "paper-node-"
FLIP_SUFFIX = "-flip"  # the flip model's profiles (faults.profiles takes it)


def paper_node_number(profile: str) -> int | None:
    """15 for "paper-node-15" and its flip model "paper-node-15-flip"; None for a profile that
    is not one of Ma et al.'s nodes."""
    number = profile.removeprefix(PAPER_PREFIX).removesuffix(FLIP_SUFFIX)
    if not profile.startswith(PAPER_PREFIX) or not number.isdigit():
        return None
    node = int(number)
    return node if node in WCNTS else None


def published(profile: str) -> dict | None:
    """{"freq": {site: Table 1}, "max_severity": {site: Table 2}, "wcnts": Figure 5} for a
    `paper-node-N` profile (zeros for the nodes Tables 1-2 leave out); None for others."""
    node = paper_node_number(profile)
    if node is None:
        return None
    return {"freq": dict(zip(SITES, TABLE1_FREQUENCY.get(node, (0.0,) * 4))),
            "max_severity": dict(zip(SITES, TABLE2_MAX_SEVERITY.get(node, (0.0,) * 4))),
            "wcnts": WCNTS[node]}
