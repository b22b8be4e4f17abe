// Sparse sink attention for one shared 512-wide key=value row per token (DeepSeek-V4 / DSpark).
//
// Decode is memory-bound: every head of a request reads the SAME gathered rows. So one CTA
// takes 64 query heads of one (request, query row), gathers a tile of 64 rows into shared
// memory once with the Hopper bulk-copy engine (one `cp.async.bulk` per 1 KB row, completing
// on an mbarrier), and all 64 heads consume it on tensor cores (mma.sync m16n8k16, bf16 in,
// f32 accumulate). Warp 0 keeps the next tile in flight (double buffer) while all eight
// warps run an online softmax over the current one. Long lists are split over
// CTAs (split-K); partials carry their log-sum-exp and a combine kernel merges them exactly,
// then applies the sink and the inverse-RoPE epilogue.
//
// Index values are checked here: anything outside [0, n) (including -1) is a masked row,
// never a read, so a bad index cannot read out of bounds.
//
// FP8 pools (448 e4m3 dims + 64 bf16 RoPE dims + one power-of-two scale per 64 e4m3 values,
// params.h) use a second instantiation of the same kernel: the loader bulk-copies the 448
// e4m3 bytes into the second half of the row's bf16 slot and the RoPE dims to their final
// place, warp 0 fetches the scales, and all warps expand the e4m3 bytes in place to bf16
// (exact: 4 significant bits times a power of two) before the unchanged MMA pipeline runs.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cmath>

#include "attention/common.cuh"
#include "attention/params.h"
#include "common/ptx.cuh"

namespace jds {
namespace {

constexpr int D = kAttnHeadDim;
constexpr int BM = kAttnHeadsPerCta;
constexpr int BK = kAttnKeysPerTile;
constexpr int kRowBytes = D * 2;
// Rows sit 1040 B apart in shared memory: eight rows read by one ldmatrix land 4 banks apart,
// so the 8x16 B phases of ldmatrix (plain and transposed) are free of bank conflicts, and
// 1040 keeps the 16-byte alignment the bulk copy needs.
constexpr int kRowStride = kRowBytes + 16;
constexpr int kPStride = BK * 2 + 16;  // bf16 probabilities, padded the same way
constexpr int kConsumerWarps = 8;
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kThreads = kConsumerThreads;

constexpr int kStageBytes = BK * kRowStride;
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + BM * kRowStride;
constexpr int kOffP = kOffKV + 2 * kStageBytes;
constexpr int kOffMax = kOffP + BM * kPStride;
constexpr int kOffSum = kOffMax + 2 * BM * 4;
constexpr int kOffValid = kOffSum + 2 * BM * 4;
constexpr int kOffBar = kOffValid + 16;
constexpr int kSmemBytes = kOffBar + 5 * 8;
static_assert(kOffBar % 8 == 0, "mbarriers need 8-byte alignment");
static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one H100/H200 CTA");
// FP8 instantiation only: per stage, each row's 8 scale bytes and the masks of FP8 rows.
constexpr int kOffScale = kSmemBytes;
constexpr int kOffFp8 = kOffScale + 2 * BK * kAttnScaleBytes;
constexpr int kSmemBytesFp8 = kOffFp8 + 4 * 4;
constexpr int kFp8CopyBytes = kAttnNopeDim + 2 * kAttnRopeDim;  // 576 bytes bulk-copied per FP8 row
constexpr int kNopeChunks = kAttnNopeDim / 16;                   // 28 lanes expand 16 e4m3 bytes each
static_assert(kOffScale % 8 == 0, "scale rows are stored as 8-byte words");
static_assert(kSmemBytesFp8 <= 227 * 1024, "shared memory budget of one H100/H200 CTA");
static_assert(kAttnNopeDim % 16 == 0 && kAttnNopeDim % kAttnScaleBlock == 0 && kAttnScaleBlock % 16 == 0,
              "FP8 nope bytes are expanded in 16-byte chunks within one scale block");


// Index values of rows j0 + lane and j0 + 32 + lane of the concatenated [main | extra] list
// (any value; validity is decided when the tile is issued). Loaded one tile ahead so the
// global-load latency hides behind a tile of tensor-core work.
__device__ __forceinline__ void load_tile_indices(const SparseSinkAttentionParams& p, int t, int key_begin,
                                                  int key_end, int64_t bs, int lane, int (&idx)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = key_begin + t * BK + lane + 32 * half;
    idx[half] = -1;
    if (j < key_end)
      idx[half] = j < p.k_main ? p.main_idx[bs * p.k_main + j] : p.extra_idx[bs * p.k_extra + (j - p.k_main)];
  }
}

// Zeroes the first 64 16-byte chunks of rows first + i for every set bit i of `z`; one warp,
// lane l writes chunks l and l + 32.
__device__ __forceinline__ void zero_rows(uint8_t* stage_base, uint32_t z, int first, int lane) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  while (z) {
    const int r = first + __ffs(z) - 1;
    z &= z - 1;
    uint4* row = reinterpret_cast<uint4*>(stage_base + r * kRowStride);
    row[lane] = zero;
    row[lane + 32] = zero;
  }
}

