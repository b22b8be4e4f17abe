"""The speculative decode engine: prefill and one decode round as jitted functions, and `generate`.

Data flow of one decode round (`../shared/DESIGN.md`), all inside ONE jitted function with
the state donated and no host round trip:

1. target verify forward over `[anchor, d_1 .. d_g]` at positions `lengths ..` (rows past
   each request's verify length are padding) -> logits for `g + 1` rows and the captured
   hiddens;
2. `spec.verify`: lossless rejection sampling (greedy: exact match) -> `n` accepted
   drafts and the next token;
3. commit: `lengths += n + 1`; rollback of the target is bookkeeping only (rows past the
   committed length are overwritten before anything reads them);
4. drafter: `commit` the `n + 1` newly committed rows (back-fill of its context from the
   verify forward's hiddens), then `draft` the next block from the new anchor (backbone,
   shared LM head, Markov chain, confidence logits);
5. schedule: survivals of the calibrated confidences -> verify lengths of the next round
   (`g` for everyone without a scheduler).

Without a drafter (`drafter=None`) the same round runs with a block of zero drafts: the
verify forward is a plain one-token decode step and `verify` just samples the next token,
so speculative and plain decoding share every line except the drafter's.

The drafter contract is in `jax_dspark.models.dspark`'s module docstring (`block_size`,
`init_state`, `commit`, `draft`). Finished requests (those that reached `max_new_tokens`)
stay in the batch (shapes are static) but are routed to the scratch slot with nothing to
commit, so they never write real state; they are excluded from the statistics.

`generate` is a thin Python loop around the round with one tiny device-to-host read per
round (how many tokens each request has), which also drives the progress callback.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dspark.ops.sampling import SamplingParams, sample
from jax_dspark.spec.schedule import schedule_budgeted, schedule_causal, survival
from jax_dspark.spec.state import DecodeState, RoundStats, Scheduler
from jax_dspark.spec.sts import calibrated_confidence
from jax_dspark.spec.verify import verify

__all__ = [
    "GenerateResult",
    "GenerateStats",
    "SpeculativeEngine",
    "decode_round",
    "generate",
    "prefill",
]


# -- pure round functions (modules in, state out) -------------------------------------------


def _block_size(drafter) -> int:
    return 0 if drafter is None else int(drafter.block_size)


def _schedule(scheduler: Scheduler | None, confidence: jax.Array, history: jax.Array,
              active: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Verify lengths `i32[B]` for the drafts just proposed, and the updated survival history."""
    b, g = confidence.shape
    if scheduler is None or g == 0:
        return jnp.where(active, g, 0).astype(jnp.int32), history
    a = survival(calibrated_confidence(confidence, scheduler.temperatures))
    if scheduler.kind == "causal":
        lengths = schedule_causal(a, scheduler.table, active=active)
    else:
        lengths = schedule_budgeted(a, scheduler.table, budget_survival=history[0],
                                    min_len=min(scheduler.min_len, g), active=active)
    return lengths, jnp.stack([history[1], a])


def _draft(target, drafter, state_d, key, anchor, slots, lengths, sampling, batch, vocab):
    """The drafter's proposal as (tokens, probs or None when greedy, confidence logits)."""
    if drafter is None:
        probs = None if sampling.greedy else jnp.zeros((batch, 0, vocab), jnp.float32)
        return jnp.zeros((batch, 0), jnp.int32), probs, jnp.zeros((batch, 0), jnp.float32), state_d
    proposal = drafter.draft(target, state_d, key, anchor=anchor, slots=slots, lengths=lengths,
                             sampling=sampling)
    probs = None if sampling.greedy else proposal.probs
    conf = proposal.confidence_logits
    if conf is None:
        conf = jnp.zeros(proposal.tokens.shape, jnp.float32)
    return proposal.tokens.astype(jnp.int32), probs, conf.astype(jnp.float32), state_d


