// Grouped BF16 GEMM over experts on Hopper: CUTLASS 3.x pointer-array grouped kernels (TMA
// loads, wgmma, warp-specialised consumers, persistent grid).
//
// Why this kernel: the per-expert row counts are only known on the device (they come out of
// the permute), and XLA may capture the call in a CUDA graph, so the host can neither read
// them nor launch per-expert GEMMs. CUTLASS's grouped kernel reads the problem shapes and
// operand pointers from device arrays and rewrites its TMA descriptors per group on the
// device; a tiny setup kernel here fills those arrays from the permute's offsets. Groups with
// zero rows own zero tiles and are skipped by the scheduler.
//
// Why two tile heights: MoE GEMMs at V4 shapes are bound by reading the expert weights (a
// 4096-token chunk does ~96 FLOP per weight byte on V4-Flash, under the H200's ~185 ridge),
// and every M tile of an expert streams that expert's weights again. At decode (1-16 rows per
// expert) 64-row ping-pong tiles pad least; at prefill (64-96 rows per expert) 128-row
// cooperative tiles read each expert's weights once. Measured on the H200 (docs/moe_kernels.md):
// 64-row tiles alone made prefill re-read the weights per tile (7.0 ms V4-Flash, 20.3 ms V4-Pro
// at 4096 tokens, matching 2x / 1.5x the weight bytes at 3.8 TB/s). FC1 and FC2 share the two
// instantiations (same layouts and types), which keeps the build small.
#include <algorithm>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "moe/params.h"
#ifdef JAX_DSPARK_MOE_PROBES
#include "moe/grouped_probes.cuh"
#endif

namespace jds {
namespace {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // <M, N, K> per group
using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;  // tokens x K
using LayoutB = cutlass::layout::RowMajor;  // K x N (weights as stored: N contiguous)
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlign = 8;  // 16 bytes of bf16
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

// Decode: 64-row tiles, two consumer warp groups on two tiles (ping-pong).
struct SmallM {
  using Tile = Shape<_64, _128, _64>;
  using Cluster = Shape<_1, _2, _1>;  // two N tiles share (multicast) the token tile
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
// Prefill: 128-row tiles, both consumer warp groups on one tile (cooperative), so every row of
// an expert with <= 128 rows shares one pass over the expert's weights; 256 columns a tile
// (half as many passes over the token rows as 128: 5-10% faster on every V4 prefill matrix
// in moe_driver's sweep, docs/moe_kernels.md).
struct LargeM {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// kAlongN: the persistent group scheduler walks a group's tiles along N first (diagnostic
// builds only; the release configs keep CUTLASS's default, along M).
template <class Config, bool kAlongN = false>
struct Grouped {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
      typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlign, Element, LayoutD*, kAlign, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
      LayoutB*, kAlign, float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Schedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  static typename Gemm::Arguments arguments(int experts, int sm_count, Shape3* shapes,
                                            const Element** ptr_a, const Element** ptr_b,
                                            Element** ptr_d, StrideA* sa, StrideB* sb, StrideD* sd) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {experts, shapes, nullptr};  // shapes live on the device only
    args.mainloop = {ptr_a, sa, ptr_b, sb};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.thread.alpha_ptr = nullptr;
    args.epilogue.thread.beta_ptr = nullptr;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = ptr_d;
    args.epilogue.dD = sd;
    args.hw_info = hw;
    if constexpr (kAlongN) {
      using Raster = decltype(args.scheduler.raster_order);
      args.scheduler.raster_order = Raster::AlongN;
    }
    return args;
  }

