"""Acceptance measurement and the `jax-dspark eval` command on the tiny random target."""

import argparse
import json

import numpy as np
import pytest

from jax_dspark.commands import eval as eval_cmd
from jax_dspark.models.dspark import tiny_dspark
from jax_dspark.models.llama import TINY, tiny_llama
from jax_dspark.train.acceptance import AcceptanceResult, acceptance_interval, measure_acceptance

EOS = [TINY.vocab_size - 1]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _prompts(seed=0, n=3):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, TINY.vocab_size - 1, rng.integers(5, 12))) for _ in range(n)]


def test_acceptance_length_is_one_plus_the_per_position_acceptances(target):
    drafter = tiny_dspark(TINY, seed=2, block_size=3, num_layers=1, markov_rank=4)
    r = measure_acceptance(target, drafter, _prompts(), max_new_tokens=10, temperature=1.0, eos_ids=EOS, seed=1)
    assert len(r.per_position_acceptance) == 3
    assert r.acceptance_length == pytest.approx(1.0 + sum(r.per_position_acceptance))
    assert all(a >= b for a, b in zip(r.per_position_acceptance, r.per_position_acceptance[1:]))
    assert r.num_tokens == sum(len(o) for o in r.outputs) and r.prompts == 3


def test_per_request_counts_add_up_to_the_totals(target):
    drafter = tiny_dspark(TINY, seed=2, block_size=3, num_layers=1, markov_rank=4)
    r = measure_acceptance(target, drafter, _prompts(n=5), max_new_tokens=10, temperature=1.0, eos_ids=EOS,
                           batch_size=2, seed=3)
    assert len(r.request_emitted) == len(r.request_rounds) == 5
    assert sum(r.request_rounds) == r.rounds
    assert sum(r.request_emitted) / sum(r.request_rounds) == pytest.approx(r.acceptance_length)
    assert "request_emitted" not in r.summary()


def _counts(emitted, rounds):
    return AcceptanceResult(acceptance_length=sum(emitted) / sum(rounds), per_position_acceptance=[],
                            conditional_acceptance=[], tokens_per_s=0.0, num_tokens=0, rounds=sum(rounds),
                            prompts=len(rounds), wall_s=0.0, compile_s=0.0, outputs=[],
                            request_emitted=list(emitted), request_rounds=list(rounds))


def test_interval_brackets_the_acceptance_length_and_narrows_with_more_prompts():
    rng = np.random.default_rng(0)

    def sample(n):
        rounds = rng.integers(20, 60, n)
        return _counts((rounds * rng.uniform(1.5, 3.5, n)).astype(int), rounds)

    few, many = sample(16), sample(400)
    lo, hi = acceptance_interval(few)
    assert lo < few.acceptance_length < hi
    mlo, mhi = acceptance_interval(many)
    assert mlo < many.acceptance_length < mhi and (mhi - mlo) < (hi - lo) / 3


def test_paired_ratio_interval_cancels_what_both_drafters_share():
    # prompt difficulty varies 3x, but drafter a emits exactly 10% more on every prompt:
    # the paired ratio is 1.1 in every resample, while the unpaired intervals overlap widely
    rounds = np.full(32, 100)
    base = (rounds * np.linspace(1.2, 3.6, 32)).astype(int)
    b = _counts(base, rounds)
    a = _counts((base * 1.1).round().astype(int), rounds)
    lo, hi = acceptance_interval(a, b)
    assert 1.09 < lo <= hi < 1.11
    assert acceptance_interval(a)[0] < acceptance_interval(b)[1]
    with pytest.raises(ValueError, match="same 32 requests"):
        acceptance_interval(a, _counts(base[:8], rounds[:8]))
    with pytest.raises(ValueError, match="level"):
        acceptance_interval(a, level=95)


def test_plain_decoding_has_acceptance_length_one_and_counts_tokens_to_eos(target):
    r = measure_acceptance(target, None, _prompts(), max_new_tokens=8, eos_ids=EOS)
    assert r.acceptance_length == 1.0 and r.per_position_acceptance == []
    assert r.rounds == r.num_tokens - r.prompts  # the first token comes from prefill
    for out in r.outputs:
        assert len(out) == 8 or out[-1] in EOS


def test_greedy_speculative_answers_equal_plain_answers(target):
    drafter = tiny_dspark(TINY, seed=4, block_size=3, num_layers=1, markov_rank=4)
    spec = measure_acceptance(target, drafter, _prompts(1), max_new_tokens=9, eos_ids=EOS)
    plain = measure_acceptance(target, None, _prompts(1), max_new_tokens=9, eos_ids=EOS)
    assert spec.outputs == plain.outputs


