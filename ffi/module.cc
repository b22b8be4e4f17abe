// pybind11 module `jax_dspark._C`: the handler capsules for jax.ffi.register_ffi_target, and
// the same inspection functions as the plain shared library (which ctypes loads instead where
// this module was built for another Python).
#include <pybind11/pybind11.h>

#include <string>

#include "ffi/handlers.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "jax-dspark XLA FFI handlers (CUDA, sm_90a)";
  m.def("targets", [] {
    py::dict d;
    for (const char* name : {"jax_dspark_sparse_sink_attention", "jax_dspark_sparse_sink_attention_wgmma",
                             "jax_dspark_rms_norm_rope",
                             "jax_dspark_rms_norm_rope_fp8"})
      d[name] = py::capsule(jax_dspark_handler(name));
#ifdef JAX_DSPARK_WITH_MOE  // cmake/moe.cmake
    for (const char* name : {"jax_dspark_moe_experts", "jax_dspark_moe_route", "jax_dspark_moe_hash_route",
                             "jax_dspark_moe_experts_fp8"})
      d[name] = py::capsule(jax_dspark_handler(name));
#endif
    return d;
  });
  m.def("api_version", [] {
    int major = 0, minor = 0;
    jax_dspark_ffi_api_version(&major, &minor);
    return py::make_tuple(major, minor);
  });
  m.def("handler_metadata", [](const std::string& name) {
    int major = 0, minor = 0;
    unsigned traits = 0;
    const int rc = jax_dspark_handler_metadata(name.c_str(), &major, &minor, &traits);
    if (rc != 0) throw py::value_error("no metadata for target " + name + " (code " + std::to_string(rc) + ")");
    return py::make_tuple(major, minor, traits);
  });
}
