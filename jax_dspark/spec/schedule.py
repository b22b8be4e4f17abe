"""Confidence-scheduled verification: how many drafts of each request to verify.

Spec section 5.2-5.3. With calibrated conditional acceptance probabilities `c[r, j]`, the
survival `a[r, j] = prod_{i <= j} c[r, i]` is the probability that draft `j` of request `r`
is accepted, so verifying `l_r` drafts per request emits `tau = sum_r (1 + sum_{j < l_r}
a[r, j])` tokens in expectation while the verify forward processes `B = sum_r (1 + l_r)`
tokens. The schedulers maximise `tau * SPS(B)`, where `SPS` is the target's measured
verify steps per second at `B` batch tokens (`SpsTable`, from `spec.profile`).

Two variants:

* `schedule_causal`: the paper's Algorithm 1. Admit candidates in order of decreasing
  survival and stop at the FIRST one that does not improve the objective. The early stop
  is what keeps it lossless: `c[r, j+1]` depends on the realised draft `j`, and a search
  that looks past a non-improving step would let that draft's value decide whether it is
  verified (the paper's Appendix A counterexample).
* `schedule_budgeted` = `verify_budget` + `allocate_topk`: the production form. A token
  budget is the GLOBAL argmax of the objective over all budgets (real SPS curves are
  jagged staircases, where a first-descent stop leaves throughput on the table), computed
  from survivals old enough (two rounds back in the engine) that the current drafts cannot
  influence it; the budget is then filled with the top current survivals above a floor of
  `min_len` drafts per request.

Because survivals are non-increasing along a request and ties are broken by (position,
request), every admitted set is a prefix of each request's block, so a count is a length.
All functions are pure `jnp` with static shapes (jittable); an `active` mask lets padding
requests in a fixed-size batch take no part (length 0, no tokens counted).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark.ops import _checks

#: Survivals below this are never worth a verify slot (TRT's `survival_eps`).
SURVIVAL_EPS = 1e-6


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpsTable:
    """Measured verify throughput: steps per second at a few batch-token counts.

    Attributes:
      tokens: `f32[M]` strictly increasing batch-token counts (anchor rows included).
      steps_per_s: `f32[M]` verify steps per second measured at each count (> 0).

    Between entries the table is linearly interpolated, outside it clamped to the end
    values (`sps_at`). A staircase is expressed by listing every integer count. Build
    with `SpsTable.create`, which validates; the class itself is a pytree so a table can
    be a jit argument.
    """

    tokens: jax.Array
    steps_per_s: jax.Array

    @classmethod
    def create(cls, tokens, steps_per_s) -> "SpsTable":
        """Validated table from two equal-length sequences (see the attributes)."""
        t = np.asarray(tokens, np.float64)
        s = np.asarray(steps_per_s, np.float64)
        if t.ndim != 1 or t.size < 1:
            _checks.fail("tokens", "must be a non-empty 1-D sequence", t.shape)
        if s.shape != t.shape:
            _checks.fail("steps_per_s", f"shape must be {t.shape} to match tokens", s.shape)
        if not np.all(np.isfinite(t)) or np.any(np.diff(t) <= 0):
            _checks.fail("tokens", "must be finite and strictly increasing", t.tolist())
        if not np.all(np.isfinite(s)) or np.any(s <= 0):
            _checks.fail("steps_per_s", "must be finite and > 0", s.tolist())
        return cls(tokens=jnp.asarray(t, jnp.float32), steps_per_s=jnp.asarray(s, jnp.float32))


def sps_at(table: SpsTable, tokens: jax.Array) -> jax.Array:
    """Steps per second at `tokens` batch tokens (clamped linear interpolation).

    Args:
      table: the measured table.
      tokens: `[...]` batch-token counts (int or float).
    Returns:
      `f32[...]`.
    """
    return jnp.interp(jnp.asarray(tokens, jnp.float32), table.tokens, table.steps_per_s)


def survival(confidence: jax.Array) -> jax.Array:
    """Survival products `a[r, j] = prod_{i <= j} c[r, i]`.

    Args:
      confidence: `f32[B, g]` calibrated conditional acceptance probabilities in [0, 1]
        (`sts.calibrated_confidence` of the confidence logits).
    Returns:
      `f32[B, g]`, non-increasing along `g`.
    """
    _checks.check_rank("confidence", confidence, 2, "[B, g]")
    return jnp.cumprod(jnp.clip(confidence.astype(jnp.float32), 0.0, 1.0), axis=1)


def _active_mask(name: str, active: jax.Array | None, b: int) -> jax.Array:
    if active is None:
        return jnp.ones((b,), bool)
    if _checks.shape_of(active) != (b,):
        _checks.fail(name, f"shape must be ({b},)", _checks.shape_of(active))
    return jnp.asarray(active, bool)


def _ranked(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Flatten `[B, g]` position-major and sort descending, ties by (position, request).

    Returns the sorted values and, for each sorted slot, the flat index `j * B + r`.
    A stable sort of the position-major flattening gives exactly that tie order.
    """
    flat = values.T.reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    return flat[order], order


