"""Random anchors per sequence and the block labels they supervise (host-side numpy).

An anchor a is a response position whose next token is also a response token; its block
learns to predict tokens a+1 .. a+g. Sampling many anchors per sequence (DeepSpec: up to
512) turns one target forward into many training blocks. Supervision stops at the first
label outside the response (a contiguous prefix), because at inference a block is only
useful up to its first wrong draft.
"""

from __future__ import annotations

import numpy as np


def sample_anchors(rng: np.random.Generator, loss_mask: np.ndarray, num_anchors: int) -> np.ndarray:
    """`int32[num_anchors]` sorted anchor positions, `-1` padded.

    Candidates are positions i with `loss_mask[i]` and `loss_mask[i + 1]`; drawn uniformly
    without replacement.
    """
    mask = np.asarray(loss_mask, bool)
    if mask.ndim != 1:
        raise ValueError(f"loss_mask: expected a 1-D mask (got shape {mask.shape})")
    if num_anchors < 1:
        raise ValueError(f"num_anchors: must be >= 1 (got {num_anchors})")
    candidates = np.nonzero(mask[:-1] & mask[1:])[0]
    chosen = np.sort(rng.choice(candidates, size=min(num_anchors, candidates.size), replace=False))
    out = np.full(num_anchors, -1, np.int32)
    out[: chosen.size] = chosen
    return out


def block_labels(tokens: np.ndarray, loss_mask: np.ndarray, anchors: np.ndarray, block: int):
    """Labels `int32[A, g]` (tokens a+1 .. a+g, 0 where invalid) and `bool[A, g]` validity.

    Validity is the contiguous prefix of in-range response labels; padding anchors (-1)
    are entirely invalid.
    """
    tokens = np.asarray(tokens)
    mask = np.asarray(loss_mask, bool)
    pos = np.asarray(anchors)[:, None] + 1 + np.arange(block)[None, :]
    in_range = (np.asarray(anchors)[:, None] >= 0) & (pos < tokens.size)
    safe = np.where(in_range, pos, 0)
    ok = in_range & mask[safe]
    valid = np.cumprod(ok, axis=1).astype(bool)
    labels = np.where(valid, tokens[safe], 0).astype(np.int32)
    return labels, valid
