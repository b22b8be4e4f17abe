"""FP8 e4m3 with UE8M0 scales rounded up: exact bytes, bounds and round-trip error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import ops


@pytest.mark.parametrize("k", [1, 8, 40])
def test_scale_byte_at_448_times_power_of_two_is_127_plus_k(k):
    x = np.full((1, 128), 448.0 * 2.0**k, np.float32)
    x[0, 5] = -x[0, 5]
    _, exps = ops.quantize_fp8(x)
    assert exps.dtype == jnp.uint8
    assert int(exps[0, 0]) == 127 + k


def test_scale_byte_for_amax_1000_is_129():
    x = np.random.default_rng(0).uniform(-1, 1, (1, 64)).astype(np.float32)
    x[0, 3] = 1e3
    assert int(ops.quantize_fp8(x, block=64)[1][0, 0]) == 129


def test_amax_is_floored_at_1e4():
    x = np.full((2, 128), 1e-9, np.float32)
    # 1e-4 / 448 = 2^-22.09 -> ceil -> 2^-22 -> byte 105
    assert np.all(np.asarray(ops.quantize_fp8(x)[1]) == 105)


def test_values_fit_e4m3_and_round_trip_error_is_bounded_per_block():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 100, (8, 1))).astype(np.float32)
    for block in (128, 64):
        values, exps = ops.quantize_fp8(x, block)
        assert values.dtype == jnp.float8_e4m3fn and exps.shape == (8, 512 // block)
        assert np.all(np.abs(np.asarray(values, np.float32)) <= 448)
        back = np.asarray(ops.dequantize_fp8(values, exps, block, dtype=jnp.float32))
        xb = x.reshape(8, -1, block)
        # e4m3 has 3 mantissa bits: relative step 2^-3 at worst, half of it after rounding,
        # relative to the block's amax (subnormal tail included).
        err = np.abs(back.reshape(xb.shape) - xb).max(-1) / np.abs(xb).max(-1)
        assert err.max() <= 2.0**-4 + 1e-7


def test_scale_is_the_smallest_power_of_two_that_fits():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 128)).astype(np.float32) * 37.0
    _, exps = ops.quantize_fp8(x)
    s = 2.0 ** (np.asarray(exps, np.float64) - 127)
    amax = np.abs(x).max(-1, keepdims=True)
    assert np.all(amax / s <= 448) and np.all(amax / (s / 2) > 448)


def test_weight_blocks_are_128_by_128():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 384)).astype(np.float32)
    w[128:, 256:] *= 1000.0
    values, exps = ops.quantize_fp8_weight(w)
    assert exps.shape == (2, 3)
    assert exps[1, 2] > exps[0, 0] + 8
    back = np.asarray(ops.dequantize_fp8_weight(values, exps, dtype=jnp.float32))
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.05


def test_round_trip_is_idempotent():
    x = np.random.default_rng(4).standard_normal((4, 128)).astype(np.float32)
    once = ops.fp8_round_trip(x)
    np.testing.assert_array_equal(ops.fp8_round_trip(once), once)


def test_bad_block_and_shapes_raise():
    with pytest.raises(ValueError, match="block: must be"):
        ops.quantize_fp8(jnp.ones((2, 128)), block=100)
    with pytest.raises(ValueError, match="x: last dim must be a multiple of block=128"):
        ops.quantize_fp8(jnp.ones((2, 100)))
    with pytest.raises(ValueError, match="w: last two dims"):
        ops.quantize_fp8_weight(jnp.ones((128, 100)))


def test_bit_decode_matches_the_cast_for_all_256_codes():
    from jax_dspark.ops import fp8

    codes = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
    want = np.asarray(codes.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(fp8.e4m3_to_f32(codes)), want)  # NaN codes compare equal


def test_round_to_bf16_equals_the_bf16_cast():
    from jax_dspark.ops import fp8

    x = np.random.default_rng(3).standard_normal((4, 999)).astype(np.float32) * 1e3
    np.testing.assert_array_equal(np.asarray(fp8.round_to_bf16(x)), np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.gpu
def test_round_trip_inside_one_jit_still_rounds_on_gpu():
    # XLA on GPU may fold a convert pair f32 -> e4m3 -> f32 inside one computation; the
    # references must keep FP8's rounding there (as the kernels do), not silently skip it.
    x = jnp.asarray(np.random.default_rng(4).standard_normal((64, 256)), jnp.float32)
    inside = np.asarray(jax.jit(lambda v: ops.fp8_round_trip(v * 1.0) + 0.0)(x))
    values, exps = jax.jit(ops.quantize_fp8)(x)  # materialised e4m3: rounding certainly happened
    separate = np.asarray(jax.jit(lambda v, e: ops.dequantize_fp8(v, e, dtype=jnp.float32))(values, exps))
    np.testing.assert_array_equal(inside, separate)
    assert not np.array_equal(inside, np.asarray(x))


def test_scale_byte_from_the_bits_of_amax_equals_the_division_for_every_mantissa():
    """The CUDA prep kernel reads the scale byte from amax's bits instead of dividing by 448
    (`ue8m0_exponent` in csrc/prep/rms_norm_rope.cu): byte = biased exponent - 8, plus one
    when the mantissa exceeds 1.75's. This pins that identity against the reference's
    division, for all 2^23 mantissas at several exponents, the 1e-4 floor and infinity."""
    from jax_dspark.ops import fp8

    mantissas = np.arange(1 << 23, dtype=np.uint32)
    for biased in (100, 127, 128, 140, 254):
        amax = ((np.uint32(biased) << 23) | mantissas).view(np.float32)
        want = np.asarray(fp8._scale_exponent(jnp.asarray(amax))) + 127
        bits = np.maximum(amax, np.float32(fp8.AMAX_FLOOR)).view(np.uint32)
        got = (bits >> 23).astype(np.int64) - 8 + ((bits & 0x7FFFFF) > 0x600000)
        np.testing.assert_array_equal(got, want, err_msg=f"biased exponent {biased}")
    for amax in (0.0, 1e-9, 1e-4):  # floored: the byte of 1e-4
        bits = np.maximum(np.float32(amax), np.float32(fp8.AMAX_FLOOR)).view(np.uint32)
        assert int(bits >> 23) - 8 + int((bits & 0x7FFFFF) > 0x600000) == 105
    # an infinite amax: 127 in the kernel, as in the reference (frexp's exponent 0 for inf)
    assert int(np.asarray(fp8._scale_exponent(jnp.asarray([np.inf], jnp.float32)))[0]) + 127 == 127
