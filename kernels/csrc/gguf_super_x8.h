// Q4_K, Q5_K and Q6_K regrouped by 8 rows (gguf_x8_layout.h) against activations quantized
// per 256 values (codes c, one scale s per super-block and row; llama.cpp's Q8_K).
//
// A super-block of 8 rows is one pass over its words: each 32-byte vector of codes (4 values
// of each row) meets the 4 broadcast activation codes of those values in one byte dot, so
// the 8 int32 lanes are the 8 rows' partial sums and no horizontal sum remains. Per row and
// super-block, all in integers except the last line:
//     Q4_K / Q5_K  sum_s scale_s (sum_{j in s} q_j c_j) - dmin/d-free: sum_s min_s (sum c_j)
//     Q6_K         sum_s scale_s (sum_{j in s} q_j c_j) - 32 sum_s scale_s (sum_{j in s} c_j)
//     out += s d (first term) - s dmin (second term)       (Q6_K: s d (first - second))
// With VNNI each 32-value (Q6_K: 16-value) sub-block's dot is one vpdpbusd chain, then one
// vpmulld by the rows' sub-block scales; without it, vpmaddubsw pair sums add up in int16
// (at most 2 x 15 x 127 x 8 for Q4_K, 2 x 31 x 127 x 4 for Q5_K, 2 x 63 x 127 for Q6_K) and
// vpmaddwd multiplies them by the scales. The min and zero-point terms need only the
// activations' code sums per sub-block (SuperActivations::bsum, bsum32) and vpmaddwd.
//
// Each output row's arithmetic is the same whatever the tile and the batch: a row is a lane,
// and the order of its sums never depends on its neighbours (batch-invariant by construction).
//
// Included by gguf_gemm.cpp after its instruction-set macros (GGUF_AVX2, GGUF_VNNI,
// GGUF_DPBUSD); `Acts` is its SuperActivations.
#pragma once

#include "gguf_x8_layout.h"

#ifdef GGUF_AVX2
namespace gguf_x8 {

inline __m256i load_words(const uint8_t* block, int64_t at) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + at));
}

// 4 activation codes in every lane: one broadcast load (vbroadcastss), where a load into a
// general register and a broadcast from it took two more instructions on the vector ports.
inline __m256i broadcast_codes(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

#ifdef GGUF_VNNI
// acc + the byte dots of q against the 4 codes at p broadcast to every lane.
inline __m256i dpbusd_broadcast(__m256i acc, __m256i q, const int8_t* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(GGUF_VNNI_EMULATED)
  // The broadcast folded into the dot's memory operand ({1to8}): no separate broadcast
  // instruction on the vector ports.
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
#else
  return GGUF_DPBUSD(acc, q, broadcast_codes(p));
#endif
}
#endif

// The next group's block of `bytes` per row, one group ahead of use: rows of a few
// super-blocks end the hardware prefetcher's streams before they pay off.
inline void prefetch_next_group(const uint8_t* block, int64_t row_bytes, int64_t bytes) {
  const char* next = reinterpret_cast<const char*>(block + kGroupRows * row_bytes);
  for (int64_t line = 0; line < kGroupRows * bytes; line += 64) {
    _mm_prefetch(next + line, _MM_HINT_T0);
  }
}

// The 8 rows' s * d as a vector: d from the group's fp16 field at `at`.
inline __m256 row_factors(const uint8_t* block, int64_t at, float s) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + at)));
  return _mm256_mul_ps(d, _mm256_set1_ps(s));
}

// Bit `bit` of every code byte of `high`, moved to bit 4 (Q5_K's fifth bit).
inline __m256i fifth_bit(__m256i high, int bit) {
  const __m256i mask = _mm256_set1_epi8(0x10);
  if (bit < 4) return _mm256_and_si256(_mm256_slli_epi16(high, 4 - bit), mask);
  if (bit == 4) return _mm256_and_si256(high, mask);
  return _mm256_and_si256(_mm256_srli_epi16(high, bit - 4), mask);
}

// Q4_K / Q5_K: the packed 12 bytes of 6-bit scales and mins, as three words per row, to
// scales and mins 0-3 and 4-7 (one byte each per int32 lane).
struct ScalesMins {
  __m256i scales_lo, scales_hi, mins_lo, mins_hi;
};

