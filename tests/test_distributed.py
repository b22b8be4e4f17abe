"""A 2-process jax.distributed job (CPU, gloo) generates the tokens one process does."""

import json
import os
import socket
import subprocess
import sys

import pytest

ARGS = ["generate", "a b c d", "xyz", "--target", "tiny-v4", "--max-new-tokens", "5", "--json", "--no-progress"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


def test_two_process_expert_parallel_generation_equals_one_process():
    cli = [sys.executable, "-m", "jax_dspark.cli"]
    single = subprocess.run(cli + ARGS, capture_output=True, text=True, env=_env(), timeout=900)
    assert single.returncode == 0, single.stderr[-2000:]
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            cli + ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)]
            + ARGS + ["--expert-parallel", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("2-process run timed out")
        assert p.returncode == 0, err[-2000:]
        # gloo's C++ side prints "[Gloo] Rank ... connected" lines on stdout; the JSON object is
        # the line our CLI printed.
        outs.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    want = json.loads(single.stdout)["tokens"]
    assert outs[0]["tokens"] == want and outs[1]["tokens"] == want