// The rows of a tile whose bit is clear in the validity masks (m0: rows 0..31, m1: 32..63).
__device__ __forceinline__ void zero_masked_rows(uint8_t* stage_base, uint32_t m0, uint32_t m1, int lane) {
  zero_rows(stage_base, ~m0, 0, lane);
  zero_rows(stage_base, ~m1, 32, lane);
}

// Warp 0 doubles as the producer: it gathers tile t of this split's rows into stage t % 2.
// (A dedicated ninth warp would cap every thread at 168 registers: the 4 schedulers split
// the register file, and one of them would host 3 warps.)
__device__ __forceinline__ void produce_tile(const SparseSinkAttentionParams& p, uint8_t* smem, int t,
                                             int key_begin, int key_end, int lane, const int (&idx)[2]) {
  uint64_t* bar_full = reinterpret_cast<uint64_t*>(smem + kOffBar) + 1;
  uint64_t* bar_empty = bar_full + 2;
  uint32_t* s_valid = reinterpret_cast<uint32_t*>(smem + kOffValid);
  const __nv_bfloat16* main_rows = static_cast<const __nv_bfloat16*>(p.main_rows);
  const __nv_bfloat16* extra_rows = static_cast<const __nv_bfloat16*>(p.extra_rows);
  const int stage = t & 1;
  const int j0 = key_begin + t * BK;
  const __nv_bfloat16* src[2];
  bool ok[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = j0 + lane + 32 * half;
    const bool in_main = j < p.k_main;
    const int64_t n = in_main ? p.n_main : p.n_extra;
    ok[half] = j < key_end && idx[half] >= 0 && idx[half] < n;
    src[half] = (in_main ? main_rows : extra_rows) + int64_t(idx[half]) * D;
  }
  const uint32_t m0 = __ballot_sync(0xffffffffu, ok[0]);
  const uint32_t m1 = __ballot_sync(0xffffffffu, ok[1]);
  if (t >= 2) mbar_wait(&bar_empty[stage], ((t >> 1) - 1) & 1);
  uint8_t* stage_base = smem + kOffKV + stage * kStageBytes;
  // Masked rows are zeroed: their probability is 0, and 0 * (stale NaN) would not be.
  zero_masked_rows(stage_base, m0, m1, lane);
  if (lane == 0) {
    s_valid[stage * 2] = m0;
    s_valid[stage * 2 + 1] = m1;
  }
  __syncwarp();
  if (lane == 0) mbar_arrive_expect_tx(&bar_full[stage], uint32_t(__popc(m0) + __popc(m1)) * kRowBytes);
  __syncwarp();
  if (ok[0]) bulk_copy_g2s(stage_base + lane * kRowStride, src[0], kRowBytes, &bar_full[stage]);
  if (ok[1]) bulk_copy_g2s(stage_base + (lane + 32) * kRowStride, src[1], kRowBytes, &bar_full[stage]);
}


