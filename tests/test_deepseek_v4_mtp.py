"""DeepSeek-V4 MTP block: cached forward equivalences, rollback, and the MTP drafter.

The MTP forward's inputs are the target's final streams and the next tokens, so the
forward tests feed random streams (no target forward needed). Every forward goes through
the jitted `deepseek_v4_mtp.forward` compiled once per shape at XLA optimisation level 0
(B = 3, S in {32, 4}; "decode" is an S = 4 call with one real row, so padding rows are
exercised everywhere). Tiny config with the MTP block: window 8, so 30 positions cross
the window many times.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dspark.models import deepseek_v4 as v4
from jax_dspark.models import deepseek_v4_mtp as mtp
from jax_dspark.ops.sampling import SamplingParams
from jax_dspark.spec.engine import generate

CFG = v4.tiny().replace(num_mtp_layers=1)
B, MAX_LEN, BIG, SMALL, T = 3, 64, 32, 4, 30
FAST_COMPILE = {"xla_backend_optimization_level": 0}
ATOL = 2e-4
N, D = CFG.hc_mult, CFG.hidden_size


@pytest.fixture(scope="module")
def fx():
    target = v4.DeepseekV4(CFG, rngs=nnx.Rngs(0), capture_streams=True)
    graphdef, params = nnx.split(target)
    compiled = {}

    def run(cache, streams, next_tokens, slots, starts, lengths):
        args = [cache, jnp.asarray(streams, jnp.float32)] + [
            jnp.asarray(a, jnp.int32) for a in (next_tokens, slots, starts, lengths)]
        shape = args[2].shape
        if shape not in compiled:
            compiled[shape] = mtp.forward.lower(graphdef, params, *args).compile(
                compiler_options=FAST_COMPILE)
        logits, out, cache = compiled[shape](params, *args)
        return np.asarray(logits), np.asarray(out), cache

    def new_cache():
        return mtp.init_mtp_cache(CFG, B - 1, MAX_LEN, max_tokens_per_call=BIG, page_size=4)

    return types.SimpleNamespace(target=target, run=run, new_cache=new_cache, scratch=B - 1)


def _sequences(seed: int):
    """Random final streams `[B, T, n, d]` of positions 0..T-1 and tokens `[B, T + 1]`."""
    rng = np.random.default_rng(seed)
    streams = rng.standard_normal((B, T, N, D)).astype(np.float32)
    tokens = rng.integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    return streams, tokens


def _call(fx, cache, seqs, rows, width, junk_seed):
    """One call of `width` rows; `rows[b] = (start, count)` (count 0 = padding request):
    row j of request b is (streams[b, start + j], tokens[b, start + j + 1]) at start + j."""
    streams, tokens = seqs
    rng = np.random.default_rng(junk_seed)
    x = rng.standard_normal((B, width, N, D)).astype(np.float32)
    nxt = rng.integers(0, CFG.vocab_size, (B, width)).astype(np.int32)
    for b, (start, count) in enumerate(rows):
        x[b, :count] = streams[b, start:start + count]
        nxt[b, :count] = tokens[b, start + 1:start + 1 + count]
    slots = [b if count else fx.scratch for b, (_, count) in enumerate(rows)]
    return fx.run(cache, x, nxt, slots, [s for s, _ in rows], [c for _, c in rows])


def test_one_call_over_a_sequence_equals_row_by_row_calls(fx):
    seqs = _sequences(1)
    lengths = [30, 23, 0]
    full, full_out, _ = _call(fx, fx.new_cache(), seqs, [(0, n) for n in lengths], BIG, 90)
    cache = fx.new_cache()
    for p in range(T):
        rows = [(p, 1) if p < lengths[b] else (0, 0) for b in range(B)]
        logits, out, cache = _call(fx, cache, seqs, rows, SMALL, junk_seed=p)
        for b in range(2):
            if p < lengths[b]:
                np.testing.assert_allclose(logits[b, 0], full[b, p], atol=ATOL,
                                           err_msg=f"request {b} position {p}")
                np.testing.assert_allclose(out[b, 0], full_out[b, p], atol=ATOL)


def test_rows_written_past_the_committed_length_leave_no_trace(fx):
    """Write 4 rows, keep fewer (rollback = continue from the kept length) with junk in the
    rejected ones, continue: logits equal a clean one-call run."""
    seqs = _sequences(2)
    full, _, _ = _call(fx, fx.new_cache(), seqs, [(0, T), (0, T), (0, 0)], BIG, 91)
    starts, kept = [13, 6], [2, 1]
    _, _, cache = _call(fx, fx.new_cache(), seqs, [(0, starts[0]), (0, starts[1]), (0, 0)], BIG, 92)
    streams, tokens = seqs
    junk_streams, junk_tokens = _sequences(3)
    # Rejected rows: this request's rows up to `kept`, then other streams and tokens.
    mixed = (streams.copy(), tokens.copy())
    for b in range(2):
        lo = starts[b] + kept[b]
        mixed[0][b, lo:] = junk_streams[b, lo:]
        mixed[1][b, lo + 1:] = junk_tokens[b, lo + 1:]
    _, _, cache = _call(fx, cache, mixed, [(starts[0], SMALL), (starts[1], SMALL), (0, 0)],
                        SMALL, 93)
    done = [s + k for s, k in zip(starts, kept)]
    for step in range(5):
        rows = [(done[b], min(SMALL, T - done[b])) for b in range(2)] + [(0, 0)]
        logits, _, cache = _call(fx, cache, seqs, rows, SMALL, 94 + step)
        for b in range(2):
            for j in range(rows[b][1]):
                np.testing.assert_allclose(logits[b, j], full[b, done[b] + j], atol=ATOL,
                                           err_msg=f"request {b} position {done[b] + j}")
            done[b] += rows[b][1]


def test_padding_requests_never_change_other_requests(fx):
    seqs = _sequences(4)
    results = []
    for variant, (len1, junk) in enumerate([(0, 20), (30, 21)]):
        # Variant 0: request 1 pads on the scratch slot; variant 1: it is real.
        logits, out, cache = _call(fx, fx.new_cache(), seqs, [(0, 20), (0, len1), (0, 0)], BIG, junk)
        nxt, _, _ = _call(fx, cache, seqs, [(20, SMALL), (0, SMALL) if variant else (0, 0), (0, 0)],
                          SMALL, 30 + variant)
        results.append((logits[0, :20], out[0, :20], nxt[0]))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=1e-5)


@functools.partial(jax.jit, static_argnames=("d_graph", "t_graph"))
def _commit_and_draft(d_graph, d_params, t_graph, t_params, state, commits, anchor, lengths):
    """`commits` = [(tokens, hiddens, slots, starts, counts), ...], then one greedy draft."""
    drafter, target = nnx.merge(d_graph, d_params), nnx.merge(t_graph, t_params)
    for tokens, hiddens, slots, starts, counts in commits:
        state = drafter.commit(target, state, tokens=tokens, hiddens=hiddens, slots=slots,
                               starts=starts, counts=counts)
    slots = jnp.asarray([0, 1, B - 1], jnp.int32)
    p = drafter.draft(target, state, jax.random.key(0), anchor=anchor, slots=slots,
                      lengths=lengths, sampling=SamplingParams())
    return p.tokens, p.logits


def test_drafter_commits_then_drafts_what_the_forward_predicts(fx):
    """Two commits (one split mid-sequence, junk past `counts`, a padding request), then a
    2-step chained draft: step 0 equals the one-call forward's row L - 1 (streams of L - 1,
    the anchor t_L); step 1 equals a forward row at L fed step 0's output streams and draft."""
    streams, tokens = _sequences(5)
    s = 16
    drafter = mtp.MTPDrafter(CFG, block_size=2, max_tokens_per_call=s, page_size=4)
    n_cap = len(CFG.capture_layers)
    rng = np.random.default_rng(6)
    commits, done = [], [0, 0]
    for counts in ([13, 9, 0], [7, 8, 0]):
        hid = rng.standard_normal((B, s, n_cap + N, D)).astype(np.float32)
        tok = rng.integers(0, CFG.vocab_size, (B, s)).astype(np.int32)
        for b in range(2):
            hid[b, :counts[b], n_cap:] = streams[b, done[b]:done[b] + counts[b]]
            tok[b, :counts[b]] = tokens[b, done[b]:done[b] + counts[b]]
        commits.append(tuple(jnp.asarray(a) for a in (
            tok, hid, np.asarray([0, 1, B - 1], np.int32), np.asarray(done + [0], np.int32),
            np.asarray(counts, np.int32))))
        done = [done[b] + counts[b] for b in range(2)]
    lengths = np.asarray(done + [0], np.int32)                      # [20, 17, 0]
    anchor = np.asarray([tokens[0, done[0]], tokens[1, done[1]], 0], np.int32)
    drafts, logits = _commit_and_draft(*nnx.split(drafter), *nnx.split(fx.target),
                                       drafter.init_state(B - 1, MAX_LEN), commits,
                                       jnp.asarray(anchor), jnp.asarray(lengths))
    drafts, logits = np.asarray(drafts), np.asarray(logits)

    full, full_out, cache = _call(fx, fx.new_cache(), (streams, tokens),
                                  [(0, done[0]), (0, done[1]), (0, 0)], BIG, 95)
    x = np.zeros((B, SMALL, N, D), np.float32)
    nxt = np.zeros((B, SMALL), np.int32)
    for b in range(2):
        x[b, 0] = full_out[b, done[b] - 1]
        nxt[b, 0] = drafts[b, 0]
    second, _, _ = fx.run(cache, x, nxt, [0, 1, fx.scratch], done + [0], [1, 1, 0])
    for b in range(2):
        np.testing.assert_allclose(logits[b, 0], full[b, done[b] - 1], atol=ATOL, err_msg=f"request {b}")
        np.testing.assert_allclose(logits[b, 1], second[b, 0], atol=ATOL, err_msg=f"request {b}")
        assert drafts[b, 0] == np.argmax(full[b, done[b] - 1])


