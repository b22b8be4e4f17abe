"""An autoregressive model used as a drafter (classic speculative decoding), e.g. the target itself.

`ModelDrafter(model, block_size)` implements the DSpark drafter contract (see
`models/dspark.py`) with any model that follows the target-model protocol: it keeps its
own cache of the committed tokens and drafts `g` tokens one forward at a time, each drawn
from `probabilities(logits)` with the target's sampling parameters.

Why it exists: with `model` equal to the target, every draft distribution equals the
target's, so verification must accept every draft (greedy: the drafts ARE the target's
argmax chain; sampled: `min(1, p/q) = 1`). That pins the engine's bookkeeping (positions,
commit, back-fill, the bonus row) independently of any trained drafter, and gives the
acceptance upper bound `g + 1`. With a small model of the same tokenizer it is the
classic two-model speculative decoding baseline.

The confidence it reports is a constant high logit (TRT-LLM's neutral 30.0: "certainly
accept"), since an autoregressive drafter has no confidence head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dspark.ops.sampling import SamplingParams, gumbel_sample, probabilities
from jax_dspark.spec.propose import Proposal

__all__ = ["ModelDrafter", "NEUTRAL_CONFIDENCE_LOGIT"]

#: Confidence logit reported for every draft (sigmoid ~ 1).
NEUTRAL_CONFIDENCE_LOGIT = 30.0


class ModelDrafter(nnx.Module):
    """Drafts `block_size` tokens by running `model` autoregressively from the anchor.

    Attributes:
      model: a model with the target-model protocol (`init_cache`, `__call__`, `config`).
      block_size: g, drafts per block.

    State: the model's own cache (same slot convention). `commit` runs the committed rows
    through the model (prefill chunk or the accepted prefix of a verify block); `draft`
    writes rows past the committed length in a local copy only, which the next `commit`
    overwrites, so no rollback is needed.
    """

    def __init__(self, model, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be a positive int (got {block_size!r})")
        self.model = model
        self.block_size = block_size

    def init_state(self, num_slots: int, max_len: int):
        """The model's cache for `num_slots` requests plus the scratch slot."""
        return self.model.init_cache(num_slots, max_len)

    def commit(self, target, state, *, tokens, hiddens, slots, starts, counts):
        """Run the committed rows (`j < counts[b]` of `tokens [B, S]`) through the model."""
        del target, hiddens
        _, _, state = self.model(tokens, state, slots=slots, starts=starts, lengths=counts)
        return state

    def draft(self, target, state, key, *, anchor, slots, lengths, sampling: SamplingParams) -> Proposal:
        """`g` autoregressive steps from the anchor at position `lengths`.

        Returns a `spec.Proposal` whose `probs[:, k]` is the distribution `tokens[:, k]` was
        drawn from (one-hot when greedy), `logits` the model's raw logits, and a constant
        neutral confidence.
        """
        del target
        greedy = sampling.greedy
        anchor = jnp.asarray(anchor, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        ones = jnp.ones_like(lengths)

        def step(carry, k_key):
            cache, token, pos = carry
            logits, _, cache = self.model(token[:, None], cache, slots=slots, starts=pos, lengths=ones)
            logits = logits[:, 0]
            q = probabilities(logits, sampling)
            if greedy:
                x = jnp.argmax(q, axis=-1).astype(jnp.int32)
            else:
                x = gumbel_sample(k_key, jnp.log(q)).astype(jnp.int32)
            return (cache, x, pos + 1), (x, q, logits)

        keys = jax.random.split(key, self.block_size)
        _, (tokens, probs, logits) = jax.lax.scan(step, (state, anchor, lengths), keys)
        tokens, probs, logits = (jnp.swapaxes(a, 0, 1) for a in (tokens, probs, logits))
        conf = jnp.full(tokens.shape, NEUTRAL_CONFIDENCE_LOGIT, jnp.float32)
        return Proposal(tokens=tokens, probs=probs, logits=logits.astype(jnp.float32), confidence_logits=conf)
