"""DSpark drafters: context bookkeeping of both backbones, non-causal blocks, V4 losslessness.

Every drafter call here has one shape per drafter kind (batch 2, chunks of `S` rows, one
state size), so each test module compiles one commit and one draft program per kind.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dspark.models.deepseek_v4 import DeepseekV4, tiny
from jax_dspark.models.dspark import tiny_dspark
from jax_dspark.models.dspark_v4 import DSparkV4Config, tiny_dspark_v4
from jax_dspark.models.llama import tiny_llama
from jax_dspark.ops.sampling import SamplingParams
from jax_dspark.spec.engine import generate
from jax_dspark.spec.schedule import SpsTable
from jax_dspark.spec.state import Scheduler

GREEDY = SamplingParams()
B, S, MAX_LEN = 2, 13, 40   # batch, rows per commit call, positions per slot


@pytest.fixture(scope="module")
def v4_target():
    return DeepseekV4(tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def v4_drafter(v4_target):
    return tiny_dspark_v4(v4_target.config)


@pytest.fixture(scope="module")
def llama_target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def llama_drafter(llama_target):
    return tiny_dspark(llama_target.config)


def _hiddens(seed: int, width: int, target_config) -> jax.Array:
    c = len(target_config.capture_layers)
    return jax.random.normal(jax.random.key(seed), (B, width, c, target_config.hidden_size), jnp.float32)


def _i32(x):
    return jnp.asarray(x, jnp.int32)


@functools.partial(jax.jit, static_argnames=("d_graph", "t_graph"))
def _jit_commit(d_graph, d_params, t_graph, t_params, state, hiddens, slots, starts, counts):
    drafter, target = nnx.merge(d_graph, d_params), nnx.merge(t_graph, t_params)
    tokens = jnp.zeros(hiddens.shape[:2], jnp.int32)
    return drafter.commit(target, state, tokens=tokens, hiddens=hiddens, slots=slots, starts=starts, counts=counts)


@functools.partial(jax.jit, static_argnames=("d_graph", "t_graph"))
def _jit_draft(d_graph, d_params, t_graph, t_params, state, anchor, slots, lengths):
    drafter, target = nnx.merge(d_graph, d_params), nnx.merge(t_graph, t_params)
    p = drafter.draft(target, state, jax.random.key(0), anchor=anchor, slots=slots, lengths=lengths, sampling=GREEDY)
    return p.logits, p.confidence_logits


def _commit(drafter, target, state, hiddens, *, slots, starts, counts):
    """`drafter.commit` of `hiddens [B, S, C, d]` (jitted once per drafter kind)."""
    assert hiddens.shape[:2] == (B, S)
    return _jit_commit(*nnx.split(drafter), *nnx.split(target), state, hiddens, _i32(slots), _i32(starts),
                       _i32(counts))


def _draft(drafter, target, state, *, lengths, anchor=(7, 11), slots=(0, 1)):
    """Corrected draft logits `[B, g, V]` and confidence logits `[B, g]` of `drafter.draft`."""
    logits, conf = _jit_draft(*nnx.split(drafter), *nnx.split(target), state, _i32(anchor), _i32(slots),
                              _i32(lengths))
    return np.asarray(logits), np.asarray(conf)


def _with_embedding_row(target, row: int, seed: int):
    """A copy of `target` whose embedding of token `row` is replaced by random values."""
    graph, params = nnx.split(target)
    new = nnx.merge(graph, jax.tree.map(lambda x: x, params))
    var = new.embedding if hasattr(new, "embedding") else new.embed_tokens
    table = var[...]
    var.set_value(table.at[row].set(jax.random.normal(jax.random.key(seed), table.shape[1:], table.dtype)))
    return new


def _assert_non_causal(drafter, target, state, lengths):
    """Only the noise slots (1..g-1) see a different input; slot 0's logits must still move."""
    other = _with_embedding_row(target, drafter.config.noise_token_id, seed=9)
    a = _draft(drafter, target, state, lengths=lengths)[0]
    b = _draft(drafter, other, state, lengths=lengths)[0]
    assert np.abs(a[:, 0] - b[:, 0]).max() > 1e-4


# -- V4-embedded drafter ------------------------------------------------------------------------


def test_v4_ring_sees_only_the_last_window_of_committed_positions(v4_target, v4_drafter):
    w = v4_drafter.config.window
    assert S > w
    h = _hiddens(1, S, v4_target.config)
    full = _commit(v4_drafter, v4_target, v4_drafter.init_state(B, MAX_LEN), h, slots=[0, 1], starts=[0, 0],
                   counts=[S, S])
    # Same context, but only the last W positions ever committed (the rest never seen).
    tail_h = jnp.roll(h, -(S - w), axis=1)
    tail = _commit(v4_drafter, v4_target, v4_drafter.init_state(B, MAX_LEN), tail_h, slots=[0, 1],
                   starts=[S - w] * 2, counts=[w, w])
    a = _draft(v4_drafter, v4_target, full, lengths=[S, S])
    b = _draft(v4_drafter, v4_target, tail, lengths=[S, S])
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-5)