def decode_round(
    target,
    drafter,
    state: DecodeState,
    scheduler: Scheduler | None,
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
) -> DecodeState:
    """One decode round: verify the pending drafts, commit, draft the next block, schedule.

    Args:
      target: target model (target-model protocol of `docs/interfaces.md`).
      drafter: DSpark-style drafter (contract in `models/dspark.py`) or None.
      state: the batch's `DecodeState`.
      scheduler: `Scheduler` or None (verify every draft).
      sampling: target and draft sampling parameters (static).
      max_new_tokens: requests stop being active at this many emitted tokens (static).
      stop_ids: token ids that end a request (static), e.g. end-of-turn: the request
        emits up to and including the first one and then stops (its `num_out` jumps to
        `max_new_tokens`; `out_tokens` past the stop token are not meaningful).
    Returns:
      the next `DecodeState`.
    """
    b, g = state.drafts.shape
    scratch = b  # init_state gives B real slots, so slot B is the scratch slot
    active = state.num_out < max_new_tokens
    slots = jnp.where(active, state.slots, scratch)
    vlen = jnp.where(active, jnp.clip(state.verify_lens, 0, g), 0)
    key, k_verify, k_draft = jax.random.split(state.key, 3)

    # 1. verify forward over [anchor, drafts]
    tokens = jnp.concatenate([state.anchor[:, None], state.drafts], axis=1)          # [B, g+1]
    logits, hiddens, cache = target(tokens, state.target_cache, slots=slots, starts=state.lengths,
                                    lengths=vlen + 1)
    # 2. lossless verification
    result = verify(k_verify, logits, state.drafts, state.draft_probs, sampling, vlen)
    n = result.num_accepted
    committed = jnp.where(active, n + 1, 0)

    # 3. commit: advance lengths, append the emitted tokens
    lengths = state.lengths + committed
    out_tokens = jax.vmap(
        lambda row, new, start, on: jnp.where(on, jax.lax.dynamic_update_slice(row, new, (start,)), row)
    )(state.out_tokens, result.tokens, state.num_out, active)
    num_out = state.num_out + committed
    emitted = committed
    if stop_ids:
        is_stop = jnp.isin(result.tokens, jnp.asarray(stop_ids, jnp.int32)) & result.valid
        stopped = active & jnp.any(is_stop, axis=1)
        emitted = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, committed)
        num_out = jnp.where(stopped, jnp.maximum(num_out, max_new_tokens), num_out)
    anchor = jnp.where(active, result.next_token, state.anchor)

    # 4. drafter: back-fill the committed rows, then draft from the new anchor
    state_d = state.drafter_state
    if drafter is not None:
        state_d = drafter.commit(target, state_d, tokens=tokens, hiddens=hiddens, slots=slots,
                                 starts=state.lengths, counts=committed)
    still = num_out < max_new_tokens
    drafts, probs, conf, state_d = _draft(target, drafter, state_d, k_draft, anchor,
                                          jnp.where(still, state.slots, scratch), lengths, sampling, b,
                                          logits.shape[-1])
    # 5. schedule the next verify
    verify_lens, history = _schedule(scheduler, conf, state.survival_history, still)

    j = jnp.arange(g)
    on = active.astype(jnp.int32)[:, None]
    stats = RoundStats(
        rounds=state.stats.rounds + active.astype(jnp.int32),
        emitted=state.stats.emitted + emitted,
        verified=state.stats.verified + jnp.sum(on * (j[None, :] < vlen[:, None]), axis=0),
        accepted=state.stats.accepted + jnp.sum(on * (j[None, :] < n[:, None]), axis=0),
    )
    return DecodeState(
        target_cache=cache, drafter_state=state_d, slots=state.slots, lengths=lengths,
        anchor=anchor, drafts=drafts, draft_probs=probs, confidence=conf,
        verify_lens=verify_lens, survival_history=history, out_tokens=out_tokens,
        num_out=num_out, key=key, stats=stats,
    )


