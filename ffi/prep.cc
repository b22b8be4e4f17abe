// XLA FFI handlers of the fused RMSNorm + RoPE (+ FP8) prep kernel. x may carry any leading
// shape; it is treated as [rows, D]. `weight` and `freqs` are indexed per group of rows, which
// is what `vmap_method="broadcast_all"` produces (batch axes outermost), so vmap needs no
// custom rule: weight [G, D] serves rows / G consecutive rows each, freqs [F, R/2, 2] serves
// rows / F consecutive rows each (e.g. the H heads of one position).
#include <cstdint>
#include <string>

#include "ffi/device.h"
#include "ffi/handlers.h"
#include "prep/params.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error bad(const std::string& msg) { return ffi::Error::InvalidArgument("jax_dspark_rms_norm_rope: " + msg); }

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Fills everything but the outputs; validates shapes and dtypes the kernel relies on.
ffi::Error bind_common(float eps, int32_t inverse, int32_t rope_dim, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                       ffi::AnyBuffer freqs, jds::RmsNormRopeParams& p) {
  using DT = ffi::DataType;
  auto xd = x.dimensions();
  if (xd.size() < 1) return bad("x must have rank >= 1");
  if (x.element_type() == DT::BF16)
    p.dtype = jds::PrepDType::kBF16;
  else if (x.element_type() == DT::F32)
    p.dtype = jds::PrepDType::kF32;
  else
    return bad("x must be bf16 or f32");
  const int64_t D = xd[xd.size() - 1];
  if (D <= 0 || D % 8 != 0 || D > jds::kPrepMaxDim)
    return bad("last dim must be a positive multiple of 8 and <= 2048, got " + std::to_string(D));
  const int64_t rows = int64_t(x.element_count()) / D;
  if (rope_dim < 0 || rope_dim % 8 != 0 || rope_dim > D)
    return bad("rope_dim must be a multiple of 8 in [0, D], got " + std::to_string(rope_dim));
  // An empty weight means none (RMSNorm without a gain): nothing to read per row.
  if (weight.element_type() != DT::F32 || int64_t(weight.element_count()) % D != 0)
    return bad("weight must be f32 [G, D] (or empty for no weight)");
  const int64_t groups = int64_t(weight.element_count()) / D;
  if (groups > 0 && rows % groups != 0) return bad("weight groups must divide the rows");
  int64_t freq_rows = 1;
  if (rope_dim > 0) {
    if (freqs.element_type() != DT::F32 || freqs.element_count() == 0 ||
        int64_t(freqs.element_count()) % rope_dim != 0)
      return bad("freqs must be f32 [F, rope_dim / 2, 2]");
    freq_rows = int64_t(freqs.element_count()) / rope_dim;
    if (rows % freq_rows != 0) return bad("freqs rows must divide the rows of x");
  }
  // The kernels move rows in 16-byte vectors (and bulk copies): every base address must be
  // 16-byte aligned (XLA's buffers are; a misaligned one would fault, not compute).
  if (!aligned16(x.untyped_data()) || (groups > 0 && !aligned16(weight.untyped_data())) ||
      (rope_dim > 0 && !aligned16(freqs.untyped_data())))
    return bad("x, weight and freqs must be 16-byte aligned");
  p.x = x.untyped_data();
  p.weight = groups > 0 ? static_cast<const float*>(weight.untyped_data()) : nullptr;
  p.freqs = rope_dim > 0 ? static_cast<const float*>(freqs.untyped_data()) : nullptr;
  p.rows = rows;
  p.dim = int(D);
  p.rope_dim = rope_dim;
  p.weight_groups = rows > 0 && groups > 0 ? groups : 1;
  p.freq_rows = rows > 0 ? freq_rows : 1;
  p.inverse = inverse != 0;
  p.eps = eps;
  p.sms = sm_count_of_current_device();
  p.half_warp_rows = 1;  // half a warp per row where the layout allows (docs/kernels.md, "Prep kernel")
  return ffi::Error::Success();
}

ffi::Error launch(const jds::RmsNormRopeParams& p, cudaStream_t stream) {
  const cudaError_t err = jds::run_rms_norm_rope(p, stream);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("jax_dspark_rms_norm_rope: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error RmsNormRopeImpl(cudaStream_t stream, float eps, int32_t inverse, int32_t rope_dim, ffi::AnyBuffer x,
                           ffi::AnyBuffer weight, ffi::AnyBuffer freqs, ffi::Result<ffi::AnyBuffer> y) {
  jds::RmsNormRopeParams p{};
  if (auto e = bind_common(eps, inverse, rope_dim, x, weight, freqs, p); e.failure()) return e;
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count())
    return bad("y must match x in dtype and size");
  if (!aligned16(y->untyped_data())) return bad("y must be 16-byte aligned");
  p.y = y->untyped_data();
  p.exps = nullptr;
  p.fp8_block = 0;
  return launch(p, stream);
}

ffi::Error RmsNormRopeFp8Impl(cudaStream_t stream, float eps, int32_t inverse, int32_t rope_dim, int32_t fp8_block,
                              ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer freqs,
                              ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> exps) {
  jds::RmsNormRopeParams p{};
  if (auto e = bind_common(eps, inverse, rope_dim, x, weight, freqs, p); e.failure()) return e;
  if (fp8_block != 64 && fp8_block != 128) return bad("fp8_block must be 64 or 128, got " + std::to_string(fp8_block));
  if (p.dim % fp8_block != 0) return bad("last dim must be a multiple of fp8_block");
  if (values->element_type() != ffi::DataType::F8E4M3FN || values->element_count() != x.element_count())
    return bad("values must be float8_e4m3fn with x's size");
  if (exps->element_type() != ffi::DataType::U8 ||
      int64_t(exps->element_count()) != p.rows * (p.dim / fp8_block))
    return bad("exps must be uint8 [rows, D / fp8_block]");
  if (!aligned16(values->untyped_data())) return bad("values must be 16-byte aligned");
  p.y = values->untyped_data();
  p.exps = static_cast<uint8_t*>(exps->untyped_data());
  p.fp8_block = fp8_block;
  return launch(p, stream);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkRmsNormRope, RmsNormRopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("inverse")
                                  .Attr<int32_t>("rope_dim")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkRmsNormRopeFp8, RmsNormRopeFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("inverse")
                                  .Attr<int32_t>("rope_dim")
                                  .Attr<int32_t>("fp8_block")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
