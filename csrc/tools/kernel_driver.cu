// Standalone driver for the kernels, without XLA:
//   kernel_driver memcheck   edge cases on exact-size cudaMalloc buffers (run it under
//                            compute-sanitizer: every out-of-bounds access is reported), outputs
//                            poisoned with NaN, small cases checked against a float64 CPU reference
//   kernel_driver ... --wgmma  the same with the wgmma kernel (run_sparse_sink_attention_wgmma)
//   kernel_driver ... --wgmma-lockstep / --wgmma-ws  one wgmma schedule forced (FP8 pools too)
//   kernel_driver ... --wgmma-persistent  one-split launches on persistent lockstep CTAs (candidate)
//   kernel_driver ... --wgmma-ws-persistent  one-split launches on persistent warp-specialised CTAs
//                            (dispatched for FP8 pools; for bf16 pools an experiment)
//   kernel_driver ... --wgmma-cluster / --wgmma-combine  the dispatched wgmma schedule with split
//                            partials merged in a cluster (whenever 2..8 splits) / by the combine
//                            launch; --wgmma lets use_cluster_merge choose
//   kernel_driver bench      CUDA-event timing of the benchmark cases (pure device time) over
//                            rotating pools larger than L2; also the target for ncu; with --rope
//                            the cases take the inverse-RoPE epilogue (as the V4 models call it)
//   kernel_driver bench-prep  the same for the prep kernel, beside a device copy of its bytes
//   kernel_driver ... --prep-half  prep rows of <= 1 KB half a warp each (the layout the library dispatches)
//   kernel_driver bench-shape B S H K [fp8]  the same timing for one shape (K list rows, one
//                            pool): sweeps such as the warp-specialised schedule's threshold
//   kernel_driver ... --probe-gather1 / --probe-gather2 / --probe-math  time a diagnostic
//                            launch instead (AttnProbe: the lockstep kernel's gather alone with
//                            one or two tiles in flight, or its compute alone); bench only, the
//                            outputs are garbage
//   kernel_driver bench ... --timeline  (timeline builds: -DJAX_DSPARK_ATTENTION_TIMELINE=ON) one
//                            more launch of each case recording every CTA's phases
//                            (set_attention_timeline), summarised as a second JSON line
//   kernel_driver ... --late-start CYCLES  (timeline builds) the persistent kernel's CTAs with
//                            one work item fewer spin CYCLES before their first (an experiment)
// Built by hand (docs/kernels.md), not part of the installed library.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "attention/params.h"
#include "prep/params.h"
#include "tools/check.h"

using bf16 = __nv_bfloat16;

// The attention launcher under test (mma.sync by default, `--wgmma` for the wgmma kernel).
static cudaError_t (*run_attn)(const jds::SparseSinkAttentionParams&, cudaStream_t) = jds::run_sparse_sink_attention;

static cudaError_t probe_gather1(const jds::SparseSinkAttentionParams& p, cudaStream_t s) {
  return jds::run_sparse_sink_attention_wgmma_probe(p, jds::AttnProbe::kGatherDepth1, s);
}
static cudaError_t probe_gather2(const jds::SparseSinkAttentionParams& p, cudaStream_t s) {
  return jds::run_sparse_sink_attention_wgmma_probe(p, jds::AttnProbe::kGatherDepth2, s);
}
static cudaError_t probe_math(const jds::SparseSinkAttentionParams& p, cudaStream_t s) {
  return jds::run_sparse_sink_attention_wgmma_probe(p, jds::AttnProbe::kMathOnly, s);
}
// --prep-half: prep rows of <= 1 KB half a warp each where the layout allows
// (RmsNormRopeParams::half_warp_rows), the layout the library dispatches since a3f6df1.
static int prep_half = 0;

template <class T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  if (!h.empty()) {
    CK(cudaMalloc(&d, h.size() * sizeof(T)));
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return d;
}
template <class T>
T* poisoned(size_t n) {  // 0xFF bytes: NaN in bf16 and f32
  T* d = nullptr;
  if (n) {
    CK(cudaMalloc(&d, n * sizeof(T)));
    CK(cudaMemset(d, 0xFF, n * sizeof(T)));
  }
  return d;
}

static std::mt19937 rng(1234);
// Roughly normal values (sum of 4 uniforms, unit variance) from a xorshift generator: the
// benchmark pools hold up to 2 x 10^9 values and std::normal_distribution is far too slow.
static std::vector<bf16> randn_bf16(size_t n) {
  std::vector<bf16> v(n);
  uint64_t x = 0x9E3779B97F4A7C15ull ^ rng();
  for (auto& out : v) {
    float acc = 0.f;
    for (int i = 0; i < 4; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      acc += float(x >> 40) * (1.0f / 16777216.0f);
    }
    out = __float2bfloat16((acc - 2.f) * 1.7320508f);
  }
  return v;
}

// Benchmark pools generated on the device (timing only, never checked against a reference):
// on the host, randn_bf16 took about 10 s a dense-16k set (268 M values) and the four rotating
// sets of a bench case most of a bench call's device time. Values: splitmix64 of (seed, index).
__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

enum class Fill { kRandnBf16, kFp8Bytes, kScaleBytes };

// kRandnBf16: bf16, sum of four 16-bit uniforms scaled to unit variance (as randn_bf16);
// kFp8Bytes: e4m3 bytes with bit 3 cleared (never the NaN codes S.1111.111);
// kScaleBytes: scale bytes around 2^0 (120..127 for the 7 used of every 8 a row, 127 else).
__global__ void fill_kernel(uint8_t* out, size_t n, uint64_t seed, Fill kind) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    if (kind == Fill::kRandnBf16) {
      const float acc = float((h & 0xFFFF) + ((h >> 16) & 0xFFFF) + ((h >> 32) & 0xFFFF) + (h >> 48)) * (1.f / 65536.f);
      reinterpret_cast<bf16*>(out)[i] = __float2bfloat16((acc - 2.f) * 1.7320508f);
    } else if (kind == Fill::kFp8Bytes) {
      out[i] = uint8_t(h >> 56) & 0xF7;
    } else {
      out[i] = i % jds::kAttnScaleBytes < 7 ? uint8_t(120 + (uint64_t(i) * 2654435761u >> 28) % 8) : uint8_t(127);
    }
  }
}

