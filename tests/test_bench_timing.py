"""Launch modes of the kernel benchmarks: command buffers must be chosen before JAX starts."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jax_dspark import cli
from jax_dspark.bench import timing


def _python(code: str, xla_flags: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_command_buffers_join_existing_xla_flags_before_the_backend_starts():
    code = (
        "import os\n"
        "from jax_dspark.bench import timing\n"
        "assert timing.launch_mode() == 'streams'\n"
        "timing.enable_command_buffers(); timing.enable_command_buffers()\n"
        "print(os.environ['XLA_FLAGS']); print(timing.launch_mode())\n"
        "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))\n"
    )
    out = _python(code, xla_flags="--xla_force_host_platform_device_count=2")
    assert out.returncode == 0, out.stderr[-2000:]
    flags, mode, total = out.stdout.split("\n")[:3]
    assert flags.split() == ["--xla_force_host_platform_device_count=2", *timing.COMMAND_BUFFER_FLAGS]
    assert mode == "command buffers"
    assert total == "3.0"


def test_command_buffers_after_the_backend_started_raise_instead_of_being_ignored():
    jnp.zeros(1).block_until_ready()  # this process's backend exists
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError, match="already initialised"):
        timing.enable_command_buffers()
    assert os.environ.get("XLA_FLAGS") == before


@pytest.mark.parametrize("what", ["moe", "round"])
def test_bench_refuses_command_buffers_where_they_are_not_measured(what, capsys):
    assert cli.main(["bench", what, "--command-buffers"]) == 2
    assert "--command-buffers is for attention and prep only" in capsys.readouterr().out


def test_launch_notes_name_the_mode():
    assert "CUDA graphs" in timing.launch_note("command buffers")
    assert "no command buffers" in timing.launch_note("streams")


class _Named:
    def __init__(self, name, **kw):
        self.name = name
        self.__dict__.update(kw)


def test_busy_time_sums_gpu_stream_events_and_skips_derived_lines_and_the_host():
    kernel = _Named("fusion", duration_ns=1500)
    custom = _Named("rms_norm_rope_stream_kernel", duration_ns=2500)
    gpu = _Named("/device:GPU:0", lines=[
        _Named("Stream #13(Compute)", events=[kernel, custom]),
        _Named("XLA Ops", events=[kernel, custom]),      # the same time again, per op
        _Named("XLA Modules", events=[_Named("jit_f", duration_ns=9000)]),
    ])
    host = _Named("/host:CPU", lines=[_Named("Stream #1", events=[_Named("x", duration_ns=7)])])
    assert timing.stream_busy_ns([host, gpu]) == 4000


def test_busy_time_is_none_without_a_gpu_in_the_trace():
    sets = [(jnp.full((8,), float(i)),) for i in range(3)]
    assert timing.device_busy_us(lambda x: x * 2 + 1, sets) is None


def test_call_times_gives_the_per_call_time_and_no_busy_time_on_the_cpu():
    sets = [(jnp.full((64,), float(i)),) for i in range(3)]
    per_call, busy = timing.call_times(lambda x: jnp.sin(x) * 2, sets, reps=3)
    assert per_call > 0 and busy is None
    with pytest.raises(ValueError, match="at least 2 sets"):
        timing.call_times(lambda x: x, sets[:1])


def test_prep_rows_say_whether_five_times_xla_fits_under_the_copy_rate():
    from jax_dspark.bench import prep

    nbytes = prep.case_bytes(1, 16384, 1, 64)  # bf16 x read, e4m3 + one exponent per 64 written
    assert nbytes == 16384 * 512 * 2 + 16384 * 512 + 16384 * 8
    cols = prep.speedup_target_columns(nbytes, 4.12, 34.4)
    assert cols["x5_needs_of_copy"] == round(nbytes / (34.4 / 5 * 1e-6) / 1e12 / 4.12, 2)
    assert cols["x5_within_copy_rate"] and cols["x5_needs_of_copy"] < 1
    fast_xla = prep.speedup_target_columns(nbytes, 4.12, 10.0)  # XLA at half the copy rate already
    assert not fast_xla["x5_within_copy_rate"]
    assert prep.speedup_target_columns(nbytes, 4.12, None) == dict(x5_needs_of_copy=None, x5_within_copy_rate=None)
    stored = {"copy_TBps": 4.12, "cases": [{"B": 1, "S": 16384, "H": 1, "fp8_block": 64, "xla_device_us": 34.4}]}
    got = prep.with_speedup_floor(stored)
    assert got["cases"][0]["x5_needs_of_copy"] == cols["x5_needs_of_copy"] and "not measured again" in got["floors_note"]
    assert "x5_needs_of_copy" not in stored["cases"][0]
