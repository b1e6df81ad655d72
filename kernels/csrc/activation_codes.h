// One block of activations rounded to int8 codes with one scale, as every int8 GEMM here
// takes them (32 values for the 32-value formats, 256 for the K-quants):
//   s = amax / 127, c_j = nearbyint(x_j * (1 / s)) (0 for an all-zero block; the same fp32
//   operations as kernels/gguf_blocks_torch.quantize_activation_blocks),
// with the int32 sum of each 4 consecutive codes (the lanes of a 32-byte integer dot; the
// formats' offsets and the K-quants' 16-value sums are built from them).
//
// The SIMD path is the scalar path's arithmetic: the maximum is exact in any order, the
// product is one fp32 multiply per value, and vcvtps2dq rounds to nearest even, as
// nearbyint does in the default rounding mode. So the codes, and every result computed from
// them, are the same on every instruction set (the kernel tests compare the builds). The
// scalar loop cost about 2.5 ns per value, which a decode step of one sequence paid once per
// matmul on one thread while the other waited (K = 8960: 22 us of a 400 us matmul).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && !defined(LLMSERVE_GGUF_SCALAR)
#include <immintrin.h>
#define ACTIVATION_CODES_AVX2 1
#endif

namespace activation_codes {

struct BlockScale {
  float scale;    // s
  float inverse;  // 1 / s, 0 for an all-zero block
};

inline BlockScale scale_of(float amax) {
  const float s = amax / 127.f;
  return {s, s != 0.f ? 1.f / s : 0.f};
}

inline BlockScale block_scale_scalar(const float* v, int n) {
  float amax = 0.f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(v[j]));
  return scale_of(amax);
}

// n values (a multiple of 32) -> codes[n] and quad_sums[n / 4]; returns the block's scale.
inline BlockScale quantize_block_scalar(const float* v, int n, int8_t* codes,
                                        int32_t* quad_sums) {
  const BlockScale b = block_scale_scalar(v, n);
  for (int i = 0; i < n / 4; ++i) {
    int32_t quad = 0;
    for (int j = 4 * i; j < 4 * i + 4; ++j) {
      const int32_t code = static_cast<int32_t>(std::nearbyint(v[j] * b.inverse));
      codes[j] = static_cast<int8_t>(code);
      quad += code;
    }
    quad_sums[i] = quad;
  }
  return b;
}

#ifdef ACTIVATION_CODES_AVX2
inline BlockScale quantize_block_avx2(const float* v, int n, int8_t* codes, int32_t* quad_sums) {
  // |x|: the sign bit cleared. max_ps(x, amax) keeps amax where x is NaN, as std::max does.
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) {
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)), amax);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const BlockScale b = scale_of(_mm_cvtss_f32(m4));
  const __m256 inverse = _mm256_set1_ps(b.inverse);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  // packs_epi32 then packs_epi16 interleave the four vectors by 128-bit lane; this puts the
  // 32-bit groups back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int j = 0; j < n; j += 32) {
    __m256i q[4];
    for (int t = 0; t < 4; ++t) {
      q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j + 8 * t), inverse));
    }
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + j), packed);
    const __m256i quads = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, packed), ones16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(quad_sums + j / 4), quads);
  }
  return b;
}
#endif

inline BlockScale quantize_block(const float* v, int n, int8_t* codes, int32_t* quad_sums) {
#ifdef ACTIVATION_CODES_AVX2
  return quantize_block_avx2(v, n, codes, quad_sums);
#else
  return quantize_block_scalar(v, n, codes, quad_sums);
#endif
}

}  // namespace activation_codes
