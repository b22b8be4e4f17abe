"""Mixture-of-experts pieces: router scores, top-k / hash routing, clamped SwiGLU, experts.

DeepSeek-V4 scores experts with sqrt(softplus(logits)), picks the top-k of
`scores + bias` (the bias only steers selection; it is learned load balancing), and weights
the chosen experts by their unbiased scores renormalised to sum 1 times a route scale. Its
first layers skip the learned choice and read the experts from a frozen token-id table.
The routed computation groups (token, slot) pairs by expert so each expert runs one
matmul over a contiguous block of rows (`jax.lax.ragged_dot` here; a grouped-GEMM kernel on
GPU), then scatters the weighted rows back to token order.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark import _ffi
from jax_dspark.ops import _checks

ScoreKind = Literal["sqrt_softplus", "sigmoid", "softmax"]

# (mesh, axis) while `expert_parallel` is active: `moe_experts` then runs expert-parallel
# through `jax_dspark.parallel.moe_experts_ep`, so models need no code change to use EP.
_EXPERT_PARALLEL: contextvars.ContextVar = contextvars.ContextVar("expert_parallel", default=None)


@contextlib.contextmanager
def expert_parallel(mesh, axis: str = "expert"):
    """Within this context (at trace time) `moe_experts` splits experts over `mesh[axis]`."""
    if axis not in mesh.shape:
        _checks.fail("axis", f"not a mesh axis {tuple(mesh.shape)}", axis)
    token = _EXPERT_PARALLEL.set((mesh, axis))
    try:
        yield
    finally:
        _EXPERT_PARALLEL.reset(token)


def router_scores(logits: jax.Array, kind: ScoreKind = "sqrt_softplus") -> jax.Array:
    """`f32[T, E]` expert scores from router logits `[T, E]`."""
    _checks.check_rank("logits", logits, 2, "[T, E]")
    l = logits.astype(jnp.float32)
    if kind == "sqrt_softplus":
        return jnp.sqrt(jax.nn.softplus(l))
    if kind == "sigmoid":
        return jax.nn.sigmoid(l)
    if kind == "softmax":
        return jax.nn.softmax(l, axis=-1)
    _checks.fail("kind", "must be 'sqrt_softplus', 'sigmoid' or 'softmax'", kind)


def _weights_from(scores: jax.Array, ids: jax.Array, renormalize: bool, route_scale: float) -> jax.Array:
    w = jnp.take_along_axis(scores.astype(jnp.float32), ids, axis=-1)
    if renormalize:
        w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-20)
    return w * route_scale


def topk_route(
    scores: jax.Array,
    k: int,
    *,
    bias: jax.Array | None = None,
    route_scale: float = 1.0,
    renormalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Bias-steered top-k selection with unbiased weights.

    Args:
      scores: `f32[T, E]` from `router_scores`.
      k: experts per token, `1 <= k <= E`.
      bias: `f32[E]` added for selection only (V4's `e_score_correction_bias`), or None.
      route_scale: multiplies the (renormalised) weights (V4: 1.5 Flash, 2.5 Pro).
    Returns:
      `weights f32[T, k]`, `ids int32[T, k]` (ordered by biased score, descending; ties
      go to the lower expert id).
    """
    t, e = _checks.check_rank("scores", scores, 2, "[T, E]")
    if not (isinstance(k, int) and 1 <= k <= e):
        _checks.fail("k", f"must be an int in [1, E={e}]", k)
    if bias is not None and _checks.shape_of(bias) != (e,):
        _checks.fail("bias", f"shape must be (E,)=({e},)", _checks.shape_of(bias))
    if _ffi.use_kernel("moe_route"):
        from jax_dspark.ops import _moe_kernels

        return _moe_kernels.topk_route(scores, k, bias=bias, route_scale=route_scale, renormalize=renormalize)
    select = scores.astype(jnp.float32)
    if bias is not None:
        select = select + bias.astype(jnp.float32)
    _, ids = jax.lax.top_k(select, k)
    ids = ids.astype(jnp.int32)
    return _weights_from(scores, ids, renormalize, route_scale), ids


