"""mHC (manifold-constrained hyper-connections): V4's 4-stream residual.

The residual is `n` parallel streams `X [..., n, d]`. Each sublayer reads a
sigmoid-weighted mix of the streams and writes back through a doubly-stochastic `n x n`
matrix, so signal propagation stays non-expansive over depth. All mixing math is fp32
(the released model keeps these parameters in fp32 too).

We follow DeepSeek's TileKernels reference and TensorRT-LLM where ports disagree (spec
1.10): the comb logits go through a row softmax, then Sinkhorn normalisation ending on a
column step; `post` is multiplied by 2 (`hc_post_mult`); the residual update contracts
comb over its FIRST index (`X'_j = post_j * y + sum_i comb[i, j] X_i`). The HF port's
sigmoid-before-Sinkhorn, post without x2 and untransposed comb are NOT used.

Parameter names follow the HF port (`attn_hc.{fn,base,scale}`, `hc_head.{hc_fn,hc_base,
hc_scale}`); the released checkpoint calls them `hc_attn_fn` ... and `hc_head_fn` ...
(see docs/deepseek_v4.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dspark import ops
from .deepseek_v4_params import normal


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Project `n x n` logits onto (approximately) doubly-stochastic matrices.

    Args:
      logits: f32 `[..., n, n]`.
      iters: total normalisation rounds (20 in V4); must be >= 1.
      eps: added after the softmax and to every divisor.
    Returns:
      f32 `[..., n, n]`: row softmax + eps, one column normalisation, then `iters - 1`
      rounds of (row, column) normalisation. Ends on a column step, so columns sum to 1
      up to eps and rows to within the Sinkhorn residual.
    """
    if iters < 1:
        raise ValueError(f"iters={iters}: must be >= 1")
    x = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps
    x = x / (x.sum(-2, keepdims=True) + eps)

    def round_(_, x):
        x = x / (x.sum(-1, keepdims=True) + eps)
        return x / (x.sum(-2, keepdims=True) + eps)

    # A loop, not an unrolled chain: 20 rounds x 8 mHC sites unrolled dominate compile time.
    return jax.lax.fori_loop(0, iters - 1, round_, x)


def _mix_logits(streams: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """`fn @ rms(vec(X))`: the one fp32 projection all mHC gates come from.

    `streams [..., n, d]`, `fn [m, n*d]` -> `[..., m]`. RMS over all `n*d` values,
    unweighted (equivalent to scaling the projection by `rsqrt(mean(x^2) + eps)`).
    """
    flat = streams.reshape(streams.shape[:-2] + (-1,)).astype(jnp.float32)
    flat = ops.rms_norm(flat, eps=eps)
    return jnp.einsum("...k,mk->...m", flat, fn.astype(jnp.float32))


def mhc_pre(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *,
            sinkhorn_iters: int, eps: float, post_mult: float,
            norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Read a sublayer input from the streams; also return the write-back gates.

    Args:
      streams: `[..., n, d]`.
      fn: f32 `[(2+n)*n, n*d]`; base: f32 `[(2+n)*n]`; scale: f32 `[3]`.
    Returns:
      u: `[..., d]` (streams dtype) `= sum_i pre_i X_i`, `pre = sigmoid(.) + eps`;
      post: f32 `[..., n]` `= post_mult * sigmoid(.)`;
      comb: f32 `[..., n, n]` Sinkhorn-projected.
    """
    n = streams.shape[-2]
    a = _mix_logits(streams, fn, norm_eps)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(a[..., :n] * scale[0] + base[:n]) + eps
    post = post_mult * jax.nn.sigmoid(a[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = a[..., 2 * n:] * scale[2] + base[2 * n:]
    comb = sinkhorn(comb_logits.reshape(a.shape[:-1] + (n, n)), sinkhorn_iters, eps)
    u = jnp.einsum("...n,...nd->...d", pre, streams.astype(jnp.float32))
    return u.astype(streams.dtype), post, comb


def mhc_post(y: jax.Array, streams: jax.Array, post: jax.Array,
             comb: jax.Array) -> jax.Array:
    """Write a sublayer output back: `X'_j = post_j * y + sum_i comb[i, j] X_i`.

    Args:
      y: `[..., d]` sublayer output; streams: `[..., n, d]`; post: f32 `[..., n]`;
      comb: f32 `[..., n, n]`.
    Returns:
      `[..., n, d]` in the streams dtype (fp32 math).
    """
    x = streams.astype(jnp.float32)
    out = post[..., :, None] * y.astype(jnp.float32)[..., None, :]
    out = out + jnp.einsum("...ij,...id->...jd", comb, x)
    return out.astype(streams.dtype)


class HyperConnection(nnx.Module):
    """One sublayer's mHC parameters (HF `attn_hc` / `ffn_hc`).

    `pre(streams) -> (u, post, comb)`; write back with `mhc_post(y, streams, post, comb)`.
    """

    def __init__(self, hidden_size: int, *, hc_mult: int, sinkhorn_iters: int, eps: float,
                 post_mult: float, norm_eps: float, init_std: float, rngs: nnx.Rngs):
        mix = (2 + hc_mult) * hc_mult
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.post_mult = post_mult
        self.norm_eps = norm_eps
        self.fn = nnx.Param(normal(rngs, (mix, hc_mult * hidden_size), init_std))
        self.base = nnx.Param(normal(rngs, (mix,), init_std))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))

    def pre(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`streams [..., n, d]` -> `(u [..., d], post [..., n], comb [..., n, n])`."""
        return mhc_pre(streams, self.fn[...], self.base[...], self.scale[...],
                       sinkhorn_iters=self.sinkhorn_iters, eps=self.eps,
                       post_mult=self.post_mult, norm_eps=self.norm_eps)


class HyperHead(nnx.Module):
    """Collapse the streams before the final norm (HF `hc_head`): sigmoid weights only."""

    def __init__(self, hidden_size: int, *, hc_mult: int, eps: float, norm_eps: float,
                 init_std: float, rngs: nnx.Rngs):
        self.eps = eps
        self.norm_eps = norm_eps
        self.hc_fn = nnx.Param(normal(rngs, (hc_mult, hc_mult * hidden_size), init_std))
        self.hc_base = nnx.Param(normal(rngs, (hc_mult,), init_std))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))

    def __call__(self, streams: jax.Array) -> jax.Array:
        """`streams [..., n, d]` -> `[..., d]` (streams dtype) `= sum_i w_i X_i`."""
        a = _mix_logits(streams, self.hc_fn[...], self.norm_eps)
        w = jax.nn.sigmoid(a * self.hc_scale[...][0] + self.hc_base[...]) + self.eps
        out = jnp.einsum("...n,...nd->...d", w, streams.astype(jnp.float32))
        return out.astype(streams.dtype)
