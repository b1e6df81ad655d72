// The K-quants (Q2_K..Q6_K) regrouped by 8 rows (gguf_x8_layout.h) against activations
// quantized per 256 values (codes c, one scale s per super-block and row; llama.cpp's Q8_K).
//
// A super-block of a tile's rows is one pass over its words: each vector of codes (4 values
// of each of the 8 rows, or of 16 rows in a 512-bit vector: gguf_vec.h) meets the 4 broadcast
// activation codes of those values in one byte dot, so the int32 lanes are the rows' partial
// sums and no horizontal sum remains. Per row and super-block, in integers except the last
// line (with VNNI, Q4_K, Q5_K and Q6_K scale each sub-block's sum in fp32: below):
//     Q4_K / Q5_K  sum_s scale_s (sum_{j in s} q_j c_j) - dmin/d-free: sum_s min_s (sum c_j)
//     Q2_K         the same over 16-value sub-blocks
//     Q6_K, Q3_K   sum_s scale_s (sum_{j in s} q_j c_j) - z sum_s scale_s (sum_{j in s} c_j),
//                  z = 32 and 4
//     out += s d (first term) - s dmin (second term)       (Q6_K, Q3_K: s d (first - second))
// With VNNI each 32-value (Q2_K, Q3_K, Q6_K: 16-value) sub-block's dot is one vpdpbusd chain,
// then one vpmulld by the rows' sub-block scales (Q2_K, Q3_K), or, for Q4_K, Q5_K and Q6_K,
// converted to fp32 and multiplied by d scale_s (exact) in one multiply-add: fewer micro-ops
// on the vector ports the dots need, in the tiles that are bound by them (Q6_K's chains start
// at its zero point's term, so the first line's last term is in the chain). Without VNNI,
// vpmaddubsw pair sums add up in int16 (at most 2 x 15 x 127 x 8 for Q4_K, 2 x 31 x 127 x 4
// for Q5_K, 2 x 63 x 127 for Q6_K) and vpmaddwd multiplies them by the scales. The min and
// zero-point terms need only the activations' code sums per sub-block
// (SuperActivations::bsum32, bsum_q6) and vpmaddwd (vpdpwssd with VNNI).
//
// Each output row's arithmetic is the same whatever the tile, the vector width and the batch:
// a row is a lane, and the order of its sums never depends on its neighbours (batch-invariant
// by construction).
//
// Included by gguf_gemm.cpp after its instruction-set macros (GGUF_AVX2, GGUF_VNNI,
// GGUF_DPBUSD); `Acts` is its SuperActivations.
#pragma once

#include "gguf_x8_layout.h"

#ifdef GGUF_AVX2
#include "gguf_vec.h"

