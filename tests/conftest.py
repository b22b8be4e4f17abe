"""Shared pytest setup: CPU by default, float32 matmuls at full precision for references."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu") if os.environ.get("JAX_DSPARK_TEST_GPU") is None else None

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
