// rope: x * cos + rotate(x) * sin, one row at a time; norm_rope: the same of
// each stream's RMSNorm, written into its slice of the streams' concatenation.

#include "common.h"

namespace mindiesd_cpu {
namespace {

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

// The table values of a block of interleaved pairs: per-pair tables hold one
// value per pair (each used twice), full-width ones one per element.
template <bool kPerPair, typename BlockT>
inline std::pair<fVec, fVec> pair_table(const BlockT& block, const float* table) {
  if constexpr (kPerPair) {
    const int64_t pairs = block.n / 2;
    const int64_t first = std::min(pairs, kLanes / 2);
    return {load_duplicated(table + block.j / 2, first),
            load_duplicated(table + block.j / 2 + kLanes / 2, pairs - first)};
  } else {
    return block.load(table);
  }
}

// Stores the interleaved rotation of a block's values (a, b): out = v * cos + rotate_pairs(v) * sin.
template <bool kPerPair, typename BlockT, typename TO>
inline void store_interleaved(
    const BlockT& block, TO* outr, const fVec& a, const fVec& b, const float* cr, const float* sr) {
  const auto [c0, c1] = pair_table<kPerPair>(block, cr);
  const auto [s0, s1] = pair_table<kPerPair>(block, sr);
  block.store(outr, at::vec::fmadd(rotate_pairs(a), s0, a * c0), at::vec::fmadd(rotate_pairs(b), s1, b * c1));
}

// Stores the half rotation of a block's pairs: x1 at j, x2 at j + half (as two vectors each); the tables' values
// of the second half start ``second_table`` values in (0 for per-pair tables).
template <typename BlockT, typename TO>
inline void store_half(const BlockT& block, TO* outr, int64_t half, int64_t second_table,
                       const std::pair<fVec, fVec>& x1, const std::pair<fVec, fVec>& x2, const float* cr,
                       const float* sr) {
  const auto [x1a, x1b] = x1;
  const auto [x2a, x2b] = x2;
  const auto [c1a, c1b] = block.load(cr);
  const auto [s1a, s1b] = block.load(sr);
  const auto [c2a, c2b] = block.load(cr + second_table);
  const auto [s2a, s2b] = block.load(sr + second_table);
  block.store(outr, at::vec::fmsub(x1a, c1a, x2a * s1a), at::vec::fmsub(x1b, c1b, x2b * s1b));
  block.store(outr + half, at::vec::fmadd(x2a, c2a, x1a * s2a), at::vec::fmadd(x2b, c2b, x1b * s2b));
}

// Interleaved pairs (x[2i], x[2i+1]). Per-pair tables hold D/2 values.
template <typename TX, typename TO, bool kPerPair>
void rope_interleaved_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor& out) {
  auto body = [&](const RowWalk& walk, TO* outr, const TX* xr, const float* cr, const float* sr, float*) {
    for_each_block(0, walk.width, walk.stream, [&](const auto& block) {
      const auto [a, b] = block.load(xr);
      store_interleaved<kPerPair>(block, outr, a, b, cr, sr);
    });
  };
  for_each_row<TO, TX, float, float>(out, {&x, &cos, &sin}, body);
}

// Half-rotated pairs (x[i], x[i + D/2]). Per-pair tables hold D/2 values.
template <typename TX, typename TO, bool kPerPair>
void rope_half_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor& out) {
  const int64_t half = x.size(-1) / 2;
  const int64_t second_table = kPerPair ? 0 : half;
  auto body = [&](const RowWalk& walk, TO* outr, const TX* xr, const float* cr, const float* sr, float*) {
    for_each_block(0, half, walk.stream, [&](const auto& block) {
      store_half(block, outr, half, second_table, block.load(xr), block.load(xr + half), cr, sr);
    });
  };
  for_each_row<TO, TX, float, float>(out, {&x, &cos, &sin}, body);
}

