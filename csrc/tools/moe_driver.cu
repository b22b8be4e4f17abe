// Standalone driver for the grouped GEMMs of the MoE experts, without XLA:
//   moe_driver ["case substring"] [--fp8 | --bf16] [--configs 0,2,5]
// For each case (one expert matrix of V4-Flash or V4-Pro, rows per expert from a random
// top-k routing of T tokens), each weight type (FP8 block-scaled, BF16; both by default) and
// each CUTLASS configuration of run_moe_grouped_gemm{_fp8}_probe (config 0 / 1: the release
// prefill / decode ones): poisons D, runs once and checks 64 sampled outputs against a
// float64 host reference from the same bytes and scales, then times it with CUDA events
// (median of 10). Also times the release entry point (which picks config 0 or 1 itself) and
// a device copy, so each line carries the weight bytes' floor measured in the same run.
// Built by cmake/moe.cmake with JAX_DSPARK_BUILD_DRIVER=ON; never part of the library.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/params.h"
#include "tools/check.h"

namespace {

constexpr int kBlock = jds::kMoeFp8Block;

struct Case {
  const char* name;
  int experts, n, k, tokens, top_k;
};

const Case kCases[] = {
    {"V4-Flash FC1 T=4096", 256, 4096, 4096, 4096, 6}, {"V4-Flash FC2 T=4096", 256, 4096, 2048, 4096, 6},
    {"V4-Pro FC1 T=4096", 384, 6144, 7168, 4096, 6},   {"V4-Pro FC2 T=4096", 384, 7168, 3072, 4096, 6},
    {"V4-Flash FC1 T=64", 256, 4096, 4096, 64, 6},     {"V4-Pro FC1 T=64", 384, 6144, 7168, 64, 6},
};

__host__ __device__ inline uint32_t mix(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return uint32_t(x);
}

// e4m3 bytes with exponent fields 0..7 (|v| < 2, never NaN): sign + 3 exponent bits + mantissa.
__host__ __device__ inline uint8_t e4m3_byte(uint64_t i, uint32_t seed) { return uint8_t(mix(i, seed) & 0xBFu); }

// Powers of two 2^-(0..3): what the quantisers produce, kept small so sums stay moderate.
__host__ __device__ inline float scale_value(uint64_t i, uint32_t seed) { return 1.f / float(1u << (mix(i, seed) & 3u)); }

__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = e4m3_byte(i, seed);
}

// bf16 with |v| in [2^-7, 1): sign, exponent 120..127, random mantissa.
__global__ void fill_bf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = mix(i, seed);
    p[i] = uint16_t(((h >> 31) << 15) | ((120u + (h & 7u)) << 7) | ((h >> 8) & 0x7Fu));
  }
}

__global__ void fill_scales(float* p, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = scale_value(i, seed);
}

double e4m3_to_double(uint8_t b) {
  const int sign = b >> 7, e = (b >> 3) & 0xF, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -v : v;
}

