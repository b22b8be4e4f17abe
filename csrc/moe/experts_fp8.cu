// Routed experts, FP8 (DeepSeek's recipe), as stream-ordered launches:
//   permute (experts.cu)                                         -> offsets, row maps
//   weight scales: UE8M0 bytes -> f32 in the GEMM's layout        -> sfb1, sfb2
//   gather + quantise x rows per 1x128                            -> xq e4m3 [P, d], sfa1
//   grouped block-scaled FC1 (xq @ w_gate_up[e]^T)                -> h bf16 [P, 2I]
//   clamped SwiGLU + quantise per 1x128                           -> aq e4m3 [P, I], sfa2
//   grouped block-scaled FC2 (aq @ w_down[e]^T)                   -> y bf16 [P, d]
//   weighted un-permute (experts.cu)                              -> out bf16 [T, d]
// Activation quantisation is fused into the passes that already touch every row (gather,
// SwiGLU), so FP8 adds no pass over the activations. Activation scales are written where
// the grouped GEMM reads them: for row i of expert e (M_e rows from offsets[e]), K block kb,
// at sfa[offsets[e] * (K / 128) + kb * M_e + i] (grouped_gemm_fp8.cu); a row finds its
// expert by binary search over offsets (E + 1 ints, in L1/L2).
//
// The quantiser is the one of jax_dspark/ops/fp8.py, bit for bit on the same f32 input:
// scale 2^e with e = ceil(log2(max(amax, 1e-4) / 448)) (IEEE f32 division, exact ceil via
// frexp), values = round-to-nearest-even e4m3 of clip(x * 2^-e, -448, 448).
#include <cfloat>
#include <cmath>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "moe/params.h"
#include "moe/swiglu.cuh"

namespace jds {
namespace {

constexpr float kE4m3Max = 448.f;
constexpr float kAmaxFloor = 1e-4f;
constexpr int kWarpsPerRow = 8;  // blocks of 256 threads; one warp per 128-wide scale block

__device__ __forceinline__ int scale_exponent(float amax) {
  const float r = fmaxf(amax, kAmaxFloor) / kE4m3Max;
  int e = 0;
  const float m = frexpf(r, &e);  // r = m * 2^e, m in [0.5, 1)
  return m == 0.5f ? e - 1 : e;
}

// Expert of row r (r < offsets[E]): the largest e in [0, E) with offsets[e] <= r.
__device__ __forceinline__ int expert_of_row(const int32_t* __restrict__ offsets, int experts, int r) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One warp quantises one 128-wide block held as 4 floats per lane (lane owns columns
// 4*lane .. 4*lane+3): writes 4 e4m3 bytes to dst (4-byte aligned) and returns the scale.
__device__ __forceinline__ float quantize_block(const float (&v)[4], uint32_t* dst) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const int e = scale_exponent(amax);
  const float inv = ldexpf(1.f, -e);
  float q[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) q[j] = fminf(fmaxf(v[j] * inv, -kE4m3Max), kE4m3Max);
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q[0], q[1]), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q[2], q[3]), __NV_SATFINITE, __NV_E4M3);
  *dst = uint32_t(lo) | (uint32_t(hi) << 16);
  return ldexpf(1.f, e);
}

// UE8M0 bytes [E, NB, KB] (K blocks contiguous) -> f32 [E, KB, NB] (N blocks contiguous).
__global__ void weight_scales_kernel(const uint8_t* __restrict__ exps, int64_t total, int nb, int kb,
                                     float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t per = int64_t(nb) * kb;
  const int64_t e = i / per, rem = i % per;
  const int n = int(rem / kb), k = int(rem % kb);
  out[e * per + int64_t(k) * nb + n] = ldexpf(1.f, int(exps[i]) - 127);
}

