// XLA FFI handlers of the mixture-of-experts kernels: they check what could make a kernel
// touch memory it does not own (ranks, dtypes, sizes, workspace size), fill the plain params
// structs of csrc/moe/params.h and call the launchers. Nothing here allocates or
// synchronises, so XLA may capture the calls in a CUDA graph. The routed-experts workspace is
// an XLA-allocated output (not a scratch allocation) so its address is stable under capture
// and replay; the Python wrapper sizes it with `moe_experts_workspace_bound`.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "ffi/device.h"
#include "ffi/moe_handlers.h"
#include "moe/params.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error bad(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + msg);
}

ffi::Error from_cuda(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(err));
}

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

constexpr const char* kExperts = "jax_dspark_moe_experts";
constexpr const char* kRoute = "jax_dspark_moe_route";
constexpr const char* kExpertsFp8 = "jax_dspark_moe_experts_fp8";

// Token-side operands of both experts handlers: x bf16 [T, d], ids s32 [T, k], weights f32
// [T, k], out bf16 like x. Fills T, d, k.
ffi::Error check_tokens(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                        ffi::Result<ffi::AnyBuffer>& out, int64_t& T, int64_t& d, int64_t& k) {
  using DT = ffi::DataType;
  auto xd = x.dimensions(), idd = ids.dimensions(), wd = weights.dimensions();
  if (xd.size() != 2) return bad(op, "x must be [T, d], got " + dims_str(xd));
  T = xd[0];
  d = xd[1];
  if (idd.size() != 2 || idd[0] != T) return bad(op, "ids must be [T, k], got " + dims_str(idd));
  k = idd[1];
  if (wd.size() != 2 || wd[0] != T || wd[1] != k)
    return bad(op, "weights must be [T, k] like ids, got " + dims_str(wd));
  if (x.element_type() != DT::BF16 || out->element_type() != DT::BF16) return bad(op, "x and out must be bf16");
  if (ids.element_type() != DT::S32) return bad(op, "ids must be int32");
  if (weights.element_type() != DT::F32) return bad(op, "weights must be f32");
  if (out->element_count() != x.element_count()) return bad(op, "out must be [T, d]");
  return ffi::Error::Success();
}

ffi::Error check_counts(const char* op, int64_t E, int64_t T, int64_t k) {
  if (E < 1 || E > jds::kMoeMaxExperts)
    return bad(op, "E must be in [1, " + std::to_string(jds::kMoeMaxExperts) + "], got " + std::to_string(E));
  if (k < 1 || T * k > INT32_MAX) return bad(op, "need k >= 1 and T*k < 2^31");
  return ffi::Error::Success();
}

// The fields both params structs share; sm_count 0 means no device.
template <class Params>
void fill_common(Params& p, float limit, ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                 ffi::Result<ffi::AnyBuffer>& out, int64_t T, int64_t k, int64_t E, int64_t d, int64_t I) {
  p.x = x.untyped_data();
  p.ids = static_cast<const int32_t*>(ids.untyped_data());
  p.weights = static_cast<const float*>(weights.untyped_data());
  p.out = out->untyped_data();
  p.tokens = T;
  p.k = int(k);
  p.experts = int(E);
  p.hidden = int(d);
  p.inter = int(I);
  p.limit = limit;
  p.sm_count = sm_count_of_current_device();
}

ffi::Error check_workspace(const char* op, size_t need, ffi::Result<ffi::AnyBuffer>& workspace) {
  const size_t have = workspace->size_bytes();
  if (have < need) return bad(op, "workspace has " + std::to_string(have) + " bytes, needs " + std::to_string(need));
  return ffi::Error::Success();
}