// A rotation table the kernels read: a row table of a covered float dtype, or float64 (Lumina2's complex128
// freqs_cis seen as real pairs) read as float32 when the output is float32 or 16-bit (a float64 output is left to
// the composition): the tables' rounding moves the result by about one float32 step of its largest value.
inline bool covers_rope_table(const Tensor& t, at::IntArrayRef sizes) {
  return t.dim() >= 1 && on_cpu(t) && (is_covered_float(t.scalar_type()) || t.scalar_type() == ScalarType::Double) &&
         broadcasts_into_rows(t, sizes);
}

// Whether cos and sin are tables the kernels read for rotated rows of ``width`` values in a tensor of ``sizes``
// (``width``, ``width`` / 2 or 1 values each); ``per_pair``: both hold one value per pair (or one value).
inline bool covers_rope_tables(
    const Tensor& cos, const Tensor& sin, at::IntArrayRef sizes, int64_t width, bool& per_pair) {
  per_pair = width > 0;
  for (const Tensor* t : {&cos, &sin}) {
    if (!covers_rope_table(*t, sizes)) {
      return false;
    }
    const int64_t last = t->size(-1);
    if (last != width && last != width / 2 && last != 1) {
      return false;
    }
    if (last == width && last != 1) {
      per_pair = false;
    }
  }
  return true;
}

// A table of one value per pair widened to one value per element, where the other table is full width (tables
// stay compact unless one of them is not).
inline Tensor widened_table(const Tensor& t, int64_t width, bool per_pair, bool interleaved) {
  if (per_pair || t.size(-1) != width / 2 || width <= 1) {
    return t;
  }
  if (interleaved) {
    return t.to(ScalarType::Float).repeat_interleave(2, -1);
  }
  std::vector<int64_t> twice(t.dim(), 1);  // (t, t) along the last dim
  twice.back() = 2;
  return t.repeat(twice);
}


// The rows of one stream: RMSNorm of each row of x, then the rotation of each of its heads of ``head_dim``
// values (one head: the whole row), into the rows of ``out`` (the stream's slice of the concatenation).  The
// tables hold the first head's values of a row; ``table_head_step`` floats further on are the next head's (0
// when every head reads the same).  The weight is float32 (a [W] weight is small beside the rows it scales).
// ``layout``: the stream's leading sizes and the element strides of x, the weight, cos, sin and out, in that order.
template <typename T, bool kWeighted, bool kRound, bool kInterleaved, bool kPerPair>
void norm_rope_kernel(
    const RowLayout& layout, int64_t rows, int64_t row_width, bool stream, T* out, const T* x, const float* weight,
    const float* cos, const float* sin, float eps, int64_t head_dim, int64_t table_head_step) {
  const int64_t width = head_dim;
  const int64_t heads = row_width / head_dim;
  const int64_t half = width / 2;
  const int64_t second_table = kPerPair ? 0 : half;
  const float inv_width = 1.0f / static_cast<float>(row_width);
  auto head = [&](const RowWalk& walk, T* outr, const T* xr, const float* wr, const float* cr, const float* sr,
                  const fVec& inv_rms) {
    if constexpr (kInterleaved) {
      for_each_block(0, width, walk.stream, [&](const auto& block) {
        const auto [a, b] = normed_block<T, float, kWeighted, kRound>(block, xr, wr, inv_rms);
        store_interleaved<kPerPair>(block, outr, a, b, cr, sr);
      });
    } else {
      const float* wr2 = kWeighted ? wr + half : wr;
      for_each_block(0, half, walk.stream, [&](const auto& block) {
        store_half(block, outr, half, second_table, normed_block<T, float, kWeighted, kRound>(block, xr, wr, inv_rms),
                   normed_block<T, float, kWeighted, kRound>(block, xr + half, wr2, inv_rms), cr, sr);
      });
    }
  };
  for_each_layout_row<T, T, float, float, float>(
      layout, rows, row_width, stream, out, {x, weight, cos, sin},
      [&](const RowWalk& walk, T* outr, const T* xr, const float* wr, const float* cr, const float* sr, float*) {
        const fVec inv_rms(1.0f / std::sqrt(sum_of_squares(xr, row_width) * inv_width + eps));
        // The row is read again from L1 below; meanwhile the next row is fetched (as rms_norm does).
        prefetch_bytes(xr + walk.next[0], row_width * static_cast<int64_t>(sizeof(T)));
        for (int64_t h = 0; h < heads; ++h) {
          head(walk, outr + h * head_dim, xr + h * head_dim, kWeighted ? wr + h * head_dim : wr,
               cr + h * table_head_step, sr + h * table_head_step, inv_rms);
        }
      });
}

