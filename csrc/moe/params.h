// Plain parameter blocks and launchers of the mixture-of-experts kernels: pointers, sizes,
// no framework types, so an XLA FFI handler (or any other host code) can fill them and call
// the launchers. Layouts follow docs/interfaces.md: w_gate_up [E, d, 2I] (gate = first I
// columns), w_down [E, I, d], everything row-major.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace jds {

constexpr int kMoeMaxExperts = 4096;  // permute keeps two int32 counters per expert in shared memory
constexpr int kMoeRouteMaxExperts = 1024;  // route keeps E / 32 scores per lane in registers
constexpr int kMoeRouteMaxK = 32;
constexpr int kMoeFp8Block = 128;  // FP8 scale blocks: 1x128 activations, 128x128 weights

enum MoeScoreKind : int {
  kMoeScoreSqrtSoftplus = 0,  // sqrt(softplus(l)), DeepSeek-V4
  kMoeScoreSigmoid = 1,       // sigmoid(l), DeepSeek-V3
  kMoeScoreSoftmax = 2,       // softmax over the experts
  kMoeScoreIdentity = 3,      // the input already holds scores
};

// Router: scores from logits, top-k of (scores + bias) or a token -> experts table, and
// combine weights = unbiased scores of the chosen experts (renormalised) x route_scale.
struct MoeRouteParams {
  const void* logits;        // [T, E], f32 or bf16 (logits_bf16)
  const float* bias;         // [E] selection-only bias, or null
  const int32_t* token_ids;  // [T] (hash routing) or null (top-k routing)
  const int32_t* table;      // [vocab, k] token -> experts (hash routing)
  float* weights;            // [T, k]
  int32_t* ids;              // [T, k]
  int64_t tokens;            // T
  int64_t vocab;             // rows of `table`
  int experts;               // E <= kMoeRouteMaxExperts
  int k;                     // 1 <= k <= min(E, kMoeRouteMaxK)
  int score_kind;            // MoeScoreKind
  bool logits_bf16;
  bool renormalize;
  float route_scale;
};

cudaError_t run_moe_route(const MoeRouteParams& p, cudaStream_t stream);

// Routed experts, BF16: permute -> gather -> grouped FC1 -> clamped SwiGLU -> grouped FC2 ->
// weighted un-permute. All intermediates live in one caller-provided workspace.
struct MoeExpertsParams {
  const void* x;          // bf16 [T, d]
  const int32_t* ids;     // [T, k]; ids outside [0, E) are dropped (no memory is touched)
  const float* weights;   // [T, k]
  const void* w_gate_up;  // bf16 [E, d, 2I]
  const void* w_down;     // bf16 [E, I, d]
  void* out;              // bf16 [T, d]
  int64_t tokens;         // T
  int k;                  // slots per token
  int experts;            // E <= kMoeMaxExperts
  int hidden;             // d, multiple of 8 (16-byte rows for the copy engine)
  int inter;              // I, multiple of 8
  float limit;            // SwiGLU clamp; <= 0 means none
  int sm_count;           // multiprocessors of the device (persistent GEMM grid)
};

// Bytes of workspace `run_moe_experts` needs (the workspace must be 16-byte aligned).
size_t moe_experts_workspace_bytes(int64_t tokens, int k, int experts, int hidden, int inter,
                                   int sm_count);

cudaError_t run_moe_experts(const MoeExpertsParams& p, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream);

// ---- pieces, exposed for the grouped GEMM file and for tests --------------------------

// Counting sort of the T*k (token, slot) pairs by expert. Writes offsets[E + 1] (exclusive
// prefix sum of the per-expert counts; offsets[E] = valid pairs), row_of_pair[T*k] (its row in
// expert-contiguous order, -1 for an out-of-range id) and token_of_row[T*k] (first offsets[E]
// entries valid). Rows of one expert are contiguous and not padded: the grouped GEMM builds one
// copy-engine descriptor per expert, so a tile never reads another expert's rows.
cudaError_t run_moe_permute(const int32_t* ids, int64_t pairs, int k, int experts,
                            int32_t* offsets, int32_t* row_of_pair, int32_t* token_of_row,
                            cudaStream_t stream);

// Grouped GEMM D_e = A_e @ B_e for every expert e: A rows [offsets[e], offsets[e+1]) of a
// row-major [*, K] bf16 matrix, B_e = b + e*K*N row-major [K, N] bf16, D rows likewise of a
// row-major [*, N] bf16 matrix. Group arrays and the GEMM's own workspace live in `workspace`.
size_t moe_grouped_gemm_workspace_bytes(int experts, int sm_count);

