// XLA FFI handler of the sparse sink attention kernel: binds buffers and attributes to the
// params struct, re-checks everything that could make the kernel touch memory it does not
// own, and launches. No allocation, no synchronisation: the split-K workspace is an output
// buffer that XLA assigns with the executable, so the call can be captured into a command
// buffer and replayed.
//
// Either pool may be FP8 (attributes main_fp8 / extra_fp8): its rows buffer is then e4m3
// [N, 448] and the pool's RoPE dims (bf16 [N, 64]) and scale bytes (uint8 [N, 8]) come as
// their own operands; for a bf16 pool those two operands are unused (pass empty arrays).
//
// Two targets share this handler: jax_dspark_sparse_sink_attention (the mma.sync kernel)
// and jax_dspark_sparse_sink_attention_wgmma (the wgmma kernel). Both take bf16 or FP8
// pools; Python picks the target per call (ops/_kernels.attention_target, docs/kernels.md).
#include <cstdint>
#include <string>
#include <utility>

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

template <bool kWgmma>
ffi::Error SparseSinkAttentionImpl(cudaStream_t stream, float scale, int32_t num_splits, int32_t has_sink,
                                   int32_t rope_dim, int32_t main_fp8, int32_t extra_fp8, ffi::AnyBuffer q,
                                   ffi::AnyBuffer main_rows, ffi::AnyBuffer main_idx, ffi::AnyBuffer extra_rows,
                                   ffi::AnyBuffer extra_idx, ffi::AnyBuffer sink, ffi::AnyBuffer inv_rope,
                                   ffi::AnyBuffer main_rope, ffi::AnyBuffer main_scale, ffi::AnyBuffer extra_rope,
                                   ffi::AnyBuffer extra_scale, ffi::Result<ffi::AnyBuffer> out,
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
  // An FP8 pool: e4m3 [N, 448] + bf16 [N, 64] + uint8 [N, 8], each row 16-byte aligned for
  // the bulk copies (8-byte for the scale load), so the base addresses must be too.
  auto check_fp8_pool = [&](ffi::AnyBuffer nope, ffi::AnyBuffer rope, ffi::AnyBuffer scales,
                            const std::string& name) -> ffi::Error {
    auto dn = nope.dimensions(), dr = rope.dimensions(), ds = scales.dimensions();
    if (nope.element_type() != DT::F8E4M3FN || dn.size() != 2 || dn[1] != jds::kAttnNopeDim)
      return bad(name + "_rows (FP8) must be f8e4m3fn [N, 448], got " + dims_str(dn));
    const int64_t n = dn[0];
    if (rope.element_type() != DT::BF16 || dr.size() != 2 || dr[0] != n || dr[1] != jds::kAttnRopeDim)
      return bad(name + "_rope must be bf16 [N = " + std::to_string(n) + ", 64], got " + dims_str(dr));
    if (scales.element_type() != DT::U8 || ds.size() != 2 || ds[0] != n || ds[1] != jds::kAttnScaleBytes)
      return bad(name + "_scale must be uint8 [N = " + std::to_string(n) + ", 8], got " + dims_str(ds));
    if (n > 0 && (reinterpret_cast<uintptr_t>(nope.untyped_data()) % 16 != 0 ||
                  reinterpret_cast<uintptr_t>(rope.untyped_data()) % 16 != 0 ||
                  reinterpret_cast<uintptr_t>(scales.untyped_data()) % 8 != 0))
      return bad(name + " FP8 pool buffers must be 16-byte (scale: 8-byte) aligned");
    return ffi::Error::Success();
  };
  auto check_idx = [&](ffi::AnyBuffer idx, const char* name) -> ffi::Error {
    auto d = idx.dimensions();
    if (idx.element_type() != DT::S32 || d.size() != 3 || d[0] != B || d[1] != S)
      return bad(std::string(name) + " must be int32 [B, S, K] matching q, got " + dims_str(d));
    return ffi::Error::Success();
  };
  if (main_fp8 != 0 && main_fp8 != 1) return bad("main_fp8 must be 0 or 1, got " + std::to_string(main_fp8));
  if (extra_fp8 != 0 && extra_fp8 != 1) return bad("extra_fp8 must be 0 or 1, got " + std::to_string(extra_fp8));
  if (main_fp8) {
    if (auto e = check_fp8_pool(main_rows, main_rope, main_scale, "main"); e.failure()) return e;
  } else if (auto e = check_rows(main_rows, "main_rows"); e.failure()) {
    return e;
  }
  if (extra_fp8) {
    if (auto e = check_fp8_pool(extra_rows, extra_rope, extra_scale, "extra"); e.failure()) return e;
  } else if (auto e = check_rows(extra_rows, "extra_rows"); e.failure()) {
    return e;
  }
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
  // The kernels read q and bf16 rows in 16-byte copies and write out and the split partials in
  // 16-byte stores (the staged epilogue), so every such base address must be 16-byte aligned
  // (XLA's buffers are; a misaligned one would fault, so it is refused here).
  // Empty buffers are not checked (nothing is read from or written to them).
  const std::pair<const char*, const ffi::AnyBuffer*> vector_accessed[] = {
      {"q", &q}, {"main_rows", main_fp8 ? nullptr : &main_rows}, {"extra_rows", extra_fp8 ? nullptr : &extra_rows},
      {"out", &*out}, {"workspace", num_splits > 1 ? &*workspace : nullptr}};
  for (const auto& [name, buf] : vector_accessed) {
    if (buf == nullptr || buf->element_count() == 0) continue;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(buf->untyped_data());
    if (addr % 16 != 0)
      return bad(std::string(name) + " must be 16-byte aligned, got an address = " + std::to_string(addr % 16) +
                 " mod 16");
  }

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
  p.main_fp8 = main_fp8;
  p.extra_fp8 = extra_fp8;
  p.main_rope = main_fp8 ? main_rope.untyped_data() : nullptr;
  p.main_scale = main_fp8 ? static_cast<const uint8_t*>(main_scale.untyped_data()) : nullptr;
  p.extra_rope = extra_fp8 ? extra_rope.untyped_data() : nullptr;
  p.extra_scale = extra_fp8 ? static_cast<const uint8_t*>(extra_scale.untyped_data()) : nullptr;
  const cudaError_t err =
      kWgmma ? jds::run_sparse_sink_attention_wgmma(p, stream) : jds::run_sparse_sink_attention(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_dspark_sparse_sink_attention: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Attributes, then 11 operands, then 3 results (ffi/handlers.h lists them).
auto AttentionBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Attr<float>("scale")
      .Attr<int32_t>("num_splits")
      .Attr<int32_t>("has_sink")
      .Attr<int32_t>("rope_dim")
      .Attr<int32_t>("main_fp8")
      .Attr<int32_t>("extra_fp8")
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()  // main_rope   (FP8 main pool)
      .Arg<ffi::AnyBuffer>()  // main_scale
      .Arg<ffi::AnyBuffer>()  // extra_rope  (FP8 extra pool)
      .Arg<ffi::AnyBuffer>()  // extra_scale
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkSparseSinkAttention, SparseSinkAttentionImpl<false>, AttentionBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsparkSparseSinkAttentionWgmma, SparseSinkAttentionImpl<true>, AttentionBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
