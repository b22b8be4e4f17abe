"""The DSpark drafter embedded in DeepSeek-V4 checkpoints (`mtp.{0,1,2}.*`).

Spec: `../shared/notes/dspark-spec.md` sections 1.2 and 2. Stages are ordinary V4 blocks
(mHC around attention, mHC around the MoE; window-only, score-routed) whose attention is
DSpark attention:

* context: the target's captured hiddens (mean of the mHC streams entering the capture
  layers) are concatenated, projected by `main_proj` and normed (`main_norm`) ONCE per
  committed position; each stage turns that into its own shared key=value row with its
  own `kv_proj` + `kv_norm` + RoPE at the row's position, and keeps the last `W` of them
  in a ring (`W` = the target's window, 128 in the release). Only committed positions are
  ever written, so rejected drafts never pollute the ring and nothing is rolled back.
* block: `[anchor, noise x (g-1)]` embedded with the target's table, replicated into the
  `n` mHC streams, at positions `lengths .. lengths + g - 1`.
* attention: `ops.sparse_sink_attention` with the stage's ring as the main pool (the W
  committed positions before the block) and the block's own K/V rows as the extra pool,
  every block row seeing every block row (non-causal), per-head sink, inverse RoPE on the
  output, grouped low-rank output projection: exactly the V4 attention block's `attend`.
* head: `hc_head` collapses the streams, `norm`, then the target's LM head; the Markov
  and confidence heads of `dspark_heads.py` finish the proposal (`spec.propose`).

The blocks come from `models/deepseek_v4*.py` (`DecoderLayer.attention_input`, `.ffn`,
`Attention.project_q / project_kv / attend`, `HyperHead`), so stage weights have the
target's layout and names. The confidence head reads the collapsed hidden BEFORE the final
norm (the official V4.1 reference and SGLang), switchable with
`confidence_post_norm` for checkpoints trained on the post-norm state (DeepSpec, TRT).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark import ops
from jax_dspark.ops.sampling import SamplingParams
from jax_dspark.spec.propose import Proposal, propose

from .deepseek_v4_block import DecoderLayer
from .deepseek_v4_config import DeepseekV4Config
from .deepseek_v4_mhc import HyperHead, mhc_post
from .deepseek_v4_params import kernel, norm_weight
from .dspark import block_input_ids, shared_embed, shared_unembed
from .dspark_heads import ConfidenceHead, MarkovHead

__all__ = ["DSparkV4Config", "DSparkV4State", "DSparkV4Drafter", "tiny_dspark_v4"]


@dataclasses.dataclass(frozen=True)
class DSparkV4Config:
    """The V4-embedded drafter: stage count, block geometry and heads.

    Attributes:
      target: the target's `DeepseekV4Config`; every stage is a V4 block of its shape
        (hidden size, heads, q/o LoRA ranks, MoE, mHC), window-only and score-routed.
      block_size: g, block slots = drafts per block (5 in the release).
      num_stages: V4 blocks in the backbone (3 in the release).
      markov_rank: r of the Markov head (256 in the release).
      noise_token_id: id of block slots 1..g-1 (128799 in the release).
      ring_size: committed context rows each stage keeps (the target's window, 128); 0
        means "use `target.window`".
      confidence_post_norm: confidence head reads the final-normed hidden (DeepSpec,
        TRT) instead of the pre-norm collapsed one (official V4.1, SGLang).
      kv_fp8: emulate the reference's FP8 storage of K/V: the non-RoPE dims of every
        context and block row are quantised and dequantised in 1x64 blocks (UE8M0
        scales); the RoPE dims stay in the activation dtype.
    """

    target: DeepseekV4Config
    block_size: int = 5
    num_stages: int = 3
    markov_rank: int = 256
    noise_token_id: int = 128799
    ring_size: int = 0
    confidence_post_norm: bool = False
    kv_fp8: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.target, DeepseekV4Config):
            raise ValueError(f"target: must be a DeepseekV4Config (got {type(self.target).__name__})")
        for name in ("block_size", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int (got {value!r})")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank: must be an int >= 0 (got {self.markov_rank!r})")
        if not 0 <= self.noise_token_id < self.target.vocab_size:
            raise ValueError(
                f"noise_token_id: must lie in [0, {self.target.vocab_size}) (got {self.noise_token_id!r})")
        if not isinstance(self.ring_size, int) or self.ring_size < 0:
            raise ValueError(f"ring_size: must be an int >= 0 (got {self.ring_size!r})")
        if not self.target.capture_layers:
            raise ValueError("target: capture_layers must name the layers the drafter reads (got ())")
        nope = self.target.head_dim - self.target.rope_dim
        if self.kv_fp8 and nope % 64:
            raise ValueError(f"kv_fp8: needs head_dim - rope_dim divisible by 64 (got {nope})")

    @property
    def window(self) -> int:
        return self.ring_size or self.target.window


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSparkV4State:
    """Per-stage context rings and the drafter's RoPE table.

    Attributes:
      rings: one `cache.RowPool` per stage (ring addressing, capacity W, width D, one page
        per slot, `num_slots + 1` slots; the last is the scratch slot): the stage's
        key=value row of each of the last W committed positions, at `position mod W`.
      table: `f32[P, R/2, 2]` (cos, sin) of positions `0 .. P-1` (theta `rope_theta`, no
        YaRN), `P` covering every context and block position of the state's `max_len`.
    """

    rings: tuple[kvcache.RowPool, ...]
    table: jax.Array


class DSparkV4Drafter(nnx.Module):
    """DSpark drafter for DeepSeek-V4 targets (see module docstring).

    Usage:
      drafter = DSparkV4Drafter(DSparkV4Config(target.config, ...), rngs=nnx.Rngs(1))
      state = drafter.init_state(num_slots=2, max_len=256)
      state = drafter.commit(target, state, tokens=..., hiddens=..., slots=..., starts=..., counts=...)
      proposal = drafter.draft(target, state, key, anchor=..., slots=..., lengths=..., sampling=...)

    Parameters (release names in brackets): `main_proj [C*d, d]` (`mtp.0.main_proj`),
    `main_norm [d]` (`mtp.0.main_norm`), `stages[s]` = V4 `DecoderLayer`s (`mtp.{s}.*`),
    `hc_head` and `norm` (last stage's `hc_head_*`, `norm`), `markov` (`markov_head.
    markov_w{1,2}`), `confidence` (`confidence_head.proj`, no bias).
    """

    #: which `jax_dspark.parallel` sharding table places this model's parameters
    sharding_family = "v4"

    def __init__(self, config: DSparkV4Config, *, rngs: nnx.Rngs):
        if not isinstance(config, DSparkV4Config):
            raise ValueError(f"config: must be a DSparkV4Config (got {type(config).__name__})")
        self.config = config
        c = config.target
        d = c.hidden_size
        self.main_proj = kernel(rngs, len(c.capture_layers) * d, d, c.dtype, c.init_std)
        self.main_norm = norm_weight(rngs, d, c.dtype)
        self.stages = nnx.List([
            DecoderLayer(c, c.num_layers + s, rngs=rngs, kind="swa", hashed=False)
            for s in range(config.num_stages)
        ])
        self.hc_head = HyperHead(d, hc_mult=c.hc_mult, eps=c.hc_eps, norm_eps=c.rms_eps,
                                 init_std=c.init_std, rngs=rngs)
        self.norm = norm_weight(rngs, d, c.dtype)
        self.markov = MarkovHead(c.vocab_size, config.markov_rank, rngs=rngs) if config.markov_rank else None
        self.confidence = ConfidenceHead(d, config.markov_rank, rngs=rngs, use_bias=False)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- state ---------------------------------------------------------------------------

    def init_state(self, num_slots: int, max_len: int) -> DSparkV4State:
        """Empty rings for `num_slots` requests (+ scratch) of up to `max_len` positions."""
        if not isinstance(num_slots, (int, np.integer)) or num_slots < 1:
            raise ValueError(f"num_slots: must be a positive int (got {num_slots!r})")
        if not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"max_len: must be a positive int (got {max_len!r})")
        c = self.config.target
        w = self.config.window
        rings = tuple(
            kvcache.new_pool(int(num_slots), w, c.head_dim, page_size=w, dtype=c.cache_dtype, ring=True)
            for _ in range(self.config.num_stages))
        table = ops.rope_table(int(max_len) + self.block_size + 1, c.rope_dim, theta=c.rope_theta)
        return DSparkV4State(rings=rings, table=table)

    # -- pieces --------------------------------------------------------------------------

    def _freqs(self, state: DSparkV4State, positions: jax.Array) -> jax.Array:
        return state.table[jnp.clip(positions, 0, state.table.shape[0] - 1)]

    def _kv(self, stage: DecoderLayer, x: jax.Array, freqs: jax.Array) -> jax.Array:
        """A stage's key=value rows `[B, S, D]` of normalised inputs `x [B, S, d]`."""
        kv = stage.self_attn.project_kv(x, freqs)
        if self.config.kv_fp8:
            r = self.config.target.rope_dim
            kv = jnp.concatenate([ops.fp8_round_trip(kv[..., :-r], 64), kv[..., -r:]], axis=-1)
        return kv

    def context(self, hiddens: jax.Array) -> jax.Array:
        """`main_norm(main_proj(concat_c hiddens[:, :, c]))`: `[B, S, C, d]` -> `[B, S, d]`."""
        c = self.config.target
        b, s, n_cap, d = hiddens.shape
        if (n_cap, d) != (len(c.capture_layers), c.hidden_size):
            raise ValueError(f"hiddens: expected [B, S, {len(c.capture_layers)}, {c.hidden_size}] "
                             f"(got shape {hiddens.shape})")
        x = jnp.dot(hiddens.reshape(b, s, n_cap * d).astype(c.dtype), self.main_proj[...])
        return ops.rms_norm(x, self.main_norm[...], eps=c.rms_eps)

    # -- contract ------------------------------------------------------------------------

    def commit(
        self,
        target,
        state: DSparkV4State,
        *,
        tokens: jax.Array,
        hiddens: jax.Array,
        slots: jax.Array,
        starts: jax.Array,
        counts: jax.Array,
    ) -> DSparkV4State:
        """Back-fill every stage's ring with the committed rows `j < counts[b]`.

        Only the last W committed rows of the call are written (earlier ones would be
        overwritten in the same scatter, in an unspecified order).

        Args:
          target: unused (context comes from the captured hiddens).
          tokens: `i32[B, S]` unused.
          hiddens: `[B, S, C, d]` captured target hiddens of the forward.
          slots, starts, counts: `i32[B]`; row j sits at position `starts + j`.
        """
        del target, tokens
        s = hiddens.shape[1]
        starts = jnp.asarray(starts, jnp.int32)
        counts = jnp.asarray(counts, jnp.int32)
        slots = jnp.asarray(slots, jnp.int32)
        j = jnp.arange(s, dtype=jnp.int32)[None, :]
        positions = starts[:, None] + j
        keep = (j < counts[:, None]) & (j >= counts[:, None] - self.config.window)
        main_x = self.context(hiddens)
        freqs = self._freqs(state, positions)
        rings = tuple(
            kvcache.write_rows(ring, slots, positions, self._kv(stage, main_x, freqs), keep)
            for stage, ring in zip(self.stages, state.rings))
        return dataclasses.replace(state, rings=rings)

    def backbone(
        self, target, state: DSparkV4State, *, anchor: jax.Array, slots: jax.Array, lengths: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """One parallel pass over the block.

        Returns:
          `(h [B, g, d], h_normed [B, g, d])`: the streams collapsed by `hc_head`, before
          and after the final norm.
        """
        cfg, c = self.config, self.config.target
        g, w = cfg.block_size, cfg.window
        slots = jnp.asarray(slots, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        b = slots.shape[0]
        ids = block_input_ids(anchor, g, cfg.noise_token_id)
        x = shared_embed(target, ids).astype(c.dtype)
        streams = jnp.broadcast_to(x[:, :, None, :], (b, g, c.hc_mult, c.hidden_size))
        positions = lengths[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
        freqs = self._freqs(state, positions)
        # Every block row sees the same context: the W committed positions before the block.
        ctx_positions = kvcache.window_positions(lengths - 1, w)                   # [B, W]
        ctx_positions = jnp.broadcast_to(ctx_positions[:, None, :], (b, g, w))
        block_idx = jnp.broadcast_to(
            (jnp.arange(b, dtype=jnp.int32)[:, None, None] * g + jnp.arange(g, dtype=jnp.int32)), (b, g, g))
        for stage, ring in zip(self.stages, state.rings):
            xa, post, comb = stage.attention_input(streams)
            q, _ = stage.self_attn.project_q(xa, freqs)
            kv = self._kv(stage, xa, freqs)
            y = stage.self_attn.attend(
                q, ring.rows, kvcache.row_index(ring, slots, ctx_positions), freqs=freqs,
                extra_rows=kv.reshape(b * g, -1).astype(ring.rows.dtype), extra_idx=block_idx)
            streams = mhc_post(y, streams, post, comb)
            streams = stage.ffn(streams, ids)
        h = self.hc_head(streams)
        return h, ops.rms_norm(h, self.norm[...], eps=c.rms_eps)

    def draft(
        self,
        target,
        state: DSparkV4State,
        key: jax.Array,
        *,
        anchor: jax.Array,
        slots: jax.Array,
        lengths: jax.Array,
        sampling: SamplingParams,
    ) -> Proposal:
        """Propose one block (contract in `models/dspark.py`): backbone, the target's LM
        head, Markov chain, confidence logits."""
        h, h_normed = self.backbone(target, state, anchor=anchor, slots=slots, lengths=lengths)
        base_logits = shared_unembed(target, h_normed)
        hidden = h_normed if self.config.confidence_post_norm else h
        return propose(key, base_logits, jnp.asarray(anchor, jnp.int32), sampling,
                       markov=self.markov, hidden=hidden, confidence=self.confidence)


def tiny_dspark_v4(target_config: DeepseekV4Config, seed: int = 1, **overrides) -> DSparkV4Drafter:
    """Random-weight V4 drafter for a (tiny) V4 target config: 2 stages, block 4, rank 16."""
    fields = dict(block_size=4, num_stages=2, markov_rank=16, noise_token_id=target_config.vocab_size - 1)
    fields.update(overrides)
    return DSparkV4Drafter(DSparkV4Config(target_config, **fields), rngs=nnx.Rngs(seed))
