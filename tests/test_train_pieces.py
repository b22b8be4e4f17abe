"""Training pieces: prompts disjoint from the eval sets, anchors and labels, the loss."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark.train import anchors, losses, prompts

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "prompts")


def _code_block(prompt: str) -> str:
    """The Python source inside a prompt's ```python fence."""
    return prompt.split("```python\n", 1)[1].rsplit("\n```", 1)[0]


def test_training_prompts_are_deterministic_distinct_and_mixed():
    a = prompts.training_prompts(300, seed=3)
    assert a == prompts.training_prompts(300, seed=3)
    assert len(set(a)) == 300
    assert sum(p.endswith(prompts.MATH_SUFFIX) for p in a) > 50
    assert sum("Python function" in p for p in a) > 50


def test_code_methods_add_class_method_prompts_whose_source_parses():
    import ast

    plain = prompts.training_prompts(3000, seed=0, mix=(0, 1, 0))
    more = prompts.training_prompts(3000, seed=0, mix=(0, 1, 0), code_methods=True)
    assert len(more) > 1.5 * len(plain)
    methods = [p for p in more if p.startswith("Write a Python function `") and "." in p.split("`")[1].split("(")[0]]
    assert methods
    for p in more:
        if p.startswith("Explain what this Python function does"):
            ast.parse(_code_block(p))


def test_code_stubs_add_implement_prompts_whose_code_is_signature_and_docstring_only():
    import ast

    plain = prompts.training_prompts(3000, seed=0, mix=(0, 1, 0))
    more = prompts.training_prompts(3000, seed=0, mix=(0, 1, 0), code_stubs=True)
    stubs = [p for p in more if p.startswith("Implement this Python function")]
    assert len(stubs) > 0.25 * len(more) and len(more) > 1.3 * len(plain)
    for p in stubs:
        (fn,) = ast.parse(_code_block(p)).body
        assert isinstance(fn, ast.FunctionDef) and len(fn.body) == 1 and ast.get_docstring(fn)


def test_text_extended_adds_distinct_instruction_kinds_and_keeps_the_plain_ones():
    plain = prompts.training_prompts(5000, seed=0, mix=(0, 0, 1))
    more = prompts.training_prompts(5000, seed=0, mix=(0, 0, 1), text_extended=True)
    assert len(plain) < 3000 and len(more) == 5000  # the plain templates run out; the extended do not
    assert sum(p.startswith("List every person, object and number") for p in more) > 200
    assert sum(any(p.startswith(t.split("{")[0]) for t in prompts._TASKS if t.split("{")[0]) for p in more) > 1000


def test_reproduce_command_names_the_prompt_source_flags_only_when_set():
    import argparse

    from jax_dspark.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    command = lambda *extra: train.reproduce_command(  # noqa: E731
        parser.parse_args(["--out", "d", *extra]), steps=5, markov_rank=4, markov_factors="table", out="d")
    assert not any(f in command() for f in ("--code-methods", "--code-stubs", "--text-extended"))
    assert "--code-methods --code-stubs --text-extended" in command("--code-methods", "--code-stubs", "--text-extended")


@pytest.mark.parametrize("mix", [(1, 1), (-1, 1, 1), (0, 0, 0)])
def test_training_prompts_reject_a_bad_mix(mix):
    with pytest.raises(ValueError, match="mix"):
        prompts.training_prompts(10, mix=mix)


@pytest.mark.skipif(not os.path.isdir(SHARED), reason="shared/data/prompts not beside the checkout")
def test_training_prompts_share_no_prompt_with_the_eval_sets():
    evals = set()
    for name in os.listdir(SHARED):
        if name.endswith(".jsonl"):
            with open(os.path.join(SHARED, name)) as fh:
                for line in fh:
                    for turn in json.loads(line)["turns"]:
                        evals.add(turn.strip())
    ours = prompts.training_prompts(2000, seed=0) + prompts.training_prompts(
        2000, seed=1, code_methods=True, code_stubs=True, text_extended=True)
    assert not evals & {p.strip() for p in ours}
    # no eval question body appears inside a training prompt either
    bodies = {e.split("\n")[0][:80] for e in evals if len(e) > 40}
    assert not any(b in p for p in ours for b in bodies)


def test_anchors_need_two_consecutive_response_positions():
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 0], bool)
    got = anchors.sample_anchors(np.random.default_rng(0), mask, 10)
    assert got[:3].tolist() == [2, 3, 6] and np.all(got[3:] == -1)


def test_block_labels_stop_at_the_first_invalid_label():
    tokens = np.arange(100, 110)
    mask = np.array([0, 1, 1, 1, 1, 0, 1, 1, 1, 1], bool)
    labels, valid = anchors.block_labels(tokens, mask, np.array([1, 7, -1]), 4)
    assert labels[0].tolist() == [102, 103, 104, 0] and valid[0].tolist() == [True, True, True, False]
    assert valid[1].tolist() == [True, True, False, False]  # runs off the end
    assert not valid[2].any()


def test_loss_is_zero_tv_when_draft_equals_target_and_confidence_target_is_acceptance():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((3, 4, 11)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 11, (3, 4)), jnp.int32)
    valid = jnp.ones((3, 4), bool)
    _, m = losses.dspark_loss(logits, logits, labels, valid, jnp.zeros((3, 4)))
    assert float(m["tv"]) < 1e-6 and abs(float(m["acceptance"]) - 1.0) < 1e-6
    # BCE against target 1 at logit 0 is log 2
    np.testing.assert_allclose(float(m["bce"]), np.log(2), rtol=1e-5)


def test_loss_weights_decay_with_position_and_ignore_invalid_slots():
    rng = np.random.default_rng(1)
    d = jnp.asarray(rng.standard_normal((2, 3, 7)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((2, 3, 7)), jnp.float32)
    labels = jnp.zeros((2, 3), jnp.int32)
    valid = jnp.array([[True, True, False], [True, False, False]])
    loss, m = losses.dspark_loss(d, t, labels, valid)
    poisoned = d.at[0, 2].set(1e4).at[1, 1:].set(-1e4)
    loss2, _ = losses.dspark_loss(poisoned, t, labels, valid)
    np.testing.assert_allclose(loss, loss2, rtol=1e-6)
    np.testing.assert_allclose(float(m["weight"]), 2 + np.exp(-0.25), rtol=1e-6)
    grad = jax.grad(lambda x: losses.dspark_loss(x, t, labels, valid)[0])(d)
    assert np.all(np.asarray(grad[0, 2]) == 0)
