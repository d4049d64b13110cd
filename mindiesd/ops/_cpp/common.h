// Helpers shared by the single-pass CPU kernels (rms_norm.cpp, rope.cpp,
// adalayernorm.cpp, glu.cpp, fast_gelu.cpp, mul_add.cpp).
//
// Every kernel reads its input once from memory and writes one contiguous
// output.  The row kernels (rms_norm, adalayernorm, rope, glu, and mul_add
// when its operands share the output's last dim) walk the rows of the last dim
// with per-operand broadcast strides and keep a row in L1 between passes
// (for_each_row); fast_gelu runs one flat loop over contiguous input.  Other
// strides and broadcasts of fast_gelu and mul_add go through a
// TensorIterator.  16-bit values are widened to float32, computed in float32
// and rounded once when stored (Io, Block).  Outputs larger than most of the
// last-level cache are written with non-temporal stores.
//
// Each entry point (kernels.h; bound to Python in bindings.cpp) returns
// std::nullopt for a form it does not cover; the Python wrapper then runs the
// aten composition kernel instead.  Shapes and dtypes are validated by the
// shared Python rules before the call; the checks here only protect memory
// accesses and select the covered forms.  Each op's source also registers,
// after its kernel, the executor's entry for the op (entries.h).
//
// Every source is compiled with the same flags, so the inline definitions
// here are the same in every translation unit.  What runs once per call
// rather than per element is defined in common.cpp, which alone includes
// the heavier ATen headers it needs (each source parses this one).

#pragma once

#include "entries.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mindiesd_cpu {

using at::BFloat16;
using at::Half;
using at::ScalarType;
using at::Tensor;
using fVec = at::vec::Vectorized<float>;

constexpr int64_t kLanes = fVec::size();
// Elements handled per step: one vector of a 16-bit type, two of float32.
constexpr int64_t kBlock = 2 * kLanes;
constexpr int64_t kMaxLeadingDims = 8;
constexpr int kMaxOperands = 5;
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
inline std::atomic<int64_t> streaming_threshold_bytes{-1};

// 3/4 of the L3 size sysconf reports (of 32 MiB when it reports none).
int64_t default_streaming_threshold();

inline bool streams(const Tensor& out) {
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

// One block of a row: the kBlock values at element ``j`` (kFull), or the
// ``n`` < kBlock values left at the end of a row.  Loads and stores take the
// row's start; which form they use is decided at compile time.
template <bool kFull>
struct Block {
  int64_t j;
  int64_t n;
  bool stream;

  // The block's values of ``row`` as two float32 vectors (zero past the end).
  template <typename T>
  inline std::pair<fVec, fVec> load(const T* row) const {
    fVec a, b;
    if constexpr (kFull) {
      Io<T>::load(row + j, a, b);
    } else {
      Io<T>::load(row + j, n, a, b);
    }
    return {a, b};
  }

  // Stores the block into ``row`` (non-temporal when streaming a full block).
  template <typename T>
  inline void store(T* row, const fVec& a, const fVec& b) const {
    if constexpr (kFull) {
      Io<T>::put(row + j, a, b, stream);
    } else {
      Io<T>::store(row + j, n, a, b);
    }
  }
};

// Calls f(block) for the blocks of elements [begin, end): the full ones, then
// the partial one at the end if any.
template <typename F>
inline void for_each_block(int64_t begin, int64_t end, bool stream, const F& f) {
  int64_t j = begin;
  for (; j + kBlock <= end; j += kBlock) {
    f(Block<true>{j, kBlock, stream});
  }
  if (j < end) {
    f(Block<false>{j, end - j, stream});
  }
}

inline float horizontal_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// A reduction over a row of ``width`` values of ``p`` (as float32), with four
// independent accumulators (two blocks per step): acc = add(acc, v) for every
// vector v of the row, after visit(block, a, b) has seen its block.  Returns
// the sum of the accumulators.
template <typename T, typename Add, typename Visit>
inline float reduce_row(const T* p, int64_t width, const Add& add, const Visit& visit) {
  fVec acc0(0.0f), acc1(0.0f), acc2(0.0f), acc3(0.0f);
  int64_t j = 0;
  for (; j + 2 * kBlock <= width; j += 2 * kBlock) {
    fVec a, b, c, d;
    Io<T>::load(p + j, a, b);
    Io<T>::load(p + j + kBlock, c, d);
    visit(Block<true>{j, kBlock, false}, a, b);
    visit(Block<true>{j + kBlock, kBlock, false}, c, d);
    acc0 = add(acc0, a);
    acc1 = add(acc1, b);
    acc2 = add(acc2, c);
    acc3 = add(acc3, d);
  }
  for_each_block(j, width, false, [&](const auto& block) {
    const auto [a, b] = block.load(p);
    visit(block, a, b);
    acc0 = add(acc0, a);
    acc1 = add(acc1, b);
  });
  return horizontal_sum((acc0 + acc1) + (acc2 + acc3));
}

// Sum of squares of a row.
template <typename T>
inline float sum_of_squares(const T* p, int64_t width) {
  return reduce_row(
      p, width, [](const fVec& acc, const fVec& v) { return at::vec::fmadd(v, v, acc); },
      [](const auto&, const fVec&, const fVec&) {});
}

// Rounds two float32 vectors to the 16-bit type T and back, as a tensor of T would hold them (float: as is).
template <typename T>
inline void round_through(fVec& a, fVec& b) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(a, b) = at::vec::convert_to_float<T>(from_float<T>(a, b));
  }
}