inline ScalesMins unpack_scales_mins(const uint8_t* block, int64_t at) {
  const __m256i w0 = load_words(block, at), w1 = load_words(block, at + 32),
                w2 = load_words(block, at + 64);
  const __m256i low6 = _mm256_set1_epi32(0x3f3f3f3f), low4 = _mm256_set1_epi32(0x0f0f0f0f),
                low2 = _mm256_set1_epi32(0x03030303);
  auto top2 = [&](__m256i w) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w, 6), low2), 4); };
  return {_mm256_and_si256(w0, low6), _mm256_or_si256(_mm256_and_si256(w2, low4), top2(w0)),
          _mm256_and_si256(w1, low6),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low4), top2(w1))};
}

// Byte `byte` of each int32 lane, zero-extended.
inline __m256i lane_byte(__m256i v, int byte) {
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * byte), _mm256_set1_epi32(0xFF));
}

// Bytes 2p and 2p + 1 of each int32 lane as its two int16 halves (sub-blocks 2p and 2p + 1).
inline __m256i lane_byte_pair(__m256i v, int p) {
  const char a = static_cast<char>(2 * p), b = static_cast<char>(2 * p + 1);
  const __m256i control = _mm256_setr_epi8(
      a, -1, b, -1, a + 4, -1, b + 4, -1, a + 8, -1, b + 8, -1, a + 12, -1, b + 12, -1, a, -1,
      b, -1, a + 4, -1, b + 4, -1, a + 8, -1, b + 8, -1, a + 12, -1, b + 12, -1);
  return _mm256_shuffle_epi8(v, control);
}

// The scale in both int16 halves of each lane (vpmaddwd against pair sums).
inline __m256i twice16(__m256i scale32) {
  const __m256i low = _mm256_and_si256(scale32, _mm256_set1_epi32(0xFFFF));
  return _mm256_or_si256(low, _mm256_slli_epi32(low, 16));
}

// Q4_K (FIFTH = false) and Q5_K (true): one group of 8 rows against activation rows
// [m0, m0 + MR): out[m * ldo + r].
template <int MR, bool FIFTH, typename Acts>
void q45_k_tile(const Acts& a, int64_t m0, const uint8_t* group, int64_t row_bytes, float* out,
                int64_t ldo) {
  constexpr int64_t kind = FIFTH ? gguf::kQ5_K : gguf::kQ4_K;
  constexpr int64_t bytes = fields<kind>().bytes;
  constexpr int64_t nibbles_word = FIFTH ? 11 : 3, high_word = 3;
  const int64_t k = a.in_features, num_supers = a.num_supers;
  const __m256i low_nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_supers; ++g) {
    const uint8_t* block = group + g * kGroupRows * bytes;
    prefetch_next_group(block, row_bytes, bytes);
    const ScalesMins sm = unpack_scales_mins(block, word_at<kind>(0));
    const int8_t* codes = a.codes.data() + m0 * k + g * 256;
    __m256i sumi[MR];
    for (int m = 0; m < MR; ++m) sumi[m] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i scales = p < 2 ? sm.scales_lo : sm.scales_hi;
      const __m256i scale_lo = lane_byte(scales, 2 * (p % 2)),
                    scale_hi = lane_byte(scales, 2 * (p % 2) + 1);
#ifdef GGUF_VNNI
      __m256i dot_lo[MR], dot_hi[MR];
      for (int m = 0; m < MR; ++m) dot_lo[m] = dot_hi[m] = _mm256_setzero_si256();
#else
      constexpr int kPerWidening = FIFTH ? 4 : 8;
      const __m256i scale16_lo = twice16(scale_lo), scale16_hi = twice16(scale_hi);
      __m256i pairs_lo[MR], pairs_hi[MR];
      for (int m = 0; m < MR; ++m) pairs_lo[m] = pairs_hi[m] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i v = load_words(block, word_at<kind>(nibbles_word + 8 * p + i));
        __m256i lo = _mm256_and_si256(v, low_nibble);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibble);
        if constexpr (FIFTH) {
          const __m256i high = load_words(block, word_at<kind>(high_word + i));
          lo = _mm256_or_si256(lo, fifth_bit(high, 2 * p));
          hi = _mm256_or_si256(hi, fifth_bit(high, 2 * p + 1));
        }
        for (int m = 0; m < MR; ++m) {
#ifdef GGUF_VNNI
          dot_lo[m] = dpbusd_broadcast(dot_lo[m], lo, codes + m * k + 64 * p + 4 * i);
          dot_hi[m] = dpbusd_broadcast(dot_hi[m], hi, codes + m * k + 64 * p + 32 + 4 * i);
#else
          const __m256i c_lo = broadcast_codes(codes + m * k + 64 * p + 4 * i);
          const __m256i c_hi = broadcast_codes(codes + m * k + 64 * p + 32 + 4 * i);
          pairs_lo[m] = _mm256_add_epi16(pairs_lo[m], _mm256_maddubs_epi16(lo, c_lo));
          pairs_hi[m] = _mm256_add_epi16(pairs_hi[m], _mm256_maddubs_epi16(hi, c_hi));
          if ((i + 1) % kPerWidening == 0) {
            sumi[m] = _mm256_add_epi32(
                sumi[m], _mm256_add_epi32(_mm256_madd_epi16(pairs_lo[m], scale16_lo),
                                          _mm256_madd_epi16(pairs_hi[m], scale16_hi)));
            pairs_lo[m] = pairs_hi[m] = _mm256_setzero_si256();
          }
#endif
        }
      }
