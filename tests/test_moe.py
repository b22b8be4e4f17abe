"""MoE routing and routed experts pinned to definitions and a per-token loop."""

import jax
import numpy as np
import pytest

from jax_dspark import ops


def test_router_scores_kinds():
    l = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(ops.router_scores(l), np.sqrt(np.log1p(np.exp(l))), rtol=1e-6)
    np.testing.assert_allclose(ops.router_scores(l, "sigmoid"), 1 / (1 + np.exp(-l)), rtol=1e-6)
    np.testing.assert_allclose(ops.router_scores(l, "softmax").sum(-1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        ops.router_scores(l, "relu")


def test_bias_steers_selection_but_not_weights():
    scores = np.array([[0.9, 0.8, 0.1, 0.05]], np.float32)
    bias = np.array([0.0, 0.0, 1.0, 0.0], np.float32)
    w, ids = ops.topk_route(scores, 2, bias=bias, route_scale=1.5)
    assert ids.tolist() == [[2, 0]]
    np.testing.assert_allclose(w, [[0.1 / 1.0 * 1.5, 0.9 / 1.0 * 1.5]], rtol=1e-6)


def test_topk_weights_are_renormalised_unbiased_scores_times_scale():
    rng = np.random.default_rng(1)
    scores = ops.router_scores(rng.standard_normal((16, 32)).astype(np.float32))
    bias = rng.standard_normal(32).astype(np.float32) * 0.1
    w, ids = ops.topk_route(scores, 6, bias=bias, route_scale=2.5)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 2.5, rtol=1e-5)
    expect = np.argsort(-(np.asarray(scores) + bias), axis=-1, kind="stable")[:, :6]
    np.testing.assert_array_equal(ids, expect)
    picked = np.take_along_axis(np.asarray(scores), expect, -1)
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True) * 2.5, rtol=1e-5)


def test_hash_route_reads_experts_from_the_token_table():
    rng = np.random.default_rng(2)
    scores = ops.router_scores(rng.standard_normal((5, 16)).astype(np.float32))
    table = np.stack([rng.permutation(16)[:3] for _ in range(50)]).astype(np.int32)
    tokens = np.array([4, 4, 17, 0, 49], np.int32)
    w, ids = ops.hash_route(scores, tokens, table, route_scale=1.5)
    np.testing.assert_array_equal(ids, table[tokens])
    picked = np.take_along_axis(np.asarray(scores), table[tokens], -1)
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True) * 1.5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"token_ids: must be in \[0, V=50\)"):
        ops.hash_route(scores, np.array([0, 1, 2, 3, 50], np.int32), table)


def test_swiglu_clamps_gate_from_above_and_up_both_ways():
    gate = np.array([-20.0, 5.0, 20.0], np.float32)
    up = np.array([-20.0, 3.0, 20.0], np.float32)
    y = np.asarray(ops.swiglu(gate, up, limit=10.0))
    silu = lambda v: v / (1 + np.exp(-v))
    np.testing.assert_allclose(y, [silu(-20.0) * -10.0, silu(5.0) * 3.0, silu(10.0) * 10.0], rtol=1e-6)
    np.testing.assert_allclose(ops.swiglu(gate, up), silu(gate) * up, rtol=1e-6)


def loop_moe(x, ids, weights, w_gate_up, w_down, limit):
    x = np.asarray(x, np.float64)
    i = w_down.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = x[t] @ w_gate_up[e]
            g, u = h[:i], h[i:]
            if limit is not None:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ w_down[e])
    return out


@pytest.mark.parametrize("limit", [None, 0.5])
def test_routed_experts_equal_per_token_loop(limit):
    rng = np.random.default_rng(3)
    t, d, e, i, k = 13, 16, 8, 12, 3
    x = rng.standard_normal((t, d)).astype(np.float32)
    w1 = (rng.standard_normal((e, d, 2 * i)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((e, i, d)) / 4).astype(np.float32)
    w, ids = ops.topk_route(ops.router_scores(rng.standard_normal((t, e)).astype(np.float32)), k)
    out = ops.moe_experts(x, ids, w, w1, w2, limit=limit)
    ref = loop_moe(x, np.asarray(ids), np.asarray(w), w1, w2, limit)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_routed_experts_handle_empty_experts_and_jit():
    rng = np.random.default_rng(4)
    t, d, e, i = 6, 8, 16, 4
    x = rng.standard_normal((t, d)).astype(np.float32)
    w1 = rng.standard_normal((e, d, 2 * i)).astype(np.float32)
    w2 = rng.standard_normal((e, i, d)).astype(np.float32)
    ids = np.array([[3, 7]] * t, np.int32)  # 14 of 16 experts get no rows
    weights = rng.uniform(size=(t, 2)).astype(np.float32)
    out = jax.jit(ops.moe_experts)(x, ids, weights, w1, w2)
    ref = loop_moe(x, ids, weights, w1, w2, None)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_routed_experts_of_zero_tokens_is_empty():
    e, d, i = 4, 8, 4
    out = ops.moe_experts(
        np.zeros((0, d), np.float32), np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32),
        np.ones((e, d, 2 * i), np.float32), np.ones((e, i, d), np.float32),
    )
    assert out.shape == (0, d)


def test_duplicate_expert_in_a_token_is_rejected():
    e, d, i = 4, 8, 4
    ids = np.array([[0, 1], [2, 2]], np.int32)
    with pytest.raises(ValueError, match=r"ids: token 1 lists an expert twice"):
        ops.moe_experts(np.ones((2, d), np.float32), ids, np.ones((2, 2), np.float32),
                        np.ones((e, d, 2 * i), np.float32), np.ones((e, i, d), np.float32))


def test_out_of_range_expert_is_rejected():
    e, d, i = 4, 8, 4
    with pytest.raises(ValueError, match=r"ids: expert ids must be in \[0, E=4\)"):
        ops.moe_experts(np.ones((1, d), np.float32), np.array([[0, 4]], np.int32), np.ones((1, 2), np.float32),
                        np.ones((e, d, 2 * i), np.float32), np.ones((e, i, d), np.float32))


def test_shared_expert_mlp_matches_definition():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w1 = rng.standard_normal((8, 10)).astype(np.float32)
    w2 = rng.standard_normal((5, 8)).astype(np.float32)
    h = x @ w1
    g, u = np.minimum(h[:, :5], 2.0), np.clip(h[:, 5:], -2.0, 2.0)
    np.testing.assert_allclose(ops.mlp_swiglu(x, w1, w2, limit=2.0), (g / (1 + np.exp(-g)) * u) @ w2, rtol=1e-5)