// A block of a row normalised (rms_norm.cpp, rope.cpp's norm_rope): x * inv_rms (* weight), rounded to x's type as
// an output of that type would be when ``kRound`` (else kept in float32).
template <typename TX, typename TW, bool kWeighted, bool kRound, typename BlockT>
inline std::pair<fVec, fVec> normed_block(const BlockT& block, const TX* xr, const TW* wr, const fVec& inv_rms) {
  auto [a, b] = block.load(xr);
  a = a * inv_rms;
  b = b * inv_rms;
  if constexpr (kWeighted) {
    const auto [wa, wb] = block.load(wr);
    a = a * wa;
    b = b * wb;
  }
  if constexpr (kRound) {
    round_through<TX>(a, b);
  }
  return {a, b};
}

// ---------------------------------------------------------------------------
// Activations in float32 (fast_gelu.cpp, glu.cpp).
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

// silu(v) = v / (1 + exp(-v)); exp's argument clamped as in gelu_tanh.
inline float silu(float v) {
  return v / (1.0f + std::exp(-v));
}

inline fVec silu(const fVec& v) {
  const fVec inner = at::vec::clamp(fVec(0.0f) - v, fVec(-87.0f), fVec(88.0f));
  return v * reciprocal(fVec(1.0f) + exp_clamped(inner));
}

// The exact GELU, 0.5 v (1 + erf(v / sqrt(2))), with ATen's vectorized erf (that of aten.gelu).
constexpr float kSqrtHalf = 0.70710678118654752f;

inline float gelu_erf(float v) {
  return 0.5f * v * (1.0f + std::erf(v * kSqrtHalf));
}

inline fVec gelu_erf(const fVec& v) {
  return fVec(0.5f) * v * (fVec(1.0f) + (v * fVec(kSqrtHalf)).erf());
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

// ``tensors`` all have the shape of the leading dims (broadcast strides allowed).
template <size_t N>
inline RowLayout make_layout(at::IntArrayRef leading_sizes, const std::array<const Tensor*, N>& tensors) {
  static_assert(N <= kMaxOperands, "too many row operands");
  RowLayout layout;
  layout.dims = static_cast<int64_t>(leading_sizes.size());
  layout.operands = static_cast<int>(N);
  for (int64_t d = 0; d < layout.dims; ++d) {
    layout.sizes[d] = leading_sizes[d];
  }
  for (size_t op = 0; op < N; ++op) {
    for (int64_t d = 0; d < layout.dims; ++d) {
      layout.strides[op][d] = tensors[op]->size(d) == 1 ? 0 : tensors[op]->stride(d);
    }
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

// Prefetches ``bytes`` bytes from ``p`` into L1.  The row kernels finish a
// row from L1 in their later passes; prefetching the next row meanwhile keeps
// memory busy.  Prefetches past the end of a tensor are harmless.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(start + offset, 0, 3);
  }
}

inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(width, 1));
}

