"""Confidence scheduling: survival, SPS table, Algorithm 1, budgeted top-K, Appendix A, profiler."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark.spec import (
    SpsTable,
    allocate_topk,
    profile_sps,
    schedule_budgeted,
    schedule_causal,
    sps_at,
    survival,
    verify_budget,
)


def _staircase(max_tokens: int = 40, step: int = 4, seed: int = 0) -> SpsTable:
    """Throughput that drops in jagged steps every `step` tokens (listed at every integer)."""
    rng = np.random.default_rng(seed)
    tokens = np.arange(1, max_tokens + 1)
    levels = 100.0 / (1.0 + np.cumsum(rng.uniform(0.0, 0.6, max_tokens // step + 1)))
    return SpsTable.create(tokens, levels[(tokens - 1) // step])


def _random_survival(rng: np.random.Generator, b: int, g: int) -> jax.Array:
    return survival(jnp.asarray(rng.uniform(0.3, 1.0, (b, g)), jnp.float32))


def _theta(a: np.ndarray, lengths: np.ndarray, table: SpsTable) -> float:
    """tau * SPS(B) of a choice of verify lengths (all requests active)."""
    tau = len(lengths) + sum(a[r, :l].sum() for r, l in enumerate(lengths))
    return float(tau * sps_at(table, len(lengths) + int(np.sum(lengths))))


# ---------------------------------------------------------------- survival and table


def test_survival_is_the_cumulative_product_of_confidences():
    c = jax.random.uniform(jax.random.key(0), (3, 5))
    np.testing.assert_allclose(np.asarray(survival(c)), np.cumprod(np.asarray(c), axis=1), rtol=1e-6)
    assert np.all(np.diff(np.asarray(survival(c)), axis=1) <= 0)


def test_survival_rejects_wrong_rank():
    with pytest.raises(ValueError, match="confidence"):
        survival(jnp.ones((2, 3, 4)))


def test_sps_table_interpolates_linearly_and_clamps_outside():
    table = SpsTable.create([2, 6, 10], [50.0, 30.0, 10.0])
    got = np.asarray(sps_at(table, jnp.array([0, 2, 4, 6, 9, 10, 40])))
    np.testing.assert_allclose(got, [50, 50, 40, 30, 15, 10, 10], rtol=1e-6)


@pytest.mark.parametrize("tokens,sps,name", [
    ([1, 3, 2], [3.0, 2.0, 1.0], "tokens"),
    ([1, 2, 3], [3.0, 0.0, 1.0], "steps_per_s"),
    ([1, 2, 3], [3.0, 2.0], "steps_per_s"),
    ([], [], "tokens"),
])
def test_sps_table_rejects_malformed_input(tokens, sps, name):
    with pytest.raises(ValueError, match=name):
        SpsTable.create(tokens, sps)


# ---------------------------------------------------------------- Algorithm 1


def _algorithm1_reference(a: np.ndarray, table: SpsTable) -> np.ndarray:
    """The paper's Algorithm 1, written as its plain loop."""
    b, g = a.shape
    cands = sorted(((a[r, j], j, r) for r in range(b) for j in range(g) if a[r, j] > 0),
                   key=lambda t: (-t[0], t[1], t[2]))
    lengths = np.zeros(b, int)
    tokens, tau = b, float(b)
    best = tau * float(sps_at(table, tokens))
    for value, j, r in cands:
        theta = (tau + value) * float(sps_at(table, tokens + 1))
        if not theta > best:
            break
        lengths[r], tokens, tau, best = j + 1, tokens + 1, tau + value, theta
    return lengths


@pytest.mark.parametrize("seed", range(10))
def test_causal_greedy_matches_the_papers_loop_on_a_staircase(seed):
    rng = np.random.default_rng(seed)
    table = _staircase(seed=seed)
    a = _random_survival(rng, 4, 5)
    got = np.asarray(jax.jit(schedule_causal)(a, table))
    np.testing.assert_array_equal(got, _algorithm1_reference(np.asarray(a, np.float64), table))


def test_causal_greedy_stops_at_the_first_non_improvement():
    """Verifying 2 would pay off, but verifying 1 does not, so Algorithm 1 verifies 0."""
    table = SpsTable.create([1, 2, 3], [1.0, 0.5, 0.45])
    a = jnp.array([[0.8, 0.8]])
    assert int(schedule_causal(a, table)[0]) == 0
    assert int(schedule_budgeted(a, table)[0]) == 2