// produce_tile for the FP8 instantiation: rows of an FP8 pool bring 448 e4m3 bytes (landing
// at byte 448 of the slot, expanded in place by dequantize_tile) and 128 bytes of bf16 RoPE
// dims (landing at byte 896, their final place); bf16 rows are copied whole as before. The
// rows' scale bytes are loaded into `scl` here and stored by finish_tile_fp8 a tile of work
// later, whose arrival (the second of the full barrier's two) releases them.
__device__ __forceinline__ void produce_tile_fp8(const SparseSinkAttentionParams& p, uint8_t* smem, int t,
                                                 int key_begin, int key_end, int lane, const int (&idx)[2],
                                                 uint2 (&scl)[2]) {
  uint64_t* bar_full = reinterpret_cast<uint64_t*>(smem + kOffBar) + 1;
  uint64_t* bar_empty = bar_full + 2;
  uint32_t* s_valid = reinterpret_cast<uint32_t*>(smem + kOffValid);
  uint32_t* s_fp8 = reinterpret_cast<uint32_t*>(smem + kOffFp8);
  const int stage = t & 1;
  const int j0 = key_begin + t * BK;
  const uint8_t* src[2];
  const uint8_t* rope[2];
  bool ok[2], f8[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = j0 + lane + 32 * half;
    const bool in_main = j < p.k_main;
    const int64_t n = in_main ? p.n_main : p.n_extra;
    ok[half] = j < key_end && idx[half] >= 0 && idx[half] < n;
    f8[half] = (in_main ? p.main_fp8 : p.extra_fp8) != 0;
    const int64_t row = ok[half] ? idx[half] : 0;
    src[half] = static_cast<const uint8_t*>(in_main ? p.main_rows : p.extra_rows) +
                row * (f8[half] ? kAttnNopeDim : kRowBytes);
    rope[half] = f8[half] ? static_cast<const uint8_t*>(in_main ? p.main_rope : p.extra_rope) + row * (2 * kAttnRopeDim)
                          : nullptr;
    scl[half] = make_uint2(0u, 0u);
    if (ok[half] && f8[half]) {
      const uint8_t* scale_row = (in_main ? p.main_scale : p.extra_scale) + row * kAttnScaleBytes;
      scl[half] = __ldg(reinterpret_cast<const uint2*>(scale_row));
    }
  }
  const uint32_t m0 = __ballot_sync(0xffffffffu, ok[0]);
  const uint32_t m1 = __ballot_sync(0xffffffffu, ok[1]);
  const uint32_t g0 = __ballot_sync(0xffffffffu, ok[0] && f8[0]);
  const uint32_t g1 = __ballot_sync(0xffffffffu, ok[1] && f8[1]);
  if (t >= 2) mbar_wait(&bar_empty[stage], ((t >> 1) - 1) & 1);
  uint8_t* stage_base = smem + kOffKV + stage * kStageBytes;
  zero_masked_rows(stage_base, m0, m1, lane);
  if (lane == 0) {
    s_valid[stage * 2] = m0;
    s_valid[stage * 2 + 1] = m1;
    s_fp8[stage * 2] = g0;
    s_fp8[stage * 2 + 1] = g1;
  }
  __syncwarp();
  fence_proxy_async_smem();
  if (lane == 0) {
    const uint32_t rows = __popc(m0) + __popc(m1), fp8_rows = __popc(g0) + __popc(g1);
    mbar_arrive_expect_tx(&bar_full[stage], rows * kRowBytes - fp8_rows * (kRowBytes - kFp8CopyBytes));
  }
  __syncwarp();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (!ok[half]) continue;
    uint8_t* slot = stage_base + (lane + 32 * half) * kRowStride;
    if (f8[half]) {
      bulk_copy_g2s(slot + kAttnNopeDim, src[half], kAttnNopeDim, &bar_full[stage]);
      bulk_copy_g2s(slot + 2 * kAttnNopeDim, rope[half], 2 * kAttnRopeDim, &bar_full[stage]);
    } else {
      bulk_copy_g2s(slot, src[half], kRowBytes, &bar_full[stage]);
    }
  }
}

