"""What docs/metrics.md ("Injected faults") says faults.parquet's rows and `faults/landed`
count: one row per landed element per device that holds it, so a `grad`/`update` leaf every tp
rank holds alike (a norm's scale, the embedding) is recorded once per rank, and a leaf split
over tp once (each rank's block is its own elements).

If a test here fails, the host counts corruptions another way than the page says (for
instance once per logical element), and docs/metrics.md, docs/faults.md 5.1 and the README's
demo figure ("... more in the weight gradients") must follow. One small program: a gradient
site on two CPU devices.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sdcstudy.core import mesh as M
from sdcstudy.core import runfolder as RF
from sdcstudy.core.step import Place
from sdcstudy.faults import inject as F
from sdcstudy.faults.feature import Faults
from sdcstudy.faults.specs import FaultSpec, Profile

COUNT = 3  # elements each tensor (each rank's block) gets


def _rows_of_a_tp2_grad_step() -> tuple[list[dict], dict]:
    """faults.parquet rows and counters of one step of `{site: grad, kind: bitflip, count: 3}`
    on a replicated 8 x 8 leaf and a leaf split in halves over tp = 2."""
    feature = Faults.from_profile(Profile("p", (FaultSpec("grad", "bitflip", count=COUNT),)),
                                  n_layers=1)

    def local(replicated, split):
        ctx = F.FaultContext(jax.random.key(3), jnp.int32(1), jnp.int32(-1), tp_axis=M.TP)
        feature.transform_grads({"replicated": replicated, "split": split}, ctx)
        return jax.tree.map(lambda r: r[None], M.vary(ctx.records, (M.TP,)))

    mesh = M.make_mesh(1, 1, 2)
    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(M.TP)),
                                out_specs=P(M.TP), check_vma=True))
    leaves = (jax.random.normal(jax.random.key(k), (8, 8)) for k in (6, 7))
    records = jax.device_get(run(*leaves))
    places = [Place((t,), tp_rank=t) for t in range(2)]
    tables, counters = feature.host(1, {"step": records}, places, microsteps=1)
    return tables[RF.FAULTS], counters


def test_a_replicated_gradient_leaf_is_counted_once_per_rank_a_split_one_once():
    rows, counters = _rows_of_a_tp2_grad_step()
    hits = lambda leaf, rank: {(r["flat_index"], r["bit"], r["original"], r["corrupted"])  # noqa: E731
                               for r in rows if r["site"] == f"grad/{leaf}"
                               and r["tp_rank"] == rank}
    # The replicated leaf: the same COUNT corruptions on both ranks, recorded on each.
    assert hits("replicated", 0) == hits("replicated", 1) and len(hits("replicated", 0)) == COUNT
    # The split leaf: each rank's half gets its own COUNT (rank 1's flat indices are local to
    # its half, so compare the values, which differ between the halves).
    assert len(hits("split", 0)) == len(hits("split", 1)) == COUNT
    assert not {h[2] for h in hits("split", 0)} & {h[2] for h in hits("split", 1)}
    # Logical corruptions: COUNT in the replicated leaf, 2 x COUNT in the split one; the
    # counter and the rows hold the replicated leaf's twice.
    assert len(rows) == counters["faults/landed"] == 4 * COUNT
    assert counters["faults/unlogged"] == 0