namespace gguf_x8 {

// The block of `bytes` per row at the same position in each group the tile takes next (a
// 512-bit tile's unit is two groups, one group stride apart), one tile ahead of use: rows of
// a few super-blocks end the hardware prefetcher's streams before they pay off. Part `part`
// of PARTS of its lines: a super-block's 18-27 lines per group, issued at once, fill the
// core's line-fill buffers ahead of the tile's own loads; issued a part per sub-block pass,
// they stream beside them. Measured, 2 threads, weights from memory, M = 1: Q4_K 16384 x 2048
// 0.786 -> 0.729-0.748 ms, Q6_K 3072 x 2048 0.223-0.230 -> 0.211-0.219. Prefetching a few
// super-blocks ahead in the same rows instead (on into the next tile at a row's end) read
// 25-45 % slower.
template <typename V, int PARTS = 1>
inline void prefetch_next_groups(const uint8_t* block, int64_t row_bytes, int64_t bytes,
                                 int part = 0) {
  const int64_t lines = (kGroupRows * bytes + 63) / 64;
  const int64_t first = lines * part / PARTS, last = lines * (part + 1) / PARTS;
  for (int64_t group = 0; group < V::kRows / kGroupRows; ++group) {
    const char* next =
        reinterpret_cast<const char*>(block + (V::kRows + group * kGroupRows) * row_bytes);
    for (int64_t line = first; line < last; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
  }
}

// Bit `bit` of every code byte of `high`, moved to bit 4 (Q5_K's fifth bit).
template <typename V, int BIT>
inline typename V::I fifth_bit(typename V::I high) {
  const typename V::I mask = V::set1_8(0x10);
  if constexpr (BIT < 4) return V::and_(V::template slli16<4 - BIT>(high), mask);
  if constexpr (BIT == 4) return V::and_(high, mask);
  if constexpr (BIT > 4) return V::and_(V::template srli16<BIT - 4>(high), mask);
}

// Q4_K / Q5_K: the packed 12 bytes of 6-bit scales and mins, as three words per row, to
// scales and mins 0-3 and 4-7 (one byte each per int32 lane).
template <typename V>
struct ScalesMins {
  typename V::I scales_lo, scales_hi, mins_lo, mins_hi;
};

template <typename V>
inline ScalesMins<V> unpack_scales_mins(const uint8_t* block, int64_t at, int64_t stride) {
  using I = typename V::I;
  const I w0 = V::load(block + at, stride), w1 = V::load(block + at + 32, stride),
          w2 = V::load(block + at + 64, stride);
  const I low6 = V::set1_32(0x3f3f3f3f), low4 = V::set1_32(0x0f0f0f0f),
          low2 = V::set1_32(0x03030303);
  auto top2 = [&](I w) {
    return V::template slli32<4>(V::and_(V::template srli32<6>(w), low2));
  };
  return {V::and_(w0, low6), V::or_(V::and_(w2, low4), top2(w0)), V::and_(w1, low6),
          V::or_(V::and_(V::template srli32<4>(w2), low4), top2(w1))};
}

// Byte `byte` of each int32 lane, zero-extended.
template <typename V>
inline typename V::I lane_byte(typename V::I v, int byte) {
  return V::and_(V::srl32(v, _mm_cvtsi32_si128(8 * byte)), V::set1_32(0xFF));
}

// Bytes 2p and 2p + 1 of each int32 lane as its two int16 halves (sub-blocks 2p and 2p + 1).
template <typename V>
inline typename V::I lane_byte_pair(typename V::I v, int p) {
  const char a = static_cast<char>(2 * p), b = static_cast<char>(2 * p + 1);
  const __m128i control = _mm_setr_epi8(a, -1, b, -1, a + 4, -1, b + 4, -1, a + 8, -1, b + 8,
                                        -1, a + 12, -1, b + 12, -1);
  return V::shuffle8(v, V::lanes16(control));
}

// The scale in both int16 halves of each lane (vpmaddwd against pair sums).
template <typename V>
inline typename V::I twice16(typename V::I scale32) {
  const typename V::I low = V::and_(scale32, V::set1_32(0xFFFF));
  return V::or_(low, V::template slli32<16>(low));
}

// Q4_K (FIFTH = false) and Q5_K (true): the V::kRows rows from `group` on against
// activation rows [m0, m0 + MR): out[m * ldo + r].
template <typename V, int MR, bool FIFTH, typename Acts>
void q45_k_tile(const Acts& a, int64_t m0, const uint8_t* group, int64_t row_bytes, float* out,
                int64_t ldo) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t kind = FIFTH ? gguf::kQ5_K : gguf::kQ4_K;
  constexpr int64_t bytes = fields<kind>().bytes;
  constexpr int64_t nibbles_word = FIFTH ? 11 : 3, high_word = 3;
  const int64_t stride = kGroupRows * row_bytes;  // to the next group (V16's upper lanes)
  const int64_t k = a.in_features, num_supers = a.num_supers;
  const I low_nibble = V::set1_8(0x0F);
  F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zero_ps();
  for (int64_t g = 0; g < num_supers; ++g) {
    const uint8_t* block = group + g * kGroupRows * bytes;
    const ScalesMins<V> sm = unpack_scales_mins<V>(block, word_at<kind>(0), stride);
    const int8_t* codes = a.codes.data() + m0 * k + g * 256;
    const F d = V::halves(block + half_at<kind>(0), stride),
            dmin = V::halves(block + half_at<kind>(1), stride);
#ifdef GGUF_VNNI
    // sum_s dot_s (d scale_s) in fp32, sub-block by sub-block: a conversion and a multiply-add
    // per sub-block and row where the integer form took a 32-bit multiply (two micro-ops on
    // Intel's cores) and an add, and d's multiply per row (d scale_s is exact: 11 x 6 bits).
    F part[MR];
    for (int m = 0; m < MR; ++m) part[m] = V::zero_ps();
#else
    I sumi[MR];
    for (int m = 0; m < MR; ++m) sumi[m] = V::zero();
#endif
    for (int p = 0; p < 4; ++p) {
      prefetch_next_groups<V, 4>(block, row_bytes, bytes, p);
      const I scales = p < 2 ? sm.scales_lo : sm.scales_hi;
      const I scale_lo = lane_byte<V>(scales, 2 * (p % 2)),
              scale_hi = lane_byte<V>(scales, 2 * (p % 2) + 1);
#ifdef GGUF_VNNI
      I dot_lo[MR], dot_hi[MR];
      for (int m = 0; m < MR; ++m) dot_lo[m] = dot_hi[m] = V::zero();
#else
      constexpr int kPerWidening = FIFTH ? 4 : 8;
      const I scale16_lo = twice16<V>(scale_lo), scale16_hi = twice16<V>(scale_hi);
      I pairs_lo[MR], pairs_hi[MR];
      for (int m = 0; m < MR; ++m) pairs_lo[m] = pairs_hi[m] = V::zero();
#endif
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const I v = V::load(block + word_at<kind>(nibbles_word + 8 * p + i), stride);
        I lo = V::and_(v, low_nibble);
        I hi = V::and_(V::template srli16<4>(v), low_nibble);
        if constexpr (FIFTH) {
          const I high = V::load(block + word_at<kind>(high_word + i), stride);
          switch (p) {  // bits 2p and 2p + 1, as immediates
            case 0: lo = V::or_(lo, fifth_bit<V, 0>(high)); hi = V::or_(hi, fifth_bit<V, 1>(high)); break;
            case 1: lo = V::or_(lo, fifth_bit<V, 2>(high)); hi = V::or_(hi, fifth_bit<V, 3>(high)); break;
            case 2: lo = V::or_(lo, fifth_bit<V, 4>(high)); hi = V::or_(hi, fifth_bit<V, 5>(high)); break;
            default: lo = V::or_(lo, fifth_bit<V, 6>(high)); hi = V::or_(hi, fifth_bit<V, 7>(high)); break;
          }
        }
        for (int m = 0; m < MR; ++m) {
#ifdef GGUF_VNNI
          dot_lo[m] = V::dpbusd(dot_lo[m], lo, codes + m * k + 64 * p + 4 * i);
          dot_hi[m] = V::dpbusd(dot_hi[m], hi, codes + m * k + 64 * p + 32 + 4 * i);
#else
          const I c_lo = V::broadcast4(codes + m * k + 64 * p + 4 * i);
          const I c_hi = V::broadcast4(codes + m * k + 64 * p + 32 + 4 * i);
          pairs_lo[m] = V::add16(pairs_lo[m], V::maddubs(lo, c_lo));
          pairs_hi[m] = V::add16(pairs_hi[m], V::maddubs(hi, c_hi));
          if ((i + 1) % kPerWidening == 0) {
            sumi[m] = V::add32(sumi[m], V::add32(V::madd16(pairs_lo[m], scale16_lo),
                                                 V::madd16(pairs_hi[m], scale16_hi)));
            pairs_lo[m] = pairs_hi[m] = V::zero();
          }
#endif
        }
      }
#ifdef GGUF_VNNI
      const F factor_lo = V::mul(d, V::cvt(scale_lo)), factor_hi = V::mul(d, V::cvt(scale_hi));
      for (int m = 0; m < MR; ++m) {
        part[m] = V::fmadd(V::cvt(dot_lo[m]), factor_lo, part[m]);
        part[m] = V::fmadd(V::cvt(dot_hi[m]), factor_hi, part[m]);
      }
#endif
    }
    // sum_s min_s (sum of the sub-block's codes): mins in int16 pairs against code-sum pairs.
    I min_pairs[4];
    for (int t = 0; t < 4; ++t) {
      min_pairs[t] = lane_byte_pair<V>(t < 2 ? sm.mins_lo : sm.mins_hi, t % 2);
    }
    for (int m = 0; m < MR; ++m) {
      const int16_t* sums = a.bsum32.data() + ((m0 + m) * k + g * 256) / 32;
      I corr = V::zero();
      for (int t = 0; t < 4; ++t) {
        // Sums 2t and 2t + 1, adjacent: one int32 broadcast.
        corr = V::dpwssd(corr, min_pairs[t], reinterpret_cast<const int8_t*>(sums + 2 * t));
      }
      const F s = V::set1_ps(a.scale[(m0 + m) * num_supers + g]);
#ifdef GGUF_VNNI
      acc[m] = V::fmadd(V::fnmadd(V::cvt(corr), dmin, part[m]), s, acc[m]);
#else
      acc[m] = V::fmadd(V::cvt(sumi[m]), V::mul(d, s), acc[m]);
      acc[m] = V::fnmadd(V::cvt(corr), V::mul(dmin, s), acc[m]);
#endif
    }
  }
  for (int m = 0; m < MR; ++m) V::store(out + m * ldo, acc[m]);
}

