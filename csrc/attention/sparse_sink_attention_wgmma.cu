// Sparse sink attention on Hopper warpgroup MMA (wgmma), bf16 row pools. Same contract as
// sparse_sink_attention.cu (params.h); written to remove that kernel's bottleneck, which ncu
// located in shared-memory traffic: with mma.sync every warp re-reads its K and V fragments
// through ldmatrix (about 650 KB of shared-memory reads per 64-row tile for 64 heads), and
// wgmma reads each operand tile once per warpgroup instruction.
//
// One CTA = 64 query heads of one (request, query row) over a split of the row list, as in
// the mma.sync kernel, with two consumer warpgroups and no dedicated producer:
//   * every thread gathers: row tile t + 1 is copied with per-thread 16-byte `cp.async`
//     (row `tid / 4`, 16-byte chunks `tid % 4 + 4 i`) while tile t is computed; masked rows
//     (index outside [0, n), or past the list) are zero-filled and flagged in `s_valid`;
//   * shared memory holds Q [64 x 512] and two row tiles [64 x 512] in wgmma's 128-byte
//     swizzle layout: eight column blocks of 64 dims, rows 128 bytes apart in a block, and
//     the 16-byte chunk j (dims 8j .. 8j + 7) of row r at (j / 8) * 8192 + r * 128 +
//     ((j % 8) ^ (r % 8)) * 16. One tile then serves both products: K-major B of S = Q K^T
//     (SBO 1024 between 8-row groups, k16 steps advance the start address 32 bytes inside a
//     block) and MN-major B of O = P V (LBO 8192 between column blocks, SBO 1024 between
//     8-key groups). This is the layout dense Hopper GEMMs feed wgmma from; the first
//     version used the no-swizzle layout, whose core matrices of one k16 slice lie 1 KB
//     apart on the same banks (docs/kernels.md compares the two);
//   * warpgroup c ends up with S for keys 32c .. 32c + 31 of the tile: computed over
//     dims 256c .. 256c + 255 for all 64 keys (m64n64k16, both operands from shared memory,
//     16 steps) with the partner's partial sums of its keys added (s_tile_half_d), or, in
//     the bf16 warp-specialised kernel, over all of D for its 32 keys (m64n32k16, 32 steps;
//     kSOverHalfD says why); warp w of each warpgroup holds
//     heads 16w .. 16w + 15, and the two warps with the same w swap their row maxima and
//     then their P fragments through 8.5 KB of shared memory, each swap under a named
//     barrier of those 64 threads only. Each warpgroup then multiplies all 64 keys of P
//     (registers, the m16n8k16 A layout: its own half and its partner's) by its half of V's
//     columns (m64n256k16, 4 steps over the keys): warpgroup c owns output dims
//     256c .. 256c + 255. Both use the same running max, so O and the row sums rescale
//     alike; the halves' row sums are added in the epilogue. Tensor work is the minimum
//     (S once, P V once), against 1.5x when each warpgroup computed the whole S.
// Split-K partials and the epilogue are the mma.sync kernel's (attention/common.cuh).
//
// FP8 pools (params.h: 448 e4m3 + 64 bf16 RoPE dims + UE8M0 scales per row), second
// instantiation: the thread that owns a row's chunks copies its 8-byte e4m3 chunks into the
// tile in place, two to each of its first seven 16-byte bf16 chunk slots (cp.async 8 B),
// its RoPE chunks straight into the tile (cp.async 16 B) and the row's 8 scale bytes into
// registers; one iteration later, before the tile is used, the same thread reads its 14
// staged chunks into registers and writes them back expanded to bf16 (exact, as in the
// mma.sync kernel). No staging rows (which took the 28 KB the split S now uses) and no
// barrier of its own: the stage's one CTA barrier per tile (wait for tile t, expand it,
// barrier, then issue tile t + 1) also frees the other stage and the swap area.
// Status (H200, 2026-12-03): default for both pool kinds; kernel_driver edge cases,
// memcheck and racecheck clean, every GPU test passes; 1.2-1.6x (bf16) and 1.5-2.0x (FP8)
// faster than the mma.sync kernel through XLA (docs/benchmarks/attention.md).
#include <cuda_bf16.h>

#include <cfloat>
#include <cmath>
#include <type_traits>

#include "attention/common.cuh"
#include "attention/params.h"
#include "common/ptx.cuh"
#include "common/wgmma.cuh"

namespace jds {
namespace {

constexpr int D = kAttnHeadDim;
constexpr int BM = kAttnHeadsPerCta;
constexpr int BK = kAttnKeysPerTile;
constexpr int kChunks = D / 8;                // 16-byte chunks per row
constexpr int kBlockBytes = BK * 128;          // one 64-dim column block of 64 rows (8 KB)
constexpr int kTileBytes = (kChunks / 8) * kBlockBytes;
constexpr int kThreads = 256;                 // two warpgroups
constexpr int kChunksPerThread = kChunks / 4;  // 4 threads per row
constexpr int kOffQ = 0;
constexpr int kOffKV = kTileBytes;
constexpr int kOffValid = kOffKV + 2 * kTileBytes;
// The swap area of the split S: the row maxima and sums one warpgroup hands the other
// ([2][64] floats) and each thread's P fragments of its 32 keys (8 words) for its partner
// thread tid ^ 128.
constexpr int kOffXRow = kOffValid + 2 * BK;
constexpr int kOffXP = kOffXRow + 2 * BM * 4;
// The partial sums of S over half of D that the warpgroups swap (s_tile_half_d), 16 KB.
constexpr int kOffXS = kOffXP + kThreads * 32;
// The epilogue's constants (load_epilogue_constants): the sink logits of the CTA's 64 heads
// and the query row's inverse-RoPE (cos, sin) pairs (rope_dim / 2 <= 256 of them).
constexpr int kOffSink = kOffXS + kThreads * 64;
constexpr int kOffCs = kOffSink + BM * 4;
constexpr int kSmemBytes = kOffCs + (D / 2) * 8;
// The persistent kernel's extras past kSmemBytes: staged output row 63 and the row-validity
// flags of region 0 (Q's region in the other kernels, a tile stage in turn in this one).
constexpr int kOffLastRow = kSmemBytes;
constexpr int kOffValidR0 = kOffLastRow + D * 2 + 16;
constexpr int kSmemBytesPersistent = kOffValidR0 + BK;
constexpr int kMaxClusterSplits = 8;  // splits merged in one cluster at most (the portable cluster size)
constexpr int kNopeChunks = kAttnNopeDim / 8;  // FP8 rows: 8-dim chunks held as e4m3 (56)
static_assert(kOffXP % 16 == 0, "swap area: uint4 stores");
static_assert(kNopeChunks % 4 == 0 && kNopeChunks / 4 == 14, "each thread holds 14 nope + 2 RoPE chunks of its row");
static_assert(kAttnScaleBlock == 64, "expand_fp8_row: chunk i of a thread uses scale block i / 2");
static_assert(BM == 64 && BK == 64, "one row per 4 threads, 64 rows per tile and per Q block");
static_assert(kThreads == 4 * BK, "the gather maps thread -> (row, chunk phase)");
static_assert(D / 2 <= kThreads && BM <= kThreads, "load_epilogue_constants: one value a thread");
static_assert(kSmemBytesPersistent <= 227 * 1024, "shared memory budget of one H100/H200 CTA");
static_assert(63 * (D * 2 + 16) <= kTileBytes, "the persistent kernel stages rows 0..62 in one 64 KB region");


// 128-byte swizzle: dims 64b .. 64b + 63 of all rows form column block b (rows 128 bytes
// apart), and 16-byte chunk j of row r sits at chunk j ^ (r % 8) of its row.
__device__ __forceinline__ uint32_t chunk_offset(int row, int chunk) {
  return (chunk >> 3) * kBlockBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// Where an FP8 row's e4m3 chunk i (of the 14 nope chunks phase + 4i a thread owns) waits
// for its expansion: the front half or back half of the thread's own bf16 chunk
// phase + 4 (i / 2) in the tile. The expansion reads all 14 before it writes any bf16
// chunk, and no other thread touches these bytes, so staging in place needs no barrier.
__device__ __forceinline__ uint32_t staged_fp8_offset(int row, int phase, int i) {
  return chunk_offset(row, phase + 4 * (i >> 1)) + 8 * (i & 1);
}

// Index of row `row` of tile t in the concatenated [main | extra] list (-1 past the split).
__device__ __forceinline__ int row_index(const SparseSinkAttentionParams& p, int t, int key_begin, int key_end,
                                         int64_t bs, int row) {
  const int j = key_begin + t * BK + row;
  if (j >= key_end) return -1;
  return j < p.k_main ? p.main_idx[bs * p.k_main + j] : p.extra_idx[bs * p.k_extra + (j - p.k_main)];
}

// What a thread keeps of the row it issued: whether it is an FP8 row still to expand, and
// that row's 8 UE8M0 scale bytes.
struct IssuedRow {
  bool fp8;
  uint2 scale;
};

// This thread's share of tile t: 16 chunks of row `row` into the stage at `base` (its flag
// into `valid`), or zeros when the row is masked (so a zero probability never meets stale
// NaN bytes). An FP8 row's 14 nope chunks (8 bytes each) are staged in place
// (staged_fp8_offset; expand_fp8_row turns them into bf16 later).
template <bool kFp8>
__device__ __forceinline__ IssuedRow gather_tile_into(const SparseSinkAttentionParams& p, uint8_t* base,
                                                      uint8_t* valid, int t, int key_begin, int key_end, int row,
                                                      int phase, int idx) {
  const int j = key_begin + t * BK + row;
  const bool in_main = j < p.k_main;
  const int64_t n = in_main ? p.n_main : p.n_extra;
  const bool ok = j < key_end && idx >= 0 && idx < n;
  const bool f8 = kFp8 && ok && (in_main ? p.main_fp8 : p.extra_fp8) != 0;
  IssuedRow issued{f8, make_uint2(0u, 0u)};
  if (!ok) {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i)
      *reinterpret_cast<uint4*>(base + chunk_offset(row, phase + 4 * i)) = make_uint4(0, 0, 0, 0);
  } else if (!f8) {
    const uint8_t* src = static_cast<const uint8_t*>(in_main ? p.main_rows : p.extra_rows) + int64_t(idx) * (D * 2);
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = phase + 4 * i;
      cp_async_16(smem_addr(base + chunk_offset(row, chunk)), src + chunk * 16);
    }
  } else if constexpr (kFp8) {
    const uint8_t* nope = static_cast<const uint8_t*>(in_main ? p.main_rows : p.extra_rows) + int64_t(idx) * kAttnNopeDim;
    const uint8_t* rope =
        static_cast<const uint8_t*>(in_main ? p.main_rope : p.extra_rope) + int64_t(idx) * (2 * kAttnRopeDim);
#pragma unroll
    for (int i = 0; i < kNopeChunks / 4; ++i) {
      const int chunk = phase + 4 * i;
      cp_async_8(smem_addr(base + staged_fp8_offset(row, phase, i)), nope + chunk * 8);
    }
#pragma unroll
    for (int i = kNopeChunks / 4; i < kChunksPerThread; ++i) {
      const int chunk = phase + 4 * i;
      cp_async_16(smem_addr(base + chunk_offset(row, chunk)), rope + (chunk - kNopeChunks) * 16);
    }
    const uint8_t* scale_row = (in_main ? p.main_scale : p.extra_scale) + int64_t(idx) * kAttnScaleBytes;
    issued.scale = __ldg(reinterpret_cast<const uint2*>(scale_row));
  }
  if (phase == 0) valid[row] = ok ? 1 : 0;
  return issued;
}

// Tile t into its stage t % 2 of the kernels' layout.
template <bool kFp8>
__device__ __forceinline__ IssuedRow gather_tile(const SparseSinkAttentionParams& p, uint8_t* smem, int t,
                                                 int key_begin, int key_end, int row, int phase, int idx) {
  const int stage = t & 1;
  return gather_tile_into<kFp8>(p, smem + kOffKV + stage * kTileBytes, smem + kOffValid + stage * BK, t, key_begin,
                                key_end, row, phase, idx);
}

// A thread's nope chunk i (8 e4m3 values) as 8 bf16, scaled by its 64-dim block's UE8M0
// byte: chunk phase + 4i covers dims 8 (phase + 4i) .., block i / 2 since phase < 4.
__device__ __forceinline__ uint4 expanded_chunk(uint2 v, uint2 scale, int i) {
  const int block = i >> 1;
  const uint32_t byte = ((block < 4 ? scale.x : scale.y) >> (8 * (block & 3))) & 0xFFu;
  const float sc = ue8m0_scale(byte);
  return make_uint4(e4m3x2_to_bf16x2(v.x, sc), e4m3x2_to_bf16x2(v.x >> 16, sc), e4m3x2_to_bf16x2(v.y, sc),
                    e4m3x2_to_bf16x2(v.y >> 16, sc));
}

// The issuing thread's 14 nope chunks of its FP8 row, staged in place (e4m3) -> tile (bf16):
// all 14 into registers first, since expanding chunk i overwrites where chunks 2i, 2i + 1 wait.
__device__ __forceinline__ void expand_fp8_row(uint8_t* base, int row, int phase, uint2 scale) {
  uint2 staged[kNopeChunks / 4];
#pragma unroll
  for (int i = 0; i < kNopeChunks / 8; ++i) {
    const uint4 v = *reinterpret_cast<const uint4*>(base + chunk_offset(row, phase + 4 * i));
    staged[2 * i] = make_uint2(v.x, v.y);
    staged[2 * i + 1] = make_uint2(v.z, v.w);
  }
#pragma unroll
  for (int i = 0; i < kNopeChunks / 4; ++i)
    *reinterpret_cast<uint4*>(base + chunk_offset(row, phase + 4 * i)) = expanded_chunk(staged[i], scale, i);
}

// Where a CTA's time goes (timeline builds only; set_attention_timeline): thread 0 records
// clock64 at mark `slot` and, at the first and last, %globaltimer, its SM and tile count, so
// the host can line CTAs of one SM up and convert cycles to time. A no-op in other builds.
enum TimelineSlot {
  kTlStart,      // work item known
  kTlIssued,     // lockstep: Q and tile 0 issued (after the tile-0 index load)
  kTlFirstTile,  // Q and tile 0 landed (past the barrier)
  kTlLastTile,   // past the last tile's P V
  kTlStats,      // finish_rows: row sums swapped, lse known
  kTlStaged,     // output rows (or f32 partials) written to shared memory
  kTlStoring,    // past the barrier (or first cluster sync) before the stores / merge
  kTlEnd,        // finish_rows returned
};
#ifdef JAX_DSPARK_ATTENTION_TIMELINE
__device__ unsigned long long* g_timeline = nullptr;
__device__ int g_timeline_ctas = 0;
__device__ long long g_late_start_cycles = 0;  // set_persistent_late_start
#endif
__device__ __forceinline__ void timeline_mark([[maybe_unused]] TimelineSlot slot, [[maybe_unused]] int ntiles = 0) {
#ifdef JAX_DSPARK_ATTENTION_TIMELINE
  static_assert(kTlEnd + 5 == kAttnTimelineWords, "timeline record layout");
  if (threadIdx.x != 0 || g_timeline == nullptr) return;
  const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= g_timeline_ctas) return;
  unsigned long long* rec = g_timeline + int64_t(cta) * kAttnTimelineWords;
  rec[slot] = clock64();
  if (slot == kTlStart || slot == kTlEnd) {
    unsigned long long ns, sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    asm volatile("{ .reg .u32 s; mov.u32 s, %%smid; cvt.u64.u32 %0, s; }" : "=l"(sm));
    rec[slot == kTlStart ? kTlEnd + 1 : kTlEnd + 2] = ns;
    rec[kTlEnd + 3] = sm;
    rec[kTlEnd + 4] = ntiles;
  }
#endif
}

