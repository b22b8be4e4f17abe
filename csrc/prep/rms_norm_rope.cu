// Fused q/kv preparation: RMSNorm (optional weight) -> interleaved RoPE on the last R dims
// (forward or inverse) -> optional FP8 e4m3 with power-of-two (UE8M0) block scales.
//
// Memory-bound and tiny per row: one warp per row, 8 elements per lane per 16-byte vector,
// the row in registers (D <= 2048), one pass over memory, no tensor cores. Rows of at most
// 1 KB stream through a shared-memory ring filled by the bulk copy engine (the stream
// kernel), wider ones load straight to registers (the register kernel); both share
// load_freqs / finish_row. It reproduces the reference composition
// quantize_fp8(apply_rope(rms_norm(x, w), freqs), block) including its intermediate roundings
// to x's dtype, so the FP8 blocks see the same values the reference quantises.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "prep/params.h"

namespace jds {
namespace {

constexpr int kChunk = 256;  // elements one warp covers per 16-byte load per lane
constexpr int kMaxChunks = kPrepMaxDim / kChunk;

template <typename T>
struct Vec8;
template <>
struct Vec8<__nv_bfloat16> {
  static __device__ __forceinline__ void load(const void* base, int64_t off, float (&v)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(base) + off);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
  // The same values, unpacked by one shift or mask each (a bf16 is the high half of its f32);
  // `load` lets the compiler pick, which cost 1.5 instructions an element there.
  static __device__ __forceinline__ void load_bits(const void* base, int64_t off, float (&v)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(base) + off);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
  static __device__ __forceinline__ void store(void* base, int64_t off, const float (&v)[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(base) + off) = raw;
  }
};
template <>
struct Vec8<float> {
  static __device__ __forceinline__ void load(const void* base, int64_t off, float (&v)[8]) {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(base) + off);
    const float4 a = src[0], b = src[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
  static __device__ __forceinline__ void load_bits(const void* base, int64_t off, float (&v)[8]) { load(base, off, v); }
  static __device__ __forceinline__ float round(float x) { return x; }
  static __device__ __forceinline__ void store(void* base, int64_t off, const float (&v)[8]) {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(base) + off);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};

// UE8M0 exponent of a block: 127 + ceil(log2(q)) with q = RN(max(amax, 1e-4) / 448), read
// from the bits of a = max(amax, 1e-4) without dividing (a float division is a dozen
// instructions and a slow-path call, per block of every row). 448 = 7 x 2^6, so with
// a = m x 2^E (m in [1, 2)): for m >= 1.75, q = RN(4m / 7) x 2^(E - 8) with 4m / 7 in
// [1, 1.143), a power of two only at m = 1.75 exactly; for m < 1.75, q = RN(8m / 7) x 2^(E - 9)
// with 8m / 7 in (1, 2) and never rounded up to 2 (its largest value lies 1.14 ulp below).
// Both give ceil(log2(q)) = E - 8 + (m > 1.75); tests/test_fp8.py checks the identity against
// the reference's division for every mantissa. An infinite amax gives 127, as the reference.
__device__ __forceinline__ int ue8m0_exponent(float amax) {
  const uint32_t bits = __float_as_uint(fmaxf(amax, 1e-4f));  // normal and positive
  const int biased = int(bits >> 23);
  if (biased == 0xff) return 127;
  return biased - 8 + int((bits & 0x7fffffu) > 0x600000u);  // 0x600000: the mantissa bits of 1.75
}

// n / d for non-negative n and d > 0, in 32 bits whenever both fit (a 64-bit division is a
// called subroutine on the GPU). The register kernel divides once per row for its weight group
// and table row; the stream kernel divides once per thread and then steps a RowGroup.
__device__ __forceinline__ int64_t div_rows(int64_t n, int64_t d) {
  return (n | d) <= int64_t(UINT32_MAX) ? int64_t(uint32_t(n) / uint32_t(d)) : n / d;
}

// row / per for a row that advances by a fixed stride (a persistent warp's rows): quotient and
// remainder move by stride / per and stride % per (`dq`, `dr`: computed on the host for the
// launch's grid, so they cost no registers) with one carry, instead of a division per row
// (two per row, weight and table, were ~40 of the stream kernel's instructions).
struct RowGroup {
  int64_t q, r;
  __device__ __forceinline__ RowGroup(int64_t row, int64_t per) : q(div_rows(row, per)), r(row - q * per) {}
  __device__ __forceinline__ void advance(int64_t dq, int64_t dr, int64_t per) {
    q += dq, r += dr;
    if (r >= per) r -= per, ++q;
  }
};

// How a row is spread over the lanes: LANES lanes per row (32: a warp; 16: half a warp, two
// rows per warp), 8 consecutive elements per lane per chunk, so a chunk is LANES x 8 elements
// and lane `sub` (its index among the row's lanes) holds elements c x LANES x 8 + 8 sub ..
// + 7 of chunk c. RC is how many chunks keep (cos, sin) pairs in registers: all of them
// (RC = CHUNKS, any RoPE span), or one (RC = 1: the span lies in the row's last chunk
// `rope_chunk`, which the launch checks), which spares the registers the half-warp layout's
// four chunks would otherwise cost.
template <int CHUNKS, int LANES, int RC>
struct RowLayout {
  static_assert(LANES == 16 || LANES == 32, "a row is spread over 16 or 32 lanes");
  static_assert(RC == CHUNKS || RC == 1, "pairs for every chunk or for the last one");
  static constexpr int kWidth = LANES * 8;  // elements of a chunk
  // The slot of chunk c's pairs, or -1: chunk c holds no RoPE dims of this layout.
  static __device__ __forceinline__ int pair_slot(int c, int rope_chunk) {
    if constexpr (RC == CHUNKS) return c;
    return c == rope_chunk ? 0 : -1;
  }
};

// (cos, sin) pairs of the lanes whose 8 elements of a chunk fall in the RoPE span (R % 8 == 0,
// so 8 elements are 4 whole pairs), from table row `freq_row`. Independent of x, so callers
// issue it early.
template <int CHUNKS, int LANES, int RC>
__device__ __forceinline__ void load_freqs(const RmsNormRopeParams& p, int64_t freq_row, int sub, int rope_chunk,
                                           float4 (&cs)[RC][2]) {
  using L = RowLayout<CHUNKS, LANES, RC>;
  if (p.rope_dim == 0) return;
  const float* fr = p.freqs + freq_row * int64_t(p.rope_dim);
  const int rope_lo = p.dim - p.rope_dim;
  const auto load = [&](int e0, float4 (&pair)[2]) {
    if (e0 < p.dim && e0 >= rope_lo) {
      pair[0] = __ldg(reinterpret_cast<const float4*>(fr + (e0 - rope_lo)));
      pair[1] = __ldg(reinterpret_cast<const float4*>(fr + (e0 - rope_lo) + 4));
    }
  };
  if constexpr (RC == 1 && CHUNKS > 1) {
    load(rope_chunk * L::kWidth + sub * 8, cs[0]);
  } else {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) load(c * L::kWidth + sub * 8, cs[c]);
  }
}

// Everything after the row is in registers: RMSNorm (sum over the row's lanes), weight row `w`
// (null: none), RoPE with the pairs from `load_freqs`, then the store in x's dtype or, for
// FP8 = 64 or 128, the FP8 blocks and their exponents. FP8 is a template argument so the
// block's lane count, shuffle distances and shifts are constants (as a runtime value it cost
// a loop of shuffles with divergence checks per chunk). `inv_dim` = 1 / D. Every lane of the
// warp calls it (the shuffles span the warp); `live` lanes store.
template <typename T, int CHUNKS, int FP8, int LANES, int RC>
__device__ __forceinline__ void finish_row(const RmsNormRopeParams& p, int64_t row, bool live, int sub, float (&v)[CHUNKS][8],
                                           const float4 (&cs)[RC][2], int rope_chunk, const float* w, float inv_dim) {
  using L = RowLayout<CHUNKS, LANES, RC>;
  static_assert(FP8 == 0 || FP8 == 64 || FP8 == 128, "FP8 block is 0 (none), 64 or 128");
  static_assert(FP8 / 8 <= LANES, "an FP8 block lies within one row's lanes");
  const int64_t base = row * p.dim;
  const int rope_lo = p.dim - p.rope_dim;
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    if (c * L::kWidth + sub * 8 < p.dim) {
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += v[c][i] * v[c][i];
    }
  }
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within the row's lanes
  const float rinv = rsqrtf(ss * inv_dim + p.eps);
  const float sgn = p.inverse ? -1.f : 1.f;

#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int e0 = c * L::kWidth + sub * 8;
    if (e0 < p.dim) {
      if (w) {  // shared by many rows: an L1 / L2 hit, so it is read only now, sparing registers
        const float4 w0 = __ldg(reinterpret_cast<const float4*>(w + e0));
        const float4 w1 = __ldg(reinterpret_cast<const float4*>(w + e0 + 4));
        const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = Vec8<T>::round(v[c][i] * rinv * wv[i]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = Vec8<T>::round(v[c][i] * rinv);
      }
      const int slot = L::pair_slot(c, rope_chunk);
      if (p.rope_dim > 0 && slot >= 0 && e0 >= rope_lo) {
        const float4 c0 = cs[slot < 0 ? 0 : slot][0], c1 = cs[slot < 0 ? 0 : slot][1];
        const float cosv[4] = {c0.x, c0.z, c1.x, c1.z};
        const float sinv[4] = {c0.y, c0.w, c1.y, c1.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float x0 = v[c][2 * k], x1 = v[c][2 * k + 1];
          const float s = sgn * sinv[k];
          v[c][2 * k] = Vec8<T>::round(x0 * cosv[k] - x1 * s);
          v[c][2 * k + 1] = Vec8<T>::round(x0 * s + x1 * cosv[k]);
        }
      }
    }
  }

