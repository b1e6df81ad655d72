// Batched multi-LoRA on CPUs (Punica / S-LoRA "shrink then expand"): the tokens of a step come
// in contiguous segments, each with the slot of its adapter (-1: none), and
//
//   shrink  out[t, :]   = x[t] @ lora_a[slot].T                     fp32 (T, S * R)
//   expand  y[t, rows of slice i] += scales[slot] * v[t, i*R:(i+1)*R] @ lora_b[slot, rows].T
//
// with lora_a (num_slots, S * R, K), lora_b (num_slots, N, R), S output slices (a fused q|k|v
// or gate|up projection; 1 otherwise), R the padded max rank. kernels/lora_torch.py is the
// reference and says more about the layout.
//
// A decode step costs what reading each slot's A and B costs (a few dozen multiply-adds per
// weight read), so the tokens are first grouped by slot, in order of first appearance: all the
// segments sharing an adapter make one group and each work item (group, rows of A or B, a
// chunk of the group's tokens) streams its rows of that adapter once for all its tokens.
// Items split A's rows, B's rows and long groups' tokens, so one adapter's matrices are split
// between the threads instead of read by each.
//
// Shrink: dot products along K, tiles of up to 4 tokens x 2 rows of A in registers. Expand: R
// is short (8-64), so each vector of W output rows takes W dot products of length R reduced
// with one transpose-reduce, then y += scale * dots in fp32 with one rounding to y's dtype.
// Vector widths come from attention_vec.h: a backend needs K (shrink) or R (expand) to be a
// multiple of its width, else the next narrower one runs (R = 8 takes AVX2 on an AVX-512
// build; odd ranks the scalar code).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_vec.h"
#include "cpu_ops.h"

namespace {

using namespace llmserve_cpu;

// Tokens of one group per item: more would keep fewer threads busy on a long prefill segment,
// fewer would read the adapter's rows more often (from L2: they stay there within an item).
constexpr int64_t kShrinkTokenChunk = 16;
constexpr int64_t kExpandTokenChunk = 32;
// Output rows of B per expand item (64 x R=64 x 2 bytes = 8 KB: stays in L1 across tokens).
constexpr int64_t kExpandRowBlock = 64;
// Below this many multiply-adds, one thread: an OpenMP wake-up costs more than it saves.
constexpr int64_t kMinParallelMacs = 1 << 17;
// Register tile of the shrink.
constexpr int kShrinkTileTokens = 4;
constexpr int kShrinkTileRows = 2;

using SlotGroups = LoraSlotGroups;

void check_segment_tensors(const at::Tensor& seg_starts, const at::Tensor& seg_slots) {
  TORCH_CHECK(seg_slots.dim() == 1 && seg_slots.scalar_type() == at::kInt,
              "seg_slots must be int32 (num_segments,), got ", seg_slots.scalar_type(), " ",
              seg_slots.sizes());
  TORCH_CHECK(seg_starts.dim() == 1 && seg_starts.scalar_type() == at::kInt &&
                  seg_starts.size(0) == seg_slots.size(0) + 1,
              "seg_starts must be int32 (num_segments + 1,), got ", seg_starts.scalar_type(), " ",
              seg_starts.sizes());
}

}  // namespace

