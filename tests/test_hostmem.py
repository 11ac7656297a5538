"""The host allocator's thresholds (sdcstudy/hostmem.py), checked in fresh processes: the
setting happens once, when `sdcstudy` is imported."""

import os
import platform
import subprocess
import sys

import pytest

from sdcstudy import hostmem

SNIPPET = "import sdcstudy; from sdcstudy import hostmem; print(hostmem.describe())"


def _run(**env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in hostmem.USER_TUNABLES and k != hostmem.OPT_OUT}
    return subprocess.run([sys.executable, "-c", SNIPPET], env={**clean, **env},
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


def test_a_misspelt_opt_out_is_named_in_one_warning():
    """If this fails, `SDCSTUDY_MALLOC=sytem` would tune the allocator without a word."""
    out = _run(**{hostmem.OPT_OUT: "sytem"})
    assert "SDCSTUDY_MALLOC='sytem' is not understood" in out.stderr
