"""Parameter creation for the V4 modules, and the map to HF / released checkpoint names.

Why our own tiny helpers instead of `nnx.Linear`: the V4 weights have layouts no stock
layer matches (grouped output projection, fused expert tensors, fp32 mHC matrices), and
keeping every weight a bare `nnx.Param` named after the HF module path makes the
checkpoint map below a handful of rules. Matrices are stored `[in, out]` ("kernel") so a
forward is `x @ kernel`; the HF / released tensors are `[out, in]` ("weight"), i.e. the
transpose.

Naming: module paths follow the HF port (`layers.{i}.self_attn.q_a_proj`, ...). The
released checkpoint (`layers.{i}.attn.wq_a`, ...) maps through `CHECKPOINT_MAP`; both
maps are documented in docs/deepseek_v4.md.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


_TRACED_DRAWS = itertools.count()


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float = 1.0,
           dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """`std * N(0, 1)` of `shape`, drawn from the `params` stream of `rngs`.

    Under tracing (`nnx.eval_shape`, `jit`) this is `jax.random.normal` on a key folded
    with a Python counter, so abstract construction of the 1.6T model allocates nothing
    and stays linear in the number of parameters (advancing the stream's traced counter
    Variable once per parameter made flax 0.12 tracing quadratic: minutes for `pro`).
    Concrete construction draws on the host with numpy seeded from the stream's key:
    eager `jax.random` compiles one program per distinct shape, which made building even
    the tiny model take tens of seconds on CPU.
    """
    stream = rngs.params
    base = stream.key[...]
    if isinstance(base, jax.core.Tracer):
        key = jax.random.fold_in(base, next(_TRACED_DRAWS) % (1 << 31))
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    seed = np.asarray(jax.random.key_data(stream())).astype(np.uint64).ravel().tolist()
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * std
    return jnp.asarray(values.astype(dtype))


def random_choice_table(rngs: nnx.Rngs, rows: int, choices: int, k: int) -> jax.Array:
    """int32 `[rows, k]`: `k` distinct values in `[0, choices)` per row (random)."""
    u = normal(rngs, (rows, choices))
    if isinstance(u, jax.core.Tracer):
        return jnp.argsort(u, axis=-1)[:, :k].astype(jnp.int32)
    return jnp.asarray(np.argsort(np.asarray(u), axis=-1)[:, :k].astype(np.int32))


def kernel(rngs: nnx.Rngs, fan_in: int, fan_out: int, dtype: jnp.dtype,
           std: float) -> nnx.Param:
    """A `[fan_in, fan_out]` matrix, normal(0, std / sqrt(fan_in / 64)).

    The fan-in correction keeps activations O(1) at any width, so the tiny config (random
    weights) exercises routing, gating and attention instead of saturating.
    """
    scale = std / max(1.0, (fan_in / 64.0) ** 0.5)
    return nnx.Param(normal(rngs, (fan_in, fan_out), scale, dtype))


def grouped_kernel(rngs: nnx.Rngs, groups: int, fan_in: int, fan_out: int,
                   dtype: jnp.dtype, std: float) -> nnx.Param:
    """`[groups, fan_in, fan_out]`: one matrix per group (grouped output projection)."""
    scale = std / max(1.0, (fan_in / 64.0) ** 0.5)
    return nnx.Param(normal(rngs, (groups, fan_in, fan_out), scale, dtype))


def norm_weight(rngs: nnx.Rngs, dim: int, dtype: jnp.dtype) -> nnx.Param:
    """RMSNorm weight near 1 (randomised so tests never see a no-op weight)."""
    return nnx.Param((1.0 + normal(rngs, (dim,), 0.1)).astype(dtype))


class Buffer(nnx.Variable):
    """Non-trainable model state that a checkpoint provides (hash tables, routing bias).

    Kept apart from `nnx.Param` so optimisers and parameter counts skip it.
    """


# (released checkpoint name, HF transformers name, our state path, transform). `{i}` is
# the layer, `{e}` the expert. Transforms: "T" = transpose ([out, in] -> our [in, out]);
# "stack" = stack experts along a new leading axis; "cat" = concatenate on the last axis.
# HF has no MTP module (it drops `mtp.*` on load); our MTP paths mirror a layer's.
CHECKPOINT_MAP: tuple[tuple[str, str, str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight", "embed_tokens", ""),
    ("head.weight", "lm_head.weight", "lm_head", "T"),
    ("norm.weight", "model.norm.weight", "norm", ""),
    ("hc_head_{fn,base,scale}", "model.hc_head.hc_{fn,base,scale}", "hc_head.hc_{fn,base,scale}", ""),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight",
     "layers.{i}.input_layernorm", ""),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
     "layers.{i}.post_attention_layernorm", ""),
    ("layers.{i}.hc_attn_{fn,base,scale}", "model.layers.{i}.attn_hc.{fn,base,scale}",
     "layers.{i}.attn_hc.{fn,base,scale}", ""),
    ("layers.{i}.hc_ffn_{fn,base,scale}", "model.layers.{i}.ffn_hc.{fn,base,scale}",
     "layers.{i}.ffn_hc.{fn,base,scale}", ""),
    ("layers.{i}.attn.wq_a.weight", "model.layers.{i}.self_attn.q_a_proj.weight",
     "layers.{i}.self_attn.q_a_proj", "T"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight",
     "layers.{i}.self_attn.q_norm", ""),
    ("layers.{i}.attn.wq_b.weight", "model.layers.{i}.self_attn.q_b_proj.weight",
     "layers.{i}.self_attn.q_b_proj", "T"),
    ("layers.{i}.attn.wkv.weight", "model.layers.{i}.self_attn.kv_proj.weight",
     "layers.{i}.self_attn.kv_proj", "T"),
    ("layers.{i}.attn.kv_norm.weight", "model.layers.{i}.self_attn.kv_norm.weight",
     "layers.{i}.self_attn.kv_norm", ""),
    ("layers.{i}.attn.wo_a.weight", "model.layers.{i}.self_attn.o_a_proj.weight",
     "layers.{i}.self_attn.o_a_proj", "[g*r, H*D/g] -> reshape [g, r, H*D/g] -> T per group"),
    ("layers.{i}.attn.wo_b.weight", "model.layers.{i}.self_attn.o_b_proj.weight",
     "layers.{i}.self_attn.o_b_proj", "T"),
    ("layers.{i}.attn.attn_sink", "model.layers.{i}.self_attn.sinks",
     "layers.{i}.self_attn.sinks", ""),
    ("layers.{i}.attn.compressor.wkv.weight", "model.layers.{i}.self_attn.compressor.kv_proj.weight",
     "layers.{i}.self_attn.compressor.kv_proj", "T"),
    ("layers.{i}.attn.compressor.wgate.weight",
     "model.layers.{i}.self_attn.compressor.gate_proj.weight",
     "layers.{i}.self_attn.compressor.gate_proj", "T"),
    ("layers.{i}.attn.compressor.ape", "model.layers.{i}.self_attn.compressor.position_bias",
     "layers.{i}.self_attn.compressor.position_bias", ""),
    ("layers.{i}.attn.compressor.norm.weight",
     "model.layers.{i}.self_attn.compressor.kv_norm.weight",
     "layers.{i}.self_attn.compressor.kv_norm", ""),
    ("layers.{i}.attn.indexer.compressor.{wkv,wgate}.weight",
     "model.layers.{i}.self_attn.compressor.indexer.{kv,gate}_proj.weight",
     "layers.{i}.self_attn.compressor.indexer.{kv,gate}_proj", "T"),
    ("layers.{i}.attn.indexer.compressor.ape",
     "model.layers.{i}.self_attn.compressor.indexer.position_bias",
     "layers.{i}.self_attn.compressor.indexer.position_bias", ""),
    ("layers.{i}.attn.indexer.compressor.norm.weight",
     "model.layers.{i}.self_attn.compressor.indexer.kv_norm.weight",
     "layers.{i}.self_attn.compressor.indexer.kv_norm", ""),
    ("layers.{i}.attn.indexer.wq_b.weight",
     "model.layers.{i}.self_attn.compressor.indexer.q_b_proj.weight",
     "layers.{i}.self_attn.compressor.indexer.q_b_proj", "T"),
    ("layers.{i}.attn.indexer.weights_proj.weight",
     "model.layers.{i}.self_attn.compressor.indexer.weights_proj.weight",
     "layers.{i}.self_attn.compressor.indexer.weights_proj", "T"),
    ("layers.{i}.ffn.gate.weight", "model.layers.{i}.mlp.gate.weight",
     "layers.{i}.mlp.gate.weight", "T"),
    ("layers.{i}.ffn.gate.bias", "model.layers.{i}.mlp.gate.e_score_correction_bias",
     "layers.{i}.mlp.gate.e_score_correction_bias", ""),
    ("layers.{i}.ffn.gate.tid2eid", "model.layers.{i}.mlp.gate.tid2eid",
     "layers.{i}.mlp.gate.tid2eid", "int32"),
    ("layers.{i}.ffn.experts.{e}.{w1,w3}.weight", "model.layers.{i}.mlp.experts.gate_up_proj",
     "layers.{i}.mlp.experts.gate_up_proj", "T, cat [w1 | w3], stack over e"),
    ("layers.{i}.ffn.experts.{e}.w2.weight", "model.layers.{i}.mlp.experts.down_proj",
     "layers.{i}.mlp.experts.down_proj", "T, stack over e"),
    ("layers.{i}.ffn.shared_experts.{w1,w3}.weight",
     "model.layers.{i}.mlp.shared_experts.{gate,up}_proj.weight",
     "layers.{i}.mlp.shared_experts.gate_up_proj", "T, cat [w1 | w3]"),
    ("layers.{i}.ffn.shared_experts.w2.weight",
     "model.layers.{i}.mlp.shared_experts.down_proj.weight",
     "layers.{i}.mlp.shared_experts.down_proj", "T"),
    ("mtp.0.{enorm,hnorm}.weight", "-", "mtp.{enorm,hnorm}", ""),
    ("mtp.0.{e_proj,h_proj}.weight", "-", "mtp.{e_proj,h_proj}", "T"),
    ("mtp.0.<layer tensor>", "-", "mtp.layer.<same path as a layer>", "as for layers"),
    ("mtp.0.hc_head_{fn,base,scale}", "-", "mtp.hc_head.hc_{fn,base,scale}", ""),
    ("mtp.0.norm.weight", "-", "mtp.norm", ""),
)
