"""MoE CUDA kernels (route, permute + grouped GEMMs + un-permute) against per-token loops.

GPU tests run with `JAX_DSPARK_TEST_GPU=1 pytest -m gpu tests/test_kernels_moe.py` on the
H200 with the kernel library built; they force the kernels (`ops.force("kernel")`), so a
missing library fails loudly instead of silently testing the reference. Every input is fresh
random data; outputs are poisoned with NaN where XLA lets the output reuse a donated buffer,
so an element the kernel never wrote shows up as NaN.

Tolerance: relative Frobenius error <= 1e-2 against a float64 per-token loop. The kernel
rounds to bf16 three times in between (FC1 output, SwiGLU output, FC2 output), each a
relative 2^-9; measured errors are a few 1e-3.

FP8 kernel (DeepSeek recipe): relative Frobenius error <= 2e-2 against the FP8 reference
(`moe_fp8.moe_experts_fp8_reference`), which quantises the same operands the same way (x and
the weights identically, bit for bit). What may differ is the f32 accumulation order and the
FP8 tensor cores' reduced-precision partial sums (promoted to f32 every 128 of K), which can
move an FC1 output across a bf16 rounding and then a SwiGLU output across an e4m3 rounding
(2^-4 relative) in a few elements. On the CPU, perturbing x by 2^-10 relative moved the
FP8 reference by 0.7-0.9%; a wrong scale, block or row gives errors of order 1.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark import ops
from jax_dspark.ops import _moe_kernels, moe_fp8
from moe_problem import problem, rel_err

TOL = 1e-2
FP8_TOL = 2e-2


def _per_token_moe(x, ids, weights, w_gate_up, w_down, limit):
    """float64 loop over tokens and slots: the definition the kernel must match."""
    x = np.asarray(x, np.float64)
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    e_count, _, two_i = w_gate_up.shape
    inter = two_i // 2
    used = {int(e) for e in ids.ravel() if 0 <= e < e_count}  # convert only the experts used
    wgu = {e: np.asarray(w_gate_up[e], np.float64) for e in used}
    wd = {e: np.asarray(w_down[e], np.float64) for e in used}
    out = np.zeros((x.shape[0], x.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if not 0 <= e < e_count:
                continue
            h = x[t] @ wgu[e]
            g, u = h[:inter], h[inter:]
            if limit is not None:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


def _poisoned_experts(x, ids, weights, wgu, wd, limit):
    """Run the kernel with its output placed (when XLA allows) in a NaN-filled donated buffer."""
    poison = jnp.full(x.shape, jnp.nan, x.dtype)
    address = poison.unsafe_buffer_pointer()

    def f(p, x, ids, weights, wgu, wd):
        del p
        return ops.moe_experts(x, ids, weights, wgu, wd, limit=limit)

    out = jax.jit(f, donate_argnums=0)(poison, x, ids, weights, wgu, wd)
    return out, out.unsafe_buffer_pointer() == address


@pytest.fixture
def kernels():
    with ops.force("kernel"):
        yield


def test_unsupported_dtype_falls_back_to_the_reference():
    x, ids, weights, wgu, wd = problem(0, 5, 2, 4, 16, 8)
    x32 = x.astype(jnp.float32)
    got = _moe_kernels.moe_experts(x32, ids, weights, wgu, wd, limit=3.0)
    want = ops.moe_experts_reference(x32, ids, weights, wgu, wd, limit=3.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_workspace_bound_grows_with_every_operand_size():
    base = _moe_kernels.experts_workspace_bytes(64, 6, 256, 4096, 2048)
    # xp + h + a alone for 64 * 6 rows, before maps and GEMM arrays
    assert base >= 64 * 6 * (4096 + 2 * 2048 + 2048) * 2
    for bigger in [(65, 6, 256, 4096, 2048), (64, 7, 256, 4096, 2048), (64, 6, 256, 4104, 2048),
                   (64, 6, 256, 4096, 2056), (64, 6, 4096, 4096, 2048)]:
        assert _moe_kernels.experts_workspace_bytes(*bigger) > base, bigger


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,k,experts,hidden,inter,limit",
    [
        (96, 6, 16, 256, 128, 10.0),  # several rows per expert, one M tile each
        (300, 4, 8, 512, 256, None),  # ~150 rows per expert: three 64-row tiles, no clamp
        (64, 6, 24, 384, 192, 0.5),  # tight clamp exercised on most elements
        (3, 6, 32, 2048, 1024, 10.0),  # decode-like: a few tokens, long K, most experts empty
    ],
)
def test_kernel_experts_match_per_token_loop(kernels, tokens, k, experts, hidden, inter, limit):
    x, ids, weights, wgu, wd = problem(tokens * 7 + experts, tokens, k, experts, hidden, inter)
    out, poisoned = _poisoned_experts(x, ids, weights, wgu, wd, limit)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), f"unwritten or non-finite outputs (poisoned={poisoned})"
    assert rel_err(out, _per_token_moe(x, ids, weights, wgu, wd, limit)) < TOL


@pytest.mark.gpu
def test_kernel_experts_handle_empty_and_single_row_experts(kernels):
    x, _, weights, wgu, wd = problem(11, 5, 2, 64, 128, 64)
    # Expert 63 gets exactly one row, 0..9 a few, every other expert none.
    ids = np.array([[63, 0], [1, 2], [3, 4], [5, 6], [7, 9]], np.int32)
    out, _ = _poisoned_experts(x, ids, weights, wgu, wd, 10.0)
    assert rel_err(out, _per_token_moe(x, ids, weights, wgu, wd, 10.0)) < TOL


@pytest.mark.gpu
def test_kernel_experts_prefill_tiles_skip_empty_experts(kernels):
    # 400 rows over 8 experts selects the 128-row tiles; experts 4..7 get no row, 0..3 ~100.
    x, _, weights, wgu, wd = problem(18, 200, 2, 8, 256, 128)
    rng = np.random.default_rng(18)
    ids = np.argsort(rng.standard_normal((200, 4)), axis=1)[:, :2].astype(np.int32)
    out, _ = _poisoned_experts(x, ids, weights, wgu, wd, 10.0)
    assert rel_err(out, _per_token_moe(x, ids, weights, wgu, wd, 10.0)) < TOL


@pytest.mark.gpu
def test_kernel_experts_with_zero_tokens_return_empty(kernels):
    x, ids, weights, wgu, wd = problem(12, 0, 2, 8, 64, 32)
    assert ops.moe_experts(x, ids, weights, wgu, wd).shape == (0, 64)


@pytest.mark.gpu
def test_kernel_experts_drop_out_of_range_ids_under_jit(kernels):
    x, ids, weights, wgu, wd = problem(13, 33, 3, 8, 128, 64)
    ids[0, 0], ids[5, 2], ids[32, 1] = -1, 8, 1 << 30  # unseen by the op's concrete check
    out = jax.jit(lambda *a: ops.moe_experts(*a, limit=10.0))(x, ids, weights, wgu, wd)
    assert rel_err(out, _per_token_moe(x, ids, weights, wgu, wd, 10.0)) < TOL


@pytest.mark.gpu
def test_kernel_experts_reject_duplicate_ids_before_launch(kernels):
    x, ids, weights, wgu, wd = problem(14, 4, 2, 8, 64, 32)
    ids[2] = [3, 3]
    with pytest.raises(ValueError, match="token 2 lists an expert twice"):
        ops.moe_experts(x, ids, weights, wgu, wd)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sqrt_softplus", "sigmoid", "softmax"])
def test_kernel_route_matches_scores_then_topk(kernels, kind):
    rng = np.random.default_rng(15)
    logits = rng.standard_normal((77, 384)).astype(np.float32)
    bias = (rng.standard_normal(384) * 0.1).astype(np.float32)
    w, ids = _moe_kernels.route(jnp.asarray(logits), 6, kind=kind, bias=jnp.asarray(bias), route_scale=2.5)
    with ops.force("reference"):
        want_w, want_ids = ops.topk_route(ops.router_scores(logits, kind), 6, bias=bias, route_scale=2.5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_kernel_topk_route_without_bias_or_renormalisation(kernels):
    rng = np.random.default_rng(16)
    scores = ops.router_scores(rng.standard_normal((9, 40)).astype(np.float32))
    w, ids = _moe_kernels.topk_route(scores, 5, route_scale=1.5, renormalize=False)
    with ops.force("reference"):
        want_w, want_ids = ops.topk_route(scores, 5, route_scale=1.5, renormalize=False)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-6)


@pytest.mark.gpu
def test_kernel_hash_route_reads_the_table_and_weights_from_scores(kernels):
    rng = np.random.default_rng(17)
    logits = rng.standard_normal((50, 256)).astype(np.float32)
    table = np.stack([rng.permutation(256)[:6] for _ in range(1000)]).astype(np.int32)
    tokens = rng.integers(0, 1000, 50).astype(np.int32)
    w, ids = _moe_kernels.hash_route(jnp.asarray(logits), tokens, table, kind="sqrt_softplus", route_scale=1.5)
    with ops.force("reference"):
        want_w, want_ids = ops.hash_route(ops.router_scores(logits), tokens, table, route_scale=1.5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5)


_GRAPH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax_dspark import ops
rng = np.random.default_rng(0)
f = jax.jit(lambda x, ids, w, a, b: ops.moe_experts(jnp.tanh(x), ids, w, a, b, limit=10.0) * 2)
errs = []
with ops.force("kernel"):
    for trial in range(3):
        x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
        a = jnp.asarray(rng.standard_normal((8, 256, 256)) / 16, jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal((8, 128, 256)) / 11, jnp.bfloat16)
        ids = np.argsort(rng.standard_normal((40, 8)), 1)[:, :3].astype(np.int32)
        w = rng.uniform(size=(40, 3)).astype(np.float32)
        got = np.asarray(f(x, ids, w, a, b), np.float64)
        with ops.force("reference"):
            want = np.asarray(jax.jit(lambda *z: ops.moe_experts(jnp.tanh(z[0]), *z[1:], limit=10.0) * 2)(x, ids, w, a, b), np.float64)
        errs.append(np.linalg.norm(got - want) / np.linalg.norm(want))
print("ERRS", errs)
assert max(errs) < 2e-2, errs
"""


