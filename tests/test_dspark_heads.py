"""DSpark Markov and confidence heads: bias formula, guarded lookup, confidence input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dspark.models.dspark_heads import ConfidenceHead, GatedMarkov, MarkovGate, MarkovHead

V, R, D = 11, 4, 6


def _markov(seed: int = 0, dtype=jnp.float32) -> MarkovHead:
    return MarkovHead(V, R, rngs=nnx.Rngs(seed), param_dtype=dtype)


def test_markov_bias_is_w1_row_times_w2_transpose():
    head = _markov()
    prev = jnp.array([[3, 0], [10, 7]], jnp.int32)
    w1 = np.asarray(head.w1[...], np.float64)
    w2 = np.asarray(head.w2[...], np.float64)
    expected = w1[np.asarray(prev)] @ w2.T
    got = head(prev)
    assert got.shape == (2, 2, V) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prev", [-1, -7, V, V + 5])
def test_markov_bias_is_zero_for_out_of_vocab_predecessor(prev):
    head = _markov(1)
    out = head(jnp.array([prev, 2], jnp.int32))
    assert np.all(np.asarray(out[0]) == 0.0)
    assert np.any(np.asarray(out[1]) != 0.0)
    assert np.all(np.asarray(head.embed(jnp.array([prev])))[0] == 0.0)


def test_markov_bias_is_float32_for_bfloat16_weights():
    head = _markov(2, jnp.bfloat16)
    got = head(jnp.array([5], jnp.int32))
    w1 = np.asarray(head.w1[...].astype(jnp.float32), np.float64)
    w2 = np.asarray(head.w2[...].astype(jnp.float32), np.float64)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got)[0], w1[5] @ w2.T, rtol=1e-5, atol=1e-6)


def test_confidence_logit_is_weight_dot_hidden_and_predecessor_embedding():
    markov = _markov(3)
    head = ConfidenceHead(D, R, rngs=nnx.Rngs(4))
    hidden = jax.random.normal(jax.random.key(5), (2, 3, D), jnp.bfloat16)
    prev = jnp.array([[1, 4, 9], [0, -1, 10]], jnp.int32)
    got = head(hidden, markov.embed(prev))
    feats = np.concatenate(
        [np.asarray(hidden.astype(jnp.float32), np.float64), np.asarray(markov.embed(prev), np.float64)], axis=-1
    )
    expected = feats @ np.asarray(head.w[...], np.float64)
    assert got.shape == (2, 3) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_confidence_bias_exists_only_when_requested_and_is_added():
    hidden = jax.random.normal(jax.random.key(6), (4, D))
    without = ConfidenceHead(D, 0, rngs=nnx.Rngs(7))
    assert without.b is None
    with_bias = ConfidenceHead(D, 0, rngs=nnx.Rngs(7), use_bias=True)
    with_bias.b[...] = jnp.asarray(0.75)
    np.testing.assert_allclose(np.asarray(with_bias(hidden) - without(hidden)), 0.75, rtol=1e-6)


def test_confidence_head_requires_predecessor_embedding_when_it_has_markov_rank():
    head = ConfidenceHead(D, R, rngs=nnx.Rngs(8))
    with pytest.raises(ValueError, match="prev_embedding"):
        head(jnp.ones((2, D)))


def test_confidence_head_rejects_wrong_hidden_width():
    head = ConfidenceHead(D, 0, rngs=nnx.Rngs(9))
    with pytest.raises(ValueError, match="hidden"):
        head(jnp.ones((2, D + 1)))


@pytest.mark.parametrize("vocab,rank", [(0, 4), (8, 0)])
def test_markov_head_rejects_empty_sizes(vocab, rank):
    with pytest.raises(ValueError):
        MarkovHead(vocab, rank, rngs=nnx.Rngs(0))


def _embedding_markov(seed: int = 0):
    from jax_dspark.models.llama import TINY, tiny_llama

    from jax_dspark.models.dspark_heads import EmbeddingMarkovHead

    target = tiny_llama(0)
    head = EmbeddingMarkovHead(TINY.hidden_size, 5, rngs=nnx.Rngs(seed))
    return target, head, head.bind(target)


def test_embedding_markov_bias_is_lm_head_of_projected_predecessor_embedding():
    target, head, bound = _embedding_markov()
    prev = jnp.array([[1, 7], [30, 2]], jnp.int32)
    e = np.asarray(target.embedding[...], np.float64)[np.asarray(prev)]
    p1, p2 = np.asarray(head.p1[...], np.float64), np.asarray(head.p2[...], np.float64)
    lm = np.asarray(target.embedding[...] if target.lm_head is None else target.lm_head[...].T, np.float64)
    want = (e @ p1 @ p2.T) @ lm.T
    assert bound(prev).dtype == jnp.float32
    got = np.asarray(bound(prev), np.float64)
    assert got.shape == (2, 2, target.config.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(bound.embed(prev)), e @ p1, rtol=1e-5, atol=1e-6)
    assert bound.rank == 5 and bound.vocab_size == target.config.vocab_size


@pytest.mark.parametrize("prev", [-1, 10**6])
def test_embedding_markov_bias_is_zero_for_out_of_vocab_predecessor(prev):
    _, _, bound = _embedding_markov()
    assert not np.any(np.asarray(bound(jnp.array([prev]))))
    assert not np.any(np.asarray(bound.embed(jnp.array([prev]))))


def test_embedding_markov_head_is_the_vanilla_head_with_tied_tables():
    """W1 = E P1 and W2^T = unembed(P2^T) in a plain MarkovHead give the same bias."""
    target, head, bound = _embedding_markov(3)
    table = MarkovHead(target.config.vocab_size, 5, rngs=nnx.Rngs(0))
    table.w1[...] = target.embedding[...] @ head.p1[...]
    table.w2[...] = target.unembed(head.p2[...].T).T
    prev = jnp.arange(0, target.config.vocab_size, 7, dtype=jnp.int32)
    np.testing.assert_allclose(np.asarray(bound(prev)), np.asarray(table(prev)), rtol=1e-4, atol=1e-5)


def _gated(seed: int = 10) -> GatedMarkov:
    """A gated head with a random (non-zero) gate, so the gate visibly matters."""
    gate = MarkovGate(D, R, rngs=nnx.Rngs(seed))
    gate.w[...] = jax.random.normal(jax.random.key(seed), gate.w.shape)
    gate.b[...] = jax.random.normal(jax.random.key(seed + 1), gate.b.shape)
    return GatedMarkov(_markov(seed), gate)


def test_gated_markov_bias_is_sigmoid_gate_times_w1_row_through_w2():
    head = _gated()
    prev = jnp.array([[3, 0, 10], [7, 7, 1]], jnp.int32)
    hidden = jax.random.normal(jax.random.key(12), (2, 3, D))
    w1 = np.asarray(head.head.w1[...], np.float64)
    w2 = np.asarray(head.head.w2[...], np.float64)
    wg, bg = np.asarray(head.gate.w[...], np.float64), np.asarray(head.gate.b[...], np.float64)
    e = w1[np.asarray(prev)]
    z = np.concatenate([np.asarray(hidden, np.float64), e], axis=-1) @ wg + bg
    expected = (e / (1.0 + np.exp(-z))) @ w2.T
    got = head(prev, hidden)
    assert got.shape == (2, 3, V) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    # the confidence head's feature stays the ungated row
    np.testing.assert_array_equal(np.asarray(head.embed(prev)), np.asarray(head.head.embed(prev)))


def test_gated_markov_bias_depends_on_the_hidden_state_and_is_zero_without_a_predecessor():
    head = _gated(13)
    prev = jnp.array([4, -1, V], jnp.int32)
    h1, h2 = jax.random.normal(jax.random.key(14), (2, 3, D))
    a, b = np.asarray(head(prev, h1)), np.asarray(head(prev, h2))
    assert np.abs(a[0] - b[0]).max() > 1e-3
    assert np.all(a[1:] == 0.0) and np.all(b[1:] == 0.0)


def test_gated_markov_rejects_a_missing_or_mis_shaped_hidden_state():
    head = _gated(15)
    with pytest.raises(ValueError, match="hidden"):
        head(jnp.array([1, 2], jnp.int32))
    with pytest.raises(ValueError, match="hidden"):
        head(jnp.array([1, 2], jnp.int32), jnp.ones((2, D + 1)))
    with pytest.raises(ValueError, match="rank"):
        GatedMarkov(_markov(), MarkovGate(D, R + 1, rngs=nnx.Rngs(0)))


def test_fresh_gate_is_one_half_everywhere():
    gate = MarkovGate(D, R, rngs=nnx.Rngs(16))
    out = gate(jax.random.normal(jax.random.key(17), (5, D)), jax.random.normal(jax.random.key(18), (5, R)))
    np.testing.assert_array_equal(np.asarray(out), 0.5)
