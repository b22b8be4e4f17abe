"""DSpark drafters: the standalone drafter for dense targets, and the shared drafter contract.

A DSpark drafter proposes a block of `g` tokens in ONE parallel pass of a few transformer
blocks, then runs a cheap sequential Markov chain over the block (`spec.propose`). Its only
view of the sequence is the target's captured hidden states of the committed positions
(`../shared/notes/dspark-spec.md` sections 1-2, 4):

* block input `[anchor, noise x (g-1)]`, and EVERY slot predicts a draft (slot `j`
  predicts the token right after slot `j`'s position), so `g` inputs give `g` drafts;
* attention is non-causal inside the block; context enters as extra keys/values only
  ("KV injection"), never as queries;
* the target's embedding and LM head are shared (the drafter calls `target.embed` and
  `target.unembed`; it holds no copy), the Markov and confidence heads are its own.

Two backbones implement the contract below: `DSparkDrafter` here (DeepSpec's Qwen3 style
for Llama-family targets) and `DSparkV4Drafter` in `dspark_v4.py` (the drafter embedded
in DeepSeek-V4 checkpoints).

The drafter contract the engine (`jax_dspark.spec.engine`) relies on:

* `block_size: int` (g), static.
* `init_state(num_slots, max_len)` -> a pytree holding `num_slots + 1` slots; the last
  one is the scratch slot that padding and finished requests point at.
* `commit(target, state, *, tokens, hiddens, slots, starts, counts)` -> state: rows
  `j < counts[b]` of a target forward (prefill or verify) are now committed at positions
  `starts[b] + j`; the drafter stores what it needs of them (here: the per-layer context
  K/V of those positions). Rows past `counts` are never stored, so rejected drafts leave
  no trace and rollback needs no copy.
* `draft(target, state, key, *, anchor, slots, lengths, sampling)` -> `spec.Proposal`:
  `lengths[b]` committed positions exist (context rows `0 .. lengths-1`), the anchor
  sits at position `lengths[b]`, block slot `j` at `lengths[b] + j` predicts the token at
  `lengths[b] + j + 1`. This is the official frame convention (spec section 2.1) with
  `p = lengths - 1`.

Positions: the context row of position `i` is the target's hidden entering the capture
layers for the token at `i` (the one whose output predicted the token at `i + 1`), so the
block's first slot, at `i + 1 = lengths`, sits right after the newest context row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dspark import ops
from jax_dspark.ops.sampling import SamplingParams
from jax_dspark.spec.propose import Proposal, propose

from . import _validate
from .dspark_heads import ConfidenceHead, EmbeddingMarkovHead, GatedMarkov, MarkovGate, MarkovHead
from .llama import gqa_attention, rope_half_split

__all__ = [
    "DSparkConfig", "DSparkState", "DSparkDrafter", "block_input_ids", "shared_embed",
    "shared_unembed", "tiny_dspark",
]


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """Standalone DSpark drafter for a Llama-family target (DeepSpec's Qwen3 layout).

    Attributes:
      vocab_size: the target's vocabulary (embedding and LM head are the target's).
      hidden_size: d, the target's width (the drafter's residual stream has the same width,
        because it reads the target's embeddings and feeds the target's LM head).
      num_context_layers: C, how many captured target layers `fc` concatenates (the
        target's `len(capture_layers)`).
      block_size: g, drafts per block (= block slots; DeepSpec ships 7).
      num_layers, num_heads, num_kv_heads, head_dim, intermediate_size: the backbone
        (DeepSpec: 5 layers of the target family's shape).
      rope_theta: RoPE base of the target family (half-split pairs, like the target).
      rms_eps: epsilon of every RMSNorm.
      markov_rank: r of the Markov head (0 = no Markov head).
      markov_factors: how the Markov head stores its `[V, r]` factors: "table" (free
        `W1`, `W2`, DSpark's and V4's layout) or "embedding" (`dspark_heads.
        EmbeddingMarkovHead`: tied to the target's embedding and LM head through two
        `[d, r]` maps, for a high rank within a small file).
      markov_gate: DeepSpec's `gated` Markov variant (`dspark_heads.GatedMarkov`): the
        predecessor's embedding is gated per rank direction by `sigmoid([h; e] W + b)`
        before the logit factor; needs `markov_rank > 0`.
      noise_token_id: id fed into block slots 1..g-1 (DeepSpec's `mask_token_id`).
      confidence_bias: DeepSpec's confidence head has a bias (the V4 one has none).
      dtype: parameter / activation dtype name.
    """

    vocab_size: int
    hidden_size: int
    num_context_layers: int
    block_size: int = 4
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    markov_rank: int = 16
    markov_factors: str = "table"
    markov_gate: bool = False
    noise_token_id: int = 0
    confidence_bias: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _validate.positive_ints(self, ("vocab_size", "hidden_size", "num_context_layers", "block_size",
                                       "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                       "intermediate_size"))
        _validate.grouped_query_heads(self.num_heads, self.num_kv_heads, self.head_dim)
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank: must be an int >= 0 (got {self.markov_rank!r})")
        if self.markov_factors not in ("table", "embedding"):
            raise ValueError(f"markov_factors: must be 'table' or 'embedding' (got {self.markov_factors!r})")
        if not isinstance(self.markov_gate, bool) or (self.markov_gate and not self.markov_rank):
            raise ValueError(f"markov_gate: must be a bool, True only with markov_rank > 0 "
                             f"(got {self.markov_gate!r} with markov_rank {self.markov_rank})")
        if not 0 <= self.noise_token_id < self.vocab_size:
            raise ValueError(
                f"noise_token_id: must lie in [0, {self.vocab_size}) (got {self.noise_token_id!r})")
        if not self.rope_theta > 1:
            raise ValueError(f"rope_theta: must be > 1 (got {self.rope_theta!r})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: must be 'float32' or 'bfloat16' (got {self.dtype!r})")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @classmethod
    def for_target(cls, target_config, **overrides) -> "DSparkConfig":
        """A drafter shaped like a Llama-family target config (`LlamaConfig`).

        Takes width, vocabulary, head shapes, RoPE base and the capture count from the
        target; `overrides` set anything else (block size, layer count, Markov rank, ...).
        """
        fields = dict(
            vocab_size=target_config.vocab_size,
            hidden_size=target_config.hidden_size,
            num_context_layers=len(target_config.capture_layers),
            num_heads=target_config.num_heads,
            num_kv_heads=target_config.num_kv_heads,
            head_dim=target_config.head_dim,
            intermediate_size=target_config.intermediate_size,
            rope_theta=target_config.rope_theta,
            rms_eps=target_config.rms_eps,
            dtype=target_config.dtype,
        )
        fields.update(overrides)
        return cls(**fields)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSparkState:
    """Context K/V of the committed positions, per drafter layer and slot.

    Attributes:
      k, v: `[L, num_slots + 1, max_len, KV, head_dim]`; keys after k_norm and RoPE, so a
        stored row needs no position. Slot `num_slots` is the scratch slot.

    Only committed positions are ever written (by `commit`), and a block pass reads rows
    `< lengths` only, so stale rows past the committed length are harmless.
    """

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


# Names and shapes of the stacked per-layer weights (leading axis = layer), stored (in, out).
LAYER_PARAMS = {
    "attn_norm": lambda c: (c.num_layers, c.hidden_size),
    "wq": lambda c: (c.num_layers, c.hidden_size, c.num_heads * c.head_dim),
    "wk": lambda c: (c.num_layers, c.hidden_size, c.num_kv_heads * c.head_dim),
    "wv": lambda c: (c.num_layers, c.hidden_size, c.num_kv_heads * c.head_dim),
    "q_norm": lambda c: (c.num_layers, c.head_dim),
    "k_norm": lambda c: (c.num_layers, c.head_dim),
    "wo": lambda c: (c.num_layers, c.num_heads * c.head_dim, c.hidden_size),
    "mlp_norm": lambda c: (c.num_layers, c.hidden_size),
    "w_gate_up": lambda c: (c.num_layers, c.hidden_size, 2 * c.intermediate_size),
    "w_down": lambda c: (c.num_layers, c.intermediate_size, c.hidden_size),
}


def block_input_ids(anchor: jax.Array, block_size: int, noise_token_id: int) -> jax.Array:
    """`i32[B, g]` block input `[anchor, noise x (g-1)]` (spec section 4.1)."""
    anchor = jnp.asarray(anchor, jnp.int32)
    noise = jnp.full((anchor.shape[0], block_size - 1), noise_token_id, jnp.int32)
    return jnp.concatenate([anchor[:, None], noise], axis=1)


def shared_embed(target, ids: jax.Array) -> jax.Array:
    """The target's token embeddings `[..., d]` of `ids [...]` (the drafter has no table)."""
    return target.embed(ids)


def shared_unembed(target, h: jax.Array) -> jax.Array:
    """The target's LM head alone (no final norm): `f32[..., V]` logits of `h [..., d]`."""
    return target.unembed(h)


def _cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """`f32[B, S, 1, head_dim/2]` cos and sin of integer positions `[B, S]` (half-split RoPE)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def _random_param(rngs: nnx.Rngs, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    """Random initial value: norms near 1 (randomised, so a test can tell whether the weight
    is applied), matrices `N(0, 1/fan_in)` (fan-in = the second-to-last dim)."""
    if name.endswith("norm"):
        value = 1.0 + 0.1 * jax.random.normal(rngs.params(), shape, jnp.float32)
    else:
        value = jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(shape[-2])
    return value.astype(dtype)


def _with_params(model: nnx.Module, values: dict) -> nnx.Module:
    """`model` with its parameters set to copies of the pure dict `values` (so the result
    shares no arrays with the drafter the values came from)."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.array(x, copy=True), values))
    nnx.update(model, state)
    return model


class _Layers(nnx.Module):
    """All backbone blocks' weights, stacked along a leading layer axis (`LAYER_PARAMS`)."""

    def __init__(self, config: DSparkConfig, rngs: nnx.Rngs):
        for name, shape_of in LAYER_PARAMS.items():
            setattr(self, name, nnx.Param(_random_param(rngs, name, shape_of(config), config.jnp_dtype)))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS}


class DSparkDrafter(nnx.Module):
    """Standalone DSpark drafter for Llama-family targets (DeepSpec / DFlash style).

    Usage:
      drafter = DSparkDrafter(DSparkConfig.for_target(target.config), rngs=nnx.Rngs(1))
      state = drafter.init_state(num_slots=2, max_len=256)
      state = drafter.commit(target, state, tokens=..., hiddens=..., slots=..., starts=..., counts=...)
      proposal = drafter.draft(target, state, key, anchor=..., slots=..., lengths=..., sampling=...)

    Parameters: `fc [C*d, d]` and `hidden_norm [d]` (context projection), `layers.<name>`
    (stacked blocks, `LAYER_PARAMS`), `final_norm [d]`, `markov` (`MarkovHead`, or
    `EmbeddingMarkovHead` with `markov_factors="embedding"`; absent when `markov_rank = 0`),
    `markov_gate` (`MarkovGate`, only with `markov_gate=True`) and `confidence`
    (`ConfidenceHead` over `[h; W1[prev]]`).

    Per layer, the context features are projected by the SAME `wk`/`wv` as the block rows
    (after `k_norm` and RoPE at their own positions); the layer's input norm applies to the
    block rows only, as in DFlash/DeepSpec. Context K/V are computed once, when a position
    is committed, and stored in `DSparkState`; a block pass only computes the block's own
    K/V. The confidence head reads the post-final-norm hidden state (DeepSpec's choice).
    """

    #: which `jax_dspark.parallel` sharding table places this model's parameters
    sharding_family = "llama"

    def __init__(self, config: DSparkConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, DSparkConfig):
            raise ValueError(f"config: must be a DSparkConfig (got {type(config).__name__})")
        self.config = config
        d, c = config.hidden_size, config.num_context_layers
        dt = config.jnp_dtype
        self.fc = nnx.Param(_random_param(rngs, "fc", (c * d, d), dt))
        self.hidden_norm = nnx.Param(_random_param(rngs, "hidden_norm", (d,), dt))
        self.layers = _Layers(config, rngs)
        self.final_norm = nnx.Param(_random_param(rngs, "final_norm", (d,), dt))
        rank = config.markov_rank
        if not rank:
            self.markov = None
        elif config.markov_factors == "embedding":
            self.markov = EmbeddingMarkovHead(d, rank, rngs=rngs)
        else:
            self.markov = MarkovHead(config.vocab_size, rank, rngs=rngs)
        self.markov_gate = MarkovGate(d, rank, rngs=rngs) if config.markov_gate else None
        self.confidence = ConfidenceHead(d, rank, rngs=rngs, use_bias=config.confidence_bias)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def markov_head(self, target):
        """The Markov head as `spec.propose` calls it (`embed`, `__call__`), or None:
        the table head itself, or the embedding-tied head bound to `target`, wrapped in
        `GatedMarkov` when the drafter has a gate."""
        head = self.markov.bind(target) if isinstance(self.markov, EmbeddingMarkovHead) else self.markov
        if head is not None and self.markov_gate is not None:
            return GatedMarkov(head, self.markov_gate)
        return head

    def with_markov_tables(self, target) -> "DSparkDrafter":
        """This drafter with an embedding-tied Markov head turned into free tables
        `W1 = E @ P1`, `W2^T = unembed(P2^T)` (the same bias), for decoding.

        The tied head costs one LM-head product (`d x V`) per draft position; the tables
        cost `r x V`, and nothing depends on the target's tables at decode time. Returns
        `self` when the head is already a table (or absent). The result's config says
        `markov_factors="table"`; it shares no arrays with `self`.
        """
        if not isinstance(self.markov, EmbeddingMarkovHead):
            return self
        vocab = self.config.vocab_size
        if getattr(getattr(target, "config", None), "vocab_size", None) != vocab:
            raise ValueError(f"target: vocab_size must be the drafter's {vocab} "
                             f"(got {getattr(getattr(target, 'config', None), 'vocab_size', None)!r})")
        dt = self.config.jnp_dtype
        bound = self.markov.bind(target)
        w1 = bound.embed(jnp.arange(vocab, dtype=jnp.int32)).astype(dt)                 # [V, r]
        w2 = target.unembed(self.markov.p2[...].astype(jnp.float32).T).T.astype(dt)     # [V, r]
        config = dataclasses.replace(self.config, markov_factors="table")
        new = nnx.eval_shape(lambda: DSparkDrafter(config, rngs=nnx.Rngs(0)))
        values = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        values["markov"] = {"w1": w1, "w2": w2}
        return _with_params(new, values)

    def grown(self, *, rngs: nnx.Rngs, markov_rank: int | None = None,
              num_layers: int | None = None, markov_gate: bool | None = None) -> "DSparkDrafter":
        """This drafter with a larger Markov head and/or more backbone layers, proposing
        exactly what it proposed before, so a trained drafter can continue with more capacity
        (`jax-dspark train --init` with a larger `--markov-rank` / `--num-layers`) instead of
        starting over. Returns a new drafter; `self` is unchanged.

        Markov rank r -> r': the new columns of the head's first factor (`w1` / `p1`, the
        predecessor's embedding) are random at the head's init scale; those of the second
        (`w2` / `p2`, the logit side) and the confidence head's new weights are zero, so the
        bias `W1[prev] W2^T` and the confidence logit are unchanged until training moves
        them (the second factor's new columns get gradient at once, the first's after
        them). Growing from 0 adds a head whose bias starts at zero.

        Layers L -> L': new blocks are appended after the old ones with random weights
        except their output projections `wo` and `w_down`, which are zero, so each new
        block adds nothing to the residual stream (and the final norm sees what it saw)
        until training moves them.

        A gated head growing its rank keeps its gate on the old directions (zero weights
        from the new ones) and gates the new ones at 1/2.

        Vanilla -> gated Markov head (`markov_gate=True`): the gate starts at zero weights,
        i.e. 1/2 everywhere, and the head's logit factor (`w2` / `p2`) is doubled, so
        `(1/2 * e) (2 W2)^T` is the old bias exactly (DeepSpec's gated form, eq. 6, with
        its `W2` scaled; the function class is the same).
        """
        cfg = self.config
        rank = cfg.markov_rank if markov_rank is None else markov_rank
        layers = cfg.num_layers if num_layers is None else num_layers
        gate = cfg.markov_gate if markov_gate is None else markov_gate
        for name, value, cur in (("markov_rank", rank, cfg.markov_rank), ("num_layers", layers, cfg.num_layers)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < cur:
                raise ValueError(f"{name}: must be an int >= the current {cur} (got {value!r})")
        if not isinstance(gate, bool) or gate < cfg.markov_gate:
            raise ValueError(f"markov_gate: must be a bool, not removing a gate (got {gate!r}, stored {cfg.markov_gate})")
        if (rank, layers, gate) == (cfg.markov_rank, cfg.num_layers, cfg.markov_gate):
            raise ValueError(f"markov_rank / num_layers / markov_gate: nothing to grow "
                             f"(all as stored: {rank}, {layers}, {gate})")
        if gate and not rank:
            raise ValueError("markov_gate: needs a Markov head (markov_rank 0)")
        config = dataclasses.replace(cfg, markov_rank=int(rank), num_layers=int(layers), markov_gate=gate)
        new = DSparkDrafter(config, rngs=rngs)
        values = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        fresh = nnx.to_pure_dict(nnx.state(new, nnx.Param))
        if rank > cfg.markov_rank:
            cur = cfg.markov_rank
            first, second = ("p1", "p2") if config.markov_factors == "embedding" else ("w1", "w2")
            head = fresh["markov"]
            head[second] = jnp.zeros_like(head[second])
            if cur:
                head[first] = head[first].at[:, :cur].set(values["markov"][first])
                head[second] = head[second].at[:, :cur].set(values["markov"][second])
            values["markov"] = head
            w = values["confidence"]["w"]
            values["confidence"]["w"] = jnp.concatenate([w, jnp.zeros((rank - cur,), w.dtype)])
        if layers > cfg.num_layers:
            for name, stacked in fresh["layers"].items():
                added = stacked[cfg.num_layers:]
                if name in ("wo", "w_down"):
                    added = jnp.zeros_like(added)
                values["layers"][name] = jnp.concatenate([values["layers"][name], added])
        if gate and not cfg.markov_gate:
            second = "p2" if config.markov_factors == "embedding" else "w2"
            values["markov"][second] = 2 * values["markov"][second]
            values["markov_gate"] = fresh["markov_gate"]
        elif gate and rank > cfg.markov_rank:
            # A gated head growing its rank: the old gate keeps its outputs (the new `e`
            # inputs get zero weights) and the new directions' gates start at 1/2; their
            # logit factor is zero, so the bias is unchanged.
            d, cur, old = cfg.hidden_size, cfg.markov_rank, values["markov_gate"]
            w = jnp.zeros_like(fresh["markov_gate"]["w"])
            w = w.at[:d, :cur].set(old["w"][:d]).at[d:d + cur, :cur].set(old["w"][d:])
            values["markov_gate"] = {"w": w, "b": jnp.zeros_like(fresh["markov_gate"]["b"]).at[:cur].set(old["b"])}
        return _with_params(new, values)

    # -- state ---------------------------------------------------------------------------

    def init_state(self, num_slots: int, max_len: int) -> DSparkState:
        """Empty context K/V for `num_slots` requests of up to `max_len` positions each,
        plus the scratch slot (index `num_slots`)."""
        if not isinstance(num_slots, (int, np.integer)) or num_slots < 1:
            raise ValueError(f"num_slots: must be a positive int (got {num_slots!r})")
        if not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"max_len: must be a positive int (got {max_len!r})")
        cfg = self.config
        shape = (cfg.num_layers, int(num_slots) + 1, int(max_len), cfg.num_kv_heads, cfg.head_dim)
        return DSparkState(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype))

    # -- context -------------------------------------------------------------------------

    def context_features(self, hiddens: jax.Array) -> jax.Array:
        """`hidden_norm(fc(concat_c hiddens[:, :, c]))`: `[B, S, C, d]` -> `[B, S, d]`."""
        cfg = self.config
        b, s, c, d = hiddens.shape
        if (c, d) != (cfg.num_context_layers, cfg.hidden_size):
            raise ValueError(f"hiddens: expected [B, S, {cfg.num_context_layers}, {cfg.hidden_size}] "
                             f"(got shape {hiddens.shape})")
        x = hiddens.reshape(b, s, c * d).astype(cfg.jnp_dtype) @ self.fc[...]
        return ops.rms_norm(x, self.hidden_norm[...], eps=cfg.rms_eps)

    def _project_kv(self, w: dict[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array):
        """Per-layer K (k_norm + RoPE) and V of rows `x [B, S, d]`: `[B, S, KV, hd]` each."""
        cfg = self.config
        b, s, _ = x.shape
        k = (x @ w["wk"]).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
        k = rope_half_split(ops.rms_norm(k, w["k_norm"], eps=cfg.rms_eps), cos, sin)
        v = (x @ w["wv"]).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
        return k, v

    def commit(
        self,
        target,
        state: DSparkState,
        *,
        tokens: jax.Array,
        hiddens: jax.Array,
        slots: jax.Array,
        starts: jax.Array,
        counts: jax.Array,
    ) -> DSparkState:
        """Store the context K/V of newly committed positions.

        Args:
          target: the target model (unused: context comes from the captured hiddens).
          state: current drafter state.
          tokens: `i32[B, S]` the tokens of the target forward (unused here).
          hiddens: `[B, S, C, d]` captured target hiddens of that forward.
          slots: `i32[B]` slot per request.
          starts: `i32[B]` position of row 0.
          counts: `i32[B]` rows `j < counts[b]` are committed; the rest are not stored.
        Returns:
          the updated state (rows outside the slot's capacity are dropped).
        """
        del target, tokens
        cfg = self.config
        b, s = hiddens.shape[:2]
        feats = self.context_features(hiddens)
        positions = jnp.asarray(starts, jnp.int32)[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]
        cos, sin = _cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        keep = jnp.arange(s)[None, :] < jnp.asarray(counts, jnp.int32)[:, None]
        rows = jnp.where(keep & (positions >= 0), positions, state.max_len)   # max_len = dropped
        slot_idx = jnp.broadcast_to(jnp.asarray(slots, jnp.int32)[:, None], (b, s))

        def per_layer(w):
            return self._project_kv(w, feats, cos, sin)

        k, v = jax.vmap(per_layer)(self.layers.arrays())                      # [L, B, S, KV, hd]
        return DSparkState(
            k=state.k.at[:, slot_idx, rows].set(k.astype(state.k.dtype), mode="drop"),
            v=state.v.at[:, slot_idx, rows].set(v.astype(state.v.dtype), mode="drop"),
        )

    # -- block pass ----------------------------------------------------------------------

    def backbone(
        self, target, state: DSparkState, *, anchor: jax.Array, slots: jax.Array, lengths: jax.Array
    ) -> jax.Array:
        """One parallel pass over the block: `[B, g, d]` final-normed hidden states.

        Each block row sees the context rows `0 .. lengths-1` of its slot and ALL block
        rows (non-causal), through every layer.
        """
        cfg = self.config
        g = cfg.block_size
        slots = jnp.asarray(slots, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        b = slots.shape[0]
        x = shared_embed(target, block_input_ids(anchor, g, cfg.noise_token_id)).astype(cfg.jnp_dtype)
        positions = lengths[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
        cos, sin = _cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        ctx_visible = jnp.arange(state.max_len)[None, :] < lengths[:, None]         # [B, T]
        mask = jnp.concatenate([ctx_visible, jnp.ones((b, g), bool)], axis=1)       # [B, T + g]
        mask = jnp.broadcast_to(mask[:, None, :], (b, g, mask.shape[1]))
        # Rows past the committed length may hold anything (stale or never written): zero
        # them, so a masked score times a non-finite value cannot leak into the output.
        hidden = ~ctx_visible[None, :, :, None, None]
        ctx_k = jnp.where(hidden, 0, jnp.take(state.k, slots, axis=1))             # [L, B, T, KV, hd]
        ctx_v = jnp.where(hidden, 0, jnp.take(state.v, slots, axis=1))

        def layer(x, xs):
            w, k_ctx, v_ctx = xs
            h = ops.rms_norm(x, w["attn_norm"], eps=cfg.rms_eps)
            q = (h @ w["wq"]).reshape(b, g, cfg.num_heads, cfg.head_dim)
            q = rope_half_split(ops.rms_norm(q, w["q_norm"], eps=cfg.rms_eps), cos, sin)
            k_blk, v_blk = self._project_kv(w, h, cos, sin)
            keys = jnp.concatenate([k_ctx.astype(k_blk.dtype), k_blk], axis=1)
            values = jnp.concatenate([v_ctx.astype(v_blk.dtype), v_blk], axis=1)
            attn = gqa_attention(q, keys, values, mask, scale=cfg.head_dim ** -0.5)
            x = x + attn.reshape(b, g, -1) @ w["wo"]
            h = ops.rms_norm(x, w["mlp_norm"], eps=cfg.rms_eps)
            x = x + ops.mlp_swiglu(h, w["w_gate_up"], w["w_down"])
            return x, None

        x, _ = jax.lax.scan(layer, x, (self.layers.arrays(), ctx_k, ctx_v))
        return ops.rms_norm(x, self.final_norm[...], eps=cfg.rms_eps)

    def draft(
        self,
        target,
        state: DSparkState,
        key: jax.Array,
        *,
        anchor: jax.Array,
        slots: jax.Array,
        lengths: jax.Array,
        sampling: SamplingParams,
    ) -> Proposal:
        """Propose one block: backbone, shared LM head, Markov chain, confidence.

        Args:
          target: the target model (its `embed` and `unembed` are used).
          state: drafter state holding the committed context of every slot.
          key: PRNG key for the Markov chain's draws.
          anchor: `i32[B]` last emitted token (block slot 0), at position `lengths[b]`.
          slots: `i32[B]` slot per request.
          lengths: `i32[B]` committed positions.
          sampling: the target's sampling parameters (static).
        Returns:
          `spec.Proposal` with `g` drafts per request.
        """
        h = self.backbone(target, state, anchor=anchor, slots=slots, lengths=lengths)
        base_logits = shared_unembed(target, h)
        return propose(key, base_logits, jnp.asarray(anchor, jnp.int32), sampling,
                       markov=self.markov_head(target), hidden=h, confidence=self.confidence)


def tiny_dspark(target_config, seed: int = 1, **overrides) -> DSparkDrafter:
    """Random-weight standalone drafter for a (tiny) Llama-family target config."""
    fields = dict(block_size=4, num_layers=2, markov_rank=16)
    fields.update(overrides)
    return DSparkDrafter(DSparkConfig.for_target(target_config, **fields), rngs=nnx.Rngs(seed))