@pytest.mark.gpu
def test_kernel_experts_inside_a_cuda_graph(kernels):
    # XLA captures custom calls with the command-buffer trait into CUDA graphs; run in a fresh
    # process so the flags take effect, with three different input sets (graph updates).
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"
                        " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL").strip()
    run = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


# ---- FP8 experts ------------------------------------------------------------------------


def _fp8_problem(seed, tokens, k, experts, hidden, inter):
    x, ids, weights, wgu, wd = problem(seed, tokens, k, experts, hidden, inter)
    with ops.force("reference"):
        q_gu, q_d = moe_fp8.quantize_expert_weights(wgu, wd)
    return x, ids, weights, q_gu, q_d


def _fp8_reference(x, ids, weights, q_gu, q_d, limit):
    with ops.force("reference"):
        return moe_fp8.moe_experts_fp8_reference(x, ids, weights, q_gu, q_d, limit=limit)


def test_fp8_kernel_falls_back_to_the_fp8_reference_for_f32_tokens():
    x, ids, weights, q_gu, q_d = _fp8_problem(25, 5, 2, 4, 128, 128)
    x32 = x.astype(jnp.float32)
    got = _moe_kernels.moe_experts_fp8(x32, ids, weights, q_gu, q_d, limit=3.0)
    np.testing.assert_array_equal(got, _fp8_reference(x32, ids, weights, q_gu, q_d, 3.0))


