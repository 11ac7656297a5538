"""What the fault engine's compile time rests on: the structure of the programs it emits, not
a timing.

XLA's CPU backend compiles a kernel per distinct fused computation; identical ones (the same
shapes at every layer) are compiled once, distinct shapes each time, and LLVM unrolls a loop
of a few elements element by element. A stack of hashes (the `grad` and `update` sites' stacked
leaves) is therefore one flat hash: a (stack, few counters) hash is unrolled row by row.
Timings: docs/developing.md, "What the suite costs".
"""

import re

import jax
import numpy as np

from sdcstudy.faults import hashing as H


def test_a_stack_of_hashes_is_one_flat_hash():
    # A vmapped hash (stacked leaves' draws) must reach XLA as one hash over the stack's
    # counters laid end to end, each row the hash of its own key: if this fails, the stack's
    # hash is (5, 7) again, which the CPU backend unrolls row by row.
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 5))
    stacked = jax.jit(jax.vmap(lambda k: H.hashes([(k, 3), (k, 4)])))
    shapes = set(re.findall(r"call @threefry2x32\(.*\) : \(tensor<(\w+)>",
                            stacked.lower(keys).as_text()))
    assert shapes == {"35xui32"}, shapes
    rows = jax.device_get(stacked(keys))
    for i, key in enumerate(keys):
        alone = jax.device_get(H.hashes([(key, 3), (key, 4)]))
        for words, one in zip(rows, alone):
            assert all(np.array_equal(w[i], o) for w, o in zip(words, one))
