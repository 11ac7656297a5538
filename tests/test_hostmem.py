"""The host allocator's thresholds (sdcstudy/core/hostmem.py), checked in fresh processes: the
setting happens once, when `sdcstudy` is imported."""

import os
import platform
import subprocess
import sys

import pytest

from sdcstudy.core import hostmem

SNIPPET = "import sdcstudy; from sdcstudy.core import hostmem; print(hostmem.describe())"


def _run(snippet: str = SNIPPET, **env) -> subprocess.CompletedProcess:
    """`snippet` in a fresh process whose environment holds none of the user's allocator
    choices (their tunables, the opt-out, a preloaded allocator), then `env`."""
    clean = {k: v for k, v in os.environ.items()
             if k not in (*hostmem.USER_TUNABLES, hostmem.OPT_OUT, "LD_PRELOAD")}
    return subprocess.run([sys.executable, "-c", snippet], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, check=True)


def _describe(**env) -> str:
    return _run(**env).stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_import_sets_glibc_thresholds_and_respects_the_user():
    """If this fails, glibc refused a value (mallopt returns 0) or the user's own choice (an
    opt-out or glibc's MALLOC_*_ variables) was overridden."""
    tuned = _describe()
    assert tuned.startswith("glibc mallopt: mmap threshold 32 MiB"), tuned
    assert _describe(**{hostmem.OPT_OUT: "system"}) == \
        f"allocator defaults ({hostmem.OPT_OUT}=system)"
    assert _describe(MALLOC_TOP_PAD_="131072") == "allocator defaults (MALLOC_TOP_PAD_ is set)"


def test_a_preloaded_allocator_is_named_and_left_alone(monkeypatch):
    """If this fails, a benchmark run under jemalloc (docs/paft.md, section 7) would record
    glibc's thresholds as in force, which then reach nothing."""
    monkeypatch.delenv(hostmem.OPT_OUT, raising=False)
    for name in hostmem.USER_TUNABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/x/libfoo.so /usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert hostmem.preloaded_allocator() == "libjemalloc.so.2"
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    assert hostmem._skip_reason() == "LD_PRELOAD allocator libjemalloc.so.2"
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:-1")  # recorded with the benchmark
    assert hostmem._skip_reason() == ("LD_PRELOAD allocator libjemalloc.so.2, "
                                      "MALLOC_CONF=dirty_decay_ms:-1")
    monkeypatch.setenv("LD_PRELOAD", "libfoo.so:libbar.so")
    assert hostmem.preloaded_allocator() is None


def test_a_misspelt_opt_out_is_named_in_one_warning():
    """If this fails, `SDCSTUDY_MALLOC=sytem` would tune the allocator without a word."""
    out = _run(**{hostmem.OPT_OUT: "sytem"})
    assert "SDCSTUDY_MALLOC='sytem' is not understood" in out.stderr


RELEASE_SNIPPET = """
import numpy as np
import sdcstudy
from sdcstudy.core import hostmem

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

blocks = [np.ones(2 << 20) for _ in range(32)]  # 32 blocks of 16 MiB, from the heap
del blocks
before = rss()
who = hostmem.release()
print(who, before - rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_release_hands_freed_heap_memory_back():
    """With the thresholds the heap keeps up to 1 GiB of freed memory for the next step; if
    this fails, a benchmark's next stage (preset, worker count) is built beside the previous
    one's freed peak instead of in its place."""
    out = _run(RELEASE_SNIPPET).stdout.split()
    assert out[0] == "glibc"
    assert int(out[1]) > 400 << 20  # of the 512 MiB freed
