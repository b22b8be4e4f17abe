"""DeepSeek-V4's own MTP block as a speculative drafter: the cached MTP forward and `MTPDrafter`.

The block (`deepseek_v4.MTPBlock`, spec 1.7) reads the target's FINAL mHC streams `X_p`
(entering the HC head) of position p and the token at p + 1, runs one window-only V4
block, its own HC head and norm, and the target's LM head: a prediction of the token at
p + 2. TensorRT-LLM serves it as Eagle-style one-model MTP-1; `MTPDrafter` is that, in the
drafter contract of `models/dspark.py` (`block_size`, `init_state`, `commit`, `draft`),
so `spec.engine.generate(target, MTPDrafter(...), ...)` runs it.

Position convention: the pair (X_p, t_{p+1}) sits at position p (RoPE and window), i.e.
the next tokens are shifted one row left while the positions stay the target's, as the
Eagle / MTP serving stacks feed it (the MTP "commit pass is roll-by-one over each
request's committed span"). Our notes do not pin this against a trained checkpoint; it
is a single place to change (`commit`'s `positions` and `draft`'s `starts`).

Cache: the block has its own one-layer `cache.DeepseekV4Cache` (`init_mtp_cache`): a ring
of raw key=value rows, capacity `window + max_tokens_per_call - 1`, written by position,
exactly like the target's window-only layers, so rollback is bookkeeping: a call may
write rows past the committed length and the next call simply starts from the
committed position (`mtp_forward`, `forward`). `tables` holds only the main RoPE table
(theta `rope_theta`, no YaRN: the block is window-only).

Why the drafter needs the target built with `capture_streams=True`: the engine's only
channel from the verify forward to a drafter is `hiddens`, and the block normalises and
projects every stream on its own (the stream mean, a capture of layer `num_layers`,
loses that). With the flag the target appends the n final streams after its C captures.
Recomputing them would cost a second target forward.

How the drafter splits the work (the MTP row of position p needs X_p AND t_{p+1}):
* `commit` gets the rows `j < counts` of a target forward at positions `s + j`: their
  streams and tokens. Row j's token is t_{s+j}, so it pairs with the streams of position
  s + j - 1: the previous row's, or for j = 0 the streams the previous commit left as
  `pending` (the newest committed position, whose next token was not known then). So
  commit writes the MTP window rows of positions `s - 1 .. s + counts - 2` (only the
  key=value projection: one block, nothing reads a committed row's output) and keeps the
  streams of position `s + counts - 1` as the new `pending`. Only committed rows are
  written, so rejected drafts never reach the state.
* `draft` runs the full block for (pending X_{L-1}, anchor t_L) at position L - 1 over
  the committed window, giving the draft of t_{L+1} (block slot 0 at position L).
  `block_size > 1` chains the same block Eagle-style: step i feeds the block's own output
  streams of step i - 1 and draft i - 1 at position L - 1 + i. The release trained the
  block for depth 1 only, so chained drafts are an approximation (lossless all the same:
  verification decides). Draft never returns state (the contract), so its rows live in a
  discarded copy of the cache; the next commit writes the committed ones again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark import ops
from jax_dspark.ops.sampling import SamplingParams
from jax_dspark.spec.propose import Proposal, propose

from .deepseek_v4 import MTPBlock
from .deepseek_v4_attention import StepContext, rope_freqs
from .deepseek_v4_config import DeepseekV4Config

__all__ = ["MTPDrafter", "MTPState", "forward", "init_mtp_cache", "mtp_forward"]


def _check_config(config: DeepseekV4Config) -> None:
    if not isinstance(config, DeepseekV4Config):
        raise ValueError(f"config: must be a DeepseekV4Config (got {type(config).__name__})")
    if config.num_mtp_layers != 1:
        raise ValueError(f"config.num_mtp_layers={config.num_mtp_layers}: the MTP block needs 1")


def _block(target) -> MTPBlock:
    mtp = getattr(target, "mtp", None)
    if not isinstance(mtp, MTPBlock):
        raise ValueError(f"target: has no MTP block (target.mtp={mtp!r}); build it with "
                         f"num_mtp_layers=1")
    return mtp


def init_mtp_cache(config: DeepseekV4Config, num_slots: int, max_len: int, *,
                   max_tokens_per_call: int = 256, page_size: int = 64) -> kvcache.DeepseekV4Cache:
    """The MTP block's window cache for `num_slots` requests (+ the scratch slot).

    One window-only layer (`layers[0].window`: ring of `window + max_tokens_per_call - 1`
    rows of width `head_dim`, `cache_dtype`); `tables = (main RoPE table,)` covering
    positions `0 .. max_len + max_tokens_per_call - 1`.
    """
    _check_config(config)
    spec = kvcache.LayerCacheSpec(window=config.window, ratio=0, overlap=False,
                                  head_dim=config.head_dim)
    main = ops.rope_table(max_len + max_tokens_per_call, config.rope_dim, theta=config.rope_theta)
    return kvcache.init_deepseek_v4_cache(
        (spec,), num_slots, max_len, max_tokens_per_call=max_tokens_per_call,
        page_size=page_size, dtype=config.cache_dtype, tables=(main,))


def mtp_forward(target, streams: jax.Array, next_tokens: jax.Array,
                cache: kvcache.DeepseekV4Cache, *, slots: jax.Array, starts: jax.Array,
                lengths: jax.Array) -> tuple[jax.Array, jax.Array, kvcache.DeepseekV4Cache]:
    """Cached MTP forward over `S` rows per request (same layout rules as the target's).

    Row j of request b sits at position `p = starts[b] + j`: `streams[b, j]` are the
    target's final streams of position p, `next_tokens[b, j]` the token at p + 1; its
    logits predict the token at p + 2. Rows `j >= lengths[b]` are padding (nothing
    written, outputs unspecified); each row sees the block's window rows of positions
    `p - window + 1 .. p` (this call's rows written first). Rows past a request's committed
    length may be written: continuing from an earlier position is all rollback takes.

    Args:
      target: a `DeepseekV4` with `num_mtp_layers=1` (its `mtp`, `embed`, `unembed`).
      streams: `[B, S, n, d]`; next_tokens: int32 `[B, S]`; cache: `init_mtp_cache`;
      slots, starts, lengths: int32 `[B]`.
    Returns:
      `(logits f32[B, S, V], output streams [B, S, n, d], cache)`; the output streams are
      what a chained (depth > 1) step feeds back in.
    """
    mtp = _block(target)
    c = target.config
    if jnp.ndim(streams) != 4 or streams.shape[2:] != (c.hc_mult, c.hidden_size):
        raise ValueError(f"streams.shape={jnp.shape(streams)}: expected [B, S, {c.hc_mult}, "
                         f"{c.hidden_size}]")
    b, s = streams.shape[:2]
    if jnp.shape(next_tokens) != (b, s):
        raise ValueError(f"next_tokens.shape={jnp.shape(next_tokens)}: expected ({b}, {s})")
    if s > cache.max_tokens_per_call:
        raise ValueError(f"streams.shape={streams.shape}: S={s} exceeds the cache's "
                         f"max_tokens_per_call={cache.max_tokens_per_call}")
    if len(cache.layers) != 1:
        raise ValueError(f"cache has {len(cache.layers)} layers: expected the MTP cache (1)")
    for name, arr in (("slots", slots), ("starts", starts), ("lengths", lengths)):
        if jnp.shape(arr) != (b,):
            raise ValueError(f"{name}.shape={jnp.shape(arr)}: expected ({b},)")
    main = cache.tables[0]
    ctx = StepContext.make(slots, starts, lengths, s, main, main)
    next_tokens = jnp.asarray(next_tokens, jnp.int32)
    out, lc = mtp(streams.astype(c.dtype), target.embed(next_tokens), next_tokens,
                  cache.layers[0], ctx)
    logits = target.unembed(mtp.head(out))
    lengths_out = cache.lengths.at[ctx.slots].set(ctx.starts + ctx.lengths)
    return logits, out, dataclasses.replace(cache, layers=(lc,), lengths=lengths_out)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def forward(graphdef: nnx.GraphDef, params: nnx.State, cache: kvcache.DeepseekV4Cache,
            streams: jax.Array, next_tokens: jax.Array, slots: jax.Array, starts: jax.Array,
            lengths: jax.Array) -> tuple[jax.Array, jax.Array, kvcache.DeepseekV4Cache]:
    """Jitted `mtp_forward` over `(graphdef, params) = nnx.split(target)`; the cache is
    donated. One compilation per (B, S)."""
    target = nnx.merge(graphdef, params)
    return mtp_forward(target, streams, next_tokens, cache, slots=slots, starts=starts,
                       lengths=lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
    """The MTP drafter's state.

    Attributes:
      cache: the block's window cache (`init_mtp_cache`); rows of committed positions
        `0 .. L - 2` (L = committed length), the row of L - 1 needs the anchor and is
        made by `draft`.
      pending: `[num_slots + 1, n, d]` the target's final streams of each slot's newest
        committed position (L - 1), waiting for the token after it.
    """

    cache: kvcache.DeepseekV4Cache
    pending: jax.Array


class MTPDrafter(nnx.Module):
    """Eagle-style MTP-1 drafter over the target's own MTP block (see module docstring).

    Usage:
      target = DeepseekV4(config, rngs=nnx.Rngs(0), capture_streams=True)  # num_mtp_layers=1
      result = generate(target, MTPDrafter(target.config), prompts, max_new_tokens=32)

    It holds no parameters: the block's weights are the target's `mtp.*` (the released
    checkpoint's `mtp.0.*`), reached through the `target` argument of `commit` / `draft`,
    like the shared embedding and LM head. No Markov or confidence head: the proposal's
    confidence logits are None (the engine then verifies every draft).

    Args:
      config: the target's `DeepseekV4Config` (`num_mtp_layers=1`).
      block_size: drafts per round (1 = MTP-1; more chains the one block).
      max_tokens_per_call: the most rows one `commit` receives (the engine's prefill chunk
        or `block_size + 1`); sizes the window ring.
      page_size: rows per page of the window pool.
    """

    def __init__(self, config: DeepseekV4Config, *, block_size: int = 1,
                 max_tokens_per_call: int = 256, page_size: int = 64):
        _check_config(config)
        for name, value in (("block_size", block_size),
                            ("max_tokens_per_call", max_tokens_per_call),
                            ("page_size", page_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: must be a positive int (got {value!r})")
        if max_tokens_per_call < block_size + 1:
            raise ValueError(f"max_tokens_per_call: must be >= block_size + 1 = {block_size + 1} "
                             f"(got {max_tokens_per_call})")
        self.config = config
        self.block_size = int(block_size)
        self.max_tokens_per_call = int(max_tokens_per_call)
        self.page_size = int(page_size)

    def init_state(self, num_slots: int, max_len: int) -> MTPState:
        """Empty window cache and pending streams for `num_slots` requests (+ scratch)."""
        for name, value in (("num_slots", num_slots), ("max_len", max_len)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: must be a positive int (got {value!r})")
        c = self.config
        cache = init_mtp_cache(c, int(num_slots), int(max_len),
                               max_tokens_per_call=self.max_tokens_per_call,
                               page_size=self.page_size)
        pending = jnp.zeros((int(num_slots) + 1, c.hc_mult, c.hidden_size), c.dtype)
        return MTPState(cache=cache, pending=pending)

    def commit(
        self,
        target,
        state: MTPState,
        *,
        tokens: jax.Array,
        hiddens: jax.Array,
        slots: jax.Array,
        starts: jax.Array,
        counts: jax.Array,
    ) -> MTPState:
        """Write the MTP rows the committed rows `j < counts[b]` complete (module docstring).

        Args:
          target: the `DeepseekV4` target (its `mtp` block and embedding).
          tokens: `i32[B, S]` the forward's tokens (row j at position `starts + j`).
          hiddens: `[B, S, C + n, d]` the forward's hiddens with the final streams appended
            (target built with `capture_streams=True`).
          slots, starts, counts: `i32[B]`; `counts = 0` commits nothing (padding).
        """
        mtp = _block(target)
        c = self.config
        b, s = jnp.shape(tokens)
        n_cap = len(c.capture_layers)
        want = (b, s, n_cap + c.hc_mult, c.hidden_size)
        if jnp.shape(hiddens) != want:
            raise ValueError(
                f"hiddens.shape={jnp.shape(hiddens)}: expected {want}, the C={n_cap} captures "
                f"then the {c.hc_mult} final streams; build the target with capture_streams=True")
        if s > state.cache.max_tokens_per_call:
            raise ValueError(f"tokens.shape={jnp.shape(tokens)}: S={s} exceeds the drafter's "
                             f"max_tokens_per_call={state.cache.max_tokens_per_call}")
        slots = jnp.asarray(slots, jnp.int32)
        starts = jnp.asarray(starts, jnp.int32)
        counts = jnp.asarray(counts, jnp.int32)
        tokens = jnp.asarray(tokens, jnp.int32)
        streams = hiddens[:, :, n_cap:].astype(c.dtype)                          # [B, S, n, d]
        # Row j pairs token t_{starts+j} with the streams of position starts + j - 1.
        shifted = jnp.concatenate([state.pending[slots][:, None], streams[:, :-1]], axis=1)
        j = jnp.arange(s, dtype=jnp.int32)[None, :]
        positions = starts[:, None] - 1 + j
        write = (j < counts[:, None]) & (positions >= 0)
        freqs = rope_freqs(state.cache.tables[0], positions)
        kv = mtp.kv_rows(shifted, target.embed(tokens), freqs)
        lc = state.cache.layers[0]
        lc = dataclasses.replace(lc, window=kvcache.write_rows(lc.window, slots, positions, kv, write))
        has_rows = counts > 0
        last = jnp.take_along_axis(streams, jnp.clip(counts - 1, 0, s - 1)[:, None, None, None],
                                   axis=1)[:, 0]
        dropped = state.pending.shape[0]                    # out of range -> dropped
        pending = state.pending.at[jnp.where(has_rows, slots, dropped)].set(last, mode="drop")
        lengths = state.cache.lengths.at[jnp.where(has_rows, slots, dropped)].set(
            starts + counts - 1, mode="drop")
        cache = dataclasses.replace(state.cache, layers=(lc,), lengths=lengths)
        return MTPState(cache=cache, pending=pending)

    def draft(
        self,
        target,
        state: MTPState,
        key: jax.Array,
        *,
        anchor: jax.Array,
        slots: jax.Array,
        lengths: jax.Array,
        sampling: SamplingParams,
    ) -> Proposal:
        """Propose `block_size` drafts (contract in `models/dspark.py`): step i runs the block
        at position `lengths - 1 + i` and draws the token at `lengths + i + 1` from the shared
        LM head's logits with the target's sampling (`spec.propose`, no Markov head)."""
        slots = jnp.asarray(slots, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        token = jnp.asarray(anchor, jnp.int32)
        b = slots.shape[0]
        streams = state.pending[slots][:, None]                                  # [B, 1, n, d]
        cache = state.cache
        one = jnp.ones((b,), jnp.int32)
        steps = []
        for i, k in enumerate(jax.random.split(key, self.block_size)):
            logits, streams, cache = mtp_forward(target, streams, token[:, None], cache,
                                                 slots=slots, starts=lengths - 1 + i, lengths=one)
            step = propose(k, logits, token, sampling)
            steps.append(step)
            token = step.tokens[:, 0]
        return Proposal(tokens=jnp.concatenate([p.tokens for p in steps], axis=1),
                        probs=jnp.concatenate([p.probs for p in steps], axis=1),
                        logits=jnp.concatenate([p.logits for p in steps], axis=1),
                        confidence_logits=None)
