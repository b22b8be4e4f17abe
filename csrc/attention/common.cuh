// What the sparse sink attention kernels (mma.sync and wgmma) share: the CTA's work item
// (64 heads of one query row, one split of its row list), the sink, the inverse RoPE and the
// output pair, and the merge of split-K partials into a row (combine_row).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cmath>

#include "attention/params.h"
#include "common/ptx.cuh"

namespace jds {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// One CTA: heads h0 .. h0 + 63 of query row bs = (b, s), rows [key_begin, key_end) of the
// concatenated [main | extra] list (split `split` of num_splits), in ntiles tiles of BK.
struct AttnWorkItem {
  int h0, split, key_begin, key_end, ntiles;
  int64_t bs;
};

__device__ __forceinline__ AttnWorkItem attn_work_item(const SparseSinkAttentionParams& p) {
  constexpr int BM = kAttnHeadsPerCta, BK = kAttnKeysPerTile;
  const int nhb = (p.heads + BM - 1) / BM;
  AttnWorkItem w;
  w.h0 = (blockIdx.x % nhb) * BM;
  w.bs = int64_t(blockIdx.z) * p.seq + blockIdx.x / nhb;
  w.split = blockIdx.y;
  const int k_total = p.k_main + p.k_extra;
  const int tiles_all = (k_total + BK - 1) / BK;
  const int tps = (tiles_all + p.num_splits - 1) / p.num_splits;  // = attn_tiles_per_split
  w.key_begin = w.split * tps * BK;
  w.key_end = min(k_total, w.key_begin + tps * BK);
  w.ntiles = w.key_end > w.key_begin ? (w.key_end - w.key_begin + BK - 1) / BK : 0;
  return w;
}

__device__ __forceinline__ float sink_factor(const float* sink, int h, float lse) {
  // out = (sum_j p_j v_j) / (sum_j p_j + exp(sink)) = normalized * 1 / (1 + exp(sink - lse)).
  if (lse == -INFINITY) return 0.f;
  if (sink == nullptr) return 1.f;
  return 1.f / (1.f + __expf(sink[h] - lse));
}

// Inverse rotation of one interleaved pair (x0, x1) by the query position's (cos, sin).
__device__ __forceinline__ void inverse_rope_pair(float& x0, float& x1, float2 cs) {
  const float y0 = x0 * cs.x + x1 * cs.y;
  const float y1 = x1 * cs.x - x0 * cs.y;
  x0 = y0;
  x1 = y1;
}

// A thread's two output rows (m16n8 accumulator layout) scaled by alpha[0] / alpha[1].
__device__ __forceinline__ void scale_rows(float (&o)[32][4], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    o[n][0] *= alpha[0];
    o[n][1] *= alpha[0];
    o[n][2] *= alpha[1];
    o[n][3] *= alpha[1];
  }
}

// Online softmax step for a thread's two rows: the output and the running sums scaled by
// alpha = exp2(old max - new max), plus this tile's sums rs.
__device__ __forceinline__ void rescale_rows(float (&o)[32][4], float (&l_run)[2], const float (&alpha)[2],
                                             const float (&rs)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * alpha[i] + rs[i];
  scale_rows(o, alpha);
}

// Output dims (dim, dim + 1) of query row bs, already normalised, as packed bf16: rotated
// back by the query position when they are RoPE dims (from rope_lo = D - rope_dim on) and
// the call asked for it.
__device__ __forceinline__ uint32_t output_pair(const SparseSinkAttentionParams& p, float x0, float x1, int64_t bs,
                                                int dim, int rope_lo) {
  if (p.inv_rope != nullptr && dim >= rope_lo) {
    const float2 cs = reinterpret_cast<const float2*>(p.inv_rope)[bs * (p.rope_dim / 2) + (dim - rope_lo) / 2];
    inverse_rope_pair(x0, x1, cs);
  }
  return pack_bf16x2(x0, x1);
}

// The same with the query row's (cos, sin) pairs at `cs` (any memory; null: no inverse RoPE).
__device__ __forceinline__ uint32_t output_pair(float x0, float x1, const float2* cs, int dim, int rope_lo) {
  if (cs != nullptr && dim >= rope_lo) inverse_rope_pair(x0, x1, cs[(dim - rope_lo) / 2]);
  return pack_bf16x2(x0, x1);
}

// The (cos, sin) pairs of query row bs in global memory (the call must have an inverse RoPE).
__device__ __forceinline__ const float2* inv_rope_row(const SparseSinkAttentionParams& p, int64_t bs) {
  return reinterpret_cast<const float2*>(p.inv_rope) + bs * (p.rope_dim / 2);
}

