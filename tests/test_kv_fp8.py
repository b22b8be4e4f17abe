"""FP8 KV rows (ops/kv_fp8.py) and sparse_sink_attention over FP8 pools, on the CPU reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import ops
from jax_dspark.ops import _kernels, kv_fp8
from jax_dspark.ops.fp8 import quantize_fp8

D = 512


def random_rows(seed, n=16):
    """Rows whose 64-wide blocks span very different magnitudes (each block gets its own scale)."""
    rng = np.random.default_rng(seed)
    mult = np.exp2(rng.integers(-12, 12, (n, D // 64))).repeat(64, axis=1)
    return jnp.asarray(rng.standard_normal((n, D)) * mult, jnp.float32)


def attention_case(seed, b=2, s=2, h=4, n=16, k=6, n2=9, k2=3):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, s, h, D)), jnp.bfloat16)
    main = jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16)
    extra = jnp.asarray(rng.standard_normal((n2, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, n, (b, s, k)), jnp.int32)
    idx2 = jnp.asarray(rng.integers(-1, n2, (b, s, k2)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((b, s, 32, 2)), jnp.float32)
    return q, main, idx, extra, idx2, sink, rope


def test_round_trip_error_is_within_half_an_e4m3_step_per_block():
    x = random_rows(0)
    rows = kv_fp8.quantize_kv_rows(x)
    back = np.asarray(kv_fp8.dequantize_kv_rows(rows, jnp.float32), np.float64)
    x64 = np.asarray(x, np.float64)
    scale = np.exp2(np.asarray(rows.scale[:, :7], np.float64) - 127).repeat(64, -1)
    # e4m3: 3 mantissa bits -> relative step 2^-3 (half: 2^-4); subnormal step 2^-9 (half: 2^-10).
    bound = 2.0**-4 * np.abs(x64[:, :448]) + 2.0**-10 * scale
    assert np.all(np.abs(back[:, :448] - x64[:, :448]) <= bound)
    np.testing.assert_array_equal(back[:, 448:], np.asarray(x[:, 448:].astype(jnp.bfloat16), np.float64))


def test_dequantised_rows_are_exact_in_bf16():
    rows = kv_fp8.quantize_kv_rows(random_rows(1))
    f32 = kv_fp8.dequantize_kv_rows(rows, jnp.float32)
    np.testing.assert_array_equal(np.asarray(f32), np.asarray(kv_fp8.dequantize_kv_rows(rows).astype(jnp.float32)))


def test_scale_bytes_are_the_64_block_exponents_then_a_zero_pad():
    x = random_rows(2)
    rows = kv_fp8.quantize_kv_rows(x)
    values, exps = quantize_fp8(x[:, :448], 64)
    np.testing.assert_array_equal(np.asarray(rows.scale[:, :7]), np.asarray(exps))
    np.testing.assert_array_equal(np.asarray(rows.nope, np.float32), np.asarray(values, np.float32))
    assert np.all(np.asarray(rows.scale[:, 7]) == 0)


def test_quantize_rejects_rows_that_are_not_512_wide():
    with pytest.raises(ValueError, match="rows"):
        kv_fp8.quantize_kv_rows(jnp.ones((3, 448), jnp.float32))


@pytest.mark.parametrize("main_fp8,extra_fp8", [(True, False), (False, True), (True, True)])
def test_fp8_pools_attend_exactly_as_their_dequantised_rows(main_fp8, extra_fp8):
    q, main, idx, extra, idx2, sink, rope = attention_case(3 + 2 * main_fp8 + extra_fp8)
    main_q, extra_q = kv_fp8.quantize_kv_rows(main), kv_fp8.quantize_kv_rows(extra)
    kw = dict(extra_idx=idx2, sink=sink, scale=0.05, inverse_rope=rope, return_lse=True)
    out, lse = ops.sparse_sink_attention(
        q, main_q if main_fp8 else main, idx, extra_rows=extra_q if extra_fp8 else extra, **kw
    )
    main_d = kv_fp8.dequantize_kv_rows(main_q) if main_fp8 else main
    extra_d = kv_fp8.dequantize_kv_rows(extra_q) if extra_fp8 else extra
    want, want_lse = ops.sparse_sink_attention(q, main_d, idx, extra_rows=extra_d, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_fp8_pool_under_jit_masks_out_of_range_indices():
    q, main, idx, *_ = attention_case(7)
    pool = kv_fp8.quantize_kv_rows(main)
    bad = idx.at[0, 0, :3].set(jnp.asarray([16, 10**6, -5], jnp.int32))
    f = jax.jit(lambda q, pool, i: ops.sparse_sink_attention(q, pool, i, scale=0.05))
    got = f(q, pool, bad)
    masked = jnp.where((bad < 0) | (bad >= 16), -1, bad)
    want = ops.sparse_sink_attention(q, kv_fp8.dequantize_kv_rows(pool), masked, scale=0.05)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _bad_pools(pool):
    yield "main_rows.nope", pool._replace(nope=pool.nope.astype(jnp.bfloat16))
    yield "main_rows.nope", pool._replace(nope=pool.nope[:, :384])
    yield "main_rows.rope", pool._replace(rope=pool.rope.astype(jnp.float32))
    yield "main_rows.rope", pool._replace(rope=pool.rope[:5])
    yield "main_rows.scale", pool._replace(scale=pool.scale[:, :7])
    yield "main_rows.scale", pool._replace(scale=pool.scale.astype(jnp.int32))


@pytest.mark.parametrize("case", range(6))
def test_malformed_fp8_pools_raise_naming_the_field(case):
    q, main, idx, *_ = attention_case(8)
    name, pool = list(_bad_pools(kv_fp8.quantize_kv_rows(main)))[case]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ops.sparse_sink_attention(q, pool, idx, scale=0.05)


def test_fp8_pool_needs_q_512_wide():
    q, main, idx, *_ = attention_case(9)
    pool = kv_fp8.quantize_kv_rows(main)
    with pytest.raises(ValueError, match="main_rows"):
        ops.sparse_sink_attention(q[..., :256], pool, idx, scale=0.05)


def test_fp8_extra_pool_indices_out_of_range_raise_when_concrete():
    q, main, idx, extra, idx2, *_ = attention_case(10)
    pool = kv_fp8.quantize_kv_rows(extra)
    with pytest.raises(ValueError, match="extra_idx"):
        ops.sparse_sink_attention(q, main, idx, extra_rows=pool, extra_idx=idx2.at[1, 1, 0].set(9), scale=0.05)


def _lowered_custom_call(main_rows, extra_rows):
    """The kernel wrapper's custom call as StableHLO text (lowering needs no GPU)."""
    q = jnp.zeros((1, 1, 64, D), jnp.bfloat16)
    idx = jnp.zeros((1, 1, 5), jnp.int32)
    f = jax.jit(lambda q, m, i, e: _kernels.sparse_sink_attention(q, m, i, extra_rows=e, extra_idx=i, scale=0.1))
    text = f.lower(q, main_rows, idx, extra_rows).as_text()
    line = next(line for line in text.splitlines() if "jax_dspark_sparse_sink_attention" in line)
    return line, re.search(r": \((.*)\) -> \(", line).group(1).split(", ")


