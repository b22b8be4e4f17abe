"""`jax-dspark bench moe`: routed-expert kernels against the ragged_dot reference on the GPU.

One run measures, on the same card and in the same process: the copy bandwidth (a large
elementwise read + write) and the BF16 GEMM rate (8192^3 through XLA/cuBLAS), both with
`bench.timing` as the attention and prep benches do, and for V4-Flash
(d 4096, I 2048, 256 experts, top-6) and V4-Pro (d 7168, I 3072, 384 experts, top-6) expert
shapes at 64 tokens (decode) and 4096 tokens (prefill chunk): the pure-JAX reference
(`jax.lax.ragged_dot`) and the kernel, with BF16 weights and with FP8 weights (e4m3, one UE8M0
scale per 128x128 block, quantised from the same BF16 weights; activations quantised per 1x128
inside the kernel). Results go to `moe.json` and `moe.md` in `out_dir`.

The FP8 rows' baseline is the ragged_dot reference on the BF16 weights (the BF16 row's
measurement: same tokens, routing and weights before quantisation), since that is what a JAX
user has without these kernels; their error is measured against the BF16 kernel's output.
FP8 "touched weight" bytes count e4m3 values plus the scale bytes.

Useful FLOPs count real rows only (`2 * T * k * 3 * d * I`); "touched weight" bytes count
each expert that at least one token chose once (both matrices). Targets (issue 6): prefill
>= 70% of the measured GEMM rate (BF16), >= 1.2x it (FP8); decode >= 70% of the copy
bandwidth over the touched weights; always >= 5x the ragged_dot reference.

Every case also carries its byte floor, measured in the same run: the time to read the
touched weights once at the copy rate (`byte_floor_ms`), the kernel's share of it
(`kernel_of_byte_floor`), the longest time that meets all of the case's targets
(`target_ms`), the weight-streaming rate that time needs (`target_needs_TBps`), and whether
that rate is within the measured copy rate (`target_within_copy_rate`). A target that needs
more than the copy rate cannot be met by any kernel that reads each touched weight once;
the table says which targets are of that kind instead of leaving it to prose.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark import ops
from jax_dspark.bench import report, timing
from jax_dspark.ops import _moe_kernels

MODELS = {  # name: (hidden d, intermediate I, experts E, top-k)
    "V4-Flash": (4096, 2048, 256, 6),
    "V4-Pro": (7168, 3072, 384, 6),
}
TOKENS = (64, 4096)
TARGETS = {
    "prefill_bf16_fraction_of_gemm": 0.7,
    "prefill_fp8_multiple_of_bf16_gemm": 1.2,
    "decode_fraction_of_copy_bandwidth": 0.7,
    "min_speedup_over_ragged_dot": 5.0,
}
LIMIT = 10.0  # V4's SwiGLU clamp


def _median_ms(fn, *args, min_iters: int = 3, max_iters: int = 20, budget_s: float = 2.0) -> float:
    """Median wall time of `fn(*args)` after a warm-up; synchronises on every call.

    Each call here moves at least tens of MB or runs for over 100 us, so the per-call
    dispatch overhead (~20 us) is small against what is measured.
    """
    jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def _routing(key, tokens: int, experts: int, k: int):
    logits = jax.random.normal(key, (tokens, experts), jnp.float32)
    with ops.force("reference"):
        weights, ids = ops.topk_route(ops.router_scores(logits), k, route_scale=1.5)
    return weights, ids


def _rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def bench_case(model: str, tokens: int, weights_bf16, copy_tbps: float, gemm_tflops: float,
               outputs: dict | None = None) -> dict:
    """BF16 kernel vs ragged_dot; stores the kernel's output in `outputs[(model, tokens)]` if given."""
    d, inter, experts, k = MODELS[model]
    w_gate_up, w_down = weights_bf16
    kx, kr = jax.random.split(jax.random.key(tokens + d))
    x = jax.random.normal(kx, (tokens, d), jnp.bfloat16)
    weights, ids = _routing(kr, tokens, experts, k)
    touched = int(np.unique(np.asarray(ids)).size)
    flops, touched_bytes = work(tokens, d, inter, k, touched, "bf16")

    kernel = jax.jit(functools.partial(_moe_kernels.moe_experts, limit=LIMIT))
    reference = jax.jit(functools.partial(ops.moe_experts_reference, limit=LIMIT))
    case = {"name": f"{model} T={tokens} bf16", "model": model, "tokens": tokens, "dtype": "bf16",
            "hidden": d, "inter": inter, "experts": experts, "top_k": k, "experts_touched": touched}
    out_kernel = kernel(x, ids, weights, w_gate_up, w_down)
    if outputs is not None:
        outputs[(model, tokens)] = out_kernel
    try:
        out_ref = reference(x, ids, weights, w_gate_up, w_down)
        case["rel_err_vs_ragged_dot"] = _rel_err(out_kernel.astype(jnp.float32), out_ref.astype(jnp.float32))
        del out_ref
        case["ragged_dot_ms"] = _median_ms(reference, x, ids, weights, w_gate_up, w_down, max_iters=5, budget_s=5.0)
    except Exception as err:  # noqa: BLE001 - OOM of the padded dense lowering is a result
        case["ragged_dot_ms"] = None
        case["ragged_dot_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    _kernel_rates(case, _median_ms(kernel, x, ids, weights, w_gate_up, w_down), flops, touched_bytes)
    if tokens >= 1024:
        threshold = TARGETS["prefill_bf16_fraction_of_gemm"]
        _prefill_target(case, f">= {threshold:.0%} of GEMM", threshold, gemm_tflops)
    else:
        _decode_target(case, copy_tbps)
    return _judge(case, flops, touched_bytes, copy_tbps, gemm_tflops)


def work(tokens: int, d: int, inter: int, k: int, touched: int, dtype: str) -> tuple[float, float]:
    """Useful FLOPs (real rows only, FC1 + FC2) and bytes of the touched experts' weights
    (both matrices; FP8: e4m3 values plus one UE8M0 byte per 128x128 block)."""
    flops = 2.0 * tokens * k * 3 * d * inter
    per_weight = 2.0 if dtype == "bf16" else 1 + 1 / (128 * 128)
    return flops, touched * 3 * d * inter * per_weight


def with_floors(result: dict) -> dict:
    """A stored result (`moe.json`) with every measured case's floor columns recomputed
    from its own recorded times and ceilings, for results written before those columns
    existed. Nothing is measured again; `floors_note` says so."""
    out = dict(result, cases=[])
    for case in result["cases"]:
        case = dict(case)
        if case.get("kernel_ms") is not None:
            flops, touched_bytes = work(case["tokens"], case["hidden"], case["inter"], case["top_k"],
                                        case["experts_touched"], case["dtype"])
            case.update(byte_floor(case, flops, touched_bytes, result["copy_TBps"], result["gemm_bf16_TFLOPs"]))
        out["cases"].append(case)
    out["floors_note"] = ("The floor columns were computed afterwards by bench.moe.with_floors from this run's recorded "
                          "times and ceilings; not measured again")
    return out


def _kernel_rates(case: dict, kernel_ms: float, flops: float, touched_bytes: float) -> None:
    """The kernel's time, its compute and touched-weight rates, and its speed-up over
    ragged_dot when that ran."""
    case["kernel_ms"] = kernel_ms
    case["kernel_TFLOPs"] = flops / (kernel_ms * 1e-3) / 1e12
    case["touched_weight_TBps"] = touched_bytes / (kernel_ms * 1e-3) / 1e12
    if case["ragged_dot_ms"]:
        case["speedup_vs_ragged_dot"] = case["ragged_dot_ms"] / kernel_ms


def _prefill_target(case: dict, label: str, threshold: float, gemm_tflops: float) -> None:
    """Prefill targets are multiples of the BF16 GEMM rate measured in the same run."""
    case["target"] = f"{label} = {threshold * gemm_tflops:.0f} TFLOP/s"
    case["fraction_of_target_metric"] = case["kernel_TFLOPs"] / gemm_tflops
    case["target_threshold"] = threshold


def _decode_target(case: dict, copy_tbps: float) -> None:
    case["target"] = f">= {TARGETS['decode_fraction_of_copy_bandwidth']:.0%} of copy = " \
                     f"{TARGETS['decode_fraction_of_copy_bandwidth'] * copy_tbps:.2f} TB/s"
    case["fraction_of_target_metric"] = case["touched_weight_TBps"] / copy_tbps
    case["target_threshold"] = TARGETS["decode_fraction_of_copy_bandwidth"]


def _judge(case: dict, flops: float, touched_bytes: float, copy_tbps: float, gemm_tflops: float) -> dict:
    """Whether the case meets its targets, and whether any kernel could at these shapes.

    The byte floor is reading every touched weight once at the copy rate of this run. The
    targets define the longest acceptable time: the metric's (decode: touched bytes at the
    threshold x copy; prefill: useful FLOPs at the threshold x GEMM) and, when ragged_dot
    ran, a fifth of its time. Dividing the touched bytes by that time gives the streaming
    rate the target needs; above the copy rate the target is out of reach for a kernel that
    reads each weight once, whatever its schedule.
    """
    met = case["fraction_of_target_metric"] >= case["target_threshold"]
    speed_ok = case.get("speedup_vs_ragged_dot", float("inf")) >= TARGETS["min_speedup_over_ragged_dot"]
    case["meets_targets"] = bool(met and speed_ok)
    case.update(byte_floor(case, flops, touched_bytes, copy_tbps, gemm_tflops))
    return case


def byte_floor(case: dict, flops: float, touched_bytes: float, copy_tbps: float, gemm_tflops: float) -> dict:
    """The floor columns of one case (see `_judge`); times in ms, rates in TB/s."""
    if case["tokens"] >= 1024:
        metric_ms = flops / (case["target_threshold"] * gemm_tflops * 1e12) * 1e3
    else:
        metric_ms = touched_bytes / (case["target_threshold"] * copy_tbps * 1e12) * 1e3
    target_ms = metric_ms
    if case.get("ragged_dot_ms"):
        target_ms = min(target_ms, case["ragged_dot_ms"] / TARGETS["min_speedup_over_ragged_dot"])
    floor_ms = touched_bytes / (copy_tbps * 1e12) * 1e3
    needs = touched_bytes / (target_ms * 1e-3) / 1e12
    return {
        "touched_weight_bytes": touched_bytes,
        "byte_floor_ms": floor_ms,
        "kernel_of_byte_floor": floor_ms / case["kernel_ms"],
        "target_ms": target_ms,
        "target_needs_TBps": needs,
        "target_within_copy_rate": bool(needs <= copy_tbps),
    }


def quantize_experts_on_device(w_gate_up, w_down, chunk: int = 16):
    """BF16 experts -> FP8 `Fp8Weight`s (`moe_fp8.quantize_expert_weights`), `chunk` experts per call.

    Why chunks from Python: inside one jitted `lax.map` XLA hoists the per-expert transpose
    out of the loop, and for V4-Pro that whole-tensor transpose (31.5 GiB) cannot be
    allocated next to the 51 GB of BF16 experts. A chunk's temporaries are a few GB.
    """
    from jax_dspark.ops import moe_fp8

    one = jax.jit(moe_fp8.quantize_expert_weights)
    parts = [one(w_gate_up[i:i + chunk], w_down[i:i + chunk]) for i in range(0, w_gate_up.shape[0], chunk)]
    return tuple(moe_fp8.Fp8Weight(*(jnp.concatenate(fields) for fields in zip(*(p[m] for p in parts))))
                 for m in range(2))


def bench_case_fp8(model: str, tokens: int, weights_fp8, bf16_case: dict, bf16_out, copy_tbps: float,
                   gemm_tflops: float) -> dict:
    """FP8 kernel on weights quantised from the BF16 case's; baseline = that case's ragged_dot."""
    d, inter, experts, k = MODELS[model]
    q_gu, q_d = weights_fp8
    kx, kr = jax.random.split(jax.random.key(tokens + d))  # same inputs as bench_case
    x = jax.random.normal(kx, (tokens, d), jnp.bfloat16)
    weights, ids = _routing(kr, tokens, experts, k)
    touched = int(np.unique(np.asarray(ids)).size)
    flops, touched_bytes = work(tokens, d, inter, k, touched, "fp8")
    kernel = jax.jit(functools.partial(_moe_kernels.moe_experts_fp8, limit=LIMIT))
    case = {"name": f"{model} T={tokens} fp8", "model": model, "tokens": tokens, "dtype": "fp8",
            "hidden": d, "inter": inter, "experts": experts, "top_k": k, "experts_touched": touched,
            "ragged_dot_ms": bf16_case.get("ragged_dot_ms"),
            "ragged_dot_note": "BF16 reference on the BF16 weights (the bf16 row's measurement)"}
    if bf16_case.get("ragged_dot_error"):
        case["ragged_dot_error"] = bf16_case["ragged_dot_error"]
    out = kernel(x, ids, weights, q_gu, q_d)
    case["rel_err_vs_bf16_kernel"] = _rel_err(out.astype(jnp.float32), bf16_out.astype(jnp.float32))
    del out
    _kernel_rates(case, _median_ms(kernel, x, ids, weights, q_gu, q_d), flops, touched_bytes)
    case["speedup_vs_bf16_kernel"] = bf16_case["kernel_ms"] / case["kernel_ms"]
    if tokens >= 1024:
        threshold = TARGETS["prefill_fp8_multiple_of_bf16_gemm"]
        _prefill_target(case, f">= {threshold:.1f}x BF16 GEMM", threshold, gemm_tflops)
    else:
        _decode_target(case, copy_tbps)
    return _judge(case, flops, touched_bytes, copy_tbps, gemm_tflops)


def _fp8_unavailable(model: str, tokens: int, reason: str) -> dict:
    d, inter, experts, k = MODELS[model]
    return {"name": f"{model} T={tokens} fp8", "model": model, "tokens": tokens, "dtype": "fp8",
            "hidden": d, "inter": inter, "experts": experts, "top_k": k,
            "ragged_dot_ms": None, "kernel_ms": None, "kernel_TFLOPs": None, "touched_weight_TBps": None,
            "status": f"FP8 not measured: {reason}"}


def to_markdown(result: dict) -> str:
    lines = [
        "# MoE kernel benchmark",
        "",
        f"GPU: {result['gpu']}; commit {result['commit']}; {result['date']}. Measured in the same run: "
        f"copy {result['copy_TBps']:.2f} TB/s (read + write), BF16 GEMM {result['gemm_bf16_TFLOPs']:.0f} TFLOP/s (8192^3).",
        "Made by `jax-dspark bench moe` (jax_dspark/bench/moe.py); top-6 routing from random logits, SwiGLU clamp 10.",
        "Which targets are reachable at these shapes, and why: docs/moe_kernels.md.",
        "FP8 rows: e4m3 weights with UE8M0 128x128 block scales (quantised from the BF16 weights), activations "
        "quantised per 1x128 in the kernel; their ragged_dot baseline is the BF16 reference on the BF16 weights "
        "(the bf16 row's measurement), their error is against the BF16 kernel's output.",
        "",
        "Byte floor: the touched weights read once at this run's copy rate. \"target needs\": the weight-streaming "
        "rate the case's targets (metric and 5x ragged_dot) ask for; a target that needs more than the copy rate "
        "cannot be met by a kernel that reads each weight once.",
        *([result["floors_note"] + "."] if result.get("floors_note") else []),
        "",
        "| case | experts touched | ragged_dot ms | kernel ms | speedup | kernel TFLOP/s | touched TB/s | target | target met "
        "| >= 5x ragged_dot | byte floor ms | kernel of floor | target needs TB/s | within copy rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"

    def speed(c):
        if c.get("speedup_vs_ragged_dot") is None:
            return "reference failed"
        return "yes" if c["speedup_vs_ragged_dot"] >= TARGETS["min_speedup_over_ragged_dot"] else "no"
    for c in result["cases"]:
        if c.get("kernel_ms") is None:
            lines.append(f"| {c['name']} | | | | | | | | {c.get('status', 'not run')} | | | | | |")
            continue
        err = c.get("ragged_dot_error", "")
        rd = f(c.get("ragged_dot_ms")) if c.get("ragged_dot_ms") else (
            "out of memory" if "RESOURCE_EXHAUSTED" in err else "failed: " + err[:60])
        lines.append(
            f"| {c['name']} | {c['experts_touched']} | {rd} | {f(c['kernel_ms'], 3)} | {f(c.get('speedup_vs_ragged_dot'), 1)}x "
            f"| {f(c['kernel_TFLOPs'], 0)} | {f(c['touched_weight_TBps'])} | {c['target']} "
            f"| {'yes' if c['fraction_of_target_metric'] >= c.get('target_threshold', 0.7) else 'no'} "
            f"({c['fraction_of_target_metric']:.0%}) "
            f"| {speed(c)} | {f(c.get('byte_floor_ms'), 3)} | {f(c.get('kernel_of_byte_floor'))} "
            f"| {f(c.get('target_needs_TBps'))} | {'-' if 'target_within_copy_rate' not in c else 'yes' if c['target_within_copy_rate'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def run(
    out_dir: str = "docs/benchmarks",
    *,
    commit: str | None = None,
    only: str | None = None,
    models: tuple[str, ...] = tuple(MODELS),
    tokens: tuple[int, ...] = TOKENS,
    stem: str = "moe",
) -> dict:
    """Runs every case in one process and writes `<stem>.json` / `<stem>.md` to `out_dir`.

    `only` keeps the models whose name contains it (e.g. "Flash"); `commit` is recorded as is
    (default: $JAX_DSPARK_COMMIT, else `git rev-parse --short HEAD`).
    """
    if only:
        models = tuple(m for m in models if only in m)
    if not _moe_kernels_available():
        raise RuntimeError(f"moe_experts kernel not available: {ops_kernel_reason()}")
    gpu = jax.devices()[0].device_kind
    fp8_reason = None if _moe_kernels.experts_fp8_available() else _moe_kernels.experts_fp8_status()
    # The ceilings of the attention and prep benches (back-to-back calls, so no per-call
    # dispatch gap in the time); GEMM first: it also brings the clocks up.
    gemm_tflops = timing.gemm_bf16_TFLOPs()
    copy_tbps = timing.copy_bandwidth_TBps()
    print(f"copy {copy_tbps:.2f} TB/s, gemm {gemm_tflops:.0f} TFLOP/s", flush=True)
    cases = []
    for model in models:
        d, inter, experts, _ = MODELS[model]
        k1, k2 = jax.random.split(jax.random.key(len(model)))
        # jitted so the scaling fuses into the generation (V4-Pro's experts are 51 GB in bf16)
        init = jax.jit(lambda key, shape, scale: jax.random.normal(key, shape, jnp.bfloat16) * jnp.bfloat16(scale),
                       static_argnums=(1, 2))
        w_gate_up = init(k1, (experts, d, 2 * inter), d**-0.5)
        w_down = init(k2, (experts, inter, d), inter**-0.5)
        bf16_cases, bf16_outputs = {}, {}
        for t in tokens:
            case = bench_case(model, t, (w_gate_up, w_down), copy_tbps, gemm_tflops, outputs=bf16_outputs)
            print(json.dumps(case), flush=True)
            cases.append(case)
            bf16_cases[t] = case
        if fp8_reason is not None:
            del w_gate_up, w_down
            cases.extend(_fp8_unavailable(model, t, fp8_reason) for t in tokens)
            continue
        try:
            q = quantize_experts_on_device(w_gate_up, w_down)
        except Exception as err:  # noqa: BLE001 - recorded in the JSON; the other models still run
            q = None
            reason = f"quantising the experts failed: {type(err).__name__}: {str(err)[:300]}"
        del w_gate_up, w_down  # V4-Pro: 51 GB of bf16 next to 25 GB of e4m3
        for t in tokens:
            if q is None:
                case = _fp8_unavailable(model, t, reason)
            else:
                try:
                    case = bench_case_fp8(model, t, q, bf16_cases[t], bf16_outputs[(model, t)], copy_tbps,
                                          gemm_tflops)
                except Exception as err:  # noqa: BLE001
                    case = _fp8_unavailable(model, t, f"{type(err).__name__}: {str(err)[:300]}")
            print(json.dumps(case), flush=True)
            cases.append(case)
        del q, bf16_outputs
    result = {
        "gpu": gpu,
        "commit": report.commit_id(commit),
        "date": report.today(),
        "jax": jax.__version__,
        "copy_TBps": copy_tbps,
        "gemm_bf16_TFLOPs": gemm_tflops,
        "targets": TARGETS,
        "cases": cases,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as fh:
        fh.write(to_markdown(result))
    return result


def _moe_kernels_available() -> bool:
    from jax_dspark import _ffi

    return _ffi.kernel_report().get("moe_experts") == _ffi.REGISTERED and _ffi.use_kernel("moe_experts")


def ops_kernel_reason() -> str:
    from jax_dspark import _ffi

    return _ffi.kernel_report().get("moe_experts", "unknown")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="docs/benchmarks", help="where moe.json and moe.md go (moe_<gpu>.* on a GPU other than the H200)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    run(args.out_dir, models=tuple(m for m in args.models.split(",") if m),
        tokens=tuple(int(t) for t in args.tokens.split(",") if t),
        stem="moe" + report.gpu_suffix(jax.devices()[0].device_kind))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
