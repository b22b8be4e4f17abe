// Routed experts, BF16, as six stream-ordered launches:
//   permute (counting sort of (token, slot) pairs by expert)  -> offsets, row maps
//   gather  (x rows into expert-contiguous order)             -> xp [P, d]
//   grouped FC1 (xp @ w_gate_up[e])                            -> h  [P, 2I]
//   clamped SwiGLU                                             -> a  [P, I]
//   grouped FC2 (a @ w_down[e])                                -> y  [P, d]   (reuses xp)
//   un-permute (out[t] = sum_j weights[t, j] * y[row(t, j)])  -> out [T, d]
// P = T * k. No launch depends on a host-side value computed on the device, so the whole
// sequence can be captured in a CUDA graph; rows past offsets[E] (dropped pairs) are never
// read. The un-permute sums a token's k rows in slot order in f32, so the result is
// deterministic (no atomics on the output).
#include <cfloat>
#include <cmath>
#include <cuda_bf16.h>

#include "moe/params.h"
#include "moe/swiglu.cuh"

namespace jds {
namespace {

constexpr int kPermuteThreads = 1024;

// Block-wide exclusive scan of one int per thread; returns the block total in *total.
__device__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += o;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int s = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, s, off);
      if (lane >= off) s += o;
    }
    if (lane < warps) warp_sums[lane] = s;  // inclusive over warps
    if (lane == 31) *total = s;
  }
  __syncthreads();
  const int before = warp == 0 ? 0 : warp_sums[warp - 1];
  const int result = before + incl - v;
  __syncthreads();
  return result;
}

// One block: histogram in shared memory, scan, then each pair takes the next row of its
// expert. The order of rows inside an expert depends on atomic timing; the results do not
// (each row's GEMM output depends only on that row).
__global__ void __launch_bounds__(kPermuteThreads)
    permute_kernel(const int32_t* __restrict__ ids, int64_t pairs, int k, int experts,
                   int32_t* __restrict__ offsets, int32_t* __restrict__ row_of_pair,
                   int32_t* __restrict__ token_of_row) {
  extern __shared__ int smem[];
  int* count = smem;               // [experts]
  int* cursor = smem + experts;    // [experts]
  __shared__ int warp_sums[32];
  __shared__ int total;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < experts) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Each thread scans a contiguous chunk of experts.
  const int chunk = (experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(int(threadIdx.x) * chunk, experts), e1 = min(e0 + chunk, experts);
  int local = 0;
  for (int e = e0; e < e1; ++e) local += count[e];
  int run = block_exclusive_scan(local, warp_sums, &total);
  for (int e = e0; e < e1; ++e) {
    cursor[e] = run;
    offsets[e] = run;
    run += count[e];
  }
  if (threadIdx.x == 0) offsets[experts] = total;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < experts) {
      const int r = atomicAdd(&cursor[e], 1);
      row_of_pair[i] = r;
      token_of_row[r] = static_cast<int32_t>(i / k);
    } else {
      row_of_pair[i] = -1;
    }
  }
}

// xp[r] = x[token_of_row[r]] for r < offsets[E]; one block per row, 16-byte copies.
__global__ void gather_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ token_of_row,
                              const int32_t* __restrict__ valid_rows, int vecs_per_row,
                              uint4* __restrict__ xp) {
  const int r = blockIdx.x;
  if (r >= *valid_rows) return;
  const int64_t src = int64_t(token_of_row[r]) * vecs_per_row, dst = int64_t(r) * vecs_per_row;
  for (int v = threadIdx.x; v < vecs_per_row; v += blockDim.x) xp[dst + v] = x[src + v];
}

// a[r, i] = silu(min(g, L)) * clip(u, -L, L) with g = h[r, i], u = h[r, I + i], in f32.
__global__ void swiglu_kernel(const __nv_bfloat16* __restrict__ h, const int32_t* __restrict__ valid_rows,
                              int inter, float limit, __nv_bfloat16* __restrict__ a) {
  const int r = blockIdx.x;
  if (r >= *valid_rows) return;
  const int vecs = inter / 8;
  const uint4* gate = reinterpret_cast<const uint4*>(h + int64_t(r) * 2 * inter);
  const uint4* up = reinterpret_cast<const uint4*>(h + int64_t(r) * 2 * inter + inter);
  uint4* dst = reinterpret_cast<uint4*>(a + int64_t(r) * inter);
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    const uint4 gv = gate[v], uv = up[v];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
    uint4 out;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = swiglu_pair(__bfloat1622float2(g2[j]), __bfloat1622float2(u2[j]), limit);
      o2[j] = __floats2bfloat162_rn(a.x, a.y);
    }
    dst[v] = out;
  }
}

// out[t] = bf16(sum_j weights[t, j] * y[row_of_pair[t, j]]), f32 sum in slot order.
__global__ void unpermute_kernel(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ row_of_pair,
                                 const float* __restrict__ weights, int k, int hidden,
                                 __nv_bfloat16* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int vecs = hidden / 8;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < k; ++j) {
      const int r = row_of_pair[t * k + j];
      if (r < 0) continue;
      const float w = weights[t * k + j];
      const uint4 yv = reinterpret_cast<const uint4*>(y + int64_t(r) * hidden)[v];
      const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&yv);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(y2[q]);
        acc[2 * q] += w * f.x;
        acc[2 * q + 1] += w * f.y;
      }
    }
    uint4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int q = 0; q < 4; ++q) o2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    reinterpret_cast<uint4*>(out + t * hidden)[v] = o;
  }
}