// One warp merges the split partials of output row `row` (head h of query row bs) by their
// log-sum-exp, then applies the sink and the inverse RoPE and stores the bf16 row and its lse;
// lane l holds dims 128 k + 4 l .. 128 k + 4 l + 3 for k = 0..3, so each float4 read is one
// contiguous 512-byte warp access and each store a 256-byte one.
// `split_lse(sp)`: split sp's lse (natural log, sink excluded, -inf when it saw no valid
// row); `split_chunk(sp, k)`: the float4 at dims 128 k + 4 l of split sp's normalised
// partial O / l, in global memory (the wgmma kernels' cluster merge has its own layout:
// merge_cluster_rows).
template <class SplitLse, class SplitChunk>
__device__ __forceinline__ void combine_row(const SparseSinkAttentionParams& p, int64_t row, int h, int64_t bs,
                                            int lane, SplitLse&& split_lse, SplitChunk&& split_chunk) {
  constexpr int D = kAttnHeadDim;
  const float mine = lane < p.num_splits ? split_lse(lane) : -INFINITY;
  float mx = mine;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float w = mx == -INFINITY ? 0.f : __expf(mine - mx);
  float sum = w;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = mx == -INFINITY ? -INFINITY : mx + __logf(sum);

  float acc[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) acc[k] = 0.f;
  if (mx != -INFINITY) {
    for (int sp = 0; sp < p.num_splits; ++sp) {
      const float ws = __shfl_sync(0xffffffffu, w, sp) / sum;
      if (ws == 0.f) continue;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float4 v = split_chunk(sp, k);
        acc[4 * k] += ws * v.x;
        acc[4 * k + 1] += ws * v.y;
        acc[4 * k + 2] += ws * v.z;
        acc[4 * k + 3] += ws * v.w;
      }
    }
  }
  const float f = sink_factor(p.sink, h, lse);
  const int rope_lo = D - p.rope_dim;
  __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(p.out) + row * D;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int dim = 128 * k + 4 * lane;
    *reinterpret_cast<uint2*>(out_row + dim) =
        make_uint2(output_pair(p, acc[4 * k] * f, acc[4 * k + 1] * f, bs, dim, rope_lo),
                   output_pair(p, acc[4 * k + 2] * f, acc[4 * k + 3] * f, bs, dim + 2, rope_lo));
  }
  if (lane == 0) p.lse[row] = lse;
}

// UE8M0 byte -> 2^(e - 127) as an exact float (e = 0 is the subnormal 2^-127, 255 is inf).
__device__ __forceinline__ float ue8m0_scale(uint32_t e) {
  return __int_as_float(e ? int(e << 23) : 0x00400000);
}

// Two e4m3 values (low byte first) times a power of two, as packed bf16x2. e4m3 -> f16 is
// exact, the product is exact (power-of-two scale), and so is the rounding to bf16 (4
// significant bits), barring overflow/underflow of the scale itself.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two, float s) {
  const __half2 h(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xFFFFu), __NV_E4M3));
  const float2 f = __half22float2(h);
  return pack_bf16x2(f.x * s, f.y * s);
}

// Raises an attention kernel's dynamic shared-memory limit (launch_attention_grid, the cluster
// launches). It is a per-function host setting, not stream work,
// so it is safe while XLA captures the stream into a command buffer; done once per device
// (per instantiation: `configured` is a static of each Kernel). Atomic flags: XLA drives
// each device from its own thread, and two threads may both set the (idempotent) attribute
// the first time.
template <void (*Kernel)(SparseSinkAttentionParams)>
cudaError_t configure_attention_kernel(int smem_bytes) {
  static std::atomic<bool> configured[64] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64 || !configured[dev].load(std::memory_order_relaxed)) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < 64) configured[dev].store(true, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Launches an attention kernel over its grid: (64-head blocks x query rows, splits, batch).
template <void (*Kernel)(SparseSinkAttentionParams)>
cudaError_t launch_attention_grid(const SparseSinkAttentionParams& p, int threads, int smem_bytes,
                                  cudaStream_t stream) {
  const cudaError_t err = configure_attention_kernel<Kernel>(smem_bytes);
  if (err != cudaSuccess) return err;
  const int nhb = (p.heads + kAttnHeadsPerCta - 1) / kAttnHeadsPerCta;
  const dim3 grid(nhb * p.seq, p.num_splits, p.batch);
  Kernel<<<grid, threads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

// Merges split-K partials (one warp per output row), then sink and inverse RoPE.
cudaError_t launch_sparse_sink_attention_combine(const SparseSinkAttentionParams& p, cudaStream_t stream);

}  // namespace jds