// The tile math both instantiations share. Fragment layout (m64nN accumulator, per thread):
// sc[4j + e] is head row 16w + g + 8 (e >> 1), key key0 + 8j + 2 q4 + (e & 1).

// Q K^T into the accumulator `d` (zeroed first): kSteps k16 steps over the column blocks from
// q_base / k_base (both operands in shared memory, 128-byte swizzle), `mma` the wgmma shape.
// Descriptors built once; step ks adds its constant offset to the start-address field
// (desc_advance). Built per step, each wgmma cost ~12 integer instructions and a move to a
// uniform register (SASS of 097f3dd: 420 of a full tile's ~1,000 instructions a warp).
template <int kSteps, int kRegs, class Mma>
__device__ __forceinline__ void s_product(float (&d)[kRegs], uint32_t q_base, uint32_t k_base, Mma mma) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) d[i] = 0.f;
  const uint64_t da0 = gmma_desc_sw128(q_base, 16, 1024);
  const uint64_t db0 = gmma_desc_sw128(k_base, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const uint32_t k_off = (ks >> 2) * kBlockBytes + (ks & 3) * 32;  // column block, k16 within it
    mma(d, desc_advance(da0, k_off), desc_advance(db0, k_off), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kRegs; ++i) reg_fence(d[i]);
}

// S = Q K^T over D for the warpgroup's 32 keys, whose rows start at k_base: 32 steps of
// k16, both operands from shared memory (a short tile: its first 16 keys only).
template <bool kShort>
__device__ __forceinline__ void s_tile(float (&sc)[16], uint32_t q_base, uint32_t k_base) {
  s_product<D / 16>(sc, q_base, k_base, [](float (&d)[16], uint64_t da, uint64_t db, int acc) {
    if constexpr (kShort)
      wgmma_m64n16k16_ss(d, da, db, acc);
    else
      wgmma_m64n32k16_ss(d, da, db, acc);
  });
}

// s_tile's result for a full tile, computed as two halves of D (where kSOverHalfD says):
// warpgroup c multiplies dims 256c .. 256c + 255 of Q by the same dims of all 64 keys
// (m64n64k16, 16 steps), hands its partner tid ^ 128 its partial sums of the partner's 32
// keys through kOffXS, and adds the partner's partial sums of its own. Why: wgmma with both
// operands in shared memory reads A again for every instruction, so m64n32k16 over all of D
// reads 3 KB a step for 16 cycles of tensor work (Q read twice a tile, 192 KB of operand
// reads for both warpgroups' S), m64n64k16 4 KB for 32 cycles (128 KB a tile), at the price
// of 32 KB of swap traffic and one more barrier of the warp pair. part[4j + e] is key
// 8j + 2 q4 + (e & 1); the warpgroup's own keys are j = 4c .. 4c + 3 (sc's layout).
__device__ __forceinline__ void s_tile_half_d(float (&sc)[16], uint8_t* smem, uint32_t q_base, uint32_t kv_base,
                                              int tid, int c) {
  float part[32];
  const uint32_t half = c * 4 * kBlockBytes;  // column blocks 4c .. 4c + 3
  s_product<D / 32>(part, q_base + half, kv_base + half, [](float (&d)[32], uint64_t da, uint64_t db, int acc) {
    wgmma_m64n64k16_ss(d, da, db, acc);
  });
  uint4* xs = reinterpret_cast<uint4*>(smem + kOffXS);  // [k][thread]: keys 8 (4c' + k) .. of the reader c'
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = c == 0 ? part[16 + 4 * k + e] : part[4 * k + e];
    xs[k * kThreads + tid] =
        make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
  }
  named_barrier_sync(1 + ((tid >> 5) & 3), 64);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint4 x = xs[k * kThreads + (tid ^ 128)];
    const float other[4] = {__uint_as_float(x.x), __uint_as_float(x.y), __uint_as_float(x.z), __uint_as_float(x.w)};
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[4 * k + e] = (c == 0 ? part[4 * k + e] : part[16 + 4 * k + e]) + other[e];
  }
}

// Scores to log2 units, masked keys to -inf (in place), and the maxima of this thread's two
// rows over the keys of its quad.
template <int kJ>
__device__ __forceinline__ void masked_row_max(float (&sc)[4 * kJ], const uint8_t* s_valid, int key0, int q4, float sl2,
                                               float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + 8 * j + 2 * q4 + (e & 1);
      const float x = s_valid[key] ? sc[4 * j + e] * sl2 : -INFINITY;
      sc[4 * j + e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
  }
}

// The offset after a tile whose row maxima are mx (log2 units): mu, the offset the tile's P
// uses (0 while a row has seen no key), and alpha = exp2(old offset - mu) for what came
// before. The offset moves only when a tile's max exceeds it by more than kRescaleSlack, so
// P = exp2(score - mu) <= 2^kRescaleSlack (bf16 and the f32 sums hold that exactly as well as
// values <= 1: the rounding is relative), and most tiles keep alpha = 1 and skip the O
// rescale, 128 multiplies a thread on the path from S to P V. Exact either way: O and the
// row sums always share the offset, which the epilogue's lse adds back.
constexpr float kRescaleSlack = 8.f;
__device__ __forceinline__ void advance_max(float (&m_run)[2], const float (&mx)[2], float (&mu)[2],
                                            float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float m_new = mx[i] > m_run[i] + kRescaleSlack ? mx[i] : m_run[i];  // -inf + slack is -inf
    mu[i] = m_new == -INFINITY ? 0.f : m_new;
    alpha[i] = exp2f(m_run[i] - mu[i]);
    m_run[i] = m_new;
  }
}

// rescale_rows for offsets that rarely move: the row sums always, O only when the offset of
// one of the warp's rows moved (alpha != 1; alpha 0 only before the first valid key, where O
// is still zero). The vote keeps the branch warp-uniform.
__device__ __forceinline__ void rescale_moved_rows(float (&o)[32][4], float (&l_run)[2], const float (&alpha)[2],
                                                   const float (&rs)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * alpha[i] + rs[i];
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) scale_rows(o, alpha);
}

// P = exp2(score - mu) as the A operand of O += P V: k16 step ks covers the accumulator
// blocks j = 2 ks (a0: row g, a1: row g + 8) and 2 ks + 1 (a2, a3); rs gets the row sums.
template <int kJ>
__device__ __forceinline__ void p_fragments(const float (&sc)[4 * kJ], const float (&mu)[2], uint32_t (&pa)[kJ / 2][4],
                                            float (&rs)[2]) {
  rs[0] = rs[1] = 0.f;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    float pv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pv[e] = exp2f(sc[4 * j + e] - mu[e >> 1]);
      rs[e >> 1] += pv[e];
    }
    pa[j >> 1][(j & 1) * 2] = pack_bf16x2(pv[0], pv[1]);
    pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16x2(pv[2], pv[3]);
  }
}

// O[:, 256c .. 256c + 255] += P V: kSteps k16 steps over the tile's keys, V columns of
// warpgroup c from v_base (the tile's column block 4c).
template <int kSteps>
__device__ __forceinline__ void pv_tile(float (&o)[32][4], const uint32_t (&pa)[4][4], uint32_t v_base) {
  const uint64_t dv0 = gmma_desc_sw128(v_base, kBlockBytes, 1024);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const uint64_t dv = desc_advance(dv0, ks * 16 * 128);
    wgmma_m64n256k16_rs_tb(o, pa[ks], dv, 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    reg_fence(o[n][0]);
    reg_fence(o[n][1]);
    reg_fence(o[n][2]);
    reg_fence(o[n][3]);
  }
}

// The rest of a tile once this warpgroup's S (its 32 keys, raw scores) is in `sc`: masking,
// the max swap with the partner warp, P, the P swap, the rescale and P V. The swap area
// (row maxima [2][64] floats, then P fragments [2][256] uint4) lies at smem + kOffSwap.
template <bool kShort, int kOffSwap>
__device__ __forceinline__ void softmax_pv(float (&o)[32][4], float (&m_run)[2], float (&l_run)[2], uint8_t* smem,
                                           float (&sc)[16], uint32_t kv_base, const uint8_t* s_valid, float sl2,
                                           int tid, int c) {
  const int w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  float mx[2], alpha[2], mu[2], rs[2];
  masked_row_max<4>(sc, s_valid, 32 * c, q4, sl2, mx);
  float* xrow = reinterpret_cast<float*>(smem + kOffSwap);  // [warpgroup][head row]
#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (q4 == 0) xrow[c * BM + 16 * w + g + 8 * i] = mx[i];
  named_barrier_sync(1 + w, 64);
#pragma unroll
  for (int i = 0; i < 2; ++i) mx[i] = fmaxf(mx[i], xrow[(1 - c) * BM + 16 * w + g + 8 * i]);
  advance_max(m_run, mx, mu, alpha);
  uint32_t pown[2][4];  // this half's P as two k16 A fragments (keys 32c + 16 kk ..)
  p_fragments<4>(sc, mu, pown, rs);
  uint4* xp = reinterpret_cast<uint4*>(smem + kOffSwap + 2 * BM * 4);  // [k16 step of the half][thread]
  xp[tid] = make_uint4(pown[0][0], pown[0][1], pown[0][2], pown[0][3]);
  xp[kThreads + tid] = make_uint4(pown[1][0], pown[1][1], pown[1][2], pown[1][3]);
  rescale_moved_rows(o, l_run, alpha, rs);
  named_barrier_sync(1 + w, 64);
  const uint4 q0 = xp[tid ^ 128], q1 = xp[kThreads + (tid ^ 128)];
  const uint32_t poth[2][4] = {{q0.x, q0.y, q0.z, q0.w}, {q1.x, q1.y, q1.z, q1.w}};
  // k-step ks covers keys 16 ks ..: warpgroup 0's half for ks < 2, warpgroup 1's after.
  uint32_t pa[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[ks][r] = ((ks >> 1) == c) ? pown[ks & 1][r] : poth[ks & 1][r];
  pv_tile<kShort ? 1 : BK / 16>(o, pa, kv_base + c * 4 * kBlockBytes);  // all 64 keys (a short tile: its first 16)
}

// One tile of the consumer warpgroups (thread tid < 256): S split between the warpgroups
// (warpgroup c: keys 32c .. 32c + 31 of the tile), no duplicated tensor work. The two warps
// that own heads 16w .. 16w + 15 (warp w of each warpgroup) swap row maxima, then P
// fragments, through shared memory under a named barrier of their 64 threads; thread tid's
// partner is tid ^ 128, which holds the same rows and key offsets of the other half. Both
// warpgroups then use the same running max, so O and the row sums rescale alike; the sums
// stay per half until the epilogue. A short tile (at most 16 rows of the list: the last one
// of a DSpark block's 133 rows, say) computes S for keys 0 .. 15 in warpgroup 0 only (warpgroup
// 1's keys are all masked) and one k16 step of P V. Exact: the other columns are masked
// (probability 0) and their V rows zero-filled, so they would only add +0. Two instantiations
// rather than branches inside one: ptxas serialises every wgmma of a kernel whose pipeline
// stages contain a branch (the branch on c below holds a whole wgmma group, issue to wait,
// and compiles without that: no C7511, registers unchanged). Skipping warpgroup 1's S (which
// also read Q from shared memory beside warpgroup 0's) made the DSpark blocks 1.5-2% faster
// on an H100 (docs/kernels.md, "Short tiles: one warpgroup's S").
template <bool kShort, bool kHalfD>
__device__ __forceinline__ void consume_tile(float (&o)[32][4], float (&m_run)[2], float (&l_run)[2], uint8_t* smem,
                                             uint32_t q_base, uint32_t kv_base, const uint8_t* s_valid, float sl2,
                                             int tid, int c) {
  float sc[16];
  if constexpr (kHalfD && !kShort) {
    s_tile_half_d(sc, smem, q_base, kv_base, tid, c);
  } else if constexpr (kShort) {
    if (c == 0) {
      s_tile<true>(sc, q_base, kv_base);
    } else {  // warpgroup 1's keys (32 ..) are past a short tile and masked; zeros keep sc defined
#pragma unroll
      for (int i = 0; i < 16; ++i) sc[i] = 0.f;
    }
  } else {
    s_tile<false>(sc, q_base, kv_base + c * 32 * 128);  // row 32c of every column block (1024-aligned)
  }
  softmax_pv<kShort, kOffXRow>(o, m_run, l_run, smem, sc, kv_base, s_valid, sl2, tid, c);
}

// A thread's running state before the first tile: O zero, running max -inf (log2 units),
// its share of the row sums zero.
__device__ __forceinline__ void init_rows(float (&o)[32][4], float (&m_run)[2], float (&l_run)[2]) {
#pragma unroll
  for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  m_run[0] = m_run[1] = -INFINITY;
  l_run[0] = l_run[1] = 0.f;
}

// Which kernels compute a full tile's S over half of D a warpgroup (s_tile_half_d) rather than
// over all of D for half of the keys (s_tile): all but the bf16 warp-specialised one. On an
// H100 (2026-12-07, CUDA events, docs/kernels.md "S over half of D") that moved the lockstep
// cases and the FP8 warp-specialised ones by 0 to -2% and V4-Pro HCA bf16, the one bf16
// warp-specialised case, by +2.4%.
template <bool kFp8, bool kWarpSpecialised>
constexpr bool kSOverHalfD = kFp8 || !kWarpSpecialised;

// The tile in `stage`, of which `tile_rows` rows are in the list: the short instantiation
// when at most 16 are. c = warpgroup_of(tid), taken once before the tile loop: a value the
// compiler knows is warp-uniform keeps the descriptors in uniform registers (the shuffle
// inside the loop cost dense 16k 1% on the H100).
template <bool kHalfD>
__device__ __forceinline__ void consume_rows_at(float (&o)[32][4], float (&m_run)[2], float (&l_run)[2], uint8_t* smem,
                                                uint32_t q_base, uint32_t kv_base, const uint8_t* s_valid, int tile_rows,
                                                float sl2, int tid, int c) {
  if (tile_rows <= 16)
    consume_tile<true, kHalfD>(o, m_run, l_run, smem, q_base, kv_base, s_valid, sl2, tid, c);
  else
    consume_tile<false, kHalfD>(o, m_run, l_run, smem, q_base, kv_base, s_valid, sl2, tid, c);
}

template <bool kHalfD>
__device__ __forceinline__ void consume_stage(float (&o)[32][4], float (&m_run)[2], float (&l_run)[2], uint8_t* smem,
                                              uint32_t q_base, int stage, int tile_rows, float sl2, int tid, int c) {
  consume_rows_at<kHalfD>(o, m_run, l_run, smem, q_base, smem_addr(smem + kOffKV + stage * kTileBytes),
                          smem + kOffValid + stage * BK, tile_rows, sl2, tid, c);
}

// A thread's two rows at the end: lse (natural log, sink excluded) and 1 / row sum, from
// the quad sums plus the other half's (through the swap area).
struct RowStats {
  float lse[2], inv[2];
};

template <int kOffSwap = kOffXRow>
__device__ __forceinline__ RowStats row_stats(uint8_t* smem, const float (&m_run)[2], const float (&l_run)[2],
                                              int tid) {
  const int c = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  float lsum[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    lsum[i] = l_run[i];
    lsum[i] += __shfl_xor_sync(0xffffffffu, lsum[i], 1);
    lsum[i] += __shfl_xor_sync(0xffffffffu, lsum[i], 2);
  }
  {
    float* xrow = reinterpret_cast<float*>(smem + kOffSwap);
    if (q4 == 0) {
      xrow[c * BM + 16 * w + g] = lsum[0];
      xrow[c * BM + 16 * w + g + 8] = lsum[1];
    }
    named_barrier_sync(1 + w, 64);
    lsum[0] += xrow[(1 - c) * BM + 16 * w + g];
    lsum[1] += xrow[(1 - c) * BM + 16 * w + g + 8];
  }
  RowStats r;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float l = lsum[i];
    r.lse[i] = (m_run[i] == -INFINITY || !(l > 0.f)) ? -INFINITY : (m_run[i] + log2f(l)) * kLn2;
    r.inv[i] = l > 0.f ? 1.f / l : 0.f;
  }
  return r;
}