constexpr size_t kSlab = 256;
inline size_t slab(size_t bytes) { return (bytes + kSlab - 1) / kSlab * kSlab; }

struct Workspace {
  int32_t* offsets;
  int32_t* row_of_pair;
  int32_t* token_of_row;
  __nv_bfloat16* xp;  // [P, d], later y
  __nv_bfloat16* h;   // [P, 2I]
  __nv_bfloat16* a;   // [P, I]
  void* gemm;
  size_t gemm_bytes;
  size_t total;
};

Workspace carve(char* base, int64_t tokens, int k, int experts, int hidden, int inter, int sm_count) {
  const int64_t P = tokens * k;
  Workspace w{};
  size_t at = 0;
  auto take = [&](size_t bytes) { char* p = base ? base + at : nullptr; at += slab(bytes); return p; };
  w.offsets = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * (experts + 1)));
  w.row_of_pair = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * P));
  w.token_of_row = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * P));
  w.xp = reinterpret_cast<__nv_bfloat16*>(take(2 * size_t(P) * hidden));
  w.h = reinterpret_cast<__nv_bfloat16*>(take(2 * size_t(P) * 2 * inter));
  w.a = reinterpret_cast<__nv_bfloat16*>(take(2 * size_t(P) * inter));
  w.gemm_bytes = moe_grouped_gemm_workspace_bytes(experts, sm_count);
  w.gemm = take(w.gemm_bytes);
  w.total = at + kSlab;  // slack to align the base
  return w;
}

}  // namespace

cudaError_t run_moe_permute(const int32_t* ids, int64_t pairs, int k, int experts, int32_t* offsets,
                            int32_t* row_of_pair, int32_t* token_of_row, cudaStream_t stream) {
  if (experts < 1 || experts > kMoeMaxExperts || k < 1) return cudaErrorInvalidValue;
  const size_t smem = 2 * sizeof(int) * experts;
  if (smem > 48 * 1024) {
    static const cudaError_t attr = cudaFuncSetAttribute(
        permute_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * sizeof(int) * kMoeMaxExperts);
    if (attr != cudaSuccess) return attr;
  }
  permute_kernel<<<1, kPermuteThreads, smem, stream>>>(ids, pairs, k, experts, offsets, row_of_pair,
                                                       token_of_row);
  return cudaGetLastError();
}

size_t moe_experts_workspace_bytes(int64_t tokens, int k, int experts, int hidden, int inter,
                                   int sm_count) {
  return carve(nullptr, tokens, k, experts, hidden, inter, sm_count).total;
}

cudaError_t run_moe_experts(const MoeExpertsParams& p, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.hidden % 8 || p.inter % 8 || p.k < 1 || p.experts < 1 || p.experts > kMoeMaxExperts ||
      p.tokens * p.k > INT32_MAX)
    return cudaErrorInvalidValue;
  char* base = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(workspace) + kSlab - 1) / kSlab * kSlab);
  const Workspace w = carve(base, p.tokens, p.k, p.experts, p.hidden, p.inter, p.sm_count);
  if (workspace_bytes < w.total) return cudaErrorInvalidValue;
  const int64_t P = p.tokens * p.k;
  const int32_t* valid = w.offsets + p.experts;  // device-side count of kept pairs

  cudaError_t err = run_moe_permute(p.ids, P, p.k, p.experts, w.offsets, w.row_of_pair,
                                    w.token_of_row, stream);
  if (err != cudaSuccess) return err;
  gather_kernel<<<static_cast<unsigned>(P), 128, 0, stream>>>(
      static_cast<const uint4*>(p.x), w.token_of_row, valid, p.hidden / 8,
      reinterpret_cast<uint4*>(w.xp));
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  err = run_moe_grouped_gemm(w.xp, p.w_gate_up, w.h, w.offsets, p.experts, 2 * p.inter, p.hidden, P,
                             p.sm_count, w.gemm, w.gemm_bytes, stream);
  if (err != cudaSuccess) return err;
  swiglu_kernel<<<static_cast<unsigned>(P), 128, 0, stream>>>(w.h, valid, p.inter, p.limit, w.a);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  __nv_bfloat16* y = w.xp;  // xp is dead once FC1 has run (same stream)
  err = run_moe_grouped_gemm(w.a, p.w_down, y, w.offsets, p.experts, p.hidden, p.inter, P,
                             p.sm_count, w.gemm, w.gemm_bytes, stream);
  if (err != cudaSuccess) return err;
  unpermute_kernel<<<static_cast<unsigned>(p.tokens), 128, 0, stream>>>(
      y, w.row_of_pair, p.weights, p.k, p.hidden, static_cast<__nv_bfloat16*>(p.out));
  return cudaGetLastError();
}

cudaError_t run_moe_unpermute(const void* y, const int32_t* row_of_pair, const float* weights,
                              int64_t tokens, int k, int hidden, void* out, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  if (hidden % 8 || k < 1) return cudaErrorInvalidValue;
  unpermute_kernel<<<static_cast<unsigned>(tokens), 128, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(y), row_of_pair, weights, k, hidden, static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

}  // namespace jds