  if constexpr (FP8 == 0) {
    if (!live) return;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      const int e0 = c * L::kWidth + sub * 8;
      if (e0 < p.dim) Vec8<T>::store(p.y, base + e0, v[c]);
    }
  } else {
    // A block of FP8 elements spans FP8 / 8 consecutive lanes of one chunk (D % FP8 == 0).
    constexpr int kLanesPerBlock = FP8 / 8;
    constexpr int kBlockShift = FP8 == 64 ? 6 : 7;
    const int64_t exp_base = row * (p.dim >> kBlockShift);
    uint8_t* y8 = static_cast<uint8_t*>(p.y);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      const int e0 = c * L::kWidth + sub * 8;
      if (c * L::kWidth >= p.dim) break;  // warp-uniform: whole warp leaves together
      const bool active = e0 < p.dim;
      float amax = 0.f;
      if (active) {
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[c][i]));
      }
#pragma unroll
      for (int o = 1; o < kLanesPerBlock; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (!active || !live) continue;
      const int ex = ue8m0_exponent(amax);
      const float inv_scale = __int_as_float((254 - ex) << 23);  // 2^(127 - ex), exact
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_fp8x2_storage_t pr = __nv_cvt_float2_to_fp8x2(
            make_float2(v[c][2 * k] * inv_scale, v[c][2 * k + 1] * inv_scale), __NV_SATFINITE, __NV_E4M3);
        if (k < 2)
          lo |= uint32_t(pr) << (16 * k);
        else
          hi |= uint32_t(pr) << (16 * (k - 2));
      }
      *reinterpret_cast<uint2*>(y8 + base + e0) = make_uint2(lo, hi);
      if (sub % kLanesPerBlock == 0) p.exps[exp_base + (e0 >> kBlockShift)] = uint8_t(ex);
    }
  }
}

