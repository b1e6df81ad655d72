// Lane-by-lane models of the AVX-512 intrinsics that kernels/csrc/attention_vec.h uses, so its
// AVX-512 backend can run (slowly) on a CPU without AVX-512. Test builds only: compiled with
// -DLLMSERVE_EMULATE_AVX512 by tests/kernels/cpu_kernel_variant.py. Each function follows the
// operation as the Intel Intrinsics Guide describes it; the type and function names are
// macros onto emu_* names because <immintrin.h> already declares the real ones.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

struct emu_m512 {
  float f[16];
};
struct emu_m512i {
  int32_t i[16];
};
struct emu_m512d {
  double d[8];
};
using emu_mmask16 = uint16_t;

template <class To, class From>
inline To emu_bits(const From& x) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &x, sizeof(To));
  return out;
}

inline emu_m512 emu_setzero_ps() { return emu_m512{}; }
inline emu_m512 emu_set1_ps(float x) {
  emu_m512 r;
  for (float& v : r.f) v = x;
  return r;
}
inline emu_m512i emu_set1_epi32(int32_t x) {
  emu_m512i r;
  for (int32_t& v : r.i) v = x;
  return r;
}
inline emu_m512i emu_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7,
                                int a8, int a9, int a10, int a11, int a12, int a13, int a14,
                                int a15) {
  return emu_m512i{{a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15}};
}
inline emu_m512 emu_loadu_ps(const float* p) {
  emu_m512 r;
  std::memcpy(r.f, p, sizeof(r.f));
  return r;
}
inline void emu_storeu_ps(float* p, emu_m512 x) { std::memcpy(p, x.f, sizeof(x.f)); }

inline emu_m512 emu_castsi512_ps(emu_m512i x) { return emu_bits<emu_m512>(x); }
inline emu_m512i emu_castps_si512(emu_m512 x) { return emu_bits<emu_m512i>(x); }
inline emu_m512d emu_castps_pd(emu_m512 x) { return emu_bits<emu_m512d>(x); }
inline emu_m512 emu_castpd_ps(emu_m512d x) { return emu_bits<emu_m512>(x); }
inline __m256 emu_castps512_ps256(emu_m512 x) { return _mm256_loadu_ps(x.f); }
inline __m256d emu_extractf64x4_pd(emu_m512d x, int imm) {
  return _mm256_loadu_pd(x.d + 4 * (imm & 1));
}

inline emu_m512i emu_slli_epi32(emu_m512i a, unsigned count) {
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.i[i] = count > 31 ? 0 : int32_t(uint32_t(a.i[i]) << count);
  return r;
}
inline emu_m512i emu_srli_epi32(emu_m512i a, unsigned count) {
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.i[i] = count > 31 ? 0 : int32_t(uint32_t(a.i[i]) >> count);
  return r;
}
inline emu_m512i emu_srlv_epi32(emu_m512i a, emu_m512i count) {
  emu_m512i r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t c = uint32_t(count.i[i]);
    r.i[i] = c > 31 ? 0 : int32_t(uint32_t(a.i[i]) >> c);
  }
  return r;
}
inline emu_m512i emu_and_si512(emu_m512i a, emu_m512i b) {
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.i[i] = a.i[i] & b.i[i];
  return r;
}
inline emu_m512i emu_add_epi32(emu_m512i a, emu_m512i b) {
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.i[i] = int32_t(uint32_t(a.i[i]) + uint32_t(b.i[i]));
  return r;
}

inline emu_m512i emu_cvtepu16_epi32(__m256i a) {
  uint16_t in[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(in), a);
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.i[i] = in[i];
  return r;
}
inline emu_m512i emu_cvtepi8_epi32(__m128i a) {
  int8_t in[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(in), a);
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.i[i] = in[i];
  return r;
}
inline emu_m512 emu_cvtepi32_ps(emu_m512i a) {
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = float(a.i[i]);
  return r;
}
inline emu_m512i emu_cvtps_epi32(emu_m512 a) {
  // Rounds with the current mode (nearest even); out of range and NaN give INT32_MIN.
  emu_m512i r;
  for (int i = 0; i < 16; ++i) {
    const float x = a.f[i];
    r.i[i] = (std::isnan(x) || x >= 2147483648.f || x < -2147483648.f) ? INT32_MIN
                                                                       : int32_t(std::nearbyint(x));
  }
  return r;
}
inline __m256i emu_cvtepi32_epi16(emu_m512i a) {
  uint16_t out[16];
  for (int i = 0; i < 16; ++i) out[i] = uint16_t(uint32_t(a.i[i]));
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out));
}
inline __m128i emu_cvtsepi32_epi8(emu_m512i a) {
  int8_t out[16];
  for (int i = 0; i < 16; ++i)
    out[i] = int8_t(a.i[i] > 127 ? 127 : (a.i[i] < -128 ? -128 : a.i[i]));
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(out));
}
inline emu_m512 emu_cvtph_ps(__m256i a) {
  uint16_t in[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(in), a);
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = _cvtsh_ss(in[i]);
  return r;
}
inline __m256i emu_cvtps_ph(emu_m512 a, int /*rounding: nearest even*/) {
  uint16_t out[16];
  for (int i = 0; i < 16; ++i) out[i] = _cvtss_sh(a.f[i], _MM_FROUND_TO_NEAREST_INT);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out));
}

