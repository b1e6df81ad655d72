// KV-cache write on CPUs: scatter this step's key/value rows [T, Hkv, D] into the paged
// caches at slot_mapping [T] (slot = block_id * block_size + offset; slot < 0 is a padding
// token and is skipped), converting to the cache dtype or, for an int8 cache, quantizing per
// group of D / k_scale.size(-1) values exactly as kernels/kv_cache_torch.quantize_kv_int8:
//
//   scale = amax(|x|) / 127 rounded to the scale dtype first; code = round_half_even(x / scale)
//   clamped to [-127, 127]; an all-zero group (or one whose scale rounds to 0) gets scale 0
//   and codes 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "attention_vec.h"

namespace {

using namespace llmserve_cpu;

// Rows (token x kv head) below which one thread does the whole write: a decode step writes
// B rows per layer, far less than an OpenMP wake-up is worth.
constexpr int64_t kMinParallelRows = 256;

template <class V, typename Src, typename Dst>
void convert_row(const Src* src, Dst* dst, int64_t head_dim) {
  if constexpr (std::is_same_v<Src, Dst>) {
    std::memcpy(dst, src, head_dim * sizeof(Dst));  // bit-exact, NaN payloads included
  } else {
    for (int64_t lane = 0; lane < head_dim; lane += V::kWidth) {
      V::store(dst + lane, V::load(src + lane));
    }
  }
}

// Rounds an fp32 scale to the scale dtype, stores it there, and returns the stored value.
inline float store_scale(float scale, void* dst, at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: {
      const c10::Half rounded(scale);
      *static_cast<c10::Half*>(dst) = rounded;
      return static_cast<float>(rounded);
    }
    case at::kBFloat16: {
      const c10::BFloat16 rounded(scale);
      *static_cast<c10::BFloat16*>(dst) = rounded;
      return static_cast<float>(rounded);
    }
    default:
      *static_cast<float*>(dst) = scale;
      return scale;
  }
}

template <class V, typename Src>
void quantize_row(const Src* src, int8_t* codes, char* scales, at::ScalarType scale_dtype,
                  int64_t head_dim, int64_t group, float* values, float* divisors) {
  using Reg = typename V::Reg;
  constexpr int64_t W = V::kWidth;
  for (int64_t lane = 0; lane < head_dim; lane += W) V::store(values + lane, V::load(src + lane));
  const int64_t num_groups = head_dim / group;
  const int64_t scale_bytes = c10::elementSize(scale_dtype);
  for (int64_t i = 0; i < num_groups; ++i) {
    const float* x = values + i * group;
    float amax = 0.f;
    if (group % W == 0) {
      Reg m = V::zero();
      for (int64_t j = 0; j < group; j += W) m = V::max(V::abs(V::load(x + j)), m);
      amax = V::reduce_max(m);
    } else {
      for (int64_t j = 0; j < group; ++j) amax = ScalarVec::max(std::fabs(x[j]), amax);
    }
    const float scale = store_scale(amax / 127.f, scales + i * scale_bytes, scale_dtype);
    divisors[i] = scale == 0.f ? 1.f : scale;
  }
  for (int64_t lane = 0; lane < head_dim; lane += W) {
    const Reg divisor = group >= W ? V::set1(divisors[lane / group])
                                   : V::expand_scales(divisors + lane / group, group);
    const Reg q = V::round_even(V::div(V::load(values + lane), divisor));
    V::store_codes(codes + lane, V::clamp(q, -127.f, 127.f));
  }
}

struct WriteArgs {
  const void* key;
  const void* value;
  int64_t key_stride_token, key_stride_head;  // elements; often views of the fused qkv
  int64_t value_stride_token, value_stride_head;
  void* k_cache;
  void* v_cache;
  RowStrides k_strides, v_strides;
  void* k_scale;
  void* v_scale;
  at::ScalarType scale_dtype;
  RowStrides k_scale_strides, v_scale_strides;
  int64_t quant_group;
  const int64_t* slots;
  int64_t num_kv_heads, head_dim, block_size;
};

