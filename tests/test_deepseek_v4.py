"""DeepSeek-V4 target on the tiny config: cached forward equivalences, mHC, compressor,
routing, parameter totals.

Every forward goes through the jitted entry point `deepseek_v4.forward` (cache donated),
compiled once per shape at XLA backend optimisation level 0 to keep CPU compile time
down (numerics are unaffected). Two shapes only: B = 3 and S in {32, 4}; decode is the
S = 4 call with one real row (the other rows are padding), which also exercises padding
rows everywhere.

Tiny config: window 8, CSA ratio 2 (indexer top-3), HCA ratio 8, layers SWA/CSA/HCA/CSA,
first two layers hash-routed; 30-token sequences cross many window and compression
boundaries.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dspark import cache as kvcache
from jax_dspark.models import deepseek_v4 as v4
from jax_dspark.models.deepseek_v4_mhc import mhc_post, sinkhorn

B, MAX_LEN, BIG, SMALL = 3, 64, 32, 4
FAST_COMPILE = {"xla_backend_optimization_level": 0}
ATOL = 2e-4


@pytest.fixture(scope="module")
def target():
    cfg = v4.tiny()
    model = v4.DeepseekV4(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    compiled = {}

    def run(cache, tokens, slots, starts, lengths):
        args = [cache] + [jnp.asarray(a, jnp.int32) for a in (tokens, slots, starts, lengths)]
        shape = args[1].shape
        if shape not in compiled:
            compiled[shape] = v4.forward.lower(graphdef, params, *args).compile(
                compiler_options=FAST_COMPILE)
        logits, hiddens, cache = compiled[shape](params, *args)
        return np.asarray(logits), np.asarray(hiddens), cache

    def new_cache():
        return model.init_cache(B - 1, MAX_LEN, max_tokens_per_call=BIG, page_size=4)

    return types.SimpleNamespace(cfg=cfg, model=model, run=run, new_cache=new_cache,
                                 scratch=B - 1)


def _tokens(seed: int, shape, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _prefill(t, seqs, lengths, junk_seed=99):
    """One S = 32 call: request b = seqs[b][:lengths[b]] in slot b (length 0 = padding)."""
    cache = t.new_cache()
    tokens = _tokens(junk_seed, (B, BIG), t.cfg.vocab_size)
    for b, n in enumerate(lengths):
        tokens[b, :n] = seqs[b][:n]
    slots = [b if n else t.scratch for b, n in enumerate(lengths)]
    return t.run(cache, tokens, slots, [0] * B, lengths)


def _step(t, cache, rows, starts, junk_seed):
    """One S = 4 call; rows[b] = list of real tokens (<= 4) of request b, [] = padding."""
    tokens = _tokens(junk_seed, (B, SMALL), t.cfg.vocab_size)
    lengths = []
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
        lengths.append(len(r))
    slots = [b if rows[b] else t.scratch for b in range(B)]
    return t.run(cache, tokens, slots, starts, lengths)


# ---- mHC ------------------------------------------------------------------------------

def test_sinkhorn_output_is_doubly_stochastic():
    """20 rounds ending on a column step: columns exact to eps, rows to the Sinkhorn
    residual (~2e-4 for unit-scale logits, what mHC's scaled projections produce)."""
    logits = jax.random.normal(jax.random.key(0), (256, 4, 4))
    m = np.asarray(sinkhorn(logits, 20, 1e-6))
    assert (m > 0).all()
    np.testing.assert_allclose(m.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(m.sum(-1), 1.0, atol=1e-3)


def test_mhc_post_mixes_streams_through_comb_transposed():
    rng = np.random.default_rng(1)
    y, x = rng.standard_normal((2, 5)), rng.standard_normal((2, 4, 5))
    post, comb = rng.random((2, 4)), rng.random((2, 4, 4))
    got = np.asarray(mhc_post(jnp.asarray(y), jnp.asarray(x), jnp.asarray(post),
                              jnp.asarray(comb)))
    want = post[..., None] * y[:, None] + np.einsum("tij,tid->tjd", comb, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- MoE ------------------------------------------------------------------------------

def _swiglu(h, limit):
    g, u = np.split(h, 2, axis=-1)
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-g)) * u


def test_hash_layers_route_by_token_id(target):
    cfg = target.cfg
    moe = target.model.layers[0].mlp
    assert cfg.is_hash_layer(0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, cfg.hidden_size)).astype(np.float32)
    tok = np.array([5, 5, 17, 99, 17, 3], np.int32)
    got = np.asarray(moe(jnp.asarray(x), jnp.asarray(tok)))
    w_gate = np.asarray(moe.gate.weight[...])
    table = np.asarray(moe.gate.tid2eid[...])
    up, down = np.asarray(moe.experts.gate_up_proj[...]), np.asarray(moe.experts.down_proj[...])
    s_up, s_down = (np.asarray(moe.shared_experts.gate_up_proj[...]),
                    np.asarray(moe.shared_experts.down_proj[...]))
    scores = np.sqrt(np.logaddexp(0.0, x @ w_gate))
    want = np.zeros_like(x)
    for t in range(len(tok)):
        ids = table[tok[t]]
        w = scores[t, ids] / scores[t, ids].sum() * cfg.routed_scale
        for e, we in zip(ids, w):
            want[t] += we * (_swiglu(x[t] @ up[e], cfg.swiglu_limit) @ down[e])
        want[t] += _swiglu(x[t] @ s_up, cfg.swiglu_limit) @ s_down
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---- compressor -----------------------------------------------------------------------