// Epilogue of the two compute warpgroups (each holds its half of D of every row; warpgroup 0
// stores the lse). The rows go through shared memory (Q's region and both tile stages, free
// once every compute warp is past its last P V) and out: whole bf16 rows by one bulk copy a
// row, split f32 partials in 16-byte stores, a warp writing 512 contiguous bytes of one row
// (or merged in the cluster). Storing straight from the accumulator layout took 64 four-byte
// stores a thread, each instruction touching 8 rows 1 KB apart: the short launches were bound
// by those (ncu of the DSpark block: LG throttle); staged, the DSpark block took 50.2 instead
// of 56.3 us on the H200 (docs/kernels.md, "Staged output stores"). Staged rows are padded
// (bf16 1040 bytes, f32 2080) so the accumulator-layout writes hit 32 distinct banks. Only
// the 256 compute threads take part (kEpilogueBar): the warp-specialised kernel's producers
// have returned by then, their last copies landed before the last tile was announced.
constexpr int kStageRowBf16 = D * 2 + 16;

// Experiment (kernel_driver builds with -DJAX_DSPARK_ATTENTION_SPREAD_STORES; off in the
// library): the 64 bulk copies of a whole-row epilogue issued by lanes 0..7 of every compute
// warp instead of all lanes of the first two, in case a warp's bulk-copy instruction is issued
// lane by lane and those two warps hold up the persistent kernels' next item (docs/kernels.md,
// "The H100 bench of d3be25c"). spread_store_row: the row thread `tid` copies, or -1.
#ifdef JAX_DSPARK_ATTENTION_SPREAD_STORES
constexpr bool kSpreadStores = true;
#else
constexpr bool kSpreadStores = false;
#endif
__device__ __forceinline__ int spread_store_row(int tid) { return (tid & 31) < 8 ? ((tid >> 5) << 3) + (tid & 31) : -1; }
// Whether thread `tid` issues one of those copies for the item at heads h0 .. (the persistent
// kernels wait for its reads before they reuse the region).
__device__ __forceinline__ bool spread_store_issued(int tid, int h0, int heads) {
  const int sr = spread_store_row(tid);
  return sr >= 0 && h0 + sr < heads;
}
// Experiment (kernel_driver builds with -DJAX_DSPARK_ATTENTION_ROPE_SPLIT_STAGING; off in the
// library): the whole-row staging with inverse RoPE, for the models' 64 RoPE dims, as two
// straight-line blocks (warpgroup 0: no RoPE dim; warpgroup 1: pairs n >= 24 rotated) instead
// of a test and branch on every one of the 32 pairs. The branchy loop is 831 instructions of the
// bf16 persistent warp-specialised kernel's SASS (cuobjdump of 2799f2e), about 550 executed by
// each compute warp, two such warps a scheduler: some 0.6 us of issue per item against 0.33 for
// the straight-line blocks (docs/kernels.md, "No machine lent").
#ifdef JAX_DSPARK_ATTENTION_ROPE_SPLIT_STAGING
constexpr bool kRopeSplitStaging = true;
#else
constexpr bool kRopeSplitStaging = false;
#endif
constexpr int kRopeSplitFirstPair = (D - 64 - 256) / 8;  // warpgroup 1's first rotated pair (24)
static_assert(256 + 8 * kRopeSplitFirstPair == D - 64, "warpgroup 1 holds dims 256 .., the last 64 are RoPE dims");
constexpr int kStageRowF32 = D * 4 + 32;
constexpr int kEpilogueBar = 9;  // named barrier of the compute threads; 1..8 are the swap, full and empty ones
static_assert(D * 4 == 1 << 11, "finish_rows's f32 row shift");
static_assert(BM * kStageRowF32 <= kOffValid, "staged f32 rows fit Q's region and both tile stages");

// Row i (0 or 1) of this thread's accumulator rows, normalised by `inv`, into a staged f32
// row at `dst` (its dims dim_first + 8 n, + 1).
__device__ __forceinline__ void stage_f32_row(uint8_t* dst, const float (&o)[32][4], int i, float inv, int dim_first) {
#pragma unroll
  for (int n = 0; n < 32; ++n)
    *reinterpret_cast<float2*>(dst + (dim_first + 8 * n) * 4) = make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
}

// The cluster merge of finish_rows<true>: CTA `rank` of the n split CTAs merges rows rank,
// rank + n, ... (at most 32), eight threads a row; thread t takes row rank + n (t / 8) and its
// 16-byte chunks t % 8 + 8 i (dims 4 (t % 8 + 8 i) .. + 3, so a warp's read of chunk i is 128
// contiguous bytes of each of its four rows: no bank conflict at the 2080-byte pitch). Each
// group of kMergeChunks chunks is read from two splits at once, so with two splits a thread
// waits on nine distributed-shared-memory round trips: the lse values, then eight groups.
// (Larger groups, or the group loop unrolled, made ptxas spill 208 bytes in the FP8
// warp-specialised cluster kernel's producers, whose region has 112 registers.) The first
// version (one warp a row through combine_row: the lse values, then each split in turn, then
// the sink and the (cos, sin) pairs from global memory, four rows a warp one after another)
// took 7.3 us of CSA decode's 29 us a CTA (H100 timeline). The arithmetic is combine_row's: weights
// exp(lse_sp - max) / sum, splits added in order, then the sink factor and the inverse RoPE;
// `sink` and `cs` point at load_epilogue_constants's copies (null when absent).
constexpr int kMergeChunks = 2;  // 16-byte chunks a thread reads from each split at once
__device__ __forceinline__ void merge_cluster_rows(const SparseSinkAttentionParams& p, uint32_t rows_base,
                                                   uint32_t lse_base, const float* sink, const float2* cs, int64_t bs,
                                                   int h0, int tid) {
  const int n = p.num_splits, rank = int(cluster_ctarank());
  const int lr = rank + n * (tid >> 3), part = tid & 7;
  if (lr >= BM || h0 + lr >= p.heads) return;
  float l_sp[kMaxClusterSplits];
  float mx = -INFINITY;
#pragma unroll
  for (int sp = 0; sp < kMaxClusterSplits; ++sp) {
    l_sp[sp] = sp < n ? ld_cluster_f32(cluster_map(lse_base + lr * 4, sp)) : -INFINITY;
    mx = fmaxf(mx, l_sp[sp]);
  }
  float w[kMaxClusterSplits], sum = 0.f;
#pragma unroll
  for (int sp = 0; sp < kMaxClusterSplits; ++sp) {
    w[sp] = mx == -INFINITY ? 0.f : __expf(l_sp[sp] - mx);
    sum += w[sp];
  }
  const float lse = mx == -INFINITY ? -INFINITY : mx + __logf(sum);
  const float f = sink_factor(sink, lr, lse);
  const int rope_lo = D - p.rope_dim;
  const int64_t row = bs * p.heads + h0 + lr;
  __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(p.out) + row * D;
#pragma unroll 1
  for (int g = 0; g < 16 / kMergeChunks; ++g) {
    float a[kMergeChunks][4] = {};
#pragma unroll
    for (int sp0 = 0; sp0 < kMaxClusterSplits; sp0 += 2) {  // two splits' chunks in flight at once (n = 2: all)
      if (sp0 >= n) break;
      float4 v[2][kMergeChunks];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int k = 0; k < kMergeChunks; ++k)
          if (sp0 + j < n)
            v[j][k] = ld_cluster_f32x4(
                cluster_map(rows_base + lr * kStageRowF32 + (part + 8 * (kMergeChunks * g + k)) * 16, sp0 + j));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float wj = sp0 + j < n ? w[sp0 + j] : 0.f;
        if (wj == 0.f) continue;
        const float ws = wj / sum;
#pragma unroll
        for (int k = 0; k < kMergeChunks; ++k) {
          a[k][0] += ws * v[j][k].x;
          a[k][1] += ws * v[j][k].y;
          a[k][2] += ws * v[j][k].z;
          a[k][3] += ws * v[j][k].w;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kMergeChunks; ++k) {
      const int dim = 4 * (part + 8 * (kMergeChunks * g + k));
      *reinterpret_cast<uint2*>(out_row + dim) = make_uint2(output_pair(a[k][0] * f, a[k][1] * f, cs, dim, rope_lo),
                                                            output_pair(a[k][2] * f, a[k][3] * f, cs, dim + 2, rope_lo));
    }
  }
  if (part == 0) p.lse[row] = lse;
}