// What a row body is told besides its row pointers.
struct RowWalk {
  // The output's last dim.
  int64_t width = 0;
  // Whether full blocks are stored non-temporally (Block::store does it).
  bool stream = false;
  // Element step from a row of input i to the next one in iteration order
  // (exact within the innermost leading dim, which holds most rows).
  std::array<int64_t, kMaxOperands> next{};
};

template <typename TO, typename... TIn, typename Body, size_t... I>
void walk_rows(
    Tensor& out, const std::array<const Tensor*, sizeof...(TIn)>& inputs, int64_t scratch_floats,
    const Body& body, std::index_sequence<I...>) {
  const RowLayout layout = make_layout(out.sizes().slice(0, out.dim() - 1), inputs);
  RowWalk walk;
  walk.width = out.size(-1);
  walk.stream = streams(out);
  for (int op = 0; op < layout.operands; ++op) {
    walk.next[op] = layout.dims == 0 ? 0 : layout.strides[op][layout.dims - 1];
  }
  const int64_t rows = out.numel() / walk.width;
  const std::tuple<const TIn*...> data{inputs[I]->template const_data_ptr<TIn>()...};
  TO* out_data = out.mutable_data_ptr<TO>();
  at::parallel_for(0, rows, row_grain(walk.width), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    RowCursor cursor(layout, begin);
    for (int64_t row = begin; row < end; ++row, cursor.next()) {
      body(walk, out_data + row * walk.width, (std::get<I>(data) + cursor.offset(I))..., scratch.data());
    }
    finish_streaming(walk.stream);
  });
}

// Runs body(walk, out_row, input_rows..., scratch) for every row of the
// contiguous ``out``, in parallel: ``inputs`` (of C++ types TIn) have out's
// leading shape (broadcast strides allowed) and a unit-stride last dim;
// ``scratch`` holds ``scratch_floats`` floats private to the running thread.
template <typename TO, typename... TIn, typename Body>
void for_each_row(
    Tensor& out, const std::array<const Tensor*, sizeof...(TIn)>& inputs, const Body& body,
    int64_t scratch_floats = 0) {
  walk_rows<TO, TIn...>(out, inputs, scratch_floats, body, std::index_sequence_for<TIn...>{});
}

template <typename TO, typename... TIn, typename Body, size_t... I>
void walk_layout_rows(
    const RowLayout& layout, int64_t rows, int64_t width, bool stream, TO* out,
    const std::tuple<const TIn*...>& data, const Body& body, std::index_sequence<I...>) {
  constexpr int kOut = static_cast<int>(sizeof...(TIn));
  RowWalk walk;
  walk.width = width;
  walk.stream = stream;
  for (int op = 0; op < layout.operands; ++op) {
    walk.next[op] = layout.dims == 0 ? 0 : layout.strides[op][layout.dims - 1];
  }
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    RowCursor cursor(layout, begin);
    for (int64_t row = begin; row < end; ++row, cursor.next()) {
      body(walk, out + cursor.offset(kOut), (std::get<I>(data) + cursor.offset(I))..., nullptr);
    }
    finish_streaming(stream);
  });
}

