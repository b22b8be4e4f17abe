"""`jax-dspark eval`: acceptance length, per-position acceptance and tokens/s on prompt sets.

For every dataset x temperature x drafter asked for, the target answers the first
`--limit` prompts (first turn, ChatML) through the speculative engine, and
`train.acceptance.measure_acceptance` counts rounds until each answer's end-of-turn token.
Unless `--no-baseline`, plain decoding (`--drafter none`) runs on the same prompts too and
its tokens/s is reported beside each drafter's as `baseline_tokens_per_s`.

`--json` prints `{"gpu", "commit", "date", "runs": [...]}`; each run has `dataset`,
`temperature`, `drafter`, `block`, `prompts`, `acceptance_length`,
`per_position_acceptance`, `conditional_acceptance`, `tokens_per_s`,
`baseline_tokens_per_s` and the settings; drafter runs add `acceptance_length_ci95`, and
DSpark runs beside a Markov-off run `ratio_vs_markov_off` with its `ratio_vs_markov_off_ci95`
(95% bootstrap intervals over the prompts, paired for the ratio:
`train.acceptance.acceptance_interval`), so a goal's margin can be read against the noise of
a finite prompt set. `--out` writes the same object to a file (the
schema of `docs/benchmarks/acceptance.json`), `--markdown` a table with the issue's goals.

Drafters: `dspark` and `markov-off` are the shipped `smollm2_dspark` /
`smollm2_markov_off` (`jax_dspark.drafters`); `--dspark-path` / `--markov-off-path`
point at other files. The `tiny` target uses random-weight drafters (tests only).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any

DRAFTERS = ("dspark", "markov-off", "none")
GOAL_GSM8K_T0 = 3.0
GOAL_MARKOV_RATIO = 1.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", nargs="+", required=True, help="prompt sets (.jsonl with 'turns')")
    parser.add_argument("--limit", type=int, default=16, help="first N prompts of each set")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    parser.add_argument("--drafter", nargs="+", choices=DRAFTERS, default=["dspark"])
    parser.add_argument("--no-baseline", action="store_true", help="do not also run plain decoding")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, help="requests decoded together (default: --limit)")
    parser.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--dspark-path", default="smollm2_dspark")
    parser.add_argument("--markov-off-path", default="smollm2_markov_off")
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="sampling seed(s); several repeat every run per seed in one process (each run "
                             "records its seed; DSpark's ratio pairs it with the Markov-off run of the same seed)")
    parser.add_argument("--commit", help="commit id to record (default: git rev-parse --short HEAD)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", help="write the report JSON here")
    parser.add_argument("--markdown", help="write a markdown table of the report here")


def _log(msg: str) -> None:
    print(f"[eval {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_prompts(path: str, limit: int) -> list[str]:
    """First turn of the first `limit` records of a `{"turns": [...]}` JSONL file."""
    if limit < 1:
        raise ValueError(f"limit: must be >= 1 (got {limit})")
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if not isinstance(record.get("turns"), list) or not record["turns"]:
                    raise ValueError(f"dataset: {path} has a record without 'turns' (got {line[:80]!r})")
                out.append(str(record["turns"][0]))
            if len(out) == limit:
                break
    if not out:
        raise ValueError(f"dataset: no prompts in {path}")
    return out


def _commit(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
        return done.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _setup(args):
    """`(target, encode, eos_ids, {drafter name: drafter or None})`."""
    names = set(args.drafter) | (set() if args.no_baseline else {"none"})
    if args.target == "tiny":
        from jax_dspark.commands.train import _target
        from jax_dspark.models.dspark import tiny_dspark
        from jax_dspark.models.llama import TINY

        target, encode, eos, _ = _target("tiny")
        make = {"dspark": lambda: tiny_dspark(TINY, block_size=4, markov_rank=8),
                "markov-off": lambda: tiny_dspark(TINY, block_size=4, markov_rank=0)}
    else:
        from jax_dspark.checkpoint import load_smollm2
        from jax_dspark.drafters import load_drafter

        target, tokenizer = load_smollm2()
        eos = list(tokenizer.eos_ids)

        def encode(text: str) -> list[int]:
            return tokenizer.apply_chat_template([{"role": "user", "content": text}])

        make = {"dspark": lambda: load_drafter(args.dspark_path, target=target),
                "markov-off": lambda: load_drafter(args.markov_off_path, target=target)}
    drafters = {name: (None if name == "none" else make[name]()) for name in DRAFTERS if name in names}
    return target, encode, eos, drafters


def run(args: argparse.Namespace) -> int:
    import jax

    from jax_dspark.train.acceptance import acceptance_interval, measure_acceptance, precompile

    t0 = time.perf_counter()
    target, encode, eos, drafters = _setup(args)
    device = jax.devices()[0]
    gpu = device.device_kind if device.platform == "gpu" else f"cpu ({device.device_kind})"
    _log(f"target and drafters loaded in {time.perf_counter() - t0:.1f} s on {gpu}")
    sets = {os.path.splitext(os.path.basename(p))[0]: [encode(t) for t in read_prompts(p, args.limit)]
            for p in args.dataset}
    width = -(-max(len(p) for ps in sets.values() for p in ps) // 64) * 64   # one compile for every set
    for batch in sorted({args.batch_size or len(ps) for ps in sets.values()}):
        seconds = precompile(target, list(drafters.values()), args.temperature,
                             max_new_tokens=args.max_new_tokens, batch_size=batch, width=width)
        _log(f"compiled {len(drafters) * len(args.temperature)} engines for batch {batch}, width {width} "
             f"in {seconds:.1f} s")
    runs: list[dict[str, Any]] = []
    for seed, temp, (name, prompts) in itertools.product(args.seed, args.temperature, sets.items()):
        results = {}
        for drafter_name, drafter in drafters.items():
            r = measure_acceptance(target, drafter, prompts, max_new_tokens=args.max_new_tokens,
                                   temperature=temp, eos_ids=eos, batch_size=args.batch_size,
                                   width=width, seed=seed)
            results[drafter_name] = r
            _log(f"{name} T={temp} seed {seed} {drafter_name}: AL {r.acceptance_length:.3f}, "
                 f"{r.tokens_per_s:.1f} tok/s ({r.num_tokens} tokens, compile {r.compile_s:.1f} s)")
        base = results.get("none")
        for drafter_name, r in results.items():  # the baseline too: it was measured
            drafter = drafters[drafter_name]
            runs.append(dict(
                dataset=name, temperature=temp, drafter=drafter_name,
                block=0 if drafter is None else int(drafter.block_size),
                prompts=r.prompts, acceptance_length=r.acceptance_length,
                per_position_acceptance=r.per_position_acceptance,
                conditional_acceptance=r.conditional_acceptance,
                tokens_per_s=r.tokens_per_s,
                baseline_tokens_per_s=None if base is None else base.tokens_per_s,
                num_tokens=r.num_tokens, rounds=r.rounds, max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size or r.prompts, seed=seed,
            ))
            if drafter is not None:
                runs[-1]["acceptance_length_ci95"] = list(acceptance_interval(r, seed=seed))
            off = results.get("markov-off")
            if drafter_name == "dspark" and off is not None and off.acceptance_length > 0:
                runs[-1]["ratio_vs_markov_off"] = r.acceptance_length / off.acceptance_length
                runs[-1]["ratio_vs_markov_off_ci95"] = list(acceptance_interval(r, off, seed=seed))
    report = dict(gpu=gpu, commit=_commit(args.commit),
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  target=args.target, jax=jax.__version__, runs=runs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(report))
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _ci(run: dict[str, Any], key: str, before: str = ", ", after: str = "") -> str:
    """`, 95% CI lo-hi` for a run that carries the interval `key` (reports before it: "")."""
    ci = run.get(key)
    return f"{before}95% CI {ci[0]:.2f}-{ci[1]:.2f}{after}" if ci else ""


def markdown_table(report: dict[str, Any]) -> str:
    """One markdown table of a report, with the issue's goals beside the numbers.

    Goals (issue 7): acceptance length >= 3.0 at T = 0 on gsm8k with block 7; DSpark >=
    1.1x the Markov-off ablation's acceptance length on every set and temperature.
    """
    runs = report["runs"]
    by_key = {(r["dataset"], r["temperature"], r["drafter"], r.get("seed")): r for r in runs}
    lines = [f"Device: {report['gpu']}; commit {report['commit']}; {report['date']}.", "",
             "| dataset | T | drafter | block | prompts | acceptance length | per-position acceptance | "
             "tokens/s | baseline tokens/s | speed-up | goal | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        goal, met = "", ""
        if r["drafter"] == "dspark":
            off = by_key.get((r["dataset"], r["temperature"], "markov-off", r.get("seed")))
            goals = []
            if off is not None and off["acceptance_length"] > 0:
                ratio = r["acceptance_length"] / off["acceptance_length"]
                goals.append((f"AL >= {GOAL_MARKOV_RATIO}x Markov-off (is {ratio:.2f}x{_ci(r, 'ratio_vs_markov_off_ci95')})",
                              ratio >= GOAL_MARKOV_RATIO))
            if r["dataset"] == "gsm8k" and r["temperature"] == 0 and r["block"] == 7:
                goals.append((f"AL >= {GOAL_GSM8K_T0}{_ci(r, 'acceptance_length_ci95', ' (', ')')}",
                              r["acceptance_length"] >= GOAL_GSM8K_T0))
            goal = "; ".join(g for g, _ in goals)
            met = "; ".join("yes" if ok else "no" for _, ok in goals)
        base = r.get("baseline_tokens_per_s")
        speed = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        per_pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
        lines.append(
            f"| {r['dataset']} | {r['temperature']:g} | {r['drafter']} | {r['block']} | {r['prompts']} | "
            f"{r['acceptance_length']:.2f} | {per_pos} | {r['tokens_per_s']:.1f} | "
            f"{'' if base is None else f'{base:.1f}'} | {speed} | {goal} | {met} |")
    return "\n".join(lines) + "\n"