#define EMU_BINARY_PS(name, expr)                \
  inline emu_m512 name(emu_m512 a, emu_m512 b) { \
    emu_m512 r;                                  \
    for (int i = 0; i < 16; ++i) {               \
      const float x = a.f[i], y = b.f[i];        \
      r.f[i] = (expr);                           \
    }                                            \
    return r;                                    \
  }
EMU_BINARY_PS(emu_add_ps, x + y)
EMU_BINARY_PS(emu_mul_ps, x* y)
EMU_BINARY_PS(emu_div_ps, x / y)
// MAXPS/MINPS: the second operand when the comparison is false (equal values, or a NaN).
EMU_BINARY_PS(emu_max_ps, x > y ? x : y)
EMU_BINARY_PS(emu_min_ps, x < y ? x : y)
#undef EMU_BINARY_PS

inline emu_m512 emu_fmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) {
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = std::fma(a.f[i], b.f[i], c.f[i]);
  return r;
}
inline emu_m512 emu_fnmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) {
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = std::fma(-a.f[i], b.f[i], c.f[i]);
  return r;
}
inline emu_m512 emu_roundscale_ps(emu_m512 a, int imm) {
  // Only the forms the kernels use: scale 0 (round to an integer), nearest even.
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = (imm >> 4) == 0 ? std::nearbyint(a.f[i]) : NAN;
  return r;
}
inline emu_m512 emu_scalef_ps(emu_m512 a, emu_m512 b) {
  // a * 2^floor(b); the kernels pass an integral b.
  emu_m512 r;
  for (int i = 0; i < 16; ++i) {
    if (std::isnan(a.f[i]) || std::isnan(b.f[i])) {
      r.f[i] = NAN;
    } else {
      const float e = std::floor(b.f[i]);
      const int n = e > 300.f ? 300 : (e < -300.f ? -300 : int(e));
      r.f[i] = std::ldexp(a.f[i], n);
    }
  }
  return r;
}

inline emu_mmask16 emu_cmp_ps_mask(emu_m512 a, emu_m512 b, int predicate) {
  emu_mmask16 k = 0;
  for (int i = 0; i < 16; ++i) {
    const float x = a.f[i], y = b.f[i];
    bool bit;
    switch (predicate) {
      case _CMP_UNORD_Q:
        bit = std::isnan(x) || std::isnan(y);
        break;
      case _CMP_LT_OQ:
        bit = x < y;
        break;
      default:
        bit = false;  // not used by the kernels
    }
    k |= emu_mmask16(bit) << i;
  }
  return k;
}
inline emu_m512 emu_mask_mov_ps(emu_m512 src, emu_mmask16 k, emu_m512 a) {
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = (k >> i) & 1 ? a.f[i] : src.f[i];
  return r;
}
inline emu_m512 emu_maskz_mov_ps(emu_mmask16 k, emu_m512 a) {
  return emu_mask_mov_ps(emu_setzero_ps(), k, a);
}
inline emu_m512i emu_mask_mov_epi32(emu_m512i src, emu_mmask16 k, emu_m512i a) {
  emu_m512i r;
  for (int i = 0; i < 16; ++i) r.i[i] = (k >> i) & 1 ? a.i[i] : src.i[i];
  return r;
}

