"""Random routed-experts problems shared by the MoE tests (BF16 and FP8, CPU and GPU)."""

import jax.numpy as jnp
import numpy as np


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def problem(seed, tokens=16, k=2, experts=4, hidden=256, inter=128):
    """bf16 `x [T, d]`, `ids int32[T, k]` (distinct per token), `weights f32[T, k]`, bf16 experts.

    Weights scaled so FC1 outputs are O(1): the clamp and SiLU both see their interesting range.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    wgu = rng.standard_normal((experts, hidden, 2 * inter), np.float32) / np.float32(np.sqrt(hidden))
    wd = rng.standard_normal((experts, inter, hidden), np.float32) / np.float32(np.sqrt(inter))
    ids = np.argsort(rng.standard_normal((tokens, experts)), axis=1)[:, :k].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    return bf(x), ids, weights, bf(wgu), bf(wd)