def _run_eval(tmp_path, *options: str) -> int:
    """`jax-dspark eval` on the tiny target over a 3-prompt set, first 2 prompts, both drafters."""
    data = tmp_path / "set.jsonl"
    data.write_text("\n".join(json.dumps({"turns": [f"question {i} about numbers"]}) for i in range(3)))
    parser = argparse.ArgumentParser()
    eval_cmd.add_arguments(parser)
    return eval_cmd.run(parser.parse_args(["--target", "tiny", "--dataset", str(data), "--limit", "2",
                                           "--drafter", "dspark", "markov-off", "--max-new-tokens", "6",
                                           "--json", "--commit", "abc", *options]))


def test_eval_command_json_has_the_issue_fields(tmp_path, capsys):
    assert _run_eval(tmp_path, "--temperature", "0", "--out", str(tmp_path / "a.json"),
                     "--markdown", str(tmp_path / "a.md")) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"gpu", "commit", "date", "runs"} <= set(report) and report["commit"] == "abc"
    run, off, base = report["runs"]  # the plain-decoding baseline is measured, so it is reported too
    assert base["drafter"] == "none" and base["block"] == 0 and base["acceptance_length"] == 1.0
    assert off["drafter"] == "markov-off" and "ratio_vs_markov_off" not in off
    assert run["ratio_vs_markov_off"] == pytest.approx(run["acceptance_length"] / off["acceptance_length"])
    lo, hi = run["ratio_vs_markov_off_ci95"]
    assert lo <= run["ratio_vs_markov_off"] <= hi or lo == hi
    lo, hi = run["acceptance_length_ci95"]
    assert lo <= run["acceptance_length"] <= hi and "acceptance_length_ci95" not in base
    assert run["dataset"] == "set" and run["drafter"] == "dspark" and run["temperature"] == 0
    assert run["block"] == 4 and run["prompts"] == 2
    for key in ("acceptance_length", "per_position_acceptance", "tokens_per_s", "baseline_tokens_per_s"):
        assert key in run
    assert len(run["per_position_acceptance"]) == 4 and run["baseline_tokens_per_s"] > 0
    assert json.loads((tmp_path / "a.json").read_text()) == report
    assert "| set | 0 | dspark | 4 | 2 |" in (tmp_path / "a.md").read_text()


def test_eval_command_repeats_every_run_per_seed_and_pairs_the_ratio_within_a_seed(tmp_path, capsys):
    assert _run_eval(tmp_path, "--temperature", "1", "--no-baseline", "--seed", "3", "4") == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["seed"], r["drafter"]) for r in runs] == [(3, "dspark"), (3, "markov-off"), (4, "dspark"), (4, "markov-off")]
    for spark, off in (runs[:2], runs[2:]):
        assert spark["ratio_vs_markov_off"] == pytest.approx(spark["acceptance_length"] / off["acceptance_length"])
    # sampled answers differ between seeds (the seed reaches the draws)
    assert (runs[0]["num_tokens"], runs[0]["rounds"], runs[0]["per_position_acceptance"]) != \
        (runs[2]["num_tokens"], runs[2]["rounds"], runs[2]["per_position_acceptance"])


def test_markdown_marks_the_gsm8k_and_markov_goals():
    def run(drafter, al):
        return dict(dataset="gsm8k", temperature=0.0, drafter=drafter, block=7, prompts=4, acceptance_length=al,
                    per_position_acceptance=[0.5], tokens_per_s=10.0, baseline_tokens_per_s=5.0)

    text = eval_cmd.markdown_table(dict(gpu="x", commit="c", date="d", runs=[run("dspark", 3.3), run("markov-off", 2.5)]))
    row = next(line for line in text.splitlines() if "| dspark |" in line)
    assert "is 1.32x)" in row and row.rstrip().endswith("| yes; yes |")
    with_ci = dict(run("dspark", 3.3), ratio_vs_markov_off_ci95=[1.05, 1.6], acceptance_length_ci95=[2.9, 3.7])
    text = eval_cmd.markdown_table(dict(gpu="x", commit="c", date="d", runs=[with_ci, run("markov-off", 2.5)]))
    row = next(line for line in text.splitlines() if "| dspark |" in line)
    assert "is 1.32x, 95% CI 1.05-1.60)" in row and "AL >= 3.0 (95% CI 2.90-3.70)" in row


def test_read_prompts_rejects_a_zero_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"turns": ["a"]}))
    with pytest.raises(ValueError, match="limit"):
        eval_cmd.read_prompts(str(path), 0)
