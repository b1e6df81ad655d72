// Paged decode attention on CPUs: one query token per sequence over its paged KV cache, read
// in place (no gathered copy), fp32 math, output in the query's dtype.
//
//   query [B, Hq, D] (any row strides)      k_cache/v_cache [num_blocks, block_size, Hkv, D]
//   block_tables [B, W] int32               float (= query dtype), or int8 with k_scale/v_scale
//   context_lens [B] int32 (0: padding row)   [num_blocks, block_size, Hkv, D / group]
//
// Work is cut into items (sequence, token range, KV heads: all of them unless items are few).
// Tokens go in chunks of kChunk; the G = Hq / Hkv query heads sharing a KV head are scored
// together (q . k, scores in L1), folded into a running max and sum (online softmax at chunk
// granularity), and the values accumulated. Both passes walk a chunk W token rows at a time
// with every KV head of the item inside, so each row (Hkv x D contiguous values) comes from
// memory once, whole, while the prefetches fetch the next rows: one item per (sequence, kv
// head) touched 1 / Hkv of each row per pass and ran 1.4-1.8x slower on a 50 MB cache (B 64,
// context 1024, one thread). Several key rows are scored at once and the value sums run
// several tokens in flight, so the FMAs do not wait on each other: 1.7x at batch 16, context
// 192, 9 / 3 heads of 64 (cache in L3).
// Contexts too long for the batch to balance across the threads (batch 1 on 2 threads) are
// split into ranges processed in parallel and merged with their log-sum-exp
// (flash-decoding). With fewer ranges than the threads can share (one user's context under
// kInvariantSplit is one range) each range is also cut into a few runs of adjacent KV heads,
// one per thread, which changes no arithmetic (each thread reads its contiguous part of every
// row): one user at context 256, Llama 3.2 1B's 32 / 8 heads, 2 threads, cache from memory:
// 2.0x faster.
//
// Sliding window W > 0: a sequence's items cover only its last W tokens (positions
// context_len - W .. context_len - 1), so the blocks before the window are never read and a
// long context costs the window. Soft-capped logits (c > 0): each chunk's scores become
// c * tanh(score / c) before the softmax.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_vec.h"

namespace llmserve_cpu {
std::atomic<bool>& scalar_kernels_forced() {
  static std::atomic<bool> forced{false};
  return forced;
}
}  // namespace llmserve_cpu

namespace {

using namespace llmserve_cpu;

// Query heads scored in one pass over K/V: up to 8 accumulators per key row fit the registers
// (GQA groups above 8 run in several passes).
constexpr int64_t kMaxGroupTile = 8;
// Tokens scored before their values are accumulated: G x 256 fp32 scores stay in L1.
constexpr int64_t kChunk = 256;
// Prefetch distance, in tiles of W tokens, of the key and value rows.
constexpr int64_t kPrefetchTiles = 2;
// Splits shorter than this cost more in merging than they win in balance.
constexpr int64_t kMinSplit = 128;
// Items per thread aimed for when splitting: enough that unequal lengths even out.
constexpr int64_t kItemsPerThread = 4;
// Fixed cost of an item (query load, output store), in tokens, for the load balance.
constexpr int64_t kItemOverhead = 16;
// Below this many multiply-adds (tokens x Hq x D) one thread is faster than waking the
// others: an OpenMP region costs a few microseconds.
constexpr int64_t kMinParallelWork = 1 << 18;

// Batch-invariant calls split a context into ranges of this many tokens at most, by its own
// length alone (the usual split is sized from the whole batch's tokens): each sequence's
// output then depends only on its own query and context, and one long context still spreads
// over the threads.
constexpr int64_t kInvariantSplit = 512;

struct DecodeArgs {
  bool batch_invariant = false;
  const void* query;
  at::ScalarType query_dtype;
  int64_t query_stride_batch, query_stride_head;
  const void* k_cache;
  const void* v_cache;
  RowStrides k_strides, v_strides;
  const void* k_scale;  // int8 caches only
  const void* v_scale;
  at::ScalarType scale_dtype;
  RowStrides k_scale_strides, v_scale_strides;
  int64_t quant_group;  // values per scale; 0 for a float cache
  int64_t num_scales;   // D / quant_group
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* context_lens;
  int64_t num_q_heads, num_kv_heads, group, head_dim, block_size;
  float scale;
  int64_t sliding_window = 0;  // 0: the whole context
  float logit_softcap = 0.f;   // 0: scores as they are
  void* out;                   // contiguous [B, Hq, D], query dtype
};

// The first token of `context_len` that the query attends to.
inline int64_t window_start(const DecodeArgs& a, int64_t context_len) {
  return a.sliding_window > 0 ? std::max<int64_t>(0, context_len - a.sliding_window) : 0;
}

struct WorkItem {
  int64_t batch, begin, end;
  int64_t first_kv_head, end_kv_head;  // the KV heads [first, end) and their query heads
  int64_t partial;  // -1: the whole context, written to the output; else its partial slot
};

// KV heads [first, end) of an item, with their group's query heads.
struct HeadRange {
  int64_t first, end;
};

// Per-thread buffers, sized once per op call.
template <class V>
struct Scratch {
  static constexpr int64_t kWidth = V::kWidth;
  std::vector<float> query, scores, acc, max_score, sum_exp, k_scales, v_scales;
  std::vector<const char*> k_tokens, v_tokens;  // a chunk's token rows (all heads)
  int64_t scale_stride;

