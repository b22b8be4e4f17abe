// Diagnostic builds only (JAX_DSPARK_MOE_PROBES, csrc/tools/moe_driver.cu): helpers over a
// std::tuple of grouped-GEMM configurations, so grouped_gemm.cu and grouped_gemm_fp8.cu can
// each offer their release configurations beside alternatives under one index.
#pragma once

#include <algorithm>
#include <cstddef>
#include <tuple>

#include <cuda_runtime_api.h>

namespace jds::probes {

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
