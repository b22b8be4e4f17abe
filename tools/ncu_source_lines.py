"""Where a kernel's warp samples sit in the source, from an ncu report and the binary it ran.

ncu's source page needs the .cu files on the GPU machine (our paths there differ, so its CUDA
view comes back empty), but its SASS view always comes back. `nvdisasm -gi` of the same binary
gives each instruction's source line with the chain of inlined calls, in the same order, so the
two can be joined here: samples and stall reasons per innermost source line, per chain of
enclosing functions, and per role (producer warps or the rest) where a kernel names the line
range of its producer branch.

    ncu ... -o rep ...; ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    cuobjdump -xelf all kernel_driver; nvdisasm -gi -c sparse_sink_attention_wgmma.sm_90a.cubin > gi.sass
    python tools/ncu_source_lines.py sass.csv gi.sass ws_kernelILb0ELb0E [--producer 1220-1274]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
_FRAME = re.compile(r'\s*//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_INST = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_DEF = re.compile(r"^(?:template <[^>]*>\s*)?(?:__global__|__device__|static|constexpr|inline|auto|void|float|int|bool)\b")
_CALLED = re.compile(r"\b(\w+)\s*\(")
_NOT_NAMES = {"__launch_bounds__", "__align__", "if", "for", "while", "return", "sizeof"}


@dataclass(frozen=True)
class Frame:
    """One source position of an instruction: `file`:`line`, inlined at `at_file`:`at_line`
    (empty / 0 for the outermost)."""

    file: str
    line: int
    at_file: str = ""
    at_line: int = 0


@dataclass(frozen=True)
class Instruction:
    offset: int
    text: str
    frames: tuple[Frame, ...]  # innermost first


def read_disassembly(text: str, function: str) -> list[Instruction]:
    """The instructions of the first function whose section name contains `function`, each
    with the frames nvdisasm printed before it (an instruction with none keeps the last ones)."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(".text.") and function in line), None)
    if start is None:
        raise ValueError(f"no function containing {function!r} in the disassembly")
    out: list[Instruction] = []
    pending: list[Frame] = []
    current: tuple[Frame, ...] = ()
    for line in lines[start + 1 :]:
        if line.startswith("//----") or line.startswith(".text."):
            break
        m = _FRAME.match(line)
        if m:
            f, ln, at_f, at_ln = m.groups()
            pending.append(Frame(f, int(ln), at_f or "", int(at_ln or 0)))
            continue
        m = _INST.match(line)
        if m:
            if pending:
                current, pending = tuple(pending), []
            out.append(Instruction(int(m.group(1), 16), m.group(2), current))
    return out


def read_samples(path: Path) -> tuple[list[str], list[dict[str, float]]]:
    """ncu's SASS source page (csv): the stall-reason column names and, per instruction in
    order, its sample counts by column."""
    rows = list(csv.reader(path.open()))
    header_at = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    header = rows[header_at]
    if SAMPLES not in header:
        raise ValueError(f"{path}: no {SAMPLES!r} column (profile with --set full)")
    stalls = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    wanted = [SAMPLES, *stalls]

    def number(text: str) -> float:
        text = text.replace(",", "").strip()
        return float(text) if text not in ("", "-") else 0.0

    data = [{c: number(r[header.index(c)]) for c in wanted} for r in rows[header_at + 1 :] if len(r) == len(header)]
    return stalls, data


def function_starts(source: list[str]) -> list[tuple[int, str]]:
    """(line, name) of each function definition in `source` (1-based lines): a line starting
    like a definition, not ending in ';', whose first called name (or the next line's, after
    `__launch_bounds__(...)`) is the function's."""
    out = []
    for i, text in enumerate(source, 1):
        if not _DEF.match(text) or text.strip().endswith(";") or "=" in text.split("(")[0]:
            continue
        for candidate in (text, source[i] if i < len(source) else ""):
            names = [n for n in _CALLED.findall(candidate) if n not in _NOT_NAMES]
            if names:
                out.append((i, names[0]))
                break
    return out


def enclosing_function(starts: list[tuple[int, str]], line: int) -> str:
    """Name of the last function starting at or before `line` (`starts` from function_starts)."""
    name = "?"
    for at, n in starts:
        if at > line:
            break
        name = n
    return name


