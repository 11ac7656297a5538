"""Figure 10 at the paper's sizes: how often ABFT flags the paper nodes' attention faults in
real float32 products of the paper's shapes. Imports no JAX (numpy only).

Ma et al., appendix D: ABFT in float32 on every linear layer; Figure 10 plots how often the
check of the attention output projection `o` flagged, frequently on node 14 and "little to no"
on the others. The check's threshold (eq. 6) grows with the product's inner dimension k and
width n, so a fault that flags every time on a 64-wide model need not flag at the paper's 4096.
Here each node's fwd/attn faults, as `faults.profiles.paper_node` builds them (an error of e
times its row's RMS, e log-uniform on [2^-8, 1], at the profile's rate; in o's product, or in
its input under `attn_placement`), go into real float32 products, and `check` applies
`abft.checksum`'s rules (`paper`: eq. 6 with tau = k 2^-23; `rounding`: our per-row bound) in
numpy; tests/test_abft_paper_scale.py holds it against the JAX checker.

Shapes. The o projection is row-parallel (appendix B.2): on a tp rank A is the context of the
rank's heads for every token of the microstep and B the rank's k rows of W_o, so m = 4096
tokens (micro-batch 1 of 4096 tokens, appendix B.3), k = 4096 / tp, n = 4096. The paper does
not state tp: tp = 1, 8 and 32. As the project counts rates (per element of each rank's partial
product, `reproduce.plan.site_elements`), a check holds rate * m * n faults on average. A is
Gaussian (unit scale), B Gaussian with variance 1/k: every ratio below is scale-free, and
independent rows of one scale are the check's best case (rows of unequal scale raise
||A||_inf above a typical row's and lower R).

Scaling. One fault of e times its row's RMS, e sqrt(k) sigma_a sigma_b, against the threshold
k u ||A||_inf ||B||_inf ~ k u (k E|a|) (n E|b|), with E|x| = sigma sqrt(2/pi) for a Gaussian:

    R = residual / threshold ~ (pi/2) e / (u k^1.5 n),      u = 2^-23        (`law_ratio`)

lowered by the norms' maxima over rows (about 0.8x at the paper's sizes; `single_fault_ratio`
measures R). With lambda faults, rarely two in a row, a check flags with probability about
1 - exp(-lambda q), q = P(e R > 1) (`sparse_prediction`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sdcstudy.abft.tables import EPS32, tau
from sdcstudy.reproduce import figure10_paper
from sdcstudy.reproduce.training_rows import Row

RULES = ("paper", "rounding")
MARGIN = 1.01  # the rounding bound's allowance for second-order terms (abft/checksum.py)
U32 = 2.0 ** -24  # float32 unit roundoff, the rounding bound's u
PAPER_STEPS = 4500  # section 4: the run a time pattern's share of active steps is taken over
PAPER_TOKENS = 4096  # one microstep on one rank: micro-batch 1 of 4096 tokens (appendix B.3)
PAPER_WIDTH = 4096  # d (appendix B.2)
PAPER_TPS = (1, 8, 32)


@dataclass(frozen=True)
class Shape:
    """One checked product A (m x k) B (k x n)."""

    name: str
    m: int
    k: int
    n: int


def paper_shapes(tps=PAPER_TPS) -> list[Shape]:
    return [Shape(f"paper tp {tp}", PAPER_TOKENS, PAPER_WIDTH // tp, PAPER_WIDTH) for tp in tps]


# The o checks of the tiny and small scorecards (reproduce.plan: tp 1, batch x seq tokens).
ANCHOR_SHAPES = (Shape("tiny", 1024, 64, 64), Shape("small", 1024, 512, 512))


# --- the check, in numpy ---------------------------------------------------------------------


@dataclass(frozen=True)
class Checksums:
    """What a check takes from its inputs A and B alone: A (B w), (w^T A) B, the paper's norm
    products, and the rounding bound's |A| (|B| w) and (w^T |A|) |B| (all float32)."""

    a_bw: np.ndarray
    wa_b: np.ndarray
    norm_inf: np.float32
    norm_one: np.float32
    row_spread: np.ndarray
    col_spread: np.ndarray
    k: int


def checksums(a: np.ndarray, b: np.ndarray) -> Checksums:
    abs_a, abs_b = np.abs(a), np.abs(b)
    return Checksums(
        a_bw=a @ b.sum(axis=1), wa_b=a.sum(axis=0) @ b,
        norm_inf=abs_a.sum(axis=1).max() * abs_b.sum(axis=1).max(),
        norm_one=abs_a.sum(axis=0).max() * abs_b.sum(axis=0).max(),
        row_spread=abs_a @ abs_b.sum(axis=1), col_spread=abs_b.T @ abs_a.sum(axis=0),
        k=a.shape[1])


