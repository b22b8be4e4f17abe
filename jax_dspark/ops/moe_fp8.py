"""FP8 routed experts, DeepSeek's recipe: e4m3 weights with one UE8M0 exponent per 128x128
block, activations quantised per 1x128 row block before each expert matmul.

Representation. An FP8 expert matrix is an `Fp8Weight(values, exps)` NamedTuple (a pytree,
so it passes through `jit` and `nnx` state unchanged):

- `w_gate_up`: values `float8_e4m3fn[E, 2I, d]`, exps `uint8[E, 2I/128, d/128]`;
- `w_down`: values `float8_e4m3fn[E, d, I]`, exps `uint8[E, d/128, I/128]`;

i.e. "out x in" (the checkpoints' `nn.Linear` layout, transposed against the BF16 ops
layout `[E, d, 2I]` / `[E, I, d]`), because FP8 tensor-core GEMMs on Hopper read both
operands K-major. A byte `b` means the scale `2^(b - 127)`; the scale of each block is the
power of two `jax_dspark.ops.fp8` picks (amax over the block / 448, rounded up), so every
dequantised value is exact in bf16. Gate rows come first (`values[:, :I]`), as in BF16.

What is quantised: the expert input `x` (per token, 1x128 along d) and the SwiGLU output
(per row, 1x128 along I), as DeepSeek's inference does; FC1 and FC2 outputs are rounded to
bf16 (the kernel's GEMM epilogues write bf16), accumulation is f32. The reference below
reproduces those roundings, so the CUDA kernel is compared against it closely; against the
BF16 experts the FP8 result differs by the FP8 rounding itself (a few percent, relative).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark.ops import _checks, moe
from jax_dspark.ops.fp8 import WEIGHT_BLOCK, dequantize_fp8_weight, fp8_round_trip, quantize_fp8_weight, round_to_bf16


class Fp8Weight(NamedTuple):
    """One FP8 expert matrix: `values float8_e4m3fn[E, N, K]`, `exps uint8[E, N/128, K/128]`."""

    values: jax.Array
    exps: jax.Array


def _check_fp8_weight(name: str, w, n: int | None, k: int | None) -> tuple[int, int, int]:
    """Validates one `Fp8Weight` (`[E, N, K]` values, `[E, N/128, K/128]` exps); returns (E, N, K)."""
    if not isinstance(w, Fp8Weight):
        _checks.fail(name, "must be an Fp8Weight(values, exps) when the other expert matrix is", type(w).__name__)
    e, n2, k2 = _checks.check_rank(f"{name}.values", w.values, 3, "[E, N, K]")
    _checks.check_dtype(f"{name}.values", w.values, (jnp.float8_e4m3fn,))
    if (n is not None and n2 != n) or (k is not None and k2 != k):
        _checks.fail(f"{name}.values", f"expected [E, N={n}, K={k}]", (e, n2, k2))
    if n2 % WEIGHT_BLOCK or k2 % WEIGHT_BLOCK:
        _checks.fail(f"{name}.values", "N and K must be multiples of 128", (e, n2, k2))
    want = (e, n2 // WEIGHT_BLOCK, k2 // WEIGHT_BLOCK)
    if _checks.shape_of(w.exps) != want:
        _checks.fail(f"{name}.exps", f"shape must be {want}", _checks.shape_of(w.exps))
    _checks.check_dtype(f"{name}.exps", w.exps, (np.uint8,))
    return e, n2, k2


def quantize_expert_weights(w_gate_up: jax.Array, w_down: jax.Array) -> tuple[Fp8Weight, Fp8Weight]:
    """BF16 (or f32) experts in the ops layout -> FP8 `Fp8Weight`s in "out x in" layout.

    Args:
      w_gate_up: `[E, d, 2I]` floating, `d % 128 == 0`, `I % 128 == 0`.
      w_down: `[E, I, d]`.
    Returns:
      `(Fp8Weight([E, 2I, d], [E, 2I/128, d/128]), Fp8Weight([E, d, I], [E, d/128, I/128]))`.
    """
    e, d, two_i = _checks.check_rank("w_gate_up", w_gate_up, 3, "[E, d, 2I]")
    _checks.check_floating("w_gate_up", w_gate_up)
    _checks.check_floating("w_down", w_down)
    if two_i % 2 or d % WEIGHT_BLOCK or (two_i // 2) % WEIGHT_BLOCK:
        _checks.fail("w_gate_up", "need d and I multiples of 128 ([E, d, 2I])", (e, d, two_i))
    if _checks.shape_of(w_down) != (e, two_i // 2, d):
        _checks.fail("w_down", f"shape must be (E, I, d)=({e}, {two_i // 2}, {d})", _checks.shape_of(w_down))
    gate_up = Fp8Weight(*quantize_fp8_weight(jnp.swapaxes(w_gate_up, 1, 2)))
    down = Fp8Weight(*quantize_fp8_weight(jnp.swapaxes(w_down, 1, 2)))
    return gate_up, down


def dequantize_expert_weights(
    w_gate_up: Fp8Weight, w_down: Fp8Weight, dtype=jnp.bfloat16
) -> tuple[jax.Array, jax.Array]:
    """Inverse of `quantize_expert_weights`: back to the ops layout `[E, d, 2I]`, `[E, I, d]`.

    Exact in bf16 (e4m3 times a power of two), so the BF16 path on these weights computes
    the same products as the FP8 one, up to the activation quantisation.
    """
    e, two_i, d = _check_fp8_weight("w_gate_up", w_gate_up, None, None)
    _check_fp8_weight("w_down", w_down, d, two_i // 2)
    gate_up = dequantize_fp8_weight(w_gate_up.values, w_gate_up.exps, dtype=dtype)
    down = dequantize_fp8_weight(w_down.values, w_down.exps, dtype=dtype)
    return jnp.swapaxes(gate_up, 1, 2), jnp.swapaxes(down, 1, 2)


def _validate(x, ids, weights, w_gate_up, w_down) -> None:
    d = moe.validate_tokens(x, ids, weights)
    e, two_i, d2 = _check_fp8_weight("w_gate_up", w_gate_up, None, d)
    if two_i % (2 * WEIGHT_BLOCK):
        _checks.fail("w_gate_up.values", "N = 2I needs I a multiple of 128", _checks.shape_of(w_gate_up.values))
    e2, _, _ = _check_fp8_weight("w_down", w_down, d, two_i // 2)
    if e2 != e:
        _checks.fail("w_down.values", f"must hold E={e} experts like w_gate_up", _checks.shape_of(w_down.values))
    moe.validate_routing(ids, e)


def fp8_expert_rows(
    rows: jax.Array, expert_of_row: jax.Array, w_gate_up: Fp8Weight, w_down: Fp8Weight, *, limit=None
) -> jax.Array:
    """Each row through its own FP8 expert: `[R, d]`, `int32[R]` -> `f32[R, d]`.

    Rows whose expert id is outside `[0, E)` give zeros. Same grouping as
    `moe.expert_rows`; dequantised operands are exact in bf16, so `ragged_dot` with f32
    accumulation computes the FP8 products.
    """
    e, two_i, _ = w_gate_up.values.shape
    inter = two_i // 2
    w1, w2 = dequantize_expert_weights(w_gate_up, w_down, dtype=jnp.bfloat16)
    quantized = lambda a: fp8_round_trip(a, WEIGHT_BLOCK).astype(jnp.bfloat16)  # exact in bf16

    def body(sorted_rows, group_sizes):
        h = jax.lax.ragged_dot(quantized(sorted_rows), w1, group_sizes, preferred_element_type=jnp.float32)
        h = round_to_bf16(h)  # FC1 writes bf16
        a = moe.swiglu(h[:, :inter], h[:, inter:], limit=limit)  # f32
        y = jax.lax.ragged_dot(quantized(a), w2, group_sizes, preferred_element_type=jnp.float32)
        return round_to_bf16(y)  # FC2 writes bf16

    return moe.grouped_by_expert(rows, expert_of_row, e, body)


def moe_experts_fp8_reference(x, ids, weights, w_gate_up: Fp8Weight, w_down: Fp8Weight, *, limit=None):
    """Pure-JAX FP8 routed experts: per (token, slot) row, weighted scatter-add to tokens."""
    return moe.combine_expert_rows(
        x, ids, weights, lambda rows, e: fp8_expert_rows(rows, e, w_gate_up, w_down, limit=limit))


def moe_experts_fp8(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate_up: Fp8Weight,
    w_down: Fp8Weight,
    *,
    limit: float | None = None,
) -> jax.Array:
    """Routed experts with FP8 weights: `out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`.

    Args:
      x: `[T, d]` tokens (bf16 for the kernel; other float dtypes run the reference).
      ids: `int32[T, k]` chosen experts (distinct per token).
      weights: `f32[T, k]` combine weights.
      w_gate_up: `Fp8Weight`, values `e4m3[E, 2I, d]`, exps `uint8[E, 2I/128, d/128]`.
      w_down: `Fp8Weight`, values `e4m3[E, d, I]`, exps `uint8[E, d/128, I/128]`.
      limit: SwiGLU clamp, or None.
    Returns:
      `[T, d]` in x's dtype.
    """
    _validate(x, ids, weights, w_gate_up, w_down)
    if limit is not None and not limit > 0:
        _checks.fail("limit", "must be > 0 or None", limit)
    ep = moe._EXPERT_PARALLEL.get()
    if ep is not None and ep[0].shape[ep[1]] > 1:
        return moe._moe_experts_ep_padded(x, ids, weights, w_gate_up, w_down, limit, *ep)
    from jax_dspark.ops import _moe_kernels

    if _moe_kernels.experts_fp8_available():
        return _moe_kernels.moe_experts_fp8(x, ids, weights, w_gate_up, w_down, limit=limit)
    return moe_experts_fp8_reference(x, ids, weights, w_gate_up, w_down, limit=limit)
