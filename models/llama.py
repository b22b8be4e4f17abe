"""Dense Llama-family target (SmolLM2, Llama, Qwen2-style without biases) in Flax NNX.

Implements the target-model protocol of `docs/interfaces.md`: `config`, `init_cache`, and
one `__call__` that serves chunked prefill, decode and speculative verify, returning float32
logits, the residual stream entering each `config.capture_layers` layer, and the updated
cache. The engine treats it exactly like the DeepSeek-V4 target.

Architecture: pre-norm blocks (RMSNorm -> GQA attention with RoPE -> residual, RMSNorm ->
SwiGLU -> residual), final RMSNorm, LM head tied to the embedding or separate. RoPE uses
the HF / NeoX half-split pairing (dim i rotates with dim i + head_dim/2), so HF checkpoints
load unchanged; GGUF files store Q/K rows permuted for llama.cpp's adjacent-pair RoPE and
`jax_dspark.checkpoint.gguf` undoes that permutation. Layer weights are stacked along a
leading layer axis and the blocks run under one `lax.scan`: a 30-layer model compiles as
fast as a 1-layer one, which keeps the CPU tests and first-token latency short.

KV cache (`LlamaCache`): flat row pools `k, v [L, R, KV, head_dim]` addressed through a
block table `[num_slots + 1, pages]` of page ids (row = page * page_size + offset), the
same "paged layouts are index arithmetic" scheme the V4 target uses. `init_cache` gives
every slot its own contiguous pages; the last slot is the scratch slot that padding
requests point at, so their writes never touch a real request's rows. Rows at positions
`>= starts + lengths` (padding inside a request) and beyond the slot's capacity are not
written at all (scatter with an out-of-range row id, dropped), and rollback after verify is
bookkeeping only: a later call masks keys by position, so stale rows past the committed
length are overwritten before anything reads them.

Why attention is local here and not `jax_dspark.ops.sparse_sink_attention`: that op is
multi-query attention over ONE shared key=value row per index (V4's latent), with a
per-query index list. Llama has separate K and V and several KV heads. Routing it through
the op would need rows `[k; v]` of twice the width with queries padded by zeros, one call
per KV head, and per-query index lists `[B, S, max_len]` whose reference gathers
`B * S * max_len` rows although every query of a request reads the same causal prefix.
The local masked softmax below gathers each request's rows once (`[B, max_len]`) and masks
by position, which is S times less traffic in prefill and verify and has no head loop.
The engine only depends on this module's `__call__` contract, so a dense GQA kernel can
replace `gqa_attention` later without touching anything else.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dspark import ops

from jax_dspark.models.llama_config import CONFIGS, SMOLLM2_135M, TINY, LlamaConfig

__all__ = [
    "CONFIGS", "SMOLLM2_135M", "TINY", "LlamaConfig", "LlamaCache", "Llama", "LAYER_PARAMS",
    "gqa_attention", "rope_half_split", "tiny_llama", "llama_from_params", "jit_forward",
]

# Names and shapes of the stacked per-layer weights (leading axis = layer). Weights are
# stored (in, out) so a layer computes `x @ w`; `w_gate_up` is [gate | up] along its last
# axis, the layout `ops.mlp_swiglu` takes.
LAYER_PARAMS: dict[str, Callable[[LlamaConfig], tuple[int, ...]]] = {
    "attn_norm": lambda c: (c.num_layers, c.hidden_size),
    "wq": lambda c: (c.num_layers, c.hidden_size, c.num_heads * c.head_dim),
    "wk": lambda c: (c.num_layers, c.hidden_size, c.num_kv_heads * c.head_dim),
    "wv": lambda c: (c.num_layers, c.hidden_size, c.num_kv_heads * c.head_dim),
    "wo": lambda c: (c.num_layers, c.num_heads * c.head_dim, c.hidden_size),
    "mlp_norm": lambda c: (c.num_layers, c.hidden_size),
    "w_gate_up": lambda c: (c.num_layers, c.hidden_size, 2 * c.intermediate_size),
    "w_down": lambda c: (c.num_layers, c.intermediate_size, c.hidden_size),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LlamaCache:
    """Paged KV state of every slot.

    Attributes:
      k, v: `[L, R, KV, head_dim]` row pools, R = pages * page_size; keys are stored after
        RoPE, so reading a row needs no position.
      block_table: `int32[num_slots + 1, pages_per_slot]` page ids of each slot's
        positions (position p of slot s lives in row `block_table[s, p // page_size] *
        page_size + p % page_size`). The last slot is the scratch slot.
      page_size: rows per page (static).
    """

    k: jax.Array
    v: jax.Array
    block_table: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_slots(self) -> int:
        """Real slots (the scratch slot excluded)."""
        return self.block_table.shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        return self.block_table.shape[0] - 1

    @property
    def max_len(self) -> int:
        """Positions each slot can hold (the requested max_len rounded up to a page)."""
        return self.block_table.shape[1] * self.page_size


def rope_half_split(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x [B, S, N, D]` by RoPE with HF / NeoX pairing (i with i + D/2).

    `cos, sin` are `f32[B, S, 1, D/2]`. Not `ops.apply_rope`, which pairs adjacent dims
    (V4's convention); the math is f32 and the result has x's dtype.
    """
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """`cos, sin f32[B, S, 1, head_dim/2]` of integer positions `[B, S]`, computed on the fly
    (no table, so no maximum position to agree on)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float) -> jax.Array:
    """Grouped-query attention with an explicit mask, f32 softmax.

    Args:
      q: `[B, S, H, D]`; query head h reads KV head `h // (H // KV)` (HF `repeat_kv`).
      k, v: `[B, T, KV, D]`.
      mask: `bool[B, S, T]`, True = visible. A row with nothing visible gives a uniform
        average instead of NaN (only padding rows can be in that state).
      scale: softmax scale.
    Returns:
      `[B, S, H, D]` in q's dtype.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, d).astype(jnp.float32)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k.astype(jnp.float32)) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v.astype(jnp.float32))
    return out.reshape(b, s, h, d).astype(q.dtype)


