"""Measure the verify step's throughput table (`SpsTable`) for the scheduler.

The scheduler trades expected accepted tokens against the cost of a bigger verify batch,
so it needs steps per second as a function of batch tokens, measured on the machine and
model that will serve (the curve is a jagged staircase on GPUs: tile and wave
quantisation). The profiler only times a function it is given; building inputs of a given
batch-token count is the caller's business, because only the caller knows the model, the
cache and how tokens split into requests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_dspark.spec.schedule import SpsTable


def profile_sps(
    step: Callable[..., Any],
    make_inputs: Callable[[int], tuple[Any, ...]],
    token_counts: Sequence[int],
    *,
    warmup: int = 1,
    repeats: int = 5,
) -> SpsTable:
    """Time `step(*make_inputs(n))` for each `n` and tabulate steps per second.

    Inputs are rebuilt before every call, outside the timed region, so a `step` that
    donates its arguments (as the engine's verify step does with the cache) can be timed
    as it runs in production. Each count is warmed up first (compilation of a new shape
    happens there, not in the timings); the median of `repeats` wall-clock times, each
    ended by `jax.block_until_ready`, is the step time.

    Args:
      step: the jitted verify step.
      make_inputs: `n -> args` for a batch of `n` verify tokens (anchors included).
      token_counts: strictly increasing batch-token counts to measure.
      warmup: untimed calls per count (>= 1 so compilation is never timed).
      repeats: timed calls per count (>= 1).
    Returns:
      `SpsTable` with `tokens = token_counts`, `steps_per_s = 1 / median time`.
    """
    counts = [int(n) for n in token_counts]
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"token_counts: must be a non-empty sequence of counts >= 1 (got {list(token_counts)!r})")
    if warmup < 1:
        raise ValueError(f"warmup: must be >= 1 so compilation is not timed (got {warmup!r})")
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1 (got {repeats!r})")
    rates = []
    for n in counts:
        for _ in range(warmup):
            jax.block_until_ready(step(*make_inputs(n)))
        times = []
        for _ in range(repeats):
            args = jax.block_until_ready(make_inputs(n))
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append(time.perf_counter() - start)
        rates.append(1.0 / max(statistics.median(times), 1e-9))
    return SpsTable.create(counts, rates)
