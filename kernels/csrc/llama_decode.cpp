// A pure-decode step of a Llama-family model whose projections are GGUF blocks, all decoder
// layers in one call: what services/worker/model/llama.py computes for one query token per
// sequence, without going back to Python between ops.
//
// Why: at batch 1 a layer is ten small ops around four matrix-vector products; dispatched from
// Python (eager) or from a compiled graph's wrapper, the calls between them cost as much as
// the products themselves (~150 us a layer, measured). Here they are plain loops over [B, H]
// rows, and the heavy parts are this library's own kernels called directly:
//
//   per layer   h, r = rms_norm(h + r)                 (layer 0: r = h, h = rms_norm(h))
//               qkv = gguf_linear(h) (+ bias)          [B, (Hq + 2 Hkv) D], any GGUF kinds
//               q, k = rms_norm of each head (Qwen3; only with q_norms / k_norms)
//               rotary(q, k) at positions; write k, v at slot_mapping
//               a = paged_decode_attention(q)          [B, Hq D], the layer's sliding window
//               h, r = rms_norm(gguf_linear(a) + r)
//               h = gguf_linear(silu(gate) * up)       gate | up = gguf_linear(h)
//   returns     (h, r) of the last layer; the final norm and the vocabulary stay in Python.
//
// With LoRA tables (services/worker/lora/slots.py) each of the four products then gets its
// rows' adapter deltas, as the eager layers add them (batch.lora.add after each projection):
// lora.cpp's batched shrink-then-expand over the step's segment table, one row per sequence.
//
// Math is fp32 throughout (a bf16 model's norms come in as fp32 copies and its cache is read
// with a bf16 query), as the torch references do it (kernels/*_torch.py): the rotary
// pairs (i, i + R/2) of the NeoX convention over the first R = rope.size(1) dims of each head
// (R < D: partial rotary, the rest pass through), rms_norm as x * (1 / sqrt(mean(x^2) + eps))
// * w. The head dim D is the KV caches'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "attention_vec.h"
#include "cpu_ops.h"

namespace {

// Each kernel call records itself under its op's name when torch.profiler runs (a flag check
// otherwise), so a step profile still sees matmuls, attention and KV writes apart.
#define LLMSERVE_RECORD(name) RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{})

// ggml's type ids of the unquantized tensors: a projection stored dense (a safetensors model,
// or a GGUF file's F32/F16/BF16 tensors) is one part of one of these kinds.
constexpr int64_t kDenseF32 = 0, kDenseF16 = 1, kDenseBF16 = 30;
constexpr bool is_dense_kind(int64_t kind) {
  return kind == kDenseF32 || kind == kDenseF16 || kind == kDenseBF16;
}
inline at::ScalarType dense_dtype(int64_t kind) {
  return kind == kDenseF32 ? at::kFloat : kind == kDenseF16 ? at::kHalf : at::kBFloat16;
}

// The layers' projections: parts (GGUF block tensors, or one dense weight) in layer order,
// q|k|v, o, gate|up, down, each projection one or more parts (a file may store a fused layer's
// parts in different kinds).
class Projections {
 public:
  Projections(at::TensorList parts, at::IntArrayRef kinds, at::IntArrayRef part_counts,
              size_t num_layers)
      : parts_(parts), kinds_(kinds), part_counts_(part_counts) {
    TORCH_CHECK(parts.size() == kinds.size(),
                "llama_decode_layers: one kind per projection part");
    TORCH_CHECK(part_counts.size() == 4 * num_layers,
                "llama_decode_layers: part_counts must hold 4 per layer");
    int64_t first = 0;
    for (size_t index = 0; index < part_counts.size(); ++index) {
      const int64_t count = part_counts[index];
      TORCH_CHECK(count > 0, "llama_decode_layers: a projection has no parts");
      for (int64_t part = first; part < first + count && static_cast<size_t>(part) < kinds.size(); ++part) {
        TORCH_CHECK(!is_dense_kind(kinds[part]) ||
                        (count == 1 && parts[part].dim() == 2 &&
                         parts[part].scalar_type() == dense_dtype(kinds[part])),
                    "llama_decode_layers: a dense projection is one [N, K] weight of its kind's "
                    "dtype");
      }
      first_.push_back(first);
      first += count;
    }
    TORCH_CHECK(static_cast<size_t>(first) == parts.size(),
                "llama_decode_layers: part_counts add up to ", first, ", not ", parts.size());
  }

