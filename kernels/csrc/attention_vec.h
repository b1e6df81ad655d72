// Vector primitives for the CPU attention and KV-cache kernels (paged_decode_attention.cpp,
// write_kv_cache.cpp): one struct per instruction set with the same static interface, so each
// kernel is written once and instantiated for AVX-512 (16 lanes), AVX2 (8 lanes) and a
// portable scalar backend (1 lane; always built, and what runs when the SIMD ones are not).
//
// Every conversion matches torch bit for bit: bf16 is the top half of an fp32 (widening is a
// shift, narrowing rounds to nearest even with the NaN rule of c10::BFloat16), fp16 goes
// through the F16C/AVX-512 converters with round-to-nearest-even. No -ffast-math: NaN flows
// through max, exp and the sums as it does in torch.
//
// LLMSERVE_SCALAR_KERNELS (a compile-time macro) leaves the SIMD backends out entirely; the
// op llmserve::set_scalar_kernels switches to the scalar backend at run time.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if !defined(LLMSERVE_SCALAR_KERNELS) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMSERVE_HAVE_AVX2 1
#endif
// The AVX-512 backend borrows AVX2 helpers (every AVX-512 CPU has AVX2).
#if defined(LLMSERVE_HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX512VL__)
#define LLMSERVE_HAVE_AVX512 1
#endif
#if defined(LLMSERVE_HAVE_AVX512) || defined(LLMSERVE_HAVE_AVX2)
#include <immintrin.h>
#endif
// Test builds only (tests/kernels/cpu_kernel_variant.py): the AVX-512 backend on lane-by-lane
// models of its intrinsics, so it runs and is checked on CPUs without AVX-512.
#if defined(LLMSERVE_EMULATE_AVX512) && defined(LLMSERVE_HAVE_AVX2)
#include "avx512_emulation.h"
#define LLMSERVE_HAVE_AVX512 1
#endif

namespace llmserve_cpu {

// Set by the op llmserve::set_scalar_kernels; read once per op call.
std::atomic<bool>& scalar_kernels_forced();

namespace {

// Inputs to exp are clamped to [kExpLow, kExpHigh]: below kExpLow the result is flushed to 0
// (the exact value is a denormal under 1.2e-38, nothing a softmax weight can use); above
// kExpHigh only tanh's exp(2|x|) goes, where any value that large gives tanh = 1.
constexpr float kExpLow = -87.33654f;
constexpr float kExpHigh = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
// ln 2 split in two so that n * kLn2High is exact for |n| <= 128 (Cody-Waite reduction).
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
// exp(r) on [-ln2/2, ln2/2]: 1 + r + r^2 * P(r), P of degree 5 (Cephes expf), ~1 ulp.
constexpr float kExpP0 = 1.9875691500e-4f;
constexpr float kExpP1 = 1.3981999507e-3f;
constexpr float kExpP2 = 8.3334519073e-3f;
constexpr float kExpP3 = 4.1665795894e-2f;
constexpr float kExpP4 = 1.6666665459e-1f;
constexpr float kExpP5 = 5.0000001201e-1f;
// tanh(x) for |x| < kTanhSmall: x + x^3 Q(x^2), Q of degree 4 (Cephes tanhf), ~2 ulp; above,
// 1 - 2 / (exp(2|x|) + 1) with x's sign, where the subtraction loses nothing.
constexpr float kTanhSmall = 0.625f;
constexpr float kTanhQ0 = -5.70498872745e-3f;
constexpr float kTanhQ1 = 2.06390887954e-2f;
constexpr float kTanhQ2 = -5.37397155531e-2f;
constexpr float kTanhQ3 = 1.33314422036e-1f;
constexpr float kTanhQ4 = -3.33332819422e-1f;

inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

// ---------------------------------------------------------------------------------------
// Scalar backend: one lane. The reference semantics of every primitive below.
// ---------------------------------------------------------------------------------------
struct ScalarVec {
  using Reg = float;
  static constexpr int kWidth = 1;
  // Plenty: the compiler keeps what fits in registers and spills the rest.
  static constexpr int kRegisters = 32;
  static constexpr const char* kName = "scalar";

