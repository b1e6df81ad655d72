// A pure-decode step of any decoder family the worker serves (services/worker/model/
// causal_lm.py's switches), whose projections are GGUF blocks or dense float weights, all
// decoder layers in one call: what `CausalLM.forward` computes for one query token per
// sequence, without going back to Python between ops.
//
// Why: at batch 1 a layer is ten small ops around four matrix-vector products; dispatched from
// Python (eager) or from a compiled graph's wrapper, the calls between them cost as much as
// the products themselves (~150 us a layer, measured). Here they are plain loops over [B, H]
// rows, and the heavy parts are this library's own kernels called directly:
//
//   per layer   x += d; h = attn_norm(x)               (layer 0: x = the embedding, no add)
//               qkv = linear(h) (+ bias)               [B, (Hq + 2 Hkv) D], any GGUF kinds
//               q, k = rms_norm per head or across heads (only with q_norms / k_norms)
//               rotary(q, k) with the layer's table, at positions (none: layer_ropes -1)
//               write k, v at slot_mapping
//               a = paged_decode_attention(q)          [B, Hq D], the layer's window, soft-cap
//               d = attn_out_norm(linear(a)) * residual_multiplier
//               x += d; h = mlp_norm(x)
//               d = mlp_out_norm(linear(act(gate) * up)) * residual_multiplier,
//                                                      gate | up = linear(h), act SiLU or GELU
//   returns     (d, x) of the last layer; the final norm and the vocabulary stay in Python.
//
// Each norm is there when its list holds one weight per layer, and absent when the list is
// empty: Llama has attn_norm and mlp_norm, Gemma 2/3 all four, OLMo 2 only the two after the
// blocks (*_out_norm: Gemma's post_attention / post_feedforward norms); without a norm, h is x.
//
// With LoRA tables (services/worker/lora/slots.py) each of the four products then gets its
// rows' adapter deltas, as the eager layers add them (batch.lora.add after each projection):
// lora.cpp's batched shrink-then-expand over the step's segment table, one row per sequence.
//
// Math is fp32 throughout (a bf16 model's norms come in as fp32 copies and its cache is read
// with a bf16 query), as the torch references do it (kernels/*_torch.py): the rotary
// pairs (i, i + R/2) of the NeoX convention over the first R = rope.size(1) dims of each head
// (R < D: partial rotary, the rest pass through), rms_norm as x * (1 / sqrt(mean(x^2) + eps))
// * w, GELU's tanh form 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))). The head dim D is the
// KV caches'. Against the eager layers (torch ops around the same products, attention and KV
// write) only the rounding differs: the order of the norms' sums, the rotary's fused
// multiply-adds, exp / tanh (~1-2 ulp); tests/kernels/fused_decode_bounds.py derives how far
// that may move a step's keys, values and logits.
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

// residual += delta (when there is one); hidden = rms_norm(residual), or residual itself
// when the layer has no norm there (weight null: OLMo 2): the fused add + norm between
// sublayers.
void add_rms_norm(const at::Tensor* delta, at::Tensor& residual, const at::Tensor* weight,
                  float eps, at::Tensor& hidden) {
  const int64_t rows = residual.size(0), n = residual.size(1);
  const float* d = delta != nullptr ? delta->data_ptr<float>() : nullptr;
  const float* w = weight != nullptr ? weight->data_ptr<float>() : nullptr;
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
      if (w != nullptr) {
        rms_norm_row(rr, w, eps, n, h + m * n);
      } else {
        std::copy(rr, rr + n, h + m * n);
      }
    }
  });
}

// A block's output before it joins the residual stream, in place: rms_norm with the block's
// own weight (weight null: none), then times the residual multiplier (Granite), two roundings
// as the eager layer's two ops.
void finish_block_output(at::Tensor& out, const at::Tensor* weight, float eps,
                         float residual_multiplier) {
  if (weight == nullptr && residual_multiplier == 1.f) return;
  const int64_t rows = out.size(0), n = out.size(1);
  const float* w = weight != nullptr ? weight->data_ptr<float>() : nullptr;
  float* base = out.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = base + m * n;
      if (w != nullptr) rms_norm_row(row, w, eps, n, row);
      if (residual_multiplier != 1.f) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) row[i] *= residual_multiplier;
      }
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

