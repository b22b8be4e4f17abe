"""sparse_sink_attention and merge_partials pinned to a loop reference and their algebra."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import ops


def loop_reference(q, main_rows, main_idx, extra_rows=None, extra_idx=None, sink=None, scale=1.0):
    """One query row and head at a time, in float64 numpy."""
    q = np.asarray(q, np.float64)
    b_, s_, h_, d_ = q.shape
    out = np.zeros_like(q)
    lse = np.full((b_, s_, h_), -np.inf)
    for b in range(b_):
        for s in range(s_):
            rows = [np.asarray(main_rows, np.float64)[i] for i in np.asarray(main_idx)[b, s] if i >= 0]
            if extra_rows is not None:
                rows += [np.asarray(extra_rows, np.float64)[i] for i in np.asarray(extra_idx)[b, s] if i >= 0]
            for h in range(h_):
                if not rows:
                    continue
                kv = np.stack(rows)
                sc = kv @ q[b, s, h] * scale
                m = sc.max()
                denom = np.exp(sc - m).sum()
                lse[b, s, h] = m + np.log(denom)
                if sink is not None:
                    denom += np.exp(float(sink[h]) - m)
                out[b, s, h] = np.exp(sc - m) @ kv / denom
    return out, lse


def random_case(seed, b=2, s=3, h=4, d=32, n=20, k=7, n2=9, k2=5, drop=0.3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    rows = rng.standard_normal((n, d)).astype(np.float32)
    rows2 = rng.standard_normal((n2, d)).astype(np.float32)
    idx = np.stack([rng.permutation(n)[:k] for _ in range(b * s)]).reshape(b, s, k).astype(np.int32)
    idx[rng.random(idx.shape) < drop] = -1
    idx2 = np.stack([rng.permutation(n2)[:k2] for _ in range(b * s)]).reshape(b, s, k2).astype(np.int32)
    sink = rng.standard_normal(h).astype(np.float32)
    return q, rows, idx, rows2, idx2, sink


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def test_matches_loop_reference_with_two_pools_and_sink():
    q, rows, idx, rows2, idx2, sink = random_case(0)
    out, lse = ops.sparse_sink_attention(
        q, rows, idx, extra_rows=rows2, extra_idx=idx2, sink=sink, scale=0.2, return_lse=True
    )
    ref, ref_lse = loop_reference(q, rows, idx, rows2, idx2, sink, 0.2)
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_minus_inf_sink_equals_plain_softmax_attention():
    q, rows, idx, *_ = random_case(1, drop=0.0)
    sink = np.full(q.shape[2], -np.inf, np.float32)
    with_sink = ops.sparse_sink_attention(q, rows, idx, sink=sink, scale=0.3)
    gathered = rows[idx]  # [B, S, K, D]
    scores = np.einsum("bshd,bskd->bshk", q, gathered) * 0.3
    plain = np.einsum("bshk,bskd->bshd", jax.nn.softmax(scores, axis=-1), gathered)
    assert rel_err(with_sink, plain) < 1e-5
    assert rel_err(ops.sparse_sink_attention(q, rows, idx, scale=0.3), plain) < 1e-5


def test_finite_sink_strictly_reduces_mass():
    q, rows, idx, *_ = random_case(2, drop=0.0)
    ones = np.ones_like(rows)  # values all ones: output = attention mass on each dim
    sink = np.zeros(q.shape[2], np.float32)
    mass_without = ops.sparse_sink_attention(q, ones, idx, scale=0.3)[..., 0]
    mass_with = ops.sparse_sink_attention(q, ones, idx, sink=sink, scale=0.3)[..., 0]
    np.testing.assert_allclose(mass_without, 1.0, rtol=1e-5)
    assert np.all(np.asarray(mass_with) < 1.0) and np.all(np.asarray(mass_with) > 0.0)


def test_minus_one_index_equals_dropping_the_row():
    q, rows, idx, *_ = random_case(3, drop=0.0, k=6)
    masked = idx.copy()
    masked[:, :, 2] = -1
    dropped = np.delete(idx, 2, axis=2)
    a = ops.sparse_sink_attention(q, rows, masked, scale=0.25)
    b = ops.sparse_sink_attention(q, rows, dropped, scale=0.25)
    assert rel_err(a, b) < 1e-6


def test_empty_index_lists_give_zeros_not_nan():
    q, rows, idx, rows2, idx2, sink = random_case(4)
    idx[0, 1] = -1
    idx2[0, 1] = -1
    out, lse = ops.sparse_sink_attention(
        q, rows, idx, extra_rows=rows2, extra_idx=idx2, sink=sink, scale=0.2, return_lse=True
    )
    assert np.all(np.asarray(out[0, 1]) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse[0, 1])))
    assert np.all(np.isfinite(np.asarray(out)))
    zero_width = ops.sparse_sink_attention(q, rows, np.zeros((2, 3, 0), np.int32), scale=0.2)
    assert np.all(np.asarray(zero_width) == 0.0)


def test_inverse_rope_rotates_the_output_back_by_query_position():
    q, rows, idx, *_ = random_case(5)
    table = ops.rope_table(64, 8, theta=10000.0)
    pos = np.random.default_rng(5).integers(0, 64, size=q.shape[:2])
    freqs = table[pos]  # [B, S, 4, 2]
    plain = ops.sparse_sink_attention(q, rows, idx, scale=0.2)
    rotated = ops.sparse_sink_attention(q, rows, idx, scale=0.2, inverse_rope=freqs)
    expect = ops.apply_rope(plain, freqs[:, :, None], inverse=True)
    assert rel_err(rotated, expect) < 1e-6
    np.testing.assert_array_equal(np.asarray(rotated)[..., :-8], np.asarray(plain)[..., :-8])


def test_merge_of_split_partials_equals_unsplit_result():
    q, rows, idx, rows2, idx2, sink = random_case(6, k=8)
    full = ops.sparse_sink_attention(q, rows, idx, extra_rows=rows2, extra_idx=idx2, sink=sink, scale=0.2)
    parts = [
        ops.sparse_sink_attention(q, rows, idx[..., :3], scale=0.2, return_lse=True),
        ops.sparse_sink_attention(q, rows, idx[..., 3:], scale=0.2, return_lse=True),
        ops.sparse_sink_attention(q, rows2, idx2, scale=0.2, return_lse=True),
    ]
    merged, lse = ops.merge_partials([p[0] for p in parts], [p[1] for p in parts], sink)
    assert rel_err(merged, full) < 1e-5
    _, ref_lse = loop_reference(q, rows, idx, rows2, idx2, None, 0.2)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_with_an_empty_part_ignores_it():
    q, rows, idx, *_ = random_case(7, drop=0.0)
    full, full_lse = ops.sparse_sink_attention(q, rows, idx, scale=0.2, return_lse=True)
    empty = ops.sparse_sink_attention(q, rows, np.full_like(idx, -1), scale=0.2, return_lse=True)
    merged, _ = ops.merge_partials([full, empty[0]], [full_lse, empty[1]])
    assert rel_err(merged, full) < 1e-6


def test_bf16_inputs_return_bf16_close_to_f32():
    q, rows, idx, *_ = random_case(8)
    out = ops.sparse_sink_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(rows, jnp.bfloat16), idx, scale=0.2)
    assert out.dtype == jnp.bfloat16
    ref = ops.sparse_sink_attention(q, rows, idx, scale=0.2)
    assert rel_err(out, ref) < 2e-2


def test_out_of_range_index_is_rejected_naming_the_value():
    q, rows, idx, *_ = random_case(9)
    idx[1, 2, 0] = rows.shape[0]
    with pytest.raises(ValueError, match=r"main_idx.*\(1, 2, 0\).*20"):
        ops.sparse_sink_attention(q, rows, idx, scale=0.2)


def test_out_of_range_index_under_jit_is_masked_not_read():
    q, rows, idx, *_ = random_case(10, drop=0.0)
    bad = idx.copy()
    bad[:, :, 0] = 10_000
    masked = idx.copy()
    masked[:, :, 0] = -1
    jitted = jax.jit(lambda q, r, i: ops.sparse_sink_attention(q, r, i, scale=0.2))
    assert rel_err(jitted(q, rows, bad), jitted(q, rows, masked)) == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q=np.zeros((2, 3, 4)), scale=1.0), r"q: expected rank 4"),
        (dict(main_idx=np.zeros((2, 3, 7), np.int64), scale=1.0), r"main_idx: dtype"),
        (dict(sink=np.zeros(5, np.float32), scale=1.0), r"sink: shape must be \(H,\)"),
        (dict(scale=float("nan")), r"scale: must be a finite positive"),
        (dict(main_rows=np.zeros((20, 31), np.float32), scale=1.0), r"main_rows: last dim"),
        (dict(extra_rows=np.zeros((4, 32), np.float32), scale=1.0), r"extra_rows/extra_idx: give both"),
        (dict(inverse_rope=np.zeros((2, 3, 20, 2), np.float32), scale=1.0), r"inverse_rope"),
    ],
)
def test_contract_violations_raise_value_error(kwargs, message):
    q, rows, idx, *_ = random_case(11)
    args = dict(q=q, main_rows=rows, main_idx=idx)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ops.sparse_sink_attention(args.pop("q"), args.pop("main_rows"), args.pop("main_idx"), **args)
