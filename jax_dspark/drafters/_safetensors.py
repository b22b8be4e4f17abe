"""Read and write the safetensors file format with numpy alone.

The committed drafters are safetensors files so any tool of the Hugging Face ecosystem can
open them, but the package does not depend on the `safetensors` wheel for two small
functions: the format is an 8-byte little-endian header length, a JSON header mapping each
name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the end of
the header), then the raw little-endian bytes. bfloat16 comes from `ml_dtypes` (a JAX
dependency), so bf16 weights round-trip without a float32 copy on disk.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

__all__ = ["save_safetensors", "load_safetensors"]

_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def save_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (name -> array of a dtype in `_DTYPES`) to `path`, names sorted."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        arr = np.ascontiguousarray(value).reshape(value.shape)  # ascontiguousarray makes 0-d arrays 1-d
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensors[{name!r}]: dtype must be one of {sorted(_NAMES.values())} (got {arr.dtype})")
        blob = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`(tensors, metadata)` of a safetensors file; arrays are copies (the file is closed)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"path: {os.fspath(path)!r} is too short to be a safetensors file")
    (size,) = struct.unpack("<Q", raw[:8])
    if 8 + size > len(raw):
        raise ValueError(f"path: header length {size} runs past the end of {os.fspath(path)!r}")
    header = json.loads(raw[8:8 + size])
    metadata = header.pop("__metadata__", {}) or {}
    data = memoryview(raw)[8 + size:]
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"path: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]].newbyteorder("<")
        arr = np.frombuffer(data[begin:end], dtype=dtype).reshape(info["shape"])
        tensors[name] = arr.astype(arr.dtype.newbyteorder("="), copy=True)
    return tensors, dict(metadata)
