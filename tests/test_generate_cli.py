"""`jax-dspark generate`: JSON output, and greedy speculative == greedy plain decoding.

Three prompts of <= 16 bytes and 10 new tokens on tiny-llama: the shapes of
tests/test_engine.py, so the compiled programs are shared when both run in one session.
"""

from __future__ import annotations

import json

import pytest

from jax_dspark import cli
from jax_dspark.commands.generate import byte_decode, byte_encode

PROMPTS = ["hi", "hello world", "0123456789abcdef"]


def _run_json(capsys, *extra: str) -> dict:
    code = cli.main(["generate", *PROMPTS, "--target", "tiny-llama", "--max-new-tokens", "10", "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, "stdout must be exactly one JSON object"
    return json.loads(lines[0]) | {"_stderr": err}


def test_cli_greedy_dspark_and_plain_decoding_print_identical_tokens(capsys):
    spec = _run_json(capsys, "--drafter", "dspark")
    plain = _run_json(capsys, "--drafter", "none")
    assert spec["tokens"] == plain["tokens"]
    assert [len(t) for t in spec["tokens"]] == [10, 10, 10]
    for key in ("acceptance_length", "per_position_acceptance", "tokens_per_s", "verify_rate", "ttft_s"):
        assert key in spec, key
    assert len(spec["per_position_acceptance"]) == 4 and plain["per_position_acceptance"] == []
    assert plain["acceptance_length"] == 1.0
    assert spec["prompt_tokens"][1] == list(b"hello world")
    assert "30/30 tokens" in spec["_stderr"], "progress bar on stderr"


def test_cli_rejects_a_scheduler_without_a_throughput_table(capsys):
    code = cli.main(["generate", "hi", "--target", "tiny-llama", "--scheduler", "causal", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "--sps-table" in err


def test_byte_mapping_wraps_into_the_vocabulary_and_round_trips_ascii():
    assert byte_encode("é", 128) == [0xC3 % 128, 0xA9 % 128]
    assert byte_decode(byte_encode("plain ascii", 128)) == "plain ascii"
    with pytest.raises(ValueError, match="vocab_size"):
        byte_encode("x", 0)


def test_cli_without_a_prompt_uses_the_built_in_default(capsys):
    from jax_dspark.commands.generate import DEFAULT_PROMPT

    code = cli.main(["generate", "--target", "tiny-llama", "--drafter", "none", "--max-new-tokens", "2",
                     "--json", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["prompts"] == [DEFAULT_PROMPT]