// RMS-normalizes `num_groups` runs of `group_size` values from value `first` on, in every qkv
// row, in place, with one weight [group_size] for all of them: q_norm / k_norm before the
// rotary, per head (Qwen3, Gemma 3: a group is a head) or across heads (OLMo 2: one group,
// the whole q or k).
void norm_groups(at::Tensor& qkv, int64_t first, int64_t num_groups, int64_t group_size,
                 const at::Tensor& weight, float eps) {
  const int64_t rows = qkv.size(0), row_stride = qkv.size(1);
  const float* w = weight.data_ptr<float>();
  float* base = qkv.data_ptr<float>() + first;
  at::parallel_for(0, rows, row_grain(num_groups * group_size), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < num_groups; ++g) {
        float* x = base + m * row_stride + g * group_size;
        rms_norm_row(x, w, eps, group_size, x);
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

// GELU's tanh form (torch's approximate="tanh", Gemma's gelu_pytorch_tanh), in torch's order:
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

// dst = gelu_tanh(gate) * up over n values (GeGLU), with the attention kernels' vector tanh.
template <class V>
void gelu_tanh_and_mul_row(const float* gate, const float* up, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (V::kWidth > 1) {
    const typename V::Reg one = V::set1(1.f), half = V::set1(0.5f);
    const typename V::Reg beta = V::set1(kGeluBeta), kappa = V::set1(kGeluKappa);
    for (; i + V::kWidth <= n; i += V::kWidth) {
      const typename V::Reg g = V::load(gate + i);
      const typename V::Reg cube = V::mul(V::mul(g, g), g);
      const typename V::Reg inner = V::mul(beta, V::add(g, V::mul(kappa, cube)));
      const typename V::Reg gelu = V::mul(V::mul(half, g), V::add(one, V::tanh(inner)));
      V::store(dst + i, V::mul(gelu, V::load(up + i)));
    }
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    const float inner = kGeluBeta * (g + kGeluKappa * (g * g * g));
    dst[i] = 0.5f * g * (1.f + std::tanh(inner)) * up[i];
  }
}

// The gating of the MLP: SwiGLU (silu, most families) or GeGLU (gelu_tanh, Gemma); the names
// are ModelArchitecture.hidden_act's.
enum class Activation { kSilu, kGeluTanh };

Activation parse_activation(c10::string_view name) {
  if (name == "silu") return Activation::kSilu;
  TORCH_CHECK(name == "gelu_tanh", "llama_decode_layers: hidden_act must be silu or gelu_tanh, ",
              "got ", name);
  return Activation::kGeluTanh;
}

using GatedRow = void (*)(const float*, const float*, float*, int64_t);

template <class V>
GatedRow gated_row_of(Activation activation) {
  return activation == Activation::kSilu ? &silu_and_mul_row<V> : &gelu_tanh_and_mul_row<V>;
}

GatedRow gated_row_kernel(Activation activation) {
  using namespace llmserve_cpu;
  if (scalar_kernels_forced().load(std::memory_order_relaxed)) {
    return gated_row_of<ScalarVec>(activation);
  }
#if defined(LLMSERVE_HAVE_AVX512)
  return gated_row_of<Avx512Vec>(activation);
#elif defined(LLMSERVE_HAVE_AVX2)
  return gated_row_of<Avx2Vec>(activation);
#else
  return gated_row_of<ScalarVec>(activation);
#endif
}

// [B, 2I] = [gate | up] -> act(gate) * up [B, I].
at::Tensor gated_activation(const at::Tensor& gate_up, Activation activation) {
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const GatedRow row_kernel = gated_row_kernel(activation);
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

// One kind of norm of every layer: empty (the model has none there) or one fp32 [size] weight
// per layer, checked once.
class LayerNorms {
 public:
  LayerNorms(at::TensorList weights, size_t num_layers, int64_t size, const char* name)
      : weights_(weights) {
    if (weights.empty()) return;
    check_layer_lists(num_layers, weights, name);
    for (const at::Tensor& weight : weights) check_fp32_vector(weight, size, name);
  }
  // Layer l's weight, or null when there is no such norm.
  const at::Tensor* at(size_t layer) const {
    return weights_.empty() ? nullptr : &weights_[layer];
  }

 private:
  at::TensorList weights_;
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> llama_decode_layers(
    const at::Tensor& hidden_in, at::TensorList attn_norms, at::TensorList mlp_norms,
    at::TensorList attn_out_norms, at::TensorList mlp_out_norms, at::TensorList projection_parts,
    at::IntArrayRef kinds, at::IntArrayRef part_counts, at::TensorList qkv_bias,
    at::TensorList q_norms, at::TensorList k_norms, at::TensorList k_caches,
    at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
    const at::Tensor& positions_in, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, at::TensorList ropes, at::IntArrayRef layer_ropes,
    at::IntArrayRef sliding_windows, int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale, double attn_logit_softcap, double residual_multiplier,
    c10::string_view hidden_act, bool int8_activations, bool query_in_cache_dtype,
    at::TensorList lora_a, at::TensorList lora_b, const std::optional<at::Tensor>& lora_scales,
    const std::optional<at::Tensor>& lora_seg_starts,
    const std::optional<at::Tensor>& lora_seg_slots) {
  const size_t num_layers = k_caches.size();
  TORCH_CHECK(num_layers > 0, "llama_decode_layers: no layers");
  check_layer_lists(num_layers, v_caches, "v_caches");
  const Projections projections(projection_parts, kinds, part_counts, num_layers);
  TORCH_CHECK(sliding_windows.size() == num_layers,
              "llama_decode_layers: sliding_windows must hold one window per layer (0: none)");
  TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == num_layers,
              "llama_decode_layers: qkv_bias is empty or one per layer");
  TORCH_CHECK(q_norms.size() == k_norms.size() && (q_norms.empty() || q_norms.size() == num_layers),
              "llama_decode_layers: q_norms and k_norms are both empty or one per layer each");
  TORCH_CHECK(layer_ropes.size() == num_layers,
              "llama_decode_layers: layer_ropes must hold one table index per layer (-1: none)");
  const bool quantized_cache = !k_scales.empty();
  if (quantized_cache) {
    check_layer_lists(num_layers, k_scales, "k_scales");
    check_layer_lists(num_layers, v_scales, "v_scales");
  }
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kFloat,
              "llama_decode_layers: hidden must be fp32 [B, H]");
  TORCH_CHECK(k_caches[0].dim() == 4,
              "llama_decode_layers: caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(attn_logit_softcap >= 0,
              "llama_decode_layers: attn_logit_softcap must be >= 0 (0: none)");
  const int64_t batch = hidden_in.size(0), hidden_size = hidden_in.size(1);
  const int64_t head_dim = k_caches[0].size(3);
  for (const at::Tensor& rope : ropes) {
    TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.dim() == 2 && rope.is_contiguous(),
                "llama_decode_layers: a rope must be a contiguous fp32 [max_positions, R] table");
    TORCH_CHECK(rope.size(1) % 2 == 0 && rope.size(1) <= head_dim, "llama_decode_layers: rope ",
                "has ", rope.size(1), " values a row, an even number up to the head dim ",
                head_dim);
  }
  for (const int64_t index : layer_ropes) {
    TORCH_CHECK(index >= -1 && index < static_cast<int64_t>(ropes.size()),
                "llama_decode_layers: layer_ropes names table ", index, " of ", ropes.size());
  }
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(positions_in.dim() == 1 && positions_in.size(0) == batch,
              "llama_decode_layers: positions must be [B]");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const float epsilon = static_cast<float>(eps);
  const float multiplier = static_cast<float>(residual_multiplier);
  const Activation activation = parse_activation(hidden_act);
  const LayerNorms attn_norm(attn_norms, num_layers, hidden_size, "attn_norms");
  const LayerNorms mlp_norm(mlp_norms, num_layers, hidden_size, "mlp_norms");
  const LayerNorms attn_out_norm(attn_out_norms, num_layers, hidden_size, "attn_out_norms");
  const LayerNorms mlp_out_norm(mlp_out_norms, num_layers, hidden_size, "mlp_out_norms");
  // q_norms / k_norms of [D] normalize each head; of [Hq D] and [Hkv D], all heads together
  // (OLMo 2). With one query head the two are the same computation.
  const bool qk_norm_across_heads = !q_norms.empty() && q_norms[0].size(0) != head_dim;
  const int64_t q_group = qk_norm_across_heads ? q_size : head_dim;
  const int64_t k_group = qk_norm_across_heads ? kv_size : head_dim;
  const LayerNorms q_norm(q_norms, num_layers, q_group, "q_norms");
  const LayerNorms k_norm(k_norms, num_layers, k_group, "k_norms");
  const LoraTables lora(lora_a, lora_b, lora_scales, lora_seg_starts, lora_seg_slots, num_layers,
                        batch);

  at::Tensor residual = hidden_in.contiguous().clone();
  at::Tensor hidden = at::empty_like(residual);
  at::Tensor delta;  // the last block's output, added to the residual by the next norm
  for (size_t l = 0; l < num_layers; ++l) {
    // Layer 0 norms the embedding itself; later layers first add the MLP's output.
    add_rms_norm(l == 0 ? nullptr : &delta, residual, attn_norm.at(l), epsilon, hidden);
    at::Tensor qkv = projections.apply(hidden, l, 0, int8_activations);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "llama_decode_layers: qkv_proj gives ",
                qkv.size(1), " features, the heads need ", q_size + 2 * kv_size);
    if (!qkv_bias.empty()) qkv.add_(qkv_bias[l]);
    lora.add(hidden, qkv, l, 0);
    if (q_norm.at(l) != nullptr) {
      norm_groups(qkv, 0, q_size / q_group, q_group, *q_norm.at(l), epsilon);
      norm_groups(qkv, q_size, kv_size / k_group, k_group, *k_norm.at(l), epsilon);
    }
    if (layer_ropes[l] >= 0) {
      rotate_qkv(qkv, positions, ropes[layer_ropes[l]], num_heads + num_kv_heads, head_dim);
    }
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
      // cache. Everything around it stays fp32. Contexts split by their own length only
      // (batch_invariant), so a row's result never depends on the rows beside it.
      const auto cache_type = k_caches[l].scalar_type();
      const bool cast_query =
          query_in_cache_dtype && !quantized_cache && cache_type != at::kFloat;
      attended = paged_decode_attention(cast_query ? query.to(cache_type) : query, k_caches[l],
                                        v_caches[l], block_tables, context_lens, scale, k_scale,
                                        v_scale, /*batch_invariant=*/true, sliding_windows[l],
                                        attn_logit_softcap);
      if (cast_query) attended = attended.to(at::kFloat);
    }
    const at::Tensor heads = attended.view({batch, q_size});
    delta = projections.apply(heads, l, 1, int8_activations);
    lora.add(heads, delta, l, 1);
    finish_block_output(delta, attn_out_norm.at(l), epsilon, multiplier);
    add_rms_norm(&delta, residual, mlp_norm.at(l), epsilon, hidden);
    at::Tensor gate_up = projections.apply(hidden, l, 2, int8_activations);
    lora.add(hidden, gate_up, l, 2);
    const at::Tensor gated = gated_activation(gate_up, activation);
    delta = projections.apply(gated, l, 3, int8_activations);
    lora.add(gated, delta, l, 3);
    finish_block_output(delta, mlp_out_norm.at(l), epsilon, multiplier);
  }
  return {delta, residual};
}