def test_v4_back_fill_in_pieces_equals_one_commit(v4_target, v4_drafter):
    h = _hiddens(2, 2 * S, v4_target.config)
    once = _commit(v4_drafter, v4_target, v4_drafter.init_state(B, MAX_LEN), h[:, :S], slots=[0, 1],
                   starts=[0, 0], counts=[11, 9])
    # A prefill of 5 rows, then a verify block of which 6 / 4 rows are committed.
    step = _commit(v4_drafter, v4_target, v4_drafter.init_state(B, MAX_LEN), h[:, :S], slots=[0, 1],
                   starts=[0, 0], counts=[5, 5])
    step = _commit(v4_drafter, v4_target, step, h[:, 5:5 + S], slots=[0, 1], starts=[5, 5], counts=[6, 4])
    for r1, r2 in zip(once.rings, step.rings):
        np.testing.assert_allclose(np.asarray(r1.rows), np.asarray(r2.rows), rtol=1e-6, atol=1e-6)


def test_v4_ring_never_stores_rows_past_the_committed_count_or_for_the_scratch_slot(v4_target, v4_drafter):
    state = v4_drafter.init_state(B, MAX_LEN)
    poisoned = dataclasses.replace(
        state, rings=tuple(dataclasses.replace(r, rows=jnp.full_like(r.rows, jnp.nan)) for r in state.rings))
    # Request 0 commits 2 rows into slot 0; request 1 is padding on the scratch slot (B).
    out = _commit(v4_drafter, v4_target, poisoned, _hiddens(3, S, v4_target.config), slots=[0, B],
                  starts=[3, 3], counts=[2, 6])
    w = v4_drafter.config.window
    for ring in out.rings:
        rows = np.asarray(ring.rows)
        written = np.flatnonzero(~np.isnan(rows).all(axis=1))
        assert written[written < B * w].tolist() == [3, 4], "slot 0 holds positions 3 and 4 only"


def test_v4_block_is_non_causal(v4_target, v4_drafter):
    state = _commit(v4_drafter, v4_target, v4_drafter.init_state(B, MAX_LEN), _hiddens(4, S, v4_target.config),
                    slots=[0, 1], starts=[0, 0], counts=[4, 6])
    _assert_non_causal(v4_drafter, v4_target, state, lengths=[4, 6])


def test_v4_drafter_config_rejects_fp8_kv_when_nope_dims_do_not_split_into_64(v4_target):
    with pytest.raises(ValueError, match="kv_fp8"):
        DSparkV4Config(v4_target.config, noise_token_id=1, kv_fp8=True)


PROMPTS = [[5, 17, 100], list(range(40, 51)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 99, 98, 97, 96, 95, 94, 93, 1, 2, 3]]
BUDGETED = Scheduler(table=SpsTable.create([1.0, 4.0, 8.0, 16.0], [1.0, 0.9, 0.5, 0.2]), kind="budgeted", min_len=1)


@pytest.mark.parametrize("scheduler, seeds", [(None, (0, 5)), (BUDGETED, (2,))], ids=["verify_all", "budgeted_schedule"])
def test_v4_greedy_speculative_output_equals_greedy_plain_decoding(scheduler, seeds, greedy_errors):
    for seed in seeds:
        target = DeepseekV4(tiny(), rngs=nnx.Rngs(seed))
        spec = generate(target, tiny_dspark_v4(target.config, seed=seed + 1), PROMPTS, max_new_tokens=9,
                        seed=seed, scheduler=scheduler)
        assert greedy_errors(target, PROMPTS, spec.tokens) == [], f"seed {seed}"
        if scheduler is not None:
            assert spec.stats.verify_rate < 1.0, "the steep table should trim some blocks"


# -- standalone drafter --------------------------------------------------------------------------


def test_standalone_back_fill_in_pieces_equals_one_commit(llama_target, llama_drafter):
    h = _hiddens(5, 2 * S, llama_target.config)
    once = _commit(llama_drafter, llama_target, llama_drafter.init_state(B, MAX_LEN), h[:, :S], slots=[0, 1],
                   starts=[0, 0], counts=[9, 7])
    step = _commit(llama_drafter, llama_target, llama_drafter.init_state(B, MAX_LEN), h[:, :S], slots=[0, 1],
                   starts=[0, 0], counts=[4, 4])
    step = _commit(llama_drafter, llama_target, step, h[:, 4:4 + S], slots=[0, 1], starts=[4, 4], counts=[5, 3])
    np.testing.assert_allclose(np.asarray(once.k), np.asarray(step.k), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(once.v), np.asarray(step.v), rtol=1e-6, atol=1e-6)


