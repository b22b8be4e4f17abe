"""DeepSeek-V4 configuration: every structural knob of the architecture as a frozen field.

Why a single dataclass with derived per-layer properties: the layer mix (sliding window
only, CSA, HCA), hash routing and capture points are all decided per layer from a few
lists, exactly as in the released `config.json`; the model, the cache and the tests all
read the same derived answers (`layer_kind`, `is_hash_layer`) instead of re-deriving them.

Published values (`flash`, `pro`) follow `../shared/notes/deepseek-v4-spec.md` section 1.2.
`tiny` keeps every shape rule of the real model (MQA with one shared key=value row,
RoPE on the last dims, grouped output projection, overlapping CSA compressor with an
indexer, disjoint HCA compressor, hash layers first, 4 mHC streams) at sizes a CPU runs
in seconds, with window and compression ratios scaled down together so that a 30-token
sequence crosses many window and compression boundaries.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

LayerKind = Literal["swa", "csa", "hca"]


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """Architecture of a DeepSeek-V4 model.

    Attributes (shapes in the notation of the spec: d hidden, H heads, D head dim, R RoPE
    dims, n mHC streams):
      vocab_size, hidden_size (d), num_layers: as published.
      num_heads (H), head_dim (D), rope_dim (R): queries are `[H, D]`, the single shared
        key=value row is `[D]`; RoPE (interleaved pairs) acts on the last R dims.
      q_lora_rank: width of the query latent `c_q` (also the indexer's query input).
      o_groups, o_lora_rank: grouped low-rank output projection, `H*D/g -> o_lora` per
        group, then `g*o_lora -> d`.
      window: sliding window of raw rows every layer sees (128).
      compress_ratios: one entry per layer; 0 = window only, `csa_ratio` = CSA (overlapping
        compressor + lightning indexer), any other ratio = HCA (disjoint compressor, all
        completed entries visible). Extra trailing entries (MTP / padding in the released
        file) are not allowed here: the tuple must have exactly `num_layers` entries.
      csa_ratio: the ratio that marks a CSA layer (4 in the release).
      index_heads, index_head_dim, index_topk: lightning indexer shape and top-k.
      num_experts, num_experts_per_tok, moe_intermediate_size, routed_scale,
        score_func, swiglu_limit, num_hash_layers: MoE on every layer; the first
        `num_hash_layers` layers route by the frozen `tid2eid[token]` table.
      shared_expert_limit: apply the SwiGLU clamp to the shared expert too (TensorRT-LLM
        does, the HF port does not; we follow TensorRT-LLM, see docs/deepseek_v4.md).
      hc_mult, hc_sinkhorn_iters, hc_eps, hc_post_mult: mHC residual (4 streams, 20
        Sinkhorn iterations, eps 1e-6, post multiplier 2).
      rms_eps: epsilon of every RMSNorm.
      hc_norm_eps: epsilon of the mHC / HC-head RMS scaling (separate because the DSpark
        drafter sets its RMSNorm eps to 1e-20 but keeps mHC's 1e-6).
      rope_theta: RoPE base of window-only layers (no YaRN).
      compress_rope_theta, yarn_factor, yarn_original_max_positions, yarn_beta_fast,
        yarn_beta_slow: RoPE of compressed (CSA/HCA) layers: queries, window rows,
        compressed rows and indexer rows of those layers all use it (TensorRT-LLM).
      max_position_embeddings: size of the RoPE tables the model holds.
      num_mtp_layers: the MTP block (0 or 1); its parameters are built and counted.
      capture_layers: layers whose *entering* hidden state (mean over the mHC streams)
        the forward returns for a drafter; `num_layers` means "after the last layer".
      dtype: parameter and activation dtype; cache_dtype: window / compressed rows.
      init_std: standard deviation of the random initialisation.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]
    csa_ratio: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scale: float
    num_hash_layers: int
    score_func: str = "sqrt_softplus"
    swiglu_limit: float = 10.0
    shared_expert_limit: bool = True
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hc_post_mult: float = 2.0
    rms_eps: float = 1e-6
    hc_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_positions: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    num_mtp_layers: int = 1
    capture_layers: tuple[int, ...] = ()
    dtype: jnp.dtype = jnp.bfloat16
    cache_dtype: jnp.dtype = jnp.bfloat16
    init_std: float = 0.02

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, value: object, why: str) -> None:
            if not cond:
                raise ValueError(f"DeepseekV4Config.{name}={value!r}: {why}")

        need(len(self.compress_ratios) == self.num_layers, "compress_ratios",
             self.compress_ratios, f"needs exactly num_layers={self.num_layers} entries")
        need(all(r >= 0 for r in self.compress_ratios), "compress_ratios",
             self.compress_ratios, "ratios must be >= 0")
        need(self.csa_ratio >= 1, "csa_ratio", self.csa_ratio, "must be >= 1")
        need(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim, "rope_dim",
             self.rope_dim, f"must be even and <= head_dim={self.head_dim}")
        need(self.rope_dim <= self.index_head_dim, "index_head_dim", self.index_head_dim,
             f"must hold the rope_dim={self.rope_dim} rotated dims")
        need(self.num_heads % self.o_groups == 0, "o_groups", self.o_groups,
             f"must divide num_heads={self.num_heads}")
        need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
             self.num_experts_per_tok, f"must be in 1..num_experts={self.num_experts}")
        need(0 <= self.num_hash_layers <= self.num_layers, "num_hash_layers",
             self.num_hash_layers, f"must be in 0..num_layers={self.num_layers}")
        need(self.num_mtp_layers in (0, 1), "num_mtp_layers", self.num_mtp_layers,
             "must be 0 or 1")
        need(all(0 <= c <= self.num_layers for c in self.capture_layers), "capture_layers",
             self.capture_layers, f"entries must be in 0..num_layers={self.num_layers}")
        need(self.window >= 1, "window", self.window, "must be >= 1")

    def layer_kind(self, layer: int) -> LayerKind:
        """"swa" (window only), "csa" (overlapping compressor + indexer) or "hca"."""
        ratio = self.compress_ratios[layer]
        if ratio == 0:
            return "swa"
        return "csa" if ratio == self.csa_ratio else "hca"

    def is_hash_layer(self, layer: int) -> bool:
        """Whether `layer`'s MoE routes by the frozen token-id table."""
        return layer < self.num_hash_layers

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    @property
    def hc_mix(self) -> int:
        """Outputs of one mHC projection: n pre + n post + n*n comb logits."""
        return (2 + self.hc_mult) * self.hc_mult

    def replace(self, **changes: object) -> "DeepseekV4Config":
        return dataclasses.replace(self, **changes)


