"""Draft proposal: the Markov chain over one block, as a `lax.scan`.

The drafter's backbone and LM head produce base logits for all `g` positions of the block
in one parallel pass. The only sequential part is the Markov head: position `k` adds the
bigram bias of the token actually drawn at position `k - 1` (the anchor for `k = 0`), then
draws its own token (spec section 3.1, 4.2-4.3). Running the chain greedily and re-sampling
afterwards would break the coupling between a token and the bias it conditions, and with it
losslessness at T > 0, so the chain draws inside the scan.

The draft distribution `q` returned for verification is exactly the one each token was
drawn from: the corrected logits after the SAME `ops.sampling.process_logits` the target
goes through (temperature, top-k, top-p), one-hot when greedy. Each token is what
`ops.sampling.sample` would draw from the corrected logits with the step's key.

The proposal is always the full block; truncation is the scheduler's job
(`jax_dspark.spec.schedule`). Everything has static shapes and no host round trips, so the
function can sit inside the jitted decode round.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dspark.ops import _checks
from jax_dspark.ops.sampling import SamplingParams, draw_from_processed, process_logits
from jax_dspark.models.dspark_heads import ConfidenceHead, MarkovHead


class Proposal(NamedTuple):
    """One block of drafts for a batch of requests.

    Attributes:
      tokens: `i32[B, g]` draft tokens; `tokens[:, k]` was drawn from `probs[:, k]`.
      probs: `f32[B, g, V]` the exact draft distributions `q` (processed like the target's;
        one-hot when greedy). Verification needs these, not the logits.
      logits: `f32[B, g, V]` corrected logits `base + MarkovBias(prev)`, before
        temperature / top-k / top-p (what training losses and diagnostics compare).
      confidence_logits: `f32[B, g]` raw confidence-head logits (no sigmoid, no STS), or
        None when no confidence head was given.
    """

    tokens: jax.Array
    probs: jax.Array
    logits: jax.Array
    confidence_logits: jax.Array | None


def predecessors(anchor: jax.Array, tokens: jax.Array) -> jax.Array:
    """The token each block position conditions on: `[anchor, tokens[:, :-1]]`.

    Args:
      anchor: `i32[B]` last token emitted by the target (the block's slot-0 input).
      tokens: `i32[B, g]` draft tokens.
    Returns:
      `i32[B, g]`.
    """
    return jnp.concatenate([anchor[:, None].astype(jnp.int32), tokens[:, :-1].astype(jnp.int32)], axis=1)


def propose(
    key: jax.Array,
    base_logits: jax.Array,
    anchor: jax.Array,
    params: SamplingParams,
    *,
    markov: MarkovHead | None = None,
    hidden: jax.Array | None = None,
    confidence: ConfidenceHead | None = None,
) -> Proposal:
    """Run the Markov chain over one block and score it.

    Args:
      key: PRNG key (unused when greedy).
      base_logits: `[B, g, V]` drafter LM-head logits of the block, any float dtype.
      anchor: `i32[B]` anchor (bonus) token of each request; negative or out-of-vocab ids
        (padding requests) give a zero Markov bias.
      params: sampling parameters, the same as the target's (static).
      markov: Markov head, or None for a drafter without one (then `logits == base`).
        Its vocabulary may be smaller than `V` (columns beyond it get no bias).
      hidden: `[B, g, d]` block hidden states the confidence head (and a gated Markov
        head, `GatedMarkov`) reads; required with `confidence` or a gated head.
      confidence: confidence head, or None to skip scoring.
    Returns:
      `Proposal` (tokens, exact draft distributions, corrected logits, confidence logits).
    """
    b, g, v = _checks.check_rank("base_logits", base_logits, 3, "[B, g, V]")
    _checks.check_floating("base_logits", base_logits)
    if _checks.shape_of(anchor) != (b,):
        _checks.fail("anchor", f"shape must be ({b},) to match base_logits", _checks.shape_of(anchor))
    if g < 1:
        _checks.fail("base_logits", "needs at least one draft position (g >= 1)", _checks.shape_of(base_logits))
    if markov is not None and markov.vocab_size > v:
        _checks.fail("markov", f"vocab_size must be <= the logits' vocab {v}", markov.vocab_size)
    gated = markov is not None and markov.needs_hidden
    if gated and hidden is None:
        _checks.fail("hidden", "required by a gated Markov head", None)
    if confidence is not None and hidden is None:
        _checks.fail("hidden", "required when a confidence head is given", None)
    if hidden is not None:
        hb = _checks.check_rank("hidden", hidden, 3, "[B, g, d]")
        if hb[:2] != (b, g):
            _checks.fail("hidden", f"leading dims must be ({b}, {g}) to match base_logits", hb)
        if gated and hb[2] != markov.hidden_size:
            _checks.fail("hidden", f"last dim must be the gated Markov head's hidden size {markov.hidden_size}", hb)
    if confidence is not None:
        if confidence.markov_rank > 0 and markov is None:
            _checks.fail("markov", "required by a confidence head with markov_rank > 0", None)
        if markov is not None and confidence.markov_rank not in (0, markov.rank):
            _checks.fail("confidence", f"markov_rank must be 0 or the Markov head's rank {markov.rank}",
                         confidence.markov_rank)

    anchor = anchor.astype(jnp.int32)

    def bias(prev: jax.Array, hidden_k: jax.Array | None) -> jax.Array:
        out = markov(prev, hidden_k)   # hidden_k is None unless the head is gated
        if out.shape[-1] < v:
            out = jnp.pad(out, ((0, 0), (0, v - out.shape[-1])))
        return out

    def step(prev, inputs):
        base_k, key_k, hidden_k = inputs
        z = base_k.astype(jnp.float32)
        if markov is not None:
            z = z + bias(prev, hidden_k)
        # One process_logits serves both the draw and q, so the token is exactly a draw from q.
        x, q = draw_from_processed(key_k, process_logits(z, params), params)
        return x, (x, q, z)

    keys = jax.random.split(key, g)
    hiddens = jnp.swapaxes(hidden, 0, 1) if gated else None
    _, (tokens, probs, logits) = jax.lax.scan(step, anchor, (jnp.swapaxes(base_logits, 0, 1), keys, hiddens))
    tokens = jnp.swapaxes(tokens, 0, 1)
    probs = jnp.swapaxes(probs, 0, 1)
    logits = jnp.swapaxes(logits, 0, 1)

    conf = None
    if confidence is not None:
        prev_embedding = None
        if confidence.markov_rank > 0:
            prev_embedding = markov.embed(predecessors(anchor, tokens))
        conf = confidence(hidden, prev_embedding)
    return Proposal(tokens=tokens, probs=probs, logits=logits, confidence_logits=conf)