  explicit Scratch(const DecodeArgs& a)
      : query(a.num_q_heads * a.head_dim),
        scores(a.num_q_heads * kChunk),
        acc(a.num_q_heads * a.head_dim),
        max_score(a.num_q_heads),
        sum_exp(a.num_q_heads),
        k_tokens(kChunk),
        v_tokens(kChunk),
        // Widened scales: [token][kv head][D / group], each token padded by a vector because
        // expand_scales reads a full vector from the first scale it needs.
        scale_stride(a.num_kv_heads * a.num_scales + kWidth) {
    if (a.quant_group > 0) {
      k_scales.resize(kChunk * scale_stride);
      v_scales.resize(kChunk * scale_stride);
    }
  }
};

template <class V>
typename V::Reg scale_vector(const float* scales, int64_t lane, int64_t group) {
  // Dequantization scale of the lanes [lane, lane + W) of a row.
  if (group >= V::kWidth) return V::set1(scales[lane / group]);
  return V::expand_scales(scales + lane / group, group);
}

template <class V, typename KV>
typename V::Reg load_row_vector(const KV* row, int64_t lane, const float* scales, int64_t group) {
  typename V::Reg x = V::load(row + lane);
  if constexpr (std::is_same_v<KV, int8_t>) x = V::mul(x, scale_vector<V>(scales, lane, group));
  return x;
}

// Rows of one KV head in a chunk: token row starts (all heads) plus this head's offset.
struct ChunkRows {
  const char* const* tokens;
  int64_t head_offset;  // bytes
};

// Fetches the whole token rows (every head) [first, last) of a chunk ahead of use.
inline void prefetch_rows(const char* const* tokens, int64_t row_bytes, int64_t first,
                          int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(tokens[t] + byte);
  }
}

// Key rows scored at once in score_tile: G x R independent dot products keep the FMA units
// busy (one row at a time left G chains, each waiting on its previous FMA), within the
// registers left by G query vectors and a key vector.
constexpr int rows_per_pass(int group, int registers, int width) {
  const int rows = (registers - group - 2) / group;
  return rows < 1 ? 1 : (rows > width ? width : rows);
}

// partial[g][j0 + r] = the lane-wise products q_g * k of rows t0 + j0 + r, r < R, summed over
// head_dim's vectors.
template <class V, typename KV, int G, int R>
void score_rows(const float* query, const ChunkRows& keys, const float* scales,
                int64_t scale_stride, int64_t group, int64_t t, int64_t head_dim,
                typename V::Reg (*partial)[V::kWidth], int64_t j0) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  const KV* k[R];
  const float* row_scales[R] = {};
  for (int r = 0; r < R; ++r) {
    k[r] = reinterpret_cast<const KV*>(keys.tokens[t + r] + keys.head_offset);
    if constexpr (std::is_same_v<KV, int8_t>) row_scales[r] = scales + (t + r) * scale_stride;
  }
  Reg dots[G][R];
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) dots[g][r] = V::zero();
  }
  for (int64_t lane = 0; lane < head_dim; lane += W) {
    Reg q[G];
    for (int g = 0; g < G; ++g) q[g] = V::load(query + g * head_dim + lane);
    for (int r = 0; r < R; ++r) {
      const Reg kv = load_row_vector<V, KV>(k[r], lane, row_scales[r], group);
      for (int g = 0; g < G; ++g) dots[g][r] = V::fma(q[g], kv, dots[g][r]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) partial[g][j0 + r] = dots[g][r];
  }
}

// scores[g][t] = q_g . k_t for rows [t0, t0 + n) of a chunk, n <= W. Each row's G partial dot
// products stay vectors; W of them are reduced at once (one transpose-reduce instead of W
// horizontal sums).
template <class V, typename KV, int G>
void score_tile(const float* query, const ChunkRows& keys, const float* scales,
                int64_t scale_stride, int64_t group, int64_t t0, int64_t n, int64_t head_dim,
                float* scores) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  constexpr int R = rows_per_pass(G, V::kRegisters, V::kWidth);
  Reg partial[G][W];
  int64_t j = 0;
  for (; j + R <= n; j += R) {
    score_rows<V, KV, G, R>(query, keys, scales, scale_stride, group, t0 + j, head_dim, partial,
                            j);
  }
  for (; j < n; ++j) {
    score_rows<V, KV, G, 1>(query, keys, scales, scale_stride, group, t0 + j, head_dim, partial,
                            j);
  }
  for (; j < W; ++j) {
    for (int g = 0; g < G; ++g) partial[g][j] = V::zero();
  }
  for (int g = 0; g < G; ++g) V::store(scores + g * kChunk + t0, V::transpose_reduce(partial[g]));
}

