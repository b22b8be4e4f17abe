"""`jax.ffi.ffi_call` wrappers of the CUDA kernels (jax_dspark/_ffi.py registers them).

The public ops validate their inputs and call these only when `_ffi.use_kernel(name)` is
true. A wrapper still checks what its kernel supports (dtypes, sizes) and runs the op's
pure-JAX reference otherwise, so `use_kernel` can stay a per-op switch rather than a
per-shape one; under `ops.force("kernel")` an unsupported call raises instead.

Kernel-only details live here and nowhere else: how the split-K count is chosen (the
workspace is an explicit output so XLA owns it), how RoPE tables are laid out per row group,
which dummies stand in for absent optional inputs, and each op's `vmap_method`.
"""

from __future__ import annotations

import contextlib
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark import _ffi
from jax_dspark.ops import kv_fp8

HEAD_DIM = 512  # the attention kernel's row width (448 nope + 64 rope dims)
HEADS_PER_CTA = 64
KEYS_PER_TILE = 64
MAX_SPLITS = 32
PREP_MAX_DIM = 2048


def _unsupported(op: str, reason: str) -> None:
    if _ffi.force_mode() == "kernel":
        raise ValueError(f"{op}: the CUDA kernel cannot run this call ({reason}) and ops.force('kernel') is on")


# ------------------------------------------------------------------------------------------
# Sparse sink attention
# ------------------------------------------------------------------------------------------