def prefill(
    target,
    drafter,
    state: DecodeState,
    chunk: jax.Array,
    starts: jax.Array,
    counts: jax.Array,
    prompt_lens: jax.Array,
    *,
    sampling: SamplingParams,
    final: bool,
    stop_ids: tuple[int, ...] = (),
    max_new_tokens: int = 0,
) -> DecodeState:
    """One prefill chunk; the final chunk also drafts the first block.

    Each request's first generated token is sampled from the chunk that holds its last
    prompt token (prompts of different lengths end in different chunks); requests with no
    rows in a chunk are routed to the scratch slot for it. The first round verifies every
    draft (the scheduler starts with the first round's confidences), which keeps prefill
    independent of the scheduler: one compiled prefill serves scheduled and unscheduled
    decoding.

    Args:
      target, drafter, sampling: as in `decode_round`.
      state: a fresh `DecodeState` (`SpeculativeEngine.init_state`) or the previous chunk's.
      chunk: `i32[B, C]` prompt tokens at positions `starts .. starts + C - 1`.
      starts: `i32[B]` position of the chunk's first row.
      counts: `i32[B]` valid rows of the chunk per request (0 = none).
      prompt_lens: `i32[B]` (>= 1) full prompt lengths.
      final: the last chunk (static): then draft, schedule and emit the first token.
      stop_ids, max_new_tokens: a first token in `stop_ids` finishes its request at once.
    Returns:
      after the final chunk, the state before the first decode round: lengths = prompt
      lengths, anchor = first generated token (also `out_tokens[:, 0]`), drafts and verify
      lengths for round 1.
    """
    b, c = chunk.shape
    key, k_first, k_draft = jax.random.split(state.key, 3)
    has_rows = counts > 0
    slots = jnp.where(has_rows, state.slots, b)          # slot B is the scratch slot
    logits, hiddens, cache = target(chunk, state.target_cache, slots=slots, starts=starts, lengths=counts)
    last_row = jnp.clip(prompt_lens - 1 - starts, 0, c - 1)
    last = jnp.take_along_axis(logits, last_row[:, None, None], axis=1)[:, 0]          # [B, V]
    ends_here = has_rows & (starts + counts == prompt_lens)
    anchor = jnp.where(ends_here, sample(k_first, last, sampling), state.anchor)
    lengths = jnp.where(has_rows, starts + counts, state.lengths)
    state_d = state.drafter_state
    if drafter is not None:
        state_d = drafter.commit(target, state_d, tokens=chunk, hiddens=hiddens, slots=slots,
                                 starts=starts, counts=counts)
    state = dataclasses.replace(state, target_cache=cache, drafter_state=state_d, lengths=lengths,
                                anchor=anchor, key=key)
    if not final:
        return state
    drafts, probs, conf, state_d = _draft(target, drafter, state_d, k_draft, anchor, state.slots,
                                          lengths, sampling, b, logits.shape[-1])
    return dataclasses.replace(
        state, drafter_state=state_d, drafts=drafts, draft_probs=probs, confidence=conf,
        verify_lens=jnp.full((b,), drafts.shape[1], jnp.int32),
        out_tokens=state.out_tokens.at[:, 0].set(anchor),
        # int32 operands: Python ints would make num_out weak-typed, and the round (which
        # returns it strong) would then compile a second program at its second call.
        num_out=jnp.where(jnp.isin(anchor, jnp.asarray(stop_ids, jnp.int32)), jnp.int32(max(max_new_tokens, 1)),
                          jnp.int32(1)) if stop_ids else jnp.ones((b,), jnp.int32),
    )


# -- jitted engine ----------------------------------------------------------------------------
#
# The jitted functions live at module level with the graph definitions as static arguments:
# two engines over models of the same architecture (e.g. different seeds or checkpoints)
# then share one compiled program, because parameters are ordinary array arguments.

_STATIC = ("t_graph", "d_graph", "sampling", "stop_ids")


@functools.partial(jax.jit, static_argnames=_STATIC + ("final", "max_new_tokens"), donate_argnames=("state",))
def _jit_prefill(t_params, d_params, state, chunk, starts, counts, prompt_lens, *,
                 t_graph, d_graph, sampling, stop_ids, final, max_new_tokens):
    target = nnx.merge(t_graph, t_params)
    drafter = None if d_graph is None else nnx.merge(d_graph, d_params)
    return prefill(target, drafter, state, chunk, starts, counts, prompt_lens,
                   sampling=sampling, final=final, stop_ids=stop_ids, max_new_tokens=max_new_tokens)


@functools.partial(jax.jit, static_argnames=_STATIC + ("max_new_tokens",), donate_argnames=("state",))
def _jit_round(t_params, d_params, state, scheduler, *, t_graph, d_graph, sampling, stop_ids, max_new_tokens):
    target = nnx.merge(t_graph, t_params)
    drafter = None if d_graph is None else nnx.merge(d_graph, d_params)
    return decode_round(target, drafter, state, scheduler, sampling=sampling, max_new_tokens=max_new_tokens,
                        stop_ids=stop_ids)


