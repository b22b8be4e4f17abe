"""V4 KV compressor: gated softmax pooling of raw positions into compressed rows.

Entry `i` of a layer with ratio `m` is complete once position `(i + 1) * m - 1` has been
seen. Per token the compressor projects the layer input to KV candidates `C` and gate
logits `Z` (fp32); the entry is, per channel, `sum_t softmax_t(Z_t + B_slot(t)) * C_t`
over its positions, then RMSNorm (weighted) and RoPE at position `i * m` (the window's
start, as TensorRT-LLM and HF both do).

* HCA (`overlap=False`, width `c = 1`): positions `i*m .. i*m + m - 1`.
* CSA (`overlap=True`, projections `2 * D` wide): positions `i*m - m .. i*m + m - 1`; the
  previous window's tokens contribute their LOW half `[:D]` (bias rows `B[:, :D]`), the
  current window's tokens their HIGH half `[D:]` (bias `B[:, D:]`); entry 0 has no
  previous window (those gates are -inf).

Streaming: a call writes each token's fp32 `[C | Z]` row into a ring (`V4LayerCache.state`)
by position, then pools every entry whose closing position falls inside the call, reading
its positions back from the ring. Because the ring is indexed by position (never a running
sum), re-processing positions after a rollback reproduces the same entries bit for bit;
see jax_dspark/cache.py for the capacity argument. `compress_sequence` is the independent
whole-sequence formulation (the HF-style reshape + shift) the tests compare against.

Parameter names follow HF (`compressor.{kv_proj,gate_proj,position_bias,kv_norm}`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark import ops
from .deepseek_v4_params import kernel, norm_weight, normal


def pool_windows(kv: jax.Array, logits: jax.Array) -> jax.Array:
    """Per-channel softmax pooling over the window axis.

    Args:
      kv: f32 `[..., L, D]` candidates; logits: f32 `[..., L, D]` gate + bias (-inf =
        absent position).
    Returns:
      f32 `[..., D]`.
    """
    w = jax.nn.softmax(logits, axis=-2)
    return jnp.sum(w * kv, axis=-2)


def _split_window(rows: jax.Array, present: jax.Array, bias: jax.Array, ratio: int,
                  overlap: bool, width: int) -> tuple[jax.Array, jax.Array]:
    """Turn gathered state rows of one window into (kv, logits) of width `width`.

    rows: f32 `[..., span, 2*c*width]` (kv then gate); present: bool `[..., span]`;
    bias: `[ratio, c*width]`.
    """
    c = 2 if overlap else 1
    kv, gate = rows[..., :c * width], rows[..., c * width:]
    bias = bias.astype(jnp.float32)
    if overlap:
        kv = jnp.concatenate([kv[..., :ratio, :width], kv[..., ratio:, width:]], axis=-2)
        gate = jnp.concatenate([gate[..., :ratio, :width] + bias[:, :width],
                                gate[..., ratio:, width:] + bias[:, width:]], axis=-2)
    else:
        gate = gate + bias
    logits = jnp.where(present[..., None], gate, -jnp.inf)
    return kv, logits


def finish_entries(pooled: jax.Array, norm_w: jax.Array, freqs: jax.Array,
                   eps: float) -> jax.Array:
    """RMSNorm (weighted) then RoPE on the last R dims: `[..., D]` f32 -> f32."""
    return ops.apply_rope(ops.rms_norm(pooled, norm_w, eps=eps), freqs)


def compress_sequence(state_rows: jax.Array, bias: jax.Array, norm_w: jax.Array,
                      table: jax.Array, *, ratio: int, overlap: bool, width: int,
                      eps: float) -> jax.Array:
    """All complete entries of one whole sequence at once (reference formulation).

    Args:
      state_rows: f32 `[T, 2*c*width]` per-token `[C | Z]` projections, positions 0..T-1.
      bias: `[ratio, c*width]`; norm_w: `[width]`; table: RoPE table `[P, R/2, 2]`.
    Returns:
      f32 `[T // ratio, width]` entries (normalised and rotated).
    """
    c = 2 if overlap else 1
    n = state_rows.shape[0] // ratio
    rows = state_rows[:n * ratio].reshape(n, ratio, 2 * c * width)
    kv, gate = rows[..., :c * width], rows[..., c * width:]
    gate = gate + bias.astype(jnp.float32)
    if overlap:
        cur_kv, cur_gate = kv[..., width:], gate[..., width:]
        prev_kv = jnp.concatenate([jnp.zeros_like(kv[:1, :, :width]), kv[:-1, :, :width]], 0)
        prev_gate = jnp.concatenate(
            [jnp.full_like(gate[:1, :, :width], -jnp.inf), gate[:-1, :, :width]], 0)
        kv = jnp.concatenate([prev_kv, cur_kv], axis=1)
        gate = jnp.concatenate([prev_gate, cur_gate], axis=1)
    pooled = pool_windows(kv, gate)
    freqs = table[jnp.arange(n) * ratio]
    return finish_entries(pooled, norm_w, freqs, eps)


def stream_compress(state: kvcache.RowPool, entries: kvcache.RowPool, state_rows: jax.Array,
                    *, slots: jax.Array, starts: jax.Array, lengths: jax.Array,
                    bias: jax.Array, norm_w: jax.Array, table: jax.Array, ratio: int,
                    overlap: bool, width: int,
                    eps: float) -> tuple[kvcache.RowPool, kvcache.RowPool]:
    """Advance one layer's compressor by one call's tokens.

    Args:
      state: the `[C | Z]` ring; entries: the compressed-row pool (row i = entry i).
      state_rows: f32 `[B, S, 2*c*width]` projections of this call's tokens.
      slots, starts, lengths: int32 `[B]` (rows `j >= lengths[b]` are padding).
      bias: `[ratio, c*width]`; norm_w: `[width]`; table: RoPE table `[P, R/2, 2]`.
    Returns:
      `(state, entries)` with this call's tokens stored and every entry whose closing
      position is a real token of this call written (others untouched).
    """
    b, s, _ = state_rows.shape
    j = jnp.arange(s, dtype=jnp.int32)
    positions = starts[:, None] + j[None, :]
    valid = j[None, :] < lengths[:, None]
    state = kvcache.write_rows(state, slots, positions, state_rows, valid)
    # Entries closing inside this call are consecutive from starts // ratio; at most
    # ceil(S / ratio) of them.
    n_cand = -(-s // ratio)
    ids = starts[:, None] // ratio + jnp.arange(n_cand, dtype=jnp.int32)[None, :]
    done = (ids + 1) * ratio - 1 < (starts + lengths)[:, None]
    span = ratio * (2 if overlap else 1)
    first = ids * ratio - (ratio if overlap else 0)
    win_pos = first[..., None] + jnp.arange(span, dtype=jnp.int32)  # [B, n, span]
    idx = kvcache.row_index(state, slots, win_pos)
    rows = kvcache.read_rows(state, idx).astype(jnp.float32)
    kv, logits = _split_window(rows, win_pos >= 0, bias, ratio, overlap, width)
    pooled = pool_windows(kv, logits)
    freqs = table[jnp.clip(ids * ratio, 0, table.shape[0] - 1)]
    new = finish_entries(pooled, norm_w, freqs, eps)
    entries = kvcache.write_rows(entries, slots, ids, new, done)
    return state, entries


class Compressor(nnx.Module):
    """Per-layer compressor parameters (HF `self_attn.compressor`) and its two modes.

    Attributes:
      kv_proj, gate_proj: `[d, c*width]`; position_bias: f32 `[ratio, c*width]`;
      kv_norm: `[width]`. `c = 2` when `overlap` (CSA), else 1 (HCA).
      indexer: the CSA layer's lightning indexer (HF nests it here), else None.
    """

    def __init__(self, hidden_size: int, width: int, *, ratio: int, overlap: bool,
                 eps: float, dtype: jnp.dtype, init_std: float, rngs: nnx.Rngs,
                 indexer: nnx.Module | None = None):
        c = 2 if overlap else 1
        self.ratio = ratio
        self.overlap = overlap
        self.width = width
        self.eps = eps
        self.kv_proj = kernel(rngs, hidden_size, c * width, dtype, init_std)
        self.gate_proj = kernel(rngs, hidden_size, c * width, dtype, init_std)
        self.position_bias = nnx.Param(normal(rngs, (ratio, c * width)))
        self.kv_norm = norm_weight(rngs, width, dtype)
        self.indexer = indexer

    def project(self, x: jax.Array) -> jax.Array:
        """`x [..., d]` -> f32 `[..., 2*c*width]` = `[C | Z]` (fp32 accumulation)."""
        kv = jnp.dot(x, self.kv_proj[...], preferred_element_type=jnp.float32)
        gate = jnp.dot(x, self.gate_proj[...], preferred_element_type=jnp.float32)
        return jnp.concatenate([kv, gate], axis=-1)

    def compress_sequence(self, x: jax.Array, table: jax.Array) -> jax.Array:
        """Reference: `x [T, d]` (positions 0..T-1) -> f32 `[T // ratio, width]`."""
        return compress_sequence(self.project(x), self.position_bias[...], self.kv_norm[...],
                                 table, ratio=self.ratio, overlap=self.overlap,
                                 width=self.width, eps=self.eps)

    def stream(self, state: kvcache.RowPool, entries: kvcache.RowPool, x: jax.Array, *,
               slots: jax.Array, starts: jax.Array, lengths: jax.Array,
               table: jax.Array) -> tuple[kvcache.RowPool, kvcache.RowPool]:
        """Cached mode: `x [B, S, d]` -> updated `(state, entries)` (see `stream_compress`)."""
        return stream_compress(state, entries, self.project(x), slots=slots, starts=starts,
                               lengths=lengths, bias=self.position_bias[...],
                               norm_w=self.kv_norm[...], table=table, ratio=self.ratio,
                               overlap=self.overlap, width=self.width, eps=self.eps)
