// The CPU's int8 multiply-add peak, measured: every thread runs independent chains of the
// widest int8 dot-product instructions this build has, with nothing else in the loop, and
// the threads' rates add up. The benchmarks hold the GEMM kernels against this number
// (benchmarks/machine_peaks.py): a formula (instructions per cycle x clock) cannot know how
// many ports a core really has for them, nor the clock a VM runs at.
//
// One figure per instruction form, NaN where the build lacks it:
//   0  vpdpbusd ymm      (AVX-512 VNNI with VL, or AVX-VNNI)    32 MACs
//   1  vpdpbusd zmm      (AVX-512 VNNI)                        64 MACs
//   2  vpmaddubsw + vpmaddwd ymm (AVX2: a dot product without VNNI)   32 MACs per pair
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Independent accumulator chains: more than a dot's latency x the ports that issue it
// (4-5 cycles x 2), so the loop measures throughput, not latency.
constexpr int kChains = 12;

template <typename Body>
double ops_per_s(int64_t iterations, double ops_per_iteration, Body body) {
  const int threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto start = std::chrono::steady_clock::now();
      const int64_t sink = body(iterations);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // The sink keeps the chains alive; it is never zero for these inputs.
      rates[t] = sink == 0 ? 0.0 : iterations * ops_per_iteration / seconds;
    }
  });
  double total = 0.0;
  for (double rate : rates) total += rate;
  return total;
}

#if defined(__AVX2__)
// An opaque copy: the compiler may not treat the operands as constants and fold the loop.
template <typename V>
inline void opaque(V& v) {
  asm volatile("" : "+x"(v));
}

template <typename V>
int64_t lane_sum(const V* acc, int count) {
  alignas(64) int32_t lanes[sizeof(V) / 4];
  int64_t sum = 0;
  for (int c = 0; c < count; ++c) {
    std::memcpy(lanes, &acc[c], sizeof(V));
    for (int32_t lane : lanes) sum += lane;
  }
  return sum;
}
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
int64_t dpbusd_ymm(int64_t iterations) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  opaque(a);
  opaque(b);
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c + 1);
  for (int64_t n = 0; n < iterations; ++n) {
    for (int c = 0; c < kChains; ++c) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      acc[c] = _mm256_dpbusd_epi32(acc[c], a, b);
#else
      acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
#endif
    }
  }
  return lane_sum(acc, kChains);
}
#endif

#if defined(__AVX512VNNI__)
int64_t dpbusd_zmm(int64_t iterations) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  asm volatile("" : "+v"(a));
  asm volatile("" : "+v"(b));
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c + 1);
  for (int64_t n = 0; n < iterations; ++n) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  }
  int64_t sum = 0;
  for (int c = 0; c < kChains; ++c) sum += _mm512_reduce_add_epi32(acc[c]);
  return sum;
}
#endif

#if defined(__AVX2__)
// The signed operand passes through an empty asm before each use, so the compiler can neither
// hoist the constant products out of the loop nor share one between chains.
int64_t maddubs_ymm(int64_t iterations) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  const __m256i ones = _mm256_set1_epi16(1);
  opaque(a);
  __m256i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c + 1);
  for (int64_t n = 0; n < iterations; ++n) {
    for (int c = 0; c < kChains; ++c) {
      opaque(b);
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
    }
  }
  return lane_sum(acc, kChains);
}
#endif

std::vector<double> int8_dot_peak(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "int8_dot_peak: iterations must be positive, got ", iterations);
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> figures(3, nan);
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  figures[0] = ops_per_s(iterations, 2.0 * 32 * kChains, dpbusd_ymm);
#endif
#if defined(__AVX512VNNI__)
  figures[1] = ops_per_s(iterations, 2.0 * 64 * kChains, dpbusd_zmm);
#endif
#if defined(__AVX2__)
  figures[2] = ops_per_s(iterations, 2.0 * 32 * kChains, maddubs_ymm);
#endif
  return figures;
}

}  // namespace

// No tensor arguments: one kernel for every dispatch key.
TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("int8_dot_peak(int iterations) -> float[]", &int8_dot_peak);
}
