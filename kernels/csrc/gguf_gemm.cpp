// GGUF Q4_0 / Q4_1 / Q8_0 linear layers and embeddings computed straight from the file's
// blocks (no conversion at load, no second copy of the weights).
//
//   weight [N, K] = blocks uint8 [N, K / 32 * bytes]: the file's blocks, row after row
//     Q4_0 (ggml id 2, 18 B)  d fp16 | 16 B nibbles            w_j = d * (q_j - 8)
//     Q4_1 (ggml id 3, 20 B)  d fp16 | m fp16 | 16 B nibbles   w_j = d * q_j + m
//     Q8_0 (ggml id 8, 34 B)  d fp16 | 32 x int8               w_j = d * q_j
//   (a Q4 block keeps q_j in the low nibble of byte j and q_{j+16} in the high nibble)
//
// Every kind is written as w_j = d * q_j + o with o = -8 d (Q4_0), m (Q4_1) or 0 (Q8_0).
//
// fp32 activations (int8_activations unset) take the EXACT path: each weight is dequantized
// as the file defines it (d * q_j is exact in fp32; Q4_1 rounds once adding m, like ggml) and
// multiplied in fp32, so the result is x @ W^T up to summation order.
//
// bf16 / fp16 activations, and fp32 ones when int8_activations is set, take the FAST path:
// each 32-value block of an activation row is rounded to int8 codes c_j with one scale
// s = amax / 127, and a block's dot product becomes
//     sum_j w_j x_j ~= d s (sum_j q_j c_j) + o (s sum_j c_j)
// with the bracket an exact integer: u8 x s8 pair products (vpmaddubsw + vpmaddwd, or vpdpbusd
// where VNNI exists). Q4 codes 0..15 are the unsigned operand as they are; Q8_0 codes are
// signed, so |q| is the unsigned operand and c takes q's sign (|q| <= 128, |c| <= 127: a pair
// sums to at most 32512, below the int16 saturation). The o term needs only the block sums of
// the codes, once per activation row. Its only error is the activation rounding
// (|x_j - s c_j| <= s / 2); kernels/gguf_blocks_torch.quantize_activation_blocks is the same
// rounding in torch. From kHalfPanelMinRows activation rows on, Q4 layers compute in fp32 on
// a dequantized panel instead (measured faster there without VNNI; exact weights too).
//
// Parallel over output rows (chunks of kChunkN, at::parallel_for); within a chunk, activation
// rows go in tiles of up to kTileM so each weight block is unpacked once per tile, against NR
// weight rows at a time (register tiles: MR x NR accumulators).
//
// LLMSERVE_GGUF_SCALAR forces the portable scalar code and LLMSERVE_GGUF_EMULATE_VNNI runs the
// VNNI code path on AVX2 (the tests build both); LLMSERVE_GGUF_NAMESPACE renames the op
// namespace so such a build can load beside the main library.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "activation_codes.h"
#include "gguf_formats.h"
#include "gguf_x8_layout.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(LLMSERVE_GGUF_SCALAR)
#define GGUF_AVX2 1
#include <immintrin.h>
#if defined(LLMSERVE_GGUF_EMULATE_VNNI)
// Test builds on CPUs without VNNI: vpdpbusd's arithmetic in AVX2, so the VNNI code path
// runs here too. Each int32 lane gets the sum of its four u8 x s8 products, with no int16
// saturation in between (vpmaddubsw would saturate; vpmaddwd on 16-bit halves cannot).
#define GGUF_VNNI 1
#define GGUF_VNNI_EMULATED 1
#define GGUF_DPBUSD emulated_dpbusd
inline __m256i emulated_dpbusd(__m256i acc, __m256i u, __m256i s) {
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0xFF));
  const __m256i u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);
  const __m256i s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even),
                                                _mm256_madd_epi16(u_odd, s_odd)));
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GGUF_VNNI 1
#define GGUF_DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define GGUF_VNNI 1
#define GGUF_DPBUSD _mm256_dpbusd_avx_epi32
#endif
#endif

// The x8 kernels' tiles of 8 activation rows need 32 vector registers (the scalar code's
// tiles stay at kTileM).
#if defined(GGUF_AVX2) && defined(__AVX512VL__)
#define GGUF_WIDE_TILES 1
#endif

#include "gguf_super_x8.h"  // after the instruction-set macros it reads

#ifndef LLMSERVE_GGUF_NAMESPACE
#define LLMSERVE_GGUF_NAMESPACE llmserve
#endif

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;
constexpr int kTileM = 4;
// 16 rows: enough chunks to balance two threads on the smallest layer (576 rows), and a
// chunk's weights (16 x 960 B for K = 1536, Q4_1) stay in L1 while every M tile reads them.
constexpr int64_t kChunkN = 16;

template <int64_t KIND>
struct Layout;
template <>
struct Layout<kQ4_0> {
  static constexpr int64_t bytes = 18, codes = 2;
};
template <>
struct Layout<kQ4_1> {
  static constexpr int64_t bytes = 20, codes = 4;
};
template <>
struct Layout<kQ8_0> {
  static constexpr int64_t bytes = 34, codes = 2;
};

// The kinds with kernels of their own below (one scale per 32 values, offset folded per
// block); every other kind goes through gguf_formats.h's chunks.
constexpr bool is_block_kind(int64_t kind) {
  return kind == kQ4_0 || kind == kQ4_1 || kind == kQ8_0;
}

using gguf::half_at;

// w_j = d * q_j + o for the block at `block`.
template <int64_t KIND>
inline void block_scale(const uint8_t* block, float& d, float& o) {
  d = half_at(block);
  if constexpr (KIND == kQ4_1) {
    o = half_at(block + 2);
  } else if constexpr (KIND == kQ4_0) {
    o = -8.f * d;  // exact; d * q + (-8 d) then rounds to d * (q - 8), itself exact
  } else {
    o = 0.f;
  }
}

// The block's codes in value order: Q4 0..15, Q8_0 -128..127.
template <int64_t KIND>
inline void block_codes(const uint8_t* block, int32_t* q) {
  const uint8_t* bytes = block + Layout<KIND>::codes;
  if constexpr (KIND == kQ8_0) {
    for (int j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(bytes[j]);
  } else {
    for (int j = 0; j < kBlock / 2; ++j) {
      q[j] = bytes[j] & 0xF;
      q[j + kBlock / 2] = bytes[j] >> 4;
    }
  }
}

template <int64_t KIND>
inline void dequantize_block(const uint8_t* block, float* w) {
  float d, o;
  block_scale<KIND>(block, d, o);
  int32_t q[kBlock];
  block_codes<KIND>(block, q);
  for (int j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(q[j]) + o;
}

template <int64_t KIND>
void dequantize_row(const uint8_t* row, int64_t num_blocks, float* out) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    dequantize_block<KIND>(row + b * Layout<KIND>::bytes, out + b * kBlock);
  }
}

// ---- activations -> int8 blocks (fast path) -------------------------------------------

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  // bf16 is the top half of an fp32: a shift widens it (and vectorizes).
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* wide = reinterpret_cast<uint32_t*>(dst);  // built with -fno-strict-aliasing
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Activations {
  int64_t rows = 0, in_features = 0, num_blocks = 0;
  std::vector<int8_t> codes;  // [rows, K]
  std::vector<float> scale;   // [rows, K / 32]: s
  std::vector<float> sum;     // [rows, K / 32]: s * sum_j c_j
  // [rows, K / 32]: -z sum_j c_j for the zero points z = 8 (Q4_0), 16 (Q5_0) and 128 (Q8_0
  // and IQ4_NL, whose signed codes are offset by 128 with VNNI): an x8 tile's dot chain
  // starts there (a broadcast from memory, no vector operation to take it off afterwards).
  std::vector<int32_t> zero_point8, zero_point16, zero_point128;
  // [rows, K / 32, 2]: (s, f * s * sum_j c_j), f = 1 (Q4_1), -8 (Q4_0), 0 (Q8_0): one 8-byte
  // load gives a block's two activation factors to the small-M kernel.
  std::vector<float> pair;
  // [rows, K / 32, 8]: s * (the sum of codes 4i .. 4i + 3), the lanes of a 32-byte integer dot;
  // a chunk format's offsets (one per 16 values) multiply them.
  std::vector<float> sum4;
};

// Row m of x as fp32: x itself when it is fp32, else converted into `buffer`.
inline const float* float_row(const float* x, int64_t m, int64_t k, std::vector<float>&) {
  return x + m * k;
}
template <typename scalar_t>
const float* float_row(const scalar_t* x, int64_t m, int64_t k, std::vector<float>& buffer) {
  buffer.resize(k);
  to_float(x + m * k, buffer.data(), k);
  return buffer.data();
}

template <typename scalar_t>
Activations quantize_activations(const scalar_t* x, int64_t rows, int64_t k, float sum_factor) {
  Activations a;
  a.rows = rows;
  a.in_features = k;
  a.num_blocks = k / kBlock;
  a.codes.resize(rows * k);
  a.scale.resize(rows * a.num_blocks);
  a.sum.resize(rows * a.num_blocks);
  a.zero_point8.resize(rows * a.num_blocks);
  a.zero_point16.resize(rows * a.num_blocks);
  a.zero_point128.resize(rows * a.num_blocks);
  a.pair.resize(rows * a.num_blocks * 2);
  a.sum4.resize(rows * a.num_blocks * 8);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t m = begin; m < end; ++m) {
      const float* row = float_row(x, m, k, buffer);
      for (int64_t b = 0; b < a.num_blocks; ++b) {
        const int64_t at = m * a.num_blocks + b;
        int32_t quads[kBlock / 4];
        const auto [s, inverse] = activation_codes::quantize_block(
            row + b * kBlock, kBlock, a.codes.data() + m * k + b * kBlock, quads);
        int32_t total = 0;
        for (int i = 0; i < 8; ++i) {
          a.sum4[at * 8 + i] = s * static_cast<float>(quads[i]);
          total += quads[i];
        }
        a.scale[at] = s;
        a.sum[at] = s * static_cast<float>(total);
        a.zero_point8[at] = -8 * total;
        a.zero_point16[at] = -16 * total;
        a.zero_point128[at] = -128 * total;
        a.pair[at * 2] = s;
        a.pair[at * 2 + 1] = sum_factor * a.sum[at];
      }
    }
  });
  return a;
}