  static Reg zero() { return 0.f; }
  static Reg set1(float x) { return x; }
  static Reg load(const float* p) { return *p; }
  static Reg load(const c10::BFloat16* p) { return bf16_bits_to_float(p->x); }
  static Reg load(const c10::Half* p) { return static_cast<float>(*p); }
  static Reg load(const int8_t* p) { return static_cast<float>(*p); }
  static void store(float* p, Reg x) { *p = x; }
  static void store(c10::BFloat16* p, Reg x) { *p = c10::BFloat16(x); }
  static void store(c10::Half* p, Reg x) { *p = c10::Half(x); }
  static Reg add(Reg a, Reg b) { return a + b; }
  static Reg mul(Reg a, Reg b) { return a * b; }
  static Reg div(Reg a, Reg b) { return a / b; }
  static Reg fma(Reg a, Reg b, Reg c) { return std::fma(a, b, c); }
  // NaN-propagating max (std::max would drop a NaN in its second argument).
  static Reg max(Reg a, Reg b) { return (a > b || std::isnan(a)) ? a : b; }
  static Reg abs(Reg a) { return std::fabs(a); }
  static Reg clamp(Reg x, float low, float high) { return x < low ? low : (x > high ? high : x); }
  static Reg round_even(Reg x) { return std::nearbyint(x); }  // default mode: to nearest even
  static float reduce_add(Reg x) { return x; }
  static float reduce_max(Reg x) { return x; }
  static Reg exp(Reg x) {
    if (x < kExpLow) return 0.f;
    return std::exp(x);
  }
  static Reg tanh(Reg x) { return std::tanh(x); }
  // rows[j] summed over its lanes lands in lane j.
  static Reg transpose_reduce(const Reg* rows) { return rows[0]; }
  // Lane i gets scales[i / group] (scales already offset to the vector's first group).
  static Reg expand_scales(const float* scales, int64_t /*group*/) { return scales[0]; }
  // Rounded, clamped codes -> int8.
  static void store_codes(int8_t* p, Reg codes) { *p = static_cast<int8_t>(codes); }
};

#if defined(LLMSERVE_HAVE_AVX2)
// ---------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: 8 lanes, 16 registers.
// ---------------------------------------------------------------------------------------
struct Avx2Vec {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRegisters = 16;
  static constexpr const char* kName = "avx2";

  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static Reg load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Reg load(const int8_t* p) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
  }
  static void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
  static void store(c10::BFloat16* p, Reg x) {
    // Round to nearest even on the bit pattern; NaN becomes the canonical 0x7FC0 (c10's rule).
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    rounded = _mm256_srli_epi32(rounded, 16);
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    rounded = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), is_nan));
    // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather qwords 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(c10::Half* p, Reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg max(Reg a, Reg b) {
    // maxps returns its second operand when either is NaN: make a NaN in `a` win too.
    const Reg m = _mm256_max_ps(a, b);
    return _mm256_blendv_ps(m, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static Reg abs(Reg a) {
    return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  }
  static Reg clamp(Reg x, float low, float high) {
    return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(low)), _mm256_set1_ps(high));
  }
  static Reg round_even(Reg x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static float reduce_add(Reg x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static __m128 max128(__m128 a, __m128 b) {
    return _mm_blendv_ps(_mm_max_ps(a, b), a, _mm_cmpunord_ps(a, a));
  }
  static float reduce_max(Reg x) {
    __m128 m = max128(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = max128(m, _mm_movehl_ps(m, m));
    m = max128(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static Reg exp(Reg x) {
    const Reg tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_LT_OQ);
    // min/max return the second operand on NaN: x second keeps a NaN input NaN.
    x = _mm256_min_ps(_mm256_set1_ps(kExpHigh), x);
    x = _mm256_max_ps(_mm256_set1_ps(kExpLow), x);
    const Reg n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Reg r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
    Reg p = _mm256_set1_ps(kExpP0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    // 2^n built in the exponent field; n is in [-126, 127] after the clamp.
    const __m256i exponent =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const Reg result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
    return _mm256_blendv_ps(result, _mm256_setzero_ps(), tiny);
  }
  static Reg tanh(Reg x) {
    const Reg z = _mm256_mul_ps(x, x);
    Reg q = _mm256_set1_ps(kTanhQ0);
    q = _mm256_fmadd_ps(q, z, _mm256_set1_ps(kTanhQ1));
    q = _mm256_fmadd_ps(q, z, _mm256_set1_ps(kTanhQ2));
    q = _mm256_fmadd_ps(q, z, _mm256_set1_ps(kTanhQ3));
    q = _mm256_fmadd_ps(q, z, _mm256_set1_ps(kTanhQ4));
    const Reg small = _mm256_fmadd_ps(_mm256_mul_ps(q, z), x, x);
    const Reg ax = abs(x);
    const Reg one = _mm256_set1_ps(1.f);
    const Reg e = exp(_mm256_add_ps(ax, ax));  // NaN stays NaN
    const Reg ratio = _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one));
    Reg large = _mm256_fnmadd_ps(ratio, one, one);
    large = _mm256_or_ps(large, _mm256_and_ps(x, _mm256_set1_ps(-0.f)));
    return _mm256_blendv_ps(large, small,
                            _mm256_cmp_ps(ax, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ));
  }
  static Reg transpose_reduce(const Reg* rows) {
    // hadd pairs twice: [r0 r1 r2 r3 (low halves) | r0 r1 r2 r3 (high halves)], same for r4..7.
    const Reg t0 = _mm256_hadd_ps(rows[0], rows[1]);
    const Reg t1 = _mm256_hadd_ps(rows[2], rows[3]);
    const Reg t2 = _mm256_hadd_ps(rows[4], rows[5]);
    const Reg t3 = _mm256_hadd_ps(rows[6], rows[7]);
    const Reg u0 = _mm256_hadd_ps(t0, t1);
    const Reg u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  static Reg expand_scales(const float* scales, int64_t group) {
    // group in {1, 2, 4}: lane i reads scales[i / group] (the caller pads `scales` to 8).
    const int shift = group == 1 ? 0 : (group == 2 ? 1 : 2);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i index = _mm256_srlv_epi32(lanes, _mm256_set1_epi32(shift));
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(scales), index);
  }
  static void store_codes(int8_t* p, Reg codes) {
    const __m256i words = _mm256_cvtps_epi32(codes);
    const __m128i shorts =
        _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(shorts, shorts));
  }
};
#endif  // LLMSERVE_HAVE_AVX2

#if defined(LLMSERVE_HAVE_AVX512)
// ---------------------------------------------------------------------------------------
// AVX-512 (F, BW, DQ, VL): 16 lanes, 32 registers.
// ---------------------------------------------------------------------------------------
struct Avx512Vec {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRegisters = 32;
  static constexpr const char* kName = "avx512";

  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const c10::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static Reg load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Reg load(const int8_t* p) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
  }
  static void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
  static void store(c10::BFloat16* p, Reg x) {
    // Not vcvtneps2bf16: it flushes denormals, c10::BFloat16 keeps them.
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    rounded = _mm512_srli_epi32(rounded, 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  static void store(c10::Half* p, Reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg max(Reg a, Reg b) {
    const Reg m = _mm512_max_ps(a, b);
    return _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
  }
  static Reg abs(Reg a) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  static Reg clamp(Reg x, float low, float high) {
    return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(low)), _mm512_set1_ps(high));
  }
  static Reg round_even(Reg x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static float reduce_add(Reg x) {
    const __m256 half =
        _mm256_add_ps(_mm512_castps512_ps256(x),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(Reg x) {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    const __m256 low = _mm512_castps512_ps256(x);
    const __m256 m =
        _mm256_blendv_ps(_mm256_max_ps(low, high), low, _mm256_cmp_ps(low, low, _CMP_UNORD_Q));
    return Avx2Vec::reduce_max(m);
  }
  static Reg exp(Reg x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(kExpHigh), x);
    x = _mm512_max_ps(_mm512_set1_ps(kExpLow), x);
    const Reg n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Reg r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
    Reg p = _mm512_set1_ps(kExpP0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    // scalef multiplies by 2^n without building the exponent by hand.
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
  }
  static Reg tanh(Reg x) {
    const Reg z = _mm512_mul_ps(x, x);
    Reg q = _mm512_set1_ps(kTanhQ0);
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(kTanhQ1));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(kTanhQ2));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(kTanhQ3));
    q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(kTanhQ4));
    const Reg small = _mm512_fmadd_ps(_mm512_mul_ps(q, z), x, x);
    const Reg ax = abs(x);
    const Reg one = _mm512_set1_ps(1.f);
    const Reg e = exp(_mm512_add_ps(ax, ax));  // NaN stays NaN
    const Reg ratio = _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one));
    Reg large = _mm512_fnmadd_ps(ratio, one, one);
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    large = _mm512_mask_mov_ps(large, negative, _mm512_mul_ps(large, _mm512_set1_ps(-1.f)));
    const __mmask16 near_zero = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(kTanhSmall), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(large, near_zero, small);
  }
  static Reg transpose_reduce(const Reg* rows) {
    // 1: pairs of rows -> per 128-bit lane [a(0+2) b(0+2) a(1+3) b(1+3)].
    Reg s1[8];
    for (int i = 0; i < 8; ++i) {
      s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]),
                            _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]));
    }
    // 2: per 128-bit lane, the lane's sum for 4 consecutive rows.
    Reg s2[4];
    for (int i = 0; i < 4; ++i) {
      const __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
      s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // 3 and 4: add the 128-bit lanes pairwise across vectors until lane j holds row j.
    Reg s3[2];
    for (int i = 0; i < 2; ++i) {
      s3[i] =
          _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static Reg expand_scales(const float* scales, int64_t group) {
    // group in {1, 2, 4, 8}: lane i reads scales[i / group] (the caller pads `scales` to 16).
    const int shift = group == 1 ? 0 : (group == 2 ? 1 : (group == 4 ? 2 : 3));
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i index = _mm512_srlv_epi32(lanes, _mm512_set1_epi32(shift));
    return _mm512_permutexvar_ps(index, _mm512_loadu_ps(scales));
  }
  static void store_codes(int8_t* p, Reg codes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(codes)));
  }
};
#endif  // LLMSERVE_HAVE_AVX512

