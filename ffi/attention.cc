// XLA FFI handler of the sparse sink attention kernel: binds buffers and attributes to the
// params struct, re-checks everything that could make the kernel touch memory it does not
// own, and launches. No allocation, no synchronisation: the split-K workspace is an output
// buffer that XLA assigns with the executable, so the call can be captured into a command
// buffer and replayed.
#include <cstdint>
#include <string>

#include "attention/params.h"
#include "ffi/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error bad(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_dspark_sparse_sink_attention: " + msg);
}

ffi::Error SparseSinkAttentionImpl(cudaStream_t stream, float scale, int32_t num_splits, int32_t has_sink,
                                   int32_t rope_dim, ffi::AnyBuffer q, ffi::AnyBuffer main_rows,
                                   ffi::AnyBuffer main_idx, ffi::AnyBuffer extra_rows, ffi::AnyBuffer extra_idx,
                                   ffi::AnyBuffer sink, ffi::AnyBuffer inv_rope, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace) {
  using DT = ffi::DataType;
  const int64_t D = jds::kAttnHeadDim;
  auto qd = q.dimensions();
  if (q.element_type() != DT::BF16 || qd.size() != 4 || qd[3] != D)
    return bad("q must be bf16 [B, S, H, 512], got " + dims_str(qd));
  const int64_t B = qd[0], S = qd[1], H = qd[2];
  auto check_rows = [&](ffi::AnyBuffer rows, const char* name) -> ffi::Error {
    auto d = rows.dimensions();
    if (rows.element_type() != DT::BF16 || d.size() != 2 || d[1] != D)
      return bad(std::string(name) + " must be bf16 [N, 512], got " + dims_str(d));
    return ffi::Error::Success();
  };
  auto check_idx = [&](ffi::AnyBuffer idx, const char* name) -> ffi::Error {
    auto d = idx.dimensions();
    if (idx.element_type() != DT::S32 || d.size() != 3 || d[0] != B || d[1] != S)
      return bad(std::string(name) + " must be int32 [B, S, K] matching q, got " + dims_str(d));
    return ffi::Error::Success();
  };
  if (auto e = check_rows(main_rows, "main_rows"); e.failure()) return e;
  if (auto e = check_rows(extra_rows, "extra_rows"); e.failure()) return e;
  if (auto e = check_idx(main_idx, "main_idx"); e.failure()) return e;
  if (auto e = check_idx(extra_idx, "extra_idx"); e.failure()) return e;
  const int64_t K = main_idx.dimensions()[2], K2 = extra_idx.dimensions()[2];
  if (K + K2 > INT32_MAX / 2) return bad("index lists too long: " + std::to_string(K + K2));
  if (B > 65535 || S * ((H + 63) / 64) > INT32_MAX) return bad("grid too large for B = " + std::to_string(B));
  if (num_splits < 1 || num_splits > jds::kAttnMaxSplits)
    return bad("num_splits must be in [1, 32], got " + std::to_string(num_splits));
  if (has_sink && (sink.element_type() != DT::F32 || int64_t(sink.element_count()) != H))
    return bad("sink must be f32 [H = " + std::to_string(H) + "], got " + dims_str(sink.dimensions()));
  if (rope_dim < 0 || rope_dim > D || rope_dim % 2 != 0)
    return bad("rope_dim must be even and in [0, 512], got " + std::to_string(rope_dim));
  if (rope_dim > 0 && (inv_rope.element_type() != DT::F32 || int64_t(inv_rope.element_count()) != B * S * rope_dim))
    return bad("inverse_rope must be f32 [B, S, rope_dim / 2, 2], got " + dims_str(inv_rope.dimensions()));
  if (out->element_type() != DT::BF16 || int64_t(out->element_count()) != B * S * H * D)
    return bad("out must be bf16 [B, S, H, 512], got " + dims_str(out->dimensions()));
  if (lse->element_type() != DT::F32 || int64_t(lse->element_count()) != B * S * H)
    return bad("lse must be f32 [B, S, H], got " + dims_str(lse->dimensions()));
  const int64_t ws_need = jds::attn_workspace_floats(int(B), int(S), int(H), num_splits);
  if (workspace->element_type() != DT::F32 || int64_t(workspace->element_count()) < ws_need)
    return bad("workspace must be f32 with at least " + std::to_string(ws_need) + " elements for num_splits = " +
               std::to_string(num_splits) + ", got " + dims_str(workspace->dimensions()));

  jds::SparseSinkAttentionParams p{};
  p.q = q.untyped_data();
  p.main_rows = main_rows.untyped_data();
  p.main_idx = static_cast<const int32_t*>(main_idx.untyped_data());
  p.extra_rows = extra_rows.untyped_data();
  p.extra_idx = static_cast<const int32_t*>(extra_idx.untyped_data());
  p.sink = has_sink ? static_cast<const float*>(sink.untyped_data()) : nullptr;
  p.inv_rope = rope_dim > 0 ? static_cast<const float*>(inv_rope.untyped_data()) : nullptr;
  p.out = out->untyped_data();
  p.lse = static_cast<float*>(lse->untyped_data());
  float* ws = static_cast<float*>(workspace->untyped_data());
  p.partial_out = num_splits > 1 ? ws : nullptr;
  p.partial_lse = num_splits > 1 ? ws + int64_t(num_splits) * B * S * H * D : nullptr;
  p.batch = int(B);
  p.seq = int(S);
  p.heads = int(H);
  p.n_main = main_rows.dimensions()[0];
  p.n_extra = extra_rows.dimensions()[0];
  p.k_main = int(K);
  p.k_extra = int(K2);
  p.num_splits = num_splits;
  p.rope_dim = rope_dim;
  p.scale = scale;
  const cudaError_t err = jds::run_sparse_sink_attention(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_dspark_sparse_sink_attention: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkSparseSinkAttention, SparseSinkAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("num_splits")
                                  .Attr<int32_t>("has_sink")
                                  .Attr<int32_t>("rope_dim")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
