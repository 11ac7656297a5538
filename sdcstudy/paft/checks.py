"""The PAFT settings that cannot work, refused before anything is built.

`check_config` ends each impossible combination of `mesh` and `paft` settings (fewer than two
workers, tensor parallelism, a negative error level or interval, a drop probability outside
[0, 1), an unknown aggregate, bursts shorter than a packet) in one sentence that names the key
and what it must be, as a UserError (exit 2). The paft mode's check (`modes/paft.py`) and
`PaftTrainer.from_config` call it.
"""

from __future__ import annotations

from sdcstudy.core.config import Config, UserError
from sdcstudy.paft import packets


def check_config(cfg: Config) -> None:
    """One-sentence errors for PAFT settings that cannot work."""
    c, loss = cfg.paft, cfg.paft.loss
    if cfg.mesh.dp < 2:
        raise UserError(f"paft mode needs at least 2 workers (mesh.dp), not {cfg.mesh.dp}.")
    if cfg.mesh.tp != 1:
        raise UserError("paft mode runs data-parallel workers only; set mesh.tp=1.")
    checks = [("paft.noise.sigma2", c.noise.sigma2 >= 0, "non-negative"),
              ("paft.noise.large_sigma2", c.noise.large_sigma2 >= 0, "non-negative"),
              ("paft.noise.large_every", c.noise.large_every >= 0, "non-negative"),
              ("paft.sync_every", c.sync_every >= 0, "non-negative"),
              ("paft.div_every", c.div_every >= 0, "non-negative"),
              ("paft.h_min", c.h_min >= 1, "at least 1"),
              ("paft.h_max", c.h_max >= c.h_min, "at least paft.h_min"),
              ("paft.loss.p", 0 <= loss.p < 1, "in [0, 1)"),
              ("paft.loss.param_p", loss.param_p is None or 0 <= loss.param_p < 1,
               "in [0, 1) or null"),
              ("paft.loss.packet_size", loss.packet_size >= 1, "at least 1"),
              ("paft.loss.burst", loss.burst == 0 or loss.burst >= max(1.0, loss.p / (1 - loss.p)),
               "0 (independent drops) or a mean run length of at least 1 packet")]
    for key, ok, what in checks:
        if not ok:
            raise UserError(f"{key} must be {what}.")
    if loss.aggregate not in packets.AGGREGATES:
        raise UserError(f"paft.loss.aggregate {loss.aggregate!r} is not one of "
                        f"{', '.join(packets.AGGREGATES)}.")
    if c.dynamic and c.sync_every == 0 and c.h_min < 1:
        raise UserError("paft.dynamic needs paft.h_min >= 1.")


__all__ = ["check_config"]
