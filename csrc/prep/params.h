// Parameter block of the fused RMSNorm + interleaved RoPE (+ FP8 e4m3) prep kernel.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace jds {

constexpr int kPrepMaxDim = 2048;  // a warp keeps one row in registers (8 chunks of 256)

enum class PrepDType : int { kBF16 = 0, kF32 = 1 };

struct RmsNormRopeParams {
  const void* x;       // [rows, dim], bf16 or f32
  const float* weight; // [weight_groups, dim]; row r uses group r / (rows / weight_groups); null: no weight
  const float* freqs;  // [freq_rows, rope_dim / 2, 2] (cos, sin); row r uses r / (rows / freq_rows)
  void* y;             // [rows, dim] in x's dtype (fp8_block == 0) or f8e4m3 values
  uint8_t* exps;       // [rows, dim / fp8_block] UE8M0 exponents (fp8_block > 0)
  int64_t rows;
  int dim;             // D, multiple of 8, <= kPrepMaxDim
  int rope_dim;        // R, multiple of 8, <= D (0 = no RoPE)
  int64_t weight_groups;
  int64_t freq_rows;
  int inverse;         // 1: rotate by -theta
  int fp8_block;       // 0 (no quantisation), 64 or 128
  float eps;
  PrepDType dtype;
  int sms;             // multiprocessors of the device (sizes the persistent grid; 0 = one block per 8 rows)
  int half_warp_rows;  // 1: rows of <= 1 KB go half a warp each where the layout allows (the FFI
                       // handlers set it; kernel_driver without --prep-half leaves it 0)
  int64_t rows_per_weight_group;  // set by run_rms_norm_rope: rows / weight_groups
  int64_t rows_per_freq_row;      // set by run_rms_norm_rope: rows / freq_rows
  // set at the stream kernel's launch, for its row stride (8 x grid): stride / and % per group
  int64_t weight_step_q, weight_step_r, freq_step_q, freq_step_r;
};

cudaError_t run_rms_norm_rope(const RmsNormRopeParams& p, cudaStream_t stream);

}  // namespace jds