// Second arrival on the FP8 instantiation's full barrier: the scale bytes of tile `stage`.
__device__ __forceinline__ void finish_tile_fp8(uint8_t* smem, int stage, int lane, const uint2 (&scl)[2]) {
  uint64_t* bar_full = reinterpret_cast<uint64_t*>(smem + kOffBar) + 1;
  uint2* s_scale = reinterpret_cast<uint2*>(smem + kOffScale) + stage * BK;
  s_scale[lane] = scl[0];
  s_scale[lane + 32] = scl[1];
  __syncwarp();
  if (lane == 0) mbar_arrive(&bar_full[stage]);
}

// All eight warps expand the tile's FP8 rows in place (warp w: rows 8w..8w+7, two rows per
// step). Lane l < 28 reads the 16 e4m3 bytes of dims 16l..16l+15 (at byte 448 + 16l of the
// slot) and, after a warp sync (the writes of lanes 14..27 overlap the bytes being read),
// writes them as 16 bf16 at byte 32l. Returns whether the tile had FP8 rows (then all
// threads have synchronised and the stage holds bf16 rows only). Block-uniform branches.
__device__ __forceinline__ bool dequantize_tile(uint8_t* smem, int stage, int warp, int lane) {
  const uint32_t* s_fp8 = reinterpret_cast<const uint32_t*>(smem + kOffFp8);
  if ((s_fp8[stage * 2] | s_fp8[stage * 2 + 1]) == 0u) return false;
  const uint32_t rows8 = (s_fp8[stage * 2 + (warp >> 2)] >> (8 * (warp & 3))) & 0xFFu;
  uint8_t* stage_base = smem + kOffKV + stage * kStageBytes;
  const uint8_t* scales = smem + kOffScale + stage * BK * kAttnScaleBytes;
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    if (((rows8 >> i) & 3u) == 0u) continue;
    uint4 v[2];
    float sc[2];
    bool act[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = 8 * warp + i + j;
      act[j] = lane < kNopeChunks && ((rows8 >> (i + j)) & 1u);
      if (act[j]) {
        v[j] = *reinterpret_cast<const uint4*>(stage_base + row * kRowStride + kAttnNopeDim + 16 * lane);
        sc[j] = ue8m0_scale(scales[row * kAttnScaleBytes + (16 * lane) / kAttnScaleBlock]);
      }
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (!act[j]) continue;
      const uint32_t w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
      uint32_t o[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        o[2 * k] = e4m3x2_to_bf16x2(w[k], sc[j]);
        o[2 * k + 1] = e4m3x2_to_bf16x2(w[k] >> 16, sc[j]);
      }
      uint4* dst = reinterpret_cast<uint4*>(stage_base + (8 * warp + i + j) * kRowStride + 32 * lane);
      dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
      dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
  __syncthreads();
  return true;
}

__device__ __forceinline__ void produce_q(const SparseSinkAttentionParams& p, uint8_t* smem, int64_t bs,
                                          int h0, int lane) {
  uint64_t* bar_q = reinterpret_cast<uint64_t*>(smem + kOffBar);
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q) + (bs * p.heads + h0) * D;
  const int hcount = min(BM, p.heads - h0);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int r = hcount; r < BM; ++r) {  // absent heads: zeros, never garbage
    uint4* row = reinterpret_cast<uint4*>(smem + kOffQ + r * kRowStride);
    row[lane] = zero;
    row[lane + 32] = zero;
  }
  __syncwarp();
  if (lane == 0) mbar_arrive_expect_tx(bar_q, uint32_t(hcount) * kRowBytes);
  __syncwarp();
  for (int r = lane; r < hcount; r += 32)
    bulk_copy_g2s(smem + kOffQ + r * kRowStride, q + int64_t(r) * D, kRowBytes, bar_q);
}

