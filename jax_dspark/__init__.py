"""jax-dspark: DSpark speculative decoding in JAX.

Public surface: `jax_dspark.ops` (attention, norms, RoPE, FP8, MoE, sampling, each with a
pure-JAX reference), `jax_dspark.models` (Flax NNX targets and drafters), `jax_dspark.spec`
(propose / verify / schedule / engine) and `jax_dspark.kernels()` (which CUDA kernels are
registered, and why not).
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout `models/` sits beside this package; an installed wheel has it at
# `jax_dspark/models`. Extending the package path lets `jax_dspark.models` resolve in both.
_here = _os.path.dirname(__file__)
if not _os.path.isdir(_os.path.join(_here, "models")):
    _root_models = _os.path.join(_os.path.dirname(_here), "models")
    if _os.path.isfile(_os.path.join(_root_models, "__init__.py")):
        __path__.append(_os.path.dirname(_here))  # type: ignore[name-defined]


def kernels() -> dict[str, str]:
    """Names of the CUDA kernels and, for each, "registered" or the reason it is not."""
    from jax_dspark import _ffi

    return _ffi.kernel_report()


def generate(*args, **kwargs):
    """Speculative generation; see `jax_dspark.spec.engine.generate` (imported on first use)."""
    from jax_dspark.spec.engine import generate as _generate

    return _generate(*args, **kwargs)
