"""FFI calls of the mixture-of-experts CUDA kernels (csrc/moe/, ffi/moe_handlers.cc).

Called by `jax_dspark.ops.moe` only after `_ffi.use_kernel(...)` said the kernels are
registered and the backend is a GPU, and after the op validated its inputs. What the
kernels do not cover (dtypes other than bf16, hidden or intermediate sizes that are not
multiples of 8, more than 4096 experts) falls back to the pure-JAX reference here, so a
caller never has to know the kernel's limits.

Design notes (docs/moe_kernels.md): one `moe_experts` custom call runs permute -> gather ->
grouped FC1 -> clamped SwiGLU -> grouped FC2 -> weighted un-permute; its intermediates live
in a workspace that is a second, XLA-allocated output (its address is then stable when XLA
captures the call in a CUDA graph, which a per-call scratch allocation would not promise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark import _ffi
from jax_dspark.ops import moe as _moe

EXPERTS_TARGET = "jax_dspark_moe_experts"
EXPERTS_FP8_TARGET = "jax_dspark_moe_experts_fp8"
ROUTE_TARGET = "jax_dspark_moe_route"
HASH_ROUTE_TARGET = "jax_dspark_moe_hash_route"

MAX_EXPERTS = 4096  # kMoeMaxExperts: permute keeps two counters per expert in shared memory
ROUTE_MAX_EXPERTS = 1024  # kMoeRouteMaxExperts: E / 32 scores per lane in registers
ROUTE_MAX_K = 32

_SCORE_KINDS = {"sqrt_softplus": 0, "sigmoid": 1, "softmax": 2, "identity": 3}
_SLAB = 256  # csrc/moe/experts.cu: every workspace array starts on 256 bytes
_GEMM_ARRAY = 128  # csrc/moe/grouped_gemm.cu: group arrays start on 128 bytes
_MAX_SMS = 1024  # bound on multiprocessors; the GEMM keeps 512 bytes of tensor maps per SM


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def experts_workspace_bytes(tokens: int, k: int, experts: int, hidden: int, inter: int) -> int:
    """Upper bound of the bytes `run_moe_experts` needs (the handler checks it exactly).

    Mirrors `carve` in csrc/moe/experts.cu: offsets, two row maps, xp/y [P, d], h [P, 2I],
    a [P, I] with P = tokens * k, plus the grouped GEMM's group arrays (7 per expert, at most
    16 bytes an entry) and per-SM tensor maps, plus alignment slack.
    """
    p = tokens * k
    gemm = 7 * _round(16 * experts, _GEMM_ARRAY) + 512 * _MAX_SMS + 2 * _GEMM_ARRAY
    parts = [4 * (experts + 1), 4 * p, 4 * p, 2 * p * hidden, 2 * p * 2 * inter, 2 * p * inter, gemm]
    return sum(_round(b, _SLAB) for b in parts) + _SLAB


def experts_supported(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> bool:
    """Whether the BF16 kernel covers these operands (else the reference runs)."""
    e, d, two_i = w_gate_up.shape
    return (
        x.dtype == jnp.bfloat16
        and w_gate_up.dtype == jnp.bfloat16
        and w_down.dtype == jnp.bfloat16
        and d % 8 == 0
        and (two_i // 2) % 8 == 0
        and 1 <= e <= MAX_EXPERTS
    )


def moe_experts(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    limit: float | None = None,
) -> jax.Array:
    """Routed experts on the GPU; same contract as `ops.moe_experts` (inputs validated there).

    Out-of-range expert ids (possible only under jit, where the op cannot see the values)
    contribute nothing, as in the reference; the kernel checks every id before using it.
    """
    if not experts_supported(x, w_gate_up, w_down):
        return _moe.moe_experts_reference(x, ids, weights, w_gate_up, w_down, limit=limit)
    e, _, two_i = w_gate_up.shape
    ws = experts_workspace_bytes(x.shape[0], ids.shape[1], e, x.shape[1], two_i // 2)
    return _experts_call(EXPERTS_TARGET, ws, x, ids, weights, (w_gate_up, w_down), limit)


def _experts_call(target: str, ws: int, x, ids, weights, expert_operands: tuple, limit) -> jax.Array:
    """One experts custom call: `(x, ids, weights, *expert_operands) -> (out [T, d], workspace)`."""
    t, d = x.shape
    if t == 0:
        return jnp.zeros((0, d), x.dtype)
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((t, d), x.dtype), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
        vmap_method="sequential",
    )
    out, _ = call(
        x,
        ids.astype(jnp.int32),
        weights.astype(jnp.float32),
        *expert_operands,
        limit=np.float32(0.0 if limit is None else limit),
    )
    return out


def _route_supported(scores: jax.Array, k: int) -> bool:
    e = scores.shape[1]
    return scores.dtype in (jnp.float32, jnp.bfloat16) and e <= ROUTE_MAX_EXPERTS and k <= ROUTE_MAX_K


def _route_outputs(t: int, k: int):
    return (jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32))


def route(
    logits: jax.Array,
    k: int,
    *,
    kind: str = "sqrt_softplus",
    bias: jax.Array | None = None,
    route_scale: float = 1.0,
    renormalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Fused router: scores from `logits [T, E]` (f32 or bf16), bias-steered top-k, weights.

    Equals `topk_route(router_scores(logits, kind), k, bias=..., ...)` in one launch (one warp
    per token). `kind="identity"` takes `logits` as the scores. Returns `weights f32[T, k]`,
    `ids int32[T, k]`.
    """
    if kind not in _SCORE_KINDS:
        raise ValueError(f"kind: must be one of {sorted(_SCORE_KINDS)} (got {kind!r})")
    t, e = logits.shape
    if not _route_supported(logits, k):
        scores = logits.astype(jnp.float32) if kind == "identity" else _moe.router_scores(logits, kind)
        return _moe.topk_route(scores, k, bias=bias, route_scale=route_scale, renormalize=renormalize)
    has_bias = bias is not None
    bias_arg = bias.astype(jnp.float32) if has_bias else jnp.zeros((e,), jnp.float32)
    call = jax.ffi.ffi_call(ROUTE_TARGET, _route_outputs(t, k), vmap_method="sequential")
    return tuple(
        call(
            logits,
            bias_arg,
            score_kind=np.int32(_SCORE_KINDS[kind]),
            renormalize=np.int32(renormalize),
            route_scale=np.float32(route_scale),
            has_bias=np.int32(has_bias),
        )
    )