def test_standalone_draft_reads_no_context_row_past_the_committed_length(llama_target, llama_drafter):
    state = _commit(llama_drafter, llama_target, llama_drafter.init_state(B, MAX_LEN),
                    _hiddens(6, S, llama_target.config), slots=[0, 1], starts=[0, 0], counts=[5, 8])
    past = jnp.arange(MAX_LEN)[None, :] >= jnp.asarray([5, 8, 0])[:, None]       # [slots + 1, T]
    poison = past[None, :, :, None, None]
    poisoned = dataclasses.replace(state, k=jnp.where(poison, jnp.nan, state.k), v=jnp.where(poison, jnp.nan, state.v))
    clean = _draft(llama_drafter, llama_target, state, lengths=[5, 8])
    dirty = _draft(llama_drafter, llama_target, poisoned, lengths=[5, 8])
    np.testing.assert_array_equal(clean[0], dirty[0])
    np.testing.assert_array_equal(clean[1], dirty[1])


def test_standalone_block_is_non_causal(llama_target, llama_drafter):
    state = _commit(llama_drafter, llama_target, llama_drafter.init_state(B, MAX_LEN),
                    _hiddens(7, S, llama_target.config), slots=[0, 1], starts=[0, 0], counts=[4, 6])
    _assert_non_causal(llama_drafter, llama_target, state, lengths=[4, 6])


def test_standalone_drafter_with_embedding_markov_head_is_lossless(llama_target, greedy_errors):
    drafter = tiny_dspark(llama_target.config, seed=4, markov_rank=8, markov_factors="embedding")
    spec = generate(llama_target, drafter, PROMPTS, max_new_tokens=9, seed=0)
    assert greedy_errors(llama_target, PROMPTS, spec.tokens) == []
    assert spec.stats.verify_rate == 1.0 and len(spec.stats.per_position_acceptance) == drafter.block_size


def _assert_same_drafts(a, b, target, *, seed, counts, tol, state_of_b=False):
    """Drafters `a` and `b` give the same draft and confidence logits on one committed
    context of `counts` positions per slot (the state is built with `a`, and separately
    with `b` when `state_of_b`: drafters of different depth keep different states)."""
    def committed(drafter):
        return _commit(drafter, target, drafter.init_state(B, MAX_LEN), _hiddens(seed, S, target.config),
                       slots=[0, 1], starts=[0, 0], counts=counts)

    state = committed(a)
    a_logits, a_conf = _draft(a, target, state, lengths=counts)
    b_logits, b_conf = _draft(b, target, committed(b) if state_of_b else state, lengths=counts)
    np.testing.assert_allclose(b_logits, a_logits, rtol=tol, atol=tol)
    np.testing.assert_allclose(b_conf, a_conf, rtol=tol, atol=tol)


def test_embedding_markov_drafter_drafts_the_same_with_materialised_tables(llama_target):
    tied = tiny_dspark(llama_target.config, seed=6, markov_rank=8, markov_factors="embedding")
    tables = tied.with_markov_tables(llama_target)
    assert tables.config.markov_factors == "table" and tables.markov.w1.shape == (llama_target.config.vocab_size, 8)
    _assert_same_drafts(tied, tables, llama_target, seed=8, counts=[6, 9], tol=1e-4)
    assert tiny_dspark(llama_target.config, markov_rank=4).with_markov_tables(llama_target).config.markov_factors == "table"


@pytest.mark.parametrize("factors, rank", [("embedding", 8), ("table", 8), ("embedding", 0)])
def test_markov_rank_growth_keeps_what_the_drafter_proposes(llama_target, factors, rank):
    small = tiny_dspark(llama_target.config, seed=7, markov_rank=rank, markov_factors=factors)
    grown = small.grown(markov_rank=rank + 5, rngs=nnx.Rngs(3))
    first, second = ("p1", "p2") if factors == "embedding" else ("w1", "w2")
    assert grown.config.markov_rank == rank + 5 and small.config.markov_rank == rank
    assert np.any(np.asarray(getattr(grown.markov, first)[...])[:, rank:])          # new columns can learn
    assert not np.any(np.asarray(getattr(grown.markov, second)[...])[:, rank:])     # ... from a zero bias
    _assert_same_drafts(small, grown, llama_target, seed=9, counts=[5, 8], tol=1e-5)


