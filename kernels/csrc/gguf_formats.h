// The GGUF block formats beyond Q4_0 / Q4_1 / Q8_0, each described once for every kernel in
// gguf_gemm.cpp: where its codes and scales sit, the values ggml defines, and how a 32-value
// chunk of it becomes byte codes for an integer dot product.
//
//   format   ggml id  values  bytes  one group (a block, or a K-quant super-block)
//   Q5_0       6        32     22    d | qh (32 high bits) | 16 B nibbles      d (q - 16)
//   Q5_1       7        32     24    d | m | qh | 16 B nibbles                  d q + m
//   Q2_K      10       256     84    16 B scales (4-bit scale | 4-bit min) | 64 B 2-bit codes
//                                    | d | dmin                                 d s q - dmin m
//   Q3_K      11       256    110    32 B high bits | 64 B 2-bit codes | 12 B 6-bit scales | d
//                                                                               d (s - 32) (q - 4)
//   Q4_K      12       256    144    d | dmin | 12 B 6-bit scales and mins | 128 B nibbles
//                                                                               d s q - dmin m
//   Q5_K      13       256    176    d | dmin | 12 B scales and mins | 32 B high bits | 128 B
//   Q6_K      14       256    210    128 B low nibbles | 64 B 2-bit highs | 16 int8 scales | d
//                                                                               d s (q - 32)
//   IQ4_NL    20        32     18    d | 16 B nibbles -> 16 non-uniform levels  d T[q]
//   IQ4_XS    23       256    136    d | 2 B high scale bits | 4 B low scale bits | 128 B
//                                                                               d (s - 32) T[q]
// (d, m, dmin: fp16.) The exact values come from `dequantize`, written as ggml's reference
// dequantization computes them (the same float operations in the same order, so the fp32
// path multiplies by the file's weights to the bit).
//
// The integer path reads a group as chunks of 32 values, each one 32 byte codes (value order).
// The 32-value kinds (Q5_0, Q5_1, IQ4_NL) give a factor and an offset per chunk:
//     w_j = factor * q_j + offset
// and the K-quants their super-block in integers (SuperScales below).
// Unsigned formats give q_j < 64, so u8 x s8 pair sums stay below int16 saturation. Signed
// formats (kSigned: IQ4 levels in -127..113) give q_j as int8 and no offset; the kernel moves
// their sign onto the activations.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(LLMSERVE_GGUF_SCALAR)
#include <immintrin.h>
#define GGUF_FORMATS_AVX2 1
#endif

#include <c10/util/Half.h>

namespace gguf {

constexpr int64_t kQ5_0 = 6, kQ5_1 = 7, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
                  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23;
constexpr int kChunk = 32;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#ifdef GGUF_FORMATS_AVX2
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// IQ4's 16 levels (llama.cpp's kvalues_iq4nl).
alignas(16) constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// A group's factor and offset per 32-value chunk (the chunk kernels' form: Q5_0, Q5_1, IQ4_NL;
// Q4_K and Q5_K's exact dequantization reads it too).
struct GroupScales {
  float factor[16];
  float offset[16];
};

// A K-quant super-block in integers, for activations quantized per 256 values (codes c, one
// scale s; llama.cpp's Q8_K): with h the 16-value sub-blocks,
//     sum_j w_j x_j = s (d sum_h scale[h] sum_{j in h} q_j c_j
//                        - dcorr sum_h correction[h] sum_{j in h} c_j)
// exactly up to the activation rounding: the sub-block scales, mins and zero points are
// small integers in every K-quant, so the whole super-block is one integer dot per term.
struct SuperScales {
  int16_t scale[16];
  int16_t correction[16];
  float d, dcorr;
};

#ifdef GGUF_FORMATS_AVX2
// SuperScales as two vectors of 16 int16 (the kernels' form).
struct SuperVectors {
  __m256i scale, correction;
  float d, dcorr;
};

inline SuperVectors load_super_scales(const SuperScales& s) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.scale)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.correction)), s.d, s.dcorr};
}

// 8 bytes -> 16 int16, each twice: lane h holds byte h / 2 (sub-blocks of 32 values).
inline __m256i twice_per_lane(uint64_t bytes) {
  const __m128i wide = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(bytes)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(wide, wide), _mm_unpacklo_epi16(wide, wide));
}
#endif

