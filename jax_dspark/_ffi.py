"""Finds the compiled kernel library, registers its FFI targets, decides kernel vs reference.

(Initial version by the lead; the kernel helper extends it with the library loading.)
"""

from __future__ import annotations

import jax

_MODES = ("auto", "reference", "kernel")
_force = "auto"


def force_mode() -> str:
    return _force


def set_force_mode(mode: str) -> None:
    global _force
    if mode not in _MODES:
        raise ValueError(f"mode: must be one of {_MODES} (got {mode!r})")
    _force = mode


def kernel_report() -> dict[str, str]:
    return {}


def _on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def use_kernel(name: str) -> bool:
    if _force == "reference":
        return False
    available = kernel_report().get(name) == "registered" and _on_gpu()
    if _force == "kernel" and not available:
        raise RuntimeError(f"kernel {name!r} forced but not available: {kernel_report().get(name, 'not built')}")
    return available