// A rotation table as the norm_rope kernel reads it: float32, ``width`` values with unit stride in its last dim.
// The usual table is that already (no new tensor); a table of one value per pair where the other is full width is
// widened, other dtypes converted, a broadcast or strided last dim made contiguous.
inline Tensor norm_rope_table(const Tensor& t, int64_t head_dim, bool per_pair, bool interleaved, int64_t width) {
  return as_row_values(widened_table(t, head_dim, per_pair, interleaved), width, ScalarType::Float);
}

// The element strides of ``t`` over the first ``lead`` dims of a shape it broadcasts into, aligned at the end
// of that shape's ``lead + 1`` dims (0 where t has no such dim or size 1).
inline std::array<int64_t, kMaxLeadingDims + 1> broadcast_strides(const Tensor& t, int64_t lead) {
  std::array<int64_t, kMaxLeadingDims + 1> strides{};
  const int64_t offset = lead - (t.dim() - 1);
  for (int64_t j = 0; j < lead; ++j) {
    const int64_t k = j - offset;
    strides[j] = (k < 0 || t.size(k) == 1) ? 0 : t.stride(k);
  }
  return strides;
}

}  // namespace

std::optional<Tensor> rope(
    const Tensor& x_in, const Tensor& cos_in, const Tensor& sin_in, bool interleaved, ScalarType out_dtype) {
  if (!covers_rows(x_in, out_dtype)) {
    return std::nullopt;
  }
  const int64_t width = x_in.size(-1);
  if (width % 2 != 0) {
    return std::nullopt;
  }
  bool per_pair = false;
  if (!covers_rope_tables(cos_in, sin_in, x_in.sizes(), width, per_pair)) {
    return std::nullopt;
  }
  return row_op(x_in, out_dtype, [&](const Tensor& x, Tensor& out) {
    const int64_t table_width = per_pair ? width / 2 : width;
    auto prepare = [&](const Tensor& t) {
      return as_row_operand(widened_table(t, width, per_pair, interleaved), x.sizes(), table_width,
                            ScalarType::Float);
    };
    const Tensor cos = prepare(cos_in);
    const Tensor sin = prepare(sin_in);
    dispatch_float(x.scalar_type(), [&](auto x_tag) {
      using TX = decltype(x_tag);
      dispatch_float(out_dtype, [&](auto o_tag) {
        using TO = decltype(o_tag);
        if (interleaved && per_pair) {
          rope_interleaved_kernel<TX, TO, true>(x, cos, sin, out);
        } else if (interleaved) {
          rope_interleaved_kernel<TX, TO, false>(x, cos, sin, out);
        } else if (per_pair) {
          rope_half_kernel<TX, TO, true>(x, cos, sin, out);
        } else {
          rope_half_kernel<TX, TO, false>(x, cos, sin, out);
        }
      });
    });
  });
}

