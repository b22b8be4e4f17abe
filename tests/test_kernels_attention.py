"""The sparse sink attention kernel against the pure-JAX reference on the GPU.

Fresh random inputs per case; outputs land in NaN-poisoned buffers (donated into the call),
so an element the kernel forgets to write fails loudly. Error metric: ||out - ref|| / ||ref||
over bf16 outputs, tolerance 1e-2 (bf16 probabilities and output rounding give ~3e-3);
lse within 2e-3 (absolute and relative). FP8 pools (ops.kv_fp8) are held to the same
tolerance against the reference on their dequantised rows, and to 1e-5 (lse: 1e-6) against
the same kernel run on those dequantised bf16 rows (the comparison pins the kernel
explicitly, whatever the default dispatch picks): the loader's expansion is exact and the
MMA pipeline is the same code, so the two should agree to the bit; the slack only allows
for the compiler scheduling the two instantiations' float ops differently.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import _ffi, ops
from jax_dspark.ops import _kernels, kv_fp8

pytestmark = pytest.mark.gpu
TOL = 1e-2
D = 512


def make_case(seed, b, s, h, k, n=None, k2=0, n2=0, drop=0.2, shared_lists=False):
    rng = np.random.default_rng(seed)
    n = n or max(1, b * k)
    q = rng.standard_normal((b, s, h, D)).astype(np.float32)
    rows = rng.standard_normal((n, D)).astype(np.float32)
    idx = rng.integers(0, n, (b, 1 if shared_lists else s, k)).astype(np.int32)
    idx = np.where(rng.random(idx.shape) < drop, -1, idx)
    idx = np.broadcast_to(idx, (b, s, k)).copy()
    args = dict(q=jnp.asarray(q, jnp.bfloat16), main_rows=jnp.asarray(rows, jnp.bfloat16), main_idx=jnp.asarray(idx))
    if n2:
        rows2 = rng.standard_normal((n2, D)).astype(np.float32)
        idx2 = rng.integers(-1, n2, (b, s, k2)).astype(np.int32)
        args.update(extra_rows=jnp.asarray(rows2, jnp.bfloat16), extra_idx=jnp.asarray(idx2))
    return args, rng


def run_kernel(args, **kw):
    """The op under ops.force('kernel'), writing into NaN-filled donated output buffers."""
    b, s, h, _ = args["q"].shape

    def f(poison_out, poison_lse, a):
        del poison_out, poison_lse
        with ops.force("kernel"):
            return ops.sparse_sink_attention(**a, **kw, return_lse=True)

    poison_out = jnp.full((b, s, h, D), jnp.nan, jnp.bfloat16)
    poison_lse = jnp.full((b, s, h), jnp.nan, jnp.float32)
    return jax.jit(f, donate_argnums=(0, 1))(poison_out, poison_lse, args)


def reference(args, **kw):
    """The pure-JAX reference, jitted: run eagerly, each of its primitives compiles on its
    own for every new shape (seconds per case on the GPU)."""
    scale = kw.pop("scale")
    return jax.jit(lambda a, k: ops.sparse_sink_attention_reference(**a, **k, scale=scale, return_lse=True))(args, kw)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), "kernel left NaN (unwritten or poisoned) elements"
    denom = np.linalg.norm(want)
    return np.linalg.norm(got - want) / (denom if denom > 0 else 1.0)


def check(args, **kw):
    out, lse = run_kernel(args, **kw)
    ref_out, ref_lse = reference(args, **kw)
    assert rel_err(out, ref_out) < TOL
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)
    return out, lse


def test_kernel_is_registered_on_the_h200():
    assert _ffi.kernel_report()["sparse_sink_attention"] == _ffi.REGISTERED
    assert _ffi.kernel_report()["sparse_sink_attention_wgmma"] == _ffi.REGISTERED


def test_env_switch_sends_calls_to_the_wgmma_target(monkeypatch):
    """`JAX_DSPARK_ATTENTION_KERNEL=wgmma pytest -m gpu tests/test_kernels_attention.py` runs
    every case below (bf16 and FP8 pools) on the wgmma kernel; this pins that the switch
    reaches the lowered program."""
    args, _ = make_case(0, 1, 1, 64, 70)

    def lowered():
        with ops.force("kernel"):
            return jax.jit(lambda a: ops.sparse_sink_attention(**a, scale=0.05)).lower(args).as_text()

    monkeypatch.setenv("JAX_DSPARK_ATTENTION_KERNEL", "wgmma")
    assert "jax_dspark_sparse_sink_attention_wgmma" in lowered()
    monkeypatch.setenv("JAX_DSPARK_ATTENTION_KERNEL", "mma")
    assert "jax_dspark_sparse_sink_attention_wgmma" not in lowered()


def test_default_sends_bf16_and_fp8_pools_to_wgmma(monkeypatch):
    monkeypatch.delenv("JAX_DSPARK_ATTENTION_KERNEL", raising=False)

    def lowered(a):
        with ops.force("kernel"):
            return jax.jit(lambda a: ops.sparse_sink_attention(**a, scale=0.05)).lower(a).as_text()

    assert "jax_dspark_sparse_sink_attention_wgmma" in lowered(make_case(0, 1, 1, 64, 70)[0])
    assert "jax_dspark_sparse_sink_attention_wgmma" in lowered(fp8_case(0, b=1, s=1, h=64, k=70)[0])


@pytest.mark.parametrize(
    "case",
    [
        dict(b=2, s=2, h=64, k=65, k2=7, n2=20),  # tile edge, both pools
        dict(b=2, s=3, h=128, k=133),  # DSpark block: a short last tile
        dict(b=1, s=1, h=96, k=70),  # partial head block
        dict(b=1, s=2, h=64, k=3000, n=5000),  # split over CTAs
    ],
    ids=["tile-edge", "short-tile", "h96", "split-k"],
)
def test_mma_kernel_still_matches_the_reference(monkeypatch, case):
    # Default dispatch sends every pool to the wgmma kernel, so the rest of this file runs
    # there; the mma.sync kernel (the fallback, and JAX_DSPARK_ATTENTION_KERNEL=mma) keeps
    # these cases of its own.
    monkeypatch.setenv("JAX_DSPARK_ATTENTION_KERNEL", "mma")
    args, rng = make_case(sum(case.values()), **case)
    h = case["h"]
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((case["b"], case["s"], 32, 2)), jnp.float32)
    check(args, sink=sink, scale=512**-0.5, inverse_rope=rope)


@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("s", [1, 3])
def test_matches_reference_with_sink_and_inverse_rope(h, s):
    args, rng = make_case(10 * h + s, b=3, s=s, h=h, k=150, k2=9, n2=40)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((3, s, 32, 2)), jnp.float32)
    check(args, sink=sink, scale=512**-0.5, inverse_rope=rope)


@pytest.mark.parametrize("pairs", [16, 200])
@pytest.mark.parametrize("b, s, k", [(26, 5, 133), (30, 5, 133), (3, 2, 150), (1, 2, 3000)],
                         ids=["one-item-a-cta", "persistent", "cluster-merge", "combine"])
def test_inverse_rope_over_other_rope_dims(pairs, b, s, k):
    # Every other case rotates the models' 64 dims. The epilogues tell RoPE dims apart by
    # rope_dim at run time: 32 dims (warpgroup 1's last four pairs) and 400 (both warpgroups'
    # halves), through the whole-row staging of one-item CTAs (130 items, one split) and of the
    # persistent kernels (150 items, more than the SMs), the cluster merge (3 splits) and the
    # combine launch (12 splits): choose_splits on 132 SMs.
    args, rng = make_case(pairs + k, b=b, s=s, h=64, k=k, k2=5, n2=30)
    sink = jnp.asarray(rng.standard_normal(64), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((b, s, pairs, 2)), jnp.float32)
    check(args, sink=sink, scale=512**-0.5, inverse_rope=rope)


@pytest.mark.parametrize("k", [1, 63, 64, 65, 100, 129])
def test_list_lengths_around_the_tile_size(k):
    args, _ = make_case(k, b=2, s=2, h=64, k=k, drop=0.0)
    check(args, scale=0.05)


def test_long_lists_split_over_ctas_combine_exactly():
    args, rng = make_case(7, b=2, s=1, h=64, k=3000, n=5000)
    sink = jnp.asarray(rng.standard_normal(64) + 3.0, jnp.float32)
    check(args, sink=sink, scale=512**-0.5)


def test_long_lists_with_inverse_rope_through_the_combine():
    args, rng = make_case(8, b=1, s=2, h=128, k=2000, n=3000, k2=300, n2=500)
    rope = jnp.asarray(rng.standard_normal((1, 2, 32, 2)), jnp.float32)
    check(args, scale=512**-0.5, inverse_rope=rope)


@pytest.mark.parametrize("h", [128, 96])
def test_long_lists_over_two_head_blocks_take_the_warp_specialised_schedule_and_match(h):
    # More than one head block and >= 16 tiles a split: the bf16 launch goes to the
    # warp-specialised kernel (use_warp_specialised in sparse_sink_attention_wgmma.cu);
    # 96 heads leave the second head block half empty, masked rows and both pools included.
    b, s, k, k2 = 8, 2, 4000, 100
    splits = _kernels.choose_splits(b, s, h, k + k2, _ffi.num_sms())
    tiles = -(-(k + k2) // _kernels.KEYS_PER_TILE)
    assert -(-tiles // splits) >= 16, "the shape no longer reaches the warp-specialised schedule"
    args, rng = make_case(40 + h, b=b, s=s, h=h, k=k, n=6000, k2=k2, n2=300)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((b, s, 32, 2)), jnp.float32)
    check(args, sink=sink, scale=512**-0.5, inverse_rope=rope)


def _work_items(b, s, h, k_total):
    splits = _kernels.choose_splits(b, s, h, k_total, _ffi.num_sms())
    return -(-h // _kernels.HEADS_PER_CTA) * s * b * splits


@pytest.mark.parametrize(
    "b, s, h, k, k2",
    [(40, 4, 64, 150, 20), (140, 1, 64, 190, 10), (30, 3, 96, 10, 3)],
    ids=["short-lists", "split-k", "partial-head-block-one-short-tile"],
)
def test_more_work_items_than_sms_match(b, s, h, k, k2):
    # More (request, row, head block, split) items than SMs on short lists: persistent
    # warp-specialised CTAs for the one-split shapes (the DSpark blocks' regime), several
    # waves of plain CTAs with split-K partials, a half-empty second head block, masked rows,
    # both pools, sink and inverse RoPE.
    assert _work_items(b, s, h, k + k2) > _ffi.num_sms(), "the shape no longer has more work items than SMs"
    args, rng = make_case(60 + b, b=b, s=s, h=h, k=k, n=400, k2=k2, n2=50, drop=0.25)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((b, s, 32, 2)), jnp.float32)
    check(args, sink=sink, scale=512**-0.5, inverse_rope=rope)


def test_heads_not_a_multiple_of_64():
    args, _ = make_case(9, b=2, s=1, h=96, k=70)
    check(args, scale=0.04)


def test_empty_lists_give_zeros_and_minus_inf_lse():
    args, rng = make_case(11, b=2, s=2, h=64, k=0, n=10)
    out, lse = run_kernel(args, sink=jnp.asarray(rng.standard_normal(64), jnp.float32), scale=0.1)
    assert np.all(np.asarray(out, np.float32) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


def test_empty_lists_over_more_work_items_than_sms_give_zeros():
    # One-split bf16 launches of more work items than SMs run on persistent CTAs that walk
    # several items each (use_persistent in the .cu); with empty lists every item has no tile,
    # and the persistent lockstep kernel takes them.
    b, s = 70, 2
    assert _work_items(b, s, 64, 0) > _ffi.num_sms(), "the shape no longer has more work items than SMs"
    args, rng = make_case(31, b=b, s=s, h=64, k=0, n=10)
    out, lse = run_kernel(args, sink=jnp.asarray(rng.standard_normal(64), jnp.float32), scale=0.1)
    assert np.all(np.asarray(out, np.float32) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


def test_all_masked_rows_give_zeros():
    args, _ = make_case(12, b=2, s=1, h=64, k=200, drop=1.0)
    out, lse = run_kernel(args, scale=0.1)
    assert np.all(np.asarray(out, np.float32) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


def test_only_the_extra_pool_has_rows():
    args, _ = make_case(13, b=2, s=2, h=64, k=0, k2=50, n2=60)
    check(args, scale=0.05)


def test_one_row():
    args, _ = make_case(14, b=1, s=1, h=64, k=1, n=1, drop=0.0)
    check(args, scale=0.05)


def test_out_of_range_indices_under_jit_are_masked_not_read():
    args, rng = make_case(15, b=2, s=2, h=64, k=90, n=50)
    idx = np.asarray(args["main_idx"]).copy()
    idx[0, 0, :5] = [50, 10**9, -2, -(10**9), 49]  # pool boundary and far outside it
    args["main_idx"] = jnp.asarray(idx)

    def f(a):
        with ops.force("kernel"):
            return ops.sparse_sink_attention(**a, scale=0.05, return_lse=True)

    out, _ = jax.jit(f)(args)
    masked = dict(args, main_idx=jnp.asarray(np.where((idx < 0) | (idx >= 50), -1, idx)))
    ref_out, _ = reference(masked, scale=0.05)
    assert rel_err(out, ref_out) < TOL


@pytest.mark.parametrize("sink_value", [-np.inf, 40.0])
def test_extreme_sinks(sink_value):
    args, _ = make_case(16, b=2, s=1, h=64, k=80)
    check(args, sink=jnp.full((64,), sink_value, jnp.float32), scale=0.05)


def test_dspark_block_rows_share_one_list():
    args, rng = make_case(17, b=4, s=5, h=64, k=128, k2=5, n2=40, shared_lists=True)
    check(args, sink=jnp.asarray(rng.standard_normal(64), jnp.float32), scale=512**-0.5)


def test_vmap_over_requests_matches_reference():
    args, _ = make_case(18, b=2, s=1, h=64, k=70)
    batched = {k: jnp.stack([v, v[::-1]]) if k != "main_rows" else v for k, v in args.items()}

    def f(q, idx):
        with ops.force("kernel"):
            return ops.sparse_sink_attention(q, batched["main_rows"], idx, scale=0.05)

    got = jax.jit(jax.vmap(f))(batched["q"], batched["main_idx"])
    want = jax.vmap(lambda q, i: ops.sparse_sink_attention_reference(q, batched["main_rows"], i, scale=0.05))(
        batched["q"], batched["main_idx"]
    )
    assert rel_err(got, want) < TOL


def test_handler_rejects_a_short_workspace_with_an_ffi_error():
    args, _ = make_case(19, b=1, s=1, h=64, k=640)
    call = jax.ffi.ffi_call(
        "jax_dspark_sparse_sink_attention",
        (
            jax.ShapeDtypeStruct((1, 1, 64, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 1, 64), jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.float32),
        ),
    )
    with pytest.raises(Exception, match="workspace"):
        out = call(
            args["q"], args["main_rows"], args["main_idx"], jnp.zeros((0, D), jnp.bfloat16),
            jnp.zeros((1, 1, 0), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32),
            *_no_fp8_operands(), *_no_fp8_operands(),
            scale=np.float32(0.1), num_splits=np.int32(4), has_sink=np.int32(0), rope_dim=np.int32(0),
            main_fp8=np.int32(0), extra_fp8=np.int32(0),
        )
        jax.block_until_ready(out)


# ------------------------------------------------------------------------------------------
# FP8 row pools (448 e4m3 + 64 bf16 + UE8M0 scale per 64): expanded to bf16 in the loader
# ------------------------------------------------------------------------------------------


def _no_fp8_operands():
    return jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 8), jnp.uint8)


def to_fp8(rows, rng):
    """FP8 pool of `rows` with each 64-block scaled by its own power of two (so every scale
    byte matters), quantised by the reference quantiser."""
    n = rows.shape[0]
    mult = np.exp2(rng.integers(-3, 4, (n, D // 64))).repeat(64, axis=1)
    return kv_fp8.quantize_kv_rows(rows.astype(jnp.float32) * mult)


def fp8_case(seed, main_fp8=True, extra_fp8=False, **kw):
    args, rng = make_case(seed, **kw)
    if main_fp8:
        args["main_rows"] = to_fp8(args["main_rows"], rng)
    if extra_fp8:
        args["extra_rows"] = to_fp8(args["extra_rows"], rng)
    return args, rng


def dequantised(args):
    return {k: kv_fp8.dequantize_kv_rows(v) if kv_fp8.is_fp8_rows(v) else v for k, v in args.items()}


def check_fp8(args, same_tol=1e-5, **kw):
    """Reference tolerance, and (near-)identical to the kernel over the dequantised bf16 rows
    (within `same_tol`: see check_scores_set_by_the_last_dim for where that is not 1e-5)."""
    out, lse = check(args, **kw)
    with _kernels.attention_kernel(_kernels.attention_variant(fp8=True)):
        out_bf16, lse_bf16 = run_kernel(dequantised(args), **kw)
    assert rel_err(out, out_bf16) < same_tol
    lse, lse_bf16 = np.asarray(lse), np.asarray(lse_bf16)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_bf16))
    finite = np.isfinite(lse_bf16)
    np.testing.assert_allclose(lse[finite], lse_bf16[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("h", [64, 128])
def test_fp8_main_pool_with_bf16_extra_pool(h):
    args, rng = fp8_case(20 + h, b=2, s=3, h=h, k=150, k2=9, n2=40)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((2, 3, 32, 2)), jnp.float32)
    check_fp8(args, sink=sink, scale=512**-0.5, inverse_rope=rope)


def test_fp8_extra_pool_with_bf16_main_pool():
    args, rng = fp8_case(21, main_fp8=False, extra_fp8=True, b=2, s=2, h=64, k=70, k2=60, n2=80)
    check_fp8(args, sink=jnp.asarray(rng.standard_normal(64), jnp.float32), scale=512**-0.5)


def test_fp8_both_pools_mixed_in_one_tile():
    args, rng = fp8_case(22, extra_fp8=True, b=3, s=1, h=64, k=40, k2=50, n2=70)
    check_fp8(args, scale=512**-0.5)


@pytest.mark.parametrize("k", [1, 65, 129])
def test_fp8_list_lengths_around_the_tile_size_with_masked_rows(k):
    args, _ = fp8_case(30 + k, b=2, s=2, h=64, k=k, drop=0.3)
    check_fp8(args, scale=0.05)


def test_fp8_long_lists_split_over_ctas_combine_exactly():
    args, rng = fp8_case(23, extra_fp8=True, b=2, s=1, h=64, k=2500, n=4000, k2=300, n2=500)
    rope = jnp.asarray(rng.standard_normal((2, 1, 32, 2)), jnp.float32)
    check_fp8(args, sink=jnp.asarray(rng.standard_normal(64) + 3.0, jnp.float32), scale=512**-0.5, inverse_rope=rope)


def test_fp8_long_splits_take_the_warp_specialised_schedule_and_match():
    # Long FP8 splits (16+ tiles; FP8 pools take the warp-specialised kernel from 3 tiles a
    # split, use_warp_specialised) over many tiles of the producers' register prefetch; both
    # pools FP8, masked rows, one head block.
    b, s, h, k, k2 = 16, 2, 64, 4000, 100
    splits = _kernels.choose_splits(b, s, h, k + k2, _ffi.num_sms())
    tiles = -(-(k + k2) // _kernels.KEYS_PER_TILE)
    assert -(-tiles // splits) >= 16, "the shape no longer reaches the warp-specialised schedule"
    args, rng = fp8_case(26, extra_fp8=True, b=b, s=s, h=h, k=k, n=6000, k2=k2, n2=300, drop=0.1)
    rope = jnp.asarray(rng.standard_normal((b, s, 32, 2)), jnp.float32)
    check_fp8(args, sink=jnp.asarray(rng.standard_normal(h), jnp.float32), scale=512**-0.5, inverse_rope=rope)


def check_scores_set_by_the_last_dim(b, fp8, seed, q_last, last_dim):
    # H 128, 17 full tiles of one list shared by every query row; the scores are about q's last
    # dim (q_last, per head) times the rows' last dim (last_dim(tile, key) plus noise under 0.5),
    # a RoPE dim: bf16 in FP8 rows as well. b 66 is one split of 17 tiles a CTA on a 132-SM GPU
    # (both pool kinds on the warp-specialised schedule), b 4 many splits of one or two tiles
    # (lockstep).
    h, k = 128, 64 * 17
    rng = np.random.default_rng(seed)
    q = 0.1 * rng.standard_normal((b, 1, h, D))
    q[..., -1] = q_last(np.arange(h))
    rows = 0.1 * rng.standard_normal((k, D))
    rows[:, -1] = last_dim(np.arange(k) // 64, np.arange(k) % 64) + 0.5 * rng.random(k)
    rows = jnp.asarray(rows, jnp.bfloat16)
    args = dict(
        q=jnp.asarray(q, jnp.bfloat16),
        main_rows=kv_fp8.quantize_kv_rows(rows.astype(jnp.float32)) if fp8 else rows,
        main_idx=jnp.asarray(np.broadcast_to(np.arange(k, dtype=np.int32), (b, 1, k))),
    )
    if not fp8:
        check(args, scale=1.0)
        return
    # At b 66 the FP8 and the bf16 pool take the warp-specialised kernel, which sums S over
    # each half of D for FP8 rows and over all of D for bf16 rows (kSOverHalfD). With scores
    # near 75 the two fp32 S differ in their last bit, which flips some bf16 roundings of P:
    # 1.9e-4 apart on an H100 for the jump test (2026-12-07), 2.1e-4 in a float64 emulation of
    # the two summation orders with P rounded to bf16 (docs/kernels.md, "Every GPU test with
    # the persistent kernel's library").
    # An expansion error reaches every row (a wrong scale block or chunk) and moves far more.
    check_fp8(args, same_tol=1e-5 if b == 4 else 5e-4, scale=1.0)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("b", [4, 66])
def test_scores_climbing_across_tiles_move_the_softmax_offset_and_match(b, fp8):
    # The wgmma kernels keep a row's softmax offset until a tile's max passes it by more than
    # 8 (log2 units, kRescaleSlack) and rescale O only then. Here the scores climb about 6.5
    # log2 units a tile (the offset kept, then moved, in turn), jump by 43 at tile 7 and drop
    # after tile 8.
    check_scores_set_by_the_last_dim(
        b, fp8, 60 + b + fp8, lambda head: 1.0,
        lambda tile, key: 4.5 * tile + 30.0 * (tile == 7) - 40.0 * (tile > 8))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("b", [4, 66])
def test_a_jump_in_one_half_of_a_tile_moves_the_offset_of_both_halves(b, fp8):
    # Each warpgroup masks and maxes its own 32 keys of a tile, and the two halves must agree
    # on the row's offset (softmax_pv swaps the maxima; a schedule that computed P before the
    # swap, tried on 2026-12-07, has to fall back when one half moves it). Here the tiles'
    # first or second halves jump in turn (by up to 10 log2 units a quarter tile: past the
    # slack of 8 from tile 2 on), and by how much depends on the head, so in one tile some rows
    # of a warp move and others do not, and in some tiles only one warpgroup's keys move the
    # offset.
    def last_dim(tile, key):
        jump = np.where(tile % 3 == 1, key < 32, np.where(tile % 3 == 2, key >= 32, False))
        return 2.0 * tile + 10.0 * jump * (tile + 1) / 4

    check_scores_set_by_the_last_dim(b, fp8, 90 + b + fp8, lambda head: np.where(head % 3 == 0, 1.0, 0.7), last_dim)


def test_fp8_all_masked_rows_give_zeros():
    args, _ = fp8_case(24, b=2, s=1, h=64, k=200, drop=1.0)
    out, lse = run_kernel(args, scale=0.1)
    assert np.all(np.asarray(out, np.float32) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


def test_fp8_out_of_range_indices_under_jit_are_masked_not_read():
    args, _ = fp8_case(25, b=2, s=2, h=64, k=90, n=50)
    idx = np.asarray(args["main_idx"]).copy()
    idx[0, 0, :5] = [50, 10**9, -2, -(10**9), 49]
    args["main_idx"] = jnp.asarray(idx)

    def f(a):
        with ops.force("kernel"):
            return ops.sparse_sink_attention(**a, scale=0.05)

    out = jax.jit(f)(args)
    masked = dict(args, main_idx=jnp.asarray(np.where((idx < 0) | (idx >= 50), -1, idx)))
    ref_out, _ = reference(masked, scale=0.05)
    assert rel_err(out, ref_out) < TOL


def test_handler_rejects_a_wrong_fp8_scale_shape_with_an_ffi_error():
    args, _ = fp8_case(26, b=1, s=1, h=64, k=64)
    pool = args["main_rows"]
    call = jax.ffi.ffi_call(
        "jax_dspark_sparse_sink_attention",
        (
            jax.ShapeDtypeStruct((1, 1, 64, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 1, 64), jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.float32),
        ),
    )
    with pytest.raises(Exception, match="main_scale"):
        out = call(
            args["q"], pool.nope, args["main_idx"], jnp.zeros((0, D), jnp.bfloat16),
            jnp.zeros((1, 1, 0), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32),
            pool.rope, pool.scale[:, :7], *_no_fp8_operands(),
            scale=np.float32(0.1), num_splits=np.int32(1), has_sink=np.int32(0), rope_dim=np.int32(0),
            main_fp8=np.int32(1), extra_fp8=np.int32(0),
        )
        jax.block_until_ready(out)


def test_fp8_pools_reach_the_mma_kernel_only_when_asked(monkeypatch):
    # Auto mode sends FP8 pools to the wgmma kernel (no mbarriers); the mma.sync kernel's FP8
    # instantiation stays opt-in until the stall seen twice on the H200 is explained
    # (ops/attention.py, _fp8_kernel_enabled): force("kernel") or the env var opt in.
    args, _ = fp8_case(27, b=1, s=1, h=64, k=64)
    hlo = lambda: jax.jit(lambda a: ops.sparse_sink_attention(**a, scale=0.1)).lower(args).as_text()
    monkeypatch.delenv("JAX_DSPARK_FP8_ATTENTION", raising=False)
    monkeypatch.delenv("JAX_DSPARK_ATTENTION_KERNEL", raising=False)
    assert "jax_dspark_sparse_sink_attention_wgmma" in hlo()
    monkeypatch.setenv("JAX_DSPARK_ATTENTION_KERNEL", "mma")
    assert "jax_dspark_sparse_sink_attention" not in hlo()
    monkeypatch.setenv("JAX_DSPARK_FP8_ATTENTION", "1")
    text = hlo()
    assert "jax_dspark_sparse_sink_attention" in text and "jax_dspark_sparse_sink_attention_wgmma" not in text
    bf16 = dict(args, main_rows=kv_fp8.dequantize_kv_rows(args["main_rows"]))
    monkeypatch.delenv("JAX_DSPARK_FP8_ATTENTION")
    assert "jax_dspark_sparse_sink_attention" in jax.jit(lambda a: ops.sparse_sink_attention(**a, scale=0.1)).lower(bf16).as_text()


@pytest.mark.parametrize("b, s, h, k, k2", [(40, 4, 64, 150, 20), (50, 3, 96, 200, 40)])
def test_fp8_more_work_items_than_sms_match(b, s, h, k, k2):
    # One split of 3 or 4 tiles over more work items than SMs: persistent warp-specialised
    # CTAs (use_persistent in the .cu), each walking items whose regions rotate differently
    # for odd and even tile counts; the second shape has a half-empty second head block.
    # The dequantised bf16 pool takes the same kernel's bf16 instantiation, which sums S over
    # all of D where the FP8 one sums each half (kSOverHalfD), so the two outputs differ by the
    # bf16 roundings of P and of the output that the last bit of S flips: 4.4e-5 for the first
    # shape in a float64 emulation of the two orders (docs/kernels.md, "The bf16 persistent
    # warp-specialised kernel run and dispatched"), over the 1e-5 of identical arithmetic.
    assert _work_items(b, s, h, k + k2) > _ffi.num_sms(), "the shape no longer has more work items than SMs"
    assert _kernels.choose_splits(b, s, h, k + k2, _ffi.num_sms()) == 1, "the shape no longer takes one split"
    args, rng = fp8_case(27, extra_fp8=True, b=b, s=s, h=h, k=k, n=400, k2=k2, n2=50, drop=0.25)
    rope = jnp.asarray(rng.standard_normal((b, s, 32, 2)), jnp.float32)
    check_fp8(args, same_tol=5e-4, sink=jnp.asarray(rng.standard_normal(h), jnp.float32), scale=512**-0.5,
              inverse_rope=rope)