  // x @ W^T of projection `which` (0 q|k|v, 1 o, 2 gate|up, 3 down) of `layer`.
  at::Tensor apply(const at::Tensor& x, size_t layer, int which, bool int8_activations) const {
    const size_t index = 4 * layer + which;
    const int64_t first = first_[index], count = part_counts_[index];
    if (count == 1 && is_dense_kind(kinds_[first])) {
      // A dense weight [N, K] in the model's dtype: the product the eager layer computes
      // (x rounded to a bf16/fp16 weight's dtype, the product rounded back), widened to fp32.
      LLMSERVE_RECORD("aten::mm");
      const at::Tensor& weight = parts_[first];
      return at::linear(x.to(weight.scalar_type()), weight).to(at::kFloat);
    }
    LLMSERVE_RECORD("llmserve::gguf_linear");
    if (count == 1) return gguf_linear(x, parts_[first], kinds_[first], int8_activations);
    return gguf_linear_parts(x, parts_.slice(first, count), kinds_.slice(first, count),
                             int8_activations);
  }

 private:
  at::TensorList parts_;
  at::IntArrayRef kinds_, part_counts_;
  std::vector<int64_t> first_;
};

// Rows per task of the elementwise loops: a decode step of a small model is a few thousand
// values per op, below what waking a second thread is worth.
constexpr int64_t kMinParallelValues = 16384;

int64_t row_grain(int64_t row_values) {
  return std::max<int64_t>(1, kMinParallelValues / std::max<int64_t>(1, row_values));
}

// out[i] = x[i] * (1 / sqrt(mean(x^2) + eps)) * weight[i]
inline void rms_norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inverse * weight[i];
}

// residual += delta (when there is one); hidden = rms_norm(residual): the fused add + norm
// between sublayers.
void add_rms_norm(const at::Tensor* delta, at::Tensor& residual, const at::Tensor& weight,
                  float eps, at::Tensor& hidden) {
  const int64_t rows = residual.size(0), n = residual.size(1);
  const float* d = delta != nullptr ? delta->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* r = residual.data_ptr<float>();
  float* h = hidden.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* rr = r + m * n;
      if (d != nullptr) {
        const float* dr = d + m * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) rr[i] += dr[i];
      }
      rms_norm_row(rr, w, eps, n, h + m * n);
    }
  });
}

// Rotates the first R dims of the q and k heads of each qkv row in place at its position
// (cos | sin table rows of R values).
void rotate_qkv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& rope,
                int64_t num_rotated_heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0), row_stride = qkv.size(1);
  const int64_t rotary_dim = rope.size(1), half = rotary_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_positions = rope.size(0);
  for (int64_t m = 0; m < rows; ++m) {
    TORCH_CHECK(pos[m] >= 0 && pos[m] < max_positions, "llama_decode_layers: position ",
                pos[m], " is outside the rotary table of ", max_positions);
  }
  const float* table = rope.data_ptr<float>();
  float* base = qkv.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(num_rotated_heads * head_dim),
                   [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* cos = table + pos[m] * rotary_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < num_rotated_heads; ++h) {
        float* x = base + m * row_stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * cos[i] - x2 * sin[i];
          x[i + half] = x2 * cos[i] + x1 * sin[i];
        }
      }
    }
  });
}

// RMS-normalizes `num_heads` heads of D values from `first_head` on, in every qkv row, in place
// with one weight [D] for all of them (Qwen3's q_norm / k_norm, before the rotary).
void norm_heads(at::Tensor& qkv, int64_t first_head, int64_t num_heads, int64_t head_dim,
                const at::Tensor& weight, float eps) {
  const int64_t rows = qkv.size(0), row_stride = qkv.size(1);
  const float* w = weight.data_ptr<float>();
  float* base = qkv.data_ptr<float>() + first_head * head_dim;
  at::parallel_for(0, rows, row_grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x = base + m * row_stride + h * head_dim;
        rms_norm_row(x, w, eps, head_dim, x);
      }
    }
  });
}