// xq[r] = quantise(x[token_of_row[r]]) per 1x128; one block per row, one warp per K block.
__global__ void __launch_bounds__(32 * kWarpsPerRow)
    gather_quantize_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ token_of_row,
                           const int32_t* __restrict__ offsets, int experts, int hidden,
                           uint8_t* __restrict__ xq, float* __restrict__ sfa) {
  const int r = blockIdx.x;
  if (r >= offsets[experts]) return;
  const int e = expert_of_row(offsets, experts, r);
  const int row0 = offsets[e], rows = offsets[e + 1] - row0;
  const int blocks = hidden / kMoeFp8Block;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const __nv_bfloat16* src = x + int64_t(token_of_row[r]) * hidden;
  for (int b = warp; b < blocks; b += kWarpsPerRow) {
    const int c = b * kMoeFp8Block + 4 * lane;
    const uint2 raw = *reinterpret_cast<const uint2*>(src + c);
    const __nv_bfloat162* p2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 a = __bfloat1622float2(p2[0]), bb = __bfloat1622float2(p2[1]);
    const float v[4] = {a.x, a.y, bb.x, bb.y};
    const float s = quantize_block(v, reinterpret_cast<uint32_t*>(xq + int64_t(r) * hidden + c));
    if (lane == 0) sfa[int64_t(row0) * blocks + int64_t(b) * rows + (r - row0)] = s;
  }
}

// a = silu(min(g, L)) * clip(u, -L, L) from h bf16 [P, 2I] (gate = first I columns), in f32,
// quantised per 1x128 into aq [P, I] and sfa (GEMM layout, K = I).
__global__ void __launch_bounds__(32 * kWarpsPerRow)
    swiglu_quantize_kernel(const __nv_bfloat16* __restrict__ h, const int32_t* __restrict__ offsets,
                           int experts, int inter, float limit, uint8_t* __restrict__ aq,
                           float* __restrict__ sfa) {
  const int r = blockIdx.x;
  if (r >= offsets[experts]) return;
  const int e = expert_of_row(offsets, experts, r);
  const int row0 = offsets[e], rows = offsets[e + 1] - row0;
  const int blocks = inter / kMoeFp8Block;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const __nv_bfloat16* gate = h + int64_t(r) * 2 * inter;
  const __nv_bfloat16* up = gate + inter;
  for (int b = warp; b < blocks; b += kWarpsPerRow) {
    const int c = b * kMoeFp8Block + 4 * lane;
    const uint2 graw = *reinterpret_cast<const uint2*>(gate + c);
    const uint2 uraw = *reinterpret_cast<const uint2*>(up + c);
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&graw);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uraw);
    float v[4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 a = swiglu_pair(__bfloat1622float2(g2[j]), __bfloat1622float2(u2[j]), limit);
      v[2 * j] = a.x;
      v[2 * j + 1] = a.y;
    }
    const float s = quantize_block(v, reinterpret_cast<uint32_t*>(aq + int64_t(r) * inter + c));
    if (lane == 0) sfa[int64_t(row0) * blocks + int64_t(b) * rows + (r - row0)] = s;
  }
}

constexpr size_t kSlab = 256;
inline size_t slab(size_t bytes) { return (bytes + kSlab - 1) / kSlab * kSlab; }

struct Workspace {
  int32_t* offsets;
  int32_t* row_of_pair;
  int32_t* token_of_row;
  uint8_t* xq;           // [P, d]
  float* sfa1;           // [P * d / 128]
  __nv_bfloat16* h;      // [P, 2I]
  uint8_t* aq;           // [P, I]
  float* sfa2;           // [P * I / 128]
  __nv_bfloat16* y;      // [P, d]
  float* sfb1;           // [E * 2I/128 * d/128]
  float* sfb2;           // [E * d/128 * I/128]
  void* gemm;
  size_t gemm_bytes;
  size_t total;
};