// The value pass's register tile: NV vectors of head_dim per query head, U tokens in flight
// with sums of their own (G x NV x U accumulators, NV value vectors and a weight). More
// accumulators keep more FMAs independent; a wider NV reads the weights fewer times.
struct ValueTile {
  int vectors, unroll;
};
constexpr ValueTile value_tile(int group, int registers) {
  ValueTile best{1, 1};
  for (int nv : {4, 2, 1}) {
    for (int u : {2, 1}) {
      const bool fits = group * nv * u + nv + 1 <= registers;
      if (fits && nv * u > best.vectors * best.unroll) best = {nv, u};
    }
  }
  return best;
}

// acc[g][lane0, lane0 + NV W) += sum over rows [t0, t1) of weights[g][t] * v_t.
template <class V, typename KV, int G, int NV, int U>
void accumulate_tile(const float* weights, const ChunkRows& rows, const float* scales,
                     int64_t scale_stride, int64_t group, int64_t t0, int64_t t1,
                     int64_t head_dim, int64_t lane0, float* acc) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  Reg sums[U][G][NV];
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < NV; ++v) {
      sums[0][g][v] = V::load(acc + g * head_dim + lane0 + v * W);
      for (int u = 1; u < U; ++u) sums[u][g][v] = V::zero();
    }
  }
  auto add_row = [&](Reg(&into)[G][NV], int64_t t) {
    const KV* row = reinterpret_cast<const KV*>(rows.tokens[t] + rows.head_offset);
    const float* row_scales = nullptr;
    if constexpr (std::is_same_v<KV, int8_t>) row_scales = scales + t * scale_stride;
    Reg values[NV];
    for (int v = 0; v < NV; ++v)
      values[v] = load_row_vector<V, KV>(row, lane0 + v * W, row_scales, group);
    for (int g = 0; g < G; ++g) {
      const Reg w = V::set1(weights[g * kChunk + t]);
      for (int v = 0; v < NV; ++v) into[g][v] = V::fma(w, values[v], into[g][v]);
    }
  };
  int64_t t = t0;
  for (; t + U <= t1; t += U) {
    for (int u = 0; u < U; ++u) add_row(sums[u], t + u);
  }
  for (; t < t1; ++t) add_row(sums[0], t);
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < NV; ++v) {
      Reg total = sums[0][g][v];
      for (int u = 1; u < U; ++u) total = V::add(total, sums[u][g][v]);
      V::store(acc + g * head_dim + lane0 + v * W, total);
    }
  }
}

// acc[g] += sum over rows [t0, t1) of weights[g][t] * v_t, over head_dim in lane tiles that
// keep the sums in registers (the rows of a token tile stay in L1 between lane tiles).
template <class V, typename KV, int G>
void accumulate_rows(const float* weights, const ChunkRows& rows, const float* scales,
                     int64_t scale_stride, int64_t group, int64_t t0, int64_t t1,
                     int64_t head_dim, float* acc) {
  constexpr ValueTile kTile = value_tile(G, V::kRegisters);
  constexpr int64_t tile = kTile.vectors * V::kWidth;
  int64_t lane = 0;
  for (; lane + tile <= head_dim; lane += tile) {
    accumulate_tile<V, KV, G, kTile.vectors, kTile.unroll>(weights, rows, scales, scale_stride,
                                                           group, t0, t1, head_dim, lane, acc);
  }
  for (; lane < head_dim; lane += V::kWidth) {
    accumulate_tile<V, KV, G, 1, kTile.unroll>(weights, rows, scales, scale_stride, group, t0, t1,
                                               head_dim, lane, acc);
  }
}

template <class V>
void load_query_rows(const DecodeArgs& a, int64_t batch, int64_t first_head, int64_t count,
                     float* dst) {
  using Reg = typename V::Reg;
  const Reg scale = V::set1(a.scale);
  for (int64_t g = 0; g < count; ++g) {
    const int64_t offset = batch * a.query_stride_batch + (first_head + g) * a.query_stride_head;
    float* row = dst + g * a.head_dim;
    for (int64_t lane = 0; lane < a.head_dim; lane += V::kWidth) {
      Reg x;
      switch (a.query_dtype) {
        case at::kBFloat16:
          x = V::load(static_cast<const c10::BFloat16*>(a.query) + offset + lane);
          break;
        case at::kHalf:
          x = V::load(static_cast<const c10::Half*>(a.query) + offset + lane);
          break;
        default:
          x = V::load(static_cast<const float*>(a.query) + offset + lane);
          break;
      }
      // Scaling q once (not every score) is what SDPA's CPU kernel does too.
      V::store(row + lane, V::mul(x, scale));
    }
  }
}

template <class V, typename T>
void store_row(T* dst, const float* src, float multiplier, int64_t head_dim) {
  const typename V::Reg m = V::set1(multiplier);
  for (int64_t lane = 0; lane < head_dim; lane += V::kWidth) {
    V::store(dst + lane, V::mul(V::load(src + lane), m));
  }
}

template <class V>
void store_output_row(const DecodeArgs& a, int64_t row, const float* src, float multiplier) {
  const int64_t offset = row * a.head_dim;
  switch (a.query_dtype) {
    case at::kBFloat16:
      store_row<V>(static_cast<c10::BFloat16*>(a.out) + offset, src, multiplier, a.head_dim);
      break;
    case at::kHalf:
      store_row<V>(static_cast<c10::Half*>(a.out) + offset, src, multiplier, a.head_dim);
      break;
    default:
      store_row<V>(static_cast<float*>(a.out) + offset, src, multiplier, a.head_dim);
      break;
  }
}