class _Layers(nnx.Module):
    """All decoder blocks' weights, stacked along a leading layer axis (see LAYER_PARAMS)."""

    def __init__(self, config: LlamaConfig, rngs: nnx.Rngs):
        dt = config.jnp_dtype
        for name, shape_of in LAYER_PARAMS.items():
            shape = shape_of(config)
            if name.endswith("norm"):
                # Random around 1 rather than exactly 1, so a test can tell whether the
                # norm weight is applied.
                value = 1.0 + 0.1 * jax.random.normal(rngs.params(), shape, jnp.float32)
            else:
                value = jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(shape[-2])
            setattr(self, name, nnx.Param(value.astype(dt)))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS}


class Llama(nnx.Module):
    """Llama-family decoder implementing the target-model protocol.

    Usage:
      model = Llama(TINY, rngs=nnx.Rngs(0))
      cache = model.init_cache(num_slots=2, max_len=64)
      logits, hiddens, cache = model(tokens, cache, slots=..., starts=..., lengths=...)

    Parameters (all `nnx.Param`): `embedding [V, d]`, `final_norm [d]`, `lm_head [d, V]`
    when untied, and `layers.<name>` for the stacked block weights in `LAYER_PARAMS`.
    """

    #: which `jax_dspark.parallel` sharding table places this model's parameters
    sharding_family = "llama"

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config: must be a LlamaConfig (got {type(config).__name__})")
        self.config = config
        dt = config.jnp_dtype
        d, vocab = config.hidden_size, config.vocab_size
        self.embedding = nnx.Param(
            (jax.random.normal(rngs.params(), (vocab, d), jnp.float32) / np.sqrt(d)).astype(dt))
        self.layers = _Layers(config, rngs)
        self.final_norm = nnx.Param(
            (1.0 + 0.1 * jax.random.normal(rngs.params(), (d,), jnp.float32)).astype(dt))
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(
                (jax.random.normal(rngs.params(), (d, vocab), jnp.float32) / np.sqrt(d)).astype(dt))

    # -- pieces a drafter shares -------------------------------------------------------

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings `[..., d]` (model dtype) of `int[...]` ids; ids are clipped
        into range by the gather, never out of bounds."""
        return jnp.take(self.embedding[...], tokens, axis=0, mode="clip")

    def unembed(self, h: jax.Array) -> jax.Array:
        """LM head only (no final norm): `f32[..., V]` logits of `h [..., d]`."""
        h32 = h.astype(jnp.float32)
        if self.lm_head is None:
            return h32 @ self.embedding[...].astype(jnp.float32).T
        return h32 @ self.lm_head[...].astype(jnp.float32)

    def final_hidden_to_logits(self, h: jax.Array) -> jax.Array:
        """Final RMSNorm then LM head: `f32[..., V]` logits of the last residual `h`."""
        return self.unembed(ops.rms_norm(h, self.final_norm[...], eps=self.config.rms_eps))

    # -- cache --------------------------------------------------------------------------

    def init_cache(self, num_slots: int, max_len: int, *, page_size: int | None = None) -> LlamaCache:
        """Empty cache for `num_slots` requests of up to `max_len` positions each, plus the
        scratch slot (index `num_slots`). `max_len` is rounded up to whole pages.

        The pools start as zeros: every row a valid query can see is written (by the call
        that carries its position) before it is read, so the initial value never matters;
        tests poison the pools to prove that.
        """
        cfg = self.config
        if not isinstance(num_slots, (int, np.integer)) or num_slots < 1:
            raise ValueError(f"num_slots: must be a positive int (got {num_slots!r})")
        if not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"max_len: must be a positive int (got {max_len!r})")
        page_size = cfg.page_size if page_size is None else page_size
        if not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size: must be a positive int (got {page_size!r})")
        pages_per_slot = -(-int(max_len) // int(page_size))
        slots = int(num_slots) + 1
        rows = slots * pages_per_slot * int(page_size)
        shape = (cfg.num_layers, rows, cfg.num_kv_heads, cfg.head_dim)
        block_table = jnp.arange(slots * pages_per_slot, dtype=jnp.int32).reshape(slots, pages_per_slot)
        return LlamaCache(
            k=jnp.zeros(shape, cfg.jnp_dtype),
            v=jnp.zeros(shape, cfg.jnp_dtype),
            block_table=block_table,
            page_size=int(page_size),
        )

    # -- forward ------------------------------------------------------------------------

    def __call__(
        self,
        tokens: jax.Array,
        cache: LlamaCache,
        *,
        slots: jax.Array,
        starts: jax.Array,
        lengths: jax.Array,
    ) -> tuple[jax.Array, jax.Array, LlamaCache]:
        """Run `tokens` at positions `starts + j` of each request's slot.

        Args:
          tokens: `int32[B, S]`.
          cache: from `init_cache`.
          slots: `int32[B]` slot per request (`cache.scratch_slot` for padding requests).
          starts: `int32[B]` position of `tokens[:, 0]` (= committed length).
          lengths: `int32[B]` valid rows; rows `j >= lengths[b]` are padding (not written,
            outputs unspecified).
        Returns:
          `logits f32[B, S, V]`, `hiddens [B, S, C, d]` (residual entering each
          `capture_layers` layer, model dtype) and the updated cache.
        """
        cfg = self.config
        b, s = _check_call(cfg, tokens, cache, slots, starts, lengths)
        tokens = jnp.asarray(tokens, jnp.int32)
        slots = jnp.asarray(slots, jnp.int32)
        starts = jnp.asarray(starts, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)

        positions = starts[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]      # [B, S]
        write_rows, read_rows = _cache_rows(cache, slots, positions, lengths)
        key_positions = jnp.arange(read_rows.shape[1], dtype=jnp.int32)
        mask = key_positions[None, None, :] <= positions[:, :, None]               # [B, S, T]
        live = key_positions[None, :] < (starts + lengths)[:, None]                 # [B, T]
        cos, sin = _rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)

        capture = jnp.asarray(cfg.capture_layers, jnp.int32).reshape(-1)
        x = self.embed(tokens)
        captured = jnp.zeros((capture.shape[0], b, s, cfg.hidden_size), x.dtype)

        def body(carry, xs):
            x, k_pool, v_pool, captured = carry
            layer, weights = xs
            captured = jnp.where((capture == layer)[:, None, None, None], x[None], captured)
            x, k_pool, v_pool = _block(
                cfg, weights, x, layer, k_pool, v_pool, cos, sin, write_rows, read_rows, live, mask)
            return (x, k_pool, v_pool, captured), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, k_pool, v_pool, captured), _ = jax.lax.scan(
            body, (x, cache.k, cache.v, captured), (layer_ids, self.layers.arrays()))
        captured = jnp.where((capture == cfg.num_layers)[:, None, None, None], x[None], captured)
        logits = self.final_hidden_to_logits(x)
        hiddens = jnp.moveaxis(captured, 0, 2)
        return logits, hiddens, dataclasses.replace(cache, k=k_pool, v=v_pool)


def _block(cfg, w, x, layer, k_pool, v_pool, cos, sin, write_rows, read_rows, live, mask):
    """One decoder block on `x [B, S, d]`; writes this chunk's K/V rows, then attends over
    the request's rows (prefix + chunk) masked by position."""
    b, s, _ = x.shape
    hd = cfg.head_dim
    h = ops.rms_norm(x, w["attn_norm"], eps=cfg.rms_eps)
    q = (h @ w["wq"]).reshape(b, s, cfg.num_heads, hd)
    k = (h @ w["wk"]).reshape(b, s, cfg.num_kv_heads, hd)
    v = (h @ w["wv"]).reshape(b, s, cfg.num_kv_heads, hd)
    q = rope_half_split(q, cos, sin)
    k = rope_half_split(k, cos, sin)
    k_pool = k_pool.at[layer, write_rows].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer, write_rows].set(v.astype(v_pool.dtype), mode="drop")
    # Rows past the last valid position of the request are never visible to a valid
    # query, but a masked probability of 0 times a NaN row is still NaN: zero them so
    # stale or never-written rows cannot leak into any output row.
    keys = jnp.where(live[:, :, None, None], k_pool[layer, read_rows], 0)             # [B, T, KV, hd]
    values = jnp.where(live[:, :, None, None], v_pool[layer, read_rows], 0)
    attn = gqa_attention(q, keys, values, mask, scale=hd ** -0.5)
    x = x + attn.reshape(b, s, cfg.num_heads * hd) @ w["wo"]
    h = ops.rms_norm(x, w["mlp_norm"], eps=cfg.rms_eps)
    x = x + ops.mlp_swiglu(h, w["w_gate_up"], w["w_down"])
    return x, k_pool, v_pool


