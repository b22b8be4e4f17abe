"""rms_norm and interleaved RoPE: definitions, f32 math, round trips and contracts."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import ops


def test_rms_norm_matches_definition_with_and_without_weight():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    expect = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(ops.rms_norm(x), expect, rtol=1e-5)
    np.testing.assert_allclose(ops.rms_norm(x, w), expect * w, rtol=1e-5)


def test_rms_norm_of_bf16_is_computed_in_f32_and_returned_as_bf16():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64)) * 300, jnp.bfloat16)
    y = ops.rms_norm(x)
    assert y.dtype == jnp.bfloat16
    ref = ops.rms_norm(x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2)


def test_rms_norm_rejects_wrong_weight_shape():
    with pytest.raises(ValueError, match=r"weight: shape must be \(8,\)"):
        ops.rms_norm(jnp.ones((2, 8)), jnp.ones(7))


def test_rope_table_holds_cos_sin_of_position_times_frequency():
    table = np.asarray(ops.rope_table(10, 8, theta=100.0))
    freqs = 100.0 ** (-np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(table[7, :, 0], np.cos(7 * freqs), rtol=1e-6)
    np.testing.assert_allclose(table[7, :, 1], np.sin(7 * freqs), rtol=1e-6)


def test_rope_rotates_adjacent_pairs_of_the_last_dims_only():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 12)).astype(np.float32)
    table = ops.rope_table(32, 4, theta=10000.0)
    pos = np.array([3, 17])
    y = np.asarray(ops.apply_rope(x, table[pos]))
    np.testing.assert_array_equal(y[:, :8], x[:, :8])
    for b in range(2):
        for i in range(2):
            c, s = np.asarray(table)[pos[b], i]
            a, bb = x[b, 8 + 2 * i], x[b, 9 + 2 * i]
            np.testing.assert_allclose(y[b, 8 + 2 * i : 10 + 2 * i], [a * c - bb * s, a * s + bb * c], rtol=1e-5)


def test_inverse_rope_undoes_rope():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 512)).astype(np.float32)
    table = ops.rope_table(4096, 64, theta=10000.0)
    freqs = table[rng.integers(0, 4096, size=(4, 3))]
    back = ops.apply_rope(ops.apply_rope(x, freqs), freqs, inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-5)


def test_yarn_keeps_high_frequencies_and_divides_low_ones_by_factor():
    plain = np.asarray(ops.rope_table(2, 64, theta=160000.0))[1]
    yarn = np.asarray(ops.rope_table(2, 64, theta=160000.0, yarn=ops.YarnScaling(factor=16, original_max_positions=65536)))[1]
    w_plain, w_yarn = np.arctan2(plain[:, 1], plain[:, 0]), np.arctan2(yarn[:, 1], yarn[:, 0])
    np.testing.assert_allclose(w_yarn[0], w_plain[0], rtol=1e-6)
    np.testing.assert_allclose(w_yarn[-1], w_plain[-1] / 16, rtol=1e-4)


def test_apply_rope_rejects_freqs_wider_than_x():
    with pytest.raises(ValueError, match=r"freqs: rope_dim 16 exceeds"):
        ops.apply_rope(jnp.ones((2, 8)), jnp.ones((2, 8, 2)))


def test_rms_norm_rope_is_the_composition_and_can_emit_fp8():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(128), jnp.float32)
    freqs = ops.rope_table(64, 32, theta=1e4)[rng.integers(0, 64, (2, 3))][:, :, None]
    y = ops.rms_norm_rope(x, w, freqs, eps=1e-6)
    np.testing.assert_allclose(y, ops.apply_rope(ops.rms_norm(x, w), freqs), rtol=1e-6, atol=1e-6)
    values, exps = ops.rms_norm_rope(x, w, freqs, inverse=True, fp8_block=64)
    ref_v, ref_e = ops.quantize_fp8(ops.apply_rope(ops.rms_norm(x, w), freqs, inverse=True), 64)
    np.testing.assert_array_equal(exps, ref_e)
    np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(ref_v, np.float32))
    with pytest.raises(ValueError, match="freqs"):
        ops.rms_norm_rope(x, w, freqs[:, :2])
