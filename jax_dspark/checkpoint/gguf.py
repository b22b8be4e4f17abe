"""Llama-family weights from a GGUF file (llama.cpp's format) into `models.llama` params.

Reading, metadata parsing and block dequantisation (Q4_1, Q8_0, K-quants, F16, ...) come
from the `gguf` package (pure numpy). What this module adds is the mapping onto our
parameter layout and one subtle step: llama.cpp's converter permutes the rows of the Q and
K projections of Llama-family models so that its "normal" RoPE, which rotates ADJACENT
pairs (2i, 2i+1), computes what HF's half-split RoPE (i, i + D/2) computes on the original
rows. `models.llama` uses the HF pairing, so `unpermute_rope_rows` undoes that permutation
per head; without it the model still runs but attends to the wrong positions and its text
degrades into nonsense rather than failing loudly.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jax_dspark.models.llama import LAYER_PARAMS
from jax_dspark.models.llama_config import LlamaConfig

__all__ = [
    "open_gguf", "gguf_metadata", "dequantize", "unpermute_rope_rows", "permute_rope_rows",
    "llama_config_from_gguf", "llama_params_from_gguf",
]


def open_gguf(path: str | os.PathLike[str]):
    """A `gguf.GGUFReader` over the file (memory-mapped; tensors are read lazily)."""
    import gguf

    if not os.path.isfile(path):
        raise ValueError(f"path: no such GGUF file (got {os.fspath(path)!r})")
    return gguf.GGUFReader(path)


def gguf_metadata(reader) -> dict[str, Any]:
    """Every metadata key of the file with its decoded value (str, number, bool or list)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def dequantize(tensor) -> np.ndarray:
    """`float32` array of one GGUF tensor in numpy order (`[rows, cols]` = HF `[out, in]`).

    The `gguf` package's dequantisers cover every llama.cpp block format; an unsupported
    one raises its NotImplementedError, naming the type.
    """
    from gguf import quants

    values = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: `w [num_heads * D, ...]` in GGUF order ->
    HF order, head by head.

    The converter maps HF row `h*D + j*(D/2) + i` to GGUF row `h*D + 2*i + j` (j in {0, 1}),
    i.e. it views each head's rows as `[2, D/2]` and transposes them to `[D/2, 2]`.
    """
    rows = w.shape[0]
    if num_heads <= 0 or rows % (2 * num_heads):
        raise ValueError(f"num_heads: must split {rows} rows into heads of even size (got {num_heads})")
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The converter's permutation (HF order -> GGUF order); the inverse of
    `unpermute_rope_rows`, used to write GGUF files in tests."""
    rows = w.shape[0]
    if num_heads <= 0 or rows % (2 * num_heads):
        raise ValueError(f"num_heads: must split {rows} rows into heads of even size (got {num_heads})")
    head_dim = rows // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _scalar(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"reader: GGUF metadata lacks {key!r}")
    return meta[key]


def llama_config_from_gguf(reader, **overrides: Any) -> LlamaConfig:
    """The `LlamaConfig` a GGUF file describes (architecture "llama"); `overrides` set the
    fields the file cannot know (capture_layers, page_size, dtype).

    Tying is read from the tensors: no `output.weight` means the LM head is the embedding.
    """
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"reader: general.architecture must be 'llama' (got {arch!r})")
    names = {t.name for t in reader.tensors}
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"reader: partial RoPE is not supported (rope dims {rope_dims} != head_dim {head_dim})")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    fields = dict(
        vocab_size=int(meta.get("llama.vocab_size", int(embd.shape[1]))),
        hidden_size=hidden,
        num_layers=int(_scalar(meta, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(_scalar(meta, "llama.feed_forward_length")),
        # Stored as float32: 1e-5 reads back as 9.99999974e-06; 7 significant digits undo that.
        rope_theta=float(f'{float(meta.get("llama.rope.freq_base", 10000.0)):.7g}'),
        rms_eps=float(f'{float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")):.7g}'),
        tie_embeddings="output.weight" not in names,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def llama_params_from_gguf(reader, config: LlamaConfig) -> dict[str, np.ndarray]:
    """Float32 params for `models.llama.llama_from_params`, stacked per layer, Q/K rows
    un-permuted, weights transposed to our `(in, out)` layout."""
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"reader: GGUF file lacks tensor {name!r}")
        return dequantize(tensors[name])

    def per_layer(name: str) -> list[np.ndarray]:
        return [get(f"blk.{i}.{name}.weight") for i in range(config.num_layers)]

    layers = {
        "attn_norm": np.stack(per_layer("attn_norm")),
        "wq": np.stack([unpermute_rope_rows(w, config.num_heads).T for w in per_layer("attn_q")]),
        "wk": np.stack([unpermute_rope_rows(w, config.num_kv_heads).T for w in per_layer("attn_k")]),
        "wv": np.stack([w.T for w in per_layer("attn_v")]),
        "wo": np.stack([w.T for w in per_layer("attn_output")]),
        "mlp_norm": np.stack(per_layer("ffn_norm")),
        "w_gate_up": np.stack([np.concatenate([g.T, u.T], axis=1)
                               for g, u in zip(per_layer("ffn_gate"), per_layer("ffn_up"))]),
        "w_down": np.stack([w.T for w in per_layer("ffn_down")]),
    }
    params = {"embedding": get("token_embd.weight"), "final_norm": get("output_norm.weight")}
    if not config.tie_embeddings:
        params["lm_head"] = get("output.weight").T
    params.update({f"layers.{name}": value for name, value in layers.items()})
    for name, shape_of in LAYER_PARAMS.items():
        if params[f"layers.{name}"].shape != shape_of(config):
            raise ValueError(
                f"reader: layers.{name} has shape {params[f'layers.{name}'].shape}, "
                f"config expects {shape_of(config)}")
    return params
