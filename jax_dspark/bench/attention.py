"""`jax-dspark bench attention`: sparse sink attention, XLA reference vs CUDA kernel.

Each case gives every request K distinct rows of its own (a random permutation of a
private region of one big pool, so the gather order is random and nothing repeats across
requests); the S query rows of a request share the list, as a DSpark block does. DSpark
cases put the last 5 rows in the extra pool (the draft block) and the rest in the main pool
(the context ring). Every call takes the sink and the inverse-RoPE epilogue on the last 64
output dims, as `models/deepseek_v4_attention.py` calls the op (since 2026-12-06; earlier
runs had no inverse RoPE). Bytes counted = distinct rows x 1024 B; FLOPs = 4 * B*S*H*K*512.

Every case runs twice, `kv_dtype` "bf16" (1024-byte rows) and "fp8" (both pools in the
`ops.kv_fp8.Fp8Rows` form: 448 e4m3 + 64 bf16 + 8 scale bytes = 584 bytes per row, the
bytes the kernel reads, so `kernel_TBps` counts 584 B per distinct row), and every
registered kernel variant gets its own row (`kernel`: "mma.sync" and "wgmma"), all against the
same XLA timing; `default` marks the row of the kernel that calls get by default
(`ops._kernels.AUTO_ATTENTION_KERNEL`: wgmma for both kinds since 4380827).

Every row also says whether its case's target is within the GPU's ceilings at all
(`floor_columns`). The targets are stated on KV bytes (memory-bound) or FLOPs
(compute-bound) alone, but any kernel also has to read q and write the output: the byte
floor is those bytes plus the distinct KV rows, the index lists and the RoPE table, moved
once at this run's copy rate; the tensor floor is the FLOPs at this run's GEMM rate. A
target whose time is shorter than either floor is out of reach whatever the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark import _ffi, ops
from jax_dspark.bench import report, timing
from jax_dspark.ops import _kernels, kv_fp8

D = 512
ROPE_DIM = 64  # V4's RoPE dims, rotated back in the epilogue (inverse_rope)


@dataclass(frozen=True)
class Case:
    name: str
    B: int  # requests
    S: int  # query rows per request
    H: int  # heads
    K: int  # rows seen per query row
    extra: int = 0  # of K, rows taken from the extra pool


CASES = (
    Case("V4-Flash CSA decode", 64, 1, 64, 640),
    Case("DSpark block", 64, 5, 64, 133, extra=5),
    Case("V4-Pro DSpark block", 128, 5, 128, 133, extra=5),
    Case("V4-Pro HCA long context", 16, 1, 128, 8192),
    Case("dense 16k", 32, 1, 64, 16384),
)
TARGET_MEMORY_FRACTION = 0.8
TARGET_COMPUTE_FRACTION = 0.5
TARGET_SPEEDUP = 5.0
KV_DTYPES = ("bf16", "fp8")
VARIANT_NAMES = {"mma": "mma.sync", "wgmma": "wgmma"}
ROW_BYTES = {"bf16": D * 2, "fp8": kv_fp8.ROW_BYTES}


def make_inputs(case: Case, sets: int, seed: int = 0, kv_dtype: str = "bf16"):
    """`sets` input tuples (q, main_rows, main_idx, extra_rows, extra_idx, sink, inverse_rope) over
    shared pools (`kv_dtype` "fp8": both pools quantised once into `kv_fp8.Fp8Rows`);
    inverse_rope `f32[B, S, 32, 2]`: (cos, sin) of random angles per query row."""
    rng = np.random.default_rng(seed)
    k_main = case.K - case.extra
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    main_rows = jax.random.normal(k1, (case.B * k_main, D), jnp.bfloat16)
    extra_rows = jax.random.normal(k2, (max(1, case.B * case.extra), D), jnp.bfloat16)
    if kv_dtype == "fp8":
        main_rows, extra_rows = kv_fp8.quantize_kv_rows(main_rows), kv_fp8.quantize_kv_rows(extra_rows)
    sink = jnp.asarray(rng.standard_normal(case.H), jnp.float32)
    out = []
    for i in range(sets):
        qk = jax.random.fold_in(k3, i)
        q = jax.random.normal(qk, (case.B, case.S, case.H, D), jnp.bfloat16)
        main_idx = np.stack([b * k_main + rng.permutation(k_main) for b in range(case.B)]).astype(np.int32)
        main_idx = jnp.asarray(np.broadcast_to(main_idx[:, None], (case.B, case.S, k_main)).copy())
        extra_idx = None
        if case.extra:
            e = np.stack([b * case.extra + rng.permutation(case.extra) for b in range(case.B)]).astype(np.int32)
            extra_idx = jnp.asarray(np.broadcast_to(e[:, None], (case.B, case.S, case.extra)).copy())
        angle = rng.uniform(0.0, 2 * np.pi, (case.B, case.S, ROPE_DIM // 2))
        freqs = jnp.asarray(np.stack([np.cos(angle), np.sin(angle)], axis=-1), jnp.float32)
        out.append((q, main_rows, main_idx, extra_rows if case.extra else None, extra_idx, sink, freqs))
    return out


def _op(mode: str):
    def f(q, main_rows, main_idx, extra_rows, extra_idx, sink, freqs):
        with ops.force(mode):
            return ops.sparse_sink_attention(
                q, main_rows, main_idx, extra_rows=extra_rows, extra_idx=extra_idx, sink=sink, scale=D**-0.5,
                inverse_rope=freqs,
            )

    return f


def work(B: int, S: int, H: int, K: int, kv_dtype: str) -> tuple[float, float]:
    """The FLOPs (`4*B*S*H*K*D`) and distinct KV bytes (`B*K*row bytes`) the targets count."""
    return 4.0 * B * S * H * K * D, float(B * K * ROW_BYTES[kv_dtype])


def min_bytes(B: int, S: int, H: int, K: int, kv_dtype: str, rope_dims: int = ROPE_DIM) -> float:
    """Bytes every kernel moves through DRAM at least once for one call: q and the bf16
    output (`B*S*H*D*2` each), each request's K distinct KV rows (the S query rows of a
    request share them), the int32 index lists (`B*S*K*4`) and the f32 (cos, sin) table of
    the inverse RoPE (`B*S*rope_dims*4`). The sink and the lse (not asked for) are ignored."""
    return float(2 * B * S * H * D * 2 + B * K * ROW_BYTES[kv_dtype] + B * S * K * 4 + B * S * rope_dims * 4)


def floor_columns(row: dict, copy: float, gemm: float, rope_dims: int = ROPE_DIM) -> dict:
    """Whether `row`'s target is within this run's ceilings (`copy` TB/s, `gemm` TFLOP/s).

    target_us: the longest time meeting the case's targets: its KV bytes at 80% of copy
    (memory-bound) or its FLOPs at 50% of the GEMM rate (compute-bound), and a fifth of the
    XLA reference's time per call. byte_floor_us / tensor_floor_us: `min_bytes` at the copy
    rate / the FLOPs at the GEMM rate. target_needs_of_copy (of_gemm): the fraction of the
    copy (GEMM) rate that moving those bytes (doing that math) within target_us takes; above
    1 no kernel meets the target on this GPU. Both at most 1 is necessary, not sufficient:
    the floors overlap only as far as a schedule overlaps its loads and its math.
    busy_of_floor: the larger floor over the kernel's GPU busy time (how far the kernel is
    from the ceilings, whatever the target).
    """
    B, S, H, K, kv_dtype = row["B"], row["S"], row["H"], row["K"], row["kv_dtype"]
    flops, kv_bytes = work(B, S, H, K, kv_dtype)
    if row["bound"] == "memory":
        target_us = kv_bytes / (TARGET_MEMORY_FRACTION * copy * 1e12) * 1e6
    else:
        target_us = flops / (TARGET_COMPUTE_FRACTION * gemm * 1e12) * 1e6
    target_us = min(target_us, row["xla_us"] / TARGET_SPEEDUP)
    byte_floor_us = min_bytes(B, S, H, K, kv_dtype, rope_dims) / (copy * 1e12) * 1e6
    tensor_floor_us = flops / (gemm * 1e12) * 1e6
    needs_copy, needs_gemm = byte_floor_us / target_us, tensor_floor_us / target_us
    busy = row.get("kernel_device_us")
    return dict(
        target_us=round(target_us, 2), byte_floor_us=round(byte_floor_us, 2), tensor_floor_us=round(tensor_floor_us, 2),
        target_needs_of_copy=round(needs_copy, 3), target_needs_of_gemm=round(needs_gemm, 3),
        target_within_ceilings=bool(needs_copy <= 1.0 and needs_gemm <= 1.0),
        busy_of_floor=round(max(byte_floor_us, tensor_floor_us) / busy, 3) if busy else None,
    )


def with_floors(result: dict) -> dict:
    """A stored result with every row's `floor_columns` computed from its own recorded
    ceilings and XLA time, for results written before those columns existed. Nothing is
    measured again; `floors_note` says so."""
    rope = result.get("inverse_rope_dims", 0)
    cases = [dict(row, **floor_columns(row, result["copy_TBps"], result["gemm_bf16_TFLOPs"], rope))
             for row in result["cases"]]
    return dict(result, cases=cases, floors_note="The floor columns were computed afterwards by "
                "bench.attention.with_floors from this run's recorded ceilings and XLA times; not measured again")


def _device_columns(kernel_dev, xla_dev, flops, kv_bytes, bound, copy, gemm) -> dict:
    """The row's fields judged on GPU busy time (`timing.device_busy_us`; None where no trace)."""
    if kernel_dev is None or xla_dev is None:
        return dict(xla_device_us=xla_dev and round(xla_dev, 2), kernel_device_us=kernel_dev and round(kernel_dev, 2),
                    device_fraction_of_ceiling=None, device_speedup_vs_xla=None, meets_target_device_time=False)
    achieved = (kv_bytes / copy if bound == "memory" else flops / gemm) / (kernel_dev * 1e-6) / 1e12
    needed = TARGET_MEMORY_FRACTION if bound == "memory" else TARGET_COMPUTE_FRACTION
    return dict(
        xla_device_us=round(xla_dev, 2), kernel_device_us=round(kernel_dev, 2),
        device_fraction_of_ceiling=round(achieved, 3), device_speedup_vs_xla=round(xla_dev / kernel_dev, 1),
        meets_target_device_time=bool(achieved >= needed and xla_dev / kernel_dev >= TARGET_SPEEDUP),
    )