#ifdef GGUF_VNNI
      for (int m = 0; m < MR; ++m) {
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(_mm256_mullo_epi32(dot_lo[m], scale_lo),
                                                              _mm256_mullo_epi32(dot_hi[m], scale_hi)));
      }
#endif
    }
    // sum_s min_s (sum of the sub-block's codes): mins in int16 pairs against code-sum pairs.
    __m256i min_pairs[4];
    for (int t = 0; t < 4; ++t) min_pairs[t] = lane_byte_pair(t < 2 ? sm.mins_lo : sm.mins_hi, t % 2);
    for (int m = 0; m < MR; ++m) {
      const int16_t* sums = a.bsum32.data() + ((m0 + m) * k + g * 256) / 32;
      __m256i corr = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        // Sums 2t and 2t + 1, adjacent: one int32 broadcast.
        const __m256i pair = broadcast_codes(reinterpret_cast<const int8_t*>(sums + 2 * t));
        corr = _mm256_add_epi32(corr, _mm256_madd_epi16(min_pairs[t], pair));
      }
      const float s = a.scale[(m0 + m) * num_supers + g];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), row_factors(block, half_at<kind>(0), s),
                               acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), row_factors(block, half_at<kind>(1), s),
                                acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

// Q6_K: chunk c = 4 h + j (32 values) takes the nibbles of word 16 h + 8 (j % 2) + i (low for
// j < 2) and bits 2j, 2j + 1 of word 32 + 8 h + i; its 16-value sub-blocks are 2c and 2c + 1.
// One loop iteration per chunk with its shifts as counts (the loop stays small, as Q4_K's:
// the super-block unrolled whole spent more instructions on addresses than on dots).
template <int MR, typename Acts>
void q6_k_tile(const Acts& a, int64_t m0, const uint8_t* group, int64_t row_bytes, float* out,
               int64_t ldo) {
  constexpr int64_t kind = gguf::kQ6_K;
  constexpr int64_t bytes = fields<kind>().bytes;
  const int64_t k = a.in_features, num_supers = a.num_supers;
  const __m256i low_nibble = _mm256_set1_epi8(0x0F);
#ifdef __AVX512VL__
  const __m256i six_bits = _mm256_set1_epi8(0x3F);
#else
  const __m256i two_bits = _mm256_set1_epi8(0x30);
#endif
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_supers; ++g) {
    const uint8_t* block = group + g * kGroupRows * bytes;
    prefetch_next_group(block, row_bytes, bytes);
    __m256i scale_words[4];
    for (int t = 0; t < 4; ++t) scale_words[t] = load_words(block, word_at<kind>(48 + t));
    const int8_t* codes = a.codes.data() + m0 * k + g * 256;
    __m256i sumi[MR];
    for (int m = 0; m < MR; ++m) sumi[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const int h = c / 4, j = c % 4;
      const uint8_t* nibbles = block + word_at<kind>(16 * h + 8 * (j % 2));
      const uint8_t* highs = block + word_at<kind>(32 + 8 * h);
      const __m128i nibble_shift = _mm_cvtsi32_si128(4 * (j / 2));
#ifdef __AVX512VL__
      // Bits 2j, 2j + 1 of each byte to bits 4, 5 by one 32-bit rotation (by 4 - 2j, mod 32).
      const __m256i high_rotation = _mm256_set1_epi32((4 - 2 * j) & 31);
#else
      const __m128i high_shift = _mm_cvtsi32_si128(2 * j);
#endif
      const int8_t* chunk_codes = codes + 32 * c;
      // The codes of word i of the chunk's 8 rows (values 4i..4i+3 of each), 0..63.
      auto decode = [&](int i) {
        const __m256i v = load_words(nibbles, 32 * i);
        const __m256i high = load_words(highs, 32 * i);
#ifdef __AVX512VL__
        // Bits 0-3 from the nibbles, 4-7 from the rotated high bits (one ternary-logic
        // select: 0xE4 = C ? A : B), then the two bits above the code cleared.
        return _mm256_and_si256(
            _mm256_ternarylogic_epi32(_mm256_srl_epi16(v, nibble_shift),
                                      _mm256_rolv_epi32(high, high_rotation), low_nibble, 0xE4),
            six_bits);
#else
        const __m256i low = _mm256_and_si256(_mm256_srl_epi16(v, nibble_shift), low_nibble);
        // Bits 2j, 2j + 1 of each byte to bits 0, 1 (16-bit shifts: what crosses from the
        // high byte lands above bit 5 of the low one), then to bits 4, 5.
        const __m256i top = _mm256_slli_epi16(_mm256_srl_epi16(high, high_shift), 4);
        return _mm256_or_si256(low, _mm256_and_si256(top, two_bits));
#endif
      };
      // The int8 scales of sub-blocks 2c (first half) and 2c + 1, sign-extended in each lane.
      auto sub_scale = [&](int sub) {
        return _mm256_srai_epi32(
            _mm256_sll_epi32(scale_words[sub / 4], _mm_cvtsi32_si128(24 - 8 * (sub % 4))), 24);
      };
      const __m256i scale_a = sub_scale(2 * c), scale_b = sub_scale(2 * c + 1);
#ifdef GGUF_VNNI
      // The two halves' dot chains side by side (word i of the first, i + 4 of the second):
      // 2 MR chains of 4 vpdpbusd each, where one half at a time left MR chains whose
      // latency the out-of-order window could not hide.
      __m256i dot_a[MR], dot_b[MR];
      for (int m = 0; m < MR; ++m) dot_a[m] = dot_b[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i q_a = decode(i), q_b = decode(i + 4);
        for (int m = 0; m < MR; ++m) {
          dot_a[m] = dpbusd_broadcast(dot_a[m], q_a, chunk_codes + m * k + 4 * i);
          dot_b[m] = dpbusd_broadcast(dot_b[m], q_b, chunk_codes + m * k + 16 + 4 * i);
        }
      }
      for (int m = 0; m < MR; ++m) {
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(_mm256_mullo_epi32(dot_a[m], scale_a),
                                                              _mm256_mullo_epi32(dot_b[m], scale_b)));
      }
#else
      const __m256i scale16_a = twice16(scale_a), scale16_b = twice16(scale_b);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i q = decode(i);
        const __m256i scale16 = i < 4 ? scale16_a : scale16_b;
        for (int m = 0; m < MR; ++m) {
          const __m256i cv = broadcast_codes(chunk_codes + m * k + 4 * i);
          sumi[m] = _mm256_add_epi32(sumi[m],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(q, cv), scale16));
        }
      }