SlotGroups lora_group_rows(const at::Tensor& seg_starts_in, const at::Tensor& seg_slots_in,
                           int64_t num_tokens, int64_t num_slots) {
  check_segment_tensors(seg_starts_in, seg_slots_in);
  const at::Tensor seg_starts = seg_starts_in.contiguous();
  const at::Tensor seg_slots = seg_slots_in.contiguous();
  const int32_t* starts = seg_starts.data_ptr<int32_t>();
  const int32_t* slot_ids = seg_slots.data_ptr<int32_t>();
  const int64_t num_segments = seg_slots.size(0);
  TORCH_CHECK(starts[0] >= 0 && starts[num_segments] <= num_tokens,
              "seg_starts must lie in [0, num_tokens=", num_tokens, "], got ", starts[0], "..",
              starts[num_segments]);
  SlotGroups groups;
  std::vector<int64_t> group_of_slot(num_slots, -1);
  std::vector<int64_t> counts;
  for (int64_t s = 0; s < num_segments; ++s) {
    TORCH_CHECK(starts[s] <= starts[s + 1], "seg_starts must not decrease (segment ", s, ")");
    const int64_t slot = slot_ids[s];
    TORCH_CHECK(slot >= -1 && slot < num_slots, "seg_slots[", s, "] = ", slot,
                " is not -1 or a slot < ", num_slots);
    if (slot < 0 || starts[s] == starts[s + 1]) continue;
    if (group_of_slot[slot] < 0) {
      group_of_slot[slot] = groups.size();
      groups.slots.push_back(slot);
      counts.push_back(0);
    }
    counts[group_of_slot[slot]] += starts[s + 1] - starts[s];
  }
  for (int64_t c : counts) groups.offsets.push_back(groups.offsets.back() + c);
  groups.tokens.resize(groups.offsets.back());
  std::vector<int64_t> filled(groups.offsets.begin(), groups.offsets.end() - 1);
  for (int64_t s = 0; s < num_segments; ++s) {
    if (slot_ids[s] < 0) continue;
    int64_t& next = filled[group_of_slot[slot_ids[s]]];
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t) groups.tokens[next++] = t;
  }
  return groups;
}

namespace {

SlotGroups group_by_slot(const at::Tensor& seg_starts, const at::Tensor& seg_slots,
                         int64_t num_tokens, int64_t num_slots) {
  return lora_group_rows(seg_starts, seg_slots, num_tokens, num_slots);
}

// Runs items [0, n) on the threads, or on this one when the whole call is small.
template <class F>
void run_items(int64_t num_items, int64_t macs, const F& run) {
  if (num_items > 1 && macs >= kMinParallelMacs && !at::in_parallel_region()) {
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) run(i);
    });
  } else {
    for (int64_t i = 0; i < num_items; ++i) run(i);
  }
}

// ---- shrink ----------------------------------------------------------------------------

struct ShrinkArgs {
  const void* x;
  int64_t x_stride;
  const void* lora_a;  // (num_slots, rank, K) contiguous
  float* out;
  int64_t out_stride;
  int64_t rank, in_features;
};

struct ShrinkItem {
  int64_t group, token_begin, token_end, row_begin, row_end;  // tokens: indices into the group
};