def test_layer_growth_appends_blocks_that_add_nothing_yet(llama_target):
    small = tiny_dspark(llama_target.config, seed=8, num_layers=2, markov_rank=4, markov_factors="embedding")
    grown = small.grown(num_layers=3, markov_rank=6, rngs=nnx.Rngs(4))
    assert grown.config.num_layers == 3 and grown.layers.wq.shape[0] == 3
    np.testing.assert_array_equal(np.asarray(grown.layers.wq[...])[:2], np.asarray(small.layers.wq[...]))
    assert np.any(np.asarray(grown.layers.wq[...])[2]) and not np.any(np.asarray(grown.layers.wo[...])[2])
    # a 3-layer state holds one more layer of context K/V: commit with the grown drafter itself
    _assert_same_drafts(grown, small, llama_target, seed=10, counts=[4, 7], tol=1e-5, state_of_b=True)


@pytest.mark.parametrize("kwargs, match", [(dict(markov_rank=2), "markov_rank"), (dict(num_layers=1), "num_layers"),
                                           (dict(markov_rank=4), "nothing to grow"),
                                           (dict(num_layers=2.5), "num_layers")])
def test_growth_rejects_a_smaller_or_unchanged_or_non_int_size(llama_target, kwargs, match):
    drafter = tiny_dspark(llama_target.config, seed=7, num_layers=2, markov_rank=4)
    with pytest.raises(ValueError, match=match):
        drafter.grown(rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("factors", ["embedding", "table"])
def test_gate_growth_keeps_what_the_drafter_proposes_until_the_gate_moves(llama_target, factors):
    vanilla = tiny_dspark(llama_target.config, seed=11, markov_rank=6, markov_factors=factors)
    gated = vanilla.grown(markov_gate=True, rngs=nnx.Rngs(5))
    assert gated.config.markov_gate and not vanilla.config.markov_gate and vanilla.markov_gate is None
    _assert_same_drafts(vanilla, gated, llama_target, seed=12, counts=[5, 8], tol=1e-5)
    state = _commit(gated, llama_target, gated.init_state(B, MAX_LEN), _hiddens(12, S, llama_target.config),
                    slots=[0, 1], starts=[0, 0], counts=[5, 8])
    before, _ = _draft(gated, llama_target, state, lengths=[5, 8])
    gated.markov_gate.w[...] = jax.random.normal(jax.random.key(13), gated.markov_gate.w.shape)
    after, _ = _draft(gated, llama_target, state, lengths=[5, 8])
    assert np.abs(after - before).max() > 1e-3


@pytest.mark.parametrize("factors", ["embedding", "table"])
def test_rank_growth_of_a_gated_drafter_keeps_what_it_proposes(llama_target, factors):
    gated = tiny_dspark(llama_target.config, seed=17, markov_rank=4, markov_factors=factors, markov_gate=True)
    gated.markov_gate.w[...] = jax.random.normal(jax.random.key(18), gated.markov_gate.w.shape)
    gated.markov_gate.b[...] = jax.random.normal(jax.random.key(19), gated.markov_gate.b.shape)
    grown = gated.grown(markov_rank=7, rngs=nnx.Rngs(6))
    assert grown.markov_gate.w.shape == (llama_target.config.hidden_size + 7, 7)
    _assert_same_drafts(gated, grown, llama_target, seed=20, counts=[5, 8], tol=1e-5)


def test_gated_drafter_is_lossless_and_drafts_the_same_with_materialised_tables(llama_target, greedy_errors):
    drafter = tiny_dspark(llama_target.config, seed=14, markov_rank=8, markov_factors="embedding", markov_gate=True)
    drafter.markov_gate.w[...] = jax.random.normal(jax.random.key(15), drafter.markov_gate.w.shape)
    tables = drafter.with_markov_tables(llama_target)
    assert tables.config.markov_gate and tables.config.markov_factors == "table"
    _assert_same_drafts(drafter, tables, llama_target, seed=16, counts=[6, 9], tol=1e-4)
    spec = generate(llama_target, tables, PROMPTS, max_new_tokens=9, seed=0)
    assert greedy_errors(llama_target, PROMPTS, spec.tokens) == []


@pytest.mark.parametrize("kwargs, match", [(dict(markov_gate="yes"), "markov_gate"),
                                           (dict(markov_gate=True, markov_rank=0), "markov_gate")])
def test_gated_config_needs_a_bool_and_a_markov_head(llama_target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_dspark(llama_target.config, **kwargs)


def test_gate_growth_rejects_removing_a_gate_or_a_rank_zero_drafter(llama_target):
    gated = tiny_dspark(llama_target.config, seed=7, markov_rank=4, markov_gate=True)
    with pytest.raises(ValueError, match="markov_gate"):
        gated.grown(rngs=nnx.Rngs(0), markov_gate=False)
    with pytest.raises(ValueError, match="markov_gate"):
        tiny_dspark(llama_target.config, seed=7, markov_rank=0).grown(rngs=nnx.Rngs(0), markov_gate=True)
