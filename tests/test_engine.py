"""The speculative engine on the tiny Llama target: losslessness, bookkeeping, one jitted round.

Shapes here (3 prompts of <= 16 tokens, 10 new tokens) match tests/test_generate_cli.py so
the CLI test reuses these compiled programs; keep them in sync.
"""

from __future__ import annotations

import re

import jax
import numpy as np

import pytest

from jax_dspark.models.dspark import tiny_dspark
from jax_dspark.models.dspark_model_drafter import ModelDrafter
from jax_dspark.models.llama import tiny_llama
from jax_dspark.ops.sampling import SamplingParams
from jax_dspark.spec.engine import SpeculativeEngine, generate
from jax_dspark.spec.schedule import SpsTable
from jax_dspark.spec.state import Scheduler

PROMPTS = [[5, 17, 300], list(range(40, 51)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 99, 98, 97, 96, 95, 94, 93]]
MAX_NEW = 10
# Verify throughput falls fast with batch tokens, so the scheduler really trims blocks.
STEEP = SpsTable.create([1.0, 4.0, 8.0, 16.0], [1.0, 0.9, 0.5, 0.2])


@pytest.mark.parametrize("scheduler", [None, Scheduler(table=STEEP)], ids=["verify_all", "causal_schedule"])
def test_greedy_speculative_output_equals_greedy_plain_decoding(scheduler, greedy_errors):
    for seed in (0, 3):
        target = tiny_llama(seed)
        plain = generate(target, None, PROMPTS, max_new_tokens=MAX_NEW, seed=seed)
        spec = generate(target, tiny_dspark(target.config, seed=seed + 1), PROMPTS, max_new_tokens=MAX_NEW,
                        seed=seed, scheduler=scheduler)
        assert spec.tokens == plain.tokens, f"seed {seed}"
        assert greedy_errors(target, PROMPTS, plain.tokens) == [], f"seed {seed}"
        if scheduler is not None:
            assert spec.stats.verify_rate < 1.0, "the steep table should trim some blocks"


def test_prefill_in_chunks_gives_the_same_tokens_as_one_chunk():
    target = tiny_llama(0)
    drafter = tiny_dspark(target.config, seed=1)
    # Chunks of 4 rows: the three prompts end in the first, third and fourth chunk.
    chunked = generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, prefill_chunk=4)
    whole = generate(target, None, PROMPTS, max_new_tokens=MAX_NEW)
    assert chunked.tokens == whole.tokens


def test_target_as_its_own_drafter_is_always_fully_accepted_when_sampling():
    target = tiny_llama(0)
    g = 3
    result = generate(target, ModelDrafter(target, g), PROMPTS, max_new_tokens=MAX_NEW,
                      sampling=SamplingParams(temperature=1.0), seed=1)
    assert result.stats.acceptance_length == g + 1
    assert result.stats.per_position_acceptance == [1.0] * g
    # 1 token from prefill + rounds of g + 1 tokens each.
    assert result.stats.rounds == -(-(MAX_NEW - 1) // (g + 1))
    assert all(len(t) == MAX_NEW for t in result.tokens)


def test_decode_round_lowers_to_one_computation_without_host_callbacks():
    target = tiny_llama(0)
    engine = SpeculativeEngine(
        target, tiny_dspark(target.config), max_new_tokens=6,
        sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
        scheduler=Scheduler(table=STEEP, kind="budgeted", min_len=1),
    )
    text = engine.lower_step(engine.init_state(2, 8)).as_text()
    assert text.count("func.func public") == 1
    assert "callback" not in text.lower()
    targets = set(re.findall(r"custom_call\s*@([\w.]+)", text))
    assert not any("host" in t or "python" in t for t in targets), targets
    # Donated state: the caches are updated in place (input aliased to an output).
    assert len(re.findall(r"tf\.aliasing_output", text)) >= 4


def test_generate_rejects_prompts_with_out_of_vocabulary_ids():
    target = tiny_llama(0)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        generate(target, None, [[1, 2], [3, target.config.vocab_size]], max_new_tokens=2)


def test_a_stop_token_ends_its_request_and_the_rest_are_unchanged(greedy_errors):
    target = tiny_llama(0)
    drafter = tiny_dspark(target.config, seed=1)
    full = generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
    stop = full.tokens[1][3]  # request 1 emits this token at step 3 (maybe earlier too)
    cut = generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, stop_ids=[stop])
    for want, got in zip(full.tokens, cut.tokens):
        end = want.index(stop) + 1 if stop in want else len(want)
        assert got == want[:end]
    assert len(cut.tokens[1]) <= 4 and cut.tokens[1][-1] == stop
    assert greedy_errors(target, PROMPTS, cut.tokens) == []
    with pytest.raises(ValueError, match="stop_ids"):
        generate(target, drafter, PROMPTS, max_new_tokens=2, stop_ids=[target.config.vocab_size])


def _avals(state):
    return jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", False)), state)


@pytest.mark.parametrize("stop_ids", [(), (3, 9)])
def test_compiled_engine_serves_every_round_from_jits_cache(stop_ids):
    """`compile` must fill jit's own dispatch cache for all rounds that follow: an
    ahead-of-time executable (`lower().compile()`) does not serve later calls, and a state
    whose types drift between prefill and round (a weak-typed `num_out` from prefill with
    stop ids, strong after a round) made the second round compile again; both were counted
    by generate as decode time (1-2 s on the SmolLM2 pair, 5x its real round time)."""
    from jax_dspark.spec import engine as engine_mod

    target = tiny_llama(0)
    # A max_new_tokens no other test uses, so this engine's programs are new to the process.
    engine = SpeculativeEngine(target, tiny_dspark(target.config, seed=1), max_new_tokens=13 + len(stop_ids),
                               stop_ids=stop_ids)
    prompts = np.zeros((2, 8), np.int32) + 7
    lens = np.array([8, 5], np.int32)
    before = engine_mod._jit_round._cache_size(), engine_mod._jit_prefill._cache_size()
    engine.compile(engine.init_state(2, 8), prompts, lens)
    compiled = engine_mod._jit_round._cache_size(), engine_mod._jit_prefill._cache_size()
    assert compiled == (before[0] + 1, before[1] + 1)
    fresh = engine.init_state(2, 8)
    types = _avals(fresh)
    state = engine.prefill(fresh, prompts, lens)
    assert _avals(state) == types
    for _ in range(3):
        state = engine.step(state)
        assert _avals(state) == types
    jax.block_until_ready(state.anchor)
    assert (engine_mod._jit_round._cache_size(), engine_mod._jit_prefill._cache_size()) == compiled