// out[token i, row j] for up to kShrinkTileTokens tokens x kShrinkTileRows rows of A.
template <class V, typename T, int NT, int NR>
void shrink_tile(const T* const* x_rows, const T* a_rows, int64_t K, float* const* out_rows,
                 int64_t row) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  Reg acc[NT][NR];
  for (int i = 0; i < NT; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  }
  for (int64_t k = 0; k < K; k += W) {
    Reg a[NR];
    for (int j = 0; j < NR; ++j) a[j] = V::load(a_rows + j * K + k);
    for (int i = 0; i < NT; ++i) {
      const Reg xv = V::load(x_rows[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = V::fma(xv, a[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NT; ++i) {
    for (int j = 0; j < NR; ++j) out_rows[i][row + j] = V::reduce_add(acc[i][j]);
  }
}

template <class V, typename T, int NT>
void shrink_tokens(const T* const* x_rows, const T* a_slot, int64_t row_begin, int64_t row_end,
                   int64_t K, float* const* out_rows) {
  int64_t row = row_begin;
  for (; row + kShrinkTileRows <= row_end; row += kShrinkTileRows) {
    shrink_tile<V, T, NT, kShrinkTileRows>(x_rows, a_slot + row * K, K, out_rows, row);
  }
  for (; row < row_end; ++row) shrink_tile<V, T, NT, 1>(x_rows, a_slot + row * K, K, out_rows, row);
}

template <class V, typename T>
void run_shrink(const ShrinkArgs& a, const SlotGroups& groups) {
  const int64_t K = a.in_features;
  std::vector<ShrinkItem> items;
  for (int64_t g = 0; g < groups.size(); ++g) {
    for (int64_t t = 0; t < groups.count(g); t += kShrinkTokenChunk) {
      items.push_back({g, t, std::min(t + kShrinkTokenChunk, groups.count(g)), 0, a.rank});
    }
  }
  // Few items (decode with few adapters): split A's rows too, so the threads share the reads.
  const int64_t threads = at::get_num_threads();
  const int64_t row_splits =
      std::clamp<int64_t>((2 * threads + static_cast<int64_t>(items.size()) - 1) /
                              std::max<int64_t>(1, static_cast<int64_t>(items.size())),
                          1, std::max<int64_t>(1, a.rank / 4));
  if (row_splits > 1) {
    std::vector<ShrinkItem> split;
    const int64_t rows_per = (a.rank + row_splits - 1) / row_splits;
    for (const ShrinkItem& item : items) {
      for (int64_t r = 0; r < a.rank; r += rows_per) {
        split.push_back({item.group, item.token_begin, item.token_end, r,
                         std::min(r + rows_per, a.rank)});
      }
    }
    items.swap(split);
  }
  const int64_t macs = groups.offsets.back() * a.rank * K;
  run_items(static_cast<int64_t>(items.size()), macs, [&](int64_t i) {
    const ShrinkItem& item = items[i];
    const T* a_slot = static_cast<const T*>(a.lora_a) + groups.slots[item.group] * a.rank * K;
    const int64_t* tokens = groups.tokens.data() + groups.offsets[item.group];
    for (int64_t t = item.token_begin; t < item.token_end; t += kShrinkTileTokens) {
      const int n = static_cast<int>(std::min<int64_t>(kShrinkTileTokens, item.token_end - t));
      const T* x_rows[kShrinkTileTokens];
      float* out_rows[kShrinkTileTokens];
      for (int j = 0; j < n; ++j) {
        x_rows[j] = static_cast<const T*>(a.x) + tokens[t + j] * a.x_stride;
        out_rows[j] = a.out + tokens[t + j] * a.out_stride;
      }
      switch (n) {
        case 4:
          shrink_tokens<V, T, 4>(x_rows, a_slot, item.row_begin, item.row_end, K, out_rows);
          break;
        case 3:
          shrink_tokens<V, T, 3>(x_rows, a_slot, item.row_begin, item.row_end, K, out_rows);
          break;
        case 2:
          shrink_tokens<V, T, 2>(x_rows, a_slot, item.row_begin, item.row_end, K, out_rows);
          break;
        default:
          shrink_tokens<V, T, 1>(x_rows, a_slot, item.row_begin, item.row_end, K, out_rows);
          break;
      }
    }
  });
}

template <typename T>
void run_shrink_isa(const ShrinkArgs& a, const SlotGroups& groups) {
  switch (pick_isa(a.in_features, 0)) {
#if defined(LLMSERVE_HAVE_AVX512)
    case Isa::kAvx512:
      return run_shrink<Avx512Vec, T>(a, groups);
#endif
#if defined(LLMSERVE_HAVE_AVX2)
    case Isa::kAvx2:
      return run_shrink<Avx2Vec, T>(a, groups);
#endif
    default:
      return run_shrink<ScalarVec, T>(a, groups);
  }
}

void check_input(const at::Tensor& x, const at::Tensor& lora_a) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "x must be (num_tokens, in_features) with contiguous rows, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.size(2) == x.size(1) &&
                  lora_a.scalar_type() == x.scalar_type() && lora_a.is_contiguous(),
              "lora_a must be contiguous (num_slots, rank, in_features=", x.size(1), ") ",
              x.scalar_type(), ", got ", lora_a.scalar_type(), " ", lora_a.sizes());
}

void check_intermediate(const char* name, const at::Tensor& t, int64_t num_tokens, int64_t rank) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.size(0) == num_tokens &&
                  t.size(1) == rank && t.stride(1) == 1,
              name, " must be float32 (num_tokens, slices * rank) = (", num_tokens, ", ", rank,
              ") with contiguous rows, got ", t.scalar_type(), " ", t.sizes());
}