// Rows of over 1 KB, up to 2048 elements: one warp per row, loaded straight to registers.
// CHUNKS = ceil(D / 256) (2, 4 or 8) is a template argument so a row costs only the
// registers its width needs. The row and its (cos, sin) pairs are loaded before the first is
// used, so each warp waits for DRAM once; the weight, shared by many rows and so an L1 / L2
// hit, is read only when applied.
template <typename T, int CHUNKS, int FP8>
__global__ void __launch_bounds__(256) rms_norm_rope_kernel(const RmsNormRopeParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= p.rows) return;
  float v[CHUNKS][8];
  float4 cs[CHUNKS][2];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int e0 = c * kChunk + lane * 8;
    if (e0 < p.dim) Vec8<T>::load(p.x, row * p.dim + e0, v[c]);
  }
  if (p.rope_dim > 0) load_freqs<CHUNKS, 32, CHUNKS>(p, div_rows(row, p.rows_per_freq_row), lane, 0, cs);
  const float* w = p.weight ? p.weight + div_rows(row, p.rows_per_weight_group) * p.dim : nullptr;
  finish_row<T, CHUNKS, FP8, 32, CHUNKS>(p, row, true, lane, v, cs, 0, w, 1.f / float(p.dim));
}

// Rows of at most 1 KB (bf16 D <= 512, f32 D <= 256: every V4 / DSpark q and kv row): the
// register kernel keeps only one row per warp in flight (32 warps x 1 KB per SM at the 56
// registers it had at ae018d1), which measured 2.8 TB/s of 4.1 on the H200. Here a
// persistent block streams groups of 8 consecutive rows (8 KB, contiguous) through a
// 4-stage ring in shared memory with the bulk copy engine: thread 0 keeps 4 groups in flight
// per block, so the bytes in flight no longer cost registers. Each row of the group goes to
// LANES lanes (a warp, or half a warp: 256 or 128 threads a block, 3 or 6 blocks an SM), which
// copy it from shared memory to registers; one CTA barrier per group releases the stage to
// the next copy. The (cos, sin) pairs of a row's successor are loaded one group ahead
// (per-row tables, as for kv, come from DRAM). A lane's rows advance by 8 x gridDim.x, so
// their weight group and table row are stepped (RowGroup), not divided.
// Half a warp per row (two rows a warp) is meant to halve what a row costs in per-row
// instructions (the loop, barrier and ring bookkeeping, the table loads' addressing, the RMS
// shuffles, the RoPE lanes that run while the others wait): with a warp per row the FP8 q
// prefill runs at ~420 warp instructions a row, instruction-bound (docs/kernels.md, "Prep
// kernel"). Written 2026-12-05 without a GPU: reached only through kernel_driver --prep-half
// until it has been checked and timed there.
constexpr int kStreamStages = 4;
constexpr int kStreamRowBytes = 1024;
// Blocks an SM holds, guaranteed by the launch bounds: 3 of 256 threads (a warp per row) or 6 of
// 128 (half a warp per row), 768 threads and 3 x 33 or 6 x 33 KB of ring either way, <= 85
// registers (80 at most, no spills: the unconditional ring loads keep the four chunks of
// values free of selects).
constexpr int stream_blocks_per_sm(int lanes) { return lanes == 32 ? 3 : 6; }

