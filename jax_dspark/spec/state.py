"""The decode state the engine threads through its jitted functions, and the scheduler config.

Everything a decode round reads or writes lives in one pytree (`DecodeState`) so the round
can be a single jitted function with the state donated: the target's cache, the drafter's
state, per-request bookkeeping, the block of drafts waiting for verification, the output
buffer, the PRNG key and running statistics. Shapes are fixed by the batch size, the block
size and `max_new_tokens`, so every round reuses one compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_dspark.spec.schedule import SpsTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundStats:
    """Running counters of the decode rounds (only rounds of active requests count).

    Attributes:
      rounds: `i32[B]` decode rounds each request took part in.
      emitted: `i32[B]` tokens those rounds emitted (`n + 1` each: accepted drafts plus the
        bonus / corrected token), before truncation to `max_new_tokens`.
      verified: `i32[g]` per draft position, how many request-rounds verified it.
      accepted: `i32[g]` per draft position, how many request-rounds accepted it.
    """

    rounds: jax.Array
    emitted: jax.Array
    verified: jax.Array
    accepted: jax.Array

    @classmethod
    def zeros(cls, batch: int, block_size: int) -> "RoundStats":
        return cls(
            rounds=jnp.zeros((batch,), jnp.int32),
            emitted=jnp.zeros((batch,), jnp.int32),
            verified=jnp.zeros((block_size,), jnp.int32),
            accepted=jnp.zeros((block_size,), jnp.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """All state of a batch of requests between two decode rounds.

    Attributes:
      target_cache: the target's cache pytree (`num_slots + 1` slots, last = scratch).
      drafter_state: the drafter's state pytree, or None without a drafter.
      slots: `i32[B]` slot of each request (request b owns slot b; finished requests are
        routed to the scratch slot inside a round, so their state is never touched again).
      lengths: `i32[B]` committed positions in the target cache (the prompt plus every
        emitted token except the anchor).
      anchor: `i32[B]` last emitted token, at position `lengths`; the next verify input's
        first row.
      drafts: `i32[B, g]` drafts waiting to be verified (positions `lengths + 1 ..`).
      draft_probs: `f32[B, g, V]` the distributions they were drawn from, or None when
        greedy (exact-match verification needs no distributions).
      confidence: `f32[B, g]` raw confidence logits of the drafts.
      verify_lens: `i32[B]` drafts of each request the next verify reads (the scheduler's
        choice; `g` when verifying everything).
      survival_history: `f32[2, B, g]` survivals of the two previous rounds, oldest first;
        the budgeted scheduler sizes its budget from the oldest so the current drafts
        cannot influence it.
      out_tokens: `i32[B, max_new + g + 1]` emitted tokens (first `num_out[b]` valid).
      num_out: `i32[B]` emitted tokens so far; a request is active while it is below
        `max_new_tokens`.
      key: PRNG key, split every round.
      stats: `RoundStats`.
    """

    target_cache: Any
    drafter_state: Any
    slots: jax.Array
    lengths: jax.Array
    anchor: jax.Array
    drafts: jax.Array
    draft_probs: jax.Array | None
    confidence: jax.Array
    verify_lens: jax.Array
    survival_history: jax.Array
    out_tokens: jax.Array
    num_out: jax.Array
    key: jax.Array
    stats: RoundStats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scheduler:
    """Confidence-scheduled verification: how the engine picks per-request verify lengths.

    Attributes:
      table: the target's measured verify throughput (`spec.profile_sps`).
      temperatures: `f32[g]` STS temperatures for the confidence logits, or None (raw).
      kind: "causal" (the paper's Algorithm 1 with early stop, on current survivals) or
        "budgeted" (production form: budget from survivals two rounds old, filled with the
        top current survivals above `min_len`).
      min_len: drafts every active request verifies regardless ("budgeted" only).

    A pytree (the table and temperatures are data, the rest static), so a scheduler is an
    argument of the jitted round and changing the table does not recompile.
    """

    table: SpsTable
    temperatures: jax.Array | None = None
    kind: str = dataclasses.field(default="causal", metadata=dict(static=True))
    min_len: int = dataclasses.field(default=0, metadata=dict(static=True))

    def __post_init__(self):
        if self.kind not in ("causal", "budgeted"):
            raise ValueError(f"kind: must be 'causal' or 'budgeted' (got {self.kind!r})")
        if not isinstance(self.min_len, int) or self.min_len < 0:
            raise ValueError(f"min_len: must be an int >= 0 (got {self.min_len!r})")