// Calls f(std::integral_constant<int, G>) for a group tile of `count` query heads.
template <class F>
void with_group_tile(int64_t count, F&& f) {
  switch (count) {
#define LLMSERVE_GROUP_CASE(G)             \
  case G:                                  \
    f(std::integral_constant<int, G>{});   \
    break;
    LLMSERVE_GROUP_CASE(1)
    LLMSERVE_GROUP_CASE(2)
    LLMSERVE_GROUP_CASE(3)
    LLMSERVE_GROUP_CASE(4)
    LLMSERVE_GROUP_CASE(5)
    LLMSERVE_GROUP_CASE(6)
    LLMSERVE_GROUP_CASE(7)
    LLMSERVE_GROUP_CASE(8)
#undef LLMSERVE_GROUP_CASE
    default:
      TORCH_INTERNAL_ASSERT(false, "group tile out of range");
  }
}

// Calls f(kv_head, first query head, group tile size) for every group tile of the KV heads
// [first_kv_head, end_kv_head).
template <class F>
void for_each_group_tile(const DecodeArgs& a, int64_t first_kv_head, int64_t end_kv_head, F&& f) {
  for (int64_t h = first_kv_head; h < end_kv_head; ++h) {
    for (int64_t g0 = 0; g0 < a.group; g0 += kMaxGroupTile) {
      f(h, h * a.group + g0, std::min(kMaxGroupTile, a.group - g0));
    }
  }
}

// One chunk of n tokens for every query head: score, fold into the running max and sum
// (rescaling what earlier chunks accumulated by exp(old max - new max)), accumulate the
// values. Both passes walk the chunk a tile of W token rows at a time with every KV head
// inside, so each row comes from memory once and the loads spread over the compute; the
// prefetches run kPrefetchTiles tiles ahead, through the keys and on into the values.
// (Scoring one KV head over the whole chunk before the next fetched every row during the
// first head's pass alone: 2.7x slower at batch 16, context 192, cache from memory.)
template <class V, typename KV>
void attend_chunk(const DecodeArgs& a, const HeadRange& heads, Scratch<V>& s, int64_t n,
                  bool first_chunk) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  const int64_t head_dim = a.head_dim;
  const int64_t element = static_cast<int64_t>(sizeof(KV));
  // The bytes of a token row the range's heads occupy (the token pointers point at its first).
  const int64_t num_heads = heads.end - heads.first;
  const int64_t k_row_bytes = ((num_heads - 1) * a.k_strides.head + head_dim) * element;
  const int64_t v_row_bytes = ((num_heads - 1) * a.v_strides.head + head_dim) * element;
  const bool quantized = a.quant_group > 0;
  auto rows_of = [&](const std::vector<const char*>& tokens, int64_t head_stride, int64_t h) {
    return ChunkRows{tokens.data(), (h - heads.first) * head_stride * element};
  };
  auto scales_of = [&](const std::vector<float>& scales, int64_t h) {
    return quantized ? scales.data() + h * a.num_scales : nullptr;
  };
  for (int64_t t0 = 0; t0 < n; t0 += W) {
    const int64_t ahead = t0 + kPrefetchTiles * W;
    prefetch_rows(s.k_tokens.data(), k_row_bytes, std::min(n, ahead), std::min(n, ahead + W));
    if (ahead + W > n) {
      prefetch_rows(s.v_tokens.data(), v_row_bytes, std::max<int64_t>(0, ahead - n),
                    std::min(n, ahead + W - n));
    }
    const int64_t rows = std::min(W, n - t0);
    for_each_group_tile(a, heads.first, heads.end, [&](int64_t h, int64_t first, int64_t count) {
      const ChunkRows keys = rows_of(s.k_tokens, a.k_strides.head, h);
      with_group_tile(count, [&](auto group_tile) {
        score_tile<V, KV, decltype(group_tile)::value>(
            s.query.data() + first * head_dim, keys, scales_of(s.k_scales, h), s.scale_stride,
            a.quant_group, t0, rows, head_dim, s.scores.data() + first * kChunk);
      });
    });
  }
  // Pad the chunk to whole vectors with -inf scores (weight 0).
  const int64_t padded = (n + W - 1) / W * W;
  for (int64_t qh = heads.first * a.group; qh < heads.end * a.group; ++qh) {
    float* scores = s.scores.data() + qh * kChunk;
    if (a.logit_softcap > 0.f) {
      const Reg cap = V::set1(a.logit_softcap), inverse_cap = V::set1(1.f / a.logit_softcap);
      for (int64_t t = 0; t < padded; t += W) {
        V::store(scores + t, V::mul(V::tanh(V::mul(V::load(scores + t), inverse_cap)), cap));
      }
    }
    for (int64_t t = n; t < padded; ++t) scores[t] = -std::numeric_limits<float>::infinity();
    Reg chunk_max = V::set1(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += W) chunk_max = V::max(chunk_max, V::load(scores + t));
    const float previous = s.max_score[qh];
    const float current = ScalarVec::max(V::reduce_max(chunk_max), previous);
    const Reg shift = V::set1(-current);
    Reg total = V::zero();
    for (int64_t t = 0; t < padded; t += W) {
      const Reg p = V::exp(V::add(V::load(scores + t), shift));
      V::store(scores + t, p);
      total = V::add(total, p);
    }
    float& sum_exp = s.sum_exp[qh];
    if (first_chunk) {
      sum_exp = V::reduce_add(total);
    } else {
      const float rescale = std::exp(previous - current);
      sum_exp = sum_exp * rescale + V::reduce_add(total);
      float* acc = s.acc.data() + qh * head_dim;
      const Reg r = V::set1(rescale);
      for (int64_t lane = 0; lane < head_dim; lane += W) {
        V::store(acc + lane, V::mul(V::load(acc + lane), r));
      }
    }
    s.max_score[qh] = current;
  }
  for (int64_t t0 = 0; t0 < n; t0 += W) {
    const int64_t ahead = t0 + kPrefetchTiles * W;
    prefetch_rows(s.v_tokens.data(), v_row_bytes, std::min(n, ahead), std::min(n, ahead + W));
    const int64_t t1 = std::min(n, t0 + W);
    for_each_group_tile(a, heads.first, heads.end, [&](int64_t h, int64_t first, int64_t count) {
      const ChunkRows values = rows_of(s.v_tokens, a.v_strides.head, h);
      with_group_tile(count, [&](auto group_tile) {
        accumulate_rows<V, KV, decltype(group_tile)::value>(
            s.scores.data() + first * kChunk, values, scales_of(s.v_scales, h), s.scale_stride,
            a.quant_group, t0, t1, head_dim, s.acc.data() + first * head_dim);
      });
    });
  }
}