void shrink_checked(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& out,
                    const SlotGroups& groups) {
  if (groups.tokens.empty() || lora_a.size(1) == 0) return;
  const ShrinkArgs a{x.data_ptr(),      x.stride(0),     lora_a.data_ptr(), out.data_ptr<float>(),
                     out.stride(0),     lora_a.size(1),  x.size(1)};
  switch (x.scalar_type()) {
    case at::kBFloat16:
      return run_shrink_isa<c10::BFloat16>(a, groups);
    case at::kHalf:
      return run_shrink_isa<c10::Half>(a, groups);
    default:
      return run_shrink_isa<float>(a, groups);
  }
}

// ---- expand ----------------------------------------------------------------------------

struct ExpandArgs {
  const float* v;
  int64_t v_stride;
  const void* lora_b;  // (num_slots, N, R) contiguous
  const float* scales;
  void* y;
  int64_t y_stride;
  int64_t out_features, rank;
};

struct ExpandItem {
  int64_t group, token_begin, token_end, row_begin, row_end, v_offset;
};

template <class V, typename T>
void expand_rows(const ExpandArgs& a, const ExpandItem& item, const T* b_slot, float scale,
                 const int64_t* tokens) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  const int64_t R = a.rank;
  const Reg scale_v = V::set1(scale);
  int64_t row = item.row_begin;
  // W rows at a time: W dot products of length R, reduced into one vector of W outputs.
  for (; row + W <= item.row_end; row += W) {
    const T* b_rows = b_slot + row * R;
    for (int64_t t = item.token_begin; t < item.token_end; ++t) {
      const float* v_row = a.v + tokens[t] * a.v_stride + item.v_offset;
      T* y_row = static_cast<T*>(a.y) + tokens[t] * a.y_stride + row;
      Reg acc[W];
      for (int64_t i = 0; i < W; ++i) acc[i] = V::zero();
      for (int64_t r = 0; r < R; r += W) {
        const Reg vv = V::load(v_row + r);
        for (int64_t i = 0; i < W; ++i) acc[i] = V::fma(vv, V::load(b_rows + i * R + r), acc[i]);
      }
      const Reg dots = V::transpose_reduce(acc);
      V::store(y_row, V::add(V::load(y_row), V::mul(dots, scale_v)));
    }
  }
  // The rows left (a slice not a multiple of W): one dot product each.
  for (; row < item.row_end; ++row) {
    const T* b_row = b_slot + row * R;
    for (int64_t t = item.token_begin; t < item.token_end; ++t) {
      const float* v_row = a.v + tokens[t] * a.v_stride + item.v_offset;
      T* y_elem = static_cast<T*>(a.y) + tokens[t] * a.y_stride + row;
      Reg acc = V::zero();
      for (int64_t r = 0; r < R; r += W) acc = V::fma(V::load(v_row + r), V::load(b_row + r), acc);
      const float dot = V::reduce_add(acc);
      ScalarVec::store(y_elem, ScalarVec::load(y_elem) + dot * scale);
    }
  }
}

template <class V, typename T>
void run_expand(const ExpandArgs& a, const SlotGroups& groups, const std::vector<int64_t>& slices) {
  std::vector<ExpandItem> items;
  for (int64_t g = 0; g < groups.size(); ++g) {
    for (int64_t t = 0; t < groups.count(g); t += kExpandTokenChunk) {
      const int64_t t_end = std::min(t + kExpandTokenChunk, groups.count(g));
      int64_t slice_begin = 0;
      for (size_t s = 0; s < slices.size(); ++s) {
        const int64_t slice_end = slice_begin + slices[s];
        for (int64_t r = slice_begin; r < slice_end; r += kExpandRowBlock) {
          items.push_back({g, t, t_end, r, std::min(r + kExpandRowBlock, slice_end),
                           static_cast<int64_t>(s) * a.rank});
        }
        slice_begin = slice_end;
      }
    }
  }
  const int64_t macs = groups.offsets.back() * a.out_features * a.rank;
  run_items(static_cast<int64_t>(items.size()), macs, [&](int64_t i) {
    const ExpandItem& item = items[i];
    const int64_t slot = groups.slots[item.group];
    const T* b_slot = static_cast<const T*>(a.lora_b) + slot * a.out_features * a.rank;
    expand_rows<V, T>(a, item, b_slot, a.scales[slot],
                      groups.tokens.data() + groups.offsets[item.group]);
  });
}