// ---- scalar kernels (the portable path, and the reference for the SIMD ones) ------------

// One weight row against `mr` activation rows: out[m * ldo] for m < mr.
template <int64_t KIND>
void exact_row_scalar(const float* x, int mr, int64_t k, const uint8_t* w_row, float* out,
                      int64_t ldo) {
  float acc[kTileM] = {};
  float w[kBlock];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    dequantize_block<KIND>(w_row + b * Layout<KIND>::bytes, w);
    for (int m = 0; m < mr; ++m) {
      const float* xb = x + m * k + b * kBlock;
      float partial = 0.f;
      for (int j = 0; j < kBlock; ++j) partial += w[j] * xb[j];
      acc[m] += partial;
    }
  }
  for (int m = 0; m < mr; ++m) out[m * ldo] = acc[m];
}

template <int64_t KIND>
void fast_row_scalar(const Activations& a, int64_t m0, int mr, const uint8_t* w_row,
                     float* out, int64_t ldo) {
  float acc[kTileM] = {}, offset[kTileM] = {};
  int32_t q[kBlock];
  const int64_t k = a.in_features, nb = a.num_blocks;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = w_row + b * Layout<KIND>::bytes;
    float d, o;
    block_scale<KIND>(block, d, o);
    block_codes<KIND>(block, q);
    for (int m = 0; m < mr; ++m) {
      const int8_t* c = a.codes.data() + (m0 + m) * k + b * kBlock;
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += q[j] * static_cast<int32_t>(c[j]);
      acc[m] += static_cast<float>(dot) * (d * a.scale[(m0 + m) * nb + b]);
      offset[m] = std::fma(o, a.sum[(m0 + m) * nb + b], offset[m]);
    }
  }
  for (int m = 0; m < mr; ++m) out[m * ldo] = acc[m] + offset[m];
}

// ---- AVX2 kernels ---------------------------------------------------------------------

#ifdef GGUF_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block's weights as 4 x 8 fp32, exactly as the file defines them.
template <int64_t KIND>
inline void dequantize_block_avx2(const uint8_t* block, __m256* v) {
  float d, o;
  block_scale<KIND>(block, d, o);
  const __m256 scale = _mm256_set1_ps(d);
  const uint8_t* bytes = block + Layout<KIND>::codes;
  if constexpr (KIND == kQ8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16));
    v[0] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
    v[1] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
    v[2] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
    v[3] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
  } else {
    const __m256 offset = _mm256_set1_ps(o);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m128i lo = _mm_and_si128(packed, mask);                      // q_0 .. q_15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);   // q_16 .. q_31
    v[0] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), offset);
    v[1] = _mm256_fmadd_ps(
        scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), offset);
    v[2] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), offset);
    v[3] = _mm256_fmadd_ps(
        scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), offset);
  }
}

// MR activation rows x NR weight rows. With few accumulators the FMA latency (4 cycles)
// would bound the loop, so small tiles keep two partial sums per output.
template <int64_t KIND, int MR, int NR>
void exact_tile_avx2(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes,
                     float* out, int64_t ldo) {
  constexpr int A = MR * NR >= 8 ? 1 : 2;
  __m256 acc[MR][NR][A];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < A; ++i) acc[m][r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    for (int r = 0; r < NR; ++r) {
      __m256 v[4];
      dequantize_block_avx2<KIND>(w + r * row_bytes + b * Layout<KIND>::bytes, v);
      for (int m = 0; m < MR; ++m) {
        const float* xb = x + m * k + b * kBlock;
        for (int i = 0; i < 4; ++i) {
          acc[m][r][i % A] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + 8 * i), acc[m][r][i % A]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      __m256 total = acc[m][r][0];
      if constexpr (A == 2) total = _mm256_add_ps(total, acc[m][r][1]);
      out[m * ldo + r] = hsum(total);
    }
  }
}

// MR activation rows x NR rows of an already dequantized fp32 panel (row stride k): the
// inner product of an fp32 GEMM, 8 independent FMA chains for the 4 x 2 tile.
template <int MR, int NR>
void panel_tile_avx2(const float* x, int64_t k, const float* w, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm256_loadu_ps(w + r * k + j);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * k + j);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = hsum(acc[m][r]);
}

// A weight block as the unsigned operand of the byte dot product (and, for Q8_0, the signed
// codes whose sign moves onto the activations).
struct Codes {
  __m256i u;
  __m256i s;
};

template <int64_t KIND>
inline Codes unpack_avx2(const uint8_t* block) {
  const uint8_t* bytes = block + Layout<KIND>::codes;
  if constexpr (KIND == kQ8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    return {_mm256_abs_epi8(q), q};
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed),
                                                 _mm_srli_epi16(packed, 4), 1);
    const __m256i q = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
    return {q, q};
  }
}

// 8 int32 lanes whose sum is sum_j q_j c_j.
template <int64_t KIND>
inline __m256i dot_avx2(const Codes& w, __m256i c) {
  const __m256i signed_c = KIND == kQ8_0 ? _mm256_sign_epi8(c, w.s) : c;
#ifdef GGUF_VNNI
  return GGUF_DPBUSD(_mm256_setzero_si256(), w.u, signed_c);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, signed_c), _mm256_set1_epi16(1));
#endif
}

// scratch: (2 NR + MR NR) * num_blocks floats.
template <int64_t KIND, int MR, int NR>
void fast_tile_avx2(const Activations& a, int64_t m0, const uint8_t* w, int64_t row_bytes,
                    float* out, int64_t ldo, float* scratch) {
  const int64_t k = a.in_features, nb = a.num_blocks;
  float* d = scratch;        // [NR][nb]
  float* o = d + NR * nb;    // [NR][nb]
  float* ds = o + NR * nb;   // [MR][NR][nb]: d * s, the scale of each block's integer dot
  for (int r = 0; r < NR; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      block_scale<KIND>(w + r * row_bytes + b * Layout<KIND>::bytes, d[r * nb + b],
                        o[r * nb + b]);
    }
  }
  float offset[MR][NR];
  for (int m = 0; m < MR; ++m) {
    const float* s = a.scale.data() + (m0 + m) * nb;
    const float* sums = a.sum.data() + (m0 + m) * nb;
    for (int r = 0; r < NR; ++r) {
      float* dsr = ds + (m * NR + r) * nb;
      const float* dr = d + r * nb;
      const float* orow = o + r * nb;
#pragma omp simd
      for (int64_t b = 0; b < nb; ++b) dsr[b] = dr[b] * s[b];
      // In block order and with one rounding per block, as fast_tile_small_avx2 adds it: a
      // row's result is then the same whichever tile height computed it. A vectorized
      // reduction would reorder the sum, and an unfused multiply-add is free to be contracted
      // in one kernel and not the other, so the fused form is spelled out in both.
      float total = 0.f;
      if constexpr (KIND != kQ8_0) {
        for (int64_t b = 0; b < nb; ++b) total = std::fma(orow[b], sums[b], total);
      }
      offset[m][r] = total;
    }
  }
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const int8_t* codes = a.codes.data() + m0 * k;
  for (int64_t b = 0; b < nb; ++b) {
    Codes wq[NR];
    for (int r = 0; r < NR; ++r) {
      wq[r] = unpack_avx2<KIND>(w + r * row_bytes + b * Layout<KIND>::bytes);
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i c =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + m * k + b * kBlock));
      for (int r = 0; r < NR; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(dot_avx2<KIND>(wq[r], c));
        acc[m][r] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(ds + (m * NR + r) * nb + b),
                                    acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = hsum(acc[m][r]) + offset[m][r];
}

// (d, d) for Q4_0, (d, m) for Q4_1, (d, 0) for Q8_0 in lanes 0 and 1: times a block's
// activation pair (s, f s sum c) it gives the dot's scale d s and the offset term o s sum c.
template <int64_t KIND>
inline __m128 block_factors(const uint8_t* block) {
  if constexpr (KIND == kQ4_1) {
    int32_t bits;
    std::memcpy(&bits, block, sizeof(bits));
    return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  } else {
    uint16_t half;
    std::memcpy(&half, block, sizeof(half));
    const uint32_t bits = KIND == kQ4_0 ? half * 0x10001u : half;
    return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(bits)));
  }
}

// The small-M tile (decode): scales folded in per block, so no per-tile set-up pass; it is
// what keeps M = 1 close to the cost of reading the blocks.
template <int64_t KIND, int MR, int NR>
void fast_tile_small_avx2(const Activations& a, int64_t m0, const uint8_t* w,
                          int64_t row_bytes, float* out, int64_t ldo) {
  const int64_t k = a.in_features, nb = a.num_blocks;
  __m256 acc[MR][NR];
  __m128 offset[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      acc[m][r] = _mm256_setzero_ps();
      offset[m][r] = _mm_setzero_ps();
    }
  }
  const int8_t* codes = a.codes.data() + m0 * k;
  const float* pairs = a.pair.data() + m0 * nb * 2;
  for (int64_t b = 0; b < nb; ++b) {
    Codes wq[NR];
    __m128 factors[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* block = w + r * row_bytes + b * Layout<KIND>::bytes;
      wq[r] = unpack_avx2<KIND>(block);
      factors[r] = block_factors<KIND>(block);
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i c =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + m * k + b * kBlock));
      const __m128 pair = _mm_castpd_ps(
          _mm_load_sd(reinterpret_cast<const double*>(pairs + (m * nb + b) * 2)));
      for (int r = 0; r < NR; ++r) {
        const __m128 scaled = _mm_mul_ps(factors[r], pair);  // (d s, o s sum c)
        // Fused, as fast_tile_avx2 adds its offsets (lane 1 is the one used).
        offset[m][r] = _mm_fmadd_ps(factors[r], pair, offset[m][r]);
        const __m256 dot = _mm256_cvtepi32_ps(dot_avx2<KIND>(wq[r], c));
        acc[m][r] = _mm256_fmadd_ps(dot, _mm256_broadcastss_ps(scaled), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      const __m128 o = offset[m][r];
      out[m * ldo + r] = hsum(acc[m][r]) + _mm_cvtss_f32(_mm_shuffle_ps(o, o, 1));
    }
  }
}