def hash_route(
    scores: jax.Array,
    token_ids: jax.Array,
    table: jax.Array,
    *,
    route_scale: float = 1.0,
    renormalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Experts from a frozen `token id -> experts` table; weights still from the scores.

    Args:
      scores: `f32[T, E]`.
      token_ids: `int32[T]` input token of each row.
      table: `int32[V, k]` experts per vocabulary entry (V4's `tid2eid`).
    Returns:
      `weights f32[T, k]`, `ids int32[T, k]`.
    """
    t, e = _checks.check_rank("scores", scores, 2, "[T, E]")
    if _checks.shape_of(token_ids) != (t,):
        _checks.fail("token_ids", f"shape must be (T,)=({t},)", _checks.shape_of(token_ids))
    _checks.check_dtype("token_ids", token_ids, (np.int32,))
    v, _ = _checks.check_rank("table", table, 2, "[V, k]")
    _checks.check_dtype("table", table, (np.int32,))
    tok = _checks.concrete(token_ids)
    if tok is not None and tok.size and (tok.min() < 0 or tok.max() >= v):
        _checks.fail("token_ids", f"must be in [0, V={v})", (int(tok.min()), int(tok.max())))
    tab = _checks.concrete(table)
    if tab is not None and tab.size and (tab.min() < 0 or tab.max() >= e):
        _checks.fail("table", f"expert ids must be in [0, E={e})", (int(tab.min()), int(tab.max())))
    if _ffi.use_kernel("moe_route"):
        from jax_dspark.ops import _moe_kernels

        return _moe_kernels.hash_route(scores, token_ids, table, route_scale=route_scale, renormalize=renormalize)
    ids = jnp.take(table, jnp.clip(token_ids, 0, v - 1), axis=0)
    return _weights_from(scores, ids, renormalize, route_scale), ids


def swiglu(gate: jax.Array, up: jax.Array, *, limit: float | None = None) -> jax.Array:
    """`silu(min(gate, limit)) * clip(up, -limit, limit)` in f32, returned in gate's dtype.

    The clamp (V4: 10) bounds activations of rarely-used experts; `limit=None` is plain
    SwiGLU. The gate is clamped from above only, as DeepSeek's reference does.
    """
    if _checks.shape_of(gate) != _checks.shape_of(up):
        _checks.fail("up", f"shape must equal gate's {_checks.shape_of(gate)}", _checks.shape_of(up))
    if limit is not None and not limit > 0:
        _checks.fail("limit", "must be > 0 or None", limit)
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    if limit is not None:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return (jax.nn.silu(g) * u).astype(gate.dtype)


def mlp_swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, limit: float | None = None) -> jax.Array:
    """Dense SwiGLU MLP (shared expert / dense FFN): `x[..., d]`, `w_gate_up[d, 2I]`, `w_down[I, d]`."""
    d = _checks.shape_of(x)[-1]
    d2, two_i = _checks.check_rank("w_gate_up", w_gate_up, 2, "[d, 2I]")
    if d2 != d or two_i % 2:
        _checks.fail("w_gate_up", f"expected [d={d}, 2I]", (d2, two_i))
    if _checks.shape_of(w_down) != (two_i // 2, d):
        _checks.fail("w_down", f"shape must be (I, d)=({two_i // 2}, {d})", _checks.shape_of(w_down))
    h = jnp.dot(x, w_gate_up.astype(x.dtype), preferred_element_type=jnp.float32)
    a = swiglu(h[..., : two_i // 2], h[..., two_i // 2 :], limit=limit).astype(x.dtype)
    return jnp.dot(a, w_down.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def validate_tokens(x, ids, weights) -> int:
    """Checks `x [T, d]` floating, `ids int32[T, k]`, `weights [T, k]`; returns d."""
    t, d = _checks.check_rank("x", x, 2, "[T, d]")
    _checks.check_floating("x", x)
    ishape = _checks.check_rank("ids", ids, 2, "[T, k]")
    _checks.check_dtype("ids", ids, (np.int32,))
    if ishape[0] != t:
        _checks.fail("ids", f"first dim must be T={t}", ishape)
    if _checks.shape_of(weights) != ishape:
        _checks.fail("weights", f"shape must equal ids' {ishape}", _checks.shape_of(weights))
    return d


def _validate_experts(x, ids, weights, w_gate_up, w_down):
    d = validate_tokens(x, ids, weights)
    e, d2, two_i = _checks.check_rank("w_gate_up", w_gate_up, 3, "[E, d, 2I]")
    if d2 != d or two_i % 2:
        _checks.fail("w_gate_up", f"expected [E, d={d}, 2I]", (e, d2, two_i))
    if _checks.shape_of(w_down) != (e, two_i // 2, d):
        _checks.fail("w_down", f"shape must be (E, I, d)=({e}, {two_i // 2}, {d})", _checks.shape_of(w_down))
    validate_routing(ids, e)


def validate_routing(ids, e: int) -> None:
    """Concrete expert ids must lie in `[0, E)` and be distinct within a token."""
    values = _checks.concrete(ids)
    if values is not None and values.size:
        if values.min() < 0 or values.max() >= e:
            _checks.fail("ids", f"expert ids must be in [0, E={e})", (int(values.min()), int(values.max())))
        srt = np.sort(values, axis=1)
        dup = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
        if dup.size:
            _checks.fail("ids", f"token {int(dup[0])} lists an expert twice", values[dup[0]].tolist())


def moe_experts(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    limit: float | None = None,
) -> jax.Array:
    """Routed experts: `out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`.

    Args:
      x: `[T, d]` tokens.
      ids: `int32[T, k]` chosen experts (distinct per token).
      weights: `f32[T, k]` combine weights.
      w_gate_up: `[E, d, 2I]` (gate = `[..., :I]`, up = `[..., I:]`), or FP8
        (`moe_fp8.Fp8Weight`, `[E, 2I, d]` e4m3 + UE8M0 exponents per 128x128 block).
      w_down: `[E, I, d]`, or FP8 (`Fp8Weight`, `[E, d, I]`).
      limit: SwiGLU clamp, or None.
    Returns:
      `[T, d]` in x's dtype (f32 accumulation).

    FP8 weights (both or neither) run DeepSeek's recipe (`moe_fp8.moe_experts_fp8`):
    activations quantised per 1x128 before each expert matmul.
    """
    from jax_dspark.ops import moe_fp8

    if isinstance(w_gate_up, moe_fp8.Fp8Weight) or isinstance(w_down, moe_fp8.Fp8Weight):
        return moe_fp8.moe_experts_fp8(x, ids, weights, w_gate_up, w_down, limit=limit)
    _validate_experts(x, ids, weights, w_gate_up, w_down)
    ep = _EXPERT_PARALLEL.get()
    if ep is not None and ep[0].shape[ep[1]] > 1:
        return _moe_experts_ep_padded(x, ids, weights, w_gate_up, w_down, limit, *ep)
    if _ffi.use_kernel("moe_experts"):
        from jax_dspark.ops import _moe_kernels

        return _moe_kernels.moe_experts(x, ids, weights, w_gate_up, w_down, limit=limit)
    return moe_experts_reference(x, ids, weights, w_gate_up, w_down, limit=limit)


def _moe_experts_ep_padded(x, ids, weights, w_gate_up, w_down, limit, mesh, axis):
    """Pad tokens to a multiple of the expert axis (zero-weight rows), run EP, drop the pad."""
    from jax_dspark.parallel import moe_experts_ep

    n = mesh.shape[axis]
    t = x.shape[0]
    pad = (-t) % n
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, x.shape[1]), x.dtype)])
        # padding rows pick experts 0..k-1 (distinct) with weight 0: they cost compute, add nothing
        ids = jnp.concatenate([ids, jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=ids.dtype), (pad, ids.shape[1]))])
        weights = jnp.concatenate([weights, jnp.zeros((pad, weights.shape[1]), weights.dtype)])
    out = moe_experts_ep(x, ids, weights, w_gate_up, w_down, mesh=mesh, axis=axis, limit=limit)
    return out[:t]


def expert_rows(
    rows: jax.Array, expert_of_row: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, limit=None
) -> jax.Array:
    """Each row through its own expert: `[R, d]`, `int32[R]` -> `f32[R, d]`.

    Rows whose expert id is outside `[0, E)` give zeros (padding rows of an expert-parallel
    dispatch buffer use -1). Rows are grouped by a stable sort so each expert runs one
    matmul over a contiguous block (`jax.lax.ragged_dot`).
    """
    e, _, two_i = w_gate_up.shape

    def body(sorted_rows, group_sizes):
        h = jax.lax.ragged_dot(sorted_rows, w_gate_up.astype(rows.dtype), group_sizes,
                               preferred_element_type=jnp.float32)
        a = swiglu(h[:, : two_i // 2], h[:, two_i // 2 :], limit=limit).astype(rows.dtype)
        return jax.lax.ragged_dot(a, w_down.astype(rows.dtype), group_sizes, preferred_element_type=jnp.float32)

    return grouped_by_expert(rows, expert_of_row, e, body)


def grouped_by_expert(rows, expert_of_row, e: int, body):
    """Runs `body(sorted_rows [R, d], group_sizes int32[E]) -> f32[R, d']` on rows grouped by expert.

    Rows are grouped by a stable sort so each expert owns a contiguous block (what
    `jax.lax.ragged_dot` takes); ids outside `[0, E)` sort last and give zeros; the result
    comes back in the rows' order. Shared by the BF16 and FP8 references.
    """
    eid = jnp.where((expert_of_row >= 0) & (expert_of_row < e), expert_of_row, e)
    order = jnp.argsort(eid, stable=True)
    group_sizes = jnp.bincount(eid, length=e + 1)[:e].astype(jnp.int32)
    y = body(jnp.take(rows, order, axis=0), group_sizes)
    # Rows past the last group are not written by ragged_dot's contract: zero them explicitly.
    y = jnp.where((jnp.take(eid, order) < e)[:, None], y, 0.0)
    return jnp.zeros_like(y).at[order].set(y)


def moe_experts_reference(x, ids, weights, w_gate_up, w_down, *, limit=None):
    """Per (token, slot) row through its expert, weighted scatter-add back to tokens."""
    return combine_expert_rows(x, ids, weights, lambda rows, e: expert_rows(rows, e, w_gate_up, w_down, limit=limit))


def combine_expert_rows(x, ids, weights, rows_fn):
    """`out[t] = sum_j weights[t, j] * rows_fn(x rows, expert ids)[t*k + j]`, in x's dtype.

    `rows_fn([R, d], int32[R]) -> f32[R, d]` runs each (token, slot) row through its expert;
    shared by the BF16 and FP8 references so both combine identically.
    """
    t, k = ids.shape
    token_of = jnp.arange(t * k) // k
    y = rows_fn(jnp.take(x, token_of, axis=0), ids.reshape(-1))
    w = weights.reshape(-1).astype(jnp.float32)
    out = jnp.zeros((t, x.shape[1]), jnp.float32).at[token_of].add(y * w[:, None])
    return out.astype(x.dtype)
