// The library's C API beside the handlers: which targets exist, which FFI API version the
// handlers were compiled against, and a metadata probe that asks a handler for its version
// and traits the way XLA does at registration, so the version rule can be tested on a CPU.
#include <cstring>

#include "ffi/handlers.h"
#include "ffi/moe_handlers.h"

namespace {

struct Target {
  const char* name;
  XLA_FFI_Handler* handler;
};

constexpr Target kTargets[] = {
    {"jax_dspark_sparse_sink_attention", JaxDsparkSparseSinkAttention},
    {"jax_dspark_sparse_sink_attention_wgmma", JaxDsparkSparseSinkAttentionWgmma},
    {"jax_dspark_rms_norm_rope", JaxDsparkRmsNormRope},
    {"jax_dspark_rms_norm_rope_fp8", JaxDsparkRmsNormRopeFp8},
#ifdef JAX_DSPARK_WITH_MOE  // cmake/moe.cmake: built when CUTLASS headers were found
    {"jax_dspark_moe_experts", JaxDsparkMoeExperts},
    {"jax_dspark_moe_route", JaxDsparkMoeRoute},
    {"jax_dspark_moe_hash_route", JaxDsparkMoeHashRoute},
    {"jax_dspark_moe_experts_fp8", JaxDsparkMoeExpertsFp8},
#endif
};

}  // namespace

extern "C" {

void jax_dspark_ffi_api_version(int* major, int* minor) {
  *major = XLA_FFI_API_MAJOR;
  *minor = XLA_FFI_API_MINOR;
}

const char* jax_dspark_target_names() {
  return "jax_dspark_sparse_sink_attention=JaxDsparkSparseSinkAttention,"
         "jax_dspark_sparse_sink_attention_wgmma=JaxDsparkSparseSinkAttentionWgmma,"
         "jax_dspark_rms_norm_rope=JaxDsparkRmsNormRope,"
         "jax_dspark_rms_norm_rope_fp8=JaxDsparkRmsNormRopeFp8"
#ifdef JAX_DSPARK_WITH_MOE
         ",jax_dspark_moe_experts=JaxDsparkMoeExperts"
         ",jax_dspark_moe_route=JaxDsparkMoeRoute"
         ",jax_dspark_moe_hash_route=JaxDsparkMoeHashRoute"
         ",jax_dspark_moe_experts_fp8=JaxDsparkMoeExpertsFp8"
#endif
         ;
}

void* jax_dspark_handler(const char* name) {
  for (const Target& t : kTargets)
    if (std::strcmp(t.name, name) == 0) return reinterpret_cast<void*>(t.handler);
  return nullptr;
}

int jax_dspark_handler_metadata(const char* name, int* major, int* minor, unsigned* traits) {
  XLA_FFI_Handler* handler = reinterpret_cast<XLA_FFI_Handler*>(jax_dspark_handler(name));
  if (handler == nullptr) return 1;
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension ext{};
  ext.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  ext.extension_base.type = XLA_FFI_Extension_Metadata;
  ext.extension_base.next = nullptr;
  ext.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &ext.extension_base;
  // With correct struct sizes the handler fills the metadata without touching `api`.
  if (handler(&frame) != nullptr) return 2;
  *major = metadata.api_version.major_version;
  *minor = metadata.api_version.minor_version;
  *traits = metadata.traits;
  return 0;
}
}