def test_causal_greedy_gives_inactive_requests_nothing_and_does_not_count_them():
    table = _staircase(seed=3)
    a = _random_survival(np.random.default_rng(3), 3, 4)
    active = jnp.array([True, False, True])
    got = np.asarray(schedule_causal(a, table, active=active))
    assert got[1] == 0
    np.testing.assert_array_equal(got[[0, 2]], np.asarray(schedule_causal(a[jnp.array([0, 2])], table)))


# ---------------------------------------------------------------- budgeted variant


def _oracle_theta(a: np.ndarray, table: SpsTable, min_len: int, max_len: int) -> float:
    """Best tau * SPS(B) over every choice of per-request lengths in [min_len, max_len]."""
    b = a.shape[0]
    return max(_theta(a, np.array(ls), table)
               for ls in itertools.product(range(min_len, max_len + 1), repeat=b))


@pytest.mark.parametrize("seed", range(25))
def test_budgeted_schedule_matches_brute_force_on_a_staircase(seed):
    rng = np.random.default_rng(100 + seed)
    b, g = 3, 4
    min_len = int(rng.integers(0, 2))
    max_len = int(rng.integers(max(min_len, 1), g + 1))
    table = _staircase(max_tokens=int(rng.integers(6, 20)), step=int(rng.integers(2, 5)), seed=seed)
    a = _random_survival(rng, b, g)
    run = jax.jit(functools.partial(schedule_budgeted, min_len=min_len, max_len=max_len))
    lengths = np.asarray(run(a, table))
    assert np.all((lengths >= min_len) & (lengths <= max_len))
    a64 = np.asarray(a, np.float64)
    assert _theta(a64, lengths, table) == pytest.approx(_oracle_theta(a64, table, min_len, max_len), rel=1e-5)


def test_global_argmax_beats_stopping_at_the_first_descent():
    """A jagged table dips then rises: the first descent would stop at a far worse budget."""
    table = SpsTable.create([1, 2, 3, 4, 5, 6], [10.0, 6.0, 5.9, 5.8, 5.7, 5.6])
    a = jnp.full((1, 5), 0.99) ** jnp.arange(1, 6)
    lengths = schedule_budgeted(a, table)
    first_descent = _theta(np.asarray(a, np.float64), np.array([0]), table)
    assert _theta(np.asarray(a, np.float64), np.asarray(lengths), table) >= 2 * first_descent


def test_flat_cost_table_verifies_every_position_above_eps():
    a = jnp.array([[0.9, 0.5, 1e-7], [0.7, 0.2, 0.1]])
    flat = SpsTable.create([1, 100], [5.0, 5.0])
    np.testing.assert_array_equal(np.asarray(schedule_budgeted(a, flat)), [2, 3])


def test_low_confidence_gives_a_small_budget():
    table = _staircase(seed=5)
    high = survival(jnp.full((4, 5), 0.95))
    low = survival(jnp.full((4, 5), 0.05))
    assert int(verify_budget(low, table)) < int(verify_budget(high, table))
    assert int(verify_budget(low, table)) == 0


def test_budget_is_zero_when_no_request_is_active():
    a = _random_survival(np.random.default_rng(6), 3, 4)
    assert int(verify_budget(a, _staircase(), active=jnp.zeros((3,), bool))) == 0


def test_allocation_is_a_prefix_within_bounds_and_prefers_confident_requests():
    a = survival(jnp.array([[0.9, 0.9, 0.9, 0.9], [0.3, 0.9, 0.9, 0.9], [0.95, 0.95, 0.5, 0.5]]))
    lengths = np.asarray(allocate_topk(a, jnp.int32(4), min_len=1, max_len=4))
    # Candidates beyond the floor (position >= 1) by survival: r2j1 .903, r0j1 .81, r0j2 .729,
    # r0j3 .656, r2j2 .451, ... -> admit 4.
    np.testing.assert_array_equal(lengths, [4, 1, 2])


def test_zero_budget_gives_everyone_the_floor_and_huge_budget_the_cap():
    a = _random_survival(np.random.default_rng(7), 3, 5)
    np.testing.assert_array_equal(np.asarray(allocate_topk(a, jnp.int32(0), min_len=2)), [2, 2, 2])
    np.testing.assert_array_equal(np.asarray(allocate_topk(a, jnp.int32(1000), min_len=1, max_len=4)), [4, 4, 4])


