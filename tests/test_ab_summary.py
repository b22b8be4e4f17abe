"""tools/ab_summary.py: an A/B step's kernel_driver bench lines from checks.log, one table."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "ab_summary.py"
_spec = importlib.util.spec_from_file_location("ab_summary", _PATH)
ab = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ab
_spec.loader.exec_module(ab)

# Two builds alternating twice, with the noise a real log has: sanitizer output, an
# edge-case line, a truncated JSON line and a command that printed no bench line.
LOG = """\
NVIDIA H200, 1980 MHz
== .dev/build_both/kernel_driver --wgmma (limit 60 s)
attention DSpark block rel_err=1.1e-03 ok
== compute-sanitizer --tool memcheck --error-exitcode 9 .dev/build_both/kernel_driver --wgmma (limit 200 s)
========= ERROR SUMMARY: 0 errors
== .dev/build/kernel_driver --wgmma --rope bench DSpark (limit 60 s)
attention kernel: wgmma
{"name": "DSpark block rope", "B": 64, "kernel_event_us": 40.00}
{"name": "V4-Pro DSpark block rope", "B": 128, "kernel_event_us": 116.00}
== .dev/build_sp/kernel_driver --wgmma --rope bench DSpark (limit 60 s)
{"name": "DSpark block rope", "B": 64, "kernel_event_us": 36.00}
{"name": "V4-Pro DSpark block rope", "B": 128, "kern
== .dev/build/kernel_driver --wgmma --rope bench DSpark (limit 60 s)
{"name": "DSpark block rope", "B": 64, "kernel_event_us": 42.00}
{"name": "V4-Pro DSpark block rope", "B": 128, "kernel_event_us": 118.00}
== .dev/build_sp/kernel_driver --wgmma --rope bench DSpark (limit 60 s)
{"name": "DSpark block rope", "B": 64, "kernel_event_us": 38.00}
{"name": "V4-Pro DSpark block rope", "B": 128, "kernel_event_us": 110.00}
"""


def test_runs_of_one_command_line_are_gathered_per_case_in_log_order():
    times = ab.bench_times(LOG)
    assert list(times) == [".dev/build/kernel_driver --wgmma --rope bench DSpark",
                           ".dev/build_sp/kernel_driver --wgmma --rope bench DSpark"]
    assert times[".dev/build/kernel_driver --wgmma --rope bench DSpark"] == {
        "DSpark block rope": [40.0, 42.0], "V4-Pro DSpark block rope": [116.0, 118.0]}
    # the truncated line is skipped, not fatal
    assert times[".dev/build_sp/kernel_driver --wgmma --rope bench DSpark"]["V4-Pro DSpark block rope"] == [110.0]


def test_table_gives_medians_against_the_first_command():
    text = ab.table(ab.bench_times(LOG))
    assert "| DSpark block rope | `.dev/build/kernel_driver --wgmma --rope bench DSpark` | 40.00, 42.00 | 41.00 | 1.000 |" in text
    assert "| DSpark block rope | `.dev/build_sp/kernel_driver --wgmma --rope bench DSpark` | 36.00, 38.00 | 37.00 | 0.902 |" in text
    assert "| 110.00 | 0.940 |" in text  # 110 / median(116, 118)


def test_only_keeps_matching_cases():
    text = ab.table(ab.bench_times(LOG), only="V4-Pro")
    assert "V4-Pro DSpark block rope" in text and "| DSpark block rope" not in text


def test_a_log_without_bench_lines_is_an_error(tmp_path, capsys):
    log = tmp_path / "checks.log"
    log.write_text("== .dev/build/kernel_driver --wgmma (limit 60 s)\nattention x ok\n")
    with pytest.raises(SystemExit, match="no kernel_driver bench lines"):
        ab.main([str(log)])
