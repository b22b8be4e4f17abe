"""Kernel library plumbing that needs no GPU: dispatch switch, FFI API-version rule, handler
metadata, split-K choice and the wrappers' fallbacks."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import _ffi, ops
from jax_dspark.ops import _kernels


@pytest.fixture
def lib():
    loaded = _ffi.library()
    if isinstance(loaded, str):
        pytest.skip(f"no compiled kernel library here: {loaded}")
    return loaded


def test_kernels_are_not_used_on_a_cpu_backend():
    with _ffi.forced("auto"):
        assert not _ffi.use_kernel("sparse_sink_attention")
        assert not _ffi.use_kernel("rms_norm_rope")


def test_kernel_report_names_every_kernel_with_a_reason():
    report = _ffi.kernel_report()
    assert set(report) == set(_ffi.KERNELS)
    assert all(reason != _ffi.REGISTERED and reason for reason in report.values())


def test_attention_target_follows_the_env_switch(monkeypatch):
    monkeypatch.delenv(_kernels.ATTENTION_KERNEL_ENV, raising=False)
    # auto wants wgmma for either pool kind; not registered here, so it falls back to mma.sync.
    assert _kernels.attention_target() == "jax_dspark_sparse_sink_attention"
    assert _kernels.attention_target(fp8=True) == "jax_dspark_sparse_sink_attention"
    monkeypatch.setenv(_kernels.ATTENTION_KERNEL_ENV, "mma")
    assert _kernels.attention_target(fp8=True) == "jax_dspark_sparse_sink_attention"
    # No GPU here: asking for the wgmma kernel names why it is unavailable.
    monkeypatch.setenv(_kernels.ATTENTION_KERNEL_ENV, "wgmma")
    with pytest.raises(RuntimeError, match="wgmma kernel is not available"):
        _kernels.attention_target()
    monkeypatch.setenv(_kernels.ATTENTION_KERNEL_ENV, "cutlass")
    with pytest.raises(ValueError, match="'cutlass'"):
        _kernels.attention_target()


def test_attention_kernel_context_sets_the_switch_and_restores_it(monkeypatch):
    monkeypatch.setenv(_kernels.ATTENTION_KERNEL_ENV, "mma")
    with _kernels.attention_kernel("wgmma"):
        assert os.environ[_kernels.ATTENTION_KERNEL_ENV] == "wgmma"
    assert os.environ[_kernels.ATTENTION_KERNEL_ENV] == "mma"
    monkeypatch.delenv(_kernels.ATTENTION_KERNEL_ENV)
    with _kernels.attention_kernel("wgmma"):
        pass
    assert _kernels.ATTENTION_KERNEL_ENV not in os.environ
    with pytest.raises(ValueError, match="'sm80'"):
        with _kernels.attention_kernel("sm80"):
            pass


def test_attention_bench_row_names_its_kernel_and_leaves_unmeasured_fields_empty():
    from jax_dspark.bench import attention as bench_attention

    case = bench_attention.CASES[0]
    row = bench_attention._case_row(case, "bf16", "wgmma", float("nan"), 100.0, 1e9, 1e6, "memory", 4.0, 700.0)
    assert row["kernel"] == "wgmma" and row["xla_us"] == 100.0 and row["name"] == case.name
    assert row["kernel_us"] is None and row["meets_target"] is False  # no kernel on this machine
    assert row["default"] is True  # both pool kinds default to wgmma
    mma = bench_attention._case_row(case, "bf16", "mma", 50.0, 100.0, 1e9, 1e6, "memory", 4.0, 700.0)
    assert mma["default"] is False and mma["speedup_vs_xla"] == 2.0


def test_attention_bench_calls_rotate_back_the_rope_dims_as_the_models_do():
    import jax.numpy as jnp
    import numpy as np

    from jax_dspark import ops
    from jax_dspark.bench import attention as bench_attention

    case = bench_attention.Case("tiny", B=2, S=2, H=64, K=70, extra=5)
    q, main_rows, main_idx, extra_rows, extra_idx, sink, freqs = bench_attention.make_inputs(case, 1)[0]
    assert freqs.shape == (2, 2, bench_attention.ROPE_DIM // 2, 2) and freqs.dtype == jnp.float32
    np.testing.assert_allclose(np.hypot(freqs[..., 0], freqs[..., 1]), 1.0, rtol=1e-6)  # (cos, sin) pairs
    out = bench_attention._op("reference")(q, main_rows, main_idx, extra_rows, extra_idx, sink, freqs)
    plain = ops.sparse_sink_attention_reference(
        q, main_rows, main_idx, extra_rows=extra_rows, extra_idx=extra_idx, sink=sink, scale=bench_attention.D**-0.5
    )
    lo = bench_attention.D - bench_attention.ROPE_DIM
    out, plain = np.asarray(out, np.float32), np.asarray(plain, np.float32)
    np.testing.assert_array_equal(out[..., :lo], plain[..., :lo])  # nope dims untouched
    assert np.abs(out[..., lo:] - plain[..., lo:]).max() > 1e-2  # RoPE dims rotated back


def _dspark_block_row(**overrides):
    row = dict(name="DSpark block", kv_dtype="bf16", kernel="wgmma", B=64, S=5, H=64, K=133, bound="compute",
               xla_us=1000.0, kernel_device_us=50.0)
    row.update(overrides)
    return row


def test_attention_floor_puts_a_target_out_of_reach_when_its_bytes_need_more_than_the_copy_rate():
    from jax_dspark.bench import attention as bench_attention

    # q + out 2*64*5*64*1024, KV 64*133*1024, index lists 64*5*133*4, RoPE table 64*5*64*4
    assert bench_attention.min_bytes(64, 5, 64, 133, "bf16") == 41_943_040 + 8_716_288 + 170_240 + 81_920
    f = bench_attention.floor_columns(_dspark_block_row(), copy=2.867, gemm=643.6)
    flops = 4.0 * 64 * 5 * 64 * 133 * 512
    assert f["target_us"] == pytest.approx(flops / (0.5 * 643.6e12) * 1e6, abs=0.01)  # 50% of GEMM: 17.33 us
    assert f["byte_floor_us"] == pytest.approx(50_911_488 / 2.867e12 * 1e6, abs=0.01)  # 17.76 us
    assert f["target_needs_of_copy"] > 1.0 and f["target_needs_of_gemm"] == pytest.approx(0.5, abs=1e-3)
    assert f["target_within_ceilings"] is False
    assert f["busy_of_floor"] == pytest.approx(f["byte_floor_us"] / 50.0, abs=1e-3)
    # On a GPU with 4.1 TB/s the same bytes fit.
    assert bench_attention.floor_columns(_dspark_block_row(), copy=4.1, gemm=643.6)["target_within_ceilings"]


def test_attention_floor_target_is_the_stricter_of_the_ceiling_and_five_times_xla():
    from jax_dspark.bench import attention as bench_attention

    f = bench_attention.floor_columns(_dspark_block_row(xla_us=50.0, kernel_device_us=None), copy=4.1, gemm=643.6)
    assert f["target_us"] == 10.0  # 50 / 5 < 17.3
    assert f["target_needs_of_gemm"] == pytest.approx(4.0 * 64 * 5 * 64 * 133 * 512 / 643.6e12 * 1e6 / 10.0, abs=1e-3)
    assert f["busy_of_floor"] is None and f["target_within_ceilings"] is False


def test_attention_with_floors_adds_the_columns_to_a_stored_run_and_says_so(tmp_path):
    from jax_dspark.bench import attention as bench_attention

    stored = dict(gpu="g", commit="c", date="d", copy_TBps=4.1, gemm_bf16_TFLOPs=650.0, launch="streams",
                  targets=dict(ridge_flop_per_byte=158.5), cases=[_dspark_block_row(kernel_us=60.0)])
    got = bench_attention.with_floors(stored)  # a run from before inverse RoPE: no RoPE table bytes
    assert got["cases"][0]["kernel_us"] == 60.0 and "not measured again" in got["floors_note"]
    no_rope = bench_attention.min_bytes(64, 5, 64, 133, "bf16", rope_dims=0)
    assert got["cases"][0]["byte_floor_us"] == pytest.approx(no_rope / 4.1e12 * 1e6, abs=0.01)
    assert "byte_floor_us" not in stored["cases"][0]  # the stored result is left as it was
    md = bench_attention.write(got, str(tmp_path / "a.json"))
    assert "| target within ceilings |" in md and "not measured again" in md


def test_auto_attention_kernel_picks_wgmma_for_both_pool_kinds_when_registered(monkeypatch):
    monkeypatch.delenv(_kernels.ATTENTION_KERNEL_ENV, raising=False)
    report = {name: _ffi.REGISTERED for name, _ in _kernels.ATTENTION_KERNELS.values()}
    monkeypatch.setattr(_ffi, "kernel_report", lambda: report)
    assert _kernels.attention_target(fp8=False) == "jax_dspark_sparse_sink_attention_wgmma"
    assert _kernels.attention_target(fp8=True) == "jax_dspark_sparse_sink_attention_wgmma"
    with _kernels.attention_kernel("mma"):
        assert _kernels.attention_target(fp8=False) == "jax_dspark_sparse_sink_attention"
        assert _kernels.attention_target(fp8=True) == "jax_dspark_sparse_sink_attention"


def test_forcing_an_unavailable_kernel_raises_with_its_name():
    with _ffi.forced("kernel"), pytest.raises(RuntimeError, match="sparse_sink_attention"):
        _ffi.use_kernel("sparse_sink_attention")


def test_forced_mode_is_restored_after_the_context():
    _ffi.set_force_mode("auto")
    with _ffi.forced("reference"):
        assert _ffi.force_mode() == "reference"
    assert _ffi.force_mode() == "auto"


def test_unknown_force_mode_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        _ffi.set_force_mode("fast")


@pytest.mark.parametrize(
    ("handler", "runtime", "ok"),
    [((0, 3), (0, 3), True), ((0, 3), (0, 4), True), ((0, 5), (0, 4), False), ((1, 0), (0, 4), False)],
)
def test_api_version_rule_accepts_only_older_or_equal_minor(handler, runtime, ok):
    assert _ffi.api_version_compatible(handler, runtime) is ok


def test_handlers_report_the_api_version_of_their_build_headers(lib):
    for target in lib.capsules:
        major, minor, _ = lib.metadata(target)
        assert (major, minor) == lib.api_version


def test_library_api_version_is_accepted_by_this_jaxlib(lib):
    runtime = _ffi.runtime_ffi_api_version()
    assert runtime is not None
    assert _ffi.api_version_compatible(lib.api_version, runtime)


def test_handlers_declare_command_buffer_compatibility(lib):
    for target in lib.capsules:
        assert lib.metadata(target)[2] & 1, target  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE


def test_metadata_of_an_unknown_target_raises(lib):
    with pytest.raises(ValueError, match="no_such_target"):
        lib.metadata("no_such_target")


def test_split_k_fills_the_gpu_for_v4_flash_decode():
    # B 64, S 1, H 64, K 640: 64 CTAs alone would leave half of 132 SMs idle.
    assert _kernels.choose_splits(64, 1, 64, 640, 132) == 2


def test_split_k_leaves_short_lists_unsplit():
    assert _kernels.choose_splits(1, 1, 64, 64, 132) == 1
    assert _kernels.choose_splits(128, 5, 128, 133, 132) == 1


@pytest.mark.parametrize("seed", range(3))
def test_split_k_never_leaves_a_split_without_rows(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        b, s, h, k = (int(v) for v in (rng.integers(1, 65), rng.integers(1, 9), rng.choice([64, 128]), rng.integers(0, 20000)))
        splits = _kernels.choose_splits(b, s, h, k, 132)
        tiles = -(-k // 64)
        assert 1 <= splits <= max(1, min(32, tiles))
        per_split = -(-tiles // splits) if tiles else 0
        assert tiles == 0 or -(-tiles // per_split) == splits


def test_per_head_rope_table_is_passed_without_tiling():
    freqs = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 1, 4, 2)), jnp.float32)
    grouped = _kernels._freqs_per_row_group(freqs, (2, 3, 16))  # x [2, 3, 16 heads, D]
    assert grouped.shape == (6, 4, 2)
    np.testing.assert_array_equal(np.asarray(grouped), np.asarray(freqs).reshape(6, 4, 2))


def test_rope_table_varying_in_a_middle_axis_is_broadcast_over_the_leading_ones():
    freqs = jnp.asarray(np.random.default_rng(1).standard_normal((3, 1, 4, 2)), jnp.float32)
    grouped = _kernels._freqs_per_row_group(freqs, (2, 3, 5))
    assert grouped.shape == (6, 4, 2)
    np.testing.assert_array_equal(np.asarray(grouped)[4], np.asarray(freqs)[1, 0])


def test_attention_wrapper_runs_the_reference_for_float32_queries():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 2, 3, 512)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((10, 512)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, 10, (1, 2, 4)), jnp.int32)
    got = _kernels.sparse_sink_attention(q, rows, idx, scale=0.05)
    want = ops.sparse_sink_attention_reference(q, rows, idx, scale=0.05)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_attention_wrapper_refuses_an_unsupported_call_when_the_kernel_is_forced():
    q = jnp.ones((1, 1, 2, 64), jnp.bfloat16) * 0.5
    rows = jnp.ones((3, 64), jnp.bfloat16)
    idx = jnp.zeros((1, 1, 2), jnp.int32)
    with _ffi.forced("kernel"), pytest.raises(ValueError, match="head dim 64"):
        _kernels.sparse_sink_attention(q, rows, idx, scale=0.1)


def test_prep_wrapper_runs_the_reference_composition_for_float16():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float16)
    freqs = jnp.asarray(rng.standard_normal((4, 8, 2)), jnp.float32)
    got = _kernels.rms_norm_rope(x, None, freqs, eps=1e-6)
    want = ops.apply_rope(ops.rms_norm(x, eps=1e-6), freqs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_prep_wrapper_rejects_a_block_that_does_not_divide_the_row():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 192)), jnp.bfloat16)
    with pytest.raises(ValueError, match="fp8_block"):
        _kernels.rms_norm_rope(x, fp8_block=128)