def topk_route(
    scores: jax.Array,
    k: int,
    *,
    bias: jax.Array | None = None,
    route_scale: float = 1.0,
    renormalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Kernel form of `ops.topk_route` (scores already computed)."""
    return route(scores, k, kind="identity", bias=bias, route_scale=route_scale, renormalize=renormalize)


def hash_route(
    scores: jax.Array,
    token_ids: jax.Array,
    table: jax.Array,
    *,
    kind: str = "identity",
    route_scale: float = 1.0,
    renormalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Kernel form of `ops.hash_route`; `kind` other than "identity" fuses the scoring.

    Token ids outside the table are clipped into it (as the reference does); table entries
    outside [0, E) get weight 0 and are passed through, so `moe_experts` drops them.
    """
    if kind not in _SCORE_KINDS:
        raise ValueError(f"kind: must be one of {sorted(_SCORE_KINDS)} (got {kind!r})")
    t, _ = scores.shape
    k = table.shape[1]
    if not _route_supported(scores, k):
        s = scores.astype(jnp.float32) if kind == "identity" else _moe.router_scores(scores, kind)
        return _moe.hash_route(s, token_ids, table, route_scale=route_scale, renormalize=renormalize)
    call = jax.ffi.ffi_call(HASH_ROUTE_TARGET, _route_outputs(t, k), vmap_method="sequential")
    return tuple(
        call(
            scores,
            token_ids.astype(jnp.int32),
            table.astype(jnp.int32),
            score_kind=np.int32(_SCORE_KINDS[kind]),
            renormalize=np.int32(renormalize),
            route_scale=np.float32(route_scale),
        )
    )


# ---- FP8 experts (csrc/moe/experts_fp8.cu, grouped_gemm_fp8.cu) ---------------------------

FP8_BLOCK = 128  # kMoeFp8Block


def experts_fp8_available() -> bool:
    """Whether the FP8 experts kernel can run here (at trace time); raises under force("kernel") if not."""
    return _ffi.use_kernel("moe_experts_fp8")


def experts_fp8_status() -> str:
    """"registered", or why the FP8 experts kernel cannot run here."""
    return _ffi.kernel_report().get("moe_experts_fp8", "unknown")


def experts_fp8_workspace_bytes(tokens: int, k: int, experts: int, hidden: int, inter: int) -> int:
    """Upper bound of the bytes `run_moe_experts_fp8` needs (the handler checks it exactly).

    Mirrors `carve` in csrc/moe/experts_fp8.cu: offsets, two row maps, xq e4m3 [P, d] and its
    f32 scales [P, d/128], h bf16 [P, 2I], aq e4m3 [P, I] and scales [P, I/128], y bf16
    [P, d], the f32 weight scales of both matrices, and the FP8 grouped GEMM's 11 group
    arrays (at most 32 bytes an entry) plus per-SM tensor maps (bounded by 1 KiB an SM).
    """
    p = tokens * k
    db, ib = hidden // FP8_BLOCK, inter // FP8_BLOCK
    gemm = 11 * _round(32 * experts, _GEMM_ARRAY) + 1024 * _MAX_SMS + 2 * _GEMM_ARRAY
    parts = [
        4 * (experts + 1), 4 * p, 4 * p,
        p * hidden, 4 * p * db,
        2 * p * 2 * inter,
        p * inter, 4 * p * ib,
        2 * p * hidden,
        4 * experts * 2 * ib * db, 4 * experts * db * ib,
        gemm,
    ]
    return sum(_round(b, _SLAB) for b in parts) + _SLAB


def experts_fp8_supported(x: jax.Array, w_gate_up, w_down) -> bool:
    """Whether the FP8 kernel covers these operands (else the FP8 reference runs)."""
    e, two_i, d = w_gate_up.values.shape
    return (
        x.dtype == jnp.bfloat16
        and w_gate_up.values.dtype == jnp.float8_e4m3fn
        and w_down.values.dtype == jnp.float8_e4m3fn
        and d % FP8_BLOCK == 0
        and (two_i // 2) % FP8_BLOCK == 0
        and 1 <= e <= MAX_EXPERTS
    )


def moe_experts_fp8(x, ids, weights, w_gate_up, w_down, *, limit: float | None = None) -> jax.Array:
    """FP8 routed experts on the GPU; same contract as `moe_fp8.moe_experts_fp8` (validated there)."""
    from jax_dspark.ops import moe_fp8

    if not experts_fp8_supported(x, w_gate_up, w_down):
        return moe_fp8.moe_experts_fp8_reference(x, ids, weights, w_gate_up, w_down, limit=limit)
    e, two_i, _ = w_gate_up.values.shape
    ws = experts_fp8_workspace_bytes(x.shape[0], ids.shape[1], e, x.shape[1], two_i // 2)
    operands = (w_gate_up.values, w_gate_up.exps, w_down.values, w_down.exps)
    return _experts_call(EXPERTS_FP8_TARGET, ws, x, ids, weights, operands, limit)