// The kinds of 16 sub-blocks of 16 values (Q6_K, Q3_K, Q2_K): chunk c (32 values, sub-blocks
// 2c and 2c + 1) decodes its codes word by word, per kind:
//   Q6_K  c = 4 h + j: the nibbles of word 16 h + 8 (j % 2) + i (low for j < 2) and bits 2j,
//         2j + 1 of word 32 + 8 h + i: 0..63, zero point 32, int8 scales (words 48-51)
//   Q3_K  c = 4 n + j: bits 2j, 2j + 1 of word 8 + 8 n + i and bit c of word i: 0..7, zero
//         point 4, 6-bit scales - 32 packed in words 24-26
//   Q2_K  c = 4 n + j: bits 2j, 2j + 1 of word 4 + 8 n + i: 0..3, 4-bit scales and mins
//         (words 0-3), the mins times dmin taken off as Q4_K's
// One loop iteration per chunk with its shifts as counts (the loop stays small, as Q4_K's:
// the super-block unrolled whole spent more instructions on addresses than on dots).
// sum_s f_s (sum of the activation codes of 16-value sub-block s) per lane, for the 16
// signed per-sub-block byte factors in `words` (4 per lane per word: Q6_K's and Q3_K's scales,
// Q2_K's mins): the factors as int16 pairs (even bytes 4t, 4t + 2 and odd 4t + 1, 4t + 3 of
// word t) against the row's code-sum pairs (SuperActivations::bsum_q6).
template <typename V>
struct Sub16FactorSums {
  using I = typename V::I;
  I even[4], odd[4];

