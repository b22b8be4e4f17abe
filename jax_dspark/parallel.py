"""Parallelism through `jax.sharding`: mesh, sharding rules, expert and Helix parallelism.

JAX's own machinery (meshes, NamedSharding, `shard_map`, collectives) is the distributed
engine; this module adds only what the models need on top of it:

- `make_mesh` with named axes `data` (requests), `sequence` (KV rows, Helix), `expert`
  (MoE experts) and `tensor` (heads / FFN columns / vocab);
- `ShardingRules`: regex on a parameter's path -> `PartitionSpec`, applied to any pytree
  (NNX state, caches), so a model's sharding is one table next to it, not code inside it;
- `moe_experts_ep`: expert-parallel MoE through `shard_map` with all-to-all dispatch and
  combine, equal to the single-device `ops.moe_experts`;
- `helix_sparse_sink_attention`: KV rows sharded along the sequence, each shard's attention
  returning (out, lse), merged exactly with `ops.merge_partials`, the sink applied once;
- `initialize_distributed`: `jax.distributed.initialize` from flags or the usual
  environment variables (gloo collectives on CPU).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dspark import _ffi, ops
from jax_dspark.ops import _moe_kernels
from jax_dspark.ops.moe import expert_rows
from jax_dspark.ops.moe_fp8 import Fp8Weight, fp8_expert_rows

AXES = ("data", "sequence", "expert", "tensor")


def make_mesh(
    *, data: int = 1, sequence: int = 1, expert: int = 1, tensor: int = 1, devices: Sequence | None = None
) -> Mesh:
    """A mesh over `data x sequence x expert x tensor` devices (all four axes always exist).

    Size-1 axes cost nothing, and keeping every name present lets sharding rules name any
    axis regardless of how a particular run is laid out.
    """
    sizes = (data, sequence, expert, tensor)
    if any(not (isinstance(s, int) and s >= 1) for s in sizes):
        raise ValueError(f"mesh axis sizes must be ints >= 1 (got {dict(zip(AXES, sizes))})")
    devices = list(jax.devices() if devices is None else devices)
    need = int(np.prod(sizes))
    if need > len(devices):
        raise ValueError(f"mesh needs {need} devices ({dict(zip(AXES, sizes))}), only {len(devices)} available")
    return Mesh(np.asarray(devices[:need]).reshape(sizes), AXES)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Ordered `(path regex, PartitionSpec)` pairs; the first match wins, no match = replicated.

    Paths are the pytree key path joined with "/" (e.g. `layers/3/attn/wq_b/kernel`).
    A spec naming more dims than the array has, or an axis that does not divide the dim,
    raises ValueError naming the parameter, so a wrong rule fails at placement time rather
    than silently replicating.
    """

    rules: tuple[tuple[str, P], ...]

    def spec_for(self, path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
        for pattern, spec in self.rules:
            if re.search(pattern, path):
                if len(spec) > len(shape):
                    raise ValueError(f"sharding rule {pattern!r} -> {spec} has more dims than {path} {shape}")
                for dim, axis in zip(shape, spec):
                    names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
                    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
                    if dim % size:
                        raise ValueError(f"{path}: dim {dim} not divisible by mesh axes {names} (size {size})")
                return spec
        return P()

    def shardings(self, tree, mesh: Mesh):
        """A pytree of NamedSharding matching `tree` (arrays or ShapeDtypeStructs)."""

        def one(key_path, leaf):
            path = "/".join(_key_name(k) for k in key_path)
            path = path[: -len("/value")] if path.endswith("/value") else path  # nnx Variables
            return NamedSharding(mesh, self.spec_for(path, tuple(np.shape(leaf)), mesh))

        return jax.tree_util.tree_map_with_path(one, tree)

    def apply(self, tree, mesh: Mesh):
        """`tree` placed on `mesh` by these rules."""
        return jax.device_put(tree, self.shardings(tree, mesh))


# DeepSeek-V4 (and the V4-embedded drafter, whose blocks share these names): experts over
# `expert`; attention heads, output-projection groups, the shared expert's FFN and the
# vocabulary over `tensor`. Everything else (norms, mHC, compressor, indexer) is small and
# replicated. Caches stay replicated (their slot pools carry a scratch slot, so they do not
# split evenly over `data`).
V4_RULES = ShardingRules((
    (r"mlp/experts/(gate_up|down)_proj$", P("expert")),
    (r"mlp/shared_experts/gate_up_proj$", P(None, "tensor")),
    (r"mlp/shared_experts/down_proj$", P("tensor", None)),
    (r"self_attn/q_b_proj$", P(None, "tensor")),
    (r"self_attn/o_a_proj$", P("tensor")),
    (r"self_attn/o_b_proj$", P("tensor", None)),
    (r"self_attn/sinks$", P("tensor")),
    (r"^embed_tokens$", P("tensor", None)),
    (r"^lm_head$", P(None, "tensor")),
))


# Dense Llama-family targets and their standalone DSpark drafter. Layers are stacked along a
# leading axis for `lax.scan`, so specs name `[L, in, out]`: Q/K/V and the FFN's gate|up
# columns split over `tensor` (heads / FFN columns), the output and down projections split
# by rows (XLA inserts the reduction), the vocabulary of the embedding and Markov tables too.
LLAMA_RULES = ShardingRules((
    (r"^layers/(wq|wk|wv|w_gate_up)$", P(None, None, "tensor")),
    (r"^layers/(wo|w_down)$", P(None, "tensor", None)),
    (r"^(embedding|lm_head)$", P("tensor", None)),
    (r"^markov/w[12]$", P("tensor", None)),
))


def rules_for(model) -> ShardingRules:
    """The sharding table a model names with its `sharding_family` ("v4" or "llama")."""
    family = getattr(model, "sharding_family", None)
    tables = {"v4": V4_RULES, "llama": LLAMA_RULES}
    if family not in tables:
        raise ValueError(f"model: {type(model).__name__} names no sharding family in {sorted(tables)} (got {family!r})")
    return tables[family]


def shard_model(model, mesh: Mesh) -> None:
    """Place an NNX model's state on `mesh` by its rules (in place, via `nnx.update`)."""
    from flax import nnx

    nnx.update(model, rules_for(model).apply(nnx.state(model), mesh))


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def moe_experts_ep(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "expert",
    limit: float | None = None,
) -> jax.Array:
    """Expert-parallel `ops.moe_experts`: tokens and experts both split over `axis`.

    Each device owns `E / n` experts and `T / n` tokens. Dispatch: every (token, slot) row
    goes to the device owning its expert through one `all_to_all`; the receiver runs its
    experts (grouped matmul); a second `all_to_all` returns the rows, and the source applies
    the routing weights and sums into token order. The send buffer per destination holds
    `T/n * k` rows, the worst case, so no row is ever dropped and the result equals the
    single-device computation (a capacity factor < 1 would trade exactness for memory).

    Args:
      x: `[T, d]`; ids `int32[T, k]`; weights `f32[T, k]`; `w_gate_up [E, d, 2I]`,
        `w_down [E, I, d]` as in `ops.moe_experts`, or both FP8 (`ops.moe_fp8.Fp8Weight`,
        values and exponents split along E alike). T and E must divide by the axis size.
    Returns:
      `[T, d]` sharded along `axis` like x.

    Each device runs its experts as `ops.moe_experts` would on one device
    (`shard_expert_rows`): the CUDA grouped-GEMM kernels where they run, else the pure-JAX
    grouped matmul (`expert_rows`, or `fp8_expert_rows` for FP8 weights, DeepSeek's
    activation quantisation included); either way the result equals single-device
    `ops.moe_experts` on the same weights up to f32 summation order.
    """
    fp8 = isinstance(w_gate_up, Fp8Weight)
    if fp8 != isinstance(w_down, Fp8Weight):
        raise ValueError("moe_experts_ep: w_gate_up and w_down must both be Fp8Weight or both arrays")
    rows_fn = shard_expert_rows(fp8)
    n = mesh.shape[axis]
    t, k = ids.shape
    e = (w_gate_up.values if fp8 else w_gate_up).shape[0]
    if e % n or t % n:
        raise ValueError(f"moe_experts_ep: experts E={e} and tokens T={t} must divide by mesh[{axis!r}]={n}")
    e_local = e // n

    def local(x, ids, weights, wgu, wd):
        t_l, d = x.shape
        rows_out = t_l * k
        flat_ids = ids.reshape(-1)
        # An id outside [0, E) (possible only under jit) goes to destination n, which does
        # not exist: never sent, its row reads back as zeros, as in the single-device op.
        dest = jnp.where((flat_ids >= 0) & (flat_ids < e), flat_ids // e_local, n)
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=n + 1)
        starts = jnp.cumsum(counts) - counts
        sorted_dest = dest[order]
        slot = jnp.arange(rows_out) - starts[sorted_dest]  # rank of the row within its destination
        token = order // k
        send_x = jnp.zeros((n, rows_out, d), x.dtype).at[sorted_dest, slot].set(x[token], mode="drop")
        send_e = jnp.full((n, rows_out), -1, jnp.int32).at[sorted_dest, slot].set(flat_ids[order] % e_local,
                                                                                 mode="drop")
        recv_x = jax.lax.all_to_all(send_x, axis, 0, 0)
        recv_e = jax.lax.all_to_all(send_e, axis, 0, 0)
        y = rows_fn(recv_x.reshape(n * rows_out, d), recv_e.reshape(-1), wgu, wd, limit=limit)
        back = jax.lax.all_to_all(y.reshape(n, rows_out, d), axis, 0, 0)
        mine = back.at[sorted_dest, slot].get(mode="fill", fill_value=0)  # [rows_out, d] in `order`
        w = weights.reshape(-1)[order].astype(jnp.float32)
        out = jnp.zeros((t_l, d), jnp.float32).at[token].add(mine * w[:, None])
        return out.astype(x.dtype)

    spec = P(axis)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec, spec), out_specs=spec)
    return fn(x, ids, weights, w_gate_up, w_down)