// kCluster: the num_splits (2..8) CTAs of a work item form one thread-block cluster and merge
// their partials through distributed shared memory (use_cluster_merge says when): each stages
// its normalised f32 rows and their lse (in the P swap area), the cluster syncs, CTA `rank`'s
// threads merge rows rank, rank + n, ... of the 64 over all splits (merge_cluster_rows,
// reading the other CTAs' shared memory) and store them, and the cluster syncs again so that no CTA exits
// while its rows are still read. Otherwise split partials go to global memory (f32, 2 KB a
// row and split) for the combine launch to read back: CSA decode at 2 splits writes 16 MB
// and reads it again, which the cluster merge saves (-12% on the H100, docs/kernels.md).
// kPersistent (one split only): the rows are staged at `rows_base` (a 64 KB region; row 63,
// which does not fit it at the padded pitch, at kOffLastRow), the hook runs once every
// compute warp is past its last S and P V (the persistent kernel issues the next item's tile
// 0 there), and the bulk copies are committed without waiting: the caller waits for their
// reads (bulk_wait_read) before it reuses the region.
struct NoHook {
  __device__ void operator()() const {}
};
template <bool kCluster, bool kPersistent = false, class Hook = NoHook>
__device__ __forceinline__ void finish_rows(const SparseSinkAttentionParams& p, uint8_t* smem, const float (&o)[32][4],
                                            const float (&m_run)[2], const float (&l_run)[2], int64_t bs, int h0,
                                            int split, int tid, uint8_t* rows_base = nullptr, Hook hook = Hook{}) {
  const int c = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const RowStats r = row_stats(smem, m_run, l_run, tid);
  timeline_mark(kTlStats);
  const int64_t rows = int64_t(p.batch) * p.seq * p.heads;
  const int dim_first = 256 * c + 2 * q4, rope_lo = D - p.rope_dim;
  float* lse_rows = reinterpret_cast<float*>(smem + kOffXP);  // kCluster: this CTA's partial lse
  // load_epilogue_constants's copies (null where the call has no sink / no inverse RoPE)
  const float* sink = p.sink == nullptr ? nullptr : reinterpret_cast<const float*>(smem + kOffSink);
  const float2* cs_row = p.inv_rope == nullptr ? nullptr : reinterpret_cast<const float2*>(smem + kOffCs);
  named_barrier_sync(kEpilogueBar, kThreads);  // every compute warp past its last S and P V
  hook();
  if (!kCluster && (kPersistent || p.num_splits == 1)) {
    // Whole rows: bf16 (sink applied, RoPE dims rotated back when asked) into the staged rows,
    // both of the thread's rows in one pass over its 32 dim pairs, the RoPE test hoisted out of
    // the calls without inverse RoPE. With a test and a branch in each of the 64 pair stores
    // this straight-line code (run once a CTA) was 2,100 instructions, and the short launches
    // stalled fetching it (ncu, DSpark block: "no instruction" on ~10% of the samples).
    const int lr0 = 16 * w + g;  // the thread's rows lr0 and lr0 + 8
    float f[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int h = h0 + lr0 + 8 * i;
      f[i] = h < p.heads ? r.inv[i] * sink_factor(sink, lr0 + 8 * i, r.lse[i]) : 0.f;
    }
    auto staged_row = [&](int lr) -> uint8_t* {
      if constexpr (kPersistent)
        return lr == BM - 1 ? smem + kOffLastRow : rows_base + lr * kStageRowBf16;
      else
        return smem + lr * kStageRowBf16;
    };
    uint8_t* dst = staged_row(lr0);
    uint8_t* dst8 = kPersistent ? staged_row(lr0 + 8) : dst + 8 * kStageRowBf16;
    if (p.inv_rope == nullptr) {
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int dim = dim_first + 8 * n;
        *reinterpret_cast<uint32_t*>(dst + dim * 2) = pack_bf16x2(o[n][0] * f[0], o[n][1] * f[0]);
        *reinterpret_cast<uint32_t*>(dst8 + dim * 2) = pack_bf16x2(o[n][2] * f[1], o[n][3] * f[1]);
      }
    } else if (kRopeSplitStaging && rope_lo == D - 64) {
      // pair n of warpgroup 1 is dim 256 + 2 q4 + 8 n: rotated from n = 24 on, with (cos, sin)
      // pair q4 + 4 (n - 24); warpgroup 0's dims are all below 448.
      auto stage_pair = [&](int n, bool rotate) {
        const int dim = dim_first + 8 * n;
        float a0 = o[n][0] * f[0], a1 = o[n][1] * f[0], b0 = o[n][2] * f[1], b1 = o[n][3] * f[1];
        if (rotate) {
          const float2 cs = cs_row[q4 + 4 * (n - kRopeSplitFirstPair)];
          inverse_rope_pair(a0, a1, cs);
          inverse_rope_pair(b0, b1, cs);
        }
        *reinterpret_cast<uint32_t*>(dst + dim * 2) = pack_bf16x2(a0, a1);
        *reinterpret_cast<uint32_t*>(dst8 + dim * 2) = pack_bf16x2(b0, b1);
      };
      if (c == 0) {
#pragma unroll
        for (int n = 0; n < 32; ++n) stage_pair(n, false);
      } else {
#pragma unroll
        for (int n = 0; n < 32; ++n) stage_pair(n, n >= kRopeSplitFirstPair);
      }
    } else {  // one (cos, sin) load a pair for both rows: they belong to the same query row bs
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int dim = dim_first + 8 * n;
        float a0 = o[n][0] * f[0], a1 = o[n][1] * f[0], b0 = o[n][2] * f[1], b1 = o[n][3] * f[1];
        if (dim >= rope_lo) {
          const float2 cs = cs_row[(dim - rope_lo) / 2];  // shared memory
          inverse_rope_pair(a0, a1, cs);
          inverse_rope_pair(b0, b1, cs);
        }
        *reinterpret_cast<uint32_t*>(dst + dim * 2) = pack_bf16x2(a0, a1);
        *reinterpret_cast<uint32_t*>(dst8 + dim * 2) = pack_bf16x2(b0, b1);
      }
    }
    if (c == 0 && q4 == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int h = h0 + lr0 + 8 * i;
        if (h < p.heads) p.lse[bs * p.heads + h] = r.lse[i];
      }
    }
    // Out: one bulk copy a row (1 KB), issued by the first two warps, a lane a row. Each
    // issuing lane waits only until its row has been read out of shared memory (the CTA may
    // exit then); the other warps leave at once, instead of 16 stores a thread and their drain.
    fence_proxy_async_smem();  // the staged rows, before the bulk copies read them
    timeline_mark(kTlStaged);
    named_barrier_sync(kEpilogueBar, kThreads);
    timeline_mark(kTlStoring);
    auto store_row = [&](int lr) {
      bulk_copy_s2g(static_cast<uint8_t*>(p.out) + (bs * p.heads + h0 + lr) * (D * 2), staged_row(lr), D * 2);
      if constexpr (kPersistent)
        bulk_commit();
      else
        bulk_commit_and_wait_read();
    };
    if constexpr (kSpreadStores) {
      if (spread_store_issued(tid, h0, p.heads)) store_row(spread_store_row(tid));
    } else if (tid < BM && h0 + tid < p.heads) {
      store_row(tid);
    }
    return;
  }
  if constexpr (!kPersistent) {  // (the persistent kernel has one split: whole rows only)
    // Split partials: normalised f32 rows (the combine applies the sink and inverse RoPE).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int lr = 16 * w + g + 8 * i, h = h0 + lr;
      if (h >= p.heads) continue;
      stage_f32_row(smem + lr * kStageRowF32, o, i, r.inv[i], dim_first);
      if (c == 0 && q4 == 0) {
        if constexpr (kCluster)
          lse_rows[lr] = r.lse[i];
        else
          p.partial_lse[int64_t(split) * rows + bs * p.heads + h] = r.lse[i];
      }
    }
    timeline_mark(kTlStaged);
    if constexpr (kCluster) {  // launched with 2..kMaxClusterSplits splits only (launch_attention)
      cluster_sync();
      timeline_mark(kTlStoring);
      merge_cluster_rows(p, smem_addr(smem), smem_addr(lse_rows), sink, cs_row, bs, h0, tid);
      cluster_sync();
      return;
    }
    // Out: 16-byte chunks of the staged f32 rows, consecutive threads along a row. (One bulk
    // copy a row, as for whole rows, made dense 16k 28% slower on the H100: 64 issuing lanes
    // for 128 KB a CTA against 256 threads' stores.)
    named_barrier_sync(kEpilogueBar, kThreads);
    timeline_mark(kTlStoring);
    uint8_t* out = reinterpret_cast<uint8_t*>(p.partial_out + int64_t(split) * rows * D);
    for (int k = tid; k < (BM << 7); k += kThreads) {
      const int lr = k >> 7, ch = k & 127, h = h0 + lr;
      if (h < p.heads)
        *reinterpret_cast<uint4*>(out + ((bs * p.heads + h) << 11) + ch * 16) =
            *reinterpret_cast<const uint4*>(smem + lr * kStageRowF32 + ch * 16);
    }
  }
}

// The epilogue's per-CTA constants into shared memory (kOffSink, kOffCs) while the tiles
// run: read in finish_rows, they cost a global round trip or two after the last tile (the
// timeline of the DSpark block on an H100: 2.4 us from lse to staged rows with them, 0.85
// without inverse RoPE; the cluster merge of CSA decode 7.3 us for its 32 rows a CTA).
// Plain loads: the thread waits for them at its shared store, inside the wait for tile 0.
// Visible to the epilogue after the first tile's barrier (or the one the caller adds when
// the CTA has no tile).
__device__ __forceinline__ void load_epilogue_constants(const SparseSinkAttentionParams& p, uint8_t* smem, int64_t bs,
                                                        int h0, int tid) {
  if (p.sink != nullptr && tid < BM)
    reinterpret_cast<float*>(smem + kOffSink)[tid] = h0 + tid < p.heads ? p.sink[h0 + tid] : 0.f;
  if (p.inv_rope != nullptr && tid < p.rope_dim / 2)
    reinterpret_cast<float2*>(smem + kOffCs)[tid] = inv_rope_row(p, bs)[tid];
}

#ifdef JAX_DSPARK_ATTENTION_ASYNC_CONSTANTS
// Experiment (kernel_driver builds with -DJAX_DSPARK_ATTENTION_ASYNC_CONSTANTS): the same
// constants by cp.async (the caller commits, and waits before finish_rows's first barrier),
// so the persistent warp-specialised consumers do not wait for them at each item's start.
__device__ __forceinline__ void issue_epilogue_constants(const SparseSinkAttentionParams& p, uint8_t* smem,
                                                         int64_t bs, int h0, int tid) {
  if (p.sink != nullptr && tid < BM) {
    if (h0 + tid < p.heads)
      cp_async_4(smem_addr(smem + kOffSink) + 4 * tid, p.sink + h0 + tid);
    else
      reinterpret_cast<float*>(smem + kOffSink)[tid] = 0.f;
  }
  if (p.inv_rope != nullptr && tid < p.rope_dim / 2)
    cp_async_8(smem_addr(smem + kOffCs) + 8 * tid, inv_rope_row(p, bs) + tid);
}
#endif

// This thread's share of the Q block (heads h0 .. h0 + 63 of query row bs) into `dst` in the
// tile layout, by cp.async (the caller commits); absent heads as zeros (their rows of O are
// never stored).
__device__ __forceinline__ void issue_q_block(const SparseSinkAttentionParams& p, uint8_t* dst, int64_t bs, int h0,
                                              int row, int phase) {
  const int h = h0 + row;
  const uint8_t* src = static_cast<const uint8_t*>(p.q) + (bs * p.heads + h) * int64_t(D * 2);
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int chunk = phase + 4 * i;
    uint8_t* at = dst + chunk_offset(row, chunk);
    if (h < p.heads)
      cp_async_16(smem_addr(at), src + chunk * 16);
    else
      *reinterpret_cast<uint4*>(at) = make_uint4(0, 0, 0, 0);
  }
}

// kMathOnly (diagnostic builds only, JAX_DSPARK_ATTENTION_PROBES): tiles 0 and 1 are gathered
// as usual, later tiles are not (their stages keep tiles 0 and 1), so the kernel times the
// compute chain without the memory behind it. Results are meaningless then.
template <bool kFp8, bool kMathOnly = false, bool kCluster = false>
__global__ void __launch_bounds__(kThreads, 1) sparse_sink_attention_wgmma_kernel(const SparseSinkAttentionParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  if (smem_addr(smem) & 1023) __trap();  // the swizzled operand atoms need 1024-byte alignment
  const AttnWorkItem item = attn_work_item(p);
  const int h0 = item.h0, split = item.split, key_begin = item.key_begin, key_end = item.key_end;
  const int ntiles = item.ntiles;
  const int64_t bs = item.bs;
  timeline_mark(kTlStart, ntiles);

  const int tid = threadIdx.x;
  const int row = tid >> 2;    // gather: row of the tile / head of the Q block
  const int phase = tid & 3;   // gather: chunks phase, phase + 4, ...

  // Q block (absent heads as zeros) and tile 0: cp.async group 0. (Tile 0's index load
  // before the Q copies, as the warp-specialised producers do it: CSA decode +9%, V4-Pro
  // DSpark block -3% on the H100, docs/kernels.md; not taken.)
  issue_q_block(p, smem + kOffQ, bs, h0, row, phase);
  int next_idx = -1;
  IssuedRow in_flight{false, make_uint2(0u, 0u)};
  if (ntiles > 0)
    in_flight = gather_tile<kFp8>(p, smem, 0, key_begin, key_end, row, phase, row_index(p, 0, key_begin, key_end, bs, row));
  cp_async_commit();
  timeline_mark(kTlIssued);
  if (ntiles > 1) next_idx = row_index(p, 1, key_begin, key_end, bs, row);
  load_epilogue_constants(p, smem, bs, h0, tid);

  float o[32][4], m_run[2], l_run[2];
  init_rows(o, m_run, l_run);
  const float sl2 = p.scale * kLog2e;
  const uint32_t q_base = smem_addr(smem + kOffQ);
  const int wg = warpgroup_of(tid);

  for (int t = 0; t < ntiles; ++t) {
    const int stage = t & 1;
    // One CTA barrier per tile. Before it: this thread's copies of tile t (the only group in
    // flight) have landed and its FP8 row is expanded. After it: every warp is past tile
    // t - 1's math (its wgmmas waited for, its swap-area reads done), so tile t + 1 may be
    // gathered into the other stage while tile t is computed.
    cp_async_wait<0>();
    if constexpr (kFp8) {
      if (in_flight.fp8) expand_fp8_row(smem + kOffKV + stage * kTileBytes, row, phase, in_flight.scale);
    }
    fence_proxy_async_smem();  // its plain and cp.async stores, before wgmma reads them
    __syncthreads();
    if (t == 0) timeline_mark(kTlFirstTile, ntiles);
    in_flight = IssuedRow{false, make_uint2(0u, 0u)};
    if (t + 1 < ntiles && (!kMathOnly || t + 1 < 2)) {
      in_flight = gather_tile<kFp8>(p, smem, t + 1, key_begin, key_end, row, phase, next_idx);
      if (t + 2 < ntiles) next_idx = row_index(p, t + 2, key_begin, key_end, bs, row);
    }
    cp_async_commit();

    consume_stage<kSOverHalfD<kFp8, false>>(o, m_run, l_run, smem, q_base, stage,
                                            min(BK, key_end - (key_begin + t * BK)), sl2, tid, wg);
  }
  cp_async_wait<0>();  // nothing may be in flight at exit (Q when ntiles == 0)
  if (ntiles == 0) __syncthreads();  // load_epilogue_constants's stores, before finish_rows reads them
  timeline_mark(kTlLastTile, ntiles);

  finish_rows<kCluster>(p, smem, o, m_run, l_run, bs, h0, split, tid);
  timeline_mark(kTlEnd, ntiles);
}



