"""Device timing from JAX without profiler access.

Small kernels (a few microseconds) are dwarfed by Python dispatch, so `per_call_us` compiles
N calls over N different input sets into ONE executable and subtracts the time of a 1-call
executable: what remains is device time per call plus launch gaps, with the fixed dispatch
cost cancelled. Different input sets keep XLA from merging the calls and rotate the data
through memory the way a decode loop does. Large operations (the copy and GEMM ceilings)
are timed over a Python loop, where dispatch is negligible.

What the subtraction cannot remove is the launch gap between one call's kernels and the
next inside the executable (~5-15 µs per call through XLA's thunks, which is most of a
small case). `enable_command_buffers` makes XLA replay fusions and custom calls as CUDA
graphs instead, as a deployment with command buffers would; every timing of the process,
reference and kernel alike, then runs that way, and `launch_mode()` says which it was.
On the H200 that did not lower the floor (docs/kernels.md), so `device_busy_us` also reads
the GPU's own record: a profiler trace of the same N-call executable, summing the
durations of the kernels and copies on the device's streams, i.e. time the GPU was busy
with the call, gaps excluded.
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.profiler
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


def _n_call_executable(fn: Callable, input_sets: Sequence[tuple]):
    """`fn` over every input set in one jitted executable, compiled and warmed up."""
    many = jax.jit(lambda sets: [fn(*s) for s in sets])
    sets = list(input_sets)
    for _ in range(2):  # compile + warm up
        jax.block_until_ready(many(sets))
    return many, sets


def _per_call(fn: Callable, many, sets: list, reps: int) -> float:
    n = len(sets)
    one = jax.jit(lambda sets: [fn(*s) for s in sets])
    first = sets[:1]
    for _ in range(2):
        jax.block_until_ready(one(first))
    t_many = median_wall_s(lambda: many(sets), reps)
    t_one = median_wall_s(lambda: one(first), reps)
    return max(t_many - t_one, 1e-9) / (n - 1) * 1e6


def _busy(many, sets: list) -> float | None:
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(many(sets))
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None
        busy_ns = stream_busy_ns(jax.profiler.ProfileData.from_file(files[0]).planes)
    return busy_ns / len(sets) / 1e3 if busy_ns > 0 else None


def _check_sets(input_sets: Sequence[tuple]) -> None:
    if len(input_sets) < 2:
        raise ValueError(f"input_sets: need at least 2 sets (got {len(input_sets)})")


def per_call_us(fn: Callable, input_sets: Sequence[tuple], reps: int = 15) -> float:
    """Median device time of `fn(*inputs)` in microseconds (see module docstring)."""
    _check_sets(input_sets)
    many, sets = _n_call_executable(fn, input_sets)
    return _per_call(fn, many, sets, reps)


def device_busy_us(fn: Callable, input_sets: Sequence[tuple]) -> float | None:
    """GPU busy time of `fn(*inputs)` per call in microseconds: one profiled run of the
    N-call executable of `per_call_us`, summed stream events (kernels, copies) / N. None
    when the trace holds no GPU stream events (no GPU, or the profiler cannot see it)."""
    many, sets = _n_call_executable(fn, input_sets)
    return _busy(many, sets)


def call_times(fn: Callable, input_sets: Sequence[tuple], reps: int = 15) -> tuple[float, float | None]:
    """`(per_call_us, device_busy_us)` of `fn` from ONE compilation of the N-call executable
    (what the benchmarks record for every case)."""
    _check_sets(input_sets)
    many, sets = _n_call_executable(fn, input_sets)
    return _per_call(fn, many, sets, reps), _busy(many, sets)


def stream_busy_ns(planes) -> int:
    """Summed durations of the events on the GPU planes' stream lines ("Stream #N..."): the
    kernels and copies themselves. The derived lines ("XLA Ops", "XLA Modules", ...) span
    the same time again and are skipped."""
    total = 0
    for plane in planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                total += sum(int(event.duration_ns) for event in line.events)
    return total


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


COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL", "--xla_gpu_graph_min_graph_size=1")


def enable_command_buffers() -> None:
    """Add `COMMAND_BUFFER_FLAGS` to XLA_FLAGS. XLA reads its flags once, when JAX creates
    its backends, so this must come first: afterwards it raises instead of doing nothing."""
    from jax._src import xla_bridge  # the only way to ask (no public API)

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("enable_command_buffers: JAX's backends are already initialised, so XLA_FLAGS "
                           "would be ignored; call it before the first JAX computation")
    flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in COMMAND_BUFFER_FLAGS if f not in flags])


def launch_mode() -> str:
    """How this process's executables launch their kernels: "command buffers" when XLA_FLAGS
    holds `COMMAND_BUFFER_FLAGS`, else "streams" (one launch per thunk)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return "command buffers" if all(f in flags for f in COMMAND_BUFFER_FLAGS) else "streams"


def launch_note(mode: str) -> str:
    """The markdown note that says how a benchmark's executables launched (`launch_mode`)."""
    if mode == "command buffers":
        return ("Launches: XLA command buffers (" + " ".join(COMMAND_BUFFER_FLAGS) + "): fusions and custom calls "
                "replayed as CUDA graphs, for the reference and the kernel alike.")
    return "Launches: one stream launch per XLA thunk (no command buffers); small cases include the launch gaps."


def gpu_name() -> str:
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform}, {getattr(d, 'core_count', '?')} SMs)"


def finite_or_none(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None
