"""DeepSeek-V4 target model (Flax NNX) with a paged cache and one forward for
prefill chunks, decode and verify.

    model = DeepseekV4(deepseek_v4_config.tiny(), rngs=nnx.Rngs(0))
    cache = model.init_cache(num_slots=4, max_len=256)
    logits, hiddens, cache = model(tokens, cache, slots=slots, starts=starts, lengths=lengths)

Target protocol (docs/interfaces.md): token `tokens[b, j]` sits at position
`starts[b] + j`; rows `j >= lengths[b]` are padding (outputs unspecified, nothing
written); slot `cache.scratch_slot` (the last) is for padding requests. Rollback is
bookkeeping: every state a later call reads is indexed by position (window ring,
compressor rings, compressed rows), so after a verify the engine just continues from
`starts + n + 1`. `hiddens[:, :, c]` is the mean over the mHC streams ENTERING layer
`config.capture_layers[c]` (the DSpark capture point); with `capture_streams=True` the
final mHC streams follow them (the MTP block's input, see `deepseek_v4_mtp.py`).

Jitted entry points (`prefill_chunk`, `decode`, `verify`) take `(graphdef, params)` from
`nnx.split(model)` and donate the cache; they are one compiled function per shape.

The blocks are importable for the DSpark drafter: `DecoderLayer`, `Attention`,
`HyperConnection` / `mhc_pre` / `mhc_post` / `HyperHead`, `MoE` (see
docs/deepseek_v4.md, "Reusing V4 blocks").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark import ops
from .deepseek_v4_attention import Attention, StepContext, rope_freqs
from .deepseek_v4_block import DecoderLayer
from .deepseek_v4_config import CONFIGS, DeepseekV4Config, flash, pro, tiny
from .deepseek_v4_mhc import HyperConnection, HyperHead, mhc_post, mhc_pre, sinkhorn
from .deepseek_v4_moe import MoE
from .deepseek_v4_params import kernel, norm_weight, normal

__all__ = [
    "CONFIGS", "Attention", "DecoderLayer", "DeepseekV4", "DeepseekV4Config", "HyperConnection",
    "HyperHead", "MTPBlock", "MoE", "StepContext", "count_params", "decode", "flash", "forward",
    "mhc_post", "mhc_pre", "prefill_chunk", "pro", "rope_freqs", "rope_tables", "sinkhorn",
    "tiny", "verify",
]


def rope_tables(config: DeepseekV4Config, num_positions: int) -> tuple[jax.Array, jax.Array]:
    """`(main, compressed)` RoPE tables `f32[num_positions, R/2, 2]`.

    main: theta `rope_theta`, no YaRN (window-only layers, the MTP block, drafters);
    compressed: theta `compress_rope_theta` with YaRN (CSA / HCA layers, all their rows).
    """
    c = config
    main = ops.rope_table(num_positions, c.rope_dim, theta=c.rope_theta)
    yarn = ops.YarnScaling(factor=c.yarn_factor,
                           original_max_positions=c.yarn_original_max_positions,
                           beta_fast=c.yarn_beta_fast, beta_slow=c.yarn_beta_slow)
    compressed = ops.rope_table(num_positions, c.rope_dim, theta=c.compress_rope_theta,
                                yarn=yarn)
    return main, compressed


class MTPBlock(nnx.Module):
    """The released multi-token-prediction block (`mtp.0`), spec 1.7.

    One extra window-only, score-routed V4 block fed with the target's FINAL mHC streams
    (`X` entering the HC head) of position `p` and the embedding of the token at `p + 1`;
    its own HC head and final norm, then the target's LM head, predict the token at
    `p + 2`. Per stream `i`: `input_i = e_proj(enorm(embed(t_{p+1}))) + h_proj(hnorm(X_i))`
    (the embedding term is broadcast to the n streams; V3 concatenated and used one
    `eh_proj`). The cached forward and the MTP-1 drafter are in `deepseek_v4_mtp.py`; this
    class holds the parameters and the per-row math.

    Attributes: enorm, hnorm `[d]`, e_proj, h_proj `[d, d]`, a window-only non-hash
    `layer`, its own `hc_head` and `norm` (the LM head is shared).
    """

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        c = config
        self.eps = c.rms_eps
        self.enorm = norm_weight(rngs, c.hidden_size, c.dtype)
        self.hnorm = norm_weight(rngs, c.hidden_size, c.dtype)
        self.e_proj = kernel(rngs, c.hidden_size, c.hidden_size, c.dtype, c.init_std)
        self.h_proj = kernel(rngs, c.hidden_size, c.hidden_size, c.dtype, c.init_std)
        self.layer = DecoderLayer(c, c.num_layers, rngs=rngs, kind="swa", hashed=False)
        self.hc_head = HyperHead(c.hidden_size, hc_mult=c.hc_mult, eps=c.hc_eps,
                                 norm_eps=c.hc_norm_eps, init_std=c.init_std, rngs=rngs)
        self.norm = norm_weight(rngs, c.hidden_size, c.dtype)

    def inputs(self, streams: jax.Array, embedded: jax.Array) -> jax.Array:
        """The block's input streams.

        Args:
          streams: `[..., n, d]` the target's final streams of position p.
          embedded: `[..., d]` the (target-)embedded token at p + 1.
        Returns:
          `[..., n, d]` (streams dtype) `= e_proj(enorm(e)) + h_proj(hnorm(X_i))`.
        """
        e = ops.rms_norm(embedded.astype(streams.dtype), self.enorm[...], eps=self.eps)
        e = jnp.dot(e, self.e_proj[...].astype(e.dtype))
        h = ops.rms_norm(streams, self.hnorm[...], eps=self.eps)
        h = jnp.dot(h, self.h_proj[...].astype(h.dtype))
        return (h + e[..., None, :]).astype(streams.dtype)

    def kv_rows(self, streams: jax.Array, embedded: jax.Array, freqs: jax.Array) -> jax.Array:
        """The window rows the cached forward would write, without attending.

        `streams [B, S, n, d]`, `embedded [B, S, d]`, freqs `[B, S, R/2, 2]` -> `[B, S, D]`:
        the block's attention input (mHC pre + `input_layernorm`) through `kv_proj` +
        `kv_norm` + RoPE, exactly what `Attention.__call__` stores. The MTP-1 drafter's
        commit needs only these (one block: nothing downstream reads a committed row's
        output).
        """
        x, _, _ = self.layer.attention_input(self.inputs(streams, embedded))
        return self.layer.self_attn.project_kv(x, freqs)

    def __call__(self, streams: jax.Array, embedded: jax.Array, token_ids: jax.Array,
                 lc: kvcache.V4LayerCache, ctx: StepContext,
                 ) -> tuple[jax.Array, kvcache.V4LayerCache]:
        """Cached block forward: `streams [B, S, n, d]` (target's final streams at the
        positions `ctx.positions`), `embedded [B, S, d]` and `token_ids [B, S]` of the next
        tokens, the block's window cache `lc` -> `(output streams [B, S, n, d], lc)`."""
        return self.layer(self.inputs(streams, embedded), token_ids, lc, ctx)

    def head(self, streams: jax.Array) -> jax.Array:
        """`[..., n, d]` -> `[..., d]`: own HC head and final norm (then the shared LM head)."""
        return ops.rms_norm(self.hc_head(streams), self.norm[...], eps=self.eps)


