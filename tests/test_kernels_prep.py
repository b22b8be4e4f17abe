"""The fused RMSNorm + RoPE (+ FP8) prep kernel against its reference composition on the GPU.

Reference: `quantize_fp8(apply_rope(rms_norm(x, w), freqs, inverse), block)` from the ops,
with the same roundings to x's dtype between steps. Outputs land in NaN-poisoned donated
buffers. Tolerances: bf16 outputs rel. error < 1e-2 (one bf16 ulp where the f32 sums round
differently), f32 < 1e-5; FP8 values compared after dequantisation, exponents must agree on
>= 99% of blocks (a one-ulp difference in a block's amax can move its power of two).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import _ffi, ops
from jax_dspark.ops import _kernels

pytestmark = pytest.mark.gpu


def make(seed, shape, dtype=jnp.bfloat16, rope_dim=64, freq_shape=None, weight=True):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * 3.0, dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32) if weight else None
    freqs = None
    if rope_dim:
        angles = rng.uniform(0, 2 * np.pi, (freq_shape or shape[:-1]) + (rope_dim // 2,))
        freqs = jnp.asarray(np.stack([np.cos(angles), np.sin(angles)], -1), jnp.float32)
    return x, w, freqs


def kernel(x, w, freqs, **kw):
    def f(poison, x, w, freqs):
        del poison
        with ops.force("kernel"):
            return _kernels.rms_norm_rope(x, w, freqs, **kw)

    poison = jnp.full(x.shape, jnp.nan, x.dtype)
    return jax.jit(f, donate_argnums=0)(poison, x, w, freqs)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), "kernel left NaN (unwritten or poisoned) elements"
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_kernel_is_registered_on_the_h200():
    assert _ffi.kernel_report()["rms_norm_rope"] == _ffi.REGISTERED


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("weight", [True, False])
def test_bf16_per_head_rows_with_per_position_table(inverse, weight):
    x, w, freqs = make(int(inverse) + 2 * int(weight), (3, 5, 16, 512), freq_shape=(3, 5, 1))
    got = kernel(x, w, freqs, eps=1e-6, inverse=inverse)
    want = _kernels.rms_norm_rope_reference(x, w, freqs, eps=1e-6, inverse=inverse)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("d", [8, 136, 512, 1000, 2048])  # stream kernel (<= 256), then 2, 4, 8 chunks of 256
def test_f32_rows_of_several_widths(d):
    x, w, freqs = make(d, (37, d), jnp.float32, rope_dim=8 if d == 8 else 64)
    got = kernel(x, w, freqs, eps=1e-5)
    want = _kernels.rms_norm_rope_reference(x, w, freqs, eps=1e-5)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype, d, block", [(jnp.bfloat16, 512, None), (jnp.bfloat16, 512, 128), (jnp.float32, 256, 64)])
def test_many_rows_stream_through_the_ring_with_a_partial_last_group(dtype, d, block):
    # rows of <= 1 KB go through the persistent bulk-copy kernel: 20483 rows are 2561 groups of
    # 8 (the last one of 3 rows), several per block, so every stage of the ring is reused
    x, w, freqs = make(11 + d + (block or 0), (20483, d), dtype)
    got = kernel(x, w, freqs, eps=1e-6, fp8_block=block)
    want = _kernels.rms_norm_rope_reference(x, w, freqs, eps=1e-6, fp8_block=block)
    if block is None:
        assert rel_err(got, want) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)
        return
    assert np.mean(np.asarray(got[1]) == np.asarray(want[1])) >= 0.99
    g = ops.dequantize_fp8(got[0], got[1], block, jnp.float32)
    r = ops.dequantize_fp8(want[0], want[1], block, jnp.float32)
    assert rel_err(g, r) < 3e-2


def test_no_rope_is_plain_rms_norm():
    x, w, _ = make(5, (64, 1536), rope_dim=0)
    got = kernel(x, w, None, eps=1e-6)
    assert rel_err(got, ops.rms_norm(x, w, eps=1e-6)) < 1e-2


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("weight", [True, False])
def test_fp8_output_matches_quantised_reference(block, weight):
    x, w, freqs = make(6 + block + int(weight), (4, 2, 64, 512), freq_shape=(4, 2, 1), weight=weight)
    values, exps = kernel(x, w, freqs, eps=1e-6, fp8_block=block)
    ref_values, ref_exps = _kernels.rms_norm_rope_reference(x, w, freqs, eps=1e-6, fp8_block=block)
    assert np.mean(np.asarray(exps) == np.asarray(ref_exps)) >= 0.99
    got = ops.dequantize_fp8(values, exps, block, jnp.float32)
    want = ops.dequantize_fp8(ref_values, ref_exps, block, jnp.float32)
    assert rel_err(got, want) < 3e-2


def test_vmap_with_a_batched_weight_matches_reference():
    x, w, freqs = make(7, (3, 10, 512))
    ws = jnp.stack([w, 2 * w, -w])

    def f(x, w, fr):
        with ops.force("kernel"):
            return _kernels.rms_norm_rope(x, w, fr, eps=1e-6)

    got = jax.jit(jax.vmap(f))(x, ws, freqs)
    want = jax.vmap(lambda x, w, fr: _kernels.rms_norm_rope_reference(x, w, fr, eps=1e-6))(x, ws, freqs)
    assert rel_err(got, want) < 1e-2


def test_vmap_without_a_weight_matches_reference():
    x, _, freqs = make(9, (3, 10, 512), weight=False)

    def f(x, fr):
        with ops.force("kernel"):
            return _kernels.rms_norm_rope(x, None, fr, eps=1e-6)

    got = jax.jit(jax.vmap(f))(x, freqs)
    want = jax.vmap(lambda x, fr: _kernels.rms_norm_rope_reference(x, None, fr, eps=1e-6))(x, freqs)
    assert rel_err(got, want) < 1e-2


def test_handler_rejects_a_mismatched_weight_with_an_ffi_error():
    x, _, freqs = make(8, (4, 512))
    call = jax.ffi.ffi_call("jax_dspark_rms_norm_rope", jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(Exception, match="weight"):
        out = call(x, jnp.ones((500,), jnp.float32), freqs.reshape(4, 32, 2), eps=np.float32(1e-6),
                   inverse=np.int32(0), rope_dim=np.int32(64))
        jax.block_until_ready(out)
