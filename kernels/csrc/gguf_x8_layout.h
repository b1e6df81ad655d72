// GGUF blocks regrouped by 8 rows: the layout the int8-activation kernels stream best.
//
// At load, each group of 8 weight rows is rewritten block by block (a K-quant's block is its
// 256-value super-block). A block's fp16 fields go first, each as the 8 rows' values side by
// side; the rest of the block, in file order, follows as 4-byte words, each word as the 8
// rows' words side by side:
//
//   per group of 8 rows, per block b:  field_0[8] | field_1[8] | word_0[8] | word_1[8] | ...
//                                      (16 B per fp16 field, 32 B per word)
//   kind     fp16 fields (file offset)   words (file bytes)
//   Q4_0     d (0)                       2..18     4 words of nibbles
//   Q4_1     d (0), m (2)                4..20
//   Q5_0     d (0)                       2..22     qh, then 4 of nibbles
//   Q5_1     d (0), m (2)                4..24
//   Q8_0     d (0)                       2..34     8 words of int8 codes
//   IQ4_NL   d (0)                       2..18     4 words of nibbles (level indices)
//   Q2_K     d (80), dmin (82)           0..80     4 of 4-bit scales and mins, 16 of 2-bit codes
//   Q3_K     d (108)                     0..108    8 of high bits, 16 of 2-bit codes, 3 of
//                                                  packed 6-bit scales
//   Q4_K     d (0), dmin (2)             4..144    3 of packed scales and mins, 32 of nibbles
//   Q5_K     d (0), dmin (2)             4..176    3 of scales, 8 of qh, 32 of nibbles
//   Q6_K     d (208)                     0..208    32 of low nibbles, 16 of 2-bit highs,
//                                                  4 of int8 scales
//
// The same bytes, so the same memory. One 32-byte load then holds one word of each of the 8
// rows: unpacked once, a 32-byte vector of codes against 4 broadcast activation codes gives
// the 8 rows' partial dots in the 8 int32 lanes, with no horizontal sum left, the rows'
// scales load as vectors, and a tile of activation rows reuses every unpacked vector. A
// 512-bit vector takes the same word of two adjacent groups (16 rows; gguf_vec.h).
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_formats.h"