def _cache_rows(cache: LlamaCache, slots, positions, lengths):
    """Pool rows to write (`[B, S]`, out-of-range id = skip) and to read (`[B, T]`)."""
    ps = cache.page_size
    n_rows = cache.k.shape[1]
    table = cache.block_table[slots]                                                # [B, P]
    pages = table.shape[1]
    page_idx = jnp.clip(positions // ps, 0, pages - 1)
    rows = jnp.take_along_axis(table, page_idx, axis=1) * ps + positions % ps
    valid = (jnp.arange(positions.shape[1])[None, :] < lengths[:, None]) & (positions >= 0) & (
        positions < pages * ps)
    write_rows = jnp.where(valid, rows, n_rows)
    read_rows = (table[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)).reshape(table.shape[0], -1)
    return write_rows, read_rows


def _check_call(cfg, tokens, cache, slots, starts, lengths) -> tuple[int, int]:
    shape = np.shape(tokens)
    if len(shape) != 2:
        raise ValueError(f"tokens: expected rank 2 [B, S] (got shape {shape})")
    dtype = tokens.dtype if hasattr(tokens, "dtype") else np.asarray(tokens).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"tokens: must be integer ids (got dtype {dtype})")
    b, s = shape
    for name, arr in (("slots", slots), ("starts", starts), ("lengths", lengths)):
        if np.shape(arr) != (b,):
            raise ValueError(f"{name}: expected shape ({b},) to match tokens' batch (got {np.shape(arr)})")
    if not isinstance(cache, LlamaCache):
        raise ValueError(f"cache: must be a LlamaCache from init_cache (got {type(cache).__name__})")
    expected = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    got = (cache.k.shape[0],) + tuple(cache.k.shape[2:])
    if got != expected:
        raise ValueError(f"cache: pools (L, KV, head_dim) must be {expected} for this config (got {got})")
    return b, s