def test_fp8_workspace_bound_covers_every_buffer_and_grows_with_every_size():
    base = _moe_kernels.experts_fp8_workspace_bytes(64, 6, 256, 4096, 2048)
    p = 64 * 6
    # xq + scales, h, aq + scales, y; then both f32 weight-scale arrays
    assert base >= p * (4096 + 4 * 32 + 2 * 2 * 2048 + 2048 + 4 * 16 + 2 * 4096) + 4 * 256 * 2 * 16 * 32
    for bigger in [(65, 6, 256, 4096, 2048), (64, 7, 256, 4096, 2048), (64, 6, 256, 4224, 2048),
                   (64, 6, 256, 4096, 2176), (64, 6, 4096, 4096, 2048)]:
        assert _moe_kernels.experts_fp8_workspace_bytes(*bigger) > base, bigger


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,k,experts,hidden,inter,limit",
    [
        (96, 6, 16, 256, 128, 10.0),  # 36 rows per expert: 128-row cooperative tiles
        (300, 4, 8, 512, 256, None),  # ~150 rows per expert: two M tiles, no clamp
        (64, 6, 24, 384, 256, 0.5),  # 16 rows per expert: 64-row ping-pong tiles, tight clamp
        (3, 6, 32, 2048, 1024, 10.0),  # decode-like: long K, most experts empty
    ],
)
def test_kernel_fp8_experts_match_fp8_reference(kernels, tokens, k, experts, hidden, inter, limit):
    x, ids, weights, q_gu, q_d = _fp8_problem(tokens * 5 + experts, tokens, k, experts, hidden, inter)
    out, poisoned = _poisoned_experts(x, ids, weights, q_gu, q_d, limit)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), f"unwritten or non-finite outputs (poisoned={poisoned})"
    assert rel_err(out, _fp8_reference(x, ids, weights, q_gu, q_d, limit)) < FP8_TOL


@pytest.mark.gpu
def test_kernel_fp8_experts_handle_empty_and_single_row_experts(kernels):
    x, _, weights, q_gu, q_d = _fp8_problem(21, 5, 2, 64, 128, 128)
    ids = np.array([[63, 0], [1, 2], [3, 4], [5, 6], [7, 9]], np.int32)  # expert 63: one row
    out, _ = _poisoned_experts(x, ids, weights, q_gu, q_d, 10.0)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    assert rel_err(out, _fp8_reference(x, ids, weights, q_gu, q_d, 10.0)) < FP8_TOL


