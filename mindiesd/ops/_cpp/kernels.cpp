// Single-pass CPU kernels for the mindiesd fused operators.
//
// Every kernel reads its input once from memory and writes one contiguous
// output.  The row kernels (rms_norm, adalayernorm, rope, and mul_add when
// its operands share the output's last dim) walk the rows of the last dim
// with per-operand broadcast strides and keep a row in L1 between passes;
// fast_gelu runs one flat loop over contiguous input.  Other strides and
// broadcasts of fast_gelu and mul_add go through a TensorIterator.  16-bit
// values are widened to float32, computed in float32 and rounded once when
// stored.  Outputs larger than most of the last-level cache are written with
// non-temporal stores.
//
// Each entry point (kernels.h; bound to Python in bindings.cpp) returns
// std::nullopt for a form it does not cover; the Python wrapper then runs the
// aten composition kernel instead.  Shapes and
// dtypes are validated by the shared Python rules before the call; the checks
// here only protect memory accesses and select the covered forms.

#include "kernels.h"

#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/TensorIterator.h>
#include <ATen/native/cpu/Loops.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

namespace mindiesd_cpu {
namespace {

using at::BFloat16;
using at::Half;
using at::ScalarType;
using at::Tensor;
using fVec = at::vec::Vectorized<float>;

constexpr int64_t kLanes = fVec::size();
// Elements handled per step: one vector of a 16-bit type, two of float32.
constexpr int64_t kBlock = 2 * kLanes;
constexpr int64_t kMaxLeadingDims = 8;
constexpr int kMaxOperands = 4;
// Elements per parallel task below which a kernel stays on one thread.
constexpr int64_t kParallelElements = 16384;

// ---------------------------------------------------------------------------
// Stores (plain and non-temporal) and loads of kBlock values as two float32
// vectors.
// ---------------------------------------------------------------------------

// Outputs of at least this many bytes are written with non-temporal stores:
// they do not fit in the last-level cache anyway, and streaming them skips
// the read-for-ownership of every output line.  The loader sets it to 3/4 of
// the L3 size one core sees (sysfs); -1 falls back to sysconf's L3 size.
std::atomic<int64_t> streaming_threshold_bytes{-1};

int64_t default_streaming_threshold() {
  long cache = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (cache <= 0) {
    cache = 32L << 20;
  }
  return static_cast<int64_t>(cache) * 3 / 4;
}

bool streams(const Tensor& out) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  int64_t threshold = streaming_threshold_bytes.load(std::memory_order_relaxed);
  if (threshold < 0) {
    threshold = default_streaming_threshold();
    streaming_threshold_bytes.store(threshold, std::memory_order_relaxed);
  }
  return static_cast<int64_t>(out.nbytes()) >= threshold;
#else
  (void)out;
  return false;
#endif
}

inline bool vector_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(fVec) == 0;
}

// Non-temporal store of one full vector (float32 or 16-bit) to aligned ``p``.
template <typename V>
inline void stream_vector(void* p, const V& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<V, fVec>) {
    _mm512_stream_ps(static_cast<float*>(p), v);
  } else {
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<V, fVec>) {
    _mm256_stream_ps(static_cast<float*>(p), v);
  } else {
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  }
#else
  v.store(p);
#endif
}

// Orders a thread's non-temporal stores before the parallel region ends.
inline void finish_streaming(bool stream) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (stream) {
    _mm_sfence();
  }
#else
  (void)stream;
#endif
}

// Rounds two float32 vectors to one vector of a 16-bit type (once, to nearest even).
template <typename T>
inline at::vec::Vectorized<T> from_float(const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BFloat16>) {
    // One instruction instead of ATen's integer emulation; the results agree
    // except that float32 subnormals become zero.
    return at::vec::Vectorized<T>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
  }
#endif
  return at::vec::convert_from_float<T>(a, b);
}

template <typename T>
struct Io {
  using Vec = at::vec::Vectorized<T>;
  static_assert(Vec::size() == kBlock, "16-bit vectors hold two float vectors");

  static inline void load(const T* p, fVec& a, fVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(Vec::loadu(p));
  }
  // Loads n < kBlock values; the rest of the block reads as zero.
  static inline void load(const T* p, int64_t n, fVec& a, fVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(Vec::loadu(p, n));
  }
  static inline void store(T* p, const fVec& a, const fVec& b) {
    from_float<T>(a, b).store(p);
  }
  static inline void store(T* p, int64_t n, const fVec& a, const fVec& b) {
    from_float<T>(a, b).store(p, n);
  }
  // Full-block store, non-temporal when ``stream`` and ``p`` is aligned.
  static inline void put(T* p, const fVec& a, const fVec& b, bool stream) {
    if (stream && vector_aligned(p)) {
      stream_vector(p, from_float<T>(a, b));
    } else {
      store(p, a, b);
    }
  }
};

template <>
struct Io<float> {
  static inline void load(const float* p, fVec& a, fVec& b) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + kLanes);
  }
  static inline void load(const float* p, int64_t n, fVec& a, fVec& b) {
    a = fVec::loadu(p, n < kLanes ? n : kLanes);
    b = n > kLanes ? fVec::loadu(p + kLanes, n - kLanes) : fVec(0.0f);
  }
  static inline void store(float* p, const fVec& a, const fVec& b) {
    a.store(p);
    b.store(p + kLanes);
  }
  static inline void store(float* p, int64_t n, const fVec& a, const fVec& b) {
    a.store(p, n < kLanes ? n : kLanes);
    if (n > kLanes) {
      b.store(p + kLanes, n - kLanes);
    }
  }
  static inline void put(float* p, const fVec& a, const fVec& b, bool stream) {
    if (stream && vector_aligned(p)) {
      stream_vector(p, a);
      stream_vector(p + kLanes, b);
    } else {
      store(p, a, b);
    }
  }
};

