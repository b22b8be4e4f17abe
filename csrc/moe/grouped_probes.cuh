// Diagnostic builds only (JAX_DSPARK_MOE_PROBES, csrc/tools/moe_driver.cu): helpers over a
// std::tuple of grouped-GEMM configurations, so grouped_gemm.cu and grouped_gemm_fp8.cu can
// each offer their release configurations beside alternatives under one index.
#pragma once

#include <algorithm>
#include <cstddef>
#include <tuple>

#include <cuda_runtime_api.h>
#include <cute/tensor.hpp>

namespace jds::probes {

// A configuration like `From` (its mainloop and epilogue schedules) with an M x N x K tile
// and a CM x CN cluster.
template <int M, int N, int K, int CM, int CN, class From>
struct Variant {
  using Tile = cute::Shape<cute::Int<M>, cute::Int<N>, cute::Int<K>>;
  using Cluster = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using Schedule = typename From::Schedule;
  using EpilogueSchedule = typename From::EpilogueSchedule;
};

template <class T>
struct Tag {
  using type = T;
};

// The largest CUTLASS workspace any configuration of `Configs` asks for.
template <class Configs, int I = 0>
size_t max_gemm_workspace(int experts, int sm_count) {
  if constexpr (I == int(std::tuple_size_v<Configs>)) {
    return 0;
  } else {
    return std::max(std::tuple_element_t<I, Configs>::gemm_workspace(experts, sm_count),
                    max_gemm_workspace<Configs, I + 1>(experts, sm_count));
  }
}

// launch(Tag<G>{}) for G, the configuration at index `config` of `Configs`.
template <class Configs, int I = 0, class Launch>
cudaError_t launch_config(int config, Launch&& launch) {
  if constexpr (I == int(std::tuple_size_v<Configs>)) {
    return cudaErrorInvalidValue;
  } else {
    if (config == I) return launch(Tag<std::tuple_element_t<I, Configs>>{});
    return launch_config<Configs, I + 1>(config, launch);
  }
}

}  // namespace jds::probes