template <typename T>
void run_expand_isa(const ExpandArgs& a, const SlotGroups& groups,
                    const std::vector<int64_t>& slices) {
  switch (pick_isa(a.rank, 0)) {
#if defined(LLMSERVE_HAVE_AVX512)
    case Isa::kAvx512:
      return run_expand<Avx512Vec, T>(a, groups, slices);
#endif
#if defined(LLMSERVE_HAVE_AVX2)
    case Isa::kAvx2:
      return run_expand<Avx2Vec, T>(a, groups, slices);
#endif
    default:
      return run_expand<ScalarVec, T>(a, groups, slices);
  }
}

std::vector<int64_t> check_output(const at::Tensor& y, const at::Tensor& lora_b,
                                  const at::Tensor& scales, at::IntArrayRef out_slices) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1,
              "y must be (num_tokens, out_features) with contiguous rows, got ", y.sizes());
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16 ||
                  y.scalar_type() == at::kHalf,
              "y must be float32, bfloat16 or float16, got ", y.scalar_type());
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.size(1) == y.size(1) &&
                  lora_b.scalar_type() == y.scalar_type() && lora_b.is_contiguous(),
              "lora_b must be contiguous (num_slots, out_features=", y.size(1), ", rank) ",
              y.scalar_type(), ", got ", lora_b.scalar_type(), " ", lora_b.sizes());
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == lora_b.size(0) &&
                  scales.scalar_type() == at::kFloat,
              "scales must be float32 (num_slots,) = (", lora_b.size(0), ",), got ",
              scales.scalar_type(), " ", scales.sizes());
  std::vector<int64_t> slices(out_slices.begin(), out_slices.end());
  if (slices.empty()) slices.push_back(y.size(1));
  int64_t total = 0;
  for (int64_t size : slices) {
    TORCH_CHECK(size > 0, "out_slices must be positive, got ", out_slices);
    total += size;
  }
  TORCH_CHECK(total == y.size(1), "out_slices ", out_slices, " must sum to out_features ",
              y.size(1));
  return slices;
}

void expand_checked(const at::Tensor& v, const at::Tensor& lora_b, const at::Tensor& scales_in,
                    const at::Tensor& y, const std::vector<int64_t>& slices,
                    const SlotGroups& groups) {
  if (groups.tokens.empty() || lora_b.size(2) == 0) return;
  const at::Tensor scales = scales_in.contiguous();
  const ExpandArgs a{v.data_ptr<float>(), v.stride(0),    lora_b.data_ptr(), scales.data_ptr<float>(),
                     y.data_ptr(),        y.stride(0),    y.size(1),         lora_b.size(2)};
  switch (y.scalar_type()) {
    case at::kBFloat16:
      return run_expand_isa<c10::BFloat16>(a, groups, slices);
    case at::kHalf:
      return run_expand_isa<c10::Half>(a, groups, slices);
    default:
      return run_expand_isa<float>(a, groups, slices);
  }
}

// ---- ops -------------------------------------------------------------------------------

void lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& seg_starts,
                 const at::Tensor& seg_slots, const at::Tensor& out) {
  check_input(x, lora_a);
  check_intermediate("out", out, x.size(0), lora_a.size(1));
  const SlotGroups groups = group_by_slot(seg_starts, seg_slots, x.size(0), lora_a.size(0));
  shrink_checked(x, lora_a, out, groups);
}

