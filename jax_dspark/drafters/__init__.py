"""Trained DSpark drafters shipped with the package, and how to save and load one.

Each drafter is two files in this folder: `<name>.safetensors` (bf16 weights, names are the
dotted `nnx` parameter paths: `fc`, `layers.wq`, `markov.w1`, `confidence.w`, ...) and
`<name>.json` (`config`: the `DSparkConfig` fields; `target`: which target it was trained
for; `command`: the exact command that reproduced it; `training`: what the run measured).
Weights are stored in bfloat16 to keep every file under 16 MiB; `load_drafter` upcasts them
to the requested dtype, so the numbers a loaded drafter produces are those of the bf16
weights on every machine.

Shipped:
- `smollm2_dspark`: standalone DSpark drafter for SmolLM2-135M-Instruct (Markov head on,
  embedding-tied, gated since run 8 of docs/training.md).
- `smollm2_markov_off`: the same recipe with `markov_rank = 0` (the DFlash-like ablation).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jax_dspark.drafters._safetensors import load_safetensors, save_safetensors

__all__ = ["DRAFTER_DIR", "available", "drafter_path", "load_drafter", "load_drafter_meta", "save_drafter"]

DRAFTER_DIR = Path(__file__).resolve().parent


def available() -> list[str]:
    """Names of the drafters present in `DRAFTER_DIR` (both files found)."""
    return sorted(p.stem for p in DRAFTER_DIR.glob("*.safetensors") if p.with_suffix(".json").is_file())


def drafter_path(name_or_path: str | os.PathLike[str]) -> Path:
    """`<stem>.safetensors` for a shipped name (`"smollm2_dspark"`) or a path with or
    without the suffix."""
    p = Path(name_or_path)
    if p.suffix == ".safetensors" and p.is_file():
        return p
    for candidate in (p.with_suffix(".safetensors"), DRAFTER_DIR / f"{p.name}.safetensors"):
        if candidate.is_file() and candidate.with_suffix(".json").is_file():
            return candidate
    raise ValueError(f"name_or_path: no drafter {os.fspath(name_or_path)!r} "
                     f"(shipped: {available()}; a path needs <stem>.safetensors and <stem>.json)")


def load_drafter_meta(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON beside a drafter's weights (config, target, command, training)."""
    with open(drafter_path(name_or_path).with_suffix(".json")) as f:
        return json.load(f)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def save_drafter(drafter, path: str | os.PathLike[str], meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write `<path>.safetensors` (bf16) and `<path>.json` (`meta` plus the config).

    Args:
      drafter: a `models.dspark.DSparkDrafter`.
      path: output path without suffix (a `.safetensors` suffix is replaced).
      meta: JSON-serialisable fields stored beside `config` (target, command, training).
    Returns:
      the two paths written.
    """
    import jax
    import ml_dtypes
    from flax import nnx

    stem = Path(path)
    if stem.suffix in (".safetensors", ".json"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    flat = _flatten(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    tensors = {k: np.asarray(jax.device_get(v), np.float32).astype(ml_dtypes.bfloat16) for k, v in flat.items()}
    weights, info = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    save_safetensors(weights, tensors, metadata={"format": "jax-dspark drafter", "dtype": "bfloat16"})
    record = dict(meta)
    record["config"] = dataclasses.asdict(drafter.config)
    record["weights_dtype"] = "bfloat16"
    with open(info, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    return weights, info


def load_drafter(name_or_path: str | os.PathLike[str] = "smollm2_dspark", *, dtype: str = "float32",
                 target=None):
    """A `DSparkDrafter` with the saved weights (upcast from bf16 to `dtype`).

    Args:
      name_or_path: a shipped name (see `available()`) or a path to `<stem>.safetensors`
        with its `<stem>.json`.
      dtype: compute / parameter dtype ("float32" or "bfloat16").
      target: the target the drafter will decode with; given, an embedding-tied Markov
        head is turned into free tables once here (`DSparkDrafter.with_markov_tables`:
        the same bias, cheaper per draft position). Without it the drafter is returned
        as stored (what training and saving need).
    Raises:
      ValueError: unknown drafter, or weights that do not match the stored config.
    """
    import jax.numpy as jnp
    from flax import nnx

    from jax_dspark.models.dspark import DSparkConfig, DSparkDrafter

    weights = drafter_path(name_or_path)
    meta = load_drafter_meta(weights)
    config = DSparkConfig(**dict(meta["config"], dtype=dtype))
    model = nnx.eval_shape(lambda: DSparkDrafter(config, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    expected = _flatten(nnx.to_pure_dict(state))
    tensors, _ = load_safetensors(weights)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"name_or_path: {weights} does not match its config: missing {missing}, unexpected {extra}")
    values = {}
    for name, abstract in expected.items():
        if tuple(tensors[name].shape) != tuple(abstract.shape):
            raise ValueError(f"name_or_path: {weights}[{name!r}] has shape {tensors[name].shape}, "
                             f"config expects {tuple(abstract.shape)}")
        values[name] = jnp.asarray(np.asarray(tensors[name], np.float32), abstract.dtype)
    nnx.replace_by_pure_dict(state, _unflatten(values))
    nnx.update(model, state)
    return model if target is None else model.with_markov_tables(target)
