// The per-call helpers of common.h, and the entry points of kernels.h that
// describe the build and set the streaming threshold rather than run an op.

#include "common.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <string>

#include <unistd.h>

namespace mindiesd_cpu {

int64_t default_streaming_threshold() {
  long cache = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (cache <= 0) {
    cache = 32L << 20;
  }
  return static_cast<int64_t>(cache) * 3 / 4;
}

bool broadcasts_into_rows(const Tensor& t, at::IntArrayRef x_sizes) {
  if (t.dim() > static_cast<int64_t>(x_sizes.size())) {
    return false;
  }
  const int64_t offset = static_cast<int64_t>(x_sizes.size()) - t.dim();
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    const int64_t size = t.size(d);
    if (size != 1 && size != x_sizes[offset + d]) {
      return false;
    }
  }
  return true;
}

Tensor as_row_values(Tensor t, int64_t width, ScalarType dtype) {
  if (t.dim() == 0) {
    t = t.reshape({1});
  }
  if (t.scalar_type() != dtype) {
    t = t.to(dtype);
  }
  if (t.size(-1) != width) {
    std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
    sizes.back() = width;
    t = t.expand(sizes).contiguous();
  } else if (width > 1 && t.stride(-1) != 1) {
    t = t.contiguous();
  }
  return t;
}

Tensor as_row_operand(Tensor t, at::IntArrayRef x_sizes, int64_t width, ScalarType dtype) {
  t = as_row_values(std::move(t), width, dtype);
  std::vector<int64_t> target(x_sizes.begin(), x_sizes.end());
  target.back() = width;
  return expanded(t, target);
}

Tensor expanded(const Tensor& t, at::IntArrayRef sizes) {
  if (!plain_impl(t) || t.dim() > static_cast<int64_t>(sizes.size())) {
    return t.expand(sizes);
  }
  std::vector<int64_t> strides(sizes.size(), 0);
  const int64_t offset = static_cast<int64_t>(sizes.size()) - t.dim();
  for (int64_t k = 0; k < t.dim(); ++k) {
    const int64_t size = t.size(k);
    if (size == sizes[offset + k]) {
      strides[offset + k] = t.stride(k);
    } else if (size != 1) {
      return t.expand(sizes);  // not a broadcast: expand's own error
    }
  }
  return alias_view(t, sizes, strides, t.storage_offset());
}

Tensor alias_view(const Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(base.storage()),
                                                   base.key_set(), base.dtype());
  impl->set_sizes_and_strides(sizes, strides, offset);
  return Tensor(std::move(impl));
}

Tensor empty_output(const Tensor& x, at::IntArrayRef sizes, ScalarType dtype) {
  // the CPU allocation itself, without a call through the dispatcher, unless a dispatch mode is there to see it
  // (a device-graph capture's recording)
  if (x.is_cpu() && c10::impl::TorchDispatchModeTLS::stack_len() == 0) {
    return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, at::MemoryFormat::Contiguous);
  }
  return at::empty(sizes, x.options().dtype(dtype).memory_format(at::MemoryFormat::Contiguous));
}

std::optional<Tensor> channel_op_output(const Tensor& x, ScalarType dtype) {
  if (x.is_contiguous()) {
    return empty_output(x, x.sizes(), dtype);
  }
  if (channels_innermost(x)) {
    return at::empty_strided(x.sizes(), x.strides(), x.options().dtype(dtype));
  }
  return std::nullopt;
}

ScalarType parameter_dtype(ScalarType x_dtype, int64_t x_numel, std::initializer_list<const Tensor*> params) {
  bool all_small = true;
  for (const Tensor* p : params) {
    if (p->scalar_type() != x_dtype) {
      return ScalarType::Float;
    }
    all_small = all_small && is_small_operand(*p, x_numel);
  }
  return all_small ? ScalarType::Float : x_dtype;
}

#define MINDIESD_STRINGIFY_(x) #x
#define MINDIESD_STRINGIFY(x) MINDIESD_STRINGIFY_(x)

std::string capability() {
  std::string name = MINDIESD_STRINGIFY(CPU_CAPABILITY);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  name += "+BF16";
#endif
  return name;
}

int64_t vector_lanes() {
  return kLanes;
}

void set_streaming_threshold(int64_t bytes) {
  streaming_threshold_bytes.store(bytes);
}

int64_t streaming_threshold() {
  const int64_t bytes = streaming_threshold_bytes.load();
  return bytes < 0 ? default_streaming_threshold() : bytes;
}

}  // namespace mindiesd_cpu