// dst = silu(gate) * up over n values, silu(g) = g / (1 + exp(-g)), with the vector exp of
// the attention kernels (~1 ulp): glibc's scalar expf made this loop a tenth of a batch-16
// decode step.
template <class V>
void silu_and_mul_row(const float* gate, const float* up, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (V::kWidth > 1) {
    const typename V::Reg one = V::set1(1.f), minus_one = V::set1(-1.f);
    for (; i + V::kWidth <= n; i += V::kWidth) {
      const typename V::Reg g = V::load(gate + i);
      const typename V::Reg sigmoid_denominator = V::add(one, V::exp(V::mul(g, minus_one)));
      V::store(dst + i, V::mul(V::div(g, sigmoid_denominator), V::load(up + i)));
    }
  }
  for (; i < n; ++i) dst[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

using SiluRow = void (*)(const float*, const float*, float*, int64_t);

SiluRow silu_row_kernel() {
  using namespace llmserve_cpu;
  if (scalar_kernels_forced().load(std::memory_order_relaxed)) {
    return &silu_and_mul_row<ScalarVec>;
  }
#if defined(LLMSERVE_HAVE_AVX512)
  return &silu_and_mul_row<Avx512Vec>;
#elif defined(LLMSERVE_HAVE_AVX2)
  return &silu_and_mul_row<Avx2Vec>;
#else
  return &silu_and_mul_row<ScalarVec>;
#endif
}

// [B, 2I] = [gate | up] -> silu(gate) * up [B, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const SiluRow row_kernel = silu_row_kernel();
  at::parallel_for(0, rows, row_grain(inner), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* gate = in + m * 2 * inner;
      row_kernel(gate, gate + inner, o + m * inner, inner);
    }
  });
  return out;
}