// Q4_K / Q5_K: scale and min of sub-block j (of 8), 6 bits each, packed in 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q3_K: the 16 6-bit scales (minus 32).
inline void q3_k_scales(const uint8_t* packed, int8_t* out) {
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? packed[j] & 0xF : packed[j - 8] >> 4;
    const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
    out[j] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

// Byte i of the result: bit i of the 32 bits at `bits`, as 0 or `value`.
#ifdef GGUF_FORMATS_AVX2
inline __m256i spread_bits(const uint8_t* bits, int8_t value) {
  uint32_t word;
  std::memcpy(&word, bits, sizeof(word));
  // Byte i <- byte i / 8 of the word, then test bit i % 8 of it.
  const __m256i byte_of_bit = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                 0x0303030303030303LL);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(word)),
                                             byte_of_bit);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}

// 16 bytes of nibbles -> 32 codes: the low nibbles (values 0..15), then the high ones.
inline __m256i split_nibbles(const uint8_t* bytes) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed),
                                               _mm_srli_epi16(packed, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 32 bytes, bits [shift, shift + width) of each.
inline __m256i bit_field(const uint8_t* bytes, int shift, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)),
                          _mm256_set1_epi8(static_cast<char>(mask)));
}

inline __m256i iq4_levels(__m256i nibbles) {
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Levels));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles);
}
#endif

// Q5_0 / Q5_1: 16 bytes of nibbles at `qs` and 32 high bits at `qh` -> 32 codes 0..31 (the low
// nibbles are values 0..15, bit j of qh is value j's fifth bit).
inline void five_bit_codes(const uint8_t* qh_bytes, const uint8_t* qs, int32_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
    q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}

template <int64_t KIND>
struct Format;

template <>
struct Format<kQ5_0> {
  static constexpr int kValues = 32, kBytes = 22;
  static constexpr bool kSigned = false;
  static void dequantize(const uint8_t* g, float* y) {
    const float d = half_at(g);
    int32_t q[32];
    codes(g, 0, q);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j] - 16) * d;
  }
  static void scales(const uint8_t* g, GroupScales& s) {
    s.factor[0] = half_at(g);
    s.offset[0] = -16.f * s.factor[0];
  }
  static void codes(const uint8_t* g, int, int32_t* q) { five_bit_codes(g + 2, g + 6, q); }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int) {
    return _mm256_or_si256(split_nibbles(g + 6), spread_bits(g + 2, 16));
  }
#endif
};

template <>
struct Format<kQ5_1> {
  static constexpr int kValues = 32, kBytes = 24;
  static constexpr bool kSigned = false;
  static void dequantize(const uint8_t* g, float* y) {
    const float d = half_at(g), m = half_at(g + 2);
    int32_t q[32];
    codes(g, 0, q);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j]) * d + m;
  }
  static void scales(const uint8_t* g, GroupScales& s) {
    s.factor[0] = half_at(g);
    s.offset[0] = half_at(g + 2);
  }
  static void codes(const uint8_t* g, int, int32_t* q) { five_bit_codes(g + 4, g + 8, q); }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int) {
    return _mm256_or_si256(split_nibbles(g + 8), spread_bits(g + 4, 16));
  }
#endif
};

// Q2_K: scales[16] | qs[64] | d | dmin. Chunk c (of 8): codes (qs[32 (c / 4) + l] >> 2 (c % 4))
// & 3, sub-blocks 2c and 2c + 1.
template <>
struct Format<kQ2_K> {
  static constexpr int kValues = 256, kBytes = 84;
  static constexpr bool kSigned = false;
  static void dequantize(const uint8_t* g, float* y) {
    int32_t q[32];
    for (int c = 0; c < 8; ++c) {
      codes(g, c, q);
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = g[2 * c + half];
        const float dl = half_at(g + 80) * static_cast<float>(sc & 0xF);
        const float ml = half_at(g + 82) * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) y[32 * c + 16 * half + l] = dl * q[16 * half + l] - ml;
      }
    }
  }
  static void super_scales(const uint8_t* g, SuperScales& s) {
    for (int h = 0; h < 16; ++h) {
      s.scale[h] = g[h] & 0xF;
      s.correction[h] = g[h] >> 4;
    }
    s.d = half_at(g + 80);
    s.dcorr = half_at(g + 82);
  }
