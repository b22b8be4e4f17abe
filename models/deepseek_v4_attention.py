"""V4 attention: shared-KV MQA with a sink over window rows + compressed rows.

Per token (spec 1.4): `c_q = RMSNorm(x @ q_a_proj)`, `q = c_q @ q_b_proj` as `[H, D]`,
weightless per-head RMSNorm, RoPE on the last R dims; one key=value row
`kv = RoPE(RMSNorm(x @ kv_proj))`; attention over the layer's visible rows with a learned
per-head sink and scale `1/sqrt(D)`; inverse RoPE on the output's last R dims (values
carry rotated channels); grouped low-rank output projection (heads grouped contiguously,
`H*D/g -> o_lora` per group, then `g*o_lora -> d`).

The block is split so the DSpark drafter can reuse it with its own row selection:
`project_q`, `project_kv` and `attend` know nothing about caches; `__call__` is the
target's cached forward (window ring + compressor + indexer) built from them. All
attention goes through `ops.sparse_sink_attention`: window rows are the main pool,
compressed rows the extra pool, `-1` marks "no row".

RoPE choice (spec 1.10): window-only layers use theta 1e4 without YaRN; on compressed
layers EVERYTHING (queries, window rows, compressed rows, indexer) uses the compressed
table (theta 1.6e5 + YaRN), as TensorRT-LLM does. The HF port's mix is not used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark import ops
from .deepseek_v4_compressor import Compressor
from .deepseek_v4_config import DeepseekV4Config
from .deepseek_v4_indexer import Indexer
from .deepseek_v4_params import grouped_kernel, kernel, norm_weight, normal


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Per-call request layout shared by every layer of one forward.

    Attributes:
      slots, starts, lengths: int32 `[B]` as in the target protocol.
      positions: int32 `[B, S]` = `starts[:, None] + arange(S)`.
      valid: bool `[B, S]` = `arange(S) < lengths[:, None]` (false = padding row).
      main_table, compressed_table: RoPE tables `f32[P, R/2, 2]`.
    """

    slots: jax.Array
    starts: jax.Array
    lengths: jax.Array
    positions: jax.Array
    valid: jax.Array
    main_table: jax.Array
    compressed_table: jax.Array

    @staticmethod
    def make(slots: jax.Array, starts: jax.Array, lengths: jax.Array, seq: int,
             main_table: jax.Array, compressed_table: jax.Array) -> "StepContext":
        j = jnp.arange(seq, dtype=jnp.int32)
        slots = slots.astype(jnp.int32)
        starts = starts.astype(jnp.int32)
        lengths = lengths.astype(jnp.int32)
        return StepContext(slots=slots, starts=starts, lengths=lengths,
                           positions=starts[:, None] + j[None, :],
                           valid=j[None, :] < lengths[:, None], main_table=main_table,
                           compressed_table=compressed_table)


def rope_freqs(table: jax.Array, positions: jax.Array) -> jax.Array:
    """`table[positions]` with positions clipped into the table: `[..., R/2, 2]`."""
    return table[jnp.clip(positions, 0, table.shape[0] - 1)]


