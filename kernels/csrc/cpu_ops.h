// The C++ CPU ops that other kernels of this library call directly (not through the
// dispatcher): one declaration each, defined in the .cpp file named beside it.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

// gguf_gemm.cpp
// batch_invariant: each output row depends only on its own input row (one arithmetic path
// for every M), so a sequence's result does not depend on what it is batched with.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                       bool int8_activations, bool batch_invariant = false);
// The parts' outputs side by side: [M, sum of their N] (a fused layer whose parts the file
// stores in different kinds).
at::Tensor gguf_linear_parts(const at::Tensor& x, at::TensorList parts, at::IntArrayRef kinds,
                             bool int8_activations, bool batch_invariant = false);

// paged_decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  bool batch_invariant = false, int64_t sliding_window = 0,
                                  double logit_softcap = 0.0);

// write_kv_cache.cpp
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale);

// lora.cpp
// y += scales[slot] * (x @ lora_a[slot].T) @ lora_b[slot].T in place for the tokens of each
// segment with a slot (-1: none); x, lora_a and lora_b, y of one float dtype, the sums fp32.
void lora_apply(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& seg_starts, const at::Tensor& seg_slots,
                const at::Tensor& scales, const at::Tensor& y, at::IntArrayRef out_slices);

// The tokens of each slot a step uses, grouped: group g is slot slots[g] and holds
// tokens[offsets[g] .. offsets[g + 1]) in ascending order. Made once per step by the fused
// decode step, which applies every layer's projections over the same rows.
struct LoraSlotGroups {
  std::vector<int64_t> slots;
  std::vector<int64_t> offsets{0};
  std::vector<int64_t> tokens;

  int64_t size() const { return static_cast<int64_t>(slots.size()); }
  int64_t count(int64_t g) const { return offsets[g + 1] - offsets[g]; }
};
LoraSlotGroups lora_group_rows(const at::Tensor& seg_starts, const at::Tensor& seg_slots,
                               int64_t num_tokens, int64_t num_slots);
// lora_apply for fp32 rows, with the groups made once and one layer's tables by pointer (no
// tensor per call): lora_a (num_slots, rank, in_features) and lora_b (num_slots, out_features,
// rank) contiguous fp32; v is num_tokens x rank fp32 scratch.
void lora_apply_grouped_fp32(const float* x, int64_t x_stride, int64_t in_features,
                             const float* lora_a, const float* lora_b, int64_t rank,
                             int64_t out_features, const float* scales, float* y,
                             int64_t y_stride, float* v, const LoraSlotGroups& groups);