def test_survival_eps_excludes_hopeless_positions():
    a = jnp.array([[0.9, 0.5, 5e-7, 1e-9], [0.8, 2e-6, 1e-6, 1e-7]])
    np.testing.assert_array_equal(np.asarray(allocate_topk(a, jnp.int32(100))), [2, 3])


def test_ties_break_toward_earlier_positions_then_lower_requests():
    a = jnp.array([[1.0, 0.5, 0.5], [0.5, 0.5, 0.5], [1.0, 1.0, 0.5]])
    # Candidates equal to 0.5: (r0,j1) (r1,j0) (r1,j1) (r0,j2) ... order by (position, request):
    # j0: r1; j1: r0, r1; j2: r0, r1, r2.  The 1.0s (r0j0, r2j0, r2j1) go first.
    lengths = allocate_topk(a, jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(lengths), [2, 1, 2])
    again = jax.jit(allocate_topk)(a, jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(lengths))


def test_inactive_requests_get_zero_length_and_no_floor():
    a = _random_survival(np.random.default_rng(8), 3, 4)
    lengths = allocate_topk(a, jnp.int32(3), min_len=1, active=jnp.array([True, False, True]))
    assert int(lengths[1]) == 0 and np.all(np.asarray(lengths)[[0, 2]] >= 1)


def test_schedule_bounds_are_validated():
    a = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="min_len"):
        allocate_topk(a, jnp.int32(1), min_len=3, max_len=2)
    with pytest.raises(ValueError, match="max_len"):
        verify_budget(a, _staircase(), max_len=4)


# ---------------------------------------------------------------- Appendix A


P_TARGET = np.array([0.7, 0.3])
P_DRAFT = np.array([0.5, 0.5])
APPENDIX_A_TABLE = SpsTable.create([1, 2, 3], [1.0, 0.5, 0.45])


def _confidence_after(x1: int) -> np.ndarray:
    """The head scores draft 1 without seeing it (0.8 = its true acceptance rate) and draft 2
    knowing the realised draft 1: sure after token 0, hopeless after token 1."""
    return np.array([[0.8, 1.0 if x1 == 0 else 0.0]])


def _first_token_law(schedule) -> np.ndarray:
    """Exact law of the first emitted token: enumerate both drafts, schedule, verify."""
    law = np.zeros(2)
    for x1, x2 in itertools.product(range(2), repeat=2):
        weight = P_DRAFT[x1] * P_DRAFT[x2]
        length = int(schedule(survival(jnp.asarray(_confidence_after(x1), jnp.float32)))[0])
        if length == 0:
            law += weight * P_TARGET  # no draft verified: the target's own sample
            continue
        accept = min(1.0, P_TARGET[x1] / P_DRAFT[x1])
        residual = np.maximum(P_TARGET - P_DRAFT, 0.0)
        law[x1] += weight * accept
        law += weight * (1.0 - accept) * residual / residual.sum()
    return law


def test_appendix_a_look_ahead_scheduler_distorts_the_output_distribution():
    law = _first_token_law(lambda a: schedule_budgeted(a, APPENDIX_A_TABLE))
    np.testing.assert_allclose(law, [0.85, 0.15], atol=1e-6)


def test_appendix_a_early_stop_scheduler_keeps_the_target_distribution():
    law = _first_token_law(lambda a: schedule_causal(a, APPENDIX_A_TABLE))
    np.testing.assert_allclose(law, [0.7, 0.3], atol=1e-6)


# ---------------------------------------------------------------- profiler


def test_profiler_times_each_count_with_fresh_inputs_and_returns_a_table():
    built = []

    @functools.partial(jax.jit, donate_argnums=0)
    def step(x):
        return x * 2.0 + 1.0

    def make_inputs(n):
        built.append(n)
        return (jax.random.normal(jax.random.key(n), (n, 8)),)

    table = profile_sps(step, make_inputs, [2, 4, 8], warmup=1, repeats=3)
    np.testing.assert_array_equal(np.asarray(table.tokens), [2, 4, 8])
    assert np.all(np.asarray(table.steps_per_s) > 0)
    assert built == [2] * 4 + [4] * 4 + [8] * 4
    assert schedule_causal(jnp.full((2, 3), 0.5), table).shape == (2,)


def test_profiler_rejects_zero_warmup():
    with pytest.raises(ValueError, match="warmup"):
        profile_sps(lambda x: x, lambda n: (jnp.ones(n),), [1], warmup=0)
