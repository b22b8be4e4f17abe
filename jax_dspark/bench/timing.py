"""Device timing from JAX without profiler access.

Small kernels (a few microseconds) are dwarfed by Python dispatch, so `per_call_us` compiles
N calls over N different input sets into ONE executable and subtracts the time of a 1-call
executable: what remains is device time per call plus launch gaps, with the fixed dispatch
cost cancelled. Different input sets keep XLA from merging the calls and rotate the data
through memory the way a decode loop does. Large operations (the copy and GEMM ceilings)
are timed over a Python loop, where dispatch is negligible.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def median_wall_s(fn: Callable[[], object], reps: int) -> float:
    """Median wall time in seconds of `reps` calls of `fn`, each ended by
    `jax.block_until_ready` (warm-up is the caller's business)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def per_call_us(fn: Callable, input_sets: Sequence[tuple], reps: int = 15) -> float:
    """Median device time of `fn(*inputs)` in microseconds (see module docstring)."""
    n = len(input_sets)
    if n < 2:
        raise ValueError(f"input_sets: need at least 2 sets (got {n})")
    many = jax.jit(lambda sets: [fn(*s) for s in sets])
    one = jax.jit(lambda sets: [fn(*s) for s in sets])
    sets = list(input_sets)
    first = sets[:1]
    for _ in range(2):  # compile + warm up
        jax.block_until_ready(many(sets))
        jax.block_until_ready(one(first))
    t_many = median_wall_s(lambda: many(sets), reps)
    t_one = median_wall_s(lambda: one(first), reps)
    return max(t_many - t_one, 1e-9) / (n - 1) * 1e6


def copy_bandwidth_TBps(gib: float = 2.0, reps: int = 10) -> float:
    """Device memory bandwidth of an elementwise pass (bytes read + written per second)."""
    n = int(gib * 2**30) // 4
    x = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A))
    jax.block_until_ready(f(x))
    loops = 10
    t = median_wall_s(lambda: [f(x) for _ in range(loops)][-1], reps) / loops
    return 2 * n * 4 / t / 1e12


def gemm_bf16_TFLOPs(size: int = 8192, reps: int = 10) -> float:
    """bf16 matrix-product rate through XLA (cuBLAS) on random data."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (size, size), jnp.bfloat16)
    b = jax.random.normal(kb, (size, size), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    jax.block_until_ready(f(a, b))
    loops = 10
    t = median_wall_s(lambda: [f(a, b) for _ in range(loops)][-1], reps) / loops
    return 2 * size**3 / t / 1e12


def gpu_name() -> str:
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform}, {getattr(d, 'core_count', '?')} SMs)"


def finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None
