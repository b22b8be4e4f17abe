"""Input-contract helpers shared by the ops: every failure names the argument and value."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def fail(name: str, problem: str, value: Any) -> None:
    raise ValueError(f"{name}: {problem} (got {value!r})")


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def check_rank(name: str, x: Any, rank: int, layout: str) -> tuple[int, ...]:
    shape = shape_of(x)
    if len(shape) != rank:
        fail(name, f"expected rank {rank} {layout}", shape)
    return shape


def check_dtype(name: str, x: Any, allowed: tuple[Any, ...]) -> None:
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if not any(dtype == np.dtype(a) for a in allowed):
        fail(name, f"dtype must be one of {[np.dtype(a).name for a in allowed]}", dtype.name)


def check_floating(name: str, x: Any) -> None:
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    if not np.issubdtype(dtype, np.floating) and dtype.name not in ("bfloat16",):
        fail(name, "must be a floating-point array", dtype.name)


def concrete(x: Any) -> np.ndarray | None:
    """The value of `x` as numpy when it is known now (not a tracer), else None.

    Value checks (index ranges, duplicate experts) can only run on concrete inputs; under
    `jit` the ops instead treat out-of-range values as masked so nothing is read out of
    bounds.
    """
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - anything that is not materialisable now
        return None