def test_kernel_wrapper_passes_an_fp8_pool_as_its_three_arrays_with_its_flag():
    _, main, _, extra, *_ = attention_case(11)
    line, operands = _lowered_custom_call(kv_fp8.quantize_kv_rows(main), extra)
    assert "main_fp8 = 1" in line and "extra_fp8 = 0" in line
    assert operands[:5] == [
        "tensor<1x1x64x512xbf16>", "tensor<16x448xf8E4M3FN>", "tensor<1x1x5xi32>", "tensor<9x512xbf16>",
        "tensor<1x1x5xi32>",
    ]
    assert operands[7:] == [
        "tensor<16x64xbf16>", "tensor<16x8xui8>", "tensor<0x64xbf16>", "tensor<0x8xui8>",
    ]


def test_kernel_wrapper_keeps_bf16_pools_as_before_with_empty_fp8_operands():
    _, main, _, extra, *_ = attention_case(12)
    line, operands = _lowered_custom_call(main, extra)
    assert "main_fp8 = 0" in line and "extra_fp8 = 0" in line
    assert operands[1] == "tensor<16x512xbf16>" and operands[3] == "tensor<9x512xbf16>"
    assert operands[7:] == ["tensor<0x64xbf16>", "tensor<0x8xui8>", "tensor<0x64xbf16>", "tensor<0x8xui8>"]