// Attention of the query heads of `heads` of `batch` over tokens [begin, end) of its context:
// leaves the running max, the sum of exponentials and the unnormalized weighted sum of values
// of each of those query heads in the scratch (at its own head's place).
template <class V, typename KV>
void attend_range(const DecodeArgs& a, int64_t batch, int64_t begin, int64_t end,
                  const HeadRange& heads, Scratch<V>& s) {
  const int64_t first_q = heads.first * a.group, num_q = (heads.end - heads.first) * a.group;
  load_query_rows<V>(a, batch, first_q, num_q, s.query.data() + first_q * a.head_dim);
  std::fill_n(s.acc.begin() + first_q * a.head_dim, num_q * a.head_dim, 0.f);
  std::fill_n(s.max_score.begin() + first_q, num_q, -std::numeric_limits<float>::infinity());
  std::fill_n(s.sum_exp.begin() + first_q, num_q, 0.f);
  const int32_t* table = a.block_tables + batch * a.table_stride;
  const int64_t element = static_cast<int64_t>(sizeof(KV));
  const int64_t scale_element = a.quant_group > 0 ? c10::elementSize(a.scale_dtype) : 0;
  for (int64_t chunk = begin; chunk < end; chunk += kChunk) {
    const int64_t n = std::min(kChunk, end - chunk);
    // Token rows of the chunk, walking the block table once.
    int64_t block_index = chunk / a.block_size, offset = chunk % a.block_size;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t block_id = table[block_index];
      s.k_tokens[t] = static_cast<const char*>(a.k_cache) +
                      element * a.k_strides.at(block_id, offset, heads.first);
      s.v_tokens[t] = static_cast<const char*>(a.v_cache) +
                      element * a.v_strides.at(block_id, offset, heads.first);
      if (a.quant_group > 0) {
        // Widen the token's scales for all the range's heads at once when they are contiguous
        // (they are in the worker's layout): one call per token instead of one per head.
        const bool packed =
            a.k_scale_strides.head == a.num_scales && a.v_scale_strides.head == a.num_scales;
        const int64_t heads_per_call = packed ? heads.end - heads.first : 1;
        for (int64_t h = heads.first; h < heads.end; h += heads_per_call) {
          const int64_t count = heads_per_call * a.num_scales;
          load_scales(static_cast<const char*>(a.k_scale) +
                          scale_element * a.k_scale_strides.at(block_id, offset, h),
                      a.scale_dtype, count,
                      s.k_scales.data() + t * s.scale_stride + h * a.num_scales);
          load_scales(static_cast<const char*>(a.v_scale) +
                          scale_element * a.v_scale_strides.at(block_id, offset, h),
                      a.scale_dtype, count,
                      s.v_scales.data() + t * s.scale_stride + h * a.num_scales);
        }
      }
      if (++offset == a.block_size) {
        offset = 0;
        ++block_index;
      }
    }
    attend_chunk<V, KV>(a, heads, s, n, chunk == begin);
  }
}

