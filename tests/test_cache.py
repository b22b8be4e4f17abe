"""Paged row pools: addressing, masking, rings, scratch slot (jax_dspark/cache.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import cache as kvcache


def _pool(ring: bool, capacity: int = 8, num_slots: int = 2, width: int = 3):
    return kvcache.new_pool(num_slots, capacity, width, page_size=4, dtype=jnp.float32,
                            ring=ring)


def test_ring_pool_reuses_rows_modulo_capacity():
    pool = _pool(ring=True)
    slots = jnp.array([1], jnp.int32)
    a = kvcache.row_index(pool, slots, jnp.array([[3]]))
    b = kvcache.row_index(pool, slots, jnp.array([[3 + pool.capacity]]))
    assert int(a[0, 0]) == int(b[0, 0]) >= 0


def test_linear_pool_has_no_row_past_capacity():
    pool = _pool(ring=False)
    idx = kvcache.row_index(pool, jnp.array([0], jnp.int32),
                            jnp.array([[pool.capacity - 1, pool.capacity]]))
    assert int(idx[0, 0]) >= 0 and int(idx[0, 1]) == -1


def test_negative_positions_have_no_row():
    pool = _pool(ring=True)
    idx = kvcache.row_index(pool, jnp.array([0], jnp.int32), jnp.array([[-1, -5]]))
    np.testing.assert_array_equal(np.asarray(idx), [[-1, -1]])


def test_rows_of_different_slots_never_alias():
    pool = _pool(ring=True)
    pos = jnp.broadcast_to(jnp.arange(pool.capacity), (3, pool.capacity))
    idx = np.asarray(kvcache.row_index(pool, jnp.array([0, 1, 2], jnp.int32), pos))
    assert len(set(idx.ravel().tolist())) == idx.size


def test_written_rows_read_back_and_masked_rows_are_not_written():
    rng = np.random.default_rng(0)
    pool = _pool(ring=False)
    before = jnp.asarray(rng.standard_normal(pool.rows.shape), jnp.float32)
    pool = kvcache.RowPool(rows=before, block_table=pool.block_table, page_size=4, ring=False)
    slots = jnp.array([0, 1], jnp.int32)
    pos = jnp.array([[2, 5], [0, 7]], jnp.int32)
    vals = jnp.asarray(rng.standard_normal((2, 2, 3)), jnp.float32)
    mask = jnp.array([[True, False], [True, True]])
    out = kvcache.write_rows(pool, slots, pos, vals, mask)
    idx = kvcache.row_index(out, slots, pos)
    got = np.asarray(kvcache.read_rows(out, idx))
    np.testing.assert_array_equal(got[0, 0], np.asarray(vals[0, 0]))
    np.testing.assert_array_equal(got[1], np.asarray(vals[1]))
    np.testing.assert_array_equal(got[0, 1], np.asarray(before)[int(idx[0, 1])])
    changed = np.nonzero((np.asarray(out.rows) != np.asarray(before)).any(-1))[0]
    assert sorted(changed.tolist()) == sorted(np.asarray(idx)[np.asarray(mask)].tolist())


def test_write_past_linear_capacity_is_dropped():
    pool = _pool(ring=False)
    vals = jnp.full((1, 1, 3), 7.0)
    out = kvcache.write_rows(pool, jnp.array([0], jnp.int32),
                             jnp.array([[pool.capacity]], jnp.int32), vals)
    np.testing.assert_array_equal(np.asarray(out.rows), np.asarray(pool.rows))


def test_scratch_slot_is_the_last_slot():
    spec = kvcache.LayerCacheSpec(window=4, ratio=2, overlap=True, head_dim=8,
                                  index_head_dim=4)
    cache = kvcache.init_deepseek_v4_cache([spec], num_slots=3, max_len=16,
                                           max_tokens_per_call=4, page_size=4,
                                           dtype=jnp.float32)
    assert cache.scratch_slot == cache.num_slots == 3
    assert cache.layers[0].window.block_table.shape[0] == 4


def test_ring_capacity_covers_window_plus_one_call():
    spec = kvcache.LayerCacheSpec(window=8, ratio=4, overlap=True, head_dim=8)
    lc = kvcache.init_layer_cache(spec, 1, 64, max_tokens_per_call=5, page_size=4,
                                  dtype=jnp.float32)
    assert lc.window.capacity >= 8 + 5 - 1
    assert lc.state.capacity >= spec.span + 5 - 1
    assert lc.entries.capacity >= 64 // 4


def test_window_positions_end_at_the_query():
    got = np.asarray(kvcache.window_positions(jnp.array([[1, 6]]), 4))
    np.testing.assert_array_equal(got, [[[-2, -1, 0, 1], [3, 4, 5, 6]]])


def test_commit_sets_the_committed_length():
    spec = kvcache.LayerCacheSpec(window=4, ratio=0, overlap=False, head_dim=8)
    cache = kvcache.init_deepseek_v4_cache([spec], num_slots=2, max_len=16,
                                           max_tokens_per_call=4, page_size=4)
    cache = kvcache.commit(cache, jnp.array([1], jnp.int32), jnp.array([9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 9, 0])


def test_bad_pool_size_names_the_argument():
    with pytest.raises(ValueError, match="capacity=0"):
        kvcache.new_pool(1, 0, 4, page_size=4, dtype=jnp.float32, ring=True)