def _rounding_bound(abs_c_sum, spread, k: int, other: int):
    """abft/checksum.py's bound for a float32 product (no output rounding), less its underflow
    term (`abft.bound.underflow`, about 1e-30 here): these operands are standard normal draws,
    whose bounds that term cannot move in float32."""
    return np.float32(MARGIN) * (np.float32(other * U32) * abs_c_sum +
                                 np.float32((2 * k + other) * U32) * spread)


def check(sums: Checksums, c: np.ndarray, rule: str) -> dict:
    """One check of the product `c` of the inputs `sums` came from, as `abft.checksum.check`
    makes it: the reported row and column residuals and thresholds, and the flag."""
    m, n = c.shape
    row = np.abs(c.sum(axis=1) - sums.a_bw)
    col = np.abs(c.sum(axis=0) - sums.wa_b)
    row, col = (np.where(np.isnan(r), np.inf, r) for r in (row, col))
    if rule == "rounding":
        abs_c = np.where(np.isfinite(c), np.abs(c), np.float32(0))
        row_bound = _rounding_bound(abs_c.sum(axis=1), sums.row_spread, sums.k, n)
        col_bound = _rounding_bound(abs_c.sum(axis=0), sums.col_spread, sums.k, m)
        with np.errstate(divide="ignore", invalid="ignore"):
            row_ratio = np.where(row == 0, 0, row / row_bound)
            col_ratio = np.where(col == 0, 0, col / col_bound)
        i, j = int(np.argmax(row_ratio)), int(np.argmax(col_ratio))
        row_thr, col_thr = row_bound[i], col_bound[j]
        flagged = bool(row_ratio[i] > 1 or col_ratio[j] > 1)
    elif rule == "paper":
        i, j = int(np.argmax(row)), int(np.argmax(col))
        factor = np.float32(tau(rule, sums.k, 32))
        row_thr, col_thr = factor * sums.norm_inf, factor * sums.norm_one
        flagged = bool(row[i] > row_thr or col[j] > col_thr)
    else:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, not {rule!r}.")
    return {"row_residual": float(row[i]), "row_threshold": float(row_thr),
            "col_residual": float(col[j]), "col_threshold": float(col_thr),
            "flagged": flagged, "row": i, "col": j}


# --- the products and the faults ------------------------------------------------------------