def flash() -> DeepseekV4Config:
    """DeepSeek-V4-Flash (284B total / 13B active): 2 SWA + 21 CSA + 20 HCA layers."""
    return DeepseekV4Config(
        vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512,
        rope_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window=128,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4,), csa_ratio=4, index_heads=64,
        index_head_dim=128, index_topk=512, num_experts=256, num_experts_per_tok=6,
        moe_intermediate_size=2048, routed_scale=1.5, num_hash_layers=3,
        capture_layers=(40, 41, 42),
    )


def pro() -> DeepseekV4Config:
    """DeepSeek-V4-Pro (1.6T total / 49B active): 30 CSA + 31 HCA layers."""
    return DeepseekV4Config(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, head_dim=512,
        rope_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024, window=128,
        compress_ratios=(128, 128) + (4, 128) * 29 + (4,), csa_ratio=4, index_heads=64,
        index_head_dim=128, index_topk=1024, num_experts=384, num_experts_per_tok=6,
        moe_intermediate_size=3072, routed_scale=2.5, num_hash_layers=3,
        capture_layers=(58, 59, 60),
    )


def tiny() -> DeepseekV4Config:
    """CPU test model: d 64, 4 layers (SWA, CSA, HCA, CSA), window 8, CSA 2x, HCA 8x.

    Ratios keep the released relations (HCA ratio == window, CSA ratio small, windows of
    2x the CSA ratio); YaRN is scaled down (x4 from 32 positions) so the compressed-layer
    RoPE actually interpolates inside test lengths. float32 everywhere so that decode vs
    prefill comparisons are tight.
    """
    return DeepseekV4Config(
        vocab_size=128, hidden_size=64, num_layers=4, num_heads=4, head_dim=32,
        rope_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, window=8,
        compress_ratios=(0, 2, 8, 2), csa_ratio=2, index_heads=4, index_head_dim=16,
        index_topk=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        routed_scale=1.5, num_hash_layers=2, yarn_factor=4.0,
        yarn_original_max_positions=32, max_position_embeddings=256, num_mtp_layers=0,
        capture_layers=(1, 2, 3), dtype=jnp.float32, cache_dtype=jnp.float32,
        init_std=0.2,
    )


CONFIGS = {"tiny": tiny, "flash": flash, "pro": pro}