// ---- Persistent lockstep CTAs (one split; kernel_driver --wgmma-persistent) ----------
// The timelines (docs/kernels.md, "Per-CTA timelines") show a short-list CTA spending half its
// time or more before its first tile (Q and tile 0, every SM of a wave loading at once) and
// after its last (staging and the bulk stores), with the memory idle while the SMs compute.
// Here min(items, SMs) CTAs walk the work items (item = blockIdx.x + k gridDim.x, in grid
// order) and overlap the next item's loads with the end of the current one. Shared memory is
// three 64 KB regions (region 0 is Q's region of the other kernels, 1 and 2 their tile
// stages) whose roles rotate: item i has Q in rq and its tiles alternately in ra and rb. At
// its last tile's barrier the idle tile region y takes item i + 1's Q; once every warp is
// past the last P V (finish_rows's hook), the last tile's region x takes item i + 1's tile 0;
// the output rows are staged in rq (Q is read by S only) and leave by bulk copies that the
// CTA does not wait for. Item i + 1 then has Q in y, tiles in x and rq, and the issuing lanes
// wait for the bulk reads of rq before item i + 1's first barrier, after which rq may be
// written. A list of no tiles takes ra for the next tile 0 and rb for the next Q.
__device__ __forceinline__ uint8_t* region_of(uint8_t* smem, int r) { return smem + r * kTileBytes; }
__device__ __forceinline__ uint8_t* region_valid(uint8_t* smem, int r) {
  return smem + (r == 0 ? kOffValidR0 : kOffValid + (r - 1) * BK);
}

// Work item i of a persistent one-split launch: attn_work_item of grid position
// (i % x_items, 0, i / x_items), x_items = head blocks x query rows. (Written out rather than
// generalising attn_work_item, which changed ptxas's allocation in the other kernels.)
__device__ __forceinline__ AttnWorkItem persistent_item(const SparseSinkAttentionParams& p, int x_items, int i) {
  AttnWorkItem w;
  const int x = i % x_items, nhb = (p.heads + BM - 1) / BM;
  w.h0 = (x % nhb) * BM;
  w.bs = int64_t(i / x_items) * p.seq + x / nhb;
  w.split = 0;
  w.key_begin = 0;
  w.key_end = p.k_main + p.k_extra;
  w.ntiles = (w.key_end + BK - 1) / BK;
  return w;
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_sink_attention_wgmma_persistent_kernel(const SparseSinkAttentionParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  if (smem_addr(smem) & 1023) __trap();  // the swizzled operand atoms need 1024-byte alignment
  const int x_items = (p.heads + BM - 1) / BM * p.seq, items = x_items * p.batch;
  const int tid = threadIdx.x, row = tid >> 2, phase = tid & 3;
  const float sl2 = p.scale * kLog2e;
  const int wg = warpgroup_of(tid);
  auto item_at = [&](int i) { return persistent_item(p, x_items, i); };
  auto tile0_index = [&](const AttnWorkItem& w) {
    return w.ntiles > 0 ? row_index(p, 0, w.key_begin, w.key_end, w.bs, row) : -1;
  };

#ifdef JAX_DSPARK_ATTENTION_TIMELINE
  // Experiment (timeline builds): the CTAs with one item fewer than the others start late, so
  // that their loads do not arrive in the same burst as everyone else's.
  if (g_late_start_cycles > 0 && items % int(gridDim.x) != 0 && int(blockIdx.x) >= items % int(gridDim.x)) {
    const long long t0 = clock64();
    while (clock64() - t0 < g_late_start_cycles) {
    }
  }
#endif
  int item = blockIdx.x;
  AttnWorkItem w = item_at(item);
  int rq = 0, ra = 1, rb = 2;
  issue_q_block(p, region_of(smem, rq), w.bs, w.h0, row, phase);
  IssuedRow in_flight{false, make_uint2(0u, 0u)};
  if (w.ntiles > 0)
    in_flight = gather_tile_into<kFp8>(p, region_of(smem, ra), region_valid(smem, ra), 0, w.key_begin, w.key_end, row,
                                       phase, tile0_index(w));
  cp_async_commit();
  bool bulk_pending = false;  // this thread's bulk copies of the previous item's rows, reads not yet waited for

  for (;;) {  // (timeline builds: each item's marks overwrite the last, so a CTA's record is of its last item)
    const int ntiles = w.ntiles, next = item + int(gridDim.x);
    const bool has_next = next < items;
    timeline_mark(kTlStart, ntiles);
    const AttnWorkItem wn = item_at(has_next ? next : item);
    const int next_idx0 = has_next ? tile0_index(wn) : -1;
    int next_idx = ntiles > 1 ? row_index(p, 1, w.key_begin, w.key_end, w.bs, row) : -1;
    load_epilogue_constants(p, smem, w.bs, w.h0, tid);
    if (bulk_pending) bulk_wait_read();  // rb held the previous item's staged rows
    bulk_pending = false;

    float o[32][4], m_run[2], l_run[2];
    init_rows(o, m_run, l_run);
    const uint32_t q_base = smem_addr(region_of(smem, rq));
    int x = ra, y = rb;
    for (int t = 0; t < ntiles; ++t) {
      const int r = (t & 1) ? rb : ra, other = (t & 1) ? ra : rb;
      cp_async_wait<0>();
      if constexpr (kFp8) {
        if (in_flight.fp8) expand_fp8_row(region_of(smem, r), row, phase, in_flight.scale);
      }
      fence_proxy_async_smem();
      __syncthreads();  // tile t landed everywhere; every warp past tile t - 1 (and the bulk reads of rb waited for)
      if (t == 0) timeline_mark(kTlFirstTile, ntiles);
      in_flight = IssuedRow{false, make_uint2(0u, 0u)};
      if (t + 1 < ntiles) {
        in_flight = gather_tile_into<kFp8>(p, region_of(smem, other), region_valid(smem, other), t + 1, w.key_begin,
                                           w.key_end, row, phase, next_idx);
        if (t + 2 < ntiles) next_idx = row_index(p, t + 2, w.key_begin, w.key_end, w.bs, row);
      } else if (has_next) {
        issue_q_block(p, region_of(smem, other), wn.bs, wn.h0, row, phase);  // the next item's Q, into the idle region
      }
      cp_async_commit();
      consume_rows_at<kSOverHalfD<kFp8, false>>(o, m_run, l_run, smem, q_base, smem_addr(region_of(smem, r)),
                                                region_valid(smem, r), min(BK, w.key_end - (w.key_begin + t * BK)),
                                                sl2, tid, wg);
      x = r, y = other;
    }
    if (ntiles == 0) {
      cp_async_wait<0>();  // this item's Q, before its region is staged over
      fence_proxy_async_smem();
      __syncthreads();  // the constants' stores, and the bulk reads of rb waited for
      if (has_next) issue_q_block(p, region_of(smem, y), wn.bs, wn.h0, row, phase);
      cp_async_commit();
    }
    // The next item's tile 0 into x once every warp is past its last P V.
    auto issue_next_tile0 = [&] {
      if (has_next && wn.ntiles > 0)
        in_flight = gather_tile_into<kFp8>(p, region_of(smem, x), region_valid(smem, x), 0, wn.key_begin, wn.key_end,
                                           row, phase, next_idx0);
      cp_async_commit();
    };
    timeline_mark(kTlLastTile, ntiles);
    finish_rows<false, true>(p, smem, o, m_run, l_run, w.bs, w.h0, 0, tid, region_of(smem, rq), issue_next_tile0);
    timeline_mark(kTlEnd, ntiles);
    bulk_pending = kSpreadStores ? spread_store_issued(tid, w.h0, p.heads) : tid < BM && w.h0 + tid < p.heads;
    if (!has_next) break;
    const int staged = rq;
    rq = y, ra = x, rb = staged;
    item = next, w = wn;
  }
  cp_async_wait<0>();
  if (bulk_pending) bulk_wait_read();  // the staged rows must outlive their bulk copies' reads
}

// ---- Warp-specialised schedule (long lists; use_warp_specialised) --------------------
// The lockstep kernel's gather is issued by the same warps that compute, between a tile's
// barrier and its S: ncu (H200, V4-Pro HCA and dense 16k) puts about 19% of its warp
// samples on issuing those 16 cp.async per thread (LSU throttle) and 8% more on the wait and
// barrier before them, time in which no warp feeds the tensor pipe. Here a third warpgroup
// gathers and the two others only compute; they hand the two stages back and forth through
// named barriers (no mbarrier, no parity to get wrong): the producers arrive on kFullBar + s
// when stage s holds its tile (copies landed, proxy-fenced), the consumers arrive on
// kEmptyBar + s when their P V of it has completed. The producers announce tile t + 1 while
// the consumers still compute tile t and gather tile t + 2 as soon as tile t is done with,
// so each tile has one tile's compute time to land, as in the lockstep kernel, but its
// issue is off the compute path. Registers: a CTA of 12 warps gets 168 a thread at launch;
// `setmaxnreg` moves them from the producers to the consumers (kProducerRegs, kConsumerRegs).
constexpr int kWsThreads = kThreads + 128;
constexpr int kFullBar = 5;   // + stage; 1..4 are the consumers' swap barriers
constexpr int kEmptyBar = 7;  // + stage
constexpr int kRowsPerProducerWarp = BK / 4;
static_assert(kEmptyBar + 1 < kEpilogueBar && kEpilogueBar < 16, "named barrier ids");
// Registers a thread of each side gets after `setmaxnreg`. The CTA's pool is what it was
// launched with, 168 a thread (ptxas's allocation for 384 threads), and `setmaxnreg.inc`
// waits until the pool can cover it: a split that asks for more than the producers gave back
// never returns (the first FP8 split, 56 / 224 then 96 / 208, hung the H200 that way, at the
// first FP8 case of `kernel_driver --wgmma-ws`, 2026-12-04). The FP8 producers hold two rows'
// e4m3 bytes, RoPE dims and scales a tile ahead (produce_fp8_tiles, 80 registers of data):
// 112 is the least without spills, and at 96 / 200 both sides spill.
constexpr int kLaunchRegs = 168;
template <bool kFp8> constexpr int kProducerRegs = kFp8 ? 112 : 40;
template <bool kFp8> constexpr int kConsumerRegs = kFp8 ? 192 : 232;
static_assert(128 * kProducerRegs<false> + kThreads * kConsumerRegs<false> <= kWsThreads * kLaunchRegs,
              "register pool of the setmaxnreg split (bf16)");
static_assert(128 * kProducerRegs<true> + kThreads * kConsumerRegs<true> <= kWsThreads * kLaunchRegs,
              "register pool of the setmaxnreg split (FP8)");

// Producer warp pw's share of the 64 rows at smem address `dst` (Q or a tile stage): rows
// 16 pw .. 16 pw + 15, one per step, lane l copying chunks l and l + 32, so a warp
// instruction reads 512 contiguous bytes. `eff`: the row index of row 16 pw + (lane % 16),
// -1 for a masked row (zero-filled: a zero probability must never meet stale NaN bytes).
// Rows before `main_rows_end` come from `main`, the others from `extra`; `dummy` is any
// valid address (zero-byte copies read nothing).
__device__ __forceinline__ void issue_rows(uint32_t dst, const uint8_t* main, const uint8_t* extra, int main_rows_end,
                                           int eff, const uint8_t* dummy, int pw, int lane) {
#pragma unroll 4
  for (int i = 0; i < kRowsPerProducerWarp; ++i) {
    const int r = kRowsPerProducerWarp * pw + i;
    const int e = __shfl_sync(0xffffffffu, eff, i);
    const uint8_t* src = e >= 0 ? (r < main_rows_end ? main : extra) + int64_t(e) * (D * 2) : dummy;
    const uint32_t bytes = e >= 0 ? 16u : 0u;
    cp_async_16_zfill(dst + chunk_offset(r, lane), src + lane * 16, bytes);
    cp_async_16_zfill(dst + chunk_offset(r, lane + 32), src + (lane + 32) * 16, bytes);
  }
}

// A list entry as a row index of its pool, -1 where it is outside [0, n).
__device__ __forceinline__ int checked_index(const SparseSinkAttentionParams& p, bool in_main, int idx) {
  return idx >= 0 && idx < (in_main ? p.n_main : p.n_extra) ? idx : -1;
}

// Row index of list position j for the producers, -1 where the row is masked.
__device__ __forceinline__ int effective_index(const SparseSinkAttentionParams& p, int j, int key_end, int64_t bs) {
  if (j >= key_end) return -1;
  const bool in_main = j < p.k_main;
  return checked_index(p, in_main, in_main ? p.main_idx[bs * p.k_main + j] : p.extra_idx[bs * p.k_extra + (j - p.k_main)]);
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory"); }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs) : "memory"); }

// The producers' side for pools that may hold FP8 rows. Thread pt owns rows pt / 4 and
// pt / 4 + 32 of a tile at phase pt % 4: the 16-byte e4m3 pieces phase + 4 i (i < 7, dims
// 16 (phase + 4 i) .. + 15, scale block i) and RoPE chunks 2 phase, 2 phase + 1, which land
// as the tile's bf16 chunks 8 i + 2 phase and 8 i + 2 phase + 1 (i < 8). An FP8 row is
// loaded into registers (Fp8RowRegs) a whole tile before its stage is free, then expanded
// straight into the stage, so neither the DRAM latency nor a shared-memory staging round
// trip sits between the consumers' release of a stage and its next tile: tile t + 1's loads
// are issued as soon as tile t is announced and have the consumers' whole tile t - 1 to land.
// H100, 2026-12-07 (docs/kernels.md, "FP8 producers loading rows into registers"), against
// the staged in-place expansion this replaced: V4-Pro HCA FP8 122-123 -> 114 us, dense 16k
// 236-238 -> 225, V4-Flash CSA decode 34 -> 33, the DSpark blocks -3% (then forced onto this
// schedule; they take it by default since kWsMinTilesFp8 = 3).
// bf16 rows of a mixed call take cp.async into the stage (their bytes do not fit registers),
// masked rows zeros. A tile is announced once its FP8 rows are expanded, so the consumers'
// tile math is the bf16 one.
struct Fp8RowRegs {
  uint4 nope[kNopeChunks / 8];  // 7 pieces of 16 e4m3 values
  uint4 rope[2];                // RoPE chunks 2 phase, 2 phase + 1 (bf16)
  uint2 scale;
  int idx;  // the row's index in its pool, -1 when masked
  int fp8;  // whether its pool holds FP8 rows
};

// `raw`: row_index's value (-1 past the split), loaded a tile earlier; checked here, so the
// check does not wait for the index load.
__device__ __forceinline__ Fp8RowRegs load_fp8_producer_row(const SparseSinkAttentionParams& p, bool in_main, int phase,
                                                            int raw) {
  Fp8RowRegs r{};
  r.idx = checked_index(p, in_main, raw);
  r.fp8 = r.idx >= 0 && (in_main ? p.main_fp8 : p.extra_fp8) != 0;
  if (r.fp8) {
    const int64_t idx = r.idx;
    const uint4* nope = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(in_main ? p.main_rows : p.extra_rows) +
                                                       idx * kAttnNopeDim);
    const uint4* rope = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(in_main ? p.main_rope : p.extra_rope) +
                                                       idx * (2 * kAttnRopeDim));
#pragma unroll
    for (int i = 0; i < kNopeChunks / 8; ++i) r.nope[i] = __ldg(nope + phase + 4 * i);
    r.rope[0] = __ldg(rope + 2 * phase);
    r.rope[1] = __ldg(rope + 2 * phase + 1);
    r.scale = __ldg(reinterpret_cast<const uint2*>((in_main ? p.main_scale : p.extra_scale) + idx * kAttnScaleBytes));
  }
  return r;
}

