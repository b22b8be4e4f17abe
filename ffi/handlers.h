// The XLA FFI handler symbols this library exports (C ABI, so ctypes and pybind11 see the
// same functions), and the small C API used to inspect them without a GPU.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {

// Sparse sink attention: q, main_rows, main_idx, extra_rows, extra_idx, sink, inv_rope,
// main_rope, main_scale, extra_rope, extra_scale -> out, lse, workspace. Attributes: scale
// (f32), num_splits, has_sink, rope_dim, main_fp8, extra_fp8 (i32).
XLA_FFI_Error* JaxDsparkSparseSinkAttention(XLA_FFI_CallFrame* call_frame);
// The same operands and attributes on the wgmma kernel.
XLA_FFI_Error* JaxDsparkSparseSinkAttentionWgmma(XLA_FFI_CallFrame* call_frame);

// RMSNorm + RoPE prep: x, weight, freqs -> y. Attributes: eps (f32), inverse, rope_dim (i32).
XLA_FFI_Error* JaxDsparkRmsNormRope(XLA_FFI_CallFrame* call_frame);

// Same, with FP8 output: -> values (f8e4m3fn), exps (u8). Extra attribute: fp8_block (i32).
XLA_FFI_Error* JaxDsparkRmsNormRopeFp8(XLA_FFI_CallFrame* call_frame);

// FFI API version of the headers this library was compiled with.
void jax_dspark_ffi_api_version(int* major, int* minor);

// Asks a handler for its metadata exactly as XLA does at registration (a call frame holding
// the metadata extension). Returns 0 on success and fills the handler's reported API version
// and traits; needs no GPU. `name` is a target name from jax_dspark_target_names().
int jax_dspark_handler_metadata(const char* name, int* major, int* minor, unsigned* traits);

// Comma-separated "target=symbol" pairs of every handler in this library.
const char* jax_dspark_target_names();

// Looks a handler up by target name (nullptr if unknown).
void* jax_dspark_handler(const char* name);
}
