"""The host half's reasoning: from the checksums of one step, which collective on which tp
rank was handed different values (computation) or delivered them (communication).

Per microstep, data-parallel replica, layer and collective, on the healthy node (0) and the
suspect (1) (`checksum.py` names the points):
- communication, found by "sum": an all-gather's received checksum on some node is not the
  wrapping sum of that node's sent checksums (one node suffices);
- communication, found by "pair": every tp rank sent the same checksums on both nodes, but
  this rank received different ones;
- computation, found by "pair": this rank's computed input differs between the nodes.
An input of a collective is every rank's, so a difference on one rank makes every rank's
output differ; "pair" blames the wire only when all inputs agree. A difference propagates
(an all-gather's corrupted output feeds the attention, whose output then differs): `first`
marks the step's earliest verdict of each microstep and replica in the forward order, the
root cause; a computation before the collective it feeds.
"""

from __future__ import annotations

import numpy as np

from sdcstudy.collectives.checksum import COMPUTED, RECEIVED, SENT, parse_record_key
from sdcstudy.core import sites as S

TABLE = "collectives.parquet"
COLUMNS = ("step", "microstep", "layer", "submodule", "collective", "direction", "dp_rank",
           "tp_rank", "verdict", "found_by", "first")
COMMUNICATION, COMPUTATION = "communication", "computation"
VERDICTS = (COMPUTATION, COMMUNICATION)  # in the order they happen at one collective
ORDER = tuple(S.COLLECTIVES)  # (submodule, collective) in the order a block runs them
_WRAP = np.uint64(2 ** 32)


def _by_point(fwd: dict) -> dict:
    """{(layer, submodule, collective, point): uint64 array (node, dp, tp, microstep)}."""
    out = {}
    for key, array in fwd.items():
        array = np.asarray(array)
        if array.ndim != 4 or array.shape[0] != 2:
            raise ValueError(f"checksums {key!r} have shape {array.shape}; expected (node=2, "
                             f"dp, tp, microstep) blocks.")
        out[parse_record_key(key)] = array.astype(np.uint64)
    return out


def _collective_verdicts(sent, received, computed, all_gather: bool) -> list[tuple]:
    """[(tp rank, verdict, found_by)] of one collective, from (node, tp) checksums."""
    found = []
    inputs_agree = bool(np.all(sent[0] == sent[1]))
    totals = sent.sum(axis=1) % _WRAP  # per node: what every rank's all-gather must receive
    for rank in range(sent.shape[1]):
        if computed[0, rank] != computed[1, rank]:
            found.append((rank, COMPUTATION, "pair"))
        if all_gather and np.any(received[:, rank] != totals):
            found.append((rank, COMMUNICATION, "sum"))
        elif inputs_agree and received[0, rank] != received[1, rank]:
            found.append((rank, COMMUNICATION, "pair"))
    return found


def verdict_rows(step: int, fwd: dict) -> list[dict]:
    """collectives.parquet rows of one step's forward checksums ({record key: (node, dp,
    tp, microstep) array}), in forward order per microstep and replica."""
    sums = _by_point(fwd)
    if not sums:
        return []
    _, dp, _, microsteps = next(iter(sums.values())).shape
    layers = sorted({layer for layer, *_ in sums})
    rows = []
    for m in range(microsteps):
        for d in range(dp):
            found = []
            for layer in layers:
                for position, (submodule, collective) in enumerate(ORDER):
                    at = lambda point: sums[(layer, submodule, collective, point)][:, d, :, m]  # noqa: E731
                    gather = collective == S.ALL_GATHER
                    sent, received = at(SENT), at(RECEIVED)
                    computed = sent if gather else at(COMPUTED)
                    for rank, verdict, how in _collective_verdicts(sent, received, computed,
                                                                   gather):
                        order = (layer, position, VERDICTS.index(verdict))
                        found.append((order, {
                            "step": step, "microstep": m, "layer": layer,
                            "submodule": submodule, "collective": collective,
                            "direction": "fwd", "dp_rank": d, "tp_rank": rank,
                            "verdict": verdict, "found_by": how}))
            earliest = min((order for order, _ in found), default=None)
            rows += [{**row, "first": order == earliest} for order, row in found]
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