template <typename T, int CHUNKS, int FP8, int LANES, int RC>
__global__ void __launch_bounds__(8 * LANES, stream_blocks_per_sm(LANES))
    rms_norm_rope_stream_kernel(const RmsNormRopeParams p) {
  using L = RowLayout<CHUNKS, LANES, RC>;
  static_assert(CHUNKS * L::kWidth * sizeof(T) <= kStreamRowBytes, "a row must fit its 1 KB slot of the ring");
  __shared__ alignas(128) uint8_t ring[kStreamStages][8 * kStreamRowBytes];
  __shared__ alignas(8) uint64_t full[kStreamStages];
  const int sub = threadIdx.x % LANES, slot = threadIdx.x / LANES;  // lane within the row, row within the group
  const uint32_t row_bytes = uint32_t(p.dim) * sizeof(T);
  const int64_t groups = (p.rows + 7) / 8;
  const int rope_chunk = (p.dim - 1) / L::kWidth;  // RC = 1: the launch checked that RoPE lies in it
  const auto issue = [&](int64_t g, int s) {  // thread 0: bulk-copy group g into stage s
    const int64_t r0 = g * 8;
    const uint32_t bytes = uint32_t(p.rows - r0 < 8 ? p.rows - r0 : 8) * row_bytes;
    mbar_arrive_expect_tx(&full[s], bytes);
    bulk_copy_g2s(ring[s], static_cast<const uint8_t*>(p.x) + r0 * row_bytes, bytes, &full[s]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStreamStages; ++s) mbar_init(&full[s], 1);
    fence_barrier_init();
    for (int s = 0; s < kStreamStages; ++s) {
      const int64_t g = blockIdx.x + int64_t(s) * gridDim.x;
      if (g < groups) issue(g, s);
    }
  }
  __syncthreads();

  const int64_t first = int64_t(blockIdx.x) * 8 + slot, stride = int64_t(gridDim.x) * 8;
  RowGroup wg(first, p.rows_per_weight_group);  // of the current row
  RowGroup fg(first, p.rows_per_freq_row);      // of the row whose pairs are loaded next
  const float inv_dim = 1.f / float(p.dim);
  // A warp per row loads its next row's pairs one group ahead (a second set of registers);
  // half a warp per row has no registers to spare for that and loads the current row's at
  // the top of the iteration, under the ring wait, the barrier and the RMS reduction.
  constexpr bool kAhead = LANES == 32;
  float4 cs[RC][2];
  if (kAhead && first < p.rows) load_freqs<CHUNKS, LANES, RC>(p, fg.q, sub, rope_chunk, cs);
  if (kAhead) fg.advance(p.freq_step_q, p.freq_step_r, p.rows_per_freq_row);
  int it = 0;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x, ++it) {
    const int s = it % kStreamStages;
    const int64_t row = g * 8 + slot;
    const bool live = row < p.rows;
    if (!kAhead) {
      if (live) load_freqs<CHUNKS, LANES, RC>(p, fg.q, sub, rope_chunk, cs);
      fg.advance(p.freq_step_q, p.freq_step_r, p.rows_per_freq_row);
    }
    float v[CHUNKS][8];
    mbar_wait(&full[s], uint32_t(it / kStreamStages) & 1u);
    if constexpr (LANES == 32) {
      if (live) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          const int e0 = c * L::kWidth + sub * 8;
          if (e0 < p.dim) Vec8<T>::load(ring[s] + slot * row_bytes, e0, v[c]);
        }
      }
    } else {
      // Every lane loads every chunk, also past D and for an absent row: inside the stage (a
      // row's slot of CHUNKS x LANES x 8 elements fits 1 KB, the 8th ends at the stage's
      // end), unconditionally, so no value needs a select (with them, the four chunks spilled
      // at 85 registers); what lies past D or in an absent row is never summed, stored or
      // shuffled into a present row's lanes.
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) Vec8<T>::load_bits(ring[s] + slot * row_bytes, c * L::kWidth + sub * 8, v[c]);
    }
    __syncthreads();  // every lane holds its share of its row: stage s may take the next copy
    if (threadIdx.x == 0 && g + int64_t(kStreamStages) * gridDim.x < groups) issue(g + int64_t(kStreamStages) * gridDim.x, s);
    if constexpr (kAhead) {
      float4 cur[RC][2];
#pragma unroll
      for (int c = 0; c < RC; ++c) cur[c][0] = cs[c][0], cur[c][1] = cs[c][1];
      if (row + stride < p.rows) load_freqs<CHUNKS, LANES, RC>(p, fg.q, sub, rope_chunk, cs);
      fg.advance(p.freq_step_q, p.freq_step_r, p.rows_per_freq_row);
      if (live)
        finish_row<T, CHUNKS, FP8, LANES, RC>(p, row, true, sub, v, cur, rope_chunk,
                                              p.weight ? p.weight + wg.q * p.dim : nullptr, inv_dim);
    } else {  // every lane of the warp joins the shuffles, a dead row's too
      finish_row<T, CHUNKS, FP8, LANES, RC>(p, row, live, sub, v, cs, rope_chunk,
                                            p.weight ? p.weight + wg.q * p.dim : nullptr, inv_dim);
    }
    wg.advance(p.weight_step_q, p.weight_step_r, p.rows_per_weight_group);
  }
}

