"""Lightning indexer of CSA layers: which compressed rows each query reads.

The indexer keeps its own compressed keys (same overlapping 2m-token windows as the CSA
compressor, `index_head_dim` wide, RMSNorm + RoPE) and scores every COMPLETE entry `s` for
a query at position `p` as

    I(p, s) = sum_h w_h * ReLU(q_h . K_s) / sqrt(index_head_dim),
    q = RoPE(c_q @ q_b_proj) as [index_heads, index_head_dim],
    w = (x @ weights_proj) / sqrt(index_heads),

where `c_q` is the attention's normalised query latent and `x` the normalised layer
input. The top `index_topk` entries (only those with `(s + 1) * m <= p + 1`) are the
query's extra rows; fewer complete entries than k leave `-1`s.

The scan over all keys here is the plain-JAX reference (memory `B*S*H*N`); on GPU this
is the job of a DeepGEMM-style `mqa_logits` kernel. Parameter names follow HF
(`self_attn.compressor.indexer.*`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark import ops
from .deepseek_v4_compressor import compress_sequence, stream_compress
from .deepseek_v4_params import kernel, norm_weight, normal


class Indexer(nnx.Module):
    """Indexer parameters and its two operations (`stream` keys, `select` top-k).

    Attributes:
      kv_proj, gate_proj: `[d, 2*Di]`; position_bias: f32 `[ratio, 2*Di]`;
      kv_norm: `[Di]`; q_b_proj: `[q_lora, Hi*Di]`; weights_proj: `[d, Hi]`.
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, *, heads: int, head_dim: int,
                 ratio: int, topk: int, eps: float, dtype: jnp.dtype, init_std: float,
                 rngs: nnx.Rngs):
        self.heads = heads
        self.head_dim = head_dim
        self.ratio = ratio
        self.topk = topk
        self.eps = eps
        self.kv_proj = kernel(rngs, hidden_size, 2 * head_dim, dtype, init_std)
        self.gate_proj = kernel(rngs, hidden_size, 2 * head_dim, dtype, init_std)
        self.position_bias = nnx.Param(normal(rngs, (ratio, 2 * head_dim)))
        self.kv_norm = norm_weight(rngs, head_dim, dtype)
        self.q_b_proj = kernel(rngs, q_lora_rank, heads * head_dim, dtype, init_std)
        self.weights_proj = kernel(rngs, hidden_size, heads, dtype, init_std)

    def project(self, x: jax.Array) -> jax.Array:
        """`x [..., d]` -> f32 `[..., 4*Di]` = `[C | Z]` of the indexer's compressor."""
        kv = jnp.dot(x, self.kv_proj[...], preferred_element_type=jnp.float32)
        gate = jnp.dot(x, self.gate_proj[...], preferred_element_type=jnp.float32)
        return jnp.concatenate([kv, gate], axis=-1)

    def keys_sequence(self, x: jax.Array, table: jax.Array) -> jax.Array:
        """Reference keys of a whole sequence: `x [T, d]` -> f32 `[T // ratio, Di]`."""
        return compress_sequence(self.project(x), self.position_bias[...], self.kv_norm[...],
                                 table, ratio=self.ratio, overlap=True, width=self.head_dim,
                                 eps=self.eps)

    def stream(self, state: kvcache.RowPool, keys: kvcache.RowPool, x: jax.Array, *,
               slots: jax.Array, starts: jax.Array, lengths: jax.Array,
               table: jax.Array) -> tuple[kvcache.RowPool, kvcache.RowPool]:
        """Cached mode: store this call's projections, write keys of closed windows."""
        return stream_compress(state, keys, self.project(x), slots=slots, starts=starts,
                               lengths=lengths, bias=self.position_bias[...],
                               norm_w=self.kv_norm[...], table=table, ratio=self.ratio,
                               overlap=True, width=self.head_dim, eps=self.eps)

    def select(self, x: jax.Array, c_q: jax.Array, positions: jax.Array,
               keys: kvcache.RowPool, slots: jax.Array, table: jax.Array) -> jax.Array:
        """Top-k complete entries per query.

        Args:
          x: `[B, S, d]` normalised layer input; c_q: `[B, S, q_lora]` query latent;
          positions: int32 `[B, S]`; keys: indexer key pool; slots: int32 `[B]`;
          table: compressed-layer RoPE table `[P, R/2, 2]`.
        Returns:
          int32 `[B, S, min(topk, entries capacity)]` entry ids, `-1` where fewer
          entries are complete.
        """
        b, s, _ = x.shape
        q = jnp.dot(c_q, self.q_b_proj[...], preferred_element_type=jnp.float32)
        q = q.reshape(b, s, self.heads, self.head_dim)
        freqs = table[jnp.clip(positions, 0, table.shape[0] - 1)]
        q = ops.apply_rope(q, freqs[:, :, None])
        w = jnp.dot(x, self.weights_proj[...], preferred_element_type=jnp.float32)
        w = w * (self.heads ** -0.5) * (self.head_dim ** -0.5)
        n = keys.capacity
        ent = jnp.arange(n, dtype=jnp.int32)
        rows = kvcache.row_index(keys, slots, jnp.broadcast_to(ent, (b, n)))
        k = kvcache.read_rows(keys, rows).astype(jnp.float32)  # [B, N, Di]
        logits = jnp.einsum("bshd,bnd->bshn", q, k, precision=jax.lax.Precision.HIGHEST)
        score = jnp.einsum("bshn,bsh->bsn", jax.nn.relu(logits), w,
                           precision=jax.lax.Precision.HIGHEST)
        visible = ent[None, None, :] < ((positions + 1) // self.ratio)[..., None]
        score = jnp.where(visible, score, -jnp.inf)
        vals, top = jax.lax.top_k(score, min(self.topk, n))
        return jnp.where(jnp.isfinite(vals), top, -1).astype(jnp.int32)
