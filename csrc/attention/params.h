// Plain parameter block of the sparse sink attention kernel: pointers, sizes, no framework
// types, so an XLA FFI handler (or any other host code) can fill it and call the launcher.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace jds {

constexpr int kAttnHeadDim = 512;     // D: one shared key=value row per token
constexpr int kAttnHeadsPerCta = 64;  // query heads one CTA computes against a row tile
constexpr int kAttnKeysPerTile = 64;  // rows gathered per pipeline stage
constexpr int kAttnMaxSplits = 32;    // split-K partials a combine can merge
// FP8 rows (DeepSeek-V4 MODEL1): 448 e4m3 "nope" dims with one UE8M0 exponent per 64, then
// 64 bf16 RoPE dims. jax_dspark/ops/kv_fp8.py holds the format; 584 bytes per row.
constexpr int kAttnNopeDim = 448;
constexpr int kAttnRopeDim = kAttnHeadDim - kAttnNopeDim;
constexpr int kAttnScaleBlock = 64;
constexpr int kAttnScaleBytes = 8;  // 7 exponents + 1 pad byte (one aligned 8-byte load)

struct SparseSinkAttentionParams {
  const void* q;             // bf16 [B, S, H, D]
  const void* main_rows;     // bf16 [n_main, D]
  const int32_t* main_idx;   // [B, S, k_main], -1 = no row
  const void* extra_rows;    // bf16 [n_extra, D] (may be null when k_extra == 0)
  const int32_t* extra_idx;  // [B, S, k_extra]
  const float* sink;         // [H] or null (no sink)
  const float* inv_rope;     // [B, S, rope_dim / 2, 2] (cos, sin) or null
  void* out;                 // bf16 [B, S, H, D]
  float* lse;                // [B, S, H]
  float* partial_out;        // [num_splits, B*S*H, D] when num_splits > 1
  float* partial_lse;        // [num_splits, B*S*H]   when num_splits > 1
  int batch;                 // B
  int seq;                   // S, query rows per request
  int heads;                 // H
  int64_t n_main;            // rows in the main pool
  int64_t n_extra;           // rows in the extra pool
  int k_main;                // index-list length into the main pool
  int k_extra;               // index-list length into the extra pool
  int num_splits;            // CTAs sharing one (request, row, head block) list
  int rope_dim;              // R: last R dims rotated back in the epilogue (0 = none)
  float scale;               // softmax scale applied to q . row
  // FP8 pools: when main_fp8 (extra_fp8), main_rows (extra_rows) is e4m3 [n, 448] and the
  // RoPE dims / scales come from the arrays below; otherwise those are unused.
  int main_fp8;
  int extra_fp8;
  const void* main_rope;      // bf16 [n_main, 64]
  const uint8_t* main_scale;  // uint8 [n_main, 8], scale 2^(byte - 127) for nope block byte
  const void* extra_rope;     // bf16 [n_extra, 64]
  const uint8_t* extra_scale; // uint8 [n_extra, 8]
};

// Row tiles of the concatenated list [main | extra] handled by one split.
inline int attn_tiles_per_split(int k_total, int num_splits) {
  const int tiles = (k_total + kAttnKeysPerTile - 1) / kAttnKeysPerTile;
  return (tiles + num_splits - 1) / num_splits;
}

// Workspace floats the launcher needs for `num_splits` (0 when no split).
inline int64_t attn_workspace_floats(int batch, int seq, int heads, int num_splits) {
  if (num_splits <= 1) return 0;
  const int64_t rows = int64_t(batch) * seq * heads;
  return int64_t(num_splits) * rows * (kAttnHeadDim + 1);
}

cudaError_t run_sparse_sink_attention(const SparseSinkAttentionParams& p, cudaStream_t stream);