// The step's LoRA adapters, or none: per projection (q|k|v, o, gate|up, down) every layer's
// A [layers, slots, S * R, in] and B [layers, slots, out, S * R] stacked over the slots, the
// slots' scales, and the segment table of the batch's rows (slot -1: the base model).
class LoraTables {
 public:
  LoraTables(at::TensorList lora_a, at::TensorList lora_b,
             const std::optional<at::Tensor>& scales,
             const std::optional<at::Tensor>& seg_starts,
             const std::optional<at::Tensor>& seg_slots, size_t num_layers, int64_t batch)
      : lora_a_(lora_a), lora_b_(lora_b) {
    if (lora_a.empty() && lora_b.empty()) return;
    TORCH_CHECK(lora_a.size() == 4 && lora_b.size() == 4,
                "llama_decode_layers: lora_a and lora_b hold one table per projection (4)");
    TORCH_CHECK(scales.has_value() && seg_starts.has_value() && seg_slots.has_value(),
                "llama_decode_layers: LoRA tables need lora_scales, lora_seg_starts and "
                "lora_seg_slots");
    for (size_t which = 0; which < 4; ++which) {
      for (const at::Tensor& table : {lora_a[which], lora_b[which]}) {
        TORCH_CHECK(table.dim() == 4 && table.size(0) == static_cast<int64_t>(num_layers) &&
                        table.scalar_type() == lora_a[0].scalar_type(),
                    "llama_decode_layers: a LoRA table must be [", num_layers,
                    " layers, slots, rows, cols] of one dtype, got ", table.scalar_type(), " ",
                    table.sizes());
      }
    }
    scales_ = *scales;
    seg_starts_ = seg_starts->contiguous();
    seg_slots_ = seg_slots->contiguous();
    TORCH_CHECK(seg_starts_.scalar_type() == at::kInt && seg_slots_.scalar_type() == at::kInt &&
                    seg_starts_.dim() == 1 && seg_starts_.size(0) == seg_slots_.size(0) + 1,
                "llama_decode_layers: lora_seg_starts int32 [segments + 1] and lora_seg_slots "
                "int32 [segments]");
    const int32_t* starts = seg_starts_.data_ptr<int32_t>();
    const int32_t* slots = seg_slots_.data_ptr<int32_t>();
    for (int64_t s = 0; s < seg_slots_.size(0); ++s) {
      TORCH_CHECK(0 <= starts[s] && starts[s] <= starts[s + 1] && starts[s + 1] <= batch,
                  "llama_decode_layers: lora_seg_starts must rise within the batch of ", batch);
      if (slots[s] >= 0 && starts[s] < starts[s + 1]) {
        adapter_rows_.emplace_back(starts[s], starts[s + 1] - starts[s]);
      }
    }
    if (adapter_rows_.empty() || lora_a[0].scalar_type() != at::kFloat) return;
    // fp32 tables: the rows are grouped by slot once for the step's 4 x layers products, and
    // each product reads its layer's tables by pointer: no tensor made, nothing checked again.
    const int64_t num_slots = lora_a[0].size(1);
    groups_ = lora_group_rows(seg_starts_, seg_slots_, batch, num_slots);
    int64_t max_rank = 0;
    for (size_t which = 0; which < 4; ++which) {
      const at::Tensor& a = lora_a[which];
      const at::Tensor& b = lora_b[which];
      TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.size(1) == num_slots &&
                      b.size(1) == num_slots && b.size(3) == a.size(2),
                  "llama_decode_layers: LoRA tables must be contiguous [layers, slots, rank, in] "
                  "and [layers, slots, out, rank], got ", a.sizes(), " and ", b.sizes());
      fp32_[which] = {a.data_ptr<float>(), b.data_ptr<float>(), a.size(2), a.size(3), b.size(2),
                      a.stride(0), b.stride(0)};
      max_rank = std::max(max_rank, a.size(2));
    }
    scratch_ = at::empty({batch, max_rank}, lora_a[0].options());
    scales_ = scales_.contiguous();
  }

  // y += the delta of projection `which` (0 q|k|v, 1 o, 2 gate|up, 3 down) of `layer` for the
  // rows with an adapter; x [B, in] and y [B, out] fp32.
  void add(const at::Tensor& x, at::Tensor& y, size_t layer, int which) const {
    if (adapter_rows_.empty()) return;
    LLMSERVE_RECORD("llmserve::lora_apply");
    if (scratch_.defined()) {
      const Fp32Tables& t = fp32_[which];
      TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                      x.stride(1) == 1 && y.stride(1) == 1 && x.size(1) == t.in_features &&
                      y.size(1) == t.out_features,
                  "llama_decode_layers: LoRA projection ", which, " got x ", x.sizes(), " y ",
                  y.sizes());
      const int64_t index = static_cast<int64_t>(layer);
      lora_apply_grouped_fp32(x.data_ptr<float>(), x.stride(0), t.in_features,
                              t.lora_a + index * t.a_layer_stride,
                              t.lora_b + index * t.b_layer_stride, t.rank, t.out_features,
                              scales_.data_ptr<float>(), y.data_ptr<float>(), y.stride(0),
                              scratch_.data_ptr<float>(), groups_);
      return;
    }
    const at::Tensor lora_a = lora_a_[which].select(0, static_cast<int64_t>(layer));
    const at::Tensor lora_b = lora_b_[which].select(0, static_cast<int64_t>(layer));
    const auto dtype = lora_a.scalar_type();
    if (dtype == at::kFloat) {
      lora_apply(x, lora_a, lora_b, seg_starts_, seg_slots_, scales_, y, {});
      return;
    }
    // A bf16/fp16 model's tables: x and y in that dtype and each sum rounded once to it, as
    // its eager layers compute them. Only the adapters' rows come back: a base-model row keeps
    // its fp32 product, whatever the batch around it holds.
    at::Tensor rounded = y.to(dtype);
    lora_apply(x.to(dtype), lora_a, lora_b, seg_starts_, seg_slots_, scales_, rounded, {});
    for (const auto& [first, count] : adapter_rows_) {
      y.narrow(0, first, count).copy_(rounded.narrow(0, first, count));
    }
  }

 private:
  // One projection's fp32 tables of every layer: layer l's at l * the layer stride.
  struct Fp32Tables {
    const float* lora_a = nullptr;
    const float* lora_b = nullptr;
    int64_t rank = 0, in_features = 0, out_features = 0, a_layer_stride = 0, b_layer_stride = 0;
  };

  at::TensorList lora_a_, lora_b_;
  at::Tensor scales_, seg_starts_, seg_slots_;
  LoraSlotGroups groups_;
  Fp32Tables fp32_[4];
  at::Tensor scratch_;  // defined: the fp32 path
  std::vector<std::pair<int64_t, int64_t>> adapter_rows_;  // (first row, rows) with a slot
};

void check_layer_lists(size_t num_layers, at::TensorList list, const char* name) {
  TORCH_CHECK(list.size() == num_layers, "llama_decode_layers: ", name, " has ", list.size(),
              " tensors for ", num_layers, " layers");
}

