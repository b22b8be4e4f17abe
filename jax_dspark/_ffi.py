"""Finds the compiled kernel library, registers its FFI targets, decides kernel vs reference.

The CUDA library is optional: a pure-Python install (no nvcc at build time) and every CPU
machine run the pure-JAX references. Where the library exists it comes in one of two forms
built from the same objects (docs/kernels.md):

- `jax_dspark._C`, a pybind11 module handing out the handler capsules (tied to the Python
  version it was built for);
- `jax_dspark/libjax_dspark_ffi.so`, a plain shared library with the same handlers and a C
  API, loaded with ctypes (any Python version).

`JAX_DSPARK_FFI_LIB=/path/libjax_dspark_ffi.so` forces the ctypes route with that file;
`JAX_DSPARK_DISABLE_FFI=1` disables kernels altogether.

Registration is lazy (first `use_kernel` / `kernel_report`) and happens only on a GPU backend
with a compute-capability-9.0 device (the library holds sm_90a code only). It runs after the
backend is up, so an FFI API-version mismatch surfaces here, as a reason in
`kernel_report()`, instead of at the first compile.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax

# Kernel name (what ops ask `use_kernel` about) -> the FFI targets it needs.
KERNELS: dict[str, tuple[str, ...]] = {
    "sparse_sink_attention": ("jax_dspark_sparse_sink_attention",),
    "sparse_sink_attention_wgmma": ("jax_dspark_sparse_sink_attention_wgmma",),  # the default for both pool kinds, ops/_kernels.py
    "rms_norm_rope": ("jax_dspark_rms_norm_rope", "jax_dspark_rms_norm_rope_fp8"),
    "moe_experts": ("jax_dspark_moe_experts",),
    "moe_experts_fp8": ("jax_dspark_moe_experts_fp8",),
    "moe_route": ("jax_dspark_moe_route", "jax_dspark_moe_hash_route"),
}
REGISTERED = "registered"
_MODES = ("auto", "reference", "kernel")
_LIB_NAME = "libjax_dspark_ffi.so"

_force = "auto"
_lock = threading.RLock()
_status: dict[str, str] | None = None
_library: Library | str | None = None


@dataclass(frozen=True)
class Library:
    """A loaded kernel library: where it came from and what it offers."""

    route: str  # "pybind11" or "ctypes"
    path: str
    capsules: dict[str, object]  # FFI target name -> handler capsule
    api_version: tuple[int, int]  # XLA FFI API version of the headers it was built with
    metadata: Callable[[str], tuple[int, int, int]]  # target -> (major, minor, traits)


def force_mode() -> str:
    """The current choice: "auto", "reference" or "kernel"."""
    return _force


def set_force_mode(mode: str) -> None:
    """Force kernels ("kernel"), references ("reference") or choose per op ("auto").

    Read at trace time. Under "kernel", `use_kernel` raises for a kernel that cannot run.
    """
    global _force
    if mode not in _MODES:
        raise ValueError(f"mode: must be one of {_MODES} (got {mode!r})")
    _force = mode


@contextlib.contextmanager
def forced(mode: str) -> Iterator[None]:
    """Context manager form of `set_force_mode` that restores the previous mode."""
    previous = _force
    set_force_mode(mode)
    try:
        yield
    finally:
        set_force_mode(previous)


def _ctypes_library(path: str) -> Library | str:
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        return f"cannot load {path}: {err}"
    lib.jax_dspark_target_names.restype = ctypes.c_char_p
    pairs = [item.split("=") for item in lib.jax_dspark_target_names().decode().split(",") if item]
    capsules = {target: jax.ffi.pycapsule(getattr(lib, symbol)) for target, symbol in pairs}
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.jax_dspark_ffi_api_version(ctypes.byref(major), ctypes.byref(minor))

    def metadata(target: str) -> tuple[int, int, int]:
        a, b, t = ctypes.c_int(), ctypes.c_int(), ctypes.c_uint()
        rc = lib.jax_dspark_handler_metadata(target.encode(), ctypes.byref(a), ctypes.byref(b), ctypes.byref(t))
        if rc != 0:
            raise ValueError(f"target: no metadata for {target!r} (code {rc})")
        return a.value, b.value, t.value

    return Library("ctypes", path, capsules, (major.value, minor.value), metadata)


def _find_library() -> Library | str:
    if os.environ.get("JAX_DSPARK_DISABLE_FFI", "") not in ("", "0"):
        return "disabled by JAX_DSPARK_DISABLE_FFI"
    explicit = os.environ.get("JAX_DSPARK_FFI_LIB")
    if explicit:
        return _ctypes_library(explicit)
    pybind_error = None
    if importlib.util.find_spec("jax_dspark._C") is not None:
        try:
            from jax_dspark import _C  # type: ignore[attr-defined]
        except ImportError as err:  # e.g. built for another Python: try the ctypes library
            pybind_error = f"jax_dspark._C not loadable: {err}"
        else:
            return Library("pybind11", _C.__file__, dict(_C.targets()), tuple(_C.api_version()), _C.handler_metadata)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)
    if os.path.exists(path):
        return _ctypes_library(path)
    return pybind_error or "no compiled kernel library (pure-Python install: no CUDA compiler at build time)"


def library() -> Library | str:
    """The loaded kernel library, or the reason there is none (loads on first call)."""
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = _find_library()
    return _library


def runtime_ffi_api_version() -> tuple[int, int] | None:
    """XLA FFI API version of the running jaxlib (read from the headers it ships)."""
    path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    try:
        text = open(path).read()
    except OSError:
        return None
    major = re.search(r"^#define XLA_FFI_API_MAJOR (\d+)", text, re.M)
    minor = re.search(r"^#define XLA_FFI_API_MINOR (\d+)", text, re.M)
    if not (major and minor):
        return None
    return int(major.group(1)), int(minor.group(1))


def api_version_compatible(handler: tuple[int, int], runtime: tuple[int, int]) -> bool:
    """The FFI rule: same major version and handler minor <= runtime minor.

    XLA accepts handlers built with older FFI headers (it fills only the fields they know)
    but rejects newer ones, so the library is built against the OLDEST supported jaxlib.
    """
    return handler[0] == runtime[0] and handler[1] <= runtime[1]


def _gpu_problem() -> str | None:
    try:
        backend = jax.default_backend()
    except RuntimeError as err:
        return f"no JAX backend: {err}"
    if backend != "gpu":
        return f"backend is {backend!r}, not 'gpu'"
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is not None and str(capability) != "9.0":
        return f"library holds sm_90a code only; {device.device_kind} has compute capability {capability}"
    return None


def _register() -> dict[str, str]:
    lib = library()
    if isinstance(lib, str):
        return {name: lib for name in KERNELS}
    problem = _gpu_problem()
    if problem is not None:
        return {name: problem for name in KERNELS}
    status = {}
    for name, targets in KERNELS.items():
        reason = REGISTERED
        for target in targets:
            if target not in lib.capsules:
                reason = f"library {lib.path} lacks target {target}"
                break
            try:
                jax.ffi.register_ffi_target(target, lib.capsules[target], platform="CUDA")
            except Exception as err:  # noqa: BLE001 - XLA reports version/ABI problems here
                reason = f"registration of {target} failed: {err}"
                break
        status[name] = reason
    return status


def kernel_report() -> dict[str, str]:
    """Each kernel's name -> "registered", or the reason it cannot be used here."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _register()
    return dict(_status)


def use_kernel(name: str) -> bool:
    """True when op `name` should call its kernel (at trace time).

    True iff the library is loaded, the kernel's targets registered, the default backend is
    a GPU and the force mode is not "reference". Under "kernel" an unavailable kernel raises.
    """
    if _force == "reference":
        return False
    reason = kernel_report().get(name, f"unknown kernel {name!r} (known: {sorted(KERNELS)})")
    available = reason == REGISTERED
    if _force == "kernel" and not available:
        raise RuntimeError(f"kernel {name!r} forced but not available: {reason}")
    return available


def num_sms() -> int:
    """Multiprocessors of the default GPU (132 on an H100/H200 SXM when unknown)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except Exception:  # noqa: BLE001
        return 132
