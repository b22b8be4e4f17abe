"""`jax-dspark bench attention|prep|moe|round`: benchmarks written to docs/benchmarks/*.json.

Kernel benches (attention, prep, moe; GPU only) measure, in one process, the GPU's copy
bandwidth and bf16 GEMM rate, the XLA reference and the CUDA kernel. `round` times one
speculative decode round and its parts (`bench.round`; any backend). Each writes
`<out>/<what>.json` plus a markdown table; on a GPU other than the H200 the project's figures
come from, `<out>/<what>_<gpu>.json` (`report.gpu_suffix`: `attention_h100.json`), so such a
run never overwrites them.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=("attention", "prep", "moe", "round"), help="what to benchmark")
    parser.add_argument("--out", default="docs/benchmarks",
                        help="directory for <what>.json and <what>.md (<what>_<gpu>.* on a GPU other than the H200)")
    parser.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse HEAD)")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this text")
    parser.add_argument("--sets", type=int, default=20, help="input sets (calls) per timed executable")
    parser.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2", help="round: the target")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="round: batch sizes")
    parser.add_argument("--repeats", type=int, default=30, help="round: timed rounds per case")
    parser.add_argument("--command-buffers", action="store_true",
                        help="attention, prep: time with XLA command buffers (CUDA graphs) for fusions and custom "
                             "calls, reference and kernel alike; writes <what>_command_buffers.json")


def run(args: argparse.Namespace) -> int:
    import jax

    from jax_dspark.bench import timing

    suffix = ""
    if args.command_buffers:
        if args.what not in ("attention", "prep"):
            print(f"bench {args.what}: --command-buffers is for attention and prep only")
            return 2
        timing.enable_command_buffers()  # before the backend exists (jax.default_backend below)
        suffix = "_command_buffers"

    if args.what == "round":
        from jax_dspark.bench import round as bench_round

        bench_round.run(os.path.join(args.out, "round.json"), commit=args.commit, target=args.target,
                        batch_sizes=args.batch, repeats=args.repeats)
        return 0
    if jax.default_backend() != "gpu":
        print(f"bench {args.what}: needs a GPU backend (have {jax.default_backend()!r})")
        return 2
    from jax_dspark.bench import report

    gpu = report.gpu_suffix(jax.devices()[0].device_kind)
    path = os.path.join(args.out, f"{args.what}{gpu}{suffix}.json")
    if args.what == "attention":
        from jax_dspark.bench import attention

        attention.run(path, commit=args.commit, kernel_sets=args.sets, only=args.only)
    elif args.what == "prep":
        from jax_dspark.bench import prep

        prep.run(path, commit=args.commit, sets=args.sets, only=args.only)
    else:
        from jax_dspark.bench import moe

        moe.run(args.out, commit=args.commit, only=args.only, stem=f"moe{gpu}")
    return 0