def shard_expert_rows(fp8: bool):
    """How one device runs received rows through its experts under `moe_experts_ep`:
    `(rows [R, d], ids int32[R], w_gate_up, w_down, *, limit) -> [R, d]`.

    With the kernel library on a GPU (`_ffi.use_kernel`, so `ops.force` applies), the CUDA
    grouped-GEMM kernels of `ops.moe_experts`: each row is a token with one slot of weight
    1, so the kernel's un-permute hands back the expert's output row itself (bf16, as the
    single-device kernel's rows before its weighted sum), and ids outside `[0, E)` (the
    dispatch buffer's padding) give zero rows, as in the reference. Elsewhere the pure-JAX
    grouped matmul (`expert_rows` / `fp8_expert_rows`, f32 rows).
    """
    if not _ffi.use_kernel("moe_experts_fp8" if fp8 else "moe_experts"):
        return fp8_expert_rows if fp8 else expert_rows
    kernel = _moe_kernels.moe_experts_fp8 if fp8 else _moe_kernels.moe_experts

    def rows_through_kernel(rows, ids, w_gate_up, w_down, *, limit=None):
        one_slot = jnp.ones((rows.shape[0], 1), jnp.float32)
        return kernel(rows, ids[:, None], one_slot, w_gate_up, w_down, limit=limit)

    return rows_through_kernel