def operands(shape: Shape, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A: the context, unit Gaussian; B: the weights, Gaussian of variance 1/k (float32)."""
    a = rng.standard_normal((shape.m, shape.k), dtype=np.float32)
    b = rng.standard_normal((shape.k, shape.n), dtype=np.float32)
    return a, b * np.float32(1 / math.sqrt(shape.k))


def row_rms(x: np.ndarray) -> np.ndarray:
    """The RMS of each row in float32, as `faults.corrupt.row_rms` takes it."""
    return np.sqrt(np.mean(np.square(x), axis=1))


def any_fault(size: int, rate: float) -> float:
    """The probability that a tensor of `size` elements gets a fault at `rate`."""
    return -math.expm1(size * math.log1p(-rate)) if rate > 0 else 0.0


def draw_faults(rng: np.random.Generator, size: int, rate: float, scale: tuple[float, float],
                at_least_one: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, signed sizes in units of the row's RMS) of the faults one tensor of `size`
    elements gets at `rate`: a binomial count of distinct elements, each e log-uniform on
    `scale` with a random sign (the profiles' `additive` kind). With `at_least_one`, the same
    given one fault at least: the first hit's index is geometric, cut at the tensor's end, and
    every element after it is hit at `rate`."""
    if rate <= 0:
        where = np.zeros(0, np.int64)
    elif at_least_one:
        none = 1 - any_fault(size, rate)
        first = min(size - 1, math.floor(math.log1p(-rng.random() * (1 - none)) /
                                         math.log1p(-rate)))
        rest = size - first - 1
        where = np.concatenate(([first], first + 1 + _distinct(rng, rest, rate)))
    else:
        where = _distinct(rng, size, rate)
    lo, hi = scale
    e = np.exp(rng.uniform(math.log(lo), math.log(hi), len(where)))
    sign = np.where(rng.random(len(where)) < 0.5, 1.0, -1.0)
    return where, (sign * e).astype(np.float32)


def _distinct(rng: np.random.Generator, size: int, rate: float) -> np.ndarray:
    count = int(rng.binomial(size, rate)) if size else 0
    return rng.choice(size, count, replace=False) if count else np.zeros(0, np.int64)


def add_faults(x: np.ndarray, where: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`x` with `sizes` times its row's RMS added at the flat indices `where` (float32)."""
    y = x.copy()
    flat = y.reshape(-1)
    rms = row_rms(x)[where // x.shape[1]]
    flat[where] = flat[where] + sizes * rms
    return y


@dataclass(frozen=True)
class AttentionFaults:
    """One node's fwd/attn faults as its profile places them: per element of o's product and
    of its input (the context), the error sizes, and the share of checks its time pattern
    leaves on over the paper's run (bursts, onset; 1 for a constant rate or a decay, whose
    initial spike is left out)."""

    node: int
    o_rate: float
    context_rate: float
    scale: tuple[float, float]
    active: float


def attention_faults(profile, node: int) -> AttentionFaults:
    """The fwd/attn faults of a `faults.specs.Profile` (read as plain data)."""
    o_rate = context_rate = 0.0
    scale, active = (1.0, 1.0), 1.0
    for spec in profile.specs:
        if spec.site not in ("fwd/attn", "fwd/attn_context"):
            continue
        if spec.kind != "additive":
            raise ValueError(f"{profile.name}: {spec.site} faults of kind {spec.kind!r}; this "
                             f"measures additive ones.")
        if spec.site == "fwd/attn":
            o_rate += spec.rate
        else:
            context_rate += spec.rate
        scale = spec.scale
        if spec.pattern.kind in ("burst", "onset"):
            active = spec.pattern.mean_multiplier(PAPER_STEPS)
    return AttentionFaults(node, o_rate, context_rate, scale, active)


def faulty_product(a, b, c, sums: Checksums, faults: AttentionFaults, rng: np.random.Generator,
                   at_least_one: bool = False) -> tuple[np.ndarray, Checksums, int, int]:
    """(o's product, the checksums of its inputs, faults in the product, faults in the
    context) with `faults` drawn afresh (`at_least_one`: given one fault at least): context
    faults first (the rows they reach are recomputed from the corrupted input, a float32
    product of it like any other), then faults in the product."""
    m, k = a.shape
    context_rate, o_rate = faults.context_rate, faults.o_rate
    in_context = in_o = False
    if at_least_one:  # which tensor holds a fault for sure; the other one is then as drawn
        p_context, p_o = any_fault(m * k, context_rate), any_fault(c.size, o_rate)
        in_context = rng.random() * (1 - (1 - p_context) * (1 - p_o)) < p_context
        in_o, context_rate = not in_context, context_rate if in_context else 0.0
    where_a, sizes_a = draw_faults(rng, m * k, context_rate, faults.scale, in_context)
    if len(where_a):
        a = add_faults(a, where_a, sizes_a)
        rows = np.unique(where_a // k)
        c = c.copy()
        c[rows] = a[rows] @ b
        sums = checksums(a, b)
    where_c, sizes_c = draw_faults(rng, c.size, o_rate, faults.scale, in_o)
    if len(where_c):
        c = add_faults(c, where_c, sizes_c)
    return c, sums, len(where_c), len(where_a)


def faulty_check(a, b, c, sums: Checksums, faults: AttentionFaults, healthy: dict,
                 rng: np.random.Generator, at_least_one: bool = False) -> dict:
    """{rule: flagged, "o": faults, "context": faults} of one `faulty_product`; `healthy`
    ({rule: flagged} of the product as it is) where no fault landed."""
    c, sums, o, context = faulty_product(a, b, c, sums, faults, rng, at_least_one)
    flags = healthy if not o + context else {rule: check(sums, c, rule)["flagged"]
                                              for rule in RULES}
    return {"o": o, "context": context, **flags}


# --- scaling ---------------------------------------------------------------------------------


def law_ratio(shape: Shape, e: float = 1.0) -> float:
    """(pi/2) e / (u k^1.5 n): a fault's residual over the paper's threshold, to leading
    order (module docstring)."""
    return (math.pi / 2) * e / (EPS32 * shape.k ** 1.5 * shape.n)


def single_fault_ratio(shape: Shape, rng: np.random.Generator, faults: int = 16) -> float:
    """The mean over `faults` single faults of 1 times their row's RMS (each alone in one
    product) of the faulty row's residual over the `paper` rule's row threshold."""
    a, b = operands(shape, rng)
    c = a @ b
    sums = checksums(a, b)
    threshold = np.float32(tau("paper", shape.k, 32)) * sums.norm_inf
    rms = row_rms(c)
    ratios = []
    for _ in range(faults):
        i, j = int(rng.integers(shape.m)), int(rng.integers(shape.n))
        row = c[i].copy()
        row[j] += rms[i] * np.float32(rng.choice((-1.0, 1.0)))
        ratios.append(abs(row.sum() - sums.a_bw[i]) / threshold)
    return float(np.mean(ratios))


def sparse_prediction(expected_faults: float, ratio: float,
                      scale: tuple[float, float]) -> float:
    """1 - exp(-lambda q), q = P(e * ratio > 1) for e log-uniform on `scale`: the share of
    checks a fault flags while a row rarely holds two."""
    lo, hi = scale
    cut = max(lo, 1 / ratio) if ratio > 0 else math.inf
    q = 0.0 if cut >= hi else math.log(hi / cut) / math.log(hi / lo)
    return 1 - math.exp(-expected_faults * q)


# --- the measurement -------------------------------------------------------------------------


def measure(profile_of, shapes, nodes, placements=("o_proj",), products: int = 2,
            draws: int = 10, seed: int = 0, first_index: int = 0) -> list[dict]:
    """One entry per shape, node and placement (and a healthy one per shape, node 0): faults
    expected and landed per check, the share of checks flagged under each rule while the
    node's pattern is on and over the run, and the sparse prediction.

    `profile_of(node, placement, context_width)` is `faults.profiles.paper_node`; each shape
    takes `products` pairs of operands and `draws` fault draws on each, seeded by `seed`. A
    node that expects under one fault a check is drawn given one fault at least, and weighed
    by the probability of one (`fault_share`): its rare flags are then measured, not missed.
    `first_index` is the index of `shapes[0]` in the series the seeds number (a shape
    measured again alone, with more draws, keeps its first draws)."""
    entries = []
    for s, shape in enumerate(shapes, first_index):
        ratio = single_fault_ratio(shape, np.random.default_rng([seed, s, 0, 1]))
        tally: dict[tuple, list[dict]] = {}
        for p in range(products):
            a, b = operands(shape, np.random.default_rng([seed, s, p, 0]))
            c, sums = a @ b, checksums(a, b)
            healthy = {rule: check(sums, c, rule)["flagged"] for rule in RULES}
            tally.setdefault((0, "none"), []).append({"o": 0, "context": 0, **healthy})
            for node in nodes:
                for x, placement in enumerate(placements):
                    faults = attention_faults(profile_of(node, placement, shape.k), node)
                    rare = fault_share(faults, shape) < 1
                    for d in range(draws):
                        rng = np.random.default_rng([seed, s, p, 2, node, x, d])
                        tally.setdefault((faults, placement), []).append(
                            faulty_check(a, b, c, sums, faults, healthy, rng, rare))
        healthy_share = {rule: np.mean([c[rule] for c in tally[0, "none"]]) for rule in RULES}
        for (faults, placement), checks in tally.items():
            entries.append(_entry(shape, faults, placement, checks, ratio, healthy_share))
    return entries


def expected_faults(faults: AttentionFaults, shape: Shape) -> float:
    """Faults a check expects while the pattern is on, in o's product and in its input."""
    return faults.o_rate * shape.m * shape.n + faults.context_rate * shape.m * shape.k


def fault_share(faults: AttentionFaults, shape: Shape) -> float:
    """The share of checks that hold a fault while the pattern is on: 1 where a check expects
    one fault or more (then every draw counts as it falls), else the probability of one."""
    if expected_faults(faults, shape) >= 1:
        return 1.0
    none = ((1 - any_fault(shape.m * shape.n, faults.o_rate)) *
            (1 - any_fault(shape.m * shape.k, faults.context_rate)))
    return 1 - none


def _entry(shape: Shape, faults, placement: str, checks: list[dict], ratio: float,
           healthy_share: dict) -> dict:
    healthy = faults == 0
    node, active = (0, 1.0) if healthy else (faults.node, faults.active)
    share = 1.0 if healthy else fault_share(faults, shape)
    o_expected = 0.0 if healthy else faults.o_rate * shape.m * shape.n
    context_expected = 0.0 if healthy else faults.context_rate * shape.m * shape.k
    entry = {"shape": shape.name, "m": shape.m, "k": shape.k, "n": shape.n, "node": node,
             "placement": placement, "checks": len(checks), "active": active,
             "fault_share": share, "o_faults": o_expected, "context_faults": context_expected,
             "o_landed": share * float(np.mean([c["o"] for c in checks])),
             "context_landed": share * float(np.mean([c["context"] for c in checks])),
             "single_fault_ratio": ratio, "law_ratio": law_ratio(shape),
             "sparse_prediction": 0.0 if healthy else
             active * sparse_prediction(o_expected, ratio, faults.scale)}
    for rule in RULES:
        when_active = float(share * np.mean([c[rule] for c in checks]) +
                            (1 - share) * healthy_share[rule])
        entry[f"flagged_active_{rule}"] = when_active
        entry[f"flagged_{rule}"] = active * when_active
    return entry


# --- the scorecard's rows: reproduce/figure10_paper.py (sampling noise told apart) ---------


def figure10_paper_rows(entries: list[dict], placement: str = "o_proj",
                        rule: str = "paper") -> list[Row]:
    """Scorecard rows, Figure 10 at the paper's sizes (`figure10_paper.rows`)."""
    return figure10_paper.rows(entries, placement, rule)
