"""Where `jax-dspark bench` writes: the reference GPU's figures are never overwritten by a run elsewhere."""

import argparse
import types

import jax
import pytest

from jax_dspark.bench import attention, prep, report, timing
from jax_dspark.commands import bench


@pytest.mark.parametrize("kind, suffix", [
    ("NVIDIA H200", ""),
    ("NVIDIA H200 NVL", ""),
    ("NVIDIA H100 80GB HBM3", "_h100"),
    ("NVIDIA A100-SXM4-40GB", "_a100"),
    ("NVIDIA GeForce RTX 4090", "_4090"),
    ("Some GPU", "_some_gpu"),
    ("", "_unknown"),
])
def test_gpu_suffix_is_empty_only_on_the_reference_gpu(kind, suffix):
    assert report.gpu_suffix(kind) == suffix


@pytest.mark.parametrize("what, module", [("attention", attention), ("prep", prep)])
@pytest.mark.parametrize("kind, command_buffers, name", [
    ("NVIDIA H200", False, "{what}.json"),
    ("NVIDIA H100 80GB HBM3", False, "{what}_h100.json"),
    ("NVIDIA H100 80GB HBM3", True, "{what}_h100_command_buffers.json"),
])
def test_kernel_bench_names_its_json_after_the_gpu(monkeypatch, tmp_path, what, module, kind, command_buffers, name):
    written = []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(device_kind=kind)])
    monkeypatch.setattr(module, "run", lambda path, **kw: written.append(path))
    monkeypatch.setattr(timing, "enable_command_buffers", lambda: None)  # it would reconfigure XLA
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = [what, "--out", str(tmp_path)] + (["--command-buffers"] if command_buffers else [])
    assert bench.run(parser.parse_args(argv)) == 0
    assert written == [str(tmp_path / name.format(what=what))]