def choose_splits(batch: int, seq: int, heads: int, k_total: int, num_sms: int) -> int:
    """Split-K count for one call: fill the GPU without paying for needless partials.

    One CTA (about 205 KB of shared memory, so one per SM) handles 64 heads of one query
    row over a range of 64-row tiles. The estimate is waves x (tiles per CTA + 1 for the Q
    load and epilogue) plus a small charge per split for the partials and the combine; only
    counts that leave no split empty are considered.
    """
    tiles = -(-k_total // KEYS_PER_TILE)
    if tiles <= 1:
        return 1
    base = -(-heads // HEADS_PER_CTA) * seq * batch
    best, best_cost = 1, math.inf
    for splits in range(1, min(MAX_SPLITS, tiles) + 1):
        per_split = -(-tiles // splits)
        if -(-tiles // per_split) != splits:
            continue
        waves = -(-base * splits // num_sms)
        cost = waves * (per_split + 1) + (0.25 * splits if splits > 1 else 0.0)
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


def attention_workspace_floats(batch: int, seq: int, heads: int, splits: int) -> int:
    """f32 elements of split-K partials: outputs `[splits, B*S*H, D]` then lse `[splits, B*S*H]`."""
    return 0 if splits <= 1 else splits * batch * seq * heads * (HEAD_DIM + 1)


def attention_unsupported_reason(q, main_rows, extra_rows, inverse_rope) -> str | None:
    """Why the kernel cannot take these operands (None when it can)."""
    if q.dtype != jnp.bfloat16:
        return f"q dtype {q.dtype} (kernel: bfloat16)"
    if q.shape[-1] != HEAD_DIM:
        return f"head dim {q.shape[-1]} (kernel: {HEAD_DIM})"
    for name, rows in (("main_rows", main_rows), ("extra_rows", extra_rows)):
        if rows is not None and not kv_fp8.is_fp8_rows(rows) and rows.dtype != jnp.bfloat16:
            return f"{name} dtype {rows.dtype} (kernel: bfloat16 or ops.kv_fp8.Fp8Rows)"
    if q.shape[0] > 65535:
        return f"batch {q.shape[0]} > 65535"
    return None


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
    """Kernel path of `ops.sparse_sink_attention` (same arguments, same results).

    Shapes: q `[B, S, H, 512]` bf16, rows `[N, 512]` bf16 or `kv_fp8.Fp8Rows` (each pool
    independently; an FP8 pool goes to the handler as its three arrays with `main_fp8` /
    `extra_fp8` set, a bf16 pool with two empty placeholders), idx `int32[B, S, K]`, sink
    `f32[H]`, inverse_rope `f32[B, S, R/2, 2]`. Any H works (heads are processed 64 at a
    time; 64 and 128 are the tuned cases). vmap runs the kernel once per batch element
    (`vmap_method="sequential"`): the pools are shared operands the kernel cannot batch.
    """
    reason = attention_unsupported_reason(q, main_rows, extra_rows, inverse_rope)
    if reason is not None:
        _unsupported("sparse_sink_attention", reason)
        from jax_dspark.ops.attention import sparse_sink_attention_reference

        return sparse_sink_attention_reference(
            q, main_rows, main_idx, extra_rows=extra_rows, extra_idx=extra_idx, sink=sink,
            scale=scale, inverse_rope=inverse_rope, return_lse=return_lse,
        )
    b, s, h, d = q.shape
    if extra_rows is None:
        extra_rows = jnp.zeros((0, d), jnp.bfloat16)
        extra_idx = jnp.zeros((b, s, 0), jnp.int32)
    main_rows, main_rope, main_scale, main_fp8 = _pool_operands(main_rows)
    extra_rows, extra_rope, extra_scale, extra_fp8 = _pool_operands(extra_rows)
    k_total = main_idx.shape[-1] + extra_idx.shape[-1]
    splits = choose_splits(b, s, h, k_total, _ffi.num_sms())
    rope_dim = 0 if inverse_rope is None else 2 * inverse_rope.shape[2]
    out_types = (
        jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, s, h), jnp.float32),
        jax.ShapeDtypeStruct((max(1, attention_workspace_floats(b, s, h, splits)),), jnp.float32),
    )
    call = jax.ffi.ffi_call(attention_target(main_fp8 or extra_fp8), out_types, vmap_method="sequential")
    out, lse, _ = call(
        q,
        main_rows,
        main_idx.astype(jnp.int32),
        extra_rows,
        extra_idx.astype(jnp.int32),
        jnp.zeros((0,), jnp.float32) if sink is None else sink.astype(jnp.float32),
        jnp.zeros((0,), jnp.float32) if inverse_rope is None else inverse_rope.astype(jnp.float32),
        main_rope,
        main_scale,
        extra_rope,
        extra_scale,
        scale=np.float32(scale),
        num_splits=np.int32(splits),
        has_sink=np.int32(sink is not None),
        rope_dim=np.int32(rope_dim),
        main_fp8=np.int32(main_fp8),
        extra_fp8=np.int32(extra_fp8),
    )
    return (out, lse) if return_lse else out


ATTENTION_KERNEL_ENV = "JAX_DSPARK_ATTENTION_KERNEL"
# Attention kernel variants: switch value -> (name in `_ffi.KERNELS`, FFI target).
ATTENTION_KERNELS = {
    "mma": ("sparse_sink_attention", "jax_dspark_sparse_sink_attention"),
    "wgmma": ("sparse_sink_attention_wgmma", "jax_dspark_sparse_sink_attention_wgmma"),
}
# What "auto" (the default) picks, by whether a pool holds FP8 rows: the faster kernel of
# each kind on the H200 (docs/benchmarks/attention.md, both kernels timed in one run at
# 6e48b89: wgmma is 1.2-1.6x faster than mma.sync on bf16 pools and 1.5-2.0x on FP8 pools).
AUTO_ATTENTION_KERNEL = {False: "wgmma", True: "wgmma"}


def _attention_variant(name: str, what: str) -> str:
    if name != "auto" and name not in ATTENTION_KERNELS:
        raise ValueError(f"{what}: must be 'auto' or one of {sorted(ATTENTION_KERNELS)} (got {name!r})")
    return name


@contextlib.contextmanager
def attention_kernel(name: str):
    """Within the block, traced attention calls use kernel `name` ("auto", "mma" or
    "wgmma"), as `JAX_DSPARK_ATTENTION_KERNEL` would select it; the previous setting comes
    back after."""
    _attention_variant(name, "name")
    before = os.environ.get(ATTENTION_KERNEL_ENV)
    os.environ[ATTENTION_KERNEL_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ATTENTION_KERNEL_ENV, None)
        else:
            os.environ[ATTENTION_KERNEL_ENV] = before


def attention_variant(fp8: bool = False) -> str:
    """Kernel variant ("mma" or "wgmma") for an attention call whose pools hold FP8 rows
    (`fp8`) or not (read at trace time).

    `JAX_DSPARK_ATTENTION_KERNEL` = "auto" (default: `AUTO_ATTENTION_KERNEL`, wgmma for
    bf16 and FP8 pools, falling back to mma.sync where the wgmma kernel is not registered),
    "mma" or "wgmma" (that kernel for every call; asking for one that is not registered
    raises with the reason). Both kernels compute the same contract and are
    tested against the same reference. Being read when a call is traced, the setting is
    baked into jit's cached traces: set it before the first call (or trace new functions
    after changing it, as the benchmark does).
    """
    choice = _attention_variant(os.environ.get(ATTENTION_KERNEL_ENV, "auto"), ATTENTION_KERNEL_ENV)
    if choice == "mma":  # its availability is the op's own dispatch decision
        return choice
    auto = choice == "auto"
    if auto:
        choice = AUTO_ATTENTION_KERNEL[bool(fp8)]
    reason = _ffi.kernel_report().get(ATTENTION_KERNELS[choice][0], "unknown kernel")
    if reason == _ffi.REGISTERED:
        return choice
    if auto:
        return "mma"
    raise RuntimeError(f"{ATTENTION_KERNEL_ENV}={choice} but the {choice} kernel is not available: {reason}")


def attention_target(fp8: bool = False) -> str:
    """FFI target of `attention_variant(fp8)`."""
    return ATTENTION_KERNELS[attention_variant(fp8)][1]


def _pool_operands(rows):
    """`(rows, rope, scale, is_fp8)` handler operands of one pool.

    An FP8 pool passes its e4m3 `[N, 448]` nope array as the rows operand; a bf16 pool
    passes empty placeholders for the RoPE / scale operands (the handler ignores them).
    """
    if kv_fp8.is_fp8_rows(rows):
        return rows.nope, rows.rope, rows.scale, True
    return rows, jnp.zeros((0, kv_fp8.ROPE_DIM), jnp.bfloat16), jnp.zeros((0, kv_fp8.SCALE_BYTES), jnp.uint8), False


# ------------------------------------------------------------------------------------------
# RMSNorm + RoPE (+ FP8) prep
# ------------------------------------------------------------------------------------------


from jax_dspark.ops.prep import rms_norm_rope_reference  # noqa: E402  (the fallback)


def _check_prep(x, weight, freqs, eps, fp8_block) -> None:
    shape = tuple(np.shape(x))
    if not shape:
        raise ValueError(f"x: needs at least one axis (got shape {shape!r})")
    d = shape[-1]
    if weight is not None and tuple(np.shape(weight)) != (d,):
        raise ValueError(f"weight: shape must be ({d},) (got {tuple(np.shape(weight))!r})")
    if freqs is not None:
        fshape = tuple(np.shape(freqs))
        if len(fshape) < 2 or fshape[-1] != 2 or 2 * fshape[-2] > d:
            raise ValueError(f"freqs: expected [..., R/2, 2] with R <= {d} (got {fshape!r})")
        try:
            ok = np.broadcast_shapes(fshape[:-2], shape[:-1]) == shape[:-1]
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"freqs: leading dims must broadcast to x's {shape[:-1]} (got {fshape!r})")
    if fp8_block is not None and (fp8_block not in (64, 128) or d % fp8_block):
        raise ValueError(f"fp8_block: must be None, 64 or 128 and divide D={d} (got {fp8_block!r})")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0 (got {eps!r})")


def prep_unsupported_reason(x, freqs, fp8_block) -> str | None:
    d = x.shape[-1]
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        return f"x dtype {x.dtype} (kernel: bfloat16 or float32)"
    if d % 8 or d > PREP_MAX_DIM:
        return f"last dim {d} (kernel: a multiple of 8, at most {PREP_MAX_DIM})"
    rope_dim = 0 if freqs is None else 2 * freqs.shape[-2]
    if rope_dim % 8:
        return f"rope dim {rope_dim} (kernel: a multiple of 8)"
    return None


def _freqs_per_row_group(freqs: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """freqs `[..., R/2, 2]` (broadcasting against `lead`) as `[F, R/2, 2]`, one entry per
    group of consecutive rows of `x.reshape(-1, D)`.

    Trailing lead axes over which freqs is broadcast (typically the heads) become the group,
    so a `[B, S, R/2, 2]` table for `x [B, S, H, D]` is passed as is, not tiled H times.
    """
    half = freqs.shape[-2]
    fl = (1,) * (len(lead) - (freqs.ndim - 2)) + tuple(freqs.shape[:-2])
    keep = len(lead)
    while keep > 0 and fl[keep - 1] == 1:
        keep -= 1
    f = freqs.astype(jnp.float32).reshape(fl[:keep] + (half, 2))
    f = jnp.broadcast_to(f, tuple(lead[:keep]) + (half, 2))
    return f.reshape(-1, half, 2)


def rms_norm_rope(
    x: jax.Array,
    weight: jax.Array | None = None,
    freqs: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    inverse: bool = False,
    fp8_block: int | None = None,
):
    """Fused RMSNorm (optional weight) -> interleaved RoPE on the last R dims -> optional FP8.

    Args:
      x: `[..., D]` bf16 or f32 (kernel: D % 8 == 0, D <= 2048).
      weight: `[D]` or None.
      freqs: `[..., R/2, 2]` (cos, sin) broadcasting against `x.shape[:-1]`, or None (no RoPE).
      eps: RMSNorm epsilon (> 0).
      inverse: rotate by the negative angle.
      fp8_block: None (output in x.dtype), 64 or 128 (e4m3 values + UE8M0 exponents).
    Returns:
      `y [..., D]` in x.dtype, or `(values f8e4m3fn[..., D], exps uint8[..., D/block])`;
      equal to `rms_norm_rope_reference` (same intermediate roundings to x.dtype).

    vmap: `broadcast_all`; the handler indexes weight and freqs per group of consecutive
    rows, which is exactly what broadcasting a leading batch axis produces.
    """
    _check_prep(x, weight, freqs, eps, fp8_block)
    reason = prep_unsupported_reason(x, freqs, fp8_block)
    if reason is not None:
        _unsupported("rms_norm_rope", reason)
        return rms_norm_rope_reference(x, weight, freqs, eps=eps, inverse=inverse, fp8_block=fp8_block)
    d = x.shape[-1]
    lead = tuple(x.shape[:-1])
    w = jnp.zeros((0,), jnp.float32) if weight is None else weight.astype(jnp.float32)  # empty: no weight
    if freqs is None:
        rope_dim, f = 0, jnp.zeros((1, 0, 2), jnp.float32)
    else:
        rope_dim, f = 2 * freqs.shape[-2], _freqs_per_row_group(freqs, lead)
    attrs = dict(eps=np.float32(eps), inverse=np.int32(bool(inverse)), rope_dim=np.int32(rope_dim))
    if fp8_block is None:
        call = jax.ffi.ffi_call(
            "jax_dspark_rms_norm_rope", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="broadcast_all"
        )
        return call(x, w, f, **attrs)
    out_types = (
        jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct(lead + (d // fp8_block,), jnp.uint8),
    )
    call = jax.ffi.ffi_call("jax_dspark_rms_norm_rope_fp8", out_types, vmap_method="broadcast_all")
    values, exps = call(x, w, f, fp8_block=np.int32(fp8_block), **attrs)
    return values, exps
