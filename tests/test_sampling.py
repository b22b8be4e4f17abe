"""Sampling transforms: greedy, temperature, top-k, top-p and Gumbel draws."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import ops
from jax_dspark.ops import SamplingParams


def test_greedy_is_argmax_and_one_hot():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 11)), jnp.float32)
    p = SamplingParams()
    np.testing.assert_array_equal(ops.sample(jax.random.key(0), logits, p), np.argmax(logits, -1))
    np.testing.assert_array_equal(ops.probabilities(logits, p), jax.nn.one_hot(np.argmax(logits, -1), 11))


def test_temperature_scales_logits():
    logits = jnp.asarray([[1.0, 2.0, 4.0]])
    probs = ops.probabilities(logits, SamplingParams(temperature=2.0))
    np.testing.assert_allclose(probs, jax.nn.softmax(logits / 2.0), rtol=1e-6)


def test_top_k_keeps_exactly_the_k_largest():
    logits = jnp.asarray([[0.1, 3.0, -1.0, 2.0, 0.5]])
    out = np.asarray(ops.process_logits(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert np.isfinite(out).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(probs)[None], jnp.float32)
    kept = lambda p: np.isfinite(np.asarray(ops.process_logits(logits, SamplingParams(temperature=1.0, top_p=p))))[0]
    assert kept(0.5).tolist() == [True, False, False, False]
    assert kept(0.79).tolist() == [True, True, False, False]
    assert kept(0.81).tolist() == [True, True, True, False]
    assert kept(0.01).tolist() == [True, False, False, False]


def test_gumbel_samples_follow_the_softmax():
    probs = np.array([0.6, 0.25, 0.1, 0.05])
    logits = jnp.asarray(np.log(probs), jnp.float32)
    keys = jax.random.split(jax.random.key(1), 40_000)
    draws = np.asarray(jax.vmap(lambda k: ops.gumbel_sample(k, logits))(keys))
    freq = np.bincount(draws, minlength=4) / draws.size
    assert np.abs(freq - probs).max() < 0.01


def test_masked_tokens_are_never_sampled():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal(50), jnp.float32)
    params = SamplingParams(temperature=1.5, top_k=5)
    keys = jax.random.split(jax.random.key(3), 2000)
    draws = np.asarray(jax.vmap(lambda k: ops.sample(k, logits, params))(keys))
    top5 = set(np.argsort(-np.asarray(logits))[:5].tolist())
    assert set(draws.tolist()) <= top5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_invalid_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