// Row `row` of the stage at `base` from what load_fp8_producer_row kept (flag into `valid`).
__device__ __forceinline__ void store_fp8_producer_row(const SparseSinkAttentionParams& p, const Fp8RowRegs& r,
                                                       bool in_main, uint8_t* base, uint8_t* valid, int row, int phase) {
  if (r.fp8) {
#pragma unroll
    for (int i = 0; i < kNopeChunks / 8; ++i) {
      const uint4 v = r.nope[i];  // two 8-value chunks of scale block i (expanded_chunk's 2i, 2i + 1)
      *reinterpret_cast<uint4*>(base + chunk_offset(row, 8 * i + 2 * phase)) =
          expanded_chunk(make_uint2(v.x, v.y), r.scale, 2 * i);
      *reinterpret_cast<uint4*>(base + chunk_offset(row, 8 * i + 2 * phase + 1)) =
          expanded_chunk(make_uint2(v.z, v.w), r.scale, 2 * i + 1);
    }
    *reinterpret_cast<uint4*>(base + chunk_offset(row, kNopeChunks + 2 * phase)) = r.rope[0];
    *reinterpret_cast<uint4*>(base + chunk_offset(row, kNopeChunks + 2 * phase + 1)) = r.rope[1];
  } else if (r.idx >= 0) {  // a bf16 row of a mixed call
    const uint8_t* src = static_cast<const uint8_t*>(in_main ? p.main_rows : p.extra_rows) + int64_t(r.idx) * (D * 2);
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = 8 * (i >> 1) + 2 * phase + (i & 1);
      cp_async_16(smem_addr(base + chunk_offset(row, chunk)), src + chunk * 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i)
      *reinterpret_cast<uint4*>(base + chunk_offset(row, 8 * (i >> 1) + 2 * phase + (i & 1))) = make_uint4(0, 0, 0, 0);
  }
  if (phase == 0) valid[row] = r.idx >= 0;
}

// `issue_q`: the caller's copies of the Q block, issued once tile 0's index loads are in flight.
template <class IssueQ>
__device__ __forceinline__ void produce_fp8_tiles(const SparseSinkAttentionParams& p, uint8_t* smem,
                                                  const AttnWorkItem& item, int pt, IssueQ&& issue_q) {
  const int key_begin = item.key_begin, key_end = item.key_end, ntiles = item.ntiles;
  const int64_t bs = item.bs;
  const int row0 = pt >> 2, phase = pt & 3;
  int idx[2];
  Fp8RowRegs held[2];
  auto in_main = [&](int t, int r) { return key_begin + t * BK + row0 + 32 * r < p.k_main; };
  auto load_indices = [&](int t) {  // raw: checked by load_fp8_producer_row a tile later
#pragma unroll
    for (int r = 0; r < 2; ++r) idx[r] = t < ntiles ? row_index(p, t, key_begin, key_end, bs, row0 + 32 * r) : -1;
  };
  auto load_rows = [&](int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) held[r] = load_fp8_producer_row(p, in_main(t, r), phase, idx[r]);
  };
  load_indices(0);
  issue_q();
  load_rows(0);
  load_indices(1);
  for (int t = 0; t < ntiles; ++t) {
    const int stage = t & 1;
    if (t >= 2) named_barrier_sync(kEmptyBar + stage, kWsThreads);  // the consumers are done with tile t - 2
#pragma unroll
    for (int r = 0; r < 2; ++r)
      store_fp8_producer_row(p, held[r], in_main(t, r), smem + kOffKV + stage * kTileBytes, smem + kOffValid + stage * BK,
                             row0 + 32 * r, phase);
    cp_async_commit();  // bf16 rows of a mixed call (and, at t = 0, the caller's Q block)
    cp_async_wait<0>();
    fence_proxy_async_smem();  // copies, expanded chunks, zero rows and flags, before wgmma reads them
    named_barrier_arrive(kFullBar + stage, kWsThreads);
    // Only after the fence: it compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, and the
    // MEMBAR waits for this thread's outstanding global loads, so loads issued before it
    // put a whole DRAM round trip into every tile's announcement (13ebf07: +14% on HCA).
    if (t + 1 < ntiles) {
      load_rows(t + 1);  // in flight while the consumers finish tile t - 1 and compute tile t
      load_indices(t + 2);
    }
  }
}

// Where the producers leave: at once, or (kCluster) after taking part in the consumers' two
// cluster syncs of finish_rows, which every thread of the cluster joins.
template <bool kCluster>
__device__ __forceinline__ void producers_leave(int num_splits) {
  if constexpr (kCluster) {
    if (num_splits > 1) {
      cluster_sync();
      cluster_sync();
    }
  }
}

template <bool kFp8, bool kCluster = false>
__global__ void __launch_bounds__(kWsThreads, 1) sparse_sink_attention_wgmma_ws_kernel(const SparseSinkAttentionParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  if (smem_addr(smem) & 1023) __trap();  // the swizzled operand atoms need 1024-byte alignment
  const AttnWorkItem item = attn_work_item(p);
  const int key_begin = item.key_begin, key_end = item.key_end, ntiles = item.ntiles;
  const int64_t bs = item.bs;
  const int tid = threadIdx.x;
  timeline_mark(kTlStart, ntiles);

  if (tid >= kThreads) {  // producer warpgroup
    setmaxnreg_dec<kProducerRegs<kFp8>>();
    const int lane = tid & 31, pw = (tid >> 5) & 3;
    const int my_row = kRowsPerProducerWarp * pw + (lane % kRowsPerProducerWarp);
    const uint8_t* main = static_cast<const uint8_t*>(p.main_rows);
    const uint8_t* extra = static_cast<const uint8_t*>(p.extra_rows);
    const uint8_t* q = static_cast<const uint8_t*>(p.q);
    // No tile, no Q either: nothing would wait for its copies before the epilogue stages rows over it.
    if (ntiles == 0) return producers_leave<kCluster>(p.num_splits);
    // Q block, absent heads as zeros (their rows of O are never stored). Issued once the first
    // tiles' index loads are in flight, so their latency runs under the Q copies' issue.
    auto issue_q = [&] {
      const uint8_t* q_rows = q + bs * p.heads * int64_t(D * 2);  // head h of this query row at h * 1024
      const int h = item.h0 + my_row;
      issue_rows(smem_addr(smem + kOffQ), q_rows, q_rows, BK, h < p.heads ? h : -1, q, pw, lane);
    };
    if constexpr (kFp8) {
      produce_fp8_tiles(p, smem, item, tid - kThreads, issue_q);
      return producers_leave<kCluster>(p.num_splits);
    }
    // Tile t into stage t % 2, with its row-validity flags; `eff` from `index_of(t)`.
    auto index_of = [&](int t) { return effective_index(p, key_begin + t * BK + my_row, key_end, bs); };
    auto issue_tile = [&](int t, int eff) {
      if (lane < kRowsPerProducerWarp) smem[kOffValid + (t & 1) * BK + my_row] = eff >= 0;
      issue_rows(smem_addr(smem + kOffKV + (t & 1) * kTileBytes), main, extra, p.k_main - (key_begin + t * BK), eff,
                 q, pw, lane);
      cp_async_commit();
    };
    int eff = -1;
    const int eff0 = index_of(0), eff1 = ntiles > 1 ? index_of(1) : -1;
    issue_q();
    issue_tile(0, eff0);  // one group with Q
    if (ntiles > 1) issue_tile(1, eff1);
    if (ntiles > 2) eff = index_of(2);
    // Announce tile 0; then, the consumers on tile t: announce t + 1 once landed, take
    // stage t % 2 back once they are done with t, gather t + 2 into it.
    if (ntiles > 1)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    fence_proxy_async_smem();  // this thread's copies and flag stores, before wgmma reads them
    named_barrier_arrive(kFullBar, kWsThreads);
    for (int t = 0; t + 1 < ntiles; ++t) {
      cp_async_wait<0>();  // tile t + 1: the only group in flight
      fence_proxy_async_smem();
      named_barrier_arrive(kFullBar + ((t + 1) & 1), kWsThreads);
      if (t + 2 < ntiles) {
        named_barrier_sync(kEmptyBar + (t & 1), kWsThreads);
        issue_tile(t + 2, eff);
        if (t + 3 < ntiles) eff = index_of(t + 3);
      }
    }
    return producers_leave<kCluster>(p.num_splits);
  }

  setmaxnreg_inc<kConsumerRegs<kFp8>>();
  load_epilogue_constants(p, smem, bs, item.h0, tid);
  if (ntiles == 0) named_barrier_sync(kEpilogueBar, kThreads);  // its stores, before finish_rows reads them
  float o[32][4], m_run[2], l_run[2];
  init_rows(o, m_run, l_run);
  const float sl2 = p.scale * kLog2e;
  const uint32_t q_base = smem_addr(smem + kOffQ);
  const int wg = warpgroup_of(tid);
  for (int t = 0; t < ntiles; ++t) {
    const int stage = t & 1;
    named_barrier_sync(kFullBar + stage, kWsThreads);
    if (t == 0) timeline_mark(kTlFirstTile, ntiles);
    consume_stage<kSOverHalfD<kFp8, true>>(o, m_run, l_run, smem, q_base, stage,
                                           min(BK, key_end - (key_begin + t * BK)), sl2, tid, wg);
    if (t + 2 < ntiles) named_barrier_arrive(kEmptyBar + stage, kWsThreads);  // its wgmmas have completed
  }
  timeline_mark(kTlLastTile, ntiles);
  finish_rows<kCluster>(p, smem, o, m_run, l_run, bs, item.h0, item.split, tid);
  timeline_mark(kTlEnd, ntiles);
}

// ---- Persistent warp-specialised CTAs (one split; FP8 pools dispatched; kernel_driver --wgmma-ws-persistent) ----
// The FP8 counterpart of the persistent lockstep kernel: the short FP8 launches (the DSpark
// blocks: 3 tiles an item, 2.4 or 9.7 items an SM) take the warp-specialised schedule, whose
// producers expand the rows off the compute path, and the persistent lockstep kernel lost to
// it (+5.5% / +6% on the H100, docs/kernels.md "Persistent lockstep CTAs"), so the overlap of
// one item's epilogue with the next item's loads has to come from producers that walk the
// items. min(items, SMs) CTAs; every item has the same n >= 1 tiles (one split over the whole
// list). The three 64 KB regions rotate as in the persistent lockstep kernel: item i has Q in
// rq and tile t in ra (t even) or rb (t odd); once its last tile (region x) is announced and
// the other tile region y is handed back, the producers load item i + 1's Q into y; when the
// consumers hand x back after their last P V, item i + 1's tile 0 goes there, and its tile 1
// into rq once the consumers have staged item i's output rows there and their bulk copies
// have read them. Item i + 1 then has (rq, ra, rb) = (y, x, rq).
// Every region passes from the producers to the consumers and back through its own pair of
// named barriers (kPwsFullBar + r, kPwsEmptyBar + r), whatever it holds: each fill is handed
// back exactly once and each refill waits for that, so neither side can arrive twice on a
// barrier before the other has passed it. A Q fill has no full barrier of its own: the
// producers announce it with the item's tile 0. At the end the producers wait for the last
// hand-backs, so no barrier is left half arrived.
constexpr int kPwsFullBar = 10;   // + region
constexpr int kPwsEmptyBar = 13;  // + region
static_assert(kEpilogueBar < kPwsFullBar && kPwsEmptyBar + 2 < 16, "named barrier ids");
// bf16 pools (dispatched since 2026-12-07, use_persistent): no row fits a producer's registers,
// so a tile's rows are copied (cp.async) once its region is handed back, as in the plain
// warp-specialised kernel; the producers need more registers than its 40 for the item loop,
// and the consumers (full-D S) get 216.
template <bool kFp8> constexpr int kPwsProducerRegs = kFp8 ? kProducerRegs<true> : 64;
template <bool kFp8> constexpr int kPwsConsumerRegs = kFp8 ? kConsumerRegs<true> : 216;
static_assert(128 * kPwsProducerRegs<false> + kThreads * kPwsConsumerRegs<false> <= kWsThreads * kLaunchRegs,
              "register pool of the setmaxnreg split (bf16, persistent)");