// `rows_hint` (total rows over all experts, known on the host) picks the tile height: 64-row
// ping-pong tiles for decode-sized groups, 128-row cooperative tiles for prefill-sized ones.
cudaError_t run_moe_grouped_gemm(const void* a, const void* b, void* d, const int32_t* offsets,
                                 int experts, int n, int k, int64_t rows_hint, int sm_count,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Routed experts, FP8 (DeepSeek's recipe): permute -> gather + quantise x per 1x128 ->
// grouped block-scaled FC1 -> clamped SwiGLU + quantise per 1x128 -> grouped block-scaled
// FC2 -> weighted un-permute. Weights are e4m3 [E, N, K] (K contiguous, "out x in") with one
// UE8M0 byte per 128x128 block, [E, N/128, K/128]; a byte b means the scale 2^(b - 127).
// Activation scales are powers of two, 2^ceil(log2(max(amax, 1e-4) / 448)), as in
// jax_dspark/ops/fp8.py. FC outputs are bf16, accumulation f32.
struct MoeExpertsFp8Params {
  const void* x;             // bf16 [T, d]
  const int32_t* ids;        // [T, k]; ids outside [0, E) are dropped
  const float* weights;      // [T, k]
  const void* w_gate_up;     // e4m3 [E, 2I, d] (gate = first I rows)
  const uint8_t* s_gate_up;  // [E, 2I/128, d/128]
  const void* w_down;        // e4m3 [E, d, I]
  const uint8_t* s_down;     // [E, d/128, I/128]
  void* out;                 // bf16 [T, d]
  int64_t tokens;            // T
  int k;
  int experts;               // E <= kMoeMaxExperts
  int hidden;                // d, multiple of 128
  int inter;                 // I, multiple of 128
  float limit;               // SwiGLU clamp; <= 0 means none
  int sm_count;
};

size_t moe_experts_fp8_workspace_bytes(int64_t tokens, int k, int experts, int hidden, int inter,
                                       int sm_count);

cudaError_t run_moe_experts_fp8(const MoeExpertsFp8Params& p, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream);

// out[t] = bf16(sum_j weights[t, j] * y[row_of_pair[t, j]]) (f32, slot order; rows < 0 skipped).
cudaError_t run_moe_unpermute(const void* y, const int32_t* row_of_pair, const float* weights,
                              int64_t tokens, int k, int hidden, void* out, cudaStream_t stream);

// Grouped block-scaled FP8 GEMM D_e = (A_e * SFA) @ (B_e * SFB)^T: A rows [offsets[e],
// offsets[e+1]) of a row-major e4m3 [*, K] matrix, B_e = b + e*N*K e4m3 [N, K] (K contiguous),
// D rows of a row-major bf16 [*, N] matrix. Scale layouts: csrc/moe/grouped_gemm_fp8.cu.
size_t moe_grouped_gemm_fp8_workspace_bytes(int experts, int sm_count);

cudaError_t run_moe_grouped_gemm_fp8(const void* a, const float* sfa, const void* b, const float* sfb,
                                     void* d, const int32_t* offsets, int experts, int n, int k,
                                     int64_t rows_hint, int sm_count, void* workspace,
                                     size_t workspace_bytes, cudaStream_t stream);

#ifdef JAX_DSPARK_MOE_PROBES
// Diagnostic builds only (csrc/tools/moe_driver.cu): the grouped GEMMs under alternative
// CUTLASS configurations (tile, cluster, raster order), config 0 and 1 being the release
// prefill and decode ones. Same operands and layouts as run_moe_grouped_gemm_fp8.
int moe_grouped_gemm_fp8_probe_count();
const char* moe_grouped_gemm_fp8_probe_name(int config);
size_t moe_grouped_gemm_fp8_probe_workspace_bytes(int experts, int sm_count);
cudaError_t run_moe_grouped_gemm_fp8_probe(int config, const void* a, const float* sfa, const void* b,
                                           const float* sfb, void* d, const int32_t* offsets, int experts, int n,
                                           int k, int sm_count, void* workspace, size_t workspace_bytes,
                                           cudaStream_t stream);
// The same for the BF16 grouped GEMM (run_moe_grouped_gemm's operands and layouts).
int moe_grouped_gemm_probe_count();
const char* moe_grouped_gemm_probe_name(int config);
size_t moe_grouped_gemm_probe_workspace_bytes(int experts, int sm_count);
cudaError_t run_moe_grouped_gemm_probe(int config, const void* a, const void* b, void* d, const int32_t* offsets,
                                       int experts, int n, int k, int sm_count, void* workspace,
                                       size_t workspace_bytes, cudaStream_t stream);
#endif

}  // namespace jds