#endif  // GGUF_AVX2

// One row of blocks -> K exact fp32 values (the same values on every path: d * q is exact,
// so a fused multiply-add and a multiply then add round alike).
template <int64_t KIND>
void dequantize_row_fast(const uint8_t* row, int64_t num_blocks, float* out) {
#ifdef GGUF_AVX2
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m256 v[4];
    dequantize_block_avx2<KIND>(row + b * Layout<KIND>::bytes, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kBlock + 8 * i, v[i]);
  }
#else
  dequantize_row<KIND>(row, num_blocks, out);
#endif
}

// NR for an MR-row tile: enough independent accumulators, few enough registers (16 ymm).
constexpr int rows_per_tile(int mr) { return mr <= 2 ? 4 : 2; }

// Weight rows [n0, n1) against activation rows [m0, m0 + MR): out is [M, N] fp32.
template <int64_t KIND, int MR>
void exact_rows(const float* x, int64_t m0, int64_t k, const uint8_t* w, int64_t row_bytes,
                int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const float* xt = x + m0 * k;
  float* ot = out + m0 * ldo;
  int64_t n = n0;
#ifdef GGUF_AVX2
  constexpr int NR = rows_per_tile(MR);
  for (; n + NR <= n1; n += NR) {
    exact_tile_avx2<KIND, MR, NR>(xt, k, w + n * row_bytes, row_bytes, ot + n, ldo);
  }
  for (; n < n1; ++n) {
    exact_tile_avx2<KIND, MR, 1>(xt, k, w + n * row_bytes, row_bytes, ot + n, ldo);
  }
#else
  for (; n < n1; ++n) exact_row_scalar<KIND>(xt, MR, k, w + n * row_bytes, ot + n, ldo);
#endif
}

template <int64_t KIND, int MR>
void fast_rows(const Activations& a, int64_t m0, const uint8_t* w, int64_t row_bytes,
               int64_t n0, int64_t n1, float* out, int64_t ldo, float* scratch) {
  float* ot = out + m0 * ldo;
  int64_t n = n0;
#ifdef GGUF_AVX2
  if constexpr (MR <= 2) {
    // Registers: MR x NR ymm sums and as many xmm offsets, NR unpacked blocks.
    constexpr int NR = MR == 1 ? 4 : 2;
    for (; n + NR <= n1; n += NR) {
      fast_tile_small_avx2<KIND, MR, NR>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo);
    }
    for (; n < n1; ++n) {
      fast_tile_small_avx2<KIND, MR, 1>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo);
    }
  } else {
    constexpr int NR = rows_per_tile(MR);
    for (; n + NR <= n1; n += NR) {
      fast_tile_avx2<KIND, MR, NR>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo, scratch);
    }
    for (; n < n1; ++n) {
      fast_tile_avx2<KIND, MR, 1>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo, scratch);
    }
  }
#else
  (void)scratch;
  for (; n < n1; ++n) fast_row_scalar<KIND>(a, m0, MR, w + n * row_bytes, ot + n, ldo);
#endif
}

// ---- chunk formats (gguf_formats.h: Q5_0, Q5_1, K-quants, IQ4) ------------------------
// Each 32-value chunk of a weight row is 32 byte codes with a factor and an offset per 16
// values; against a row's int8 activation chunk (codes c, scale s):
//     sum_j w_j x_j ~= s (f_lo dot_lo + f_hi dot_hi) + (o_lo s sum_lo c + o_hi s sum_hi c)
// One integer dot gives 8 int32 lanes of 4 products each, lanes 0-3 the first 16 values, so
// the factors and offsets enter as lane vectors and the offsets meet Activations::sum4.

template <int64_t KIND>
void chunk_row_scalar(const Activations& a, int64_t m0, int mr, const uint8_t* w_row,
                      float* out, int64_t ldo) {
  using F = gguf::Format<KIND>;
  constexpr int kChunks = F::kValues / kBlock;
  const int64_t k = a.in_features, nb = a.num_blocks;
  float acc[kTileM] = {};
  int32_t q[kBlock];
  for (int64_t g = 0; g < k / F::kValues; ++g) {
    const uint8_t* group = w_row + g * F::kBytes;
    gguf::GroupScales sc;
    F::scales(group, sc);
    for (int c = 0; c < kChunks; ++c) {
      F::codes(group, c, q);
      const int64_t chunk = g * kChunks + c;
      for (int m = 0; m < mr; ++m) {
        const int8_t* codes = a.codes.data() + (m0 + m) * k + chunk * kBlock;
        const float s = a.scale[(m0 + m) * nb + chunk];
        for (int h = 0; h < 2; ++h) {
          int32_t dot = 0, sum = 0;
          for (int j = 16 * h; j < 16 * h + 16; ++j) {
            dot += q[j] * static_cast<int32_t>(codes[j]);
            sum += codes[j];
          }
          acc[m] += sc.factor[c] * s * static_cast<float>(dot) +
                    sc.offset[c] * s * static_cast<float>(sum);
        }
      }
    }
  }
  for (int m = 0; m < mr; ++m) out[m * ldo] = acc[m];
}

#ifdef GGUF_AVX2
// 8 int32 lanes, lane i the sum of q_j c_j over j in [4i, 4i + 4).
template <bool SIGNED>
inline __m256i chunk_dot(__m256i q, __m256i c) {
  const __m256i u = SIGNED ? _mm256_abs_epi8(q) : q;
  const __m256i signed_c = SIGNED ? _mm256_sign_epi8(c, q) : c;
#ifdef GGUF_VNNI
  return GGUF_DPBUSD(_mm256_setzero_si256(), u, signed_c);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, signed_c), _mm256_set1_epi16(1));
#endif
}

template <int64_t KIND, int MR, int NR>
void chunk_tile_avx2(const Activations& a, int64_t m0, const uint8_t* w, int64_t row_bytes,
                     float* out, int64_t ldo) {
  using F = gguf::Format<KIND>;
  constexpr int kChunks = F::kValues / kBlock;
  const int64_t k = a.in_features, nb = a.num_blocks;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / F::kValues; ++g) {
    gguf::GroupScales sc[NR];
    for (int r = 0; r < NR; ++r) F::scales(w + r * row_bytes + g * F::kBytes, sc[r]);
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = g * kChunks + c;
      __m256i q[NR];
      __m256 factor[NR], offset[NR];
      for (int r = 0; r < NR; ++r) {
        q[r] = F::codes_avx2(w + r * row_bytes + g * F::kBytes, c);
        factor[r] = _mm256_set1_ps(sc[r].factor[c]);
        if constexpr (!F::kSigned) offset[r] = _mm256_set1_ps(sc[r].offset[c]);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256i codes = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.codes.data() + (m0 + m) * k + chunk * kBlock));
        const __m256 s = _mm256_broadcast_ss(a.scale.data() + (m0 + m) * nb + chunk);
        __m256 sums = _mm256_setzero_ps();
        if constexpr (!F::kSigned) sums = _mm256_loadu_ps(a.sum4.data() + ((m0 + m) * nb + chunk) * 8);
        for (int r = 0; r < NR; ++r) {
          const __m256 dot = _mm256_cvtepi32_ps(chunk_dot<F::kSigned>(q[r], codes));
          acc[m][r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(factor[r], s), acc[m][r]);
          if constexpr (!F::kSigned) acc[m][r] = _mm256_fmadd_ps(offset[r], sums, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = hsum(acc[m][r]);
}
#endif  // GGUF_AVX2

template <int64_t KIND, int MR>
void chunk_rows(const Activations& a, int64_t m0, const uint8_t* w, int64_t row_bytes,
                int64_t n0, int64_t n1, float* out, int64_t ldo) {
  float* ot = out + m0 * ldo;
  int64_t n = n0;
#ifdef GGUF_AVX2
  constexpr int NR = MR <= 2 ? 4 : 2;
  for (; n + NR <= n1; n += NR) {
    chunk_tile_avx2<KIND, MR, NR>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo);
  }
  for (; n < n1; ++n) chunk_tile_avx2<KIND, MR, 1>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo);
#else
  for (; n < n1; ++n) chunk_row_scalar<KIND>(a, m0, MR, w + n * row_bytes, ot + n, ldo);
#endif
}


// ---- Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 repacked by 8 rows (the int8 path's layout) -------
// gguf_x8_layout.h regroups 8 rows so that one 32-byte load holds 4 code bytes of each row:
//     Q4_0  d[8] fp16 | 4 x [row 0 bytes 4i..4i+3 | row 1 ... | row 7]        16 + 128 bytes
//     Q5_1  d[8] | m[8] | qh[8] (32 bits each) | the same 4 x 32 bytes         64 + 128
// A 4-bit 32-byte vector's low nibbles are values 4i..4i+3 of each row and its high nibbles
// values 16 + 4i..; against the broadcast 4 activation codes of those values, one byte dot
// gives the 8 rows' partial sums in the 8 int32 lanes. Pair products are at most 2 x 15 x 127
// (Q4) or 2 x 31 x 127 (Q5), so 8 (Q4) or 4 (Q5) of them add up in int16 before one widening.
using gguf_x8::kGroupRows;
constexpr int64_t kRepackedX8 = 256;  // kind flag: the blocks are in the layout above

