// Paged decode attention for CPUs: one query token per sequence, read straight from the
// paged KV cache (no gathered copy), fp32 math, parallel over (sequence, kv head).
//
// For each (b, h): the G = Hq / Hkv query heads that share KV head h are scored against the
// sequence's keys block by block (pass 1), softmaxed (pass 2), and the values are summed with
// those weights (pass 3). Keys and values are each read once.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Widening loads: bf16 is the top half of an fp32, so a shift converts it (and vectorizes,
// unlike the c10::BFloat16 conversion operator).
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* widened = reinterpret_cast<uint32_t*>(dst);  // built with -fno-strict-aliasing
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) widened[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename scalar_t>
void decode_one(
    const scalar_t* query, const scalar_t* k_cache, const scalar_t* v_cache,
    const int32_t* block_table, int64_t context_len, int64_t b, int64_t h,
    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, scalar_t* out, std::vector<float>& q, std::vector<float>& scores,
    std::vector<float>& acc, std::vector<float>& row) {
  const int64_t group = num_q_heads / num_kv_heads;
  q.assign(group * head_dim, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* src = query + (b * num_q_heads + h * group + g) * head_dim;
    load_row(src, q.data() + g * head_dim, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] *= scale;
  }
  scores.resize(group * context_len);
  const int64_t token_stride = num_kv_heads * head_dim;
  // Pass 1: scores[g][t] = q_g . k_t
  for (int64_t t = 0; t < context_len; ++t) {
    const int64_t block = block_table[t / block_size];
    const scalar_t* k = k_cache + (block * block_size + t % block_size) * token_stride + h * head_dim;
    load_row(k, row.data(), head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q.data() + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
      scores[g * context_len + t] = dot;
    }
  }
  // Pass 2: softmax per query head.
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * context_len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < context_len; ++t) max_score = std::max(max_score, s[t]);
    float total = 0.f;
    for (int64_t t = 0; t < context_len; ++t) {
      s[t] = std::exp(s[t] - max_score);
      total += s[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
  }
  // Pass 3: out_g = sum_t p[g][t] * v_t
  acc.assign(group * head_dim, 0.f);
  for (int64_t t = 0; t < context_len; ++t) {
    const int64_t block = block_table[t / block_size];
    const scalar_t* v = v_cache + (block * block_size + t % block_size) * token_stride + h * head_dim;
    load_row(v, row.data(), head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * context_len + t];
      float* a = acc.data() + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* dst = out + (b * num_q_heads + h * group + g) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
  }
}

}  // namespace

at::Tensor paged_decode_attention(
    at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
    at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [B, Hq, D], cache [N, bs, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "query and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type(), "cache dtype must match the query's");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t batch = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t max_blocks = tables.size(1);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv");
  auto out = at::empty_like(query);
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
        const scalar_t* q = query.data_ptr<scalar_t>();
        const scalar_t* k = k_cache.data_ptr<scalar_t>();
        const scalar_t* v = v_cache.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> qbuf, scores, acc, row(head_dim);
          for (int64_t index = begin; index < end; ++index) {
            const int64_t b = index / num_kv_heads, h = index % num_kv_heads;
            decode_one<scalar_t>(q, k, v, table_ptr + b * max_blocks, len_ptr[b], b, h,
                                 num_q_heads, num_kv_heads, head_dim, block_size,
                                 static_cast<float>(scale), o, qbuf, scores, acc, row);
          }
        });
      });
  return out;
}

at::Tensor paged_decode_attention_meta(
    at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
    at::Tensor block_tables, at::Tensor context_lens, double scale) {
  return at::empty_like(query);
}

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables,"
      " Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}

TORCH_LIBRARY_IMPL(llmserve, Meta, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_meta);
}
