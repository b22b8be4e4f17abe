"""FP8 key=value rows for the sparse sink attention (DeepSeek-V4's "MODEL1" KV row format).

A V4 cache row is 512 wide: 448 "nope" dims and 64 RoPE dims. The FP8 form keeps the 448
nope dims as e4m3 with one power-of-two (UE8M0) scale per 64 values (7 scales, exponent
rounded up exactly as `ops.fp8.quantize_fp8` does) and the 64 RoPE dims in bf16, which
DeepSeek leaves unquantised for accuracy. That is 448 + 128 + 8 = 584 bytes per row instead
of 1024, and decode attention is bound by the bytes it reads.

JAX form: `Fp8Rows(nope, rope, scale)`, a NamedTuple (so a pytree: it passes through `jit`,
`vmap` and `.at[].set` field by field):

- `nope  float8_e4m3fn[..., 448]`
- `rope  bfloat16[..., 64]`
- `scale uint8[..., 8]`: bytes 0..6 are the UE8M0 exponents (scale `2^(byte - 127)`) of the
  nope blocks `[64 i, 64 i + 64)`; byte 7 is padding (written 0, ignored on read). Eight,
  not seven, bytes: MODEL1 stores 8 per token, and the CUDA loader then fetches a row's
  scales with one aligned 8-byte load.

Dequantised values are exact in bf16 (an e4m3 value has 4 significant bits and the scale is
a power of two), so "attention over FP8 rows" means exactly "attention over
`dequantize_kv_rows(rows)`".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dspark.ops import _checks
from jax_dspark.ops.fp8 import dequantize_fp8, quantize_fp8

NOPE_DIM = 448
ROPE_DIM = 64
ROW_DIM = NOPE_DIM + ROPE_DIM
SCALE_BLOCK = 64
NUM_SCALES = NOPE_DIM // SCALE_BLOCK  # 7
SCALE_BYTES = 8  # 7 exponents + 1 pad byte
ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM + SCALE_BYTES  # 584 bytes read per row


class Fp8Rows(NamedTuple):
    """Rows in FP8 form (see the module docstring): nope e4m3, rope bf16, scale bytes."""

    nope: jax.Array  # float8_e4m3fn [..., 448]
    rope: jax.Array  # bfloat16 [..., 64]
    scale: jax.Array  # uint8 [..., 8]


def is_fp8_rows(x) -> bool:
    return isinstance(x, Fp8Rows)


def quantize_kv_rows(rows: jax.Array) -> Fp8Rows:
    """Quantise `[..., 512]` floating rows into the FP8 row form.

    Args:
      rows: `[..., 512]` bf16 / f32 rows (448 nope dims then 64 RoPE dims).
    Returns:
      `Fp8Rows(nope e4m3[..., 448], rope bf16[..., 64], scale u8[..., 8])`.
    """
    _checks.check_floating("rows", rows)
    shape = _checks.shape_of(rows)
    if not shape or shape[-1] != ROW_DIM:
        _checks.fail("rows", f"last dim must be {ROW_DIM} ({NOPE_DIM} nope + {ROPE_DIM} rope)", shape)
    nope, exps = quantize_fp8(rows[..., :NOPE_DIM], SCALE_BLOCK)
    pad = jnp.zeros((*shape[:-1], SCALE_BYTES - NUM_SCALES), jnp.uint8)
    return Fp8Rows(nope, rows[..., NOPE_DIM:].astype(jnp.bfloat16), jnp.concatenate([exps, pad], axis=-1))


def dequantize_kv_rows(rows: Fp8Rows, dtype=jnp.bfloat16) -> jax.Array:
    """`[..., 512]` rows in `dtype`: `nope * 2^(scale - 127)` per 64-block, then rope."""
    nope = dequantize_fp8(rows.nope, rows.scale[..., :NUM_SCALES], SCALE_BLOCK, dtype=dtype)
    return jnp.concatenate([nope, rows.rope.astype(dtype)], axis=-1)


def take_kv_rows(rows: Fp8Rows, idx: jax.Array) -> Fp8Rows:
    """Rows `idx` (any int shape, values in range) of a pool `[N, ...]`, field by field."""
    return Fp8Rows(*(jnp.take(field, idx, axis=0) for field in rows))


def check_kv_pool(name: str, rows) -> int:
    """Validate an FP8 row pool `[N, ...]` (ValueError naming `name.<field>`); returns N."""
    if not is_fp8_rows(rows):
        _checks.fail(name, "must be an Fp8Rows(nope, rope, scale)", type(rows).__name__)
    expected = (
        ("nope", NOPE_DIM, np.dtype(jnp.float8_e4m3fn)),
        ("rope", ROPE_DIM, np.dtype(jnp.bfloat16)),
        ("scale", SCALE_BYTES, np.dtype(np.uint8)),
    )
    n = None
    for field, width, dtype in expected:
        value = getattr(rows, field)
        shape = _checks.check_rank(f"{name}.{field}", value, 2, f"[N, {width}]")
        if shape[1] != width:
            _checks.fail(f"{name}.{field}", f"last dim must be {width}", shape)
        _checks.check_dtype(f"{name}.{field}", value, (dtype,))
        if n is None:
            n = shape[0]
        elif shape[0] != n:
            _checks.fail(f"{name}.{field}", f"must have as many rows as {name}.nope ({n})", shape)
    return n
