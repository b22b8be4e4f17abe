"""Config checks shared by the model configs (ValueError naming the field and value)."""

from __future__ import annotations


def positive_ints(config, names: tuple[str, ...]) -> None:
    """Each named field of `config` is an int > 0."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: must be a positive int (got {value!r})")


def grouped_query_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """GQA shape rules: KV heads divide query heads; head_dim even for RoPE pairs."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: must divide num_heads={num_heads} (got {num_kv_heads!r})")
    if head_dim % 2:
        raise ValueError(f"head_dim: must be even for RoPE pairs (got {head_dim!r})")
