"""DSpark's two small heads: the low-rank Markov (bigram) head and the confidence head.

Both sit after the drafter's parallel backbone and its LM head (see
`../shared/notes/dspark-spec.md` section 3):

* `MarkovHead` adds `B(prev, .) = W1[prev] @ W2^T` to each draft position's logits, where
  `prev` is the token actually drawn at the previous position (the anchor for position 0).
  It is the only sequential part of the proposal, one row gather plus one `r x V` mat-vec
  per step, so the backbone and the LM head still run once per block. `GatedMarkov` is
  DeepSpec's `gated` variant (paper eq. 6): the predecessor's embedding is scaled, per
  rank direction, by a sigmoid gate that also reads the position's hidden state, so how
  much of the bigram statistics a position takes depends on its context.
* `ConfidenceHead` predicts, per position, the probability that the draft is accepted given
  that every earlier one was: `logit = w . [h; W1[prev]] (+ b)`. It sees the predecessor,
  never the draft itself, which keeps the scheduler that consumes it non-anticipating.
  It returns raw logits; sigmoid and the per-position STS temperatures belong to the
  consumer (`jax_dspark.spec.sts.calibrated_confidence`), because the temperatures are
  fitted after training and are not part of the checkpoint.

The heads are separate modules (not methods of the drafter) so the V4-embedded drafter and
the standalone dense drafter share them, and so the proposal code can be tested without a
backbone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _require_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}: must be >= 1 (got {value!r})")


def _guarded_rows(prev: jax.Array, vocab_size: int, rows_of) -> jax.Array:
    """`f32[..., r]` = `rows_of(prev)` where `0 <= prev < vocab_size`, zero rows elsewhere
    (the lookup sees a valid id everywhere, so no clamped row leaks in)."""
    prev = jnp.asarray(prev, jnp.int32)
    valid = (prev >= 0) & (prev < vocab_size)
    rows = rows_of(jnp.where(valid, prev, 0)).astype(jnp.float32)
    return jnp.where(valid[..., None], rows, 0.0)


class MarkovHead(nnx.Module):
    """Vanilla low-rank Markov head: `bias(prev) = W1[prev] @ W2^T`, computed in float32.

    Attributes:
      w1: `[V, r]` predecessor embedding table (`markov_w1` in checkpoints); also the
        predecessor feature the confidence head reads.
      w2: `[V, r]` logit projection (`markov_w2`), applied transposed.

    An out-of-vocabulary or negative predecessor (padding requests, ids beyond the Markov
    vocabulary) gets a zero bias rather than a clamped row: a clamped lookup would inject a
    real token's bigram statistics into a position that has no such predecessor.
    """

    needs_hidden = False

    def __init__(
        self,
        vocab_size: int,
        rank: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        _require_positive(vocab_size=vocab_size, rank=rank)
        self.vocab_size = vocab_size
        self.rank = rank
        # Scales chosen so a fresh head's bias has variance ~1/r: visible in tiny random
        # configs, small next to the LM head's logits.
        scale = rank**-0.5
        self.w1 = nnx.Param(scale * jax.random.normal(rngs.params(), (vocab_size, rank), param_dtype))
        self.w2 = nnx.Param(scale * jax.random.normal(rngs.params(), (vocab_size, rank), param_dtype))

    def embed(self, prev: jax.Array) -> jax.Array:
        """Guarded predecessor embedding `W1[prev]`.

        Args:
          prev: `i32[...]` predecessor token ids (any value; out-of-range means "none").
        Returns:
          `f32[..., r]`, zero rows where `prev < 0` or `prev >= V`.
        """
        return _guarded_rows(prev, self.vocab_size, lambda ids: jnp.take(self.w1[...], ids, axis=0))

    def project(self, e: jax.Array) -> jax.Array:
        """`f32[..., V]` = `e @ W2^T` for `e: [..., r]` (the logit side of the bias)."""
        return e.astype(jnp.float32) @ self.w2[...].astype(jnp.float32).T

    def __call__(self, prev: jax.Array, hidden: jax.Array | None = None) -> jax.Array:
        """Markov bias for each predecessor.

        Args:
          prev: `i32[...]` predecessor token ids.
          hidden: ignored (the call surface `GatedMarkov` shares).
        Returns:
          `f32[..., V]` = `W1[prev] @ W2^T` in float32; zero where `prev` is out of vocab.
        """
        return self.project(self.embed(prev))


class EmbeddingMarkovHead(nnx.Module):
    """Markov head whose vocabulary factors are the target's own embedding and LM head.

    `bias(prev) = unembed(E[prev] @ P1 @ P2^T)`: the predecessor's target embedding, mapped
    through a rank-`r` linear map, added in hidden space and read out by the target's LM
    head. It is the vanilla head `W1[prev] @ W2^T` with `W1 = E @ P1` (`[V, r]`) and
    `W2^T = unembed(P2^T)` (`[r, V]`), so proposal, confidence head and verification see
    exactly a rank-`r` Markov head; only the storage differs: `2 d r` parameters instead of
    `2 V r`. For SmolLM2 (V = 49152, d = 576) that is rank 256 (V4's rank) in 0.6 MB of
    bf16 where free tables allow rank ~30 within a 16 MiB drafter file.

    Attributes:
      p1: `[d, r]` predecessor projection (`markov.p1` in checkpoints); `E[prev] @ P1` is
        also the predecessor feature the confidence head reads.
      p2: `[d, r]` projection back to hidden space, applied transposed (`markov.p2`).

    `bind(target)` returns the object `spec.propose` and the trainer call (`embed`, `__call__`,
    `vocab_size`, `rank`), with the target's tables read inside the caller's trace.
    """

    def __init__(self, hidden_size: int, rank: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype = jnp.float32):
        _require_positive(hidden_size=hidden_size, rank=rank)
        self.hidden_size = hidden_size
        self.rank = rank
        # P1 keeps the embedding's scale; P2 starts small so a fresh head barely moves the
        # LM head's logits (its gradient is not zero: P1 is random).
        self.p1 = nnx.Param(hidden_size**-0.5 * jax.random.normal(rngs.params(), (hidden_size, rank), param_dtype))
        self.p2 = nnx.Param(0.02 * jax.random.normal(rngs.params(), (hidden_size, rank), param_dtype))

    def bind(self, target) -> "BoundEmbeddingMarkov":
        """This head over `target`'s embedding (`target.embed`) and LM head (`target.unembed`)."""
        return BoundEmbeddingMarkov(self, target)


class BoundEmbeddingMarkov:
    """An `EmbeddingMarkovHead` bound to a target: the `MarkovHead` call surface."""

    needs_hidden = False

    def __init__(self, head: EmbeddingMarkovHead, target):
        vocab = getattr(getattr(target, "config", None), "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"target: needs config.vocab_size (got {vocab!r})")
        self.head, self.target = head, target
        self.vocab_size, self.rank = vocab, head.rank

    def embed(self, prev: jax.Array) -> jax.Array:
        """`f32[..., r]` = `E[prev] @ P1`, zero rows where `prev < 0` or `prev >= V`."""
        p1 = self.head.p1[...].astype(jnp.float32)
        return _guarded_rows(prev, self.vocab_size, lambda ids: self.target.embed(ids).astype(jnp.float32) @ p1)

    def project(self, e: jax.Array) -> jax.Array:
        """`f32[..., V]` = `unembed(e @ P2^T)` for `e: [..., r]`."""
        shift = e.astype(jnp.float32) @ self.head.p2[...].astype(jnp.float32).T
        return self.target.unembed(shift).astype(jnp.float32)

    def __call__(self, prev: jax.Array, hidden: jax.Array | None = None) -> jax.Array:
        """`f32[..., V]` Markov bias `unembed(E[prev] @ P1 @ P2^T)`; zero for invalid `prev`
        (`hidden` is ignored)."""
        return self.project(self.embed(prev))


class MarkovGate(nnx.Module):
    """The gate of DeepSpec's `gated` Markov variant: `sigmoid([h; e] @ W + b)`, `[..., r]`.

    Attributes:
      w: `[d + r, r]`; the first `d` rows read the position's hidden state `h`, the last
        `r` the predecessor's embedding `e = W1[prev]`.
      b: `[r]`.

    Both start at zero, so a fresh gate is 1/2 everywhere: a vanilla head turned gated
    with its logit factor doubled (`DSparkDrafter.grown(markov_gate=True)`) proposes
    exactly what it proposed before, and the gate's gradient is not zero (`e` is not).
    """

    def __init__(self, hidden_size: int, rank: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype = jnp.float32):
        del rngs  # zero init; the argument keeps the nnx constructor convention
        _require_positive(hidden_size=hidden_size, rank=rank)
        self.hidden_size, self.rank = hidden_size, rank
        self.w = nnx.Param(jnp.zeros((hidden_size + rank, rank), param_dtype))
        self.b = nnx.Param(jnp.zeros((rank,), param_dtype))

    def __call__(self, hidden: jax.Array, e: jax.Array) -> jax.Array:
        """`f32[..., r]` gate for hidden states `[..., d]` and predecessor embeddings `[..., r]`."""
        d = self.hidden_size
        if hidden.shape[-1] != d or hidden.shape[:-1] != e.shape[:-1]:
            raise ValueError(f"hidden: shape must be {e.shape[:-1] + (d,)} to match e {e.shape} (got {hidden.shape})")
        w = self.w[...].astype(jnp.float32)
        z = hidden.astype(jnp.float32) @ w[:d] + e.astype(jnp.float32) @ w[d:] + self.b[...].astype(jnp.float32)
        return jax.nn.sigmoid(z)


class GatedMarkov:
    """DeepSpec's `gated` Markov head over a vanilla one (`MarkovHead` or a bound
    `EmbeddingMarkovHead`): `bias(prev, h) = (gate(h, e) * e) W2^T` with `e = W1[prev]`.

    The gate reads the draft position's backbone hidden state, which exists for the whole
    block before the chain starts, so the chain stays one gather, one `[d + r, r]`
    product and one `r x V` product per step. The confidence head still reads the
    ungated `e` (`embed`), as in DeepSpec. An invalid predecessor has `e = 0`, hence a
    zero bias whatever the gate says.
    """

    needs_hidden = True

    def __init__(self, head, gate: MarkovGate):
        if gate.rank != head.rank:
            raise ValueError(f"gate: rank must be the Markov head's {head.rank} (got {gate.rank})")
        self.head, self.gate = head, gate
        self.vocab_size, self.rank = head.vocab_size, head.rank
        self.hidden_size = gate.hidden_size

    def embed(self, prev: jax.Array) -> jax.Array:
        """`f32[..., r]` = `W1[prev]` (ungated), zero rows for invalid `prev`."""
        return self.head.embed(prev)

    def __call__(self, prev: jax.Array, hidden: jax.Array | None = None) -> jax.Array:
        """`f32[..., V]` gated bias for predecessors `prev [...]` at hidden states `[..., d]`."""
        if hidden is None:
            raise ValueError("hidden: required by a gated Markov head (got None)")
        e = self.embed(prev)
        return self.head.project(self.gate(hidden, e) * e)


class ConfidenceHead(nnx.Module):
    """Per-position acceptance logit `w . [h; e] (+ b)`, evaluated in float32.

    Attributes:
      w: `[d + r]` weight (the V4 checkpoint's `proj [1, d + r]`, flattened); the first `d`
        entries multiply the hidden state, the last `r` the Markov predecessor embedding.
      b: scalar bias, present only with `use_bias=True` (DeepSpec checkpoints have one, V4
        checkpoints do not; a missing bias is not the same as a zero one when loading
        strictly, so the parameter exists only when asked for).

    With `markov_rank = 0` the head reads the hidden state alone (a drafter without a
    Markov head).
    """

    def __init__(
        self,
        hidden_size: int,
        markov_rank: int,
        *,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        if hidden_size < 1:
            raise ValueError(f"hidden_size: must be >= 1 (got {hidden_size!r})")
        if markov_rank < 0:
            raise ValueError(f"markov_rank: must be >= 0 (got {markov_rank!r})")
        self.hidden_size = hidden_size
        self.markov_rank = markov_rank
        self.use_bias = use_bias
        width = hidden_size + markov_rank
        self.w = nnx.Param(width**-0.5 * jax.random.normal(rngs.params(), (width,), param_dtype))
        self.b = nnx.Param(jnp.zeros((), param_dtype)) if use_bias else None

    def __call__(self, hidden: jax.Array, prev_embedding: jax.Array | None = None) -> jax.Array:
        """Raw confidence logits.

        Args:
          hidden: `[..., d]` drafter hidden state of each position (any float dtype).
          prev_embedding: `[..., r]` = `MarkovHead.embed(prev)` of each position's
            predecessor; required iff `markov_rank > 0`.
        Returns:
          `f32[...]` logits (no sigmoid, no temperature).
        """
        d, r = self.hidden_size, self.markov_rank
        if hidden.shape[-1] != d:
            raise ValueError(f"hidden: last dim must be hidden_size={d} (got shape {hidden.shape})")
        w = self.w[...].astype(jnp.float32)
        logit = hidden.astype(jnp.float32) @ w[:d]
        if r > 0:
            if prev_embedding is None:
                raise ValueError("prev_embedding: required when markov_rank > 0 (got None)")
            if prev_embedding.shape != hidden.shape[:-1] + (r,):
                raise ValueError(
                    f"prev_embedding: shape must be {hidden.shape[:-1] + (r,)} "
                    f"(got {prev_embedding.shape})"
                )
            logit = logit + prev_embedding.astype(jnp.float32) @ w[d:]
        elif prev_embedding is not None:
            raise ValueError(
                f"prev_embedding: must be None when markov_rank = 0 (got shape {prev_embedding.shape})"
            )
        if self.b is not None:
            logit = logit + self.b[...].astype(jnp.float32)
        return logit