@pytest.mark.gpu
def test_kernel_fp8_experts_with_zero_tokens_return_empty(kernels):
    x, ids, weights, q_gu, q_d = _fp8_problem(22, 0, 2, 8, 128, 128)
    assert ops.moe_experts(x, ids, weights, q_gu, q_d).shape == (0, 128)


@pytest.mark.gpu
def test_kernel_fp8_experts_drop_out_of_range_ids_under_jit(kernels):
    x, ids, weights, q_gu, q_d = _fp8_problem(23, 33, 3, 8, 256, 128)
    ids[0, 0], ids[5, 2], ids[32, 1] = -1, 8, 1 << 30  # unseen by the op's concrete check
    out = jax.jit(lambda *a: ops.moe_experts(*a, limit=10.0))(x, ids, weights, q_gu, q_d)
    assert rel_err(out, _fp8_reference(x, ids, weights, q_gu, q_d, 10.0)) < FP8_TOL


@pytest.mark.gpu
def test_kernel_fp8_experts_stay_close_to_bf16_kernel(kernels):
    x, ids, weights, wgu, wd = problem(24, 64, 6, 16, 256, 128)
    with ops.force("reference"):
        q = moe_fp8.quantize_expert_weights(wgu, wd)
    fp8 = ops.moe_experts(x, ids, weights, *q, limit=10.0)
    bf16 = ops.moe_experts(x, ids, weights, wgu, wd, limit=10.0)
    assert rel_err(fp8, bf16) < 0.1  # four e4m3 roundings, ~0.065 on the CPU reference


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_experts_serve_expert_parallel_shards(kernels, fp8):
    # parallel.moe_experts_ep on a one-GPU mesh: the shard body sends its rows (with -1
    # padding rows from the dispatch buffer) through the CUDA kernels as one-slot tokens.
    # Forced kernels: an unavailable kernel raises instead of testing the reference. The
    # single-device kernel sums the same bf16 expert rows in another f32 order.
    from jax_dspark import parallel

    x, ids, weights, wgu, wd = problem(25 + fp8, 48, 6, 32, 256, 128)
    ids[3, 1] = -1  # a dropped slot under jit, as a padding row would be
    if fp8:
        with ops.force("reference"):
            wgu, wd = moe_fp8.quantize_expert_weights(wgu, wd)
    single = jax.jit(lambda *a: ops.moe_experts(*a, limit=10.0))(x, ids, weights, wgu, wd)
    mesh = parallel.make_mesh(expert=1)
    poison = jnp.full(x.shape, jnp.nan, x.dtype)

    def ep(p, *a):
        del p
        return parallel.moe_experts_ep(*a, mesh=mesh, limit=10.0)

    out = jax.jit(ep, donate_argnums=0)(poison, x, ids, weights, wgu, wd)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    assert rel_err(out, single) < 1e-2
    if not fp8:
        assert rel_err(out, _per_token_moe(x, ids, weights, wgu, wd, 10.0)) < TOL


_GRAPH_SCRIPT_FP8 = """
import jax, jax.numpy as jnp, numpy as np
from jax_dspark import ops
from jax_dspark.ops import moe_fp8
rng = np.random.default_rng(0)
f = jax.jit(lambda x, ids, w, a, b: ops.moe_experts(jnp.tanh(x), ids, w, a, b, limit=10.0) * 2)
errs = []
for trial in range(3):
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((8, 256, 256)) / 16, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((8, 128, 256)) / 11, jnp.bfloat16)
    with ops.force("reference"):
        qa, qb = moe_fp8.quantize_expert_weights(a, b)
    ids = np.argsort(rng.standard_normal((40, 8)), 1)[:, :3].astype(np.int32)
    w = rng.uniform(size=(40, 3)).astype(np.float32)
    with ops.force("kernel"):
        got = np.asarray(f(x, ids, w, qa, qb), np.float64)
    with ops.force("reference"):
        want = np.asarray(jax.jit(lambda *z: ops.moe_experts(jnp.tanh(z[0]), *z[1:], limit=10.0) * 2)(x, ids, w, qa, qb), np.float64)
    errs.append(np.linalg.norm(got - want) / np.linalg.norm(want))
print("ERRS", errs)
assert max(errs) < 2e-2, errs
"""


@pytest.mark.gpu
def test_kernel_fp8_experts_inside_a_cuda_graph(kernels):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"
                        " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL").strip()
    run = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT_FP8], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
