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