  static size_t gemm_workspace(int experts, int sm_count) {
    return Gemm::get_workspace_size(
        arguments(experts, sm_count, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr));
  }
};

// The group arrays hold the same types for both configs (checked below), so one layout serves.
using Small = Grouped<SmallM>;
using Large = Grouped<LargeM>;
static_assert(std::is_same_v<Small::StrideA, Large::StrideA> && std::is_same_v<Small::StrideB, Large::StrideB> &&
              std::is_same_v<Small::StrideD, Large::StrideD>);
using StrideA = Small::StrideA;
using StrideB = Small::StrideB;
using StrideD = Small::StrideD;

constexpr size_t kAlignBytes = 128;  // tensor maps need 64-byte alignment; keep every array on 128

inline size_t round_up(size_t v) { return (v + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// Offsets of the group arrays inside the workspace, then CUTLASS's own workspace.
struct Layout {
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, gemm, total;
};

Layout layout_for(int experts, int sm_count) {
  Layout l{};
  size_t at = 0;
  l.shapes = at;   at += round_up(sizeof(Shape3) * experts);
  l.ptr_a = at;    at += round_up(sizeof(void*) * experts);
  l.ptr_b = at;    at += round_up(sizeof(void*) * experts);
  l.ptr_d = at;    at += round_up(sizeof(void*) * experts);
  l.stride_a = at; at += round_up(sizeof(StrideA) * experts);
  l.stride_b = at; at += round_up(sizeof(StrideB) * experts);
  l.stride_d = at; at += round_up(sizeof(StrideD) * experts);
  l.gemm = at;
  at += round_up(std::max(Small::gemm_workspace(experts, sm_count), Large::gemm_workspace(experts, sm_count)));
  l.total = at + kAlignBytes;  // slack to align the base
  return l;
}

__global__ void setup_groups(const int32_t* __restrict__ offsets, int experts, int n, int k,
                             const Element* a, const Element* b, Element* d, Shape3* shapes,
                             const Element** ptr_a, const Element** ptr_b, Element** ptr_d,
                             StrideA* sa, StrideB* sb, StrideD* sd, StrideA stride_a,
                             StrideB stride_b, StrideD stride_d) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  const int64_t row0 = offsets[e];
  const int rows = offsets[e + 1] - offsets[e];
  shapes[e] = Shape3{rows, n, k};
  ptr_a[e] = a + row0 * k;
  ptr_b[e] = b + int64_t(e) * k * n;
  ptr_d[e] = d + row0 * n;
  sa[e] = stride_a;
  sb[e] = stride_b;
  sd[e] = stride_d;
}

// The workspace base rounded up to kAlignBytes (the layouts' totals include that slack).
char* aligned_base(void* workspace) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace) + kAlignBytes - 1) / kAlignBytes *
                                 kAlignBytes);
}

// Launches setup_groups: each expert's shape, operand pointers and strides into the
// workspace arrays the grouped kernel reads. Row-major strides do not depend on the group's
// row count, so one value serves all groups.
cudaError_t fill_groups(const void* a, const void* b, void* d, const int32_t* offsets, int experts, int n, int k,
                        char* base, const Layout& l, cudaStream_t stream) {
  const StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(1, k, 1));
  const StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
  const StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(1, n, 1));
  setup_groups<<<(experts + 127) / 128, 128, 0, stream>>>(
      offsets, experts, n, k, static_cast<const Element*>(a), static_cast<const Element*>(b),
      static_cast<Element*>(d), reinterpret_cast<Shape3*>(base + l.shapes),
      reinterpret_cast<const Element**>(base + l.ptr_a), reinterpret_cast<const Element**>(base + l.ptr_b),
      reinterpret_cast<Element**>(base + l.ptr_d), reinterpret_cast<StrideA*>(base + l.stride_a),
      reinterpret_cast<StrideB*>(base + l.stride_b), reinterpret_cast<StrideD*>(base + l.stride_d),
      stride_a, stride_b, stride_d);
  return cudaGetLastError();
}

template <class G>
cudaError_t launch(int experts, int sm_count, char* base, const Layout& l, cudaStream_t stream) {
  auto args = G::arguments(experts, sm_count, reinterpret_cast<Shape3*>(base + l.shapes),
                           reinterpret_cast<const Element**>(base + l.ptr_a),
                           reinterpret_cast<const Element**>(base + l.ptr_b),
                           reinterpret_cast<Element**>(base + l.ptr_d),
                           reinterpret_cast<StrideA*>(base + l.stride_a),
                           reinterpret_cast<StrideB*>(base + l.stride_b),
                           reinterpret_cast<StrideD*>(base + l.stride_d));
  typename G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, base + l.gemm, stream) != cutlass::Status::kSuccess)
    return cudaErrorUnknown;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

}  // namespace