def _lengths_from_admitted(admitted: jax.Array, order: jax.Array, b: int, g: int) -> jax.Array:
    """Per-request count of admitted candidates (`admitted` is in sorted order)."""
    flat = jnp.zeros((b * g,), jnp.int32).at[order].set(admitted.astype(jnp.int32))
    return jnp.sum(flat.reshape(g, b), axis=0).astype(jnp.int32)


def schedule_causal(survival: jax.Array, table: SpsTable, *, active: jax.Array | None = None) -> jax.Array:
    """The paper's Algorithm 1: causal greedy with early stop.

    Starting from verifying nothing (`B = tau = R` active requests), candidates `(r, j)`
    with `a[r, j] > 0` are admitted in order of decreasing survival while each admission
    strictly increases `tau * SPS(B)`; the first non-improving candidate ends the search.

    Args:
      survival: `f32[B, g]` survival products (non-increasing along `g`).
      table: verify throughput table.
      active: `bool[B]` real requests (None = all).
    Returns:
      `i32[B]` verify lengths in `[0, g]` (0 for inactive requests).
    """
    b, g = _checks.check_rank("survival", survival, 2, "[B, g]")
    active = _active_mask("active", active, b)
    a = jnp.where(active[:, None], survival.astype(jnp.float32), 0.0)
    values, order = _ranked(a)
    r = jnp.sum(active).astype(jnp.float32)
    steps = jnp.arange(1, b * g + 1, dtype=jnp.float32)
    theta = (r + jnp.cumsum(values)) * sps_at(table, r + steps)
    previous = jnp.concatenate([(r * sps_at(table, r))[None], theta[:-1]])
    improves = (theta > previous) & (values > 0)
    admitted = jnp.cumprod(improves.astype(jnp.int32)) > 0
    return _lengths_from_admitted(admitted, order, b, g)


def _check_bounds(g: int, min_len: int, max_len: int | None) -> int:
    max_len = g if max_len is None else max_len
    if not 0 <= max_len <= g:
        _checks.fail("max_len", f"must lie in [0, {g}]", max_len)
    if not 0 <= min_len <= max_len:
        _checks.fail("min_len", f"must lie in [0, max_len={max_len}]", min_len)
    return max_len


def _candidates(a: jax.Array, active: jax.Array, min_len: int, max_len: int, eps: float) -> jax.Array:
    """Survivals of the schedulable positions `[min_len, max_len)`, others set to 0."""
    g = a.shape[1]
    j = jnp.arange(g)
    ok = active[:, None] & (j >= min_len)[None, :] & (j < max_len)[None, :] & (a >= eps)
    return jnp.where(ok, a, 0.0), ok


