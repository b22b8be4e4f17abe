"""Paged KV state as pytrees: flat row pools addressed through block tables.

Every piece of per-request state the models keep between calls is a `RowPool`: one flat
`[num_pages * page_size, width]` array plus an int32 block table `[num_slots + 1,
pages_per_slot]` that maps a request slot's logical page to a physical page. A row's flat
index is `block_table[slot, page] * page_size + offset`, which is exactly what the sparse
attention op consumes (`main_rows` / `extra_rows` plus index lists), so attention never
needs a gather-and-copy of the cache.

Two addressing modes:
  * linear (`ring=False`): logical row = position; rows past the capacity are dropped.
    Used for state that grows with the sequence (V4 compressed rows, indexer keys).
  * ring (`ring=True`): logical row = position mod capacity. Used for state that only
    needs the recent past (sliding-window rows, the compressor's open-window rows).

Why rings hold per-token rows rather than running accumulators: rollback after a
speculative verify is bookkeeping only (the engine just moves the committed length back),
so a call must never destroy state that a re-run from an earlier position needs. A ring
of capacity `span + max_tokens_per_call - 1` written by position satisfies that: a call
of at most `max_tokens_per_call` tokens starting at `c` only writes positions
`c .. c + S - 1`, which never alias the `span - 1` positions before `c` that a re-run
from any `c' >= c` reads. Re-processing a position simply rewrites the same row with the
same value.

Slots: a cache is built for `num_slots` requests plus one more, the scratch slot (always
the last one, `num_slots`), which padding requests in a static-shape batch point at. Its
rows receive garbage and are never handed to a real request.

The DeepSeek-V4 layout (`DeepseekV4Cache`) is a tuple of per-layer `V4LayerCache`s:
window rows on every layer, compressed rows and the compressor's fp32 open-window state
on CSA/HCA layers, indexer keys and the indexer compressor's state on CSA layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("rows", "block_table"),
    meta_fields=("page_size", "ring"),
)
@dataclasses.dataclass(frozen=True)
class RowPool:
    """Flat row pool plus block table (see module docstring).

    Attributes:
      rows: `[num_pages * page_size, width]`.
      block_table: int32 `[num_slots + 1, pages_per_slot]` physical page of each logical
        page of each slot (last slot = scratch).
      page_size: rows per page (static).
      ring: positions wrap modulo `capacity` (static).
    """

    rows: jax.Array
    block_table: jax.Array
    page_size: int
    ring: bool

    @property
    def capacity(self) -> int:
        """Rows one slot can address (`pages_per_slot * page_size`)."""
        return self.block_table.shape[1] * self.page_size

    @property
    def width(self) -> int:
        return self.rows.shape[1]

    @property
    def num_slots(self) -> int:
        """Real slots (the scratch slot excluded)."""
        return self.block_table.shape[0] - 1


def new_pool(num_slots: int, capacity: int, width: int, *, page_size: int,
             dtype: jnp.dtype, ring: bool) -> RowPool:
    """A zero-filled pool for `num_slots` requests + the scratch slot.

    Capacity is rounded up to whole pages. The block table is the identity layout (slot
    `s` owns pages `s * pages_per_slot ...`); an allocator may hand out pages differently
    later, nothing else depends on this layout.
    """
    for name, value in (("num_slots", num_slots), ("capacity", capacity), ("width", width),
                        ("page_size", page_size)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    pages_per_slot = _round_up(capacity, page_size) // page_size
    total_pages = (num_slots + 1) * pages_per_slot
    table = jnp.arange(total_pages, dtype=jnp.int32).reshape(num_slots + 1, pages_per_slot)
    rows = jnp.zeros((total_pages * page_size, width), dtype)
    return RowPool(rows=rows, block_table=table, page_size=page_size, ring=ring)


def row_index(pool: RowPool, slots: jax.Array, positions: jax.Array) -> jax.Array:
    """Flat row index of each (slot, position); -1 where the position has no row.

    Args:
      slots: int32 `[B]`.
      positions: int32 `[B, ...]` (any trailing shape).
    Returns:
      int32 `[B, ...]`: `-1` for negative positions and, for linear pools, positions
      `>= capacity`.
    """
    positions = positions.astype(jnp.int32)
    cap = pool.capacity
    if pool.ring:
        logical = jnp.mod(positions, cap)
        valid = positions >= 0
    else:
        logical = jnp.clip(positions, 0, cap - 1)
        valid = (positions >= 0) & (positions < cap)
    table = pool.block_table[slots.astype(jnp.int32)]  # [B, pages]
    table = table.reshape(table.shape[:1] + (1,) * (positions.ndim - 1) + table.shape[1:])
    page = logical // pool.page_size
    phys = jnp.take_along_axis(table, page[..., None], axis=-1)[..., 0]
    rows = phys * pool.page_size + logical % pool.page_size
    return jnp.where(valid, rows, -1)


def write_rows(pool: RowPool, slots: jax.Array, positions: jax.Array, values: jax.Array,
               mask: jax.Array | None = None) -> RowPool:
    """Store `values[b, ...]` at `(slots[b], positions[b, ...])` where `mask` is true.

    Args:
      slots: int32 `[B]`; positions: int32 `[B, ...]`; values: `[B, ..., width]`
      (cast to the pool dtype); mask: bool `[B, ...]` or None (all).
    Rows with no address (see `row_index`) or a false mask are dropped, never clamped.
    """
    if values.shape[:-1] != positions.shape or values.shape[-1] != pool.width:
        raise ValueError(
            f"values.shape={values.shape}: expected {positions.shape + (pool.width,)}")
    idx = row_index(pool, slots, positions)
    if mask is not None:
        idx = jnp.where(mask, idx, -1)
    # Out-of-range index -> dropped by the scatter (mode="drop").
    idx = jnp.where(idx < 0, pool.rows.shape[0], idx).reshape(-1)
    rows = pool.rows.at[idx].set(values.reshape(-1, pool.width).astype(pool.rows.dtype),
                                 mode="drop")
    return dataclasses.replace(pool, rows=rows)


def read_rows(pool: RowPool, idx: jax.Array, fill: float = 0.0) -> jax.Array:
    """Rows at flat indices `idx` (`[...]` -> `[..., width]`); `fill` where `idx < 0`."""
    safe = jnp.clip(idx, 0, pool.rows.shape[0] - 1)
    out = pool.rows[safe]
    return jnp.where((idx >= 0)[..., None], out, jnp.asarray(fill, out.dtype))


def window_positions(positions: jax.Array, window: int) -> jax.Array:
    """Positions `p - window + 1 .. p` for each query position `p` (`[...]` -> `[..., W]`).

    Negative results mean "before the sequence start"; `row_index` maps them to -1.
    """
    return positions[..., None] + jnp.arange(1 - window, 1, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class LayerCacheSpec:
    """What one V4 layer keeps.

    Attributes:
      window: sliding-window rows read per query.
      ratio: compression ratio (0 = window only).
      overlap: CSA-style overlapping windows (each entry pools 2 * ratio tokens).
      head_dim: width of window and compressed rows.
      index_head_dim: width of indexer keys (0 = no indexer).
    """

    window: int
    ratio: int
    overlap: bool
    head_dim: int
    index_head_dim: int = 0

    @property
    def span(self) -> int:
        """Raw positions one compressed entry pools."""
        return self.ratio * (2 if self.overlap else 1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("window", "entries", "state", "index_keys", "index_state"),
    meta_fields=(),
)
@dataclasses.dataclass(frozen=True)
class V4LayerCache:
    """One V4 layer's state (absent parts are None).

    Attributes:
      window: ring of raw key=value rows `[.., head_dim]` (cache dtype).
      entries: compressed rows `[.., head_dim]`, row `i` = entry `i` (linear).
      state: ring of the compressor's per-token fp32 projections `[.., 2 * c * head_dim]`
        (kv then gate logits; c = 2 on CSA layers, 1 on HCA layers).
      index_keys: indexer keys `[.., index_head_dim]`, row `i` = entry `i` (linear).
      index_state: ring of the indexer compressor's fp32 projections
        `[.., 4 * index_head_dim]`.
    """

    window: RowPool
    entries: RowPool | None = None
    state: RowPool | None = None
    index_keys: RowPool | None = None
    index_state: RowPool | None = None


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("layers", "lengths", "tables"),
    meta_fields=("max_len", "max_tokens_per_call"),
)
@dataclasses.dataclass(frozen=True)
class DeepseekV4Cache:
    """All layers' state for `num_slots` requests + the scratch slot.

    Attributes:
      layers: one `V4LayerCache` per layer (the MTP block keeps its own cache: `models/deepseek_v4_mtp.py`).
      lengths: int32 `[num_slots + 1]`: positions written per slot by the last call
        (`starts + lengths`); informational, the model never reads it. The engine sets
        the committed length with `commit` after a verify.
      tables: read-only per-position tables (V4: RoPE cos/sin of window-only layers and
        of compressed layers, `f32[max_len + max_tokens_per_call, R/2, 2]`). They live
        here because their size is the cache's `max_len`, not a model property: a model
        built for 1M positions (or only shape-evaluated) allocates none.
      max_len: positions per slot (static).
      max_tokens_per_call: largest S one call may process (static; sizes the rings).
    """

    layers: tuple[V4LayerCache, ...]
    lengths: jax.Array
    tables: tuple[jax.Array, ...]
    max_len: int
    max_tokens_per_call: int

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0] - 1

    @property
    def scratch_slot(self) -> int:
        """Slot index padding requests use (always the last)."""
        return self.lengths.shape[0] - 1


def init_layer_cache(spec: LayerCacheSpec, num_slots: int, max_len: int, *,
                     max_tokens_per_call: int, page_size: int,
                     dtype: jnp.dtype) -> V4LayerCache:
    """Allocate one layer's pools (see `V4LayerCache`)."""
    extra = max_tokens_per_call - 1
    window = new_pool(num_slots, spec.window + extra, spec.head_dim, page_size=page_size,
                      dtype=dtype, ring=True)
    if spec.ratio == 0:
        return V4LayerCache(window=window)
    n_entries = max(1, max_len // spec.ratio)
    c = 2 if spec.overlap else 1
    entries = new_pool(num_slots, n_entries, spec.head_dim, page_size=page_size,
                       dtype=dtype, ring=False)
    state = new_pool(num_slots, spec.span + extra, 2 * c * spec.head_dim,
                     page_size=page_size, dtype=jnp.float32, ring=True)
    if spec.index_head_dim == 0:
        return V4LayerCache(window=window, entries=entries, state=state)
    index_keys = new_pool(num_slots, n_entries, spec.index_head_dim, page_size=page_size,
                          dtype=dtype, ring=False)
    index_state = new_pool(num_slots, spec.span + extra, 2 * c * spec.index_head_dim,
                           page_size=page_size, dtype=jnp.float32, ring=True)
    return V4LayerCache(window=window, entries=entries, state=state, index_keys=index_keys,
                        index_state=index_state)


def init_deepseek_v4_cache(specs: Sequence[LayerCacheSpec], num_slots: int, max_len: int,
                           *, max_tokens_per_call: int, page_size: int = 64,
                           dtype: jnp.dtype = jnp.bfloat16,
                           tables: tuple[jax.Array, ...] = ()) -> DeepseekV4Cache:
    """Allocate a `DeepseekV4Cache` (one `V4LayerCache` per spec; `tables` kept as is)."""
    if max_len < 1:
        raise ValueError(f"max_len={max_len}: must be >= 1")
    if max_tokens_per_call < 1:
        raise ValueError(f"max_tokens_per_call={max_tokens_per_call}: must be >= 1")
    layers = tuple(
        init_layer_cache(s, num_slots, max_len, max_tokens_per_call=max_tokens_per_call,
                         page_size=page_size, dtype=dtype) for s in specs)
    return DeepseekV4Cache(layers=layers, lengths=jnp.zeros((num_slots + 1,), jnp.int32),
                           tables=tuple(tables), max_len=max_len,
                           max_tokens_per_call=max_tokens_per_call)


def commit(cache: DeepseekV4Cache, slots: jax.Array, lengths: jax.Array) -> DeepseekV4Cache:
    """Record `lengths[b]` as the committed length of `slots[b]` (rollback = this)."""
    new = cache.lengths.at[slots].set(lengths.astype(jnp.int32))
    return dataclasses.replace(cache, lengths=new)