std::tuple<at::Tensor, at::Tensor> llama_decode_layers_meta(
    const at::Tensor& hidden, at::TensorList attn_norms, at::TensorList mlp_norms,
    at::TensorList attn_out_norms, at::TensorList mlp_out_norms, at::TensorList projection_parts,
    at::IntArrayRef kinds, at::IntArrayRef part_counts, at::TensorList qkv_bias,
    at::TensorList q_norms, at::TensorList k_norms, at::TensorList k_caches,
    at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
    const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, at::TensorList ropes, at::IntArrayRef layer_ropes,
    at::IntArrayRef sliding_windows, int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale, double attn_logit_softcap, double residual_multiplier,
    c10::string_view hidden_act, bool int8_activations, bool query_in_cache_dtype,
    at::TensorList lora_a, at::TensorList lora_b, const std::optional<at::Tensor>& lora_scales,
    const std::optional<at::Tensor>& lora_seg_starts,
    const std::optional<at::Tensor>& lora_seg_slots) {
  return {at::empty_like(hidden), at::empty_like(hidden)};
}

// Per-layer data comes as lists (one entry per layer; a norm's list may be empty: no such
// norm), the model's switches as scalars.
TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def(
      "llama_decode_layers(Tensor hidden,"
      " Tensor[] attn_norms, Tensor[] mlp_norms, Tensor[] attn_out_norms, Tensor[] mlp_out_norms,"
      " Tensor[] projection_parts, int[] kinds, int[] part_counts, Tensor[] qkv_bias,"
      " Tensor[] q_norms, Tensor[] k_norms,"
      " Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!)[] k_scales,"
      " Tensor(d!)[] v_scales,"
      " Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor context_lens,"
      " Tensor[] ropes, int[] layer_ropes, int[] sliding_windows,"
      " int num_heads, int num_kv_heads, float eps, float scale, float attn_logit_softcap,"
      " float residual_multiplier, str hidden_act, bool int8_activations,"
      " bool query_in_cache_dtype,"
      " Tensor[] lora_a, Tensor[] lora_b, Tensor? lora_scales, Tensor? lora_seg_starts,"
      " Tensor? lora_seg_slots) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("llama_decode_layers", &llama_decode_layers); }

TORCH_LIBRARY_IMPL(llmserve, Meta, m) {
  m.impl("llama_decode_layers", &llama_decode_layers_meta);
}