// n elements (bf16 values or bytes, by `kind`) in a fresh device buffer; null for n = 0.
static void* device_fill(size_t n, Fill kind) {
  if (n == 0) return nullptr;
  void* d = nullptr;
  CK(cudaMalloc(&d, n * (kind == Fill::kRandnBf16 ? 2 : 1)));
  const uint64_t seed = (uint64_t(rng()) << 32) ^ rng();
  fill_kernel<<<1024, 256>>>(static_cast<uint8_t*>(d), n, seed, kind);
  CK(cudaGetLastError());
  return d;
}

static int choose_splits(int b, int s, int h, int k_total, int sms) {  // = ops/_kernels.choose_splits
  const int tiles = (k_total + 63) / 64;
  if (tiles <= 1) return 1;
  const long base = long((h + 63) / 64) * s * b;
  int best = 1;
  double best_cost = 1e30;
  for (int sp = 1; sp <= std::min(32, tiles); ++sp) {
    const int per = (tiles + sp - 1) / sp;
    if ((tiles + per - 1) / per != sp) continue;
    const double waves = double((base * sp + sms - 1) / sms);
    const double cost = waves * (per + 1) + (sp > 1 ? 0.25 * sp : 0.0);
    if (cost < best_cost) best = sp, best_cost = cost;
  }
  return best;
}

struct AttnCase {
  const char* name;
  int B, S, H, K, K2, n_main, n_extra;
  float drop;
  bool sink, rope, bad;
  bool fp8_main = false, fp8_extra = false;  // pools in the FP8 row form (params.h)
  int check_every = 1;  // rows checked against the float64 reference: every n-th (all: finite)
  int splits = 0;       // split count forced (0: choose_splits), e.g. for the cluster merge's 3..8
};

struct AttnData {
  jds::SparseSinkAttentionParams p{};
  std::vector<bf16> q, rows, rows2;
  std::vector<int> idx, idx2;
  std::vector<float> sink, rope;
};

// One pool in the FP8 row form, quantised as ops/kv_fp8.quantize_kv_rows does (exponent
// ceil(log2(max(amax, 1e-4) / 448)) per 64 nope values, e4m3 round-to-nearest); `rows` is
// replaced by the dequantised values (exact in bf16), which the CPU reference then reads.
struct Fp8Pool {
  std::vector<uint8_t> nope, scale;
  std::vector<bf16> rope;
};

static Fp8Pool quantize_pool(std::vector<bf16>& rows, int n) {
  const int D = jds::kAttnHeadDim, ND = jds::kAttnNopeDim, B = jds::kAttnScaleBlock;
  Fp8Pool f;
  f.nope.resize(size_t(n) * ND);
  f.scale.assign(size_t(n) * jds::kAttnScaleBytes, 0);
  f.rope.resize(size_t(n) * jds::kAttnRopeDim);
  for (int r = 0; r < n; ++r) {
    // Vary the magnitude per block (a power of two) so every scale byte matters.
    for (int blk = 0; blk < ND / B; ++blk) {
      const float mult = std::ldexp(1.f, int(rng() % 7) - 3);
      for (int i = 0; i < B; ++i) {
        bf16& v = rows[size_t(r) * D + blk * B + i];
        v = __float2bfloat16(__bfloat162float(v) * mult);
      }
    }
    for (int blk = 0; blk < ND / B; ++blk) {
      float amax = 0.f;
      for (int i = 0; i < B; ++i) amax = std::max(amax, std::fabs(__bfloat162float(rows[size_t(r) * D + blk * B + i])));
      int e2 = 0;
      const float m = std::frexp(std::max(amax, 1e-4f) / 448.f, &e2);  // r = m 2^e2, m in [0.5, 1)
      const int e = m == 0.5f ? e2 - 1 : e2;
      f.scale[size_t(r) * jds::kAttnScaleBytes + blk] = uint8_t(127 + e);
      for (int i = 0; i < B; ++i) {
        bf16& v = rows[size_t(r) * D + blk * B + i];
        const __nv_fp8_storage_t q =
            __nv_cvt_float_to_fp8(std::ldexp(__bfloat162float(v), -e), __NV_SATFINITE, __NV_E4M3);
        f.nope[size_t(r) * ND + blk * B + i] = q;
        __half_raw h = __nv_cvt_fp8_to_halfraw(q, __NV_E4M3);
        v = __float2bfloat16(std::ldexp(__half2float(__half(h)), e));
      }
    }
    for (int i = 0; i < jds::kAttnRopeDim; ++i)
      f.rope[size_t(r) * jds::kAttnRopeDim + i] = rows[size_t(r) * D + ND + i];
  }
  return f;
}