#ifdef GGUF_FORMATS_AVX2
  static SuperVectors super_vectors(const uint8_t* g) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
    return {_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high), half_at(g + 80),
            half_at(g + 82)};
  }
#endif
  static void codes(const uint8_t* g, int c, int32_t* q) {
    const uint8_t* qs = g + 16 + 32 * (c / 4);
    for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> (2 * (c % 4))) & 3;
  }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int c) {
    return bit_field(g + 16 + 32 * (c / 4), 2 * (c % 4), 3);
  }
#endif
};

// Q3_K: hmask[32] | qs[64] | scales[12] | d. Chunk c: low bits as Q2_K's, high bit = bit c of
// hmask[l]; the code q3 = low + 4 high is 0..7 and the value d (s - 32) (q3 - 4).
template <>
struct Format<kQ3_K> {
  static constexpr int kValues = 256, kBytes = 110;
  static constexpr bool kSigned = false;
  static void dequantize(const uint8_t* g, float* y) {
    int8_t sc[16];
    q3_k_scales(g + 96, sc);
    const float d = half_at(g + 108);
    int32_t q[32];
    for (int c = 0; c < 8; ++c) {
      codes(g, c, q);
      for (int half = 0; half < 2; ++half) {
        const float dl = d * static_cast<float>(sc[2 * c + half]);
        for (int l = 0; l < 16; ++l) {
          y[32 * c + 16 * half + l] = dl * static_cast<float>(q[16 * half + l] - 4);
        }
      }
    }
  }
  static void super_scales(const uint8_t* g, SuperScales& s) {
    int8_t sc[16];
    q3_k_scales(g + 96, sc);
    for (int h = 0; h < 16; ++h) {
      s.scale[h] = sc[h];
      s.correction[h] = static_cast<int16_t>(4 * sc[h]);
    }
    s.d = s.dcorr = half_at(g + 108);
  }
#ifdef GGUF_FORMATS_AVX2
  static SuperVectors super_vectors(const uint8_t* g) {
    SuperScales s;
    super_scales(g, s);
    return load_super_scales(s);
  }
#endif
  static void codes(const uint8_t* g, int c, int32_t* q) {
    const uint8_t* qs = g + 32 + 32 * (c / 4);
    for (int l = 0; l < 32; ++l) {
      q[l] = ((qs[l] >> (2 * (c % 4))) & 3) | (((g[l] >> c) & 1) << 2);
    }
  }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int c) {
    const __m256i low = bit_field(g + 32 + 32 * (c / 4), 2 * (c % 4), 3);
    const __m256i high = bit_field(g, c, 1);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
  }
#endif
};

// Q4_K: d | dmin | scales[12] | qs[128]. Chunk c: nibbles of qs[32 (c / 2) + l], low for even c;
// sub-block c's 6-bit scale and min.
template <>
struct Format<kQ4_K> {
  static constexpr int kValues = 256, kBytes = 144;
  static constexpr bool kSigned = false;
  static void dequantize(const uint8_t* g, float* y) {
    GroupScales s;
    scales(g, s);
    int32_t q[32];
    for (int c = 0; c < 8; ++c) {
      codes(g, c, q);
      // ggml: d1 * q - m1, where offset = -m1 (negation is exact)
      for (int l = 0; l < 32; ++l) y[32 * c + l] = s.factor[c] * q[l] + s.offset[c];
    }
  }
  static void scales(const uint8_t* g, GroupScales& s) {
    const float d = half_at(g), dmin = half_at(g + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(j, g + 4, sc, m);
      s.factor[j] = d * static_cast<float>(sc);
      s.offset[j] = -(dmin * static_cast<float>(m));
    }
  }
  static void super_scales(const uint8_t* g, SuperScales& s) {
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(j, g + 4, sc, m);
      s.scale[2 * j] = s.scale[2 * j + 1] = static_cast<int16_t>(sc);
      s.correction[2 * j] = s.correction[2 * j + 1] = static_cast<int16_t>(m);
    }
    s.d = half_at(g);
    s.dcorr = half_at(g + 2);
  }
