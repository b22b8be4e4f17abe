"""`jax-dspark` command line: `generate | bench | eval | train | selfcheck`.

Each subcommand lives in `jax_dspark/commands/<name>.py` and provides
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when their
command runs, so `jax-dspark --help` stays fast and one broken optional dependency
cannot take down the other commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": "speculative generation with a target and its DSpark drafter",
    "bench": "kernel and model benchmarks on the GPU (writes docs/benchmarks/*.json)",
    "eval": "acceptance length and tokens/s on prompt sets",
    "train": "train a DSpark drafter for a target",
    "selfcheck": "check every op against its pure-JAX reference on random inputs",
}


def _load(name: str):
    return importlib.import_module(f"jax_dspark.commands.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="jax-dspark", description=__doc__.splitlines()[0])
    dist = parser.add_argument_group(
        "multi-process (jax.distributed; defaults from JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES, JAX_PROCESS_ID)"
    )
    dist.add_argument("--coordinator", help="host:port of process 0")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    available = {}
    for name, help_text in COMMANDS.items():
        try:
            module = _load(name)
        except ModuleNotFoundError as err:
            if err.name != f"jax_dspark.commands.{name}":
                raise
            continue
        available[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from jax_dspark.parallel import initialize_distributed

    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return int(available[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
