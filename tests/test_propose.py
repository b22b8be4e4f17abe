"""Draft proposal: Markov chain semantics, draft distributions, confidence scoring, jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dspark.models.dspark_heads import ConfidenceHead, GatedMarkov, MarkovGate, MarkovHead
from jax_dspark.ops.sampling import SamplingParams, probabilities
from jax_dspark.spec import predecessors, propose

B, G, V, R, D = 3, 4, 13, 4, 8
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_k=7, top_p=0.9)


def _markov(seed: int = 0) -> MarkovHead:
    head = MarkovHead(V, R, rngs=nnx.Rngs(seed))
    # Strong bias so the chain visibly depends on the predecessor.
    head.w2[...] = head.w2[...] * 4.0
    return head


def _base(seed: int = 1, b: int = B) -> jax.Array:
    return 2.0 * jax.random.normal(jax.random.key(seed), (b, G, V))


def _anchor(b: int = B) -> jax.Array:
    return jnp.arange(b, dtype=jnp.int32) * 5 % V


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_step0_corrected_logits_are_base_plus_markov_bias_of_anchor(params):
    markov, base, anchor = _markov(), _base(), _anchor()
    out = propose(jax.random.key(2), base, anchor, params, markov=markov)
    np.testing.assert_array_equal(np.asarray(out.logits[:, 0]), np.asarray(base[:, 0] + markov(anchor)))
    w1 = np.asarray(markov.w1[...], np.float64)
    w2 = np.asarray(markov.w2[...], np.float64)
    expected = np.asarray(base[:, 0], np.float64) + w1[np.asarray(anchor)] @ w2.T
    np.testing.assert_allclose(np.asarray(out.logits[:, 0]), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("anchor", [-1, V, V + 100])
def test_out_of_vocab_anchor_gives_zero_step0_bias(anchor):
    base = _base(3)
    out = propose(jax.random.key(0), base, jnp.full((B,), anchor, jnp.int32), GREEDY, markov=_markov())
    np.testing.assert_array_equal(np.asarray(out.logits[:, 0]), np.asarray(base[:, 0]))


def test_greedy_tokens_are_argmax_of_corrected_logits_with_one_hot_probs():
    out = propose(jax.random.key(0), _base(4), _anchor(), GREEDY, markov=_markov(5))
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(out.logits), axis=-1))
    np.testing.assert_array_equal(np.asarray(out.probs), np.eye(V, dtype=np.float32)[tokens])


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_markov_bias_at_each_step_uses_the_token_drawn_at_the_previous_step(params):
    markov, base = _markov(6), _base(7)
    out = propose(jax.random.key(8), base, _anchor(), params, markov=markov)
    prev = predecessors(_anchor(), out.tokens)
    np.testing.assert_array_equal(np.asarray(prev[:, 1:]), np.asarray(out.tokens[:, :-1]))
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(base + markov(prev)))


def test_sampled_draft_probs_are_the_targets_processing_of_corrected_logits():
    out = propose(jax.random.key(9), _base(10), _anchor(), SAMPLED, markov=_markov(11))
    np.testing.assert_allclose(np.asarray(out.probs), np.asarray(probabilities(out.logits, SAMPLED)), atol=1e-7)
    drawn = np.take_along_axis(np.asarray(out.probs), np.asarray(out.tokens)[..., None], axis=-1)
    assert np.all(drawn > 0), "every draft must lie in the support of its q"


def test_sampled_chain_joint_distribution_of_two_steps_matches_the_markov_model():
    """Tokens 0 and 1 jointly follow q0(x0 | anchor) * q1(x1 | x0) (many independent rows)."""
    n, v = 100_000, 5
    markov = MarkovHead(v, 3, rngs=nnx.Rngs(12))
    markov.w2[...] = markov.w2[...] * 5.0
    params = SamplingParams(temperature=1.0)
    row = jax.random.normal(jax.random.key(13), (1, 2, v))
    out = jax.jit(lambda k: propose(k, jnp.broadcast_to(row, (n, 2, v)), jnp.full((n,), 2, jnp.int32), params,
                                    markov=markov))(jax.random.key(14))
    q0 = np.asarray(probabilities(row[0, 0] + markov(jnp.int32(2)), params), np.float64)
    q1 = np.asarray(probabilities(row[0, 1][None] + markov(jnp.arange(v)), params), np.float64)
    expected = q0[:, None] * q1
    counts = np.zeros((v, v))
    np.add.at(counts, (np.asarray(out.tokens[:, 0]), np.asarray(out.tokens[:, 1])), 1)
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert tv < 0.01, tv


def test_confidence_logits_read_hidden_and_predecessor_embedding():
    markov, head = _markov(15), ConfidenceHead(D, R, rngs=nnx.Rngs(16))
    hidden = jax.random.normal(jax.random.key(17), (B, G, D))
    anchor = _anchor().at[0].set(-1)
    out = propose(jax.random.key(18), _base(19), anchor, SAMPLED, markov=markov, hidden=hidden, confidence=head)
    expected = head(hidden, markov.embed(predecessors(anchor, out.tokens)))
    assert out.confidence_logits.shape == (B, G)
    np.testing.assert_array_equal(np.asarray(out.confidence_logits), np.asarray(expected))


def test_without_heads_corrected_logits_equal_base_and_no_confidence():
    base = _base(20)
    out = propose(jax.random.key(0), base, _anchor(), GREEDY)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(base))
    assert out.confidence_logits is None


def test_markov_vocab_smaller_than_logits_vocab_biases_only_its_columns():
    small = MarkovHead(V - 3, R, rngs=nnx.Rngs(21))
    base = _base(22)
    out = propose(jax.random.key(0), base, _anchor(), GREEDY, markov=small)
    np.testing.assert_array_equal(np.asarray(out.logits[..., V - 3:]), np.asarray(base[..., V - 3:]))
    assert np.any(np.asarray(out.logits[..., : V - 3]) != np.asarray(base[..., : V - 3]))


def test_propose_under_jit_matches_eager_and_has_no_host_callbacks():
    markov, head = _markov(23), ConfidenceHead(D, R, rngs=nnx.Rngs(24))
    hidden = jax.random.normal(jax.random.key(25), (B, G, D))
    base, anchor, key = _base(26), _anchor(), jax.random.key(27)

    def run(markov, head, key, base, anchor, hidden):
        return propose(key, base, anchor, SAMPLED, markov=markov, hidden=hidden, confidence=head)

    jitted = jax.jit(run)
    eager = run(markov, head, key, base, anchor, hidden)
    traced = jitted(markov, head, key, base, anchor, hidden)
    for a, b in zip(eager, traced):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    text = jitted.lower(markov, head, key, base, anchor, hidden).as_text()
    assert "callback" not in text and "host" not in text.lower()


def test_confidence_head_without_hidden_is_rejected():
    with pytest.raises(ValueError, match="hidden"):
        propose(jax.random.key(0), _base(), _anchor(), GREEDY, markov=_markov(),
                confidence=ConfidenceHead(D, R, rngs=nnx.Rngs(0)))


def test_anchor_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="anchor"):
        propose(jax.random.key(0), _base(), jnp.zeros((B + 1,), jnp.int32), GREEDY)


def _gated_markov(seed: int = 20) -> GatedMarkov:
    gate = MarkovGate(D, R, rngs=nnx.Rngs(seed))
    gate.w[...] = 2.0 * jax.random.normal(jax.random.key(seed), gate.w.shape)
    return GatedMarkov(_markov(seed), gate)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_gated_markov_bias_at_each_step_reads_that_positions_hidden_state(params):
    markov, base = _gated_markov(), _base(21)
    hidden = jax.random.normal(jax.random.key(22), (B, G, D))
    out = propose(jax.random.key(23), base, _anchor(), params, markov=markov, hidden=hidden)
    prev = predecessors(_anchor(), out.tokens)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(base + markov(prev, hidden)), rtol=1e-6, atol=1e-6)
    # the positions' own hidden states matter: the same chain with them reversed differs
    swapped = base + markov(prev, hidden[:, ::-1])
    assert np.abs(np.asarray(out.logits - swapped)).max() > 1e-3


def test_gated_markov_head_without_or_with_a_mis_shaped_hidden_is_rejected():
    with pytest.raises(ValueError, match="hidden"):
        propose(jax.random.key(0), _base(), _anchor(), GREEDY, markov=_gated_markov())
    with pytest.raises(ValueError, match="hidden"):
        propose(jax.random.key(0), _base(), _anchor(), GREEDY, markov=_gated_markov(), hidden=jnp.ones((B, G, D + 2)))
