"""One V4 decoder block: mHC around attention, then mHC around the MoE.

    (u, post, comb) = attn_hc.pre(X);  y = self_attn(RMSNorm_attn(u));  X = mhc_post(y, X, post, comb)
    (u, post, comb) = ffn_hc.pre(X);   y = mlp(RMSNorm_ffn(u), ids);    X = mhc_post(y, X, post, comb)

The two halves are exposed separately (`attention_input`, `ffn`) so the DSpark drafter can
run its own attention (context ring + draft block) between them with the same weights
layout; `__call__` is the target's cached forward.

Parameter names follow HF: `attn_hc`, `ffn_hc`, `input_layernorm`,
`post_attention_layernorm`, `self_attn`, `mlp`.
"""

from __future__ import annotations

import jax
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark import ops
from .deepseek_v4_attention import Attention, StepContext
from .deepseek_v4_config import DeepseekV4Config
from .deepseek_v4_mhc import HyperConnection, mhc_post
from .deepseek_v4_moe import MoE
from .deepseek_v4_params import norm_weight


class DecoderLayer(nnx.Module):
    """A V4 block. `kind` / `hashed` override the config's choice for this layer index
    (the MTP block and drafter stages are window-only, non-hash blocks)."""

    def __init__(self, config: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs,
                 kind: str | None = None, hashed: bool | None = None):
        c = config
        self.eps = c.rms_eps
        hc = dict(hc_mult=c.hc_mult, sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                  post_mult=c.hc_post_mult, norm_eps=c.hc_norm_eps, init_std=c.init_std)
        self.attn_hc = HyperConnection(c.hidden_size, rngs=rngs, **hc)
        self.ffn_hc = HyperConnection(c.hidden_size, rngs=rngs, **hc)
        self.input_layernorm = norm_weight(rngs, c.hidden_size, c.dtype)
        self.post_attention_layernorm = norm_weight(rngs, c.hidden_size, c.dtype)
        self.self_attn = Attention(c, layer, rngs=rngs, kind=kind)
        self.mlp = MoE(c, hashed=c.is_hash_layer(layer) if hashed is None else hashed,
                       rngs=rngs)

    def attention_input(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`streams [..., n, d]` -> `(x [..., d] normalised attention input, post, comb)`.

        Finish the sublayer with `mhc_post(y, streams, post, comb)`.
        """
        u, post, comb = self.attn_hc.pre(streams)
        return ops.rms_norm(u, self.input_layernorm[...], eps=self.eps), post, comb

    def ffn(self, streams: jax.Array, token_ids: jax.Array) -> jax.Array:
        """The whole MoE sublayer: `streams [..., n, d]`, token_ids `[...]` -> streams."""
        u, post, comb = self.ffn_hc.pre(streams)
        x = ops.rms_norm(u, self.post_attention_layernorm[...], eps=self.eps)
        return mhc_post(self.mlp(x, token_ids), streams, post, comb)

    def __call__(self, streams: jax.Array, token_ids: jax.Array, lc: kvcache.V4LayerCache,
                 ctx: StepContext) -> tuple[jax.Array, kvcache.V4LayerCache]:
        """Target forward: `streams [B, S, n, d]`, token_ids `[B, S]` -> `(streams, lc)`."""
        x, post, comb = self.attention_input(streams)
        y, lc = self.self_attn(x, lc, ctx)
        streams = mhc_post(y, streams, post, comb)
        return self.ffn(streams, token_ids), lc