inline float horizontal_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the interleaved rotation.
inline fVec rotate_pairs(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 swapped = _mm512_permute_ps(v, 0xB1);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi64(0x80000000LL));
  return _mm512_xor_ps(swapped, sign);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 swapped = _mm256_permute_ps(v, 0xB1);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi64x(0x80000000LL));
  return _mm256_xor_ps(swapped, sign);
#else
  alignas(64) float in[kLanes];
  alignas(64) float out[kLanes];
  v.store(in);
  for (int64_t i = 0; i < kLanes; i += 2) {
    out[i] = -in[i + 1];
    out[i + 1] = in[i];
  }
  return fVec::loadu(out);
#endif
}

// n <= kLanes / 2 values (p0, p1, ...) -> (p0, p0, p1, p1, ...), zero beyond.
inline fVec load_duplicated(const float* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n == kLanes / 2) {
    const __m512 v = _mm512_castps256_ps512(_mm256_loadu_ps(p));
    const __m512i index = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(index, v);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (n == kLanes / 2) {
    const __m256 v = _mm256_castps128_ps256(_mm_loadu_ps(p));
    const __m256i index = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    return _mm256_permutevar8x32_ps(v, index);
  }
#endif
  alignas(64) float out[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    out[2 * i] = p[i];
    out[2 * i + 1] = p[i];
  }
  return fVec::loadu(out);
}

// ---------------------------------------------------------------------------
// Row iteration: all dims but the last, with per-operand element offsets.
// ---------------------------------------------------------------------------

struct RowLayout {
  int64_t dims = 0;
  int operands = 0;
  std::array<int64_t, kMaxLeadingDims> sizes{};
  std::array<std::array<int64_t, kMaxLeadingDims>, kMaxOperands> strides{};
};

// ``tensors`` all have the shape of x's leading dims (broadcast strides allowed).
RowLayout make_layout(at::IntArrayRef leading_sizes, std::initializer_list<const Tensor*> tensors) {
  RowLayout layout;
  layout.dims = static_cast<int64_t>(leading_sizes.size());
  layout.operands = static_cast<int>(tensors.size());
  for (int64_t d = 0; d < layout.dims; ++d) {
    layout.sizes[d] = leading_sizes[d];
  }
  int op = 0;
  for (const Tensor* t : tensors) {
    for (int64_t d = 0; d < layout.dims; ++d) {
      layout.strides[op][d] = t->size(d) == 1 ? 0 : t->stride(d);
    }
    ++op;
  }
  return layout;
}

class RowCursor {
 public:
  RowCursor(const RowLayout& layout, int64_t row) : layout_(layout) {
    offsets_.fill(0);
    index_.fill(0);
    for (int64_t d = layout_.dims - 1; d >= 0; --d) {
      const int64_t size = layout_.sizes[d];
      index_[d] = row % size;
      row /= size;
      for (int op = 0; op < layout_.operands; ++op) {
        offsets_[op] += index_[d] * layout_.strides[op][d];
      }
    }
  }

  int64_t offset(int op) const { return offsets_[op]; }

  void next() {
    for (int64_t d = layout_.dims - 1; d >= 0; --d) {
      if (++index_[d] < layout_.sizes[d]) {
        for (int op = 0; op < layout_.operands; ++op) {
          offsets_[op] += layout_.strides[op][d];
        }
        return;
      }
      index_[d] = 0;
      for (int op = 0; op < layout_.operands; ++op) {
        offsets_[op] -= (layout_.sizes[d] - 1) * layout_.strides[op][d];
      }
    }
  }

 private:
  const RowLayout& layout_;
  std::array<int64_t, kMaxLeadingDims> index_;
  std::array<int64_t, kMaxOperands> offsets_;
};

// Element step from a row of operand ``op`` to the next one in iteration order
// (exact within the innermost leading dim, which holds most rows).
int64_t next_row_step(const RowLayout& layout, int op) {
  return layout.dims == 0 ? 0 : layout.strides[op][layout.dims - 1];
}

// Prefetches ``bytes`` bytes from ``p`` into L1.  The row kernels finish a
// row from L1 in their later passes; prefetching the next row meanwhile keeps
// memory busy.  Prefetches past the end of a tensor are harmless.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(start + offset, 0, 3);
  }
}

int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(width, 1));
}

// Runs body(cursor, out_row_index, scratch) for every row of x, in parallel;
// ``scratch`` holds ``scratch_floats`` floats private to the running thread.
template <typename Body>
void for_each_row(
    const RowLayout& layout, int64_t rows, int64_t width, bool stream, const Body& body,
    int64_t scratch_floats = 0) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    RowCursor cursor(layout, begin);
    for (int64_t row = begin; row < end; ++row, cursor.next()) {
      body(cursor, row, scratch.data());
    }
    finish_streaming(stream);
  });
}

// ---------------------------------------------------------------------------
// Operand preparation and coverage checks.
// ---------------------------------------------------------------------------

bool is_covered_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::BFloat16 || t == ScalarType::Half;
}

bool on_cpu(const Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided;
}

// x with a unit-stride last dim (copied when its last dim is strided).
Tensor with_unit_last_stride(const Tensor& x) {
  return (x.size(-1) <= 1 || x.stride(-1) == 1) ? x : x.contiguous();
}

// True when ``t`` broadcasts into ``x_sizes``; the last dim is not compared.
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

// ``t`` as x's leading shape plus a last dim of ``width`` unit-stride values,
// with zero strides where it broadcasts.  ``t`` has last size width or 1.
Tensor as_row_operand(Tensor t, at::IntArrayRef x_sizes, int64_t width, ScalarType dtype) {
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
  std::vector<int64_t> target(x_sizes.begin(), x_sizes.end());
  target.back() = width;
  return t.expand(target);
}

Tensor empty_output(const Tensor& x, at::IntArrayRef sizes, ScalarType dtype) {
  return at::empty(sizes, x.options().dtype(dtype).memory_format(at::MemoryFormat::Contiguous));
}

