"""Sparse multi-query attention with a per-head sink over two gathered row pools.

One op serves every attention in the project (see DESIGN's "The one attention kernel"):
V4 window / CSA / HCA layers, the DSpark drafter (context ring + draft block) and dense
prefill/verify. Keys and values are the same row (V4's shared 512-wide latent), rows live in
flat pools and each query row lists the rows it may see as int32 indices, `-1` meaning
"nothing here". Returning the log-sum-exp lets partial results over disjoint row sets
(split-K, Helix sequence sharding, one call per pool) be merged exactly, with the sink
applied once after the merge.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark import _ffi
from jax_dspark.ops import _checks, kv_fp8
from jax_dspark.ops.rope import apply_rope


def _pool_size(rows) -> int:
    return rows.nope.shape[0] if kv_fp8.is_fp8_rows(rows) else rows.shape[0]


def _check_pool(prefix: str, rows, idx, b: int, s: int, d: int) -> None:
    if kv_fp8.is_fp8_rows(rows):
        n = kv_fp8.check_kv_pool(f"{prefix}_rows", rows)
        if d != kv_fp8.ROW_DIM:
            _checks.fail(f"{prefix}_rows", f"FP8 rows are {kv_fp8.ROW_DIM} wide but q's D is {d}", d)
        rshape = (n, d)
    else:
        rshape = _checks.check_rank(f"{prefix}_rows", rows, 2, "[N, D]")
        _checks.check_floating(f"{prefix}_rows", rows)
        if rshape[1] != d:
            _checks.fail(f"{prefix}_rows", f"last dim must equal q's D={d}", rshape)
    ishape = _checks.check_rank(f"{prefix}_idx", idx, 3, "[B, S, K]")
    _checks.check_dtype(f"{prefix}_idx", idx, (np.int32,))
    if ishape[:2] != (b, s):
        _checks.fail(f"{prefix}_idx", f"leading dims must be q's (B, S)=({b}, {s})", ishape)
    values = _checks.concrete(idx)
    if values is not None and values.size:
        bad = (values < -1) | (values >= rshape[0])
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            _checks.fail(
                f"{prefix}_idx",
                f"indices must be -1 or in [0, {rshape[0]}); first bad one at {where}",
                int(values[where]),
            )


def _validate(q, main_rows, main_idx, extra_rows, extra_idx, sink, scale, inverse_rope):
    b, s, h, d = _checks.check_rank("q", q, 4, "[B, S, H, D]")
    _checks.check_floating("q", q)
    _check_pool("main", main_rows, main_idx, b, s, d)
    if (extra_rows is None) != (extra_idx is None):
        _checks.fail("extra_rows/extra_idx", "give both or neither", (extra_rows is None, extra_idx is None))
    if extra_rows is not None:
        _check_pool("extra", extra_rows, extra_idx, b, s, d)
    if sink is not None:
        if _checks.shape_of(sink) != (h,):
            _checks.fail("sink", f"shape must be (H,)=({h},)", _checks.shape_of(sink))
        _checks.check_dtype("sink", sink, (np.float32,))
    if isinstance(scale, jax.core.Tracer) or not np.isfinite(scale) or not scale > 0:
        _checks.fail("scale", "must be a finite positive Python float", scale)
    if inverse_rope is not None:
        rshape = _checks.check_rank("inverse_rope", inverse_rope, 4, "[B, S, R/2, 2]")
        if rshape[:2] != (b, s) or rshape[3] != 2 or not 0 < 2 * rshape[2] <= d:
            _checks.fail("inverse_rope", f"expected [B={b}, S={s}, R/2, 2] with R <= {d}", rshape)


def sparse_sink_attention(
    q: jax.Array,
    main_rows: jax.Array,
    main_idx: jax.Array,
    *,
    extra_rows: jax.Array | None = None,
    extra_idx: jax.Array | None = None,
    sink: jax.Array | None = None,
    scale: float,
    inverse_rope: jax.Array | None = None,
    return_lse: bool = False,
):
    """Attention of each query row over the pool rows its index lists name.

    Args:
      q: `[B, S, H, D]` queries (S query rows per request, H heads).
      main_rows: `[N, D]` key=value rows of the main pool, or (D = 512) an
        `ops.kv_fp8.Fp8Rows` pool of N rows (448 e4m3 nope dims with power-of-two scales
        + 64 bf16 RoPE dims), attended exactly as its dequantised bf16 rows would be.
      main_idx: `int32[B, S, K]` rows of `main_rows` each query row sees; `-1` = none.
      extra_rows, extra_idx: an optional second pool `[N2, D]` (or `Fp8Rows`, independently
        of the main pool's form) / `int32[B, S, K2]`.
      sink: `f32[H]` per-head logit added to the softmax denominator only, or None.
      scale: softmax scale applied to `q . k`.
      inverse_rope: `f32[B, S, R/2, 2]` (cos, sin) of each query's position; the output's
        last R dims are rotated back by it. None = no rotation.
      return_lse: also return `f32[B, S, H]` log-sum-exp of the scaled scores (sink
        excluded, `-inf` for an empty list) for `merge_partials`.
    Returns:
      `out [B, S, H, D]` in q's dtype, and `lse` when asked. A query row with no valid
      index gives zeros. Indices outside `[-1, N)` raise ValueError when the index array
      is concrete; under `jit` they are treated as `-1` (masked, never read).
    """
    _validate(q, main_rows, main_idx, extra_rows, extra_idx, sink, scale, inverse_rope)
    fp8 = kv_fp8.is_fp8_rows(main_rows) or kv_fp8.is_fp8_rows(extra_rows)
    if _ffi.use_kernel("sparse_sink_attention") and (not fp8 or _fp8_kernel_enabled()):
        from jax_dspark.ops import _kernels

        return _kernels.sparse_sink_attention(
            q, main_rows, main_idx, extra_rows=extra_rows, extra_idx=extra_idx, sink=sink,
            scale=float(scale), inverse_rope=inverse_rope, return_lse=return_lse,
        )
    return sparse_sink_attention_reference(
        q, main_rows, main_idx, extra_rows=extra_rows, extra_idx=extra_idx, sink=sink,
        scale=float(scale), inverse_rope=inverse_rope, return_lse=return_lse,
    )


def _fp8_kernel_enabled() -> bool:
    """Whether FP8 pools go to a kernel in "auto" dispatch: when the kernel they would get is
    the wgmma one (the default, `_kernels.AUTO_ATTENTION_KERNEL`), or under
    `ops.force("kernel")` or JAX_DSPARK_FP8_ATTENTION=1.

    Why the mma.sync kernel's FP8 instantiation stays opt-in: in two of five H200 runs
    (2026-12-03) a test process stalled for minutes in one of its FP8 tests, which pass in
    seconds otherwise (and passed in the later three runs); the cause is not settled and
    that kernel waits on mbarriers. The wgmma kernel has no mbarriers (cp.async groups,
    `__syncthreads` and named `bar.sync` barriers only), passed every FP8 test, and is
    1.5-2.0x faster on FP8 pools (docs/benchmarks/attention.md).
    """
    from jax_dspark.ops import _kernels

    if _ffi.force_mode() == "kernel" or os.environ.get("JAX_DSPARK_FP8_ATTENTION") == "1":
        return True
    return _kernels.attention_variant(fp8=True) == "wgmma"


def _pool_scores(q32: jax.Array, rows: jax.Array, idx: jax.Array, scale: float):
    """Gathered rows `[B, S, K, D]` (f32) and masked scores `[B, S, H, K]`.

    FP8 pools are gathered first and only the gathered rows dequantised (to bf16, where
    they are exact, then f32), which equals gathering from the dequantised pool.
    """
    valid = (idx >= 0) & (idx < _pool_size(rows))
    safe = jnp.where(valid, idx, 0)
    if kv_fp8.is_fp8_rows(rows):
        gathered = kv_fp8.dequantize_kv_rows(kv_fp8.take_kv_rows(rows, safe)).astype(jnp.float32)
    else:
        gathered = jnp.take(rows, safe, axis=0).astype(jnp.float32)
    scores = jnp.einsum("bshd,bskd->bshk", q32, gathered, precision=jax.lax.Precision.HIGHEST) * scale
    return gathered, jnp.where(valid[:, :, None, :], scores, -jnp.inf)


def sparse_sink_attention_reference(
    q, main_rows, main_idx, *, extra_rows=None, extra_idx=None, sink=None, scale,
    inverse_rope=None, return_lse=False,
):
    """Pure-JAX reference (float32 gather + einsum); same contract, no validation."""
    q32 = q.astype(jnp.float32)
    values, scores = _pool_scores(q32, main_rows, main_idx, scale)
    if extra_rows is not None:
        v2, s2 = _pool_scores(q32, extra_rows, extra_idx, scale)
        values = jnp.concatenate([values, v2], axis=2)
        scores = jnp.concatenate([scores, s2], axis=-1)
    row_max = jnp.max(scores, axis=-1) if scores.shape[-1] else jnp.full(scores.shape[:-1], -jnp.inf)
    if sink is not None:
        sink_b = jnp.broadcast_to(sink.astype(jnp.float32)[None, None, :], row_max.shape)
        shift = jnp.maximum(row_max, sink_b)
    else:
        shift = row_max
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    p = jnp.exp(scores - shift[..., None])
    mass = jnp.sum(p, axis=-1)
    denom = mass + (jnp.exp(sink_b - shift) if sink is not None else 0.0)
    out = jnp.einsum("bshk,bskd->bshd", p, values, precision=jax.lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    if inverse_rope is not None:
        out = apply_rope(out, inverse_rope[:, :, None], inverse=True)
    out = out.astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(mass > 0, jnp.log(jnp.where(mass > 0, mass, 1.0)) + shift, -jnp.inf)
    return out, lse


def merge_partials(
    outs: Sequence[jax.Array], lses: Sequence[jax.Array], sink: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Exactly combine attention results computed over disjoint row sets.

    Each part must have been computed WITHOUT a sink (its softmax normalised over its own
    rows only); the sink is applied once here, as `exp(lse) / (exp(lse) + exp(sink))`.
    Inverse RoPE is linear per head, so parts may carry it already.

    Args:
      outs: P arrays `[B, S, H, D]`.
      lses: P arrays `f32[B, S, H]` (`-inf` for a part that saw no row).
      sink: `f32[H]` or None.
    Returns:
      `(out [B, S, H, D] in outs[0].dtype, lse f32[B, S, H])` over the union of rows.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        _checks.fail("outs/lses", "need the same positive number of parts", (len(outs), len(lses)))
    shape = _checks.check_rank("outs[0]", outs[0], 4, "[B, S, H, D]")
    for i, (o, l) in enumerate(zip(outs, lses)):
        if _checks.shape_of(o) != shape:
            _checks.fail(f"outs[{i}]", f"shape must match outs[0] {shape}", _checks.shape_of(o))
        if _checks.shape_of(l) != shape[:3]:
            _checks.fail(f"lses[{i}]", f"shape must be {shape[:3]}", _checks.shape_of(l))
    if sink is not None and _checks.shape_of(sink) != (shape[2],):
        _checks.fail("sink", f"shape must be (H,)=({shape[2]},)", _checks.shape_of(sink))
    lse = jnp.stack([l.astype(jnp.float32) for l in lses])
    top = jnp.max(lse, axis=0)
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lse - safe_top)  # 0 for empty parts
    total = jnp.sum(weights, axis=0)
    merged_lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + safe_top, -jnp.inf)
    norm = weights / jnp.where(total > 0, total, 1.0)
    out = sum(n[..., None] * o.astype(jnp.float32) for n, o in zip(norm, outs))
    if sink is not None:
        keep = jax.nn.sigmoid(merged_lse - sink.astype(jnp.float32)[None, None, :])
        out = out * jnp.where(jnp.isfinite(merged_lse), keep, 0.0)[..., None]
    return out.astype(outs[0].dtype), merged_lse