double bf16_to_double(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Rows per expert of a top-k routing of `tokens` tokens, each choosing k distinct experts
// uniformly (the benchmark's random logits give about this).
std::vector<int> route_counts(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> counts(c.experts, 0), pick(c.experts);
  for (int e = 0; e < c.experts; ++e) pick[e] = e;
  for (int t = 0; t < c.tokens; ++t) {
    for (int j = 0; j < c.top_k; ++j) {
      std::uniform_int_distribution<int> u(j, c.experts - 1);
      std::swap(pick[j], pick[u(rng)]);
      ++counts[pick[j]];
    }
  }
  return counts;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Device-to-device copy rate (bytes read + written per second) of a buffer larger than L2.
double copy_tbps() {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int i = 0; i < 8; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) ts.push_back(ms);
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (median(ts) * 1e-3) / 1e12;
}

struct Buffers {
  uint8_t *a, *b;
  float *sfa, *sfb;
  uint16_t* d;
  int32_t* offsets;
  void* ws;
  size_t ws_bytes;
};

// Relative Frobenius error of 64 sampled outputs against the float64 reference. FP8: A
// [rows, K] and B_e [N, K] e4m3 with block scales; BF16: A [rows, K], B_e [K, N] (N contiguous).
double sampled_error(const Case& c, bool bf16, const Buffers& buf, const std::vector<int>& offsets) {
  const int kb = c.k / kBlock, nb = c.n / kBlock;
  const int rows = offsets[c.experts];
  const size_t elem = bf16 ? 2 : 1;
  std::mt19937 rng(7);
  std::vector<uint8_t> arow(c.k * elem), brow(c.k * elem);
  std::vector<float> sa(kb, 1.f), sb(kb, 1.f);
  double num = 0, den = 0;
  for (int s = 0; s < 64; ++s) {
    const int r = std::uniform_int_distribution<int>(0, rows - 1)(rng);
    const int col = std::uniform_int_distribution<int>(0, c.n - 1)(rng);
    const int e = int(std::upper_bound(offsets.begin(), offsets.end(), r) - offsets.begin()) - 1;
    const int me = offsets[e + 1] - offsets[e], i = r - offsets[e];
    CK(cudaMemcpy(arow.data(), buf.a + size_t(r) * c.k * elem, c.k * elem, cudaMemcpyDeviceToHost));
    if (bf16) {  // column col of B_e: K values N apart
      CK(cudaMemcpy2D(brow.data(), 2, buf.b + (size_t(e) * c.k * c.n + col) * 2, size_t(c.n) * 2, 2, c.k,
                      cudaMemcpyDeviceToHost));
    } else {
      CK(cudaMemcpy(brow.data(), buf.b + (size_t(e) * c.n + col) * c.k, c.k, cudaMemcpyDeviceToHost));
      for (int q = 0; q < kb; ++q) {
        CK(cudaMemcpy(&sa[q], buf.sfa + size_t(offsets[e]) * kb + size_t(q) * me + i, 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&sb[q], buf.sfb + (size_t(e) * nb * kb + size_t(q) * nb + col / kBlock), 4,
                      cudaMemcpyDeviceToHost));
      }
    }
    auto value = [&](const std::vector<uint8_t>& v, int t) {
      if (!bf16) return e4m3_to_double(v[t]);
      uint16_t h;
      std::memcpy(&h, &v[2 * t], 2);
      return bf16_to_double(h);
    };
    double want = 0;
    for (int q = 0; q < kb; ++q) {
      double part = 0;
      for (int t = q * kBlock; t < (q + 1) * kBlock; ++t) part += value(arow, t) * value(brow, t);
      want += part * sa[q] * sb[q];
    }
    uint16_t got_bits;
    CK(cudaMemcpy(&got_bits, buf.d + size_t(r) * c.n + col, 2, cudaMemcpyDeviceToHost));
    const double got = bf16_to_double(got_bits);
    num += (got - want) * (got - want);
    den += want * want;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

template <class Launch>
float time_ms(Launch launch) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // Warm-up of at least 200 ms (or 50 launches): the first configuration of a case came right
  // after the fill and, on the 2026-12-06 H100 run with two warm-up launches, ran up to 13%
  // slower than the same kernel timed later (clocks still ramping).
  CK(cudaEventRecord(e0));
  for (int i = 0; i < 50; ++i) {
    CK(launch());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 1 && ms > 200.f) break;
  }
  std::vector<float> ts;
  for (int i = 0; i < 10; ++i) {
    CK(cudaEventRecord(e0));
    CK(launch());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return median(ts);
}

void run_case(const Case& c, bool bf16, const std::vector<int>& configs, int sms, double copy) {
  const std::vector<int> counts = route_counts(c, 1234);
  std::vector<int> offsets(c.experts + 1, 0);
  int touched = 0;
  for (int e = 0; e < c.experts; ++e) {
    offsets[e + 1] = offsets[e] + counts[e];
    touched += counts[e] > 0;
  }
  const size_t rows = size_t(offsets[c.experts]);
  const size_t elem = bf16 ? 2 : 1;
  const int kb = c.k / kBlock, nb = c.n / kBlock;
  Buffers buf{};
  const size_t b_elems = size_t(c.experts) * c.n * c.k;
  CK(cudaMalloc(&buf.a, rows * c.k * elem));
  CK(cudaMalloc(&buf.b, b_elems * elem));
  CK(cudaMalloc(&buf.d, rows * c.n * 2));
  CK(cudaMalloc(&buf.offsets, (c.experts + 1) * 4));
  CK(cudaMemcpy(buf.offsets, offsets.data(), (c.experts + 1) * 4, cudaMemcpyHostToDevice));
  if (bf16) {
    buf.ws_bytes = std::max(jds::moe_grouped_gemm_probe_workspace_bytes(c.experts, sms),
                            jds::moe_grouped_gemm_workspace_bytes(c.experts, sms));
    fill_bf16<<<1024, 256>>>(reinterpret_cast<uint16_t*>(buf.a), rows * c.k, 11);
    fill_bf16<<<4096, 256>>>(reinterpret_cast<uint16_t*>(buf.b), b_elems, 12);
  } else {
    buf.ws_bytes = std::max(jds::moe_grouped_gemm_fp8_probe_workspace_bytes(c.experts, sms),
                            jds::moe_grouped_gemm_fp8_workspace_bytes(c.experts, sms));
    CK(cudaMalloc(&buf.sfa, rows * kb * 4));
    CK(cudaMalloc(&buf.sfb, size_t(c.experts) * nb * kb * 4));
    fill_bytes<<<1024, 256>>>(buf.a, rows * c.k, 11);
    fill_bytes<<<4096, 256>>>(buf.b, b_elems, 12);
    fill_scales<<<256, 256>>>(buf.sfa, rows * kb, 13);
    fill_scales<<<256, 256>>>(buf.sfb, size_t(c.experts) * nb * kb, 14);
  }
  CK(cudaMalloc(&buf.ws, buf.ws_bytes));
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());

  const char* type = bf16 ? "bf16" : "fp8";
  const double flops = 2.0 * rows * c.n * c.k;
  // Touched weight bytes: values, plus the UE8M0 bytes for FP8.
  const double touched_bytes = double(touched) * c.n * c.k * elem + (bf16 ? 0.0 : double(touched) * nb * kb);
  const double floor_ms = touched_bytes / (copy * 1e12) * 1e3;
  std::printf("case %s %s: E %d N %d K %d rows %zu (%d experts touched, %.1f rows each), weight floor %.3f ms at "
              "%.2f TB/s\n",
              c.name, type, c.experts, c.n, c.k, rows, touched, double(rows) / touched, floor_ms, copy);
  auto report = [&](const char* what, int config, float ms, double err) {
    std::printf("{\"case\": \"%s\", \"type\": \"%s\", \"config\": %d, \"what\": \"%s\", \"ms\": %.4f, "
                "\"TFLOPs\": %.1f, \"weight_TBps\": %.3f, \"of_floor\": %.3f, \"rel_err\": %.2e, \"ok\": %s}\n",
                c.name, type, config, what, ms, flops / (ms * 1e-3) / 1e12, touched_bytes / (ms * 1e-3) / 1e12,
                floor_ms / ms, err, err < 1e-2 ? "true" : "false");
    std::fflush(stdout);
  };
  // One launch of configuration `config` (-1: the release entry point).
  auto launch = [&](int config) {
    if (bf16) {
      if (config < 0)
        return jds::run_moe_grouped_gemm(buf.a, buf.b, buf.d, buf.offsets, c.experts, c.n, c.k, int64_t(rows), sms,
                                         buf.ws, buf.ws_bytes, 0);
      return jds::run_moe_grouped_gemm_probe(config, buf.a, buf.b, buf.d, buf.offsets, c.experts, c.n, c.k, sms,
                                             buf.ws, buf.ws_bytes, 0);
    }
    if (config < 0)
      return jds::run_moe_grouped_gemm_fp8(buf.a, buf.sfa, buf.b, buf.sfb, buf.d, buf.offsets, c.experts, c.n, c.k,
                                           int64_t(rows), sms, buf.ws, buf.ws_bytes, 0);
    return jds::run_moe_grouped_gemm_fp8_probe(config, buf.a, buf.sfa, buf.b, buf.sfb, buf.d, buf.offsets,
                                               c.experts, c.n, c.k, sms, buf.ws, buf.ws_bytes, 0);
  };
  std::vector<int> all = configs;
  all.push_back(-1);
  for (int config : all) {
    const char* what = config < 0 ? "release dispatch"
                       : bf16     ? jds::moe_grouped_gemm_probe_name(config)
                                  : jds::moe_grouped_gemm_fp8_probe_name(config);
    CK(cudaMemset(buf.d, 0xFF, rows * c.n * 2));  // NaN poison
    const cudaError_t err = launch(config);
    if (err != cudaSuccess) {
      std::printf("{\"case\": \"%s\", \"type\": \"%s\", \"config\": %d, \"what\": \"%s\", \"error\": \"%s\"}\n",
                  c.name, type, config, what, cudaGetErrorString(err));
      (void)cudaGetLastError();
      continue;
    }
    CK(cudaDeviceSynchronize());
    const double rel = sampled_error(c, bf16, buf, offsets);
    report(what, config, time_ms([&] { return launch(config); }), rel);
  }
  CK(cudaFree(buf.a));
  CK(cudaFree(buf.b));
  if (buf.sfa) CK(cudaFree(buf.sfa));
  if (buf.sfb) CK(cudaFree(buf.sfb));
  CK(cudaFree(buf.d));
  CK(cudaFree(buf.offsets));
  CK(cudaFree(buf.ws));
}

}  // namespace