// Stores the rows of heads h_first and h_first + 8 of query row `bs` that this thread holds
// in the m16n8 accumulator layout: o[n][2i], o[n][2i+1] are dims dim_first + 8n (+1) of
// row i, unnormalised; inv = 1 / row sum, lse = log-sum-exp (natural log, sink excluded).
// One split: bf16 output with the sink and the inverse RoPE; several: f32 partials O / l
// and their lse for the combine kernel. `write_lse`: this thread stores the row's lse.
__device__ __forceinline__ void store_head_rows(const SparseSinkAttentionParams& p, const float (&o)[32][4],
                                                const float (&lse)[2], const float (&inv)[2], int64_t bs,
                                                int h_first, int dim_first, bool write_lse, int split) {
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  const int rope_lo = D - p.rope_dim;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int h = h_first + 8 * i;
    if (h >= p.heads) continue;
    const int64_t row = bs * p.heads + h;
    if (p.num_splits == 1) {
      const float f = inv[i] * sink_factor(p.sink, h, lse[i]);
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + row * D;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int dim = dim_first + 8 * n;
        *reinterpret_cast<uint32_t*>(out + dim) =
            output_pair(p, o[n][2 * i] * f, o[n][2 * i + 1] * f, bs, dim, rope_lo);
      }
      if (write_lse) p.lse[row] = lse[i];
    } else {
      float* po = p.partial_out + (int64_t(split) * rows + row) * D;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int dim = dim_first + 8 * n;
        *reinterpret_cast<float2*>(po + dim) = make_float2(o[n][2 * i] * inv[i], o[n][2 * i + 1] * inv[i]);
      }
      if (write_lse) p.partial_lse[int64_t(split) * rows + row] = lse[i];
    }
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_sink_attention_kernel(const SparseSinkAttentionParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const AttnWorkItem item = attn_work_item(p);
  const int h0 = item.h0, split = item.split, key_begin = item.key_begin, key_end = item.key_end;
  const int ntiles = item.ntiles;
  const int64_t bs = item.bs;

  uint64_t* bar_q = reinterpret_cast<uint64_t*>(smem + kOffBar);
  uint64_t* bar_full = bar_q + 1;
  uint64_t* bar_empty = bar_q + 3;
  const uint32_t* s_valid = reinterpret_cast<const uint32_t*>(smem + kOffValid);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    // FP8: the second arrival is finish_tile_fp8's (the scale bytes).
    mbar_init(&bar_full[0], kFp8 ? 2 : 1);
    mbar_init(&bar_full[1], kFp8 ? 2 : 1);
    mbar_init(&bar_empty[0], kConsumerThreads);
    mbar_init(&bar_empty[1], kConsumerThreads);
    fence_barrier_init();
  }
  __syncthreads();

  // Warp (r, c): query rows 16r..16r+15; scores for keys 32c..32c+31 of each tile; output
  // dims 256c..256c+255. The pair (r, 0), (r, 1) shares row maxima and probabilities.
  const int r = warp & 3;
  const int c = warp >> 2;
  const int g = lane >> 2;
  const int q4 = lane & 3;
  const uint32_t bar_id = 1 + r;
  float* s_max = reinterpret_cast<float*>(smem + kOffMax);
  float* s_sum = reinterpret_cast<float*>(smem + kOffSum);

  float o[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max, log2 units
  float l_run[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;

  const uint32_t q_addr = smem_addr(smem + kOffQ) + (16 * r + (lane & 15)) * kRowStride + (lane >> 4) * 16;
  const uint32_t k_off = (32 * c + (lane & 7) + ((lane >> 4) << 3)) * kRowStride + ((lane >> 3) & 1) * 16;
  const uint32_t v_off = ((lane & 7) + (((lane >> 3) & 1) << 3)) * kRowStride + (256 * c + (lane >> 4) * 8) * 2;
  const uint32_t p_addr = smem_addr(smem + kOffP) + (16 * r + (lane & 15)) * kPStride + (lane >> 4) * 16;
  uint8_t* p_store = smem + kOffP + (16 * r + g) * kPStride + (32 * c + 2 * q4) * 2;

  int next_idx[2] = {-1, -1};  // warp 0: indices of the next tile to issue
  uint2 next_scl[2];           // warp 0, FP8: scale bytes of the tile in flight
  if (warp == 0) {
    load_tile_indices(p, 0, key_begin, key_end, bs, lane, next_idx);
    produce_q(p, smem, bs, h0, lane);
    if (ntiles > 0) {
      if constexpr (kFp8) {
        produce_tile_fp8(p, smem, 0, key_begin, key_end, lane, next_idx, next_scl);
        finish_tile_fp8(smem, 0, lane, next_scl);
      } else {
        produce_tile(p, smem, 0, key_begin, key_end, lane, next_idx);
      }
    }
    if (ntiles > 1) load_tile_indices(p, 1, key_begin, key_end, bs, lane, next_idx);
  }
  mbar_wait(bar_q, 0);
  for (int t = 0; t < ntiles; ++t) {
    const int stage = t & 1;
    if (warp == 0 && t + 1 < ntiles) {
      if constexpr (kFp8)
        produce_tile_fp8(p, smem, t + 1, key_begin, key_end, lane, next_idx, next_scl);
      else
        produce_tile(p, smem, t + 1, key_begin, key_end, lane, next_idx);
      if (t + 2 < ntiles) load_tile_indices(p, t + 2, key_begin, key_end, bs, lane, next_idx);
    }
    mbar_wait(&bar_full[stage], (t >> 1) & 1);
    bool expanded = false;
    if constexpr (kFp8) expanded = dequantize_tile(smem, stage, warp, lane);
    const uint32_t kv_base = smem_addr(smem + kOffKV + stage * kStageBytes);
    const uint32_t vmask = s_valid[stage * 2 + c];

    // Rows of the list in this tile (the same for all warps), and in this warp's 32 keys: a
    // short last tile (the 5 draft rows after a DSpark block's 128 context rows, say) skips
    // the key groups that hold no row. Exact: their scores are masked below (probability 0)
    // and their rows zero-filled, so the skipped products would only add +0.
    const int tile_rows = min(BK, key_end - (key_begin + t * BK));
    const int warp_rows = tile_rows - 32 * c;
    float sc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
    if (warp_rows > 16) {
#pragma unroll 8
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4], b0[4], b1[4];
        ldmatrix_x4(a, q_addr + ks * 32);
        ldmatrix_x4(b0, kv_base + k_off + ks * 32);
        ldmatrix_x4(b1, kv_base + k_off + 16 * kRowStride + ks * 32);
        mma_bf16_16816(sc[0], a, b0[0], b0[1]);
        mma_bf16_16816(sc[1], a, b0[2], b0[3]);
        mma_bf16_16816(sc[2], a, b1[0], b1[1]);
        mma_bf16_16816(sc[3], a, b1[2], b1[3]);
      }
    } else if (warp_rows > 0) {
#pragma unroll 8
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4], b0[4];
        ldmatrix_x4(a, q_addr + ks * 32);
        ldmatrix_x4(b0, kv_base + k_off + ks * 32);
        mma_bf16_16816(sc[0], a, b0[0], b0[1]);
        mma_bf16_16816(sc[1], a, b0[2], b0[3]);
      }
    }

    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 8 * j + 2 * q4 + (e & 1);
        const float x = ((vmask >> key) & 1u) ? sc[j][e] * sl2 : -INFINITY;
        sc[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    if (q4 == 0) {
      s_max[c * BM + 16 * r + g] = mx[0];
      s_max[c * BM + 16 * r + g + 8] = mx[1];
    }
    named_barrier_sync(bar_id, 64);
    float alpha[2], mu[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float other = s_max[(1 - c) * BM + 16 * r + g + 8 * i];
      const float m_new = fmaxf(m_run[i], fmaxf(mx[i], other));
      mu[i] = m_new == -INFINITY ? 0.f : m_new;
      alpha[i] = exp2f(m_run[i] - mu[i]);
      m_run[i] = m_new;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = exp2f(sc[j][e] - mu[e >> 1]);
        sc[j][e] = pv;
        rs[e >> 1] += pv;
      }
      *reinterpret_cast<uint32_t*>(p_store + j * 16) = pack_bf16x2(sc[j][0], sc[j][1]);
      *reinterpret_cast<uint32_t*>(p_store + 8 * kPStride + j * 16) = pack_bf16x2(sc[j][2], sc[j][3]);
    }
    rescale_rows(o, l_run, alpha, rs);
    named_barrier_sync(bar_id, 64);