void lora_expand(const at::Tensor& v, const at::Tensor& lora_b, const at::Tensor& seg_starts,
                 const at::Tensor& seg_slots, const at::Tensor& scales, const at::Tensor& y,
                 at::IntArrayRef out_slices) {
  const std::vector<int64_t> slices = check_output(y, lora_b, scales, out_slices);
  check_intermediate("v", v, y.size(0), static_cast<int64_t>(slices.size()) * lora_b.size(2));
  const SlotGroups groups = group_by_slot(seg_starts, seg_slots, y.size(0), lora_b.size(0));
  expand_checked(v, lora_b, scales, y, slices, groups);
}

}  // namespace

// Shrink then expand in one call: the slot groups are built once and the fp32 intermediate
// (num_tokens x S * R, a few KB) never leaves the op. Outside the anonymous namespace: the
// fused decode step (llama_decode.cpp) calls it per projection, through cpu_ops.h.
void lora_apply(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& seg_starts, const at::Tensor& seg_slots,
                const at::Tensor& scales, const at::Tensor& y, at::IntArrayRef out_slices) {
  check_input(x, lora_a);
  const std::vector<int64_t> slices = check_output(y, lora_b, scales, out_slices);
  TORCH_CHECK(y.size(0) == x.size(0), "y has ", y.size(0), " tokens, x ", x.size(0));
  TORCH_CHECK(lora_a.size(0) == lora_b.size(0), "lora_a ", lora_a.sizes(), " and lora_b ",
              lora_b.sizes(), " differ in num_slots");
  TORCH_CHECK(lora_a.size(1) == static_cast<int64_t>(slices.size()) * lora_b.size(2),
              "lora_a's rank ", lora_a.size(1), " must be slices x lora_b's rank = ",
              slices.size(), " x ", lora_b.size(2));
  const SlotGroups groups = group_by_slot(seg_starts, seg_slots, x.size(0), lora_a.size(0));
  if (groups.tokens.empty()) return;
  const at::Tensor v = at::empty({x.size(0), lora_a.size(1)}, x.options().dtype(at::kFloat));
  shrink_checked(x, lora_a, v, groups);
  expand_checked(v, lora_b, scales, y, slices, groups);
}

void lora_apply_grouped_fp32(const float* x, int64_t x_stride, int64_t in_features,
                             const float* lora_a, const float* lora_b, int64_t rank,
                             int64_t out_features, const float* scales, float* y,
                             int64_t y_stride, float* v, const LoraSlotGroups& groups) {
  if (groups.tokens.empty() || rank == 0) return;
  const ShrinkArgs shrink{x, x_stride, lora_a, v, rank, rank, in_features};
  run_shrink_isa<float>(shrink, groups);
  const ExpandArgs expand{v, rank, lora_b, scales, y, y_stride, out_features, rank};
  run_expand_isa<float>(expand, groups, {out_features});
}

namespace {

void lora_shrink_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&) {}
void lora_expand_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, at::IntArrayRef) {}
void lora_apply_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def(
      "lora_shrink(Tensor x, Tensor lora_a, Tensor seg_starts, Tensor seg_slots,"
      " Tensor(a!) out) -> ()");
  m.def(
      "lora_expand(Tensor v, Tensor lora_b, Tensor seg_starts, Tensor seg_slots, Tensor scales,"
      " Tensor(a!) y, int[] out_slices=[]) -> ()");
  m.def(
      "lora_apply(Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_starts, Tensor seg_slots,"
      " Tensor scales, Tensor(a!) y, int[] out_slices=[]) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand", &lora_expand);
  m.impl("lora_apply", &lora_apply);
}

TORCH_LIBRARY_IMPL(llmserve, Meta, m) {
  m.impl("lora_shrink", &lora_shrink_meta);
  m.impl("lora_expand", &lora_expand_meta);
  m.impl("lora_apply", &lora_apply_meta);
}