@dataclass(frozen=True)
class Summary:
    """Sample totals by innermost line (`file:line`), by chain of enclosing functions
    (innermost first), by role ("producer" / "other", empty without a producer range), and
    each innermost line's samples by stall reason (`stall_` prefix dropped)."""

    line: collections.Counter
    chain: collections.Counter
    role: collections.Counter
    reasons: dict[str, collections.Counter]


def summarise(
    insts: list[Instruction],
    samples: list[dict[str, float]],
    stalls: list[str],
    sources: dict[str, list[str]],
    producer: tuple[str, int, int] | None = None,
) -> Summary:
    """Join the disassembly's instructions with ncu's samples, one to one and in order.
    `sources`: file basename -> its lines (for function names); `producer`: (file basename,
    first line, last line) of the kernel's producer branch."""
    if len(insts) != len(samples):
        raise ValueError(f"{len(insts)} instructions in the disassembly, {len(samples)} in the ncu page")
    by_line: collections.Counter = collections.Counter()
    by_chain: collections.Counter = collections.Counter()
    by_role: collections.Counter = collections.Counter()
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    starts = {base: function_starts(text) for base, text in sources.items()}
    for inst, s in zip(insts, samples):
        n = s[SAMPLES]
        if not inst.frames:
            by_line["?"] += n
            continue
        inner = inst.frames[0]
        key = f"{Path(inner.file).name}:{inner.line}"
        by_line[key] += n
        for st in stalls:
            reasons[key][st.removeprefix("stall_")] += s[st]
        names = []
        for f in inst.frames:
            base = Path(f.file).name
            names.append(f"{base}:{enclosing_function(starts.get(base, []), f.line)}")
        by_chain[" < ".join(dict.fromkeys(names))] += n
        if producer:
            pfile, lo, hi = producer
            positions = [(Path(f.file).name, f.line) for f in inst.frames]
            positions += [(Path(f.at_file).name, f.at_line) for f in inst.frames if f.at_file]
            inside = any(b == pfile and lo <= ln <= hi for b, ln in positions)
            by_role["producer" if inside else "other"] += n
    return Summary(by_line, by_chain, by_role, dict(reasons))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass_csv", type=Path)
    ap.add_argument("disassembly", type=Path, help="nvdisasm -gi output of the binary ncu profiled")
    ap.add_argument("function", help="a substring of the kernel's mangled name")
    ap.add_argument("--source-root", type=Path, default=Path(__file__).resolve().parents[1] / "csrc")
    ap.add_argument("--producer", help="FIRST-LAST: the producer branch's lines in the kernel's file")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    insts = read_disassembly(args.disassembly.read_text(), args.function)
    stalls, samples = read_samples(args.sass_csv)
    sources = {p.name: p.read_text().split("\n") for p in args.source_root.rglob("*") if p.suffix in (".cu", ".cuh", ".h")}
    producer = None
    if args.producer:
        lo, hi = (int(x) for x in args.producer.split("-"))
        # the kernel's own file: the outermost frame (an innermost one may be an inlined header)
        kernel_file = Path(insts[0].frames[-1].file).name if insts and insts[0].frames else ""
        producer = (kernel_file, lo, hi)
    out = summarise(insts, samples, stalls, sources, producer)
    total = sum(s[SAMPLES] for s in samples) or 1.0
    print(f"{len(insts)} instructions, {total:.0f} samples")
    print("\n-- by innermost source line (top stall reasons, % of all samples)")
    for key, n in out.line.most_common(args.top):
        top = ", ".join(f"{r} {100 * c / total:.1f}" for r, c in out.reasons.get(key, collections.Counter()).most_common(3))
        print(f"{100 * n / total:5.1f}%  {key:40s} {top}")
    print("\n-- by chain of enclosing functions (innermost first)")
    for key, n in out.chain.most_common(args.top):
        print(f"{100 * n / total:5.1f}%  {key[:160]}")
    for role, n in out.role.most_common():
        print(f"{role}: {100 * n / total:.1f}% of samples")


if __name__ == "__main__":
    main()
