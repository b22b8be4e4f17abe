"""Acceptance length, per-position acceptance and tokens/s of a drafter on a prompt set.

Definitions (`../shared/notes/ecosystem.md` section 2.7):

- acceptance length: tokens emitted per verify round, the bonus / corrected token
  included (`1 + accepted drafts / rounds`; 1.0 for plain decoding);
- per-position acceptance `a_k`: the fraction of rounds whose draft `k` was accepted (every
  draft is verified here, no scheduler), so `acceptance_length = 1 + sum_k a_k`; the
  conditional rate `a_k / a_{k-1}` (DeepSpec's `accept_rate@k`) is reported beside it;
- tokens/s: answer tokens of all requests of the batch per second of wall time, prefill
  included, compilation excluded.

Why not `spec.engine.generate`'s statistics: the engine always runs `max_new_tokens` and
counts every round, while an answer ends at its end-of-turn token; text generated after
that is not an answer and would bias both acceptance and tokens/s. The loop here drives the
same jitted engine (`SpeculativeEngine.prefill` / `step`) and, from the per-request token
counts it reads each round anyway, counts only rounds that start before a request's
first end-of-turn token, and stops once every request has ended. A round emits
`n + 1` tokens when `n` drafts are accepted, so the counts alone give every statistic.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["AcceptanceResult", "acceptance_interval", "decode_batch", "measure_acceptance", "pad_prompts",
           "precompile"]

# (graph definitions, sampling, max_new_tokens, batch, width) already compiled in this process
_COMPILED: set[tuple] = set()


@dataclasses.dataclass(frozen=True)
class AcceptanceResult:
    """What one measurement saw (all requests of all batches together).

    Attributes:
      acceptance_length: emitted tokens per counted round (bonus included).
      per_position_acceptance: `a_k`, accepted rounds at draft position k / rounds.
      conditional_acceptance: `a_k / a_{k-1}` (`a_{-1}` = 1).
      tokens_per_s: answer tokens per second of wall time (prefill included).
      num_tokens: answer tokens (through the first end-of-turn token, at most max_new_tokens).
      rounds: counted verify rounds over all requests.
      prompts: requests measured.
      wall_s, compile_s: measured time and compilation time.
      outputs: each request's answer ids.
      request_emitted, request_rounds: each request's emitted tokens and counted rounds, in
        prompt order (what `acceptance_interval` resamples).
    """

    acceptance_length: float
    per_position_acceptance: list[float]
    conditional_acceptance: list[float]
    tokens_per_s: float
    num_tokens: int
    rounds: int
    prompts: int
    wall_s: float
    compile_s: float
    outputs: list[list[int]]
    request_emitted: list[int] = dataclasses.field(default_factory=list)
    request_rounds: list[int] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for per_request in ("outputs", "request_emitted", "request_rounds"):
            out.pop(per_request)
        return out


def acceptance_interval(result: AcceptanceResult, baseline: AcceptanceResult | None = None, *,
                        level: float = 0.95, samples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of `result`'s acceptance length, or of its ratio to `baseline`'s.

    The prompts are the sampling unit: each resample draws requests with replacement and
    recomputes `sum(emitted) / sum(rounds)`. With a baseline measured on the same prompts
    the draws are paired (the same requests for both), so what two drafters share (an
    easy prompt, a long answer) cancels in the ratio. Percentile interval at `level`.
    """
    if not 0 < level < 1:
        raise ValueError(f"level: must be in (0, 1) (got {level!r})")
    if samples < 1:
        raise ValueError(f"samples: must be >= 1 (got {samples!r})")
    e = np.asarray(result.request_emitted, np.float64)
    r = np.asarray(result.request_rounds, np.float64)
    if e.size == 0 or e.shape != r.shape:
        raise ValueError(f"result: needs per-request counts (got {e.size} emitted, {r.size} rounds)")
    idx = np.random.default_rng(seed).integers(0, e.size, (samples, e.size))
    stat = e[idx].sum(1) / np.maximum(r[idx].sum(1), 1.0)
    if baseline is not None:
        be = np.asarray(baseline.request_emitted, np.float64)
        br = np.asarray(baseline.request_rounds, np.float64)
        if be.shape != e.shape or br.shape != e.shape:
            raise ValueError(f"baseline: needs counts for the same {e.size} requests (got {be.size})")
        stat = stat / (be[idx].sum(1) / np.maximum(br[idx].sum(1), 1.0))
    lo, hi = np.quantile(stat, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def pad_prompts(prompts: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into `i32[B, width]` and their lengths `i32[B]`."""
    lens = np.asarray([len(p) for p in prompts], np.int32)
    if lens.size == 0 or lens.min() < 1:
        raise ValueError(f"prompts: need non-empty token lists (got lengths {lens.tolist()})")
    if lens.max() > width:
        raise ValueError(f"width: must be >= the longest prompt {int(lens.max())} (got {width})")
    out = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = np.asarray(p, np.int32)
    return out, lens


def _engine_key(engine, batch: int, width: int) -> tuple:
    return (engine._t_graph, engine._d_graph, engine.sampling, engine.max_new_tokens, batch, width)


def precompile(target, drafters, temperatures, *, max_new_tokens: int, batch_size: int, width: int,
               threads: int = 8) -> float:
    """Compile the engine of every (drafter, temperature) pair at once, in threads.

    XLA compiles outside the Python lock, so on a many-core host the compilations of the
    six engines an evaluation needs (three drafters x two temperatures) overlap instead of
    adding up. Later `measure_acceptance` calls with the same shapes find them compiled.
    Returns the wall time spent.
    """
    from concurrent.futures import ThreadPoolExecutor

    from jax_dspark.ops.sampling import SamplingParams
    from jax_dspark.spec.engine import SpeculativeEngine

    jobs = []
    for drafter in drafters:
        for temp in temperatures:
            engine = SpeculativeEngine(target, drafter, sampling=SamplingParams(temperature=float(temp)),
                                       max_new_tokens=max_new_tokens)
            key = _engine_key(engine, batch_size, width)
            if key not in _COMPILED and key not in [k for _, k in jobs]:
                jobs.append((engine, key))
    prompts = np.ones((batch_size, width), np.int32)
    lens = np.full((batch_size,), width, np.int32)

    def build(job):
        engine, key = job
        engine.compile(engine.init_state(batch_size, width), prompts, lens)
        return key

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for key in pool.map(build, jobs):
            _COMPILED.add(key)
    return time.perf_counter() - t0


def decode_batch(engine, prompts: Sequence[Sequence[int]], *, width: int, eos_ids: Sequence[int],
                 seed: int = 0) -> dict[str, Any]:
    """Run one batch through `engine` until every request ends; raw counts and timings.

    Returns a dict with `outputs` (answer ids per request), `rounds [B]`, `emitted [B]`,
    `accepted [B, g]` (rounds with draft k accepted), `num_tokens`, `wall_s`, `compile_s`.
    """
    import jax

    padded, lens = pad_prompts(prompts, width)
    b, m, g = padded.shape[0], engine.max_new_tokens, engine.block_size
    eos = np.asarray(list(eos_ids), np.int32)
    key = _engine_key(engine, b, width)
    compile_s = 0.0
    if key not in _COMPILED:
        t0 = time.perf_counter()
        engine.compile(engine.init_state(b, width, seed), padded, lens)
        compile_s = time.perf_counter() - t0
        _COMPILED.add(key)

    state = engine.init_state(b, width, seed)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = engine.prefill(state, padded, lens)
    num = np.asarray(state.num_out)
    rounds = np.zeros(b, np.int64)
    emitted = np.zeros(b, np.int64)
    accepted = np.zeros((b, g), np.int64)
    end = np.full(b, -1, np.int64)  # index of the first EOS in the answer, -1 = none yet
    cols = np.arange(m)[None, :]
    while True:
        out = np.asarray(state.out_tokens)[:, :m]
        hit = np.isin(out, eos) & (cols < num[:, None])
        end = np.where((end < 0) & hit.any(axis=1), hit.argmax(axis=1), end)
        done = (end >= 0) | (num >= m)
        if done.all():
            break
        state = engine.step(state)
        new = np.asarray(state.num_out)
        live = np.nonzero(~done)[0]
        committed = new - num
        rounds[live] += 1
        emitted[live] += committed[live]
        for i in live:
            accepted[i, : max(0, int(committed[i]) - 1)] += 1
        num = new
    wall = time.perf_counter() - t0
    out = np.asarray(state.out_tokens)
    outputs = [[int(t) for t in out[i, : (end[i] + 1 if end[i] >= 0 else m)]] for i in range(b)]
    return dict(outputs=outputs, rounds=rounds, emitted=emitted, accepted=accepted,
                num_tokens=int(sum(len(o) for o in outputs)), wall_s=wall, compile_s=compile_s)


def measure_acceptance(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: Sequence[int],
    batch_size: int | None = None,
    width: int | None = None,
    seed: int = 0,
) -> AcceptanceResult:
    """Acceptance statistics and tokens/s of `drafter` (None = plain decoding) on `prompts`.

    Args:
      target: target model; drafter: its DSpark drafter or None.
      prompts: token-id lists (ChatML-encoded prompts).
      max_new_tokens: answer cap per request.
      temperature: sampling temperature of target and drafts (0 = greedy).
      eos_ids: ids that end an answer.
      batch_size: requests decoded together (default: all). A short last batch is padded
        with copies of its first prompt, which are decoded but not counted.
      width: padded prompt width (default: the longest prompt rounded up to 64); pass the
        same width for several sets to share one compilation.
      seed: PRNG seed (batch i uses seed + i).
    """
    from jax_dspark.ops.sampling import SamplingParams
    from jax_dspark.spec.engine import SpeculativeEngine

    if not prompts:
        raise ValueError("prompts: need at least one prompt (got none)")
    batch_size = len(prompts) if batch_size is None else int(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1 (got {batch_size})")
    width = width or -(-max(len(p) for p in prompts) // 64) * 64
    engine = SpeculativeEngine(target, drafter, sampling=SamplingParams(temperature=float(temperature)),
                               max_new_tokens=max_new_tokens)
    g = engine.block_size
    rounds = emitted = tokens = 0
    accepted = np.zeros(g, np.int64)
    wall = compile_s = 0.0
    outputs: list[list[int]] = []
    request_emitted: list[int] = []
    request_rounds: list[int] = []
    for k, start in enumerate(range(0, len(prompts), batch_size)):
        batch = [list(p) for p in prompts[start:start + batch_size]]
        real = len(batch)
        batch += [batch[0]] * (batch_size - real)
        r = decode_batch(engine, batch, width=width, eos_ids=eos_ids, seed=seed + k)
        rounds += int(r["rounds"][:real].sum())
        emitted += int(r["emitted"][:real].sum())
        accepted += r["accepted"][:real].sum(axis=0)
        tokens += sum(len(o) for o in r["outputs"][:real])
        outputs += r["outputs"][:real]
        request_emitted += [int(x) for x in r["emitted"][:real]]
        request_rounds += [int(x) for x in r["rounds"][:real]]
        wall += r["wall_s"]
        compile_s += r["compile_s"]
    per_pos = accepted / max(rounds, 1)
    prev = np.concatenate([[1.0], per_pos[:-1]]) if g else np.zeros(0)
    cond = np.where(prev > 0, per_pos / np.maximum(prev, 1e-12), 0.0)
    return AcceptanceResult(
        acceptance_length=float(emitted / rounds) if rounds else 0.0,
        per_position_acceptance=[float(x) for x in per_pos],
        conditional_acceptance=[float(x) for x in cond],
        tokens_per_s=float(tokens / wall) if wall > 0 else 0.0,
        num_tokens=int(tokens),
        rounds=int(rounds),
        prompts=len(prompts),
        wall_s=float(wall),
        compile_s=float(compile_s),
        outputs=outputs,
        request_emitted=request_emitted,
        request_rounds=request_rounds,
    )
