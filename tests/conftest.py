"""Test set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prepared datasets are cached per test session, never in the user's home.
os.environ.setdefault("SDCSTUDY_CACHE", tempfile.mkdtemp(prefix="sdcstudy-test-cache-"))


# Test modules by their measured share of `make test` (`pytest --durations=0`, 2026-11-26),
# heaviest first. With `--dist loadscope --no-loadscope-reorder` (Makefile) the two workers take
# whole modules in this order, so the modules that start last are short ones and neither
# worker waits long for the other at the end (xdist's own order, by number of tests, left the
# few-test, slow modules such as test_demo for last). Modules not named follow, as collected.
HEAVIEST_FIRST = ("test_bench", "test_paired", "test_reproduce", "test_faults", "test_paft",
                  "test_golden_devices", "test_detect_scores", "test_train", "test_tables",
                  "test_runlock", "test_abft", "test_demo", "test_distributed",
                  "test_fault_model", "test_golden", "test_lockstep", "test_detect",
                  "test_tensorboard", "test_reference", "test_finetune", "test_sweep")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: tests keep order