constexpr bool is_x8_kind(int64_t kind) { return gguf_x8::has_layout(kind); }
static_assert(gguf_x8::fields<kQ4_0>().bytes == Layout<kQ4_0>::bytes &&
                  gguf_x8::fields<kQ4_1>().bytes == Layout<kQ4_1>::bytes &&
                  gguf_x8::fields<kQ8_0>().bytes == Layout<kQ8_0>::bytes &&
                  gguf_x8::fields<gguf::kIQ4_NL>().bytes == gguf::Format<gguf::kIQ4_NL>::kBytes &&
                  gguf_x8::fields<gguf::kQ2_K>().bytes == gguf::Format<gguf::kQ2_K>::kBytes &&
                  gguf_x8::fields<gguf::kQ3_K>().bytes == gguf::Format<gguf::kQ3_K>::kBytes &&
                  gguf_x8::fields<gguf::kQ4_K>().bytes == gguf::Format<gguf::kQ4_K>::kBytes &&
                  gguf_x8::fields<gguf::kQ5_K>().bytes == gguf::Format<gguf::kQ5_K>::kBytes &&
                  gguf_x8::fields<gguf::kQ6_K>().bytes == gguf::Format<gguf::kQ6_K>::kBytes,
              "the 8-row layouts and the block formats must agree on a block's size");

template <int64_t KIND>
constexpr int64_t x8_block_bytes() {
  return gguf_x8::fields<KIND>().bytes;
}

constexpr bool has_min(int64_t kind) { return kind == kQ4_1 || kind == gguf::kQ5_1; }
constexpr bool has_high_bits(int64_t kind) { return kind == gguf::kQ5_0 || kind == gguf::kQ5_1; }

// Where the codes start in one block of the group (after the qh word of Q5).
template <int64_t KIND>
constexpr int64_t x8_header() {
  return gguf_x8::word_at<KIND>(has_high_bits(KIND) ? 1 : 0);
}

template <int64_t KIND>
constexpr int64_t x8_high_bits_at() {
  return gguf_x8::word_at<KIND>(0);
}

// The result of one 8-row group against activation rows [m0, m0 + MR): out[m * ldo + r].
template <int64_t KIND, int MR>
void x8_tile_scalar(const Activations& a, int64_t m0, const uint8_t* group, int64_t row_bytes,
                    float* out, int64_t ldo) {
  std::vector<uint8_t> row(row_bytes);
  for (int r = 0; r < kGroupRows; ++r) {
    // The unpacked row through the scalar kernel of its kind: the same arithmetic.
    gguf_x8::unpack_row<KIND>(group, r, row_bytes, row.data());
    if constexpr (is_block_kind(KIND)) {
      fast_row_scalar<KIND>(a, m0, MR, row.data(), out + r, ldo);
    } else {
      chunk_row_scalar<KIND>(a, m0, MR, row.data(), out + r, ldo);
    }
  }
}

#ifdef GGUF_AVX2
// Bytes 4i' .. 4i' + 3 of each lane: 16 where bit j of the lane's (high_bits >> shift) is set,
// j = 0..3 (the 5th bit of 4 codes of one row).
template <typename V>
inline typename V::I fifth_bits(typename V::I high_bits, int shift) {
  using I = typename V::I;
  const I shifted = V::srl32(high_bits, _mm_cvtsi32_si128(shift));
  const I low_byte = V::lanes16(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  const I bit = V::set1_32(0x08040201);
  const I spread = V::and_(V::shuffle8(shifted, low_byte), bit);
  return V::where_eq8(spread, bit, V::set1_8(16));
}

// The V::kRows rows from `group` on (one 8-row group, or two adjacent ones in a 512-bit
// vector: gguf_vec.h) against activation rows [m0, m0 + MR).
template <typename V, int64_t KIND, int MR>
void x8_tile(const Activations& a, int64_t m0, const uint8_t* group, int64_t row_bytes,
             float* out, int64_t ldo) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t bytes = x8_block_bytes<KIND>(), header = x8_header<KIND>();
  // int16 pair sums per widening: 8 of Q4's, 4 of Q5's (see above).
  constexpr int kPairsPerWidening = has_high_bits(KIND) ? 4 : 8;
  const int64_t stride = kGroupRows * row_bytes;  // to the next group (V16's upper lanes)
  const int64_t k = a.in_features, nb = a.num_blocks;
  const I ones = V::set1_16(1);
  const I low_nibble = V::set1_8(0x0F);
  F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kGroupRows * bytes;
    const uint8_t* q = block + header;
    // The next groups' block, one tile ahead of use.
    // Measured, 2 threads, weights from memory, M = 1: Q4_1 50 -> 41 us, Q5_0 37 -> 30.
    gguf_x8::prefetch_next_groups<V>(block, row_bytes, bytes);
    const int8_t* c[MR];
    for (int m = 0; m < MR; ++m) c[m] = a.codes.data() + (m0 + m) * k + b * kBlock;
    // Each row's dot chain starts at its zero point's term, -z sum c (d s (sum q c - z sum c)
    // in integers, exact), or at 0.
    const int32_t* zero_point = nullptr;
    if constexpr (KIND == kQ4_0) zero_point = a.zero_point8.data();
    if constexpr (KIND == gguf::kQ5_0) zero_point = a.zero_point16.data();
#ifdef GGUF_VNNI
    if constexpr (KIND == kQ8_0 || KIND == gguf::kIQ4_NL) zero_point = a.zero_point128.data();
#endif
    I dot[MR];
    for (int m = 0; m < MR; ++m) {
      dot[m] = zero_point == nullptr
                   ? V::zero()
                   : V::broadcast4(reinterpret_cast<const int8_t*>(
                         zero_point + (m0 + m) * nb + b));
    }
    if constexpr (KIND == gguf::kIQ4_NL) {
      // Each nibble indexes the 16 signed levels (one vpshufb), then the signed weights go
      // as Q8_0's do.
      const I levels = V::lanes16(
          _mm_load_si128(reinterpret_cast<const __m128i*>(gguf::kIQ4Levels)));
      for (int i = 0; i < 4; ++i) {
        const I v = V::load(q + 32 * i, stride);
        const I w_lo = V::shuffle8(levels, V::and_(v, low_nibble));
        const I w_hi = V::shuffle8(levels, V::and_(V::template srli16<4>(v), low_nibble));
#ifdef GGUF_VNNI
        const I flip = V::set1_8(static_cast<char>(0x80));
        const I u_lo = V::xor_(w_lo, flip), u_hi = V::xor_(w_hi, flip);
        for (int m = 0; m < MR; ++m) {
          dot[m] = V::dpbusd(dot[m], u_lo, c[m] + 4 * i);
          dot[m] = V::dpbusd(dot[m], u_hi, c[m] + 16 + 4 * i);
        }
#else
        const I u_lo = V::abs8(w_lo), u_hi = V::abs8(w_hi);
        for (int m = 0; m < MR; ++m) {
          const I c_lo = V::sign8(V::broadcast4(c[m] + 4 * i), w_lo);
          const I c_hi = V::sign8(V::broadcast4(c[m] + 16 + 4 * i), w_hi);
          // Widened apart: two pair sums of up to 2 x 127 x 127 would pass int16.
          dot[m] = V::add32(dot[m], V::add32(V::madd16(V::maddubs(u_lo, c_lo), ones),
                                             V::madd16(V::maddubs(u_hi, c_hi), ones)));
        }
#endif
      }
    } else if constexpr (KIND == kQ8_0) {
      for (int i = 0; i < 8; ++i) {
        const I v = V::load(q + 32 * i, stride);
#ifdef GGUF_VNNI
        // q + 128 as the unsigned operand (vpdpbusd does not saturate), the chain started at
        // -128 sum c: one shared xor where |q| and c's sign took one operation per row.
        const I u = V::xor_(v, V::set1_8(static_cast<char>(0x80)));
        for (int m = 0; m < MR; ++m) dot[m] = V::dpbusd(dot[m], u, c[m] + 4 * i);
#else
        const I u = V::abs8(v);
        for (int m = 0; m < MR; ++m) {
          const I signed_c = V::sign8(V::broadcast4(c[m] + 4 * i), v);
          dot[m] = V::add32(dot[m], V::madd16(V::maddubs(u, signed_c), ones));
        }
#endif
      }
    } else {
      I high_bits = V::zero();
      if constexpr (has_high_bits(KIND)) high_bits = V::load(block + x8_high_bits_at<KIND>(), stride);
      I pairs[MR];
      for (int m = 0; m < MR; ++m) pairs[m] = V::zero();
      for (int i = 0; i < 4; ++i) {
        const I v = V::load(q + 32 * i, stride);
        I lo = V::and_(v, low_nibble);
        I hi = V::and_(V::template srli16<4>(v), low_nibble);
        if constexpr (has_high_bits(KIND)) {
          lo = V::or_(lo, fifth_bits<V>(high_bits, 4 * i));
          hi = V::or_(hi, fifth_bits<V>(high_bits, 16 + 4 * i));
        }
        for (int m = 0; m < MR; ++m) {
#ifdef GGUF_VNNI
          dot[m] = V::dpbusd(dot[m], lo, c[m] + 4 * i);
          dot[m] = V::dpbusd(dot[m], hi, c[m] + 16 + 4 * i);
#else
          pairs[m] = V::add16(pairs[m], V::maddubs(lo, V::broadcast4(c[m] + 4 * i)));
          pairs[m] = V::add16(pairs[m], V::maddubs(hi, V::broadcast4(c[m] + 16 + 4 * i)));
          if ((2 * i + 2) % kPairsPerWidening == 0) {
            dot[m] = V::add32(dot[m], V::madd16(pairs[m], ones));
            pairs[m] = V::zero();
          }
#endif
        }
      }
    }
    const F d = V::halves(block, stride);
    for (int m = 0; m < MR; ++m) {
      const int64_t ab = (m0 + m) * nb + b;
      const F ds = V::mul(d, V::set1_ps(a.scale[ab]));
      acc[m] = V::fmadd(V::cvt(dot[m]), ds, acc[m]);
      if constexpr (has_min(KIND)) {
        acc[m] = V::fmadd(V::halves(block + 16, stride), V::set1_ps(a.sum[ab]), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) V::store(out + m * ldo, acc[m]);
}
#endif  // GGUF_AVX2

// Activation rows per pass over the weights: a prefill chunk's int8 codes of K = 8192 are
// 2 MB at 256 rows, past a core's L2; in blocks of this many bytes they stay in it while
// every weight group streams past (the weights are read once per block: 1 of 128+ rows'
// worth of work). A row's arithmetic is the same in any block.
constexpr int64_t kActivationBlockBytes = 512 * 1024;

inline int64_t activation_block_rows(int64_t k, int tile) {
  return std::max<int64_t>(tile, kActivationBlockBytes / k / tile * tile);
}

// Activation rows per x8 tile (every x8 kind, K-quants too): each unpacked code vector serves
// this many rows, which pays for the unpacking (Q6_K's six bits take four vector operations
// per 32 bytes). 8 where 32 vector registers hold their accumulators (AVX-512VL), else 4.
#if defined(GGUF_WIDE_TILES)
constexpr int kX8TileM = 8;
#else
constexpr int kX8TileM = 4;
#endif

// Calls tile(m0, mr, g, count) for every tile of up to `tile_m` activation rows and every
// unit of `unit_groups` 8-row groups (count: the unit's groups, fewer in the last unit):
// units over the threads, activation rows in blocks of kActivationBlockBytes of codes.
template <typename Tile>
void over_x8_tiles(int64_t rows, int64_t k, int64_t n_total, int tile_m, int unit_groups,
                   const Tile& tile) {
  const int64_t groups = n_total / kGroupRows;
  const int64_t units = (groups + unit_groups - 1) / unit_groups;
  const int64_t m_block = activation_block_rows(k, tile_m);
  for (int64_t m_begin = 0; m_begin < rows; m_begin += m_block) {
    const int64_t m_end = std::min(rows, m_begin + m_block);
    const int64_t grain = std::max<int64_t>(1, kChunkN / kGroupRows / unit_groups);
    at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t g = u * unit_groups;
        const int count = static_cast<int>(std::min<int64_t>(unit_groups, groups - g));
        for (int64_t m0 = m_begin; m0 < m_end; m0 += tile_m) {
          tile(m0, static_cast<int>(std::min<int64_t>(tile_m, m_end - m0)), g, count);
        }
      }
    });
  }
}