ffi::Error MoeExpertsImpl(cudaStream_t stream, float limit, ffi::AnyBuffer x, ffi::AnyBuffer ids,
                          ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  using DT = ffi::DataType;
  int64_t T, d, k;
  if (auto err = check_tokens(kExperts, x, ids, weights, out, T, d, k); err.failure()) return err;
  auto gd = w_gate_up.dimensions(), dd = w_down.dimensions();
  if (gd.size() != 3 || gd[1] != d || gd[2] % 2)
    return bad(kExperts, "w_gate_up must be [E, d, 2I], got " + dims_str(gd));
  const int64_t E = gd[0], I = gd[2] / 2;
  if (dd.size() != 3 || dd[0] != E || dd[1] != I || dd[2] != d)
    return bad(kExperts, "w_down must be [E, I, d], got " + dims_str(dd));
  if (w_gate_up.element_type() != DT::BF16 || w_down.element_type() != DT::BF16)
    return bad(kExperts, "x, w_gate_up, w_down and out must be bf16");
  if (d % 8 || I % 8 || d <= 0 || I <= 0)
    return bad(kExperts, "d and I must be positive multiples of 8, got d=" + std::to_string(d) +
                             " I=" + std::to_string(I));
  if (auto err = check_counts(kExperts, E, T, k); err.failure()) return err;
  if (T == 0) return ffi::Error::Success();

  jds::MoeExpertsParams p{};
  fill_common(p, limit, x, ids, weights, out, T, k, E, d, I);
  p.w_gate_up = w_gate_up.untyped_data();
  p.w_down = w_down.untyped_data();
  if (p.sm_count <= 0) return ffi::Error::Internal(std::string(kExperts) + ": no CUDA device");
  const size_t need = jds::moe_experts_workspace_bytes(T, p.k, p.experts, p.hidden, p.inter, p.sm_count);
  if (auto err = check_workspace(kExperts, need, workspace); err.failure()) return err;
  return from_cuda(kExperts, jds::run_moe_experts(p, workspace->untyped_data(), workspace->size_bytes(), stream));
}

// FP8 experts: weights e4m3 [E, N, K] (K contiguous) with UE8M0 bytes per 128x128 block.
ffi::Error MoeExpertsFp8Impl(cudaStream_t stream, float limit, ffi::AnyBuffer x, ffi::AnyBuffer ids,
                             ffi::AnyBuffer weights, ffi::AnyBuffer w_gate_up, ffi::AnyBuffer s_gate_up,
                             ffi::AnyBuffer w_down, ffi::AnyBuffer s_down, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> workspace) {
  using DT = ffi::DataType;
  constexpr int64_t B = jds::kMoeFp8Block;
  int64_t T, d, k;
  if (auto err = check_tokens(kExpertsFp8, x, ids, weights, out, T, d, k); err.failure()) return err;
  auto gd = w_gate_up.dimensions(), gsd = s_gate_up.dimensions();
  auto dd = w_down.dimensions(), dsd = s_down.dimensions();
  if (gd.size() != 3 || gd[2] != d || gd[1] % 2)
    return bad(kExpertsFp8, "w_gate_up must be [E, 2I, d], got " + dims_str(gd));
  const int64_t E = gd[0], I = gd[1] / 2;
  if (dd.size() != 3 || dd[0] != E || dd[1] != d || dd[2] != I)
    return bad(kExpertsFp8, "w_down must be [E, d, I], got " + dims_str(dd));
  if (d <= 0 || I <= 0 || d % B || I % B)
    return bad(kExpertsFp8, "d and I must be positive multiples of 128, got d=" + std::to_string(d) +
                                " I=" + std::to_string(I));
  if (gsd.size() != 3 || gsd[0] != E || gsd[1] != 2 * I / B || gsd[2] != d / B)
    return bad(kExpertsFp8, "s_gate_up must be [E, 2I/128, d/128], got " + dims_str(gsd));
  if (dsd.size() != 3 || dsd[0] != E || dsd[1] != d / B || dsd[2] != I / B)
    return bad(kExpertsFp8, "s_down must be [E, d/128, I/128], got " + dims_str(dsd));
  if (w_gate_up.element_type() != DT::F8E4M3FN || w_down.element_type() != DT::F8E4M3FN)
    return bad(kExpertsFp8, "w_gate_up and w_down must be float8_e4m3fn");
  if (s_gate_up.element_type() != DT::U8 || s_down.element_type() != DT::U8)
    return bad(kExpertsFp8, "s_gate_up and s_down must be uint8 (UE8M0)");
  if (auto err = check_counts(kExpertsFp8, E, T, k); err.failure()) return err;
  if (T == 0) return ffi::Error::Success();

  jds::MoeExpertsFp8Params p{};
  fill_common(p, limit, x, ids, weights, out, T, k, E, d, I);
  p.w_gate_up = w_gate_up.untyped_data();
  p.s_gate_up = static_cast<const uint8_t*>(s_gate_up.untyped_data());
  p.w_down = w_down.untyped_data();
  p.s_down = static_cast<const uint8_t*>(s_down.untyped_data());
  if (p.sm_count <= 0) return ffi::Error::Internal(std::string(kExpertsFp8) + ": no CUDA device");
  const size_t need = jds::moe_experts_fp8_workspace_bytes(T, p.k, p.experts, p.hidden, p.inter, p.sm_count);
  if (auto err = check_workspace(kExpertsFp8, need, workspace); err.failure()) return err;
  return from_cuda(kExpertsFp8,
                   jds::run_moe_experts_fp8(p, workspace->untyped_data(), workspace->size_bytes(), stream));
}

