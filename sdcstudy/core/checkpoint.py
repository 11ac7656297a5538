"""orbax checkpoints that continue a run bit for bit.

A checkpoint holds the whole training state (parameters, optimizer state, step) and a JSON
record of what else continuing needs. Data position, RNG and fault-schedule position are all
pure functions of (seed, step), so the step number is enough; the record also keeps a hash
of the configuration so a checkpoint is never restored into a different experiment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from sdcstudy.core.config import UserError
from sdcstudy.core.errors import first_line


class Checkpointer:
    def __init__(self, directory: Path, keep: int = 2, asynchronous: bool = True):
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1),
                                                 enable_async_checkpointing=asynchronous,
                                                 create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, record: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(record)))

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore `step` into the structure, shapes, dtypes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        where = self.directory / str(step)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many types for damaged or foreign files
            reason = first_line(e, 200)
            raise UserError(f"checkpoint {str(where)!r} is damaged or does not match this model "
                            f"({reason}); it was left as it is.") from e
        return out.state, dict(out.meta)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
