"""The DSpark training step and loop (DeepSpec recipe, `../shared/notes/dspark-spec.md` s. 7).

One step, all inside one jitted function:

1. teacher-forced target forward over B whole sequences (`data.teacher_forced`): the
   captured hiddens (the drafter's context) and the target logits (its supervision),
   both frozen;
2. `drafter.commit` of every position of sequence b into drafter slot b: the context K/V
   of the whole sequence, computed once;
3. `drafter.backbone` with ONE ROW PER ANCHOR: row (b, a) reads slot b with
   `lengths = a`, so it sees exactly the context positions `< a`, as at inference when
   the anchor `a` is the newest emitted token. A anchors per sequence turn one target
   forward into B x A training blocks (DeepSpec's many-anchors trick) through the
   drafter's public methods, with no separate training-only attention mask;
4. draft logits = shared LM head + Markov bias of the TEACHER-FORCED predecessors
   `[anchor, y_1 .. y_{g-1}]`; confidence logits read the same predecessor embedding;
5. `losses.dspark_loss` (0.1 CE + 0.9 TV + 1.0 BCE, weights exp(-k/4)).

Several drafters (`train_many`, e.g. DSpark and its Markov-off ablation) train in the same
step: step 1 runs once, steps 2-5 once per drafter, on the same batch.

Optimiser: AdamW (optax `scale_by_adam` + decoupled weight decay) after global-norm
clipping; the learning rate is a host-side schedule (linear warmup, cosine decay to 0)
passed into the step as an argument, so the total step count can be fixed AFTER timing
the first steps when training against a wall-clock budget (`TrainConfig.time_budget_s`)
without recompiling. The probe steps all lie inside the warmup, whose shape does not
depend on the total, so a run with `steps=N` reproduces a budgeted run that chose N.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dspark.train.anchors import block_labels, sample_anchors
from jax_dspark.train.data import SequenceData, teacher_forced
from jax_dspark.train.losses import LossWeights, dspark_loss

__all__ = ["TrainConfig", "TrainResult", "drafter_loss", "learning_rate", "make_batches", "precompile", "train",
           "train_many"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings.

    Attributes:
      steps: optimiser steps (upper bound when `time_budget_s` is set).
      batch_size: sequences per step (each gives `num_anchors` blocks).
      num_anchors: anchors sampled per sequence (fewer when the answer is short).
      learning_rate: peak rate (DeepSpec: 6e-4).
      warmup_steps: linear warmup length; cosine decay to 0 follows.
      weight_decay: decoupled (AdamW) weight decay (DeepSpec: 0).
      grad_clip: global-norm clip (DeepSpec: 1.0).
      seed: data order and anchor sampling.
      time_budget_s: if set, the loop times its first steps and lowers `steps` so that
        training ends within this many seconds (compilation excluded).
      log_every: steps between logged metric means.
      loss: loss weights.
    """

    steps: int = 1000
    batch_size: int = 8
    num_anchors: int = 64
    learning_rate: float = 6e-4
    warmup_steps: int = 40
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None
    log_every: int = 50
    loss: LossWeights = LossWeights()

    def __post_init__(self):
        for name in ("steps", "batch_size", "num_anchors", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int (got {value!r})")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be an int >= 0 (got {self.warmup_steps!r})")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate: must be > 0 (got {self.learning_rate!r})")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s: must be > 0 or None (got {self.time_budget_s!r})")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """`history`: logged metric means per window (`step`, `lr`, `loss`, `ce`, `tv`, `bce`,
    `acceptance`, `seconds`); `steps`: steps run; `train_s`: loop time without compilation;
    `compile_s`: time of the first (compiling) step."""

    history: list[dict[str, float]]
    steps: int
    train_s: float
    compile_s: float