// 8-row groups per unit of the x8 tiles: two in a 512-bit vector where the build has them
// (gguf_vec.h), else one.
#if defined(GGUF_V16)
constexpr int kX8UnitGroups = 2;
#else
constexpr int kX8UnitGroups = 1;
#endif

// Activation rows from which a unit of two groups takes one 512-bit tile instead of two
// 256-bit ones (the same arithmetic per row either way, so the choice never changes a
// result). A 512-bit vector of words is two loads and an insert; the kinds that load a
// vector per word (Q8_0's bytes, Q6_K's and Q3_K's two planes, Q2_K's 2-bit codes) pay
// more for that than a tile of few rows wins. `bench gemm-tiles`, gate|up, 2 threads, GOPS
// of 256-bit / 512-bit tiles: M = 1: Q4_K 344 / 453, Q4_0 373 / 448, Q6_K 183 / 107, Q8_0
// 305 / 132; M = 4: Q4_K 646 / 1036, Q6_K 396 / 330, Q8_0 596 / 360; M = 8: equal or better.
// Those are weights in the caches. A decode step of one or two sequences reads them from
// memory, where Q4_K's 256-bit tiles win: each walks one 8-row group from end to end, one
// stream per thread, where a 512-bit tile walks two groups side by side (`bench gemm-tiles
// --from-memory`, ms of 512-bit / 256-bit tiles, the builds alternated 3 times: M = 1 q|k|v
// 0.100 / 0.091, gate|up 0.484 / 0.440, down 0.248 / 0.239; M = 2 0.103 / 0.092, 0.489 /
// 0.435, 0.262 / 0.251; M = 3 about equal, gate|up 0.52 / 0.53).
template <int64_t KIND>
constexpr int v16_min_rows() {
  const bool vector_per_word = KIND == kQ8_0 || KIND == gguf::kQ6_K ||
                               KIND == gguf::kQ3_K || KIND == gguf::kQ2_K;
  return vector_per_word ? 8 : KIND == gguf::kQ4_K ? 3 : 1;
}

#ifdef GGUF_AVX2
// tile(V, group) over a unit of `count` groups from `group`: one 512-bit tile where it pays.
template <int64_t KIND, int MR, typename Tile>
void over_unit(int count, const uint8_t* group, int64_t row_bytes, float* out, const Tile& tile) {
#ifdef GGUF_V16
  if (count == 2 && MR >= v16_min_rows<KIND>()) {
    tile(gguf_x8::V16{}, group, out);
    return;
  }
#endif
  for (int u = 0; u < count; ++u) {
    tile(gguf_x8::V8{}, group + u * kGroupRows * row_bytes, out + u * kGroupRows);
  }
}
#endif

// fn(std::integral_constant<int, MR>{}) for a tile of `mr` rows (1 .. the build's tile height).
template <typename Fn>
void with_tile_rows(int mr, const Fn& fn) {
  switch (mr) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
#if defined(GGUF_WIDE_TILES)
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
#else
    default: fn(std::integral_constant<int, 4>{}); break;
#endif
  }
}

template <int64_t KIND>
void x8_linear(const Activations& a, const uint8_t* w, int64_t row_bytes, int64_t n_total,
               float* out, int64_t ldo) {
  over_x8_tiles(a.rows, a.in_features, n_total, kX8TileM, kX8UnitGroups,
                [&](int64_t m0, int mr, int64_t g, int count) {
    const uint8_t* group = w + g * kGroupRows * row_bytes;
    float* o = out + m0 * ldo + g * kGroupRows;
    with_tile_rows(mr, [&](auto rows) {
      constexpr int MR = decltype(rows)::value;
#ifdef GGUF_AVX2
      over_unit<KIND, MR>(count, group, row_bytes, o, [&](auto width, const uint8_t* at, float* to) {
        x8_tile<decltype(width), KIND, MR>(a, m0, at, row_bytes, to, ldo);
      });
#else
      x8_tile_scalar<KIND, MR>(a, m0, group, row_bytes, o, ldo);
#endif
    });
  });
}

// Chunks of output rows over the threads; M in tiles of kTileM inside each chunk.
template <typename Tile>
void over_tiles(int64_t m_total, int64_t n_total, const Tile& tile) {
  const int64_t num_chunks = (n_total + kChunkN - 1) / kChunkN;
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n0 = chunk * kChunkN, n1 = std::min(n_total, n0 + kChunkN);
      for (int64_t m0 = 0; m0 < m_total; m0 += kTileM) {
        tile(m0, static_cast<int>(std::min<int64_t>(kTileM, m_total - m0)), n0, n1);
      }
    }
  });
}

// Rows [n0, n1) of an fp32 panel (row r at panel + (r - n0) * k) against every activation row.
template <int MR>
void panel_rows(const float* x, int64_t m0, int64_t k, const float* panel, int64_t n0,
                int64_t n1, float* out, int64_t ldo) {
  const float* xt = x + m0 * k;
  float* ot = out + m0 * ldo;
  int64_t n = n0;
#ifdef GGUF_AVX2
  for (; n + 2 <= n1; n += 2) panel_tile_avx2<MR, 2>(xt, k, panel + (n - n0) * k, ot + n, ldo);
  for (; n < n1; ++n) panel_tile_avx2<MR, 1>(xt, k, panel + (n - n0) * k, ot + n, ldo);
#else
  for (; n < n1; ++n) {
    const float* wr = panel + (n - n0) * k;
    for (int m = 0; m < MR; ++m) {
      float total = 0.f;
      for (int64_t j = 0; j < k; ++j) total += xt[m * k + j] * wr[j];
      ot[m * ldo + n] = total;
    }
  }
#endif
}


// ---- K-quants against activations quantized per 256 values (llama.cpp's Q8_K) -----------
// Each super-block is two integer dots (gguf_formats.h SuperScales): the sub-block scales
// weight the codes' pair sums inside vpmaddwd, and the mins or zero points meet the
// activations' 16-value code sums. One float multiply-add per super-block and row remains.

struct SuperActivations {
  int64_t rows = 0, in_features = 0, num_supers = 0;
  std::vector<int8_t> codes;   // [rows, K]
  std::vector<float> scale;    // [rows, K / 256]
  std::vector<int16_t> bsum;   // [rows, K / 16]: sum of each 16 codes
  std::vector<int16_t> bsum32; // [rows, K / 32]: sum of each 32 codes
  // [rows, K / 16]: bsum in the order 0 2 1 3 4 6 5 7 ..., so that each int32 is the pair
  // of 16-value sums a Q6_K x8 kernel's vpmaddwd takes (gguf_super_x8.h).
  std::vector<int16_t> bsum_q6;
  // [rows, K / 16]: -32 times the sum of each 16 codes, the start of a Q6_K sub-block's dot
  // chain with VNNI (the zero point taken off in the chain; gguf_super_x8.h).
  std::vector<int32_t> q6_zero_point;
};

