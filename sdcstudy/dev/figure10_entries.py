"""Figure 10 at the paper's sizes, measured into the file the scorecard reads.

    python -m sdcstudy.dev.figure10_entries --out docs/scorecards [--products 2] [--draws 8]
                                            [--decide-up-to DRAWS]

`reproduce.abft_paper_scale.measure` for every paper node's attention faults (as
`faults.profiles.paper_node` builds them) in o's product, inside the attention, or split
between the two: at the tiny and small scorecards' o shapes (four times the draws: they are
cheap) and at the paper's, tp = 1, 8 and 32. Writes OUT/abft_paper_scale.json, the entries
`reproduce.scorecard.paper_scale_rows` scores, and prints those rows. 5 to 11 minutes on two
busy CPU cores; numpy only. experiments/abft_paper_scale.py prints the study's tables from
the same entries (docs/faults.md, section 5.4).

With `--decide-up-to`, each scorecard row at the paper's sizes (o's product) whose draws
cannot tell its share from the band's edge (`reproduce.figure10_paper.decided`) is measured
again with more draws, its first draws the same, until they decide it or its shape would take
more than DRAWS draws: a row its draws decide states its chance, one the analytic estimate
judges states none.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

FILE = "abft_paper_scale.json"
# o_proj first: a placement's index seeds its draws, and `decide` measures o_proj again alone.
PLACEMENTS = ("o_proj", "inside", "split")
NODES = range(1, 16)
ANCHOR_DRAWS = 4  # the scorecards' sizes get this many times the draws


def profile_of(node: int, placement: str, context_width: int):
    """Paper node `node`'s profile with its attention faults at `placement`."""
    from sdcstudy.faults import profiles as P

    return P.paper_node(node, placement, context_width=context_width)


def entries(products: int = 2, draws: int = 8, seed: int = 0) -> list[dict]:
    """`measure`'s entries: the scorecards' o shapes first, then the paper's."""
    from sdcstudy.reproduce import abft_paper_scale as A

    return [*A.measure(profile_of, A.ANCHOR_SHAPES, NODES, PLACEMENTS, products,
                       ANCHOR_DRAWS * draws, seed),
            *A.measure(profile_of, A.paper_shapes(), NODES, PLACEMENTS, products, draws, seed)]


def decide(found: list[dict], products: int, seed: int, cap: int, say=print) -> list[dict]:
    """`found` with each undecided o_proj entry at the paper's sizes measured again with more
    draws (module docstring): first as many as `figure10_paper.draws_to_decide` asks at its
    rate (the analytic one where the draws do not decide), then twice as many each time."""
    from sdcstudy.reproduce import abft_paper_scale as A
    from sdcstudy.reproduce import figure10_paper as F10

    shapes = A.paper_shapes()
    names = [shape.name for shape in shapes]
    out = list(found)
    for i, entry in enumerate(found):
        if (entry["node"] == 0 or entry["placement"] != "o_proj" or entry["shape"] not in names
                or F10.decided(entry)):
            continue
        index, draws = names.index(entry["shape"]), entry["checks"] // products
        needed = F10.draws_to_decide(_draw_rate(entry), F10.edge_probability(entry)) or 0
        draws = max(2 * draws, math.ceil(1.2 * needed / products))
        while draws * products <= cap:
            start = time.perf_counter()
            (entry,) = [e for e in A.measure(profile_of, [shapes[index]], [entry["node"]],
                                             ("o_proj",), products, draws, seed, index)
                        if e["node"] == entry["node"]]
            say(f"node {entry['node']:2d} at {entry['shape']}: {F10.flagged_draws(entry)} of "
                f"{entry['checks']} draws flagged, "
                f"{'decided' if F10.decided(entry) else 'undecided'} "
                f"({time.perf_counter() - start:.0f} s)")
            if F10.decided(entry):
                break
            draws *= 2
        out[i] = entry
    return out


def _draw_rate(entry: dict) -> float:
    """The entry's flag probability a draw: the analytic estimate's, else the measured one."""
    weight = entry.get("active", 1.0) * entry.get("fault_share", 1.0)
    share = entry.get("sparse_prediction")
    if share is None:
        share = entry["flagged_paper"]
    return share / weight if weight > 0 else 0.0


def write(found: list[dict], out: Path) -> Path:
    """`found` as OUT/abft_paper_scale.json (written atomically); returns its path."""
    from sdcstudy.core import runfolder as RF

    out.mkdir(parents=True, exist_ok=True)
    path = out / FILE
    RF.atomic_write_text(path, json.dumps(found, indent=1))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True,
                   help=f"the folder of {FILE} (docs/scorecards for the scorecard's copy)")
    p.add_argument("--products", type=int, default=2, help="products per shape (default 2)")
    p.add_argument("--draws", type=int, default=8,
                   help="fault draws per product at the paper's sizes (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decide-up-to", type=int, default=0, metavar="DRAWS",
                   help="measure undecided paper-size rows again, up to DRAWS draws a shape "
                        "(default 0: no)")
    args = p.parse_args(argv)
    if args.products < 1 or args.draws < 1 or args.decide_up_to < 0:
        p.error("--products and --draws must be at least 1, --decide-up-to at least 0.")
    from sdcstudy.reproduce import abft_paper_scale as A

    start = time.perf_counter()
    found = entries(args.products, args.draws, args.seed)
    if args.decide_up_to:
        found = decide(found, args.products, args.seed, args.decide_up_to)
    path = write(found, args.out)
    for row in A.figure10_paper_rows(found):
        print(f"node {row.node:2d} | {row.quantity} | {row.published} | {row.ours:.3g} | "
              f"{row.verdict} | {row.reason}")
    print(f"{time.perf_counter() - start:.0f} s; entries in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