void check_fp32_vector(const at::Tensor& t, int64_t size, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == size &&
                  t.is_contiguous(),
              "llama_decode_layers: ", name, " must be fp32 [", size, "], got ",
              t.scalar_type(), " ", t.sizes());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> llama_decode_layers(
    const at::Tensor& hidden_in, at::TensorList input_norms, at::TensorList post_norms,
    at::TensorList projection_parts, at::IntArrayRef kinds, at::IntArrayRef part_counts,
    at::TensorList qkv_bias,
    at::TensorList k_caches, at::TensorList v_caches, at::TensorList k_scales,
    at::TensorList v_scales, const at::Tensor& positions_in, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& rope,
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale, bool int8_activations,
    at::IntArrayRef sliding_windows, at::TensorList q_norms, at::TensorList k_norms,
    bool query_in_cache_dtype, at::TensorList lora_a, at::TensorList lora_b,
    const std::optional<at::Tensor>& lora_scales, const std::optional<at::Tensor>& lora_seg_starts,
    const std::optional<at::Tensor>& lora_seg_slots) {
  const size_t num_layers = input_norms.size();
  TORCH_CHECK(num_layers > 0, "llama_decode_layers: no layers");
  for (auto [list, name] : {std::pair{post_norms, "post_norms"}, {k_caches, "k_caches"},
                            {v_caches, "v_caches"}}) {
    check_layer_lists(num_layers, list, name);
  }
  const Projections projections(projection_parts, kinds, part_counts, num_layers);
  TORCH_CHECK(sliding_windows.size() == num_layers,
              "llama_decode_layers: sliding_windows must hold one window per layer (0: none)");
  TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == num_layers,
              "llama_decode_layers: qkv_bias is empty or one per layer");
  TORCH_CHECK(q_norms.size() == k_norms.size() && (q_norms.empty() || q_norms.size() == num_layers),
              "llama_decode_layers: q_norms and k_norms are both empty or one per layer each");
  const bool quantized_cache = !k_scales.empty();
  if (quantized_cache) {
    check_layer_lists(num_layers, k_scales, "k_scales");
    check_layer_lists(num_layers, v_scales, "v_scales");
  }
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kFloat,
              "llama_decode_layers: hidden must be fp32 [B, H]");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.dim() == 2 && rope.is_contiguous(),
              "llama_decode_layers: rope must be a contiguous fp32 [max_positions, R] table");
  TORCH_CHECK(k_caches[0].dim() == 4,
              "llama_decode_layers: caches must be [num_blocks, block_size, Hkv, D]");
  const int64_t batch = hidden_in.size(0), hidden_size = hidden_in.size(1);
  const int64_t head_dim = k_caches[0].size(3);
  TORCH_CHECK(rope.size(1) % 2 == 0 && rope.size(1) <= head_dim, "llama_decode_layers: rope ",
              "has ", rope.size(1), " values a row, an even number up to the head dim ", head_dim);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(positions_in.dim() == 1 && positions_in.size(0) == batch,
              "llama_decode_layers: positions must be [B]");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const float epsilon = static_cast<float>(eps);
  const LoraTables lora(lora_a, lora_b, lora_scales, lora_seg_starts, lora_seg_slots, num_layers,
                        batch);

  at::Tensor residual = hidden_in.contiguous().clone();
  at::Tensor hidden = at::empty_like(residual);
  at::Tensor delta;  // the last sublayer's output, added to the residual by the next norm
  for (size_t l = 0; l < num_layers; ++l) {
    check_fp32_vector(input_norms[l], hidden_size, "input_norms");
    check_fp32_vector(post_norms[l], hidden_size, "post_norms");
    // Layer 0 norms the embedding itself; later layers first add the MLP's output.
    add_rms_norm(l == 0 ? nullptr : &delta, residual, input_norms[l], epsilon, hidden);
    at::Tensor qkv = projections.apply(hidden, l, 0, int8_activations);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "llama_decode_layers: qkv_proj gives ",
                qkv.size(1), " features, the heads need ", q_size + 2 * kv_size);
    if (!qkv_bias.empty()) qkv.add_(qkv_bias[l]);
    lora.add(hidden, qkv, l, 0);
    if (!q_norms.empty()) {
      check_fp32_vector(q_norms[l], head_dim, "q_norms");
      check_fp32_vector(k_norms[l], head_dim, "k_norms");
      norm_heads(qkv, 0, num_heads, head_dim, q_norms[l], epsilon);
      norm_heads(qkv, num_heads, num_kv_heads, head_dim, k_norms[l], epsilon);
    }
    rotate_qkv(qkv, positions, rope, num_heads + num_kv_heads, head_dim);
    const at::Tensor query = qkv.narrow(1, 0, q_size).view({batch, num_heads, head_dim});
    const at::Tensor key = qkv.narrow(1, q_size, kv_size).view({batch, num_kv_heads, head_dim});
    const at::Tensor value =
        qkv.narrow(1, q_size + kv_size, kv_size).view({batch, num_kv_heads, head_dim});
    std::optional<at::Tensor> k_scale, v_scale;
    if (quantized_cache) {
      k_scale = k_scales[l];
      v_scale = v_scales[l];
    }
    {
      LLMSERVE_RECORD("llmserve::write_kv_cache");
      write_kv_cache(key, value, k_caches[l], v_caches[l], slot_mapping, k_scale, v_scale);
    }
    at::Tensor attended;
    {
      LLMSERVE_RECORD("llmserve::paged_decode_attention");
      // A bf16/fp16 model's cache is read with a query of its own dtype, as the model's eager
      // layers do (query_in_cache_dtype); a float32 model's query stays float32 over any
      // cache. Everything around it stays fp32.
      const auto cache_type = k_caches[l].scalar_type();
      const bool cast_query =
          query_in_cache_dtype && !quantized_cache && cache_type != at::kFloat;
      attended = paged_decode_attention(cast_query ? query.to(cache_type) : query, k_caches[l],
                                        v_caches[l], block_tables, context_lens, scale, k_scale,
                                        v_scale, /*batch_invariant=*/false, sliding_windows[l]);
      if (cast_query) attended = attended.to(at::kFloat);
    }
    const at::Tensor heads = attended.view({batch, q_size});
    delta = projections.apply(heads, l, 1, int8_activations);
    lora.add(heads, delta, l, 1);
    add_rms_norm(&delta, residual, post_norms[l], epsilon, hidden);
    at::Tensor gate_up = projections.apply(hidden, l, 2, int8_activations);
    lora.add(hidden, gate_up, l, 2);
    const at::Tensor gated = silu_and_mul(gate_up);
    delta = projections.apply(gated, l, 3, int8_activations);
    lora.add(gated, delta, l, 3);
  }
  return {delta, residual};
}

