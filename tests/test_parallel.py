"""Sharded execution equals one device: rules, expert parallelism, Helix attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_dspark import ops, parallel

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def test_mesh_has_all_four_named_axes():
    mesh = parallel.make_mesh(expert=4, tensor=2)
    assert dict(mesh.shape) == {"data": 1, "sequence": 1, "expert": 4, "tensor": 2}
    with pytest.raises(ValueError, match="needs 16 devices"):
        parallel.make_mesh(expert=4, tensor=4)


def test_rules_place_matching_leaves_and_reject_indivisible_dims():
    mesh = parallel.make_mesh(tensor=4)
    rules = parallel.ShardingRules(((r"attn/w$", P(None, "tensor")), (r"emb", P("tensor"))))
    tree = {"attn": {"w": jnp.ones((3, 8))}, "emb": jnp.ones((16, 2)), "norm": jnp.ones(8)}
    placed = rules.apply(tree, mesh)
    assert placed["attn"]["w"].sharding.spec == P(None, "tensor")
    assert placed["emb"].sharding.spec == P("tensor")
    assert placed["norm"].sharding.spec == P()
    with pytest.raises(ValueError, match=r"attn/w: dim 6 not divisible"):
        rules.apply({"attn": {"w": jnp.ones((3, 6))}}, mesh)


def _tokens_and_experts(rng, t, d, e, i, scale):
    """f32 tokens `[t, d]` and experts `w_gate_up [e, d, 2i]`, `w_down [e, i, d]` (/ scale)."""
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, d, 2 * i)) / scale, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, i, d)) / scale, jnp.float32)
    return x, w1, w2


def _skewed_routing(rng, t, e, k, hot):
    """Top-k routing whose first `hot` experts get +3 logits: one device gets most rows."""
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[:, :hot] += 3.0
    return ops.topk_route(ops.router_scores(jnp.asarray(logits)), k)


@pytest.mark.parametrize("n", [2, 8])
def test_expert_parallel_moe_equals_single_device(n):
    rng = np.random.default_rng(n)
    t, d, e, i, k = 32, 16, 16, 8, 3
    x, w1, w2 = _tokens_and_experts(rng, t, d, e, i, 4)
    w, ids = _skewed_routing(rng, t, e, k, 3)  # some devices receive far more rows than others
    ref = ops.moe_experts(x, ids, w, w1, w2, limit=1.0)
    mesh = parallel.make_mesh(expert=n)
    out = jax.jit(lambda *a: parallel.moe_experts_ep(*a, mesh=mesh, limit=1.0))(x, ids, w, w1, w2)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("n", [2, 8])
def test_expert_parallel_fp8_moe_equals_single_device(n):
    # ops.moe_experts with FP8 weights under ops.expert_parallel: tokens padded to the axis
    # (T = 13), experts split with their block exponents, DeepSeek's activation rounding on
    # every shard; each row meets the same arithmetic as on one device.
    rng = np.random.default_rng(10 + n)
    t, d, e, i, k = 13, 128, 8, 128, 2
    x, w1, w2 = _tokens_and_experts(rng, t, d, e, i, 8)
    w1, w2 = ops.quantize_expert_weights(w1, w2)
    w, ids = _skewed_routing(rng, t, e, k, 2)
    ref = ops.moe_experts(x, ids, w, w1, w2, limit=2.0)
    mesh = parallel.make_mesh(expert=n)
    with ops.expert_parallel(mesh):
        out = jax.jit(lambda *a: ops.moe_experts(*a, limit=2.0))(x, ids, w, w1, w2)
    assert out.shape == (t, d)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("n", [2, 8])
def test_expert_parallel_drops_out_of_range_ids_under_jit(n):
    # ids the op cannot check (traced) outside [0, E) contribute nothing on one device; the
    # dispatch must neither wrap -1 onto the last device's last expert nor misplace rows.
    rng = np.random.default_rng(30 + n)
    t, d, e, i, k = 16, 16, 8, 8, 3
    x, w1, w2 = _tokens_and_experts(rng, t, d, e, i, 4)
    ids = np.argsort(rng.standard_normal((t, e)), axis=1)[:, :k].astype(np.int32)
    ids[0, 0], ids[5, 2], ids[9, 1], ids[15, 0] = -1, e, 1 << 30, -7
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    ref = jax.jit(lambda *a: ops.moe_experts(*a, limit=1.0))(x, ids, w, w1, w2)
    keep = (ids >= 0) & (ids < e)
    swapped = ids.copy()  # each bad slot -> an expert its token does not use, with weight 0
    for tok, slot in zip(*np.nonzero(~keep)):
        swapped[tok, slot] = min(set(range(e)) - set(swapped[tok].tolist()))
    ref_valid_only = ops.moe_experts(x, swapped, jnp.where(keep, w, 0.0), w1, w2, limit=1.0)
    assert rel_err(ref, ref_valid_only) < 1e-6  # what "contribute nothing" means
    mesh = parallel.make_mesh(expert=n)
    out = jax.jit(lambda *a: parallel.moe_experts_ep(*a, mesh=mesh, limit=1.0))(x, ids, w, w1, w2)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_parallel_hands_rows_to_the_kernel_as_one_slot_tokens(monkeypatch, fp8):
    # Where the CUDA kernels run, each device's received rows (padding rows with id -1
    # included) go through the kernel's contract as tokens with one slot of weight 1. Here
    # that contract is played by the reference the GPU tests hold the kernel to, so the
    # result must still equal one device, and the stand-in must have been called.
    from jax_dspark import _ffi
    from jax_dspark.ops import _moe_kernels, moe_fp8

    rng = np.random.default_rng(20 + fp8)
    t, d, e, i, k, n = 16, 128, 8, 128, 2, 4
    x, w1, w2 = _tokens_and_experts(rng, t, d, e, i, 8)
    if fp8:
        w1, w2 = ops.quantize_expert_weights(w1, w2)
    w, ids = _skewed_routing(rng, t, e, k, 2)  # padding rows in most send buffers
    ref = ops.moe_experts(x, ids, w, w1, w2, limit=2.0)

    name = "moe_experts_fp8" if fp8 else "moe_experts"
    contract = moe_fp8.moe_experts_fp8_reference if fp8 else ops.moe_experts_reference
    calls = []

    def stand_in(x, ids, weights, w_gate_up, w_down, *, limit=None):
        calls.append((x.shape, ids.shape))
        assert ids.shape == (x.shape[0], 1) and weights.shape == (x.shape[0], 1)
        return contract(x, ids, weights, w_gate_up, w_down, limit=limit)

    real_use_kernel = _ffi.use_kernel
    monkeypatch.setattr(_ffi, "use_kernel", lambda kernel: kernel == name or real_use_kernel(kernel))
    monkeypatch.setattr(_moe_kernels, name, stand_in)
    out = parallel.moe_experts_ep(x, ids, w, w1, w2, mesh=parallel.make_mesh(expert=n), limit=2.0)
    assert calls == [((n * (t // n) * k, d), (n * (t // n) * k, 1))]  # one trace: all n rows buffers
    assert rel_err(out, ref) < 1e-5


def test_expert_parallel_rejects_mixed_fp8_and_bf16_weights():
    mesh = parallel.make_mesh(expert=2)
    w1, w2 = ops.quantize_expert_weights(jnp.ones((2, 128, 256)), jnp.ones((2, 128, 128)))
    ids = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="both be Fp8Weight"):
        parallel.moe_experts_ep(jnp.ones((2, 128)), ids, jnp.ones((2, 1)), w1, jnp.ones((2, 128, 128)), mesh=mesh)


def test_helix_attention_equals_single_device_with_sink_applied_once():
    rng = np.random.default_rng(0)
    b, s, h, d, n, k = 2, 3, 4, 64, 64, 24
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    idx = rng.integers(-1, n, (b, s, k)).astype(np.int32)
    idx[0, 0] = -1  # an empty list stays zero after the merge
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    freqs = ops.rope_table(128, 16, theta=1e4)[rng.integers(0, 128, (b, s))]
    ref = ops.sparse_sink_attention(q, rows, idx, sink=sink, scale=0.125, inverse_rope=freqs)
    mesh = parallel.make_mesh(sequence=8)
    out = jax.jit(
        lambda q, r, i: parallel.helix_sparse_sink_attention(
            q, r, i, scale=0.125, sink=sink, inverse_rope=freqs, mesh=mesh
        )
    )(q, rows, idx)
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out[0, 0]) == 0)


def test_distributed_needs_all_three_values():
    assert parallel.initialize_distributed() is False
    with pytest.raises(ValueError, match="need coordinator, num_processes and process_id"):
        parallel.initialize_distributed(coordinator="127.0.0.1:1234")


def test_v4_forward_with_tensor_and_expert_parallel_equals_one_device():
    from flax import nnx

    from jax_dspark.models import deepseek_v4 as v4
    from jax_dspark.models.deepseek_v4_config import CONFIGS

    config = CONFIGS["tiny"]()
    model = v4.DeepseekV4(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    b, s = 2, 12
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (b, s)), jnp.int32)
    slots = jnp.arange(b, dtype=jnp.int32)
    starts = jnp.zeros(b, jnp.int32)
    lengths = jnp.array([12, 9], jnp.int32)

    def run(params):
        return nnx.merge(graphdef, params)(tokens, model.init_cache(b, 32), slots=slots, starts=starts, lengths=lengths)

    ref_logits, ref_hidden, _ = jax.jit(run)(params)
    mesh = parallel.make_mesh(tensor=2, expert=4)
    sharded = parallel.V4_RULES.apply(params, mesh)
    experts = sharded["layers"][1]["mlp"]["experts"]["gate_up_proj"]
    assert experts[...].sharding.spec == P("expert")
    with ops.expert_parallel(mesh):
        lowered = jax.jit(run).lower(sharded)
    assert "all_to_all" in lowered.as_text()  # the MoE really ran expert-parallel
    logits, hidden, _ = lowered.compile()(sharded)
    mask = np.arange(s)[None, :] < np.asarray(lengths)[:, None]
    assert rel_err(np.asarray(logits)[mask], np.asarray(ref_logits)[mask]) < 1e-4
    assert rel_err(np.asarray(hidden)[mask], np.asarray(ref_hidden)[mask]) < 1e-4


def test_sharded_speculative_generation_gives_the_single_device_tokens():
    """The engine's jitted round, fed sharded target + drafter params, is unchanged code."""
    from flax import nnx

    from jax_dspark.models.deepseek_v4 import DeepseekV4
    from jax_dspark.models.deepseek_v4_config import tiny
    from jax_dspark.models.dspark_v4 import tiny_dspark_v4
    from jax_dspark.spec.engine import SpeculativeEngine, generate

    target = DeepseekV4(tiny(), rngs=nnx.Rngs(0))
    drafter = tiny_dspark_v4(target.config)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
    ref = generate(target, drafter, prompts, max_new_tokens=6)
    mesh = parallel.make_mesh(tensor=2, expert=4)
    for model in (target, drafter):
        nnx.update(model, parallel.V4_RULES.apply(nnx.state(model), mesh))
    assert nnx.state(target)["layers"][1]["mlp"]["experts"]["down_proj"][...].sharding.spec == P("expert")
    with ops.expert_parallel(mesh):
        sharded = generate(target, drafter, prompts, max_new_tokens=6)
        engine = SpeculativeEngine(target, drafter, max_new_tokens=6)
        round_text = engine.lower_step(engine.init_state(2, 7)).as_text()
    assert "all_to_all" in round_text  # the round's MoE layers really run expert-parallel
    assert [list(t) for t in sharded.tokens] == [list(t) for t in ref.tokens]


def test_tensor_parallel_llama_generation_gives_the_single_device_tokens():
    from flax import nnx

    from jax_dspark.models.dspark import tiny_dspark
    from jax_dspark.models.llama import tiny_llama
    from jax_dspark.spec.engine import generate

    target = tiny_llama(0)
    drafter = tiny_dspark(target.config, seed=1)
    prompts = [[5, 17, 300, 2], [40, 41, 42]]
    ref = generate(target, drafter, prompts, max_new_tokens=6)
    mesh = parallel.make_mesh(tensor=2)
    assert parallel.rules_for(target) is parallel.LLAMA_RULES
    for model in (target, drafter):
        parallel.shard_model(model, mesh)
    assert nnx.state(target)["layers"]["wq"][...].sharding.spec == P(None, None, "tensor")
    sharded = generate(target, drafter, prompts, max_new_tokens=6)
    assert sharded.tokens == ref.tokens
