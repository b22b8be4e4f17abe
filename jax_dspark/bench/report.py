"""Benchmark results as JSON (machine-readable, the issue's field names) and a markdown table."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess

# The GPU whose runs are the project's figures (docs/benchmarks/<what>.json, as the kernel
# issue asks); a run on any other GPU goes to <what>_<gpu>.json beside them.
REFERENCE_GPU = "h200"


def commit_id(explicit: str | None = None) -> str:
    """`explicit`, else $JAX_DSPARK_COMMIT, else `git rev-parse HEAD` (+ "-dirty"), else "unknown"."""
    if explicit:
        return explicit
    if os.environ.get("JAX_DSPARK_COMMIT"):
        return os.environ["JAX_DSPARK_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
        return head + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_suffix(device_kind: str) -> str:
    """"" for the reference GPU, else "_" + the first token of `device_kind` with a digit in it
    ("NVIDIA H100 80GB HBM3" -> "_h100"; no such token: every token, joined by "_"), so a bench
    run on another GPU never overwrites the reference figures."""
    tokens = [t for t in re.findall(r"[a-z0-9]+", device_kind.lower()) if t != "nvidia"]
    name = next((t for t in tokens if any(ch.isdigit() for ch in t)), "_".join(tokens) or "unknown")
    return "" if name == REFERENCE_GPU else "_" + name


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def write(result: dict, json_path: str, columns: list[tuple[str, str]], title: str, notes: list[str]) -> str:
    """Writes `json_path` and the `.md` beside it; returns the markdown."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    lines = [f"# {title}", ""]
    gemm = result.get("gemm_bf16_TFLOPs")
    lines.append(
        f"GPU: {result['gpu']} · commit `{result['commit']}` · {result['date']} · measured copy bandwidth "
        f"{result['copy_TBps']:.3g} TB/s (read + write) · bf16 GEMM "
        + ("not measured" if gemm is None else f"{gemm:.0f} TFLOP/s")
    )
    lines += ["", "| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for case in result["cases"]:
        cells = []
        for _, key in columns:
            v = case.get(key)
            cells.append("-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {n}" for n in notes] + [""]
    md = "\n".join(lines)
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(md)
    return md