def _case_row(case, kv_dtype, variant, kernel_us, xla_us, flops, kv_bytes, bound, copy, gemm) -> dict:
    """One JSON row: kernel `variant`'s time against the XLA time of the same case (NaN
    kernel time: not measured here, fields left empty)."""
    tbps = kv_bytes / (kernel_us * 1e-6) / 1e12
    tflops = flops / (kernel_us * 1e-6) / 1e12
    achieved = tbps / copy if bound == "memory" else tflops / gemm
    needed = TARGET_MEMORY_FRACTION if bound == "memory" else TARGET_COMPUTE_FRACTION
    row = dict(
        name=case.name, kv_dtype=kv_dtype, kernel=VARIANT_NAMES[variant], B=case.B, S=case.S, H=case.H, K=case.K,
        xla_us=round(xla_us, 2), kernel_us=timing.finite_or_none(round(kernel_us, 2)),
        kernel_TBps=timing.finite_or_none(round(tbps, 3)), kernel_TFLOPs=timing.finite_or_none(round(tflops, 1)),
        bound=bound, fraction_of_ceiling=timing.finite_or_none(round(achieved, 3)),
        speedup_vs_xla=timing.finite_or_none(round(xla_us / kernel_us, 1)),
        default=variant == _kernels.AUTO_ATTENTION_KERNEL[kv_dtype == "fp8"],
    )
    row["meets_target"] = bool(achieved >= needed and xla_us / kernel_us >= TARGET_SPEEDUP)
    return row