// Shared by top-k and hash routing: logits (or scores) [T, E] f32/bf16 -> weights f32 [T, k],
// ids s32 [T, k].
ffi::Error bind_route(int32_t score_kind, int32_t renormalize, float route_scale, ffi::AnyBuffer logits,
                      ffi::Result<ffi::AnyBuffer>& weights, ffi::Result<ffi::AnyBuffer>& ids,
                      jds::MoeRouteParams& p) {
  using DT = ffi::DataType;
  auto ld = logits.dimensions(), wd = weights->dimensions(), idd = ids->dimensions();
  if (ld.size() != 2) return bad(kRoute, "logits must be [T, E], got " + dims_str(ld));
  if (logits.element_type() != DT::F32 && logits.element_type() != DT::BF16)
    return bad(kRoute, "logits must be f32 or bf16");
  const int64_t T = ld[0], E = ld[1];
  if (wd.size() != 2 || wd[0] != T || weights->element_type() != DT::F32)
    return bad(kRoute, "weights must be f32 [T, k]");
  const int64_t k = wd[1];
  if (idd.size() != 2 || idd[0] != T || idd[1] != k || ids->element_type() != DT::S32)
    return bad(kRoute, "ids must be int32 [T, k]");
  if (E < 1 || E > jds::kMoeRouteMaxExperts)
    return bad(kRoute, "E must be in [1, " + std::to_string(jds::kMoeRouteMaxExperts) + "], got " + std::to_string(E));
  if (k < 1 || k > jds::kMoeRouteMaxK) return bad(kRoute, "k must be in [1, 32], got " + std::to_string(k));
  if (score_kind < jds::kMoeScoreSqrtSoftplus || score_kind > jds::kMoeScoreIdentity)
    return bad(kRoute, "unknown score_kind " + std::to_string(score_kind));
  p.logits = logits.untyped_data();
  p.logits_bf16 = logits.element_type() == DT::BF16;
  p.weights = static_cast<float*>(weights->untyped_data());
  p.ids = static_cast<int32_t*>(ids->untyped_data());
  p.tokens = T;
  p.experts = int(E);
  p.k = int(k);
  p.score_kind = score_kind;
  p.renormalize = renormalize != 0;
  p.route_scale = route_scale;
  return ffi::Error::Success();
}