namespace gguf_x8 {

constexpr int kGroupRows = 8;
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

struct Fields {
  int64_t bytes;        // one block in the file
  int num_halves;       // fp16 fields
  int64_t halves[2];    // their offsets in the file's block
  int64_t words_at;     // the file bytes [words_at, words_at + 4 num_words) become words
  int64_t num_words;
};

template <int64_t KIND>
constexpr Fields fields() {
  if constexpr (KIND == kQ4_0) return {18, 1, {0, 0}, 2, 4};
  if constexpr (KIND == kQ4_1) return {20, 2, {0, 2}, 4, 4};
  if constexpr (KIND == gguf::kQ5_0) return {22, 1, {0, 0}, 2, 5};
  if constexpr (KIND == gguf::kQ5_1) return {24, 2, {0, 2}, 4, 5};
  if constexpr (KIND == kQ8_0) return {34, 1, {0, 0}, 2, 8};
  if constexpr (KIND == gguf::kIQ4_NL) return {18, 1, {0, 0}, 2, 4};
  if constexpr (KIND == gguf::kQ2_K) return {84, 2, {80, 82}, 0, 20};
  if constexpr (KIND == gguf::kQ3_K) return {110, 1, {108, 0}, 0, 27};
  if constexpr (KIND == gguf::kQ4_K) return {144, 2, {0, 2}, 4, 35};
  if constexpr (KIND == gguf::kQ5_K) return {176, 2, {0, 2}, 4, 43};
  if constexpr (KIND == gguf::kQ6_K) return {210, 1, {208, 0}, 0, 52};
  return {0, 0, {0, 0}, 0, 0};
}

constexpr bool has_layout(int64_t kind) {
  return kind == kQ4_0 || kind == kQ4_1 || kind == gguf::kQ5_0 || kind == gguf::kQ5_1 ||
         kind == kQ8_0 || kind == gguf::kIQ4_NL || kind == gguf::kQ2_K || kind == gguf::kQ3_K || kind == gguf::kQ4_K || kind == gguf::kQ5_K || kind == gguf::kQ6_K;
}

// Where, in a group's block, fp16 field f and word w of row 0 sit.
template <int64_t KIND>
constexpr int64_t half_at(int f) {
  return 16 * f;
}
template <int64_t KIND>
constexpr int64_t word_at(int64_t w) {
  return 16 * fields<KIND>().num_halves + 32 * w;
}

// A row's block <-> its place in the group's block. `to_group`: file -> layout.
template <int64_t KIND, bool to_group>
inline void move_block(uint8_t* group_block, int r, uint8_t* file_block) {
  constexpr Fields f = fields<KIND>();
  for (int h = 0; h < f.num_halves; ++h) {
    uint8_t* at = group_block + half_at<KIND>(h) + 2 * r;
    if (to_group) {
      std::memcpy(at, file_block + f.halves[h], 2);
    } else {
      std::memcpy(file_block + f.halves[h], at, 2);
    }
  }
  for (int64_t w = 0; w < f.num_words; ++w) {
    uint8_t* at = group_block + word_at<KIND>(w) + 4 * r;
    if (to_group) {
      std::memcpy(at, file_block + f.words_at + 4 * w, 4);
    } else {
      std::memcpy(file_block + f.words_at + 4 * w, at, 4);
    }
  }
}

// rows [N, row_bytes] (N a multiple of 8) -> the same bytes, regrouped.
template <int64_t KIND>
void repack(const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst) {
  constexpr int64_t bytes = fields<KIND>().bytes;
  static_assert(bytes == 2 * fields<KIND>().num_halves + 4 * fields<KIND>().num_words);
  const int64_t nb = row_bytes / bytes;
  at::parallel_for(0, rows / kGroupRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* out = dst + g * kGroupRows * row_bytes + b * kGroupRows * bytes;
        for (int r = 0; r < kGroupRows; ++r) {
          const uint8_t* block = src + (g * kGroupRows + r) * row_bytes + b * bytes;
          move_block<KIND, true>(out, r, const_cast<uint8_t*>(block));
        }
      }
    }
  });
}

// The same, in place: a group of 8 rows keeps its byte range, so each group is regrouped
// through a copy of its own rows only (no second buffer the size of the weight at load).
template <int64_t KIND>
void repack_in_place(uint8_t* data, int64_t rows, int64_t row_bytes) {
  constexpr int64_t bytes = fields<KIND>().bytes;
  const int64_t nb = row_bytes / bytes;
  at::parallel_for(0, rows / kGroupRows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> rows_copy(kGroupRows * row_bytes);
    for (int64_t g = begin; g < end; ++g) {
      uint8_t* group = data + g * kGroupRows * row_bytes;
      std::memcpy(rows_copy.data(), group, rows_copy.size());
      for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < kGroupRows; ++r) {
          move_block<KIND, true>(group + b * kGroupRows * bytes, r,
                                 rows_copy.data() + r * row_bytes + b * bytes);
        }
      }
    }
  });
}

// Row `row` of a regrouped tensor back to the file's layout (lookups, the scalar path).
template <int64_t KIND>
void unpack_row(const uint8_t* repacked, int64_t row, int64_t row_bytes, uint8_t* block_row) {
  constexpr int64_t bytes = fields<KIND>().bytes;
  const int64_t nb = row_bytes / bytes, g = row / kGroupRows;
  const int r = static_cast<int>(row % kGroupRows);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* in = repacked + g * kGroupRows * row_bytes + b * kGroupRows * bytes;
    move_block<KIND, false>(const_cast<uint8_t*>(in), r, block_row + b * bytes);
  }
}

}  // namespace gguf_x8