def run(json_path: str, commit: str | None = None, kernel_sets: int = 20, xla_sets: int = 4, only: str | None = None,
        kernels: tuple[str, ...] = tuple(_kernels.ATTENTION_KERNELS)) -> dict:
    """Time every case with the XLA reference and each registered kernel in `kernels`
    ("mma": the mma.sync kernel; "wgmma": the wgmma kernel) in one process."""
    copy = timing.copy_bandwidth_TBps()
    gemm = timing.gemm_bf16_TFLOPs()
    ridge = gemm / copy  # FLOP per byte where the two ceilings meet
    registered = _ffi.kernel_report()
    variants = [v for v in kernels if registered.get(_kernels.ATTENTION_KERNELS[v][0]) == _ffi.REGISTERED]

    def kernel_us(variant, sets):
        with _kernels.attention_kernel(variant):
            return timing.call_times(_op("kernel"), sets)
    cases = []
    for case, kv_dtype in [(c, k) for k in KV_DTYPES for c in CASES]:
        if only and only.lower() not in f"{case.name} {kv_dtype}".lower():
            continue
        sets = make_inputs(case, max(kernel_sets, xla_sets), kv_dtype=kv_dtype)
        flops, kv_bytes = work(case.B, case.S, case.H, case.K, kv_dtype)
        xla_us, xla_dev = timing.call_times(_op("reference"), sets[:xla_sets])
        bound = "memory" if flops / kv_bytes < ridge else "compute"
        timed = [(v, *kernel_us(v, sets[:kernel_sets])) for v in variants] or [("mma", float("nan"), None)]
        for variant, us, dev in timed:
            row = _case_row(case, kv_dtype, variant, us, xla_us, flops, kv_bytes, bound, copy, gemm)
            row.update(_device_columns(dev, xla_dev, flops, kv_bytes, bound, copy, gemm))
            row.update(floor_columns(row, copy, gemm))
            cases.append(row)
            print(row, flush=True)
    result = dict(
        gpu=timing.gpu_name(), commit=report.commit_id(commit), date=report.today(),
        copy_TBps=round(copy, 3), gemm_bf16_TFLOPs=round(gemm, 1), launch=timing.launch_mode(),
        inverse_rope_dims=ROPE_DIM,
        targets=dict(
            memory_bound_fraction_of_copy=TARGET_MEMORY_FRACTION,
            compute_bound_fraction_of_gemm=TARGET_COMPUTE_FRACTION,
            min_speedup_vs_xla=TARGET_SPEEDUP,
            ridge_flop_per_byte=round(ridge, 1),
        ),
        cases=cases,
    )
    print(write(result, json_path))
    return result