Workspace carve(char* base, int64_t tokens, int k, int experts, int hidden, int inter, int sm_count) {
  const size_t P = size_t(tokens) * k;
  const size_t db = hidden / kMoeFp8Block, ib = inter / kMoeFp8Block;
  Workspace w{};
  size_t at = 0;
  auto take = [&](size_t bytes) { char* p = base ? base + at : nullptr; at += slab(bytes); return p; };
  w.offsets = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * (experts + 1)));
  w.row_of_pair = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * P));
  w.token_of_row = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * P));
  w.xq = reinterpret_cast<uint8_t*>(take(P * hidden));
  w.sfa1 = reinterpret_cast<float*>(take(sizeof(float) * P * db));
  w.h = reinterpret_cast<__nv_bfloat16*>(take(2 * P * 2 * inter));
  w.aq = reinterpret_cast<uint8_t*>(take(P * inter));
  w.sfa2 = reinterpret_cast<float*>(take(sizeof(float) * P * ib));
  w.y = reinterpret_cast<__nv_bfloat16*>(take(2 * P * hidden));
  w.sfb1 = reinterpret_cast<float*>(take(sizeof(float) * size_t(experts) * 2 * ib * db));
  w.sfb2 = reinterpret_cast<float*>(take(sizeof(float) * size_t(experts) * db * ib));
  w.gemm_bytes = moe_grouped_gemm_fp8_workspace_bytes(experts, sm_count);
  w.gemm = take(w.gemm_bytes);
  w.total = at + kSlab;  // slack to align the base
  return w;
}

cudaError_t convert_weight_scales(const uint8_t* exps, int experts, int nb, int kb, float* out,
                                  cudaStream_t stream) {
  const int64_t total = int64_t(experts) * nb * kb;
  weight_scales_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(exps, total, nb, kb, out);
  return cudaGetLastError();
}

}  // namespace

size_t moe_experts_fp8_workspace_bytes(int64_t tokens, int k, int experts, int hidden, int inter,
                                       int sm_count) {
  return carve(nullptr, tokens, k, experts, hidden, inter, sm_count).total;
}

cudaError_t run_moe_experts_fp8(const MoeExpertsFp8Params& p, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.hidden % kMoeFp8Block || p.inter % kMoeFp8Block || p.hidden <= 0 || p.inter <= 0 || p.k < 1 ||
      p.experts < 1 || p.experts > kMoeMaxExperts || p.tokens * p.k > INT32_MAX)
    return cudaErrorInvalidValue;
  char* base = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(workspace) + kSlab - 1) / kSlab * kSlab);
  const Workspace w = carve(base, p.tokens, p.k, p.experts, p.hidden, p.inter, p.sm_count);
  if (workspace_bytes < w.total) return cudaErrorInvalidValue;
  const int64_t P = p.tokens * p.k;
  const int db = p.hidden / kMoeFp8Block, ib = p.inter / kMoeFp8Block;

  cudaError_t err = run_moe_permute(p.ids, P, p.k, p.experts, w.offsets, w.row_of_pair,
                                    w.token_of_row, stream);
  if (err != cudaSuccess) return err;
  if ((err = convert_weight_scales(p.s_gate_up, p.experts, 2 * ib, db, w.sfb1, stream)) != cudaSuccess) return err;
  if ((err = convert_weight_scales(p.s_down, p.experts, db, ib, w.sfb2, stream)) != cudaSuccess) return err;
  gather_quantize_kernel<<<static_cast<unsigned>(P), 32 * kWarpsPerRow, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(p.x), w.token_of_row, w.offsets, p.experts, p.hidden, w.xq, w.sfa1);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  err = run_moe_grouped_gemm_fp8(w.xq, w.sfa1, p.w_gate_up, w.sfb1, w.h, w.offsets, p.experts,
                                 2 * p.inter, p.hidden, P, p.sm_count, w.gemm, w.gemm_bytes, stream);
  if (err != cudaSuccess) return err;
  swiglu_quantize_kernel<<<static_cast<unsigned>(P), 32 * kWarpsPerRow, 0, stream>>>(
      w.h, w.offsets, p.experts, p.inter, p.limit, w.aq, w.sfa2);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  err = run_moe_grouped_gemm_fp8(w.aq, w.sfa2, p.w_down, w.sfb2, w.y, w.offsets, p.experts, p.hidden,
                                 p.inter, P, p.sm_count, w.gemm, w.gemm_bytes, stream);
  if (err != cudaSuccess) return err;
  return run_moe_unpermute(w.y, w.row_of_pair, p.weights, p.tokens, p.k, p.hidden, p.out, stream);
}

}  // namespace jds
