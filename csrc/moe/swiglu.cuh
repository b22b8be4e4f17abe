// DeepSeek-V4's clamped SwiGLU, shared by the BF16 and FP8 expert paths so both compute the
// same thing: silu(min(g, L)) * clip(u, -L, L) in f32 (L <= 0: no clamp), as the pure-JAX
// reference `ops.moe.swiglu` does.
#pragma once

#include <cuda_bf16.h>

namespace jds {

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// Two gate / up pairs at once (the kernels read them as bf16x2).
__device__ __forceinline__ float2 swiglu_pair(float2 g, float2 u, float limit) {
  if (limit > 0.f) {
    g.x = fminf(g.x, limit);
    g.y = fminf(g.y, limit);
    u.x = fminf(fmaxf(u.x, -limit), limit);
    u.y = fminf(fmaxf(u.y, -limit), limit);
  }
  return make_float2(silu(g.x) * u.x, silu(g.y) * u.y);
}

}  // namespace jds