template <class V, typename Src, typename Dst>
void run_write(const WriteArgs& a, int64_t num_tokens) {
  const int64_t rows = num_tokens * a.num_kv_heads;
  auto write_rows = [&](int64_t first, int64_t last) {
    std::vector<float> values, divisors;
    if constexpr (std::is_same_v<Dst, int8_t>) {
      values.resize(a.head_dim);
      divisors.resize(a.head_dim / a.quant_group + V::kWidth);  // padded for expand_scales
    }
    const int64_t scale_bytes = a.k_scale ? c10::elementSize(a.scale_dtype) : 0;
    for (int64_t row = first; row < last; ++row) {
      const int64_t t = row / a.num_kv_heads, h = row % a.num_kv_heads;
      const int64_t slot = a.slots[t];
      if (slot < 0) continue;
      const int64_t block_id = slot / a.block_size, offset = slot % a.block_size;
      const Src* key =
          static_cast<const Src*>(a.key) + t * a.key_stride_token + h * a.key_stride_head;
      // A single-cache write (write_cache) has no value side.
      const Src* value =
          a.value == nullptr
              ? nullptr
              : static_cast<const Src*>(a.value) + t * a.value_stride_token + h * a.value_stride_head;
      Dst* k_dst = static_cast<Dst*>(a.k_cache) + a.k_strides.at(block_id, offset, h);
      Dst* v_dst =
          a.value == nullptr ? nullptr : static_cast<Dst*>(a.v_cache) + a.v_strides.at(block_id, offset, h);
      if constexpr (std::is_same_v<Dst, int8_t>) {
        char* k_scales =
            static_cast<char*>(a.k_scale) + scale_bytes * a.k_scale_strides.at(block_id, offset, h);
        char* v_scales =
            a.value == nullptr
                ? nullptr
                : static_cast<char*>(a.v_scale) + scale_bytes * a.v_scale_strides.at(block_id, offset, h);
        quantize_row<V>(key, k_dst, k_scales, a.scale_dtype, a.head_dim, a.quant_group,
                        values.data(), divisors.data());
        if (a.value != nullptr) {
          quantize_row<V>(value, v_dst, v_scales, a.scale_dtype, a.head_dim, a.quant_group,
                          values.data(), divisors.data());
        }
      } else {
        convert_row<V>(key, k_dst, a.head_dim);
        if (a.value != nullptr) convert_row<V>(value, v_dst, a.head_dim);
      }
    }
  };
  if (rows >= kMinParallelRows && !at::in_parallel_region()) {
    at::parallel_for(0, rows, kMinParallelRows / 2, write_rows);
  } else {
    write_rows(0, rows);
  }
}

template <class V, typename Src>
void run_write_for_cache(const WriteArgs& a, at::ScalarType cache_dtype, int64_t num_tokens) {
  switch (cache_dtype) {
    case at::kFloat:
      return run_write<V, Src, float>(a, num_tokens);
    case at::kBFloat16:
      return run_write<V, Src, c10::BFloat16>(a, num_tokens);
    case at::kHalf:
      return run_write<V, Src, c10::Half>(a, num_tokens);
    case at::kChar:
      return run_write<V, Src, int8_t>(a, num_tokens);
    default:
      TORCH_CHECK(false, "write_kv_cache: unsupported cache dtype ", cache_dtype);
  }
}

template <class V>
void run_write_typed(const WriteArgs& a, at::ScalarType src_dtype, at::ScalarType cache_dtype,
                     int64_t num_tokens) {
  switch (src_dtype) {
    case at::kFloat:
      return run_write_for_cache<V, float>(a, cache_dtype, num_tokens);
    case at::kBFloat16:
      return run_write_for_cache<V, c10::BFloat16>(a, cache_dtype, num_tokens);
    case at::kHalf:
      return run_write_for_cache<V, c10::Half>(a, cache_dtype, num_tokens);
    default:
      TORCH_CHECK(false, "write_kv_cache: key/value must be fp32, bf16 or fp16");
  }
}

}  // namespace

