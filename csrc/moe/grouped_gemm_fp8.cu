// Grouped FP8 GEMM over experts with DeepSeek's block scaling, on Hopper: CUTLASS 3.x
// pointer-array grouped kernels whose mainloop multiplies FP8 e4m3 tiles with wgmma and
// promotes the partial sums into f32 accumulators once per 128-deep K block, scaled there by
// the block's activation scale (one per row, "1x128") times the weight scale ("128x128").
//
// Why this kernel: it is the same device-side grouping as the BF16 path (grouped_gemm.cu:
// per-expert row counts exist only on the device, so a setup kernel fills the problem shapes
// and pointers and the kernel rewrites its TMA descriptors per group), with the block-scaled
// mainloop CUTLASS provides for sm90 ("FP8Blockwise" schedules). The scales are f32 arrays in
// the layouts that mainloop reads (both "MN-major", the only kind it supports on sm90):
//   activations (A, group e with M_e rows from row offsets[e]): float at
//     sfa + offsets[e] * (K / 128) + kb * M_e + i   for local row i, K block kb;
//   weights (B_e, [N, K] with K contiguous): float at
//     sfb + e * (N / 128) * (K / 128) + kb * (N / 128) + nb.
// experts_fp8.cu writes both (activation quantisation, UE8M0 byte -> f32 conversion).
//
// Weights are [N, K] with K contiguous ("out x in", the checkpoints' layout): FP8 wgmma reads
// both operands K-major, so the BF16 path's [K, N] layout would need a transpose per call.
// Tile heights as in the BF16 path: 64-row ping-pong tiles for decode-sized groups, 128-row
// cooperative tiles for prefill-sized ones; K tiles are 128 deep (one scale block). Prefill
// clusters of four N tiles multicast the token tile to four CTAs (2-6% faster than two in
// moe_driver's sweep, docs/moe_kernels.md).
#include <algorithm>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
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
using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // tokens x K (K contiguous)
using LayoutB = cutlass::layout::ColumnMajor;  // K x N stored N-major rows: [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16;  // 16 bytes of e4m3
constexpr int kAlignD = 8;    // 16 bytes of bf16
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kMoeFp8Block, kMoeFp8Block>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
// experts_fp8.cu hard-codes the MN-major addressing documented above.
static_assert(decltype(get<0, 1>(stride(LayoutSFA{})))::value == 1, "SFA must be M-major");
static_assert(decltype(get<0, 1>(stride(LayoutSFB{})))::value == 1, "SFB must be N-major");

// Device arrays the grouped kernel reads per expert (filled by setup_groups).
template <class StrideA, class StrideB, class StrideD>
struct GroupArrays {
  Shape3* shapes;
  const ElementAB** ptr_a;
  const ElementAB** ptr_b;
  ElementD** ptr_d;
  const float** ptr_sfa;
  const float** ptr_sfb;
  StrideA* sa;
  StrideB* sb;
  StrideD* sd;
  LayoutSFA* lsfa;
  LayoutSFB* lsfb;
};

struct SmallM {
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
struct LargeM {
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _4, _1>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// kAlongN: the persistent group scheduler walks a group's tiles along N first (diagnostic
// builds only; the release configs keep CUTLASS's default, along M).
template <class Config, bool kAlongN = false>
struct Grouped {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
      typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Schedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  using Arrays = GroupArrays<StrideA, StrideB, StrideD>;

  static typename Gemm::Arguments arguments(int experts, int sm_count, const Arrays& g) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {experts, g.shapes, nullptr};  // shapes live on the device only
    args.mainloop = {g.ptr_a, g.sa, g.ptr_b, g.sb, g.ptr_sfa, g.lsfa, g.ptr_sfb, g.lsfb};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.thread.alpha_ptr = nullptr;
    args.epilogue.thread.beta_ptr = nullptr;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = g.ptr_d;
    args.epilogue.dD = g.sd;
    args.hw_info = hw;
    if constexpr (kAlongN) {
      using Raster = decltype(args.scheduler.raster_order);
      args.scheduler.raster_order = Raster::AlongN;
    }
    return args;
  }

