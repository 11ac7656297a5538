"""The host half's reasoning: from the checksums of one step, which collective on which tp
rank was handed different values (computation) or delivered them (communication).

Per microstep, data-parallel replica, layer, collective and direction (a row's collective is
the forward one; in the backward its transpose ran), on the healthy node (0) and the
suspect (1) (`checksum.py` names the points):
- communication, found by "sum": an all-gather's received checksum on some node is not the
  wrapping sum of that node's sent checksums, each numbered where it lands (`checksum.py`;
  one node suffices; the forward all-gathers and the backward of the reduce-scatters);
- communication, found by "pair": every tp rank sent the same checksums on both nodes, but
  this rank received different ones;
- computation, found by "pair": this rank's computed input differs between the nodes.
An input of a collective is every rank's, so a difference on one rank makes every rank's
output differ; "pair" blames the wire only when all inputs agree. A difference propagates
(an all-gather's corrupted output feeds the attention, whose output then differs): `first`
marks the earliest verdict of each microstep and replica in the order the step ran them
(the forward's layers up, the backward's down), the root cause; a computation before the
collective it feeds.
"""

from __future__ import annotations

import numpy as np

from sdcstudy.collectives.checksum import BWD, COMPUTED, FWD, RECEIVED, SENT, parse_record_key
from sdcstudy.core import sites as S

TABLE = "collectives.parquet"
COLUMNS = ("step", "microstep", "layer", "submodule", "collective", "direction", "dp_rank",
           "tp_rank", "verdict", "found_by", "first")
COMMUNICATION, COMPUTATION = "communication", "computation"
VERDICTS = (COMPUTATION, COMMUNICATION)  # in the order they happen at one collective
ORDER = tuple(S.COLLECTIVES)  # (submodule, collective) in the order a block runs them
_WRAP = np.uint64(2 ** 32)


def decode(halves) -> np.ndarray:
    """Backward checksums from their sinks' cotangents: (..., 2) float32 (hi, lo) halves of
    each uint32."""
    halves = np.asarray(halves, np.float64)
    return (halves[..., 0].astype(np.uint64) << np.uint64(16)) + halves[..., 1].astype(np.uint64)


def _by_point(sums: dict) -> dict:
    """{(layer, submodule, collective, point): uint64 array (node, dp, tp, microstep, 2)}:
    each checksum the pair (A, B) of `checksum.checksum`."""
    out = {}
    for key, array in sums.items():
        array = np.asarray(array)
        if array.ndim != 5 or array.shape[0] != 2 or array.shape[-1] != 2:
            raise ValueError(f"checksums {key!r} have shape {array.shape}; expected (node=2, "
                             f"dp, tp, microstep, 2) blocks.")
        out[parse_record_key(key)] = array.astype(np.uint64)
    return out


def _collective_verdicts(sent, received, computed, all_gather: bool) -> list[tuple]:
    """[(tp rank, verdict, found_by)] of one collective, from (node, tp, 2) checksums."""
    found = []
    inputs_agree = bool(np.all(sent[0] == sent[1]))
    totals = sent.sum(axis=1) % _WRAP  # per node: what every rank's all-gather must receive
    for rank in range(sent.shape[1]):
        if np.any(computed[0, rank] != computed[1, rank]):
            found.append((rank, COMPUTATION, "pair"))
        if all_gather and np.any(received[:, rank] != totals):
            found.append((rank, COMMUNICATION, "sum"))
        elif inputs_agree and np.any(received[0, rank] != received[1, rank]):
            found.append((rank, COMMUNICATION, "pair"))
    return found


def _order(direction: str, layer: int, position: int, verdict: str) -> tuple:
    """When a verdict's difference arose in the step: forward layers up, backward down."""
    if direction == FWD:
        return 0, layer, position, VERDICTS.index(verdict)
    return 1, -layer, -position, VERDICTS.index(verdict)


def _found(sums: dict, direction: str, d: int, m: int) -> list[tuple]:
    """[(order, row without step)] of one direction, replica and microstep."""
    found = []
    for layer in sorted({layer for layer, *_ in sums}):
        for position, (submodule, collective) in enumerate(ORDER):
            at = lambda point: sums[(layer, submodule, collective, point)][:, d, :, m]  # noqa: E731
            sent, received = at(SENT), at(RECEIVED)
            tapped = (layer, submodule, collective, COMPUTED) in sums
            gather = (collective == S.ALL_GATHER) == (direction == FWD)  # what ran
            for rank, verdict, how in _collective_verdicts(
                    sent, received, at(COMPUTED) if tapped else sent, gather):
                found.append((_order(direction, layer, position, verdict), {
                    "microstep": m, "layer": layer, "submodule": submodule,
                    "collective": collective, "direction": direction, "dp_rank": d,
                    "tp_rank": rank, "verdict": verdict, "found_by": how}))
    return found


def verdict_rows(step: int, fwd: dict, bwd: dict | None = None) -> list[dict]:
    """collectives.parquet rows of one step's checksums ({record key: (node, dp, tp,
    microstep, 2) array}, forward and backward), per microstep and replica in step order."""
    by_direction = {FWD: _by_point(fwd), BWD: _by_point(bwd or {})}
    shapes = [next(iter(sums.values())).shape for sums in by_direction.values() if sums]
    if not shapes:
        return []
    _, dp, _, microsteps, _ = shapes[0]
    rows = []
    for m in range(microsteps):
        for d in range(dp):
            found = [item for direction, sums in by_direction.items() if sums
                     for item in _found(sums, direction, d, m)]
            found.sort(key=lambda item: item[0])
            earliest = found[0][0] if found else None
            rows += [{"step": step, **row, "first": order == earliest} for order, row in found]
    return rows


def counters(rows: list[dict]) -> dict:
    """The step's verdicts counted: all of them, and the root causes (`first`) by kind."""
    out = {f"collectives/{v}": 0 for v in VERDICTS}
    out.update({f"collectives/first_{v}": 0 for v in VERDICTS})
    for row in rows:
        out[f"collectives/{row['verdict']}"] += 1
        if row["first"]:
            out[f"collectives/first_{row['verdict']}"] += 1
    return out