// The same attention on Hopper wgmma (sparse_sink_attention_wgmma.cu), same contract,
// workspace and split-K; its own FFI target, the default for bf16 and FP8 pools on sm_90
// (jax_dspark/ops/_kernels.py, AUTO_ATTENTION_KERNEL; JAX_DSPARK_ATTENTION_KERNEL=mma
// forces the other), and kernel_driver --wgmma. Validated on the H200 (docs/kernels.md).
// Two schedules: lockstep (every warp gathers, then computes) and, over long lists (FP8
// pools; bf16 pools of more than one head block), warp-specialised (a gathering, and for FP8
// expanding, warpgroup beside the two computing ones); use_warp_specialised in the .cu says
// why. One-split launches of more work items than SMs that either schedule's plain kernel
// would take with one tile a list or more (the lockstep one for bf16 pools, the
// warp-specialised one for FP8 pools) take persistent warp-specialised CTAs instead; bf16
// launches of empty lists persistent lockstep ones (use_persistent).
cudaError_t run_sparse_sink_attention_wgmma(const SparseSinkAttentionParams& p, cudaStream_t stream);

// One schedule forced for every launch: kernel_driver --wgmma-lockstep / --wgmma-ws, to
// validate and time both on the same shapes.
cudaError_t run_sparse_sink_attention_wgmma_lockstep(const SparseSinkAttentionParams& p, cudaStream_t stream);
cudaError_t run_sparse_sink_attention_wgmma_ws(const SparseSinkAttentionParams& p, cudaStream_t stream);
// One-split launches on min(items, SMs) persistent lockstep CTAs that load the next work
// item's Q and first tile while finishing the current one, for either pool kind (the
// dispatch above takes them for bf16 pools' empty lists only);
// launches of several splits as dispatched. kernel_driver --wgmma-persistent.
cudaError_t run_sparse_sink_attention_wgmma_persistent(const SparseSinkAttentionParams& p, cudaStream_t stream);
// One-split launches (of at least one tile) on min(items, SMs) persistent warp-specialised
// CTAs, whose producers load the next work item's Q and first tile while the consumers
// finish the current one (the dispatch above takes them for both pool kinds with more items
// than SMs); other launches as dispatched. kernel_driver --wgmma-ws-persistent.
cudaError_t run_sparse_sink_attention_wgmma_ws_persistent(const SparseSinkAttentionParams& p, cudaStream_t stream);
// How split partials are merged, forced (schedule as dispatched): in a thread-block cluster
// through distributed shared memory whenever 2 <= num_splits <= 8 (`_cluster`), or through
// global memory and the combine launch (`_combine`). The dispatch picks the cluster when its
// CTAs fit in as few waves as a plain launch's (use_cluster_merge in the .cu);
// kernel_driver --wgmma-cluster / --wgmma-combine validate and time each.
cudaError_t run_sparse_sink_attention_wgmma_cluster(const SparseSinkAttentionParams& p, cudaStream_t stream);
cudaError_t run_sparse_sink_attention_wgmma_combine(const SparseSinkAttentionParams& p, cudaStream_t stream);

#ifdef JAX_DSPARK_ATTENTION_PROBES
// Diagnostic launches for kernel_driver builds (never in the library): where the lockstep
// kernel's time goes. kGatherDepth1 / kGatherDepth2: its gather alone, one or two tiles in
// flight per CTA; kMathOnly: its compute alone (tiles after the first two are not loaded).
// The outputs are garbage; only the time means anything.
enum class AttnProbe { kGatherDepth1, kGatherDepth2, kMathOnly };
cudaError_t run_sparse_sink_attention_wgmma_probe(const SparseSinkAttentionParams& p, AttnProbe probe,
                                                  cudaStream_t stream);
#endif

#ifdef JAX_DSPARK_ATTENTION_TIMELINE
// Timeline builds of kernel_driver only (cmake -DJAX_DSPARK_ATTENTION_TIMELINE=ON): while a
// buffer is set, thread 0 of every wgmma attention CTA (any schedule; a persistent CTA: its
// last work item) records
// kAttnTimelineWords words at its linear block index: clock64 at eight marks (entry, Q and
// tile 0 issued (lockstep only), tile 0 ready, last tile done, lse known, output staged,
// stores begun, epilogue done; TimelineSlot in the .cu), %globaltimer (ns) at entry and exit,
// %smid and its tile count. `ctas` bounds the index; a null buffer turns it off.
constexpr int kAttnTimelineWords = 12;
cudaError_t set_attention_timeline(unsigned long long* buffer, int ctas);
// Experiment: the persistent kernel's CTAs with one work item fewer than the others spin this
// many cycles before their first (0: off).
cudaError_t set_persistent_late_start(long long cycles);
#endif

}  // namespace jds