  static size_t gemm_workspace(int experts, int sm_count) {
    return Gemm::get_workspace_size(arguments(experts, sm_count, Arrays{}));
  }
};

using Small = Grouped<SmallM>;
using Large = Grouped<LargeM>;
static_assert(std::is_same_v<Small::StrideA, Large::StrideA> && std::is_same_v<Small::StrideB, Large::StrideB> &&
              std::is_same_v<Small::StrideD, Large::StrideD>);
using StrideA = Small::StrideA;
using StrideB = Small::StrideB;
using StrideD = Small::StrideD;
using Arrays = Small::Arrays;  // one type for both configs (same strides, checked above)

constexpr size_t kAlignBytes = 128;

inline size_t round_up(size_t v) { return (v + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// Offsets of the group arrays inside the workspace, then CUTLASS's own workspace.
struct WorkspaceLayout {
  size_t shapes, ptr_a, ptr_b, ptr_d, ptr_sfa, ptr_sfb, sa, sb, sd, lsfa, lsfb, gemm, total;
};

WorkspaceLayout layout_for(int experts, int sm_count) {
  WorkspaceLayout l{};
  size_t at = 0;
  l.shapes = at;  at += round_up(sizeof(Shape3) * experts);
  l.ptr_a = at;   at += round_up(sizeof(void*) * experts);
  l.ptr_b = at;   at += round_up(sizeof(void*) * experts);
  l.ptr_d = at;   at += round_up(sizeof(void*) * experts);
  l.ptr_sfa = at; at += round_up(sizeof(void*) * experts);
  l.ptr_sfb = at; at += round_up(sizeof(void*) * experts);
  l.sa = at;      at += round_up(sizeof(StrideA) * experts);
  l.sb = at;      at += round_up(sizeof(StrideB) * experts);
  l.sd = at;      at += round_up(sizeof(StrideD) * experts);
  l.lsfa = at;    at += round_up(sizeof(LayoutSFA) * experts);
  l.lsfb = at;    at += round_up(sizeof(LayoutSFB) * experts);
  l.gemm = at;
  at += round_up(std::max(Small::gemm_workspace(experts, sm_count), Large::gemm_workspace(experts, sm_count)));
  l.total = at + kAlignBytes;  // slack to align the base
  return l;
}

Arrays arrays_at(char* base, const WorkspaceLayout& l) {
  Arrays g;
  g.shapes = reinterpret_cast<Shape3*>(base + l.shapes);
  g.ptr_a = reinterpret_cast<const ElementAB**>(base + l.ptr_a);
  g.ptr_b = reinterpret_cast<const ElementAB**>(base + l.ptr_b);
  g.ptr_d = reinterpret_cast<ElementD**>(base + l.ptr_d);
  g.ptr_sfa = reinterpret_cast<const float**>(base + l.ptr_sfa);
  g.ptr_sfb = reinterpret_cast<const float**>(base + l.ptr_sfb);
  g.sa = reinterpret_cast<StrideA*>(base + l.sa);
  g.sb = reinterpret_cast<StrideB*>(base + l.sb);
  g.sd = reinterpret_cast<StrideD*>(base + l.sd);
  g.lsfa = reinterpret_cast<LayoutSFA*>(base + l.lsfa);
  g.lsfb = reinterpret_cast<LayoutSFB*>(base + l.lsfb);
  return g;
}

__global__ void setup_groups(const int32_t* __restrict__ offsets, int experts, int n, int k,
                             const ElementAB* a, const float* sfa, const ElementAB* b, const float* sfb,
                             ElementD* d, Arrays g, StrideA stride_a, StrideB stride_b, StrideD stride_d) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  const int64_t row0 = offsets[e];
  const int rows = offsets[e + 1] - offsets[e];
  const int kb = k / kMoeFp8Block, nb = n / kMoeFp8Block;
  g.shapes[e] = Shape3{rows, n, k};
  g.ptr_a[e] = a + row0 * k;
  g.ptr_b[e] = b + int64_t(e) * n * k;
  g.ptr_d[e] = d + row0 * n;
  g.ptr_sfa[e] = sfa + row0 * kb;
  g.ptr_sfb[e] = sfb + int64_t(e) * nb * kb;
  g.sa[e] = stride_a;
  g.sb[e] = stride_b;
  g.sd[e] = stride_d;
  g.lsfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, n, k, 1));
  g.lsfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, n, k, 1));
}

// The workspace base rounded up to kAlignBytes (the layouts' totals include that slack).
char* aligned_base(void* workspace) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace) + kAlignBytes - 1) / kAlignBytes *
                                 kAlignBytes);
}

// Launches setup_groups: each expert's shape, operand pointers, strides and scale layouts
// into the workspace arrays the grouped kernel reads.
cudaError_t fill_groups(const void* a, const float* sfa, const void* b, const float* sfb, void* d,
                        const int32_t* offsets, int experts, int n, int k, char* base, const WorkspaceLayout& l,
                        cudaStream_t stream) {
  const StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(1, k, 1));
  const StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
  const StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(1, n, 1));
  setup_groups<<<(experts + 127) / 128, 128, 0, stream>>>(
      offsets, experts, n, k, static_cast<const ElementAB*>(a), sfa, static_cast<const ElementAB*>(b), sfb,
      static_cast<ElementD*>(d), arrays_at(base, l), stride_a, stride_b, stride_d);
  return cudaGetLastError();
}