// Into how many parts (a divisor of Hkv) to cut each of `num_ranges` token ranges by KV
// heads, so that the threads finish together: a context shorter than kInvariantSplit is one
// range, which left all threads but one idle (batch 1, 2 threads: 2x slower). The heads'
// arithmetic is independent, so a row's result is the same, bit for bit, however its heads
// are cut. Among the cuts, the one whose busiest thread has the least work (in ranges), and
// the fewest parts among those: each part walks the block table and loads its query again.
int64_t head_parts_for(int64_t num_ranges, int64_t threads, int64_t num_kv_heads) {
  if (num_ranges == 0 || num_ranges >= threads * kItemsPerThread) return 1;
  int64_t best = 1;
  double best_load = static_cast<double>((num_ranges + threads - 1) / threads);
  for (int64_t parts = 2; parts <= num_kv_heads; ++parts) {
    if (num_kv_heads % parts != 0) continue;
    const int64_t items = num_ranges * parts;
    const double load =
        static_cast<double>((items + threads - 1) / threads) / static_cast<double>(parts);
    if (load < best_load) {
      best = parts;
      best_load = load;
    }
  }
  return best;
}

// Items, the contiguous runs of items each part (thread) takes, and the splits to merge.
struct Schedule {
  std::vector<WorkItem> items;
  std::vector<int64_t> part_begin;  // parts + 1 entries
  struct Merge {
    int64_t batch, first_partial, count;
  };
  std::vector<Merge> merges;
  int64_t num_partials = 0;
  bool parallel = false;
};

Schedule plan(const DecodeArgs& a, int64_t batch_size) {
  Schedule schedule;
  int64_t total_tokens = 0;
  for (int64_t b = 0; b < batch_size; ++b) {
    total_tokens += a.context_lens[b] - window_start(a, a.context_lens[b]);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t work = total_tokens * a.num_q_heads * a.head_dim;
  schedule.parallel = threads > 1 && !at::in_parallel_region() && work >= kMinParallelWork;
  // Split contexts longer than 1 / (threads x kItemsPerThread) of the batch's tokens: no item
  // is then big enough to leave a thread idle while another finishes it.
  const int64_t split = a.batch_invariant ? kInvariantSplit
                        : schedule.parallel
                            ? std::max(kMinSplit, (total_tokens + threads * kItemsPerThread - 1) /
                                                      (threads * kItemsPerThread))
                            : std::numeric_limits<int64_t>::max();
  int64_t num_ranges = 0;
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t len = a.context_lens[b] - window_start(a, a.context_lens[b]);
    if (len > 0) num_ranges += len <= split ? 1 : (len + split - 1) / split;
  }
  const int64_t head_parts =
      schedule.parallel ? head_parts_for(num_ranges, threads, a.num_kv_heads) : 1;
  const int64_t heads_per_part = a.num_kv_heads / head_parts;
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t first = window_start(a, a.context_lens[b]);
    const int64_t len = a.context_lens[b] - first;  // tokens attended
    if (len == 0) continue;
    const int64_t splits = len <= split ? 1 : (len + split - 1) / split;
    const int64_t range = (len + splits - 1) / splits;  // even ranges, not split + remainder
    if (splits > 1) schedule.merges.push_back({b, schedule.num_partials, splits});
    for (int64_t i = 0; i < splits; ++i) {
      const int64_t begin = first + i * range, end = first + std::min(len, i * range + range);
      // The head parts of a range share its partial slot, each filling its own heads' rows.
      const int64_t partial = splits > 1 ? schedule.num_partials++ : -1;
      for (int64_t h = 0; h < a.num_kv_heads; h += heads_per_part) {
        schedule.items.push_back({b, begin, end, h, h + heads_per_part, partial});
      }
    }
  }
  // Cut the item list into parts of near-equal cost: item i goes to the part its cost
  // midpoint falls in.
  const int64_t parts = schedule.parallel ? threads : 1;
  auto cost_of = [](const WorkItem& item) {
    return (item.end - item.begin + kItemOverhead) * (item.end_kv_head - item.first_kv_head);
  };
  int64_t total_cost = 0;
  for (const WorkItem& item : schedule.items) total_cost += cost_of(item);
  schedule.part_begin.assign(parts + 1, static_cast<int64_t>(schedule.items.size()));
  schedule.part_begin[0] = 0;
  int64_t cost = 0, part = 0;
  for (size_t i = 0; i < schedule.items.size(); ++i) {
    const int64_t item_cost = cost_of(schedule.items[i]);
    const int64_t owner = std::min(parts - 1, (2 * cost + item_cost) * parts / (2 * total_cost));
    while (part < owner) schedule.part_begin[++part] = static_cast<int64_t>(i);
    cost += item_cost;
  }
  return schedule;
}

