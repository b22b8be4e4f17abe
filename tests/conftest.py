"""Shared pytest setup: CPU by default, float32 matmuls at full precision for references."""

import os

if os.environ.get("JAX_DSPARK_TEST_GPU") is None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # 8 fake CPU devices so the sharding tests (TP / EP / Helix) run anywhere.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import functools  # noqa: E402

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


def greedy_continuation_errors(target, prompts, outputs) -> list[tuple[int, int]]:
    """(request, step) pairs where an output token is not the target's argmax after its prefix.

    One teacher-forced forward over prompt + output per request: the target's own greedy
    decoding is exactly the sequence where every token is the argmax of the row before it.
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    seqs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    tokens = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
    lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
    argmax = np.asarray(_teacher_forced_argmax(*nnx.split(target), jnp.asarray(tokens), lens))
    return [(b, k) for b, (p, o) in enumerate(zip(prompts, outputs)) for k, tok in enumerate(o)
            if argmax[b, len(p) - 1 + k] != tok]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _teacher_forced_argmax(graphdef, params, tokens, lengths):
    """`i32[B, S]` argmax of the target's logits over whole sequences from an empty cache."""
    import jax.numpy as jnp
    from flax import nnx

    target = nnx.merge(graphdef, params)
    b, s = tokens.shape
    logits, _, _ = target(tokens, target.init_cache(b, s), slots=jnp.arange(b, dtype=jnp.int32),
                          starts=jnp.zeros((b,), jnp.int32), lengths=lengths)
    return jnp.argmax(logits, axis=-1)


@pytest.fixture
def greedy_errors():
    """`greedy_errors(target, prompts, outputs) -> [(request, step), ...]` (empty = greedy)."""
    return greedy_continuation_errors
