// XLA FFI handler symbols of the mixture-of-experts kernels (C ABI, see ffi/handlers.h).
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {

// Routed experts, BF16: x, ids, weights, w_gate_up, w_down -> out, workspace (u8, sized by
// the Python wrapper). Attribute: limit (f32, <= 0 = no SwiGLU clamp).
XLA_FFI_Error* JaxDsparkMoeExperts(XLA_FFI_CallFrame* call_frame);

// Routed experts, FP8: x, ids, weights, w_gate_up (e4m3 [E, 2I, d]), s_gate_up (u8
// [E, 2I/128, d/128]), w_down (e4m3 [E, d, I]), s_down (u8 [E, d/128, I/128]) -> out,
// workspace. Attribute: limit (f32).
XLA_FFI_Error* JaxDsparkMoeExpertsFp8(XLA_FFI_CallFrame* call_frame);

// Top-k routing: logits, bias -> weights, ids. Attributes: score_kind, renormalize, has_bias
// (i32), route_scale (f32).
XLA_FFI_Error* JaxDsparkMoeRoute(XLA_FFI_CallFrame* call_frame);

// Hash routing: logits, token_ids, table -> weights, ids. Attributes: score_kind, renormalize
// (i32), route_scale (f32).
XLA_FFI_Error* JaxDsparkMoeHashRoute(XLA_FFI_CallFrame* call_frame);
}