template <class V, typename KV>
void run_decode(const DecodeArgs& a, int64_t batch_size) {
  const Schedule schedule = plan(a, batch_size);
  const int64_t num_q_heads = a.num_q_heads, head_dim = a.head_dim;
  // Per partial and query head: the max, the sum of exponentials, D weighted values.
  const int64_t partial_stride = head_dim + 2;
  std::vector<float> partials(schedule.num_partials * num_q_heads * partial_stride);
  const int64_t parts = static_cast<int64_t>(schedule.part_begin.size()) - 1;
  auto run_parts = [&](int64_t first_part, int64_t last_part) {
    Scratch<V> s(a);
    for (int64_t i = schedule.part_begin[first_part]; i < schedule.part_begin[last_part]; ++i) {
      const WorkItem& item = schedule.items[i];
      const HeadRange heads{item.first_kv_head, item.end_kv_head};
      attend_range<V, KV>(a, item.batch, item.begin, item.end, heads, s);
      for (int64_t qh = heads.first * a.group; qh < heads.end * a.group; ++qh) {
        const float* acc = s.acc.data() + qh * head_dim;
        if (item.partial < 0) {
          store_output_row<V>(a, item.batch * num_q_heads + qh, acc, 1.f / s.sum_exp[qh]);
        } else {
          float* p = partials.data() + (item.partial * num_q_heads + qh) * partial_stride;
          p[0] = s.max_score[qh];
          p[1] = s.sum_exp[qh];
          std::memcpy(p + 2, acc, head_dim * sizeof(float));
        }
      }
    }
  };
  if (schedule.parallel) {
    at::parallel_for(0, parts, 1, run_parts);
  } else {
    run_parts(0, parts);
  }
  if (schedule.merges.empty()) return;
  // out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
  auto merge = [&](int64_t first, int64_t last) {
    std::vector<float> merged(head_dim), weights;
    for (int64_t i = first; i < last; ++i) {
      const Schedule::Merge& m = schedule.merges[i];
      weights.resize(m.count);
      for (int64_t qh = 0; qh < num_q_heads; ++qh) {
        auto partial = [&](int64_t split) {
          return partials.data() + ((m.first_partial + split) * num_q_heads + qh) * partial_stride;
        };
        float global_max = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < m.count; ++sp) {
          global_max = ScalarVec::max(global_max, partial(sp)[0]);
        }
        float total = 0.f;
        for (int64_t sp = 0; sp < m.count; ++sp) {
          weights[sp] = std::exp(partial(sp)[0] - global_max);
          total += weights[sp] * partial(sp)[1];
        }
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t sp = 0; sp < m.count; ++sp) {
          const typename V::Reg w = V::set1(weights[sp]);
          const float* acc = partial(sp) + 2;
          for (int64_t lane = 0; lane < head_dim; lane += V::kWidth) {
            V::store(merged.data() + lane,
                     V::fma(w, V::load(acc + lane), V::load(merged.data() + lane)));
          }
        }
        store_output_row<V>(a, m.batch * num_q_heads + qh, merged.data(), 1.f / total);
      }
    }
  };
  // A handful of (sequence) merges of Hq x D values: not worth waking the other threads.
  merge(0, static_cast<int64_t>(schedule.merges.size()));
}