#endif
    }
    // The zero point: 32 sum_s scale_s (sum of the sub-block's codes), scales in int16 pairs
    // (even bytes 4t, 4t + 2 and odd 4t + 1, 4t + 3 of word t) against code-sum pairs.
    __m256i even[4], odd[4];
    for (int t = 0; t < 4; ++t) {
      even[t] = _mm256_srai_epi16(_mm256_slli_epi16(scale_words[t], 8), 8);
      odd[t] = _mm256_srai_epi16(scale_words[t], 8);
    }
    for (int m = 0; m < MR; ++m) {
      // Sums (4t, 4t + 2) and (4t + 1, 4t + 3), laid out as int32 pairs (bsum_q6).
      const int8_t* sums =
          reinterpret_cast<const int8_t*>(a.bsum_q6.data() + ((m0 + m) * k + g * 256) / 16);
      __m256i corr = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        corr = _mm256_add_epi32(corr,
                                _mm256_madd_epi16(even[t], broadcast_codes(sums + 8 * t)));
        corr = _mm256_add_epi32(corr,
                                _mm256_madd_epi16(odd[t], broadcast_codes(sums + 8 * t + 4)));
      }
      const __m256i total = _mm256_sub_epi32(sumi[m], _mm256_slli_epi32(corr, 5));
      const float s = a.scale[(m0 + m) * num_supers + g];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), row_factors(block, half_at<kind>(0), s),
                               acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

template <int64_t KIND, int MR, typename Acts>
void super_x8_tile(const Acts& a, int64_t m0, const uint8_t* group, int64_t row_bytes,
                   float* out, int64_t ldo) {
  if constexpr (KIND == gguf::kQ6_K) {
    q6_k_tile<MR>(a, m0, group, row_bytes, out, ldo);
  } else {
    q45_k_tile<MR, KIND == gguf::kQ5_K>(a, m0, group, row_bytes, out, ldo);
  }
}

}  // namespace gguf_x8
#endif  // GGUF_AVX2