template <typename scalar_t>
SuperActivations quantize_super_activations(const scalar_t* x, int64_t rows, int64_t k) {
  constexpr int64_t kSuper = 256;
  SuperActivations a;
  a.rows = rows;
  a.in_features = k;
  a.num_supers = k / kSuper;
  a.codes.resize(rows * k);
  a.scale.resize(rows * a.num_supers);
  a.bsum.resize(rows * k / 16);
  a.bsum32.resize(rows * k / 32);
  a.bsum_q6.resize(rows * k / 16);
  a.q6_zero_point.resize(rows * k / 16);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t m = begin; m < end; ++m) {
      const float* row = float_row(x, m, k, buffer);
      for (int64_t g = 0; g < a.num_supers; ++g) {
        int32_t quads[kSuper / 4];
        const int64_t at = m * k + g * kSuper;
        a.scale[m * a.num_supers + g] = activation_codes::quantize_block(
            row + g * kSuper, kSuper, a.codes.data() + at, quads).scale;
        int16_t* sums = a.bsum.data() + at / 16;
        for (int h = 0; h < 16; ++h) {
          sums[h] = static_cast<int16_t>(quads[4 * h] + quads[4 * h + 1] + quads[4 * h + 2] +
                                         quads[4 * h + 3]);
        }
        for (int h = 0; h < 8; ++h) {
          a.bsum32[at / 32 + h] = static_cast<int16_t>(sums[2 * h] + sums[2 * h + 1]);
        }
        constexpr int kPairOrder[4] = {0, 2, 1, 3};
        for (int h = 0; h < 16; ++h) {
          a.bsum_q6[at / 16 + h] = sums[4 * (h / 4) + kPairOrder[h % 4]];
          a.q6_zero_point[at / 16 + h] = -32 * sums[h];
        }
      }
    }
  });
  return a;
}

template <int64_t KIND>
void super_row_scalar(const SuperActivations& a, int64_t m0, int mr, const uint8_t* w_row,
                      float* out, int64_t ldo) {
  using F = gguf::Format<KIND>;
  const int64_t k = a.in_features;
  float acc[kTileM] = {};
  int32_t q[kBlock];
  for (int64_t g = 0; g < a.num_supers; ++g) {
    const uint8_t* group = w_row + g * F::kBytes;
    gguf::SuperScales sc;
    F::super_scales(group, sc);
    int32_t dot[kTileM] = {}, corr[kTileM] = {};
    for (int c = 0; c < 8; ++c) {
      F::codes(group, c, q);
      for (int m = 0; m < mr; ++m) {
        const int8_t* codes = a.codes.data() + (m0 + m) * k + g * 256 + c * kBlock;
        for (int h = 0; h < 2; ++h) {
          int32_t partial = 0;
          for (int j = 16 * h; j < 16 * h + 16; ++j) partial += q[j] * codes[j];
          dot[m] += sc.scale[2 * c + h] * partial;
        }
      }
    }
    for (int m = 0; m < mr; ++m) {
      const int16_t* bsum = a.bsum.data() + ((m0 + m) * k + g * 256) / 16;
      for (int h = 0; h < 16; ++h) corr[m] += sc.correction[h] * bsum[h];
      const float s = a.scale[(m0 + m) * a.num_supers + g];
      acc[m] += s * (sc.d * static_cast<float>(dot[m]) - sc.dcorr * static_cast<float>(corr[m]));
    }
  }
  for (int m = 0; m < mr; ++m) out[m * ldo] = acc[m];
}

#ifdef GGUF_AVX2
// vpshufb controls that give chunk c's two sub-block scales from a vector whose 128-bit lanes
// both hold four chunks' scales (int16 h at word h % 8): word 2 (c % 4) into int16 lanes 0-7,
// word 2 (c % 4) + 1 into lanes 8-15. One in-lane shuffle per chunk and row, where a
// cross-lane permute and a shuffle took two (the shuffle port was the loop's bound).
inline __m256i chunk_scale_control(int c) {
  const char low = static_cast<char>(4 * (c % 4)), high = static_cast<char>(4 * (c % 4) + 2);
  return _mm256_setr_epi8(low, low + 1, low, low + 1, low, low + 1, low, low + 1, low, low + 1,
                          low, low + 1, low, low + 1, low, low + 1, high, high + 1, high,
                          high + 1, high, high + 1, high, high + 1, high, high + 1, high,
                          high + 1, high, high + 1, high, high + 1);
}

template <int64_t KIND, int MR, int NR>
void super_tile_avx2(const SuperActivations& a, int64_t m0, const uint8_t* w, int64_t row_bytes,
                     float* out, int64_t ldo) {
  using F = gguf::Format<KIND>;
  const int64_t k = a.in_features;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.num_supers; ++g) {
    gguf::SuperVectors sc[NR];
    for (int r = 0; r < NR; ++r) sc[r] = F::super_vectors(w + r * row_bytes + g * F::kBytes);
    // The next tile's rows, one super-block ahead of use: short rows (K = 1536 is 6 Q4_K
    // super-blocks) end the hardware prefetcher's streams before they pay off. Measured, 2
    // threads, Q4_K 576 x 1536 from memory, M = 1: 91 -> 56 us (in cache: 60).
    for (int r = 0; r < NR; ++r) {
      const char* next = reinterpret_cast<const char*>(w + (r + NR) * row_bytes + g * F::kBytes);
      for (int64_t line = 0; line < F::kBytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    }
    __m256i dot[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) dot[m][r] = _mm256_setzero_si256();
    const int8_t* codes_at = a.codes.data() + m0 * k + g * 256;
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      // Sub-blocks 8 half .. 8 half + 7 in both 128-bit lanes.
      __m256i scales[NR];
      for (int r = 0; r < NR; ++r) {
        scales[r] = half == 0 ? _mm256_permute2x128_si256(sc[r].scale, sc[r].scale, 0x00)
                              : _mm256_permute2x128_si256(sc[r].scale, sc[r].scale, 0x11);
      }
#pragma GCC unroll 4
      for (int c = 4 * half; c < 4 * half + 4; ++c) {
        const __m256i control = chunk_scale_control(c);
        for (int r = 0; r < NR; ++r) {
          const __m256i q = F::codes_avx2(w + r * row_bytes + g * F::kBytes, c);
          // int16 lanes 0-7 pair the chunk's first 16 values (scale 2c), 8-15 its second 16.
          const __m256i scale = _mm256_shuffle_epi8(scales[r], control);
          const __m256i u = F::kSigned ? _mm256_abs_epi8(q) : q;
          for (int m = 0; m < MR; ++m) {
            __m256i codes = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(codes_at + m * k + c * kBlock));
            if constexpr (F::kSigned) codes = _mm256_sign_epi8(codes, q);
            const __m256i pairs = _mm256_maddubs_epi16(u, codes);
            dot[m][r] = _mm256_add_epi32(dot[m][r], _mm256_madd_epi16(pairs, scale));
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      for (int m = 0; m < MR; ++m) {
        const float s = a.scale[(m0 + m) * a.num_supers + g];
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][r]), _mm256_set1_ps(s * sc[r].d),
                                    acc[m][r]);
        if (sc[r].dcorr != 0.f) {
          const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              a.bsum.data() + ((m0 + m) * k + g * 256) / 16));
          const __m256 corr = _mm256_cvtepi32_ps(_mm256_madd_epi16(sc[r].correction, bsum));
          acc[m][r] = _mm256_fnmadd_ps(corr, _mm256_set1_ps(s * sc[r].dcorr), acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = hsum(acc[m][r]);
}
#endif  // GGUF_AVX2

template <int64_t KIND, int MR>
void super_rows(const SuperActivations& a, int64_t m0, const uint8_t* w, int64_t row_bytes,
                int64_t n0, int64_t n1, float* out, int64_t ldo) {
  float* ot = out + m0 * ldo;
  int64_t n = n0;
#ifdef GGUF_AVX2
  constexpr int NR = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  for (; n + NR <= n1; n += NR) {
    super_tile_avx2<KIND, MR, NR>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo);
  }
  for (; n < n1; ++n) super_tile_avx2<KIND, MR, 1>(a, m0, w + n * row_bytes, row_bytes, ot + n, ldo);
#else
  for (; n < n1; ++n) super_row_scalar<KIND>(a, m0, MR, w + n * row_bytes, ot + n, ldo);
#endif
}

template <int64_t KIND>
void super_linear(const SuperActivations& a, const uint8_t* w, int64_t row_bytes,
                  int64_t n_total, float* out, int64_t ldo) {
  over_tiles(a.rows, n_total, [&](int64_t m0, int mr, int64_t n0, int64_t n1) {
    switch (mr) {
      case 1: super_rows<KIND, 1>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
      case 2: super_rows<KIND, 2>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
      case 3: super_rows<KIND, 3>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
      default: super_rows<KIND, 4>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
    }
  });
}

// K-quants regrouped by 8 rows (gguf_super_x8.h): one path at every M.
template <int64_t KIND>
void super_x8_linear(const SuperActivations& a, const uint8_t* w, int64_t row_bytes,
                     int64_t n_total, float* out, int64_t ldo) {
  over_x8_tiles(a.rows, a.in_features, n_total, kX8TileM, kX8UnitGroups,
                [&](int64_t m0, int mr, int64_t g, int count) {
    const uint8_t* group = w + g * kGroupRows * row_bytes;
    float* o = out + m0 * ldo + g * kGroupRows;
#ifdef GGUF_AVX2
    with_tile_rows(mr, [&](auto rows) {
      constexpr int MR = decltype(rows)::value;
      over_unit<KIND, MR>(count, group, row_bytes, o, [&](auto width, const uint8_t* at, float* to) {
        gguf_x8::super_x8_tile<KIND, MR, decltype(width)>(a, m0, at, row_bytes, to, ldo);
      });
    });
#else
    // The unpacked row through the scalar kernel of its kind: the same arithmetic.
    thread_local std::vector<uint8_t> row;
    row.resize(row_bytes);
    for (int r = 0; r < kGroupRows; ++r) {
      gguf_x8::unpack_row<KIND>(group, r, row_bytes, row.data());
      super_row_scalar<KIND>(a, m0, mr, row.data(), o + r, ldo);
    }
#endif
  });
}

// From this many activation rows, a chunk of weight rows is dequantized once into an fp32
// panel (L1/L2 resident) that every row tile reads, instead of each tile of 4 unpacking the
// blocks again. Measured on gate|up (576 x 3072), one thread, AVX2: M = 64 5.1 -> 3.9 ms.
constexpr int64_t kPanelMinRows = 8;
// bf16/fp16 Q4 layers take the fp32 panel path from this many rows: measured against the
// int8 blocks, one thread, AVX2 without VNNI (ms, panel vs int8), M = 16: q|k|v 0.35 / 0.45,
// gate|up 1.12 / 1.40, down 0.55 / 0.52; M = 32: 0.64 / 0.88, 2.66 / 2.82, 1.00 / 1.03.
// Q8_0 keeps the int8 path (lm_head, M = 32: 34.5 int8 vs 44.0 panel).
constexpr int64_t kHalfPanelMinRows = 16;