// for_each_row over raw pointers: ``layout`` has the rows' leading sizes and the element strides of the inputs,
// then of the output (whose rows need not be contiguous); every row holds ``width`` unit-stride values. A body
// gets no scratch (nullptr).
template <typename TO, typename... TIn, typename Body>
void for_each_layout_row(
    const RowLayout& layout, int64_t rows, int64_t width, bool stream, TO* out, std::tuple<const TIn*...> inputs,
    const Body& body) {
  walk_layout_rows<TO, TIn...>(layout, rows, width, stream, out, inputs, body, std::index_sequence_for<TIn...>{});
}

// ---------------------------------------------------------------------------
// Operand preparation and coverage checks.
// ---------------------------------------------------------------------------

inline bool is_covered_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::BFloat16 || t == ScalarType::Half;
}

inline bool on_cpu(const Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided;
}

// True when ``t`` broadcasts into ``x_sizes``; the last dim is not compared.
bool broadcasts_into_rows(const Tensor& t, at::IntArrayRef x_sizes);

// The x and output dtype a row kernel covers: a CPU x of a float dtype with
// at least one and at most kMaxLeadingDims + 1 dims.
inline bool covers_rows(const Tensor& x, ScalarType out_dtype) {
  return on_cpu(x) && x.dim() >= 1 && x.dim() - 1 <= kMaxLeadingDims && is_covered_float(x.scalar_type()) &&
         is_covered_float(out_dtype);
}

// A CPU tensor of a float dtype that broadcasts into x's leading dims.
inline bool covers_row_table(const Tensor& t, const Tensor& x) {
  return on_cpu(t) && is_covered_float(t.scalar_type()) && broadcasts_into_rows(t, x.sizes());
}

// A row parameter (weight, scale, shift): a row table whose last dim is 1 or x's.
inline bool covers_row_parameter(const Tensor& p, const Tensor& x) {
  return covers_row_table(p, x) && (p.dim() == 0 || p.size(-1) == 1 || p.size(-1) == x.size(-1));
}

// ``t`` as x's leading shape plus a last dim of ``width`` unit-stride values,
// with zero strides where it broadcasts.  ``t`` has last size width or 1.
Tensor as_row_operand(Tensor t, at::IntArrayRef x_sizes, int64_t width, ScalarType dtype);

// ``t`` (last size width or 1) in ``dtype`` with ``width`` unit-stride values in its last dim: ``t`` itself
// where it is that already, else converted, broadcast or made contiguous (as_row_operand before its expand).
Tensor as_row_values(Tensor t, int64_t width, ScalarType dtype);

// t.expand(sizes), made by hand where t is plain (plain_impl): an operand the kernels read, not a result.
Tensor expanded(const Tensor& t, at::IntArrayRef sizes);

// Whether GEMMs of these tensors (nullptr: none) may call the CPU kernels straight, below the dispatcher: CPU
// tensors, no tensor subclass, dispatch mode or autocast, nothing that requires grad while grad mode is on.
bool plain_gemm_operands(std::initializer_list<const Tensor*> tensors);

// ``weight`` [n, k]'s columns ``first`` to ``first + count`` transposed, [count, n], as a view made by hand
// (``weight`` is plain: plain_gemm_operands). linear.cpp.
Tensor transposed_block(const Tensor& weight, int64_t first, int64_t count);

// ``rows`` [m, k] times ``weight_t`` [k, n] plus ``bias`` [n] (none: nullptr) as at::cpu::addmm (at::cpu::mm)
// computes it, into the contiguous [m, n] ``out``. linear.cpp.
void gemm_rows_into(Tensor& out, const Tensor& rows, const Tensor& weight_t, const Tensor* bias);

// A new contiguous tensor of ``sizes`` and ``dtype`` on x's device.
Tensor empty_output(const Tensor& x, at::IntArrayRef sizes, ScalarType dtype);

