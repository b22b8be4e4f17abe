"""Verification: losslessness of rejection sampling, greedy exact match, verify lengths."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jax_dspark.ops.sampling import SamplingParams, gumbel_sample, probabilities
from jax_dspark.spec import PAD_TOKEN, verify

G, V = 3, 4
N = 200_000  # independent draws, one per batch row

# One compilation per test instead of op-by-op dispatch (params are static).
_verify = jax.jit(verify, static_argnums=4)


def _logits(seed: int, rows: int) -> jax.Array:
    return 1.5 * jax.random.normal(jax.random.key(seed), (rows, V))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _block(key: jax.Array, b: int, v: int, params: SamplingParams):
    """Random verify inputs: target logits [b, G+1, v], q [b, G, v], drafts ~ q, lengths."""
    k_t, k_q, k_d, k_l = jax.random.split(key, 4)
    target_logits = jax.random.normal(k_t, (b, G + 1, v))
    q = probabilities(jax.random.normal(k_q, (b, G, v)), params)
    drafts = gumbel_sample(k_d, jnp.log(q))
    lengths = jax.random.randint(k_l, (b,), 0, G + 1)
    return target_logits, q, drafts, lengths


def _draw(key: jax.Array, probs: jax.Array, n: int) -> jax.Array:
    """`n` independent draws from each row of `probs [G, V]` -> `[n, G]`."""
    return gumbel_sample(key, jnp.log(jnp.broadcast_to(probs, (n,) + probs.shape)))


def _completed_sequences(params: SamplingParams, seed: int, lengths: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """One verify round per row, its emitted prefix completed by exact target draws.

    The target is context-free (row k of its logits is its distribution for position k
    whatever came before), so the round is lossless iff the completed `[G + 1]` sequence
    has the joint law prod_k p_k. Returns (sequences [N, G+1], p [G+1, V]).
    """
    target_logits = _logits(seed, G + 1)
    draft_logits = _logits(seed + 1, G)
    p = probabilities(target_logits, params)
    q = probabilities(draft_logits, params)

    @jax.jit
    def run(key):
        k_draft, k_verify, k_fill = jax.random.split(key, 3)
        drafts = _draw(k_draft, q, N)
        out = verify(k_verify, jnp.broadcast_to(target_logits, (N, G + 1, V)), drafts,
                     jnp.broadcast_to(q, (N, G, V)), params, lengths)
        fill = _draw(k_fill, p, N)
        return jnp.where(out.valid, out.tokens, fill)

    return np.asarray(run(jax.random.key(seed + 2))), np.asarray(p, np.float64)


def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel(), probs.ravel()
    assert np.all(counts[probs == 0] == 0), "a token the target never emits was emitted"
    big = probs * counts.sum() >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(probs[big], probs[~big].sum()) * counts.sum()
    keep = expected > 0
    return stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.9),
]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_k", "top_p", "top_k_top_p"])
def test_sampled_verification_emits_the_target_distribution(params):
    lengths = jnp.arange(N, dtype=jnp.int32) % (G + 1)  # every verify length, also 0
    seqs, p = _completed_sequences(params, 100 + PARAMS.index(params), lengths)
    joint = np.einsum("a,b,c,d->abcd", *p)
    counts = np.zeros((V,) * (G + 1))
    np.add.at(counts, tuple(seqs.T), 1)
    assert _chi_square_pvalue(counts, joint) > 1e-4
    tv = 0.5 * np.abs(counts / N - joint).sum()
    assert tv < 0.02, tv


def test_skipping_the_residual_would_fail_the_distribution_check():
    """The statistical check has power: resampling from p instead of the residual is caught."""
    params = SamplingParams(temperature=1.0)
    target_logits, draft_logits = _logits(7, G + 1), _logits(8, G)
    p, q = probabilities(target_logits, params), probabilities(draft_logits, params)
    drafts = _draw(jax.random.key(9), q, N)
    out = _verify(jax.random.key(10), jnp.broadcast_to(target_logits, (N, G + 1, V)), drafts,
                 jnp.broadcast_to(q, (N, G, V)), params)
    wrong_next = _draw(jax.random.key(11), p, N)[:, 0]  # p_0 instead of the residual
    first = np.where(np.asarray(out.num_accepted) > 0, np.asarray(drafts[:, 0]), np.asarray(wrong_next))
    counts = np.bincount(first, minlength=V)
    assert _chi_square_pvalue(counts, np.asarray(p[0], np.float64)) < 1e-6


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=3, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_drafter_equal_to_target_is_always_fully_accepted(params):
    n = 4096
    target_logits, _, _, lengths = _block(jax.random.key(20), n, 50, params)
    q = jax.jit(probabilities, static_argnums=1)(target_logits[:, :G], params)
    drafts = jax.jit(gumbel_sample)(jax.random.key(21), jnp.log(q))
    out = _verify(jax.random.key(23), target_logits, drafts, q, params, lengths)
    np.testing.assert_array_equal(np.asarray(out.num_accepted), np.asarray(lengths))


def test_greedy_verification_is_exact_match_with_argmax():
    b = 64
    target_logits = jax.random.normal(jax.random.key(30), (b, G + 1, V))
    argmax = np.argmax(np.asarray(target_logits), axis=-1)
    rng = np.random.default_rng(31)
    drafts = argmax[:, :G].copy()
    wrong = rng.random((b, G)) < 0.3
    drafts[wrong] = (drafts[wrong] + rng.integers(1, V, wrong.sum())) % V
    lengths = rng.integers(0, G + 1, b)
    out = _verify(jax.random.key(32), target_logits, jnp.asarray(drafts), None, SamplingParams(),
                 jnp.asarray(lengths, jnp.int32))
    out = jax.tree.map(np.asarray, out)
    for r in range(b):
        n = 0
        while n < lengths[r] and drafts[r, n] == argmax[r, n]:
            n += 1
        assert out.num_accepted[r] == n
        assert out.next_token[r] == argmax[r, n]


def test_drafts_beyond_a_requests_verify_length_are_ignored():
    b, v = 256, 9
    params = SamplingParams(temperature=1.0, top_k=5)
    target_logits, q, drafts, lengths = _block(jax.random.key(40), b, v, params)
    beyond = jnp.arange(G)[None, :] >= lengths[:, None]
    garbage_drafts = jnp.where(beyond, (drafts + 3) % v, drafts)
    garbage_q = jnp.where(beyond[..., None], jnp.roll(q, 1, axis=-1), q)
    a = _verify(jax.random.key(44), target_logits, drafts, q, params, lengths)
    c = _verify(jax.random.key(44), target_logits, garbage_drafts, garbage_q, params, lengths)
    for x, y in zip(a, c):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.all(np.asarray(a.num_accepted) <= np.asarray(lengths))


def test_all_accepted_takes_the_bonus_from_the_row_after_the_last_verified_draft():
    b, v = 8, 6
    target_logits = jax.random.normal(jax.random.key(50), (b, G + 1, v))
    argmax = jnp.argmax(target_logits, axis=-1)
    lengths = jnp.arange(b, dtype=jnp.int32) % (G + 1)
    out = _verify(jax.random.key(51), target_logits, argmax[:, :G].astype(jnp.int32), None, SamplingParams(), lengths)
    np.testing.assert_array_equal(np.asarray(out.num_accepted), np.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(out.next_token), np.asarray(argmax)[np.arange(b), np.asarray(lengths)])


def test_empty_residual_falls_back_to_the_target_distribution():
    """q == p and a draft outside the support: rejected, residual has no mass -> sample p."""
    n, v = 20_000, 6
    params = SamplingParams(temperature=1.0, top_k=3)
    logits = jax.random.normal(jax.random.key(60), (G + 1, v))
    p = probabilities(logits, params)
    outside = int(np.argmin(np.asarray(p[0])))
    assert float(p[0, outside]) == 0.0
    out = _verify(jax.random.key(61), jnp.broadcast_to(logits, (n, G + 1, v)), jnp.full((n, G), outside, jnp.int32),
                 jnp.broadcast_to(p[:G], (n, G, v)), params)
    assert np.all(np.asarray(out.num_accepted) == 0)
    counts = np.bincount(np.asarray(out.next_token), minlength=v)
    assert _chi_square_pvalue(counts, np.asarray(p[0], np.float64)) > 1e-4


def test_emitted_tokens_are_accepted_drafts_then_next_token_then_padding():
    b, v = 32, 7
    params = SamplingParams(temperature=1.0)
    target_logits, q, drafts, _ = _block(jax.random.key(70), b, v, params)
    out = _verify(jax.random.key(73), target_logits, drafts, q, params)
    out = jax.tree.map(np.asarray, out)
    n, tokens, drafts = out.num_accepted, out.tokens, np.asarray(drafts)
    assert len(set(n.tolist())) > 1
    for r in range(b):
        np.testing.assert_array_equal(tokens[r, : n[r]], drafts[r, : n[r]])
        assert tokens[r, n[r]] == int(out.next_token[r])
        assert np.all(tokens[r, n[r] + 1:] == PAD_TOKEN)
        np.testing.assert_array_equal(np.asarray(out.valid[r]), np.arange(G + 1) <= n[r])
        np.testing.assert_array_equal(np.asarray(out.accepted[r]), np.arange(G) < n[r])


def test_verify_lowers_without_host_callbacks():
    params = SamplingParams(temperature=0.9, top_p=0.95)
    target_logits, q, drafts, lengths = _block(jax.random.key(80), 4, 10, params)
    text = _verify.lower(jax.random.key(84), target_logits, drafts, q, params, lengths).as_text()
    assert "callback" not in text and "host" not in text.lower()


def test_concrete_out_of_range_lengths_are_rejected():
    target_logits = jax.random.normal(jax.random.key(90), (2, G + 1, V))
    with pytest.raises(ValueError, match="lengths"):
        verify(jax.random.key(0), target_logits, jnp.zeros((2, G), jnp.int32), None, SamplingParams(),
               jnp.array([1, G + 1]))


def test_sampled_verification_requires_draft_probs():
    target_logits = jax.random.normal(jax.random.key(91), (2, G + 1, V))
    with pytest.raises(ValueError, match="draft_probs"):
        verify(jax.random.key(0), target_logits, jnp.zeros((2, G), jnp.int32), None, SamplingParams(temperature=1.0))