def verify_budget(
    survival: jax.Array,
    table: SpsTable,
    *,
    min_len: int = 0,
    max_len: int | None = None,
    eps: float = SURVIVAL_EPS,
    active: jax.Array | None = None,
) -> jax.Array:
    """Token budget: global argmax over `n` of `tau(n) * SPS(B(n))`.

    Every active request verifies `min_len` drafts for free; `n` more are the `n` highest
    candidate survivals at positions `[min_len, max_len)` that are `>= eps`. So
    `B(n) = R * (1 + min_len) + n` and `tau(n) = R + (floor survivals) + (top-n sum)`.
    The argmax is over ALL `n` (no early stop); ties go to the smaller budget.

    Args:
      survival: `f32[B, g]` survival products the budget is computed from (in the engine,
        ones at least two rounds old, so the current drafts cannot influence the budget).
      table: verify throughput table.
      min_len: drafts every active request verifies regardless (static).
      max_len: cap on any request's verify length (static; None = g).
      eps: candidates with survival below this are never admitted.
      active: `bool[B]` real requests (None = all).
    Returns:
      `i32[]` number of drafts beyond the floor, in `[0, #candidates]`.
    """
    b, g = _checks.check_rank("survival", survival, 2, "[B, g]")
    max_len = _check_bounds(g, min_len, max_len)
    active = _active_mask("active", active, b)
    a = jnp.where(active[:, None], jnp.clip(survival.astype(jnp.float32), 0.0, 1.0), 0.0)
    cand, ok = _candidates(a, active, min_len, max_len, eps)
    values, _ = _ranked(cand)
    count = jnp.sum(ok)
    r = jnp.sum(active).astype(jnp.float32)
    floor = jnp.sum(jnp.where(jnp.arange(g)[None, :] < min_len, a, 0.0))
    n = jnp.arange(b * g + 1)
    tau = r + floor + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(values)])
    theta = tau * sps_at(table, r * (1 + min_len) + n)
    theta = jnp.where(n <= count, theta, -jnp.inf)
    return jnp.argmax(theta).astype(jnp.int32)


def allocate_topk(
    survival: jax.Array,
    budget: jax.Array,
    *,
    min_len: int = 0,
    max_len: int | None = None,
    eps: float = SURVIVAL_EPS,
    active: jax.Array | None = None,
) -> jax.Array:
    """Fill a budget with the most likely accepted drafts, above a per-request floor.

    Candidates are positions `[min_len, max_len)` with survival `>= eps`; the top `budget`
    by survival are admitted, ties broken by (position, request) so the result is
    deterministic and a prefix of each request's block.

    Args:
      survival: `f32[B, g]` current survival products.
      budget: `i32[]` drafts to admit beyond the floor (may be traced).
      min_len, max_len, eps, active: as in `verify_budget`.
    Returns:
      `i32[B]` verify lengths: `min_len + admitted` for active requests (in
      `[min_len, max_len]`), 0 for inactive ones.
    """
    b, g = _checks.check_rank("survival", survival, 2, "[B, g]")
    max_len = _check_bounds(g, min_len, max_len)
    active = _active_mask("active", active, b)
    a = jnp.clip(survival.astype(jnp.float32), 0.0, 1.0)
    cand, ok = _candidates(a, active, min_len, max_len, eps)
    # Non-candidates sort after every candidate (survival >= eps > -1) and are never taken.
    values, order = _ranked(jnp.where(ok, cand, -1.0))
    admitted = (jnp.arange(b * g) < budget) & (values >= 0)
    lengths = min_len + _lengths_from_admitted(admitted, order, b, g)
    return jnp.where(active, jnp.clip(lengths, min_len, max_len), 0).astype(jnp.int32)


def schedule_budgeted(
    survival: jax.Array,
    table: SpsTable,
    *,
    budget_survival: jax.Array | None = None,
    min_len: int = 0,
    max_len: int | None = None,
    eps: float = SURVIVAL_EPS,
    active: jax.Array | None = None,
) -> jax.Array:
    """`allocate_topk(survival, verify_budget(budget_survival or survival))`.

    Args:
      survival: `f32[B, g]` current survival products (what gets admitted).
      table: verify throughput table.
      budget_survival: `f32[B, g]` survivals the budget is computed from (the engine
        passes ones from two rounds back); None uses `survival` (look-ahead, not lossless
        by itself; see the module docstring).
      min_len, max_len, eps, active: as in `verify_budget`.
    Returns:
      `i32[B]` verify lengths.
    """
    source = survival if budget_survival is None else budget_survival
    if _checks.shape_of(source) != _checks.shape_of(survival):
        _checks.fail("budget_survival", f"shape must be {_checks.shape_of(survival)}", _checks.shape_of(source))
    budget = verify_budget(source, table, min_len=min_len, max_len=max_len, eps=eps, active=active)
    return allocate_topk(survival, budget, min_len=min_len, max_len=max_len, eps=eps, active=active)