template <class V>
void run_decode_for_cache(const DecodeArgs& a, at::ScalarType cache_dtype, int64_t batch_size) {
  switch (cache_dtype) {
    case at::kFloat:
      return run_decode<V, float>(a, batch_size);
    case at::kBFloat16:
      return run_decode<V, c10::BFloat16>(a, batch_size);
    case at::kHalf:
      return run_decode<V, c10::Half>(a, batch_size);
    case at::kChar:
      return run_decode<V, int8_t>(a, batch_size);
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported cache dtype ", cache_dtype);
  }
}

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_scale(const at::Tensor& scale, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(scale.dim() == 4 && scale.sizes().slice(0, 3) == cache.sizes().slice(0, 3), name,
              " must be [num_blocks, block_size, Hkv, D // group], got ", scale.sizes());
  TORCH_CHECK(is_float_dtype(scale.scalar_type()), name, " must be fp16, bf16 or fp32");
  TORCH_CHECK(scale.stride(3) == 1, name, " must be contiguous in its last dim");
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                                  const at::Tensor& context_lens_in, double scale,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  bool batch_invariant, int64_t sliding_window,
                                  double logit_softcap) {
  TORCH_CHECK(query_in.dim() == 3, "query must be [B, Hq, D], got ", query_in.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache/v_cache must be [num_blocks, block_size, Hkv, D] of one shape");
  TORCH_CHECK(is_float_dtype(query_in.scalar_type()), "query must be fp32, bf16 or fp16");
  TORCH_CHECK(
      block_tables_in.scalar_type() == at::kInt && context_lens_in.scalar_type() == at::kInt,
      "block_tables and context_lens must be int32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(logit_softcap >= 0, "logit_softcap must be >= 0 (0: none), got ", logit_softcap);
  const int64_t batch = query_in.size(0), num_q_heads = query_in.size(1);
  const int64_t head_dim = query_in.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim ", k_cache.size(3), " != query's ",
              head_dim);
  TORCH_CHECK(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "Hq ", num_q_heads,
              " is not a multiple of Hkv ", num_kv_heads);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "caches must be contiguous in head_dim");
  TORCH_CHECK(block_tables_in.dim() == 2 && block_tables_in.size(0) == batch &&
                  context_lens_in.dim() == 1 && context_lens_in.size(0) == batch,
              "block_tables [B, W] and context_lens [B] must match the batch");
  // The query is usually a strided view of the fused qkv output: keep its strides.
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  const at::Tensor block_tables =
      block_tables_in.stride(1) == 1 ? block_tables_in : block_tables_in.contiguous();
  const at::Tensor context_lens = context_lens_in.contiguous();

  DecodeArgs a{};
  const bool quantized = k_cache.scalar_type() == at::kChar;
  if (quantized) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 KV cache needs k/v scales");
    check_scale(*k_scale, k_cache, "k_scale");
    check_scale(*v_scale, v_cache, "v_scale");
    TORCH_CHECK(k_scale->scalar_type() == v_scale->scalar_type(), "k/v scale dtypes differ");
    TORCH_CHECK(k_scale->size(3) == v_scale->size(3) && k_scale->size(3) > 0 &&
                    head_dim % k_scale->size(3) == 0,
                "scales per head ", k_scale->size(3), " must divide head_dim ", head_dim);
    a.k_scale = k_scale->data_ptr();
    a.v_scale = v_scale->data_ptr();
    a.scale_dtype = k_scale->scalar_type();
    a.k_scale_strides = RowStrides::of(*k_scale);
    a.v_scale_strides = RowStrides::of(*v_scale);
    a.num_scales = k_scale->size(3);
    a.quant_group = head_dim / a.num_scales;
  } else {
    TORCH_CHECK(is_float_dtype(k_cache.scalar_type()), "cache dtype ", k_cache.scalar_type(),
                " must be fp32, bf16, fp16 or int8");
  }
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_width = block_tables.size(1);
  // Validate every table entry the kernel will read: a bad one would read outside the cache.
  // Entries before a sliding window are not read (they may name freed blocks).
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= table_width * block_size, "context_lens[", b,
                "] = ", lens[b], " does not fit ", table_width, " blocks of ", block_size);
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    const int64_t first =
        sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) / block_size : 0;
    for (int64_t i = first; i < used; ++i) {
      const int32_t block = tables[b * block_tables.stride(0) + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", b, ", ", i, "] = ", block,
                  " is outside the cache's ", num_blocks, " blocks");
    }
  }

  at::Tensor out = at::empty({batch, num_q_heads, head_dim}, query.options());
  const int64_t row_bytes = num_q_heads * head_dim * out.element_size();
  for (int64_t b = 0; b < batch; ++b) {
    if (lens[b] == 0) std::memset(static_cast<char*>(out.data_ptr()) + b * row_bytes, 0, row_bytes);
  }
  a.batch_invariant = batch_invariant;
  a.query = query.data_ptr();
  a.query_dtype = query.scalar_type();
  a.query_stride_batch = query.stride(0);
  a.query_stride_head = query.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.k_strides = RowStrides::of(k_cache);
  a.v_strides = RowStrides::of(v_cache);
  a.block_tables = tables;
  a.table_stride = block_tables.stride(0);
  a.context_lens = lens;
  a.num_q_heads = num_q_heads;
  a.num_kv_heads = num_kv_heads;
  a.group = num_q_heads / num_kv_heads;
  a.head_dim = head_dim;
  a.block_size = block_size;
  a.scale = static_cast<float>(scale);
  a.sliding_window = sliding_window;
  a.logit_softcap = static_cast<float>(logit_softcap);
  a.out = out.data_ptr();
  if (batch == 0) return out;

  switch (pick_isa(head_dim, a.quant_group)) {
#if defined(LLMSERVE_HAVE_AVX512)
    case Isa::kAvx512:
      run_decode_for_cache<Avx512Vec>(a, k_cache.scalar_type(), batch);
      break;
#endif
#if defined(LLMSERVE_HAVE_AVX2)
    case Isa::kAvx2:
      run_decode_for_cache<Avx2Vec>(a, k_cache.scalar_type(), batch);
      break;
#endif
    default:
      run_decode_for_cache<ScalarVec>(a, k_cache.scalar_type(), batch);
      break;
  }
  return out;
}

at::Tensor paged_decode_attention_meta(const at::Tensor& query, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                       const at::Tensor& context_lens, double scale,
                                       const std::optional<at::Tensor>& k_scale,
                                       const std::optional<at::Tensor>& v_scale,
                                       bool batch_invariant, int64_t sliding_window,
                                       double logit_softcap) {
  TORCH_CHECK(query.dim() == 3, "query must be [B, Hq, D]");
  return at::empty(query.sizes(), query.options());
}

// The instruction set the kernels run with: "avx512", "avx2" or "scalar" (also when forced).
std::string cpu_kernel_isa() {
  if (llmserve_cpu::scalar_kernels_forced().load()) return ScalarVec::kName;
#if defined(LLMSERVE_HAVE_AVX512)
  return Avx512Vec::kName;
#elif defined(LLMSERVE_HAVE_AVX2)
  return Avx2Vec::kName;
#else
  return ScalarVec::kName;
#endif
}

// Forces the portable scalar kernels (to test them, or to compare); returns the old setting.
bool set_scalar_kernels(bool enabled) {
  return llmserve_cpu::scalar_kernels_forced().exchange(enabled);
}

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables,"
      " Tensor context_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None,"
      " bool batch_invariant=False, int sliding_window=0, float logit_softcap=0.0) -> Tensor");
  m.def("cpu_kernel_isa() -> str", &cpu_kernel_isa);
  m.def("set_scalar_kernels(bool enabled) -> bool", &set_scalar_kernels);
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

TORCH_LIBRARY_IMPL(llmserve, Meta, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_meta);
}