// Scales of an int8 cache, any of the three float dtypes, widened to fp32.
inline void load_scales(const void* src, c10::ScalarType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case c10::ScalarType::Half: {
      const auto* s = static_cast<const c10::Half*>(src);
      int64_t i = 0;
#if defined(LLMSERVE_HAVE_AVX2)
      // Once per cached row and scale group: worth the F16C converter.
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Avx2Vec::load(s + i));
#endif
      for (; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      break;
    }
    case c10::ScalarType::BFloat16: {
      const auto* s = static_cast<const c10::BFloat16*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(s[i].x);
      break;
    }
    default: {
      std::memcpy(dst, src, n * sizeof(float));
      break;
    }
  }
}

// Whether backend V can run a row of `head_dim` values with `group` values per int8 scale
// (group 0: not an int8 cache). A scale vector must be a broadcast or a lane permutation.
template <class V>
inline bool backend_fits(int64_t head_dim, int64_t group) {
  if (head_dim % V::kWidth != 0) return false;
  if (group == 0 || V::kWidth == 1) return true;
  if (group % V::kWidth == 0) return true;
  return V::kWidth % group == 0 && (group == 1 || group == 2 || group == 4 || group == 8);
}

// Strides of a paged cache (or its scales) [num_blocks, block_size, Hkv, D], in elements.
struct RowStrides {
  int64_t block = 0, token = 0, head = 0;
  template <class Tensor>
  static RowStrides of(const Tensor& t) {
    return {t.stride(0), t.stride(1), t.stride(2)};
  }
  int64_t at(int64_t block_id, int64_t offset, int64_t kv_head) const {
    return block_id * block + offset * token + kv_head * head;
  }
};

enum class Isa { kScalar, kAvx2, kAvx512 };

// The widest backend compiled in that fits the row shape, unless the scalar one is forced.
inline Isa pick_isa(int64_t head_dim, int64_t group) {
  if (scalar_kernels_forced().load(std::memory_order_relaxed)) return Isa::kScalar;
#if defined(LLMSERVE_HAVE_AVX512)
  if (backend_fits<Avx512Vec>(head_dim, group)) return Isa::kAvx512;
#endif
#if defined(LLMSERVE_HAVE_AVX2)
  if (backend_fits<Avx2Vec>(head_dim, group)) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

}  // namespace
}  // namespace llmserve_cpu