// One row of any kind -> K exact fp32 values.
template <int64_t KIND>
void dequantize_any_row(const uint8_t* row, int64_t k, float* out) {
  if constexpr (is_block_kind(KIND)) {
    dequantize_row_fast<KIND>(row, k / kBlock, out);
  } else {
    using F = gguf::Format<KIND>;
    for (int64_t g = 0; g < k / F::kValues; ++g) {
      F::dequantize(row + g * F::kBytes, out + g * F::kValues);
    }
  }
}

template <int64_t KIND>
void exact_linear_panel(const float* x, int64_t m_total, int64_t k, const uint8_t* w,
                        int64_t row_bytes, int64_t n_total, float* out, int64_t ldo) {
  const int64_t num_chunks = (n_total + kChunkN - 1) / kChunkN;
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kChunkN * k);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n0 = chunk * kChunkN, n1 = std::min(n_total, n0 + kChunkN);
      for (int64_t n = n0; n < n1; ++n) {
        dequantize_any_row<KIND>(w + n * row_bytes, k, panel.data() + (n - n0) * k);
      }
      for (int64_t m0 = 0; m0 < m_total; m0 += kTileM) {
        const float* p = panel.data();
        switch (std::min<int64_t>(kTileM, m_total - m0)) {
          case 1: panel_rows<1>(x, m0, k, p, n0, n1, out, ldo); break;
          case 2: panel_rows<2>(x, m0, k, p, n0, n1, out, ldo); break;
          case 3: panel_rows<3>(x, m0, k, p, n0, n1, out, ldo); break;
          default: panel_rows<4>(x, m0, k, p, n0, n1, out, ldo); break;
        }
      }
    }
  });
}

template <int64_t KIND>
void exact_linear(const float* x, int64_t m_total, int64_t k, const uint8_t* w,
                  int64_t row_bytes, int64_t n_total, float* out, int64_t ldo,
                  bool batch_invariant) {
  // The panel tiles sum every (row, weight row) pair in one chain whatever the tile shape, so
  // batch-invariant calls take them at every M. The chunk formats always do: exact fp32 is
  // their parity mode, not their fast one.
  if (m_total >= kPanelMinRows || batch_invariant || !is_block_kind(KIND)) {
    exact_linear_panel<KIND>(x, m_total, k, w, row_bytes, n_total, out, ldo);
    return;
  }
  if constexpr (is_block_kind(KIND)) {
    over_tiles(m_total, n_total, [&](int64_t m0, int mr, int64_t n0, int64_t n1) {
      switch (mr) {
        case 1: exact_rows<KIND, 1>(x, m0, k, w, row_bytes, n0, n1, out, ldo); break;
        case 2: exact_rows<KIND, 2>(x, m0, k, w, row_bytes, n0, n1, out, ldo); break;
        case 3: exact_rows<KIND, 3>(x, m0, k, w, row_bytes, n0, n1, out, ldo); break;
        default: exact_rows<KIND, 4>(x, m0, k, w, row_bytes, n0, n1, out, ldo); break;
      }
    });
  }
}

template <int64_t KIND>
void fast_linear(const Activations& a, const uint8_t* w, int64_t row_bytes, int64_t n_total,
                 float* out, int64_t ldo) {
  const int64_t num_chunks = (n_total + kChunkN - 1) / kChunkN;
  const int64_t scratch_size = (2 * 4 + kTileM * 4) * a.num_blocks;
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(is_block_kind(KIND) ? scratch_size : 0);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n0 = chunk * kChunkN, n1 = std::min(n_total, n0 + kChunkN);
      for (int64_t m0 = 0; m0 < a.rows; m0 += kTileM) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileM, a.rows - m0));
        if constexpr (is_block_kind(KIND)) {
          float* s = scratch.data();
          switch (rows) {
            case 1: fast_rows<KIND, 1>(a, m0, w, row_bytes, n0, n1, out, ldo, s); break;
            case 2: fast_rows<KIND, 2>(a, m0, w, row_bytes, n0, n1, out, ldo, s); break;
            case 3: fast_rows<KIND, 3>(a, m0, w, row_bytes, n0, n1, out, ldo, s); break;
            default: fast_rows<KIND, 4>(a, m0, w, row_bytes, n0, n1, out, ldo, s); break;
          }
        } else if constexpr (!gguf::is_super_kind(KIND)) {  // K-quants: super_linear
          switch (rows) {
            case 1: chunk_rows<KIND, 1>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
            case 2: chunk_rows<KIND, 2>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
            case 3: chunk_rows<KIND, 3>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
            default: chunk_rows<KIND, 4>(a, m0, w, row_bytes, n0, n1, out, ldo); break;
          }
        }
      }
    }
  });
}

constexpr const char* kKindList =
    "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q2_K (10), Q3_K (11), Q4_K (12), "
    "Q5_K (13), Q6_K (14), IQ4_NL (20) or IQ4_XS (23)";

template <typename Fn>
void dispatch_kind(int64_t kind, const Fn& fn) {
  switch (kind) {
    case kQ4_0: fn(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: fn(std::integral_constant<int64_t, kQ8_0>{}); break;
    case gguf::kQ5_0: fn(std::integral_constant<int64_t, gguf::kQ5_0>{}); break;
    case gguf::kQ5_1: fn(std::integral_constant<int64_t, gguf::kQ5_1>{}); break;
    case gguf::kQ2_K: fn(std::integral_constant<int64_t, gguf::kQ2_K>{}); break;
    case gguf::kQ3_K: fn(std::integral_constant<int64_t, gguf::kQ3_K>{}); break;
    case gguf::kQ4_K: fn(std::integral_constant<int64_t, gguf::kQ4_K>{}); break;
    case gguf::kQ5_K: fn(std::integral_constant<int64_t, gguf::kQ5_K>{}); break;
    case gguf::kQ6_K: fn(std::integral_constant<int64_t, gguf::kQ6_K>{}); break;
    case gguf::kIQ4_NL: fn(std::integral_constant<int64_t, gguf::kIQ4_NL>{}); break;
    case gguf::kIQ4_XS: fn(std::integral_constant<int64_t, gguf::kIQ4_XS>{}); break;
    default: TORCH_CHECK(false, "gguf kind must be ", kKindList, ", got ", kind);
  }
}

// (values, bytes) of one group of `kind`.
std::pair<int64_t, int64_t> group_shape(int64_t kind) {
  std::pair<int64_t, int64_t> shape;
  dispatch_kind(kind & ~kRepackedX8, [&](auto kind_constant) {
    constexpr int64_t K = decltype(kind_constant)::value;
    if constexpr (is_block_kind(K)) {
      shape = {kBlock, Layout<K>::bytes};
    } else {
      shape = {gguf::Format<K>::kValues, gguf::Format<K>::kBytes};
    }
  });
  return shape;
}

void check_blocks(const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "gguf blocks must be uint8 [N, K / values * group bytes], got ",
              blocks.scalar_type(), " with ", blocks.dim(), " dims");
  const int64_t bytes = group_shape(kind).second;
  TORCH_CHECK(blocks.size(1) % bytes == 0, "gguf blocks: a row of ", blocks.size(1),
              " bytes is not a whole number of ", bytes, "-byte blocks");
  if (kind & kRepackedX8) {
    TORCH_CHECK(is_x8_kind(kind & ~kRepackedX8) && blocks.size(0) % kGroupRows == 0,
                "gguf blocks repacked by 8 rows: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K or "
                "Q6_K with a multiple of 8 rows");
  }
}

int64_t in_features(const at::Tensor& blocks, int64_t kind) {
  const auto [values, bytes] = group_shape(kind);
  return blocks.size(1) / bytes * values;
}

// Q4 kinds fold their block offsets into Activations::pair with this factor.
float pair_factor(int64_t kind) { return kind == kQ4_1 ? 1.f : kind == kQ4_0 ? -8.f : 0.f; }

}  // namespace