def write(result: dict, json_path: str, extra_notes: tuple[str, ...] = ()) -> str:
    """`result` (what `run` measured) as JSON at `json_path` and a markdown table beside it,
    with `extra_notes` under the standard ones; returns the markdown."""
    columns = [
        ("case", "name"), ("KV", "kv_dtype"), ("kernel", "kernel"), ("default", "default"), ("B", "B"), ("S", "S"),
        ("H", "H"), ("K", "K"), ("XLA µs", "xla_us"),
        ("kernel µs", "kernel_us"), ("KV TB/s", "kernel_TBps"), ("TFLOP/s", "kernel_TFLOPs"), ("bound", "bound"),
        ("of ceiling", "fraction_of_ceiling"), ("speedup", "speedup_vs_xla"), ("meets target", "meets_target"),
        ("XLA busy µs", "xla_device_us"), ("kernel busy µs", "kernel_device_us"),
        ("busy of ceiling", "device_fraction_of_ceiling"), ("busy speedup", "device_speedup_vs_xla"),
        ("meets target (busy)", "meets_target_device_time"), ("target µs", "target_us"),
        ("byte floor µs", "byte_floor_us"), ("tensor floor µs", "tensor_floor_us"),
        ("target needs of copy", "target_needs_of_copy"), ("target needs of GEMM", "target_needs_of_gemm"),
        ("target within ceilings", "target_within_ceilings"), ("busy of floor", "busy_of_floor"),
    ]
    notes = [
        "XLA = `ops.sparse_sink_attention_reference` (f32 gather + einsum at HIGHEST precision), kernel = the "
        "CUDA kernel through XLA FFI; both timed in the same process by `jax_dspark.bench.timing.per_call_us` "
        "(N calls on N input sets in one executable minus a 1-call executable).",
        "KV TB/s = distinct KV bytes (B x K x row bytes: 1024 for bf16, 584 for fp8 = 448 e4m3 + 128 bf16 RoPE + 8 "
        "scale bytes) / kernel time; TFLOP/s = 4 B S H K 512 / kernel time.",
        f"Targets: memory-bound cases >= {TARGET_MEMORY_FRACTION:.0%} of the copy bandwidth, compute-bound "
        f">= {TARGET_COMPUTE_FRACTION:.0%} of the GEMM rate, every case >= {TARGET_SPEEDUP:g}x the XLA reference; "
        f"a case is memory-bound when its FLOP/byte is under the measured ridge ({result['targets']['ridge_flop_per_byte']:.0f}).",
        "default: the kernel `ops.sparse_sink_attention` calls for this pool kind unless told otherwise "
        "(`JAX_DSPARK_ATTENTION_KERNEL`; `ops._kernels.AUTO_ATTENTION_KERNEL`).",
        timing.launch_note(result.get("launch", "streams")),
        f"Every call with the sink and the inverse RoPE of the last {result.get('inverse_rope_dims', 0)} output dims "
        "(as the V4 models call it; 0: a run from before 2026-12-06, without).",
        "busy = GPU busy time per call from a profiler trace of the same executable (`timing.device_busy_us`: "
        "kernels and copies on the device's streams, launch gaps excluded); the targets judged on it as well.",
        "Floors (`floor_columns`): target µs = the longest time meeting the case's targets (its ceiling "
        "fraction and 5x XLA); byte floor = q, output, distinct KV rows, index lists and RoPE table moved once at "
        "the copy rate; tensor floor = the FLOPs at the GEMM rate; \"needs\" = floor / target µs, above 1 no "
        "kernel meets the target on this GPU; busy of floor = the larger floor / kernel busy µs.",
        *([result["floors_note"] + "."] if result.get("floors_note") else []),
        *extra_notes,
    ]
    return report.write(result, json_path, columns, "Sparse sink attention: XLA reference vs CUDA kernel", notes)
