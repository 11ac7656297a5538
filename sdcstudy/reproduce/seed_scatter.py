"""The chance that a correct model passes the rows of Figures 5 and 6, from the runs' seed-to-seed
scatter: the same reproduce command run again with other fault seeds (`suspect.fault_seed`),
each run scored, the verdicts of each row counted (docs/reproduction.md, "The chance a correct
model passes"). Figure 5's WCNTS is the worst of the run's steps, Figure 6's loss gap the
largest of them: no law of a correct model's value in the run is at hand, so the chance is
measured, as the share of seeds whose run passes, between its one-sided 95% Clopper-Pearson
bounds (`pass_chance.lower_bound`, `upper_bound`).

The measurement is committed (`SCATTER`, written by `python -m sdcstudy.dev.seed_scatter`):
one entry per reproduce command (`command_key`: preset, steps, dtype, fault model and the
other overrides), each holding every seed's verdict and value of each row. A scorecard's node
takes its rows' chances from the entry of its own runs' command (`by_node`: a `--fault-model
chosen` card from its own command's entry where one was collected, else each node from its
kept model's command, whose runs it repeats); a row's band must be the entry's. Imports no JAX.
"""

from __future__ import annotations

from pathlib import Path

from sdcstudy.core import runfolder as RF
from sdcstudy.core.errors import UserError
from sdcstudy.reproduce import claim_rows as CR
from sdcstudy.reproduce import pass_chance as PC
from sdcstudy.reproduce import plan as P
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce.bands import Row

SCATTER = Path(__file__).resolve().parents[2] / "docs" / "scorecards" / "seed_scatter.json"
SCHEMA = "sdcstudy-seed-scatter/1"
SOURCES = ("Figure 5", "Figure 6", CR.SHAPE_SOURCE)  # the rows the scatter measures
MODES = ("paramsync", "free")  # the runs that make them
SEED_KEY = "suspect.fault_seed="
MIN_SEEDS = 2  # judged seeds a row needs before its share says anything


def command_key(request: dict) -> dict:
    """What a scatter's runs share with a scorecard's: the request without its fault seed."""
    return {"preset": request["preset"], "steps": request["steps"],
            "dtype": request.get("dtype"),
            "fault_model": request.get("fault_model", P.DEFAULT_FAULT_MODEL),
            "overrides": sorted(o for o in request.get("overrides", [])
                                if not o.startswith(SEED_KEY))}


def fault_seed(request: dict) -> int | None:
    """The request's `suspect.fault_seed` override, None without one."""
    seeds = [o[len(SEED_KEY):] for o in request.get("overrides", []) if o.startswith(SEED_KEY)]
    return int(seeds[-1]) if seeds and seeds[-1] != "null" else None


def _row_key(row: Row | dict) -> tuple:
    get = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
    return get("node"), get("source"), get("quantity")


def collect(scored: list[tuple[dict, list[Row]]]) -> dict:
    """One entry from (request, rows) of each seed's scoring: every row of `SOURCES` with its
    band and each seed's verdict and value, the seeds in the order given. Raises ValueError,
    in one sentence, where the requests are not one command with distinct fault seeds, or a
    row's band differs between seeds."""
    if len(scored) < MIN_SEEDS:
        raise ValueError(f"a seed scatter needs at least {MIN_SEEDS} reproduce folders.")
    key = command_key(scored[0][0])
    seeds = [fault_seed(request) for request, _ in scored]
    for request, _ in scored[1:]:
        if command_key(request) != key:
            raise ValueError(f"the folders were run with other settings than the first "
                             f"({command_key(request)} against {key}); a scatter is one "
                             f"command with other fault seeds.")
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"two folders share a fault seed ({seeds}); each seed counts once.")
    table: dict[tuple, dict] = {}
    for i, (_, rows) in enumerate(scored):
        for row in rows:
            if row.source not in SOURCES:
                continue
            entry = table.setdefault(_row_key(row), {
                "node": row.node, "source": row.source, "quantity": row.quantity,
                "band": row.band, "verdicts": [None] * len(scored),
                "values": [None] * len(scored)})
            if entry["band"] != row.band:
                raise ValueError(f"node {row.node}'s {row.source} {row.quantity} has band "
                                 f"{row.band!r} under fault seed {seeds[i]} and "
                                 f"{entry['band']!r} under another; score all folders with "
                                 f"one version.")
            entry["verdicts"][i] = row.verdict
            entry["values"][i] = float(row.ours) if isinstance(row.ours, (int, float)) else None
    return {**key, "fault_seeds": seeds, "rows": list(table.values())}