#ifdef GGUF_FORMATS_AVX2
  // The 12 packed bytes -> 8 scales and 8 mins, 6 bits each, with 32-bit word operations.
  static SuperVectors super_vectors(const uint8_t* g) {
    uint32_t w[3];
    std::memcpy(w, g + 4, 12);
    constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    const uint32_t scales_lo = w[0] & low6;                                  // scales 0-3
    const uint32_t mins_lo = w[1] & low6;                                    // mins 0-3
    const uint32_t scales_hi = (w[2] & low4) | (((w[0] >> 6) & low2) << 4);  // scales 4-7
    const uint32_t mins_hi = ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4);
    const uint64_t scales = scales_lo | static_cast<uint64_t>(scales_hi) << 32;
    const uint64_t mins = mins_lo | static_cast<uint64_t>(mins_hi) << 32;
    return {twice_per_lane(scales), twice_per_lane(mins), half_at(g), half_at(g + 2)};
  }
#endif
  static void codes(const uint8_t* g, int c, int32_t* q) {
    const uint8_t* qs = g + 16 + 32 * (c / 2);
    for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> (4 * (c % 2))) & 0xF;
  }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int c) {
    return bit_field(g + 16 + 32 * (c / 2), 4 * (c % 2), 0xF);
  }
#endif
};

// Q5_K: d | dmin | scales[12] | qh[32] | qs[128]. Chunk c: Q4_K's nibble plus 16 x bit c of qh[l].
template <>
struct Format<kQ5_K> {
  static constexpr int kValues = 256, kBytes = 176;
  static constexpr bool kSigned = false;
  static void dequantize(const uint8_t* g, float* y) {
    GroupScales s;
    scales(g, s);
    int32_t q[32];
    for (int c = 0; c < 8; ++c) {
      codes(g, c, q);
      for (int l = 0; l < 32; ++l) y[32 * c + l] = s.factor[c] * q[l] + s.offset[c];
    }
  }
  static void scales(const uint8_t* g, GroupScales& s) { Format<kQ4_K>::scales(g, s); }
  static void super_scales(const uint8_t* g, SuperScales& s) {
    Format<kQ4_K>::super_scales(g, s);
  }
#ifdef GGUF_FORMATS_AVX2
  static SuperVectors super_vectors(const uint8_t* g) { return Format<kQ4_K>::super_vectors(g); }
#endif
  static void codes(const uint8_t* g, int c, int32_t* q) {
    const uint8_t* qs = g + 48 + 32 * (c / 2);
    for (int l = 0; l < 32; ++l) {
      q[l] = ((qs[l] >> (4 * (c % 2))) & 0xF) | (((g[16 + l] >> c) & 1) << 4);
    }
  }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int c) {
    const __m256i low = bit_field(g + 48 + 32 * (c / 2), 4 * (c % 2), 0xF);
    return _mm256_or_si256(low, _mm256_slli_epi16(bit_field(g + 16, c, 1), 4));
  }
#endif
};

// Q6_K: ql[128] | qh[64] | scales[16] int8 | d. Chunk c = 4 h + j: nibble of ql[64 h + 32 (j % 2)
// + l] (low for j < 2), high two bits (qh[32 h + l] >> 2 j) & 3; sub-blocks 2c and 2c + 1.
template <>
struct Format<kQ6_K> {
  static constexpr int kValues = 256, kBytes = 210;
  static constexpr bool kSigned = false;
  static void dequantize(const uint8_t* g, float* y) {
    const float d = half_at(g + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(g + 192);
    int32_t q[32];
    for (int c = 0; c < 8; ++c) {
      codes(g, c, q);
      for (int half = 0; half < 2; ++half) {
        const float dl = d * static_cast<float>(sc[2 * c + half]);
        for (int l = 0; l < 16; ++l) {
          y[32 * c + 16 * half + l] = dl * static_cast<float>(q[16 * half + l] - 32);
        }
      }
    }
  }
  static void super_scales(const uint8_t* g, SuperScales& s) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(g + 192);
    for (int h = 0; h < 16; ++h) {
      s.scale[h] = sc[h];
      s.correction[h] = static_cast<int16_t>(32 * sc[h]);
    }
    s.d = s.dcorr = half_at(g + 208);
  }
#ifdef GGUF_FORMATS_AVX2
  static SuperVectors super_vectors(const uint8_t* g) {
    const __m256i scale =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 192)));
    const float d = half_at(g + 208);
    return {scale, _mm256_slli_epi16(scale, 5), d, d};
  }
