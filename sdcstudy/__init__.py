"""sdcstudy: a JAX/XLA research harness for silent data corruption in LLM training.

`import sdcstudy` imports no JAX: public names below load their module on first use.
"""

from __future__ import annotations

import importlib

from sdcstudy.core import hostmem

# Freed host memory stays in the process (see core/hostmem.py): each step's buffers are reused
# instead of being faulted in again. SDCSTUDY_MALLOC=system keeps the C library's defaults.
hostmem.tune()

# Public name -> submodule that defines it. Add a line here to export another name lazily.
_LAZY = {
    "load_hf_checkpoint": "core.hf",
    "logits": "core.hf",
    "mismatch_stats": "core.stats",
    "bit_histogram": "core.stats",
    "load_run": "report.runs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