  explicit Sub16FactorSums(const I* words) {
    for (int t = 0; t < 4; ++t) {
      even[t] = V::template srai16<8>(V::template slli16<8>(words[t]));
      odd[t] = V::template srai16<8>(words[t]);
    }
  }

  // Row `row`'s sum over super-block g.
  template <typename Acts>
  I of(const Acts& a, int64_t row, int64_t g) const {
    const int8_t* sums = reinterpret_cast<const int8_t*>(
        a.bsum_q6.data() + (row * a.in_features + g * 256) / 16);
    I sum = V::zero();
    for (int t = 0; t < 4; ++t) {
      sum = V::add32(sum, V::madd16(even[t], V::broadcast4(sums + 8 * t)));
      sum = V::add32(sum, V::madd16(odd[t], V::broadcast4(sums + 8 * t + 4)));
    }
    return sum;
  }
};

// Q6_K with VNNI: each 16-value sub-block's dot chain starts at -32 times the activations'
// code sum (SuperActivations::q6_zero_point), so it ends as the exact sum of (q - 32) c, and
// its scale d scale_s (exact in fp32: 11 x 8 bits) is one conversion and one multiply-add per
// row, where the integer form took a 32-bit multiply (two micro-ops on Intel's cores), an add
// and the zero-point sums afterwards.
template <int64_t KIND>
constexpr bool float_scales() {
#ifdef GGUF_VNNI
  return KIND == gguf::kQ6_K;
#else
  return false;
#endif
}