// bench_data: q and both pools random on the device, no host copies (timing only: the CPU
// reference cannot run on them); FP8 pools then hold random e4m3 bytes instead of quantised rows.
static AttnData make_attn(const AttnCase& c, int sms, bool shared_lists, bool bench_data = false) {
  AttnData a;
  const int D = jds::kAttnHeadDim;
  if (!bench_data) {
    a.q = randn_bf16(size_t(c.B) * c.S * c.H * D);
    a.rows = randn_bf16(size_t(c.n_main) * D);
    a.rows2 = randn_bf16(size_t(c.n_extra) * D);
  }
  std::uniform_real_distribution<float> u;
  auto fill = [&](std::vector<int>& idx, int k, int n) {
    idx.resize(size_t(c.B) * c.S * k);
    for (int b = 0; b < c.B; ++b)
      for (int s = 0; s < c.S; ++s)
        for (int j = 0; j < k; ++j) {
          const size_t at = (size_t(b) * c.S + s) * k + j;
          if (shared_lists && s > 0) {
            idx[at] = idx[(size_t(b) * c.S) * k + j];
            continue;
          }
          int v = n > 0 ? int(rng() % n) : -1;
          if (shared_lists && n >= c.B * k) v = b * k + int((long(j) * 7919) % k);  // distinct rows per request, scattered
          if (u(rng) < c.drop) v = -1;
          if (c.bad && j % 7 == 3) v = (j % 2) ? n + int(rng() % 1000) : -2 - int(rng() % 1000);
          idx[at] = v;
        }
  };
  fill(a.idx, c.K, c.n_main);
  fill(a.idx2, c.K2, c.n_extra);
  std::normal_distribution<float> nd;
  if (c.sink) a.sink.resize(c.H), [&] { for (auto& x : a.sink) x = nd(rng); }();
  if (c.rope) {
    a.rope.resize(size_t(c.B) * c.S * 64);
    for (size_t i = 0; i < a.rope.size(); i += 2) {
      const float ang = u(rng) * 6.2831853f;
      a.rope[i] = std::cos(ang);
      a.rope[i + 1] = std::sin(ang);
    }
  }
  auto& p = a.p;
  p.batch = c.B, p.seq = c.S, p.heads = c.H, p.n_main = c.n_main, p.n_extra = c.n_extra;
  p.k_main = c.K, p.k_extra = c.K2, p.rope_dim = c.rope ? 64 : 0, p.scale = 1.f / std::sqrt(512.f);
  p.num_splits = c.splits ? c.splits : choose_splits(c.B, c.S, c.H, c.K + c.K2, sms);
  auto pool = [&](std::vector<bf16>& rows, int n, bool fp8, const void*& data, const void*& rope, const uint8_t*& scale,
                  int& is_fp8) {
    is_fp8 = fp8;
    if (bench_data && fp8) {
      data = device_fill(size_t(n) * jds::kAttnNopeDim, Fill::kFp8Bytes);
      rope = device_fill(size_t(n) * jds::kAttnRopeDim, Fill::kRandnBf16);
      scale = static_cast<const uint8_t*>(device_fill(size_t(n) * jds::kAttnScaleBytes, Fill::kScaleBytes));
    } else if (bench_data) {
      data = device_fill(size_t(n) * D, Fill::kRandnBf16);
    } else if (fp8) {
      Fp8Pool f = quantize_pool(rows, n);
      data = upload(f.nope), rope = upload(f.rope), scale = upload(f.scale);
    } else {
      data = upload(rows);
    }
  };
  p.q = bench_data ? device_fill(size_t(c.B) * c.S * c.H * D, Fill::kRandnBf16) : upload(a.q);
  pool(a.rows, c.n_main, c.fp8_main, p.main_rows, p.main_rope, p.main_scale, p.main_fp8);
  pool(a.rows2, c.n_extra, c.fp8_extra, p.extra_rows, p.extra_rope, p.extra_scale, p.extra_fp8);
  p.main_idx = upload(a.idx), p.extra_idx = upload(a.idx2);
  p.sink = c.sink ? upload(a.sink) : nullptr;
  p.inv_rope = c.rope ? upload(a.rope) : nullptr;
  const size_t rows_out = size_t(c.B) * c.S * c.H;
  p.out = poisoned<bf16>(rows_out * D);
  p.lse = poisoned<float>(rows_out);
  const int64_t ws = jds::attn_workspace_floats(c.B, c.S, c.H, p.num_splits);
  float* w = poisoned<float>(size_t(ws));
  p.partial_out = ws ? w : nullptr;
  p.partial_lse = ws ? w + int64_t(p.num_splits) * rows_out * D : nullptr;
  return a;
}

static void free_attn(AttnData& a) {
  auto& p = a.p;
  for (const void* ptr : {p.q, p.main_rows, p.extra_rows, (const void*)p.main_idx, (const void*)p.extra_idx,
                          (const void*)p.sink, (const void*)p.inv_rope, (const void*)p.out, (const void*)p.lse,
                          (const void*)p.partial_out, p.main_rope, (const void*)p.main_scale, p.extra_rope,
                          (const void*)p.extra_scale})
    if (ptr) CK(cudaFree(const_cast<void*>(ptr)));
}