#endif
  static void codes(const uint8_t* g, int c, int32_t* q) {
    const int h = c / 4, j = c % 4;
    const uint8_t* ql = g + 64 * h + 32 * (j % 2);
    const uint8_t* qh = g + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      q[l] = ((ql[l] >> (4 * (j / 2))) & 0xF) | (((qh[l] >> (2 * j)) & 3) << 4);
    }
  }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int c) {
    const int h = c / 4, j = c % 4;
    const __m256i low = bit_field(g + 64 * h + 32 * (j % 2), 4 * (j / 2), 0xF);
    const __m256i high = bit_field(g + 128 + 32 * h, 2 * j, 3);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
#endif
};

template <>
struct Format<kIQ4_NL> {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kSigned = true;
  static void dequantize(const uint8_t* g, float* y) {
    const float d = half_at(g);
    int32_t q[32];
    codes(g, 0, q);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j]);
  }
  static void scales(const uint8_t* g, GroupScales& s) {
    s.factor[0] = half_at(g);
    s.offset[0] = 0.f;
  }
  static void codes(const uint8_t* g, int, int32_t* q) {
    for (int j = 0; j < 16; ++j) {
      q[j] = kIQ4Levels[g[2 + j] & 0xF];
      q[j + 16] = kIQ4Levels[g[2 + j] >> 4];
    }
  }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int) { return iq4_levels(split_nibbles(g + 2)); }
#endif
};

// IQ4_XS: d | scales_h (16 bits) | scales_l[4] | qs[128]. Chunk c: IQ4_NL's nibbles of
// qs[16 c ..], scale (4 bits of scales_l[c / 2] | 2 bits of scales_h) - 32.
template <>
struct Format<kIQ4_XS> {
  static constexpr int kValues = 256, kBytes = 136;
  static constexpr bool kSigned = true;
  static int scale(const uint8_t* g, int c) {
    uint16_t high;
    std::memcpy(&high, g + 2, sizeof(high));
    return (((g[4 + c / 2] >> (4 * (c % 2))) & 0xF) | (((high >> (2 * c)) & 3) << 4)) - 32;
  }
  static void dequantize(const uint8_t* g, float* y) {
    const float d = half_at(g);
    int32_t q[32];
    for (int c = 0; c < 8; ++c) {
      const float dl = d * static_cast<float>(scale(g, c));
      codes(g, c, q);
      for (int j = 0; j < 32; ++j) y[32 * c + j] = dl * static_cast<float>(q[j]);
    }
  }
  static void super_scales(const uint8_t* g, SuperScales& s) {
    for (int c = 0; c < 8; ++c) {
      s.scale[2 * c] = s.scale[2 * c + 1] = static_cast<int16_t>(scale(g, c));
      s.correction[2 * c] = s.correction[2 * c + 1] = 0;
    }
    s.d = half_at(g);
    s.dcorr = 0.f;
  }
#ifdef GGUF_FORMATS_AVX2
  static SuperVectors super_vectors(const uint8_t* g) {
    SuperScales s;
    super_scales(g, s);
    return load_super_scales(s);
  }
#endif
  static void codes(const uint8_t* g, int c, int32_t* q) {
    const uint8_t* qs = g + 8 + 16 * c;
    for (int j = 0; j < 16; ++j) {
      q[j] = kIQ4Levels[qs[j] & 0xF];
      q[j + 16] = kIQ4Levels[qs[j] >> 4];
    }
  }
#ifdef GGUF_FORMATS_AVX2
  static __m256i codes_avx2(const uint8_t* g, int c) {
    return iq4_levels(split_nibbles(g + 8 + 16 * c));
  }
#endif
};

// The K-quant kinds: super-blocks of 256 values with small integer sub-block scales.
constexpr bool is_super_kind(int64_t kind) {
  return kind == kQ2_K || kind == kQ3_K || kind == kQ4_K || kind == kQ5_K || kind == kQ6_K ||
         kind == kIQ4_XS;
}


}  // namespace gguf