class SpeculativeEngine:
    """Jitted prefill and decode round for one (target, drafter, sampling, max_new_tokens).

    Usage:
      engine = SpeculativeEngine(target, drafter, sampling=SamplingParams(), max_new_tokens=32)
      state = engine.init_state(batch_size=2, max_prompt_len=16, seed=0)
      state = engine.prefill(state, prompts, prompt_lens)
      while not engine.done(state):
          state = engine.step(state)

    The modules are split once (`nnx.split`) into a static graph definition and parameter
    pytrees; the jitted functions merge them back inside the trace, so the parameters are
    ordinary arguments (not baked-in constants) and the state is donated: each round
    updates the caches in place.
    """

    def __init__(
        self,
        target,
        drafter=None,
        *,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int,
        scheduler: Scheduler | None = None,
        prefill_chunk: int = 256,
        stop_ids: Sequence[int] = (),
    ):
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be a positive int (got {max_new_tokens!r})")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: must be a SamplingParams (got {type(sampling).__name__})")
        if scheduler is not None and not isinstance(scheduler, Scheduler):
            raise ValueError(f"scheduler: must be a spec.Scheduler or None (got {type(scheduler).__name__})")
        if drafter is not None and not int(drafter.block_size) >= 1:
            raise ValueError(f"drafter: block_size must be >= 1 (got {drafter.block_size!r})")
        if not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: must be a positive int (got {prefill_chunk!r})")
        self.prefill_chunk = int(prefill_chunk)
        self.target = target
        self.drafter = drafter
        self.sampling = sampling
        self.max_new_tokens = int(max_new_tokens)
        self.scheduler = scheduler
        self.block_size = _block_size(drafter)
        self._t_graph, self._t_params = nnx.split(target)
        if drafter is None:
            self._d_graph, self._d_params = None, None
        else:
            self._d_graph, self._d_params = nnx.split(drafter)
        self.stop_ids = tuple(sorted({int(t) for t in stop_ids}))
        vocab = int(target.config.vocab_size)
        if any(not 0 <= t < vocab for t in self.stop_ids):
            raise ValueError(f"stop_ids: must lie in [0, {vocab}) (got {list(self.stop_ids)})")
        self._static = dict(t_graph=self._t_graph, d_graph=self._d_graph, sampling=sampling,
                            stop_ids=self.stop_ids)

    def _chunks(self, prompts, prompt_lens):
        """Split right-padded prompts `[B, P]` into chunks of at most `prefill_chunk` rows:
        yields `(chunk [B, C], starts [B], counts [B], final)`."""
        prompts = np.asarray(prompts, np.int32)
        lens = np.asarray(prompt_lens, np.int32)
        if prompts.ndim != 2 or lens.shape != prompts.shape[:1]:
            raise ValueError(
                f"prompts/prompt_lens: expected [B, P] and [B] (got {prompts.shape}, {lens.shape})")
        if lens.min() < 1 or lens.max() > prompts.shape[1]:
            raise ValueError(f"prompt_lens: must lie in [1, {prompts.shape[1]}] (got {lens.tolist()})")
        b, p = prompts.shape
        c = min(self.prefill_chunk, p)
        n = -(-p // c)
        padded = np.zeros((b, n * c), np.int32)
        padded[:, :p] = prompts
        for k in range(n):
            starts = np.full((b,), k * c, np.int32)
            counts = np.clip(lens - k * c, 0, c).astype(np.int32)
            yield padded[:, k * c:(k + 1) * c], starts, counts, k == n - 1

    def _prefill_call(self, state, chunk, starts, counts, lens, final):
        return _jit_prefill(self._t_params, self._d_params, state, jnp.asarray(chunk),
                            jnp.asarray(starts), jnp.asarray(counts), jnp.asarray(lens, jnp.int32),
                            final=final, max_new_tokens=self.max_new_tokens, **self._static)

    def _round_kwargs(self):
        return dict(self._static, max_new_tokens=self.max_new_tokens)

    # -- public -------------------------------------------------------------------------

    def init_state(self, batch_size: int, max_prompt_len: int, seed: int = 0) -> DecodeState:
        """A fresh state for `batch_size` requests with prompts of up to `max_prompt_len`.

        Caches hold `max_prompt_len + max_new_tokens + 2 * (g + 1)` positions per slot:
        the longest committed prefix plus one verify block, with room for a drafter that
        writes a block past the committed length.
        """
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size: must be a positive int (got {batch_size!r})")
        if not isinstance(max_prompt_len, (int, np.integer)) or max_prompt_len < 1:
            raise ValueError(f"max_prompt_len: must be a positive int (got {max_prompt_len!r})")
        b, g = int(batch_size), self.block_size
        max_len = int(max_prompt_len) + self.max_new_tokens + 2 * (g + 1)
        vocab = int(self.target.config.vocab_size)
        return DecodeState(
            target_cache=self.target.init_cache(b, max_len),
            drafter_state=None if self.drafter is None else self.drafter.init_state(b, max_len),
            slots=jnp.arange(b, dtype=jnp.int32),
            lengths=jnp.zeros((b,), jnp.int32),
            anchor=jnp.zeros((b,), jnp.int32),
            drafts=jnp.zeros((b, g), jnp.int32),
            draft_probs=None if self.sampling.greedy else jnp.zeros((b, g, vocab), jnp.float32),
            confidence=jnp.zeros((b, g), jnp.float32),
            verify_lens=jnp.zeros((b,), jnp.int32),
            survival_history=jnp.ones((2, b, g), jnp.float32),
            out_tokens=jnp.zeros((b, self.max_new_tokens + g + 1), jnp.int32),
            num_out=jnp.zeros((b,), jnp.int32),
            key=jax.random.key(seed),
            stats=RoundStats.zeros(b, g),
        )

    def prefill(self, state: DecodeState, prompts: np.ndarray, prompt_lens: np.ndarray) -> DecodeState:
        """Prefill right-padded prompts `i32[B, P]` (`prompt_lens [B]`) chunk by chunk
        (jitted `prefill` per chunk, the state donated)."""
        for chunk, starts, counts, final in self._chunks(prompts, prompt_lens):
            state = self._prefill_call(state, chunk, starts, counts, prompt_lens, final)
        return state

    def step(self, state: DecodeState) -> DecodeState:
        """Jitted `decode_round` (the state is donated)."""
        return _jit_round(self._t_params, self._d_params, state, self.scheduler, **self._round_kwargs())

    def lower_step(self, state: DecodeState) -> jax.stages.Lowered:
        """The lowered decode round, e.g. to inspect its HLO (`.as_text()`) or compile it."""
        return _jit_round.lower(self._t_params, self._d_params, state, self.scheduler, **self._round_kwargs())

    def compile(self, state: DecodeState, prompts: np.ndarray, prompt_lens: np.ndarray) -> None:
        """Compile prefill and the round now, so that timings that follow exclude compilation.

        Runs `prefill` and one `step` on `state` (consumed: its buffers are donated; pass a
        throwaway `init_state` of the shapes to come). Calling the jitted functions, rather
        than `lower(...).compile()`, is what fills jit's dispatch cache: an ahead-of-time
        executable does not serve later calls of the jitted function, whose first call then
        traced and lowered the round again (1-2 s for the SmolLM2 pair, which `generate`
        used to count as decode time). Later engines with the same static arguments and
        shapes (e.g. another model of the same architecture) find both programs in that
        cache and pay one prefill and one round here.
        """
        state = self.prefill(state, prompts, prompt_lens)
        jax.block_until_ready(self.step(state))

    def done(self, state: DecodeState) -> bool:
        """Whether every request has `max_new_tokens` tokens (one small device read)."""
        return bool(np.all(_host(state.num_out) >= self.max_new_tokens))


# -- generate -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """What one `generate` call measured.

    Attributes:
      acceptance_length: mean tokens emitted per request per decode round, the bonus /
        corrected token included (1.0 for plain decoding; up to g + 1).
      per_position_acceptance: per draft position k, accepted / verified request-rounds
        (the fraction of verified drafts at that position that were accepted; with every
        draft verified this is the cumulative acceptance rate of position k).
      verify_rate: verified drafts / proposed drafts (1.0 without a scheduler; 0.0 for plain
        decoding, which proposes none).
      tokens_per_s: generated tokens (all requests) per second of wall time, prefill
        included, compilation excluded.
      ttft_s: time to first token (prefill plus the first sample), compilation excluded.
      decode_s: wall time of the decode rounds.
      compile_s: time spent compiling prefill and the round.
      rounds: decode rounds run.
      num_tokens: generated tokens over all requests.
    """

    acceptance_length: float
    per_position_acceptance: list[float]
    verify_rate: float
    tokens_per_s: float
    ttft_s: float
    decode_s: float
    compile_s: float
    rounds: int
    num_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """Tokens per prompt (generated ids only, `max_new_tokens` each) and `GenerateStats`."""

    tokens: list[list[int]]
    stats: GenerateStats


def _pad_prompts(prompts: Sequence[Sequence[int]], vocab: int,
                 bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token-id lists to a multiple of `bucket` (fewer distinct prefill shapes,
    so fewer compilations): `(i32[B, P], lengths i32[B])`."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts: must be a non-empty list of token-id lists (got {prompts!r:.80})")
    lens = []
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}]: must be a non-empty list of ints (got {p!r:.80})")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompts[{i}]: token ids must lie in [0, {vocab}) (got {ids.tolist()!r:.80})")
        lens.append(ids.size)
    width = -(-max(lens) // bucket) * bucket
    out = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        out[i, : lens[i]] = np.asarray(p, np.int32)
    return out, np.asarray(lens, np.int32)


def _until_stop(row: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """`row` up to and including its first stop token."""
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[: i + 1]
    return row


def _host(tree):
    """Device -> numpy, also for arrays spanning other processes' devices (jax.distributed):
    those are gathered from every process first, so all processes see the same values."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _summarise(state: DecodeState, g: int, ttft: float, decode_s: float, compile_s: float,
               num_tokens: int, rounds: int) -> GenerateStats:
    s = _host(state.stats)
    total_rounds = int(np.sum(s.rounds))
    verified = np.asarray(s.verified, np.float64)
    accepted = np.asarray(s.accepted, np.float64)
    per_pos = np.where(verified > 0, accepted / np.maximum(verified, 1), 0.0)
    wall = ttft + decode_s
    return GenerateStats(
        acceptance_length=float(np.sum(s.emitted) / total_rounds) if total_rounds else 0.0,
        per_position_acceptance=[float(x) for x in per_pos],
        verify_rate=float(verified.sum() / (total_rounds * g)) if total_rounds and g else (1.0 if g else 0.0),
        tokens_per_s=float(num_tokens / wall) if wall > 0 else 0.0,
        ttft_s=float(ttft),
        decode_s=float(decode_s),
        compile_s=float(compile_s),
        rounds=int(rounds),
        num_tokens=int(num_tokens),
    )


