"""tools/ncu_source_lines.py: joining ncu's SASS samples with nvdisasm's inlined source lines."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "ncu_source_lines.py"
_spec = importlib.util.spec_from_file_location("ncu_source_lines", _PATH)
ncu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ncu  # dataclasses look their module up there
_spec.loader.exec_module(ncu)

# Two functions; the second (the kernel) has a producer call inlined at line 5 and a consumer
# helper inlined at line 8; its third instruction has no frame line and keeps the second's.
DISASSEMBLY = """\
.text._Z5otherv:
	//## File "/x/k.cu", line 1
        /*0000*/                   NOP ;
//--------------------- .text._Z6kernelv --------------------------
.text._Z6kernelv:
	//## File "/x/k.cu", line 2 inlined at "/x/k.cu", line 5
	//## File "/x/k.cu", line 5
        /*0000*/                   LDG.E R0, [R2.64] ;
	//## File "/x/h.cuh", line 3 inlined at "/x/k.cu", line 8
	//## File "/x/k.cu", line 8
        /*0010*/                   HGMMA.64x32x16.F32.BF16 R4, gdesc[UR4], R4 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
//--------------------- .text._Z5afterv --------------------------
"""
SOURCES = {
    "k.cu": [
        "__device__ int load_row(int i) {",
        "  return i;",
        "}",
        "__global__ void __launch_bounds__(128, 1)",
        "    kernel(int x) {",
        "  if (x) load_row(x);",
        "  mma_step();",
        "  wait();",
    ],
    "h.cuh": ["__device__ void mma_step() {", "", "  asm volatile(\"...\");", "}"],
}


def _csv(tmp_path, samples):
    header = ["Address", "Source", ncu.SAMPLES, "stall_long_sb", "stall_barrier", "stall_barrier (Not Issued)"]
    rows = [",".join(f'"{c}"' for c in header)]
    for i, (total, long_sb, barrier) in enumerate(samples):
        rows.append(f'"0x{16 * i:x}","X","{total}","{long_sb}","{barrier}","0"')
    path = tmp_path / "sass.csv"
    path.write_text('"Kernel Name"\n' + "\n".join(rows) + "\n")
    return path


def test_instructions_of_the_named_function_carry_their_inlined_frames():
    insts = ncu.read_disassembly(DISASSEMBLY, "6kernel")
    assert [i.offset for i in insts] == [0x0, 0x10, 0x20]
    assert insts[0].frames == (ncu.Frame("/x/k.cu", 2, "/x/k.cu", 5), ncu.Frame("/x/k.cu", 5))
    assert insts[2].frames == insts[1].frames  # no frame lines of its own


def test_a_missing_function_is_named_in_the_error():
    with pytest.raises(ValueError, match="nokernel"):
        ncu.read_disassembly(DISASSEMBLY, "nokernel")


def test_kernel_names_after_launch_bounds_are_found():
    starts = ncu.function_starts(SOURCES["k.cu"])
    assert starts == [(1, "load_row"), (4, "kernel")]
    assert ncu.enclosing_function(starts, 2) == "load_row"
    assert ncu.enclosing_function(starts, 8) == "kernel"


def test_samples_go_to_lines_chains_and_roles(tmp_path):
    stalls, samples = ncu.read_samples(_csv(tmp_path, [(10, 9, 0), (5, 0, 1), (25, 0, 24)]))
    assert stalls == ["stall_long_sb", "stall_barrier"]
    insts = ncu.read_disassembly(DISASSEMBLY, "6kernel")
    out = ncu.summarise(insts, samples, stalls, SOURCES, producer=("k.cu", 5, 6))
    assert out.line == {"k.cu:2": 10, "h.cuh:3": 30}
    assert out.reasons["h.cuh:3"]["barrier"] == 25 and out.reasons["k.cu:2"]["long_sb"] == 9
    assert set(out.reasons) == {"k.cu:2", "h.cuh:3"}
    assert out.chain == {"k.cu:load_row < k.cu:kernel": 10, "h.cuh:mma_step < k.cu:kernel": 30}
    assert out.role == {"producer": 10, "other": 30}


def test_without_a_producer_range_no_role_is_counted(tmp_path):
    stalls, samples = ncu.read_samples(_csv(tmp_path, [(10, 9, 0), (5, 0, 1), (25, 0, 24)]))
    out = ncu.summarise(ncu.read_disassembly(DISASSEMBLY, "6kernel"), samples, stalls, SOURCES)
    assert not out.role and sum(out.line.values()) == 40


def test_a_page_of_another_binary_is_refused(tmp_path):
    stalls, samples = ncu.read_samples(_csv(tmp_path, [(1, 0, 0)] * 2))
    with pytest.raises(ValueError, match="3 instructions in the disassembly, 2 in the ncu page"):
        ncu.summarise(ncu.read_disassembly(DISASSEMBLY, "6kernel"), samples, stalls, SOURCES)