// value/v_cache/v_scale absent: write the key side only.
void write_kv_cache_impl(const at::Tensor& key_in, const std::optional<at::Tensor>& value_opt,
                         const at::Tensor& k_cache, const std::optional<at::Tensor>& v_cache_opt,
                         const at::Tensor& slot_mapping_in,
                         const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale_opt) {
  const bool has_value = value_opt.has_value();
  const at::Tensor& value_in = has_value ? *value_opt : key_in;
  const at::Tensor& v_cache = has_value ? *v_cache_opt : k_cache;
  const std::optional<at::Tensor>& v_scale = has_value ? v_scale_opt : k_scale;
  TORCH_CHECK(key_in.dim() == 3 && value_in.sizes() == key_in.sizes(),
              "key/value must be [T, Hkv, D] of one shape");
  TORCH_CHECK(key_in.scalar_type() == value_in.scalar_type(), "key and value dtypes differ");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache/v_cache must be [num_blocks, block_size, Hkv, D] of one shape and dtype");
  const int64_t num_tokens = key_in.size(0), num_kv_heads = key_in.size(1);
  const int64_t head_dim = key_in.size(2);
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim, "k_cache ",
              k_cache.sizes(), " does not hold rows of [Hkv, D] = ", key_in.sizes().slice(1));
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "caches must be contiguous in head_dim");
  TORCH_CHECK(slot_mapping_in.dim() == 1 && slot_mapping_in.size(0) == num_tokens,
              "slot_mapping must be [T]");
  // Usually strided views of the fused qkv output: keep their strides.
  const at::Tensor key = key_in.stride(2) == 1 ? key_in : key_in.contiguous();
  const at::Tensor value = value_in.stride(2) == 1 ? value_in : value_in.contiguous();
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  const int64_t block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is outside the cache's ", num_slots, " slots");
  }

  WriteArgs a{};
  a.key = key.data_ptr();
  a.value = has_value ? value.data_ptr() : nullptr;
  a.key_stride_token = key.stride(0);
  a.key_stride_head = key.stride(1);
  a.value_stride_token = value.stride(0);
  a.value_stride_head = value.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.k_strides = RowStrides::of(k_cache);
  a.v_strides = RowStrides::of(v_cache);
  a.slots = slots;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.block_size = block_size;
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 KV cache needs k/v scales");
    for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(s->dim() == 4 && s->sizes().slice(0, 3) == k_cache.sizes().slice(0, 3) &&
                      s->size(3) > 0 && head_dim % s->size(3) == 0 && s->stride(3) == 1,
                  "scales must be [num_blocks, block_size, Hkv, D // group], got ", s->sizes());
      TORCH_CHECK(s->scalar_type() == at::kHalf || s->scalar_type() == at::kBFloat16 ||
                      s->scalar_type() == at::kFloat,
                  "scales must be fp16, bf16 or fp32");
    }
    TORCH_CHECK(
        k_scale->sizes() == v_scale->sizes() && k_scale->scalar_type() == v_scale->scalar_type(),
        "k_scale and v_scale differ in shape or dtype");
    a.k_scale = k_scale->data_ptr();
    a.v_scale = v_scale->data_ptr();
    a.scale_dtype = k_scale->scalar_type();
    a.k_scale_strides = RowStrides::of(*k_scale);
    a.v_scale_strides = RowStrides::of(*v_scale);
    a.quant_group = head_dim / k_scale->size(3);
  }
  if (num_tokens == 0) return;
  switch (pick_isa(head_dim, a.quant_group)) {
#if defined(LLMSERVE_HAVE_AVX512)
    case Isa::kAvx512:
      run_write_typed<Avx512Vec>(a, key.scalar_type(), k_cache.scalar_type(), num_tokens);
      break;
#endif
#if defined(LLMSERVE_HAVE_AVX2)
    case Isa::kAvx2:
      run_write_typed<Avx2Vec>(a, key.scalar_type(), k_cache.scalar_type(), num_tokens);
      break;
#endif
    default:
      run_write_typed<ScalarVec>(a, key.scalar_type(), k_cache.scalar_type(), num_tokens);
      break;
  }
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale) {
  write_kv_cache_impl(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}

// One cache (K or V) per call. Inside a compiled graph, an op that mutates two views of one
// storage (a layer's K and V halves) makes functionalization copy one of them whole on every
// call; two calls that each mutate one view copy nothing.
void write_cache(const at::Tensor& src, const at::Tensor& cache, const at::Tensor& slot_mapping,
                 const std::optional<at::Tensor>& scale) {
  write_kv_cache_impl(src, std::nullopt, cache, std::nullopt, slot_mapping, scale, std::nullopt);
}

void write_cache_meta(const at::Tensor& src, const at::Tensor& cache,
                      const at::Tensor& slot_mapping, const std::optional<at::Tensor>& scale) {}

void write_kv_cache_meta(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {}

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache,"
      " Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
}

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("write_cache(Tensor src, Tensor(a!) cache, Tensor slot_mapping, Tensor(b!)? scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("write_cache", &write_cache);
}

TORCH_LIBRARY_IMPL(llmserve, Meta, m) {
  m.impl("write_kv_cache", &write_kv_cache_meta);
  m.impl("write_cache", &write_cache_meta);
}