std::tuple<at::Tensor, at::Tensor> llama_decode_layers_meta(
    const at::Tensor& hidden, at::TensorList input_norms, at::TensorList post_norms,
    at::TensorList projection_parts, at::IntArrayRef kinds, at::IntArrayRef part_counts,
    at::TensorList qkv_bias,
    at::TensorList k_caches, at::TensorList v_caches, at::TensorList k_scales,
    at::TensorList v_scales, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& rope,
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale, bool int8_activations,
    at::IntArrayRef sliding_windows, at::TensorList q_norms, at::TensorList k_norms,
    bool query_in_cache_dtype, at::TensorList lora_a, at::TensorList lora_b,
    const std::optional<at::Tensor>& lora_scales, const std::optional<at::Tensor>& lora_seg_starts,
    const std::optional<at::Tensor>& lora_seg_slots) {
  return {at::empty_like(hidden), at::empty_like(hidden)};
}

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def(
      "llama_decode_layers(Tensor hidden, Tensor[] input_norms, Tensor[] post_norms,"
      " Tensor[] projection_parts, int[] kinds, int[] part_counts, Tensor[] qkv_bias, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches,"
      " Tensor(c!)[] k_scales, Tensor(d!)[] v_scales, Tensor positions, Tensor slot_mapping,"
      " Tensor block_tables, Tensor context_lens, Tensor rope, int num_heads, int num_kv_heads,"
      " float eps, float scale, bool int8_activations, int[] sliding_windows,"
      " Tensor[] q_norms, Tensor[] k_norms, bool query_in_cache_dtype,"
      " Tensor[] lora_a, Tensor[] lora_b, Tensor? lora_scales, Tensor? lora_seg_starts,"
      " Tensor? lora_seg_slots) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("llama_decode_layers", &llama_decode_layers); }

TORCH_LIBRARY_IMPL(llmserve, Meta, m) {
  m.impl("llama_decode_layers", &llama_decode_layers_meta);
}