#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      if (16 * ks >= tile_rows) break;  // keys 16 ks .. hold no row of the list
      uint32_t a[4];
      ldmatrix_x4(a, p_addr + ks * 32);
#pragma unroll
      for (int n2 = 0; n2 < 16; ++n2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, kv_base + v_off + ks * 16 * kRowStride + n2 * 32);
        mma_bf16_16816(o[2 * n2], a, bv[0], bv[1]);
        mma_bf16_16816(o[2 * n2 + 1], a, bv[2], bv[3]);
      }
    }
    if (expanded) fence_proxy_async_smem();  // the expansion's writes before the next bulk copies
    mbar_arrive(&bar_empty[stage]);
    if constexpr (kFp8) {
      if (warp == 0 && t + 1 < ntiles) finish_tile_fp8(smem, (t + 1) & 1, lane, next_scl);
    }
  }

  // ------------------------------------ epilogue -----------------------------------------
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  if (q4 == 0) {
    s_sum[c * BM + 16 * r + g] = l_run[0];
    s_sum[c * BM + 16 * r + g + 8] = l_run[1];
  }
  named_barrier_sync(bar_id, 64);
  float lse[2], inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float l_tot = l_run[i] + s_sum[(1 - c) * BM + 16 * r + g + 8 * i];
    lse[i] = (m_run[i] == -INFINITY || !(l_tot > 0.f)) ? -INFINITY : (m_run[i] + log2f(l_tot)) * kLn2;
    inv[i] = l_tot > 0.f ? 1.f / l_tot : 0.f;
  }

  store_head_rows(p, o, lse, inv, bs, h0 + 16 * r + g, 256 * c + 2 * q4, c == 0 && q4 == 0, split);
}