def extend(older: dict, newer: dict) -> dict:
    """`newer` with the seeds of `older`, its command's earlier entry, that `newer` did not
    score again: their verdicts and values as scored then, after `newer`'s own (`kept` names
    them and, seed by seed, the version that scored each, so a seed kept twice keeps its own).
    Raises ValueError, in one sentence, where the commands differ or a row's band does."""
    if command_key(older) != command_key(newer):
        raise ValueError("the earlier entry is another command's; nothing to keep.")
    kept = [i for i, seed in enumerate(older["fault_seeds"]) if seed not in newer["fault_seeds"]]
    earlier = {_row_key(r): r for r in older["rows"]}
    rows = []
    for row in newer["rows"]:
        old = earlier.get(_row_key(row))
        if old is not None and old["band"] != row["band"]:
            raise ValueError(f"node {row['node']}'s {row['source']} {row['quantity']} has band "
                             f"{row['band']!r} now and {old['band']!r} in the kept entry; "
                             f"score every seed again with this version.")
        rows.append({**row, **{field: row[field] + [old[field][i] if old else None
                                                    for i in kept]
                               for field in ("verdicts", "values")}})
    kept_seeds = [older["fault_seeds"][i] for i in kept]
    return {**newer, "fault_seeds": newer["fault_seeds"] + kept_seeds, "rows": rows,
            "kept": {"fault_seeds": kept_seeds,
                     "scored_by": [_scorer(older, seed) for seed in kept_seeds]}}


def _scorer(entry: dict, seed: int | None) -> str | None:
    """The version that scored `seed`'s verdicts in `entry`: its `kept` one where the seed was
    kept from a still earlier entry, the entry's own otherwise."""
    kept = entry.get("kept") or {"fault_seeds": [], "scored_by": []}
    return dict(zip(kept["fault_seeds"], kept["scored_by"])).get(seed, entry.get("scored_by"))


def read(path: Path | None = None) -> list[dict]:
    """The committed entries at `path` (default `SCATTER`); none where it is missing; a file
    that is not one `python -m sdcstudy.dev.seed_scatter` wrote is refused in one sentence."""
    path = Path(path or SCATTER)
    if not path.is_file():
        return []
    try:
        found = RF.json_load(path)
        entries = found.get("entries") if found.get("schema") == SCHEMA else None
    except (ValueError, AttributeError):  # not JSON (a ValueError), or not an object
        entries = None
    if not isinstance(entries, list):
        raise UserError(f"{str(path)!r} is not a seed scatter sdcstudy wrote ({SCHEMA}); "
                        f"restore it or write it again with python -m sdcstudy.dev.seed_scatter.")
    return entries


def _matching(entries: list[dict], request: dict) -> dict | None:
    """The entry of `request`'s command among `entries`, or None."""
    key = command_key(request)
    return next((e for e in entries if {k: e[k] for k in key} == key), None)


def entry_for(request: dict, path: Path | None = None) -> dict | None:
    """The committed entry of `request`'s command, or None."""
    return _matching(read(path), request)


def by_node(request: dict, path: Path | None = None) -> dict[int, dict]:
    """{node: the committed entry of that node's runs} for the request's nodes and the
    across-nodes row (`bands.ACROSS_NODES`): the entry of the request's own command where one
    was collected (its seeds ran these very runs); else, under `--fault-model chosen`, each
    node's kept model's command, whose runs a chosen node repeats, and no entry for the row
    across nodes of mixed models."""
    entries, found = read(path), {}
    own = _matching(entries, request)
    for node in request.get("nodes", []):
        entry = own or _matching(entries, {**request, "fault_model": P.node_model(request, node)})
        if entry is not None:
            found[node] = entry
    if own is not None:
        found[B.ACROSS_NODES] = own
    return found


def with_entry(entries: list[dict], entry: dict) -> list[dict]:
    """`entries` with `entry` in place of any of its command's."""
    key = command_key(entry)
    return [e for e in entries if command_key(e) != key] + [entry]


def share(counted: dict) -> tuple[int, int]:
    """(passes, judged seeds) of one entry row."""
    judged = [v for v in counted["verdicts"] if v in ("pass", "fail")]
    return sum(v == "pass" for v in judged), len(judged)


def annotate(rows: list[Row], entries: dict[int, dict] | None) -> None:
    """Set the chance of the judged rows of `SOURCES` that state none from the seeds of their
    node's entry (`by_node`): the Clopper-Pearson bounds of their share passing, where
    `MIN_SEEDS` judged it and the row's band is the entry's."""
    tables = {node: {_row_key(e): e for e in entry["rows"]}
              for node, entry in (entries or {}).items()}
    for row in rows:
        counted = tables.get(row.node, {}).get(_row_key(row))
        if (row.source not in SOURCES or row.verdict not in ("pass", "fail")
                or row.pass_probability is not None or counted is None
                or counted["band"] != row.band):
            continue
        passed, judged = share(counted)
        if judged >= MIN_SEEDS:
            row.pass_probability = PC.lower_bound(passed, judged)
            row.pass_probability_max = PC.upper_bound(passed, judged)