template <int64_t KIND>
constexpr int zero_point_shift() {  // log2 of the zero point; Q2_K has mins instead
  return KIND == gguf::kQ6_K ? 5 : KIND == gguf::kQ3_K ? 2 : -1;
}

template <typename V, int MR, int64_t KIND, typename Acts>
void sub16_tile(const Acts& a, int64_t m0, const uint8_t* group, int64_t row_bytes, float* out,
                int64_t ldo) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t bytes = fields<KIND>().bytes;
  const int64_t stride = kGroupRows * row_bytes;
  const int64_t k = a.in_features, num_supers = a.num_supers;
  const I low_nibble = V::set1_8(0x0F);
  const I low2 = V::set1_8(0x03);
#ifdef __AVX512VL__
  const I code_mask = V::set1_8(KIND == gguf::kQ6_K ? 0x3F : 0x07);
#else
  const I two_bits = V::set1_8(0x30);
#endif
  F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zero_ps();
  for (int64_t g = 0; g < num_supers; ++g) {
    const uint8_t* block = group + g * kGroupRows * bytes;
    // The 16 sub-block scales as signed bytes (4 per lane per word), and Q2_K's mins.
    I scale_words[4], min_words[4];
    if constexpr (KIND == gguf::kQ6_K) {
      for (int t = 0; t < 4; ++t) scale_words[t] = V::load(block + word_at<KIND>(48 + t), stride);
    } else if constexpr (KIND == gguf::kQ3_K) {
      const I w0 = V::load(block + word_at<KIND>(24), stride),
              w1 = V::load(block + word_at<KIND>(25), stride),
              w2 = V::load(block + word_at<KIND>(26), stride);
      const I nibbles4 = V::set1_32(0x0F0F0F0F), bits2 = V::set1_32(0x03030303);
      auto high = [&](I shifted) { return V::template slli32<4>(V::and_(shifted, bits2)); };
      scale_words[0] = V::or_(V::and_(w0, nibbles4), high(w2));
      scale_words[1] = V::or_(V::and_(w1, nibbles4), high(V::template srli32<2>(w2)));
      scale_words[2] = V::or_(V::and_(V::template srli32<4>(w0), nibbles4),
                              high(V::template srli32<4>(w2)));
      scale_words[3] = V::or_(V::and_(V::template srli32<4>(w1), nibbles4),
                              high(V::template srli32<6>(w2)));
      for (int t = 0; t < 4; ++t) scale_words[t] = V::sub8(scale_words[t], V::set1_8(32));
    } else {
      for (int t = 0; t < 4; ++t) {
        const I w = V::load(block + word_at<KIND>(t), stride);
        scale_words[t] = V::and_(w, low_nibble);
        min_words[t] = V::and_(V::template srli16<4>(w), low_nibble);
      }
    }
    const int8_t* codes = a.codes.data() + m0 * k + g * 256;
    const F d = V::halves(block + half_at<KIND>(0), stride);
    I sumi[MR];
    F part[MR];  // float_scales: sum_s (dot_s - 32 sum_s c) (d scale_s) in fp32
    for (int m = 0; m < MR; ++m) {
      sumi[m] = V::zero();
      part[m] = V::zero_ps();
    }
    for (int c = 0; c < 8; ++c) {
      prefetch_next_groups<V, 8>(block, row_bytes, bytes, c);
      const int h = c / 4, j = c % 4;
      const __m128i pair_shift = _mm_cvtsi32_si128(2 * j);
      const uint8_t* low_words;   // the nibbles (Q6_K) or 2-bit codes
      const uint8_t* high_words;  // the 2-bit highs (Q6_K) or the high bits (Q3_K)
      __m128i low_shift;
      if constexpr (KIND == gguf::kQ6_K) {
        low_words = block + word_at<KIND>(16 * h + 8 * (j % 2));
        high_words = block + word_at<KIND>(32 + 8 * h);
        low_shift = _mm_cvtsi32_si128(4 * (j / 2));
      } else if constexpr (KIND == gguf::kQ3_K) {
        low_words = block + word_at<KIND>(8 + 8 * h);
        high_words = block + word_at<KIND>(0);
        low_shift = pair_shift;
      } else {
        low_words = block + word_at<KIND>(4 + 8 * h);
        high_words = nullptr;
        low_shift = pair_shift;
      }
#ifdef __AVX512VL__
      // Q6_K: bits 2j, 2j + 1 of each byte to bits 4, 5; Q3_K: bit c to bit 2. One 32-bit
      // rotation each (the other bits are cleared below).
      const I high_rotation = V::set1_32(KIND == gguf::kQ6_K ? (4 - 2 * j) & 31 : (2 - c) & 31);
#endif
      const int8_t* chunk_codes = codes + 32 * c;
      // The codes of word i of the chunk's rows (values 4i..4i+3 of each).
      auto decode = [&](int i) -> I {
        const I v = V::load(low_words + 32 * i, stride);
        if constexpr (KIND == gguf::kQ2_K) {
          return V::and_(V::srl16(v, low_shift), low2);
        } else {
          const I high = V::load(high_words + 32 * i, stride);
#ifdef __AVX512VL__
          // The low bits from the code words, the rest from the rotated high bits (one
          // ternary-logic select: 0xE4 = C ? A : B), then the bits above the code cleared.
          const I low_bits = KIND == gguf::kQ6_K ? low_nibble : low2;
          return V::and_(V::template ternary<0xE4>(V::srl16(v, low_shift),
                                                   V::rolv32(high, high_rotation), low_bits),
                         code_mask);
#else
          if constexpr (KIND == gguf::kQ6_K) {
            const I low = V::and_(V::srl16(v, low_shift), low_nibble);
            // Bits 2j, 2j + 1 of each byte to bits 0, 1 (16-bit shifts: what crosses from
            // the high byte lands above bit 5 of the low one), then to bits 4, 5.
            const I top = V::template slli16<4>(V::srl16(high, pair_shift));
            return V::or_(low, V::and_(top, two_bits));
          } else {
            const I low = V::and_(V::srl16(v, low_shift), low2);
            // Bit c of each byte to bit 0, then to bit 2.
            const I top = V::template slli16<2>(V::srl16(high, _mm_cvtsi32_si128(c)));
            return V::or_(low, V::and_(top, V::set1_8(0x04)));
          }
#endif
        }
      };
      // The int8 scale of sub-block `sub`, sign-extended in each lane.
      auto sub_scale = [&](int sub) {
        return V::template srai32<24>(
            V::sll32(scale_words[sub / 4], _mm_cvtsi32_si128(24 - 8 * (sub % 4))));
      };
      const I scale_a = sub_scale(2 * c), scale_b = sub_scale(2 * c + 1);
#ifdef GGUF_VNNI
      // The two halves' dot chains side by side (word i of the first, i + 4 of the second).
      I dot_a[MR], dot_b[MR];
      for (int m = 0; m < MR; ++m) {
        if constexpr (float_scales<KIND>()) {
          const int32_t* zero_point = a.q6_zero_point.data() + ((m0 + m) * k + g * 256) / 16;
          dot_a[m] = V::broadcast4(reinterpret_cast<const int8_t*>(zero_point + 2 * c));
          dot_b[m] = V::broadcast4(reinterpret_cast<const int8_t*>(zero_point + 2 * c + 1));
        } else {
          dot_a[m] = dot_b[m] = V::zero();
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const I q_a = decode(i), q_b = decode(i + 4);
        for (int m = 0; m < MR; ++m) {
          dot_a[m] = V::dpbusd(dot_a[m], q_a, chunk_codes + m * k + 4 * i);
          dot_b[m] = V::dpbusd(dot_b[m], q_b, chunk_codes + m * k + 16 + 4 * i);
        }
      }
      if constexpr (float_scales<KIND>()) {
        const F factor_a = V::mul(d, V::cvt(scale_a)), factor_b = V::mul(d, V::cvt(scale_b));
        for (int m = 0; m < MR; ++m) {
          part[m] = V::fmadd(V::cvt(dot_a[m]), factor_a, part[m]);
          part[m] = V::fmadd(V::cvt(dot_b[m]), factor_b, part[m]);
        }
      } else {
        for (int m = 0; m < MR; ++m) {
          sumi[m] = V::add32(sumi[m], V::add32(V::mullo32(dot_a[m], scale_a),
                                               V::mullo32(dot_b[m], scale_b)));
        }
      }
#else
      const I scale16_a = twice16<V>(scale_a), scale16_b = twice16<V>(scale_b);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const I q = decode(i);
        const I scale16 = i < 4 ? scale16_a : scale16_b;
        for (int m = 0; m < MR; ++m) {
          const I cv = V::broadcast4(chunk_codes + m * k + 4 * i);
          sumi[m] = V::add32(sumi[m], V::madd16(V::maddubs(q, cv), scale16));
        }
      }
#endif
    }
    // The zero point (Q6_K, Q3_K: z sum_s scale_s (sum of the sub-block's codes)) or Q2_K's
    // mins (sum_s min_s (...)): the per-byte factors in int16 pairs (even bytes 4t, 4t + 2 and
    // odd 4t + 1, 4t + 3 of word t) against code-sum pairs.
    if constexpr (float_scales<KIND>()) {
      for (int m = 0; m < MR; ++m) {
        acc[m] = V::fmadd(part[m], V::set1_ps(a.scale[(m0 + m) * num_supers + g]), acc[m]);
      }
      continue;
    }
    const Sub16FactorSums<V> factor_sums(KIND == gguf::kQ2_K ? min_words : scale_words);
    for (int m = 0; m < MR; ++m) {
      const I corr = factor_sums.of(a, m0 + m, g);
      const F s = V::set1_ps(a.scale[(m0 + m) * num_supers + g]);
      if constexpr (KIND == gguf::kQ2_K) {
        const F dmin = V::halves(block + half_at<KIND>(1), stride);
        acc[m] = V::fmadd(V::cvt(sumi[m]), V::mul(d, s), acc[m]);
        acc[m] = V::fnmadd(V::cvt(corr), V::mul(dmin, s), acc[m]);
      } else {
        const I total =
            V::sub32(sumi[m], V::template slli32<zero_point_shift<KIND>()>(corr));
        acc[m] = V::fmadd(V::cvt(total), V::mul(d, s), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) V::store(out + m * ldo, acc[m]);
}

#if defined(__AVX512VL__) && defined(GGUF_VNNI)
// Up to this many activation rows the Q6_K tile shares its word loads across chunks: eight
// dot chains per row, 32 vector registers.
constexpr int kQ6kSharedWordsMaxRows = 2;

// Q6_K for tiles of few activation rows (decode of one or two sequences), where decoding the
// codes costs more than the dots: a half h of the super-block is its words in an outer loop,
// and each word i's three vectors (nibbles of words 16 h + i and 16 h + 8 + i, 2-bit highs of
// word 32 + 8 h + i) are loaded once for the four chunks 4 h + j that use them, where
// sub16_tile loads them once per chunk (eight loads for four code vectors instead of three).
// Eight dot chains per activation row (four chunks, two sub-blocks each) stay in registers;
// the sums, their order and the scale and zero-point terms are sub16_tile's, so the result
// is bit-identical to it.
template <typename V, int MR, typename Acts>
void q6_k_shared_words_tile(const Acts& a, int64_t m0, const uint8_t* group, int64_t row_bytes,
                            float* out, int64_t ldo) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t kind = gguf::kQ6_K;
  constexpr int64_t bytes = fields<kind>().bytes;
  const int64_t stride = kGroupRows * row_bytes;
  const int64_t k = a.in_features, num_supers = a.num_supers;
  const I low_nibble = V::set1_8(0x0F), code_mask = V::set1_8(0x3F);
  // Bits 2j, 2j + 1 of each byte of the highs to bits 4, 5 (j = 0, 1, 3; j = 2 needs none).
  const I rotate_0 = V::set1_32(4), rotate_1 = V::set1_32(2), rotate_3 = V::set1_32(30);
  F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zero_ps();
  for (int64_t g = 0; g < num_supers; ++g) {
    const uint8_t* block = group + g * kGroupRows * bytes;
    I scale_words[4];
    for (int t = 0; t < 4; ++t) scale_words[t] = V::load(block + word_at<kind>(48 + t), stride);
    auto sub_scale = [&](int sub) {
      return V::template srai32<24>(
          V::sll32(scale_words[sub / 4], _mm_cvtsi32_si128(24 - 8 * (sub % 4))));
    };
    const int8_t* codes = a.codes.data() + m0 * k + g * 256;
    const F d = V::halves(block + half_at<kind>(0), stride);
    F part[MR];
    for (int m = 0; m < MR; ++m) part[m] = V::zero_ps();
    for (int h = 0; h < 2; ++h) {
      I dot[MR][4][2];
      for (int m = 0; m < MR; ++m) {
        const int32_t* zero_point = a.q6_zero_point.data() + ((m0 + m) * k + g * 256) / 16;
        for (int j = 0; j < 4; ++j) {
          for (int half = 0; half < 2; ++half) {
            dot[m][j][half] = V::broadcast4(
                reinterpret_cast<const int8_t*>(zero_point + 2 * (4 * h + j) + half));
          }
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        if (i % 4 == 0) prefetch_next_groups<V, 4>(block, row_bytes, bytes, 2 * h + i / 4);
        const I nibbles_a = V::load(block + word_at<kind>(16 * h + i), stride);
        const I nibbles_b = V::load(block + word_at<kind>(16 * h + 8 + i), stride);
        const I highs = V::load(block + word_at<kind>(32 + 8 * h + i), stride);
        // The low 4 bits from the nibbles, the rest from the rotated highs (0xE4: C ? A : B),
        // then the bits above the 6-bit code cleared.
        const I q[4] = {
            V::and_(V::template ternary<0xE4>(nibbles_a, V::rolv32(highs, rotate_0), low_nibble),
                    code_mask),
            V::and_(V::template ternary<0xE4>(nibbles_b, V::rolv32(highs, rotate_1), low_nibble),
                    code_mask),
            V::and_(V::template ternary<0xE4>(V::template srli16<4>(nibbles_a), highs, low_nibble),
                    code_mask),
            V::and_(V::template ternary<0xE4>(V::template srli16<4>(nibbles_b),
                                              V::rolv32(highs, rotate_3), low_nibble),
                    code_mask),
        };
        for (int j = 0; j < 4; ++j) {
          const int8_t* word_codes = codes + 32 * (4 * h + j) + 4 * i;
          for (int m = 0; m < MR; ++m) {
            dot[m][j][i / 4] = V::dpbusd(dot[m][j][i / 4], q[j], word_codes + m * k);
          }
        }
      }
      for (int j = 0; j < 4; ++j) {
        const int c = 4 * h + j;
        const F factor_a = V::mul(d, V::cvt(sub_scale(2 * c))),
                factor_b = V::mul(d, V::cvt(sub_scale(2 * c + 1)));
        for (int m = 0; m < MR; ++m) {
          part[m] = V::fmadd(V::cvt(dot[m][j][0]), factor_a, part[m]);
          part[m] = V::fmadd(V::cvt(dot[m][j][1]), factor_b, part[m]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      acc[m] = V::fmadd(part[m], V::set1_ps(a.scale[(m0 + m) * num_supers + g]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) V::store(out + m * ldo, acc[m]);
}
#endif

template <int64_t KIND, int MR, typename V, typename Acts>
void super_x8_tile(const Acts& a, int64_t m0, const uint8_t* group, int64_t row_bytes,
                   float* out, int64_t ldo) {
#if defined(__AVX512VL__) && defined(GGUF_VNNI)
  if constexpr (KIND == gguf::kQ6_K && MR <= kQ6kSharedWordsMaxRows) {
    q6_k_shared_words_tile<V, MR>(a, m0, group, row_bytes, out, ldo);
    return;
  }
#endif
  if constexpr (KIND == gguf::kQ6_K || KIND == gguf::kQ3_K || KIND == gguf::kQ2_K) {
    sub16_tile<V, MR, KIND>(a, m0, group, row_bytes, out, ldo);
  } else {
    q45_k_tile<V, MR, KIND == gguf::kQ5_K>(a, m0, group, row_bytes, out, ldo);
  }
}

}  // namespace gguf_x8
#endif  // GGUF_AVX2