def test_commit_rejects_hiddens_without_the_final_streams(fx):
    drafter = mtp.MTPDrafter(CFG)
    plain = jnp.ones((1, 2, len(CFG.capture_layers), D), jnp.float32)
    with pytest.raises(ValueError, match="capture_streams"):
        drafter.commit(fx.target, drafter.init_state(1, 8), tokens=jnp.zeros((1, 2), jnp.int32),
                       hiddens=plain, slots=jnp.zeros((1,), jnp.int32),
                       starts=jnp.zeros((1,), jnp.int32), counts=jnp.ones((1,), jnp.int32))


def test_drafter_rejects_a_config_without_the_mtp_block():
    with pytest.raises(ValueError, match="num_mtp_layers"):
        mtp.MTPDrafter(v4.tiny())


PROMPTS = [[5, 17, 100], list(range(40, 51)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 99, 98, 97, 96, 95, 94, 93, 1, 2, 3]]


def test_greedy_speculative_output_equals_greedy_plain_decoding(greedy_errors):
    """MTP-1 through the engine (chained blocks are pinned by the commit/draft test above;
    the engine's losslessness does not depend on the block size)."""
    target = v4.DeepseekV4(CFG, rngs=nnx.Rngs(1), capture_streams=True)
    spec = generate(target, mtp.MTPDrafter(CFG), PROMPTS, max_new_tokens=9)
    assert greedy_errors(target, PROMPTS, spec.tokens) == []
