"""The CUDA-event times of an A/B step, one table, from `tools/h200_checks.sh`'s checks.log.

The A/B steps (`ab`, `epilogue`, `ws-persistent`, ...) run the same `kernel_driver ... bench`
command lines several times, alternating builds, and each run prints one JSON line a case. Read
by eye, the log interleaves them with sanitizer output and edge-case lines; this puts each
case's times under each command line (runs in log order, then their median) and the ratio of
each command's median to the first command's, which is the baseline by the steps' convention
(`$DRIVER` or `$OLD_DRIVER` comes first).

    python tools/ab_summary.py checks.log [--only DSpark]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

_COMMAND = re.compile(r"^== (.*?) \(limit \d+ s\)\s*$")


def bench_times(log: str) -> dict[str, dict[str, list[float]]]:
    """{command line: {case name: [kernel_event_us of each run]}}, both in log order. Only
    commands that printed bench lines appear; a line that is not JSON or has no
    `kernel_event_us` is skipped (sanitizer and edge-case output)."""
    out: dict[str, dict[str, list[float]]] = {}
    command = None
    for line in log.splitlines():
        m = _COMMAND.match(line)
        if m:
            command = m.group(1)
            continue
        if command is None or not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "kernel_event_us" not in row or "name" not in row:
            continue
        out.setdefault(command, {}).setdefault(row["name"], []).append(float(row["kernel_event_us"]))
    return out


def table(times: dict[str, dict[str, list[float]]], only: str | None = None) -> str:
    """Markdown: a row per (case, command), runs, median and median / the first command's
    median of that case."""
    cases: list[str] = []
    for per_case in times.values():
        cases += [c for c in per_case if c not in cases and (only is None or only in c)]
    lines = ["| case | command | runs (µs) | median | of first |", "|---|---|---|---|---|"]
    for case in cases:
        base = None
        for command, per_case in times.items():
            runs = per_case.get(case)
            if not runs:
                continue
            med = statistics.median(runs)
            base = med if base is None else base
            shown = ", ".join(f"{t:.2f}" for t in runs)
            lines.append(f"| {case} | `{command}` | {shown} | {med:.2f} | {med / base:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="checks.log of tools/h200_checks.sh")
    parser.add_argument("--only", help="cases whose name contains this")
    args = parser.parse_args(argv)
    times = bench_times(args.log.read_text(errors="replace"))
    if not times:
        raise SystemExit(f"{args.log}: no kernel_driver bench lines")
    print(table(times, args.only))


if __name__ == "__main__":
    main()