class DeepseekV4(nnx.Module):
    """The V4 target (see module docstring). Parameter paths follow HF (`embed_tokens`,
    `layers.{i}.*`, `hc_head`, `norm`, `lm_head`, `mtp`).

    `capture_streams` (a static attribute; may be set after construction, e.g. on a loaded
    model, before `nnx.split`): when true, `__call__`'s `hiddens` gain the n final mHC
    streams (`X` entering the HC head) after the C captures, `[B, S, C + n, d]` with
    `hiddens[:, :, C + i]` = stream i. This is how the MTP drafter
    (`deepseek_v4_mtp.MTPDrafter`) receives them through the engine, whose only channel
    from the target forward to a drafter is `hiddens`. The mean over the streams (a
    capture of layer `num_layers`) is not enough: the MTP block normalises and projects
    every stream on its own. `forward_streams` returns the streams directly.
    """

    #: which `jax_dspark.parallel` sharding table places this model's parameters
    sharding_family = "v4"

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs,
                 capture_streams: bool = False):
        c = config
        self.config = c
        self.capture_streams = bool(capture_streams)
        self.embed_tokens = nnx.Param(normal(rngs, (c.vocab_size, c.hidden_size), 1.0, c.dtype))
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs) for i in range(c.num_layers)])
        self.hc_head = HyperHead(c.hidden_size, hc_mult=c.hc_mult, eps=c.hc_eps,
                                 norm_eps=c.hc_norm_eps, init_std=c.init_std, rngs=rngs)
        self.norm = norm_weight(rngs, c.hidden_size, c.dtype)
        self.lm_head = kernel(rngs, c.hidden_size, c.vocab_size, c.dtype, c.init_std)
        self.mtp = MTPBlock(c, rngs=rngs) if c.num_mtp_layers else None

    def cache_specs(self) -> tuple[kvcache.LayerCacheSpec, ...]:
        c = self.config
        specs = []
        for i in range(c.num_layers):
            kind = c.layer_kind(i)
            specs.append(kvcache.LayerCacheSpec(
                window=c.window, ratio=c.compress_ratios[i], overlap=kind == "csa",
                head_dim=c.head_dim, index_head_dim=c.index_head_dim if kind == "csa" else 0))
        return tuple(specs)

    def init_cache(self, num_slots: int, max_len: int, *, max_tokens_per_call: int = 256,
                   page_size: int = 64) -> kvcache.DeepseekV4Cache:
        """A cache for `num_slots` requests (+ the scratch slot) of up to `max_len` tokens.

        `max_tokens_per_call` bounds the S of any later call (it sizes the rings that make
        rollback free); `page_size` is rows per page of every pool.
        """
        tables = rope_tables(self.config, max_len + max_tokens_per_call)
        return kvcache.init_deepseek_v4_cache(
            self.cache_specs(), num_slots, max_len, max_tokens_per_call=max_tokens_per_call,
            page_size=page_size, dtype=self.config.cache_dtype, tables=tables)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings `[..., d]` (shared with the DSpark drafter)."""
        return jnp.take(self.embed_tokens[...], jnp.asarray(tokens, jnp.int32), axis=0, mode="clip")

    def unembed(self, h: jax.Array) -> jax.Array:
        """The LM head alone (no HC head, no final norm): `f32[..., V]` logits of `h [..., d]`."""
        return jnp.dot(h, self.lm_head[...].astype(h.dtype), preferred_element_type=jnp.float32)

    def forward_streams(self, tokens: jax.Array, cache: kvcache.DeepseekV4Cache, *,
                        slots: jax.Array, starts: jax.Array, lengths: jax.Array,
                        ) -> tuple[jax.Array, jax.Array, kvcache.DeepseekV4Cache]:
        """`__call__` without the head: `(streams [B, S, n, d], hiddens [B, S, C, d], cache)`.

        `streams` are the final mHC streams (entering the HC head; the MTP block's input);
        `hiddens` are the C captures only (never the streams). Arguments as `__call__`.
        """
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens.shape={tokens.shape}: expected [B, S]")
        b, s = tokens.shape
        if s > cache.max_tokens_per_call:
            raise ValueError(f"tokens.shape={tokens.shape}: S={s} exceeds the cache's "
                             f"max_tokens_per_call={cache.max_tokens_per_call}")
        if len(cache.layers) != c.num_layers:
            raise ValueError(f"cache has {len(cache.layers)} layers, model {c.num_layers}")
        for name, arr in (("slots", slots), ("starts", starts), ("lengths", lengths)):
            if jnp.shape(arr) != (b,):
                raise ValueError(f"{name}.shape={jnp.shape(arr)}: expected ({b},)")
        ctx = StepContext.make(slots, starts, lengths, s, *cache.tables)
        tokens = tokens.astype(jnp.int32)
        x = self.embed(tokens)
        streams = jnp.broadcast_to(x[:, :, None, :], (b, s, c.hc_mult, c.hidden_size))
        captured: dict[int, jax.Array] = {}
        layer_caches = []
        for i, layer in enumerate(self.layers):
            if i in c.capture_layers:
                captured[i] = streams.astype(jnp.float32).mean(axis=2).astype(c.dtype)
            streams, lc = layer(streams, tokens, cache.layers[i], ctx)
            layer_caches.append(lc)
        if c.num_layers in c.capture_layers:
            captured[c.num_layers] = streams.astype(jnp.float32).mean(axis=2).astype(c.dtype)
        if c.capture_layers:
            hiddens = jnp.stack([captured[i] for i in c.capture_layers], axis=2)
        else:
            hiddens = jnp.zeros((b, s, 0, c.hidden_size), c.dtype)
        lengths_out = cache.lengths.at[ctx.slots].set(ctx.starts + ctx.lengths)
        cache = dataclasses.replace(cache, layers=tuple(layer_caches), lengths=lengths_out)
        return streams, hiddens, cache

    def logits_from_streams(self, streams: jax.Array) -> jax.Array:
        """HC head, final norm, LM head: `[..., n, d]` -> `f32[..., V]`."""
        h = ops.rms_norm(self.hc_head(streams), self.norm[...], eps=self.config.rms_eps)
        return self.unembed(h)

    def __call__(self, tokens: jax.Array, cache: kvcache.DeepseekV4Cache, *,
                 slots: jax.Array, starts: jax.Array, lengths: jax.Array,
                 ) -> tuple[jax.Array, jax.Array, kvcache.DeepseekV4Cache]:
        """One forward over `S` rows per request.

        Args:
          tokens: int32 `[B, S]`; cache: from `init_cache`; slots, starts, lengths:
          int32 `[B]`.
        Returns:
          `logits f32 [B, S, V]`, `hiddens [B, S, C, d]` (C = len(capture_layers); with
          `capture_streams`, `[B, S, C + n, d]`, the final streams appended), and the
          updated cache (`cache.lengths[slots] = starts + lengths`).
        """
        streams, hiddens, cache = self.forward_streams(tokens, cache, slots=slots,
                                                       starts=starts, lengths=lengths)
        logits = self.logits_from_streams(streams)
        if self.capture_streams:
            hiddens = jnp.concatenate([hiddens, streams.astype(hiddens.dtype)], axis=2)
        return logits, hiddens, cache


def count_params(config: DeepseekV4Config) -> int:
    """Number of parameters (`nnx.Param` elements; buffers excluded), without allocating."""
    abstract = nnx.eval_shape(lambda: DeepseekV4(config, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    return sum(int(x.size) for x in leaves)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def forward(graphdef: nnx.GraphDef, params: nnx.State, cache: kvcache.DeepseekV4Cache,
            tokens: jax.Array, slots: jax.Array, starts: jax.Array, lengths: jax.Array,
            ) -> tuple[jax.Array, jax.Array, kvcache.DeepseekV4Cache]:
    """Jitted `DeepseekV4.__call__` over `(graphdef, params) = nnx.split(model)`; the
    cache is donated (do not reuse the argument). One compilation per (B, S)."""
    model = nnx.merge(graphdef, params)
    return model(tokens, cache, slots=slots, starts=starts, lengths=lengths)


def prefill_chunk(graphdef: nnx.GraphDef, params: nnx.State, cache: kvcache.DeepseekV4Cache,
                  tokens: jax.Array, slots: jax.Array, starts: jax.Array, lengths: jax.Array):
    """One prefill chunk `tokens [B, C]` (per-request `lengths <= C`); see `forward`."""
    return forward(graphdef, params, cache, tokens, slots, starts, lengths)


def decode(graphdef: nnx.GraphDef, params: nnx.State, cache: kvcache.DeepseekV4Cache,
           tokens: jax.Array, slots: jax.Array, starts: jax.Array,
           lengths: jax.Array | None = None):
    """One token per request: `tokens [B]` -> `(logits [B, V], hiddens [B, C, d], cache)`.

    `lengths` (0 or 1 per request) marks padding requests; default all 1.
    """
    if lengths is None:
        lengths = jnp.ones(tokens.shape, jnp.int32)
    logits, hiddens, cache = forward(graphdef, params, cache, tokens[:, None], slots, starts,
                                     lengths)
    return logits[:, 0], hiddens[:, 0], cache


def verify(graphdef: nnx.GraphDef, params: nnx.State, cache: kvcache.DeepseekV4Cache,
           tokens: jax.Array, slots: jax.Array, starts: jax.Array, lengths: jax.Array):
    """Verify forward over `[anchor, d_1 .. d_l]` rows (`tokens [B, S]`, per-request
    `lengths`); returns all S rows' logits and captured hiddens. Rows past the accepted
    prefix need no undo: continue from the committed length."""
    return forward(graphdef, params, cache, tokens, slots, starts, lengths)