// float64 reference of one case; returns max over rows of ||out - ref|| / ||ref|| (global norm).
static double check_attn(const AttnCase& c, const AttnData& a) {
  const int D = jds::kAttnHeadDim;
  const size_t rows_out = size_t(c.B) * c.S * c.H;
  std::vector<bf16> out(rows_out * D);
  std::vector<float> lse(rows_out);
  CK(cudaMemcpy(out.data(), a.p.out, out.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse.data(), a.p.lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0, lse_err = 0;
  std::vector<double> acc(D);
  for (int b = 0; b < c.B; ++b)
    for (int s = 0; s < c.S; ++s)
      for (int h = 0; h < c.H; ++h) {
        const size_t r = (size_t(b) * c.S + s) * c.H + h;
        if (r % c.check_every != 0) {  // not referenced: still every element written (no poison left)
          for (int d = 0; d < D; ++d)
            if (!std::isfinite(__bfloat162float(out[r * D + d]))) return INFINITY;
          if (std::isnan(lse[r])) return INFINITY;
          continue;
        }
        std::vector<std::pair<double, const bf16*>> sc;
        auto gather = [&](const std::vector<int>& idx, int k, int n, const std::vector<bf16>& rows) {
          for (int j = 0; j < k; ++j) {
            const int v = idx[(size_t(b) * c.S + s) * k + j];
            if (v < 0 || v >= n) continue;
            const bf16* row = rows.data() + size_t(v) * D;
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += double(__bfloat162float(a.q[r * D + d])) * __bfloat162float(row[d]);
            sc.push_back({dot * a.p.scale, row});
          }
        };
        gather(a.idx, c.K, c.n_main, a.rows);
        gather(a.idx2, c.K2, c.n_extra, a.rows2);
        std::fill(acc.begin(), acc.end(), 0.0);
        double ref_lse = -INFINITY;
        if (!sc.empty()) {
          double m = -INFINITY, l = 0;
          for (auto& e : sc) m = std::max(m, e.first);
          for (auto& e : sc) {
            const double w = std::exp(e.first - m);
            l += w;
            for (int d = 0; d < D; ++d) acc[d] += w * __bfloat162float(e.second[d]);
          }
          ref_lse = m + std::log(l);
          const double denom = l + (c.sink ? std::exp(a.sink[h] - m) : 0.0);
          for (int d = 0; d < D; ++d) acc[d] /= denom;
          if (c.rope)
            for (int i = 0; i < 32; ++i) {
              const double cs = a.rope[((size_t(b) * c.S + s) * 32 + i) * 2], sn = a.rope[((size_t(b) * c.S + s) * 32 + i) * 2 + 1];
              const double x0 = acc[448 + 2 * i], x1 = acc[449 + 2 * i];
              acc[448 + 2 * i] = x0 * cs + x1 * sn;
              acc[449 + 2 * i] = x1 * cs - x0 * sn;
            }
        }
        for (int d = 0; d < D; ++d) {
          const double g = __bfloat162float(out[r * D + d]);
          if (!std::isfinite(g)) return INFINITY;  // unwritten (poison) or NaN
          num += (g - acc[d]) * (g - acc[d]);
          den += acc[d] * acc[d];
        }
        if (std::isinf(ref_lse) != std::isinf(lse[r])) return INFINITY;
        if (!std::isinf(ref_lse)) lse_err = std::max(lse_err, std::fabs(lse[r] - ref_lse));
      }
  if (lse_err > 1e-2) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

static int memcheck(int sms) {
  const AttnCase cases[] = {
      {"tile edges K=65 + extra", 2, 2, 64, 65, 7, 150, 20, 0.2f, true, true, false},
      {"H=128 S=3", 2, 3, 128, 100, 0, 120, 0, 0.1f, true, false, false},
      {"H=96 (partial head block)", 1, 1, 96, 70, 0, 80, 0, 0.0f, false, true, false},
      {"split-K long list", 1, 2, 64, 3000, 40, 4000, 50, 0.1f, true, true, false},
      {"empty lists", 2, 1, 64, 0, 0, 0, 0, 0.0f, true, false, false},
      {"all masked", 1, 2, 64, 130, 0, 10, 0, 1.0f, true, true, false},
      {"one row", 1, 1, 64, 1, 0, 1, 0, 0.0f, false, false, false},
      {"bad indices (>= N, < -1)", 2, 2, 64, 200, 30, 90, 20, 0.1f, true, true, true},
      {"only extra pool", 1, 1, 64, 0, 77, 0, 90, 0.0f, false, false, false},
      {"fp8 main, tile edges + bf16 extra", 2, 2, 64, 65, 7, 150, 20, 0.2f, true, true, false, true, false},
      {"fp8 extra only, H=128", 1, 3, 128, 0, 100, 0, 120, 0.1f, true, false, false, false, true},
      {"fp8 both, split-K", 1, 2, 64, 3000, 40, 4000, 50, 0.1f, true, true, false, true, true},
      {"fp8 both, bad indices", 2, 2, 64, 200, 30, 90, 20, 0.1f, true, true, true, true, true},
      {"fp8 all masked", 1, 2, 64, 130, 0, 10, 0, 1.0f, true, false, false, true, false},
      {"fp8 one row", 1, 1, 64, 1, 0, 1, 0, 0.0f, false, false, false, true, false},
      // more work items than SMs: several waves of CTAs, split-K and a partial head block
      {"many items, bad indices", 40, 4, 64, 150, 20, 300, 40, 0.2f, true, true, true},
      {"many items, split-K", 140, 1, 64, 190, 10, 400, 30, 0.1f, true, false, false},
      {"many items, H=96, short lists", 30, 3, 96, 10, 3, 50, 8, 0.3f, false, true, false},
      {"many items, empty lists", 150, 1, 64, 0, 0, 0, 0, 0.0f, true, false, false},
      {"fp8 both, many items", 40, 4, 64, 150, 20, 300, 40, 0.2f, true, true, true, true, true},
      // one split over 1 or 2 tiles an item, 2.3 / 2.7 items an SM: the persistent kernels' region
      // rotation for odd and even tile counts (--wgmma-persistent, --wgmma-ws-persistent)
      {"fp8 many items, one tile", 150, 2, 64, 40, 10, 300, 30, 0.2f, true, true, false, true, true, 1, 1},
      {"fp8 many items, two tiles, H=96", 60, 3, 96, 90, 10, 200, 20, 0.3f, true, true, true, true, false, 1, 1},
      // 2 splits of 16 tiles: the warp-specialised schedule (H > 64 for bf16, any H for FP8)
      {"long splits, H=128, every 7th row", 32, 1, 128, 2048, 0, 4096, 0, 0.1f, true, true, false, false, false, 7},
      {"fp8 long splits, every 7th row", 64, 1, 64, 2048, 0, 4096, 0, 0.1f, true, true, false, true, false, 7},
      // split counts the benchmark shapes never pick: 3 and 5..8 splits of a 10-tile list
      // (merged in a cluster under --wgmma-cluster, two or more splits empty from 6 on)
      {"3 splits, H=96", 3, 2, 96, 600, 40, 900, 60, 0.1f, true, true, false, false, false, 1, 3},
      {"5 splits", 2, 2, 64, 600, 40, 900, 60, 0.1f, true, true, false, false, false, 1, 5},
      {"7 splits, fp8 main", 2, 2, 64, 600, 40, 900, 60, 0.1f, true, true, false, true, false, 1, 7},
      {"8 splits, 90% of rows masked", 2, 1, 64, 600, 40, 900, 60, 0.9f, true, true, false, false, false, 1, 8},
  };
  int failures = 0;
  for (const auto& c : cases) {
    AttnData a = make_attn(c, sms, false);
    CK(run_attn(a.p, 0));
    CK(cudaDeviceSynchronize());
    const double err = check_attn(c, a);
    const bool ok = err < 1e-2;
    failures += !ok;
    std::printf("attention %-34s splits=%d rel_err=%.2e %s\n", c.name, a.p.num_splits, err, ok ? "ok" : "FAIL");
    free_attn(a);
  }
  // prep: widths that leave partial chunks, both dtypes, FP8 64/128, groups of rows
  // (groups 0: no weight); one width per chunk-count instantiation (1, 2, 4, 8 chunks of 256)
  struct PrepCase { int rows, dim, rope, block; bool f32; int groups, freq_rows; };
  const PrepCase pcs[] = {{37, 136, 64, 0, false, 1, 37},   {64, 512, 64, 64, false, 2, 8}, {33, 2048, 64, 128, true, 1, 33},
                          {16, 192, 0, 64, false, 1, 1},     {8, 8, 8, 0, true, 4, 2},       {19, 512, 64, 0, false, 0, 19},
                          {13, 1000, 64, 0, false, 0, 13},   {9, 520, 8, 0, true, 3, 3},     {40, 264, 64, 0, false, 0, 8},
                          {11, 1536, 64, 128, false, 0, 11}, {7, 256, 256, 64, false, 1, 7},
                          {1001, 512, 64, 0, false, 0, 1001}, {999, 256, 64, 128, true, 1, 333},
                          {2050, 512, 64, 64, false, 1, 1025}};
  for (const auto& c : pcs) {
    jds::RmsNormRopeParams p{};
    const size_t n = size_t(c.rows) * c.dim;
    std::vector<bf16> xb = randn_bf16(n);
    std::vector<float> xf(n), w(size_t(c.groups) * c.dim), f(size_t(c.freq_rows) * c.rope);  // exact sizes
    for (size_t i = 0; i < n; ++i) xf[i] = __bfloat162float(xb[i]);
    for (auto& v : w) v = 0.5f + float(rng() % 100) / 100.f;
    for (size_t i = 0; i < f.size(); ++i) f[i] = std::cos(float(i));
    p.x = c.f32 ? (const void*)upload(xf) : (const void*)upload(xb);
    p.weight = upload(w);  // null when groups == 0
    p.freqs = c.rope ? upload(f) : nullptr;
    const size_t out_bytes = c.block ? n : n * (c.f32 ? 4 : 2);
    p.y = poisoned<uint8_t>(out_bytes);
    p.exps = c.block ? poisoned<uint8_t>(size_t(c.rows) * (c.dim / c.block)) : nullptr;
    p.rows = c.rows, p.dim = c.dim, p.rope_dim = c.rope, p.weight_groups = c.groups ? c.groups : 1;
    p.freq_rows = c.freq_rows;
    p.inverse = 1, p.fp8_block = c.block, p.eps = 1e-6f, p.dtype = c.f32 ? jds::PrepDType::kF32 : jds::PrepDType::kBF16;
    // sms = 1: 3 persistent blocks cycle their groups through the ring many times; the result
    // must equal the one-group-per-block launch (sms = 0) byte for byte
    p.sms = 0;
    p.half_warp_rows = prep_half;
    CK(jds::run_rms_norm_rope(p, 0));
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> y(out_bytes), y_ring(out_bytes), e(p.exps ? size_t(c.rows) * (c.dim / c.block) : 0), e_ring(e.size());
    CK(cudaMemcpy(y.data(), p.y, out_bytes, cudaMemcpyDeviceToHost));
    if (p.exps) CK(cudaMemcpy(e.data(), p.exps, e.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemset(p.y, 0xFF, out_bytes));
    if (p.exps) CK(cudaMemset(p.exps, 0xFF, e.size()));
    p.sms = 1;
    CK(jds::run_rms_norm_rope(p, 0));
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(y_ring.data(), p.y, out_bytes, cudaMemcpyDeviceToHost));
    if (p.exps) CK(cudaMemcpy(e_ring.data(), p.exps, e.size(), cudaMemcpyDeviceToHost));
    bool ok = y == y_ring && e == e_ring;  // and every output written (no poison left):
    if (c.block) {
      for (auto v : y) ok &= (v & 0x7F) != 0x7F;  // e4m3fn NaN is S.1111.111
      for (auto v : e) ok &= v != 0xFF;            // UE8M0 NaN
    } else if (c.f32) {
      for (size_t i = 0; i < n; ++i) ok &= std::isfinite(reinterpret_cast<float*>(y.data())[i]);
    } else {
      for (size_t i = 0; i < n; ++i) ok &= std::isfinite(__bfloat162float(reinterpret_cast<bf16*>(y.data())[i]));
    }
    failures += !ok;
    std::printf("prep rows=%d dim=%d rope=%d fp8=%d f32=%d weight_groups=%d %s\n", c.rows, c.dim, c.rope, c.block, c.f32,
                c.groups, ok ? "ok" : "FAIL");
    for (const void* ptr : {p.x, (const void*)p.weight, (const void*)p.freqs, (const void*)p.y, (const void*)p.exps})
      if (ptr) CK(cudaFree(const_cast<void*>(ptr)));
  }
  std::printf("memcheck driver: %d failure(s)\n", failures);
  return failures ? 1 : 0;
}

// Device time per launch in microseconds: `launch(i)` for i < iters between two CUDA events
// on the default stream.
template <class Launch>
static double event_us(int iters, Launch&& launch) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < iters; ++i) launch(i);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms * 1e3 / iters;
}

// Timing of one case: JSON line with the event time, split count and rates.
static bool bench_rope = false;  // --rope: the bench cases with the inverse-RoPE epilogue (as the V4 models call it)
[[maybe_unused]] static bool bench_timeline = false;  // --timeline (timeline builds)

#ifdef JAX_DSPARK_ATTENTION_TIMELINE
// Nearest-rank quantile q of v (sorted here), 0 when empty.
static double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * (v.size() - 1) + 0.5))];
}

