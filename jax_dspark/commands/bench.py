"""`jax-dspark bench attention|prep|moe`: kernel benchmarks on the GPU (docs/benchmarks/*.json).

Each run measures, in one process, the GPU's copy bandwidth and bf16 GEMM rate, the XLA
reference and the CUDA kernel, and writes `<out>/<what>.json` plus a markdown table.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=("attention", "prep", "moe"), help="which kernel to benchmark")
    parser.add_argument("--out", default="docs/benchmarks", help="directory for <what>.json and <what>.md")
    parser.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse HEAD)")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this text")
    parser.add_argument("--sets", type=int, default=20, help="input sets (calls) per timed executable")


def run(args: argparse.Namespace) -> int:
    import jax

    if jax.default_backend() != "gpu":
        print(f"bench {args.what}: needs a GPU backend (have {jax.default_backend()!r})")
        return 2
    path = os.path.join(args.out, f"{args.what}.json")
    if args.what == "attention":
        from jax_dspark.bench import attention

        attention.run(path, commit=args.commit, kernel_sets=args.sets, only=args.only)
    elif args.what == "prep":
        from jax_dspark.bench import prep

        prep.run(path, commit=args.commit, sets=args.sets, only=args.only)
    else:
        from jax_dspark.bench import moe

        moe.run(args.out, commit=args.commit, only=args.only)
    return 0