// Calls f(T{}) with T the C++ type of the covered float dtype ``t``.
template <typename F>
void dispatch_float(ScalarType t, const F& f) {
  switch (t) {
    case ScalarType::Float:
      f(float{});
      break;
    case ScalarType::BFloat16:
      f(BFloat16{});
      break;
    case ScalarType::Half:
      f(Half{});
      break;
    default:
      TORCH_CHECK(false, "mindiesd cpp kernels: uncovered dtype ", t);
  }
}

// A tensor re-read for many rows (at most 1/8 of x's size) is cheaper to
// convert to float32 once than on every read.
bool is_small_operand(const Tensor& t, int64_t x_numel) {
  return t.numel() * 8 <= x_numel;
}

// dtype of row parameters (weight, scale, shift): x's dtype when they all
// have it and one of them is large, else float32 (they are converted).
ScalarType parameter_dtype(
    ScalarType x_dtype, int64_t x_numel, std::initializer_list<const Tensor*> params) {
  bool all_small = true;
  for (const Tensor* p : params) {
    if (p->scalar_type() != x_dtype) {
      return ScalarType::Float;
    }
    all_small = all_small && is_small_operand(*p, x_numel);
  }
  return all_small ? ScalarType::Float : x_dtype;
}

// Row reductions with four independent accumulators (two blocks per step).
template <typename T>
inline float sum_of_squares(const T* p, int64_t width) {
  fVec acc0(0.0f), acc1(0.0f), acc2(0.0f), acc3(0.0f);
  int64_t j = 0;
  for (; j + 2 * kBlock <= width; j += 2 * kBlock) {
    fVec a, b, c, d;
    Io<T>::load(p + j, a, b);
    Io<T>::load(p + j + kBlock, c, d);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
    acc2 = at::vec::fmadd(c, c, acc2);
    acc3 = at::vec::fmadd(d, d, acc3);
  }
  for (; j < width; j += kBlock) {
    fVec a, b;
    if (j + kBlock <= width) {
      Io<T>::load(p + j, a, b);
    } else {
      Io<T>::load(p + j, width - j, a, b);
    }
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  return horizontal_sum((acc0 + acc1) + (acc2 + acc3));
}

// Sum of the row; when ``copy`` is given, also stores the row there as float32.
template <typename T>
inline float row_sum(const T* p, int64_t width, float* copy) {
  fVec acc0(0.0f), acc1(0.0f), acc2(0.0f), acc3(0.0f);
  int64_t j = 0;
  for (; j + 2 * kBlock <= width; j += 2 * kBlock) {
    fVec a, b, c, d;
    Io<T>::load(p + j, a, b);
    Io<T>::load(p + j + kBlock, c, d);
    if (copy != nullptr) {
      Io<float>::store(copy + j, a, b);
      Io<float>::store(copy + j + kBlock, c, d);
    }
    acc0 = acc0 + a;
    acc1 = acc1 + b;
    acc2 = acc2 + c;
    acc3 = acc3 + d;
  }
  for (; j < width; j += kBlock) {
    const int64_t n = std::min(kBlock, width - j);
    fVec a, b;
    if (n == kBlock) {
      Io<T>::load(p + j, a, b);
    } else {
      Io<T>::load(p + j, n, a, b);
    }
    if (copy != nullptr) {
      Io<float>::store(copy + j, n, a, b);
    }
    acc0 = acc0 + a;
    acc1 = acc1 + b;
  }
  return horizontal_sum((acc0 + acc1) + (acc2 + acc3));
}

// Sums of d = x - mean and of d^2 over a float32 row, as {sum d, sum d^2}.
inline std::pair<float, float> centered_sums(const float* p, int64_t width, const fVec& mean) {
  fVec sum0(0.0f), sum1(0.0f), sq0(0.0f), sq1(0.0f), sq2(0.0f), sq3(0.0f);
  int64_t j = 0;
  for (; j + 4 * kLanes <= width; j += 4 * kLanes) {
    const fVec a = fVec::loadu(p + j) - mean;
    const fVec b = fVec::loadu(p + j + kLanes) - mean;
    const fVec c = fVec::loadu(p + j + 2 * kLanes) - mean;
    const fVec d = fVec::loadu(p + j + 3 * kLanes) - mean;
    sum0 = sum0 + (a + b);
    sum1 = sum1 + (c + d);
    sq0 = at::vec::fmadd(a, a, sq0);
    sq1 = at::vec::fmadd(b, b, sq1);
    sq2 = at::vec::fmadd(c, c, sq2);
    sq3 = at::vec::fmadd(d, d, sq3);
  }
  for (; j < width; j += kLanes) {
    const int64_t n = std::min(kLanes, width - j);
    // Lanes past the row must add nothing (a zero-filled lane would add -mean).
    const fVec a = n == kLanes ? fVec::loadu(p + j) - mean
                               : fVec::set(fVec(0.0f), fVec::loadu(p + j) - mean, n);
    sum0 = sum0 + a;
    sq0 = at::vec::fmadd(a, a, sq0);
  }
  return {horizontal_sum(sum0 + sum1), horizontal_sum((sq0 + sq1) + (sq2 + sq3))};
}

// ---------------------------------------------------------------------------
// rms_norm
// ---------------------------------------------------------------------------

template <typename TX, typename TW, typename TO, bool kWeighted>
void rms_norm_kernel(const Tensor& x, const Tensor& weight, Tensor& out, float eps) {
  const int64_t width = x.size(-1);
  const int64_t rows = out.numel() / width;
  const at::IntArrayRef leading = x.sizes().slice(0, x.dim() - 1);
  const RowLayout layout = kWeighted ? make_layout(leading, {&x, &weight}) : make_layout(leading, {&x});
  const TX* x_data = x.const_data_ptr<TX>();
  const TW* w_data = kWeighted ? weight.const_data_ptr<TW>() : nullptr;
  TO* out_data = out.mutable_data_ptr<TO>();
  const bool stream = streams(out);
  const float inv_width = 1.0f / static_cast<float>(width);
  const int64_t x_step = next_row_step(layout, 0);

  for_each_row(layout, rows, width, stream, [&](const RowCursor& cursor, int64_t row, float*) {
    const TX* xr = x_data + cursor.offset(0);
    TO* outr = out_data + row * width;
    const float mean_square = sum_of_squares(xr, width) * inv_width;
    const fVec inv_rms(1.0f / std::sqrt(mean_square + eps));
    const TW* wr = kWeighted ? w_data + cursor.offset(1) : nullptr;
    const TX* next_xr = xr + x_step;
    for (int64_t j = 0; j < width; j += kBlock) {
      const int64_t n = std::min(kBlock, width - j);
      prefetch_bytes(next_xr + j, kBlock * sizeof(TX));
      fVec a, b;
      if (n == kBlock) {
        Io<TX>::load(xr + j, a, b);
      } else {
        Io<TX>::load(xr + j, n, a, b);
      }
      a = a * inv_rms;
      b = b * inv_rms;
      if constexpr (kWeighted) {
        fVec wa, wb;
        if (n == kBlock) {
          Io<TW>::load(wr + j, wa, wb);
        } else {
          Io<TW>::load(wr + j, n, wa, wb);
        }
        a = a * wa;
        b = b * wb;
      }
      if (n == kBlock) {
        Io<TO>::put(outr + j, a, b, stream);
      } else {
        Io<TO>::store(outr + j, n, a, b);
      }
    }
  });
}

std::optional<Tensor> rms_norm_entry(
    const Tensor& x_in, const std::optional<Tensor>& weight_in, double eps, ScalarType out_dtype) {
  if (!on_cpu(x_in) || x_in.dim() < 1 || x_in.dim() - 1 > kMaxLeadingDims ||
      !is_covered_float(x_in.scalar_type()) || !is_covered_float(out_dtype)) {
    return std::nullopt;
  }
  const bool weighted = weight_in.has_value() && weight_in->defined();
  if (weighted) {
    const Tensor& w = *weight_in;
    if (!on_cpu(w) || !is_covered_float(w.scalar_type()) || !broadcasts_into_rows(w, x_in.sizes())) {
      return std::nullopt;
    }
    if (w.dim() > 0 && w.size(-1) != 1 && w.size(-1) != x_in.size(-1)) {
      return std::nullopt;
    }
  }
  at::NoGradGuard no_grad;
  Tensor out = empty_output(x_in, x_in.sizes(), out_dtype);
  if (x_in.numel() == 0) {
    return out;
  }
  const Tensor x = with_unit_last_stride(x_in);
  const int64_t width = x.size(-1);
  const ScalarType x_dtype = x.scalar_type();
  Tensor weight;
  ScalarType w_dtype = x_dtype;
  if (weighted) {
    w_dtype = parameter_dtype(x_dtype, x.numel(), {&*weight_in});
    weight = as_row_operand(*weight_in, x.sizes(), width, w_dtype);
  }
  const float eps_f = static_cast<float>(eps);
  dispatch_float(x_dtype, [&](auto x_tag) {
    using TX = decltype(x_tag);
    dispatch_float(out_dtype, [&](auto o_tag) {
      using TO = decltype(o_tag);
      if (!weighted) {
        rms_norm_kernel<TX, float, TO, false>(x, weight, out, eps_f);
      } else if (w_dtype == ScalarType::Float) {
        rms_norm_kernel<TX, float, TO, true>(x, weight, out, eps_f);
      } else {
        rms_norm_kernel<TX, TX, TO, true>(x, weight, out, eps_f);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------
// adalayernorm: layer_norm(x) * (1 + scale) + shift
// ---------------------------------------------------------------------------

// kScalePlusOne: ``scale`` already holds 1 + scale (small modulations).
template <typename TX, typename TP, typename TO, bool kScalePlusOne>
void adalayernorm_kernel(
    const Tensor& x, const Tensor& scale, const Tensor& shift, Tensor& out, float eps) {
  const int64_t width = x.size(-1);
  const int64_t rows = out.numel() / width;
  const RowLayout layout = make_layout(x.sizes().slice(0, x.dim() - 1), {&x, &scale, &shift});
  const TX* x_data = x.const_data_ptr<TX>();
  const TP* scale_data = scale.const_data_ptr<TP>();
  const TP* shift_data = shift.const_data_ptr<TP>();
  TO* out_data = out.mutable_data_ptr<TO>();
  const bool stream = streams(out);
  const float inv_width = 1.0f / static_cast<float>(width);
  const fVec one(kScalePlusOne ? 0.0f : 1.0f);
  // 16-bit rows are widened once into a float32 row buffer (L1-resident).
  constexpr bool kWiden = !std::is_same_v<TX, float>;
  const int64_t x_step = next_row_step(layout, 0);

  auto body = [&](const RowCursor& cursor, int64_t row, float* scratch) {
    const TX* xr = x_data + cursor.offset(0);
    const TP* sr = scale_data + cursor.offset(1);
    const TP* hr = shift_data + cursor.offset(2);
    TO* outr = out_data + row * width;

    const float first_mean = row_sum(xr, width, kWiden ? scratch : nullptr) * inv_width;
    const float* values = kWiden ? scratch : reinterpret_cast<const float*>(xr);
    // Corrected two-pass statistics: the centered sum refines the mean.
    const auto [centered, squares] = centered_sums(values, width, fVec(first_mean));
    const float correction = centered * inv_width;
    const fVec mean(first_mean + correction);
    const float variance = std::max(squares * inv_width - correction * correction, 0.0f);
    const fVec rstd(1.0f / std::sqrt(variance + eps));

    const TX* next_xr = xr + x_step;
    for (int64_t j = 0; j < width; j += kBlock) {
      const int64_t n = std::min(kBlock, width - j);
      prefetch_bytes(next_xr + j, kBlock * sizeof(TX));
      fVec a, b, s0, s1, h0, h1;
      if (n == kBlock) {
        Io<float>::load(values + j, a, b);
        Io<TP>::load(sr + j, s0, s1);
        Io<TP>::load(hr + j, h0, h1);
      } else {
        Io<float>::load(values + j, n, a, b);
        Io<TP>::load(sr + j, n, s0, s1);
        Io<TP>::load(hr + j, n, h0, h1);
      }
      if constexpr (!kScalePlusOne) {
        s0 = s0 + one;
        s1 = s1 + one;
      }
      a = at::vec::fmadd((a - mean) * rstd, s0, h0);
      b = at::vec::fmadd((b - mean) * rstd, s1, h1);
      if (n == kBlock) {
        Io<TO>::put(outr + j, a, b, stream);
      } else {
        Io<TO>::store(outr + j, n, a, b);
      }
    }
  };
  for_each_row(layout, rows, width, stream, body, kWiden ? width : 0);
}

std::optional<Tensor> adalayernorm_entry(
    const Tensor& x_in, const Tensor& scale_in, const Tensor& shift_in, double eps, ScalarType out_dtype) {
  if (!on_cpu(x_in) || x_in.dim() < 1 || x_in.dim() - 1 > kMaxLeadingDims ||
      !is_covered_float(x_in.scalar_type()) || !is_covered_float(out_dtype)) {
    return std::nullopt;
  }
  for (const Tensor* p : {&scale_in, &shift_in}) {
    if (!on_cpu(*p) || !is_covered_float(p->scalar_type()) || !broadcasts_into_rows(*p, x_in.sizes())) {
      return std::nullopt;
    }
    if (p->dim() > 0 && p->size(-1) != 1 && p->size(-1) != x_in.size(-1)) {
      return std::nullopt;
    }
  }
  at::NoGradGuard no_grad;
  Tensor out = empty_output(x_in, x_in.sizes(), out_dtype);
  if (x_in.numel() == 0) {
    return out;
  }
  const Tensor x = with_unit_last_stride(x_in);
  const int64_t width = x.size(-1);
  const ScalarType x_dtype = x.scalar_type();
  const ScalarType p_dtype = parameter_dtype(x_dtype, x.numel(), {&scale_in, &shift_in});
  // A small scale is turned into 1 + scale once, in float32.
  const bool plus_one = p_dtype == ScalarType::Float && is_small_operand(scale_in, x.numel());
  const Tensor scale = plus_one ? as_row_operand(scale_in.to(ScalarType::Float).add(1), x.sizes(), width, p_dtype)
                                : as_row_operand(scale_in, x.sizes(), width, p_dtype);
  const Tensor shift = as_row_operand(shift_in, x.sizes(), width, p_dtype);
  const float eps_f = static_cast<float>(eps);
  dispatch_float(x_dtype, [&](auto x_tag) {
    using TX = decltype(x_tag);
    dispatch_float(out_dtype, [&](auto o_tag) {
      using TO = decltype(o_tag);
      if (plus_one) {
        adalayernorm_kernel<TX, float, TO, true>(x, scale, shift, out, eps_f);
      } else if (p_dtype == ScalarType::Float) {
        adalayernorm_kernel<TX, float, TO, false>(x, scale, shift, out, eps_f);
      } else {
        adalayernorm_kernel<TX, TX, TO, false>(x, scale, shift, out, eps_f);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------
// rope: x * cos + rotate(x) * sin
// ---------------------------------------------------------------------------

// Interleaved pairs (x[2i], x[2i+1]).  Per-pair tables hold D/2 values.
template <typename TX, typename TO, bool kPerPair>
void rope_interleaved_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor& out) {
  const int64_t width = x.size(-1);
  const int64_t rows = out.numel() / width;
  const RowLayout layout = make_layout(x.sizes().slice(0, x.dim() - 1), {&x, &cos, &sin});
  const TX* x_data = x.const_data_ptr<TX>();
  const float* cos_data = cos.const_data_ptr<float>();
  const float* sin_data = sin.const_data_ptr<float>();
  TO* out_data = out.mutable_data_ptr<TO>();
  const bool stream = streams(out);

  for_each_row(layout, rows, width, stream, [&](const RowCursor& cursor, int64_t row, float*) {
    const TX* xr = x_data + cursor.offset(0);
    const float* cr = cos_data + cursor.offset(1);
    const float* sr = sin_data + cursor.offset(2);
    TO* outr = out_data + row * width;
    for (int64_t j = 0; j < width; j += kBlock) {
      const int64_t n = std::min(kBlock, width - j);
      fVec a, b, c0, c1, s0, s1;
      if (n == kBlock) {
        Io<TX>::load(xr + j, a, b);
      } else {
        Io<TX>::load(xr + j, n, a, b);
      }
      if constexpr (kPerPair) {
        const int64_t pairs = n / 2;
        const int64_t first = std::min(pairs, kLanes / 2);
        const int64_t second = pairs - first;
        c0 = load_duplicated(cr + j / 2, first);
        s0 = load_duplicated(sr + j / 2, first);
        c1 = load_duplicated(cr + j / 2 + kLanes / 2, second);
        s1 = load_duplicated(sr + j / 2 + kLanes / 2, second);
      } else if (n == kBlock) {
        Io<float>::load(cr + j, c0, c1);
        Io<float>::load(sr + j, s0, s1);
      } else {
        Io<float>::load(cr + j, n, c0, c1);
        Io<float>::load(sr + j, n, s0, s1);
      }
      const fVec r0 = at::vec::fmadd(rotate_pairs(a), s0, a * c0);
      const fVec r1 = at::vec::fmadd(rotate_pairs(b), s1, b * c1);
      if (n == kBlock) {
        Io<TO>::put(outr + j, r0, r1, stream);
      } else {
        Io<TO>::store(outr + j, n, r0, r1);
      }
    }
  });
}

// Half-rotated pairs (x[i], x[i + D/2]).  Per-pair tables hold D/2 values.
template <typename TX, typename TO, bool kPerPair>
void rope_half_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor& out) {
  const int64_t width = x.size(-1);
  const int64_t half = width / 2;
  const int64_t rows = out.numel() / width;
  const RowLayout layout = make_layout(x.sizes().slice(0, x.dim() - 1), {&x, &cos, &sin});
  const TX* x_data = x.const_data_ptr<TX>();
  const float* cos_data = cos.const_data_ptr<float>();
  const float* sin_data = sin.const_data_ptr<float>();
  TO* out_data = out.mutable_data_ptr<TO>();
  const bool stream = streams(out);
  const int64_t second_table = kPerPair ? 0 : half;

  for_each_row(layout, rows, width, stream, [&](const RowCursor& cursor, int64_t row, float*) {
    const TX* xr = x_data + cursor.offset(0);
    const float* cr = cos_data + cursor.offset(1);
    const float* sr = sin_data + cursor.offset(2);
    TO* outr = out_data + row * width;
    for (int64_t j = 0; j < half; j += kBlock) {
      const int64_t n = std::min(kBlock, half - j);
      fVec x1a, x1b, x2a, x2b, c1a, c1b, c2a, c2b, s1a, s1b, s2a, s2b;
      if (n == kBlock) {
        Io<TX>::load(xr + j, x1a, x1b);
        Io<TX>::load(xr + half + j, x2a, x2b);
        Io<float>::load(cr + j, c1a, c1b);
        Io<float>::load(sr + j, s1a, s1b);
        Io<float>::load(cr + second_table + j, c2a, c2b);
        Io<float>::load(sr + second_table + j, s2a, s2b);
      } else {
        Io<TX>::load(xr + j, n, x1a, x1b);
        Io<TX>::load(xr + half + j, n, x2a, x2b);
        Io<float>::load(cr + j, n, c1a, c1b);
        Io<float>::load(sr + j, n, s1a, s1b);
        Io<float>::load(cr + second_table + j, n, c2a, c2b);
        Io<float>::load(sr + second_table + j, n, s2a, s2b);
      }
      const fVec o1a = at::vec::fmsub(x1a, c1a, x2a * s1a);
      const fVec o1b = at::vec::fmsub(x1b, c1b, x2b * s1b);
      const fVec o2a = at::vec::fmadd(x2a, c2a, x1a * s2a);
      const fVec o2b = at::vec::fmadd(x2b, c2b, x1b * s2b);
      if (n == kBlock) {
        Io<TO>::put(outr + j, o1a, o1b, stream);
        Io<TO>::put(outr + half + j, o2a, o2b, stream);
      } else {
        Io<TO>::store(outr + j, n, o1a, o1b);
        Io<TO>::store(outr + half + j, n, o2a, o2b);
      }
    }
  });
}

std::optional<Tensor> rope_entry(
    const Tensor& x_in, const Tensor& cos_in, const Tensor& sin_in, bool interleaved, ScalarType out_dtype) {
  if (!on_cpu(x_in) || x_in.dim() < 1 || x_in.dim() - 1 > kMaxLeadingDims ||
      !is_covered_float(x_in.scalar_type()) || !is_covered_float(out_dtype)) {
    return std::nullopt;
  }
  const int64_t width = x_in.size(-1);
  if (width % 2 != 0) {
    return std::nullopt;
  }
  // Tables of one value per pair stay compact unless the other table is full width.
  bool per_pair = width > 0;
  for (const Tensor* t : {&cos_in, &sin_in}) {
    if (!on_cpu(*t) || t->dim() < 1 || !is_covered_float(t->scalar_type()) ||
        !broadcasts_into_rows(*t, x_in.sizes())) {
      return std::nullopt;
    }
    const int64_t last = t->size(-1);
    if (last != width && last != width / 2 && last != 1) {
      return std::nullopt;
    }
    if (last == width && last != 1) {
      per_pair = false;
    }
  }
  at::NoGradGuard no_grad;
  Tensor out = empty_output(x_in, x_in.sizes(), out_dtype);
  if (x_in.numel() == 0) {
    return out;
  }
  const Tensor x = with_unit_last_stride(x_in);
  const int64_t table_width = per_pair ? width / 2 : width;
  // A D/2 table next to a full-width one is widened to full width.
  auto prepare = [&](const Tensor& t) {
    Tensor table = t;
    if (!per_pair && t.size(-1) == width / 2 && width > 1) {
      table = interleaved ? t.to(ScalarType::Float).repeat_interleave(2, -1)
                          : at::cat({t, t}, -1);
    }
    return as_row_operand(table, x.sizes(), table_width, ScalarType::Float);
  };
  const Tensor cos = prepare(cos_in);
  const Tensor sin = prepare(sin_in);
  dispatch_float(x.scalar_type(), [&](auto x_tag) {
    using TX = decltype(x_tag);
    dispatch_float(out_dtype, [&](auto o_tag) {
      using TO = decltype(o_tag);
      if (interleaved) {
        if (per_pair) {
          rope_interleaved_kernel<TX, TO, true>(x, cos, sin, out);
        } else {
          rope_interleaved_kernel<TX, TO, false>(x, cos, sin, out);
        }
      } else {
        if (per_pair) {
          rope_half_kernel<TX, TO, true>(x, cos, sin, out);
        } else {
          rope_half_kernel<TX, TO, false>(x, cos, sin, out);
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------
// fast_gelu and mul_add: elementwise, through TensorIterator.
// ---------------------------------------------------------------------------

constexpr float kGeluCoefficient = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
inline float gelu_tanh(float v) {
  const float u = kGeluCoefficient * (v + kGeluCubic * v * v * v);
  return v / (1.0f + std::exp(-2.0f * u));
}

// 1 / d for d >= 1: hardware estimate refined by one Newton step (about
// 1 ulp), much cheaper than a vector division.
inline fVec reciprocal(const fVec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 estimate = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(estimate, _mm512_fnmadd_ps(d, estimate, _mm512_set1_ps(2.0f)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 estimate = _mm256_rcp_ps(d);
  return _mm256_mul_ps(estimate, _mm256_fnmadd_ps(d, estimate, _mm256_set1_ps(2.0f)));
#else
  return fVec(1.0f) / d;
#endif
}

// exp(t) for t in [-87, 88] (callers clamp), about 2 ulp: t = n ln2 + r with
// |r| <= ln2 / 2, a degree-5 polynomial for exp(r), then a scale by 2^n.
inline fVec exp_clamped(const fVec& t) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const fVec n = (t * fVec(1.44269504088896341f)).round();
  const fVec r = at::vec::fmadd(n, fVec(-0.693147180559945309f), t);
  fVec poly = at::vec::fmadd(r, fVec(0.00828929059f), fVec(0.0418978221f));
  poly = at::vec::fmadd(poly, r, fVec(0.166676521f));
  poly = at::vec::fmadd(poly, r, fVec(0.499991506f));
  poly = at::vec::fmadd(poly, r, fVec(0.999999701f));
  poly = at::vec::fmadd(poly, r, fVec(1.0f));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(poly, n);
#else
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return poly * fVec(_mm256_castsi256_ps(exponent));
#endif
#else
  return t.exp_u20();
#endif
}

inline fVec gelu_tanh(const fVec& v) {
  const fVec minus_two_k(-2.0f * kGeluCoefficient);
  const fVec cubic(kGeluCubic);
  const fVec one(1.0f);
  // Clamped so that 1 + exp stays finite (there the result is below 1e-38 |v|)
  // and 2^n stays normal (there it is v itself).
  const fVec inner = at::vec::clamp(at::vec::fmadd(cubic * v, v * v, v) * minus_two_k, fVec(-87.0f), fVec(88.0f));
  return v * reciprocal(one + exp_clamped(inner));
}

template <typename T>
void gelu_loop(at::TensorIteratorBase& iter) {
  if constexpr (std::is_same_v<T, float>) {
    at::native::cpu_kernel_vec(
        iter, [](float v) -> float { return gelu_tanh(v); },
        [](fVec v) -> fVec { return gelu_tanh(v); });
  } else {
    using Vec = at::vec::Vectorized<T>;
    at::native::cpu_kernel_vec(
        iter, [](T v) -> T { return static_cast<T>(gelu_tanh(static_cast<float>(v))); },
        [](Vec v) -> Vec {
          auto [a, b] = at::vec::convert_to_float<T>(v);
          return from_float<T>(gelu_tanh(a), gelu_tanh(b));
        });
  }
}

// Contiguous input: one flat loop over blocks, split across threads.
template <typename T>
void gelu_contiguous(const Tensor& x, Tensor& out) {
  const T* in = x.const_data_ptr<T>();
  T* result = out.mutable_data_ptr<T>();
  const int64_t numel = x.numel();
  const bool stream = streams(out);
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kParallelElements / kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t j = block * kBlock;
      const int64_t n = std::min(kBlock, numel - j);
      fVec a, b;
      if (n == kBlock) {
        Io<T>::load(in + j, a, b);
        Io<T>::put(result + j, gelu_tanh(a), gelu_tanh(b), stream);
      } else {
        Io<T>::load(in + j, n, a, b);
        Io<T>::store(result + j, n, gelu_tanh(a), gelu_tanh(b));
      }
    }
    finish_streaming(stream);
  });
}

std::optional<Tensor> fast_gelu_entry(const Tensor& x) {
  if (!on_cpu(x) || !is_covered_float(x.scalar_type())) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  Tensor out = empty_output(x, x.sizes(), x.scalar_type());
  if (x.numel() == 0) {
    return out;
  }
  if (x.is_contiguous()) {
    dispatch_float(x.scalar_type(), [&](auto tag) { gelu_contiguous<decltype(tag)>(x, out); });
    return out;
  }
  auto iter = at::TensorIteratorConfig().add_output(out).add_const_input(x).build();
  dispatch_float(x.scalar_type(), [&](auto tag) { gelu_loop<decltype(tag)>(iter); });
  return out;
}

template <typename T>
void mul_add_loop(at::TensorIteratorBase& iter) {
  if constexpr (std::is_same_v<T, float>) {
    at::native::cpu_kernel_vec(
        iter, [](float a, float b, float c) -> float { return a * b + c; },
        [](fVec a, fVec b, fVec c) -> fVec { return at::vec::fmadd(a, b, c); });
  } else {
    using Vec = at::vec::Vectorized<T>;
    at::native::cpu_kernel_vec(
        iter,
        [](T a, T b, T c) -> T {
          return static_cast<T>(static_cast<float>(a) * static_cast<float>(b) + static_cast<float>(c));
        },
        [](Vec a, Vec b, Vec c) -> Vec {
          auto [a0, a1] = at::vec::convert_to_float<T>(a);
          auto [b0, b1] = at::vec::convert_to_float<T>(b);
          auto [c0, c1] = at::vec::convert_to_float<T>(c);
          return from_float<T>(at::vec::fmadd(a0, b0, c0), at::vec::fmadd(a1, b1, c1));
        });
  }
}

// Operands with a unit-stride last dim of the output's width: row loop.
// TY/TZ are float when y/z were converted once (small, re-read operands).
template <typename T, typename TY, typename TZ>
void mul_add_rows(const Tensor& x, const Tensor& y, const Tensor& z, Tensor& out) {
  const int64_t width = out.size(-1);
  const int64_t rows = out.numel() / width;
  const RowLayout layout = make_layout(out.sizes().slice(0, out.dim() - 1), {&x, &y, &z});
  const T* x_data = x.const_data_ptr<T>();
  const TY* y_data = y.const_data_ptr<TY>();
  const TZ* z_data = z.const_data_ptr<TZ>();
  T* out_data = out.mutable_data_ptr<T>();
  const bool stream = streams(out);
  for_each_row(layout, rows, width, stream, [&](const RowCursor& cursor, int64_t row, float*) {
    const T* xr = x_data + cursor.offset(0);
    const TY* yr = y_data + cursor.offset(1);
    const TZ* zr = z_data + cursor.offset(2);
    T* outr = out_data + row * width;
    for (int64_t j = 0; j < width; j += kBlock) {
      const int64_t n = std::min(kBlock, width - j);
      fVec x0, x1, y0, y1, z0, z1;
      if (n == kBlock) {
        Io<T>::load(xr + j, x0, x1);
        Io<TY>::load(yr + j, y0, y1);
        Io<TZ>::load(zr + j, z0, z1);
        Io<T>::put(outr + j, at::vec::fmadd(x0, y0, z0), at::vec::fmadd(x1, y1, z1), stream);
      } else {
        Io<T>::load(xr + j, n, x0, x1);
        Io<TY>::load(yr + j, n, y0, y1);
        Io<TZ>::load(zr + j, n, z0, z1);
        Io<T>::store(outr + j, n, at::vec::fmadd(x0, y0, z0), at::vec::fmadd(x1, y1, z1));
      }
    }
  });
}

// ``t`` broadcast to ``shape`` when its last dim is the output's with unit
// stride (the row loop's form), else an undefined tensor.
Tensor as_row_input(const Tensor& t, at::IntArrayRef shape) {
  if (t.dim() == 0 || t.size(-1) != shape.back() || (shape.back() > 1 && t.stride(-1) != 1)) {
    return Tensor();
  }
  return t.expand(shape);
}

// The row loop when every operand has its form; false otherwise.
template <typename T>
bool mul_add_by_rows(Tensor x, Tensor y, Tensor z, Tensor& out) {
  const int64_t numel = out.numel();
  bool y_small = false;
  bool z_small = false;
  if constexpr (!std::is_same_v<T, float>) {
    if (is_small_operand(x, numel) && !is_small_operand(y, numel)) {
      std::swap(x, y);  // x * y == y * x: keep the small factor in y
    }
    // Small operands are widened once, before broadcasting (a copy of their size).
    y_small = is_small_operand(y, numel);
    z_small = is_small_operand(z, numel);
    if (y_small) {
      y = y.to(ScalarType::Float);
    }
    if (z_small) {
      z = z.to(ScalarType::Float);
    }
  }
  x = as_row_input(x, out.sizes());
  y = as_row_input(y, out.sizes());
  z = as_row_input(z, out.sizes());
  if (!x.defined() || !y.defined() || !z.defined()) {
    return false;
  }
  if constexpr (std::is_same_v<T, float>) {
    mul_add_rows<float, float, float>(x, y, z, out);
  } else if (y_small && z_small) {
    mul_add_rows<T, float, float>(x, y, z, out);
  } else if (y_small) {
    mul_add_rows<T, float, T>(x, y, z, out);
  } else if (z_small) {
    mul_add_rows<T, T, float>(x, y, z, out);
  } else {
    mul_add_rows<T, T, T>(x, y, z, out);
  }
  return true;
}

std::optional<Tensor> mul_add_entry(const Tensor& x, const Tensor& y, const Tensor& z) {
  if (!on_cpu(x) || !on_cpu(y) || !on_cpu(z) || !is_covered_float(x.scalar_type()) ||
      y.scalar_type() != x.scalar_type() || z.scalar_type() != x.scalar_type()) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  const std::vector<int64_t> shape = at::infer_size(at::infer_size(x.sizes(), y.sizes()), z.sizes());
  Tensor out = empty_output(x, shape, x.scalar_type());
  if (out.numel() == 0) {
    return out;
  }
  if (out.dim() >= 1 && out.dim() - 1 <= kMaxLeadingDims && out.size(-1) >= kLanes) {
    bool done = false;
    dispatch_float(x.scalar_type(), [&](auto tag) { done = mul_add_by_rows<decltype(tag)>(x, y, z, out); });
    if (done) {
      return out;
    }
  }
  auto iter = at::TensorIteratorConfig()
                  .add_output(out)
                  .add_const_input(x)
                  .add_const_input(y)
                  .add_const_input(z)
                  .build();
  dispatch_float(x.scalar_type(), [&](auto tag) { mul_add_loop<decltype(tag)>(iter); });
  return out;
}

#define MINDIESD_STRINGIFY_(x) #x
#define MINDIESD_STRINGIFY(x) MINDIESD_STRINGIFY_(x)

std::string capability_name() {
  std::string name = MINDIESD_STRINGIFY(CPU_CAPABILITY);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  name += "+BF16";
#endif
  return name;
}

}  // namespace

std::optional<Tensor> rms_norm(
    const Tensor& x, const std::optional<Tensor>& weight, double eps, ScalarType out_dtype) {
  return rms_norm_entry(x, weight, eps, out_dtype);
}

std::optional<Tensor> adalayernorm(
    const Tensor& x, const Tensor& scale, const Tensor& shift, double eps, ScalarType out_dtype) {
  return adalayernorm_entry(x, scale, shift, eps, out_dtype);
}

std::optional<Tensor> rope(
    const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, ScalarType out_dtype) {
  return rope_entry(x, cos, sin, interleaved, out_dtype);
}

std::optional<Tensor> fast_gelu(const Tensor& x) {
  return fast_gelu_entry(x);
}

std::optional<Tensor> mul_add(const Tensor& x, const Tensor& y, const Tensor& z) {
  return mul_add_entry(x, y, z);
}

std::string capability() {
  return capability_name();
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