int main(int argc, char** argv) {
  const char* filter = nullptr;
  std::vector<int> configs;
  bool fp8 = true, bf16 = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--fp8") == 0) {
      bf16 = false;
    } else if (std::strcmp(argv[i], "--bf16") == 0) {
      fp8 = false;
    } else if (std::strcmp(argv[i], "--configs") == 0 && i + 1 < argc) {
      std::string list = argv[++i];
      size_t at = 0;
      while (at < list.size()) {
        const size_t comma = list.find(',', at);
        configs.push_back(std::atoi(list.substr(at, comma - at).c_str()));
        at = comma == std::string::npos ? list.size() : comma + 1;
      }
    } else {
      filter = argv[i];
    }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double copy = copy_tbps();
  std::printf("device %s, %d SMs, copy %.2f TB/s\n", prop.name, sms, copy);
  for (const bool as_bf16 : {false, true}) {
    if (as_bf16 ? !bf16 : !fp8) continue;
    std::vector<int> use = configs;
    const int count = as_bf16 ? jds::moe_grouped_gemm_probe_count() : jds::moe_grouped_gemm_fp8_probe_count();
    if (use.empty())
      for (int i = 0; i < count; ++i) use.push_back(i);
    for (const Case& c : kCases)
      if (!filter || std::strstr(c.name, filter)) run_case(c, as_bf16, use, sms, copy);
  }
  return 0;
}
