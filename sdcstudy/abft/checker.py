"""Algorithm-based fault tolerance, the step feature: checksummed matrix multiplications
(`abft/checksum.py`) on every linear layer.

`AbftHook` owns the protected matmuls: at a matmul's output site the product goes through the
faults installed before it, then its check, then what comes after (e.g. a lock-step tap), so a
forward fault at a projection's output site (`fwd/attn_q`, ...) is injected between the
product and its check and counts as a fault inside the matmul. `Checker` is the "abft" step
feature: which records exist (`record_key`), their zero sinks, and abft.parquet's rows on the
host. Results leave the step without a host sync: forward records through the loss function's
aux output, backward records as the cotangent of a zero sink.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sdcstudy.core import mesh as M
from sdcstudy.core import runfolder as RF
from sdcstudy.core import sites as S
from sdcstudy.core.step import SiteHooks, StepFeature
from sdcstudy.abft import bound as B
from sdcstudy.abft.checksum import (
    ACC_BITS, COL, COL_MAX, COL_RATIO, COL_RESIDUAL, COL_THRESHOLD, FLAGGED, IN_BITS, K, M_ROWS,
    N_COLS, NORM_INF, NORM_ONE, OPERAND_ROUNDING, OUT_BITS, OUTPUT_PARTIALS, RECOMPUTED,
    RECORD_LEN, ROW, ROW_MAX, ROW_RATIO, ROW_RESIDUAL, ROW_THRESHOLD, THRESHOLDS, checked_matmul)
from sdcstudy.abft.tables import (
    DIRECTIONS, HOST_THRESHOLDS, MATMUL_OF_SITE, counters, detection_summary, host_flags,
    host_ratios)

# Also the host tables' names (`abft/tables.py`), for callers that import this module alone.
__all__ = ["AbftHook", "Checker", "DIRECTIONS", "HOST_THRESHOLDS", "detection_summary",
           "host_flags", "host_ratios"]

MATMULS = MATMUL_OF_SITE  # model site of each protected matmul's output -> matmul name
MATMUL_SITES = {name: site for site, name in MATMULS.items()}
PREFIX = "abft|"


# --- the hook ---------------------------------------------------------------------------------


def record_key(matmul: str, layer: int) -> str:
    return f"{PREFIX}{matmul}|{layer}"


def parse_key(key: str) -> tuple[str, int]:
    _, matmul, layer = key.split("|")
    return matmul, int(layer)


class AbftHook:
    """A `sites.Hook` that also owns the protected matmuls (`sites.linear` calls `.linear`).

    `full` is the hook at every other site; at a matmul's output site the product goes through
    `fault`, then the check, then `after` (e.g. a lock-step tap). Forward records fill
    `.records` while the model is traced.
    """

    def __init__(self, checker: "Checker", sinks: dict, full: S.Hook = S.identity_hook,
                 fault: S.Hook = S.identity_hook, after: S.Hook = S.identity_hook):
        self.checker, self.sinks = checker, sinks
        self.full, self.fault, self.after = full, fault, after
        self.records: dict[str, jax.Array] = {}

    def __call__(self, site: str, x, layer: int):
        return self.full(site, x, layer)

    def linear(self, site: str, x, w, layer: int, out_dtype=None):
        matmul = MATMULS[site]
        key = record_key(matmul, layer)
        corrupt = self.checker.corrupt_backward
        c, self.records[key] = checked_matmul(
            x, w, self.sinks[key], out_dtype=out_dtype, rule=self.checker.rule,
            arithmetic=self.checker.arithmetic(), recompute=self.checker.recompute,
            fault=lambda y: self.fault(site, y, layer),
            corrupt_backward=None if corrupt is None else partial(corrupt, matmul, layer))
        return self.after(site, c, layer)


class Checker(StepFeature):
    """Static ABFT settings of a model: which records exist, their sinks, and the host rows;
    the ABFT step feature ("abft"; device half `init_sinks`, `install`; host half `host`)."""

    name = "abft"
    tables = (RF.ABFT,)

    def __init__(self, n_layers: int, rule: str = "paper", recompute: bool = False,
                 corrupt_backward=None, operand_rounding: str = "auto",
                 output_partials: int = 1):
        """`corrupt_backward(matmul, layer, direction, grad) -> grad`, for tests only, stands
        in for a fault inside a backward matmul (before its check). `operand_rounding` and
        `output_partials`: the arithmetic the rounding bound assumes (`bound.resolve`)."""
        if rule not in THRESHOLDS:
            raise ValueError(f"abft.threshold must be one of {', '.join(THRESHOLDS)}.")
        self.n_layers, self.rule, self.recompute = n_layers, rule, recompute
        self.corrupt_backward = corrupt_backward
        self.operand_rounding, self.output_partials = operand_rounding, output_partials

    @classmethod
    def from_config(cls, cfg, dims) -> "Checker | None":
        """`abft.*`, when `abft.enabled` or the abft mode (which implies it); else None."""
        a = cfg.abft
        on = a.enabled or cfg.experiment.mode == "abft"
        return cls(dims.n_layers, a.threshold, a.recompute, operand_rounding=a.operand_rounding,
                   output_partials=a.output_partials) if on else None

    def arithmetic(self) -> B.Arithmetic:
        """The products' arithmetic on the platform and matmul precision of the trace."""
        return B.resolve(self.operand_rounding, self.output_partials)

    def keys(self) -> list[str]:
        block = [n for n in MATMULS.values() if n != "head"]
        return [record_key(n, layer) for layer in range(1, self.n_layers + 1) for n in block] + \
            [record_key("head", 0)]

    def init_sinks(self, axes: tuple[str, ...] = ()) -> dict:
        """Zero sinks, one (2, RECORD_LEN) per matmul (its two backward checks)."""
        return {k: M.vary(jnp.zeros((2, RECORD_LEN), jnp.float32), axes) for k in self.keys()}

    def hook(self, sinks: dict, full: S.Hook = S.identity_hook, fault: S.Hook = S.identity_hook,
             after: S.Hook = S.identity_hook) -> AbftHook:
        return AbftHook(self, sinks, full, fault, after)

    def install(self, hooks: SiteHooks, ctx, sinks: dict) -> tuple[SiteHooks, dict]:
        """The checked matmuls (fault, check, then `after`; `full` at every other site) and
        the forward records they fill while traced. Installed last."""
        del ctx
        hook = self.hook(sinks, hooks.full, hooks.fault, hooks.after)
        return hooks._replace(full=hook), hook.records

    @staticmethod
    def flagged(records: dict):
        """Whether any check of a step's records (`records`, {"fwd", "bwd"}) flagged."""
        flag = jnp.bool_(False)
        for record in jax.tree.leaves((records["fwd"], records["bwd"])):
            flag |= jnp.any(record[..., FLAGGED] > 0)
        return flag

    def host(self, step: int, records: dict, places, microsteps: int) -> tuple[dict, dict]:
        """abft.parquet rows of one step, each place's microsteps in order, and counters."""
        rows = []
        for place in places:
            for m in range(microsteps):
                at = lambda d: {k: v[(*place.index, m)] for k, v in d.items()}  # noqa: E731
                rows += self.rows(at(records["fwd"]), at(records["bwd"]), step, m,
                                  tp_rank=place.tp_rank, node=place.node or 0,
                                  dp_rank=place.dp_rank)
        return {RF.ABFT: rows}, counters(rows)

    @staticmethod
    def rows(fwd: dict, bwd: dict, step: int, microstep: int, *, tp_rank: int = 0,
             node: int = 0, dp_rank: int = 0) -> list[dict]:
        """abft.parquet rows of one microstep on one device from host arrays: `fwd[key]` of
        shape (RECORD_LEN,), `bwd[key]` of shape (2, RECORD_LEN)."""
        rows = []
        for key in sorted(fwd, key=_order):
            matmul, layer = parse_key(key)
            records = [("fwd", fwd[key])]
            if key in bwd:
                records += [("bwd_input", bwd[key][0]), ("bwd_weight", bwd[key][1])]
            for direction, r in records:
                r = np.asarray(r, np.float64)
                flagged = bool(r[FLAGGED])
                rows.append({
                    "step": step, "microstep": microstep, "layer": layer, "matmul": matmul,
                    "direction": direction, "tp_rank": tp_rank, "residual": r[ROW_RESIDUAL],
                    "threshold": r[ROW_THRESHOLD], "flagged": flagged,
                    "col_residual": r[COL_RESIDUAL], "col_threshold": r[COL_THRESHOLD],
                    "row": int(r[ROW]) if flagged else -1, "col": int(r[COL]) if flagged else -1,
                    "recomputed": bool(r[RECOMPUTED]), "node": node, "dp_rank": dp_rank,
                    "k": int(r[K]), "m": int(r[M_ROWS]), "n": int(r[N_COLS]),
                    "out_bits": int(r[OUT_BITS]), "in_bits": int(r[IN_BITS]),
                    "max_residual": r[ROW_MAX], "max_col_residual": r[COL_MAX],
                    "norm_inf": r[NORM_INF], "norm_one": r[NORM_ONE],
                    "row_ratio": r[ROW_RATIO], "col_ratio": r[COL_RATIO],
                    "operand_rounding": B.ROUNDINGS[int(r[OPERAND_ROUNDING])],
                    "acc_bits": int(r[ACC_BITS]), "output_partials": int(r[OUTPUT_PARTIALS])})
        return rows


def _order(key: str):
    matmul, layer = parse_key(key)
    return layer if layer else 10**9, list(MATMULS.values()).index(matmul)