def generate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    scheduler: Scheduler | None = None,
    progress: Callable[[int, int], None] | None = None,
    prefill_chunk: int = 256,
    stop_ids: Sequence[int] = (),
) -> GenerateResult:
    """Speculative generation for a batch of prompts (plain decoding when `drafter` is None).

    Args:
      target: target model (e.g. `models.llama.Llama`, `models.deepseek_v4` target).
      drafter: its DSpark drafter, or None for plain decoding through the same round.
      prompts: B lists of token ids (different lengths are fine).
      max_new_tokens: tokens to generate per prompt.
      sampling: temperature / top-k / top-p, applied identically to target and drafts
        (default greedy). Output is distributed exactly as the target's own sampling.
      seed: PRNG seed of all draws.
      scheduler: `spec.Scheduler` for confidence-scheduled verification, or None to
        verify every draft.
      progress: called as `progress(tokens_done, tokens_total)` after prefill and every
        round (e.g. to draw a progress bar).
      prefill_chunk: prompt rows per prefill call (the V4 target accepts at most its
        cache's `max_tokens_per_call`, 256 by default).
      stop_ids: token ids that end a request (e.g. end-of-turn); its tokens then end with
        the first one, and statistics count only what was emitted up to it.
    Returns:
      `GenerateResult(tokens, stats)`; `tokens[b]` are the `max_new_tokens` generated ids of
      prompt b (greedy speculative decoding gives exactly the greedy plain-decoding tokens).
    """
    engine = SpeculativeEngine(target, drafter, sampling=sampling, max_new_tokens=max_new_tokens,
                               scheduler=scheduler, prefill_chunk=prefill_chunk, stop_ids=stop_ids)
    padded, lens = _pad_prompts(prompts, int(target.config.vocab_size))
    b = padded.shape[0]
    total = b * engine.max_new_tokens

    t0 = time.perf_counter()
    engine.compile(engine.init_state(b, padded.shape[1], seed), padded, lens)
    compile_s = time.perf_counter() - t0

    state = engine.init_state(b, padded.shape[1], seed)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = engine.prefill(state, padded, lens)
    jax.block_until_ready(state.anchor)
    ttft = time.perf_counter() - t0
    if progress is not None:
        progress(b, total)

    t1 = time.perf_counter()
    rounds = 0
    while True:
        done_counts = np.minimum(_host(state.num_out), engine.max_new_tokens)
        if progress is not None and rounds:
            progress(int(done_counts.sum()), total)
        if np.all(done_counts >= engine.max_new_tokens):
            break
        state = engine.step(state)
        rounds += 1
    decode_s = time.perf_counter() - t1

    out = _host(state.out_tokens)[:, : engine.max_new_tokens]
    tokens = [_until_stop([int(t) for t in row], engine.stop_ids) for row in out]
    stats = _summarise(state, engine.block_size, ttft, decode_s, compile_s, sum(map(len, tokens)), rounds)
    return GenerateResult(tokens=tokens, stats=stats)