size_t moe_grouped_gemm_workspace_bytes(int experts, int sm_count) {
  return layout_for(experts, sm_count).total;
}

cudaError_t run_moe_grouped_gemm(const void* a, const void* b, void* d, const int32_t* offsets,
                                 int experts, int n, int k, int64_t rows_hint, int sm_count,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Layout l = layout_for(experts, sm_count);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  char* base = aligned_base(workspace);
  const cudaError_t err = fill_groups(a, b, d, offsets, experts, n, k, base, l, stream);
  if (err != cudaSuccess) return err;
  // The host never sees per-expert counts (graph capture), only the total: an expert's weights
  // are read once per M tile, so once the average expert has more than half a small tile of
  // rows, the 128-row tile reads the weights about half as often.
  if (rows_hint > int64_t(experts) * 32) return launch<Large>(experts, sm_count, base, l, stream);
  return launch<Small>(experts, sm_count, base, l, stream);
}

#ifdef JAX_DSPARK_MOE_PROBES
// Diagnostic builds only (csrc/tools/moe_driver.cu): the release configs beside alternatives,
// one launch each, so a sweep can time them on the same inputs. Never in the library.
namespace {
template <int M, int N, int CM, int CN, class From>
using Variant = probes::Variant<M, N, 64, CM, CN, From>;
using ProbeConfigs =
    std::tuple<Large, Small, Grouped<Variant<128, 128, 1, 2, LargeM>>, Grouped<Variant<128, 128, 1, 1, LargeM>>,
               Grouped<Variant<128, 256, 1, 1, LargeM>>, Grouped<Variant<64, 256, 1, 2, SmallM>>,
               Grouped<LargeM, true>, Grouped<Variant<128, 128, 1, 4, LargeM>>>;
constexpr const char* kProbeNames[] = {
    "128x256x64 coop cluster 1x2 (release, prefill)", "64x128x64 pingpong cluster 1x2 (release, decode)",
    "128x128x64 coop cluster 1x2 (release before 2026-12-06)", "128x128x64 coop cluster 1x1",
    "128x256x64 coop cluster 1x1",                    "64x256x64 pingpong cluster 1x2",
    "128x256x64 coop cluster 1x2 along N",            "128x128x64 coop cluster 1x4"};
constexpr int kProbeCount = int(std::tuple_size_v<ProbeConfigs>);
static_assert(sizeof(kProbeNames) / sizeof(kProbeNames[0]) == kProbeCount);

Layout probe_layout_for(int experts, int sm_count) {
  Layout l = layout_for(experts, sm_count);
  l.total = l.gemm + round_up(probes::max_gemm_workspace<ProbeConfigs>(experts, sm_count)) + kAlignBytes;
  return l;
}
}  // namespace

int moe_grouped_gemm_probe_count() { return kProbeCount; }
const char* moe_grouped_gemm_probe_name(int config) {
  return config >= 0 && config < kProbeCount ? kProbeNames[config] : "";
}
size_t moe_grouped_gemm_probe_workspace_bytes(int experts, int sm_count) {
  return probe_layout_for(experts, sm_count).total;
}

cudaError_t run_moe_grouped_gemm_probe(int config, const void* a, const void* b, void* d, const int32_t* offsets,
                                       int experts, int n, int k, int sm_count, void* workspace,
                                       size_t workspace_bytes, cudaStream_t stream) {
  if (experts < 1 || config < 0 || config >= kProbeCount) return cudaErrorInvalidValue;
  const Layout l = probe_layout_for(experts, sm_count);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  char* base = aligned_base(workspace);
  const cudaError_t err = fill_groups(a, b, d, offsets, experts, n, k, base, l, stream);
  if (err != cudaSuccess) return err;
  return probes::launch_config<ProbeConfigs>(config, [&](auto tag) {
    return launch<typename decltype(tag)::type>(experts, sm_count, base, l, stream);
  });
}
#endif  // JAX_DSPARK_MOE_PROBES

}  // namespace jds
