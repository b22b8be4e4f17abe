"""Shared pytest setup: CPU by default, float32 matmuls at full precision for references."""

import os

if os.environ.get("JAX_DSPARK_TEST_GPU") is None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # 8 fake CPU devices so the sharding tests (TP / EP / Helix) run anywhere.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """GPU tests skip with a reason when there is no GPU (they never count as passed)."""
    try:
        has_gpu = jax.default_backend() == "gpu"
    except RuntimeError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