template <bool kFp8>
__global__ void __launch_bounds__(kWsThreads, 1)
    sparse_sink_attention_wgmma_ws_persistent_kernel(const SparseSinkAttentionParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  if (smem_addr(smem) & 1023) __trap();  // the swizzled operand atoms need 1024-byte alignment
  const int x_items = (p.heads + BM - 1) / BM * p.seq, items = x_items * p.batch;
  const int key_end = p.k_main + p.k_extra, n = (key_end + BK - 1) / BK;  // >= 1 (ws_persistent_applies)
  const int my_items = (items - 1 - int(blockIdx.x)) / int(gridDim.x) + 1;
  const int tid = threadIdx.x;
  auto item_of = [&](int j) { return persistent_item(p, x_items, int(blockIdx.x) + j * int(gridDim.x)); };

  if (tid >= kThreads) {  // producer warpgroup: tile k of the CTA's sequence is item k / n's tile k % n
    setmaxnreg_dec<kPwsProducerRegs<kFp8>>();
    const int total = my_items * n;
    int idx[2];
    Fp8RowRegs held[2];
    // The thread's rows and chunks (produce_fp8_tiles's mapping: rows row0, row0 + 32 of a tile
    // at phase pt % 4; issue_rows's for Q) are derived where used: held across the loop beside
    // the two rows of registers, they spilled.
    auto row0 = [] { return (opaque(threadIdx.x) - kThreads) >> 2; };
    auto phase = [] { return opaque(threadIdx.x) & 3; };
    auto in_main = [&](int k, int r0, int r) { return (k % n) * BK + r0 + 32 * r < p.k_main; };
    auto load_indices = [&](int k) {  // raw: checked by load_fp8_producer_row a tile later
      const int64_t bs = item_of(k / n).bs;
      const int r0 = row0();
#pragma unroll
      for (int r = 0; r < 2; ++r) idx[r] = k < total ? row_index(p, k % n, 0, key_end, bs, r0 + 32 * r) : -1;
    };
    auto load_rows = [&](int k) {
      const int r0 = row0(), ph = phase();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (kFp8) {
          held[r] = load_fp8_producer_row(p, in_main(k, r0, r), ph, idx[r]);
        } else {  // store_fp8_producer_row copies the bf16 row
          held[r] = Fp8RowRegs{};
          held[r].idx = checked_index(p, in_main(k, r0, r), idx[r]);
        }
      }
    };
    auto store_rows = [&](int k, int region) {
      const int r0 = row0(), ph = phase();
#pragma unroll
      for (int r = 0; r < 2; ++r)
        store_fp8_producer_row(p, held[r], in_main(k, r0, r), region_of(smem, region), region_valid(smem, region),
                               r0 + 32 * r, ph);
    };
    auto issue_q = [&](int region, int j) {  // item j's Q block, absent heads as zeros
      const int t = opaque(threadIdx.x), lane = t & 31, pw = (t >> 5) & 3;
      const int my_row = kRowsPerProducerWarp * pw + (lane % kRowsPerProducerWarp);
      const AttnWorkItem w = item_of(j);
      const uint8_t* q = static_cast<const uint8_t*>(p.q);
      const uint8_t* q_rows = q + w.bs * p.heads * int64_t(D * 2);
      const int h = w.h0 + my_row;
      issue_rows(smem_addr(region_of(smem, region)), q_rows, q_rows, BK, h < p.heads ? h : -1, q, pw, lane);
    };
    unsigned filled = 0;  // bit r: region r has been filled (each fill is handed back once)
    auto acquire = [&](int r) {
      if (filled >> r & 1) named_barrier_sync(kPwsEmptyBar + r, kWsThreads);
      filled |= 1u << r;
    };
    int rq = 0, ra = 1, rb = 2;
    load_indices(0);
    acquire(rq);
    issue_q(rq, 0);
    load_rows(0);
    load_indices(1);
    for (int k = 0; k < total; ++k) {
      const int t = k % n, r = (t & 1) ? rb : ra;
      acquire(r);
      store_rows(k, r);
      cp_async_commit();  // bf16 rows of a mixed call, and the item's Q with its tile 0
      cp_async_wait<0>();
      fence_proxy_async_smem();  // copies, expanded chunks, zero rows and flags, before wgmma reads them
      named_barrier_arrive(kPwsFullBar + r, kWsThreads);
      if (k + 1 < total) {  // after the fence (produce_fp8_tiles says why)
        load_rows(k + 1);
        load_indices(k + 2);
      }
      if (t == n - 1) {  // the item's last tile: the next item's Q into the other tile region
        const int y = r == ra ? rb : ra;
        if (k + 1 < total) {
          acquire(y);
          issue_q(y, k / n + 1);  // committed with the next tile 0
        }
        rb = rq;
        rq = y;
        ra = r;
      }
    }
#pragma unroll
    for (int r = 0; r < 3; ++r)
      if (filled >> r & 1) named_barrier_sync(kPwsEmptyBar + r, kWsThreads);  // the last hand-backs
    return;
  }

  setmaxnreg_inc<kPwsConsumerRegs<kFp8>>();
  int rq = 0, ra = 1, rb = 2;
  bool bulk_pending = false;  // this thread's bulk copies of the previous item's rows, reads not yet waited for
  for (int j = 0; j < my_items; ++j) {  // (timeline builds: a CTA's record is of its last item)
    // What the item's code derives from the thread index, derived anew each item: hoisted out of
    // this loop and held across it, it spilled (the consumers have 192 registers; the first
    // build spilled 420 bytes on both sides).
    const int tid = opaque(threadIdx.x);
    const float sl2 = p.scale * kLog2e;
    const int wg = warpgroup_of(tid);
    const AttnWorkItem w = item_of(j);
    timeline_mark(kTlStart, n);
#ifdef JAX_DSPARK_ATTENTION_ASYNC_CONSTANTS
    issue_epilogue_constants(p, smem, w.bs, w.h0, tid);
    cp_async_commit();
#else
    load_epilogue_constants(p, smem, w.bs, w.h0, tid);
#endif
    if (j > 0) {  // rb held the previous item's Q, then its staged rows: hand it back once they are read
      if (bulk_pending) bulk_wait_read();
      named_barrier_arrive(kPwsEmptyBar + rb, kWsThreads);
    }
    float o[32][4], m_run[2], l_run[2];
    init_rows(o, m_run, l_run);
    const uint32_t q_base = smem_addr(region_of(smem, rq));
    int r = ra;
    for (int t = 0; t < n; ++t) {
      r = (t & 1) ? rb : ra;
      named_barrier_sync(kPwsFullBar + r, kWsThreads);  // tile t (with tile 0, the item's Q) landed
      if (t == 0) timeline_mark(kTlFirstTile, n);
      consume_rows_at<kSOverHalfD<kFp8, true>>(o, m_run, l_run, smem, q_base, smem_addr(region_of(smem, r)),
                                               region_valid(smem, r), min(BK, key_end - t * BK), sl2, tid, wg);
      named_barrier_arrive(kPwsEmptyBar + r, kWsThreads);  // its wgmmas have completed
    }
    timeline_mark(kTlLastTile, n);
#ifdef JAX_DSPARK_ATTENTION_ASYNC_CONSTANTS
    cp_async_wait<0>();  // the constants (finish_rows's first barrier makes them visible)
#endif
    finish_rows<false, true>(p, smem, o, m_run, l_run, w.bs, w.h0, 0, tid, region_of(smem, rq));
    timeline_mark(kTlEnd, n);
    bulk_pending = kSpreadStores ? spread_store_issued(tid, w.h0, p.heads) : tid < BM && w.h0 + tid < p.heads;
    const int y = r == ra ? rb : ra;
    rb = rq;
    rq = y;
    ra = r;
  }
  if (bulk_pending) bulk_wait_read();  // the staged rows must outlive their bulk copies' reads
  named_barrier_arrive(kPwsEmptyBar + rb, kWsThreads);
}

#ifdef JAX_DSPARK_ATTENTION_PROBES
// The gather probes' loop: kDepth tiles in flight per CTA, each thread waiting for the oldest
// of its groups and the CTA barrier before issuing the next (`issue(t, idx)` copies tile t,
// `index_of(t)` is the thread's row index in it, loaded one tile ahead).
template <int kDepth, class Issue, class IndexOf>
__device__ __forceinline__ void gather_pipeline(int ntiles, Issue&& issue, IndexOf&& index_of) {
  int next_idx = -1;
#pragma unroll
  for (int t = 0; t < kDepth; ++t) {
    if (t < ntiles) issue(t, index_of(t));
    cp_async_commit();
  }
  if (kDepth < ntiles) next_idx = index_of(kDepth);
  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<kDepth - 1>();  // groups t .. t + kDepth - 1 were in flight: tile t has landed
    __syncthreads();              // every thread's share of tile t landed; all are past tile t - 1
    if (t + kDepth < ntiles) {
      issue(t + kDepth, next_idx);  // into tile t - 1's stage
      if (t + kDepth + 1 < ntiles) next_idx = index_of(t + kDepth + 1);
    }
    cp_async_commit();  // possibly empty: keeps kDepth groups in flight
  }
  cp_async_wait<0>();
}

// Diagnostic (kernel_driver only): the lockstep kernel's gather with nothing computed, kDepth
// tiles in flight while the CTA waits for the oldest. kDepth 1 is the lockstep kernel's
// memory pipeline (two stages: one tile landing while one is used); kDepth 2 uses the Q
// block's region as a third stage, which the real kernels cannot (they need Q), to show what
// one more tile in flight per CTA would buy. Same work items, splits and combine launch as
// the real kernel; the outputs are not written.
template <bool kFp8, int kDepth>
__global__ void __launch_bounds__(kThreads, 1) attention_gather_probe_kernel(const SparseSinkAttentionParams p) {
  static_assert(kDepth == 1 || kDepth == 2, "stages: the two tile stages, plus Q's region for depth 2");
  constexpr int kStages = kDepth + 1;
  extern __shared__ __align__(1024) uint8_t smem[];
  const AttnWorkItem item = attn_work_item(p);
  const int key_begin = item.key_begin, key_end = item.key_end, ntiles = item.ntiles;
  const int64_t bs = item.bs;
  const int tid = threadIdx.x, row = tid >> 2, phase = tid & 3;
  // stage i at smem + i * kTileBytes (stage 0: Q's region), flags in the unused swap area
  auto issue = [&](int t, int idx) {
    const int stage = (kStages == 3 ? t % 3 : 1 + (t & 1));
    gather_tile_into<kFp8>(p, smem + stage * kTileBytes, smem + kOffXP + stage * BK, t, key_begin, key_end, row,
                           phase, idx);
  };
  gather_pipeline<kDepth>(ntiles, issue, [&](int t) { return row_index(p, t, key_begin, key_end, bs, row); });
}

template <bool kFp8, int kDepth>
cudaError_t launch_gather_probe(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return launch_attention_grid<attention_gather_probe_kernel<kFp8, kDepth>>(p, kThreads, kSmemBytes, stream);
}
#endif

// The pool the setmaxnreg split assumes is the kernel's launch allocation (kLaunchRegs a
// thread); were ptxas ever to allocate fewer, the consumers' setmaxnreg.inc would wait
// forever. Checked once per instantiation on the host, so that case is an error, not a hang.
template <void (*Kernel)(SparseSinkAttentionParams)>
cudaError_t ws_register_pool() {
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, Kernel);
  if (err != cudaSuccess) return err;
  return attr.numRegs >= kLaunchRegs ? cudaSuccess : cudaErrorInvalidConfiguration;
}

// Which launches take the warp-specialised schedule (both schedules timed with CUDA events
// in one run, docs/kernels.md).
// bf16 pools (H200, 2026-12-04): it wins only on V4-Pro HCA (103 against 110 us) and loses
// 3-10% on the four other benchmark shapes. What sets HCA apart: more than one head block
// reads each KV row (H > 64), so half the gathers hit L2 and the lockstep kernel is bound by
// issuing them rather than by DRAM, and each CTA walks many tiles (32), so the producers'
// extra start-up is paid once. Dense 16k (one head block, DRAM-bound) gains nothing from
// moving the issue; the V4-Pro DSpark block (H 128 but 3 tiles a CTA) loses to the start-up.
// FP8 pools (H100, 2026-12-05, producers that staged the rows in shared memory): the
// producers also take the expansion off the compute warps, which the lockstep kernel runs
// between a tile's landing and its S; from 16 tiles a split on it won at H 64 and H 128 alike
// (16 tiles: -1.5% / -6%; 32: -8% / -12%; 64 at H 64: -15%) and below it lost (4 to 10
// tiles: +2% to +16%).
// kWsMinTiles: for bf16 the smallest winning count measured (32) rounded down (no H > 64
// shape between 3 and 32 tiles measured). kWsMinTilesFp8: with the register-prefetch FP8
// producers (H100, 2026-12-07) this schedule wins from 3 tiles a split: bench-shape at S 1
// (B 64 H 64: 4 tiles -9%, 6 -12%, 8 -15%; B 16 H 128: 3 tiles -9%, 4 -10%) and the
// benchmark cases, both schedules alternated in one run: V4-Flash CSA decode (5 tiles)
// 37.3 -> 33.3 us, DSpark block (3) 62.4 -> 57.4, V4-Pro DSpark block (3) 196.7 -> 182.0.
// Below 3 tiles nothing was measured; the lockstep kernel keeps those.
constexpr int kWsMinTiles = 16;
constexpr int kWsMinTilesFp8 = 3;
bool use_warp_specialised(const SparseSinkAttentionParams& p) {
  const int tiles = attn_tiles_per_split(p.k_main + p.k_extra, p.num_splits);
  if (p.main_fp8 || p.extra_fp8) return tiles >= kWsMinTilesFp8;
  return p.heads > kAttnHeadsPerCta && tiles >= kWsMinTiles;
}

enum class Schedule { kLockstep, kWarpSpecialised };

template <bool kFp8, Schedule kSchedule, bool kCluster>
constexpr void (*kAttentionKernel)(SparseSinkAttentionParams) =
    kSchedule == Schedule::kWarpSpecialised ? sparse_sink_attention_wgmma_ws_kernel<kFp8, kCluster>
                                            : sparse_sink_attention_wgmma_kernel<kFp8, false, kCluster>;