// One warp per (request, query row, head): merge the split partials by their log-sum-exp,
// then sink and inverse RoPE, exactly as the single-split epilogue does.
__global__ void __launch_bounds__(256) attention_combine_kernel(const SparseSinkAttentionParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  const int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows) return;
  const int h = int(row % p.heads);
  const int64_t bs = row / p.heads;

  combine_row(
      p, row, h, bs, lane, [&](int sp) { return p.partial_lse[int64_t(sp) * rows + row]; },
      [&](int sp, int k) {
        return *reinterpret_cast<const float4*>(p.partial_out + (int64_t(sp) * rows + row) * D + 128 * k + 4 * lane);
      });
}

// Launches one instantiation (bf16 pools only, or any FP8 pool).
template <bool kFp8>
cudaError_t launch_attention(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return launch_attention_grid<sparse_sink_attention_kernel<kFp8>>(p, kThreads, kFp8 ? kSmemBytesFp8 : kSmemBytes,
                                                                   stream);
}

}  // namespace

cudaError_t run_sparse_sink_attention(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seq == 0 || p.heads == 0) return cudaSuccess;
  cudaError_t err =
      (p.main_fp8 || p.extra_fp8) ? launch_attention<true>(p, stream) : launch_attention<false>(p, stream);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_sparse_sink_attention_combine(p, stream);
}

cudaError_t launch_sparse_sink_attention_combine(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  attention_combine_kernel<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jds
