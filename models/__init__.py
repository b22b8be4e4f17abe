"""Flax NNX model definitions, importable as `jax_dspark.models`.

Targets: `llama` (dense Llama family, SmolLM2), `deepseek_v4` (DeepSeek-V4 Flash / Pro).
Drafters: `dspark` (standalone, dense targets), `dspark_v4` (V4-embedded), `dspark_heads`
(Markov and confidence heads), `deepseek_v4_mtp` (V4's MTP block as an MTP-1 drafter),
`dspark_model_drafter` (any target-protocol model drafting
autoregressively). Submodules are imported on first attribute access so importing the
package stays cheap.
"""

import importlib

_EXPORTS = {
    "Llama": "llama",
    "LlamaConfig": "llama",
    "DeepseekV4": "deepseek_v4",
    "DeepseekV4Config": "deepseek_v4_config",
    "DSparkConfig": "dspark",
    "DSparkDrafter": "dspark",
    "DSparkState": "dspark",
    "tiny_dspark": "dspark",
    "DSparkV4Config": "dspark_v4",
    "DSparkV4Drafter": "dspark_v4",
    "DSparkV4State": "dspark_v4",
    "tiny_dspark_v4": "dspark_v4",
    "ModelDrafter": "dspark_model_drafter",
    "MTPDrafter": "deepseek_v4_mtp",
    "MarkovHead": "dspark_heads",
    "EmbeddingMarkovHead": "dspark_heads",
    "ConfidenceHead": "dspark_heads",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