ffi::Error MoeRouteImpl(cudaStream_t stream, int32_t score_kind, int32_t renormalize, float route_scale,
                        int32_t has_bias, ffi::AnyBuffer logits, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> weights, ffi::Result<ffi::AnyBuffer> ids) {
  jds::MoeRouteParams p{};
  if (auto e = bind_route(score_kind, renormalize, route_scale, logits, weights, ids, p); e.failure()) return e;
  if (p.k > p.experts) return bad(kRoute, "k must be <= E");
  if (has_bias) {
    if (bias.element_type() != ffi::DataType::F32 || int64_t(bias.element_count()) != p.experts)
      return bad(kRoute, "bias must be f32 [E]");
    p.bias = static_cast<const float*>(bias.untyped_data());
  }
  return from_cuda(kRoute, jds::run_moe_route(p, stream));
}

ffi::Error MoeHashRouteImpl(cudaStream_t stream, int32_t score_kind, int32_t renormalize, float route_scale,
                            ffi::AnyBuffer logits, ffi::AnyBuffer token_ids, ffi::AnyBuffer table,
                            ffi::Result<ffi::AnyBuffer> weights, ffi::Result<ffi::AnyBuffer> ids) {
  jds::MoeRouteParams p{};
  if (auto e = bind_route(score_kind, renormalize, route_scale, logits, weights, ids, p); e.failure()) return e;
  auto td = table.dimensions();
  if (token_ids.element_type() != ffi::DataType::S32 || int64_t(token_ids.element_count()) != p.tokens)
    return bad(kRoute, "token_ids must be int32 [T]");
  if (table.element_type() != ffi::DataType::S32 || td.size() != 2 || td[1] != p.k || td[0] < 1)
    return bad(kRoute, "table must be int32 [V >= 1, k], got " + dims_str(td));
  p.token_ids = static_cast<const int32_t*>(token_ids.untyped_data());
  p.table = static_cast<const int32_t*>(table.untyped_data());
  p.vocab = td[0];
  return from_cuda(kRoute, jds::run_moe_route(p, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkMoeExperts, MoeExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("limit")
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // ids
                                  .Arg<ffi::AnyBuffer>()   // weights
                                  .Arg<ffi::AnyBuffer>()   // w_gate_up
                                  .Arg<ffi::AnyBuffer>()   // w_down
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>(),  // workspace
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkMoeRoute, MoeRouteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int32_t>("score_kind")
                                  .Attr<int32_t>("renormalize")
                                  .Attr<float>("route_scale")
                                  .Attr<int32_t>("has_bias")
                                  .Arg<ffi::AnyBuffer>()   // logits / scores
                                  .Arg<ffi::AnyBuffer>()   // bias
                                  .Ret<ffi::AnyBuffer>()   // weights
                                  .Ret<ffi::AnyBuffer>(),  // ids
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkMoeHashRoute, MoeHashRouteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int32_t>("score_kind")
                                  .Attr<int32_t>("renormalize")
                                  .Attr<float>("route_scale")
                                  .Arg<ffi::AnyBuffer>()   // logits / scores
                                  .Arg<ffi::AnyBuffer>()   // token_ids
                                  .Arg<ffi::AnyBuffer>()   // table
                                  .Ret<ffi::AnyBuffer>()   // weights
                                  .Ret<ffi::AnyBuffer>(),  // ids
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkMoeExpertsFp8, MoeExpertsFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("limit")
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // ids
                                  .Arg<ffi::AnyBuffer>()   // weights
                                  .Arg<ffi::AnyBuffer>()   // w_gate_up values
                                  .Arg<ffi::AnyBuffer>()   // w_gate_up UE8M0 exponents
                                  .Arg<ffi::AnyBuffer>()   // w_down values
                                  .Arg<ffi::AnyBuffer>()   // w_down UE8M0 exponents
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>(),  // workspace
                              {ffi::Traits::kCmdBufferCompatible});