std::optional<Tensor> norm_rope(
    const std::vector<Tensor>& xs_in, int64_t dim, const std::vector<std::optional<Tensor>>& weights_in, double eps,
    std::optional<ScalarType> norm_dtype, int64_t head_dim, const Tensor& cos_in, const Tensor& sin_in,
    bool interleaved, ScalarType out_dtype) {
  if (xs_in.empty() || weights_in.size() != xs_in.size()) {
    return std::nullopt;
  }
  const Tensor& first = xs_in[0];
  const int64_t rank = first.dim();
  const int64_t width = rank > 0 ? first.size(-1) : 0;
  const int64_t d = dim < 0 ? dim + rank : dim;
  // The output in x's dtype, the normalised values rounded to it or kept in float32 (the usual cases; others are
  // left to the composition).
  const ScalarType normed = norm_dtype.value_or(first.scalar_type());
  if (rank < 2 || d < 0 || d >= rank - 1 || head_dim <= 0 || width % head_dim != 0 || head_dim % 2 != 0 ||
      out_dtype != first.scalar_type() ||
      (normed != first.scalar_type() && normed != ScalarType::Float) || !covers_rows(first, out_dtype)) {
    return std::nullopt;
  }
  const bool round_normed = normed != ScalarType::Float;
  std::vector<int64_t> sizes = first.sizes().vec();
  sizes[d] = 0;
  for (size_t i = 0; i < xs_in.size(); ++i) {
    const Tensor& x = xs_in[i];
    if (!on_cpu(x) || x.scalar_type() != first.scalar_type() || x.dim() != rank) {
      return std::nullopt;
    }
    for (int64_t k = 0; k < rank; ++k) {
      if (k != d && x.size(k) != first.size(k)) {  // streams differ only in their length along ``d``
        return std::nullopt;
      }
    }
    const std::optional<Tensor>& w = weights_in[i];
    if (w.has_value() && w->defined() && !(on_cpu(*w) && is_covered_float(w->scalar_type()) && w->dim() == 1 &&
                                           w->size(0) == width)) {
      return std::nullopt;
    }
    sizes[d] += x.size(d);
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  Tensor out = empty_output(first, sizes, out_dtype);
  // The tables broadcast into the heads' view of the output, [..., W / head_dim, head_dim] (or the output itself
  // when one head spans the row).
  const int64_t heads = width / head_dim;
  std::vector<int64_t> rotated = sizes;
  if (heads > 1) {
    rotated.back() = heads;
    rotated.push_back(head_dim);
  }
  bool per_pair = false;
  if (!covers_rope_tables(cos_in, sin_in, rotated, head_dim, per_pair)) {
    return std::nullopt;
  }
  if (out.numel() == 0) {
    return out;
  }
  const int64_t table_width = per_pair ? head_dim / 2 : head_dim;
  const Tensor cos = norm_rope_table(cos_in, head_dim, per_pair, interleaved, table_width);
  const Tensor sin = norm_rope_table(sin_in, head_dim, per_pair, interleaved, table_width);
  if (cos.dim() > static_cast<int64_t>(rotated.size()) || sin.dim() > static_cast<int64_t>(rotated.size())) {
    return std::nullopt;
  }
  // The tables' strides over the rotated shape's leading dims: the output's leading dims, then (with more than
  // one head) the heads, whose stride is the step from one head's values to the next one's.
  const int64_t lead = rank - 1;
  const int64_t rotated_lead = static_cast<int64_t>(rotated.size()) - 1;
  const auto cos_strides = broadcast_strides(cos, rotated_lead);
  const auto sin_strides = broadcast_strides(sin, rotated_lead);
  const int64_t head_step = heads > 1 ? cos_strides[lead] : 0;
  if (heads > 1 && sin_strides[lead] != head_step) {  // one step for both tables
    return std::nullopt;
  }
  const float eps_f = static_cast<float>(eps);
  const bool stream = streams(out);
  const int64_t out_step = out.stride(d);
  int64_t offset = 0;
  for (size_t i = 0; i < xs_in.size(); ++i) {
    const Tensor& x_in = xs_in[i];
    const int64_t length = x_in.size(d);
    if (length == 0) {
      continue;
    }
    const Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
    const std::optional<Tensor>& w = weights_in[i];
    const bool weighted = w.has_value() && w->defined();
    Tensor weight;
    if (weighted) {
      weight = w->scalar_type() == ScalarType::Float ? *w : w->to(ScalarType::Float);
      if (weight.stride(0) != 1) {
        weight = weight.contiguous();
      }
    }
    // The stream's rows: x's leading dims; the weight broadcast to every row; the tables and the output from the
    // stream's offset along ``d``.
    RowLayout layout;
    layout.dims = lead;
    layout.operands = 5;
    for (int64_t k = 0; k < lead; ++k) {
      const int64_t size = x.size(k);
      layout.sizes[k] = size;
      layout.strides[0][k] = size == 1 ? 0 : x.stride(k);
      layout.strides[1][k] = 0;
      layout.strides[2][k] = size == 1 ? 0 : cos_strides[k];
      layout.strides[3][k] = size == 1 ? 0 : sin_strides[k];
      layout.strides[4][k] = size == 1 ? 0 : out.stride(k);
    }
    const int64_t rows = x.numel() / width;
    const float* cos_data = cos.const_data_ptr<float>() + offset * cos_strides[d];
    const float* sin_data = sin.const_data_ptr<float>() + offset * sin_strides[d];
    const float* weight_data = weighted ? weight.const_data_ptr<float>() : nullptr;
    const int64_t out_offset = offset * out_step;
    offset += length;
    dispatch_float(x.scalar_type(), [&](auto x_tag) {
      using T = decltype(x_tag);
      T* out_data = out.mutable_data_ptr<T>() + out_offset;
      const T* x_data = x.const_data_ptr<T>();
      auto run = [&](auto weighted_tag, auto interleaved_tag, auto per_pair_tag) {
        constexpr bool kWeighted = decltype(weighted_tag)::value;
        constexpr bool kInterleaved = decltype(interleaved_tag)::value;
        constexpr bool kPerPair = decltype(per_pair_tag)::value;
        if constexpr (std::is_same_v<T, float>) {
          norm_rope_kernel<T, kWeighted, false, kInterleaved, kPerPair>(
              layout, rows, width, stream, out_data, x_data, weight_data, cos_data, sin_data, eps_f, head_dim,
              head_step);
        } else if (round_normed) {
          norm_rope_kernel<T, kWeighted, true, kInterleaved, kPerPair>(
              layout, rows, width, stream, out_data, x_data, weight_data, cos_data, sin_data, eps_f, head_dim,
              head_step);
        } else {
          norm_rope_kernel<T, kWeighted, false, kInterleaved, kPerPair>(
              layout, rows, width, stream, out_data, x_data, weight_data, cos_data, sin_data, eps_f, head_dim,
              head_step);
        }
      };
      auto with_form = [&](auto weighted_tag) {
        if (interleaved && per_pair) {
          run(weighted_tag, std::true_type{}, std::true_type{});
        } else if (interleaved) {
          run(weighted_tag, std::true_type{}, std::false_type{});
        } else if (per_pair) {
          run(weighted_tag, std::false_type{}, std::true_type{});
        } else {
          run(weighted_tag, std::false_type{}, std::false_type{});
        }
      };
      if (weighted) {
        with_form(std::true_type{});
      } else {
        with_form(std::false_type{});
      }
    });
  }
  return out;
}

namespace {

// The executor's entry (entries.h): rope(x, cos, sin, interleaved) with the resolved out_dtype.
const EntryRegistrar kRopeEntry("rope", [](const EntryArgs& a) {
  return mindiesd_cpu::rope(a.tensor(0), a.tensor(1), a.tensor(2), a.to_bool(3), a.out_dtype());
});

// The executor's entry (entries.h): norm_rope(xs, dim, weights (each a tensor or None), eps, norm_dtype (a dtype
// or None), head_dim, cos, sin, interleaved) with the resolved out_dtype.
const EntryRegistrar kNormRopeEntry("norm_rope", [](const EntryArgs& a) {
  return mindiesd_cpu::norm_rope(a.tensors(0), a.to_int(1), a.optional_tensors(2), a.to_double(3), a.optional_dtype(4),
                                 a.to_int(5), a.tensor(6), a.tensor(7), a.to_bool(8), a.out_dtype());
});

}  // namespace

}  // namespace mindiesd_cpu