at::Tensor gguf_linear_parts(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds,
                             bool int8_activations, bool batch_invariant) {
  TORCH_CHECK(!parts.empty() && parts.size() == kinds.size(),
              "gguf_linear: one kind per part, and at least one part");
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be [M, K], got ", x.dim(), " dims");
  const int64_t m_total = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "gguf_linear: K = ", k, " is not a multiple of 32");
  int64_t n_total = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    check_blocks(parts[p], kinds[p]);
    TORCH_CHECK(parts[p].device().is_cpu() && x.device().is_cpu(), "gguf_linear: CPU tensors only");
    TORCH_CHECK(in_features(parts[p], kinds[p]) == k, "gguf_linear: x has K = ", k,
                " but a row of blocks holds ", in_features(parts[p], kinds[p]), " values");
    n_total += parts[p].size(0);
  }
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "gguf_linear: x must be float32, bfloat16 or float16, got ", dtype);
  auto xc = x.contiguous();
  auto out = at::empty({m_total, n_total}, x.options().dtype(at::kFloat));
  if (m_total == 0 || n_total == 0) return out.to(dtype);
  const bool exact = dtype == at::kFloat && !int8_activations;
  at::Tensor x32;  // fp32 activations, made once when a part needs them
  std::vector<std::pair<float, Activations>> quantized;  // per pair factor, made when needed
  std::optional<SuperActivations> supers;                // per 256 values, for K-quants
  auto activations_for = [&](float factor) -> const Activations& {
    for (const auto& [f, a] : quantized) {
      if (f == factor) return a;
    }
    quantized.emplace_back(
        factor,
        dtype == at::kFloat ? quantize_activations(xc.data_ptr<float>(), m_total, k, factor)
        : dtype == at::kBFloat16
            ? quantize_activations(xc.data_ptr<c10::BFloat16>(), m_total, k, factor)
            : quantize_activations(xc.data_ptr<c10::Half>(), m_total, k, factor));
    return quantized.back().second;
  };
  auto supers_of = [&]() -> const SuperActivations& {
    if (!supers.has_value()) {
      supers = dtype == at::kFloat ? quantize_super_activations(xc.data_ptr<float>(), m_total, k)
               : dtype == at::kBFloat16
                   ? quantize_super_activations(xc.data_ptr<c10::BFloat16>(), m_total, k)
                   : quantize_super_activations(xc.data_ptr<c10::Half>(), m_total, k);
    }
    return *supers;
  };
  int64_t column = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t kind = kinds[p], n = parts[p].size(0);
    const at::Tensor wc = parts[p].contiguous();
    const uint8_t* w = wc.data_ptr<uint8_t>();
    const int64_t row_bytes = wc.size(1);
    float* o = out.data_ptr<float>() + column;
    // Enough rows of bf16/fp16 activations make a dequantized fp32 panel cheaper than Q4's
    // int8 blocks (see kHalfPanelMinRows), and exact too. Batch-invariant calls stay on one
    // path at every M.
    const bool panel = !exact && (kind == kQ4_0 || kind == kQ4_1) &&
                       m_total >= kHalfPanelMinRows && !batch_invariant;
    if (kind & kRepackedX8) {
      // One path for every M (each output row's arithmetic is its own: batch-invariant).
      TORCH_CHECK(!exact, "gguf_linear: blocks repacked by 8 rows are computed with int8 "
                  "activations; fp32 without int8_activations needs the file's layout");
      dispatch_kind(kind & ~kRepackedX8, [&](auto kind_constant) {
        constexpr int64_t K = decltype(kind_constant)::value;
        if constexpr (is_x8_kind(K) && gguf::is_super_kind(K)) {
          super_x8_linear<K>(supers_of(), w, row_bytes, n, o, n_total);
        } else if constexpr (is_x8_kind(K)) {
          x8_linear<K>(activations_for(0.f), w, row_bytes, n, o, n_total);
        }
      });
    } else if (gguf::is_super_kind(kind) && !exact) {
      dispatch_kind(kind, [&](auto kind_constant) {
        constexpr int64_t K = decltype(kind_constant)::value;
        if constexpr (gguf::is_super_kind(K)) super_linear<K>(supers_of(), w, row_bytes, n, o, n_total);
      });
    } else if (exact || panel) {
      if (!x32.defined()) x32 = xc.to(at::kFloat);
      dispatch_kind(kind, [&](auto kind_constant) {
        exact_linear<decltype(kind_constant)::value>(x32.data_ptr<float>(), m_total, k, w,
                                                     row_bytes, n, o, n_total,
                                                     batch_invariant && exact);
      });
    } else {
      const Activations& a = activations_for(pair_factor(kind));
      dispatch_kind(kind, [&](auto kind_constant) {
        fast_linear<decltype(kind_constant)::value>(a, w, row_bytes, n, o, n_total);
      });
    }
    column += n;
  }
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                       bool int8_activations, bool batch_invariant) {
  const int64_t kinds[] = {kind};
  return gguf_linear_parts(x, {blocks}, kinds, int8_activations, batch_invariant);
}

at::Tensor gguf_embedding(const at::Tensor& token_ids, const at::Tensor& blocks, int64_t kind,
                          at::ScalarType dtype) {
  check_blocks(blocks, kind);
  TORCH_CHECK(token_ids.scalar_type() == at::kLong || token_ids.scalar_type() == at::kInt,
              "gguf_embedding: token ids must be int64 or int32");
  const int64_t k = in_features(blocks, kind);
  const int64_t vocab = blocks.size(0);
  auto ids = token_ids.contiguous().to(at::kLong);
  auto wc = blocks.contiguous();
  std::vector<int64_t> shape(token_ids.sizes().begin(), token_ids.sizes().end());
  shape.push_back(k);
  auto out = at::empty(shape, blocks.options().dtype(dtype));
  const int64_t count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < vocab, "gguf_embedding: token id ", id[t],
                " is outside the table of ", vocab, " rows");
  }
  const uint8_t* w = wc.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "gguf_embedding", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> row(k);
      std::vector<uint8_t> unpacked(row_bytes);
      for (int64_t t = begin; t < end; ++t) {
        dispatch_kind(kind & ~kRepackedX8, [&](auto kind_constant) {
          constexpr int64_t K = decltype(kind_constant)::value;
          const uint8_t* source = w + id[t] * row_bytes;
          if constexpr (is_x8_kind(K)) {
            if (kind & kRepackedX8) {
              gguf_x8::unpack_row<K>(w, id[t], row_bytes, unpacked.data());
              source = unpacked.data();
            }
          }
          dequantize_any_row<K>(source, k, row.data());
        });
        for (int64_t j = 0; j < k; ++j) o[t * k + j] = static_cast<scalar_t>(row[j]);
      }
    });
  });
  return out;
}

// The file's rows -> the layout `kind | 256` names (the same bytes, regrouped by 8 rows).
at::Tensor gguf_repack(const at::Tensor& blocks, int64_t kind) {
  check_blocks(blocks, kind);
  TORCH_CHECK(is_x8_kind(kind) && blocks.size(0) % kGroupRows == 0,
              "gguf_repack: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K blocks with a "
              "multiple of 8 rows");
  auto src = blocks.contiguous();
  auto out = at::empty_like(src);
  dispatch_kind(kind, [&](auto kind_constant) {
    constexpr int64_t K = decltype(kind_constant)::value;
    if constexpr (is_x8_kind(K)) {
      gguf_x8::repack<K>(src.data_ptr<uint8_t>(), src.size(0), src.size(1),
                         out.data_ptr<uint8_t>());
    }
  });
  return out;
}

// gguf_repack into the blocks' own storage (what the loader uses: its buffer is its own).
at::Tensor gguf_repack_(at::Tensor blocks, int64_t kind) {
  check_blocks(blocks, kind);
  TORCH_CHECK(is_x8_kind(kind) && blocks.size(0) % kGroupRows == 0,
              "gguf_repack_: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K blocks with a "
              "multiple of 8 rows");
  TORCH_CHECK(blocks.is_contiguous(), "gguf_repack_: the blocks must be contiguous");
  dispatch_kind(kind, [&](auto kind_constant) {
    constexpr int64_t K = decltype(kind_constant)::value;
    if constexpr (is_x8_kind(K)) {
      gguf_x8::repack_in_place<K>(blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1));
    }
  });
  return blocks;
}

// Shape functions for torch.compile (symbolic M and token counts).
at::Tensor gguf_linear_meta(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            bool int8_activations, bool batch_invariant) {
  check_blocks(blocks, kind);
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be [M, K], got ", x.dim(), " dims");
  return at::empty_symint({x.sym_size(0), blocks.sym_size(0)}, x.options());
}

at::Tensor gguf_linear_parts_meta(const at::Tensor& x, at::TensorList parts,
                                  at::IntArrayRef kinds, bool int8_activations,
                                  bool batch_invariant) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be [M, K], got ", x.dim(), " dims");
  c10::SymInt n_total = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    check_blocks(parts[p], kinds[p]);
    n_total = n_total + parts[p].sym_size(0);
  }
  return at::empty_symint({x.sym_size(0), n_total}, x.options());
}

at::Tensor gguf_embedding_meta(const at::Tensor& token_ids, const at::Tensor& blocks,
                               int64_t kind, at::ScalarType dtype) {
  check_blocks(blocks, kind);
  std::vector<c10::SymInt> shape(token_ids.sym_sizes().begin(), token_ids.sym_sizes().end());
  const auto [values, bytes] = group_shape(kind);
  shape.push_back(blocks.sym_size(1) / bytes * values);
  return at::empty_symint(shape, token_ids.options().dtype(dtype));
}

std::string gguf_kernel_isa() {
#if defined(GGUF_AVX2) && defined(GGUF_VNNI_EMULATED)
  return "avx2+vnni-emulated";
#elif defined(GGUF_V16) && defined(GGUF_VNNI)
  return "avx512+vnni";  // 512-bit tiles from 16 rows (gguf_vec.h), 256-bit below
#elif defined(GGUF_V16)
  return "avx512";
#elif defined(GGUF_AVX2) && defined(GGUF_VNNI)
  return "avx2+vnni";
#elif defined(GGUF_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

TORCH_LIBRARY_FRAGMENT(LLMSERVE_GGUF_NAMESPACE, m) {
  m.def(
      "gguf_linear(Tensor x, Tensor blocks, int kind, bool int8_activations=False,"
      " bool batch_invariant=False) -> Tensor");
  m.def(
      "gguf_linear_parts(Tensor x, Tensor[] parts, int[] kinds, bool int8_activations=False,"
      " bool batch_invariant=False) -> Tensor");
  m.def("gguf_repack(Tensor blocks, int kind) -> Tensor");
  m.def("gguf_repack_(Tensor(a!) blocks, int kind) -> Tensor(a!)");
  m.def("gguf_embedding(Tensor token_ids, Tensor blocks, int kind, ScalarType dtype) -> Tensor");
  m.def("gguf_kernel_isa() -> str", &gguf_kernel_isa);
}

TORCH_LIBRARY_IMPL(LLMSERVE_GGUF_NAMESPACE, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_linear_parts", &gguf_linear_parts);
  m.impl("gguf_repack", &gguf_repack);
  m.impl("gguf_repack_", &gguf_repack_);
  m.impl("gguf_embedding", &gguf_embedding);
}

TORCH_LIBRARY_IMPL(LLMSERVE_GGUF_NAMESPACE, Meta, m) {
  m.impl("gguf_linear", &gguf_linear_meta);
  m.impl("gguf_linear_parts", &gguf_linear_parts_meta);
  m.impl("gguf_embedding", &gguf_embedding_meta);
}
