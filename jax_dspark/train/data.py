"""Training sequences: the target's own answers to eval-disjoint prompts.

DeepSpec regenerates every response with the target (spec section 7) because a drafter is
judged by how well it predicts THIS target, not the dataset's reference answers. Here:

1. `encode_chat_prompts`: each prompt of `train.prompts` becomes a ChatML prompt
   (`tokenizer.apply_chat_template`), too-long ones are dropped;
2. `generate_responses`: the target answers them through the speculative engine with no
   drafter (plain decoding, batched), greedily or by sampling; each answer is cut after
   its first end-of-turn token (`train.acceptance.decode_batch` stops a batch once every
   answer has ended);
3. `pack_sequences`: prompt + answer, right-padded to one length, with the loss mask on
   the answer tokens (anchors and labels are drawn from the answer only).

Hidden states and target logits are NOT stored: the trainer recomputes them with one
teacher-forced target forward inside each step (`teacher_forced`), which costs a fraction
of the step on a GPU and keeps the data a few megabytes of token ids (DeepSpec's cache of
hidden states is terabytes).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SequenceData", "encode_chat_prompts", "generate_responses", "pack_sequences", "teacher_forced",
           "save_sequences", "load_sequences", "concat_sequences", "prompt_width"]


@dataclasses.dataclass(frozen=True)
class SequenceData:
    """Packed training sequences.

    Attributes:
      tokens: `i32[N, S]` prompt + response ids, right-padded with 0.
      loss_mask: `bool[N, S]` True on response tokens (the targets of training).
      lengths: `i32[N]` valid tokens per row.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray

    def __post_init__(self):
        n, s = np.shape(self.tokens)
        if np.shape(self.loss_mask) != (n, s):
            raise ValueError(f"loss_mask: shape must be {(n, s)} (got {np.shape(self.loss_mask)})")
        if np.shape(self.lengths) != (n,):
            raise ValueError(f"lengths: shape must be {(n,)} (got {np.shape(self.lengths)})")

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def response_tokens(self) -> int:
        return int(np.sum(self.loss_mask))


def encode_chat_prompts(tokenizer, texts: Sequence[str], *, max_prompt_len: int) -> list[list[int]]:
    """ChatML ids of each single-turn prompt; prompts longer than `max_prompt_len` dropped."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len: must be >= 1 (got {max_prompt_len})")
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        if len(ids) <= max_prompt_len:
            out.append(list(ids))
    return out


def generate_responses(
    target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    batch_size: int = 64,
    seed: int = 0,
    log=None,
) -> list[list[int]]:
    """The target's answer to each prompt (plain decoding through the engine), cut after
    the first end-of-turn token.

    Prompts are sorted by length into batches (less padding) and the answers returned in
    the input order. Every batch has the same padded shape (a short last batch is filled
    with copies of its first prompt), so the engine compiles once; a batch stops as soon
    as every answer has ended.
    """
    from jax_dspark.ops.sampling import SamplingParams
    from jax_dspark.spec.engine import SpeculativeEngine
    from jax_dspark.train.acceptance import decode_batch

    if not prompts:
        raise ValueError("prompts: need at least one prompt (got none)")
    engine = SpeculativeEngine(target, None, sampling=SamplingParams(temperature=float(temperature)),
                               max_new_tokens=max_new_tokens)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    width = prompt_width(prompts)
    answers: list[list[int]] = [[] for _ in prompts]
    for k, start in enumerate(range(0, len(order), batch_size)):
        idx = [int(i) for i in order[start:start + batch_size]]
        batch = [list(prompts[i]) for i in idx]
        batch += [batch[0]] * (batch_size - len(batch))
        r = decode_batch(engine, batch, width=width, eos_ids=eos_ids, seed=seed + k)
        for j, i in enumerate(idx):
            answers[i] = r["outputs"][j]
        if log is not None:
            log(f"generated {start + len(idx)}/{len(order)} answers at T={temperature} "
                f"({r['num_tokens'] / max(r['wall_s'], 1e-9):.0f} tok/s, compile {r['compile_s']:.1f} s)")
    return answers


def prompt_width(prompts: Sequence[Sequence[int]]) -> int:
    """Padded prompt width `generate_responses` uses: the longest prompt rounded up to 64."""
    return -(-max(len(p) for p in prompts) // 64) * 64


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                   seq_len: int, min_response: int = 2) -> SequenceData:
    """Prompt + response rows of `seq_len` ids (responses truncated to fit; pairs with
    fewer than `min_response` response tokens left are dropped)."""
    if len(prompts) != len(responses):
        raise ValueError(f"responses: need one per prompt ({len(prompts)}) (got {len(responses)})")
    if seq_len < 2:
        raise ValueError(f"seq_len: must be >= 2 (got {seq_len})")
    rows = []
    for p, r in zip(prompts, responses):
        r = list(r)[: max(0, seq_len - len(p))]
        if len(r) >= min_response:
            rows.append((list(p), r))
    if not rows:
        raise ValueError("responses: no pair has a response that fits seq_len")
    tokens = np.zeros((len(rows), seq_len), np.int32)
    mask = np.zeros((len(rows), seq_len), bool)
    lengths = np.zeros((len(rows),), np.int32)
    for i, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        tokens[i, :n] = p + r
        mask[i, len(p):n] = True
        lengths[i] = n
    return SequenceData(tokens=tokens, loss_mask=mask, lengths=lengths)


def save_sequences(path: str | os.PathLike[str], data: SequenceData) -> None:
    """Write `data` to an `.npz` file (parent folders created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez_compressed(path, tokens=data.tokens, loss_mask=data.loss_mask, lengths=data.lengths)


def load_sequences(path: str | os.PathLike[str]) -> SequenceData:
    """Read what `save_sequences` wrote."""
    with np.load(path) as f:
        return SequenceData(tokens=f["tokens"], loss_mask=f["loss_mask"], lengths=f["lengths"])


def concat_sequences(parts: Sequence[SequenceData]) -> SequenceData:
    """Rows of every part, in order, as one `SequenceData` (e.g. a new data file trained
    together with an earlier one). Parts must share the row length `S`: padding rows to a
    common length would change the batches a training seed draws from the first part."""
    if not parts:
        raise ValueError("parts: need at least one SequenceData (got none)")
    widths = sorted({p.seq_len for p in parts})
    if len(widths) != 1:
        raise ValueError(f"parts: every part must have the same seq_len (got {widths})")
    return SequenceData(tokens=np.concatenate([p.tokens for p in parts]),
                        loss_mask=np.concatenate([p.loss_mask for p in parts]),
                        lengths=np.concatenate([p.lengths for p in parts]))


def teacher_forced(target, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One target forward over whole sequences: `(logits f32[B, S, V], hiddens [B, S, C, d])`.

    Uses a fresh cache with one slot per row (positions 0 .. S-1); rows past `lengths` are
    padding. Both outputs are wrapped in `stop_gradient`: the target is frozen.
    """
    b, s = tokens.shape
    cache = target.init_cache(b, s)
    logits, hiddens, _ = target(tokens, cache, slots=jnp.arange(b, dtype=jnp.int32),
                                starts=jnp.zeros((b,), jnp.int32), lengths=lengths)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(hiddens)