// The launch for one FP8 block size (0: none).
template <typename T, int FP8>
cudaError_t launch_block(RmsNormRopeParams p, cudaStream_t stream) {
  const int chunks = (p.dim + kChunk - 1) / kChunk;
  const int64_t groups = (p.rows + 7) / 8;
  if (int64_t(p.dim) * sizeof(T) <= kStreamRowBytes) {
    // Half a warp per row when asked (`half_warp_rows`: the FFI handlers ask; faster in every
    // bench-prep case, docs/kernels.md) and the RoPE span lies in the row's last 128-element chunk (every
    // V4 / DSpark q and kv row: D 512, R 64), else a warp per row.
    const int last_half_chunk = (p.dim - 1) / 128;
    const bool half = p.half_warp_rows && (p.rope_dim == 0 || p.dim - p.rope_dim >= last_half_chunk * 128);
    const int threads = half ? 128 : 256;
    const int64_t resident = int64_t(p.sms) * stream_blocks_per_sm(half ? 16 : 32);
    const unsigned blocks = unsigned(p.sms > 0 && resident < groups ? resident : groups);
    const int64_t stride = int64_t(blocks) * 8;  // rows between a lane's consecutive rows
    p.weight_step_q = stride / p.rows_per_weight_group, p.weight_step_r = stride % p.rows_per_weight_group;
    p.freq_step_q = stride / p.rows_per_freq_row, p.freq_step_r = stride % p.rows_per_freq_row;
    if (half) {
      const int half_chunks = last_half_chunk + 1;  // 1 .. 4 (bf16), 1 .. 2 (f32)
      if (half_chunks == 1)
        rms_norm_rope_stream_kernel<T, 1, FP8, 16, 1><<<blocks, threads, 0, stream>>>(p);
      else if (half_chunks == 2)
        rms_norm_rope_stream_kernel<T, 2, FP8, 16, 1><<<blocks, threads, 0, stream>>>(p);
      else if constexpr (sizeof(T) == 2)
        rms_norm_rope_stream_kernel<T, 4, FP8, 16, 1><<<blocks, threads, 0, stream>>>(p);
      return cudaGetLastError();
    }
    if constexpr (sizeof(T) == 2) {  // bf16 rows of up to 512 elements: 1 or 2 chunks
      if (chunks > 1) {
        rms_norm_rope_stream_kernel<T, 2, FP8, 32, 2><<<blocks, threads, 0, stream>>>(p);
        return cudaGetLastError();
      }
    }
    rms_norm_rope_stream_kernel<T, 1, FP8, 32, 1><<<blocks, threads, 0, stream>>>(p);  // f32 rows: at most 256 elements
    return cudaGetLastError();
  }
  const unsigned blocks = unsigned(groups);
  if (chunks <= 2)
    rms_norm_rope_kernel<T, 2, FP8><<<blocks, 256, 0, stream>>>(p);
  else if (chunks <= 4)
    rms_norm_rope_kernel<T, 4, FP8><<<blocks, 256, 0, stream>>>(p);
  else
    rms_norm_rope_kernel<T, kMaxChunks, FP8><<<blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rows(const RmsNormRopeParams& p, cudaStream_t stream) {
  switch (p.fp8_block) {
    case 64: return launch_block<T, 64>(p, stream);
    case 128: return launch_block<T, 128>(p, stream);
    default: return launch_block<T, 0>(p, stream);  // the handler admits only 0, 64 and 128
  }
}

}  // namespace

cudaError_t run_rms_norm_rope(const RmsNormRopeParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  RmsNormRopeParams p = params;
  p.rows_per_weight_group = p.rows / p.weight_groups;
  p.rows_per_freq_row = p.rows / p.freq_rows;
  return p.dtype == PrepDType::kBF16 ? launch_rows<__nv_bfloat16>(p, stream) : launch_rows<float>(p, stream);
}

}  // namespace jds