def helix_sparse_sink_attention(
    q: jax.Array,
    rows: jax.Array,
    idx: jax.Array,
    *,
    scale: float,
    sink: jax.Array | None = None,
    inverse_rope: jax.Array | None = None,
    mesh: Mesh,
    axis: str = "sequence",
) -> jax.Array:
    """`ops.sparse_sink_attention` with the row pool sharded along `axis` (Helix-style decode).

    Device j holds rows `[j*N/n, (j+1)*N/n)`. Each device attends over the indices that fall
    in its shard (others become -1) WITHOUT the sink and returns (out, lse); an all-gather of
    the partials and `ops.merge_partials` combine them exactly and apply the sink once.
    Queries and index lists are replicated; so is the result.

    Args:
      q: `[B, S, H, D]`; rows `[N, D]` (N divisible by the axis size); idx `int32[B, S, K]`
        global row ids or -1; sink `f32[H]`; inverse_rope `f32[B, S, R/2, 2]`.
    """
    n = mesh.shape[axis]
    total = rows.shape[0]
    if total % n:
        raise ValueError(f"helix: rows N={total} must divide by mesh[{axis!r}]={n}")
    per = total // n
    rope = inverse_rope

    def local(q, shard, idx, sink, rope):
        offset = jax.lax.axis_index(axis) * per
        local_idx = jnp.where((idx >= offset) & (idx < offset + per), idx - offset, -1).astype(jnp.int32)
        out, lse = ops.sparse_sink_attention(
            q, shard, local_idx, scale=scale, inverse_rope=rope, return_lse=True
        )
        outs = jax.lax.all_gather(out, axis)
        lses = jax.lax.all_gather(lse, axis)
        merged, _ = ops.merge_partials(list(outs), list(lses), sink)
        return merged

    sink_arg = sink if sink is not None else jnp.full((q.shape[2],), -jnp.inf, jnp.float32)
    rope_arg = rope if rope is not None else jnp.zeros((), jnp.float32)
    if rope is None:
        body = lambda q, shard, idx, sink, _: local(q, shard, idx, sink, None)
    else:
        body = local
    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(axis), P(), P(), P()), out_specs=P(), check_vma=False
    )
    return fn(q, rows, idx, sink_arg, rope_arg)


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Join a multi-process JAX job; returns False (and does nothing) for a single process.

    Values come from the arguments, else from `JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`. On CPU the collectives use gloo (the only CPU
    implementation that crosses processes). Must run before anything touches a backend.
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = num_processes if num_processes is not None else os.environ.get("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else os.environ.get("JAX_PROCESS_ID")
    if coordinator is None and num is None and pid is None:
        return False
    if coordinator is None or num is None or pid is None:
        raise ValueError(
            "distributed: need coordinator, num_processes and process_id together "
            f"(got {coordinator!r}, {num!r}, {pid!r})"
        )
    num, pid = int(num), int(pid)
    if not (num >= 1 and 0 <= pid < num):
        raise ValueError(f"distributed: process_id must be in [0, num_processes) (got {pid} of {num})")
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid)
    return True
