"""GGUF -> models.llama mapping and the GGUF-metadata tokenizer, on small synthetic files.

No download: each test writes its own GGUF with the `gguf` package's writer in the layout
llama.cpp's converter produces (HF `[out, in]` matrices, Q/K rows permuted for
adjacent-pair RoPE), so the loader is checked against the format, not against itself.
"""

from __future__ import annotations

import dataclasses

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from jax_dspark import ops
from jax_dspark.checkpoint import gguf as ckpt
from jax_dspark.models import llama
from jax_dspark.tokenizer import ChatTokenizer


def _converter_permutation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute`: each head's rows [2, D/2] -> [D/2, 2]."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_the_converter_permutation():
    w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(ckpt.unpermute_rope_rows(_converter_permutation(w, 3), 3), w)
    np.testing.assert_array_equal(ckpt.permute_rope_rows(w, 3), _converter_permutation(w, 3))


def test_unpermuted_weights_with_half_split_rope_give_the_gguf_attention_scores():
    # llama.cpp rotates adjacent pairs of the permuted projection; we rotate half-split
    # pairs of the un-permuted one. Attention only sees q.k, which must agree.
    rng = np.random.default_rng(1)
    heads, head_dim, d = 2, 16, 12
    w_gguf = rng.normal(size=(heads * head_dim, d)).astype(np.float32)
    w_ours = ckpt.unpermute_rope_rows(w_gguf, heads)
    x = rng.normal(size=(2, d)).astype(np.float32)   # a query token and a key token
    positions = np.array([7, 3])
    table = ops.rope_table(16, head_dim, theta=10000.0)

    def adjacent(w):
        y = jnp.asarray((x @ w.T).reshape(2, heads, head_dim))
        return ops.apply_rope(y, table[positions][:, None])

    def half_split(w):
        y = jnp.asarray((x @ w.T).reshape(1, 2, heads, head_dim))
        inv = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
        ang = positions[None, :, None, None] * inv
        return llama.rope_half_split(y, jnp.cos(ang), jnp.sin(ang))[0]

    ours = half_split(w_ours)
    theirs = adjacent(w_gguf)
    np.testing.assert_allclose((ours[0] * ours[1]).sum(-1), (theirs[0] * theirs[1]).sum(-1), rtol=1e-5, atol=1e-5)
    # and the rotated vectors themselves are the same up to that permutation
    np.testing.assert_allclose(
        ckpt.unpermute_rope_rows(np.asarray(theirs).reshape(2, -1).T, heads).T,
        np.asarray(ours).reshape(2, -1), rtol=1e-5, atol=1e-5)


def _write_llama_gguf(path, model: llama.Llama, *, quant=gguf.GGMLQuantizationType.F32) -> None:
    """Write `model` as llama.cpp's converter would (HF layout, permuted Q/K)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)

    def put(name, array, quantize=False):
        array = np.ascontiguousarray(np.asarray(array, np.float32))
        if quantize and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, array)

    layers = {k: np.asarray(v) for k, v in model.layers.arrays().items()}
    put("token_embd.weight", model.embedding[...], quantize=True)
    put("output_norm.weight", model.final_norm[...])
    if not cfg.tie_embeddings:
        put("output.weight", np.asarray(model.lm_head[...]).T, quantize=True)
    inter = cfg.intermediate_size
    for i in range(cfg.num_layers):
        put(f"blk.{i}.attn_norm.weight", layers["attn_norm"][i])
        put(f"blk.{i}.attn_q.weight", _converter_permutation(layers["wq"][i].T, cfg.num_heads), True)
        put(f"blk.{i}.attn_k.weight", _converter_permutation(layers["wk"][i].T, cfg.num_kv_heads), True)
        put(f"blk.{i}.attn_v.weight", layers["wv"][i].T, True)
        put(f"blk.{i}.attn_output.weight", layers["wo"][i].T, True)
        put(f"blk.{i}.ffn_norm.weight", layers["mlp_norm"][i])
        put(f"blk.{i}.ffn_gate.weight", layers["w_gate_up"][i][:, :inter].T, True)
        put(f"blk.{i}.ffn_up.weight", layers["w_gate_up"][i][:, inter:].T, True)
        put(f"blk.{i}.ffn_down.weight", layers["w_down"][i].T, True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _logits(model, tokens):
    n = tokens.shape[1]
    i32 = lambda v: jnp.asarray([v], jnp.int32)  # noqa: E731
    logits, _, _ = model(tokens, model.init_cache(1, n), slots=i32(0), starts=i32(0), lengths=i32(n))
    return logits


def _load(path):
    reader = ckpt.open_gguf(path)
    config = ckpt.llama_config_from_gguf(reader, capture_layers=(), page_size=llama.TINY.page_size)
    return llama.llama_from_params(config, ckpt.llama_params_from_gguf(reader, config))


@pytest.mark.parametrize("tied", [True, False])
def test_float32_gguf_round_trip_reproduces_the_model(tmp_path, tied):
    config = dataclasses.replace(llama.TINY, tie_embeddings=tied, capture_layers=())
    source = llama.tiny_llama(seed=3, config=config)
    path = tmp_path / "tiny.gguf"
    _write_llama_gguf(path, source)
    loaded = _load(path)
    assert loaded.config == config
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, config.vocab_size, (1, 9)), jnp.int32)
    np.testing.assert_allclose(_logits(loaded, tokens), _logits(source, tokens), atol=1e-5, rtol=1e-5)


def test_q8_0_gguf_loads_within_quantisation_error(tmp_path):
    source = llama.tiny_llama(seed=5, config=dataclasses.replace(llama.TINY, capture_layers=()))
    path = tmp_path / "tiny_q8.gguf"
    _write_llama_gguf(path, source, quant=gguf.GGMLQuantizationType.Q8_0)
    loaded = _load(path)
    for name, value in source.layers.arrays().items():
        got = loaded.layers.arrays()[name]
        # Q8_0: 32 values share one f16 scale amax/127, so the error is <= half a step.
        step = np.abs(np.asarray(value)).max() / 127
        np.testing.assert_allclose(got, value, atol=step, err_msg=name)
    assert not np.array_equal(loaded.layers.arrays()["wq"], source.layers.arrays()["wq"])


def test_config_rejects_a_non_llama_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture"):
        ckpt.llama_config_from_gguf(ckpt.open_gguf(path))


def _byte_bpe_metadata() -> dict:
    """A miniature SmolLM2-style vocabulary: 3 control tokens, the 256 byte symbols, a
    few merges ("he", "hel", "hell", "hello", "Ġw")."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "he l", "hel l", "hell o", "Ġ w"]
    tokens = specials + alphabet + [m.replace(" ", "") for m in merges]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}",
    }


def test_tokenizer_encodes_control_tokens_as_single_ids():
    tok = ChatTokenizer.from_gguf_metadata(_byte_bpe_metadata())
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    vocab = tok.tokenizer.get_vocab()
    assert ids == [1, vocab["hello"], 2]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>hello<|im_end|>"


def test_tokenizer_splits_digits_and_round_trips_bytes():
    tok = ChatTokenizer.from_gguf_metadata(_byte_bpe_metadata())
    text = "hello world 2024 ünïcödé\n\t!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    pieces = tok.tokenizer.encode("x 2024", add_special_tokens=False).tokens
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_chat_template_is_chatml_with_the_files_default_system_message():
    tok = ChatTokenizer.from_gguf_metadata(_byte_bpe_metadata())
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    own_system = tok.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
                                 add_generation_prompt=False)
    assert own_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert tok.eos_ids == (2, 0)


def test_tokenizer_rejects_sentencepiece_vocabularies():
    meta = dict(_byte_bpe_metadata(), **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="gpt2"):
        ChatTokenizer.from_gguf_metadata(meta)
