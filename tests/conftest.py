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