@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_streaming_compressor_matches_batch_compressor(target, layer):
    cfg, model = target.cfg, target.model
    comp = model.layers[layer].self_attn.compressor
    _, table = v4.rope_tables(cfg, MAX_LEN + BIG)
    spec = model.cache_specs()[layer]
    lc = kvcache.init_layer_cache(spec, B - 1, MAX_LEN, max_tokens_per_call=SMALL,
                                  page_size=4, dtype=jnp.float32)
    rng = np.random.default_rng(3)
    total = 29
    x = rng.standard_normal((total, cfg.hidden_size)).astype(np.float32)

    def step(lc, xb, starts, lengths):
        slots = jnp.array([0, B - 1], jnp.int32)
        kw = dict(slots=slots, starts=starts, lengths=lengths, table=table)
        state, entries = comp.stream(lc.state, lc.entries, xb, **kw)
        if comp.indexer is None:
            return state, entries, None, None
        istate, keys = comp.indexer.stream(lc.index_state, lc.index_keys, xb, **kw)
        return state, entries, istate, keys

    step = jax.jit(step, compiler_options=FAST_COMPILE)
    pos, chunks = 0, [3, 1, 4, 2, 4, 4, 1, 3, 4, 3]
    assert sum(chunks) == total
    for n in chunks:
        xb = rng.standard_normal((2, SMALL, cfg.hidden_size)).astype(np.float32)
        xb[0, :n] = x[pos:pos + n]
        state, entries, istate, keys = step(lc, jnp.asarray(xb), jnp.array([pos, 0]),
                                            jnp.array([n, 0]))
        lc = kvcache.V4LayerCache(window=lc.window, entries=entries, state=state,
                                  index_keys=keys, index_state=istate)
        pos += n
    n_ent = total // comp.ratio
    ids = kvcache.row_index(lc.entries, jnp.array([0], jnp.int32), jnp.arange(n_ent)[None])
    got = np.asarray(kvcache.read_rows(lc.entries, ids))[0]
    want = np.asarray(comp.compress_sequence(jnp.asarray(x), table))
    assert want.shape == (n_ent, cfg.head_dim)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if comp.indexer is not None:
        got_k = np.asarray(kvcache.read_rows(lc.index_keys, ids))[0]
        want_k = np.asarray(comp.indexer.keys_sequence(jnp.asarray(x), table))
        np.testing.assert_allclose(got_k, want_k, rtol=1e-4, atol=1e-4)


# ---- cached forward equivalences -------------------------------------------------------

def test_decode_logits_match_prefill_logits(target):
    lengths = [30, 23, 0]
    seqs = _tokens(4, (B, 30), target.cfg.vocab_size)
    full, full_h, _ = _prefill(target, seqs, lengths)
    cache = target.new_cache()
    for p in range(30):
        rows = [[int(seqs[b, p])] if p < lengths[b] else [] for b in range(B)]
        logits, hid, cache = _step(target, cache, rows, [p] * B, junk_seed=p)
        for b in range(2):
            if p < lengths[b]:
                np.testing.assert_allclose(logits[b, 0], full[b, p], atol=ATOL,
                                           err_msg=f"request {b} position {p}")
                np.testing.assert_allclose(hid[b, 0], full_h[b, p], atol=ATOL)


def test_chunked_prefill_matches_one_prefill(target):
    lengths = [30, 27, 0]
    seqs = _tokens(5, (B, 30), target.cfg.vocab_size)
    full, _, _ = _prefill(target, seqs, lengths)
    chunk_sizes = {0: [3, 4, 4, 1, 4, 2, 4, 4, 4], 1: [4, 4, 2, 3, 4, 4, 1, 4, 1]}
    cache, done = target.new_cache(), [0, 0, 0]
    for step in range(9):
        rows = [[], [], []]
        for b in range(2):
            n = chunk_sizes[b][step]
            rows[b] = [int(t) for t in seqs[b, done[b]:done[b] + n]]
        logits, _, cache = _step(target, cache, rows, done, junk_seed=100 + step)
        for b in range(2):
            for j, _ in enumerate(rows[b]):
                np.testing.assert_allclose(logits[b, j], full[b, done[b] + j], atol=ATOL,
                                           err_msg=f"request {b} position {done[b] + j}")
            done[b] += len(rows[b])
    assert done[:2] == [30, 27]