// Shuffles: within each 128-bit lane L (elements 4L..4L+3, or doubles 2L..2L+1).
inline emu_m512 emu_unpacklo_ps(emu_m512 a, emu_m512 b) {
  emu_m512 r;
  for (int l = 0; l < 4; ++l) {
    r.f[4 * l + 0] = a.f[4 * l + 0];
    r.f[4 * l + 1] = b.f[4 * l + 0];
    r.f[4 * l + 2] = a.f[4 * l + 1];
    r.f[4 * l + 3] = b.f[4 * l + 1];
  }
  return r;
}
inline emu_m512 emu_unpackhi_ps(emu_m512 a, emu_m512 b) {
  emu_m512 r;
  for (int l = 0; l < 4; ++l) {
    r.f[4 * l + 0] = a.f[4 * l + 2];
    r.f[4 * l + 1] = b.f[4 * l + 2];
    r.f[4 * l + 2] = a.f[4 * l + 3];
    r.f[4 * l + 3] = b.f[4 * l + 3];
  }
  return r;
}
inline emu_m512d emu_unpacklo_pd(emu_m512d a, emu_m512d b) {
  emu_m512d r;
  for (int l = 0; l < 4; ++l) {
    r.d[2 * l + 0] = a.d[2 * l + 0];
    r.d[2 * l + 1] = b.d[2 * l + 0];
  }
  return r;
}
inline emu_m512d emu_unpackhi_pd(emu_m512d a, emu_m512d b) {
  emu_m512d r;
  for (int l = 0; l < 4; ++l) {
    r.d[2 * l + 0] = a.d[2 * l + 1];
    r.d[2 * l + 1] = b.d[2 * l + 1];
  }
  return r;
}
inline emu_m512 emu_shuffle_f32x4(emu_m512 a, emu_m512 b, int imm) {
  // Result lanes 0, 1 from a and 2, 3 from b, each picked by two bits of imm.
  emu_m512 r;
  for (int l = 0; l < 4; ++l) {
    const emu_m512& src = l < 2 ? a : b;
    const int pick = (imm >> (2 * l)) & 3;
    for (int e = 0; e < 4; ++e) r.f[4 * l + e] = src.f[4 * pick + e];
  }
  return r;
}
inline emu_m512 emu_permutexvar_ps(emu_m512i index, emu_m512 a) {
  emu_m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = a.f[index.i[i] & 15];
  return r;
}

#define __m512 emu_m512
#define __m512i emu_m512i
#define __m512d emu_m512d
#define __mmask16 emu_mmask16
#define _mm512_setzero_ps emu_setzero_ps
#define _mm512_set1_ps emu_set1_ps
#define _mm512_set1_epi32 emu_set1_epi32
#define _mm512_setr_epi32 emu_setr_epi32
#define _mm512_loadu_ps emu_loadu_ps
#define _mm512_storeu_ps emu_storeu_ps
#define _mm512_castsi512_ps emu_castsi512_ps
#define _mm512_castps_si512 emu_castps_si512
#define _mm512_castps_pd emu_castps_pd
#define _mm512_castpd_ps emu_castpd_ps
#define _mm512_castps512_ps256 emu_castps512_ps256
#define _mm512_extractf64x4_pd emu_extractf64x4_pd
#define _mm512_slli_epi32 emu_slli_epi32
#define _mm512_srli_epi32 emu_srli_epi32
#define _mm512_srlv_epi32 emu_srlv_epi32
#define _mm512_and_si512 emu_and_si512
#define _mm512_add_epi32 emu_add_epi32
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#define _mm512_cvtps_epi32 emu_cvtps_epi32
#define _mm512_cvtepi32_epi16 emu_cvtepi32_epi16
#define _mm512_cvtsepi32_epi8 emu_cvtsepi32_epi8
#define _mm512_cvtph_ps emu_cvtph_ps
#define _mm512_cvtps_ph emu_cvtps_ph
#define _mm512_add_ps emu_add_ps
#define _mm512_mul_ps emu_mul_ps
#define _mm512_div_ps emu_div_ps
#define _mm512_max_ps emu_max_ps
#define _mm512_min_ps emu_min_ps
#define _mm512_fmadd_ps emu_fmadd_ps
#define _mm512_fnmadd_ps emu_fnmadd_ps
#define _mm512_roundscale_ps emu_roundscale_ps
#define _mm512_scalef_ps emu_scalef_ps
#define _mm512_cmp_ps_mask emu_cmp_ps_mask
#define _mm512_mask_mov_ps emu_mask_mov_ps
#define _mm512_maskz_mov_ps emu_maskz_mov_ps
#define _mm512_mask_mov_epi32 emu_mask_mov_epi32
#define _mm512_unpacklo_ps emu_unpacklo_ps
#define _mm512_unpackhi_ps emu_unpackhi_ps
#define _mm512_unpacklo_pd emu_unpacklo_pd
#define _mm512_unpackhi_pd emu_unpackhi_pd
#define _mm512_shuffle_f32x4 emu_shuffle_f32x4
#define _mm512_permutexvar_ps emu_permutexvar_ps