def tiny_llama(seed: int = 0, config: LlamaConfig = TINY) -> Llama:
    """Random-weight tiny target from a fixed seed (CPU seconds)."""
    return Llama(config, rngs=nnx.Rngs(seed))


def llama_from_params(config: LlamaConfig, params: Mapping[str, np.ndarray]) -> Llama:
    """A `Llama` holding the given weights, without paying for a random init.

    `params` maps `embedding`, `final_norm`, `lm_head` (untied only) and `layers.<name>` for
    each name in `LAYER_PARAMS` to arrays of the shapes `Llama` declares; any missing,
    extra or misshaped entry is a ValueError naming it.
    """
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    expected = {"embedding": (config.vocab_size, config.hidden_size),
                "final_norm": (config.hidden_size,)}
    if not config.tie_embeddings:
        expected["lm_head"] = (config.hidden_size, config.vocab_size)
    expected.update({f"layers.{n}": fn(config) for n, fn in LAYER_PARAMS.items()})
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"params: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        value = params[name]
        if tuple(np.shape(value)) != shape:
            raise ValueError(f"params[{name!r}]: expected shape {shape} (got {np.shape(value)})")
        owner = model.layers if name.startswith("layers.") else model
        var = getattr(owner, name.split(".")[-1])
        var.set_value(jnp.asarray(value, config.jnp_dtype))
    return model


def jit_forward(model: Llama) -> Callable[..., tuple[jax.Array, jax.Array, LlamaCache]]:
    """`fn(tokens, cache, slots, starts, lengths) -> (logits, hiddens, cache)` jitted over
    the model's current weights with the cache donated (the interface's split/merge form).
    """
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(params, tokens, cache, slots, starts, lengths):
        return nnx.merge(graphdef, params)(tokens, cache, slots=slots, starts=starts, lengths=lengths)

    return functools.partial(step, params)
