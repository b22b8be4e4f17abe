"""The dense Llama target honours the target-model protocol of docs/interfaces.md.

Every test compares two ways of computing the same positions (one prefill vs token by
token, chunks, verify + partial commit, batch composition) on the tiny random-weight config,
so a cache-indexing or masking bug shows as a mismatch. Shapes are reused across tests so
the jitted forward compiles only a handful of times.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark.models import llama

ATOL = 2e-5
PROMPT = 12


@pytest.fixture(scope="module")
def model():
    return llama.tiny_llama(seed=0)


@pytest.fixture(scope="module")
def forward(model):
    return llama.jit_forward(model)


def _tokens(seed: int, shape) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).integers(0, llama.TINY.vocab_size, shape), jnp.int32)


def _i32(*values) -> jnp.ndarray:
    return jnp.asarray(values, jnp.int32)


def _prefill(forward, model, tokens, lengths, num_slots=2):
    """One call over the whole prompt of each request, slots 0..B-1."""
    b = tokens.shape[0]
    cache = model.init_cache(num_slots, 32)
    return forward(tokens, cache, jnp.arange(b, dtype=jnp.int32), jnp.zeros(b, jnp.int32), lengths)


def test_token_by_token_decode_matches_one_prefill(model, forward):
    tokens = _tokens(1, (2, PROMPT))
    ref_logits, ref_hiddens, _ = _prefill(forward, model, tokens, _i32(PROMPT, PROMPT))
    cache = model.init_cache(2, 32)
    for j in range(PROMPT):
        logits, hiddens, cache = forward(tokens[:, j:j + 1], cache, _i32(0, 1), _i32(j, j), _i32(1, 1))
        np.testing.assert_allclose(logits[:, 0], ref_logits[:, j], atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(hiddens[:, 0], ref_hiddens[:, j], atol=ATOL, rtol=1e-5)


def test_chunked_prefill_matches_one_prefill(model, forward):
    tokens = _tokens(2, (2, PROMPT))
    ref_logits, _, _ = _prefill(forward, model, tokens, _i32(PROMPT, PROMPT))
    cache = model.init_cache(2, 32)
    chunk = 5
    for start in range(0, PROMPT, chunk):
        n = min(chunk, PROMPT - start)
        piece = jnp.pad(tokens[:, start:start + n], ((0, 0), (0, chunk - n)))
        logits, _, cache = forward(piece, cache, _i32(0, 1), _i32(start, start), _i32(n, n))
        np.testing.assert_allclose(logits[:, :n], ref_logits[:, start:start + n], atol=ATOL, rtol=1e-5)


def test_verify_then_partial_commit_then_continue_matches_clean_run(model, forward):
    tokens = _tokens(3, (2, PROMPT))
    ref_logits, _, _ = _prefill(forward, model, tokens, _i32(PROMPT, PROMPT))
    cache = model.init_cache(2, 32)
    _, _, cache = forward(tokens[:, :5], cache, _i32(0, 1), _i32(0, 0), _i32(5, 5))
    # Verify [t5, t6, wrong, wrong, wrong]: rows 0-1 are the true continuation, the rest are
    # rejected drafts whose K/V rows (positions 7-9) stay behind in the cache.
    drafts = jnp.concatenate([tokens[:, 5:7], _tokens(4, (2, 3))], axis=1)
    logits, _, cache = forward(drafts, cache, _i32(0, 1), _i32(5, 5), _i32(5, 5))
    np.testing.assert_allclose(logits[:, :2], ref_logits[:, 5:7], atol=ATOL, rtol=1e-5)
    # Commit only 7 positions and continue: the stale rows must not matter.
    logits, _, cache = forward(tokens[:, 7:12], cache, _i32(0, 1), _i32(7, 7), _i32(5, 5))
    np.testing.assert_allclose(logits, ref_logits[:, 7:12], atol=ATOL, rtol=1e-5)


def test_padding_request_in_scratch_slot_leaves_other_requests_unchanged(model, forward):
    real = _tokens(5, (2, PROMPT))
    scratch = model.init_cache(2, 32).scratch_slot
    results = []
    for seed, pad_start, pad_len in ((6, 0, PROMPT), (7, 9, 3)):
        batch = jnp.stack([real[0], _tokens(seed, (PROMPT,)), real[1]])
        cache = model.init_cache(2, 32)
        logits, hiddens, cache = forward(
            batch, cache, _i32(0, scratch, 1), _i32(0, pad_start, 0), _i32(PROMPT, pad_len, PROMPT))
        rows = np.concatenate([np.asarray(cache.block_table[s]) for s in (0, 1)])
        page_rows = (rows[:, None] * cache.page_size + np.arange(cache.page_size)).reshape(-1)
        results.append((logits[jnp.array([0, 2])], hiddens[jnp.array([0, 2])], cache.k[:, page_rows]))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_batch_with_different_prompt_lengths_matches_each_request_alone(model, forward):
    tokens = _tokens(8, (2, PROMPT))
    lengths = (PROMPT, 7)
    batch_logits, batch_hiddens, _ = _prefill(forward, model, tokens, _i32(*lengths))
    for b, n in enumerate(lengths):
        alone = jnp.stack([tokens[b], _tokens(9, (PROMPT,))])
        logits, hiddens, _ = _prefill(forward, model, alone, _i32(n, 1))
        np.testing.assert_allclose(batch_logits[b, :n], logits[0, :n], atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(batch_hiddens[b, :n], hiddens[0, :n], atol=ATOL, rtol=1e-5)


def test_unwritten_cache_rows_are_never_read(model, forward):
    tokens = _tokens(10, (2, PROMPT))
    lengths = _i32(PROMPT, 7)
    ref_logits, _, _ = _prefill(forward, model, tokens, lengths)
    cache = model.init_cache(2, 32)
    cache = dataclasses.replace(cache, k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan))
    logits, _, _ = forward(tokens, cache, _i32(0, 1), _i32(0, 0), lengths)
    np.testing.assert_allclose(logits[0], ref_logits[0], atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(logits[1, :7], ref_logits[1, :7], atol=ATOL, rtol=1e-5)


def test_hiddens_are_residual_entering_captured_layers():
    config = dataclasses.replace(llama.TINY, capture_layers=(0, llama.TINY.num_layers))
    model = llama.tiny_llama(seed=11, config=config)
    tokens = _tokens(12, (1, 6))
    logits, hiddens, _ = model(tokens, model.init_cache(1, 8), slots=_i32(0), starts=_i32(0), lengths=_i32(6))
    np.testing.assert_allclose(hiddens[:, :, 0], model.embed(tokens), atol=1e-6)
    np.testing.assert_allclose(model.final_hidden_to_logits(hiddens[:, :, 1]), logits, atol=ATOL, rtol=1e-5)


def test_bfloat16_model_tracks_the_float32_model():
    f32 = llama.tiny_llama(seed=16)
    bf16 = llama.llama_from_params(dataclasses.replace(llama.TINY, dtype="bfloat16"), nnx_params(f32))
    tokens = _tokens(17, (1, 6))
    args = dict(slots=_i32(0), starts=_i32(0), lengths=_i32(6))
    ref, _, _ = f32(tokens, f32.init_cache(1, 8), **args)
    got, hiddens, cache = bf16(tokens, bf16.init_cache(1, 8), **args)
    assert got.dtype == jnp.float32 and hiddens.dtype == cache.k.dtype == jnp.bfloat16
    np.testing.assert_allclose(got, ref, atol=0.1 * float(jnp.abs(ref).max()))


def test_untied_head_uses_its_own_matrix():
    config = dataclasses.replace(llama.TINY, tie_embeddings=False)
    model = llama.tiny_llama(seed=13, config=config)
    h = jax.random.normal(jax.random.key(0), (3, config.hidden_size))
    np.testing.assert_allclose(model.unembed(h), h @ model.lm_head[...], atol=1e-5)
    assert not np.allclose(model.unembed(h), h @ model.embedding[...].T, atol=1e-2)


def test_llama_from_params_reproduces_the_source_model(model):
    state = nnx_params(model)
    copy = llama.llama_from_params(llama.TINY, state)
    tokens = _tokens(14, (1, 5))
    args = dict(slots=_i32(0), starts=_i32(0), lengths=_i32(5))
    a, _, _ = model(tokens, model.init_cache(1, 8), **args)
    b, _, _ = copy(tokens, copy.init_cache(1, 8), **args)
    np.testing.assert_array_equal(a, b)


def test_llama_from_params_rejects_a_missing_weight(model):
    state = nnx_params(model)
    del state["layers.wq"]
    with pytest.raises(ValueError, match="layers.wq"):
        llama.llama_from_params(llama.TINY, state)


def test_call_rejects_lengths_of_the_wrong_batch(model):
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="lengths"):
        model(_tokens(15, (2, 3)), cache, slots=_i32(0, 1), starts=_i32(0, 0), lengths=_i32(3))


def test_config_rejects_kv_heads_that_do_not_divide_heads():
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(llama.TINY, num_kv_heads=3)


def nnx_params(model) -> dict[str, np.ndarray]:
    names = {"embedding": model.embedding[...], "final_norm": model.final_norm[...]}
    names.update({f"layers.{n}": a for n, a in model.layers.arrays().items()})
    return {k: np.asarray(v) for k, v in names.items()}