def learning_rate(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay from the peak to 0 at `total`."""
    peak, w = config.learning_rate, config.warmup_steps
    if step < w:
        return peak * (step + 1) / w
    span = max(total - w, 1)
    return 0.5 * peak * (1.0 + math.cos(math.pi * min(step - w, span) / span))


def drafter_loss(
    target,
    drafter,
    tokens: jax.Array,
    lengths: jax.Array,
    anchors: jax.Array,
    labels: jax.Array,
    valid: jax.Array,
    weights: LossWeights = LossWeights(),
    *,
    teacher: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DSpark loss of a batch of whole sequences with many anchors each.

    Args:
      target: frozen target model (target-model protocol; shares embed / LM head).
      drafter: `models.dspark.DSparkDrafter`.
      tokens: `i32[B, S]` prompt + answer ids; lengths: `i32[B]` valid ids per row.
      anchors: `i32[B, A]` anchor positions (-1 = padding anchor).
      labels: `i32[B, A, g]` tokens a+1 .. a+g; valid: `bool[B, A, g]` contiguous prefix.
      weights: loss weights.
      teacher: `(logits, hiddens)` of `data.teacher_forced(target, tokens, lengths)` when
        the caller already ran it (several drafters trained on one target forward);
        computed here when None.
    Returns:
      `(loss, metrics)` as `losses.dspark_loss`.
    """
    b, s = tokens.shape
    a = anchors.shape[1]
    g = drafter.block_size
    logits, hiddens = teacher if teacher is not None else teacher_forced(target, tokens, lengths)
    slots = jnp.arange(b, dtype=jnp.int32)
    state = drafter.init_state(b, s)
    state = drafter.commit(target, state, tokens=tokens, hiddens=hiddens, slots=slots,
                           starts=jnp.zeros((b,), jnp.int32), counts=lengths)
    rows = jnp.repeat(slots, a)                                              # [N]
    pos = jnp.maximum(anchors.reshape(-1), 0)                                # [N]
    anchor_tok = tokens[rows, pos]
    h = drafter.backbone(target, state, anchor=anchor_tok, slots=rows, lengths=pos)    # [N, g, d]
    draft = target.unembed(h)
    labels = labels.reshape(b * a, g)
    valid = valid.reshape(b * a, g)
    prev = jnp.concatenate([anchor_tok[:, None], labels[:, :-1]], axis=1)   # teacher forcing
    prev_embedding = None
    markov = drafter.markov_head(target)
    if markov is not None:
        draft = draft + markov(prev, h)   # a vanilla head ignores h, a gated one reads it
        prev_embedding = markov.embed(prev)
    confidence = drafter.confidence(h, prev_embedding)
    t_pos = jnp.clip(pos[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :], 0, s - 1)
    target_logits = logits[rows[:, None], t_pos]                             # [N, g, V]
    return dspark_loss(draft, target_logits, labels, valid, confidence, weights)


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graphs", "tx", "weights"),
                   donate_argnames=("d_params", "opt_states"))
def _train_step(t_params, d_params, opt_states, lr, tokens, lengths, anchors, labels, valid, *,
                t_graph, d_graphs, tx, weights):
    """One step of every drafter in `d_graphs` on the same batch and ONE target forward.

    The drafters' losses are independent (disjoint parameters), so each gets exactly the
    gradient it would get alone; clipping and Adam state stay per drafter.
    """
    target = nnx.merge(t_graph, t_params)
    teacher = jax.lax.stop_gradient(teacher_forced(target, tokens, lengths))
    new_params, new_states, all_metrics = [], [], []
    for d_graph, params, opt_state in zip(d_graphs, d_params, opt_states):
        def loss_fn(p, d_graph=d_graph):
            drafter = nnx.merge(d_graph, p)
            return drafter_loss(target, drafter, tokens, lengths, anchors, labels, valid, weights, teacher=teacher)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree_util.tree_map(lambda p, u: p - (lr * u).astype(p.dtype), params, updates)
        new_params.append(params)
        new_states.append(opt_state)
        all_metrics.append(dict(metrics, loss=loss, grad_norm=_global_norm(grads)))
    return tuple(new_params), tuple(new_states), tuple(all_metrics)


@functools.lru_cache(maxsize=None)
def _optimizer(grad_clip: float, weight_decay: float):
    """One optax transformation per setting: it is a static argument of the jitted step,
    so reusing the object lets `precompile` and `train` share one compilation."""
    import optax

    return optax.chain(optax.clip_by_global_norm(grad_clip), optax.scale_by_adam(),
                       optax.add_decayed_weights(weight_decay))


def precompile(target, drafters, data: SequenceData, config: TrainConfig) -> float:
    """Compile the joint training step of `drafters` (as `train_many` runs it); `train_many`
    then finds it compiled. Returns the wall time."""
    t_graph, t_params = nnx.split(target)
    tx = _optimizer(config.grad_clip, config.weight_decay)
    graphs, params = zip(*(nnx.split(d) for d in drafters))
    batch = next(make_batches(data, config, _common_block_size(drafters)))
    t0 = time.perf_counter()
    _train_step.lower(t_params, params, tuple(tx.init(p) for p in params), jnp.float32(0.0),
                      *map(jnp.asarray, batch), t_graph=t_graph, d_graphs=graphs, tx=tx,
                      weights=config.loss).compile()
    return time.perf_counter() - t0


def _common_block_size(drafters) -> int:
    sizes = {d.block_size for d in drafters}
    if len(sizes) != 1:
        raise ValueError(f"drafters: trained together they need one block size (got {sorted(sizes)})")
    return sizes.pop()


