"""V4 MoE (every layer): sqrt-softplus router, top-k or hash routing, shared expert.

Scores `s = sqrt(softplus(x @ gate))`; non-hash layers pick the top-k of
`s + e_score_correction_bias` (the bias only steers selection), hash layers take the
experts from the frozen `tid2eid[token_id]` table; either way the combine weights are the
unbiased scores of the chosen experts renormalised to 1 times `routed_scale`. Routed
experts and the one shared expert are SwiGLU with the clamp (gate <= 10, up in
[-10, 10]); the clamp on the shared expert follows TensorRT-LLM (configurable).

Parameter names follow HF: `mlp.gate.{weight,e_score_correction_bias,tid2eid}`,
`mlp.experts.{gate_up_proj,down_proj}`, `mlp.shared_experts.{gate_up_proj,down_proj}`
(our layouts: `gate.weight [d, E]`, `gate_up_proj [E, d, 2I]` with gate first,
`down_proj [E, I, d]`; shared `[d, 2I]` / `[I, d]`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dspark import ops
from .deepseek_v4_config import DeepseekV4Config
from .deepseek_v4_params import Buffer, kernel, normal, random_choice_table


class Router(nnx.Module):
    """HF `mlp.gate`: `weight [d, E]` plus `e_score_correction_bias` or `tid2eid`."""

    def __init__(self, config: DeepseekV4Config, *, hashed: bool, rngs: nnx.Rngs):
        c = config
        self.hashed = hashed
        self.k = c.num_experts_per_tok
        self.score_func = c.score_func
        self.routed_scale = c.routed_scale
        self.weight = kernel(rngs, c.hidden_size, c.num_experts, c.dtype, c.init_std)
        if hashed:
            # A random table with distinct experts per token; the checkpoint supplies the
            # real one.
            self.tid2eid = Buffer(random_choice_table(rngs, c.vocab_size, c.num_experts, self.k))
        else:
            self.e_score_correction_bias = Buffer(normal(rngs, (c.num_experts,), 0.1))

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x [T, d]`, token_ids int32 `[T]` -> `(weights f32 [T, k], ids int32 [T, k])`."""
        logits = jnp.dot(x, self.weight[...], preferred_element_type=jnp.float32)
        scores = ops.router_scores(logits, self.score_func)
        if self.hashed:
            return ops.hash_route(scores, token_ids.astype(jnp.int32), self.tid2eid[...],
                                  route_scale=self.routed_scale)
        return ops.topk_route(scores, self.k, bias=self.e_score_correction_bias[...],
                              route_scale=self.routed_scale)


class Experts(nnx.Module):
    """HF `mlp.experts`: `gate_up_proj [E, d, 2I]`, `down_proj [E, I, d]`."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        c = config
        scale = c.init_std / max(1.0, (c.hidden_size / 64) ** 0.5)
        scale_down = c.init_std / max(1.0, (c.moe_intermediate_size / 64) ** 0.5)
        shape_up = (c.num_experts, c.hidden_size, 2 * c.moe_intermediate_size)
        shape_down = (c.num_experts, c.moe_intermediate_size, c.hidden_size)
        self.gate_up_proj = nnx.Param(normal(rngs, shape_up, scale, c.dtype))
        self.down_proj = nnx.Param(normal(rngs, shape_down, scale_down, c.dtype))


class SharedExpert(nnx.Module):
    """HF `mlp.shared_experts`: `gate_up_proj [d, 2I]` (gate first), `down_proj [I, d]`."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        c = config
        self.gate_up_proj = kernel(rngs, c.hidden_size, 2 * c.moe_intermediate_size, c.dtype,
                                   c.init_std)
        self.down_proj = kernel(rngs, c.moe_intermediate_size, c.hidden_size, c.dtype,
                                c.init_std)


class MoE(nnx.Module):
    """One layer's MoE (HF `mlp`): `MoE(x [..., d], token_ids [...]) -> [..., d]`."""

    def __init__(self, config: DeepseekV4Config, *, hashed: bool, rngs: nnx.Rngs):
        self.limit = config.swiglu_limit
        self.shared_limit = config.swiglu_limit if config.shared_expert_limit else None
        self.gate = Router(config, hashed=hashed, rngs=rngs)
        self.experts = Experts(config, rngs=rngs)
        self.shared_experts = SharedExpert(config, rngs=rngs)

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> jax.Array:
        """Routed experts + shared expert.

        Args:
          x: `[..., d]` normalised input; token_ids: int32 `[...]` (hash layers read them).
        Returns:
          `[..., d]` in x's dtype.
        """
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat, token_ids.reshape(-1))
        routed = ops.moe_experts(flat, ids, weights, self.experts.gate_up_proj[...],
                                 self.experts.down_proj[...], limit=self.limit)
        shared = ops.mlp_swiglu(flat, self.shared_experts.gate_up_proj[...],
                                self.shared_experts.down_proj[...], limit=self.shared_limit)
        return (routed + shared).reshape(shape)
