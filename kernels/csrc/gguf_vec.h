// The vector widths of the x8 tiles (gguf_super_x8.h): the same kernel code over one 8-row
// group in a 256-bit vector (V8) or over two adjacent groups in a 512-bit one (V16: lanes
// 0-7 are group g's rows, 8-15 group g + 1's, so the 16 output rows stay contiguous).
//
// Why two widths: a core whose 512-bit units are full width (Zen 5, Intel's server cores)
// issues as many vpdpbusd zmm per cycle as ymm, twice the multiply-adds; the codes' unpacking
// and the activations' broadcasts are then paid once per 16 rows instead of 8. Measured on the
// 2-core Zen 5 machine (`python -m benchmarks.machine_peaks`): 1099 GOPS ymm, 2201 zmm.
//
// Each lane's arithmetic is the same in both widths (the same integer operations, the same
// float operations in the same order), so a row's result never depends on which width, nor
// on its neighbours: a row is a lane.
//
// A vector is addressed by a byte offset into group g's block; V16 loads the same offset of
// group g + 1, `group_stride` bytes further.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace gguf_x8 {

struct V8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;

  static I load(const uint8_t* p, int64_t) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  // The 8 rows' fp16 field at p, as floats.
  static F halves(const uint8_t* p, int64_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I zero() { return _mm256_setzero_si256(); }
  static F zero_ps() { return _mm256_setzero_ps(); }
  static I set1_8(char v) { return _mm256_set1_epi8(v); }
  static I set1_16(short v) { return _mm256_set1_epi16(v); }
  static I set1_32(int v) { return _mm256_set1_epi32(v); }
  static F set1_ps(float v) { return _mm256_set1_ps(v); }
  // A 16-byte pattern in every 128-bit lane (vpshufb controls).
  static I lanes16(__m128i v) { return _mm256_broadcastsi128_si256(v); }

  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I sub8(I a, I b) { return _mm256_sub_epi8(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I shuffle8(I v, I control) { return _mm256_shuffle_epi8(v, control); }
  template <int N> static I slli16(I v) { return _mm256_slli_epi16(v, N); }
  template <int N> static I srli16(I v) { return _mm256_srli_epi16(v, N); }
  template <int N> static I srai16(I v) { return _mm256_srai_epi16(v, N); }
  template <int N> static I slli32(I v) { return _mm256_slli_epi32(v, N); }
  template <int N> static I srli32(I v) { return _mm256_srli_epi32(v, N); }
  template <int N> static I srai32(I v) { return _mm256_srai_epi32(v, N); }
  static I srl16(I v, __m128i count) { return _mm256_srl_epi16(v, count); }
  static I sll32(I v, __m128i count) { return _mm256_sll_epi32(v, count); }
  static I srl32(I v, __m128i count) { return _mm256_srl_epi32(v, count); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I abs8(I v) { return _mm256_abs_epi8(v); }
  static I sign8(I v, I sign) { return _mm256_sign_epi8(v, sign); }
  // `value` in the bytes where a == b, else 0.
  static I where_eq8(I a, I b, I value) { return _mm256_and_si256(_mm256_cmpeq_epi8(a, b), value); }
#ifdef __AVX512VL__
  static I rolv32(I v, I count) { return _mm256_rolv_epi32(v, count); }
  template <int IMM> static I ternary(I a, I b, I c) {
    return _mm256_ternarylogic_epi32(a, b, c, IMM);
  }
#endif

  // 4 activation codes at p in every lane.
  static I broadcast4(const int8_t* p) {
    return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
  }
#ifdef GGUF_VNNI
  // acc + the byte dots of q (u8) against the 4 codes at p (s8) in every lane.
  static I dpbusd(I acc, I q, const int8_t* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(GGUF_VNNI_EMULATED)
    // The broadcast folded into the dot's memory operand ({1to8}): no separate broadcast
    // instruction on the vector ports.
    asm("vpdpbusd %2%{1to8%}, %1, %0"
        : "+v"(acc)
        : "v"(q), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
#else
    return GGUF_DPBUSD(acc, q, broadcast4(p));
#endif
  }
#endif

  // acc + the int16 pair products of a against the pair at p in every lane (vpdpwssd where
  // the build has VNNI: one instruction for vpmaddwd and the add).
  static I dpwssd(I acc, I a, const int8_t* p) {
#if defined(GGUF_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    !defined(GGUF_VNNI_EMULATED)
    asm("vpdpwssd %2%{1to8%}, %1, %0"
        : "+v"(acc)
        : "v"(a), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
#elif defined(GGUF_VNNI) && defined(__AVXVNNI__) && !defined(GGUF_VNNI_EMULATED)
    return _mm256_dpwssd_avx_epi32(acc, a, broadcast4(p));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, broadcast4(p)));
#endif
  }

  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

// With VNNI, only where the 512-bit vpdpbusd exists natively.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    (!defined(GGUF_VNNI) || (defined(__AVX512VNNI__) && !defined(GGUF_VNNI_EMULATED)))
#define GGUF_V16 1
struct V16 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;

  static I load(const uint8_t* p, int64_t group_stride) {
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + group_stride));
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  static F halves(const uint8_t* p, int64_t group_stride) {
    const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + group_stride));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1));
  }
  static I zero() { return _mm512_setzero_si512(); }
  static F zero_ps() { return _mm512_setzero_ps(); }
  static I set1_8(char v) { return _mm512_set1_epi8(v); }
  static I set1_16(short v) { return _mm512_set1_epi16(v); }
  static I set1_32(int v) { return _mm512_set1_epi32(v); }
  static F set1_ps(float v) { return _mm512_set1_ps(v); }
  static I lanes16(__m128i v) { return _mm512_broadcast_i32x4(v); }

  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I sub8(I a, I b) { return _mm512_sub_epi8(a, b); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I maddubs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I shuffle8(I v, I control) { return _mm512_shuffle_epi8(v, control); }
  template <int N> static I slli16(I v) { return _mm512_slli_epi16(v, N); }
  template <int N> static I srli16(I v) { return _mm512_srli_epi16(v, N); }
  template <int N> static I srai16(I v) { return _mm512_srai_epi16(v, N); }
  template <int N> static I slli32(I v) { return _mm512_slli_epi32(v, N); }
  template <int N> static I srli32(I v) { return _mm512_srli_epi32(v, N); }
  template <int N> static I srai32(I v) { return _mm512_srai_epi32(v, N); }
  static I srl16(I v, __m128i count) { return _mm512_srl_epi16(v, count); }
  static I sll32(I v, __m128i count) { return _mm512_sll_epi32(v, count); }
  static I srl32(I v, __m128i count) { return _mm512_srl_epi32(v, count); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I abs8(I v) { return _mm512_abs_epi8(v); }
  // v negated where sign < 0, zeroed where sign == 0 (AVX2's vpsignb).
  static I sign8(I v, I sign) {
    const I negated = _mm512_mask_sub_epi8(v, _mm512_movepi8_mask(sign), zero(), v);
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(sign, sign), negated);
  }
  static I where_eq8(I a, I b, I value) {
    return _mm512_maskz_mov_epi8(_mm512_cmpeq_epi8_mask(a, b), value);
  }
  static I rolv32(I v, I count) { return _mm512_rolv_epi32(v, count); }
  template <int IMM> static I ternary(I a, I b, I c) {
    return _mm512_ternarylogic_epi32(a, b, c, IMM);
  }

  static I broadcast4(const int8_t* p) {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    return _mm512_set1_epi32(word);
  }
#ifdef GGUF_VNNI
  static I dpbusd(I acc, I q, const int8_t* p) {
    asm("vpdpbusd %2%{1to16%}, %1, %0"
        : "+v"(acc)
        : "v"(q), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
#endif

  static I dpwssd(I acc, I a, const int8_t* p) {
#ifdef GGUF_VNNI
    asm("vpdpwssd %2%{1to16%}, %1, %0"
        : "+v"(acc)
        : "v"(a), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, broadcast4(p)));
#endif
  }

  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

}  // namespace gguf_x8