template <class G>
cudaError_t launch(int experts, int sm_count, char* base, const WorkspaceLayout& l, cudaStream_t stream) {
  auto args = G::arguments(experts, sm_count, arrays_at(base, l));
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

size_t moe_grouped_gemm_fp8_workspace_bytes(int experts, int sm_count) {
  return layout_for(experts, sm_count).total;
}

cudaError_t run_moe_grouped_gemm_fp8(const void* a, const float* sfa, const void* b, const float* sfb,
                                     void* d, const int32_t* offsets, int experts, int n, int k,
                                     int64_t rows_hint, int sm_count, void* workspace,
                                     size_t workspace_bytes, cudaStream_t stream) {
  if (n % kMoeFp8Block || k % kMoeFp8Block || experts < 1) return cudaErrorInvalidValue;
  const WorkspaceLayout l = layout_for(experts, sm_count);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  char* base = aligned_base(workspace);
  const cudaError_t err = fill_groups(a, sfa, b, sfb, d, offsets, experts, n, k, base, l, stream);
  if (err != cudaSuccess) return err;
  // Same tile choice as the BF16 path (grouped_gemm.cu): the 128-row tile once the average
  // expert has more than half a 64-row tile.
  if (rows_hint > int64_t(experts) * 32) return launch<Large>(experts, sm_count, base, l, stream);
  return launch<Small>(experts, sm_count, base, l, stream);
}

#ifdef JAX_DSPARK_MOE_PROBES
// Diagnostic builds only (csrc/tools/moe_driver.cu): the release configs beside alternatives,
// one launch each, so a sweep can time them on the same inputs. Never in the library.
namespace {
template <int M, int N, int CM, int CN, class From>
using Variant = probes::Variant<M, N, kMoeFp8Block, CM, CN, From>;
using ProbeConfigs =
    std::tuple<Large, Small, Grouped<Variant<128, 128, 1, 1, LargeM>>, Grouped<Variant<64, 128, 1, 1, SmallM>>,
               Grouped<Variant<128, 128, 2, 1, LargeM>>, Grouped<LargeM, true>, Grouped<SmallM, true>,
               Grouped<Variant<128, 128, 1, 2, LargeM>>, Grouped<Variant<64, 128, 1, 4, SmallM>>>;
constexpr const char* kProbeNames[] = {
    "128x128 coop cluster 1x4 (release, prefill)", "64x128 pingpong cluster 1x2 (release, decode)",
    "128x128 coop cluster 1x1",                    "64x128 pingpong cluster 1x1",
    "128x128 coop cluster 2x1",                    "128x128 coop cluster 1x4 along N",
    "64x128 pingpong cluster 1x2 along N",         "128x128 coop cluster 1x2 (release before 2026-12-06)",
    "64x128 pingpong cluster 1x4"};
constexpr int kProbeCount = int(std::tuple_size_v<ProbeConfigs>);
static_assert(sizeof(kProbeNames) / sizeof(kProbeNames[0]) == kProbeCount);

WorkspaceLayout probe_layout_for(int experts, int sm_count) {
  WorkspaceLayout l = layout_for(experts, sm_count);
  l.total = l.gemm + round_up(probes::max_gemm_workspace<ProbeConfigs>(experts, sm_count)) + kAlignBytes;
  return l;
}
}  // namespace

int moe_grouped_gemm_fp8_probe_count() { return kProbeCount; }
const char* moe_grouped_gemm_fp8_probe_name(int config) {
  return config >= 0 && config < kProbeCount ? kProbeNames[config] : "";
}
size_t moe_grouped_gemm_fp8_probe_workspace_bytes(int experts, int sm_count) {
  return probe_layout_for(experts, sm_count).total;
}

cudaError_t run_moe_grouped_gemm_fp8_probe(int config, const void* a, const float* sfa, const void* b,
                                           const float* sfb, void* d, const int32_t* offsets, int experts, int n,
                                           int k, int sm_count, void* workspace, size_t workspace_bytes,
                                           cudaStream_t stream) {
  if (n % kMoeFp8Block || k % kMoeFp8Block || experts < 1 || config < 0 || config >= kProbeCount)
    return cudaErrorInvalidValue;
  const WorkspaceLayout l = probe_layout_for(experts, sm_count);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  char* base = aligned_base(workspace);
  const cudaError_t err = fill_groups(a, sfa, b, sfb, d, offsets, experts, n, k, base, l, stream);
  if (err != cudaSuccess) return err;
  return probes::launch_config<ProbeConfigs>(config, [&](auto tag) {
    return launch<typename decltype(tag)::type>(experts, sm_count, base, l, stream);
  });
}
#endif  // JAX_DSPARK_MOE_PROBES

}  // namespace jds