def test_verify_of_s_tokens_matches_s_decode_steps(target):
    lengths = [21, 14, 0]
    seqs = _tokens(6, (B, 25), target.cfg.vocab_size)
    drafts = [[int(t) for t in seqs[b, lengths[b]:lengths[b] + SMALL]] for b in range(2)]
    _, _, cache = _prefill(target, seqs, lengths)
    ver, ver_h, _ = _step(target, cache, drafts + [[]], lengths, junk_seed=7)
    _, _, cache = _prefill(target, seqs, lengths)
    for j in range(SMALL):
        rows = [[drafts[0][j]], [drafts[1][j]], []]
        starts = [lengths[0] + j, lengths[1] + j, 0]
        logits, hid, cache = _step(target, cache, rows, starts, junk_seed=8 + j)
        for b in range(2):
            np.testing.assert_allclose(ver[b, j], logits[b, 0], atol=ATOL)
            np.testing.assert_allclose(ver_h[b, j], hid[b, 0], atol=ATOL)


def test_rejected_drafts_leave_no_trace_after_rollback(target):
    """Verify 4 rows, commit fewer (rollback = just continuing from the committed
    length), continue with other tokens: logits equal a clean run of the committed
    sequence. The rejected rows sit on window, CSA and HCA (position 15) boundaries."""
    vocab = target.cfg.vocab_size
    seqs = _tokens(9, (B, 30), vocab)
    full, _, _ = _prefill(target, seqs, [30, 30, 0])
    starts = [13, 14]          # verify rows cover positions 13-16 and 14-17
    accepted = [2, 1]          # rows kept (anchor + drafts); the rest are rejected
    _, _, cache = _prefill(target, seqs, starts + [0])
    junk = _tokens(10, (2, SMALL), vocab)
    rows = []
    for b in range(2):
        keep = [int(t) for t in seqs[b, starts[b]:starts[b] + accepted[b]]]
        rows.append(keep + [int(t) for t in junk[b, :SMALL - accepted[b]]])
    _, _, cache = _step(target, cache, rows + [[]], starts + [0], junk_seed=11)
    done = [s + a for s, a in zip(starts, accepted)]
    for step in range(4):
        rows = [[int(t) for t in seqs[b, done[b]:min(done[b] + SMALL, 30)]] for b in range(2)]
        logits, _, cache = _step(target, cache, rows + [[]], done + [0], junk_seed=12 + step)
        for b in range(2):
            for j, _ in enumerate(rows[b]):
                np.testing.assert_allclose(logits[b, j], full[b, done[b] + j], atol=ATOL,
                                           err_msg=f"request {b} position {done[b] + j}")
            done[b] += len(rows[b])


def test_padding_requests_never_change_other_requests(target):
    vocab = target.cfg.vocab_size
    seqs = _tokens(13, (B, 30), vocab)
    results = []
    for variant, (len1, junk) in enumerate([(0, 20), (30, 21)]):
        # Variant 0: request 0 with padding request 1; variant 1: request 1 is real.
        # Both: request 2 pads on the scratch slot; request 0 has 12 padding rows.
        logits, hid, cache = _prefill(target, seqs, [20, len1, 0], junk_seed=junk)
        nxt, _, _ = _step(target, cache, [[int(t) for t in seqs[0, 20:24]],
                                          [int(t) for t in seqs[1, 0:4]] if variant else [],
                                          []], [20, 30 if variant else 0, 0],
                          junk_seed=30 + variant)
        results.append((logits[0, :20], hid[0, :20], nxt[0]))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_too_many_tokens_per_call_is_rejected(target):
    cache = target.model.init_cache(1, 16, max_tokens_per_call=2, page_size=4)
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="max_tokens_per_call=2"):
        target.model(tokens, cache, slots=jnp.zeros(1, jnp.int32),
                     starts=jnp.zeros(1, jnp.int32), lengths=jnp.ones(1, jnp.int32))


# ---- published sizes ------------------------------------------------------------------

@pytest.mark.parametrize("name,published", [("flash", 284e9), ("pro", 1.6e12)])
def test_parameter_totals_match_published(name, published):
    total = v4.count_params(v4.CONFIGS[name]())
    assert abs(total / published - 1) < 0.03, total


def _expand(pattern: str) -> list[str]:
    """`a.{x,y}.b` -> [`a.x.b`, `a.y.b`] (recursively)."""
    if "{" not in pattern:
        return [pattern]
    head, rest = pattern.split("{", 1)
    inner, tail = rest.split("}", 1)
    return [p for alt in inner.split(",") for p in _expand(head + alt + tail)]


def test_checkpoint_map_covers_every_model_tensor():
    from jax_dspark.models.deepseek_v4_params import CHECKPOINT_MAP

    cfg = v4.tiny().replace(num_mtp_layers=1)
    model = nnx.eval_shape(lambda: v4.DeepseekV4(cfg, rngs=nnx.Rngs(0)))
    ours = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model))}
    layer_paths = [p for _, _, p, _ in CHECKPOINT_MAP if p.startswith("layers.{i}.")]
    mapped = set()
    for _, _, path, _ in CHECKPOINT_MAP:
        if path.startswith("mtp.layer.<"):
            path_list = ["mtp.layer." + p[len("layers.{i}."):] for p in layer_paths]
        else:
            path_list = [path]
        for p in path_list:
            for layer in range(cfg.num_layers):
                mapped.update(_expand(p.replace("{i}", str(layer))))
    assert ours <= mapped, sorted(ours - mapped)
