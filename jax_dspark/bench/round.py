"""`jax-dspark bench round`: one speculative decode round, whole and taken apart.

Tokens/s of speculative decoding is `acceptance length / round time`, so the round's cost
against a plain decoding step decides whether a drafter pays (on the H200 at batch 1 a
round of the SmolLM2 pair costs 1.6 plain steps: `docs/benchmarks/round.md`). This
bench times, per batch size and drafter, the jitted round (`SpeculativeEngine.step`, the
state donated as in `generate`) and its parts in isolation: the target forward over the
`g + 1` verify rows (its cache donated and threaded through the calls), the drafter's
`draft` (backbone, LM head, Markov chain, confidence) and its backbone alone. What the
parts do not cover (verification, commits, the drafter's back-fill, bookkeeping) is the
round minus verify minus draft. The ceiling printed beside them is the weight-read floor
of one target forward: parameter bytes / the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dspark.bench import report, timing

PROMPT = ("A farmer has 12 cows and buys 7 more. Each cow gives 3 liters of milk a day. "
          "How many liters of milk does the farmer get per day? Please reason step by step.")
WARMUP_ROUNDS = 3


def _median_ms(fn, repeats: int) -> float:
    return timing.median_wall_s(fn, repeats) * 1e3


def _setup(target_name: str):
    """`(target, {drafter name: drafter or None}, prompt ids, description)`."""
    if target_name == "tiny":
        from jax_dspark.commands.generate import byte_encode
        from jax_dspark.models.dspark import tiny_dspark
        from jax_dspark.models.llama import tiny_llama

        target = tiny_llama(0)
        prompt = byte_encode(PROMPT, target.config.vocab_size)[:40]
        drafters = {"none": None, "dspark": tiny_dspark(target.config, markov_rank=8)}
        return target, drafters, prompt, "tiny random Llama + tiny DSpark drafter"
    if target_name != "smollm2":
        raise ValueError(f"target: must be 'smollm2' or 'tiny' (got {target_name!r})")
    from jax_dspark.checkpoint import load_smollm2
    from jax_dspark.drafters import load_drafter

    target, tokenizer = load_smollm2()
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    drafters = {"none": None,
                "dspark": load_drafter("smollm2_dspark", target=target),
                "markov-off": load_drafter("smollm2_markov_off", target=target)}
    return target, drafters, prompt, "SmolLM2-135M-Instruct (f32) with the shipped drafters"


def measure_case(target, drafter, prompt: list[int], batch: int, repeats: int) -> dict:
    """Median times (ms) of one decode round and its parts at `batch` identical prompts."""
    from jax_dspark.ops.sampling import SamplingParams
    from jax_dspark.spec.engine import SpeculativeEngine, _pad_prompts

    g = 0 if drafter is None else int(drafter.block_size)
    max_new = (WARMUP_ROUNDS + repeats + 2) * (g + 1) + 8
    engine = SpeculativeEngine(target, drafter, max_new_tokens=max_new)
    padded, lens = _pad_prompts([prompt] * batch, int(target.config.vocab_size))
    engine.compile(engine.init_state(batch, padded.shape[1], 0), padded, lens)
    state = engine.prefill(engine.init_state(batch, padded.shape[1], 0), padded, lens)
    for _ in range(WARMUP_ROUNDS):
        state = engine.step(state)
    box = [state]

    def one_round():
        box[0] = engine.step(box[0])
        return box[0].anchor

    case = {"batch": batch, "block": g, "round_ms": _median_ms(one_round, repeats)}
    state = box[0]
    if drafter is None:
        return case

    t_graph, t_params = nnx.split(target)
    d_graph, d_params = nnx.split(drafter)
    slots = jnp.arange(batch, dtype=jnp.int32)

    @jax.jit
    def draft(tp, dp, sd, anchor, lengths):
        t, d = nnx.merge(t_graph, tp), nnx.merge(d_graph, dp)
        return d.draft(t, sd, jax.random.key(0), anchor=anchor, slots=slots, lengths=lengths,
                       sampling=SamplingParams()).tokens

    @jax.jit
    def backbone(tp, dp, sd, anchor, lengths):
        t, d = nnx.merge(t_graph, tp), nnx.merge(d_graph, dp)
        return d.backbone(t, sd, anchor=anchor, slots=slots, lengths=lengths)

    args = (t_params, d_params, state.drafter_state, state.anchor, state.lengths)
    for name, fn in (("draft_ms", draft), ("backbone_ms", backbone)):
        jax.block_until_ready(fn(*args))
        case[name] = _median_ms(lambda fn=fn: fn(*args), repeats)

    def forward(tp, cache, tokens, lengths):
        t = nnx.merge(t_graph, tp)
        logits, _, cache = t(tokens, cache, slots=slots, starts=lengths,
                             lengths=jnp.full((batch,), g + 1, jnp.int32))
        return logits, cache

    verify_forward = jax.jit(forward, donate_argnums=(1,))
    tokens = jnp.concatenate([state.anchor[:, None], state.drafts], axis=1)
    cache_box = [jax.tree.map(lambda x: jnp.array(x, copy=True), state.target_cache)]

    def one_verify():
        logits, cache_box[0] = verify_forward(t_params, cache_box[0], tokens, state.lengths)
        return logits

    jax.block_until_ready(one_verify())
    case["verify_forward_ms"] = _median_ms(one_verify, repeats)
    case["other_ms"] = case["round_ms"] - case["verify_forward_ms"] - case["draft_ms"]
    return case


def run(path: str, *, commit: str | None = None, target: str = "smollm2", batch_sizes=(1, 32),
        repeats: int = 30) -> dict:
    """Measure every (batch, drafter) case and write `path` (+ `.md`)."""
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes: must be positive ints (got {list(batch_sizes)!r})")
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1 (got {repeats!r})")
    model, drafters, prompt, description = _setup(target)
    on_gpu = jax.default_backend() == "gpu"
    copy = timing.copy_bandwidth_TBps(2.0 if on_gpu else 0.25)
    param_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                      for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    # The target's weights read once at the copy rate; on a CPU the jitted elementwise pass
    # is no bandwidth measurement (it runs far below what a forward streams), so no floor.
    floor_ms = param_bytes / (copy * 1e12) * 1e3 if on_gpu else None
    cases = []
    for b in batch_sizes:
        plain = None
        for name, drafter in drafters.items():
            case = {"case": f"batch {b} {name}", "drafter": name,
                    **measure_case(model, drafter, prompt, int(b), repeats)}
            if name == "none":
                plain = case["round_ms"]
            case["plain_step_ms"] = plain
            case["round_over_plain"] = None if plain is None else case["round_ms"] / plain
            case["weights_floor_ms"] = floor_ms
            cases.append(case)
            print(f"[bench round] {case['case']}: round {case['round_ms']:.2f} ms"
                  + (f" ({case['round_over_plain']:.2f}x plain)" if plain else ""), flush=True)
    result = {"gpu": timing.gpu_name(), "commit": report.commit_id(commit), "date": report.today(),
              "target": description, "copy_TBps": copy,
              "gemm_bf16_TFLOPs": timing.gemm_bf16_TFLOPs() if on_gpu else None,
              "target_param_bytes": param_bytes, "repeats": repeats, "cases": cases}
    columns = [("case", "case"), ("block", "block"), ("round ms", "round_ms"), ("plain step ms", "plain_step_ms"),
               ("round / plain", "round_over_plain"), ("verify forward ms", "verify_forward_ms"),
               ("draft ms", "draft_ms"), ("backbone ms", "backbone_ms"), ("other ms", "other_ms"),
               ("weight-read floor ms", "weights_floor_ms")]
    notes = ["round: the jitted `SpeculativeEngine.step` (state donated), median of `repeats` rounds after "
             f"{WARMUP_ROUNDS} warm-up rounds; `none` is plain decoding through the same engine.",
             "verify forward: the target over the g + 1 verify rows, cache donated; draft: `drafter.draft` "
             "(backbone, LM head, Markov chain, confidence); other = round - verify forward - draft.",
             "weight-read floor: the target's parameter bytes read once at the measured copy bandwidth "
             "(GPU only)."]
    report.write(result, path, columns, "Speculative decode round", notes)
    return result
