"""Weights from files into `jax_dspark.models`.

`gguf` maps llama.cpp GGUF files (any block quantisation the `gguf` package dequantises)
onto `models.llama`; `smollm2` fetches and loads the default real target,
SmolLM2-135M-Instruct, with its tokenizer. Both import lazily so `import jax_dspark` does
not need the optional `gguf` / `tokenizers` packages.
"""

from __future__ import annotations

__all__ = ["load_smollm2"]


def load_smollm2(**kwargs):
    """`(model, tokenizer)` of SmolLM2-135M-Instruct; see `checkpoint.smollm2.load_smollm2`."""
    from jax_dspark.checkpoint.smollm2 import load_smollm2 as _load

    return _load(**kwargs)
