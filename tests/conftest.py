"""Test set-up: 8 simulated CPU devices and a compilation cache for the session, set before JAX
is imported anywhere."""

import contextlib
import os
import shutil
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prepared datasets are cached per test session, never in the user's home: a folder the
# session's first process makes (the xdist workers inherit it) and removes at the end.
MADE_DATA_CACHE = "SDCSTUDY_CACHE" not in os.environ
if MADE_DATA_CACHE:
    os.environ["SDCSTUDY_CACHE"] = tempfile.mkdtemp(prefix="sdcstudy-test-cache-")

# Compiled programs are shared through JAX's persistent compilation cache: a folder made fresh
# for each test session (never the user's own cache), passed on in the environment, so the
# xdist workers and every `sdcstudy` subprocess they start read and write the same one. Many
# tests and subprocesses compile a program another one already compiled (the tiny step of a
# mode, a bench's contenders); they load it instead. Programs of any compile time are kept.
SESSION_CACHE = "SDCSTUDY_TEST_COMPILATION_CACHE"
CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": None, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
MADE_CACHE = SESSION_CACHE not in os.environ  # in the session's first process only
if MADE_CACHE:
    os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="sdcstudy-test-xla-cache-")
os.environ.update({name: value or os.environ[SESSION_CACHE] for name, value in CACHE_ENV.items()})

# Tests whose claim is that compiling the same program again, in this process or another, gives
# the same bits run without the session's cache: with it, the second run would load the first
# one's executable instead of compiling its own, and a compiler that is not deterministic would
# go unseen. That is test_doctor (two processes, and a program loaded from a cache hashing as
# the compiled one), and, one test each, a resume against the uninterrupted run, a rollback and
# a snapshot against the clean run. Their subprocesses get no cache settings, and the cache is
# off in the worker while they run. A test named as "module::test" runs without it, its
# module's fixtures with it (the uninterrupted run is compiled once, with the cache; the
# resumed one compiles its own). The golden modules keep the cache: a check on another device
# compiles its own program whatever the cache holds (the device is part of the program on the
# CPU), so `golden check --device 1` against a record made on device 0 still compares two
# compiles. test_distributed gives its subprocesses a cache of their own. The last name: a
# test whose premise is that two compiles of one program differ in the source lines they name.
UNCACHED = ("test_doctor", "test_train::test_resume_is_bitwise_identical",
            "test_detect::test_rollback_with_transient_faults_ends_bitwise_equal_to_the_clean_run",
            "test_detect::test_killing_a_snapshot_write_never_mixes_two_steps",
            "test_bench::test_program_text_ignores_only_source_locations")


# Test modules by their measured share of `make test` (`pytest --durations=0`, 2026-11-26),
# heaviest first. With `--dist loadscope --no-loadscope-reorder` (Makefile) the two workers take
# whole modules in this order, so the modules that start last are short ones and neither
# worker waits long for the other at the end (xdist's own order, by number of tests, left the
# few-test, slow modules such as test_demo for last). Modules not named follow, as collected.
HEAVIEST_FIRST = ("test_bench", "test_paired", "test_reproduce", "test_faults", "test_paft",
                  "test_resume_modes", "test_golden_devices", "test_detect_scores", "test_train",
                  "test_tables", "test_runlock", "test_full_disk", "test_abft", "test_demo",
                  "test_distributed", "test_fault_model", "test_golden", "test_lockstep",
                  "test_detect", "test_tensorboard", "test_guide_promises", "test_reference",
                  "test_finetune", "test_sweep")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: tests keep order


def _use_compilation_cache(on: bool) -> bool:
    """Turn the cache on or off in this process; whether it was on."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", on)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used
    return was


@contextlib.contextmanager
def _without_compilation_cache(uncached: bool):
    """No cache settings in the environment (for subprocesses) and none in this process, while
    the block runs, if `uncached`."""
    if not uncached:
        yield
        return
    with pytest.MonkeyPatch.context() as env:
        for name in CACHE_ENV:
            env.delenv(name)
        was = _use_compilation_cache(False)
        try:
            yield
        finally:
            _use_compilation_cache(was)


def _module(request) -> str:
    return request.module.__name__.rpartition(".")[2]


@pytest.fixture(autouse=True, scope="module")
def _uncached_module(request):
    with _without_compilation_cache(_module(request) in UNCACHED):
        yield


@pytest.fixture(autouse=True)
def _uncached_test(request):
    with _without_compilation_cache(f"{_module(request)}::{request.node.originalname}"
                                    in UNCACHED):
        yield


def pytest_sessionfinish(session):
    # The process that made a folder ends last (xdist's controller).
    if MADE_CACHE:
        shutil.rmtree(os.environ[SESSION_CACHE], ignore_errors=True)
    if MADE_DATA_CACHE:
        shutil.rmtree(os.environ["SDCSTUDY_CACHE"], ignore_errors=True)