// The output of a row op (x's shape, ``out_dtype``), filled by
// ``fill(x, out)`` with x given a unit-stride last dim (copied when its last
// dim is strided); an empty x gives an empty output.  Autograd is off.
template <typename Fill>
std::optional<Tensor> row_op(const Tensor& x_in, ScalarType out_dtype, const Fill& fill) {
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  Tensor out = empty_output(x_in, x_in.sizes(), out_dtype);
  if (x_in.numel() > 0) {
    const Tensor x = (x_in.size(-1) <= 1 || x_in.stride(-1) == 1) ? x_in : x_in.contiguous();
    fill(x, out);
  }
  return out;
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

// Calls f(float{}) when ``as_float``, else f(T{}): the type of an operand
// that is either converted to float32 or kept in x's type T.
template <typename T, typename F>
void dispatch_float_or(bool as_float, const F& f) {
  if (as_float) {
    f(float{});
  } else {
    f(T{});
  }
}

// Calls f(TX{}, TP{}, TO{}): the C++ types of x's dtype, of the row
// parameters' (``param_dtype``: float32 or x's) and of the output's.
template <typename F>
void dispatch_row_types(ScalarType x_dtype, ScalarType param_dtype, ScalarType out_dtype, const F& f) {
  dispatch_float(x_dtype, [&](auto x_tag) {
    using TX = decltype(x_tag);
    dispatch_float(out_dtype, [&](auto o_tag) {
      dispatch_float_or<TX>(param_dtype == ScalarType::Float, [&](auto p_tag) { f(x_tag, p_tag, o_tag); });
    });
  });
}

// A per-channel parameter (C values, contiguous) as float32 values (nullptr: none); ``holder`` keeps a converted
// copy alive (group_norm_silu.cpp, channel_rms_norm.cpp).
inline const float* channel_values(const std::optional<Tensor>& p, Tensor& holder) {
  if (!p.has_value() || !p->defined()) {
    return nullptr;
  }
  holder = (p->scalar_type() == ScalarType::Float && p->is_contiguous()) ? *p : p->to(ScalarType::Float).contiguous();
  return holder.const_data_ptr<float>();
}

// Whether x's channels (dim 1) are innermost and the other dims dense around them in order: N, the spatial
// dims, C (channels-last, channels-last-3d, and the like for any rank). group_norm_silu.cpp, channel_rms_norm.cpp.
inline bool channels_innermost(const Tensor& x) {
  if (x.stride(1) != 1 && x.size(1) != 1) {
    return false;
  }
  int64_t expected = x.size(1);
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    if (x.size(d) != 1 && x.stride(d) != expected) {
      return false;
    }
    expected *= x.size(d);
  }
  return x.size(0) == 1 || x.stride(0) == expected;
}

// A new output of x's sizes and layout for a kernel over the channels (dim 1): contiguous for a contiguous x,
// x's strides for one with its channels innermost (channels_innermost); nullopt for any other layout.
std::optional<Tensor> channel_op_output(const Tensor& x, ScalarType dtype);

// The output of an op over the channels (x's shape and layout, ``dtype``), filled by ``fill(out, contiguous)``
// (``contiguous``: x is, else its channels are innermost); nullopt for another layout, an empty x gives an empty
// output. Autograd is off (group_norm_silu.cpp, channel_rms_norm.cpp).
template <typename Fill>
std::optional<Tensor> channel_op(const Tensor& x, ScalarType dtype, const Fill& fill) {
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  std::optional<Tensor> out = channel_op_output(x, dtype);
  if (out.has_value() && x.numel() > 0) {
    fill(*out, x.is_contiguous());
  }
  return out;
}

// A tensor re-read for many rows (at most 1/8 of x's size) is cheaper to
// convert to float32 once than on every read.
inline bool is_small_operand(const Tensor& t, int64_t x_numel) {
  return t.numel() * 8 <= x_numel;
}

// dtype of row parameters (weight, scale, shift): x's dtype when they all
// have it and one of them is large, else float32 (they are converted).
ScalarType parameter_dtype(ScalarType x_dtype, int64_t x_numel, std::initializer_list<const Tensor*> params);

}  // namespace mindiesd_cpu