class Attention(nnx.Module):
    """One layer's attention (HF `self_attn`).

    Attributes:
      q_a_proj `[d, q_lora]`, q_norm `[q_lora]`, q_b_proj `[q_lora, H*D]`,
      kv_proj `[d, D]`, kv_norm `[D]`, o_a_proj `[g, H*D/g, o_lora]`,
      o_b_proj `[g*o_lora, d]`, sinks f32 `[H]`;
      compressor (CSA/HCA layers) with compressor.indexer (CSA layers), else None.
    """

    def __init__(self, config: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs,
                 kind: str | None = None):
        """`kind` overrides `config.layer_kind(layer)` (the MTP block is window-only)."""
        c = config
        self.kind = kind or c.layer_kind(layer)
        if self.kind not in ("swa", "csa", "hca"):
            raise ValueError(f"kind={kind!r}: must be 'swa', 'csa', 'hca' or None")
        self.num_heads = c.num_heads
        self.head_dim = c.head_dim
        self.window = c.window
        self.o_groups = c.o_groups
        self.eps = c.rms_eps
        dt, std = c.dtype, c.init_std
        self.q_a_proj = kernel(rngs, c.hidden_size, c.q_lora_rank, dt, std)
        self.q_norm = norm_weight(rngs, c.q_lora_rank, dt)
        self.q_b_proj = kernel(rngs, c.q_lora_rank, c.num_heads * c.head_dim, dt, std)
        self.kv_proj = kernel(rngs, c.hidden_size, c.head_dim, dt, std)
        self.kv_norm = norm_weight(rngs, c.head_dim, dt)
        self.o_a_proj = grouped_kernel(rngs, c.o_groups, c.num_heads * c.head_dim // c.o_groups,
                                       c.o_lora_rank, dt, std)
        self.o_b_proj = kernel(rngs, c.o_groups * c.o_lora_rank, c.hidden_size, dt, std)
        self.sinks = nnx.Param(normal(rngs, (c.num_heads,)))
        self.compressor = None if self.kind == "swa" else self._compressor(c, layer, rngs)

    def _compressor(self, c: DeepseekV4Config, layer: int, rngs: nnx.Rngs) -> Compressor:
        ratio = c.compress_ratios[layer]
        indexer = None
        if self.kind == "csa":
            indexer = Indexer(c.hidden_size, c.q_lora_rank, heads=c.index_heads,
                              head_dim=c.index_head_dim, ratio=ratio, topk=c.index_topk,
                              eps=c.rms_eps, dtype=c.dtype, init_std=c.init_std, rngs=rngs)
        return Compressor(c.hidden_size, c.head_dim, ratio=ratio, overlap=self.kind == "csa",
                          eps=c.rms_eps, dtype=c.dtype, init_std=c.init_std, rngs=rngs,
                          indexer=indexer)

    # ---- building blocks (no cache) -------------------------------------------------

    def project_q(self, x: jax.Array, freqs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Queries and the query latent.

        Args:
          x: `[B, S, d]` normalised layer input; freqs: `[B, S, R/2, 2]`.
        Returns:
          `q [B, S, H, D]` (x dtype; per-head RMS-normalised and rotated) and
          `c_q [B, S, q_lora]` (the indexer's query input).
        """
        b, s, _ = x.shape
        c_q = ops.rms_norm(jnp.dot(x, self.q_a_proj[...]), self.q_norm[...], eps=self.eps)
        q = jnp.dot(c_q, self.q_b_proj[...]).reshape(b, s, self.num_heads, self.head_dim)
        q = ops.apply_rope(ops.rms_norm(q, eps=self.eps), freqs[:, :, None])
        return q, c_q

    def project_kv(self, x: jax.Array, freqs: jax.Array) -> jax.Array:
        """The shared key=value row: `x [B, S, d]`, freqs `[B, S, R/2, 2]` -> `[B, S, D]`."""
        kv = ops.rms_norm(jnp.dot(x, self.kv_proj[...]), self.kv_norm[...], eps=self.eps)
        return ops.apply_rope(kv, freqs)

    def attend(self, q: jax.Array, main_rows: jax.Array, main_idx: jax.Array, *,
               freqs: jax.Array, extra_rows: jax.Array | None = None,
               extra_idx: jax.Array | None = None) -> jax.Array:
        """Sink attention over the listed rows, inverse RoPE, grouped output projection.

        Args:
          q: `[B, S, H, D]`; main_rows `[N, D]` / main_idx int32 `[B, S, K]`;
          extra_rows `[N2, D]` / extra_idx int32 `[B, S, K2]` or None; `-1` = no row;
          freqs: `[B, S, R/2, 2]` of the query positions (for the inverse rotation).
        Returns:
          `[B, S, d]` in q's dtype.
        """
        b, s = q.shape[:2]
        out = ops.sparse_sink_attention(
            q, main_rows, main_idx, extra_rows=extra_rows, extra_idx=extra_idx,
            sink=self.sinks[...], scale=float(self.head_dim) ** -0.5, inverse_rope=freqs)
        grouped = out.reshape(b, s, self.o_groups, -1)
        mid = jnp.einsum("bsgi,gio->bsgo", grouped, self.o_a_proj[...])
        return jnp.dot(mid.reshape(b, s, -1), self.o_b_proj[...])

    # ---- the target's cached forward ------------------------------------------------

    def __call__(self, x: jax.Array, lc: kvcache.V4LayerCache,
                 ctx: StepContext) -> tuple[jax.Array, kvcache.V4LayerCache]:
        """Cached forward of one call (prefill chunk, decode or verify).

        Args:
          x: `[B, S, d]` normalised layer input; lc: this layer's cache; ctx: layout.
        Returns:
          `(y [B, S, d], lc)`. Order matters: this call's window rows and every entry it
          completes are written BEFORE attending, so later rows of the same call see
          them; padding rows write nothing.
        """
        table = ctx.main_table if self.kind == "swa" else ctx.compressed_table
        freqs = rope_freqs(table, ctx.positions)
        q, c_q = self.project_q(x, freqs)
        kv = self.project_kv(x, freqs)
        window = kvcache.write_rows(lc.window, ctx.slots, ctx.positions, kv, ctx.valid)
        main_idx = kvcache.row_index(window, ctx.slots,
                                     kvcache.window_positions(ctx.positions, self.window))
        lc = dataclasses.replace(lc, window=window)
        if self.compressor is None:
            return self.attend(q, window.rows, main_idx, freqs=freqs), lc
        comp = self.compressor
        state, entries = comp.stream(lc.state, lc.entries, x, slots=ctx.slots,
                                     starts=ctx.starts, lengths=ctx.lengths, table=table)
        lc = dataclasses.replace(lc, state=state, entries=entries)
        if self.kind == "csa":
            idx_state, keys = comp.indexer.stream(lc.index_state, lc.index_keys, x,
                                                  slots=ctx.slots, starts=ctx.starts,
                                                  lengths=ctx.lengths, table=table)
            lc = dataclasses.replace(lc, index_state=idx_state, index_keys=keys)
            chosen = comp.indexer.select(x, c_q, ctx.positions, keys, ctx.slots, table)
            extra_idx = kvcache.row_index(entries, ctx.slots, chosen)
        else:
            n = entries.capacity
            ent = jnp.arange(n, dtype=jnp.int32)
            b, s = ctx.positions.shape
            rows = kvcache.row_index(entries, ctx.slots, jnp.broadcast_to(ent, (b, s, n)))
            visible = ent < ((ctx.positions + 1) // comp.ratio)[..., None]
            extra_idx = jnp.where(visible, rows, -1)
        y = self.attend(q, window.rows, main_idx, freqs=freqs, extra_rows=entries.rows,
                        extra_idx=extra_idx)
        return y, lc