template <Schedule kSchedule>
constexpr int kScheduleThreads = kSchedule == Schedule::kWarpSpecialised ? kWsThreads : kThreads;

// The grid of launch_attention_grid with a work item's splits as one cluster (finish_rows<true>).
cudaLaunchConfig_t cluster_config(const SparseSinkAttentionParams& p, int threads, cudaStream_t stream,
                                  cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t cfg{};
  const int nhb = (p.heads + BM - 1) / BM;
  cfg.gridDim = dim3(nhb * p.seq, p.num_splits, p.batch);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  *cluster = cudaLaunchAttribute{};
  cluster->id = cudaLaunchAttributeClusterDimension;
  cluster->val.clusterDim.x = 1;
  cluster->val.clusterDim.y = p.num_splits;
  cluster->val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = 1;
  return cfg;
}

// The current device's SM count, asked once per device (host code on every launch path:
// an attribute query is not stream work, so it is safe while XLA captures a command buffer).
cudaError_t device_sm_count(int* n_sms) {
  constexpr int kDevices = 64;
  static std::atomic<int> sms[kDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  *n_sms = dev >= 0 && dev < kDevices ? sms[dev].load(std::memory_order_relaxed) : 0;
  if (*n_sms > 0) return cudaSuccess;
  err = cudaDeviceGetAttribute(n_sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess && dev >= 0 && dev < kDevices) sms[dev].store(*n_sms, std::memory_order_relaxed);
  return err;
}

// Whether a launch's split partials merge in a cluster: 2..8 splits, and the cluster launch
// needs no more waves than the plain one. A cluster's CTAs must be resident together in one
// GPC, so fewer clusters than the 132 / splits a plain launch would suggest fit at once (H100,
// 4 splits: V4-Pro HCA and dense 16k, 32 clusters of 4, ran in two waves, 2x the time of the
// plain launch's one); at 2 splits (CSA decode, 64 clusters of 2) they all fit. The counts
// come from the occupancy API, once per device, schedule and cluster size.
template <bool kFp8, Schedule kSchedule>
cudaError_t use_cluster_merge(const SparseSinkAttentionParams& p, bool* use) {
  *use = false;
  if (p.num_splits < 2 || p.num_splits > kMaxClusterSplits) return cudaSuccess;
  constexpr int kDevices = 64;
  static std::atomic<int> max_clusters[kDevices][2][kMaxClusterSplits + 1] = {};  // 0: not asked yet
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= kDevices) return cudaSuccess;
  constexpr int ws = kSchedule == Schedule::kWarpSpecialised;
  int fit = max_clusters[dev][ws][p.num_splits].load(std::memory_order_relaxed);
  if (fit == 0) {
    constexpr auto kernel = kAttentionKernel<kFp8, kSchedule, true>;
    err = configure_attention_kernel<kernel>(kSmemBytes);
    if (err != cudaSuccess) return err;
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t cfg = cluster_config(p, kScheduleThreads<kSchedule>, nullptr, &cluster);
    err = cudaOccupancyMaxActiveClusters(&fit, kernel, &cfg);
    if (err != cudaSuccess) return err;
    fit = fit > 0 ? fit : -1;  // -1: none fits
    max_clusters[dev][ws][p.num_splits].store(fit, std::memory_order_relaxed);
  }
  int n_sms = 0;
  err = device_sm_count(&n_sms);
  if (err != cudaSuccess) return err;
  if (fit < 0) return cudaSuccess;
  const int64_t clusters = int64_t((p.heads + BM - 1) / BM) * p.seq * p.batch;
  const int64_t cluster_waves = (clusters + fit - 1) / fit;
  const int64_t plain_waves = (clusters * p.num_splits + n_sms - 1) / n_sms;  // one CTA an SM (kSmemBytes)
  *use = cluster_waves <= plain_waves;
  return cudaSuccess;
}

template <bool kFp8, Schedule kSchedule, bool kCluster>
cudaError_t launch_schedule(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  constexpr auto kernel = kAttentionKernel<kFp8, kSchedule, kCluster>;
  if constexpr (kSchedule == Schedule::kWarpSpecialised) {
    static const cudaError_t pool = ws_register_pool<kernel>();
    if (pool != cudaSuccess) return pool;
  }
  if constexpr (!kCluster) {
    return launch_attention_grid<kernel>(p, kScheduleThreads<kSchedule>, kSmemBytes, stream);
  } else {
    const cudaError_t err = configure_attention_kernel<kernel>(kSmemBytes);
    if (err != cudaSuccess) return err;
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t cfg = cluster_config(p, kScheduleThreads<kSchedule>, stream, &cluster);
    return cudaLaunchKernelEx(&cfg, kernel, p);
  }
}

// How a launch's split partials are merged: as use_cluster_merge says, or forced
// (kernel_driver --wgmma-cluster / --wgmma-combine; a forced cluster still needs 2..8 splits).
enum class Merge { kAuto, kCluster, kCombine };

template <bool kFp8, Schedule kSchedule>
cudaError_t run_merge(const SparseSinkAttentionParams& p, Merge merge, cudaStream_t stream) {
  bool cluster = false;
  if (merge == Merge::kAuto) {
    const cudaError_t err = use_cluster_merge<kFp8, kSchedule>(p, &cluster);
    if (err != cudaSuccess) return err;
  } else {
    cluster = merge == Merge::kCluster && p.num_splits >= 2 && p.num_splits <= kMaxClusterSplits;
  }
  if (cluster) return launch_schedule<kFp8, kSchedule, true>(p, stream);
  const cudaError_t err = launch_schedule<kFp8, kSchedule, false>(p, stream);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_sparse_sink_attention_combine(p, stream);
}

cudaError_t run_schedule(const SparseSinkAttentionParams& p, Schedule schedule, cudaStream_t stream,
                         Merge merge = Merge::kAuto) {
  if (p.batch == 0 || p.seq == 0 || p.heads == 0) return cudaSuccess;
  const bool fp8 = p.main_fp8 || p.extra_fp8;
  if (schedule == Schedule::kWarpSpecialised)
    return fp8 ? run_merge<true, Schedule::kWarpSpecialised>(p, merge, stream)
               : run_merge<false, Schedule::kWarpSpecialised>(p, merge, stream);
  return fp8 ? run_merge<true, Schedule::kLockstep>(p, merge, stream)
             : run_merge<false, Schedule::kLockstep>(p, merge, stream);
}

// A persistent kernel's grid: min(items, SMs) CTAs (one an SM).
template <void (*Kernel)(SparseSinkAttentionParams), int kBlockThreads>
cudaError_t launch_persistent_grid(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  if constexpr (kBlockThreads == kWsThreads) {
    static const cudaError_t pool = ws_register_pool<Kernel>();
    if (pool != cudaSuccess) return pool;
  }
  cudaError_t err = configure_attention_kernel<Kernel>(kSmemBytesPersistent);
  if (err != cudaSuccess) return err;
  int n_sms = 0;
  err = device_sm_count(&n_sms);
  if (err != cudaSuccess) return err;
  const int64_t items = int64_t((p.heads + BM - 1) / BM) * p.seq * p.batch;
  const int grid = int(std::min<int64_t>(items, n_sms));
  Kernel<<<grid, kBlockThreads, kSmemBytesPersistent, stream>>>(p);
  return cudaGetLastError();
}

template <bool kFp8>
cudaError_t launch_persistent(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return launch_persistent_grid<sparse_sink_attention_wgmma_persistent_kernel<kFp8>, kThreads>(p, stream);
}

// The persistent warp-specialised kernel: one split, a list of at least one tile (its items
// all have the same n >= 1 tiles).
bool ws_persistent_applies(const SparseSinkAttentionParams& p) {
  return p.num_splits == 1 && p.k_main + p.k_extra > 0 && p.batch > 0 && p.seq > 0 && p.heads > 0;
}

template <bool kFp8>
cudaError_t launch_ws_persistent(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return launch_persistent_grid<sparse_sink_attention_wgmma_ws_persistent_kernel<kFp8>, kWsThreads>(p, stream);
}

Schedule dispatched_schedule(const SparseSinkAttentionParams& p) {
  return use_warp_specialised(p) ? Schedule::kWarpSpecialised : Schedule::kLockstep;
}

}  // namespace

#ifdef JAX_DSPARK_ATTENTION_PROBES
cudaError_t run_sparse_sink_attention_wgmma_probe(const SparseSinkAttentionParams& p, AttnProbe probe,
                                                  cudaStream_t stream) {
  if (p.batch == 0 || p.seq == 0 || p.heads == 0) return cudaSuccess;
  const bool fp8 = p.main_fp8 || p.extra_fp8;
  cudaError_t err = cudaSuccess;
  switch (probe) {
    case AttnProbe::kGatherDepth1:
      err = fp8 ? launch_gather_probe<true, 1>(p, stream) : launch_gather_probe<false, 1>(p, stream);
      break;
    case AttnProbe::kGatherDepth2:
      err = fp8 ? launch_gather_probe<true, 2>(p, stream) : launch_gather_probe<false, 2>(p, stream);
      break;
    case AttnProbe::kMathOnly:
      err = fp8 ? launch_attention_grid<sparse_sink_attention_wgmma_kernel<true, true>>(p, kThreads, kSmemBytes, stream)
                : launch_attention_grid<sparse_sink_attention_wgmma_kernel<false, true>>(p, kThreads, kSmemBytes, stream);
      break;
  }
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_sparse_sink_attention_combine(p, stream);
}
#endif

#ifdef JAX_DSPARK_ATTENTION_TIMELINE
cudaError_t set_attention_timeline(unsigned long long* buffer, int ctas) {
  const cudaError_t err = cudaMemcpyToSymbol(g_timeline, &buffer, sizeof(buffer));
  return err != cudaSuccess ? err : cudaMemcpyToSymbol(g_timeline_ctas, &ctas, sizeof(ctas));
}

cudaError_t set_persistent_late_start(long long cycles) {
  return cudaMemcpyToSymbol(g_late_start_cycles, &cycles, sizeof(cycles));
}
#endif

// Which persistent kernel a launch takes: one split and more work items than SMs (with
// fewer, each CTA has one item and the kernel is the plain one), for the launches the
// lockstep schedule takes with bf16 pools and the warp-specialised one with FP8 pools (lists of
// 3 tiles or more: use_warp_specialised): persistent warp-specialised CTAs where the list has
// a tile (ws_persistent_applies), persistent lockstep CTAs for empty bf16 lists. H100,
// 2026-12-07, CUDA events: the persistent lockstep kernel against the plain ones, DSpark block
// bf16 (320 items, 2.4 an SM) 52.1 -> 48.2 us, V4-Pro DSpark block bf16 (1280) 164.7 -> 142.1
// (docs/kernels.md, "Persistent lockstep CTAs that prefetch the next item"); the persistent
// warp-specialised kernel against it (bf16, two alternations): 47.8, 47.5 -> 43.1, 42.8 and
// 141.2, 140.5 -> 120.6, 120.4 (docs/kernels.md, "The bf16 persistent warp-specialised kernel
// run and dispatched"), and against the plain warp-specialised kernel for FP8: 52.1 -> 45.4,
// 161.0 -> 130.1 (docs/kernels.md, "Persistent warp-specialised CTAs").
enum class Persistent { kNone, kLockstep, kWarpSpecialised };
cudaError_t use_persistent(const SparseSinkAttentionParams& p, Persistent* use) {
  *use = Persistent::kNone;
  if (p.num_splits != 1 || p.batch == 0 || p.seq == 0 || p.heads == 0) return cudaSuccess;
  const bool fp8 = p.main_fp8 || p.extra_fp8;
  const Schedule schedule = dispatched_schedule(p);
  if (schedule != (fp8 ? Schedule::kWarpSpecialised : Schedule::kLockstep))
    return cudaSuccess;
  int n_sms = 0;
  const cudaError_t err = device_sm_count(&n_sms);
  if (err == cudaSuccess && int64_t((p.heads + BM - 1) / BM) * p.seq * p.batch > n_sms)
    *use = ws_persistent_applies(p) ? Persistent::kWarpSpecialised : Persistent::kLockstep;
  return err;
}

cudaError_t run_sparse_sink_attention_wgmma(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  Persistent persistent = Persistent::kNone;
  const cudaError_t err = use_persistent(p, &persistent);
  if (err != cudaSuccess) return err;
  if (persistent == Persistent::kLockstep) return launch_persistent<false>(p, stream);
  if (persistent == Persistent::kWarpSpecialised)
    return (p.main_fp8 || p.extra_fp8) ? launch_ws_persistent<true>(p, stream) : launch_ws_persistent<false>(p, stream);
  return run_schedule(p, dispatched_schedule(p), stream);
}

cudaError_t run_sparse_sink_attention_wgmma_cluster(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return run_schedule(p, dispatched_schedule(p), stream, Merge::kCluster);
}

cudaError_t run_sparse_sink_attention_wgmma_combine(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return run_schedule(p, dispatched_schedule(p), stream, Merge::kCombine);
}

cudaError_t run_sparse_sink_attention_wgmma_lockstep(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return run_schedule(p, Schedule::kLockstep, stream);
}

cudaError_t run_sparse_sink_attention_wgmma_ws(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  return run_schedule(p, Schedule::kWarpSpecialised, stream);
}

cudaError_t run_sparse_sink_attention_wgmma_ws_persistent(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  if (!ws_persistent_applies(p)) return run_sparse_sink_attention_wgmma(p, stream);
  return (p.main_fp8 || p.extra_fp8) ? launch_ws_persistent<true>(p, stream) : launch_ws_persistent<false>(p, stream);
}

cudaError_t run_sparse_sink_attention_wgmma_persistent(const SparseSinkAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seq == 0 || p.heads == 0) return cudaSuccess;
  if (p.num_splits != 1) return run_schedule(p, dispatched_schedule(p), stream);
  return (p.main_fp8 || p.extra_fp8) ? launch_persistent<true>(p, stream) : launch_persistent<false>(p, stream);
}

}  // namespace jds