def _global_norm(tree) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def make_batches(data: SequenceData, config: TrainConfig, block_size: int):
    """Endless host-side batches `(tokens, lengths, anchors, labels, valid)` as numpy:
    epochs of shuffled sequences (the last partial batch of an epoch is completed from
    the next), fresh random anchors every time a sequence is used."""
    rng = np.random.default_rng(config.seed)
    b, a = config.batch_size, config.num_anchors
    order: list[int] = []
    while True:
        while len(order) < b:
            order += list(rng.permutation(data.num_sequences))
        idx, order = order[:b], order[b:]
        anchors = np.stack([sample_anchors(rng, data.loss_mask[i], a) for i in idx])
        labels, valid = zip(*(block_labels(data.tokens[i], data.loss_mask[i], anchors[k], block_size)
                              for k, i in enumerate(idx)))
        yield (data.tokens[idx], data.lengths[idx], anchors, np.stack(labels), np.stack(valid))


def train(target, drafter, data: SequenceData, config: TrainConfig,
          log: Callable[[str], None] | None = None) -> TrainResult:
    """Train `drafter` in place against the frozen `target` on `data` (`train_many` of one)."""
    return train_many(target, [drafter], data, config, log=log)[0]


def train_many(target, drafters, data: SequenceData, config: TrainConfig,
               log: Callable[[str], None] | None = None) -> list[TrainResult]:
    """Train every drafter in `drafters` in place, together, against the frozen `target`.

    Each step runs the target forward once for the batch and steps every drafter on it, so
    an ablation pair sees identical batches, anchors and learning rates, and the expensive
    target forward is shared. The batches depend only on `config.seed` and `data`, never
    on how many drafters train, so training one drafter alone with the same step count
    reproduces its schedule. Returns one `TrainResult` per drafter (shared step count and
    time); parameters are updated through `nnx.update`.
    """
    if data.num_sequences < 1:
        raise ValueError("data: needs at least one sequence (got none)")
    if not np.any(data.loss_mask[:, :-1] & data.loss_mask[:, 1:]):
        raise ValueError("data: no sequence has two consecutive answer tokens to anchor on")
    if not drafters:
        raise ValueError("drafters: need at least one (got none)")
    log = log or (lambda _msg: None)
    t_graph, t_params = nnx.split(target)
    graphs, params = zip(*(nnx.split(d) for d in drafters))
    d_params = tuple(jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), p) for p in params)
    tx = _optimizer(config.grad_clip, config.weight_decay)
    opt_states = tuple(tx.init(p) for p in d_params)
    batches = make_batches(data, config, _common_block_size(drafters))
    total = config.steps
    probe = min(10, max(config.warmup_steps, 1), total)
    histories: list[list[dict[str, float]]] = [[] for _ in drafters]
    window: list[tuple[dict[str, Any], ...]] = []
    lrs: list[float] = []
    compile_s = 0.0
    t_start = None
    step = 0
    while step < total:
        batch = next(batches)
        lr = learning_rate(step, total, config)
        t0 = time.perf_counter()
        d_params, opt_states, metrics = _train_step(
            t_params, d_params, opt_states, jnp.float32(lr), *map(jnp.asarray, batch),
            t_graph=t_graph, d_graphs=graphs, tx=tx, weights=config.loss)
        window.append(metrics)
        lrs.append(lr)
        step += 1
        if step == 1:
            jax.block_until_ready(metrics[0]["loss"])
            compile_s = time.perf_counter() - t0
            t_start = time.perf_counter()
            log(f"step 1 ran in {compile_s:.1f} s (compilation included unless precompiled)")
        elif step == probe + 1 and config.time_budget_s is not None:
            jax.block_until_ready(metrics[0]["loss"])
            per_step = (time.perf_counter() - t_start) / (step - 1)
            fit = step + int((config.time_budget_s - (time.perf_counter() - t_start)) / per_step)
            total = max(step, min(config.steps, fit))
            log(f"{per_step * 1000:.1f} ms/step; training for {total} steps within {config.time_budget_s:.0f} s")
        if step % config.log_every == 0 or step == total:
            fetched = jax.device_get(window)
            seconds = time.perf_counter() - (t_start or t0)
            for k, history in enumerate(histories):
                rows = [w[k] for w in fetched]
                mean = {name: float(np.mean([r[name] for r in rows])) for name in rows[0] if name != "weight"}
                mean.update(lr=float(np.mean(lrs)), step=step, seconds=seconds)
                history.append(mean)
                log(f"[{k}] " + " ".join(f"{name}={v:.4g}" for name, v in mean.items()))
            window, lrs = [], []
    jax.block_until_ready(d_params)
    train_s = time.perf_counter() - (t_start or time.perf_counter())
    for drafter, p in zip(drafters, d_params):
        nnx.update(drafter, p)
    return [TrainResult(history=h, steps=step, train_s=train_s, compile_s=compile_s) for h in histories]