// One isolated launch of `p` with every CTA's timeline recorded, summarised as a JSON line:
// the time between consecutive marks of a CTA (TimelineSlot in the kernel: entry -> Q and
// tile 0 issued -> tile 0 landed -> last tile done -> lse known -> output staged -> stores
// begun -> done) in µs, p50 and p90 over the CTAs with tiles (cycles converted at the clock
// the globaltimer gives); a tile's share of the tile loop; the launch span; how busy the SMs
// were over it; and the gap between consecutive CTAs on one SM (the next one's start minus
// the previous one's end).
static void timeline_case(const char* name, const jds::SparseSinkAttentionParams& p) {
  const int nhb = (p.heads + 63) / 64;
  const int ctas = nhb * p.seq * p.num_splits * p.batch;
  constexpr int W = jds::kAttnTimelineWords, kMarks = W - 4, kNs0 = kMarks, kNs1 = kMarks + 1, kSm = kMarks + 2,
                kTiles = kMarks + 3;
  unsigned long long* buf = nullptr;
  CK(cudaMalloc(&buf, size_t(ctas) * W * 8));
  CK(cudaMemset(buf, 0, size_t(ctas) * W * 8));
  CK(cudaDeviceSynchronize());
  CK(jds::set_attention_timeline(buf, ctas));
  CK(run_attn(p, 0));
  CK(cudaDeviceSynchronize());
  CK(jds::set_attention_timeline(nullptr, 0));
  std::vector<unsigned long long> h(size_t(ctas) * W);
  CK(cudaMemcpy(h.data(), buf, h.size() * 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(buf));
  double cyc = 0, ns = 0;
  unsigned long long t0 = ~0ull, t1 = 0;
  int done = 0;
  for (int i = 0; i < ctas; ++i) {
    const unsigned long long* r = &h[size_t(i) * W];
    if (!r[kNs0] || !r[kNs1]) continue;
    ++done;
    cyc += double(r[kMarks - 1] - r[0]), ns += double(r[kNs1] - r[kNs0]);
    t0 = std::min(t0, r[kNs0]), t1 = std::max(t1, r[kNs1]);
  }
  if (!done || cyc <= 0) {
    std::printf("{\"timeline\": \"%s\", \"error\": \"no CTA recorded\"}\n", name);
    return;
  }
  const double ghz = cyc / ns, us_per_cycle = 1e-3 / ghz;
  // phase k: mark k -> the next mark recorded (the warp-specialised kernel skips kTlIssued)
  static const char* kPhase[kMarks - 1] = {"issue", "land", "tiles", "stats", "stage", "barrier", "store"};
  std::vector<std::vector<double>> phase(kMarks - 1);
  std::vector<double> per_tile, total;
  std::vector<std::vector<std::pair<unsigned long long, unsigned long long>>> by_sm(1024);
  for (int i = 0; i < ctas; ++i) {
    const unsigned long long* r = &h[size_t(i) * W];
    if (!r[kNs0] || !r[kNs1] || r[kSm] >= by_sm.size()) continue;
    by_sm[r[kSm]].push_back({r[kNs0], r[kNs1]});
    total.push_back(double(r[kMarks - 1] - r[0]) * us_per_cycle);
    if (r[kTiles] == 0) continue;
    int prev = 0;
    for (int k = 1; k < kMarks; ++k) {
      if (!r[k]) continue;
      phase[k - 1].push_back(double(r[k] - r[prev]) * us_per_cycle);
      prev = k;
    }
    per_tile.push_back(double(r[3] - r[2]) * us_per_cycle / double(r[kTiles]));
  }
  std::vector<double> gaps, first_start;
  int sms_used = 0, most = 0;
  double busy = 0;
  for (auto& v : by_sm) {
    if (v.empty()) continue;
    ++sms_used;
    most = std::max(most, int(v.size()));
    std::sort(v.begin(), v.end());
    first_start.push_back(double(v[0].first - t0) * 1e-3);
    for (size_t k = 0; k < v.size(); ++k) {
      busy += double(v[k].second - v[k].first) * 1e-3;
      if (k) gaps.push_back((double(v[k].first) - double(v[k - 1].second)) * 1e-3);
    }
  }
  const double span = double(t1 - t0) * 1e-3;
  std::printf("{\"timeline\": \"%s\", \"ctas\": %d, \"recorded\": %d, \"sms\": %d, \"most_ctas_an_sm\": %d, "
              "\"clock_GHz\": %.3f, \"span_us\": %.2f, \"sm_busy_of_span\": %.3f, \"cta_us\": [%.2f, %.2f], "
              "\"per_tile_us\": [%.2f, %.2f], \"gap_between_ctas_us\": [%.2f, %.2f], \"first_start_us\": [%.2f, %.2f]",
              name, ctas, done, sms_used, most, ghz, span, busy / (span * sms_used), quantile(total, 0.5),
              quantile(total, 0.9), quantile(per_tile, 0.5), quantile(per_tile, 0.9), quantile(gaps, 0.5),
              quantile(gaps, 0.9), quantile(first_start, 0.5), quantile(first_start, 0.9));
  for (int k = 0; k < kMarks - 1; ++k)
    if (!phase[k].empty())
      std::printf(", \"%s_us\": [%.2f, %.2f]", kPhase[k], quantile(phase[k], 0.5), quantile(phase[k], 0.9));
  std::printf("}\n");
}
#endif

static void bench_case(const AttnCase& case_in, int sms) {
  const int kSets = 4;  // rotate pools: 4 x pool > L2 for every benchmark case
  AttnCase c = case_in;
  c.rope = c.rope || bench_rope;
  std::vector<AttnData> sets;
  for (int i = 0; i < kSets; ++i) sets.push_back(make_attn(c, sms, true, true));
  for (int i = 0; i < 3; ++i) CK(run_attn(sets[i % kSets].p, 0));
  CK(cudaDeviceSynchronize());
  const double us = event_us(40, [&](int i) { CK(run_attn(sets[i % kSets].p, 0)); });
  const double row_main = c.fp8_main ? 584.0 : 1024.0, row_extra = c.fp8_extra ? 584.0 : 1024.0;
  const double bytes = double(c.B) * (c.K * row_main + c.K2 * row_extra);
  const double flops = 4.0 * c.B * c.S * c.H * (c.K + c.K2) * 512.0;
  std::printf("{\"name\": \"%s%s\", \"B\": %d, \"S\": %d, \"H\": %d, \"K\": %d, \"splits\": %d, "
              "\"tiles_per_split\": %d, \"kernel_event_us\": %.2f, \"TBps\": %.3f, \"TFLOPs\": %.1f}\n",
              c.name, c.rope ? " rope" : "", c.B, c.S, c.H, c.K + c.K2, sets[0].p.num_splits,
              jds::attn_tiles_per_split(c.K + c.K2, sets[0].p.num_splits), us, bytes / us / 1e6, flops / us / 1e6);
#ifdef JAX_DSPARK_ATTENTION_TIMELINE
  if (bench_timeline) timeline_case(c.name, sets[0].p);
#endif
  for (auto& s : sets) free_attn(s);
}

static int bench(int sms, const char* only) {
  const AttnCase cases[] = {
      {"V4-Flash CSA decode", 64, 1, 64, 640, 0, 64 * 640, 0, 0.f, true, false, false},
      {"DSpark block", 64, 5, 64, 128, 5, 64 * 128, 64 * 5, 0.f, true, false, false},
      {"V4-Pro DSpark block", 128, 5, 128, 128, 5, 128 * 128, 128 * 5, 0.f, true, false, false},
      {"V4-Pro HCA long context", 16, 1, 128, 8192, 0, 16 * 8192, 0, 0.f, true, false, false},
      {"dense 16k", 32, 1, 64, 16384, 0, 32 * 16384, 0, 0.f, true, false, false},
      {"V4-Flash CSA decode fp8", 64, 1, 64, 640, 0, 64 * 640, 0, 0.f, true, false, false, true, false},
      {"DSpark block fp8", 64, 5, 64, 128, 5, 64 * 128, 64 * 5, 0.f, true, false, false, true, true},
      {"V4-Pro DSpark block fp8", 128, 5, 128, 128, 5, 128 * 128, 128 * 5, 0.f, true, false, false, true, true},
      {"V4-Pro HCA long context fp8", 16, 1, 128, 8192, 0, 16 * 8192, 0, 0.f, true, false, false, true, false},
      {"dense 16k fp8", 32, 1, 64, 16384, 0, 32 * 16384, 0, 0.f, true, false, false, true, false},
  };
  for (const auto& c : cases)
    if (!only || std::strstr(c.name, only)) bench_case(c, sms);
  return 0;
}

// One shape given on the command line: B S H K [fp8], one pool of distinct rows per request,
// no extra pool, sink on, no RoPE epilogue (as the benchmark cases).
static int bench_shape(int sms, const char* const* args, int nargs) {
  if (nargs < 5) {
    std::printf("usage: kernel_driver bench-shape B S H K [fp8]\n");
    return 2;
  }
  const int B = std::atoi(args[1]), S = std::atoi(args[2]), H = std::atoi(args[3]), K = std::atoi(args[4]);
  const bool fp8 = nargs > 5 && std::strcmp(args[5], "fp8") == 0;
  if (B < 1 || S < 1 || S > 8 || H < 1 || H > 1024 || K < 1 || int64_t(B) * K > (int64_t(1) << 23)) {
    std::printf("bench-shape: B %d, S %d, H %d, K %d out of range (B, K >= 1, B * K <= 2^23 rows, 1 <= S <= 8, 1 <= H <= 1024)\n", B, S,
                H, K);
    return 2;
  }
  AttnCase c{"shape", B, S, H, K, 0, B * K, 0, 0.f, true, false, false, fp8, false};
  bench_case(c, sms);
  return 0;
}

// Pure device time of the prep kernel on the `jax-dspark bench prep` cases (x [rows, 512] bf16,
// RoPE 64, per-position (cos, sin) shared by H rows), rotating 4 input sets, next to a
// device-to-device copy of the same bytes: what the XLA-launched numbers would be without
// launch gaps, and how close the kernel is to the copy ceiling.
static int bench_prep(int sms, const char* only) {
  struct Case { const char* name; int positions, heads, block; bool weight; };
  const Case cases[] = {{"V4-Flash q decode", 64, 64, 0, false},       {"DSpark block q", 320, 64, 0, false},
                        {"V4-Pro DSpark block q", 640, 128, 0, false}, {"kv prefill 16k + FP8 1x64", 16384, 1, 64, true},
                        {"q prefill 4k x 64 + FP8 1x128", 4096, 64, 128, false}};
  const int D = 512, R = 64, kSets = 4, iters = 50;
  for (const auto& c : cases) {
    if (only && !std::strstr(c.name, only)) continue;
    const int64_t rows = int64_t(c.positions) * c.heads;
    const size_t n = size_t(rows) * D, out_bytes = c.block ? n + n / c.block : n * 2;
    std::vector<jds::RmsNormRopeParams> sets(kSets);
    std::vector<float> w(D), f(size_t(c.positions) * R);
    for (auto& v : w) v = 0.5f + float(rng() % 100) / 100.f;
    for (size_t i = 0; i < f.size(); ++i) f[i] = std::cos(float(i));
    for (auto& p : sets) {
      p = {};
      p.x = device_fill(n, Fill::kRandnBf16);
      p.weight = c.weight ? upload(w) : nullptr;
      p.freqs = upload(f);
      p.y = poisoned<uint8_t>(c.block ? n : n * 2);
      p.exps = c.block ? poisoned<uint8_t>(n / c.block) : nullptr;
      p.rows = rows, p.dim = D, p.rope_dim = R, p.weight_groups = 1, p.freq_rows = c.positions;
      p.fp8_block = c.block, p.eps = 1e-6f, p.dtype = jds::PrepDType::kBF16, p.sms = sms;
      p.half_warp_rows = prep_half;
    }
    for (int i = 0; i < 3; ++i) CK(jds::run_rms_norm_rope(sets[i % kSets], 0));
    const double us = event_us(iters, [&](int i) { CK(jds::run_rms_norm_rope(sets[i % kSets], 0)); });
    // the copy ceiling at this size: a device copy of y's bytes (read + written)
    const size_t copy_bytes = c.block ? n : n * 2;  // the size of y
    const double copy_us = event_us(iters, [&](int i) {
      CK(cudaMemcpyAsync(sets[i % kSets].y, sets[(i + 1) % kSets].x, copy_bytes, cudaMemcpyDeviceToDevice, 0));
    });
    const double bytes = double(n) * 2 + double(out_bytes);
    std::printf("{\"name\": \"%s\", \"rows\": %lld, \"kernel_event_us\": %.2f, \"TBps\": %.3f, "
                "\"copy_event_us\": %.2f, \"copy_TBps\": %.3f}\n",
                c.name, (long long)rows, us, bytes / us / 1e6, copy_us, 2.0 * copy_bytes / copy_us / 1e6);
    for (auto& p : sets)
      for (const void* ptr : {p.x, (const void*)p.weight, (const void*)p.freqs, (const void*)p.y, (const void*)p.exps})
        if (ptr) CK(cudaFree(const_cast<void*>(ptr)));
  }
  return 0;
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // keep partial output if a time limit kills us
  int sms = 132;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const char* args[6] = {};
  int nargs = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--wgmma") == 0) {
      run_attn = jds::run_sparse_sink_attention_wgmma;
    } else if (std::strcmp(argv[i], "--wgmma-lockstep") == 0) {
      run_attn = jds::run_sparse_sink_attention_wgmma_lockstep;
    } else if (std::strcmp(argv[i], "--wgmma-ws") == 0) {
      run_attn = jds::run_sparse_sink_attention_wgmma_ws;
    } else if (std::strcmp(argv[i], "--wgmma-persistent") == 0) {
      run_attn = jds::run_sparse_sink_attention_wgmma_persistent;
    } else if (std::strcmp(argv[i], "--wgmma-ws-persistent") == 0) {
      run_attn = jds::run_sparse_sink_attention_wgmma_ws_persistent;
    } else if (std::strcmp(argv[i], "--wgmma-cluster") == 0) {
      run_attn = jds::run_sparse_sink_attention_wgmma_cluster;
    } else if (std::strcmp(argv[i], "--wgmma-combine") == 0) {
      run_attn = jds::run_sparse_sink_attention_wgmma_combine;
    } else if (std::strcmp(argv[i], "--rope") == 0) {
      bench_rope = true;
    } else if (std::strcmp(argv[i], "--timeline") == 0) {
#ifndef JAX_DSPARK_ATTENTION_TIMELINE
      std::printf("--timeline: this kernel_driver was built without -DJAX_DSPARK_ATTENTION_TIMELINE=ON\n");
      return 2;
#endif
      bench_timeline = true;
    } else if (std::strcmp(argv[i], "--late-start") == 0 && i + 1 < argc) {
#ifndef JAX_DSPARK_ATTENTION_TIMELINE
      std::printf("--late-start: this kernel_driver was built without -DJAX_DSPARK_ATTENTION_TIMELINE=ON\n");
      return 2;
#else
      CK(jds::set_persistent_late_start(std::atoll(argv[++i])));
#endif
    } else if (std::strcmp(argv[i], "--prep-half") == 0) {
      prep_half = 1;
    } else if (std::strcmp(argv[i], "--probe-gather1") == 0) {
      run_attn = probe_gather1;
    } else if (std::strcmp(argv[i], "--probe-gather2") == 0) {
      run_attn = probe_gather2;
    } else if (std::strcmp(argv[i], "--probe-math") == 0) {
      run_attn = probe_math;
    } else if (nargs < 6) {
      args[nargs++] = argv[i];
    }
  }
  const bool probe = run_attn == probe_gather1 || run_attn == probe_gather2 || run_attn == probe_math;
  if (prep_half) std::printf("prep: rows of <= 1 KB half a warp each where the layout allows\n");
  std::printf("attention kernel: %s\n", run_attn == jds::run_sparse_sink_attention                ? "mma.sync"
                                         : run_attn == jds::run_sparse_sink_attention_wgmma       ? "wgmma"
                                         : run_attn == jds::run_sparse_sink_attention_wgmma_ws    ? "wgmma ws"
                                         : run_attn == jds::run_sparse_sink_attention_wgmma_persistent ? "wgmma persistent (one split)"
                                         : run_attn == jds::run_sparse_sink_attention_wgmma_ws_persistent ? "wgmma persistent warp-specialised (one split)"
                                         : run_attn == jds::run_sparse_sink_attention_wgmma_cluster ? "wgmma, split partials merged in a cluster"
                                         : run_attn == jds::run_sparse_sink_attention_wgmma_combine ? "wgmma, split partials through the combine launch"
                                         : run_attn == probe_gather1 ? "probe: lockstep gather alone, 1 tile in flight"
                                         : run_attn == probe_gather2 ? "probe: lockstep gather alone, 2 tiles in flight"
                                         : run_attn == probe_math    ? "probe: lockstep compute alone"
                                                                     : "wgmma lockstep");
  if (nargs > 0 && std::strcmp(args[0], "bench-shape") == 0) return bench_shape(sms, args, nargs);
  if (nargs > 0 && std::strcmp(args[0], "bench") == 0) return bench(sms, nargs > 1 ? args[1] : nullptr);
  if (nargs > 0 && std::strcmp(args[0], "bench-prep") == 0) return bench_prep(sms, nargs > 1 ? args[1] : nullptr);
  if (probe) {
    std::printf("the probes only time (bench, bench-shape): their outputs are not attention\n");
    return 2;
  }
  return memcheck(sms);
}
